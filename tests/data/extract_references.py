"""Extract from OpenAI's OpenAPI spec every field of a request body that holds an id, at its
real depth, each as the smallest body of its endpoint that has it, into
stored_references.json (test_references.py's source; the spec is not in this repository).

    python tests/data/extract_references.py path/to/openai-openapi.yaml

Each field is marked by what the spec says it names: ``stored`` when its name or
description names an object the upstream account keeps (an uploaded file, a vector store, a
container, a skill, a stored prompt, a previous response or conversation, a custom voice, a
previous audio answer, an MCP tunnel), else an id the client owns (a tool call's, an item's,
a safety check's), and every object with an ``id``, as the smallest instance of its type
(which the upstream looks up by id when the instance is nothing but that).
The spec is openai/openai-openapi (MIT).
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Any

import yaml

ROOTS = {"/chat/completions": "CreateChatCompletionRequest", "/responses": "CreateResponse",
         "/responses/input_tokens": "TokenCountsBody", "/embeddings": "CreateEmbeddingRequest",
         "/moderations": "CreateModerationRequest", "/completions": "CreateCompletionRequest",
         "/audio/speech": "CreateSpeechRequest", "/images/generations": "CreateImageRequest",
         "/images/edits": "EditImageBodyJsonParam"}
# what the spec's words say a field names (its description, else its name)
STORED = re.compile(r"\b(uploaded|file id|file api|the file\b|the id of the file|of the file\.|"
                    r"vector stores?|container|skill|prompt template|custom voice|previous "
                    r"audio response|tunnel|conversation)", re.I)
OWNED = re.compile(r"\b(call|tool call|approval request|safety check|item|output message|"
                   r"reasoning|list|connectors?)\b", re.I)
STORED_NAMES = {"previous_response_id", "conversation", "container", "prompt",
                "vector_store_ids", "file_ids", "file_id", "skill_id", "container_id",
                "tunnel_id"}
IDS = {"file_id": "file-8Hq2xV3Mz1Rk7TcW5bNp9Y", "file_ids": "file-Qw4Er6Ty8Ui0Op2As4Df6G",
       "vector_store_ids": "vs_68f1c2a9d3e48191b7c5a0e2f4d6b8a1",
       "container": "cntr_68f1c2a9d3e48191b7c5a0e2f4d6b8a2",
       "container_id": "cntr_68f1c2a9d3e48191b7c5a0e2f4d6b8a3",
       "skill_id": "skill_68f1c2a9d3e48191b7c5a0e2f4d6b8a4",
       "tunnel_id": "tun_68f1c2a9d3e48191b7c5a0e2f4d6b8a5",
       "previous_response_id": "resp_68f1c2a9d3e48191b7c5a0e2f4d6b8a6",
       "conversation": "conv_68f1c2a9d3e48191b7c5a0e2f4d6b8a7",
       "call_id": "call_Xk2m9QpR4vT7wY1zA3bC5dE8", "tool_call_id": "call_Hn5b8Jq2Lm4Pz7Rt9Vw1Xy3A",
       "caller_id": "call_Bd7f9Hj1Kl3Mn5Pq7Rs9Tv1W", "approval_request_id": "mcpr_68f1c2a9d3e4",
       "connector_id": "connector_dropbox"}
MAX_DEPTH = 24


class Spec:
    def __init__(self, spec: dict[str, Any]):
        self.schemas = spec["components"]["schemas"]

    def resolve(self, node: Any, refs: frozenset[str]) -> tuple[dict[str, Any], frozenset[str]]:
        """``node`` with its $ref followed and its allOf merged (properties, required)."""
        while isinstance(node, dict) and "$ref" in node:
            name = node["$ref"].rsplit("/", 1)[1]
            if name in refs:
                return {}, refs
            refs = refs | {name}
            node = self.schemas[name]
        if not isinstance(node, dict):
            return {}, refs
        if "allOf" in node:
            merged: dict[str, Any] = {k: v for k, v in node.items() if k != "allOf"}
            merged["properties"] = dict(node.get("properties") or {})
            merged["required"] = list(node.get("required") or [])
            for part in node["allOf"]:
                part, refs = self.resolve(part, refs)
                merged["properties"].update(part.get("properties") or {})
                merged["required"] += part.get("required") or []
                for k in ("type", "anyOf", "oneOf"):
                    if k in part and k not in merged:
                        merged[k] = part[k]
            node = merged
        return node, refs

    def minimal(self, node: Any, refs: frozenset[str], depth: int = 0) -> Any:
        node, refs = self.resolve(node, refs)
        if depth > 8 or not node:
            return "x"
        if "const" in node:
            return node["const"]
        if node.get("enum"):
            return node["enum"][0]
        for k in ("oneOf", "anyOf"):
            if node.get(k):
                return self.minimal(node[k][0], refs, depth + 1)
        kind = node.get("type")
        if isinstance(kind, list):
            kind = kind[0]
        if kind == "object" or "properties" in node:
            props = node.get("properties") or {}
            return {k: self.minimal(props[k], refs, depth + 1)
                    for k in node.get("required") or [] if k in props}
        if kind == "array":
            n = node.get("minItems", 0)
            return [self.minimal(node.get("items", {}), refs, depth + 1)] * n
        return {"integer": 1, "number": 1.5, "boolean": False}.get(kind, "x")

    def fields(self, node: Any, refs: frozenset[str], depth: int = 0
               ) -> list[tuple[str, str, bool, Any]]:
        """(dotted path, its description, stored?, an instance of ``node`` holding it)."""
        node, refs = self.resolve(node, refs)
        if depth > MAX_DEPTH or not node:
            return []
        out = []
        for k in ("oneOf", "anyOf"):
            for branch in node.get(k) or []:
                out += self.fields(branch, refs, depth + 1)
        if isinstance(node.get("items"), dict):
            out += [(p, d, s, [v]) for p, d, s, v in self.fields(node["items"], refs, depth + 1)]
        extra = node.get("additionalProperties")
        if isinstance(extra, dict):
            out += [("{}." + p, d, s, {"var": v})
                    for p, d, s, v in self.fields(extra, refs, depth + 1)]
        props = node.get("properties") or {}
        for name, prop in props.items():
            base = {k: self.minimal(props[k], refs) for k in node.get("required") or []
                    if k in props and k != name}
            held = self.held(name, prop, refs)
            if held is not None:
                desc, stored, value = held
                out.append((name, desc, stored, {**base, name: value}))
            if name in ("parameters", "schema", "metadata"):
                continue  # the client's own names: nothing in them names an object
            out += [(f"{name}.{p}", d, s, {**base, name: v})
                    for p, d, s, v in self.fields(prop, refs, depth + 1)]
        return out

    def held(self, name: str, prop: Any, refs: frozenset[str]) -> tuple[str, bool, Any] | None:
        """A field holding an id: its description, whether it names a stored object, the
        id in the field's own type (a string, a list of them, an object with an ``id``)."""
        node, _ = self.resolve(prop, refs)
        desc = " ".join(str(node.get("description") or "").split())
        if not (name.endswith(("_id", "_ids")) or name == "id" or name in STORED_NAMES):
            return None
        kinds = {b.get("type") for b in [node, *(self.resolve(x, refs)[0]
                                                  for x in node.get("anyOf") or node.get(
                                                      "oneOf") or [])]}
        if name in ("prompt", "conversation") and "object" not in kinds and "string" not in kinds:
            return None
        if name == "prompt" and "object" not in kinds and (desc or "string" in kinds):
            return None  # a text prompt (completions, images, transcriptions)
        if name == "id":
            return None  # judged with its object (``objects``)
        words = desc or name.replace("_", " ")
        stored = name in STORED_NAMES or (bool(STORED.search(words))
                                          and not OWNED.search(words))
        value: Any = IDS.get(name, f"{name.removesuffix('_ids').removesuffix('_id')}_68f1c2a9")
        if name == "prompt":
            value = {"id": "pmpt_68f1c2a9d3e48191b7c5a0e2f4d6b8a8"}
        elif name.endswith("_ids") or "array" in kinds:
            value = [value]
        return desc, stored, value


