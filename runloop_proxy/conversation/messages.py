"""Messages of the conversation model (chat-completions shaped): wire types, canonical form,
hashing, refs.

A message has two identities. Its *content hash* (of the canonical form, which drops what SDKs
add or drop when they echo a reply: null-valued fields, ``annotations: []``, the ``index`` of
streamed tool calls, key order) addresses it in the store and in every cache. Its *match hash*
is what reconciliation compares: for an assistant message only its role, text and tool calls,
so a reply a client echoes back with fields of its own (LiteLLM's ``provider_specific_fields``)
or without some of ours is still the same turn; for any other message its content hash *without
the provider's cache marks* (``CACHE_MARKS``: ``cache_control`` on any block, at any depth).
What a client adds or moves for the provider's cache is not content: Claude Code moves its one
mark to the newest block on every request, so the block that carried it comes back without it,
and a hash that counted the mark read every request as an edit (a fork per request). The
content hash keeps the marks: the window forwards a message's blocks as the client sent them.
"""

from __future__ import annotations

from typing import Any, Literal, TypedDict

import orjson
import xxhash

Role = Literal["system", "developer", "user", "assistant", "tool", "function"]
ROLES: frozenset[str] = frozenset({"system", "developer", "user", "assistant", "tool", "function"})


class FunctionCall(TypedDict):
    name: str
    arguments: str


class ToolCall(TypedDict):
    id: str
    type: str
    function: FunctionCall


class Message(TypedDict, total=False):
    role: str
    content: Any
    name: str
    tool_calls: list[ToolCall]
    tool_call_id: str
    function_call: FunctionCall
    refusal: str | None
    # a message that came in as Responses items keeps them (conversation/items.py)
    items: list[dict[str, Any]]
    # a message that came in as Messages content keeps its blocks (conversation/blocks.py)
    blocks: list[dict[str, Any]]
    instructions: bool  # the system message that stands for a request's ``instructions``


_EMPTY_DROPPABLE = ("annotations", "tool_calls")
EMBEDDED_DEPTH = 64  # levels of JSON a string inside a message may nest and still be read
NOT_JSON: Any = object()  # what ``embedded_json`` gives for text it does not read as JSON


def embedded_json(text: str) -> Any:
    """The value of JSON a message carries inside a string (a call's arguments, a field) —
    or NOT_JSON when the text is none, or nests deeper than EMBEDDED_DEPTH: such text is
    only text to whatever reads it (the request's own depth bound does not see inside its
    strings, and a value too deep for the serialisers turned a session's window off)."""
    try:
        value = orjson.loads(text)
    except orjson.JSONDecodeError:
        return NOT_JSON
    stack: list[tuple[Any, int]] = [(value, 0)]
    while stack:
        v, depth = stack.pop()
        if isinstance(v, (dict, list)):
            if depth >= EMBEDDED_DEPTH:
                return NOT_JSON
            stack.extend((x, depth + 1) for x in (v.values() if isinstance(v, dict) else v))
    return value


def canonical(msg: Message) -> dict[str, Any]:
    """The message as compared and stored: stable under SDK echo differences."""
    out: dict[str, Any] = {}
    for k, v in msg.items():
        if v is None or (k in _EMPTY_DROPPABLE and v == []):
            continue
        if k == "content":
            v = _canonical_content(v)
            if v == "" and msg.get("role") == "assistant" and msg.get("tool_calls"):
                continue
        elif k == "tool_calls" and isinstance(v, list):
            v = [_canonical_call(c) for c in v]
        out[k] = v
    return out


def _canonical_content(content: Any) -> Any:
    if isinstance(content, list) and len(content) == 1 and isinstance(content[0], dict) \
            and content[0].get("type") == "text" and set(content[0]) <= {"type", "text"}:
        return content[0].get("text", "")
    return content


def _canonical_call(call: Any) -> Any:
    if not isinstance(call, dict):
        return call
    out = {k: v for k, v in call.items() if v is not None and k != "index"}
    fn = out.get("function")
    if isinstance(fn, dict):
        out["function"] = {k: v for k, v in fn.items() if v is not None}
    return out


def clean(msg: Message) -> Message:
    """The message without its null-valued fields (what an SDK leaves out when it echoes it)."""
    return {k: v for k, v in msg.items() if v is not None}  # type: ignore[return-value]


def kept_json(obj: Any, option: int | None = None) -> bytes:
    """``orjson.dumps`` for bytes that are kept (a stored body, a queued write): copied into
    a buffer of their own size. orjson allocates its output for the worst case — 4 KB for a
    small object, about ten times a long string's length — and keeps that allocation, so
    100,000 tiny messages held 800 MB where their JSON is 3 MB."""
    return bytes(memoryview(orjson.dumps(obj, option=option)))


def canonical_json(msg: Message) -> bytes:
    return kept_json(canonical(msg), orjson.OPT_SORT_KEYS)


def content_hash(data: bytes) -> str:
    return xxhash.xxh3_128_hexdigest(data)


def message_hash(msg: Message) -> str:
    return content_hash(canonical_json(msg))


CACHE_MARKS = frozenset({"cache_control"})  # fields a client sets for the provider's cache
_MARK_BYTES = tuple(f'"{k}"'.encode() for k in CACHE_MARKS)


