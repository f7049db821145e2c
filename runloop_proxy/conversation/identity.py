"""Which requests form one conversation (pure).

A session id the client gives is trusted as given: the tenant lists where to look for one
(``session_sources``; by default the session header, the headers Codex sends — ``session-id``
today, ``session_id`` and ``conversation_id`` in earlier versions — and
``metadata.session_id``). Without one, the session is a *fingerprint* of the conversation's
opening: the namespace (tenant, or the caller's key in pass-through mode), the end user and
cache group the request names (``user``, ``prompt_cache_key``: they scope the fingerprint, they
do not name a conversation — unless the tenant lists them as sources), the system prompt and
the first user message.

Where a session is stored is its *key* (``Session.id``), and each kind has a namespace of its
own, so no id the proxy prints or derives can be claimed by a client: a named session is kept
under ``n:<id>`` (a plain id) or ``h:<hash of the id>`` (any other), a fingerprint under
``fp-<hash>``, a chained Responses conversation under ``chain-…``. A client that sends back an
``fp-…`` it was shown names a new session ``n:fp-…``; two different client ids never share one.
What the client is shown in ``X-Session-Id`` is its own id, or the fingerprint.

A fingerprint can join strangers who open alike (one app, one system prompt, "Hello"), and any
guess that a request continues a stored conversation can be forged by someone who knows a reply
it got. So a session nobody named reaches only what its request carries (``reaches_store``):
guessing may decide where a turn is stored, never what a model can read.
"""

from __future__ import annotations

import hashlib
import re
import unicodedata
import urllib.parse
from collections.abc import Iterable
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

import orjson

from ..errors import InvalidRequest
from .messages import Message, content_hash, match_hash, message_text, tool_calls_of, unmarked_hash
from .runloops import preamble_end

MAX_ID_CHARS = 256
ANCHOR_TEXT_CHARS = 300  # a reply this long (or with tool calls) is one no stranger gets
ANCHORS_TRIED = 3
DEFAULT_SOURCES = ("header", "header:session-id", "header:session_id",
                   "header:conversation_id", "metadata.session_id", "claude_code")
CLAUDE_CODE_HEADER = "x-claude-code-session-id"
CLAUDE_CODE_AGENT_HEADER = "x-claude-code-agent-id"  # a subagent's (Task's) requests
SCOPE_FIELDS = ("user", "prompt_cache_key")
_PLAIN = re.compile(r"[A-Za-z0-9._-]{1,128}")
NAMED_PREFIXES = ("n:", "h:")  # every named session's key starts so; no derived key does


class SessionKind(StrEnum):
    EXPLICIT = "explicit"  # the client named it
    FINGERPRINT = "fingerprint"  # derived from the conversation's opening
    CHAINED = "chained"  # found from a Responses previous_response_id


@dataclass(frozen=True)
class Session:
    id: str  # the key it is stored under (named_key, fingerprint, chained_key)
    kind: SessionKind
    source: str  # where the id came from: "header:x-session-id", "metadata.session_id", …
    scope: tuple[str, ...] = ()  # what scopes a fingerprint: the end user, the cache group
    label: str = ""  # what the client is shown: the id it gave, or the fingerprint

    def __post_init__(self) -> None:
        # The one rule every way into a session goes through: a named session's key is
        # entered only by a request that names it. A guess (a fingerprint, a continuation, a
        # chained response id) that would land in one is a bug, refused here, never a join.
        if self.id.startswith(NAMED_PREFIXES) != (self.kind is SessionKind.EXPLICIT):
            raise ValueError(f"a {self.kind.value} session cannot be stored under a "
                             f"{'named' if self.kind is not SessionKind.EXPLICIT else 'derived'}"
                             " key")

    @property
    def header_value(self) -> str:
        """The label as a response header can carry it (percent-encoded beyond visible
        ASCII)."""
        shown = self.label or self.id
        if all(0x20 < ord(c) < 0x7F for c in shown):
            return shown
        return urllib.parse.quote(shown, safe="")

    @property
    def explicit(self) -> bool:
        return self.kind is SessionKind.EXPLICIT

    @property
    def reaches_store(self) -> bool:
        """Whether the proxy's tools may read stored messages the request does not carry
        (the session's other branches): only where the client named the session itself.
        The one rule every reader goes through (pipeline/relay.py builds the tools' reach
        from it)."""
        return self.kind is SessionKind.EXPLICIT


def named_key(client_id: str) -> str:
    """Where a session the client named is stored: ``n:<id>`` for a plain id, ``h:<hash>``
    for any other — injective, and never a key the proxy derives (``fp-``, ``chain-``)."""
    if _PLAIN.fullmatch(client_id):
        return "n:" + client_id
    return "h:" + hashlib.sha256(client_id.encode()).hexdigest()[:32]


