"""`runloop-proxy replay FILE.jsonl`: what the window saves on recorded conversations.

It reads the conversations (chat or Responses), optionally one half of them (``--half``: a
fixed hash of each conversation's id, so that defaults chosen on one half are checked on the
other), and for every assistant turn builds the window the proxy would send
(``replay_offline``) — or, with ``--proxy URL``, sends each request through a running proxy
(``HttpReplay``), and with ``--direct URL`` straight to the upstream as well, to price both
sides by the upstream's own cached tokens. ``replay_tally`` adds the figures up,
``replay_report`` prints them, ``pricing`` bills them as a provider would.
"""

from __future__ import annotations

import argparse
import hashlib
import sys
import time
from importlib import resources
from pathlib import Path
from typing import Any

import orjson
from pydantic import ValidationError

from .. import savings
from ..api.chat import json_kind, validate_chat_request
from ..api.messages import validate_messages_request
from ..api.responses import validate_responses_request
from ..config import Policy, Settings, TenantSpec, load_config, passthrough_tenant
from ..conversation import blocks
from ..conversation.items import to_items, to_messages, tool_to_chat
from ..conversation.messages import Message, content_hash
from ..errors import ConfigError, InvalidRequest
from ..pipeline.accounting import prompt_usage
from ..pricing import PriceTable, Provider
from ..window.builder import Window
from .replay_judge import (
    Judge,
    JudgeError,
    agreement,
    baseline_points,
    judge_format,
    own_agreement,
    progress,
    report_lines,
    sample_points,
)
from .replay_offline import CACHED_PRICE, Replayer
from .replay_report import Run, as_json, report
from .replay_tally import SEPARATE, Tally

HALVES = ("tune", "holdout")
POINTS_WAIT_S = 10.0  # a proxy writes a session's points behind its answers
DEFAULT_MODELS = {"openai": "gpt-4o", "anthropic": "claude-sonnet-4"}

