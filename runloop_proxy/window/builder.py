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
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Protocol

from ..config import Policy, ProxyToolsMode, ReducePastLoops
from ..conversation.messages import Message, content_hash, tool_calls_of
from ..conversation.runloops import RunLoop, segment
from .forms import (
    DEFAULT_NAMES,
    TAG,
    Budget,
    Conversation,
    Memo,
    TokenOps,
    ToolNames,
    appended,
    remember,
)

# summaries of what omission events left out: (the loop count an event omits, the text)
Summaries = tuple[tuple[int, str], ...]
# omissions asked for ("compact now"): (n, e) — from request point n on, the first e loops
# are omitted whatever the other rules say
Compactions = tuple[tuple[int, int], ...]


class Stamps(Protocol):
    """When each message was first seen (ms), by position; read at loop starts only."""

    def __getitem__(self, position: int) -> int | None: ...


class CompactionKind(StrEnum):
    PAST_LOOPS = "past_loop_reduction"
    ELISION = "in_loop_elision"
    OMISSION = "loop_omission"
    DROP = "in_loop_drop"
    TRUNCATION = "hard_truncation"
    SUMMARY = "summary"
    REJECTION = "rejection"


@dataclass(frozen=True)
class Elided:
    ref: str
    call_id: str
    tool: str
    tokens: int
    position: int


@dataclass(frozen=True)
class Event:
    """A step of the window at one request point: ``at`` messages preceded it."""

    kind: CompactionKind
    tokens_before: int
    tokens_after: int
    reason: str
    at: int


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
    carry: Carry | None = field(default=None, compare=False, repr=False)
    budget: Budget | None = field(default=None, compare=False, repr=False)

    def offers_tools(self, policy: Policy, client_tools: bool) -> bool:
        """Whether the request goes out with the proxy's tools: when something was left out,
        or (``proxy_tools = "always"``) on every request of an agent that sends tools."""
        return self.changed or (client_tools and policy.enabled
                                and policy.proxy_tools is ProxyToolsMode.ALWAYS)


@dataclass
class _Plan:
    reduced_upto: int = 0  # loops below are in question+answer form
    omit_upto: int = 0  # loops below are not shown
    elide_upto: int = 0  # tool results / reasoning below this position are elided
    drop_from: int = 0  # whole tool exchanges in [drop_from, drop_upto) are not shown
    drop_upto: int = 0
    answer_of: int = -1  # an omitted loop whose final reply stays shown after the marker
    events: list[Event] = field(default_factory=list)