def named(client_id: str, source: str) -> Session:
    return Session(named_key(client_id), SessionKind.EXPLICIT, source, label=client_id)


def name_of(key: str) -> str:
    """What a client calls the session stored under ``key``, where the key shows it (a
    plain named id); else the key itself (a hashed id is not kept)."""
    return key[2:] if key.startswith("n:") else key


def log_name(key: str) -> str:
    """A session key as a log line may show it. A plain named id is the client's id, and an
    id is a capability (whoever holds the tenant's key and the id reads the session), so a
    log shows a digest of it, ``n#…`` (the inspector's search finds the session by it);
    every other key is a hash or the proxy's own already."""
    if not key.startswith("n:"):
        return key
    return "n#" + hashlib.sha256(key.encode()).hexdigest()[:16]


def chained_key(response_id: str) -> str:
    """Where a conversation chained on a response nobody recorded is stored."""
    return "chain-" + hashlib.sha256(response_id.encode()).hexdigest()[:32]


def stored_id(given: str) -> str:
    """An operator's name for a session (admin API, inspector, ``inspect``) as a key: a key
    as it is (``n:…``, ``h:…``, ``fp-…``, ``chain-…``), else the id a client named."""
    if given.startswith((*NAMED_PREFIXES, "fp-", "chain-")):
        return given
    return named_key(given)


def check_source(source: str) -> str:
    """A ``session_sources`` entry, or ValueError saying what the valid ones are."""
    if source in ("header", "prompt_cache_key", "user", "claude_code") \
            or (source.startswith("header:") and len(source) > 7) \
            or (source.startswith("metadata.") and len(source) > 9):
        return source
    raise ValueError(f"{source!r} is not a session source: use header, header:<name>, "
                     f"metadata.<key>, prompt_cache_key, user or claude_code")


def identify(headers: Iterable[tuple[str, str]], body: dict[str, Any],
             messages: list[Message], namespace: str, session_header: str,
             sources: Iterable[str] = DEFAULT_SOURCES) -> Session:
    """The request's session: the first explicit id ``sources`` find, else the fingerprint."""
    sources = tuple(sources)
    lowered = {k.lower(): v for k, v in headers}
    for source in sources:
        value, where = _lookup(source, lowered, body, session_header)
        if isinstance(value, str) and value:
            return named(_checked(value, where), where)
    scope = tuple(f"{f}={body.get(f)}" for f in SCOPE_FIELDS
                  if f not in sources and isinstance(body.get(f), str))
    key = fingerprint(namespace, scope, messages)
    return Session(key, SessionKind.FINGERPRINT, "fingerprint", scope, label=key)


def fingerprint(namespace: str, scope: tuple[str, ...], messages: list[Message]) -> str:
    """The namespace, the scope, the system prompt and the first user message, hashed —
    without their cache marks (a client moves those between requests)."""
    pre = preamble_end(messages)
    opening = next((m for m in messages[pre:] if m.get("role") == "user"),
                   messages[pre] if pre < len(messages) else None)
    parts = [namespace, *scope, *(unmarked_hash(m) for m in messages[:pre]),
             "|", unmarked_hash(opening) if opening is not None else ""]
    return "fp-" + hashlib.sha256("\0".join(parts).encode()).hexdigest()[:32]


def anchor(message: Message, scope: tuple[str, ...]) -> str | None:
    """What finds the session a recorded reply belongs to, for a client that trimmed its
    history: only replies no stranger gets too (with tool calls — their ids are the
    provider's, unique — or long), within the same end user and cache group."""
    if not tool_calls_of(message) and len(message_text(message)) < ANCHOR_TEXT_CHARS:
        return None
    return content_hash("\0".join([*scope, match_hash(message)]).encode())


def anchors(messages: list[Message], scope: tuple[str, ...]) -> list[str]:
    """The anchors of a request's assistant messages, newest first (a few)."""
    out = []
    for m in reversed(messages):
        if m.get("role") == "assistant" and (a := anchor(m, scope)) is not None:
            out.append(a)
            if len(out) == ANCHORS_TRIED:
                break
    return out