class HttpReplay:
    """Every request point sent through a running proxy, in one proxy session per conversation.

    Raw sizes come from the proxy's ``X-Runloop-Tokens`` header (the whole prompt as sent and as
    forwarded, counted as the offline replay counts). The headline is priced as the inspector
    prices it, from the points the proxy stored for each session (``savings.of_points``: what
    each prompt shares with the last, its head, the proxy's own breakpoints), read with the
    admin key; without one it is not given. With ``direct`` each request also goes
    straight to the upstream, and both sides are measured by the upstream's own usage: prompt
    tokens and the cached tokens its prefix cache served (the cache-aware cost). The scripted
    upstream keeps the two sides' caches apart (``X-Scripted-Cache-Scope``, which real
    upstreams ignore); a real provider caches per organization, so there the side sent second
    may be served prefixes the first one cached (the system prompt and tools mostly).
    """

    def __init__(self, args: argparse.Namespace, replayer: Replayer):
        import httpx

        self.model, self.context = args.model, replayer.context
        self.replayer = replayer  # counts what a rejected request held
        self.run = f"replay-{time.time_ns()}"
        self.proxy = httpx.Client(base_url=args.proxy.rstrip("/"), timeout=120,
                                  headers=_bearer(args.api_key))
        self.direct = httpx.Client(base_url=args.direct.rstrip("/"), timeout=120,
                                   headers=_bearer(args.direct_key)) if args.direct else None
        self.cached = 0  # upstream-reported cached tokens, both sides
        key = getattr(args, "admin_key", None)
        self.admin = httpx.Client(base_url=args.proxy.rstrip("/"), timeout=60,
                                  headers=_bearer(key)) if key else None

    def summary_tokens(self) -> int:
        """What the proxy's summary calls have used so far (its /metrics), to net them out."""
        try:
            text = self.proxy.get("/metrics").text
        except Exception:  # noqa: BLE001 - a proxy without /metrics: nothing to net out
            return 0
        return int(sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                       if line.startswith("runloop_summary_tokens_total{")))

    def close(self) -> None:
        self.proxy.close()
        if self.admin is not None:
            self.admin.close()
        if self.direct is not None:
            self.direct.close()

    def conversation(self, conv: dict[str, Any], idx: int, tally: Tally) -> None:
        try:
            self._requests(conv, idx, tally)
        finally:
            tally.savings = savings.Savings(tally.requests, tally.client, tally.forwarded)
        if self.admin is not None:
            tally.savings = savings.priced(self._points(idx, tally.requests - tally.rejected),
                                           self.replayer.meter())

    def _points(self, idx: int, answered: int) -> list[dict[str, Any]]:
        """The points the proxy stored for conversation ``idx``'s session, once all
        ``answered`` are written (they are written behind the answers)."""
        deadline = time.monotonic() + POINTS_WAIT_S
        while True:
            r = self.admin.get(f"/admin/sessions/{self.run}-{idx}",  # type: ignore[union-attr]
                               params={"points": "1"})
            if r.status_code != 200 and r.status_code != 404:
                raise ReplayError(f"conversation {idx}: the proxy's admin API answered "
                                  f"{r.status_code} {r.text[:200]}")
            points = r.json().get("points") or [] if r.status_code == 200 else []
            if len(points) >= answered or time.monotonic() > deadline:
                return list(points)
            time.sleep(0.05)

    def _requests(self, conv: dict[str, Any], idx: int, tally: Tally) -> None:
        messages = conv["messages"]
        for i in range(1, len(messages)):
            if messages[i].get("role") != "assistant":
                continue
            path, body = _request(self.model, conv, messages[:i])
            payload = orjson.dumps(body)
            r = _post(self.proxy, "proxy", "/v1" + path, payload, {
                "X-Session-Id": f"{self.run}-{idx}", "Content-Type": "application/json",
                "X-Scripted-Cache-Scope": f"{self.run}-proxy"})
            tally.requests += 1
            header = r.headers.get("x-runloop-tokens")
            if r.status_code == 400 and "context_length_exceeded" in r.text:
                # refused, nothing forwarded: counted as sent, over the limit on both sides
                client = self.replayer.client_prompt(messages[:i], conv.get("tools"))
                tally.rejected += 1
                tally.client += client
                tally.forwarded += client
                tally.over_client += 1
                tally.over_forwarded += 1
                continue
            if r.status_code != 200 or not header:
                raise ReplayError(f"conversation {idx}, request {tally.requests}: the proxy "
                                  f"answered {r.status_code} {r.text[:200]}")
            client, forwarded = map(int, header.split(";"))
            tally.client += client
            tally.forwarded += forwarded
            tally.over_client += client > self.context
            tally.over_forwarded += forwarded > self.context
            if self.direct is None:
                continue
            d = _post(self.direct, "upstream", path, payload, {
                "Content-Type": "application/json", "X-Scripted-Cache-Scope": f"{self.run}-direct"})
            if d.status_code != 200:
                raise ReplayError(f"conversation {idx}: the upstream answered "
                                  f"{d.status_code} {d.text[:200]}")
            cu, fu = d.json().get("usage") or {}, r.json().get("usage") or {}
            tally.charge(SEPARATE, self._cost(cu, client), self._cost(fu, forwarded))
            if self.replayer.price is not None:
                tally.money[0] += sum(self.replayer.price.usage_cost(cu).values())
                tally.money[1] += sum(self.replayer.price.usage_cost(fu).values())

    def _cost(self, usage: dict[str, Any], tokens: int) -> float:
        """``tokens`` priced with the share of the prompt the upstream served from its cache
        (the upstream may count with another tokenizer: its share carries over, not its
        numbers)."""
        prompt, cached = prompt_usage(usage)  # Anthropic's reads and writes included
        self.cached += cached
        share = cached / prompt if prompt else 0.0
        return tokens * (1 - share) + CACHED_PRICE * tokens * share


class ReplayError(Exception):
    pass


class BadOption(Exception):
    """An option the replay cannot run with (a tenant the config has not, a --set it
    refuses), said in one line."""


class Unreachable(ReplayError):
    """Nothing answered at the proxy's (or the upstream's) address."""


def _post(client: Any, what: str, path: str, payload: bytes, headers: dict[str, str]) -> Any:
    """``client.post``, a transport failure said as such (not httpx's traceback)."""
    import httpx

    try:
        return client.post(path, content=payload, headers=headers)
    except httpx.TransportError as exc:
        raise Unreachable(f"cannot reach the {what} at {client.base_url}: "
                          f"{exc or type(exc).__name__}") from exc


def conversation_of(line: Any) -> dict[str, Any] | None:
    """A recorded conversation as the replay reads it: chat-shaped messages and tools. A
    Responses conversation (``input`` items, ``instructions``) becomes the conversation model
    the proxy builds from it, and keeps its own form for a replay through a proxy."""
    if not isinstance(line, dict):
        return None
    if isinstance(line.get("messages"), list) and _is_messages_api(line):
        tools = [t for t in line.get("tools") or [] if isinstance(t, dict)]
        return {**{k: v for k, v in line.items() if k not in ("messages", "system", "tools")},
                "messages": blocks.to_messages(line["messages"], line.get("system")),
                "tools": [blocks.tool_to_chat(t) for t in tools], "anthropic": tools}
    if isinstance(line.get("messages"), list):
        return line
    if not isinstance(line.get("input"), list):
        return None
    tools = [t for t in line.get("tools") or [] if isinstance(t, dict)]
    return {"messages": to_messages(line["input"], line.get("instructions")),
            "tools": [tool_to_chat(t) for t in tools], "responses_tools": tools}