class _Replay:
    def __init__(self, conv: Conversation, timestamps: Stamps | None,
                 now_ms: int | None, summaries: Summaries, compactions: Compactions = ()):
        self.c = conv
        self.plan = _Plan()
        self.red_sum = 0
        self.timestamps = timestamps
        self.now_ms = now_ms
        self.summaries = dict(summaries)
        self.compactions = compactions

    @property
    def summary(self) -> str | None:
        """The summary shown after the marker: the one made for what is omitted now (a
        summary enters the window only with the omission event it was made for)."""
        return self.summaries.get(self.plan.omit_upto)

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
            total += c.marked_preamble(self.summary)[1]
        if plan.answer_of >= 0:
            total += c.bridge(plan.answer_of)[1]
        if plan.drop_upto > plan.drop_from and plan.drop_upto <= p:
            total -= c.shown(plan.drop_from, plan.drop_upto)
            total += c.noted(plan.drop_from - 1, plan.drop_upto)[1]
        return total

    def reduce_to(self, loop: int) -> bool:
        plan = self.plan
        if loop <= plan.reduced_upto:
            return False
        for j in range(plan.reduced_upto, loop):
            if j >= plan.omit_upto:
                self.red_sum += self.c.reduced(j)[1]
        plan.reduced_upto = loop
        plan.elide_upto = max(plan.elide_upto, self.full_start())
        if plan.drop_from < self.full_start():
            plan.drop_from = plan.drop_upto = 0  # what was dropped is now in a reduced loop
        return True

    def reduction_pays(self, current: int) -> bool:
        """Whether reducing the closed loops still shown whole, before ``current``, clears
        ``reduce_at_least`` tokens (a prefix change that saves less is not worth making)."""
        c, plan = self.c, self.plan
        if current <= plan.reduced_upto:
            return False
        fs, cs = self.full_start(), c.loops[current].start
        full = c.prefix[cs] - c.prefix[fs]
        e = min(plan.elide_upto, cs)
        if e > fs:
            full -= c.sav_prefix[e] - c.sav_prefix[fs]
        reduced = sum(c.reduced(j)[1] for j in range(plan.reduced_upto, current))
        return full - reduced >= c.policy.reduce_at_least

    def omit_to(self, loop: int, current: int) -> bool:
        """Stop showing the closed loops below ``loop`` (``current`` is the open one),
        reduced or still whole (when reducing them did not pay).

        An omission that leaves no past loop in view keeps the last one's final reply after
        the marker, so the model still sees what the user is answering. On the turn that
        omits it that costs no extra re-read: the window differs from the last request's right
        after the marker either way, and the reply was new to the provider then anyway."""
        plan = self.plan
        loop = min(loop, current)
        if loop <= plan.omit_upto:
            return False
        self.reduce_to(loop)
        for j in range(plan.omit_upto, loop):
            self.red_sum -= self.c.reduced(j)[1]
        plan.omit_upto = loop
        kept = loop == current and self.c.answer(loop - 1)[0] is not None
        plan.answer_of = loop - 1 if kept else -1
        return True

    def time_omission(self, past: int) -> int:
        return aged_loops(self.c.policy, self.c.loops[:past], self.timestamps, self.now_ms)

    def snapshot(self) -> tuple[int, ...]:
        """The plan and the running sum it implies, without the events (those are recorded
        at the points a request brings, ``build_window``'s ``record_from``)."""
        plan = self.plan
        return (plan.reduced_upto, plan.omit_upto, plan.elide_upto, plan.drop_from,
                plan.drop_upto, plan.answer_of, self.red_sum)

    def resume(self, state: tuple[int, ...]) -> None:
        plan = self.plan
        (plan.reduced_upto, plan.omit_upto, plan.elide_upto, plan.drop_from, plan.drop_upto,
         plan.answer_of, self.red_sum) = state

    def time_omission_possible(self) -> bool:
        """Whether some loop is already older than ``max_time_range`` (then the replay's
        result depends on the clock, not only on the messages)."""
        if self.timestamps is None or self.now_ms is None:
            return False
        horizon = self.now_ms - int(self.c.policy.max_time_range_s * 1000)
        return any((ts := self.timestamps[lp.start]) is not None and ts < horizon
                   for lp in self.c.loops)

    def step(self, p: int, record: bool) -> None:
        """Apply the rules at request point ``p`` (the request held messages[:p])."""
        c, plan, pol = self.c, self.plan, self.c.policy
        current = c.loop_of[p - 1] if p > c.pre else 0
        before = self.tokens(p)
        if pol.reduce_past_loops is ReducePastLoops.ALWAYS \
                and self.reduction_pays(current) \
                and self.reduce_to(current):
            self._event(record, CompactionKind.PAST_LOOPS, before, p, "past run loops")
        before = self.tokens(p)
        if self.omit_to(max(batch_omission(pol, current), self.time_omission(current)),
                        current):
            self._event(record, CompactionKind.OMISSION, before, p, "max_run_loops/max_time_range")
        asked = max((e for n, e in self.compactions if p >= n), default=0)
        before = self.tokens(p)
        if asked and self.omit_to(asked, current):
            self._event(record, CompactionKind.OMISSION, before, p, "compact now")
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
            b = pol.omission_batch
            moved = False
            while self.tokens(p) > target and plan.omit_upto < plan.reduced_upto:
                moved |= self.omit_to(plan.omit_upto + b, plan.reduced_upto)
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
        need = max(self.tokens(p) - target, min(c.policy.clear_at_least, target))
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
        need = max(before - target, min(c.policy.clear_at_least, target))
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
            self.plan.events.append(Event(kind, before, self.tokens(p), why, p))

    def render(self) -> tuple[list[Message], list[Elided], bool]:
        c, plan = self.c, self.plan
        out: list[Message] = list(c.messages[: c.pre])
        changed = False
        if plan.omit_upto:
            out = list(c.marked_preamble(self.summary)[0])
            changed = True
        if plan.answer_of >= 0:
            out.extend(c.bridge(plan.answer_of)[0])
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


class _Checkpoints:
    """The replay's state after a request point, memoised, so the next request of a growing
    conversation replays only its own point instead of every earlier one.

    The state at point p depends only on messages[:p] (their keys and counts), the policy, the
    budget, the protected results, the summaries and the compactions; the key holds all of
    them. Omission by age
    depends on the clock as well: while any loop is older than ``max_time_range`` the replay
    runs whole.
    """

    def __init__(self, conv: Conversation, replay: _Replay, summaries: Summaries,
                 compactions: Compactions):
        self.conv, self.replay = conv, replay
        self.memo: Memo = conv.memo  # type: ignore[assignment]
        self.parts = [f"{k}:{n}," for k, n in zip(conv.keys, conv.counts, strict=True)]
        b = conv.budget
        self.context = content_hash(
            f"{conv.policy.model_dump_json()}|{b.hard}|{b.working}|{summaries!r}|"
            f"{compactions!r}|"
            f"{'|'.join(conv.names)}|"
            f"{','.join(sorted(conv.protected))}".encode())
        self.usable = not replay.time_omission_possible()

    def _key(self, p: int) -> tuple[str, ...]:
        return ("plan", self.context, content_hash("".join(self.parts[:p]).encode()))

    def restore(self, p: int) -> bool:
        if not self.usable:
            return False
        hit = self.memo.get(self._key(p))
        if hit is None:
            return False
        self.replay.resume(hit)
        return True

    def save(self, p: int) -> None:
        if not self.usable:
            return
        remember(self.memo, self._key(p), self.replay.snapshot())


