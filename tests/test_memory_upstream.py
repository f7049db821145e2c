"""Long-term memory with a tenant's embedding model through its upstream (memory =
"upstream", pipeline/remote_embeddings.py): a real proxy, a real Redis, and the scripted
upstream's ``/v1/embeddings`` over HTTP (a hashed bag of words of 1,536 numbers in which
"refund" and "reimbursement" share a dimension), with its latency and its failures."""

from __future__ import annotations

import hashlib
import math
from pathlib import Path
from typing import Any

import pytest

from runloop_proxy.conversation.segments import closed_loops, segments
from runloop_proxy.pipeline import memory
from runloop_proxy.pipeline.memory import EMBED_BATCH, FIELD_CHARS
from runloop_proxy.pipeline.remote_embeddings import stored_name
from runloop_proxy.scripted import ScriptedUpstream
from runloop_proxy.scripted_world import Latency, scripted_embedding

from .conftest import ProxyServer, until
from .keys import openai_project_key
from .test_memory import (
    MODEL,
    ORDER_TOOLS,
    PAST,
    QUERY,
    SYSTEM,
    TENANT_KEY,
    UPSTREAM_KEY,
    _client,
    _fields,
    _live_past,
    _mem_keys,
    _searching,
)

ACME_UPSTREAM_KEY = openai_project_key(373)  # the tenant's own, not the upstream's shared one
EMBEDDING_MODEL = "text-embedding-3-small"
CONVERSATION = [{"role": "system", "content": SYSTEM}, *PAST]
ASK = [*CONVERSATION, {"role": "user", "content": f"Did the {QUERY} go through?"}]


def _served(tmp_path: Path, make_proxy: Any, upstream: ScriptedUpstream,
            extra: str = "") -> ProxyServer:
    root = tmp_path / "cfg"
    (root / "tenants").mkdir(parents=True)
    (root / "runloop.toml").write_text(
        f'[upstreams.main]\nurl = "{upstream.url}"\napi_key = "{UPSTREAM_KEY}"\n'
        f'max_retries = 0\n[defaults]\nupstream = "main"\n')
    (root / "tenants" / "acme.toml").write_text(
        f'keys = ["{TENANT_KEY}"]\nupstream_key = "{ACME_UPSTREAM_KEY}"\n[policy]\n'
        f'proxy_tools = "always"\nmemory = "upstream"\n'
        f'embedding_model = "{EMBEDDING_MODEL}"\nembedding_dimensions = 1536\n{extra}')
    return make_proxy(config_dir=str(root))  # type: ignore[no-any-return]


def _indexed(proxy: ProxyServer) -> set[str]:
    want = {s.key[:FIELD_CHARS] for s in segments(CONVERSATION, closed_loops(CONVERSATION))}
    until(lambda: len(_mem_keys(proxy)) == 1 and _fields(proxy, _mem_keys(proxy)[0]) >= want,
          what="both loops indexed through the upstream")
    return want


def _cosine(a: str, b: str) -> float:
    return math.fsum(x * y for x, y in zip(scripted_embedding(a), scripted_embedding(b),
                                           strict=True))


def _ask(proxy: ProxyServer, session: str) -> tuple[str, dict[str, str]]:
    raw = _client(proxy, session).chat.completions.with_raw_response.create(
        model=MODEL, messages=ASK, tools=ORDER_TOOLS)  # type: ignore[arg-type]
    return raw.parse().choices[0].message.content or "", dict(raw.headers)


def _counted(proxy: ProxyServer, op: str, outcome: str) -> float:
    return float(proxy.metrics.memory.labels("acme", op, outcome)._value.get())


