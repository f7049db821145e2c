"""What other OpenAI-compatible and Anthropic-compatible servers really send: a table of
fixtures every translation and relay is checked against (``tests/test_dialects.py``).

Facts, not code, from each server's source or from answers users quote:
- OpenAI, Azure OpenAI: errors nested under ``error`` with ``code``
  ``context_length_exceeded``; Azure's stream opens with a chunk of no choices carrying
  ``prompt_filter_results``, and every choice carries ``content_filter_results``.
- vLLM: ``type`` ``BadRequestError``, ``code`` the integer 400; before 0.6 the fields at the
  top level with ``"object": "error"``; a stream's chunks carry ``stop_reason`` beside
  ``finish_reason``; with ``continuous_usage_stats`` every chunk carries usage.
- llama.cpp ``llama-server`` (``tools/server/server-context.cpp``): ``request (%d tokens)
  exceeds the available context size (%d tokens), try increasing it``, type
  ``exceed_context_size_error``, ``n_prompt_tokens`` and ``n_ctx`` beside; its last chunk
  carries ``timings`` and its usage.
- Ollama (``openai/openai.go``, ``llm/llama_server.go``): ``{"error": {"message", "type",
  "param", "code": null}}``, type ``invalid_request_error`` for a 400; ``the prompt is longer
  than the context length currently available to the model; ...``; a tool call comes whole
  in one chunk; ``system_fingerprint`` ``fp_ollama``.
- LiteLLM: ``litellm.ContextWindowExceededError: ...`` wrapping the provider's own words,
  ``code`` the string ``"400"``, ``type`` null.
- OpenRouter: ``This endpoint's maximum context length is N tokens. However, you requested
  about M tokens``, ``code`` the integer 400, ``metadata``; ``: OPENROUTER PROCESSING``
  comment lines in a stream; usage always in the last chunk.
- Mistral: top-level fields, ``Prompt contains M tokens and 0 draft tokens, too large for
  model with N maximum context length``. Gemini's OpenAI endpoint: a one-item list.
  TGI: a 422, ``{"error": "Input validation error: ...", "error_type": "validation"}``.
  Groq: only the code. Anthropic and its gateways (Bedrock, Vertex): ``prompt is too long:
  M tokens > N maximum``, ``input length and `max_tokens` exceed context limit: A + B > N``,
  Bedrock's ``Input is too long for requested model.``
"""

from __future__ import annotations

from typing import Any, NamedTuple

import orjson


class ErrorRow(NamedTuple):
    server: str
    status: int
    body: bytes
    overflow: bool  # a prompt too long for the model
    needed: int | None = None  # the prompt's tokens, when the words say them (with allowed)
    allowed: int | None = None


def _nested(message: str, type_: Any, code: Any, **extra: Any) -> bytes:
    return orjson.dumps({"error": {"message": message, "type": type_, "param": None,
                                   "code": code, **extra}})


