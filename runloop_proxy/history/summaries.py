"""Rolling summaries of the run loops an omission leaves out, made in the background.

A summary covers the first ``e`` loops of a conversation, where ``e`` is a loop count an
omission event can reach (a multiple of the policy's omission batch). It is made *ahead*, one
run loop before the event that omits those loops (``due``; at once when the window is past its
target and an omission may come any turn), so it is ready when the marker changes and a session
that ends sooner never pays for it; summary k rolls from summary k−1 and the loops after it
(its input never grows with the session). Rolling is append-only while the budget allows: what
the new loops add is appended to summary k−1, so the marker's text only grows and the
provider's prefix cache keeps serving it; when no room is left, one call merges it all into
half the budget, and the batches after that append again. It is stored in Redis per session,
keyed by what it covers (``e`` and a hash of the messages up to the end of loop e−1: one
branch's summary never reaches another's), so every replica reuses it; one replica makes it at
a time (a lock with expiry).

It enters the window only with the omission event it was made for (window/builder.py): the
first request that omits ``e`` loops without a summary for them marks ``e`` as *late* and the
window stays without one until the next event, so the prefix the provider caches never changes
between events. A model's summary is never on the request path: a request reads what is
stored (one Redis read when the tenant has summaries on, fail-open) and never waits for one to
be made. The extractive digest is pure and bounded (a millisecond): when its event finds none
stored — no loop of time to make it ahead (``max_run_loops`` below the batch), a client that
sends its next request at once, or one that keeps the reply in another form than the proxy
recorded — the window makes it inline (``inline_digest``) and it is stored as if made ahead.
Failures and timeouts leave the window as it would be without summaries; after three in a row a
tenant's summaries pause for ``summary_backoff_s``.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

import orjson
import xxhash

from ..caches import MESSAGE_OVERHEAD, SHARES, ByteLRU, message_bytes, messages_bytes
from ..config import Policy, UpstreamSpec
from ..conversation.messages import Message, message_text, text_of, tool_calls_of
from ..conversation.runloops import RunLoop, preamble_end, segment
from ..errors import ProxyFull, StoreError, TenantOverShare
from ..ops import logs
from ..pipeline.offload import is_large, offload
from ..pipeline.shares import Shares
from ..window.builder import Compactions, Summaries, batch_omission
from ..window.digest import VERSION as EXTRACTIVE
from ..window.digest import identifiers, roll

EXTRACTIVE_MODEL = "extractive"  # policy.summary_model's name for the digest

if TYPE_CHECKING:
    from collections.abc import Coroutine

    from ..config import ProxyConfig
    from ..conversation.identity import Session
    from ..ops.metrics import Metrics
    from ..pipeline.tokens import TokenCounter
    from ..pipeline.upstream import UpstreamClient
    from ..pipeline.values import Turn
    from ..window.builder import Window
    from .store import RedisStore

log = logs.get("summaries")
PROMPT_VERSION = "summary-prompt-2"
SECTIONS = "Goals; Decisions and facts; Identifiers (ids, numbers, paths, names — copied " \
    "verbatim); Files and records touched; Open tasks; User preferences."
MERGE = """You maintain the running summary of an agent conversation whose oldest turns are \
no longer shown to the model. Merge the previous summary with the turns below into one \
summary of at most {max_tokens} tokens, in these sections:
{sections}
Keep every identifier a later turn could need, verbatim. No preamble.

Previous summary:
{previous}

Turns to add:
{turns}"""
APPEND = """You maintain the running summary of an agent conversation whose oldest turns are \
no longer shown to the model. The summary so far stays as it is; write only what the turns \
below add to it or change in it, in at most {max_tokens} tokens, under the same sections \
(leave out a section with nothing new):
{sections}
Keep every identifier a later turn could need, verbatim. Do not repeat the summary. No preamble.

Summary so far:
{previous}

Turns to add:
{turns}"""
LATER = "\n\nLater turns:\n"
CONDENSE_SHARE = 0.5  # of summary_max_tokens, for a merged summary: the next batches append
MIN_APPEND_SHARE = 0.25  # less room than this left in the budget: merge instead
LOOP_CHARS = 6_000  # of each loop's text in a summary call: its input stays bounded
FAILURES_BEFORE_BACKOFF = 3
SUMMARY_ANSWER_BYTES = 4 << 20  # a summary model's answer, at most (it asks for ~1k tokens)
LATE = "late"
# the summaries' share of server.cache_mb (SHARES["summaries"]), split between the summaries
# to make (pending, wanted, waiting: each holds its session's messages) and the failure
# counts and pauses; a session larger than its part waits for its next request instead
SUMMARY_PARTS = {"pending": 0.48, "wanted": 0.2, "waiting": 0.2, "failures": 0.05,
                 "paused_until": 0.05, "unreleased": 0.02}
OMIT = "omit:"  # a compaction's field: omit:<e>:<cover> -> the request point it applies from
MODEL = "model:"  # a model's summary of the first e loops: model:<e>:<cover> -> its record
WAKE_SCAN = 64  # waiting sessions looked at when a call ends (the oldest first)
CALL_BATCHES = 2  # a model call adds at most this many batches of loops: its input is bounded
DIGEST_LABEL = "Turns {first}–{last}, not yet summarised:"  # before a digest in a model's place


def covers(keys: Sequence[str], loops: Sequence[RunLoop], batch: int,
           also: Collection[int] = ()) -> dict[int, str]:
    """For each loop count ``e`` (a multiple of ``batch``, or one of ``also``: where an
    omission by age stopped) whose loops are all closed, the hash of what a summary of them
    covers: the messages up to the end of loop e−1."""
    out: dict[int, str] = {}
    closed = done = 0
    h = xxhash.xxh3_128()  # content_hash of the keys so far, one pass (not a join per cover)
    for lp in loops:
        if lp.final_position is None:
            break
        closed += 1
        if closed % batch == 0 or closed in also:
            h.update("".join(keys[done:lp.end]).encode())
            done = lp.end
            out[closed] = h.hexdigest()
    return out


class Covering(NamedTuple):
    """What a window's summary planning reads, made where the window was."""

    loops: Sequence[RunLoop]
    cover: dict[int, str]  # ``covers``
    held: int  # the bytes the messages hold (``messages_bytes``): a pending summary's size


