"""The window builder (pure): which messages go to the LLM, under the token budget.

Levers, cheapest first: past run loops reduced to question + answer (+ a ledger of their tool
calls); inside the open loop, older tool results elided and older reasoning trimmed, in batches;
oldest loops omitted behind a marker; at the hard limit, everything elidable elided and the
oldest tool exchanges dropped, else the request is refused.

Prefix caches must keep hitting, so the window is append-only between compaction events. The
builder gets there without state: it replays the conversation's request points (every position
where the client asked the model for the next assistant message) and applies the same rules at
each, so the elision boundary a request sees is the one earlier requests saw, and it moves only
when a threshold is crossed — by at least ``clear_at_least`` tokens and down to ``target``.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, MutableMapping
from dataclasses import dataclass, field
from enum import StrEnum
from functools import partial
from typing import Protocol

import orjson

from .config import Policy, ReducePastLoops
from .messages import Message, message_text, text_of, tool_calls_of
from .runloops import RunLoop, preamble_end, segment

TAG = "[runloop-proxy]"
MEMO_SIZE = 200_000
Memo = MutableMapping[tuple[str, ...], tuple["Message | None", int]]
LEDGER_MAX_LINES = 24


class TokenOps(Protocol):
    def count(self, msg: Message) -> int: ...

    def truncate(self, text: str, max_tokens: int) -> str: ...


class CompactionKind(StrEnum):
    PAST_LOOPS = "past_loop_reduction"
    ELISION = "in_loop_elision"
    OMISSION = "loop_omission"
    DROP = "in_loop_drop"
    TRUNCATION = "hard_truncation"
    SUMMARY = "summary"
    REJECTION = "rejection"


@dataclass(frozen=True)
class Budget:
    hard: int  # what must fit: window - reserved output - tool schemas - margin
    working: int  # what compaction aims at (threshold/target are fractions of it)

    @classmethod
    def for_request(cls, policy: Policy, context: int, reserve: int | None, tools: int,
                    factor: float = 1.0, priming: int = 3) -> Budget:
        """Message budget for a request: the model's window less the reserved output
        (``max_tokens``, else the policy's), the tool schemas and the margin; ``factor``
        converts the model's tokens into the counter's (calibration)."""
        out = reserve or policy.reserved_output_tokens
        hard = int((context - out - policy.safety_margin_tokens) / factor) - tools - priming
        working = hard
        if policy.soft_budget_tokens:
            working = min(hard, int(policy.soft_budget_tokens / factor) - tools)
        return cls(hard=max(hard, 0), working=max(working, 1))


@dataclass(frozen=True)
class Elided:
    ref: str
    call_id: str
    tool: str
    tokens: int
    position: int


@dataclass(frozen=True)
class Event:
    kind: CompactionKind
    tokens_before: int
    tokens_after: int
    reason: str


@dataclass(frozen=True)
class Window:
    messages: list[Message]
    changed: bool
    fits: bool
    tokens_in: int
    tokens_out: int
    elided: tuple[Elided, ...] = ()
    reduced_loops: int = 0
    omitted_loops: int = 0
    events: tuple[Event, ...] = ()

    @property
    def needs_tools(self) -> bool:
        return self.changed


@dataclass
class _Plan:
    reduced_upto: int = 0  # loops below are in question+answer form
    omit_upto: int = 0  # loops below are not shown
    elide_upto: int = 0  # tool results / reasoning below this position are elided
    drop_from: int = 0  # whole tool exchanges in [drop_from, drop_upto) are not shown
    drop_upto: int = 0
    events: list[Event] = field(default_factory=list)


class _Conversation:
    """Per-message facts the replay needs, computed once per build (O(n))."""

    def __init__(self, messages: list[Message], keys: list[str], counts: list[int],
                 policy: Policy, budget: Budget, ops: TokenOps, protected: frozenset[str],
                 memo: Memo | None):
        self.messages, self.keys, self.counts = messages, keys, counts
        self.policy, self.budget, self.ops = policy, budget, ops
        self.memo = memo
        self.n = len(messages)
        self.pre = preamble_end(messages)
        self.loops = segment(messages)
        self.loop_of = [0] * self.n
        for lp in self.loops:
            for i in lp.positions:
                self.loop_of[i] = lp.index
        self.tool_names, self.tool_args = self._tool_names()
        self.refs = self._refs()
        cap = max(64, int(policy.max_tool_result_share * budget.working))
        self.full: list[Message] = list(messages)  # as shown when not elided (huge ones capped)
        self.full_counts = list(counts)
        self.short: list[Message | None] = [None] * self.n  # elided / trimmed form
        self.saving = [0] * self.n
        self.tool_positions: list[int] = []
        for i, m in enumerate(messages):
            role = m.get("role")
            if role == "tool":
                if self.tool_names[i] in policy.exclude_tools or \
                        m.get("tool_call_id") in protected:
                    continue  # kept whole: only the hard limit may touch them
                if counts[i] > cap:
                    capped, n = self._derived(("cap", keys[i], str(cap), self.refs[i]),
                                              partial(self._capped, i, cap))
                    self.full[i], self.full_counts[i] = capped, n  # type: ignore[assignment]
                self.tool_positions.append(i)
                ph, n = self._derived(("ph", keys[i], self.refs[i], str(self.full_counts[i])),
                                      partial(self._placeholder, i))
                if self.full_counts[i] - n > 0:
                    self.short[i], self.saving[i] = ph, self.full_counts[i] - n
            elif role == "assistant" and m.get("tool_calls"):
                trimmed, n = self._derived(("trim", keys[i], str(policy.reasoning_keep_tokens)),
                                           partial(self._trimmed_call, i))
                if trimmed is not None and counts[i] - n > 0:
                    self.short[i], self.saving[i] = trimmed, counts[i] - n
        self.prefix = [0] * (self.n + 1)
        self.sav_prefix = [0] * (self.n + 1)
        for i in range(self.n):
            self.prefix[i + 1] = self.prefix[i] + self.full_counts[i]
            self.sav_prefix[i + 1] = self.sav_prefix[i] + self.saving[i]
        self.pre_tokens = self.prefix[self.pre]
        self._reduced: dict[int, tuple[list[Message], int, bool]] = {}
        # tool exchanges: an assistant message with calls and the results that follow it
        self.group_end: dict[int, int] = {}
        i = 0
        while i < self.n:
            if messages[i].get("role") == "assistant" and messages[i].get("tool_calls"):
                j = i + 1
                while j < self.n and messages[j].get("role") == "tool":
                    j += 1
                self.group_end[i] = j
                i = j
            else:
                i += 1
        self._noted: dict[tuple[int, int], tuple[Message, int]] = {}
        self._elidable = frozenset(self.tool_positions)

    def _tool_names(self) -> tuple[list[str], list[str]]:
        names, args = [""] * self.n, [""] * self.n
        pending: dict[str, tuple[str, str]] = {}
        for i, m in enumerate(self.messages):
            if m.get("role") == "assistant":
                for c in tool_calls_of(m):
                    fn = c.get("function") or {}
                    pending[c.get("id", "")] = (str(fn.get("name", "")),
                                                str(fn.get("arguments", "")))
            elif m.get("role") == "tool":
                names[i], args[i] = pending.get(str(m.get("tool_call_id", "")), ("tool", ""))
        return names, args

    def _refs(self) -> list[str]:
        """What recall_tool_call takes for each result: the call id, or for a call id the
        conversation already used, the id plus a content hash. Fixed once a result exists,
        so later reuse of an id never rewrites earlier notes (append-only)."""
        seen: set[str] = set()
        refs = [""] * self.n
        for i, m in enumerate(self.messages):
            if m.get("role") == "tool":
                cid = str(m.get("tool_call_id", ""))
                refs[i] = cid if cid not in seen else f"{cid}#{self.keys[i][:8]}"
                seen.add(cid)
        return refs

    def _short_args(self, i: int) -> str:
        args = " ".join(self.tool_args[i].split())
        limit = self.policy.ledger_arg_chars
        return args if len(args) <= limit else args[: max(0, limit - 1)] + "…"

    def _derived(self, key: tuple[str, ...], make: Callable[[], Message | None]
                 ) -> tuple[Message | None, int]:
        """A derived form of a message and its count, memoised across requests: the same
        message yields the same form, so a long session re-derives only its new messages."""
        memo = self.memo
        if memo is not None:
            hit = memo.get(key)
            if hit is not None:
                return hit
        msg = make()
        out = (msg, self.ops.count(msg) if msg is not None else 0)
        if memo is not None:
            if len(memo) >= MEMO_SIZE:
                memo.clear()
            memo[key] = out
        return out

    def _trimmed_call(self, i: int) -> Message | None:
        """An older assistant tool-call message with its reasoning text and long arguments cut
        (head + tail); the arguments stay valid JSON and recall_tool_call gives them back."""
        m = self.messages[i]
        keep = self.policy.reasoning_keep_tokens
        out: dict[str, object] = dict(m)
        changed = False
        if isinstance(m.get("content"), str):
            text = self.ops.truncate(m["content"], keep)
            if text != m["content"]:
                out["content"] = text
                changed = True
        calls = []
        for call in m.get("tool_calls") or []:
            fn = call.get("function") or {}
            args = fn.get("arguments")
            if isinstance(args, str) and len(args) > keep:
                short = _trim_arguments(args, keep, call.get("id", ""), self.ops)
                if short != args:
                    call = {**call, "function": {**fn, "arguments": short}}
                    changed = True
            calls.append(call)
        out["tool_calls"] = calls
        return out if changed else None  # type: ignore[return-value]

    def _placeholder(self, i: int) -> Message:
        text = (f'{TAG} {self.full_counts[i]}-token result elided; '
                f'recall_tool_call(call_id="{self.refs[i]}") returns it.')
        return {"role": "tool", "tool_call_id": self.messages[i]["tool_call_id"], "content": text}

    def _capped(self, i: int, cap: int) -> Message:
        m = self.messages[i]
        text = self.ops.truncate(text_of(m.get("content")), cap)
        note = (f"\n{TAG} Result truncated from {self.counts[i]} tokens; "
                f'recall_tool_call(call_id="{self.refs[i]}") returns it in full.')
        return {**m, "content": text + note}

    # -- past loops in question + answer form -----------------------------------------------

    def reduced(self, j: int) -> tuple[list[Message], int, bool]:
        """Loop ``j`` as its user messages and final reply, capped, with a tool ledger."""
        if j in self._reduced:
            return self._reduced[j]
        lp = self.loops[j]
        limit = self.policy.max_message_length
        out: list[Message] = []
        changed = len(lp.user_positions) + (lp.final_position is not None) != lp.end - lp.start
        users = list(lp.user_positions)
        ledger = self._ledger(lp)
        for i in users:
            m = self.messages[i]
            text = message_text(m)
            capped = self.ops.truncate(text, limit)
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
            capped = self.ops.truncate(text, limit)
            if ledger:
                capped = f"{capped}\n\n{ledger}" if capped else ledger
            if capped != text or final_pos is None:
                out.append({"role": "assistant", "content": capped})
                changed = True
            else:
                out.append(m)
        tokens = sum(self.counts[i] if i is not None and m is self.messages[i]
                     else self.ops.count(m)
                     for m, i in zip(out, [*users, final_pos], strict=False))
        self._reduced[j] = (out, tokens, changed)
        return self._reduced[j]

    def _ledger(self, lp: RunLoop) -> str:
        entries = [f"{self.refs[i]} {self.tool_names[i]}({self._short_args(i)}) "
                   f"{self.full_counts[i]}t"
                   for i in lp.positions if self.messages[i].get("role") == "tool"]
        if not entries:
            return ""
        if len(entries) > LEDGER_MAX_LINES:
            head = LEDGER_MAX_LINES // 3
            tail = LEDGER_MAX_LINES - head
            entries = [*entries[:head], f"…{len(entries) - LEDGER_MAX_LINES} more…",
                       *entries[-tail:]]
        return (f"{TAG} {len(entries)} tool result(s) of this turn not shown; "
                f"recall_tool_call(call_id) returns one: " + "; ".join(entries))

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
            note = (f"\n\n{TAG} The first {len(steps)} tool exchange(s) after this message "
                    f"(calls {first} … {last}) are not shown to save context; "
                    f"search_history(query) searches them and recall_tool_call(call_id) "
                    f"returns any result.")
            content = m.get("content")
            if isinstance(content, list):
                new: Message = {**m, "content": [*content, {"type": "text",
                                                            "text": note.strip()}]}
            else:
                new = {**m, "content": text_of(content) + note}
            self._noted[key] = (new, self.ops.count(new) - self.counts[at])
        return self._noted[key]

    def marker(self, omitted: int, summary: str | None) -> Message:
        text = (f"{TAG} {omitted} earlier turn(s) of this conversation are not shown to save "
                f"context. search_history(query) searches them; recall_tool_call(call_id) "
                f"returns any earlier tool result.")
        if summary:
            text += f"\nSummary of those turns:\n{summary}"
        return {"role": "system", "content": text}


class _Replay:
    def __init__(self, conv: _Conversation, timestamps: list[int | None] | None,
                 now_ms: int | None, summary: str | None):
        self.c = conv
        self.plan = _Plan()
        self.red_sum = 0
        self.timestamps = timestamps
        self.now_ms = now_ms
        self.summary = summary
        self._marker_tokens: dict[int, int] = {}

    def full_start(self) -> int:
        c = self.c
        return c.loops[self.plan.reduced_upto].start if self.plan.reduced_upto < len(c.loops) \
            else c.n

    def tokens(self, p: int) -> int:
        c, plan = self.c, self.plan
        fs = self.full_start()
        total = c.pre_tokens + self.red_sum + c.prefix[p] - c.prefix[min(fs, p)]
        e = min(plan.elide_upto, p)
        if e > fs:
            total -= c.sav_prefix[e] - c.sav_prefix[fs]
        if plan.omit_upto:
            total += self.marker_tokens(plan.omit_upto)
        if plan.drop_upto > plan.drop_from and plan.drop_upto <= p:
            total -= c.shown(plan.drop_from, plan.drop_upto)
            total += c.noted(plan.drop_from - 1, plan.drop_upto)[1]
        return total

    def marker_tokens(self, k: int) -> int:
        if k not in self._marker_tokens:
            self._marker_tokens[k] = self.c.ops.count(self.c.marker(k, self.summary))
        return self._marker_tokens[k]

    def reduce_to(self, loop: int) -> bool:
        plan = self.plan
        if loop <= plan.reduced_upto:
            return False
        for j in range(plan.reduced_upto, loop):
            if j >= plan.omit_upto:
                self.red_sum += self.c.reduced(j)[1]
        plan.reduced_upto = loop
        plan.elide_upto = max(plan.elide_upto, self.full_start())
        plan.drop_from = plan.drop_upto = 0  # what was dropped is now in a reduced loop
        return True

    def reduction_saving(self, current: int) -> int:
        """Tokens saved by reducing the closed loops still shown whole, before ``current``."""
        c, plan = self.c, self.plan
        if current <= plan.reduced_upto:
            return 0
        fs, cs = self.full_start(), c.loops[current].start
        full = c.prefix[cs] - c.prefix[fs]
        e = min(plan.elide_upto, cs)
        if e > fs:
            full -= c.sav_prefix[e] - c.sav_prefix[fs]
        reduced = sum(c.reduced(j)[1] for j in range(plan.reduced_upto, current))
        return full - reduced

    def omit_to(self, loop: int) -> bool:
        plan = self.plan
        loop = min(loop, plan.reduced_upto)
        if loop <= plan.omit_upto:
            return False
        for j in range(plan.omit_upto, loop):
            self.red_sum -= self.c.reduced(j)[1]
        plan.omit_upto = loop
        return True

    def batch_omission(self) -> int:
        m = self.c.policy.max_run_loops
        b = max(1, m // 2)
        past = self.plan.reduced_upto
        if past <= m:
            return 0
        return ((past - m - 1) // b + 1) * b

    def time_omission(self) -> int:
        if self.timestamps is None or self.now_ms is None:
            return 0
        horizon = self.now_ms - int(self.c.policy.max_time_range_s * 1000)
        k = 0
        for lp in self.c.loops[: self.plan.reduced_upto]:
            ts = self.timestamps[lp.start]
            if ts is None or ts >= horizon:
                break
            k = lp.index + 1
        return k

    def step(self, p: int, record: bool) -> None:
        """Apply the rules at request point ``p`` (the request held messages[:p])."""
        c, plan, pol = self.c, self.plan, self.c.policy
        current = c.loop_of[p - 1] if p > c.pre else 0
        before = self.tokens(p)
        if pol.reduce_past_loops is ReducePastLoops.ALWAYS \
                and self.reduction_saving(current) >= pol.clear_at_least \
                and self.reduce_to(current):
            # batched like elision: one prefix change clears at least clear_at_least tokens
            self._event(record, CompactionKind.PAST_LOOPS, before, p, "past run loops")
        before = self.tokens(p)
        if self.omit_to(max(self.batch_omission(), self.time_omission())):
            self._event(record, CompactionKind.OMISSION, before, p, "max_run_loops/max_time_range")
        working = c.budget.working
        if self.tokens(p) <= pol.threshold * working:
            return
        target = pol.target * working
        before = self.tokens(p)
        if self.reduce_to(current):
            self._event(record, CompactionKind.PAST_LOOPS, before, p, "over threshold")
        if self.tokens(p) > target:
            before = self.tokens(p)
            if self.elide(p, target):
                self._event(record, CompactionKind.ELISION, before, p, "over threshold")
        if self.tokens(p) > target:
            before = self.tokens(p)
            if self.drop(p, target):
                self._event(record, CompactionKind.DROP, before, p, "elision not enough")
        if self.tokens(p) > pol.threshold * working:
            before = self.tokens(p)
            b = max(1, pol.max_run_loops // 2)
            moved = False
            while self.tokens(p) > target and plan.omit_upto < plan.reduced_upto:
                moved |= self.omit_to(plan.omit_upto + b)
            if moved:
                self._event(record, CompactionKind.OMISSION, before, p, "over threshold")

    def elide(self, p: int, target: float) -> bool:
        c, plan = self.c, self.plan
        fs = self.full_start()
        keep = c.policy.keep_recent_tool_results
        tools_before = bisect.bisect_left(c.tool_positions, p)
        if keep == 0:
            first_kept = p
        elif tools_before > keep:
            first_kept = c.tool_positions[tools_before - keep]
        else:
            first_kept = c.tool_positions[0] if tools_before else p
        limit = max(fs, first_kept)
        start = max(plan.elide_upto, fs)
        if limit <= start:
            return False
        need = max(self.tokens(p) - target, c.policy.clear_at_least)
        goal = c.sav_prefix[start] + need
        e = bisect.bisect_left(c.sav_prefix, goal, lo=start, hi=limit)
        e = min(max(e, start + 1), limit)
        if c.sav_prefix[e] == c.sav_prefix[start]:
            return False
        plan.elide_upto = e
        return True

    def drop(self, p: int, target: float) -> bool:
        """Stop showing the oldest elided tool exchanges of the open region, whole, until the
        window is under ``target`` (at least ``clear_at_least`` per event)."""
        c, plan = self.c, self.plan
        fs = self.full_start()
        if plan.drop_upto <= plan.drop_from:
            start = fs
            while start < c.n and c.messages[start].get("role") == "user":
                start += 1
            if start == fs or start not in c.group_end:
                return False  # the note needs a user message to ride on
            plan.drop_from = plan.drop_upto = start
        before = self.tokens(p)
        need = max(before - target, c.policy.clear_at_least)
        g = plan.drop_upto
        moved = False
        while g in c.group_end and c.group_end[g] <= min(plan.elide_upto, p) \
                and not c.keeps(g):
            g = c.group_end[g]
            plan.drop_upto = g
            moved = True
            if before - self.tokens(p) >= need:
                break
        if not moved and plan.drop_upto == plan.drop_from:
            plan.drop_from = plan.drop_upto = 0
        return moved

    def _event(self, record: bool, kind: CompactionKind, before: int, p: int, why: str) -> None:
        if record:
            self.plan.events.append(Event(kind, before, self.tokens(p), why))

    def render(self) -> tuple[list[Message], list[Elided], bool]:
        c, plan = self.c, self.plan
        out: list[Message] = list(c.messages[: c.pre])
        changed = False
        if plan.omit_upto:
            out.append(c.marker(plan.omit_upto, self.summary))
            changed = True
        for j in range(plan.omit_upto, plan.reduced_upto):
            msgs, _, loop_changed = c.reduced(j)
            out.extend(msgs)
            changed |= loop_changed
        elided: list[Elided] = []
        dropping = plan.drop_upto > plan.drop_from
        for i in range(self.full_start(), c.n):
            if dropping and plan.drop_from <= i < plan.drop_upto:
                continue
            if dropping and i == plan.drop_from - 1:
                out.append(c.noted(i, plan.drop_upto)[0])
                changed = True
                continue
            short = c.short[i]
            if i < plan.elide_upto and short is not None:
                out.append(short)
                changed = True
                if c.messages[i].get("role") == "tool":
                    elided.append(Elided(c.refs[i], str(c.messages[i].get("tool_call_id")),
                                         c.tool_names[i], c.full_counts[i], i))
            else:
                out.append(c.full[i])
                changed |= c.full[i] is not c.messages[i]
        return out, elided, changed


def _trim_arguments(args: str, keep: int, call_id: str, ops: TokenOps) -> str:
    """Cut long string values inside JSON arguments; the result still parses as JSON."""
    try:
        parsed = orjson.loads(args)
    except orjson.JSONDecodeError:
        return args
    note = (f" [runloop-proxy: arguments cut; recall_tool_call(call_id=\"{call_id}\", "
            f"part=\"arguments\") returns them whole] ")

    def cut(v: object) -> object:
        if isinstance(v, str) and len(v) > keep:
            short = ops.truncate(v, keep)
            return short.replace("\n…[", "\n…" + note + "[", 1) if short != v else v
        if isinstance(v, dict):
            return {k: cut(x) for k, x in v.items()}
        if isinstance(v, list):
            return [cut(x) for x in v]
        return v

    out = orjson.dumps(cut(parsed)).decode()
    return out if len(out) < len(args) else args


def request_points(messages: list[Message], pre: int) -> list[int]:
    """Positions p where a client asked for the next assistant message (messages[:p])."""
    n = len(messages)
    points = [p for p in range(pre + 1, n) if messages[p].get("role") == "assistant"]
    points.append(n)
    return points


def build_window(messages: list[Message], keys: list[str], counts: list[int], policy: Policy,
                 budget: Budget, ops: TokenOps, *, timestamps: list[int | None] | None = None,
                 now_ms: int | None = None, summary: str | None = None,
                 protected: frozenset[str] = frozenset(), memo: Memo | None = None) -> Window:
    """The window for a request carrying ``messages`` (pure; ``counts`` per message;
    ``memo`` only caches derived forms, it never changes the result)."""
    tokens_in = sum(counts)
    if not policy.enabled or _nothing_to_do(messages, counts, policy, budget, tokens_in):
        return Window(messages, False, tokens_in <= budget.hard, tokens_in, tokens_in)
    conv = _Conversation(messages, keys, counts, policy, budget, ops, protected, memo)
    replay = _Replay(conv, timestamps, now_ms, summary)
    points = request_points(messages, conv.pre)
    for p in points:
        replay.step(p, record=p == conv.n)
    out, elided, changed = replay.render()
    tokens_out = replay.tokens(conv.n)
    events = list(replay.plan.events)
    fits = tokens_out <= budget.hard
    if not fits:
        out, tokens_out, elided, changed, fits = _hard_limit(conv, replay, events)
    return Window(out if changed else messages, changed, fits, tokens_in,
                  tokens_out if changed else tokens_in, tuple(elided),
                  replay.plan.reduced_upto - replay.plan.omit_upto, replay.plan.omit_upto,
                  tuple(events))


def _nothing_to_do(messages: list[Message], counts: list[int], policy: Policy, budget: Budget,
                   tokens_in: int) -> bool:
    """A short single-loop conversation under the threshold: the replay would change nothing
    (no past loop to reduce, and every earlier request point held fewer tokens)."""
    if not policy.enabled:
        return True
    if tokens_in > policy.threshold * budget.working or tokens_in > budget.hard:
        return False
    cap = max(64, int(policy.max_tool_result_share * budget.working))
    if any(c > cap for c in counts):
        return False
    return len(segment(messages)) <= 1


def _hard_limit(conv: _Conversation, replay: _Replay, events: list[Event]
                ) -> tuple[list[Message], int, list[Elided], bool, bool]:
    """Still over the hard budget: elide everything elidable, omit every past loop, then drop
    the oldest tool exchanges of the open loop."""
    before = replay.tokens(conv.n)
    plan = replay.plan
    replay.reduce_to(conv.loop_of[conv.n - 1] if conv.n > conv.pre else 0)
    replay.omit_to(plan.reduced_upto)
    plan.elide_upto = conv.n
    out, elided, _ = replay.render()
    tokens = replay.tokens(conv.n)
    if tokens > conv.budget.hard:
        out, tokens = _drop_oldest_exchanges(conv, out, tokens)
    fits = tokens <= conv.budget.hard
    events.append(Event(CompactionKind.TRUNCATION if fits else CompactionKind.REJECTION,
                        before, tokens, "over the hard limit"))
    return out, tokens, elided, True, fits


def _drop_oldest_exchanges(conv: _Conversation, out: list[Message], tokens: int
                           ) -> tuple[list[Message], int]:
    """Drop whole assistant(tool_calls)+tool-result groups, oldest first, never the last one."""
    groups: list[tuple[int, int]] = []
    i = 0
    while i < len(out):
        if out[i].get("role") == "assistant" and tool_calls_of(out[i]):
            j = i + 1
            while j < len(out) and out[j].get("role") == "tool":
                j += 1
            groups.append((i, j))
            i = j
        else:
            i += 1
    drop: set[int] = set()
    dropped = 0
    note_reserve = 48  # the note added below
    for a, b in groups[:-1]:
        if tokens + note_reserve <= conv.budget.hard:
            break
        for k in range(a, b):
            drop.add(k)
            tokens -= conv.ops.count(out[k])
        dropped += 1
    if not drop:
        return out, tokens
    kept = [m for k, m in enumerate(out) if k not in drop]
    at = next((k for k, m in enumerate(kept) if m.get("role") == "user"
               and isinstance(m.get("content"), str)), None)
    if at is not None:
        note = (f"\n\n{TAG} {dropped} older tool exchange(s) were dropped to fit the context; "
                f"search_history(query) finds them.")
        old = kept[at]
        kept[at] = {**old, "content": old["content"] + note}
        tokens += conv.ops.count(kept[at]) - conv.ops.count(old)
    return kept, tokens


def window_json(messages: list[Message]) -> bytes:
    return orjson.dumps(messages)