def continued(stored: list[Message], request: list[Message]) -> int | None:
    """Where a request whose client trimmed its history picks up a stored conversation: the
    position in ``stored`` of the request's first message after its system prompt, or None
    when the request does not continue it. It continues it when its messages, from the first
    after the system prompt up to one of its anchoring replies, are a run of ``stored``
    ending at that reply: the reply alone when it carries tool calls (their ids are the
    provider's), else with what precedes it. Only the newest ``ANCHORS_TRIED`` anchoring
    replies are tried (those the session was found by): each try reads the run once, so the
    work is linear in the messages, whatever they hold."""
    pre = preamble_end(request)
    body = [match_hash(m) for m in request[pre:]]
    at = {h: i for i, h in enumerate(match_hash(m) for m in stored)}
    start = preamble_end(stored)
    tried = 0
    for r in range(len(body) - 1, -1, -1):
        m = request[pre + r]
        if m.get("role") != "assistant" or anchor(m, ()) is None:
            continue
        if tried == ANCHORS_TRIED:
            break
        tried += 1
        if body[r] not in at or (r == 0 and not tool_calls_of(m)):
            continue
        j = at[body[r]] - r
        if j >= start and all(match_hash(stored[j + k]) == body[k] for k in range(r)):
            return j
    return None


def header_text(value: str | None, name: str = "the session header") -> str | None:
    """A header's value as its sender wrote it: HTTP carries bytes and the server reads them
    as Latin-1, while clients send text as UTF-8 (``café`` arrives as ``cafÃ©``). Bytes that
    are not UTF-8 are refused: read as Latin-1 they would name the same session as other
    bytes (``caf\\xe9`` and ``café`` in UTF-8), and two ids must be one only when they are
    the same bytes."""
    if value is None or value.isascii():
        return value
    try:
        return value.encode("latin-1").decode("utf-8")
    except (UnicodeEncodeError, UnicodeDecodeError):
        raise InvalidRequest(f"{name} is not UTF-8: send the session id as UTF-8 text",
                             param=name) from None


def _lookup(source: str, headers: dict[str, str], body: dict[str, Any],
            session_header: str) -> tuple[Any, str]:
    if source == "header":
        name = session_header.lower()
        return header_text(headers.get(name), name), f"header:{name}"
    if source.startswith("header:"):
        name = source[7:].lower()
        return header_text(headers.get(name), name), f"header:{name}"
    if source.startswith("metadata."):
        meta = body.get("metadata")
        return (meta.get(source[9:]) if isinstance(meta, dict) else None), source
    if source == "claude_code":
        return claude_code_session(headers, body)
    return body.get(source), source


def claude_code_session(headers: dict[str, str], body: dict[str, Any]) -> tuple[Any, str]:
    """The session Claude Code names: its ``X-Claude-Code-Session-Id`` header (2.1.86 on), else
    the ``session_id`` in ``metadata.user_id`` (a JSON object as text since 2.1.78, before that
    ``user_<hash>_account_<uuid>_session_<uuid>``). Only for a request that carries tools: its
    side requests (a title, the small fast model's checks) carry none and are sessions of
    their own (fingerprinted), not branches of the conversation."""
    if not body.get("tools"):
        return None, "claude_code"
    value = header_text(headers.get(CLAUDE_CODE_HEADER), CLAUDE_CODE_HEADER)
    if isinstance(value, str) and value:
        return _agent_of(value, headers), f"header:{CLAUDE_CODE_HEADER}"
    meta = body.get("metadata")
    user = meta.get("user_id") if isinstance(meta, dict) else None
    if not isinstance(user, str):
        return None, "claude_code"
    if user.startswith("{"):
        try:
            parsed = orjson.loads(user)
        except orjson.JSONDecodeError:
            return None, "claude_code"
        found = parsed.get("session_id") if isinstance(parsed, dict) else None
    else:
        _, sep, found = user.rpartition("_session_")
        found = found if sep else None
    return _agent_of(found, headers) if isinstance(found, str) and found else found, \
        "metadata.user_id"


def _agent_of(session: str, headers: dict[str, str]) -> str:
    """A subagent's own session within Claude Code's: a Task's requests carry the main
    session's id and ``X-Claude-Code-Agent-Id`` (2.1.332), with a system prompt and a
    conversation of their own, so they are a session beside the main one, not its branch."""
    agent = header_text(headers.get(CLAUDE_CODE_AGENT_HEADER), CLAUDE_CODE_AGENT_HEADER)
    return f"{session}.agent-{agent}" if agent else session


def _checked(value: str, where: str) -> str:
    if len(value) > MAX_ID_CHARS:
        raise InvalidRequest(f"the session id in {where} is longer than {MAX_ID_CHARS} "
                             f"characters", param=_param(where))
    if any(unicodedata.category(c) in ("Cc", "Zl", "Zp") for c in value):
        raise InvalidRequest(f"the session id in {where} contains control characters",
                             param=_param(where))
    return value


def _param(where: str) -> str | None:
    return None if where.startswith("header:") else where