def covering(policy: Policy, window: Window, messages: list[Message], keys: list[str],
             entries: dict[str, str]) -> Covering | None:
    """The loops, the covers (``covers``) and the messages' size a window's summary planning
    reads, None without summaries: O(messages) (at batch 1 a cover a loop), so made where
    the window is, off the event loop for a large request."""
    if not policy.summary_model:
        return None
    # no carry while some loop is older than max_time_range (the clock decides too):
    # segment afresh then, or sessions with an old loop would never plan a summary
    loops = window.carry.conv.loops if window.carry is not None else segment(messages)
    also = {window.omitted_loops, *counts_of(entries)}
    return Covering(loops, covers(keys, loops, policy.omission_batch, also),
                    messages_bytes(messages))


def _segmented(policy: Policy, messages: list[Message], keys: list[str],
               also: Collection[int] = ()) -> tuple[list[RunLoop], dict[int, str]]:
    """A session's loops, segmented afresh, and their covers: a walk of every message
    (18,000 messages: 216,000 calls to segment, 36,000 to cover at batch 1), so off the
    event loop for a large session."""
    loops = segment(messages)
    return loops, covers(keys, loops, policy.omission_batch, also)


def next_call(previous: str | None, budget: int, count: Callable[[str], int]
              ) -> tuple[str, int]:
    """How an LLM summary rolls on, and the output tokens it may use: ``append`` to
    ``previous`` while at least ``MIN_APPEND_SHARE`` of the budget is left after it, else
    ``merge`` everything into ``CONDENSE_SHARE`` of the budget."""
    if previous is not None:
        room = budget - count(previous + LATER)
        if room >= budget * MIN_APPEND_SHARE:
            return "append", room
    return "merge", max(1, int(budget * CONDENSE_SHARE))


def due(policy: Policy, e: int, closed: int, pressed: bool) -> bool:
    """Whether the summary of the first ``e`` loops is made now, with ``closed`` loops
    closed: one loop before the event that omits them by ``max_run_loops`` (a conversation
    that ends sooner never pays for it, and the summary has a whole loop to arrive in), or as
    soon as they closed while the window is past its target (``pressed``: an omission over
    the threshold may come with any request)."""
    return closed >= e and (pressed or closed >= event_at(policy, e) - 1)


def event_at(policy: Policy, e: int) -> int:
    """The closed loops at the request whose omission (by ``max_run_loops``) reaches ``e``."""
    return max(e, policy.max_run_loops + 1 + e - policy.omission_batch)


def field(e: int, cover: str) -> str:
    return f"{e}:{cover}"


def counts_of(entries: dict[str, str]) -> set[int]:
    """The loop counts the stored summaries were made for (any branch's): where omissions
    by age stopped are among them, and a later summary rolls on from those."""
    out = set()
    for name in entries:
        e, sep, _ = name.partition(":")
        if sep and e.isdigit():
            out.add(int(e))
    return out


def omit_field(e: int, cover: str) -> str:
    return f"{OMIT}{field(e, cover)}"


def model_field(e: int, cover: str) -> str:
    return f"{MODEL}{field(e, cover)}"


def uses_model(policy: Policy) -> bool:
    """Whether the policy's summaries are a model's (made in the background, at its speed)."""
    return bool(policy.summary_model) and policy.summary_model != EXTRACTIVE_MODEL


def newest_model(entries: dict[str, str], cover: dict[int, str], upto: int
                 ) -> tuple[int, str] | None:
    """The newest model summary stored of at most ``upto`` loops (its count and field)."""
    # by what is stored, not by every cover: at batch 1 there is one a loop
    models = {name[len(MODEL):]: "" for name in entries if name.startswith(MODEL)}
    for k in sorted(counts_of(models), reverse=True):
        if 0 < k <= upto and k in cover and (name := model_field(k, cover[k])) in entries:
            return k, name
    return None


def base_of(policy: Policy, entries: dict[str, str], cover: dict[int, str], e: int
            ) -> tuple[int, str] | None:
    """What the summary of the first ``e`` loops rolls from (its loop count and field): for
    a model, the newest model summary below ``e`` while the loops after it are at most
    ``CALL_BATCHES`` batches (its input is bounded by the policy, never by how far the
    summariser fell behind), else the newest window summary below ``e`` (a model's summary
    with a digest after it: bounded by ``summary_max_tokens``); for the extractive digest,
    the newest stored below ``e``."""
    if not uses_model(policy):
        prev = previous_of(entries, cover, e)
        return None if prev is None else (prev[0], field(*prev))
    bound = CALL_BATCHES * policy.omission_batch
    model = newest_model(entries, cover, e - 1)
    if model is not None and e - model[0] <= bound:
        return model
    shown = previous_of(entries, cover, e)
    if shown is not None and (model is None or shown[0] > model[0]):
        return shown[0], field(*shown)
    return model


def compactions(entries: dict[str, str], cover: dict[int, str]) -> Compactions:
    """The omissions asked for this conversation's lineage: (request point, loops)."""
    out = [(int(raw), e) for e, c in cover.items() if (raw := entries.get(omit_field(e, c)))]
    return tuple(sorted(out))


def made(entries: dict[str, str], e: int, cover: str) -> bool:
    """Whether a summary of the first ``e`` loops is stored (not missing, not late)."""
    return (entries.get(field(e, cover)) or LATE) != LATE


def stands_in(raw: str) -> bool:
    """Whether a window's summary is (in part) the digest standing in for a model's."""
    try:
        rec = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return False
    return isinstance(rec, dict) and rec.get("digest_loops") is not None


def previous_of(entries: dict[str, str], cover: dict[int, str], e: int
                ) -> tuple[int, str] | None:
    """The newest summary stored below ``e`` (its loop count and cover): what e rolls from."""
    # by what is stored, not by every cover: at batch 1 there is one a loop
    for k in sorted(counts_of(entries), reverse=True):
        if k < e and k in cover and made(entries, k, cover[k]):
            return k, cover[k]
    return None


