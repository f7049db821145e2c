"""The bridge (pure, but for one log line): a Messages client (Claude Code, the ``anthropic`` SDKs)
served by an upstream that speaks chat completions (an upstream with ``format = "chat"``),
translated both ways. The request goes through the same stages as any other — its conversation
model, its window, the proxy's tools — and only the wire differs: ``BridgeWire`` builds a chat
body from the window's messages and reads a chat answer as the Messages answer the client gets;
the event stream is ``bridge_stream.py``'s. What chat completions have no place for (thinking
blocks, the provider's own tools, ``top_k``) is dropped, and ``BridgeWire.dropped`` says what.

Tool calls keep the upstream's ids both ways, so a result the client sends back answers the
call the model made; an answer's usage is Anthropic's (``input_tokens`` without what the
upstream's cache read, which is ``cache_read_input_tokens``)."""

from __future__ import annotations

from typing import Any

import orjson

from ..conversation.blocks import assistant, tool_to_chat
from ..conversation.messages import Message, ToolCall, text_of
from ..ops import logs
from ..pipeline.accounting import LOGGED_MODEL_CHARS
from ..pipeline.tools import ProxyTools
from ..pipeline.wire import Decision, Reply, bad_reply
from ..window.builder import Note
from .bridge_stream import BridgeRelay, stop_reason, tool_use, usage_of_chat
from .chat_wire import ChatObserver, ChatWire, completion_problem
from .messages_stream import error_type
from .messages_wire import MessagesWire
from .overflow import error_fields, overflow

log = logs.get("bridge")
Block = dict[str, Any]
# what a Messages request says that chat completions say too (the rest is dropped)
CARRIED = frozenset({"model", "messages", "system", "max_tokens", "temperature", "top_p",
                     "stop_sequences", "stream", "metadata", "tools", "tool_choice"})
OPAQUE = frozenset({"thinking", "redacted_thinking"})
IMAGES_NOTE = "[runloop-proxy] images from the tool results above ({ids})"

LOGGED_DROPS = 16  # names of what the bridge dropped, in its log line


class BridgeWire:
    """A Messages request, its upstream speaking chat completions (one per request)."""

    api = "messages"
    upstream_path = "/chat/completions"
    translates = True

    def __init__(self) -> None:
        self.chat = ChatWire()
        self.native = MessagesWire()
        self.dropped: set[str] = set()  # what the chat bodies left out (for a log line)
        self.told = 0  # how many of them a log line has named

    def outgoing(self, body: dict[str, Any], messages: list[Message],
                 extra_tools: list[dict[str, Any]], note: Note | None = None
                 ) -> dict[str, Any]:
        out = self.chat.outgoing(chat_request(body, self.dropped),
                                 to_chat(messages, self.dropped), extra_tools)
        if len(self.dropped) > self.told:  # once a request (its later rounds are
            # next_round's; a shadow call converts the same body again)
            self.told = len(self.dropped)
            # a log line is bounded whatever a client sent: the first few names, and a count
            names = sorted(self.dropped)
            log.info("bridge: dropped what chat completions cannot carry",
                     extra={"model": str(body.get("model"))[:LOGGED_MODEL_CHARS],
                            "dropped": [name[:LOGGED_MODEL_CHARS]
                                        for name in names[:LOGGED_DROPS]],
                            "dropped_count": len(names)})
        return out

    def next_round(self, sent: dict[str, Any], messages: list[Message],
                   withdraw: frozenset[str]) -> dict[str, Any]:
        return self.chat.next_round(sent, to_chat(messages, self.dropped), withdraw)

    def tool_definitions(self, tools: ProxyTools) -> list[dict[str, Any]]:
        return self.chat.tool_definitions(tools)

    def parse(self, data: Any) -> Reply:
        problem = completion_problem(data)
        if problem:
            raise bad_reply(f"a chat completion: {problem}", data)
        answer = message_of(data, "")
        return Reply(assistant(answer["content"]), usage_of_chat(data.get("usage")),
                     answer["id"])

    def client_json(self, data: dict[str, Any], decision: Decision,
                    usage: dict[str, Any], tools: ProxyTools) -> dict[str, Any]:
        return self.native.client_json(message_of(data, ""), decision, usage, tools)

    def relay(self, request: dict[str, Any]) -> BridgeRelay:
        return BridgeRelay(str(request.get("model", "")))

    def observer(self, limit: int) -> ChatObserver:
        return self.chat.observer(limit)  # never used: every answer is translated

    def upstream_error(self, status: int, raw: bytes) -> tuple[int, bytes]:
        status, body = _translated(status, raw)
        return status, orjson.dumps(body)