OVERFLOWS = [
    ErrorRow("openai", 400, _nested(
        "This model's maximum context length is 128000 tokens. However, your messages "
        "resulted in 130542 tokens. Please reduce the length of the messages.",
        "invalid_request_error", "context_length_exceeded"), True, 130542, 128000),
    ErrorRow("openai, with the completion", 400, _nested(
        "This model's maximum context length is 8192 tokens. However, you requested 9073 "
        "tokens (5073 in the messages, 4000 in the completion). Please reduce the length of "
        "the messages or completion.", "invalid_request_error", "context_length_exceeded"),
        True, 9073, 8192),
    ErrorRow("azure openai", 400, _nested(
        "This model's maximum context length is 128000 tokens. However, your messages "
        "resulted in 131211 tokens (130011 in the messages, 1200 in the functions). Please "
        "reduce the length of the messages or functions.", "invalid_request_error",
        "context_length_exceeded"), True, 131211, 128000),
    ErrorRow("vllm", 400, _nested(
        "This model's maximum context length is 32768 tokens. However, your request has "
        "40321 input tokens. Please reduce the length of the input messages. None",
        "BadRequestError", 400), True, 40321, 32768),
    ErrorRow("vllm, max_tokens past what is left", 400, _nested(
        "'max_tokens' or 'max_completion_tokens' is too large: 8000. This model's maximum "
        "context length is 4096 tokens and your request has 2778 input tokens "
        "(8000 > 4096 - 2778). None", "BadRequestError", 400), True),
    ErrorRow("vllm before 0.6 (top-level fields)", 400, orjson.dumps({
        "object": "error", "message": "This model's maximum context length is 4096 tokens. "
        "However, you requested 5120 tokens (4096 in the messages, 1024 in the completion). "
        "Please reduce the length of the messages or completion.", "type": "BadRequestError",
        "param": None, "code": 400}), True, 5120, 4096),
    ErrorRow("llama.cpp", 400, orjson.dumps({"error": {
        "code": 400, "message": "request (9412 tokens) exceeds the available context size "
        "(8192 tokens), try increasing it", "type": "exceed_context_size_error",
        "n_prompt_tokens": 9412, "n_ctx": 8192}}), True, 9412, 8192),
    ErrorRow("llama.cpp, older wording", 400, orjson.dumps({"error": {
        "code": 400, "message": "the request exceeds the available context size, try "
        "increasing it", "type": "exceed_context_size_error", "n_prompt_tokens": 17001,
        "n_ctx": 16384}}), True, 17001, 16384),
    ErrorRow("ollama", 400, _nested(
        "the prompt is longer than the context length currently available to the model; "
        "shorten the prompt, adjust the context length in settings, or use a model with a "
        "longer context length", "invalid_request_error", None), True),
    ErrorRow("litellm over openai", 400, _nested(
        "litellm.ContextWindowExceededError: litellm.BadRequestError: "
        "ContextWindowExceededError: OpenAIException - This model's maximum context length "
        "is 128000 tokens. However, your messages resulted in 200112 tokens. Please reduce "
        "the length of the messages.\nmodel=gpt-4.1-2025-04-14. context_window_fallbacks="
        "None. fallbacks=None.", None, "400"), True, 200112, 128000),
    ErrorRow("litellm over anthropic", 400, _nested(
        "litellm.ContextWindowExceededError: litellm.BadRequestError: AnthropicException - "
        '{"type":"error","error":{"type":"invalid_request_error","message":"prompt is too '
        'long: 212345 tokens > 200000 maximum"}}', None, "400"), True, 212345, 200000),
    ErrorRow("openrouter", 400, orjson.dumps({"error": {
        "message": "This endpoint's maximum context length is 200000 tokens. However, you "
        "requested about 231548 tokens (215548 of text input, 16000 in the output). Please "
        "reduce the length of either one, or use the \"middle-out\" transform to compress "
        "your prompt automatically.", "code": 400, "metadata": {"provider_name": None}}}),
        True, 231548, 200000),
    ErrorRow("deepseek", 400, _nested(
        "This model's maximum context length is 131072 tokens. However, you requested "
        "145000 tokens (145000 in the messages, 0 in the completion). Please reduce the "
        "length of the messages or completion.", "invalid_request_error",
        "invalid_request_error"), True, 145000, 131072),
    ErrorRow("mistral", 400, orjson.dumps({
        "object": "error", "message": "Prompt contains 40621 tokens and 0 draft tokens, too "
        "large for model with 32768 maximum context length", "type":
        "invalid_request_message_error", "param": None, "code": "3051"}), True, 40621, 32768),
    ErrorRow("groq", 400, _nested("Please reduce the length of the messages or completion.",
                                  "invalid_request_error", "context_length_exceeded"), True),
    ErrorRow("text-generation-inference", 422, orjson.dumps({
        "error": "Input validation error: `inputs` tokens + `max_new_tokens` must be <= 8192. "
        "Given: 9000 `inputs` tokens and 1024 `max_new_tokens`", "error_type": "validation"}),
        True),
    ErrorRow("gemini openai endpoint", 400, orjson.dumps([{"error": {
        "code": 400, "message": "The input token count (1204312) exceeds the maximum number "
        "of tokens allowed (1048576).", "status": "INVALID_ARGUMENT"}}]), True, 1204312,
        1048576),
    ErrorRow("anthropic through a gateway", 400, orjson.dumps({
        "type": "error", "error": {"type": "invalid_request_error",
                                   "message": "prompt is too long: 207936 tokens > 200000 "
                                              "maximum"}}), True, 207936, 200000),
    ErrorRow("anthropic's output reserve through a gateway", 400, _nested(
        "input length and `max_tokens` exceed context limit: 188240 + 21333 > 200000, "
        "decrease input length or `max_tokens` and try again", "invalid_request_error",
        None), True, 209573, 200000),
    ErrorRow("bedrock through a gateway", 400, _nested(
        "An error occurred (ValidationException) when calling the Converse operation: Input "
        "is too long for requested model.", "invalid_request_error", None), True),
]

