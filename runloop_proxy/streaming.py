"""Pure helpers over parsed chat-completion chunks: assemble the streamed reply, and rewrite a
stream so the proxy's own tool calls never reach the client."""

from __future__ import annotations

from typing import Any

from .messages import Message, ToolCall
from .tools import ProxyTools

USAGE_FIELDS = ("prompt_tokens", "completion_tokens", "total_tokens")


def add_usage(total: dict[str, Any], usage: dict[str, Any] | None) -> None:
    """Sum ``usage`` into ``total``, nested *_details included."""
    if not usage:
        return
    for k, v in usage.items():
        if isinstance(v, bool):
            continue
        if isinstance(v, (int, float)):
            total[k] = total.get(k, 0) + v
        elif isinstance(v, dict):
            add_usage(total.setdefault(k, {}), v)


class StreamAccumulator:
    """Builds choice 0's assistant message, the finish reason and usage from chunks."""

    def __init__(self) -> None:
        self.id: str | None = None
        self.model: str | None = None
        self.created: int | None = None
        self.content: list[str] = []
        self.refusal: list[str] = []
        self.calls: dict[int, dict[str, Any]] = {}
        self.finish_reason: str | None = None
        self.usage: dict[str, Any] | None = None

    def add(self, chunk: dict[str, Any]) -> None:
        self.id = self.id or chunk.get("id")
        self.model = self.model or chunk.get("model")
        self.created = self.created or chunk.get("created")
        if isinstance(chunk.get("usage"), dict):
            self.usage = chunk["usage"]
        for choice in chunk.get("choices") or []:
            if choice.get("index", 0) != 0:
                continue
            delta = choice.get("delta") or {}
            if isinstance(delta.get("content"), str):
                self.content.append(delta["content"])
            if isinstance(delta.get("refusal"), str):
                self.refusal.append(delta["refusal"])
            for tc in delta.get("tool_calls") or []:
                slot = self.calls.setdefault(int(tc.get("index", 0)), {
                    "id": "", "type": "function", "function": {"name": "", "arguments": ""}})
                if tc.get("id"):
                    slot["id"] = tc["id"]
                fn = tc.get("function") or {}
                if fn.get("name"):
                    slot["function"]["name"] += fn["name"]
                if fn.get("arguments"):
                    slot["function"]["arguments"] += fn["arguments"]
            if choice.get("finish_reason"):
                self.finish_reason = choice["finish_reason"]

    def tool_calls(self) -> list[ToolCall]:
        return [self.calls[i] for i in sorted(self.calls)]  # type: ignore[misc]

    def message(self) -> Message:
        msg: Message = {"role": "assistant", "content": "".join(self.content) or None}
        if self.refusal:
            msg["refusal"] = "".join(self.refusal)
        calls = self.tool_calls()
        if calls:
            msg["tool_calls"] = calls
        return msg


class ChunkRewriter:
    """Rewrites one upstream stream round for the client.

    Drops deltas of proxy-owned tool calls and renumbers the client's, keeps one stream id
    across rounds, absorbs usage chunks (the caller emits one summed at the end) and holds back
    the finish chunk until the caller knows whether the round continues.
    """

    def __init__(self, tools: ProxyTools, stream_id: str | None, next_client_index: int = 0):
        self.tools = tools
        self.stream_id = stream_id
        self.owner: dict[int, bool] = {}  # upstream index -> proxy-owned?
        self.client_index: dict[int, int] = {}
        self.next_client_index = next_client_index
        self.held_finish: dict[str, Any] | None = None

    def rewrite(self, chunk: dict[str, Any]) -> dict[str, Any] | None:
        if self.stream_id is None:
            self.stream_id = chunk.get("id")
        elif "id" in chunk:
            chunk["id"] = self.stream_id
        choices = chunk.get("choices")
        if not choices:
            return None if chunk.get("usage") is not None else chunk
        if "usage" in chunk:
            chunk.pop("usage")
        for choice in choices:
            delta = choice.get("delta") or {}
            calls = delta.get("tool_calls")
            if calls:
                kept = []
                for tc in calls:
                    idx = int(tc.get("index", 0))
                    if idx not in self.owner:
                        name = (tc.get("function") or {}).get("name")
                        self.owner[idx] = name in self.tools.names
                        if not self.owner[idx]:
                            self.client_index[idx] = self.next_client_index
                            self.next_client_index += 1
                    if not self.owner[idx]:
                        kept.append({**tc, "index": self.client_index[idx]})
                if kept:
                    delta["tool_calls"] = kept
                else:
                    delta.pop("tool_calls")
            if choice.get("finish_reason"):
                self.held_finish = {**chunk, "choices": [{**choice, "delta": {}}]}
                choice["finish_reason"] = None
                if not _has_payload(delta):
                    return None
        if not any(_has_payload(c.get("delta") or {}) for c in choices) \
                and not chunk.get("usage") and self._is_noise(choices):
            return None
        return chunk

    @staticmethod
    def _is_noise(choices: list[dict[str, Any]]) -> bool:
        return all(not c.get("finish_reason") and not c.get("logprobs") for c in choices)


def _has_payload(delta: dict[str, Any]) -> bool:
    return any(v not in (None, "", [], {}) for v in delta.values())
