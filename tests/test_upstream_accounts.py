"""What the proxy does with a key that is not the caller's (a red-team pass's findings, each
closed as a class): whose account the upstream acts in, which headers go with the proxy's
key, which key goes to which upstream, and whose namespace a caller's own key names."""

from __future__ import annotations

import hashlib
import logging
from pathlib import Path
from typing import Any

import httpx
import pytest

from runloop_proxy.api.routes import stateless
from runloop_proxy.config import Settings, load_config
from runloop_proxy.errors import ConfigError
from runloop_proxy.ops.logs import JsonFormatter, TextFormatter
from runloop_proxy.scripted import ScriptedUpstream

from .conftest import ProxyServer
from .test_config import ACME_KEY, GLOBEX_KEY, write_config

INITECH_KEY = "initech-proxy-key-0123456789"
ADMIN = "admin-0123456789abcdef"  # write_config's

# Endpoints whose answer comes from what the upstream account stores (or that store into
# it): through a key other tenants use too, each would be every such tenant's. Taken from
# OpenAI's and Anthropic's API references, every kind of stored object.
STATEFUL = [
    ("GET", "/v1/chat/completions"), ("GET", "/v1/chat/completions/chatcmpl-acme"),
    ("GET", "/v1/chat/completions/chatcmpl-acme/messages"),
    ("DELETE", "/v1/chat/completions/chatcmpl-acme"),
    ("GET", "/v1/files"), ("POST", "/v1/files"), ("GET", "/v1/files/file-acme/content"),
    ("DELETE", "/v1/files/file-acme"), ("GET", "/v1/batches"), ("POST", "/v1/batches"),
    ("GET", "/v1/batches/batch_acme"), ("POST", "/v1/uploads"),
    ("GET", "/v1/responses/resp_acme"), ("GET", "/v1/responses/resp_acme/input_items"),
    ("DELETE", "/v1/responses/resp_acme"), ("POST", "/v1/conversations"),
    ("GET", "/v1/conversations/conv_acme/items"), ("GET", "/v1/vector_stores"),
    ("GET", "/v1/fine_tuning/jobs"), ("GET", "/v1/assistants"), ("GET", "/v1/threads/t_1"),
    ("GET", "/v1/containers"), ("GET", "/v1/evals"), ("GET", "/v1/messages/batches"),
    ("GET", "/v1/organization/projects"), ("POST", "/v1/realtime/sessions"),
    ("GET", "/v1/models/ft%3Agpt-4o%3Aacme/anything"), ("DELETE", "/v1/models/ft-acme"),
    ("POST", "/v1/embeddings/../files"), ("HEAD", "/v1/files"),
]
STATELESS = [("GET", "/v1/models"), ("GET", "/v1/models/gpt-4o"), ("POST", "/v1/embeddings"),
             ("POST", "/v1/moderations"), ("POST", "/v1/audio/speech"),
             ("POST", "/v1/images/generations"), ("POST", "/v1/responses/input_tokens")]


def test_stateless_endpoints_are_a_list_of_what_keeps_nothing() -> None:
    for method, path in STATEFUL:
        assert not stateless(method, path[len("/v1"):]), (method, path)
    for method, path in STATELESS:
        assert stateless(method, path[len("/v1"):]), (method, path)


@pytest.fixture
def three_tenants(tmp_path: Path, make_proxy: Any, upstream: ScriptedUpstream,
                  monkeypatch: pytest.MonkeyPatch) -> ProxyServer:
    """acme with its own upstream key; globex and initech both on the upstream's key."""
    monkeypatch.setenv("TEST_UPSTREAM_KEY", "sk-operator-shared")
    monkeypatch.setenv("TEST_ACME_KEY", ACME_KEY)
    root = write_config(tmp_path / "cfg", upstream.url)
    (root / "tenants" / "initech.toml").write_text(f'keys = ["{INITECH_KEY}"]\n')
    return make_proxy(config_dir=str(root))  # type: ignore[no-any-return]