NOT_OVERFLOWS = [
    ErrorRow("openai rate limit", 429, _nested(
        "Rate limit reached for gpt-4.1 in organization org-Xq3Ldm on tokens per min (TPM): "
        "Limit 30000, Used 27000, Requested 9000. Please try again in 12s.", "tokens",
        "rate_limit_exceeded"), False),
    ErrorRow("openai max_tokens past the model's output", 400, _nested(
        "max_tokens is too large: 40000. This model supports at most 32768 completion "
        "tokens, whereas you provided 40000.", "invalid_request_error", "invalid_value"),
        False),
    ErrorRow("vllm unknown model", 404, _nested(
        "The model `gpt-4.1-2025-04-14` does not exist.", "NotFoundError", 404), False),
    ErrorRow("llama.cpp loading", 503, orjson.dumps({"error": {
        "code": 503, "message": "Loading model", "type": "unavailable_error"}}), False),
    ErrorRow("ollama unknown model", 404, _nested(
        'model "qwen3-coder:30b" not found, try pulling it first', "not_found_error", None),
        False),
    ErrorRow("vllm out of memory", 500, _nested(
        "CUDA out of memory. Tried to allocate 2.00 GiB", "InternalServerError", 500), False),
    ErrorRow("azure content filter", 400, _nested(
        "The response was filtered due to the prompt triggering Azure OpenAI's content "
        "management policy.", None, "content_filter"), False),
    ErrorRow("litellm budget", 400, _nested(
        "Budget has been exceeded! Current cost: 10.02, Max budget: 10.0", "budget_exceeded",
        "400"), False),
]


# -- streams ---------------------------------------------------------------------------------

class StreamRow(NamedTuple):
    server: str
    chunks: list[bytes]  # the bytes as the server sends them
    text: str
    calls: list[tuple[str, dict[str, Any]]]  # (name, arguments), in order
    finish: str | None  # the last finish_reason the server names
    stop_reason: str  # what the bridge must say for it
    cut: bool = False  # no end marker: the proxy says the answer was cut (never stored whole)


CID = "chatcmpl-9xQvT3kLmB2cR7sWnE4yA1hZ0pFdG"


def _chunk(delta: dict[str, Any], finish: str | None = None, **extra: Any) -> dict[str, Any]:
    return {"id": CID, "object": "chat.completion.chunk", "created": 1764640000,
            "model": "served-model", "choices": [{"index": 0, "delta": delta,
                                                  "logprobs": None, "finish_reason": finish,
                                                  **extra.pop("choice", {})}], **extra}


def _sse(events: list[Any], done: bytes | None = b"data: [DONE]", sep: bytes = b"\n\n",
         comments: int = 0) -> list[bytes]:
    out = [b": OPENROUTER PROCESSING" + sep] * comments
    out += [b"data: " + orjson.dumps(e) + sep for e in events]
    return out + ([done + sep] if done is not None else [])


USAGE = {"prompt_tokens": 1843, "completion_tokens": 41, "total_tokens": 1884}
TEXT = "The parser now reads CRLF."
PIECES = [{"content": TEXT[i:i + 7]} for i in range(0, len(TEXT), 7)]
BASH = ("bash", {"command": "pytest -q tests/test_sse.py"})
GREP = ("grep", {"pattern": "feed\\(", "path": "runloop_proxy"})


def _call_deltas(calls: list[tuple[str, dict[str, Any]]], ids: list[str | None],
                 indices: list[int], whole: bool = False, cut: int = 9) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for (name, args), cid, at in zip(calls, ids, indices, strict=True):
        raw = orjson.dumps(args).decode()
        head: dict[str, Any] = {"index": at, "type": "function",
                                "function": {"name": name, "arguments": raw if whole else ""}}
        if cid is not None:
            head["id"] = cid
        out.append({"tool_calls": [head]})
        if not whole:
            out += [{"tool_calls": [{"index": at, "function": {"arguments": raw[j:j + cut]}}]}
                    for j in range(0, len(raw), cut)]
    return out


def _text_stream(finish: str | None, **kw: Any) -> list[dict[str, Any]]:
    return [_chunk({"role": "assistant", "content": ""}), *[_chunk(p) for p in PIECES],
            _chunk({}, finish, **kw)]


