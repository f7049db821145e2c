"""What a request body names of what an upstream account stores (pure).

Through a key other tenants use too, such a name is another tenant's object: a file, a vector
store, a container, a skill, a stored prompt, a previous response or conversation, a custom
voice, an earlier audio answer, an item looked up by its id. They are found by construction,
not by where each API is known to put one — any field at any depth whose name or shape names
a stored object — so a field an API adds tomorrow is refused until it is known to name none:

- a field named ``*_id`` (a string) or ``*_ids`` (a list), but the ids the client owns
  (``CLIENT_IDS``: a tool call's, the approval it answers, a connector's kind);
- ``previous_response_id``, ``conversation`` and ``container`` given by id;
- an object that is nothing but an ``id`` (with at most its type, version, variables or
  skills: an item by reference, a prompt, a voice, an audio answer, a container) and any
  ``item_reference``;
- a fine-tuned model (``ft:...``), which is the account's.

What is the client's own is not read: a tool's schema, a call's arguments and input,
metadata, environment variables and headers it gives a tool.
"""

from __future__ import annotations

from typing import Any

# ids the client owns: what a model's call is answered by, what a reply points back at
CLIENT_IDS = frozenset({"call_id", "tool_call_id", "tool_use_id", "caller_id", "tool_id",
                        "approval_request_id", "connector_id"})
# fields that name a stored object by a bare id
BY_ID = frozenset({"previous_response_id", "conversation", "container"})
# an object with an id and only these beside it is a reference to what the id names
_BESIDE_ID = frozenset({"id", "type", "version", "variables", "skills"})
# the client's own names and values: nothing in them names an account's object
_NOT_READ = frozenset({"parameters", "input_schema", "schema", "metadata", "arguments",
                       "env", "headers"})
# blocks whose ``input`` is a call's arguments (Anthropic's tool uses)
_CALLS = ("tool_use", "server_tool_use", "mcp_tool_use")


def stored_references(body: Any) -> list[str]:
    """Where ``body`` names a stored object, as dotted paths (list positions left out);
    empty when it names none. Work is linear in the body's size."""
    found: list[str] = []
    stack: list[tuple[str, Any]] = [("", body)]
    while stack:
        path, value = stack.pop()
        if isinstance(value, list):
            stack.extend((path, v) for v in value)
            continue
        if not isinstance(value, dict):
            continue
        kind = value.get("type")
        if kind == "item_reference" or ("id" in value and value.keys() <= _BESIDE_ID
                                        and value["id"]):
            found.append(path or "id")
        calls = isinstance(kind, str) and kind.endswith(_CALLS)
        for key, v in value.items():
            if not isinstance(key, str) or key in _NOT_READ or (calls and key == "input"):
                continue
            where = f"{path}.{key}" if path else key
            if _names_stored(key, v, kind):
                found.append(where)
            elif isinstance(v, (dict, list)):
                stack.append((where, v))
    return found


def _names_stored(key: str, value: Any, kind: Any) -> bool:
    """Whether ``key: value`` names a stored object by its id (an object is read inside)."""
    if not value or key in CLIENT_IDS:
        return False
    if key == "model":
        return isinstance(value, str) and value.startswith("ft:")
    if key == "skill_id" and kind == "anthropic":
        return False  # one of Anthropic's own skills, no account's
    if key in BY_ID or key.endswith("_id"):
        return isinstance(value, (str, int))
    if key.endswith("_ids"):
        return isinstance(value, list)
    return False
