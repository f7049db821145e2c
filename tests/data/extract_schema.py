"""Extract the chat-completions request schema from OpenAI's OpenAPI spec, $refs resolved, into
chat_request.schema.json (the fuzz test's source; the spec itself is not in this repository).

    python tests/data/extract_schema.py path/to/openai-openapi.yaml

The spec is openai/openai-openapi (MIT). Recursive schemas are cut at a depth (an empty schema,
"anything", stands for what lies deeper).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import yaml

ROOT = "CreateChatCompletionRequest"
MAX_DEPTH = 12
KEEP = {"type", "properties", "required", "items", "enum", "anyOf", "oneOf", "allOf",
        "nullable", "minItems", "maxItems", "minimum", "maximum", "additionalProperties",
        "default"}


def resolve(node: Any, schemas: dict[str, Any], depth: int = 0) -> Any:
    if depth > MAX_DEPTH:
        return {}
    if isinstance(node, list):
        return [resolve(n, schemas, depth) for n in node]
    if not isinstance(node, dict):
        return node
    if "$ref" in node:
        return resolve(schemas[node["$ref"].rsplit("/", 1)[1]], schemas, depth + 1)
    out = {}
    for k, v in node.items():
        if k not in KEEP:
            continue
        if k == "properties":
            out[k] = {name: resolve(p, schemas, depth + 1) for name, p in v.items()}
        elif k in ("items", "additionalProperties", "anyOf", "oneOf", "allOf"):
            out[k] = resolve(v, schemas, depth + 1)
        else:
            out[k] = v
    return out


def main() -> None:
    spec = yaml.safe_load(Path(sys.argv[1]).read_text())
    schemas = spec["components"]["schemas"]
    out = Path(__file__).with_name("chat_request.schema.json")
    out.write_text(json.dumps(resolve(schemas[ROOT], schemas), separators=(",", ":")))
    print(f"wrote {out} ({out.stat().st_size} bytes)")


if __name__ == "__main__":
    main()
