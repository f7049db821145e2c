"""What each part of a conversation looks like when the window reduces it (pure).

Per message and per run loop: the elision placeholder of a tool result, a tool-call message
with its reasoning and long arguments trimmed, a capped huge result, a past loop as question +
answer + tool ledger, the omission marker and the dropped-steps note — with their token counts
and the prefix sums the window's replay runs on. Derived forms are memoised across requests.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, MutableMapping
from dataclasses import dataclass
from functools import partial
from typing import Any, NamedTuple, Protocol

import orjson

from ..config import Policy
from ..conversation.messages import (
    NOT_JSON,
    REF_CHARS,
    Message,
    content_hash,
    embedded_json,
    message_text,
    text_of,
    tool_calls_of,
)
from ..conversation.runloops import RunLoop, Segmenter, preamble_end
from .digest import Found, found_in, pick
from .names import names
from .shown import Shown

TAG = "[runloop-proxy]"
SUMMARY_HEAD = "Summary of the turns not shown:"
MEMO_SIZE = 50_000
Memo = MutableMapping[tuple[str, ...], Any]
ToolNames = tuple[str, str]  # (recall, search) as the model sees them
DEFAULT_NAMES: ToolNames = ("recall_tool_call", "search_history")
LEDGER_MAX_LINES = 24
LEDGER_INLINE_TOKENS = 16  # a result this small is shown in the ledger itself
DROP_NAMES = 8  # a drop note keeps this many times names_kept of the names it hides


class SessionMemo(MutableMapping[tuple[str, ...], Any]):
    """A process's memo as one session sees it: every key it reads or writes is prefixed by
    the session's scope, so a form cached for one session is never another's, whatever its
    key leaves out (a key that missed a call's arguments showed one tenant's account number
    to another). ``len`` and ``clear`` are the whole memo's (``remember`` empties it whole)."""

    def __init__(self, memo: Memo, scope: str):
        self.memo, self.scope = memo, scope

    def __getitem__(self, key: tuple[str, ...]) -> Any:
        return self.memo[(self.scope, *key)]

    def __setitem__(self, key: tuple[str, ...], value: Any) -> None:
        self.memo[(self.scope, *key)] = value

    def __delitem__(self, key: tuple[str, ...]) -> None:
        del self.memo[(self.scope, *key)]

    def __iter__(self) -> Iterator[tuple[str, ...]]:
        return (k[1:] for k in list(self.memo) if k[:1] == (self.scope,))

    def __len__(self) -> int:
        return len(self.memo)

    def clear(self) -> None:
        self.memo.clear()


def remember(memo: Memo, key: tuple[str, ...], value: Any) -> None:
    """Store in the cross-request memo, emptied whole when full (it only ever caches)."""
    if len(memo) >= MEMO_SIZE:
        memo.clear()
    memo[key] = value