def request_points(messages: list[Message], pre: int) -> list[int]:
    """Positions p where a client asked for the next assistant message (messages[:p])."""
    n = len(messages)
    points = [p for p in range(pre + 1, n) if messages[p].get("role") == "assistant"]
    points.append(n)
    return points


@dataclass(frozen=True)
class Carry:
    """What one request's window leaves for the next request of the same conversation: the
    derived forms (an append-only log; ``n``: how much of it this window held) and the
    replay's state after its last two request points (the next request resumes there when
    it holds the same messages and more)."""

    conv: Conversation
    n: int
    states: dict[int, tuple[int, ...]]
    summaries: Summaries
    compactions: Compactions = ()


def _carried(carry: Carry | None, messages: list[Message], keys: list[str], counts: list[int],
             policy: Policy, budget: Budget, ops: TokenOps, summaries: Summaries,
             protected: frozenset[str], memo: Memo | None, names: ToolNames,
             compactions: Compactions = (), record_from: int | None = None
             ) -> tuple[Conversation, int, tuple[int, ...]] | None:
    """The carried conversation grown by this request's messages, and the request point the
    replay resumes after (its index among ``conv.asked``) with the state there — before
    every point whose events this request records; None when the carry does not fit."""
    if carry is None or carry.summaries != summaries or carry.compactions != compactions:
        return None
    conv = carry.conv.grow(carry.n, messages, keys, counts, policy, budget, protected, names,
                           ops, memo)
    if conv is None:
        return None
    asked = conv.asked

    def index(p: int) -> int | None:
        k = bisect.bisect_left(asked, p)
        return k if k < len(asked) and asked[k] == p else None

    # never past this request's own point: its events are recorded again, as a fresh build
    # would (the same request gives the same window)
    resumable = [p for p in carry.states if index(p) is not None
                 and (record_from is None or p < record_from)]
    if not resumable:
        return None
    p = max(resumable)
    return conv, index(p) + 1, carry.states[p]  # type: ignore[operator]


def aged_loops(policy: Policy, past: Sequence[RunLoop], timestamps: Stamps | None,
               now_ms: int | None) -> int:
    """How many of the ``past`` loops (those before the open one), oldest first, started
    longer than ``max_time_range`` ago: what an omission by age leaves out."""
    if timestamps is None or now_ms is None:
        return 0
    horizon = now_ms - int(policy.max_time_range_s * 1000)
    k = 0
    for lp in past:
        ts = timestamps[lp.start]
        if ts is None or ts >= horizon:
            break
        k = lp.index + 1
    return k


