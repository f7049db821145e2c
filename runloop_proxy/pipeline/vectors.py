"""A session's vectors in this process: one contiguous float32 matrix, searched exactly.

A search used to read the session's blocks from Redis each time (10 MB at 10,000 segments),
pick the request's rows out of each with ``np.isin`` over byte keys, and score them block by
block with numpy's BLAS, whose threads wait on each other on a busy machine: 158 ms at p50.
Here a session's blocks are read once (one HGETALL) and kept as one matrix, its keys sorted,
in a cache bounded in bytes (its share of ``server.cache_mb``); a later search asks Redis only
which blocks there are (HKEYS) and reads the new ones. A request's segments become rows of the
matrix by one sorted lookup, and the scores are one matrix-vector product (``np.vecdot``: a
single-threaded loop, no BLAS).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, NamedTuple

from ..caches import ENTRY_OVERHEAD, ByteLRU
from .embeddings import KEY_BYTES, unblocked

if TYPE_CHECKING:
    from .embeddings import Vectors

BLOCK_NAME_BYTES = 120  # a block's name as kept in the set of those loaded (str, set slot)


class SessionVectors(NamedTuple):
    """A session's stored vectors as one matrix: ``rows[i]`` is the segment ``keys[i]``'s,
    the keys sorted and distinct; ``blocks`` the names of the stored blocks they came from."""

    blocks: frozenset[str]
    keys: Any  # numpy array of S{KEY_BYTES}
    rows: Vectors

    def nbytes(self) -> int:
        return int(self.rows.nbytes + self.keys.nbytes) + BLOCK_NAME_BYTES * len(self.blocks) \
            + 3 * 112 + ENTRY_OVERHEAD  # the tuple, two array headers, the frozenset


def empty(dim: int) -> SessionVectors:
    import numpy as np

    return SessionVectors(frozenset(), np.zeros(0, f"S{KEY_BYTES}"),
                          np.zeros((0, dim), np.float32))


def assemble(blocks: dict[str, bytes], dim: int, base: SessionVectors | None = None
             ) -> SessionVectors:
    """``base``'s vectors (if any) and those of ``blocks`` (name -> stored block) as one
    matrix, its keys sorted; a key stored twice (two indexings at once) keeps one row (pure)."""
    import numpy as np

    keys = [] if base is None else [base.keys]
    rows = [] if base is None else [base.rows]
    for data in blocks.values():
        k, r = unblocked(data, dim)
        keys.append(k)
        rows.append(r)
    if not keys:
        return empty(dim)
    every = np.concatenate(keys)
    distinct, first = np.unique(every, return_index=True)
    matrix = np.ascontiguousarray(np.concatenate(rows)[first], np.float32)
    names = frozenset(blocks) | (base.blocks if base is not None else frozenset())
    return SessionVectors(names, distinct, matrix)


def rows_of(vectors: SessionVectors, wanted: Any) -> tuple[Any, Any]:
    """The matrix rows of ``wanted`` (an array of segment keys) that are stored, and a mask of
    ``wanted`` saying which are (pure)."""
    import numpy as np

    if not len(vectors.keys) or not len(wanted):
        return np.zeros(0, np.intp), np.zeros(len(wanted), bool)
    at = np.searchsorted(vectors.keys, wanted)
    at = np.minimum(at, len(vectors.keys) - 1)
    held = vectors.keys[at] == wanted
    return at[held], held


def scores(rows: Vectors, query: Vectors) -> Vectors:
    """Every row's dot product with ``query`` (cosine, for unit vectors): one pass over the
    matrix in a single thread (OpenBLAS's threaded gemv took 20 ms at p50 for 10,000 rows
    on a loaded 2-core machine, against 0.3 ms here)."""
    import numpy as np

    out: Vectors = np.vecdot(rows, query)
    return out


class VectorCache:
    """Sessions' vectors kept in the process, by (namespace, session, model), bounded in
    bytes (least recently used first out)."""

    def __init__(self, max_bytes: int):
        self._kept: ByteLRU[tuple[str, str, str], SessionVectors] = ByteLRU(
            max_bytes, lambda k, v: v.nbytes() + sum(len(p) + 49 for p in k))

    def resize(self, max_bytes: int) -> None:
        self._kept.resize(max_bytes)

    def get(self, at: tuple[str, str, str]) -> SessionVectors | None:
        return self._kept.get(at)

    def put(self, at: tuple[str, str, str], vectors: SessionVectors) -> None:
        self._kept[at] = vectors

    def drop(self, at: tuple[str, str, str]) -> None:
        self._kept.pop(at, None)