def test_the_tenants_model_indexes_in_batches_with_its_key_and_finds_by_meaning(
        tmp_path: Path, make_proxy: Any, upstream: ScriptedUpstream) -> None:
    """Indexing goes to the tenant's upstream after the answers, with the tenant's own key
    and its model, in batches of at most EMBED_BATCH covering each distinct segment once;
    its tokens (the upstream's usage) are counted; vectors are kept under the model's
    name and size. The search sends the query alone, and the refund turn comes back by
    meaning with the cosine the upstream's vectors give. Red with: the upstream's shared
    key sent instead of the tenant's (planted: ``auth`` from the upstream spec), the
    embedded model searched instead (planted: ``model_for`` always local: the search
    sends nothing and the cosine is wordllama's), the tokens not counted (planted)."""
    proxy = _served(tmp_path, make_proxy, upstream)
    _live_past(proxy, upstream, "emb-refund")
    want = _indexed(proxy)
    proxy.settle()
    calls = list(upstream.embedding_calls)
    assert calls, "nothing went to /v1/embeddings"
    for headers, body in calls:
        assert headers["authorization"] == f"Bearer {ACME_UPSTREAM_KEY}"
        assert body["model"] == EMBEDDING_MODEL
        assert 1 <= len(body["input"]) <= EMBED_BATCH
    by_text = {s.text for s in segments(CONVERSATION, closed_loops(CONVERSATION))}
    sent = [t for _, body in calls for t in body["input"]]
    assert sorted(sent) == sorted(by_text) and len(sent) == len(want)
    words = sum(max(1, len(t.split())) for t in sent)
    assert proxy.metrics.memory_tokens.labels("acme", "index")._value.get() == words
    key = _mem_keys(proxy)[0]
    assert key.endswith(":mem:" + hashlib.sha256(
        stored_name("main", EMBEDDING_MODEL, 1536).encode()).hexdigest()[:8])

    upstream.embedding_calls.clear()
    upstream.responder = _searching(QUERY)
    text, headers = _ask(proxy, "emb-refund")
    assert "x-runloop-degraded" not in headers
    # the search's call comes first (this answer's own indexing may follow it)
    assert upstream.embedding_calls[0][1]["input"] == [QUERY]
    refund = next(h for h in text.splitlines() if "reimbursement of $54.04" in h
                  and h.startswith("- ["))
    assert f"meaning {_cosine(QUERY, PAST[3]['content']):.2f}" in refund
    # no word in common: found by "refund" ~ "reimbursement" alone
    assert not set(QUERY.split()) & set(str(PAST[3]["content"]).lower().split())
    assert _cosine(QUERY, PAST[3]["content"]) > 0.1
    assert proxy.metrics.memory_tokens.labels("acme", "search")._value.get() == 3


@pytest.mark.parametrize("fault", ["failing", "slow"])
def test_a_failing_or_slow_model_leaves_the_words_to_answer_and_says_so(
        tmp_path: Path, make_proxy: Any, upstream: ScriptedUpstream,
        monkeypatch: pytest.MonkeyPatch, fault: str) -> None:
    """The upstream's embeddings answering 500, or slower than the search's deadline: the
    request is answered 200, its hits by words alone (no ``meaning`` score), the
    tool's answer says why, the header says ``memory``, the metrics count it, and the
    background share is given back. Red with: the EmbeddingError raised out of the
    search (planted: ``except EmbeddingError`` re-raising: [failing] a 500), the deadline's
    TimeoutError raised (planted: [slow] a 500), the share not given back (planted:
    ``calls.give`` skipped: both red, in_use stays 1)."""
    monkeypatch.setattr(memory, "SEARCH_TIMEOUT_S", 0.5)
    proxy = _served(tmp_path, make_proxy, upstream)
    _live_past(proxy, upstream, "emb-fault")
    _indexed(proxy)
    if fault == "failing":
        upstream.embeddings_fail = 500
        why = "the embedding call answered 500"
    else:
        upstream.latency = Latency(embeddings=1.5)
        why = "the search by meaning took over 0.5 s"
    upstream.responder = _searching(QUERY)
    text, headers = _ask(proxy, "emb-fault")
    assert headers["x-runloop-degraded"] == "memory"
    assert f"(meaning partly unavailable: {why}):" in text
    hits = [h for h in text.splitlines() if h.startswith("- [")]
    assert hits and all(" words " in h and " meaning " not in h for h in hits)
    assert _counted(proxy, "search", "words_only") == 1
    assert proxy.metrics.degraded.labels("acme", "memory")._value.get() == 1
    until(lambda: proxy.state.summaries.calls.in_use == 0, what="the share given back")


