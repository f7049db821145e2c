"""Masking a request's credentials in its answer (``pipeline/masking.py``), held to an exact
reference: the body with every maximal run of a key's form (``RUN`` bytes or more, or a
short form whole) replaced by one mask, whatever the chunks cut, whatever the keys'
lengths; and the work it does grows with the answer, not with the keys."""

from __future__ import annotations

import functools
import tracemalloc
import uuid
from typing import Any

import httpx
import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from multidict import CIMultiDict

from runloop_proxy.pipeline.masking import (
    MASK,
    MAX_CREDENTIAL_BYTES,
    RUN,
    CredentialTooLong,
    Masker,
    MaskTable,
    MaskTables,
    credentials_sent,
    forms_of,
    table_of,
)
from runloop_proxy.scripted import ScriptedUpstream

from .keys import anthropic_key, jwt, openai_project_key
from .work import calls

OPENAI, ANTHROPIC, JWT = openai_project_key(), anthropic_key(), jwt()
SHORT = "sk-ab/01"  # 8 characters: masked whole, never by a part
PERIODIC = "AAAAAAAAAAAAAAAAAAAA"  # a key that is its own runs at every offset
CREDENTIAL_SETS = [(OPENAI,), (ANTHROPIC, SHORT), (JWT,), (PERIODIC,),
                   (OPENAI, ANTHROPIC, "sk-ab/0123456789+xyzLEAK")]


def reference(body: bytes, values: tuple[str, ...]) -> bytes:
    """Slow and plainly right: mark every byte inside any window of any form (``RUN``
    bytes of it, or the whole form when shorter) found anywhere in the body, then write
    each maximal marked span as one mask."""
    covered = bytearray(len(body))
    for form in {f for v in values for f in forms_of(v)}:
        n = min(RUN, len(form))
        windows = {form[k:k + n] for k in range(len(form) - n + 1)}
        for at in range(len(body) - n + 1):
            if body[at:at + n] in windows:
                covered[at:at + n] = b"\1" * n
    out, at = [], 0
    while at < len(body):
        if covered[at]:
            out.append(MASK)
            while at < len(body) and covered[at]:
                at += 1
        else:
            out.append(body[at:at + 1])
            at += 1
    return b"".join(out)


@functools.cache
def _table(values: tuple[str, ...]) -> MaskTable:
    table = table_of(values)
    assert table is not None
    return table


def masked(values: tuple[str, ...], chunks: list[bytes]) -> bytes:
    return run(Masker(_table(values)), chunks)


def run(masker: Masker, chunks: list[bytes]) -> bytes:
    return b"".join(masker.feed(c) for c in chunks) + masker.end()


@st.composite
def quotes(draw: st.DrawFn, values: tuple[str, ...]) -> bytes:
    """A body of quotes of the keys — any form, starting at any offset, of any length
    (shorter and longer than a run, the whole form, one quote beside another) — among
    bytes of the forms' alphabet and others, ids an answer holds, and the mask itself."""
    forms = sorted({f for v in values for f in forms_of(v)})
    alphabet = sorted(set(b"".join(forms)))
    parts = []
    for _ in range(draw(st.integers(0, 8))):
        kind = draw(st.sampled_from(["quote", "quote", "quote", "noise", "other", "id"]))
        if kind == "quote":
            form = draw(st.sampled_from(forms))
            start = draw(st.integers(0, len(form) - 1))
            length = draw(st.sampled_from([RUN - 5, RUN - 1, RUN, RUN + 1, 40,
                                           len(form)]))
            parts.append(form[start:start + length])
        elif kind == "noise":
            parts.append(bytes(draw(st.lists(st.sampled_from(alphabet), max_size=14))))
        elif kind == "other":
            parts.append(draw(st.sampled_from([b" ", b"\n\n", b'"', b"\xc3\xa9", MASK])))
        else:
            parts.append(str(uuid.UUID(int=draw(st.integers(0, 2**128 - 1)))).encode())
    return b"".join(parts)


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_a_masked_answer_is_the_reference_however_it_is_cut(data: st.DataObject) -> None:
    """Every maximal run of a key, in any form, from any offset, is replaced whole — never
    with bytes of the key left beside the mask — and nothing else changes, in any chunking,
    for keys of real lengths (164, 108, a 2 KB JWT) and a key that repeats itself. Planted,
    red: a mask that stops 5 bytes short of the run's end (the span's end less 5); the
    window search made to skip every other candidate word; the hold-back one byte short."""
    values = data.draw(st.sampled_from(CREDENTIAL_SETS))
    body = data.draw(quotes(values))
    cuts = sorted(data.draw(st.lists(st.integers(0, len(body)), max_size=8)))
    chunks = [body[a:b] for a, b in zip([0, *cuts], [*cuts, len(body)], strict=True)]
    assert masked(values, chunks) == reference(body, values)