def batch_omission(policy: Policy, past: int) -> int:
    """Loops to omit when ``past`` loops precede the open one: beyond ``max_run_loops``, a
    whole batch at a time (a batch larger than ``max_run_loops + 1`` waits until it has
    closed: omissions, and the summaries made for them, stay on multiples of the batch —
    ``history.summaries.event_at``)."""
    m, b = policy.max_run_loops, policy.omission_batch
    if past <= m:
        return 0
    k = ((past - m - 1) // b + 1) * b
    return k if k <= past else k - b


def build_window(messages: list[Message], keys: list[str], counts: list[int], policy: Policy,
                 budget: Budget, ops: TokenOps, *, timestamps: Stamps | None = None,
                 now_ms: int | None = None, summaries: Summaries = (),
                 protected: frozenset[str] = frozenset(), memo: Memo | None = None,
                 tool_names: ToolNames = DEFAULT_NAMES, carry: Carry | None = None,
                 compactions: Compactions = (), record_from: int | None = None) -> Window:
    """The window for a request carrying ``messages`` (pure; ``counts`` per message).
    ``summaries`` are shown after the marker from the omission event each was made for
    (``(e, text)``: the first ``e`` loops omitted); ``compactions`` omit loops on request
    (``(n, e)``: the first ``e`` loops from request point ``n`` on). ``memo`` only caches
    derived forms and ``carry`` (the previous window's) only spares recomputing them:
    neither ever changes the result.

    ``events`` are the steps taken at this request's own point and at every request point
    from ``record_from`` on: the points a request brings that no earlier request of the
    conversation ended at (a client that sends several turns at once, or a conversation the
    proxy meets in its middle). Each point's events are recorded once, however the
    conversation arrives."""
    resumed = _carried(carry, messages, keys, counts, policy, budget, ops, summaries, protected,
                       memo, tool_names, compactions, record_from) if policy.enabled else None
    checkpoints = None
    if resumed is not None:
        conv, start, state = resumed
        tokens_in = conv.total
        replay = _Replay(conv, timestamps, now_ms, summaries, compactions)
        if replay.time_omission_possible():
            start = 0  # the clock decides too: replay it whole
        else:
            replay.resume(state)
    else:
        tokens_in = sum(counts)
        if not policy.enabled or _nothing_to_do(messages, counts, policy, budget, tokens_in):
            return Window(messages, False, tokens_in <= budget.hard, tokens_in, tokens_in,
                          budget=budget)
        conv = Conversation.of(messages, keys, counts, policy, budget, ops, protected, memo,
                               tool_names)
        replay = _Replay(conv, timestamps, now_ms, summaries, compactions)
        start = 0
        checkpoints = _Checkpoints(conv, replay, summaries, compactions) \
            if memo is not None else None
        if checkpoints is not None and conv.asked \
                and (record_from is None or conv.asked[-1] < record_from) \
                and checkpoints.restore(conv.asked[-1]):
            start = len(conv.asked)  # the previous request's replay, resumed
    # the request points: every assistant message after the preamble, then this request's
    points = conv.asked
    last = len(points)  # the index of this request's own point, conv.n
    states: dict[int, tuple[int, ...]] = {}
    if start == last and last > 0:
        states[points[-1]] = replay.snapshot()
    for k in range(start, last + 1):
        p = points[k] if k < last else conv.n
        replay.step(p, record=k == last or (record_from is not None and p >= record_from))
        if k >= last - 1:
            states[p] = replay.snapshot()
    if checkpoints is not None:
        checkpoints.save(conv.n)
    out, elided, changed = replay.render()
    tokens_out = replay.tokens(conv.n)
    events = list(replay.plan.events)
    fits = tokens_out <= budget.hard
    if not fits:
        out, tokens_out, elided, changed, fits = _hard_limit(conv, replay, events)
    # made last: once handed on, the conversation is only ever grown by its next request
    next_carry = None if replay.time_omission_possible() \
        else Carry(conv, conv.n, states, summaries, compactions)
    return Window(out if changed else messages, changed, fits, tokens_in,
                  tokens_out if changed else tokens_in, tuple(elided),
                  replay.plan.reduced_upto - replay.plan.omit_upto, replay.plan.omit_upto,
                  tuple(events), next_carry, budget)


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


def _hard_limit(conv: Conversation, replay: _Replay, events: list[Event]
                ) -> tuple[list[Message], int, list[Elided], bool, bool]:
    """Still over the hard budget: elide everything elidable, omit every past loop, then drop
    the oldest tool exchanges of the open loop."""
    before = replay.tokens(conv.n)
    plan = replay.plan
    replay.reduce_to(conv.loop_of[conv.n - 1] if conv.n > conv.pre else 0)
    replay.omit_to(plan.reduced_upto, plan.reduced_upto)
    plan.answer_of = -1  # the last resort keeps no past reply either
    plan.elide_upto = conv.n
    out, elided, _ = replay.render()
    tokens = replay.tokens(conv.n)
    if tokens > conv.budget.hard:
        out, tokens = _drop_oldest_exchanges(conv, out, tokens)
    fits = tokens <= conv.budget.hard
    events.append(Event(CompactionKind.TRUNCATION if fits else CompactionKind.REJECTION,
                        before, tokens, "over the hard limit", conv.n))
    return out, tokens, elided, True, fits


def _drop_oldest_exchanges(conv: Conversation, out: list[Message], tokens: int
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
    dropped: list[int] = []
    note_reserve = 64  # the note added below
    for a, b in groups[:-1]:
        if tokens + note_reserve <= conv.budget.hard:
            break
        for k in range(a, b):
            drop.add(k)
            tokens -= conv.ops.count(out[k])
        dropped.append(a)
    if not drop:
        return out, tokens
    first = tool_calls_of(out[dropped[0]])[0].get("id", "")
    last = tool_calls_of(out[dropped[-1]])[-1].get("id", "")
    kept = [m for k, m in enumerate(out) if k not in drop]
    at = next((k for k, m in enumerate(kept) if m.get("role") == "user"
               and isinstance(m.get("content"), str)), None)
    if at is not None:
        note = (f"{TAG} {len(dropped)} older tool exchange(s) (calls {first} … {last}) were "
                f"dropped to fit the context; {conv.search}(query) finds them and "
                f"{conv.recall}(call_id) returns any result.")
        old = kept[at]
        kept[at] = appended(old, note)
        tokens += conv.ops.count(kept[at]) - conv.ops.count(old)
    return kept, tokens

