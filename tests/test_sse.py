"""SSE decoding: any chunking of a stream decodes to the same events."""

from __future__ import annotations

import sys
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from runloop_proxy.errors import UpstreamTooLarge
from runloop_proxy.pipeline.sse import SSEDecoder, SSEEvent, encode_event, encode_json

STREAM = (b": comment\n\ndata: one\n\nevent: ping\ndata: two\ndata: lines\n\n"
          b"id: 7\ndata: three\n\ndata: [DONE]\n\n")
EXPECTED = [SSEEvent("one"), SSEEvent("two\nlines", "ping"), SSEEvent("three", None, "7"),
            SSEEvent("[DONE]", None, "7")]


def decode(chunks: list[bytes]) -> list[SSEEvent]:
    d = SSEDecoder()
    out = [e for c in chunks for e in d.feed(c)]
    return out + d.flush()


@pytest.mark.parametrize("stream", [
    STREAM, STREAM.replace(b"\n", b"\r\n"), STREAM.replace(b"\n", b"\r")])
def test_line_endings(stream: bytes) -> None:
    assert decode([stream]) == EXPECTED


def test_trailing_event_without_blank_line_is_flushed() -> None:
    assert decode([b"data: last"]) == [SSEEvent("last")]


def test_field_without_space_and_unknown_fields() -> None:
    assert decode([b"data:x\nretry: 10\nfoo: bar\n\n"]) == [SSEEvent("x")]


@given(st.lists(st.integers(0, len(STREAM)), max_size=12),
       st.sampled_from([b"\n", b"\r\n", b"\r"]))
def test_any_chunking_gives_the_same_events(cuts: list[int], eol: bytes) -> None:
    stream = STREAM.replace(b"\n", eol)
    points = sorted({min(c, len(stream)) for c in cuts})
    chunks = [stream[a:b] for a, b in zip([0, *points], [*points, len(stream)], strict=True)]
    assert decode(chunks) == EXPECTED


def test_encode_round_trip() -> None:
    raw = encode_event("payload", "evt") + encode_json({"a": 1})
    assert decode([raw]) == [SSEEvent("payload", "evt"), SSEEvent('{"a":1}')]
    assert SSEEvent("[DONE]").is_done


@pytest.mark.parametrize("stream", [
    b"data: " + b"x" * 5000,  # a line never ended
    b"data: " + b"x" * 900 + b"\n" + (b"data: " + b"y" * 900 + b"\n") * 5,  # an event never ended
])
def test_an_event_past_the_limit_raises_whatever_the_chunking(stream: bytes) -> None:
    for size in (1, 7, 100, len(stream)):
        decoder = SSEDecoder(limit=4096)
        with pytest.raises(UpstreamTooLarge):
            for i in range(0, len(stream), size):
                decoder.feed(stream[i:i + size])
            decoder.flush()


def test_events_under_the_limit_pass_and_the_count_starts_afresh_each_event() -> None:
    one = b"data: " + b"z" * 3000 + b"\n\n"
    decoder = SSEDecoder(limit=4096)
    events = [e for _ in range(20) for e in decoder.feed(one)]  # 60 KB in all, 3 KB an event
    assert len(events) == 20 and all(len(e.data) == 3000 for e in events)


@pytest.mark.parametrize("line", [b"data:\n", b"data: ab\n", b"data: \xc3\xa9\xc3\xa9\n",
                                  b"data:" + b"q" * 40 + b"\n"])
def test_what_an_event_holds_is_bounded_by_the_limit_whatever_its_lines(line: bytes) -> None:
    """An event's size is what holding it costs: counted by its data's values alone, an
    upstream's endless run of empty data lines (0 bytes each) held 142 MB for 100 MB sent
    under an 8 MB limit (red team). Each held line costs its bytes and ``LINE_COST``, so
    what the decoder holds when it refuses is within a small factor of the limit."""
    limit = 64 * 1024
    decoder = SSEDecoder(limit=limit)
    fed = 0
    with pytest.raises(UpstreamTooLarge):
        for _ in range(10 ** 4):
            decoder.feed(line * 64)
            fed += 64
    held = sys.getsizeof(decoder._data) + sum(sys.getsizeof(v) for v in decoder._data)
    assert held <= 2 * limit, (fed, held)


# what an event's lines may carry: spaces at either end, colons, CR-free unicode (multibyte
# characters split by any chunking), empty values — anything but a line break
VALUES = st.text(st.characters(blacklist_categories=["Cs"], blacklist_characters="\r\n"),
                 max_size=12)


@st.composite
def streams(draw: Any) -> tuple[bytes, list[SSEEvent]]:
    """A stream written the ways the spec allows (any line ending, a space after the colon
    or none, a bare field name for an empty value, comments, unknown fields) and the events
    it must decode to."""
    eol = draw(st.sampled_from([b"\n", b"\r\n", b"\r"]))
    out, events = b"", []
    last_id = None
    for _ in range(draw(st.integers(1, 5))):
        if draw(st.booleans()):
            out += b":" + draw(VALUES).encode() + eol
        name = draw(st.one_of(st.none(), VALUES.filter(lambda v: v.strip() == v and v != "")))
        if name is not None:
            out += b"event: " + name.encode() + eol
        if draw(st.booleans()):
            last_id = draw(VALUES.filter(lambda v: not v.startswith(" ")))
            out += b"id: " + last_id.encode() + eol
        lines = draw(st.lists(VALUES, min_size=1, max_size=3))
        for value in lines:
            if value == "" and draw(st.booleans()):
                out += b"data" + eol  # a field with no colon: the whole line is its name
            elif value.startswith(" ") or draw(st.booleans()):
                out += b"data: " + value.encode() + eol  # one space after the colon is eaten
            else:
                out += b"data:" + value.encode() + eol
            if draw(st.booleans()):
                out += b"retry: 10" + eol
        out += eol
        events.append(SSEEvent("\n".join(lines), name, last_id))
    return out, events


@given(streams(), st.lists(st.integers(0, 400), max_size=16))
def test_any_stream_decodes_to_its_events_in_any_chunking(
        case: tuple[bytes, list[SSEEvent]], cuts: list[int]) -> None:
    """Every stream the spec allows, cut anywhere (a line, a CRLF, a multibyte character
    split), decodes to the events it was written from: data lines joined as sent, spaces
    and colons in values kept, a bare field name an empty value. Planted, each red: values
    stripped of their spaces; a line without a colon ignored."""
    stream, expected = case
    points = sorted({min(c, len(stream)) for c in cuts})
    chunks = [stream[a:b] for a, b in zip([0, *points], [*points, len(stream)], strict=True)]
    assert decode(chunks) == expected
    assert decode([stream[i:i + 1] for i in range(len(stream))]) == expected