def _calls_stream(calls: list[tuple[str, dict[str, Any]]], ids: list[str | None],
                  indices: list[int], finish: str | None, whole: bool = False
                  ) -> list[dict[str, Any]]:
    return [_chunk({"role": "assistant", "content": None}),
            *[_chunk(d) for d in _call_deltas(calls, ids, indices, whole)], _chunk({}, finish)]


AZURE_FILTERS = {"hate": {"filtered": False, "severity": "safe"},
                 "self_harm": {"filtered": False, "severity": "safe"}}

STREAMS = [
    StreamRow("openai, usage chunk", _sse([*_text_stream("stop"), {
        "id": CID, "object": "chat.completion.chunk", "created": 1764640000,
        "model": "gpt-4.1-2025-04-14", "choices": [], "usage": {
            **USAGE, "prompt_tokens_details": {"cached_tokens": 1536}}}]), TEXT, [], "stop",
        "end_turn"),
    StreamRow("openai, two calls in pieces", _sse(_calls_stream(
        [BASH, GREP], ["call_Hq2vN8sLx0TbR4mWc9Ye1Kd", "call_Pz7uJ3fGa5XoV2nQe8Rt6Wb"],
        [0, 1], "tool_calls")), "", [BASH, GREP], "tool_calls", "tool_use"),
    StreamRow("azure, a filter chunk first", _sse([
        {"choices": [], "created": 0, "id": "", "model": "", "object": "",
         "prompt_filter_results": [{"prompt_index": 0,
                                    "content_filter_results": AZURE_FILTERS}]},
        *[{**c, "choices": [{**c["choices"][0], "content_filter_results": AZURE_FILTERS}]}
          for c in _text_stream("stop")]]), TEXT, [], "stop", "end_turn"),
    StreamRow("vllm, stop_reason beside and usage in every chunk", _sse([
        {**c, "choices": [{**c["choices"][0], "stop_reason": None}], "usage": USAGE}
        for c in _text_stream("stop")]), TEXT, [], "stop", "end_turn"),
    StreamRow("llama.cpp, usage and timings in the last chunk", _sse(_text_stream(
        "stop", usage=USAGE, timings={"prompt_n": 1843, "prompt_ms": 912.4,
                                      "predicted_n": 41, "predicted_ms": 1533.0}),
        done=b"data: [DONE]"), TEXT, [], "stop", "end_turn"),
    StreamRow("ollama, a call whole in one chunk, finish stop", _sse([
        {**c, "system_fingerprint": "fp_ollama"} for c in _calls_stream(
            [BASH], ["call_7rj3k0ab"], [0], "stop", whole=True)]), "", [BASH], "stop",
        "tool_use"),
    StreamRow("openrouter, comment lines first", _sse(_text_stream("stop"), comments=3), TEXT,
              [], "stop", "end_turn"),
    StreamRow("a gateway, no end marker", _sse(_text_stream("stop"), done=None), TEXT, [],
              "stop", "end_turn", cut=True),
    StreamRow("data:[DONE] without its space", _sse(_text_stream("stop"), done=b"data:[DONE]"),
              TEXT, [], "stop", "end_turn"),
    StreamRow("CRLF line ends", _sse(_text_stream("stop"), sep=b"\r\n\r\n"), TEXT, [], "stop",
              "end_turn"),
    StreamRow("cut at max_tokens", _sse(_text_stream("length")), TEXT, [], "length",
              "max_tokens"),
    StreamRow("eos_token (text-generation-inference)", _sse(_text_stream("eos_token")), TEXT,
              [], "eos_token", "end_turn"),
    StreamRow("no finish reason at all", _sse(_text_stream(None)), TEXT, [], None, "end_turn"),
    StreamRow("function_call as the finish reason", _sse(_calls_stream(
        [GREP], ["call_Lw4bS9dQz1XcV6nHr3Tj8Yk"], [0], "function_call")), "", [GREP],
        "function_call", "tool_use"),
    StreamRow("a call without an id", _sse(_calls_stream([BASH], [None], [0], "tool_calls")),
              "", [BASH], "tool_calls", "tool_use"),
    StreamRow("indices with a gap", _sse(_calls_stream(
        [BASH, GREP], ["call_Aa1bB2cC3dD4eE5fF6gG7hH", "call_Ii8jJ9kK0lL1mM2nN3oO4pP"], [0, 2],
        "tool_calls")), "", [BASH, GREP], "tool_calls", "tool_use"),
]