# -- the request: Messages -> chat completions --------------------------------------------------

def chat_request(body: dict[str, Any], dropped: set[str]) -> dict[str, Any]:
    """A Messages request's parameters as a chat-completions body (its messages aside)."""
    out: dict[str, Any] = {"model": body["model"]}
    if body.get("max_tokens") is not None:
        out["max_tokens"] = body["max_tokens"]
    for key in ("temperature", "top_p"):
        if body.get(key) is not None:
            out[key] = body[key]
    if body.get("stop_sequences"):
        out["stop"] = list(body["stop_sequences"])
    if body.get("stream"):
        out["stream"] = True  # with the usage, which the last message_delta carries
        out["stream_options"] = {"include_usage": True}
    user = (body.get("metadata") or {}).get("user_id")
    if isinstance(user, str) and user:
        out["user"] = user
    tools = []
    for tool in body.get("tools") or []:
        chat = tool_to_chat(tool)
        if isinstance(chat, dict) and chat.get("type") == "function":
            tools.append(chat)
        else:  # the provider's own tools (web search, code execution): Anthropic's alone
            dropped.add(f"tool {tool.get('type') if isinstance(tool, dict) else '?'}")
    if tools:
        out["tools"] = tools
        out.update(tool_choice(body.get("tool_choice")))
    dropped.update(k for k in body if k not in CARRIED)
    return out


def tool_choice(choice: Any) -> dict[str, Any]:
    """Anthropic's ``tool_choice`` as chat's (and ``parallel_tool_calls``)."""
    if not isinstance(choice, dict):
        return {}
    kind = choice.get("type")
    out: dict[str, Any] = {}
    if kind == "any":
        out["tool_choice"] = "required"
    elif kind in ("auto", "none"):
        out["tool_choice"] = kind
    elif kind == "tool" and isinstance(choice.get("name"), str):
        out["tool_choice"] = {"type": "function", "function": {"name": choice["name"]}}
    if choice.get("disable_parallel_tool_use"):
        out["parallel_tool_calls"] = False
    return out


def to_chat(messages: list[Message], dropped: set[str]) -> list[Message]:
    """The window's messages (the conversation model, with the blocks they came from) as
    chat messages. Chat's tool messages carry text only: a result's images follow the run of
    results, in a user message of their own."""
    out: list[Message] = []
    images: list[Block] = []
    image_ids: list[str] = []
    for m in messages:
        role = m.get("role")
        if role != "tool" and images:
            out.append(_images_turn(images, image_ids))
            images, image_ids = [], []
        if role in ("system", "developer"):
            out.append({"role": "system", "content": text_of(m.get("content"))})
        elif role == "assistant":
            out.append(_assistant(m, dropped))
        elif role == "tool":
            text, pictures = _result(m.get("content"), dropped)
            call_id = str(m.get("tool_call_id", ""))
            out.append({"role": "tool", "tool_call_id": call_id, "content": text})
            if pictures:
                images += pictures
                image_ids.append(call_id)
        else:
            out.append({"role": "user", "content": _user(m.get("content"), dropped)})
    if images:
        out.append(_images_turn(images, image_ids))
    return out


def _assistant(m: Message, dropped: set[str]) -> Message:
    for block in m.get("blocks") or []:
        kind = block.get("type") if isinstance(block, dict) else None
        if kind in OPAQUE:
            dropped.add("thinking blocks")  # the upstream has no such thing: nothing to send
        elif kind not in ("text", "tool_use"):
            dropped.add(f"{kind} blocks")
    calls: list[ToolCall] = [{"id": c.get("id", ""), "type": "function",
              "function": {"name": (c.get("function") or {}).get("name", ""),
                           "arguments": (c.get("function") or {}).get("arguments") or "{}"}}
             for c in m.get("tool_calls") or []]
    out: Message = {"role": "assistant",
                    "content": text_of(m.get("content")) or (None if calls else "")}
    if calls:
        out["tool_calls"] = calls
    return out


