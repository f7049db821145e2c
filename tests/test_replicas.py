"""Server history across replicas: two ``runloop-proxy serve`` processes on one Redis.

A server-history session's conversation lives in Redis alone, and a client (or a load
balancer) may send its next turn to any replica the moment it has an answer. Each replica
used to wait only for its own outstanding writes, so a turn answered by one replica was
still queued there when the next turn reached the other: 4-6 of 180 JSON requests, 15-31
of 180 streamed ones went upstream without the turn before, and histories were stored out
of order. An answer of a server-history turn now ends only once Redis holds the turn
(``relay.kept``), so whatever replica reads the session next reads it whole.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import httpx
import openai
import orjson
import pytest

from runloop_proxy.scripted import ScriptedUpstream

from .conftest import serve_command
from .keys import openai_project_key
from .test_sessions import ADMIN, BEHIND_WRITE_DELAY_S, TOOLS, sessions, streamed_reply, texts

SESSIONS = 6
TURNS = 10
MODEL = "gpt-4o-mini-2024-07-18"


def _ask(client: openai.OpenAI, text: str, stream: bool) -> str:
    if not stream:
        answer = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": text}])
        return answer.choices[0].message.content or ""
    got = []
    for chunk in client.chat.completions.create(
            model=MODEL, stream=True, messages=[{"role": "user", "content": text}]):
        if chunk.choices and chunk.choices[0].delta.content:
            got.append(chunk.choices[0].delta.content)
    return "".join(got)


@pytest.mark.parametrize("stream", [False, True], ids=["json", "streamed"])
def test_every_turn_reaches_the_upstream_whatever_replica_answered_the_last(
        stream: bool, upstream: ScriptedUpstream, redis_url: str, tmp_path: Path) -> None:
    """Bug class: a session's outstanding write known to one process only (the next turn,
    sent to another replica, read Redis before the write landed). Planted: the answer's end
    not waiting for the turn's write (``durable`` False: the turn written behind, as
    before) — red, 2 of 60 JSON and 4 of 60 streamed requests sent upstream without the
    turn before. The second bug of the class (the stream's end sent before the write) is
    planted in the test below, where the write's latency is injected."""
    key = openai_project_key(40)
    with serve_command(upstream.url, redis_url, tmp_path / "a", [], {}) as (a, _, _), \
            serve_command(upstream.url, redis_url, tmp_path / "b", [], {}) as (b, _, _):
        replicas = [a + "/v1", b + "/v1"]
        tag = "json" if not stream else "sse"
        names = [f"replica-{tag}-{n:02d}" for n in range(SESSIONS)]
        failures: list[str] = []

        def converse(name: str) -> None:
            clients = [openai.OpenAI(base_url=url, api_key=key, max_retries=0, timeout=60,
                                     default_headers={"X-Session-Id": name,
                                                      "X-Runloop-History": "server"})
                       for url in replicas]
            try:
                for turn in range(TURNS):
                    text = f"{name} turn {turn}"
                    got = _ask(clients[turn % 2], text, stream)
                    if got != f"echo: {text}":
                        failures.append(f"{name} turn {turn}: answered {got!r}")
            except Exception as exc:  # noqa: BLE001 - said in the assertion below
                failures.append(f"{name}: {type(exc).__name__}: {exc}")
            finally:
                for c in clients:
                    c.close()

        threads = [threading.Thread(target=converse, args=(n,)) for n in names]
        for t in threads:
            t.start()
        for t in threads:
            t.join(300)
        assert not failures, failures

        def sent_for(name: str) -> list[list[Any]]:
            return [[m.get("content") for m in body["messages"]]
                    for body in list(upstream.requests)
                    if body.get("messages")
                    and body["messages"][0].get("content") == f"{name} turn 0"]

        missing = []
        for name in names:
            requests = sorted(sent_for(name), key=len)
            assert len(requests) == TURNS, (name, [len(r) for r in requests])
            for turn, contents in enumerate(requests):
                want: list[str] = []
                for earlier in range(turn):
                    want += [f"{name} turn {earlier}", f"echo: {name} turn {earlier}"]
                want.append(f"{name} turn {turn}")
                if contents != want:
                    missing.append((name, turn, contents))
        assert not missing, f"{len(missing)} of {SESSIONS * TURNS} requests went upstream " \
                            f"without every earlier turn in order: {missing[:3]}"

        # what Redis holds, read through the other replica: every turn, in order
        for n, name in enumerate(names):
            c = openai.OpenAI(base_url=replicas[n % 2], api_key=key, max_retries=0,
                              timeout=60, default_headers={"X-Session-Id": name,
                                                           "X-Runloop-History": "server"})
            assert _ask(c, f"{name} last", stream) == f"echo: {name} last"
            c.close()
            last = sent_for(name)[-1]
            assert last == [x for t in range(TURNS) for x in
                            (f"{name} turn {t}", f"echo: {name} turn {t}")] + [f"{name} last"]


WRITE_DELAY_S = 0.35  # every history write of both replicas reaches Redis this late


def _anchors_late(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every replica's anchor writes (an answer's anchors and its write's announcement)
    reach Redis BEHIND_WRITE_DELAY_S late."""
    import asyncio

    from runloop_proxy.history.store import RedisStore

    call = RedisStore._call

    async def late_anchor(self: RedisStore, op: str, make: Any) -> Any:
        if op == "anchor":
            await asyncio.sleep(BEHIND_WRITE_DELAY_S)
        return await call(self, op, make)

    monkeypatch.setattr(RedisStore, "_call", late_anchor)


def _writes_late(*replicas: Any) -> None:
    """Each replica's history writes reach Redis WRITE_DELAY_S late (its write-behind's
    batches wait before they are sent)."""
    import asyncio

    for replica in replicas:
        writes = replica.state.store.writes
        run = writes._run

        async def slow(batch: Any, run: Any = run) -> Any:
            await asyncio.sleep(WRITE_DELAY_S)
            return await run(batch)

        writes._run = slow


@pytest.mark.parametrize("stream", [False, True], ids=["json", "streamed"])
def test_a_slow_write_is_waited_for_by_the_answer_not_by_luck(
        stream: bool, make_proxy: Any, upstream: ScriptedUpstream) -> None:
    """The same property with the write's latency injected, not hoped for: two replicas
    (each its own store and write-behind queue) on one Redis, every write of either reaching
    Redis WRITE_DELAY_S late, turns alternating. Red on the second turn with the answer's
    end not waiting for the write (planted: ``durable`` False), JSON and streamed; and, the
    second bug of the class, with the wait made after the stream's ending chunk was sent
    (planted: that chunk yielded before ``kept``) — red on the second turn too."""

    from .conftest import ProxyServer

    first: ProxyServer = make_proxy()
    second = ProxyServer(first.settings, first.config).start()
    try:
        _writes_late(first, second)
        key = openai_project_key(41)
        name = "slow-write-" + ("sse" if stream else "json")
        clients = [openai.OpenAI(base_url=p.url, api_key=key, max_retries=0, timeout=60,
                                 default_headers={"X-Session-Id": name,
                                                  "X-Runloop-History": "server"})
                   for p in (first, second)]
        for turn in range(6):
            seen = len(upstream.requests)
            assert _ask(clients[turn % 2], f"{name} {turn}", stream) == f"echo: {name} {turn}"
            assert len(upstream.requests) == seen + 1
            sent = [m["content"] for m in upstream.requests[-1]["messages"]]
            assert sent == [x for t in range(turn) for x in
                            (f"{name} {t}", f"echo: {name} {t}")] + [f"{name} {turn}"], \
                (turn, sent)
        for c in clients:
            c.close()
    finally:
        second.stop()


KILL_SESSIONS = 6
KILL_ROUNDS = 3
KILL_AFTER = 9  # answers acknowledged in a round before its process is killed


@pytest.mark.parametrize("stream", [False, True], ids=["json", "streamed"])
def test_an_acknowledged_turn_survives_kill_9(stream: bool, upstream: ScriptedUpstream,
                                             redis_url: str, tmp_path: Path) -> None:
    """``kill -9`` right after answers: every server-history turn whose answer the client
    got is in Redis (the next process's requests carry each, in order). Bug class: a turn
    acknowledged before it is durable. Planted: ``durable`` False (the turn written behind
    the answer, as before) — red: acknowledged turns missing after the kill."""
    key = openai_project_key(42)
    tag = "json" if not stream else "sse"
    names = [f"kill9-{tag}-{n}" for n in range(KILL_SESSIONS)]
    acked: dict[str, list[str]] = {n: [] for n in names}
    for rnd in range(KILL_ROUNDS):
        with serve_command(upstream.url, redis_url, tmp_path / f"r{rnd}", [], {}) as (
                base, _, proc):
            url = base + "/v1"
            count = threading.Semaphore(0)
            stop = threading.Event()

            def converse(name: str, url: str = url, rnd: int = rnd,
                         count: threading.Semaphore = count, stop: threading.Event = stop) -> None:
                c = openai.OpenAI(base_url=url, api_key=key, max_retries=0, timeout=60,
                                  default_headers={"X-Session-Id": name,
                                                   "X-Runloop-History": "server"})
                turn = 0
                try:
                    while not stop.is_set():
                        text = f"{name} round {rnd} turn {turn}"
                        if _ask(c, text, stream) == f"echo: {text}":
                            acked[name].append(text)
                            count.release()
                        turn += 1
                except (openai.APIError, openai.APIConnectionError):
                    pass  # the process was killed mid-request: that turn was never acknowledged
                finally:
                    c.close()

            threads = [threading.Thread(target=converse, args=(n,)) for n in names]
            try:
                for t in threads:
                    t.start()
                for _ in range(KILL_AFTER):
                    assert count.acquire(timeout=120), "answers did not come"
            finally:
                proc.kill()  # SIGKILL: nothing of the process runs after this
                proc.wait(30)
                stop.set()
                for t in threads:
                    t.join(120)
    with serve_command(upstream.url, redis_url, tmp_path / "last", [], {}) as (base, _, _):
        url = base + "/v1"
        lost = []
        for name in names:
            c = openai.OpenAI(base_url=url, api_key=key, max_retries=0, timeout=60,
                              default_headers={"X-Session-Id": name,
                                               "X-Runloop-History": "server"})
            assert _ask(c, f"{name} after", stream) == f"echo: {name} after"
            c.close()
            sent = [m["content"] for m in upstream.requests[-1]["messages"]]
            assert sent[-1] == f"{name} after"
            at = 0  # every acknowledged turn, and its answer, in order (a turn in flight
            for text in acked[name]:  # when the process died may be there too)
                try:
                    at = sent.index(text, at)
                except ValueError:
                    lost.append(text)
                    continue
                assert sent[at + 1] == f"echo: {text}", (text, sent[at:at + 2])
        assert not lost, f"{len(lost)} of {sum(map(len, acked.values()))} acknowledged " \
                         f"turns lost to kill -9: {lost[:5]}"


@pytest.mark.parametrize("stream", [False, True], ids=["json", "streamed"])
def test_a_trimmed_history_stays_one_session_across_replicas(
        stream: bool, make_proxy: Any, upstream: ScriptedUpstream,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A client that sends its system prompt and only its last messages, each request the
    moment the answer came, to the other replica each time (two replicas on one Redis),
    while both write late: every history write WRITE_DELAY_S, each anchor write
    BEHIND_WRITE_DELAY_S. Each request after a tool call carries that call (the reply its
    session is found by) and nothing the session was fingerprinted by. Bug class: what a
    session has written known to one process only — the anchor noted on the replica that
    answered, its write behind the answer, so the other replica found no session and began
    one of its own (and, once it found it, did not wait for the turn the first was still
    writing). One session, one branch, every message stored once and in order; every
    upstream request carried what the client sent, in order."""
    import hashlib

    from .conftest import ProxyServer

    _anchors_late(monkeypatch)
    first: ProxyServer = make_proxy(admin_key=ADMIN)
    second = ProxyServer(first.settings, first.config).start()
    try:
        _writes_late(first, second)

        def respond(body: dict[str, Any]) -> dict[str, Any]:
            last = body["messages"][-1]
            if last["role"] == "user":
                return {"tool_calls": [{"id": f"call_{last['content']}", "name": "lookup",
                                        "arguments": {"q": last["content"]}}]}
            return {"content": f"found {last['content']}"}

        upstream.responder = respond
        key = openai_project_key(43)
        clients = [openai.OpenAI(base_url=p.url, api_key=key, max_retries=0, timeout=60)
                   for p in (first, second)]
        system = {"role": "system", "content": "You trim your history to its last four."}
        full: list[dict[str, Any]] = []
        sent_upstream: list[list[tuple[str, Any]]] = []
        carried: list[list[tuple[str, Any]]] = []
        n = 0
        for t in range(4):
            full.append({"role": "user", "content": f"look up order {t}"})
            for _ in range(2):  # the tool call, then the answer
                messages = [system, *full[-4:]]
                sent: dict[str, Any] = {"model": "gpt-5.1", "messages": messages,
                                        "tools": TOOLS}
                c = clients[n % 2]
                n += 1
                seen = len(upstream.requests)
                reply = streamed_reply(c, **sent) if stream else \
                    c.chat.completions.create(**sent).choices[0].message.model_dump(
                        exclude_none=True)
                assert len(upstream.requests) == seen + 1
                carried.append([(m["role"], m.get("content")) for m in messages])
                sent_upstream.append([(m["role"], m.get("content"))
                                      for m in upstream.requests[-1]["messages"]])
                full.append(reply)
                if reply.get("tool_calls"):
                    full.append({"role": "tool", "tool_call_id": reply["tool_calls"][0]["id"],
                                 "content": f"order {t}: shipped"})
        for c in clients:
            c.close()
        assert sent_upstream == carried
        second.settle()
        views = sessions(first, "pt-" + hashlib.sha256(key.encode()).hexdigest()[:16])
        assert len(views) == 1, list(views)
        (view,) = views.values()
        assert len(view["branches"]) == 1
        assert texts(view)[1:] == [str(m.get("content")) for m in full]
    finally:
        second.stop()


@pytest.mark.parametrize("stream", [False, True], ids=["json", "streamed"])
def test_a_response_chained_on_another_replica_carries_the_proxys_outputs(
        stream: bool, make_proxy: Any, upstream: ScriptedUpstream,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """An answer mixing the client's call with the proxy's, from one replica; the client
    chains on it at once through the other (two replicas on one Redis), every anchor write
    BEHIND_WRITE_DELAY_S late. The chained request needs the proxy's outputs kept with the
    answer's id (the upstream refuses a call left without output). Bug class: what a
    response's chain needs known to the answering process only (its anchors written behind
    the answer): the other replica sent the client's output alone. Streamed, the client
    acts at ``response.completed`` (as Codex does), not when the body closes."""


    from .conftest import ProxyServer
    from .test_responses import BIG, KEY, agent_turns, mixed_answer
    from .test_responses import TOOLS as RESPONSE_TOOLS
    from .test_responses import sdk as responses_sdk

    def completed(proxy: ProxyServer, name: str, body: dict[str, Any]) -> dict[str, Any]:
        """A streamed answer's response as its ``response.completed`` event has it: the
        client goes on from there."""
        with httpx.stream("POST", proxy.url + "/responses", json={**body, "stream": True},
                          timeout=60, headers={"Authorization": f"Bearer {KEY}",
                                               "X-Session-Id": name}) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    event = orjson.loads(line[len("data: "):])
                    if event.get("type") == "response.completed":
                        return event["response"]  # type: ignore[no-any-return]
        raise AssertionError("the stream ended without response.completed")

    _anchors_late(monkeypatch)
    first: ProxyServer = make_proxy()
    second = ProxyServer(first.settings, first.config).start()
    try:
        upstream.responder = lambda body: {**mixed_answer(body),
                                           "response_id": f"resp_m{len(upstream.requests)}"}
        name = f"replica-chain-{stream}"
        a, b = responses_sdk(first, name), responses_sdk(second, name)
        body = {"model": "gpt-5.1", "input": agent_turns(14, tasks=False),
                "tools": RESPONSE_TOOLS}
        answer = completed(first, name, body) if stream else \
            a.responses.create(**body).model_dump()  # type: ignore[call-overload]
        assert [o["call_id"] for o in answer["output"] if o["type"] == "function_call"] == \
            ["client_1"]
        mine = [{"type": "function_call_output", "call_id": "client_1", "output": "a b"}]
        follow = b.responses.create(model="gpt-5.1", previous_response_id=answer["id"],
                                    input=mine, tools=RESPONSE_TOOLS)  # type: ignore[arg-type]
        assert follow.output_text == "all done"
        sent = upstream.requests[-1]
        assert sent["previous_response_id"] == answer["id"] == "resp_m1"
        outputs = [i for i in sent["input"] if i.get("type") == "function_call_output"]
        assert [i["call_id"] for i in outputs] == ["rc_9", "client_1"]
        assert outputs[0]["output"] == BIG.format(k=1) and sent["input"][-1] == mine[0]
        a.close()
        b.close()
    finally:
        second.stop()


def test_a_large_answer_relayed_as_it_arrives_is_found_on_the_other_replica_at_once(
        make_proxy: Any, upstream: ScriptedUpstream, monkeypatch: pytest.MonkeyPatch) -> None:
    """A client that sends no tools gets a large JSON answer (over 128 KB: relayed as it
    arrives, never held whole) from one replica, then sends its next turn the moment it has
    it — to the other replica, its history trimmed to its last question and that answer
    (what its session is found by) — while every anchor write is BEHIND_WRITE_DELAY_S late.
    Bug class: an answer whose end does not wait for its anchors, on the path that relays
    a large answer as it arrives (``relay._passed_through``): the other replica finds no
    session and begins one of its own (planted, red: the record spawned behind the answer,
    two sessions). One session, every turn in it, in order."""
    import hashlib

    from .conftest import ProxyServer

    _anchors_late(monkeypatch)
    first: ProxyServer = make_proxy(admin_key=ADMIN)
    second = ProxyServer(first.settings, first.config).start()
    try:
        report = "\n".join(f"line {i}: carrier-{i * 7} delivered order #W{i:05d}"
                           for i in range(5_000))  # 212 KB
        upstream.responder = lambda body: {"content": {
            "report every delivery": report, "hello": "Hello, what do you need?"}.get(
                body["messages"][-1]["content"], "noted")}
        key = openai_project_key(44)
        a, b = (openai.OpenAI(base_url=p.url, api_key=key, max_retries=0, timeout=60)
                for p in (first, second))
        system = {"role": "system", "content": "You report deliveries."}
        said = [{"role": "user", "content": t}
                for t in ("hello", "report every delivery", "thanks")]
        full: list[dict[str, Any]] = [system]
        for k, (client, trim) in enumerate(((a, 0), (a, 0), (b, 2))):
            full.append(said[k])
            messages: Any = [system, *full[1 + trim:]]
            got = client.chat.completions.create(model=MODEL, messages=messages)
            full.append(got.choices[0].message.model_dump(exclude_none=True))
        assert full[4]["content"] == report and full[6]["content"] == "noted"
        a.close()
        b.close()
        second.settle()
        views = sessions(first, "pt-" + hashlib.sha256(key.encode()).hexdigest()[:16])
        assert len(views) == 1, list(views)
        (view,) = views.values()
        assert texts(view) == [m["content"] for m in full]
    finally:
        second.stop()
