"""Proxy-owned tools: their definitions, their execution, and splicing their exchanges back.

The model sees ``recall_tool_call`` and ``search_history`` only when the window elided or
omitted something. The proxy answers them itself; the client never sees these calls. When the
model mixes them with the client's own calls in one message, the client gets only its calls and
the proxy keeps its part, to splice back when the client's next request arrives.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import orjson
import tiktoken

from ..conversation.messages import (
    Message,
    ToolCall,
    message_hash,
    message_refs,
    message_text,
    text_of,
    tool_calls_of,
)
from ..conversation.runloops import segment
from ..conversation.segments import Segment
from ..errors import StoreError
from ..window.names import decoded, holds
from .memory import CANDIDATES, Found, conversation_segments, hybrid
from .offload import is_large, offload
from .tokens import TokenCounter

RECALL = "recall_tool_call"
SEARCH = "search_history"
_WORD = re.compile(r"[A-Za-z0-9_]{2,}|[^\sA-Za-z0-9_]", re.UNICODE)
SNIPPET_CHARS = 240
MIN_INFIX = 4  # a query term this long matches inside longer words when none is equal
MIN_PHRASE = 3  # a query this long is also looked for verbatim ("2.0", "n>1")
PHRASE_BONUS = 1000.0  # above any sum of term scores: verbatim matches first
MAX_INFIX_TERMS = 8  # of a query's terms, looked for inside words (each scans the vocabulary)
# The model's arguments are request content too: what one search may cost is bounded by the
# corpus it reads (each message read once per request), whatever the query.
MAX_QUERY_CHARS = 1_000  # of a query, read; the answer says when the rest was not
MAX_QUERY_TERMS = 32  # distinct terms ranked by (the first ones)
MAX_CALLS = 32  # of the proxy's tools, answered per request; later calls are refused
# a search hit's segment, opened around it by the recall tool (long-term memory)
SEGMENT_REF, SEGMENT_REF_CHARS = "s:", 8
EXPAND_SEGMENTS = 3  # each side of the hit, of its loop
CUT_NOTE = ("\n[runloop-proxy] cut here: the context window has room for {room} more tokens "
            "of this result's {tokens}; {search} finds a line of the rest")
EXPAND_CHARS = 6_000  # of what an opened segment shows in all


def _function(name: str, kind: str) -> dict[str, Any]:
    # Names and parameters only: these ride along in every request of a session with client
    # tools, from its first, and their cost is what makes a short session cost more than
    # without the proxy (bench/loss_sources.py). Every note the window shows that hides
    # something says which tool returns it and with what ("recall_tool_call(call_id="…")
    # returns it", "search_history(query) searches them"), so a description repeats the
    # name: 59 tokens with sentences, 41 with "Earlier result by id" / "Search all turns",
    # 32 (gpt-4o's rendering) without.
    param = "call_id" if kind == RECALL else "query"
    return {"name": name,
            "parameters": {"type": "object", "properties": {param: {"type": "string"}},
                           "required": [param]}}


def definitions_tokens(counter: TokenCounter, enc: tiktoken.Encoding) -> int:
    """What the proxy's tools add to a prompt that already has tools (both counts cached)."""
    return counter.tools(enc, ProxyTools.for_request(None).definitions()) \
        - counter.tools_frame(enc)