def unmarked(value: Any) -> Any:
    """``value`` without the provider's cache marks at any depth (a dict's ``cache_control``
    key), copied only where one is; ``value`` itself when it holds none. One walk of its
    containers (its nesting is bounded by the request's)."""
    if not isinstance(value, (dict, list)):
        return value
    # Post-order over the containers with an explicit stack: a new container is made only
    # for one a mark was taken out of, or one holding such a container (a container shared
    # by two fields — a tool message's content and its block's — is made once).
    out: dict[int, Any] = {}
    todo: list[tuple[Any, bool]] = [(value, False)]
    while todo:
        node, done = todo.pop()
        items = node.items() if isinstance(node, dict) else enumerate(node)
        if not done:
            todo.append((node, True))
            todo.extend((v, False) for _, v in items if isinstance(v, (dict, list)))
            continue
        changed = isinstance(node, dict) and not CACHE_MARKS.isdisjoint(node)
        kids = {k: out[id(v)] for k, v in items
                if isinstance(v, (dict, list)) and id(v) in out}
        if not changed and not kids:
            continue
        if isinstance(node, dict):
            out[id(node)] = {k: kids.get(k, v) for k, v in node.items()
                             if k not in CACHE_MARKS}
        else:
            out[id(node)] = [kids.get(i, v) for i, v in enumerate(node)]
    return out.get(id(value), value)


def marked(body: bytes) -> bool:
    """Whether a message's canonical JSON may hold a cache mark (a key, or text quoting
    one: then ``unmarked`` finds none and the hash is the content hash anyway)."""
    return any(m in body for m in _MARK_BYTES)


def unmarked_hash(msg: Message, body: bytes | None = None) -> str:
    """The content hash of ``msg`` without its cache marks (``body``: its canonical JSON,
    when known); a system message's plain text blocks read as its text."""
    body = canonical_json(msg) if body is None else body
    system = msg.get("role") in ("system", "developer") and "blocks" in msg
    if not marked(body) and not system:
        return content_hash(body)
    form = unmarked(msg)
    if system and _plain_text(form.get("blocks")):
        # a system turn in text blocks is its text (Claude Code sends its environment turn
        # in a marked block, then, the mark moved on, as a string)
        form = {k: v for k, v in form.items() if k != "blocks"}
    return message_hash(form)


def _plain_text(blocks: Any) -> bool:
    return isinstance(blocks, list) and all(
        isinstance(b, dict) and b.get("type") == "text" and set(b) <= {"type", "text"}
        for b in blocks)


def match_hash(msg: Message, content_key: str | None = None, body: bytes | None = None) -> str:
    """The identity reconciliation compares (see the module docstring); ``content_key`` and
    ``body``, the content hash and canonical JSON when known, serve every message but an
    assistant's."""
    if msg.get("role") != "assistant":
        if content_key is not None and body is not None and not marked(body) \
                and "blocks" not in msg:
            return content_key
        return unmarked_hash(msg, body)
    calls = [[c.get("id"), (c.get("function") or {}).get("name"),
              (c.get("function") or {}).get("arguments")] for c in tool_calls_of(msg)]
    return content_hash(orjson.dumps(["assistant", message_text(msg), calls]))


def assistant_of(texts: list[str], calls: list[ToolCall], original: str, shape: Any) -> Message:
    """The assistant message of another API's turn: its texts joined (None without any), its
    calls, and the turn as that API sent it under ``original`` (``blocks``, ``items``), which
    is what goes back to that API."""
    msg: dict[str, Any] = {"role": "assistant", "content": "\n".join(texts) if texts else None}
    if calls:
        msg["tool_calls"] = calls
    msg[original] = shape
    return msg  # type: ignore[return-value]


def text_of(content: Any) -> str:
    """The text a message carries, whatever its content shape (string, parts, null)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for p in content:
            if isinstance(p, dict):
                if isinstance(p.get("text"), str):
                    parts.append(p["text"])
                elif isinstance(p.get("refusal"), str):
                    parts.append(p["refusal"])
            elif isinstance(p, str):
                parts.append(p)
        return "\n".join(parts)
    return str(content)


def message_text(msg: Message) -> str:
    text = text_of(msg.get("content"))
    refusal = msg.get("refusal")
    return f"{text}\n{refusal}" if refusal and refusal not in text else text


REF_CHARS = 6


def message_refs(keys: list[str]) -> list[str]:
    """A short id per message, what recall_tool_call takes for whatever the window cut.

    The leading hex digits of the message's content hash: a few tokens where provider call ids
    take twenty, and unique where call ids are reused. A ref that would name an earlier,
    different message grows two digits until it is unique; refs depend only on the messages
    before them, so appending never changes an earlier one.
    """
    taken: dict[str, str] = {}  # ref -> key
    refs = [""] * len(keys)
    for i, key in enumerate(keys):
        n = REF_CHARS
        while taken.get(key[:n], key) != key and n < len(key):
            n += 2
        refs[i] = key[:n]
        taken.setdefault(key[:n], key)
    return refs


def tool_calls_of(msg: Message) -> list[ToolCall]:
    """Tool calls of an assistant message, legacy ``function_call`` included (id = name)."""
    calls = msg.get("tool_calls") or []
    if not calls and msg.get("function_call"):
        fc = msg["function_call"]
        return [{"id": f"function:{fc.get('name', '')}", "type": "function", "function": fc}]
    return calls