def with_ids(spec: Spec, node: Any, refs: frozenset[str], depth: int = 0
             ) -> list[tuple[str, str, bool, Any]]:
    """Every object with an ``id`` property: the object as its smallest instance with an id
    of its kind, judged by the id's description and the object's type."""
    node, refs = spec.resolve(node, refs)
    if depth > MAX_DEPTH or not node:
        return []
    out = []
    for k in ("oneOf", "anyOf"):
        for branch in node.get(k) or []:
            out += with_ids(spec, branch, refs, depth + 1)
    if isinstance(node.get("items"), dict):
        out += [(p, d, s, [v]) for p, d, s, v in with_ids(spec, node["items"], refs, depth + 1)]
    props = node.get("properties") or {}
    if "id" in props:
        idn, _ = spec.resolve(props["id"], refs)
        desc = " ".join(str(idn.get("description") or "").split())
        inst = spec.minimal(node, refs)
        if isinstance(inst, dict):
            kind = str(inst.get("type", ""))
            # an item given by nothing but its id (and type) is one the upstream looks up
            # by that id: Responses' item references may leave their type out
            stored = kind == "item_reference" or inst.keys() <= {"id", "type"} or bool(
                re.search(r"custom voice|previous audio|prompt template|conversation", desc, re.I))
            inst["id"] = {"item_reference": "msg_68f1c2a9d3e48191b7c5a0e2f4d6b8a9"}.get(
                kind, "voice_1234" if "voice" in desc else "audio_68f1c2a9d3e4"
                if "audio" in desc else "pmpt_68f1c2a9d3e4" if "prompt" in desc
                else "conv_68f1c2a9d3e4" if "conversation" in desc else "fc_68f1c2a9d3e4")
            out.append(("id", desc, stored, inst))
    for name, prop in props.items():
        if name in ("parameters", "schema", "metadata"):
            continue
        base = {k: spec.minimal(props[k], refs) for k in node.get("required") or []
                if k in props and k != name}
        out += [(f"{name}.{p}", d, s, {**base, name: v})
                for p, d, s, v in with_ids(spec, prop, refs, depth + 1)]
    return out


