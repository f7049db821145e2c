"""The window's rules, request point by request point (pure): the plan of what each
request's window shows, and the compaction events that move it.

``_Replay`` applies the levers at each request point of a conversation, in the order the
builder's docstring gives; the plan it keeps (how many loops are reduced or omitted, where
elision and drops stand) moves only at an event. A lever that only saves money — a past-loop
reduction while under the threshold, an omission beyond ``max_run_loops`` — moves only when
it pays for what it makes the provider read again (``_Replay.pays``), and not at all in a
session whose client sends no tools (its tool list would change mid-session).
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Protocol

from ..config import Policy, ReducePastLoops
from ..conversation.messages import Message
from ..conversation.runloops import RunLoop
from .forms import Conversation

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
    """A step of the window at one request point: ``at`` messages preceded it. ``items``:
    what the step took out, counted in its own unit — tool results an elision elided,
    tool exchanges a drop left out (``messages``: the messages those were); 0 for the
    other steps."""

    kind: CompactionKind
    tokens_before: int
    tokens_after: int
    reason: str
    at: int
    items: int = 0
    messages: int = 0


@dataclass(frozen=True)
class Dropped:
    """The tool exchanges of the open region a window leaves out whole (``in_loop_drop``):
    their message positions, how many exchanges those are, and the tokens they held as
    the window would otherwise have shown them (elided)."""

    positions: tuple[int, ...] = ()
    exchanges: int = 0
    tokens: int = 0


@dataclass
class _Plan:
    reduced_upto: int = 0  # loops below are in question+answer form
    omit_upto: int = 0  # loops below are not shown
    elide_upto: int = 0  # tool results / reasoning below this position are elided
    drop_from: int = 0  # whole tool exchanges in [drop_from, drop_upto) are not shown
    drop_upto: int = 0
    answer_of: int = -1  # an omitted loop whose final reply stays shown after the marker
    events: list[Event] = field(default_factory=list)


# What a lever that only saves money is judged by: the cheapest cached read the providers
# sell (a tenth of the input price) and the dearest write (Anthropic's, 1.25 times it), so
# that what pays here pays with any of them.
CACHED_READ = 0.1
CACHE_WRITE = 1.25


class _Replay:
    def __init__(self, conv: Conversation, timestamps: Stamps | None,
                 now_ms: int | None, summaries: Summaries, compactions: Compactions = (),
                 optional: bool = True):
        self.c = conv
        self.plan = _Plan()
        # whether the levers that only save money may move at all (not in a session whose
        # client sends no tools: they would bring the proxy's tools mid-session)
        self.optional = optional
        self.prev_point = 0  # the request point stepped last (0: none yet)
        self.show_opening = True  # the hard limit's last resort turns it off
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
            total += c.marked_preamble(self.summary, self.show_opening)[1]
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
                plan.drop_upto, plan.answer_of, self.red_sum, self.prev_point)

    def resume(self, state: tuple[int, ...]) -> None:
        plan = self.plan
        (plan.reduced_upto, plan.omit_upto, plan.elide_upto, plan.drop_from, plan.drop_upto,
         plan.answer_of, self.red_sum, self.prev_point) = state

    def head(self) -> list[tuple[object, int]]:
        """The window's leading parts under the plan, in order, each with its tokens, up to
        where the loops shown whole begin: what an omission or a reduction changes."""
        c, plan = self.c, self.plan
        if not plan.omit_upto:
            out: list[tuple[object, int]] = [("pre", c.pre_tokens)]
        else:
            opening = c.marked_preamble(None, self.show_opening)[1] \
                - c.marked_preamble(None, False)[1]
            marked = c.marked_preamble(self.summary, False)[1]
            if c.policy.strict_roles:  # the marker and the summary join the system prompt
                out = [(("marked", self.summary), c.pre_tokens + marked), ("opening", opening)]
            else:
                out = [("pre", c.pre_tokens), ("opening", opening),
                       (("marker", self.summary), marked)]
        if plan.answer_of >= 0:
            out.append((("bridge", plan.answer_of), c.bridge(plan.answer_of)[1]))
        out += [(("loop", j), c.reduced(j)[1]) for j in range(plan.omit_upto, plan.reduced_upto)]
        return out

    def pays(self, before: tuple[int, ...], p: int) -> bool:
        """Whether the change made to the plan since ``before`` pays at request point ``p``.
        It must take tokens out of the window (an omission of a short loop can add more —
        the marker, the kept reply, the summary — than it removes). With
        ``payback_requests``, what it takes out of this request and every later one, at the
        cached price, over that many requests, must also pay for what it makes the provider
        read again at the write price (what the last request had cached after the first
        part it changes); judged with the cheapest cached read and the dearest write, so
        that it pays with every provider (the first request has nothing cached)."""
        after, changed_head, tokens_after = self.snapshot(), self.head(), self.tokens(p)
        self.resume(before)
        head, tokens_before, cached = self.head(), self.tokens(p), self.tokens(self.prev_point)
        self.resume(after)
        saved = tokens_before - tokens_after
        horizon = self.c.policy.payback_requests
        if saved <= 0 or horizon is None or not self.prev_point:
            return saved > 0
        reread = max(0, cached - shared_prefix(head, changed_head))
        return saved * (CACHE_WRITE + horizon * CACHED_READ) >= (CACHE_WRITE - CACHED_READ) * reread

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
        c = self.c
        self._step(p, record, c.loop_of[p - 1] if p > c.pre else 0)
        self.prev_point = p

    def _lever(self, p: int, record: bool, kind: CompactionKind, why: str,
               move: Callable[[], bool]) -> bool:
        """A lever the budget asks for: made when it takes tokens out, else undone — one
        that saves nothing is a rewrite the provider bills as a cache write (dropping
        exchanges already elided made the window 2-3 tokens larger with its note). The one
        rule every lever goes through (``_optional`` adds when it pays)."""
        state, before = self.snapshot(), self.tokens(p)
        took = self.taken()
        if not move():
            return False
        if self.tokens(p) < before:
            now = self.taken()
            self._event(record, kind, before, p, why,
                        *((now[0] - took[0], 0) if kind is CompactionKind.ELISION else
                          (now[1] - took[1], now[2] - took[2])
                          if kind is CompactionKind.DROP else (0, 0)))
            return True
        self.resume(state)
        return False

    def _optional(self, p: int, record: bool, kind: CompactionKind, why: str,
                  move: Callable[[], bool]) -> None:
        """A lever that only saves money: made when it pays (``pays``), else undone."""
        state, before = self.snapshot(), self.tokens(p)
        if move():
            if self.pays(state, p):
                self._event(record, kind, before, p, why)
            else:
                self.resume(state)

    def _step(self, p: int, record: bool, current: int) -> None:
        c, pol = self.c, self.c.policy
        if self.optional and pol.reduce_past_loops is ReducePastLoops.ALWAYS \
                and self.reduction_pays(current):
            self._optional(p, record, CompactionKind.PAST_LOOPS, "past run loops",
                           lambda: self.reduce_to(current))
        # what age (max_time_range) or the operator ("compact now") omits is omitted as
        # asked, whatever it saves: those are not levers of the budget
        before = self.tokens(p)
        if self.omit_to(self.time_omission(current), current):
            self._event(record, CompactionKind.OMISSION, before, p, "max_time_range")
        if self.optional:
            self._optional(p, record, CompactionKind.OMISSION, "max_run_loops",
                           lambda: self.omit_to(batch_omission(pol, current), current))
        asked = max((e for n, e in self.compactions if p >= n), default=0)
        before = self.tokens(p)
        if asked and self.omit_to(asked, current):
            self._event(record, CompactionKind.OMISSION, before, p, "compact now")
        working = c.budget.working
        trigger = c.budget.trigger(pol)
        if self.tokens(p) <= trigger:
            return
        target = pol.target * working
        if self.shows_alike(current):
            self.reduce_to(current)  # the reduced loops read as they were: no change to make
        else:
            self._lever(p, record, CompactionKind.PAST_LOOPS, "over threshold",
                        lambda: self.reduce_to(current))
        if self.tokens(p) > target:
            self._lever(p, record, CompactionKind.ELISION, "over threshold",
                        lambda: self.elide(p, target))
        if self.tokens(p) > target:
            self._lever(p, record, CompactionKind.DROP, "elision not enough",
                        lambda: self.drop(p, target))
        if self.tokens(p) > trigger:
            self._lever(p, record, CompactionKind.OMISSION, "over threshold",
                        lambda: self._omit_batches(p, target))

    def _omit_batches(self, p: int, target: float) -> bool:
        plan, b = self.plan, self.c.policy.omission_batch
        moved = False
        while self.tokens(p) > target and plan.omit_upto < plan.reduced_upto:
            moved |= self.omit_to(plan.omit_upto + b, plan.reduced_upto)
        return moved

    def shows_alike(self, current: int) -> bool:
        """Whether reducing the loops shown whole before ``current`` changes none of them
        (loops without tools read the same reduced)."""
        plan = self.plan
        return not any(self.c.reduced(j)[2]
                       for j in range(max(plan.reduced_upto, plan.omit_upto), current))

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

    def _event(self, record: bool, kind: CompactionKind, before: int, p: int, why: str,
               items: int = 0, messages: int = 0) -> None:
        if record:
            self.plan.events.append(Event(kind, before, self.tokens(p), why, p, items,
                                          messages))

    def taken(self) -> tuple[int, int, int]:
        """What the plan takes out of the open region: tool results elided (dropped ones
        included: they were elided first), tool exchanges dropped, and their messages."""
        c, plan = self.c, self.plan
        fs = self.full_start()
        lo = bisect.bisect_left(c.tool_positions, fs)
        hi = bisect.bisect_left(c.tool_positions, max(fs, plan.elide_upto))
        results = sum(1 for i in c.tool_positions[lo:hi] if c.short[i] is not None)
        d = self.dropped()
        return results, d.exchanges, len(d.positions)

    def dropped(self) -> Dropped:
        """The exchanges the plan leaves out whole (none when it drops nothing)."""
        c, plan = self.c, self.plan
        if plan.drop_upto <= plan.drop_from:
            return Dropped()
        exchanges, g = 0, plan.drop_from
        while g < plan.drop_upto and g in c.group_end:
            g = c.group_end[g]
            exchanges += 1
        return Dropped(tuple(range(plan.drop_from, plan.drop_upto)), exchanges,
                       c.shown(plan.drop_from, plan.drop_upto))

    def render(self) -> tuple[list[Message], list[Elided], bool]:
        c, plan = self.c, self.plan
        out: list[Message] = list(c.messages[: c.pre])
        changed = False
        if plan.omit_upto:
            out = list(c.marked_preamble(self.summary, self.show_opening)[0])
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


def shared_prefix(old: Sequence[tuple[object, int]], new: Sequence[tuple[object, int]]) -> int:
    """The tokens a window whose leading parts are ``new`` shares with one whose parts were
    ``old``, as a provider's prefix cache reads them: the parts alike, then the marker's when
    only its summary grew (its old text is a prefix of the new: all but its last token)."""
    shared = 0
    for a, b in zip(old, new, strict=False):
        if a == b:
            shared += a[1]
            continue
        if _grown(a[0], b[0]):
            shared += max(0, a[1] - 1)
        break
    return shared


def _grown(old: object, new: object) -> bool:
    """Whether the marker part ``new`` reads as ``old`` with more summary after it."""
    if not (isinstance(old, tuple) and isinstance(new, tuple) and len(old) == len(new) == 2
            and old[0] == new[0] and old[0] in ("marker", "marked")):
        return False
    was, now = old[1], new[1]
    return now is not None and (was is None or (isinstance(now, str) and now.startswith(was)))


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