@dataclass(frozen=True)
class ProxyTools:
    """The proxy's tool names for one request: renamed if the client already uses a name."""

    names: dict[str, str]  # name as the model sees it -> RECALL | SEARCH

    @classmethod
    def for_request(cls, client_tools: list[dict[str, Any]] | None) -> ProxyTools:
        """The names for a request whose tools are ``client_tools`` (``Turn.chat_tools``:
        chat's form, ``{"function": {"name"}}``; a tool in another form, ``{"name"}``, such
        as a provider's own, takes its name too)."""
        taken = {str(t["function"].get("name")) if isinstance(t.get("function"), dict)
                 else str(t.get("name")) for t in client_tools or [] if isinstance(t, dict)}
        names: dict[str, str] = {}
        for kind in (RECALL, SEARCH):
            name = kind
            k = 1
            while name in taken:
                name = f"runloop_{kind}" if k == 1 else f"runloop_{kind}_{k}"
                k += 1
            names[name] = kind
        return cls(names)

    @classmethod
    def none(cls) -> ProxyTools:
        """No tool of the proxy's: every call is the client's."""
        return cls({})

    def name_of(self, kind: str) -> str:
        return next(name for name, k in self.names.items() if k == kind)

    @property
    def window_names(self) -> tuple[str, str]:
        """(recall, search) as the window's notes must name them."""
        return self.name_of(RECALL), self.name_of(SEARCH)

    def functions(self) -> list[dict[str, Any]]:
        """Name, description and parameters of each tool (an adapter wraps them its way)."""
        return [_function(name, kind) for name, kind in self.names.items()]

    def definitions(self) -> list[dict[str, Any]]:
        """The tools in chat-completions form (how they are counted, whatever the API)."""
        return [{"type": "function", "function": f} for f in self.functions()]

    def owns(self, call: ToolCall) -> bool:
        return (call.get("function") or {}).get("name") in self.names


def splice_internal(messages: list[Message], keys: list[str], chains: list[str],
                    internal: dict[str, dict[str, Any]]) -> tuple[list[Message], list[str],
                                                                  frozenset[str]]:
    """Put the proxy's stored tool exchanges back where they happened.

    ``internal`` maps the chain hash at a client-visible assistant message (``chains``: those
    of ``messages`` — a message in its lineage, so a sibling conversation that got the same
    reply never finds another's exchange; an echo with fields of the client's own still
    matches) to ``{"before": [...], "replace": msg | None, "after": [...]}``. Returns the
    messages, their keys and the call ids of the spliced proxy results (kept visible for the
    rest of the loop).
    """
    if not internal:
        return messages, keys, frozenset()
    out: list[Message] = []
    out_keys: list[str] = []
    protected: set[str] = set()
    pending_after: list[Message] = []

    def flush_after() -> None:
        for m in pending_after:
            out.append(m)
            out_keys.append(message_hash(m))
            protected.add(str(m.get("tool_call_id", "")))
        pending_after.clear()

    for m, k, chain in zip(messages, keys, chains, strict=True):
        if pending_after and m.get("role") != "tool":
            flush_after()
        entry = internal.get(chain) if m.get("role") == "assistant" else None
        if entry:
            for extra in entry.get("before", []):
                out.append(extra)
                out_keys.append(message_hash(extra))
                if extra.get("role") == "tool":
                    protected.add(str(extra.get("tool_call_id", "")))
            replacement = entry.get("replace")
            if replacement:
                out.append(replacement)
                out_keys.append(message_hash(replacement))
            else:
                out.append(m)
                out_keys.append(k)
            pending_after.extend(entry.get("after", []))
            continue
        out.append(m)
        out_keys.append(k)
    flush_after()  # the conversation ends with the client's answers: the proxy's follow
    return out, out_keys, frozenset(protected)


def spliced_stored(messages: list[Message], internal: dict[str, Any]
                   ) -> tuple[list[Message], list[str], frozenset[str]]:
    """A stored conversation as a request's window sees it: with the proxy's own exchanges
    back where they happened (``splice_internal``), so what is keyed by its messages — the
    summaries' covers, the compaction points — matches what the next request computes."""
    from ..history.writes import chain_hashes, prepare

    prepared = [prepare(m) for m in messages]
    keys = [p.hash for p in prepared]
    chains = chain_hashes([p.match for p in prepared], None)
    return splice_internal(messages, keys, chains[1:], internal)