def test_a_shared_key_reaches_nothing_the_upstream_account_stores(
        three_tenants: ProxyServer, upstream: ScriptedUpstream) -> None:
    """Finding: tenants without an ``upstream_key`` share the upstream's, and every other
    /v1 path went upstream with it: globex listed and read acme's stored completions,
    files, batches and responses, and deleted them. Through a shared key only endpoints
    that keep nothing upstream are forwarded; the rest are refused (403, the API's shape)
    before anything is sent. A tenant with a key of its own reaches its own account."""
    for method, path in STATEFUL:
        r = httpx.request(method, three_tenants.base + path,
                          headers={"Authorization": f"Bearer {GLOBEX_KEY}"}, content=b"{}")
        assert r.status_code in (400, 403), (method, path, r.status_code)
        if method != "HEAD":
            err = r.json()["error"]
            assert r.status_code == 400 or (err["type"] == "permission_error"
                                            and "upstream_key" in err["message"]), (path, err)
    r = httpx.get(three_tenants.base + "/v1/messages/batches",
                  headers={"x-api-key": INITECH_KEY, "anthropic-version": "2023-06-01"})
    assert r.status_code == 403 and r.json()["error"]["type"] == "permission_error"
    assert upstream.other == []  # nothing reached the upstream
    models = httpx.get(three_tenants.url + "/models",
                       headers={"Authorization": f"Bearer {GLOBEX_KEY}"})
    assert [m["id"] for m in models.json()["data"]] == ["gpt-4o-mini", "gpt-4o"]
    asked = {"model": "text-embedding-3-small", "input": "refund order #W5102934"}
    emb = httpx.post(three_tenants.url + "/embeddings", json=asked,
                     headers={"Authorization": f"Bearer {GLOBEX_KEY}"})
    direct = httpx.post(upstream.url + "/embeddings", json=asked,
                        headers={"Authorization": "Bearer sk-up"})
    vector = direct.json()["data"][0]["embedding"]
    assert any(vector) and emb.json()["data"][0]["embedding"] == vector  # as it came
    # acme's key is its own: its own account is its own to read
    r = httpx.get(three_tenants.url + "/files/file-acme/content",
                  headers={"Authorization": f"Bearer {ACME_KEY}"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "unknown_url"
    assert [(m, p, h["authorization"]) for m, p, h, _ in upstream.other] == \
        [("GET", "/v1/files/file-acme/content", "Bearer sk-acme-upstream")]


# a stored object named by its id, in each place an API takes one (found by a second pass:
# the pass-through's 403 left the proxy's own endpoints forwarding them with the shared key)
NAMING = [
    ("/v1/responses", {"model": "m", "input": "go on", "previous_response_id": "resp_acme"}),
    ("/v1/responses", {"model": "m", "input": "hi", "conversation": "conv_acme"}),
    ("/v1/responses", {"model": "m", "input": "hi", "prompt": {"id": "pmpt_acme"}}),
    ("/v1/responses", {"model": "m", "input": [{"role": "user", "content": [
        {"type": "input_file", "file_id": "file-acme"}]}]}),
    ("/v1/responses", {"model": "m", "input": [{"type": "item_reference", "id": "msg_acme"}]}),
    ("/v1/responses", {"model": "m", "input": "hi", "tools": [
        {"type": "file_search", "vector_store_ids": ["vs_acme"]}]}),
    ("/v1/chat/completions", {"model": "m", "messages": [{"role": "user", "content": [
        {"type": "file", "file": {"file_id": "file-acme"}}]}]}),
]


@pytest.mark.parametrize(("path", "body"), NAMING)
def test_a_shared_key_names_nothing_the_upstream_account_stores(
        three_tenants: ProxyServer, upstream: ScriptedUpstream, path: str,
        body: dict[str, Any]) -> None:
    """Through a key other tenants use too, no request of the proxy's own endpoints names a
    stored object either — a response it continues, a conversation, a stored prompt, a file,
    a vector store, an item by id: a 403 before anything is sent. A tenant with its own key
    sends them as they came, and a tool whose schema has a field called ``prompt`` or
    ``file_id`` is no reference."""
    r = httpx.post(three_tenants.base + path, json=body,
                   headers={"Authorization": f"Bearer {GLOBEX_KEY}"})
    assert r.status_code == 403 and r.json()["error"]["type"] == "permission_error", r.text
    assert upstream.requests == []
    own = httpx.post(three_tenants.base + path, json=body,
                     headers={"Authorization": f"Bearer {ACME_KEY}"})
    assert own.status_code != 403 and len(upstream.requests) == 1
    plain = httpx.post(three_tenants.base + "/v1/chat/completions", headers={
        "Authorization": f"Bearer {GLOBEX_KEY}"}, json={
        "model": "m", "messages": [{"role": "user", "content": "hi"}], "tools": [
            {"type": "function", "function": {"name": "f", "parameters": {
                "type": "object", "properties": {"prompt": {"type": "string"},
                                                 "file_id": {"type": "string"}}}}}]})
    assert plain.status_code == 200


def test_which_tenants_share_a_key(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TEST_UPSTREAM_KEY", "sk-operator-shared")
    monkeypatch.setenv("TEST_ACME_KEY", ACME_KEY)
    root = write_config(tmp_path, "http://up/v1")
    alone = load_config(Settings(config_dir=str(root)))
    assert not alone.shares_key(alone.tenants["globex"])  # the upstream's key is its alone
    (root / "tenants" / "initech.toml").write_text(
        f'keys = ["{INITECH_KEY}"]\nupstream_key = "sk-acme-upstream"\n')
    cfg = load_config(Settings(config_dir=str(root)))
    assert {n for n, t in cfg.tenants.items() if cfg.shares_key(t)} == {"acme", "initech"}


def test_the_proxys_key_goes_with_no_header_that_names_a_caller(
        three_tenants: ProxyServer, upstream: ScriptedUpstream) -> None:
    """Finding: a tenant's client sent ``OpenAI-Organization`` / ``OpenAI-Project`` beside
    the operator's key, picking which organization and project it acts in. Where the
    proxy's key goes, no client header that may name a caller goes with it — on every
    path that forwards (the conversation endpoints and the pass-through)."""
    naming = {"OpenAI-Organization": "org-acme", "OpenAI-Project": "proj_acme",
              "Cookie": "sid=acme", "x-portkey-api-key": "pk-acme", "X-User-Id": "u-1"}
    headers = {"Authorization": f"Bearer {GLOBEX_KEY}", **naming,
               "X-Stainless-Lang": "python"}
    r = httpx.post(three_tenants.url + "/chat/completions", headers=headers,
                   json={"model": "m", "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 200
    httpx.post(three_tenants.url + "/embeddings", headers=headers,
               json={"model": "e", "input": "x"})
    r = httpx.get(three_tenants.url + "/files", headers={
        **headers, "Authorization": f"Bearer {ACME_KEY}"})
    sent = [upstream.headers[-1], upstream.other[-1][2]]
    for h in sent:
        assert not {k.lower() for k in naming} & set(h), h
        assert h["x-stainless-lang"] == "python"  # the rest goes through untouched
    assert upstream.headers[-1]["authorization"] == "Bearer sk-operator-shared"


def test_a_summary_upstream_is_given_its_own_key_or_none(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Finding: a ``summary_upstream`` with no key of its own was sent the tenant's key for
    its main upstream (or, in pass-through mode, each client's own). A key goes only to the
    upstream it was given for: such a config is refused when it loads, naming the field."""
    monkeypatch.setenv("TEST_UPSTREAM_KEY", "sk-up")
    monkeypatch.setenv("TEST_ACME_KEY", ACME_KEY)
    root = write_config(tmp_path, "http://up/v1",
                        extra_global='[upstreams.cheap]\nurl = "http://cheap/v1"\n',
                        acme_policy='summary_model = "m"\nsummary_upstream = "cheap"')
    with pytest.raises(ConfigError, match="no api_key") as err:
        load_config(Settings(config_dir=str(root)))
    assert "summary_upstream" in str(err.value) and "acme" in str(err.value)
    root = write_config(tmp_path, "http://up/v1",
                        acme_policy='summary_model = "m"\nsummary_upstream = "nowhere"')
    with pytest.raises(ConfigError, match="unknown upstream 'nowhere'"):
        load_config(Settings(config_dir=str(root)))
    with pytest.raises(ConfigError, match="no api_key"):  # pass-through: the clients' keys
        load_config(Settings(upstream="http://up/v1", summary_model="m",
                             config_dir=str(_defaults(tmp_path / "pt"))))


def _defaults(root: Path) -> Path:
    root.mkdir()
    (root / "runloop.toml").write_text(
        '[upstreams.cheap]\nurl = "http://cheap/v1"\n'
        '[defaults.policy]\nsummary_upstream = "cheap"\n')
    return root


@pytest.fixture
def byok(tmp_path: Path, make_proxy: Any, upstream: ScriptedUpstream) -> ProxyServer:
    root = tmp_path / "cfg"
    (root / "tenants").mkdir(parents=True)
    (root / "runloop.toml").write_text(
        f'[server]\nadmin_key = "{ADMIN}"\n[upstreams.main]\nurl = "{upstream.url}"\n'
        f'max_retries = 0\n')
    (root / "tenants" / "byok.toml").write_text(
        'keys = ["sk-alice-own-0123456789", "sk-bob-own-0123456789"]\nupstream = "main"\n'
        'forward_client_key = true\n')
    return make_proxy(config_dir=str(root))  # type: ignore[no-any-return]


def test_a_tenant_that_forwards_its_callers_keys_keeps_each_keys_sessions_apart(
        byok: ProxyServer, upstream: ScriptedUpstream) -> None:
    """Finding: a tenant whose callers bring their own upstream keys put them all in the
    tenant's one namespace, so Bob, naming Alice's session, had her conversation sent to
    the model under his key (server history). Where a caller's own key goes upstream, its
    namespace is that key (as in pass-through mode): within the tenant, per key."""
    def say(key: str, text: str) -> None:
        r = httpx.post(byok.url + "/chat/completions", json={
            "model": "m", "messages": [{"role": "user", "content": text}]}, headers={
            "Authorization": f"Bearer {key}", "X-Session-Id": "support",
            "X-Runloop-History": "server"})
        assert r.status_code == 200, r.text
        byok.settle()
    say("sk-alice-own-0123456789", "alice: my card is 4111-1111-1111-1111")
    say("sk-bob-own-0123456789", "bob: what did I say?")
    assert "4111" not in str(upstream.requests[-1]["messages"])
    assert upstream.headers[-1]["authorization"] == "Bearer sk-bob-own-0123456789"
    say("sk-alice-own-0123456789", "alice: and again?")
    assert "4111" in str(upstream.requests[-1]["messages"])  # her own history is hers
    tenants = httpx.get(byok.base + "/admin/tenants",
                        headers={"Authorization": f"Bearer {ADMIN}"}).json()["tenants"]
    alice = "byok+" + hashlib.sha256(b"sk-alice-own-0123456789").hexdigest()[:16]
    assert {t["tenant"]: t["sessions"] for t in tenants if t["sessions"]} == {
        alice: 1, "byok+" + hashlib.sha256(b"sk-bob-own-0123456789").hexdigest()[:16]: 1}
    r = httpx.get(byok.base + "/admin/sessions/support", params={"tenant": alice},
                  headers={"Authorization": f"Bearer {ADMIN}"})
    assert r.status_code == 200 and "4111" in r.text and "bob" not in r.text


@pytest.mark.parametrize("credential", [
    {"Authorization": "Basic YWxpY2U6c2VjcmV0"}, {"x-goog-api-key": "g-alice"},
    {"cf-aig-authorization": "Bearer cf-alice"}])
def test_a_caller_named_by_any_credential_has_its_own_scope(
        make_proxy: Any, upstream: ScriptedUpstream, credential: dict[str, str]) -> None:
    """Finding: a pass-through caller whose credential was not a bearer token or an api-key
    header (Basic auth, a gateway's or Google's key) got no namespace, and every such
    caller shared one scope: Alice's answers moved Bob's ``count_tokens``. The namespace is
    every credential the caller sends, whatever its header."""
    proxy: ProxyServer = make_proxy(admin_key=ADMIN)
    bob = {k: v.replace("alice", "bob").replace("YWxpY2U", "Ym9i") for k, v in
           credential.items()}
    for who in (credential, bob):
        r = httpx.post(proxy.url + "/chat/completions", json={
            "model": "m", "messages": [{"role": "user", "content": "hello"}]},
            headers={**who, "X-Session-Id": "desk"})
        assert r.status_code == 200, r.text
    proxy.settle()
    tenants = httpx.get(proxy.base + "/admin/tenants",
                        headers={"Authorization": f"Bearer {ADMIN}"}).json()["tenants"]
    assert len([t for t in tenants if t["tenant"].startswith("pt-") and t["sessions"]]) == 2


def test_no_log_line_names_a_session_by_its_id(
        make_proxy: Any, upstream: ScriptedUpstream, caplog: pytest.LogCaptureFixture) -> None:
    """Finding: a named session's id — a capability: whoever holds the key and the id reads
    the session — was written in every request's log line and in compaction lines. Every
    formatter writes a session by a digest of it (``log_name``), whatever logs it; the
    inspector's search finds the session by that digest."""
    proxy: ProxyServer = make_proxy(admin_key=ADMIN)
    sid = "cc-7d1e4f0a-secret-session"
    msgs: list[dict[str, Any]] = []
    with caplog.at_level(logging.DEBUG, logger="runloop"):
        for k in range(4):
            msgs.append({"role": "user", "content": f"question {k} " + "x " * 300})
            r = httpx.post(proxy.url + "/chat/completions", json={"model": "m", "messages": msgs},
                           headers={"Authorization": "Bearer sk-own", "X-Session-Id": sid})
            msgs.append(r.json()["choices"][0]["message"])
        proxy.settle()
    named = [rec for rec in caplog.records if "session" in rec.__dict__]
    assert len(named) >= 4  # a line a request at least
    # the records themselves, as any handler an operator adds reads them (a second pass:
    # only the proxy's own formatters wrote the digest)
    assert not [rec for rec in caplog.records if sid in str(rec.__dict__)]
    for fmt in (JsonFormatter(), TextFormatter()):
        lines = [fmt.format(rec) for rec in caplog.records]
        assert not [line for line in lines if sid in line]
        assert any("n#" in line for line in lines)
    digest = next(v for line in [JsonFormatter().format(named[0])]
                  for v in [line.split('"session":"')[1].split('"')[0]])
    ui = httpx.Client(base_url=proxy.base, follow_redirects=False)
    assert ui.post("/admin/ui/login", data={"key": ADMIN}).status_code == 303
    tenant = "pt-" + hashlib.sha256(b"sk-own").hexdigest()[:16]
    assert sid in ui.get("/admin/ui", params={"tenant": tenant, "q": digest}).text
    assert sid not in ui.get("/admin/ui", params={"tenant": tenant, "q": "n#0"}).text
