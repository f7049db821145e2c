"""Which requests form one conversation (pure): explicit ids, fingerprints, their scope, the
keys each kind is stored under, and how a trimmed history finds where it is stored."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from runloop_proxy.conversation.identity import (
    DEFAULT_SOURCES,
    Session,
    SessionKind,
    anchor,
    anchors,
    chained_key,
    check_source,
    claude_code_session,
    continued,
    identify,
    named_key,
    stored_id,
)
from runloop_proxy.conversation.messages import Message
from runloop_proxy.errors import InvalidRequest

SYS: Message = {"role": "system", "content": "You are a support agent."}
HELLO: Message = {"role": "user", "content": "Hello"}
BODY: dict[str, Any] = {"model": "m", "messages": [SYS, HELLO]}


def ident(body: dict[str, Any] = BODY, headers: dict[str, str] | None = None, ns: str = "t",
          sources: tuple[str, ...] = DEFAULT_SOURCES) -> Any:
    return identify(list((headers or {}).items()), body, body["messages"], ns, "X-Session-Id",
                    sources)


@pytest.mark.parametrize(("headers", "extra", "sources", "expected", "source"), [
    ({"X-Session-Id": "hdr"}, {}, DEFAULT_SOURCES, "hdr", "header:x-session-id"),
    ({"session_id": "codex-1"}, {}, DEFAULT_SOURCES, "codex-1", "header:session_id"),
    ({"conversation_id": "codex-0"}, {}, DEFAULT_SOURCES, "codex-0", "header:conversation_id"),
    ({}, {"metadata": {"session_id": "md"}}, DEFAULT_SOURCES, "md", "metadata.session_id"),
    ({"X-Session-Id": "hdr"}, {"metadata": {"session_id": "md"}}, DEFAULT_SOURCES, "hdr",
     "header:x-session-id"),
    # user and prompt_cache_key name an end user and a cache group, not a conversation ...
    ({}, {"user": "u1", "prompt_cache_key": "pck"}, DEFAULT_SOURCES, None, "fingerprint"),
    # ... unless the tenant lists them as sources
    ({}, {"user": "u1"}, ("header", "user"), "u1", "user"),
    ({}, {"prompt_cache_key": "conv-7"}, ("prompt_cache_key",), "conv-7", "prompt_cache_key"),
    ({}, {"metadata": {"thread": "th"}}, ("metadata.thread",), "th", "metadata.thread"),
    ({"X-Other": "x"}, {}, ("header:x-other",), "x", "header:x-other"),
])
def test_explicit_sources_in_order(headers: dict[str, str], extra: dict[str, Any],
                                   sources: tuple[str, ...], expected: str | None,
                                   source: str) -> None:
    s = ident({**BODY, **extra}, headers, sources=sources)
    assert s.source == source
    if expected is None:
        assert s.kind is SessionKind.FINGERPRINT and s.id.startswith("fp-")
    else:
        assert (s.label, s.id, s.kind) == (expected, "n:" + expected, SessionKind.EXPLICIT)
        assert s.header_value == expected and s.reaches_store


def test_fingerprint_covers_namespace_scope_system_prompt_and_first_user_message() -> None:
    base = ident()
    pirate = {**BODY, "messages": [{"role": "system", "content": "You are a pirate."},
                                   {"role": "user", "content": "Hello there"}]}
    lawyer = {**BODY, "messages": [{"role": "system", "content": "You are a lawyer."},
                                   {"role": "user", "content": "Hello there"}]}
    assert ident(pirate).id != ident(lawyer).id
    assert ident(ns="other").id != base.id
    assert ident({**BODY, "user": "alice"}).id != ident({**BODY, "user": "bob"}).id
    assert ident({**BODY, "user": "alice"}).id != base.id
    assert ident({**BODY, "prompt_cache_key": "g1"}).id != \
        ident({**BODY, "prompt_cache_key": "g2"}).id
    # the same opening is the same conversation, however it goes on
    later = {**BODY, "messages": [SYS, HELLO, {"role": "assistant", "content": "Hi!"},
                                  {"role": "user", "content": "more"}]}
    assert ident(later).id == base.id
    # an assistant greeting before the first user message does not make everyone one session
    greeted = [SYS, {"role": "assistant", "content": "How can I help?"}]
    a = ident({**BODY, "messages": [*greeted, {"role": "user", "content": "refund"}]})
    b = ident({**BODY, "messages": [*greeted, {"role": "user", "content": "rebook"}]})
    assert a.id != b.id


def test_ids_beyond_visible_ascii_are_kept_and_echoed_percent_encoded() -> None:
    s = ident({**BODY, "user": "山田"}, sources=("user",))
    assert s.label == "山田" and s.header_value == "%E5%B1%B1%E7%94%B0"
    assert s.id == named_key("山田") and s.id.startswith("h:")
    assert ident(headers={"X-Session-Id": "plain-1"}).header_value == "plain-1"


def test_a_fingerprint_reaches_only_its_request_and_shows_its_own_key() -> None:
    s = ident()
    assert s.label == s.id and not s.reaches_store
    assert ident(headers={"X-Session-Id": s.id}).reaches_store  # named: it does


# Every id a client can give, every id the proxy shows or derives: what a client names must
# land in the named namespace, injectively, and never on a key the proxy derived.
CLIENT_IDS = st.one_of(
    st.text(min_size=1, max_size=40),
    st.from_regex(r"(n:|h:|fp-|chain-|h-|x-)[0-9a-f]{1,40}", fullmatch=True),
    st.from_regex(r"[A-Za-z0-9._:-]{1,140}", fullmatch=True))


@given(a=CLIENT_IDS, b=CLIENT_IDS)
def test_named_keys_are_injective_and_apart_from_derived_ones(a: str, b: str) -> None:
    ka, kb = named_key(a), named_key(b)
    assert (ka == kb) == (a == b)
    assert ka.startswith(("n:", "h:")) and not ka.startswith(("fp-", "chain-"))
    assert stored_id(ka) == ka  # an operator's name for a listed key is that key


@given(given_id=CLIENT_IDS)
def test_a_derived_id_sent_back_names_a_new_session(given_id: str) -> None:
    """The fingerprint the proxy echoed, a chained conversation's key, a named key itself:
    sent back as a session id, each lands on a key of its own."""
    fp = ident().id
    for shown in (fp, chained_key("resp_1"), named_key(given_id)):
        claimed = ident(headers={"X-Session-Id": shown})
        assert claimed.id != shown and claimed.id == named_key(shown)


@pytest.mark.parametrize("bad", ["a\x00b", "line\nbreak", "tab\tin", "x" * 257, "\u2028"])
def test_unusable_ids_are_a_400_naming_the_field(bad: str) -> None:
    with pytest.raises(InvalidRequest) as err:
        ident({**BODY, "metadata": {"session_id": bad}})
    assert err.value.param == "metadata.session_id"


def test_session_sources_are_checked() -> None:
    for good in ("header", "header:session_id", "metadata.k", "user", "prompt_cache_key"):
        assert check_source(good) == good
    for bad in ("cookie", "header:", "metadata.", "User"):
        with pytest.raises(ValueError):
            check_source(bad)


CALL: Message = {"role": "assistant", "content": None, "tool_calls": [
    {"id": "call_Zx81", "type": "function", "function": {"name": "lookup", "arguments": "{}"}}]}
LONG: Message = {"role": "assistant", "content": "A detailed answer. " * 20}
SHORT: Message = {"role": "assistant", "content": "Sure!"}


def test_only_replies_no_stranger_gets_anchor_a_session() -> None:
    assert anchor(SHORT, ()) is None
    assert anchor(CALL, ()) is not None and anchor(LONG, ()) is not None
    assert anchor(LONG, ("user=a",)) != anchor(LONG, ("user=b",))
    # an echo with fields of the client's own is the same reply
    echoed: Message = {**LONG, "refusal": None, "annotations": []}  # type: ignore[typeddict-unknown-key]
    assert anchor(echoed, ()) == anchor(LONG, ())
    msgs = [SYS, HELLO, CALL, {"role": "tool", "tool_call_id": "call_Zx81", "content": "r"},
            LONG, {"role": "user", "content": "next"}, SHORT]
    assert anchors(msgs, ()) == [anchor(LONG, ()), anchor(CALL, ())]


def test_a_trimmed_history_continues_where_its_messages_line_up() -> None:
    stored = [SYS, HELLO, CALL, {"role": "tool", "tool_call_id": "call_Zx81", "content": "r"},
              LONG, {"role": "user", "content": "next"}, SHORT]
    # the client keeps its system prompt and the last three messages
    trimmed = [SYS, stored[3], LONG, {"role": "user", "content": "next"}]
    assert continued(stored, trimmed) == 3
    assert continued(stored, [SYS, LONG, {"role": "user", "content": "x"}]) is None  # one
    # a reply with tool calls is evidence enough on its own (the ids are the provider's)
    assert continued(stored, [SYS, CALL, stored[3], {"role": "user", "content": "x"}]) == 2
    # a stranger whose reply matches but whose question differs does not continue it
    stranger = [SYS, {"role": "tool", "tool_call_id": "call_Zx81", "content": "other"}, LONG]
    assert continued(stored, stranger) is None
    assert continued(stored, [SYS, HELLO, SHORT]) is None  # a short reply anchors nothing


@pytest.mark.parametrize("key", ["n:alice", "h:" + "0" * 32])
@pytest.mark.parametrize("kind", [k for k in SessionKind if k is not SessionKind.EXPLICIT])
def test_no_guess_lands_in_a_named_session(key: str, kind: SessionKind) -> None:
    """The rule every way into a session goes through: a session found by a guess (a
    fingerprint, a continuation, a chained response id) is never stored under a named key,
    and a named one never under a derived key."""
    with pytest.raises(ValueError):
        Session(key, kind, "guess", label=key)
    with pytest.raises(ValueError):
        Session("fp-" + "0" * 32, SessionKind.EXPLICIT, "header")
    assert Session(key, SessionKind.EXPLICIT, "header").id == key


def _calling(k: int) -> list[Message]:
    return [{"role": "assistant", "content": None, "tool_calls": [{"id": f"call_{k}",
             "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
            {"role": "tool", "tool_call_id": f"call_{k}", "content": f"r{k}"}]


@pytest.mark.parametrize("n", [400])
def test_lining_up_a_trimmed_history_is_linear_work(n: int) -> None:
    """A request that matches a stored conversation but for one message in its middle, with
    an anchoring reply after every step: each try reads the run up to that message, so
    trying every reply was quadratic; a few are tried, and the work doubles with the size."""
    from .work import calls

    def case(size: int) -> tuple[list[Message], list[Message]]:
        stored: list[Message] = [SYS, HELLO]
        for k in range(size):
            stored += _calling(k)
        request = [SYS, *stored[1:]]
        request[size] = {"role": "tool", "tool_call_id": "call_x", "content": "forged"}
        return stored, request

    (found, small) = calls(continued, *case(n))
    (_, large) = calls(continued, *case(2 * n))
    assert large < 2.3 * small, (small, large)
    assert found is None  # the newest replies do not line up: no continuation


@pytest.mark.parametrize("headers, metadata, tools, found", [
    ({"x-claude-code-session-id": "s-head"}, {"user_id": '{"session_id": "s-json"}'}, True,
     "s-head"),  # the header first (2.1.86 on)
    ({}, {"user_id": '{"device_id": "d", "session_id": "s-json"}'}, True, "s-json"),
    ({}, {"user_id": "user_ab12_account_4f2c_session_9e1d-77"}, True, "9e1d-77"),  # before
    ({}, {"user_id": "just-a-user"}, True, None),
    ({}, {"user_id": "{not json"}, True, None),
    ({}, {"user_id": 7}, True, None),
    ({"x-claude-code-session-id": "s-head"}, {}, False, None),  # a side request: no tools
    # a subagent (the Task tool, 2.1.332): the main session's id and its own agent id
    ({"x-claude-code-session-id": "s-head", "x-claude-code-agent-id": "a99fa87e13d6a2af1"},
     {}, True, "s-head.agent-a99fa87e13d6a2af1"),
    ({"x-claude-code-agent-id": "a5b0c2"}, {"user_id": '{"session_id": "s-json"}'}, True,
     "s-json.agent-a5b0c2"),
    ({"x-claude-code-agent-id": "a5b0c2"}, {"user_id": "just-a-user"}, True, None),
    ({"x-claude-code-agent-id": ""}, {"user_id": '{"session_id": "s-json"}'}, True, "s-json"),
])
def test_the_session_claude_code_names(headers: dict[str, str], metadata: dict[str, Any],
                                       tools: bool, found: str | None) -> None:
    body: dict[str, Any] = {"metadata": metadata, **({"tools": [{"name": "t"}]} if tools else {})}
    assert claude_code_session(headers, body)[0] == found
