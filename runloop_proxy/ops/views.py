"""How the inspector and ``runloop-proxy inspect`` say things about a session: loop spans,
compression records, branches, tenants, token counts (pure: values in, text out; the caller
escapes for HTML)."""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import orjson

from ..window.builder import CompactionKind

KINDS = {CompactionKind.PAST_LOOPS: "past loops reduced", CompactionKind.OMISSION: "loops omitted",
         CompactionKind.ELISION: "tool results elided", CompactionKind.DROP: "exchanges dropped",
         CompactionKind.TRUNCATION: "hard limit", CompactionKind.SUMMARY: "summary",
         CompactionKind.REJECTION: "rejected: over the context window"}


def loop_span(first_last: Sequence[int]) -> str:
    """``[0, 4]`` → "loops 0–4" (both included); ``[3, 3]`` → "loop 3"."""
    first, last = int(first_last[0]), int(first_last[1])
    return f"loop {first}" if first == last else f"loops {first}–{last}"


def tokens(value: Any) -> str:
    """A token count for reading ("12,345"); "—" when there is none."""
    return f"{value:,}" if isinstance(value, int) and not isinstance(value, bool) else "—"


FOLD_AFTER = 6  # items of a long list shown before the rest is folded


def folded(items: Sequence[str], sep: str = "<br>", shown: int = FOLD_AFTER) -> str:
    """HTML items (escaped by the caller) joined by ``sep``; past ``shown`` of them the rest
    folded under a ``<details>`` that says how many ("—" for none)."""
    if not items:
        return "—"
    if len(items) <= shown + 1:  # folding one away saves nothing
        return sep.join(items)
    rest = items[shown:]
    return (sep.join(items[:shown]) + f"<details><summary>{len(rest):,} more</summary>"
            + sep.join(rest) + "</details>")


def saving(client: int, forwarded: int) -> str:
    """What forwarding saved of what the client sent, in percent ("—" for nothing sent); a
    prompt that grew (the proxy's tools added) says by how much."""
    if client <= 0:
        return "—"
    share = (client - forwarded) / client
    return f"{share:.0%}" if share >= 0 else f"none ({-share:.0%} added)"


class Described(NamedTuple):
    """A compression record in words: what happened, where, to the tokens, and why."""

    what: str
    where: str
    tokens: str
    why: str


def describe(rec: Mapping[str, Any]) -> Described:
    """Any record a session keeps — the window's steps, summaries, the store's own (a reply
    the client restated, a branch pruned) — with its fields named, none shown raw."""
    kind = str(rec.get("kind") or "event")
    if kind == "summary":
        loops = rec.get("loops")
        e = loops[1] if isinstance(loops, list) and len(loops) == 2 else None
        covered = loop_span([0, e - 1]) if isinstance(e, int) and e > 0 else "loops"
        used = (f"{tokens(rec.get('tokens_in'))} in, {tokens(rec.get('tokens_out'))} out"
                if isinstance(rec.get("tokens_in"), int) else "—")
        timing = "" if rec.get("in_time", True) else ", late: after the omission it was for"
        latency = rec.get("latency_ms")
        took = f", {latency} ms" if isinstance(latency, (int, float)) else ""
        return Described(f"summary of {covered}{' (appended)' if rec.get('appended') else ''}",
                         "", used, f"by {rec.get('summarizer') or 'the summariser'}{took}"
                         f"{timing}")
    if kind == "steps":
        found = rec.get("kinds")
        kinds: dict[str, Any] = found if isinstance(found, dict) else {}
        told = ", ".join(f"{n} {KINDS[CompactionKind(k)] if k in set(CompactionKind) else k}"
                         for k, n in kinds.items())
        start, end = rec.get("at_message"), rec.get("until_message")
        return Described(f"{rec.get('count')} earlier steps of one request",
                         f"at messages {start}–{end}" if isinstance(start, int)
                         and isinstance(end, int) else "",
                         f"{tokens(rec.get('tokens_before'))} → {tokens(rec.get('tokens_after'))}",
                         f"a request that brought many turns: {told}")
    if kind == "reply_restated":
        return Described("reply restated", _at(rec.get("at")), "—",
                         "the client sent the recorded reply in its own format: replaced "
                         "in place")
    if kind == "branch_pruned":
        return Described(f"branch {rec.get('branch')} pruned", "",
                         "—", f"{tokens(rec.get('length'))} messages; past max_branches, "
                         "least recently used")
    label = KINDS[CompactionKind(kind)] if kind in set(CompactionKind) else kind
    results, exchanges, messages = (rec.get(k) for k in (
        "results_elided", "exchanges_dropped", "messages_dropped"))
    if kind == CompactionKind.ELISION and _count(results):
        label = f"{results:,} tool result{'s' if results != 1 else ''} elided"
    elif kind == CompactionKind.DROP and _count(exchanges):
        label = (f"{exchanges:,} tool exchange{'s' if exchanges != 1 else ''} dropped"
                 + (f" ({messages:,} messages)" if _count(messages) else ""))
    return Described(label, _at(rec.get("at_message")),
                     f"{tokens(rec.get('tokens_before'))} → {tokens(rec.get('tokens_after'))}",
                     str(rec.get("reason") or ""))


