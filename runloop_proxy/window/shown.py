"""Whether a text shows a name, asked for many names (pure). ``name in text`` for each of
many names scans the text once per name: a text of 300 KB and 40,000 names of its own was
8 s of one request's CPU (the kept-names check of a trimmed message), and a summary's
identifiers checked against the system prompt and a summary string grown by each were
quadratic in the loops. Every such question goes through ``Shown``, which reads the text
once into the set of what a reader takes as a name in it — its runs of name characters,
those runs without their edge punctuation, their words and the words' parts — and answers
from the set alone: work linear in the text, and constant per name. A name that occurs in
the text only inside a longer run (``od_0.p`` in ``pkg/mod_0.py``) reads as not shown: a
note may repeat it, never leave out one the text does not show.
"""

from __future__ import annotations

import re

_RUN = re.compile(r"[A-Za-z0-9_./\-$@~+:#]+")  # "#W77": an order id is a run too
_PIECE = re.compile(r"\w+")
_PART = re.compile(r"[A-Za-z0-9]+")  # a word's parts (``7091239`` of ``gift_card_7091239``)
_EDGE = "./-:~+$"


class Shown:
    """``name in Shown(text)``: whether ``text`` shows ``name`` as a run, a run without its
    edge punctuation, a word or a word's part; ``add`` shows more (a summary's
    identifiers)."""

    def __init__(self, text: str = ""):
        self.known: set[str] = set()
        self.add(text)

    def add(self, text: str) -> None:
        runs = _RUN.findall(text)
        self.known.update(runs)
        self.known.update(r.strip(_EDGE) for r in runs)
        self.known.update(_PIECE.findall(text))
        self.known.update(_PART.findall(text))

    def __contains__(self, name: object) -> bool:
        return name in self.known
