"""Tool schemas rendered as the model reads them, in work bounded by their size: whatever a
schema's shape, the calls made to render it grow with its bytes (counted, not timed)."""

from __future__ import annotations

from typing import Any

import orjson
from hypothesis import given, settings
from hypothesis import strategies as st

from runloop_proxy.pipeline.schemas import BUDGET_FLOOR, BUDGET_PER_BYTE, render_tools
from runloop_proxy.pipeline.tokens import TokenCounter

from .work import calls

CALLS_PER_BYTE = 4  # measured 0.12-0.14 on the tau2 schemas; exponential paths blow past it
CALLS_FLOOR = 5_000


def tool(parameters: Any, name: str = "f") -> dict[str, Any]:
    return {"type": "function", "function": {"name": name, "parameters": parameters}}


def nested_kinds(depth: int, kinds: int = 2) -> dict[str, Any]:
    """The finding: a type list whose every kind read the whole node again (kinds^depth)."""
    schema: dict[str, Any] = {"type": "string"}
    for _ in range(depth):
        schema = {"type": ["array"] * kinds + ["object", "null"], "items": schema}
    return {"type": "object", "properties": {"x": schema}}


def bounded(tools: list[dict[str, Any]]) -> tuple[str, int, int]:
    size = len(orjson.dumps(tools))
    text, work = calls(render_tools, tools)
    return text, work, size


def test_a_type_list_nested_deep_renders_in_linear_work() -> None:
    for depth in (4, 8, 16, 32, 60):
        text, work, size = bounded([tool(nested_kinds(depth))])
        assert work <= CALLS_FLOOR + CALLS_PER_BYTE * size, (depth, work, size)
        assert len(text) <= 400 + BUDGET_FLOOR + BUDGET_PER_BYTE * size


def test_each_kind_of_a_type_list_is_rendered_once() -> None:
    text = render_tools([tool({"type": "object", "properties": {
        "a": {"type": ["string", "string", "null"]},
        "b": {"type": ["array", "null"], "items": {"type": "integer"}},
        "c": {"type": ["object", "null"], "properties": {"d": {"type": "boolean"}}}}})])
    assert "a?: string | null," in text
    assert "b?: number[] | null," in text
    assert "d?: boolean," in text and "} | null," in text


def test_past_its_budget_a_rendering_reads_any() -> None:
    wide = tool({"type": "object", "properties": {f"p{i}": {"type": ["array"] * 50,
                                                            "items": {"enum": list(range(50))}}
                                                  for i in range(50)}})
    text, work, size = bounded([wide])
    assert len(text) <= 400 + BUDGET_FLOOR + BUDGET_PER_BYTE * size
    assert "// …" in text or "any" in text
    assert work <= CALLS_FLOOR + CALLS_PER_BYTE * size


schemas = st.recursive(
    st.sampled_from([{"type": "string"}, {"type": "integer"}, {"enum": ["a", 1, None]},
                     {"type": ["string", "null"]}, {}, {"$ref": "#/x"}, {"type": "weird"}]),
    lambda inner: st.one_of(
        st.builds(lambda kinds, items: {"type": kinds, "items": items},
                  st.lists(st.sampled_from(["array", "object", "null", "array"]),
                           min_size=1, max_size=6), inner),
        st.builds(lambda props, req: {"type": "object", "properties": props,
                                      "required": req},
                  st.dictionaries(st.text("abcdef", min_size=1, max_size=4), inner,
                                  max_size=5),
                  st.lists(st.one_of(st.text("abc", max_size=2), st.integers(-5, 5)), max_size=3)),
        st.builds(lambda alts: {"anyOf": alts}, st.lists(inner, max_size=4)),
        st.builds(lambda kinds, items, props: {"type": kinds, "items": items,
                                               "properties": props},
                  st.lists(st.sampled_from(["array", "object"]), min_size=2, max_size=5),
                  inner, st.dictionaries(st.just("p"), inner, max_size=1)),
    ),
    max_leaves=40)


@settings(max_examples=150, deadline=None)
@given(st.lists(schemas, min_size=1, max_size=3))
def test_any_schema_renders_in_work_linear_in_its_bytes(params: list[Any]) -> None:
    tools = [tool({"type": "object", "properties": {"x": p}}, f"f{i}")
             for i, p in enumerate(params)]
    text, work, size = bounded(tools)
    assert work <= CALLS_FLOOR + CALLS_PER_BYTE * size, (work, size)
    assert len(text) <= 400 + BUDGET_FLOOR + BUDGET_PER_BYTE * size


def test_counting_a_hostile_schema_is_bounded_too() -> None:
    """The counter renders and then tokenizes: both within the bound (the finding: 1,015 bytes
    of schema held the event loop 11.5 s)."""
    tc = TokenCounter()
    enc, _ = tc.encoding("gpt-4o")
    tools = [tool(nested_kinds(14))]
    n, work = calls(tc.tools, enc, tools)
    size = len(orjson.dumps(tools))
    assert n > 0 and work <= CALLS_FLOOR + CALLS_PER_BYTE * size, (work, size)


JSON = st.recursive(st.none() | st.booleans() | st.integers(-2**63, 2**63 - 1)
                    | st.floats(allow_nan=False, allow_infinity=False)
                    | st.text(max_size=8),
                    lambda inner: st.lists(inner, max_size=4)
                    | st.dictionaries(st.sampled_from(["type", "properties", "items", "enum",
                                                       "anyOf", "oneOf", "required",
                                                       "description", "name", "parameters",
                                                       "function", "x"]), inner, max_size=5),
                    max_leaves=30)


SCHEMA_KEYS = ["type", "properties", "items", "enum", "anyOf", "oneOf", "required",
               "description"]
# a schema-shaped object whose every value may be any JSON: what a careless client sends
SCHEMAISH = st.recursive(
    JSON, lambda inner: st.dictionaries(st.sampled_from(SCHEMA_KEYS),
                                        inner | st.dictionaries(st.text(max_size=4), inner,
                                                                max_size=3), max_size=5),
    max_leaves=30)
TOOLS = st.lists(st.one_of(
    JSON,
    st.builds(lambda name, p: {"type": "function", "function": {"name": name, "parameters": p}},
              JSON, SCHEMAISH),
    st.builds(lambda name, p: {"type": "function", "name": name, "parameters": p},
              JSON, SCHEMAISH)), max_size=3)


@settings(max_examples=500, deadline=None)
@given(TOOLS)
def test_any_json_as_tools_renders_without_an_error(tools: list[Any]) -> None:
    """Whatever a client sends as tools (the validator checks their outline only: the rest
    passes through to the upstream, which judges it) renders in bounded work, and never
    raises: a schema whose ``properties`` is a number once made a 500."""
    as_sent = [t if isinstance(t, dict) else {"type": "function", "function": t} for t in tools]
    text, work, size = bounded(as_sent)
    assert isinstance(text, str) and work <= CALLS_FLOOR + CALLS_PER_BYTE * size
