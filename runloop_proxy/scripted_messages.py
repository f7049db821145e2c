"""The scripted upstream's Messages API (Anthropic's): a scripted reply as a message, in JSON
or as its event stream (text, ``tool_use`` blocks, thinking with a signature that must come back
byte for byte, as Anthropic checks it), and usage the
way Anthropic reports it — prompts counted with a tokenizer other than the proxy's (so a proxy
has something to calibrate against) and Anthropic's explicit prompt cache simulated: prefixes
end at the request's ``cache_control`` breakpoints, a later request reads the longest one it
repeats (looked for up to 20 blocks before each of its breakpoints, from 1,024 tokens on) and
writes the rest up to its last breakpoint."""

from __future__ import annotations

import base64
import collections
import hashlib
import threading
from collections.abc import Iterator
from typing import Any

import orjson

from .pipeline import encodings
from .scripted_world import anthropic_message_id, anthropic_tool_use_id

Reply = dict[str, Any]
TOKENIZER = "o200k_base"  # Anthropic's is not public: any tokenizer but the proxy's cl100k
PER_BLOCK = 3  # framing per content block
TOOLS_PROMPT = 346  # what a request with tools adds (Anthropic's tool-use system prompt)
IMAGE_TOKENS = 800
CACHE_MIN = 1024
SIGNING_KEY = b"scripted-upstream-thinking"
SIGNED = b"\x12\x08scripted\x1a@"  # how this upstream's signatures open (decoded)
LOOKBACK = 20


class AnthropicCache:
    """Prompt tokens and Anthropic's prompt cache for the scripted upstream (thread-safe)."""

    def __init__(self, capacity: int = 200_000):
        self.enc = encodings.load(TOKENIZER)
        self.capacity = capacity
        self._counts: collections.OrderedDict[bytes, int] = collections.OrderedDict()
        self._entries: collections.OrderedDict[bytes, None] = collections.OrderedDict()
        self._lock = threading.Lock()

    def _count(self, block: Any) -> int:
        raw = orjson.dumps(block, option=orjson.OPT_SORT_KEYS)
        key = hashlib.blake2b(raw, digest_size=16).digest()
        with self._lock:
            hit = self._counts.get(key)
        if hit is None:
            hit = PER_BLOCK + len(self.enc.encode_ordinary(_text(block)))
            with self._lock:
                self._counts[key] = hit
                if len(self._counts) > self.capacity:
                    self._counts.popitem(last=False)
        return hit

    def blocks(self, body: dict[str, Any]) -> list[tuple[Any, bool]]:
        """The prompt's blocks in the order Anthropic renders them (tools, system, messages),
        each with whether it carries a cache breakpoint."""
        out: list[tuple[Any, bool]] = []
        for tool in body.get("tools") or []:
            out.append((_unmarked(tool), _marked(tool)))
        system = body.get("system")
        for block in system if isinstance(system, list) else \
                [{"type": "text", "text": system}] if system else []:
            out.append((_unmarked(block), _marked(block)))
        for turn in body.get("messages") or []:
            content = turn.get("content")
            parts = content if isinstance(content, list) else [{"type": "text",
                                                                 "text": content or ""}]
            for k, block in enumerate(parts):
                out.append(({"role": turn.get("role")} if k == 0 else {}, False))
                out.append((_unmarked(block), _marked(block)))
        return out

    def tokens(self, body: dict[str, Any]) -> int:
        return sum(self._count(b) for b, _ in self.blocks(body)) \
            + (TOOLS_PROMPT if body.get("tools") else 0)

    def usage(self, body: dict[str, Any], scope: str) -> dict[str, int]:
        """input_tokens, cache_read_input_tokens, cache_creation_input_tokens."""
        blocks = self.blocks(body)
        h = hashlib.blake2b(scope.encode()[:64], digest_size=16)
        ends, keys = [], []
        total = TOOLS_PROMPT if body.get("tools") else 0
        for block, _ in blocks:
            total += self._count(block)
            h.update(orjson.dumps(block, option=orjson.OPT_SORT_KEYS))
            ends.append(total)
            keys.append(h.copy().digest())
        marks = [i for i, (_, marked) in enumerate(blocks) if marked and ends[i] >= CACHE_MIN]
        with self._lock:
            read = max((ends[j] for b in marks for j in range(max(0, b - LOOKBACK), b + 1)
                        if keys[j] in self._entries), default=0)
            for b in marks:
                self._entries[keys[b]] = None
                self._entries.move_to_end(keys[b])
            while len(self._entries) > self.capacity:
                self._entries.popitem(last=False)
        written = max(0, ends[marks[-1]] - read) if marks else 0
        return {"input_tokens": total - read - written, "cache_read_input_tokens": read,
                "cache_creation_input_tokens": written}


def _text(block: Any) -> str:
    """What of a block the model reads as text (images at a fixed price, as the proxy's)."""
    if not isinstance(block, dict):
        return orjson.dumps(block).decode()
    kind = block.get("type")
    if kind == "text":
        return str(block.get("text", ""))
    if kind == "thinking":
        return str(block.get("thinking", ""))
    if kind == "tool_use":
        return f"{block.get('name')} {orjson.dumps(block.get('input')).decode()}"
    if kind == "tool_result":
        content = block.get("content")
        return content if isinstance(content, str) else "\n".join(
            _text(b) for b in content or [])
    if kind in ("image", "document"):
        return "image " * IMAGE_TOKENS
    return orjson.dumps(block).decode()