def pick(entries: dict[str, str], cover: dict[int, str]) -> Summaries:
    """The summaries stored for this conversation's lineage, by loop count."""
    return tuple((e, str(orjson.loads(entries[field(e, c)])["text"]))
                 for e, c in sorted(cover.items()) if made(entries, e, c))


def loops_text(messages: Sequence[Message], loops: Sequence[RunLoop]) -> str:
    """The loops a summary call adds, each clipped to ``LOOP_CHARS``."""
    parts = []
    for lp in loops:
        lines = [f"{m.get('role')}: {message_text(m)}" for m in messages[lp.start:lp.end]]
        text = "\n".join(lines)
        if len(text) > LOOP_CHARS:
            text = text[: LOOP_CHARS // 2] + "\n…\n" + text[-LOOP_CHARS // 2:]
        parts.append(f"[turn {lp.index + 1}]\n{text}")
    return "\n\n".join(parts)


NOT_HELD = ("Not held in this summary ({search} finds them, {recall} returns any tool "
            "result):")
NOT_HELD_IDS = 200  # of the identifiers a summary no longer holds, kept in its record


def not_held(text: str, previous: str | None, sources: Sequence[str],
             skipped: tuple[int, int] | None, budget: int, count: Callable[[str], int],
             search: str = "search_history", recall: str = "recall_tool_call"
             ) -> tuple[str, list[str]]:
    """A model's summary as stored: within ``budget`` tokens (its text cut at a line when
    the model wrote more), and saying what it no longer holds — the loops the call was
    not given (``skipped``: first and last, 0-based) and the identifiers of ``previous``
    (when it was condensed, not appended to) and of ``sources`` (the skipped loops' text)
    it lacks, as many as fit, then how many more (what the model left out of the loops it
    was given is its own reading of them, not said). ``budget`` holds the note's head
    (``summary_max_tokens`` is at least 64). Returns the text and every identifier lost."""
    held = set(identifiers(text))
    lost: list[str] = []
    seen: set[str] = set()
    condensed = previous is not None and not text.startswith(previous)
    for src in ([previous] if condensed and previous else []) + list(sources):
        for ident in identifiers(src):
            if ident not in held and ident not in seen:
                seen.add(ident)
                lost.append(ident)
    if not lost and skipped is None:
        return _cut(text, budget, count), lost
    loops = (f"loop {skipped[0]}" if skipped[0] == skipped[1] else
             f"loops {skipped[0]}–{skipped[1]}") if skipped is not None else ""
    head = NOT_HELD.format(search=search, recall=recall)

    def note(k: int) -> str:
        parts = [f"{loops} (the call was not given them)"] if loops else []
        if lost:
            more = len(lost) - k
            ids = " ".join(lost[:k])
            parts.append(f"identifiers {ids}" + (f" and {more} more" if more else "")
                         if k else f"{more} identifiers")
        return f"{head} {'; '.join(parts)}"

    body = _cut(text, max(1, budget - count("\n" + note(0))), count)
    lo, hi = 0, len(lost)
    while lo < hi:  # the most identifiers that fit
        mid = (lo + hi + 1) // 2
        if count(f"{body}\n{note(mid)}") <= budget:
            lo = mid
        else:
            hi = mid - 1
    return f"{body}\n{note(lo)}", lost


def _cut(text: str, budget: int, count: Callable[[str], int]) -> str:
    """``text`` within ``budget`` tokens: whole lines while they fit, else its first words."""
    if count(text) <= budget:
        return text
    lines = text.split("\n")
    while len(lines) > 1 and count("\n".join(lines)) > budget:
        lines.pop()
    out = "\n".join(lines)
    words = out.split(" ")
    while len(words) > 1 and count(" ".join(words)) > budget:
        words = words[: max(1, len(words) * 3 // 4)]
    return " ".join(words)


@dataclass(frozen=True)
class Job:
    """Who a summary is made for: the tenant's policy and upstream, and the caller's key."""

    policy: Policy
    namespace: str
    tenant: str
    label: str
    model: str
    upstream: str
    auth: str | None
    drop_headers: frozenset[str] = frozenset()
    # the upstream as the config had it when ``auth`` was taken: a summary made after a
    # reload moved it is not sent (the key was given for the old one)
    spec: UpstreamSpec | None = None
    retention_days: float | None = None  # the tenant's: what it writes expires with it
    holder: str = ""  # who holds a share of the summary calls (``Caller.holder``)

    @classmethod
    def of(cls, turn: Turn) -> Job:
        c = turn.caller
        assert c.namespace is not None
        return cls(turn.policy, c.namespace, c.tenant.name, c.label, turn.model,
                   c.tenant.upstream, c.upstream_auth, c.drop_headers,
                   c.upstream.spec if c.upstream is not None else None,
                   c.tenant.retention_days, c.holder)


@dataclass(frozen=True)
class _Pending:
    """A summary whose last loop closes with the reply to the request that set it."""

    job: Job
    messages: list[Message]
    held: int  # what the messages hold (``messages_bytes``, counted where the window was)
    keys: list[str]
    e: int
    entries: dict[str, str]
    # what it holds, in bytes: the session's messages above all (a pending summary may
    # outlive every other reference to them)
    size: int = 0

    @classmethod
    def of(cls, job: Job, messages: list[Message], held: int, keys: list[str], e: int,
           entries: dict[str, str]) -> _Pending:
        size = 256 + held + 160 * len(keys) \
            + sum(100 + len(k) + len(v) for k, v in entries.items())
        return cls(job, messages, held, keys, e, entries, size)


class Host(Protocol):
    """What the summariser needs of the app (``state.AppState`` is one): the store, the
    upstreams and their config, the token counter, the metrics, and a way to run work off the
    request path."""

    config: ProxyConfig
    metrics: Metrics
    tokens: TokenCounter
    upstreams: dict[str, UpstreamClient]
    store: RedisStore | None

    def spawn(self, coro: Coroutine[Any, Any, object]) -> object: ...

    def upstream(self, name: str) -> UpstreamClient: ...


class SummaryService:
    """Reads stored summaries for a request, and makes the next one in the background."""

    def __init__(self, state: Host):
        self.state = state
        # failures and pauses per caller (``Job.namespace``: a tenant, a pass-through key):
        # one key that cannot use the summary model pauses no other's summaries. Bounded:
        # pass-through keys are clients'
        budget = (state.config.server.cache_mb << 20) * SHARES["summaries"]

        def part(name: str) -> int:
            return int(budget * SUMMARY_PARTS[name])
        self.failures: ByteLRU[str, int] = ByteLRU(part("failures"), lambda k, v: 100 + len(k))
        self.paused_until: ByteLRU[str, float] = ByteLRU(part("paused_until"),
                                                          lambda k, v: 100 + len(k))
        # per session, the token of a summary lock this process took and Redis did not let
        # it release: its next summary takes that lock over (``lock_summary``) rather than
        # wait out the lock's life, every summary of the session skipped meanwhile
        self.unreleased: ByteLRU[tuple[str, str], str] = ByteLRU(
            part("unreleased"), lambda k, v: 150 + len(k[0]) + len(k[1]) + len(v))
        # per session, a summary the reply to its last request will make due (bounded)
        self.pending: ByteLRU[tuple[str, str], _Pending] = ByteLRU(
            part("pending"), lambda k, v: v.size)
        # per session, the loop count of the summary being made in this process, and the
        # newest one wanted meanwhile (made when it is done)
        self.running: dict[tuple[str, str], int] = {}
        self.wanted: ByteLRU[tuple[str, str], _Pending] = ByteLRU(
            part("wanted"), lambda k, v: v.size)
        # model calls in flight: a process bound and a share of it per tenant
        # (``server.summary_calls``, ``tenant_share``); a session past them waits its turn
        # in ``waiting`` (oldest first), never a failure
        server = state.config.server
        self.calls = Shares("summary calls", server.summary_calls, server.tenant_share,
                            getattr(state, "_refused", None))
        self.waiting: ByteLRU[tuple[str, str], _Pending] = ByteLRU(
            part("waiting"), lambda k, v: v.size)

    def resize(self, budget: float, calls: int, share: float) -> None:
        """The summaries' new share of ``cache_mb``, in bytes, split as at start, and their
        model calls' bound and ``tenant_share`` of it (a reload)."""
        for name in SUMMARY_PARTS:
            cache: ByteLRU[Any, Any] = getattr(self, name)
            cache.resize(int(budget * SUMMARY_PARTS[name]))
        self.calls.resize(calls, share)

    async def stored(self, turn: Turn, session: Session) -> dict[str, str]:
        """What the store holds for the session (fail-open: nothing)."""
        store, ns = self.state.store, turn.caller.namespace
        if not turn.policy.summary_model or store is None or ns is None:
            return {}
        try:
            return await store.summaries(ns, session.id)
        except StoreError:
            return {}

    def failing(self, namespace: str) -> bool:
        """Whether the caller's summaries are failing: the last one failed (or timed out), or
        they are paused after several did."""
        return (self.failures.get(namespace) or 0) > 0 \
            or time.monotonic() < (self.paused_until.get(namespace) or 0.0)

    def after(self, turn: Turn, session: Session, messages: list[Message], keys: list[str],
              window: Window, entries: dict[str, str], covering: Covering | None) -> bool:
        """After a window was built: mark an omission event that found no summary as late,
        and make the summary the next event will want, if its loops have closed. Whether
        the window omits loops whose summary is missing (made late, or never). ``covering``
        is ``covering(...)`` of the same window, made where the window was."""
        policy, ns = turn.policy, turn.caller.namespace
        if covering is None or ns is None or self.state.store is None:
            return False
        loops, cover, nbytes = covering
        e = window.omitted_loops
        # a digest standing in for the model's summary counts as its summary missing: a
        # failing summariser's requests say so (a merely late one's do not: shaping.py)
        missing = e > 0 and e in cover and (not made(entries, e, cover[e]) or (
            uses_model(policy) and stands_in(entries[field(e, cover[e])])))
        if e in cover and field(e, cover[e]) not in entries:
            self.state.metrics.summaries.labels(turn.caller.label, "late").inc()
            self.state.spawn(self._late(ns, session.id, field(e, cover[e]),
                                        turn.caller.tenant.retention_days))
        nxt = (e // policy.omission_batch + 1) * policy.omission_batch  # an age may stop off it
        # one pass in C: every loop is a cover at batch 1, and a large request's planning
        # runs on the event loop
        closed = len(loops) - [lp.final_position for lp in loops].count(None)
        pressed = window.budget is not None \
            and window.tokens_out > policy.target * window.budget.working
        if uses_model(policy):
            # the newest cover whose loops have closed and is due: a summariser that fell
            # behind skips to it (one call rolls on from the newest summary it finished)
            due_now = [k for k in cover if k >= nxt and due(policy, k, closed, pressed)
                       and model_field(k, cover[k]) not in entries]
            if due_now:
                nxt = max(due_now)
        wanted = model_field(nxt, cover[nxt]) if uses_model(policy) and nxt in cover \
            else field(nxt, cover[nxt]) if nxt in cover else None
        if wanted is not None and wanted not in entries and due(policy, nxt, closed, pressed):
            self._spawn(Job.of(turn), session.id, messages, nbytes, keys, loops, cover, nxt,
                        entries)
        elif loops and loops[-1].final_position is None and closed + 1 >= nxt \
                and (pressed or event_at(policy, nxt) <= closed + 1):
            # the reply to this request closes the last loop the summary needs, and its event
            # may come with the very next request (max_run_loops below the batch): start it
            # as soon as the reply is in (``replied``), while the user reads and types
            self.pending[(ns, session.id)] = _Pending.of(Job.of(turn), messages, nbytes,
                                                      keys, nxt, entries)
        return missing

    def replied(self, ns: str, session_id: str, reply: Message, key: str) -> None:
        """A reply was recorded: if it closes the loops a pending summary waits for, make it."""
        p = self.pending.pop((ns, session_id), None)
        if p is None or tool_calls_of(reply):
            return
        messages, keys = [*p.messages, reply], [*p.keys, key]
        if is_large(0, len(messages)):  # segmenting and covering it walk every message
            self.state.spawn(self._replied(p, session_id, messages, keys))
        else:
            self._closed(p, session_id, messages, keys,
                         *_segmented(p.job.policy, messages, keys))

    async def _replied(self, p: _Pending, session_id: str, messages: list[Message],
                       keys: list[str]) -> None:
        self._closed(p, session_id, messages, keys,
                     *await offload(True, lambda: _segmented(p.job.policy, messages, keys)))

    def _closed(self, p: _Pending, session_id: str, messages: list[Message], keys: list[str],
                loops: Sequence[RunLoop], cover: dict[int, str]) -> None:
        if p.e in cover and field(p.e, cover[p.e]) not in p.entries \
                and model_field(p.e, cover[p.e]) not in p.entries:
            nbytes = p.held + message_bytes(messages[-1]) + MESSAGE_OVERHEAD  # and the reply
            self._spawn(p.job, session_id, messages, nbytes, keys, loops, cover, p.e,
                        p.entries)

    def _spawn(self, job: Job, session_id: str, messages: list[Message], nbytes: int,
               keys: list[str], loops: Sequence[RunLoop], cover: dict[int, str], e: int,
               entries: dict[str, str]) -> None:
        """Make the summary of the first ``e`` loops, unless one of this session's is being
        made in this process: then it is made when that one is done, if still the newest
        wanted (at most one summary per session in flight, always for the newest cover)."""
        at = (job.namespace, session_id)
        if at in self.running:
            held = self.wanted.get(at)
            if held is None or held.e <= e:
                self.wanted[at] = _Pending.of(job, messages, nbytes, keys, e, entries)
            return
        self.running[at] = e
        self.state.spawn(self._run(job, session_id, messages, nbytes, keys, loops, cover, e,
                                   entries))

    async def _run(self, job: Job, session_id: str, messages: list[Message], nbytes: int,
                   keys: list[str], loops: Sequence[RunLoop], cover: dict[int, str], e: int,
                   entries: dict[str, str]) -> None:
        at = (job.namespace, session_id)
        held = uses_model(job.policy)
        if held:
            try:
                self.calls.take(job.holder, 1, "summary calls")
            except (TenantOverShare, ProxyFull):
                # its tenant (or the process) has its share of calls in flight: it waits
                # its turn, and the newest cover wanted meanwhile replaces it
                self.running.pop(at, None)
                p = self.wanted.pop(at, None)
                self.waiting[at] = p if p is not None and p.e > e else _Pending.of(
                    job, messages, nbytes, keys, e, entries)
                self.state.metrics.summaries.labels(job.label, "deferred").inc()
                return
        try:
            await self.make(job, session_id, messages, loops, e, cover[e],
                            base_of(job.policy, entries, cover, e), entries)
        finally:
            if held:
                self.calls.give(job.holder)
            self.running.pop(at, None)
            nxt = self.wanted.pop(at, None)
            if nxt is not None and nxt.e > e:
                self.state.spawn(self._again(session_id, nxt))
            elif held:
                self.wake()

    def wake(self) -> None:
        """A call ended (a summary's, or memory's embedding call, which hold the same
        shares): the oldest waiting session whose tenant has room in its share is
        made next (one per call ended)."""
        for at in list(self.waiting)[:WAKE_SCAN]:
            p = self.waiting.get(at)
            if p is None or at in self.running:
                continue
            if self.calls.held(p.job.holder) < self.calls.per_holder \
                    and self.calls.in_use < self.calls.total:
                del self.waiting[at]
                self.state.spawn(self._again(at[1], p))
                return

    async def _again(self, session_id: str, p: _Pending) -> None:
        """The newest summary wanted while another was made: rolled from what is stored now
        (the one just finished among it)."""
        store = self.state.store
        assert store is not None
        try:
            entries = await store.summaries(p.job.namespace, session_id)
        except StoreError:
            entries = p.entries
        also = counts_of(entries)
        loops, cover = await offload(is_large(0, len(p.messages)), lambda: _segmented(
            p.job.policy, p.messages, p.keys, also))
        name = model_field if uses_model(p.job.policy) else field
        if p.e in cover and name(p.e, cover[p.e]) not in entries:
            self._spawn(p.job, session_id, p.messages, p.held, p.keys, loops, cover, p.e,
                        entries)

    async def _late(self, ns: str, session_id: str, name: str,
                    retention: float | None) -> None:
        assert self.state.store is not None
        try:
            await self.state.store.put_summary(ns, session_id, name, LATE, retention)
        except StoreError:
            pass

    async def make(self, job: Job, session_id: str, messages: list[Message],
                   loops: Sequence[RunLoop], e: int, cover: str,
                   previous: tuple[int, str] | None, entries: dict[str, str]) -> str | None:
        """Summary of loops [0, e), rolled from ``previous`` (its loop count and field: a
        model's summary or a window's, ``base_of``). A model's is stored as the model's
        (``model_field``, which later windows take the newest of) and, when its event has not
        come yet, as the window's for that event (``field``)."""
        store, ns, policy = self.state.store, job.namespace, job.policy
        tl, tenant = job.label, job.tenant
        assert store is not None and policy.summary_model
        if time.monotonic() < (self.paused_until.get(ns) or 0.0):
            self.state.metrics.summaries.labels(tl, "backoff").inc()
            return None
        at = (ns, session_id)
        try:
            token = await store.lock_summary(ns, session_id, policy.summary_timeout_s + 5,
                                             self.unreleased.get(at))
        except StoreError:
            self._unstored(tl, tenant, session_id, "lock")
            return None
        if not token:
            return None  # another replica (or worker) is making it
        self.unreleased.pop(at, None)
        try:
            return await self._locked(job, session_id, messages, loops, e, cover, previous,
                                      entries)
        finally:
            # released however the making ended; one Redis did not let go of is taken over
            # by the next (a lock left behind stopped every later summary of the session
            # for the lock's life, silently)
            if not await store.unlock_summary(ns, session_id, token):
                self.unreleased[at] = token

    async def _locked(self, job: Job, session_id: str, messages: list[Message],
                      loops: Sequence[RunLoop], e: int, cover: str,
                      previous: tuple[int, str] | None, entries: dict[str, str]
                      ) -> str | None:
        """``make``'s work, with the session's summary lock held."""
        store, ns, policy = self.state.store, job.namespace, job.policy
        tl, tenant = job.label, job.tenant
        assert store is not None and policy.summary_model
        started = time.perf_counter()
        prev_e, prev_text = _rolled_from(entries, previous)
        new = loops[prev_e:e]
        skipped: Sequence[RunLoop] = ()
        if policy.summary_model != "extractive":
            bound = CALL_BATCHES * policy.omission_batch  # a call's input: by the policy
            skipped, new = new[:-bound] if len(new) > bound else (), new[-bound:]
        enc, _ = self.state.tokens.encoding(job.model, None)

        def count(text: str) -> int:
            return self.state.tokens.text(enc, text)
        # what the new loops hold is read whole (their tool results too): off the event loop
        # when it is large, as a large request is — this runs beside every other request
        # by its messages first (the loops' span, not a walk of the loops: at batch 1 a
        # session's first summary reads thousands), then, when few, their sizes
        read = (*skipped, *new)
        first, last = (read[0].start, read[-1].end) if read else (0, 0)
        large = is_large(0, last - first) or is_large(
            sum(len(message_text(m)) for m in messages[first:last]))
        lost: list[str] = []
        try:
            if policy.summary_model == "extractive":
                text = await offload(large, lambda: digest(policy, prev_text, messages, new,
                                                           count))
                usage: dict[str, int] = {}
                summarizer = EXTRACTIVE
            else:
                turns = await offload(large, lambda: loops_text(messages, new))
                async with asyncio.timeout(policy.summary_timeout_s):  # never swallows
                    text, usage = await self._llm(job, prev_text, turns, count)  # a cancel
                summarizer = f"{policy.summary_model} ({PROMPT_VERSION})"
                # what it no longer holds is said, and the whole stays in its budget
                span = (skipped[0].index, skipped[-1].index) if skipped else None
                answer = text
                text, lost = await offload(large, lambda: not_held(
                    answer, prev_text, [message_text(m) for lp in skipped
                                        for m in messages[lp.start:lp.end]],
                    span, policy.summary_max_tokens, count))
        except Exception as exc:  # noqa: BLE001 - a summary failure never reaches a client
            outcome = "timeout" if isinstance(exc, TimeoutError) else "error"
            self._failed(ns, tl, outcome, policy.summary_backoff_s)
            log.warning("summary failed: the window stays without one",
                        extra={"tenant": tenant, "session": session_id, "outcome": outcome,
                               "error": type(exc).__name__})
            return None
        ms = round((time.perf_counter() - started) * 1000, 1)
        self.failures[ns] = 0
        metrics = self.state.metrics
        metrics.summary_seconds.labels(tl).observe(ms / 1000)
        for kind, n in (("prompt", usage.get("prompt_tokens", 0)),
                        ("completion", usage.get("completion_tokens", 0))):
            if n:
                metrics.summary_tokens.labels(tl, kind).inc(n)
        record = _record(text, summarizer, prev_e, e, prev_text, usage, ms)
        if policy.summary_model != "extractive" and (lost or skipped):
            record["not_held"] = {"loops": [skipped[0].index, skipped[-1].index]
                                  if skipped else None, "identifiers": lost[:NOT_HELD_IDS],
                                  "identifiers_lost": len(lost)}
        try:
            if policy.summary_model != "extractive":
                record["input_bytes"] = usage.get("input_bytes")
                await store.put_summary(ns, session_id, model_field(e, cover),
                                        orjson.dumps(record).decode(), job.retention_days)
            await self._put(ns, session_id, field(e, cover), record, job.retention_days)
        except StoreError:
            self._unstored(tl, tenant, session_id, "write")
            return None
        metrics.summaries.labels(tl, "ok").inc()
        return text

    def _unstored(self, label: str, tenant: str, session_id: str, step: str) -> None:
        """A summary Redis did not take (its lock or its write): counted and said; the
        window goes on with the digest, and the next omission event makes it again."""
        self.state.metrics.summaries.labels(label, "store").inc()
        log.warning("summary not stored: Redis refused or was slow; the window keeps the "
                    "digest", extra={"tenant": tenant, "session": session_id, "step": step})

    async def _put(self, ns: str, session_id: str, name: str, record: dict[str, Any],
                   retention: float | None) -> bool:
        """Store a summary and its compression record; whether it came first (``in_time``:
        neither it nor its lateness was there yet)."""
        store = self.state.store
        assert store is not None
        in_time = await store.put_summary(ns, session_id, name, orjson.dumps(record).decode(),
                                          retention)
        await store.add_record(ns, session_id, {"kind": "summary", "ts": int(
            time.time() * 1000), **record, "summary_chars": len(record["text"]),
            "in_time": in_time}, retention)
        return in_time

    def keep_inline(self, turn: Turn, session: Session, made: Made) -> None:
        """Store an extractive summary the window made inline (``inline_digest``), as the
        background would have; a store that fails loses only the record: the next request
        makes the same digest again."""
        ns, label = turn.caller.namespace, turn.caller.label
        if ns is None or self.state.store is None:
            return

        # a model's summary planned for this event (a batch's) that its event came before
        covered = made.record.get("digest_loops") is not None and uses_model(turn.policy) \
            and made.record["loops"][1] % turn.policy.omission_batch == 0

        async def put() -> None:
            try:
                if await self._put(ns, session.id, made.name, made.record,
                                   turn.caller.tenant.retention_days):
                    # a model's summary its event came before: the digest stands in for it
                    self.state.metrics.summaries.labels(label, "late" if covered
                                                        else "ok").inc()
            except StoreError:
                pass
        self.state.spawn(put())

    def _failed(self, namespace: str, label: str, outcome: str, backoff_s: float) -> None:
        self.state.metrics.summaries.labels(label, outcome).inc()
        failed = (self.failures.get(namespace) or 0) + 1
        self.failures[namespace] = failed
        if failed >= FAILURES_BEFORE_BACKOFF:
            self.paused_until[namespace] = time.monotonic() + backoff_s
            self.failures[namespace] = 0

    async def _llm(self, job: Job, previous: str | None, turns: str,
                   count: Callable[[str], int]) -> tuple[str, dict[str, int]]:
        """One chat completion through the tenant's upstream (or ``summary_upstream``) that
        rolls ``previous`` on: an addition appended to it, or a merge (``next_call``)."""
        from ..pipeline.upstream import json_headers, upstream_headers

        policy = job.policy
        kind, room = next_call(previous, policy.summary_max_tokens, count)
        prompt = (APPEND if kind == "append" else MERGE).format(
            max_tokens=room, sections=SECTIONS, previous=previous or "(none)", turns=turns)
        body = {"model": policy.summary_model, "max_tokens": room,
                "messages": [{"role": "user", "content": prompt}]}
        auth, name = job.auth, job.upstream
        if policy.summary_upstream and policy.summary_upstream != job.upstream:
            # another upstream: called with its own key only, never the tenant's or the
            # client's (config validation refuses one without a key)
            name = policy.summary_upstream
            spec = self.state.config.upstreams.get(name)
            if spec is None or not spec.api_key:
                raise RuntimeError(f"summary upstream {name!r} has no key of its own")
            auth = f"Bearer {spec.api_key}"
        client = self.state.upstream(name)
        if name == job.upstream and job.spec is not None and client.spec != job.spec:
            raise RuntimeError(f"upstream {name!r} changed since the request this summary is "
                               "for: it is made from the next one")
        headers = json_headers(upstream_headers([], auth, job.drop_headers))
        raw = orjson.dumps(body)
        resp = await client.request("POST", "/chat/completions", headers, raw)
        data: Any = orjson.loads(await resp.read(SUMMARY_ANSWER_BYTES))
        if resp.status != 200 or not isinstance(data, dict):
            raise RuntimeError(f"the summary call answered {resp.status}")
        text = data["choices"][0]["message"]["content"]
        if not isinstance(text, str) or not text.strip():
            raise RuntimeError("the summary call answered no text")
        usage = data.get("usage") or {}
        text = f"{previous}{LATER}{text.strip()}" if kind == "append" else text.strip()
        return text, {**{k: int(usage.get(k) or 0) for k in ("prompt_tokens",
                                                              "completion_tokens")},
                      "input_bytes": len(raw)}

    async def compact(self, job: Job, session_id: str, messages: list[Message],
                      keys: list[str]) -> tuple[list[tuple[int, str | None]], int]:
        """The admin's "compact now": summaries for every omission point of a stored
        conversation that has none yet, made now, and the closed loops the newest summary
        covers omitted from the next request on. ``messages`` are the stored conversation
        with the proxy's exchanges spliced back (as a request's window sees it). Returns the
        summaries made (loop count, text or None) and the loops omitted (0: none)."""
        store = self.state.store
        assert store is not None
        loops = segment(messages)
        cover = covers(keys, loops, job.policy.omission_batch)
        out: list[tuple[int, str | None]] = []
        for e, c in sorted(cover.items()):
            entries = await store.summaries(job.namespace, session_id)
            if field(e, c) in entries:
                continue  # made, or late: the event went out without it, and stays so
            out.append((e, await self.make(job, session_id, messages, loops, e, c,
                                           base_of(job.policy, entries, cover, e), entries)))
        entries = await store.summaries(job.namespace, session_id)
        ready = [e for e, c in cover.items() if made(entries, e, c)]
        if not ready:
            return out, 0
        e = max(ready)
        await store.put_summary(job.namespace, session_id, omit_field(e, cover[e]),
                                str(len(messages)), job.retention_days)
        return out, e


@dataclass(frozen=True)
class Made:
    """A summary made inline: its field (what it covers) and its record."""

    name: str
    record: dict[str, Any]


def digest(policy: Policy, previous: str | None, messages: Sequence[Message],
           loops: Sequence[RunLoop], count: Callable[[str], int],
           max_tokens: int | None = None) -> str:
    """The extractive summary rolled from ``previous`` over ``loops`` (for a model's
    summary, what replay shows in its place, and what the window shows for the loops a
    model's summary does not cover yet: ``summary_lines`` is the extractive one's), within
    ``max_tokens`` (``summary_max_tokens`` by default). Identifiers the system prompt holds
    are left out: the model sees them anyway."""
    lines_too = policy.summary_lines or policy.summary_model != "extractive"
    known = "\n".join(text_of(m.get("content")) for m in messages[:preamble_end(messages)])
    return roll(previous, [messages[lp.start:lp.end] for lp in loops],
                policy.summary_max_tokens if max_tokens is None else max_tokens, count,
                lines_too, known)


def inline_digest(policy: Policy, entries: dict[str, str], cover: dict[int, str],
                  loops: Sequence[RunLoop], messages: Sequence[Message],
                  count: Callable[[str], int], aged: int = 0, e: int | None = None
                  ) -> Made | None:
    """The summary this request's omission event needs when the store has none for it
    (neither made nor marked late), made now: pure, bounded by ``summary_max_tokens`` and
    made in a millisecond, so the window takes it now rather than going without it until
    the next event. With the extractive summariser, the digest of the loops left out; with
    a model, whose summary is never made on the request path, the newest model summary
    finished so far followed by the digest of the loops it does not cover yet (``cover``):
    every omitted loop is said something about from the first omission on. Later requests
    of the same event make the same text, whether or not the store has it yet. ``aged``:
    the loops an omission by age leaves out (``window.builder.aged_loops``), which no batch
    plans for; ``e``: the loops the window omits, when known (an omission over the
    threshold or asked for can stop off the batches)."""
    if not policy.summary_model or not loops:
        return None
    if e is None:
        e = max(batch_omission(policy, len(loops) - 1), aged)
    if e not in cover or field(e, cover[e]) in entries:
        return None
    started = time.perf_counter()
    if not uses_model(policy):
        prev_e, prev_text = _rolled_from(entries, base_of(policy, entries, cover, e))
        text = digest(policy, prev_text, messages, loops[prev_e:e], count)
        ms = round((time.perf_counter() - started) * 1000, 1)
        return Made(field(e, cover[e]), _record(text, EXTRACTIVE, prev_e, e, prev_text, {},
                                                ms))
    text, record = cover_text(policy, entries, cover, loops, messages, count, e)
    record["latency_ms"] = round((time.perf_counter() - started) * 1000, 1)
    return Made(field(e, cover[e]), record)


def cover_text(policy: Policy, entries: dict[str, str], cover: dict[int, str],
               loops: Sequence[RunLoop], messages: Sequence[Message],
               count: Callable[[str], int], e: int) -> tuple[str, dict[str, Any]]:
    """What the window shows for the first ``e`` loops while the model's summary of them is
    not in: the newest model summary finished (of the first k loops), then the digest of
    loops k..e−1 under a label naming them. The previous event's text is kept and grown
    (append-only: the provider's cached prefix holds) while no newer model summary came;
    a newer one replaces the digest it stands for when that pays (``swap_pays``), or when
    the kept text would have been rewritten anyway (no room left to append)."""
    model = newest_model(entries, cover, e)
    k, model_text, by = 0, None, None
    if model is not None:
        rec = orjson.loads(entries[model[1]])
        k, model_text, by = model[0], str(rec["text"]), str(rec.get("summarizer"))
    swap = _covered(policy, messages, loops, model_text, k, e, count)
    prev = previous_of(entries, cover, e)
    if prev is not None:
        rec = orjson.loads(entries[field(*prev)])
        base = rec.get("model_loops")
        prev_k = int(base[1]) if isinstance(base, list) and len(base) == 2 else 0
        if rec.get("digest_loops") is not None and prev_k <= k:
            old = str(rec["text"])
            grown = f"{old}\n{_digest_block(policy, messages, loops, prev[0], e, count)}"
            if count(grown) <= policy.summary_max_tokens and (
                    prev_k == k or not swap_pays(policy, old, grown, swap, count)):
                return grown, _cover_record(grown, rec.get("model_by"), prev_k, e, policy)
    return swap, _cover_record(swap, by, k, e, policy)


def swap_pays(policy: Policy, old: str, kept: str, swap: str,
              count: Callable[[str], int]) -> bool:
    """Whether a model summary that came since the last event pays for replacing the digest
    it stands for, priced as the window's other levers are (``plan._Replay.pays``): the
    swap must make the note no longer than keeping it would, and with
    ``payback_requests`` what it saves over that many requests at the cached price must pay
    for what it makes the provider read again at the write price (the last event's text
    after the part both share: everything after the note is read again at an omission
    event either way)."""
    from ..window.plan import CACHE_WRITE, CACHED_READ

    saved = count(kept) - count(swap)
    if saved < 0:
        return False
    horizon = policy.payback_requests
    if horizon is None:
        return True
    shared = 0
    for x, y in zip(old, swap, strict=False):
        if x != y:
            break
        shared += 1
    reread = count(old[shared:]) if shared < len(old) else 0
    return saved * (CACHE_WRITE + horizon * CACHED_READ) >= (CACHE_WRITE - CACHED_READ) * reread


def _digest_block(policy: Policy, messages: Sequence[Message], loops: Sequence[RunLoop],
                  first: int, last: int, count: Callable[[str], int],
                  room: int | None = None) -> str:
    """The digest of loops [first, last) under a label naming them, within ``room``
    tokens (the summary budget by default)."""
    label = DIGEST_LABEL.format(first=first + 1, last=last)
    room = policy.summary_max_tokens if room is None else room
    body = digest(policy, None, messages, loops[first:last], count,
                  max(1, room - count(label) - 1)) if last > first else ""
    return f"{label}\n{body}" if body else label


def _covered(policy: Policy, messages: Sequence[Message], loops: Sequence[RunLoop],
             model_text: str | None, k: int, e: int, count: Callable[[str], int]) -> str:
    """The model's summary of the first ``k`` loops, then the digest of loops k..e−1."""
    if model_text is None:
        return _digest_block(policy, messages, loops, 0, e, count)
    if k >= e:
        return model_text
    room = max(policy.summary_max_tokens - count(model_text) - 1,
               int(policy.summary_max_tokens * MIN_APPEND_SHARE))
    return f"{model_text}\n{_digest_block(policy, messages, loops, k, e, count, room)}"


def _cover_record(text: str, model_by: str | None, k: int, e: int, policy: Policy
                  ) -> dict[str, Any]:
    """A window summary's record: what it covers in all (``loops``), by the model's summary
    (``model_loops``) and by the digest (``digest_loops``)."""
    return {"text": text, "summarizer": f"{EXTRACTIVE} after {model_by}" if model_by
            else EXTRACTIVE, "loops": [0, e], "model_loops": [0, k] if k else None,
            "model_by": model_by, "digest_loops": [k, e] if e > k else None,
            "appended": False, "tokens_in": None, "tokens_out": None, "latency_ms": 0.0,
            "model": policy.summary_model}


def _rolled_from(entries: dict[str, str], base: tuple[int, str] | None
                 ) -> tuple[int, str | None]:
    """The loop count and text of the summary a new one rolls from (``base``: its loop
    count and field; none: 0, None)."""
    if base is None or base[1] not in entries:
        return 0, None
    return base[0], str(orjson.loads(entries[base[1]])["text"])


def _record(text: str, summarizer: str, prev_e: int, e: int, prev_text: str | None,
            usage: dict[str, int], ms: float) -> dict[str, Any]:
    return {"text": text, "summarizer": summarizer, "loops": [prev_e, e],
            "appended": bool(prev_text) and text.startswith(str(prev_text)),
            "tokens_in": usage.get("prompt_tokens"),
            "tokens_out": usage.get("completion_tokens"), "latency_ms": ms}


def summaries_of(policy: Policy, entries: dict[str, str], cover: dict[int, str] | None
                 ) -> tuple[Summaries, Compactions]:
    """What a request's window may show: the stored summaries of its lineage (``cover``:
    what each loop count covers, ``covers``), and the omissions asked for it."""
    if not policy.summary_model or not entries or cover is None:
        return (), ()
    return pick(entries, cover), compactions(entries, cover)