def _is_messages_api(line: dict[str, Any]) -> bool:
    """A conversation recorded in Anthropic's Messages format: a top-level ``system``, tools
    with an ``input_schema``, or tool_use / tool_result blocks."""
    if line.get("format") == "anthropic" or "system" in line:
        return True
    if any(isinstance(t, dict) and "input_schema" in t for t in line.get("tools") or []):
        return True
    return any(isinstance(b, dict) and b.get("type") in ("tool_use", "tool_result")
               for m in line["messages"] if isinstance(m, dict)
               and isinstance(m.get("content"), list) for b in m["content"])


def _request(model: str, conv: dict[str, Any], messages: list[Message]
             ) -> tuple[str, dict[str, Any]]:
    """The path and body of the request a client sent at this point of the conversation."""
    if "anthropic" in conv:
        system, turns = blocks.to_anthropic(messages)
        request: dict[str, Any] = {"model": model, "max_tokens": 1, "messages": turns,
                                   **({"system": system} if system is not None else {}),
                                   **({"tools": conv["anthropic"]} if conv["anthropic"] else {})}
        return "/messages", request
    if "responses_tools" in conv:
        instructions, items = to_items(messages)
        body: dict[str, Any] = {"model": model, "input": items, "max_output_tokens": 16}
        if instructions is not None:
            body["instructions"] = instructions
        if conv["responses_tools"]:
            body["tools"] = conv["responses_tools"]
        return "/responses", body
    body = {"model": model, "messages": messages, "max_tokens": 1}
    if conv.get("tools"):
        body["tools"] = conv["tools"]
    return "/chat/completions", body


def half_of(conv: dict[str, Any]) -> str:
    """Which half of a trace a conversation falls in, ``tune`` or ``holdout``: a fixed hash of
    its id (of its opening messages when it has none), so the halves never move."""
    ident = conv.get("id")
    if not isinstance(ident, str) or not ident:
        ident = content_hash(orjson.dumps(conv["messages"][:2]))
    return HALVES[hashlib.sha256(ident.encode()).digest()[0] & 1]


