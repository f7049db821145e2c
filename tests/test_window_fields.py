"""What the window does not change, it passes on: a property over every drawn conversation
and policy. Every message carries fields the proxy does not know (an SDK's ``name``, a
provider's extension), each message's own; in the window, every question, system prompt and
tool result that came from a client message — whole, capped, noted or trimmed — carries its
source's every field but the content, unchanged. Only what the proxy made itself (a marker, a
stub, an elided result's placeholder, a past loop's reduced reply) may lack them. A rewrite
that rebuilds a message from its role and content fails here whatever the lever. Planted,
each red: a past loop's capped question rebuilt from role and content; a capped tool result
rebuilt from its call id and content."""

from __future__ import annotations

from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from runloop_proxy.config import Policy
from runloop_proxy.conversation.messages import Message
from runloop_proxy.window.forms import TAG

from .test_window import PROPS, build, conversations, policies

KEPT_ROLES = ("user", "system", "developer", "tool")


def with_fields(msgs: list[Message]) -> list[Message]:
    """Each message with fields of its own the proxy does not know."""
    out: list[Message] = []
    for i, m in enumerate(msgs):
        extra: dict[str, Any] = {"x_extension": {"n": i, "tags": ["a", i]}}
        if m["role"] in ("user", "tool"):
            extra["name"] = f"caller-{i}"
        out.append({**m, **extra})  # type: ignore[typeddict-item]
    return out


def made_by_the_proxy(m: Message) -> bool:
    content = m.get("content")
    return isinstance(content, str) and content.startswith(TAG)


@PROPS
@given(conversations(), policies, st.integers(200, 3000))
def test_every_message_from_the_client_keeps_its_other_fields(
        msgs: list[Message], policy: Policy, working: int) -> None:
    sent = with_fields(msgs)
    by_id = {m["x_extension"]["n"]: m for m in sent}  # type: ignore[typeddict-item]
    window = build(sent, policy, hard=working + 200, working=working)
    for m in window.messages:
        if m["role"] not in KEPT_ROLES or made_by_the_proxy(m):
            continue
        ext = m.get("x_extension")
        assert isinstance(ext, dict), f"a {m['role']} message lost its fields: {m}"
        source = by_id[ext["n"]]
        assert source["role"] == m["role"]
        assert {k: v for k, v in m.items() if k != "content"} == \
            {k: v for k, v in source.items() if k != "content"}, (source, m)