def test_the_daily_cap_stops_the_calls_and_the_search_says_so(
        tmp_path: Path, make_proxy: Any, upstream: ScriptedUpstream) -> None:
    """embedding_daily_tokens = 5: the first answer's indexing spends more (its usage), and
    from then on no call goes — neither the next answers' indexing nor the search, which
    answers by words and says the day's tokens are spent. Red with: the cap not read
    (planted: ``_within_cap`` returning at once: calls go on), the spend not added to the
    day's (planted: ``_spent`` a no-op: the cap is never reached)."""
    proxy = _served(tmp_path, make_proxy, upstream, "embedding_daily_tokens = 5\n")
    _live_past(proxy, upstream, "emb-cap")
    proxy.settle()
    until(lambda: _counted(proxy, "index", "failed") >= 1, what="an indexing capped")
    calls = len(upstream.embedding_calls)
    assert calls >= 1
    assert proxy.metrics.memory_tokens.labels("acme", "index")._value.get() > 5
    upstream.responder = _searching(QUERY)
    text, headers = _ask(proxy, "emb-cap")
    proxy.settle()
    assert headers["x-runloop-degraded"] == "memory"
    assert "the embedding model's tokens for today are spent" in text
    assert len(upstream.embedding_calls) == calls
    assert _counted(proxy, "search", "capped") == 1


def test_a_tenant_at_its_share_of_background_calls_sends_no_embedding_call(
        tmp_path: Path, make_proxy: Any, upstream: ScriptedUpstream) -> None:
    """The tenant holds its whole share of the background model calls (its summaries in
    flight, here taken by the test): its search sends no embedding call and answers by
    words, saying so. Red with the share skipped (planted: ``calls.take`` not called: the
    call goes upstream)."""
    proxy = _served(tmp_path, make_proxy, upstream)
    _live_past(proxy, upstream, "emb-share")
    _indexed(proxy)
    proxy.settle()
    calls = proxy.state.summaries.calls
    calls.take("acme", calls.per_holder)
    try:
        upstream.embedding_calls.clear()
        upstream.responder = _searching(QUERY)
        text, headers = _ask(proxy, "emb-share")
        assert headers["x-runloop-degraded"] == "memory"
        assert "the embedding model's calls are at their share" in text
        assert upstream.embedding_calls == []
        assert _counted(proxy, "search", "over_share") == 1
    finally:
        calls.give("acme", calls.per_holder)


@pytest.mark.parametrize(("policy", "why"), [
    ('memory = "upstream"\n', "needs embedding_model and embedding_dimensions"),
    (f'memory = "upstream"\nembedding_model = "{EMBEDDING_MODEL}"\n',
     "needs embedding_model and embedding_dimensions"),
    ('embedding_upstream = "other"\n', "policy.embedding_upstream: unknown upstream 'other'"),
    ('embedding_upstream = "keyless"\n', "upstream 'keyless' has no api_key"),
])
def test_an_upstream_memory_the_config_cannot_serve_does_not_load(
        tmp_path: Path, policy: str, why: str) -> None:
    """No model named, no size, an embedding upstream unknown or without a key of its own
    (the tenant's key would go to an upstream it was not given for): refused at load.
    Red with the keyless check left to summaries (planted: the loop over
    ``embedding_upstream`` dropped, red on the last two rows)."""
    from runloop_proxy.config import Settings, load_config
    from runloop_proxy.errors import ConfigError

    root = tmp_path / "cfg"
    (root / "tenants").mkdir(parents=True)
    (root / "runloop.toml").write_text(
        f'[upstreams.main]\nurl = "http://127.0.0.1:9/v1"\napi_key = "{UPSTREAM_KEY}"\n'
        f'[upstreams.keyless]\nurl = "http://127.0.0.1:9/v1"\n[defaults]\nupstream = "main"\n')
    (root / "tenants" / "acme.toml").write_text(f'keys = ["{TENANT_KEY}"]\n[policy]\n{policy}')
    with pytest.raises(ConfigError, match=why.replace("(", r"\(")):
        load_config(Settings(config_dir=str(root)))
