"""Tool schemas rendered as the model reads them, in work bounded by their size: whatever a
schema's shape, the calls made to render it grow with its bytes (counted, not timed), and a
shape nested four times as deep costs at most about four times the work, rendered and counted
(calls and bytes allocated)."""

from __future__ import annotations

from typing import Any

import orjson
from hypothesis import given, settings
from hypothesis import strategies as st

from runloop_proxy.pipeline.schemas import BUDGET_FLOOR, BUDGET_PER_BYTE, render_tools
from runloop_proxy.pipeline.tokens import TokenCounter

from .work import allocated, calls

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


def test_a_deep_and_wide_schema_renders_within_its_budget() -> None:
    """Where a rendering outgrows its JSON: every property's line is indented by its depth, so
    an object of many empty properties nested deep renders to many times its bytes (and the
    text is tokenized next); the budget, charged for every piece written, cuts it short."""
    schema: dict[str, Any] = {"type": "string"}
    for _ in range(28):
        schema = {"type": "object", "properties": {"p": schema, **{f"q{i}": {}
                                                                  for i in range(30)}}}
    text, work, size = bounded([tool(schema)])
    assert "// …" in text and len(text) <= 400 + BUDGET_FLOOR + BUDGET_PER_BYTE * size
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


# -- a shape nested deeper: work grows with the depth, never faster ---------------------------

HOLE = "<hole>"  # where a template takes the schema it wraps
LEAVES = st.sampled_from([{"type": "string"}, {"type": "integer"}, {"enum": ["a", 1, None]},
                          {"type": ["string", "null"]}, {}, {"$ref": "#"}, {"type": "weird"},
                          {"type": "string", "description": "a field 字 😀"},
                          {"type": "object", "description": "Looks it up by its id. " * 20,
                           "properties": {"id": {"type": "string"}}}])
KINDS = st.lists(st.sampled_from(["array", "object", "null", "string", "array"]), min_size=1,
                 max_size=5)
# one level of a schema, its hole where it wraps the next: every keyword that nests a schema
# (rendered or not), with siblings of its own
LEVELS = st.one_of(
    st.builds(lambda k, leaf: {"type": k, "items": HOLE, "properties": {"p": leaf}},
              KINDS, LEAVES),
    st.builds(lambda k, leaf: {"type": k, "items": leaf, "properties": {"p": HOLE, "q": leaf},
                               "required": ["p"]}, KINDS, LEAVES),
    st.builds(lambda k, n: {"type": k, "items": HOLE} if n else {"type": "array", "items": HOLE},
              KINDS, st.booleans()),
    st.builds(lambda key, leaves, at: {key: [*leaves[:at], HOLE, *leaves[at:]]},
              st.sampled_from(["anyOf", "oneOf", "allOf"]), st.lists(LEAVES, max_size=3),
              st.integers(0, 3)),
    st.builds(lambda key, leaf: {"type": "object", key: HOLE, "properties": {"p": leaf}},
              st.sampled_from(["additionalProperties", "not", "if", "$defs"]), LEAVES),
    st.builds(lambda e: {"enum": e, "items": HOLE}, st.lists(st.integers(-99, 99), max_size=3)),
    st.builds(lambda d: {"type": "object", "description": d, "properties": {"x": HOLE}},
              st.text(max_size=30)),
)


def fill(template: Any, inner: Any) -> Any:
    if template == HOLE:
        return inner
    if isinstance(template, dict):
        return {k: fill(v, inner) for k, v in template.items()}
    if isinstance(template, list):
        return [fill(v, inner) for v in template]
    return template


def nested(levels: list[Any], leaf: Any, depth: int) -> list[dict[str, Any]]:
    schema = leaf
    for _ in range(depth):
        for level in levels:
            schema = fill(level, schema)
    return [tool({"type": "object", "properties": {"x": schema}})]


def rendered_and_counted(tools: list[dict[str, Any]]) -> int:
    tc = TokenCounter()  # a fresh cache: every depth is rendered and counted
    enc, _ = tc.encoding("gpt-4o")
    return tc.tools(enc, tools)


ALLOCATED_PER_BYTE = 16  # orjson's buffers grow in steps (4 KB, 8 KB, ...): a step may come
# between n levels and 4n, so the bytes allocated may also grow by this much a byte


@settings(max_examples=120, deadline=None)
@given(st.lists(LEVELS, min_size=1, max_size=3), LEAVES)
def test_a_shape_nested_four_times_deeper_costs_about_four_times_the_work(
        levels: list[Any], leaf: Any) -> None:
    """The class of the finding (a type list re-rendering its node per kind: kinds ** depth)
    and its kin — a node walked once per parent, a subtree copied or serialized again at each
    level, the budget not charged, a piece the tokenizer merges in quadratic time: whatever a
    level is made of, the work of rendering and counting a schema grows from n levels to 4n
    by about four times, counted as calls, and as bytes allocated (or by what its bytes
    grew, at most ``ALLOCATED_PER_BYTE`` a byte)."""
    # 1 level, 4 and 13: the growth from the first is n levels, then 4n (at 0 levels the
    # leaf would sit where a property's description is rendered: another shape)
    shapes = [nested(levels, leaf, d) for d in (1, 4, 13)]
    grown = len(orjson.dumps(shapes[2])) - len(orjson.dumps(shapes[0]))
    for measure, slack, per_byte in ((calls, 500, 0), (allocated, 8_192, ALLOCATED_PER_BYTE)):
        measure(rendered_and_counted, nested(levels, leaf, 1))  # warm: what a first call loads
        base, small, large = (measure(rendered_and_counted, shape)[1] for shape in shapes)
        assert large - base <= max(5 * (small - base), per_byte * grown) + slack, \
            (measure.__name__, base, small, large, grown)
