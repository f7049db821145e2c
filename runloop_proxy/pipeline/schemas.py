"""Tool schemas as the model reads them, in work bounded by their size.

The API shows the model a client's tools as a TypeScript-like ``namespace functions`` block,
and bills that, not the JSON. Rendering a schema is driven by request content, on the event
loop, so it must cost what the schema weighs: every node is rendered once (a ``type`` list
renders each kind of the node, and each kind reads a different part of it — ``items`` for an
array, ``properties`` for an object — so nothing is rendered twice; ``$ref`` is never
followed), every piece of text goes out through one place (``_put``) that charges it to a
budget proportional to the schema's bytes, past which the rest reads ``any``, and the pieces
are joined once at the end (a nested object joined into its parent at each level copied it
once a level). A schema nesting ``{"type": ["array", "array"], "items": …}`` ten deep took
seconds when each kind re-rendered the whole node. The text is then counted by
``tokens.count_text``, in work linear in its length too.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, TypeVar

import orjson

BUDGET_PER_BYTE = 2  # characters of rendering a schema's JSON byte may produce
BUDGET_FLOOR = 4096
PRIMITIVES = {"string": "string", "number": "number", "integer": "number",
              "boolean": "boolean", "null": "null"}
T = TypeVar("T")


def render_tools(tools: list[dict[str, Any]], size: int | None = None) -> str:
    """The tool schemas in the shape the model reads them (what the API bills for tools).
    ``size``: the tools' JSON size when the caller has it (else it is measured)."""
    if size is None:
        size = len(orjson.dumps(tools))
    return _Renderer(BUDGET_FLOOR + BUDGET_PER_BYTE * size).tools(tools)


class _Renderer:
    """One rendering: the pieces it wrote (``out``) and the characters it may still write
    (``left``). Every piece is charged as it is written, and every call writes one at least,
    so neither the output nor the work can outgrow the budget, whatever the schema's
    shape."""

    def __init__(self, budget: int):
        self.left = budget
        self.out: list[str] = []

    def _put(self, text: str) -> None:
        self.left -= len(text) + 1
        self.out.append(text)

    def tools(self, tools: list[dict[str, Any]]) -> str:
        self._put("# Tools\n\n## functions\n\nnamespace functions {\n")
        for tool in tools:
            if self.left <= 0:
                self._put("\n// …")
                break
            fn = tool.get("function") if isinstance(tool, dict) else None
            if fn is None and isinstance(tool, dict) and tool.get("type") == "function":
                fn = tool  # the Responses API's form: the function's fields at the top
            if not isinstance(fn, dict):
                self._put("\n" + orjson.dumps(tool).decode())  # another type: as sent
                continue
            if fn.get("description"):
                self._put(f"\n// {fn['description']}")
            params = fn.get("parameters")
            name = str(fn.get("name", ""))
            if isinstance(params, dict) and isinstance(params.get("properties"), dict) \
                    and params["properties"]:
                self._put(f"\ntype {name} = (_: ")
                self._object(params, 0)
                self._put(") => any;\n")
            else:
                self._put(f"\ntype {name} = () => any;\n")
        self._put("\n} // namespace functions")
        return "".join(self.out)

    def _type(self, schema: Any, depth: int) -> None:
        if self.left <= 0 or not isinstance(schema, dict):
            self._put("any")
        elif isinstance(schema.get("enum"), list):
            self._union(schema["enum"], lambda v: self._put(orjson.dumps(v).decode()))
        elif isinstance(schema.get("anyOf"), list):
            self._union(schema["anyOf"], lambda s: self._type(s, depth))
        elif isinstance(schema.get("oneOf"), list):
            self._union(schema["oneOf"], lambda s: self._type(s, depth))
        elif isinstance(schema.get("type"), list):
            kinds = dict.fromkeys(k for k in schema["type"] if isinstance(k, str))  # once each
            self._union(kinds, lambda k: self._kind(schema, k, depth))
        else:
            self._kind(schema, schema.get("type"), depth)

    def _kind(self, schema: dict[str, Any], kind: Any, depth: int) -> None:
        if kind == "object" and isinstance(schema.get("properties"), dict):
            self._object(schema, depth + 1)
        elif kind == "array":
            self._type(schema.get("items"), depth)
            self._put("[]")
        else:
            self._put(PRIMITIVES.get(kind, "any") if isinstance(kind, str) else "any")

    def _union(self, items: Iterable[T], write: Callable[[T], Any]) -> None:
        """``write`` each item, `` | `` between them, until the budget is spent (nothing past
        it is rendered); ``any`` for none."""
        first = True
        for item in items:
            if not first:
                self._put(" | ")
            write(item)
            first = False
            if self.left <= 0:
                break
        if first:
            self._put("any")

    def _object(self, schema: dict[str, Any], depth: int) -> None:
        required = {r for r in schema["required"] if isinstance(r, str)} \
            if isinstance(schema.get("required"), list) else set()
        pad = "  " * depth
        self._put("{")
        for name, prop in schema["properties"].items():
            if self.left <= 0:
                self._put(f"\n{pad}// …")
                break
            if isinstance(prop, dict) and prop.get("description"):
                self._put(f"\n{pad}// {prop['description']}")
            self._put(f"\n{pad}{name}{'' if name in required else '?'}: ")
            self._type(prop, depth)
            self._put(",")
        self._put(f"\n{pad}}}")
