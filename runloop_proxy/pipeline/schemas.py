"""Tool schemas as the model reads them, in work bounded by their size.

The API shows the model a client's tools as a TypeScript-like ``namespace functions`` block,
and bills that, not the JSON. Rendering a schema is driven by request content, on the event
loop, so it must cost what the schema weighs: every node is rendered once (a ``type`` list
renders each kind of the node, and each kind reads a different part of it — ``items`` for an
array, ``properties`` for an object — so nothing is rendered twice; ``$ref`` is never
followed), and all the text it produces is charged to a budget proportional to the schema's
bytes, past which the rest reads ``any``. A schema nesting ``{"type": ["array", "array"],
"items": …}`` ten deep took seconds when each kind re-rendered the whole node.
"""

from __future__ import annotations

from typing import Any

import orjson

BUDGET_PER_BYTE = 2  # characters of rendering a schema's JSON byte may produce
BUDGET_FLOOR = 4096
PRIMITIVES = {"string": "string", "number": "number", "integer": "number",
              "boolean": "boolean", "null": "null"}


def render_tools(tools: list[dict[str, Any]], size: int | None = None) -> str:
    """The tool schemas in the shape the model reads them (what the API bills for tools).
    ``size``: the tools' JSON size when the caller has it (else it is measured)."""
    if size is None:
        size = len(orjson.dumps(tools))
    return _Renderer(BUDGET_FLOOR + BUDGET_PER_BYTE * size).tools(tools)


class _Renderer:
    """One rendering and the characters it may still produce (``left``). Every call and every
    piece of text it adds is charged (text joined from pieces already charged is not: its
    copies cost what the nesting is deep, and the request's nesting is bounded), so neither
    the output nor the work can outgrow the budget, whatever the schema's shape."""

    def __init__(self, budget: int):
        self.left = budget

    def _add(self, text: str) -> str:
        self.left -= len(text) + 1
        return text

    def tools(self, tools: list[dict[str, Any]]) -> str:
        out = ["# Tools", "", "## functions", "", "namespace functions {", ""]
        for tool in tools:
            if self.left <= 0:
                out.append("// …")
                break
            fn = tool.get("function") if isinstance(tool, dict) else None
            if fn is None and isinstance(tool, dict) and tool.get("type") == "function":
                fn = tool  # the Responses API's form: the function's fields at the top
            if not isinstance(fn, dict):
                out.append(self._add(orjson.dumps(tool).decode()))  # another type: as sent
                continue
            if fn.get("description"):
                out.append(self._add(f"// {fn['description']}"))
            params = fn.get("parameters")
            name = self._add(str(fn.get("name", "")))
            if isinstance(params, dict) and isinstance(params.get("properties"), dict) \
                    and params["properties"]:
                out.append(f"type {name} = (_: {self._object(params, 0)}) => any;")
            else:
                out.append(f"type {name} = () => any;")
            out.append("")
        out.append("} // namespace functions")
        return "\n".join(out)

    def _type(self, schema: Any, depth: int) -> str:
        self.left -= 1
        if self.left <= 0 or not isinstance(schema, dict):
            return "any"
        if isinstance(schema.get("enum"), list):
            return self._union(self._add(orjson.dumps(v).decode()) for v in schema["enum"])
        for key in ("anyOf", "oneOf"):
            if isinstance(schema.get(key), list):
                return self._union(self._type(s, depth) for s in schema[key])
        kind = schema.get("type")
        if isinstance(kind, list):
            kinds = dict.fromkeys(k for k in kind if isinstance(k, str))  # each kind once
            return self._union(self._kind(schema, k, depth) for k in kinds)
        return self._kind(schema, kind, depth)

    def _kind(self, schema: dict[str, Any], kind: Any, depth: int) -> str:
        if kind == "object" and isinstance(schema.get("properties"), dict):
            return self._object(schema, depth + 1)
        if kind == "array":
            return self._type(schema.get("items"), depth) + self._add("[]")
        return self._add(PRIMITIVES.get(kind, "any") if isinstance(kind, str) else "any")

    def _union(self, parts: Any) -> str:
        out: list[str] = []
        for part in parts:  # a generator: nothing past the budget is rendered
            out.append(part)
            self.left -= 3
            if self.left <= 0:
                break
        return " | ".join(out) if out else "any"

    def _object(self, schema: dict[str, Any], depth: int) -> str:
        required = {r for r in schema["required"] if isinstance(r, str)} \
            if isinstance(schema.get("required"), list) else set()
        pad = "  " * depth
        lines = ["{"]
        for name, prop in schema["properties"].items():
            if self.left <= 0:
                lines.append(f"{pad}// …")
                break
            if isinstance(prop, dict) and prop.get("description"):
                lines.append(self._add(f"{pad}// {prop['description']}"))
            mark = "" if name in required else "?"
            head = self._add(f"{pad}{name}{mark}: ")
            lines.append(f"{head}{self._type(prop, depth)},")
        lines.append(pad + "}")
        return "\n".join(lines)