def _unmarked(block: Any) -> Any:
    """A block as the prompt holds it: a breakpoint says where a prefix ends, it is not in
    the prompt (the same block marked or not is the same prefix)."""
    if isinstance(block, dict) and "cache_control" in block:
        return {k: v for k, v in block.items() if k != "cache_control"}
    return block


def _marked(block: Any) -> bool:
    return isinstance(block, dict) and isinstance(block.get("cache_control"), dict)


def content(reply: Reply) -> list[dict[str, Any]]:
    """The reply's blocks: thinking (with a signature), text, tool calls."""
    out: list[dict[str, Any]] = []
    if reply.get("reasoning") is not None:
        thought = str(reply["reasoning"])
        out.append({"type": "thinking", "thinking": thought, "signature": signature(thought)})
    if reply.get("content"):
        out.append({"type": "text", "text": reply["content"]})
    for c in reply.get("tool_calls") or []:
        args = c.get("arguments", {})
        out.append({"type": "tool_use", "id": c.get("id") or anthropic_tool_use_id(),
                    "name": c["name"],
                    "input": orjson.loads(args) if isinstance(args, str) else args})
    return out


def signature(thought: str) -> str:
    """A thinking block's signature as Anthropic's look (opaque base64, a few hundred
    characters), made from the thought so the upstream can check it when it comes back."""
    digest = hashlib.blake2b(thought.encode(), key=SIGNING_KEY).digest()
    return base64.b64encode(SIGNED + digest * 4).decode()


def bad_signature(body: dict[str, Any]) -> str | None:
    """Where a request sends back a thinking block this upstream signed, changed (its
    thought or its signature not byte for byte as answered), in Anthropic's words; None when
    none is. A signature that is not this upstream's (a test's own) is not checked."""
    for i, turn in enumerate(body.get("messages") or []):
        content = turn.get("content") if turn.get("role") == "assistant" else None
        for j, block in enumerate(content if isinstance(content, list) else []):
            if not isinstance(block, dict) or block.get("type") != "thinking":
                continue
            sig = block.get("signature")
            try:
                ours = isinstance(sig, str) and base64.b64decode(sig).startswith(SIGNED)
            except ValueError:
                ours = False
            if ours and sig != signature(str(block.get("thinking"))):
                return f"messages.{i}.content.{j}: Invalid `signature` in `thinking` block"
    return None


def message(body: dict[str, Any], reply: Reply, usage: dict[str, int]) -> dict[str, Any]:
    blocks = content(reply)
    output = max(1, sum(len(orjson.dumps(b)) for b in blocks) // 4)
    return {"id": reply.get("message_id") or anthropic_message_id(), "type": "message",
            "role": "assistant", "model": body.get("model"), "content": blocks,
            "stop_reason": reply.get("stop_reason") or (
                "tool_use" if reply.get("tool_calls") else "end_turn"),
            "stop_sequence": None, "usage": {**usage, "output_tokens": output}}


def events(body: dict[str, Any], reply: Reply, usage: dict[str, int]) -> Iterator[bytes]:
    """The event stream of one answer, as Anthropic sends it (``die_after``: the connection
    breaks after that many blocks; ``stream_error``: an error event after message_start)."""
    final = message(body, reply, usage)
    start = {**final, "content": [], "stop_reason": None,
             "usage": {**usage, "output_tokens": 1}}
    yield _event({"type": "message_start", "message": start})
    if reply.get("stream_error"):
        yield _event({"type": "error", "error": reply["stream_error"]})
        return
    yield _event({"type": "ping"})
    for at, block in enumerate(final["content"]):
        if reply.get("die_after") is not None and at >= reply["die_after"]:
            raise ConnectionAbortedError("scripted death mid-stream")
        yield from _block_events(at, block)
    yield _event({"type": "message_delta", "delta": {"stop_reason": final["stop_reason"],
                                                     "stop_sequence": None},
                  "usage": final["usage"]})
    yield _event({"type": "message_stop"})


def _block_events(at: int, block: dict[str, Any]) -> Iterator[bytes]:
    kind = block["type"]
    if kind == "text":
        yield _event({"type": "content_block_start", "index": at,
                      "content_block": {"type": "text", "text": ""}})
        text = block["text"]
        for i in range(0, len(text), 8):
            yield _delta(at, {"type": "text_delta", "text": text[i:i + 8]})
    elif kind == "thinking":
        yield _event({"type": "content_block_start", "index": at,
                      "content_block": {"type": "thinking", "thinking": "", "signature": ""}})
        thought = block["thinking"]
        for i in range(0, len(thought), 12):
            yield _delta(at, {"type": "thinking_delta", "thinking": thought[i:i + 12]})
        yield _delta(at, {"type": "signature_delta", "signature": block["signature"]})
    else:  # tool_use: named at its start, its input streamed as JSON
        yield _event({"type": "content_block_start", "index": at,
                      "content_block": {**block, "input": {}}})
        raw = orjson.dumps(block["input"]).decode()
        for i in range(0, len(raw), 10):
            yield _delta(at, {"type": "input_json_delta", "partial_json": raw[i:i + 10]})
    yield _event({"type": "content_block_stop", "index": at})


def _delta(at: int, delta: dict[str, Any]) -> bytes:
    return _event({"type": "content_block_delta", "index": at, "delta": delta})


def _event(data: dict[str, Any]) -> bytes:
    return b"event: " + str(data["type"]).encode() + b"\ndata: " + orjson.dumps(data) + b"\n\n"


def error(status: int, kind: str, text: str) -> dict[str, Any]:
    return {"type": "error", "error": {"type": kind, "message": text}}
