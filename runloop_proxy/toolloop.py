"""The proxy's tool rounds: when the model calls recall_tool_call or search_history, answer
and call the upstream again — non-streaming, and streaming with the client's stream kept live
and free of the proxy's calls."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

import orjson

from . import logs
from .errors import StoreError, UpstreamError
from .exchange import Exchange, call_upstream, clean, note_usage, record, timed_read
from .messages import Message, message_hash
from .sse import DONE, SSEDecoder, encode_json
from .store import Prepared
from .streaming import ChunkRewriter, StreamAccumulator, add_usage
from .tools import ToolRunner
from .upstream import UpstreamResponse

log = logs.get("chat")


async def tool_loop(ex: Exchange, raw: bytes, body: bytes | dict[str, Any],
                     messages: list[Message], prepared: list[Prepared],
                     window_msgs: list[Message], window_keys: list[str]) -> dict[str, Any]:
    assert ex.tools is not None and isinstance(body, dict)
    data = orjson.loads(raw)
    usage: dict[str, Any] = {}
    add_usage(usage, data.get("usage"))
    runner = _runner(ex, window_msgs, window_keys)
    convo = list(body["messages"])
    exchange: list[Message] = []
    rounds = 0
    while True:
        msg = data["choices"][0]["message"]
        calls = msg.get("tool_calls") or []
        mine = [c for c in calls if ex.tools.owns(c)]
        theirs = [c for c in calls if not ex.tools.owns(c)]
        if not mine:
            break
        results = [await runner.run(c) for c in mine]
        full_assistant = clean(msg)
        if theirs or rounds >= ex.tenant.policy.max_tool_rounds:
            msg["tool_calls"] = theirs or None
            if not theirs:
                data["choices"][0]["finish_reason"] = "stop"
                msg["content"] = msg.get("content") or ""
            else:
                ex.state.spawn(_keep_internal(ex, msg, exchange, full_assistant, results))
                exchange = []
            break
        exchange += [full_assistant, *results]
        convo += [full_assistant, *results]
        resp = await call_upstream(ex, _next_round(ex, body, convo, rounds))
        nxt = await timed_read(ex, resp)
        if resp.status >= 400:
            raise _upstream_failed(resp.status, nxt)
        data = orjson.loads(nxt)
        add_usage(usage, data.get("usage"))
        rounds += 1
    _count_recalls(ex, runner)
    data["usage"] = usage or data.get("usage")
    note_usage(ex, usage)
    reply = clean(data["choices"][0]["message"])
    if exchange:
        ex.state.spawn(_keep_internal(ex, reply, exchange, None, []))
    record(ex, prepared, reply)
    return data  # type: ignore[no-any-return]


def _next_round(ex: Exchange, body: dict[str, Any], convo: list[Message],
                rounds: int) -> dict[str, Any]:
    """The request for the next tool round; on the last allowed one the proxy's tools are
    withdrawn, so the model has to answer."""
    assert ex.tools is not None
    out = {**body, "messages": convo}
    if rounds + 1 >= ex.tenant.policy.max_tool_rounds:
        out["tools"] = [t for t in body["tools"]
                        if (t.get("function") or {}).get("name") not in ex.tools.names]
    return out


def _upstream_failed(status: int, body: bytes) -> UpstreamError:
    err = UpstreamError(f"upstream answered {status} during a proxy tool round: "
                        f"{body[:300].decode(errors='replace')}")
    err.status = status if status >= 500 else 502
    return err


def _runner(ex: Exchange, window_msgs: list[Message], window_keys: list[str]) -> ToolRunner:
    assert ex.tools is not None
    return ToolRunner(ex.tools, window_msgs, window_keys, ex.state.store, ex.tenant_id,
                      ex.session_id, ex.tenant.policy.search_results)


def _count_recalls(ex: Exchange, runner: ToolRunner) -> None:
    for tool, outcome in runner.outcomes:
        ex.state.metrics.recalls.labels(ex.tenant_label, tool, outcome).inc()


async def stream_tool_loop(ex: Exchange, resp: UpstreamResponse, body: bytes | dict[str, Any],
                            window_msgs: list[Message], window_keys: list[str],
                            prepared: list[Prepared]) -> AsyncIterator[bytes]:
    assert ex.tools is not None and isinstance(body, dict)
    want_usage = bool((ex.body.get("stream_options") or {}).get("include_usage"))  # type: ignore[attr-defined]
    runner = _runner(ex, window_msgs, window_keys)
    usage: dict[str, Any] = {}
    convo = list(body["messages"])
    exchange: list[Message] = []
    stream_id: str | None = None
    next_index = 0
    rounds = 0
    last_chunk: dict[str, Any] = {}
    content_so_far: list[str] = []
    while True:
        acc = StreamAccumulator()
        rewriter = ChunkRewriter(ex.tools, stream_id, next_index)
        decoder = SSEDecoder()
        try:
            async for raw in resp.iter_chunks():
                for ev in decoder.feed(raw):
                    out = _rewrite_event(ev, acc, rewriter)
                    if out is not None:
                        last_chunk = out
                        yield encode_json(out)
            for ev in decoder.flush():
                out = _rewrite_event(ev, acc, rewriter)
                if out is not None:
                    yield encode_json(out)
        finally:
            resp.close()
        stream_id = rewriter.stream_id
        next_index = rewriter.next_client_index
        add_usage(usage, acc.usage)
        content_so_far += acc.content
        calls = acc.tool_calls()
        mine = [c for c in calls if ex.tools.owns(c)]
        theirs = [c for c in calls if not ex.tools.owns(c)]
        if mine and not theirs and rounds < ex.tenant.policy.max_tool_rounds:
            results = [await runner.run(c) for c in mine]
            assistant = clean(acc.message())
            exchange += [assistant, *results]
            convo += [assistant, *results]
            resp = await call_upstream(ex, _next_round(ex, body, convo, rounds))
            if resp.status >= 400:
                raise _upstream_failed(resp.status, await resp.read())
            rounds += 1
            continue
        finish_chunk = rewriter.held_finish
        if finish_chunk is not None:
            if mine and not theirs:
                finish_chunk["choices"][0]["finish_reason"] = "stop"
            yield encode_json(finish_chunk)
        if want_usage:
            template = finish_chunk or last_chunk
            yield encode_json({"id": stream_id, "object": "chat.completion.chunk",
                               "created": template.get("created", int(time.time())),
                               "model": template.get("model", ex.model), "choices": [],
                               "usage": usage})
        yield DONE
        break
    _count_recalls(ex, runner)
    note_usage(ex, usage)
    final = clean(acc.message())
    if len(content_so_far) > len(acc.content):
        final["content"] = "".join(content_so_far) or None
    client_view: Message = dict(final)  # type: ignore[assignment]
    if mine:
        full: Message = dict(final)  # type: ignore[assignment]
        client_view = clean({**client_view, "tool_calls": theirs or None})  # type: ignore[typeddict-item]
        results = [await runner.run(c) for c in mine] if theirs else []
        ex.state.spawn(_keep_internal(ex, client_view, exchange, full if theirs else None,
                                      results))
        exchange = []
    if exchange:
        ex.state.spawn(_keep_internal(ex, client_view, exchange, None, []))
    record(ex, prepared, client_view)


def _rewrite_event(ev: Any, acc: StreamAccumulator, rewriter: ChunkRewriter
                   ) -> dict[str, Any] | None:
    if ev.is_done or not ev.data:
        return None
    try:
        chunk = orjson.loads(ev.data)
    except orjson.JSONDecodeError:
        return None
    if isinstance(chunk, dict) and chunk.get("error"):
        raise _stream_error(chunk)
    acc.add(chunk)
    return rewriter.rewrite(chunk)


def _stream_error(chunk: dict[str, Any]) -> UpstreamError:
    err = chunk.get("error") or {}
    exc = UpstreamError(str(err.get("message", "upstream error")) if isinstance(err, dict)
                        else str(err))
    return exc


async def _keep_internal(ex: Exchange, client_view: Message, before: list[Message],
                         replace: Message | None, after: list[Message]) -> None:
    store = ex.state.store
    if store is None:
        return
    entry: dict[str, Any] = {"before": before, "replace": replace, "after": after}
    try:
        await store.add_internal(ex.tenant_id, ex.session_id, message_hash(client_view),
                                 entry)
    except StoreError as exc:
        log.warning("proxy tool exchange not stored", extra={"error": str(exc)})


