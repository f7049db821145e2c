"""Whether a text shows a name, asked for many names (pure). ``name in text`` for each of
many names scans the text once per name: a text of 300 KB and 40,000 names of its own was
8 s of one request's CPU (the kept-names check of a trimmed message). Every such question
goes through ``Shown``: a name that is a run of the text, or a piece of one, is answered from
a set made in one pass; only the others are looked for, at most ``MAX_SCANS`` times a text,
so the work is bounded by the text's length whatever the number of names.
"""

from __future__ import annotations

import re

_RUN = re.compile(r"[A-Za-z0-9_./\-$@~+:]+")
_PIECE = re.compile(r"\w+")
_EDGE = "./-:~+$"
MAX_SCANS = 256  # past these, a name reads as shown: nothing more is added for it


class Shown:
    """``name in Shown(text)``: whether ``text`` holds ``name`` (as a substring), in work
    bounded by the text; ``add`` grows the text by a name (a summary's new identifiers)."""

    def __init__(self, text: str):
        self.text = text
        self.known: set[str] = set()
        self.added: list[str] = []
        self.scans = 0
        self._learn(text)

    def _learn(self, text: str) -> None:
        runs = _RUN.findall(text)
        self.known.update(runs)
        self.known.update(r.strip(_EDGE) for r in runs)
        self.known.update(_PIECE.findall(text))

    def fresh(self) -> Shown:
        """The same text with a budget of its own (the set is shared, not made again): for a
        text asked about once per loop, such as the system prompt."""
        out = Shown.__new__(Shown)
        out.text, out.known, out.added, out.scans = self.text, self.known, self.added, 0
        return out  # what it adds, the others see

    def add(self, name: str) -> None:
        self.added.append(name)
        self.known.add(name)
        self._learn(name)

    def __contains__(self, name: str) -> bool:
        if name in self.known:
            return True
        if self.scans >= MAX_SCANS:
            return True
        self.scans += 1
        return name in self.text or any(name in a for a in self.added[-MAX_SCANS:])
        # (the names added are short, and the newest MAX_SCANS of them are searched)