def _user(content: Any, dropped: set[str]) -> Any:
    if not isinstance(content, list):
        return text_of(content)
    parts = [p for p in (_part(b, dropped) for b in content) if p is not None]
    if all(p["type"] == "text" for p in parts):
        return "\n".join(p["text"] for p in parts)  # text alone: what every server reads
    return parts


def _result(content: Any, dropped: set[str]) -> tuple[str, list[Block]]:
    """A tool result's content as chat's text, and its images."""
    if not isinstance(content, list):
        return text_of(content), []
    parts = [p for p in (_part(b, dropped) for b in content) if p is not None]
    texts = [p["text"] for p in parts if p["type"] == "text"]
    return "\n".join(texts), [p for p in parts if p["type"] != "text"]


def _images_turn(images: list[Block], ids: list[str]) -> Message:
    return {"role": "user", "content": [
        {"type": "text", "text": IMAGES_NOTE.format(ids=", ".join(ids))}, *images]}


def _part(block: Any, dropped: set[str]) -> Block | None:
    """A content block as a chat content part (None: chat has none for it)."""
    kind = block.get("type") if isinstance(block, dict) else None
    source = block.get("source") if isinstance(block, dict) else None
    source = source if isinstance(source, dict) else {}
    if kind == "text" and isinstance(block.get("text"), str):
        return {"type": "text", "text": block["text"]}
    if kind == "image" and source.get("type") in ("base64", "url"):
        url = source.get("url") if source.get("type") == "url" else \
            f"data:{source.get('media_type', 'image/png')};base64,{source.get('data', '')}"
        return {"type": "image_url", "image_url": {"url": url}}
    if kind == "document" and source.get("type") == "text":
        return {"type": "text", "text": str(source.get("data", ""))}
    if kind == "document" and source.get("type") == "base64":
        title = block.get("title")
        return {"type": "file", "file": {
            "filename": title if isinstance(title, str) else "document.pdf",
            "file_data": f"data:{source.get('media_type', 'application/pdf')};base64,"
                         f"{source.get('data', '')}"}}
    dropped.add(f"{kind} blocks")
    return None


# -- the answer: chat completions -> Messages ---------------------------------------------------

def message_of(data: dict[str, Any], model: str) -> dict[str, Any]:
    """A chat completion (``completion_problem`` accepted it) as a Messages answer."""
    choice = data["choices"][0]
    msg = choice["message"]
    content: list[Block] = []
    text = text_of(msg.get("content")) + (msg.get("refusal") or "")
    if text:
        content.append({"type": "text", "text": text})
    calls = msg.get("tool_calls") or []
    content += [tool_use(c, at) for at, c in enumerate(calls)]
    usage = usage_of_chat(data.get("usage")) or {"input_tokens": 0, "output_tokens": 0}
    rid, name = data.get("id"), data.get("model")
    return {"id": rid if isinstance(rid, str) else "msg_bridge", "type": "message",
            "role": "assistant", "model": name if isinstance(name, str) else model,
            "content": content, "stop_reason": stop_reason(choice.get("finish_reason"),
                                                           bool(calls)),
            "stop_sequence": None, "usage": usage}


# -- errors: OpenAI's shape -> Anthropic's ----------------------------------------------------

def anthropic_error(status: int, raw: bytes) -> dict[str, Any]:
    """An upstream's error body (OpenAI's shape, or any other server's) in Anthropic's, its
    type named by the status; a prompt that does not fit says so in Anthropic's words
    (Claude Code compacts its conversation on "prompt is too long"), whichever server's
    words it came in (``overflow.py``)."""
    return _translated(status, raw)[1]


def _translated(status: int, raw: bytes) -> tuple[int, dict[str, Any]]:
    try:
        data = orjson.loads(raw)
    except orjson.JSONDecodeError:
        data = None
    message, fields = error_fields(data, raw)
    message = message or f"the upstream answered {status}"
    too_long = overflow(status, raw, message, fields)
    if too_long is not None:
        # Anthropic's overflow is a 400 whichever status the server gave it (TGI's 422)
        status, message = 400, too_long.anthropic_message()
    return status, {"type": "error", "error": {"type": error_type(status), "message": message}}