def _count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _at(position: Any) -> str:
    return f"at message {position}" if isinstance(position, int) else ""


def record_line(rec: Mapping[str, Any]) -> str:
    """A compression record in one line: what it did, where, the tokens, why."""
    d = describe(rec)
    where = f" {d.where}" if d.where else ""
    amount = f": {d.tokens} tokens" if d.tokens != "—" else ""
    why = f" ({d.why})" if d.why else ""
    return f"{d.what}{where}{amount}{why}"


# a pass-through caller's readable name: two words picked by a hash of its namespace (itself
# a hash of its keys), so the same caller reads the same everywhere and nothing of a key shows
ADJECTIVES = ("amber", "brisk", "calm", "dusky", "eager", "fern", "gentle", "hazel", "ivory",
              "jade", "keen", "lucid", "mellow", "noble", "olive", "plucky", "quiet", "rusty",
              "sable", "tawny", "umber", "vivid", "wry", "young", "zesty", "bold", "coral",
              "dapper", "early", "frosty", "golden", "hardy", "indigo", "jolly", "kind",
              "lively", "misty", "nimble", "opal", "proud", "quick", "rosy", "silver", "tidy",
              "upbeat", "velvet", "warm", "azure", "breezy", "crisp", "dewy", "ember", "fleet",
              "grand", "humble", "icy", "jovial", "lunar", "mossy", "neat", "oaken", "pearl",
              "regal", "sunny")
ANIMALS = ("otter", "heron", "lynx", "marten", "finch", "badger", "crane", "ibex", "koala",
           "lemur", "magpie", "newt", "ocelot", "panda", "quail", "raven", "stoat", "tapir",
           "urchin", "vole", "walrus", "yak", "zebra", "bison", "cougar", "dingo", "egret",
           "ferret", "gecko", "hare", "impala", "jackal", "kestrel", "llama", "moose",
           "narwhal", "oriole", "puffin", "robin", "seal", "toucan", "viper", "wombat", "alpaca",
           "beaver", "condor", "dove", "eland", "falcon", "gibbon", "hornet", "iguana",
           "jaguar", "kiwi", "loris", "mink", "nuthatch", "osprey", "pika", "rhea", "shrew",
           "tern", "wren", "swift")


def caller_words(namespace: str) -> str:
    """A short, stable name for a caller known by its keys' hash ("amber-otter"): picked by
    another hash of that, so nothing in it can be traced back to a key."""
    digest = hashlib.sha256(f"caller-name:{namespace}".encode()).digest()
    return f"{ADJECTIVES[digest[0] % len(ADJECTIVES)]}-{ANIMALS[digest[1] % len(ANIMALS)]}"


def tenant_label(namespace: str, configured: bool, host: str = "") -> str:
    """A tenant as a person reads it: a configured tenant by its name; a pass-through
    namespace (``pt-`` and the hash of a client's keys) as a pass-through caller with a
    readable name and the upstream its calls go to (``host``), and one caller's own key of a
    tenant that forwards them (``<tenant>+<hash>``) as that tenant's caller. Neither shows
    the hash, nor anything else of a key."""
    tenant, sep, key = namespace.partition("+")
    if sep:
        return f"{tenant}, caller {caller_words(namespace)}"
    if configured or not namespace.startswith("pt-"):
        return namespace
    return f"pass-through caller {caller_words(namespace)}" + (f" via {host}" if host else "")


def branch_origin(branch: Mapping[str, Any]) -> str:
    """Where a branch comes from: the first branch, or the one it forked from and where."""
    if branch.get("parent") is None:
        return "the session's first branch"
    at = branch.get("fork_at")
    return f"forked from {branch['parent']}" + (f" at message {at}" if at is not None else "")


PRETTY_MAX = 2 << 20  # larger texts are shown as they are


def pretty(text: str) -> str:
    """A JSON text indented for reading (a tool's result, a call's arguments); any other
    text as it is."""
    if not text or len(text) > PRETTY_MAX or text.lstrip()[:1] not in ("{", "["):
        return text
    try:
        return orjson.dumps(orjson.loads(text), option=orjson.OPT_INDENT_2).decode()
    except orjson.JSONDecodeError:
        return text