@dataclass(frozen=True)
class Budget:
    hard: int  # what must fit: window - reserved output - tool schemas - margin
    working: int  # what compaction aims at (threshold/target are fractions of it)
    # what ``hard`` was made of, for an error that explains it
    context: int = 0
    reserve: int = 0
    tools: int = 0
    margin: int = 0
    fitting: bool = False  # the model's window bounds ``working``, not the soft budget
    factor: float = 1.0  # the model's tokens per token the proxy counts (calibration)
    known: bool = True  # False: ``context`` is a guess, never a reason to refuse

    @classmethod
    def for_request(cls, policy: Policy, context: int, reserve: int | None, tools: int,
                    factor: float = 1.0, priming: int = 3, known: bool = True) -> Budget:
        """Message budget for a request: the model's window less the reserved output
        (``max_tokens``, else the policy's — at most a quarter of a small window), the tool
        schemas and the margin (at most a sixteenth); ``factor`` converts the model's tokens
        into the counter's (calibration). The working budget is the soft budget less the tool
        schemas, which take at most half of it: a client whose tools alone fill the soft
        budget (Claude Code's take ~15k tokens) would otherwise get a working budget of a
        token, and a compaction event at every request. Where ``context`` is a guess
        (``known`` False) the request's own reserve is held to a quarter of it too: a
        ``max_tokens`` of 128,000 for a model the proxy does not know says nothing about its
        window (it left nothing for the messages, and the proxy refused every request)."""
        out = reserve or min(policy.reserved_output_tokens, context // 4)
        if not known:
            out = min(out, context // 4)
        margin = min(policy.safety_margin_tokens, context // 16)
        hard = int((context - out - margin) / factor) - tools - priming
        working = hard
        if policy.soft_budget_tokens:
            soft = int(policy.soft_budget_tokens / factor)
            working = min(hard, soft - min(tools, soft // 2))
        return cls(hard=max(hard, 0), working=max(working, 1), context=context, reserve=out,
                   tools=tools + priming, margin=margin, fitting=working >= hard,
                   factor=factor, known=known)

    def trigger(self, policy: Policy) -> float:
        """The tokens past which a compaction event fires: ``threshold`` of the working
        budget — at least ``fit_threshold`` of it where the model's window bounds it, since
        there compaction only makes the request fit (a soft budget below the window caps
        cost, and compacting early pays there)."""
        share = policy.threshold
        if self.fitting and policy.fit_threshold is not None:
            share = max(share, policy.fit_threshold)
        return share * self.working

    def explained(self) -> str:
        scale = "" if self.factor == 1.0 else (
            f" (counted as the proxy counts, where the upstream has reported "
            f"{self.factor:.2f} of the model's tokens for each)")
        guess = "" if self.known else " (a guess: the proxy does not know this model's)"
        return (f"the {self.context}-token context{guess} less {self.reserve} reserved for the "
                f"output and {self.margin} of margin leaves {self.hard} for the messages "
                f"beside {self.tools} of tool schemas{scale}")


class Cut(NamedTuple):
    """A text kept to a number of tokens: its head and tail, and the tokens between them."""

    head: str
    tail: str
    elided: int


class TokenOps(Protocol):
    # what counts: two ops of one name count every message and cut every text alike (the
    # memo of derived forms is keyed by it, as a model of another encoding counts otherwise)
    name: str

    def count(self, msg: Message) -> int: ...

    def cut(self, text: str, max_tokens: int) -> Cut | None:
        """``text`` kept to ``max_tokens`` tokens, head and tail; None when it fits."""


class Conversation:
    """Per-message facts the replay needs, and the derived forms, for a conversation that
    grows: ``of`` builds one; ``grow`` extends it in place by a request's new messages, when
    the request holds it whole (same messages, policy, budget and proxy exchanges) — a long
    session's request costs what it adds, not what it holds. It is an append-only log: the
    first request that grows it claims it, and a request holding an older view of it (a
    concurrent one, another branch) gets None and builds its own."""

    def __init__(self, policy: Policy, budget: Budget, ops: TokenOps, protected: frozenset[str],
                 memo: Memo | None, names: ToolNames = DEFAULT_NAMES):
        self.names = names  # the proxy's tools as this request calls them (renamed on a clash)
        self.recall, self.search = names
        self.policy, self.budget, self.ops = policy, budget, ops
        self.memo, self.protected = memo, protected
        self.cap = max(64, int(policy.max_tool_result_share * budget.working))
        # every form memoised across requests is keyed by the whole policy and the counter:
        # a key that named only the fields its form was thought to read kept a reloaded
        # policy's old ``names_kept``; so no field can be left out of one
        self.context = content_hash(f"{policy.model_dump_json()}|{ops.name}".encode())
        self.messages: list[Message] = []
        self.keys: list[str] = []
        self.counts: list[int] = []
        self.total = 0  # of counts: the conversation's tokens as sent
        self.asked: list[int] = []  # request points before n: assistant messages after the preamble
        self.n = 0
        self.pre = 0
        self.seg = Segmenter(0)
        self.loop_of: list[int] = []
        self.refs: list[str] = []
        self._taken: dict[str, str] = {}  # ref -> key (message_refs, incrementally)
        self.tool_names: list[str] = []
        self.tool_args: list[str] = []
        self.full: list[Message] = []  # as shown when not elided (huge results capped)
        self.full_counts: list[int] = []
        self.short: list[Message | None] = []  # elided / trimmed form
        self.saving: list[int] = []
        self.tool_positions: list[int] = []
        self._elidable: set[int] = set()
        # tool exchanges: an assistant message with calls and the results that follow it
        self.group_end: dict[int, int] = {}
        self._pending: dict[str, tuple[str, str]] = {}  # call id -> (tool, arguments)
        self._group = -1
        self.prefix = [0]
        self.sav_prefix = [0]
        self._reduced: dict[int, tuple[list[Message], int, bool]] = {}
        self._answers: dict[int, tuple[Message | None, int]] = {}
        self._marked: dict[tuple[str | None, bool], tuple[list[Message], int]] = {}
        self._names: dict[int, list[str]] = {}  # the names in an agent's message
        self._dropped: dict[int, tuple[int, list[str], set[str]]] = {}  # dropped_names
        self._noted: dict[tuple[int, int], tuple[Message, int]] = {}
        self._found: dict[int, Found] = {}  # a message's identifiers, for digests of spans
        self._lock = threading.Lock()

    @classmethod
    def of(cls, messages: list[Message], keys: list[str], counts: list[int], policy: Policy,
           budget: Budget, ops: TokenOps, protected: frozenset[str], memo: Memo | None,
           names: ToolNames = DEFAULT_NAMES) -> Conversation:
        conv = cls(policy, budget, ops, protected, memo, names)
        conv._extend(messages, keys, counts)
        return conv

    def grow(self, at: int, messages: list[Message], keys: list[str], counts: list[int],
             policy: Policy, budget: Budget, protected: frozenset[str], names: ToolNames,
             ops: TokenOps, memo: Memo | None) -> Conversation | None:
        """This conversation, as it stood with ``at`` messages, grown to hold a request's;
        None when the request does not hold it whole, or the log grew past ``at`` already."""
        if self.budget != budget or self.protected != protected or self.names != names \
                or self.policy != policy or self.ops.name != ops.name or len(keys) < at:
            return None
        with self._lock:
            if self.n != at or keys[:at] != self.keys or counts[:at] != self.counts:
                return None
            self.ops, self.memo = ops, memo
            self._noted = {}
            if self.seg.open is not None:  # the last loop may change: its forms are made anew
                self._reduced.pop(self.seg.open.index, None)
                self._answers.pop(self.seg.open.index, None)
            self._extend(messages[at:], keys[at:], counts[at:])
        return self

    def _extend(self, messages: list[Message], keys: list[str], counts: list[int]) -> None:
        start = self.n
        self.messages += messages
        self.keys += keys
        self.counts += counts
        self.total += sum(counts)
        self.n = len(self.messages)
        if self.pre == start:  # all preamble so far: where it ends may move
            self.pre = preamble_end(self.messages)
            self.seg = Segmenter(self.pre)
            self._marked = {}
            for m in self.messages[start:self.pre]:
                self._add(m)
            start = max(start, self.pre)
            self.loop_of += [0] * (self.pre - len(self.loop_of))
        for i in range(start, self.n):
            self._add(self.messages[i])
        self.pre_tokens = self.prefix[self.pre]
        self.loops: list[RunLoop] = self.seg.loops()

    def _add(self, m: Message) -> None:
        """Derive the facts of the next message (its position: how many came before)."""
        i = len(self.refs)
        key, count, names = self.keys[i], self.counts[i], self.names
        if i >= self.pre:
            self.seg.add(m)
            self.loop_of.append(self.seg.open.index if self.seg.open is not None else 0)
            if i > self.pre and m.get("role") == "assistant":
                self.asked.append(i)
        n = REF_CHARS
        while self._taken.get(key[:n], key) != key and n < len(key):
            n += 2
        self._taken.setdefault(key[:n], key)
        self.refs.append(key[:n])
        self.tool_names.append("")
        self.tool_args.append("")
        self.full.append(m)
        self.full_counts.append(count)
        self.short.append(None)
        self.saving.append(0)
        role = m.get("role")
        if role == "tool":
            cid = m.get("tool_call_id")
            self.tool_names[i], self.tool_args[i] = self._pending.get(str(cid), ("tool", ""))
            if self._group >= 0:
                self.group_end[self._group] = i + 1
            if self.tool_names[i] not in self.policy.exclude_tools and cid not in self.protected:
                cap = self.cap
                if count > cap:
                    capped, c = self._derived(("cap", key, str(cap), self.refs[i], *names),
                                              partial(self._capped, i, cap))
                    self.full[i], self.full_counts[i] = capped, c  # type: ignore[assignment]
                self.tool_positions.append(i)
                self._elidable.add(i)
                ph, c = self._derived(("ph", key, self.refs[i], str(count),
                                       self.tool_names[i], *names),
                                      partial(self._placeholder, i))
                if self.full_counts[i] - c > 0:
                    self.short[i], self.saving[i] = ph, self.full_counts[i] - c
        else:
            self._group = -1
            if role == "assistant":
                for call in tool_calls_of(m):
                    fn = call.get("function") or {}
                    self._pending[call.get("id", "")] = (str(fn.get("name", "")),
                                                         str(fn.get("arguments", "")))
                if m.get("tool_calls"):
                    self._group = i
                    self.group_end[i] = i + 1
                    trimmed, c = self._derived(("trim", key, self.refs[i],
                                                str(self.policy.reasoning_keep_tokens),
                                                str(self.policy.names_kept), *names),
                                               partial(self._trimmed_call, i))
                    if trimmed is not None and count - c > 0:
                        self.short[i], self.saving[i] = trimmed, count - c
        self.prefix.append(self.prefix[-1] + self.full_counts[i])
        self.sav_prefix.append(self.sav_prefix[-1] + self.saving[i])

    def _short_args(self, i: int) -> str:
        """A call's arguments for the ledger: ``key=value`` pairs when they are a flat JSON
        object (cheaper than JSON's quotes and braces), cut at ``ledger_arg_chars``."""
        raw = self.tool_args[i]
        parsed = embedded_json(raw)
        if isinstance(parsed, dict):
            args = ", ".join(f"{k}={v}" if isinstance(v, (str, int, float, bool)) or v is None
                             else f"{k}={orjson.dumps(v).decode()}" for k, v in parsed.items())
        else:
            args = raw
        args = " ".join(args.split())
        limit = self.policy.ledger_arg_chars
        return args if len(args) <= limit else args[: max(0, limit - 1)] + "…"

    def _derived(self, key: tuple[str, ...], make: Callable[[], Message | None]
                 ) -> tuple[Message | None, int]:
        """A derived form of a message and its count, memoised across requests: the same
        message yields the same form, so a long session re-derives only its new messages."""
        def form() -> tuple[Message | None, int]:
            msg = make()
            return msg, self.ops.count(msg) if msg is not None else 0
        return self._memoised(key, form)  # type: ignore[no-any-return]

    def _memoised(self, key: tuple[str, ...], make: Callable[[], Any]) -> Any:
        memo = self.memo
        key = (self.context, *key)
        if memo is not None:
            hit = memo.get(key)
            if hit is not None:
                return hit
        out = make()
        if memo is not None:
            remember(memo, key, out)
        return out

    def _trimmed_call(self, i: int) -> Message | None:
        """An older assistant tool-call message with its reasoning text and long arguments cut
        (head + tail); the arguments stay valid JSON and recall_tool_call gives them back."""
        m = self.messages[i]
        keep = self.policy.reasoning_keep_tokens
        out: dict[str, object] = dict(m)
        changed = False
        if isinstance(m.get("content"), str):
            text = self.shortened(m["content"], keep, i)
            if text != m["content"]:
                out["content"] = text
                changed = True
        calls = []
        for call in m.get("tool_calls") or []:
            fn = call.get("function") or {}
            args = fn.get("arguments")
            if isinstance(args, str) and len(args) > keep:
                short = self._trim_arguments(args, keep, call.get("id", ""))
                if short != args:
                    call = {**call, "function": {**fn, "arguments": short}}
                    changed = True
            calls.append(call)
        out["tool_calls"] = calls
        if changed and self.policy.names_kept:
            shown = message_text(out)  # type: ignore[arg-type]
            kept = self.missing_names([i], shown, self.policy.names_kept)
            if kept:
                out["content"] = f"{text_of(out.get('content'))}\n{TAG} names: " \
                    + " ".join(kept)
        return out if changed else None  # type: ignore[return-value]

    def _placeholder(self, i: int) -> Message:
        text = (f'{TAG} {self.tool_names[i]} result elided ({self.counts[i]} tokens); '
                f'{self.recall}(call_id="{self.refs[i]}") returns it.')
        return {"role": "tool", "tool_call_id": self.messages[i]["tool_call_id"], "content": text}

    def _capped(self, i: int, cap: int) -> Message:
        m = self.messages[i]
        return {**m, "content": self.shortened(text_of(m.get("content")), cap, i)}

    def shortened(self, text: str, max_tokens: int, i: int) -> str:
        """Message ``i``'s ``text`` kept to ``max_tokens`` tokens (head + tail), with a note in
        the middle saying how much was cut and the ref that returns the whole message.
        A cut that elides no more than its note costs is not made: a shortened text is
        never longer than the text (every form the window shows is built from this one)."""
        cut = self.ops.cut(text, max_tokens)
        if cut is None:
            return text
        note = f'\n…[{cut.elided} tokens cut; {self.recall}(call_id="{self.refs[i]}")]…\n'
        if cut.elided <= self._note_tokens(note):
            return text
        return f"{cut.head}{note}{cut.tail}"

    def _note_tokens(self, note: str) -> int:
        """What a cut's note adds to a message."""
        return self.ops.count({"role": "user", "content": note}) \
            - self.ops.count({"role": "user", "content": ""})

    def _trim_arguments(self, args: str, keep: int, call_id: str) -> str:
        """Cut long string values inside JSON arguments; the result still parses as JSON."""
        parsed = embedded_json(args)
        if parsed is NOT_JSON:
            return args
        note = f'…{TAG} arguments cut; {self.recall}(call_id="args:{call_id}") returns them…'

        def cut(v: object) -> object:
            if isinstance(v, str) and len(v) > keep:
                c = self.ops.cut(v, keep)
                return v if c is None else f"{c.head} {note} {c.tail}"
            if isinstance(v, dict):
                return {k: cut(x) for k, x in v.items()}
            if isinstance(v, list):
                return [cut(x) for x in v]
            return v

        out = orjson.dumps(cut(parsed)).decode()
        return out if len(out) < len(args) else args

    # -- past loops in question + answer form -----------------------------------------------

    def reduced(self, j: int) -> tuple[list[Message], int, bool]:
        """Loop ``j`` as its user messages and final reply, capped, with a tool ledger
        (memoised across requests: a closed loop's messages, refs and counts fix its form)."""
        if j not in self._reduced:
            lp = self.loops[j]
            pos = range(lp.start, lp.end)
            # a tool result's ledger line names its call, which may sit outside the loop
            # (a result sent after the loop that made the call closed): keyed by it too
            ident = content_hash("".join(f"{self.keys[i]}{self.refs[i]}{self.counts[i]}"
                                         f"\0{self.tool_names[i]}\0{self.tool_args[i]},"
                                         for i in pos).encode())
            pol = self.policy
            opening = str(self.cap) if j == 0 and pol.keep_opening else ""
            self._reduced[j] = self._memoised(
                ("loop", ident, str(pol.max_message_length), str(pol.ledger_arg_chars),
                 str(bool(pol.summary_model)), opening, *self.names),
                partial(self._reduce, lp))
        return self._reduced[j]

    def answer(self, j: int) -> tuple[Message | None, int]:
        """Loop ``j``'s final reply, capped like a reduced loop's but without the ledger (the
        marker before it points to search_history), and its tokens; None without a reply."""
        if j not in self._answers:
            i = self.loops[j].final_position
            self._answers[j] = (None, 0)
            if i is not None:
                text = message_text(self.messages[i])
                capped = self.shortened(text, self.policy.max_message_length, i)
                if capped == text:
                    self._answers[j] = (self.messages[i], self.counts[i])
                else:
                    msg: Message = {"role": "assistant", "content": capped}
                    self._answers[j] = (msg, self.ops.count(msg))
        return self._answers[j]

    def _reduce(self, lp: RunLoop) -> tuple[list[Message], int, bool]:
        limit = self.policy.max_message_length
        out: list[Message] = []
        changed = len(lp.user_positions) + (lp.final_position is not None) != lp.end - lp.start
        users = list(lp.user_positions)
        ledger = self._ledger(lp)
        opening = set(self.opening()) if lp.index == 0 and self.policy.keep_opening else set()
        for i in users:
            m = self.messages[i]
            text = message_text(m)
            # the opening task stays whole, unless it alone would break the budget
            capped = self.shortened(text, self.cap if i in opening else limit, i)
            if capped == text:
                out.append(m)
            else:
                out.append({**m, "content": capped})
                changed = True
        # The ledger goes with the final reply, not the question: the question then stays
        # byte-identical, so the cached prefix reaches through it when the loop is reduced.
        final_pos = lp.final_position
        if final_pos is not None or ledger:
            m = self.messages[final_pos] if final_pos is not None else {"role": "assistant"}
            text = message_text(m) if final_pos is not None else ""
            capped = self.shortened(text, limit, final_pos) if final_pos is not None else ""
            if ledger:
                capped = f"{capped}\n\n{ledger}" if capped else ledger
            ids = self._digest_ids(lp, [*out, {"role": "assistant", "content": capped}])
            if ids:
                capped = f"{capped}\n{ids}" if capped else ids
            if capped != text or final_pos is None:
                out.append({"role": "assistant", "content": capped})
                changed = True
            else:
                out.append(m)
        tokens = sum(self.counts[i] if i is not None and m is self.messages[i]
                     else self.ops.count(m)
                     for m, i in zip(out, [*users, final_pos], strict=False))
        return out, tokens, changed

    def _digest_ids(self, lp: RunLoop, shown: list[Message]) -> str:
        """With summaries on, the identifiers the loop produced that its reduced form no
        longer shows (the extractive digest of the loop, as a line)."""
        if not self.policy.summary_model:
            return ""
        seen = "\n".join(message_text(m) for m in shown)
        ids = self.identifiers(lp.start, lp.end)
        missing = [x for x in ids if x not in seen]
        return f"{TAG} ids: {' '.join(missing)}" if missing else ""

    def identifiers(self, a: int, b: int) -> list[str]:
        """The identifiers a digest keeps of positions [a, b): each message read once per
        conversation, however many spans (a drop grows one exchange at a time) take it, and a
        tool result only when the cap still needs its identifiers."""
        def found(i: int) -> Found:
            if i not in self._found:
                self._found[i] = found_in(self.messages[i])
            return self._found[i]
        tools = [i for i in range(a, b) if self.messages[i].get("role") == "tool"]
        return pick([found(i) for i in range(a, b) if self.messages[i].get("role") != "tool"],
                    (found(i) for i in tools))

    def _ledger(self, lp: RunLoop) -> str:
        """One line for the loop's tool calls: ref, tool, short arguments and the result's
        size; a result shorter than its ref and size would be is shown inline instead."""
        entries = []
        for i in lp.positions:
            if self.messages[i].get("role") != "tool":
                continue
            call = f"{self.tool_names[i]}({self._short_args(i)})"
            text = message_text(self.messages[i]) \
                if self.counts[i] <= LEDGER_INLINE_TOKENS else None
            if text is not None and len(text) <= 4 * LEDGER_INLINE_TOKENS:
                text = " ".join(text.split())
                entries.append(f"{call} → {text}" if text else call)
            else:
                entries.append(f"{self.refs[i]} {call} {self.counts[i]}t")
        if not entries:
            return ""
        if len(entries) > LEDGER_MAX_LINES:
            head = LEDGER_MAX_LINES // 3
            tail = LEDGER_MAX_LINES - head
            entries = [*entries[:head], f"…{len(entries) - LEDGER_MAX_LINES} more…",
                       *entries[-tail:]]
        return f"{TAG} tools used ({self.recall} takes the id): " + "; ".join(entries)

    def opening(self) -> list[int]:
        """The opening task: the first loop's user messages before its first assistant
        message (the task, and an environment message a client sends with it, such as
        Codex's ``<environment_context>``)."""
        if not self.loops:
            return []
        out = []
        for i in self.loops[0].positions:
            if self.messages[i].get("role") != "user":
                break
            out.append(i)
        return out

    def opened(self) -> tuple[list[Message], int]:
        """The opening task as shown once its loop is omitted, and its tokens: each message
        whole, or cut to the cap a single huge message gets (recallable whole)."""
        out: list[Message] = []
        tokens = 0
        for i in self.opening():
            m = self.messages[i]
            if self.counts[i] <= self.cap:
                out.append(m)
                tokens += self.counts[i]
            else:
                short: Message = {**m, "content": self.shortened(message_text(m), self.cap, i)}
                out.append(short)
                tokens += self.ops.count(short)
        return out, tokens

    def names_of(self, i: int) -> list[str]:
        """The names an agent's message holds (its text and its calls' arguments)."""
        if i not in self._names:
            m = self.messages[i]
            args = " ".join(str((c.get("function") or {}).get("arguments") or "")
                            for c in tool_calls_of(m))
            self._names[i] = names(f"{text_of(m.get('content'))}\n{args}")
        return self._names[i]

    def missing_names(self, positions: range | list[int], shown: str, cap: int) -> list[str]:
        """Up to ``cap`` names the agent's messages at ``positions`` hold that ``shown``
        does not, in order, each once."""
        out: list[str] = []
        seen: set[str] = set()
        has = Shown(shown)
        for i in positions:
            if self.messages[i].get("role") != "assistant":
                continue
            for x in self.names_of(i):
                if x not in seen and x not in has:
                    seen.add(x)
                    out.append(x)
                    if len(out) >= cap:
                        return out
        return out

    def dropped_names(self, at: int, upto: int) -> list[str]:
        """The names the agent's messages in (at, upto) hold that the message at ``at``
        does not, at most ``DROP_NAMES * names_kept`` of them: grown from the last span
        asked for at ``at`` (a drop grows one exchange at a time)."""
        cap = DROP_NAMES * self.policy.names_kept
        done, out, seen = self._dropped.get(at, (at + 1, [], set()))
        if upto < done:
            done, out, seen = at + 1, [], set()
        out, seen = list(out), set(seen)
        host = Shown(message_text(self.messages[at]))
        for i in range(done, upto):
            if len(out) >= cap:
                break
            if self.messages[i].get("role") != "assistant":
                continue
            for x in self.names_of(i):
                if x not in seen and x not in host:
                    seen.add(x)
                    out.append(x)
                    if len(out) >= cap:
                        break
        self._dropped[at] = (max(done, upto), out, seen)
        return out

    def keeps(self, group: int) -> bool:
        """Whether a tool exchange holds a result that is never elided (excluded, or a
        proxy recall): such an exchange is never dropped either."""
        return any(self.messages[i].get("role") == "tool" and i not in self._elidable
                   for i in range(group + 1, self.group_end[group]))

    def shown(self, a: int, b: int) -> int:
        """Tokens of positions [a, b) in their elided form (all of them lie below the
        elision boundary when they are dropped)."""
        return (self.prefix[b] - self.prefix[a]) - (self.sav_prefix[b] - self.sav_prefix[a])

    def noted(self, at: int, upto: int) -> tuple[Message, int]:
        """The user message at ``at`` with a note that the tool exchanges from ``at + 1`` to
        ``upto`` are not shown, and the tokens the note adds."""
        key = (at, upto)
        if key not in self._noted:
            m = self.messages[at]
            steps = [g for g in self.group_end if at < g < upto]
            first = tool_calls_of(self.messages[steps[0]])[0].get("id", "")
            last = tool_calls_of(self.messages[steps[-1]])[-1].get("id", "")
            note = (f"{TAG} The first {len(steps)} tool exchange(s) after this message "
                    f"(calls {first} … {last}) are not shown to save context; "
                    f"{self.search}(query) searches them and {self.recall}(call_id) "
                    f"returns any result.")
            # No identifiers digest here, summaries on or not: summaries stand for omitted
            # loops, and these exchanges are the open loop's (the coding traces' tune half:
            # 6,670 strict tokens for 6 of 30,898 references more in view, 3 fewer plainly).
            if self.policy.names_kept:  # the names the agent wrote in them
                kept = self.dropped_names(at, upto)
                if kept:
                    note += f" Names in them: {' '.join(kept)}"
            new = appended(m, note)
            self._noted[key] = (new, self.ops.count(new) - self.counts[at])
        return self._noted[key]

    def marked_preamble(self, summary: str | None, opening: bool = True
                        ) -> tuple[list[Message], int]:
        """What an omission puts after the system prompt, and the tokens it adds: the opening
        task (with ``opening`` and ``keep_opening``: the first loop's leading user messages,
        which the omission would otherwise hide), then the marker — a note, as the model's
        own (an assistant message), that earlier turns are not shown and how to get them
        back — with the summary of what is omitted after its text. With ``strict_roles``
        the marker and the summary join the client's last system message instead, for chat
        templates that allow one system message, and the opening follows.

        The marker's text reads the same whatever was omitted, and the summary only grows
        after it while it fits: a provider's prefix cache keeps serving what came before.
        Nothing here is a system message of its own, and the opening stands where it stood
        before the omission, right after the system prompt: a provider that renders the
        tool schemas after the system messages (OpenAI's order) keeps them cached at an
        omission, and the opening task is not read again."""
        key = (summary, opening)
        if key not in self._marked:
            text = (f"{TAG} Earlier turns are not shown: {self.search}(query) searches them "
                    f"and {self.recall}(call_id) returns their tool results.")
            if summary:
                text += f"\n{SUMMARY_HEAD}\n{summary}"
            task, task_tokens = self.opened() if opening and self.policy.keep_opening \
                else ([], 0)
            pre = self.messages[: self.pre]
            if self.policy.strict_roles and pre:
                merged = appended(pre[-1], text)
                self._marked[key] = ([*pre[:-1], merged, *task],
                                     self.ops.count(merged) - self.counts[self.pre - 1]
                                     + task_tokens)
            else:
                note: Message = {"role": "system" if self.policy.strict_roles else "assistant",
                                 "content": text}
                self._marked[key] = ([note, *task] if self.policy.strict_roles
                                     else [*pre, *task, note],
                                     self.ops.count(note) + task_tokens)
        return self._marked[key]

    def bridge(self, j: int) -> tuple[list[Message], int]:
        """What shows omitted loop ``j``'s final reply after the marker, and its tokens: the
        reply; with ``strict_roles`` after a user message standing for the turns not shown,
        so the conversation still opens with a user turn and roles alternate."""
        msg, n = self.answer(j)
        if msg is None:
            return [], 0
        if not self.policy.strict_roles:
            return [msg], n
        stub: Message = {"role": "user", "content": f"{TAG} (earlier turns not shown)"}
        return [stub, msg], n + self.ops.count(stub)


def appended(m: Message, text: str) -> Message:
    """``m`` with a paragraph of proxy text at the end of its content (a text part when the
    content is a list of parts): the message's own text stays a prefix of the new one."""
    content = m.get("content")
    if isinstance(content, list):
        return {**m, "content": [*content, {"type": "text", "text": text}]}
    return {**m, "content": f"{text_of(content)}\n\n{text}"}
