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
from dataclasses import dataclass, field

from ..config import Policy, ProxyToolsMode
from ..conversation.messages import Message, content_hash, tool_calls_of
from ..conversation.runloops import segment
from .forms import (
    DEFAULT_NAMES,
    SUMMARY_HEAD,
    TAG,
    Budget,
    Conversation,
    Memo,
    TokenOps,
    ToolNames,
    appended,
    remember,
)
from .plan import CompactionKind as CompactionKind  # the window's types, re-exported
from .plan import Compactions as Compactions
from .plan import Dropped as Dropped
from .plan import Elided as Elided
from .plan import Event as Event
from .plan import Stamps as Stamps
from .plan import Summaries as Summaries
from .plan import _Replay
from .plan import aged_loops as aged_loops
from .plan import batch_omission as batch_omission

# the marker's note as the pieces its text grew by: its position in the window, and texts
# whose "\n"-join is its content — the marker and the summary's head, then the first summary
# of the lineage's append chain and what each later one appended (a provider whose cache
# works by content blocks can keep the old pieces cached when a new one is appended)
Note = tuple[int, tuple[str, ...]]


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
    note: Note | None = None
    # the tool exchanges of the open region left out whole (in_loop_drop), by position
    dropped: Dropped = Dropped()

    def offers_tools(self, policy: Policy, client_tools: bool) -> bool:
        """Whether the request goes out with the proxy's tools: when something was left out,
        or (``proxy_tools = "always"``) on every request of an agent that sends tools."""
        return self.changed or (client_tools and policy.enabled
                                and policy.proxy_tools is ProxyToolsMode.ALWAYS)


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
            f"{conv.context}|{b.hard}|{b.working}|{summaries!r}|"
            f"{compactions!r}|{replay.optional}|"
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
    optional: bool = True


def _carried(carry: Carry | None, messages: list[Message], keys: list[str], counts: list[int],
             policy: Policy, budget: Budget, ops: TokenOps, summaries: Summaries,
             protected: frozenset[str], memo: Memo | None, names: ToolNames,
             compactions: Compactions = (), optional: bool = True,
             record_from: int | None = None) -> tuple[Conversation, int, tuple[int, ...]] | None:
    """The carried conversation grown by this request's messages, and the request point the
    replay resumes after (its index among ``conv.asked``) with the state there — before
    every point whose events this request records; None when the carry does not fit."""
    if carry is None or carry.summaries != summaries or carry.compactions != compactions \
            or carry.optional != optional:
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


def build_window(messages: list[Message], keys: list[str], counts: list[int], policy: Policy,
                 budget: Budget, ops: TokenOps, *, timestamps: Stamps | None = None,
                 now_ms: int | None = None, summaries: Summaries = (),
                 protected: frozenset[str] = frozenset(), memo: Memo | None = None,
                 tool_names: ToolNames = DEFAULT_NAMES, carry: Carry | None = None,
                 compactions: Compactions = (), client_tools: bool = True,
                 record_from: int | None = None) -> Window:
    """The window for a request carrying ``messages`` (pure; ``counts`` per message).
    ``summaries`` are shown after the marker from the omission event each was made for
    (``(e, text)``: the first ``e`` loops omitted); ``compactions`` omit loops on request
    (``(n, e)``: the first ``e`` loops from request point ``n`` on). ``memo`` only caches
    derived forms and ``carry`` (the previous window's) only spares recomputing them:
    neither ever changes the result. ``client_tools``: whether the client's requests carry
    tools; a session whose client sends none gets the proxy's tools (with
    ``proxy_tools = "always"``) only when the budget forces a compaction, and until then
    its requests go out as they came, so the levers that only save money wait too.

    ``events`` are the steps taken at this request's own point and at every request point
    from ``record_from`` on: the points a request brings that no earlier request of the
    conversation ended at (a client that sends several turns at once, or a conversation the
    proxy meets in its middle). Each point's events are recorded once, however the
    conversation arrives."""
    optional = client_tools or policy.proxy_tools is ProxyToolsMode.WHEN_NEEDED
    resumed = _carried(carry, messages, keys, counts, policy, budget, ops, summaries, protected,
                       memo, tool_names, compactions, optional, record_from) \
        if policy.enabled else None
    checkpoints = None
    if resumed is not None:
        conv, start, state = resumed
        tokens_in = conv.total
        replay = _Replay(conv, timestamps, now_ms, summaries, compactions, optional)
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
        replay = _Replay(conv, timestamps, now_ms, summaries, compactions, optional)
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
        else Carry(conv, conv.n, states, summaries, compactions, optional)
    return Window(out if changed else messages, changed, fits, tokens_in,
                  tokens_out if changed else tokens_in, tuple(elided),
                  replay.plan.reduced_upto - replay.plan.omit_upto, replay.plan.omit_upto,
                  tuple(events), next_carry, budget,
                  _note(out, conv, replay) if changed else None, replay.dropped())


def _note(out: list[Message], conv: Conversation, replay: _Replay) -> Note | None:
    """Where the marker's note stands in ``out`` and the pieces its text grew by (``Note``);
    None without an omission, or where the note joined the system prompt (strict roles)."""
    if not replay.plan.omit_upto or conv.policy.strict_roles:
        return None
    preamble = conv.marked_preamble(replay.summary, replay.show_opening)[0]
    at = len(preamble) - 1
    note = preamble[at]
    if len(out) <= at or out[at] is not note:
        return None
    text = str(note.get("content"))
    pieces: tuple[str, ...] = (text,)
    summary = replay.summary
    if summary and text.endswith(f"\n{SUMMARY_HEAD}\n{summary}"):
        head = text[:len(text) - len(summary) - 1]
        pieces = (head, *summary_pieces(summary, replay.summaries, replay.plan.omit_upto))
    return (at, pieces) if "\n".join(pieces) == text else None


def summary_pieces(summary: str, summaries: dict[int, str], upto: int) -> tuple[str, ...]:
    """``summary`` as the pieces it grew by: the first summary of the lineage's append
    chain that ends in it, then what each later summary appended after a newline (a summary
    that condensed the others starts a chain of its own). Their "\n"-join is ``summary``."""
    chain: list[str] = []
    for e in sorted(e for e in summaries if e <= upto):
        text = summaries[e]
        if not text or (chain and text == chain[-1]):
            continue
        if chain and text.startswith(chain[-1] + "\n") and text[len(chain[-1]) + 1:].strip():
            chain.append(text)
        else:
            chain = [text]
    if not chain or chain[-1] != summary:
        return (summary,)
    return (chain[0], *(b[len(a) + 1:] for a, b in zip(chain, chain[1:], strict=False)))


def _nothing_to_do(messages: list[Message], counts: list[int], policy: Policy, budget: Budget,
                   tokens_in: int) -> bool:
    """A short single-loop conversation under the threshold: the replay would change nothing
    (no past loop to reduce, and every earlier request point held fewer tokens)."""
    if not policy.enabled:
        return True
    if tokens_in > budget.trigger(policy) or tokens_in > budget.hard:
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
    if tokens > conv.budget.hard and plan.omit_upto and replay.show_opening:
        # the opening task goes last, when nothing else is left to take
        replay.show_opening = False
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

