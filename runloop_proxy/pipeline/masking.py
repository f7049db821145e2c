"""The credentials a request carried, masked in its answer: every form of each (as sent,
JSON-escaped, percent-encoded, base64 at each alignment) and any run of ``RUN`` bytes or
more of one (a key quoted cut short), whatever the chunks cut, in time linear in the
answer's bytes whatever the credentials' lengths.

What is masked is exact: a position of the answer is *covered* when it lies in a *window*
of some form (``RUN`` bytes of it, or the whole form when shorter) that the answer holds,
and each maximal covered span becomes one ``MASK``. So a key's run is replaced whole, never
with bytes of it left beside the mask, and nothing else is touched.

How it stays linear: a ``MaskTable`` is made once per set of credentials (and kept in
``MaskTables``, in bytes): every window of the forms in a set, and every 8-byte piece of
them (4-byte for a form shorter than 11) as a machine word. A window of 11 bytes or more
holds a whole 8-byte word at an offset that is a multiple of 4 (of 8 or more, a 4-byte one),
so a chunk is read as such words in C (``memoryview.cast``) and looked up in the set of
pieces in C; only where one is found (a few places; every fourth byte of a key's run) does
Python look at windows, each in a set. What a chunk's end may still begin (at most the
longest window less a byte, and only bytes forms are made of) waits for the next chunk;
a span that goes on past it is carried as covered, so nothing is read twice but that."""

from __future__ import annotations

import asyncio
import base64
import itertools
import sys
import urllib.parse
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import orjson

from ..caches import ByteLRU

MASK = b"[the upstream key]"
MIN_SECRET = 8  # shorter header values are not masked (a word of the answer would be)
RUN = 12  # a run of a key this long or longer is masked wherever it stands (a cut-short key)
# the longest credential the proxy forwards (and so masks), and all of a request's together:
# an Azure AD access token runs 1-3 KB, 5 KB with many claims; 8 KiB is also the header line
# that nginx's and Apache's defaults take, so a longer one would not reach most upstreams
MAX_CREDENTIAL_BYTES = 8 << 10
MAX_CREDENTIALS_BYTES = 16 << 10
# the headers whose values are credentials that may go upstream (the token of an
# Authorization, Azure's api-key, Anthropic's x-api-key)
CREDENTIAL_HEADERS = ("authorization", "api-key", "x-api-key")
LONG_CREDENTIALS = 1024  # a table for credentials longer than this is made off the loop
PIECE = 64 << 10  # an answer's chunk is masked this much at a time, the loop served between
_WIDE = 11  # windows this long or longer are found by 8-byte words, shorter ones by 4-byte
_BYTES_OBJECT = 33  # a bytes object's header in CPython
_INT_OBJECT = 32  # an int of 31 to 60 bits, as the allocator rounds it


@dataclass(frozen=True, eq=False)
class MaskTable:
    """What masking a set of credentials looks for, made once (``table_of``)."""

    windows: Mapping[int, frozenset[bytes]]  # length -> every window of that length
    words: frozenset[int]  # every 4 bytes of every form, as a native 32-bit word
    stride: int  # the words looked up in an answer: one at every ``stride`` bytes
    marks: bytes  # a translation table: b"a" for a byte some form holds, b" " for others
    alphabet: bytes  # the bytes the forms are made of
    shortest: int  # the shortest window
    longest: int  # the longest window
    size: int  # the bytes it holds, about (what its cache counts)


def forms_of(value: str) -> frozenset[bytes]:
    """A credential as sent, as a JSON string holds it (slashes escaped or not),
    percent-encoded, and in base64 at each of its three alignments (after "user:", say)
    less the characters its neighbours share."""
    escaped = orjson.dumps(value)[1:-1]
    found = {value.encode(), escaped, escaped.replace(b"/", b"\\/"),
             urllib.parse.quote(value, safe="").encode(),
             urllib.parse.quote_plus(value, safe="").encode()}
    for a in range(3):
        b64 = base64.b64encode(b"\0" * a + value.encode())
        cut = b64[4 if a else 0:len(b64) - 4 if (a + len(value)) % 3 else None]
        if len(cut) >= MIN_SECRET:
            found.add(cut)
    return frozenset(found)