class ToolRunner:
    """Executes the proxy's calls against the request's conversation.

    What they can reach is what the request carries (the proxy's own exchanges spliced back,
    and so what the window cut from it). Only in a session the client named itself
    (``branches``: the store, for that session; ``Session.reaches_store``) do they reach the
    session's other branches too: a fingerprinted session can join strangers, and a guess
    that a request continues a stored conversation can be forged, so one end user's data
    never reaches another's model.
    """

    def __init__(self, tools: ProxyTools, messages: list[Message], keys: list[str],
                 max_results: int,
                 branches: Callable[[], Awaitable[list[tuple[str, Message]]]] | None = None,
                 branch_results: Callable[[str], Awaitable[list[Message]]] | None = None,
                 large: bool = False,
                 memory: Callable[[str, list[Message]], Awaitable[Found]] | None = None,
                 room: int | None = None, count: Callable[[str], int] | None = None):
        self.tools = tools
        # what a known window has left for the proxy's rounds (in counted tokens, with
        # ``count``): a recalled result past it is cut there (None: not bounded)
        self.room = room
        self.count = count
        # what the calls read is large (the request's bytes times the calls it may make, or
        # its messages): every walk a call makes over it runs off the event loop, however
        # few messages it is spread over
        self.large = large
        self.messages = messages
        self.keys = keys
        self.max_results = max_results
        self.branches = branches
        self.branch_results = branch_results
        # long-term memory's search by meaning over these messages (policy.memory), and why
        # it did not answer when it did not (the request says so: a degraded header)
        self.memory = memory
        self.memory_failed: str | None = None
        self.outcomes: list[tuple[str, str]] = []  # (tool, outcome) for metrics
        self._docs: list[Doc] | None = None  # the corpus as search reads it, read once
        self._asked: dict[tuple[str, str], str] = {}  # a question answered -> its call's id

    async def run(self, call: ToolCall) -> Message:
        fn = call.get("function") or {}
        kind = self.tools.names.get(str(fn.get("name")), "")
        if len(self.outcomes) >= MAX_CALLS:
            self.outcomes.append((kind, "refused"))
            return _tool_message(call, f"error: more than {MAX_CALLS} calls of the proxy's "
                                       f"tools in one request; answer with what you have")
        try:
            args = orjson.loads(fn.get("arguments") or "{}")
            if not isinstance(args, dict):
                raise ValueError("arguments must be a JSON object")
        except (orjson.JSONDecodeError, ValueError) as exc:
            self.outcomes.append((kind, "bad_arguments"))
            return _tool_message(call, f"error: invalid arguments ({exc})")
        asked = (kind, str(args.get("call_id" if kind == RECALL else "query", "")).strip())
        first = self._asked.get(asked)
        if first is not None:
            # asked again in this request: its answer is above, in the model's own rounds.
            # Not copied again — a result recalled 32 times went upstream, and into the
            # session's stored exchanges, 32 times
            self.outcomes.append((kind, "hit"))
            return _tool_message(call, f"[runloop-proxy] the same as the answer to {first} "
                                       f"above")
        if kind == RECALL:
            content, outcome = await self.recall(asked[1])
            if outcome == "hit":
                content = await self._fitted(content)
        else:
            content, outcome = await self.search(asked[1])
        self.outcomes.append((kind, outcome))
        if outcome == "hit":
            self._asked[asked] = str(call.get("id", ""))
        return _tool_message(call, content)

    async def _fitted(self, content: Any) -> Any:
        """A recalled result within the room the window leaves: the round that carries it
        goes to a model whose window is known, and the result whole would not fit in it."""
        if self.room is None or self.count is None:
            return content
        text = content if isinstance(content, str) else text_of(content)
        count = self.count
        tokens = await offload(self.large or is_large(len(text)), lambda: count(text))
        room = self.room - len(CUT_NOTE) // 3  # the note's own tokens, counted high
        if tokens <= room:
            self.room -= tokens
            return content
        self.room = 0
        kept = text[:len(text) * max(room, 0) // tokens]
        return kept + CUT_NOTE.format(room=max(room, 0), tokens=tokens,
                                      search=self.tools.name_of(SEARCH))

    def _lineage(self) -> list[tuple[str, Message]]:
        return list(zip(self.keys, self.messages, strict=True))

    async def recall(self, ref: str) -> tuple[Any, str]:
        """A message by the short ref a note shows (a tool result as it was, content parts
        included; any other message's text), or a result by its tool call's id; with
        ``args:<call id>``, the call's own arguments (cut in the window when long). What
        the request holds is read off the event loop when it is large; the session's other
        branches, from the store."""
        ref = ref.strip()
        if not ref:
            return "error: call_id is required", "bad_arguments"
        if ref.startswith(SEGMENT_REF) and self.memory is not None:
            return await offload(True, lambda: around(self.messages, ref[len(SEGMENT_REF):],
                                                      self.tools.name_of(RECALL)))
        hit, found = await offload(self.large, lambda: self._in_request(ref))
        if hit is not None:
            return hit
        if not found and self.branch_results is not None:
            try:
                found = [("", m) for m in await self.branch_results(ref)]
            except StoreError:
                return (f"error: the history store is unavailable; {ref} cannot be "
                        f"recalled right now"), "store_error"
        if not found:
            return f"error: no tool result with id {ref!r} in this conversation", "not_found"
        content = found[0][1].get("content")
        if len(found) > 1:
            # a reused call id: its first result, and the refs of the others
            others = ", ".join(r for r, _ in found[1:] if r) or \
                f"{self.tools.name_of(SEARCH)} finds them"
            note = f"\n[runloop-proxy] call id {ref} was used more than once; this is the " \
                   f"first result. The others: {others}"
            content = (content if isinstance(content, str) else message_text(found[0][1])) \
                + note
        return content, "hit"

    def _in_request(self, ref: str) -> tuple[tuple[Any, str] | None,
                                              list[tuple[str, Message]]]:
        """What the request holds for ``ref``: an answer (a call's arguments, a message by
        its ref), or the results with that call id and their refs."""
        if ref.startswith("args:"):
            return self._arguments(ref[5:]), []
        ordered = message_refs(self.keys)
        for m, r in zip(self.messages, ordered, strict=True):
            if r == ref:
                return ((m.get("content") if m.get("role") == "tool" else message_text(m)),
                        "hit"), []
        refs = dict(zip(self.keys, ordered, strict=True))
        return None, [(refs.get(k, ""), m) for k, m in self._lineage()
                      if m.get("role") == "tool" and m.get("tool_call_id") == ref]

    def _arguments(self, call_id: str) -> tuple[str, str]:
        for _, m in self._lineage():
            for call in tool_calls_of(m) if m.get("role") == "assistant" else ():
                if call.get("id") == call_id:
                    return str((call.get("function") or {}).get("arguments", "")), "hit"
        return f"error: no tool call with id {call_id!r} in this conversation", "not_found"

    async def _corpus(self) -> list[Doc]:
        """What search reads: the request's messages, and in a named session the session's
        other branches; each message read once per request, off the event loop when many."""
        if self._docs is None:
            corpus = self._lineage()
            if self.branches is not None:
                try:
                    stored = await self.branches()
                except StoreError:
                    stored = []
                known = {k for k, _ in corpus}
                corpus += [(k, m) for k, m in stored if k not in known]
            # a named session's stored branches: read whole, whatever the request's size
            self._docs = await offload(self.large or self.branches is not None
                                       or is_large(0, len(corpus) * 8),
                                       lambda: [doc(k, m) for k, m in corpus])
        return self._docs

    async def search(self, query: str) -> tuple[str, str]:
        cut = len(query) > MAX_QUERY_CHARS
        query = query[:MAX_QUERY_CHARS]
        terms = query_terms(query)
        if not terms and len(" ".join(query.split())) < MIN_PHRASE:
            return "error: query must contain words", "bad_arguments"
        docs = await self._corpus()
        large = self.large or is_large(0, len(docs) * 8)
        wanted = self.max_results if self.memory is None else CANDIDATES
        hits = await offload(large, lambda: rank_docs(terms, docs, wanted, query))
        loop_of, ref_of = await offload(large, lambda: (
            loop_index(self.messages, self.keys),
            dict(zip(self.keys, message_refs(self.keys), strict=True))))
        said = f"{query!r}" + (f" (the first {MAX_QUERY_CHARS} characters)" if cut else "")
        if self.memory is not None:
            return await self._hybrid(query, terms, hits, said, loop_of, ref_of)
        if not hits:
            return f"no match for {said} in this conversation's history", "miss"
        lines = [f"{len(hits)} best match(es) for {said}:"]
        for score, key, m in hits:
            lines.append(f"- [{_where(key, m, loop_of, ref_of)}, score {score:.2f}] "
                         f"{snippet(searchable(m), [query.lower(), *terms])}")
        return "\n".join(lines), "hit"

    async def _hybrid(self, query: str, terms: list[str],
                      hits: list[tuple[float, str, Message]], said: str,
                      loop_of: dict[str, int], ref_of: dict[str, str]) -> tuple[str, str]:
        """Words and meaning, fused by rank: each message's best segment by meaning stands
        for it (its anchor shown, and its id, which the recall tool opens around)."""
        assert self.memory is not None
        found = await self.memory(query, self.messages)
        if found.note:
            self.memory_failed = found.note
        by_key: dict[str, tuple[Segment, float]] = {}
        for seg, cos in found.hits:
            by_key.setdefault(self.keys[seg.anchor.position], (seg, cos))
        words = {key: (score, m) for score, key, m in hits}
        message_of = {key: m for _, key, m in hits}
        message_of.update((k, self.messages[s.anchor.position]) for k, (s, _) in by_key.items())
        fused = hybrid(query, [key for _, key, _ in hits], list(by_key))[:self.max_results]
        if not fused:
            return (f"no match for {said} in this conversation's history"
                    + (f" (by words alone: {found.note})" if found.note else "")), "miss"
        head = f"{len(fused)} best match(es) for {said}, by words and meaning"
        lines = [head + (f" (meaning partly unavailable: {found.note}):" if found.note
                         else ":")]
        for score, key in fused:
            m = message_of[key]
            parts = [f"score {score:.4f}"]
            if key in words:
                parts.append(f"words {words[key][0]:.2f}")
            text = snippet(searchable(m), [query.lower(), *terms])
            anchor = ""
            if key in by_key:
                seg, cos = by_key[key]
                parts.append(f"meaning {cos:.2f}")
                a = seg.anchor
                anchor = (f", iteration {a.iteration}, segment {a.segment} {a.kind}, "
                          f"open={SEGMENT_REF}{seg.key[:SEGMENT_REF_CHARS]}")
                if key not in words:
                    text = snippet(seg.text, [query.lower(), *terms])
            lines.append(f"- [{_where(key, m, loop_of, ref_of)}{anchor}, {', '.join(parts)}] "
                         f"{text}")
        return "\n".join(lines), "hit"


def _where(key: str, m: Message, loop_of: dict[str, int], ref_of: dict[str, str]) -> str:
    """Where a hit is, and the id recall_tool_call takes for it: every message the request
    carries has one (a snippet is a piece; an Observation smolagents sends as a user message,
    in a loop the window omitted, comes back whole only by it)."""
    where = f"turn {loop_of[key]}" if key in loop_of else "another branch"
    ids = ""
    if m.get("role") == "tool":
        ids = f" id={ref_of.get(key) or m.get('tool_call_id')}"
    else:
        if key in ref_of:
            ids = f" id={ref_of[key]}"
        if m.get("tool_calls"):
            ids += " calls=" + ",".join(str(c.get("id")) for c in m["tool_calls"])
    return f"{where}, {m.get('role')}{ids}"


def around(messages: list[Message], ref: str, recall: str) -> tuple[str, str]:
    """The segment whose key starts with ``ref`` and its neighbours in its loop (at most
    ``EXPAND_SEGMENTS`` each side, ``EXPAND_CHARS`` in all), with what is left either side
    and how to open it (pure)."""
    if len(ref) < SEGMENT_REF_CHARS:
        return f"error: a segment id has {SEGMENT_REF_CHARS} characters after " \
               f"{SEGMENT_REF!r}", "bad_arguments"
    segs = conversation_segments(messages)
    at = next((i for i, s in enumerate(segs) if s.key.startswith(ref)), None)
    if at is None:
        return f"error: no segment {SEGMENT_REF}{ref} in this conversation", "not_found"
    loop = segs[at].anchor.loop
    first = next(i for i in range(at, -1, -1)
                 if i == 0 or segs[i - 1].anchor.loop != loop)
    last = next(i for i in range(at, len(segs))
                if i == len(segs) - 1 or segs[i + 1].anchor.loop != loop)
    lo, hi = max(first, at - EXPAND_SEGMENTS), min(last, at + EXPAND_SEGMENTS)
    budget = EXPAND_CHARS

    def shown(i: int) -> str:
        s = segs[i]
        mark = ">> " if i == at else ""
        return f"{mark}[iteration {s.anchor.iteration}, {s.anchor.kind}] {s.text}"

    body = [shown(at)]
    budget -= len(body[0])
    before: list[str] = []
    i, j = at - 1, at + 1
    while (i >= lo or j <= hi) and budget > 0:
        if i >= lo:
            piece = shown(i)[:budget]
            before.insert(0, piece)
            budget -= len(piece)
            i -= 1
        if j <= hi and budget > 0:
            piece = shown(j)[:budget]
            body.append(piece)
            budget -= len(piece)
            j += 1
    left_before, left_after = i - first + 1, last - j + 1
    n = last - first + 1
    out = [f"[runloop-proxy] turn {loop}, segments {i + 1 - first}-{j - 1 - first} of {n}:",
           *before, *body]
    if left_before:
        out.append(f"{left_before} earlier segment(s) of this turn: "
                   f"{recall}(call_id=\"{SEGMENT_REF}{segs[i].key[:SEGMENT_REF_CHARS]}\")")
    if left_after:
        out.append(f"{left_after} later segment(s) of this turn: "
                   f"{recall}(call_id=\"{SEGMENT_REF}{segs[j].key[:SEGMENT_REF_CHARS]}\")")
    return "\n".join(out), "hit"


def loop_index(messages: list[Message], keys: list[str]) -> dict[str, int]:
    """Each message key's loop (its first, for a message repeated)."""
    out: dict[str, int] = {}
    for lp in segment(messages):
        for i in lp.positions:
            out.setdefault(keys[i], lp.index)
    return out


def query_terms(query: str) -> list[str]:
    """The words search_history ranks by: distinct, the first ``MAX_QUERY_TERMS``."""
    terms = dict.fromkeys(t.lower() for t in _WORD.findall(query) if t.strip() and len(t) > 1)
    return list(terms)[:MAX_QUERY_TERMS]


def searchable(m: Message) -> str:
    """What search_history matches in a message: its text and its calls' names and
    arguments (an id the agent passed to a tool is history too)."""
    calls = [f"{(c.get('function') or {}).get('name') or ''}"
             f"({(c.get('function') or {}).get('arguments') or ''})" for c in tool_calls_of(m)]
    return "\n".join([message_text(m), *calls]) if calls else message_text(m)


class Doc(NamedTuple):
    """A message as search_history reads it: its words, counted, and its text (whitespace
    runs as one space, lower case) for verbatim matches — each read once per message."""

    key: str
    message: Message
    words: Counter[str]
    text: str


def verbatim(m: Message) -> str:
    """What a query is looked for in as typed: the searchable text, with the calls' argument
    values decoded (an edit's ``"if not objs:\\n    return"`` is JSON-escaped in the
    arguments; the model asks for the text it wrote)."""
    return f"{searchable(m)}\n{decoded(m)}" if tool_calls_of(m) else searchable(m)


def doc(key: str, m: Message) -> Doc:
    text = searchable(m)
    return Doc(key, m, Counter(t.lower() for t in _WORD.findall(text)),
               " ".join(verbatim(m).split()).lower())


def rank(terms: list[str], corpus: list[tuple[str, Message]], k: int, phrase: str = ""
         ) -> list[tuple[float, str, Message]]:
    """BM25-style ranking of messages for the query terms (pure); the messages that hold
    ``phrase`` (the query as typed) verbatim, case aside, rank first."""
    return rank_docs(terms, [doc(key, m) for key, m in corpus], k, phrase)


def rank_docs(terms: list[str], docs: list[Doc], k: int, phrase: str = ""
              ) -> list[tuple[float, str, Message]]:
    """``rank`` over messages read already. A term no message has as a word matches the
    words that contain it (``7091239`` finds ``gift_card_7091239``, ``1239`` a card number
    ending in it), if it has ``MIN_INFIX`` characters."""
    if not docs:
        return []
    typed = " ".join(phrase.split())
    phrase = typed.lower()
    exact = {d.key for d in docs if phrase in d.text} if len(phrase) >= MIN_PHRASE else set()
    # holding it as a whole token (594 in "594", not in "6594") ranks above holding it inside
    # a longer word, and holding it as typed (base_dir, not BASE_DIR) above both
    whole = {d.key for d in docs if d.key in exact and holds(d.text, phrase)}
    cased = {d.key for d in docs if d.key in whole
             and holds(" ".join(verbatim(d.message).split()), typed)}
    avg = sum(sum(d.words.values()) for d in docs) / len(docs) or 1.0
    words = {t: {t} for t in terms}
    unmatched = [t for t in words if len(t) >= MIN_INFIX and not any(t in d.words for d in docs)]
    if unmatched:
        vocabulary = set().union(*(d.words for d in docs))
        for t in unmatched[:MAX_INFIX_TERMS]:
            words[t] = {w for w in vocabulary if t in w}
    # each document's frequency of each term, read once: work per term bounded by the
    # smaller of the document and the term's words (an infix term can match thousands)
    tfs = [{t: _tf(d.words, ws) for t, ws in words.items()} for d in docs]
    df = {t: sum(1 for tf in tfs if tf[t]) for t in words}
    scored = []
    for (key, m, c, _), tf_of in zip(docs, tfs, strict=True):
        length = sum(c.values()) or 1
        score = 0.0
        for t in terms:
            tf = tf_of[t]
            if tf:
                idf = math.log(1 + (len(docs) - df[t] + 0.5) / (df[t] + 0.5))
                score += idf * tf * 2.2 / (tf + 1.2 * (0.25 + 0.75 * length / avg))
        if key in exact:
            score += PHRASE_BONUS * (1 + (key in whole) + (key in cased))
        if score > 0:
            scored.append((score, key, m))
    scored.sort(key=lambda s: -s[0])
    return scored[:k]


def _tf(counts: Counter[str], words: set[str]) -> int:
    """How often a document holds any of ``words``."""
    if len(words) <= len(counts):
        return sum(counts.get(w, 0) for w in words)
    return sum(n for w, n in counts.items() if w in words)


def snippet(text: str, terms: list[str]) -> str:
    low = text.lower()
    pos = min((p for p in (low.find(t) for t in terms) if p >= 0), default=0)
    start = max(0, pos - SNIPPET_CHARS // 3)
    piece = " ".join(text[start:start + SNIPPET_CHARS].split())
    return ("…" if start else "") + piece + ("…" if start + SNIPPET_CHARS < len(text) else "")


def _tool_message(call: ToolCall, content: Any) -> Message:
    return {"role": "tool", "tool_call_id": call["id"], "content": content}
