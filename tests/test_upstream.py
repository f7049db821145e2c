"""Upstream client: Retry-After parsing, backoff bounds, header hygiene."""

from __future__ import annotations

import email.utils
import gzip
import time
import zlib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from runloop_proxy.config import UpstreamSpec
from runloop_proxy.errors import UpstreamBadReply
from runloop_proxy.pipeline.upstream import (
    INFLATE_PIECE,
    Inflater,
    UpstreamClient,
    parse_retry_after,
    upstream_headers,
)


@pytest.mark.parametrize("value,expected", [("3", 3.0), (" 0.5 ", 0.5), ("-2", 0.0),
                                            ("soon", None)])
def test_retry_after_seconds(value: str, expected: float | None) -> None:
    assert parse_retry_after(value) == expected


def test_retry_after_http_date() -> None:
    when = email.utils.formatdate(time.time() + 30, usegmt=True)
    assert 25 < (parse_retry_after(when) or 0) <= 30
    past = email.utils.formatdate(time.time() - 30, usegmt=True)
    assert parse_retry_after(past) == 0.0


def test_backoff_is_bounded_and_honours_hints() -> None:
    client = UpstreamClient("u", UpstreamSpec(url="http://x/v1", backoff_base=0.25,
                                              backoff_max=2.0))
    for attempt in range(8):
        assert 0 <= client._backoff(attempt, None) <= 2.0
    assert client._backoff(0, "1") == 1.0
    assert client._backoff(0, "600") == 2.0  # a hint longer than the cap is capped


def test_upstream_headers_drop_hop_by_hop_and_proxy_controls() -> None:
    out = upstream_headers([("Authorization", "Bearer client"), ("Connection", "keep-alive"),
                            ("Host", "proxy"), ("X-Runloop-History", "server"),
                            ("X-Runloop-Anything", "1"), ("OpenAI-Organization", "org"),
                            ("Content-Length", "12")], "Bearer upstream")
    assert dict(out) == {"OpenAI-Organization": "org", "Authorization": "Bearer upstream"}


# -- inflating an answer: whole for any chunking, in bounded pieces whatever the ratio -----

def _raw_deflate(data: bytes) -> bytes:
    z = zlib.compressobj(wbits=-zlib.MAX_WBITS)
    return z.compress(data) + z.flush()


ENCODED = {
    "gzip": gzip.compress,
    "deflate": zlib.compress,  # zlib-wrapped, as the RFC says
    "raw deflate": _raw_deflate,  # what some servers send as "deflate"
    "two gzip members": lambda d: gzip.compress(d[:len(d) // 2]) + gzip.compress(d[len(d) // 2:]),
}


@settings(max_examples=80, deadline=None)
@given(st.sampled_from(sorted(ENCODED)), st.binary(max_size=3000),
       st.lists(st.integers(1, 400), min_size=1, max_size=40))
def test_any_chunking_inflates_to_the_body(kind: str, body: bytes, cuts: list[int]) -> None:
    data = ENCODED[kind](body * 7)
    inflater = Inflater("gzip" if "gzip" in kind else "deflate")
    out: list[bytes] = []
    at = 0
    for n in cuts * (len(data) // max(1, sum(cuts)) + 1):
        out += inflater.feed(data[at:at + n])
        at += n
        if at >= len(data):
            break
    out += inflater.feed(data[at:])
    out.append(inflater.flush())
    assert b"".join(out) == body * 7
    assert all(len(piece) <= INFLATE_PIECE for piece in out)


def test_a_bomb_inflates_in_bounded_pieces() -> None:
    bomb = gzip.compress(b"\0" * (64 << 20), 9)  # 64 MiB in ~64 KB
    pieces = list(Inflater("gzip").feed(bomb))
    assert sum(map(len, pieces)) == 64 << 20
    assert max(map(len, pieces)) <= INFLATE_PIECE and len(pieces) >= (64 << 20) // INFLATE_PIECE


@pytest.mark.parametrize("encoding, data", [("br", b"x"), ("gzip", b"not gzip at all")])
def test_what_cannot_be_inflated_is_the_upstreams_fault(encoding: str, data: bytes) -> None:
    with pytest.raises(UpstreamBadReply):
        inflater = Inflater(encoding)
        list(inflater.feed(data))
        inflater.flush()