def _bearer(key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"} if key else {}


def _progress(done: int, total: int, started: float, enabled: bool) -> None:
    if not enabled:
        return
    width = 30
    filled = int(width * done / max(total, 1))
    rate = done / max(time.monotonic() - started, 1e-9)
    sys.stderr.write(f"\r[{'#' * filled}{'.' * (width - filled)}] {done}/{total} "
                     f"conversations ({rate:.1f}/s)")
    if done == total:
        sys.stderr.write("\n")
    sys.stderr.flush()


def _tenant(args: argparse.Namespace) -> TenantSpec:
    if not args.config:
        tenant = passthrough_tenant(Settings(context_window=args.context))
    else:
        config = load_config(Settings(config_dir=args.config, upstream="http://unused"),
                             secrets=False)  # the replay reads policies, never keys
        if args.tenant and args.tenant not in config.tenants:
            raise BadOption(f"no tenant {args.tenant!r} in {args.config} "
                            f"({', '.join(sorted(config.tenants)) or 'it has none'})")
        tenant = config.tenants[args.tenant] if args.tenant else \
            config.passthrough or next(iter(config.tenants.values()))
    overrides: dict[str, Any] = {}
    for item in args.set or []:
        name, sep, value = item.partition("=")
        if not sep:
            raise BadOption(f"--set {item}: expected FIELD=VALUE")
        overrides[name] = _set_value(value)
    if overrides:
        try:
            policy = Policy.model_validate({**tenant.policy.model_dump(), **overrides})
        except ValidationError as exc:
            raise BadOption("; ".join(
                f"--set {'.'.join(map(str, e['loc']))}: "
                + ("no such policy field" if e["type"] == "extra_forbidden" else e["msg"])
                for e in exc.errors())) from exc
        tenant = tenant.model_copy(update={"policy": policy})
    return tenant


def _set_value(text: str) -> Any:
    """A ``--set`` value: JSON when it reads as JSON (a number, true/false, null, a list),
    else the text itself (a name: ``always``, ``none``, ``gpt-4o``); pydantic then says
    whether the field takes it."""
    try:
        return orjson.loads(text)
    except orjson.JSONDecodeError:
        return text


def _pricing(args: argparse.Namespace) -> tuple[Provider | None, str]:
    """The provider whose bill the replay shows, and the model: ``--provider`` (its default
    model unless ``--model`` names one), else the provider whose table has the model."""
    table = PriceTable.load(args.prices)
    if args.provider:
        provider = table.provider(args.provider)
        model = args.model or DEFAULT_MODELS[args.provider]
        if provider.price(model) is None:
            raise ConfigError("--model", model, f"no {args.provider} price for it (known: "
                                                f"{', '.join(sorted(provider.models))})")
        return provider, model
    model = args.model or DEFAULT_MODELS["openai"]
    return next((p for p in table.providers.values() if p.price(model) is not None),
                None), model


def _read(path: Path) -> list[tuple[int, dict[str, Any]]] | str:
    """The conversations of a file with their line numbers, or why they cannot be read: the
    first malformed line as ``FILE:LINE: why`` (one line, never a traceback)."""
    try:
        lines = path.read_bytes().splitlines()
    except OSError as exc:
        return f"cannot read {path}: {exc.strerror}"
    convs = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            conv = read_line(line)
        except LineProblem as exc:
            return f"{path}:{n}: {exc}"
        convs.append((n, conv))
    return convs


class LineProblem(Exception):
    """Why a line of a trace is not a conversation the replay can read."""


# what the replay reads of a line besides its turns and tools, and the JSON types each takes
_FIELDS = {"tools": (list,), "system": (str, list), "instructions": (str,), "format": (str,),
           "id": (str, int), "meta": (dict,)}


def read_line(raw: bytes) -> dict[str, Any]:
    """A trace's line as the conversation the replay reads, or LineProblem: not JSON, not a
    conversation, a field of the wrong type — each of its turns, items, blocks and tools
    checked as the API the line records checks a request (so what the replay goes on to
    read is what the proxy itself accepts)."""
    try:
        line = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise LineProblem(f"not JSON: {exc}") from None
    if not isinstance(line, dict) or not (isinstance(line.get("messages"), list)
                                          or isinstance(line.get("input"), list)):
        raise LineProblem("expected an object with a 'messages' array (chat) or an 'input' "
                          "array (Responses)")
    for name, kinds in _FIELDS.items():
        if line.get(name) is not None and (not isinstance(line[name], kinds)
                                           or isinstance(line[name], bool)):
            raise LineProblem(f"{name}: expected {' or '.join(_KIND[k] for k in kinds)}, "
                              f"not {json_kind(line[name])}")
    request: dict[str, Any] = {k: v for k, v in line.items()
                               if k in ("messages", "input", "system", "instructions", "tools")
                               and v is not None}
    try:
        if not request.get("messages", request.get("input")):
            pass  # an empty conversation: nothing to check, nothing to replay
        elif "messages" in request and _is_messages_api(line):
            validate_messages_request({**request, "model": "replay"}, counting=True)
        elif "messages" in request:
            validate_chat_request({k: v for k, v in request.items()
                                   if k in ("messages", "tools")} | {"model": "replay"})
        else:
            validate_responses_request({k: v for k, v in request.items() if k in (
                "input", "instructions", "tools")} | {"model": "replay"})
        conv = conversation_of(line)
    except InvalidRequest as exc:
        raise LineProblem(str(exc)) from None
    except (TypeError, ValueError, KeyError, AttributeError, RecursionError) as exc:
        # what the API's checks let through and the conversion cannot take: said, not raised
        raise LineProblem(f"cannot be read as a conversation ({type(exc).__name__}: "
                          f"{str(exc)[:200]})") from None
    if conv is None:
        raise LineProblem("expected an object with a 'messages' array (chat) or an 'input' "
                          "array (Responses)")
    return conv


_KIND = {list: "an array", str: "a string", dict: "an object", int: "a number"}


SAMPLE = "samples/support_agent.jsonl"  # the demo's session (tests/test_savings.py)
SAMPLE_MODEL = "gpt-4o-mini"  # the demo's
SAMPLE_POLICY = "summary_model=extractive"  # the demo's


def run_replay(args: argparse.Namespace) -> int:
    if args.sample == bool(args.file):
        print("replay: give a FILE of conversations, or --sample (not both)", file=sys.stderr)
        return 2
    if args.sample:
        args.model = args.model or SAMPLE_MODEL
        args.set = [SAMPLE_POLICY, *(args.set or [])]
    path = Path(args.file) if args.file else \
        Path(str(resources.files("runloop_proxy").joinpath(SAMPLE)))
    lines = _read(path)
    if isinstance(lines, str):
        print(lines, file=sys.stderr)
        return 2
    at = {id(conv): n for n, conv in lines}
    convs = [conv for _, conv in lines]
    if args.half:
        convs = [c for c in convs if half_of(c) == args.half]
    if args.limit:
        convs = convs[: args.limit]
    try:
        tenant = _tenant(args)
        provider, model = _pricing(args)
    except BadOption as exc:
        print(exc, file=sys.stderr)
        return 2
    except (ConfigError, KeyError) as exc:
        print(f"config: {exc}", file=sys.stderr)
        return 2
    args.model = model
    if args.direct and not args.proxy:
        print("--direct compares against a proxy: give --proxy as well", file=sys.stderr)
        return 2
    judge_args = getattr(args, "judge_upstream", None)
    if judge_args and (args.proxy or not args.judge_model):
        print("--judge-upstream replays offline and needs --judge-model", file=sys.stderr)
        return 2
    tally = Tally()
    replayer = Replayer(tenant, model, args.context, args.summary_cost, provider)
    judged: list[dict[str, Any]] = []
    judge = Judge(judge_args, args.judge_model, args.judge_key,
                  Path(args.judge_output) if args.judge_output else None,
                  fmt=judge_format(judge_args, getattr(args, "judge_format", None))) \
        if judge_args else None
    points = sample_points(convs, args.judge_sample, args.judge_seed) if judge else set()
    twice = baseline_points(points, getattr(args, "judge_baseline", 0), args.judge_seed) \
        if judge else set()
    http = HttpReplay(args, replayer) if args.proxy else None
    summary_before = http.summary_tokens() if http is not None else 0
    show = not args.no_progress and not args.json and sys.stderr.isatty()
    started = time.monotonic()
    try:
        for k, conv in enumerate(convs):
            one = Tally()
            try:
                if http is not None:
                    http.conversation(conv, k, one)
                elif judge is not None:
                    def seen(i: int, req: list[Message], window: Window,
                             k: int = k, conv: dict[str, Any] = conv) -> None:
                        if (k, i) in points and judge is not None:
                            judged.append(judge.judge(
                                f"{conv.get('id') or k}:{i}", req, window,
                                conv.get("tools") or None,
                                tenant.policy.shadow_text_threshold, (k, i) in twice))
                            if show or not args.json:
                                progress(len(judged), len(points))
                    replayer.conversation(conv, one, seen)
                else:
                    replayer.conversation(conv, one)
            except (TypeError, ValueError, KeyError, AttributeError, IndexError) as exc:
                # a line the checks above let through and the replay cannot take: named by
                # its place, as a malformed line is, never a traceback
                print(f"{path}:{at[id(conv)]}: cannot be replayed ({type(exc).__name__}: "
                      f"{str(exc)[:200]})", file=sys.stderr)
                return 2
            meta = conv.get("meta")
            domain = meta.get("domain") if isinstance(meta, dict) else None
            tally.add(one, str(conv.get("id") or k), str(domain or ""))
            _progress(k + 1, len(convs), started, show)
    except Unreachable as exc:
        print(exc, file=sys.stderr)
        return 1
    except (ReplayError, JudgeError, OSError) as exc:
        print(f"replay stopped: {exc}", file=sys.stderr)
        return 1
    finally:
        if judge is not None:
            judge.close()
        if http is not None:
            # the proxy's summary calls, by the upstream's usage, count as forwarded: net
            spent = http.summary_tokens() - summary_before
            tally.summary_tokens += spent
            tally.spend(spent)
            http.close()
    if http is not None and http.admin is None:
        print("replay: through a proxy the headline is priced from the points it stores: "
              "give --admin-key (or RUNLOOP_ADMIN_KEY) for it", file=sys.stderr)
    # through a proxy, a cache-aware cost needs the upstream's word on both sides
    measured = http is None or (http.direct is not None and http.cached > 0)
    run = Run(path, len(convs), model, replayer, tenant.policy, provider, args.half,
              http is not None, measured, round(time.monotonic() - started, 2))
    by_lever = agreement(judged) if judge is not None else None
    own = own_agreement(judged)
    if args.json:
        data = as_json(run, tally)
        if by_lever is not None:
            data["judge"] = {"model": args.judge_model, "by_lever": by_lever, "own": own}
        print(orjson.dumps(data, option=orjson.OPT_INDENT_2).decode())
    else:
        print("\n".join(report(run, tally, args.worst)))
        if by_lever is not None:
            print("\n".join(report_lines(by_lever, args.judge_model, own)))
    return 0