def table_of(values: Iterable[str]) -> MaskTable | None:
    """The table for ``values`` (credentials of ``MIN_SECRET`` characters or more); None
    when there is nothing to mask."""
    forms = {f for v in values for f in forms_of(v)}
    if not forms:
        return None
    windows: dict[int, set[bytes]] = {}
    for form in forms:
        n = min(RUN, len(form))
        windows.setdefault(n, set()).update(form[k:k + n] for k in range(len(form) - n + 1))
    words = {int.from_bytes(f[k:k + 4], sys.byteorder) for f in forms
             for k in range(len(f) - 3)}
    alphabet = bytes(sorted(set(b"".join(forms))))
    marks = bytes(0x61 if c in alphabet else 0x20 for c in range(256))
    kept = {n: frozenset(w) for n, w in sorted(windows.items())}
    held = frozenset(words)
    # what it holds: the sets as Python sizes them, their objects as its allocator rounds
    size = 8192 + sys.getsizeof(held) + len(held) * _INT_OBJECT + sum(
        sys.getsizeof(w) + len(w) * (_BYTES_OBJECT + n + 7) // 8 * 8 for n, w in kept.items())
    # a window of 11 bytes or more holds a whole word at a multiple of 8, of 7 at one of 4
    stride = 8 if min(windows) >= 11 else 4
    return MaskTable(kept, held, stride, marks, alphabet, min(windows), max(windows), size)


class CredentialTooLong(ValueError):
    """A credential (or a request's credentials together) past what the proxy masks."""


def credentials_sent(headers: Mapping[str, str]) -> tuple[str, ...]:
    """The credentials a request to the upstream carries, which its answer may quote: its
    Authorization's token, its api-key and x-api-key values (each of ``MIN_SECRET``
    characters or more), sorted. CredentialTooLong past the bounds, before anything is
    made of them."""
    found: set[str] = set()
    total = 0
    for name, value in headers.items():
        lower = name.lower()
        if lower not in CREDENTIAL_HEADERS:
            continue
        if lower == "authorization":
            value = value.split(" ", 1)[-1]
        value = value.strip()
        total += len(value)
        if len(value) > MAX_CREDENTIAL_BYTES or total > MAX_CREDENTIALS_BYTES:
            raise CredentialTooLong(
                f"a credential of {len(value)} bytes ({total} in all): the proxy forwards "
                f"credentials of at most {MAX_CREDENTIAL_BYTES} bytes each, "
                f"{MAX_CREDENTIALS_BYTES} together")
        if len(value) >= MIN_SECRET:
            found.add(value)
    return tuple(sorted(found))


class MaskTables:
    """The tables of the credential sets seen lately, kept within ``max_bytes`` (a share of
    ``server.cache_mb``): a pass-through caller chooses its credential, so neither their
    number nor their size is the operator's to bound."""

    def __init__(self, max_bytes: int):
        self._kept: ByteLRU[tuple[str, ...], MaskTable] = ByteLRU(
            max_bytes, lambda k, v: v.size + sum(len(c) + 60 for c in k))

    @property
    def bytes(self) -> int:
        return self._kept.bytes

    def resize(self, max_bytes: int) -> None:
        self._kept.resize(max_bytes)

    def of(self, values: tuple[str, ...]) -> MaskTable | None:
        if not values:
            return None
        table = self._kept.get(values)
        if table is None:
            table = table_of(values)
            if table is not None:
                self._kept[values] = table
        return table

    async def made(self, values: tuple[str, ...]) -> MaskTable | None:
        """``of``, made in a worker thread when the credentials are long (a 2 KB JWT's
        table is 10,000 windows: tens of ms)."""
        if sum(map(len, values)) <= LONG_CREDENTIALS or values in self._kept:
            return self.of(values)
        table = await asyncio.to_thread(table_of, values)
        if table is not None:
            self._kept[values] = table
        return table


def _candidates(table: MaskTable, data: bytes) -> list[int]:
    """Where ``data`` holds 4 bytes of a form at an offset that is a multiple of the
    table's stride: every window wholly inside it holds such a word. In C but the list."""
    n = len(data) // 4 * 4
    words = memoryview(data)[:n].cast("I")[::table.stride // 4]
    return list(itertools.compress(range(0, n, table.stride),
                                   map(table.words.__contains__, words)))


def _extend(data: bytes, n: int, found: frozenset[bytes], frontier: int, end: int) -> int:
    """The end of the span of windows (``n`` bytes long, in ``found``) that reaches
    ``end``, every window that begins at or before ``frontier`` known to end by ``end``:
    each later start up to the span's end is looked at once, from the farthest back (the
    first found reaches farthest; where a key's run goes on, it is the first looked at)."""
    while True:
        for at in range(end, max(frontier, end - n), -1):
            if data[at:at + n] in found:
                frontier, end = end, at + n
                break
        else:
            return end


def _spans(data: bytes, n: int, found: frozenset[bytes], candidates: list[int],
           carried: int) -> list[tuple[int, int]]:
    """The maximal spans of ``data`` covered by windows of one length."""
    spans = [(0, _extend(data, n, found, -1, carried))] if carried else []
    last = spans[-1][1] if spans else -1
    for q in candidates:
        if q <= last:
            continue  # inside the span before: every window starting there is known
        # the first window holding the word at q is the span's start (none starts between
        # the last span and it, or an earlier word would have found it)
        for at in range(max(q + 4 - n, last + 1), q + 1):
            if data[at:at + n] in found:
                last = _extend(data, n, found, at, at + n)
                spans.append((at, last))
                break
    return spans


def covered(table: MaskTable, data: bytes, carried: int = 0) -> list[tuple[int, int]]:
    """The maximal covered spans of ``data`` by windows wholly inside it, in order;
    ``carried``: its first bytes are covered already (by a window that began before)."""
    if data.translate(table.marks).find(b"a" * table.shortest) == -1:
        return [(0, carried)] if carried else []  # no run of the forms' bytes a window long
    candidates = _candidates(table, data)
    if len(table.windows) == 1:  # the usual case: every form 12 bytes or longer
        ((n, found),) = table.windows.items()
        return _spans(data, n, found, candidates, carried)
    # windows of several lengths (a credential shorter than 12): the union of each
    # length's spans (a span of one length can lead into another's)
    every = sorted(span for n, found in table.windows.items()
                   for span in _spans(data, n, found, candidates, carried))
    spans: list[tuple[int, int]] = []
    for start, stop in every:
        if spans and start <= spans[-1][1]:
            spans[-1] = (spans[-1][0], max(spans[-1][1], stop))
        else:
            spans.append((start, stop))
    return spans


class Masker:
    """A body's chunks with a ``MaskTable``'s credentials masked, however the chunks cut
    them: the same bytes as the body masked in one piece. A chunk that ends after a byte no
    form holds is sent whole (a stream's event goes at once)."""

    def __init__(self, table: MaskTable):
        self.table = table
        self.tail = b""  # what the next chunk may still make part of a window
        self.carried = 0  # how many of the tail's first bytes are covered already
        self.open = False  # whether the last byte sent was covered (its MASK sent)

    def feed(self, chunk: bytes) -> bytes:
        return self._scan(self.tail + chunk, final=False)

    def end(self) -> bytes:
        return self._scan(self.tail, final=True)

    def whole(self, data: bytes) -> bytes:
        """``data`` as one chunk that nothing follows (a header's value)."""
        return Masker(self.table)._scan(data, final=True)

    def _scan(self, data: bytes, final: bool) -> bytes:
        n = len(data)
        # what is decided: all of it at the end; else all but what a window wholly after
        # it could still cover (its start: within the longest window's reach of the end,
        # and in a run of bytes some form holds)
        done = n if final else max(n - self.table.longest + 1,
                                   len(data.rstrip(self.table.alphabet)))
        if done <= 0:
            self.tail = data
            return b""
        out: list[bytes] = []
        at = 0
        for start, stop in covered(self.table, data, self.carried):
            if start >= done:
                break
            out.append(data[at:start])
            if not (start == 0 and self.open):
                out.append(MASK)
            at = stop
        if at < done:
            out.append(data[at:done])
        self.open = at >= done
        self.carried = max(0, at - done)
        self.tail = data[done:]
        return b"".join(out)
