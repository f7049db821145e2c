"""A base URL given with ``/v1`` at its end, the most common mistake
(``ANTHROPIC_BASE_URL=http://host/v1``: the anthropic SDK and Claude Code add ``/v1``
themselves, and ask for ``/v1/v1/messages``): every API answers as at its own path, with the
real SDKs — the Messages API (JSON, streamed, count_tokens), chat completions and the
Responses API, the pass-through's model list — and errors keep their API's shape.

The bug class: *a path the client doubled is a 404 the client shows as something else*
(Claude Code: "issue with the selected model"). Planted to see these tests red: the doubled
prefix taken off for the conversation endpoints only (the pass-through's /v1/v1/models a
404), and off the path but not the raw path (the pass-through forwards /v1/v1/models).
"""

from __future__ import annotations

import hashlib
from typing import Any

import anthropic
import httpx
import openai

from runloop_proxy.scripted import ScriptedUpstream

from .conftest import ProxyServer
from .keys import anthropic_key, openai_project_key

ADMIN = "admin-base-url-0123456789"
MODEL = "claude-haiku-4-5-20251001"


def test_the_anthropic_sdk_with_v1_in_its_base_url(make_proxy: Any,
                                                    upstream: ScriptedUpstream) -> None:
    proxy: ProxyServer = make_proxy(admin_key=ADMIN)
    key = anthropic_key(11)
    client = anthropic.Anthropic(base_url=proxy.base + "/v1", api_key=key, max_retries=0,
                                 default_headers={"X-Session-Id": "doubled-v1"})
    first = client.messages.create(model=MODEL, max_tokens=512, system="Be brief.",
                                   messages=[{"role": "user", "content": "ping"}])
    assert first.content[0].text == "echo: ping"  # type: ignore[union-attr]
    with client.messages.stream(model=MODEL, max_tokens=512, system="Be brief.", messages=[
            {"role": "user", "content": "ping"},
            {"role": "assistant", "content": "echo: ping"},
            {"role": "user", "content": "pong"}]) as stream:
        assert "".join(stream.text_stream) == "echo: pong"
    counted = client.messages.count_tokens(model=MODEL, messages=[
        {"role": "user", "content": "how many tokens is this"}])
    assert counted.input_tokens > 0
    assert len(upstream.requests) == 2 and not upstream.other  # both at /v1/messages
    proxy.settle()
    tenant = "pt-" + hashlib.sha256(key.encode()).hexdigest()[:16]
    view = httpx.get(f"{proxy.base}/admin/sessions/doubled-v1", params={
        "tenant": tenant, "messages": "1"}, headers={"Authorization": f"Bearer {ADMIN}"})
    assert view.status_code == 200, view.text
    assert [m["content"] for m in view.json()["messages"]] == [
        "Be brief.", "ping", "echo: ping", "pong", "echo: pong"]
    # an error at the doubled path is still Anthropic's
    try:
        client.messages.create(model=MODEL, max_tokens=512, messages=[])
    except anthropic.BadRequestError as exc:
        assert exc.body["type"] == "error"  # type: ignore[index]
    else:
        raise AssertionError("an empty conversation was accepted")


def test_the_openai_sdk_with_v1_twice(make_proxy: Any, upstream: ScriptedUpstream) -> None:
    proxy: ProxyServer = make_proxy()
    client = openai.OpenAI(base_url=proxy.base + "/v1/v1", api_key=openai_project_key(11),
                           max_retries=0)
    chat = client.chat.completions.create(model="gpt-4.1-mini-2025-04-14", messages=[
        {"role": "user", "content": "hello"}])
    assert chat.choices[0].message.content == "echo: hello"
    reply = client.responses.create(model="gpt-5-mini-2025-08-07", input="hi there")
    assert reply.output_text == "echo: hi there"
    models = client.models.list()  # passed through, to the upstream's /v1/models
    assert [m.id for m in models.data] == ["gpt-4o-mini", "gpt-4o"]
    assert len(upstream.requests) == 2 and not upstream.other
