"""Upstream client: Retry-After parsing, backoff bounds, header hygiene."""

from __future__ import annotations

import email.utils
import time

import pytest

from runloop_proxy.config import UpstreamSpec
from runloop_proxy.pipeline.upstream import UpstreamClient, parse_retry_after, upstream_headers


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