def test_the_reference_refuses_a_mask_that_leaves_five_bytes_beside_it() -> None:
    """The oracle is not one that only forbids a whole key: a key's last 5 bytes left
    beside its mask differ from it."""
    body = b'{"error": "bad key ' + OPENAI.encode() + b'"}'
    right = reference(body, (OPENAI,))
    assert right == b'{"error": "bad key ' + MASK + b'"}'
    assert b'{"error": "bad key ' + MASK + OPENAI[-5:].encode() + b'"}' != right
    assert masked((OPENAI,), [body]) == right


@pytest.mark.parametrize("values", CREDENTIAL_SETS, ids=["openai", "anthropic+short", "jwt",
                                                         "periodic", "three"])
def test_every_byte_boundary_gives_the_reference(values: tuple[str, ...]) -> None:
    """A quote of each form at the body's start, middle and end, cut at every byte."""
    forms = sorted({f for v in values for f in forms_of(v)})[:3]
    body = b"".join(b'x "' + f[3:] + b'" ' + f[:RUN] for f in forms) + forms[-1][-RUN - 2:]
    want = reference(body, values)
    for cut in range(0, len(body) + 1, max(1, len(body) // 300)):
        assert masked(values, [body[:cut], body[cut:]]) == want, cut
    assert masked(values, [body[k:k + 1] for k in range(len(body))]) == want


def test_an_event_that_ends_after_a_byte_no_key_holds_goes_at_once() -> None:
    table = table_of((OPENAI,))
    assert table is not None
    event = b'data: {"x": "' + OPENAI.encode() + b'"}\n\n'
    assert Masker(table).feed(event) == b'data: {"x": "' + MASK + b'"}\n\n'


def _uuids(n: int) -> bytes:
    return orjson.dumps({"data": [str(uuid.UUID(int=k * 7919 + 1)) for k in range(n)]})


def _events(n: int) -> list[bytes]:
    return [b'data: {"choices":[{"delta":{"content":"' + str(uuid.UUID(int=k)).encode()
            + b'"}}]}\n\n' for k in range(n)]


@pytest.mark.parametrize("shape", ["uuids", "events", "quoted"])
def test_masking_work_grows_with_the_answer_not_with_the_key(shape: str) -> None:
    """Finding: masking cost grew with the key's length (one search per 6 bytes of each
    form: 3,000 UUIDs held the loop 223 ms with a 164-character key, 8 ms with a 20-character
    one). Counted, not timed: the calls masking makes for a 20-character key, a
    164-character key and a 2 KB JWT are within a few of each other, and four times the
    answer costs about four times the calls. Planted, red: the old masker (a search per
    piece of the key); the candidates looked up one word at a time in Python."""
    def answer(n: int, key: str) -> list[bytes]:
        if shape == "uuids":
            return [_uuids(n)]
        if shape == "events":
            return _events(n)
        quote = b'{"error": "bad key ' + key.encode() + b'"}\n'  # the same bytes quoted
        return [quote * (n * 40 // len(quote))]

    def work(values: tuple[str, ...], n: int) -> int:
        table = table_of(values)
        assert table is not None
        return calls(run, Masker(table), answer(n, values[0]))[1]

    keys = {"short": ("sk-test-0123456789ab",), "openai": (OPENAI,), "jwt": (JWT,)}
    small = {name: work(values, 300) for name, values in keys.items()}
    large = {name: work(values, 1200) for name, values in keys.items()}
    for name in keys:
        assert large[name] <= 4.5 * small[name] + 50, (name, small, large)
    if shape == "quoted":  # spans of the key: their count differs, the bytes do not
        size = sum(map(len, answer(300, OPENAI)))
        assert max(small.values()) <= size / 2, (size, small)
    else:
        assert max(small.values()) <= 1.5 * min(small.values()) + 50, small


def test_a_credential_longer_than_forwarded_is_refused_before_anything_is_made() -> None:
    long = "k" * (MAX_CREDENTIAL_BYTES + 1)
    with pytest.raises(CredentialTooLong):
        credentials_sent({"x-api-key": long})
    with pytest.raises(CredentialTooLong):  # together, in several headers
        credentials_sent(CIMultiDict([("x-api-key", JWT * 3), ("x-api-key", JWT * 3),
                                      ("Authorization", "Bearer " + JWT * 3)]))
    assert credentials_sent({"Authorization": f"Bearer {JWT}", "x-api-key": "short"}) == (JWT,)


def test_tables_are_kept_in_bytes() -> None:
    """The masks' tables are counted by what they hold (a 2 KB JWT's is 1.8 MB, as
    tracemalloc sees it), and the least recently used goes once their share is full."""
    tables = MaskTables(4 << 20)
    for k in range(40):
        tables.of((jwt(k),))
        assert tables.bytes <= 4 << 20
    assert tables.of((jwt(39),)) is tables.of((jwt(39),))  # kept: made once
    for values in ((jwt(99),), (OPENAI,), (ANTHROPIC, SHORT), ("/" * 8000,)):
        tracemalloc.start()
        try:
            one = table_of(values)
            held = tracemalloc.get_traced_memory()[0]
        finally:
            tracemalloc.stop()
        assert one is not None and held <= one.size <= 1.5 * held + 16_384, (held, one.size)


@pytest.mark.parametrize(("path", "shape"), [("/v1/models", "openai"),
                                             ("/v1/messages", "anthropic")])
def test_a_credential_no_upstream_takes_is_refused_before_anything_is_sent(
        make_proxy: Any, upstream: ScriptedUpstream, path: str, shape: str) -> None:
    """Finding: in pass-through mode the client chooses the credential: a 60 KB x-api-key,
    no valid key needed, held the loop 400 ms per request and left ~11 MB in a cache.
    Now a 400 in the path's API's shape, before the body is read or anything is sent.
    Planted, red: the door's check removed (the upstream got the request)."""
    proxy = make_proxy()
    upstream.reset()
    body = {"model": "claude-sonnet-4-5-20250929", "max_tokens": 16,
            "messages": [{"role": "user", "content": "hi"}]}
    r = httpx.request("GET" if path == "/v1/models" else "POST", proxy.base + path,
                      json=None if path == "/v1/models" else body, timeout=30,
                      headers={"x-api-key": "k" * 60_000})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    if shape == "anthropic":
        assert r.json()["type"] == "error" and error["type"] == "invalid_request_error"
    else:
        assert error["code"] == "credential_too_long" and error["param"] == "headers"
    assert f"at most {MAX_CREDENTIAL_BYTES} bytes" in error["message"]
    assert "k" * 100 not in r.text
    assert not upstream.requests and not upstream.other
    # a JWT of real length goes through, and is masked in what comes back
    upstream.push({"content": f"the token {JWT} is expired; ids " + " ".join(
        str(uuid.UUID(int=k)) for k in range(300))})
    r = httpx.post(proxy.url + "/chat/completions", timeout=30,
                   json={"model": "gpt-4o-2024-08-06",
                         "messages": [{"role": "user", "content": "hi"}]},
                   headers={"Authorization": f"Bearer {JWT}"})
    assert r.status_code == 200, r.text
    content = r.json()["choices"][0]["message"]["content"]
    assert content.startswith("the token [the upstream key] is expired; ids 00000000-")
    assert JWT[:RUN] not in r.text and JWT[-RUN:] not in r.text