def _holds_stored(value: Any) -> bool:
    if isinstance(value, list):
        return any(_holds_stored(v) for v in value)
    if isinstance(value, dict):
        return any((k in STORED_NAMES and isinstance(v, str) and v) or _holds_stored(v)
                   for k, v in value.items())
    return False


def main(path: str) -> None:
    spec = Spec(yaml.load(Path(path).read_text(), Loader=getattr(yaml, "CSafeLoader",
                                                                  yaml.SafeLoader)))
    rows: list[dict[str, Any]] = []
    seen = set()
    for endpoint, root in ROOTS.items():
        found = spec.fields(spec.schemas[root], frozenset({root})) \
            + with_ids(spec, spec.schemas[root], frozenset({root}))
        for field, desc, stored, body in found:
            key = (endpoint, field, json.dumps(body, sort_keys=True))
            if key in seen:
                continue
            seen.add(key)
            # (an instance's required fields may name a stored object of their own: a code
            # interpreter call's container)
            stored = stored or _holds_stored(body)
            rows.append({"endpoint": endpoint, "field": field, "stored": stored,
                         "description": desc[:160], "body": body})
    out = Path(__file__).with_name("stored_references.json")
    out.write_text(json.dumps(rows, indent=1, sort_keys=True) + "\n")
    print(f"{len(rows)} fields ({sum(r['stored'] for r in rows)} naming a stored object) "
          f"-> {out}")


if __name__ == "__main__":
    main(sys.argv[1])
