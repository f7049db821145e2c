"""The values a request's stages hand each other (turn.py tells the story)."""

from __future__ import annotations

import functools
from collections.abc import AsyncIterator, Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from multidict import CIMultiDict

from ..config import Policy, TenantSpec
from ..conversation.messages import Message
from ..errors import InvalidRequest
from ..history.store import Prepared
from ..window.builder import Window
from ..windows import asks_long_context
from .offload import is_large, is_large_body
from .references import stored_references
from .tools import ProxyTools
from .upstream import UpstreamClient, UpstreamResponse, upstream_headers
from .wire import Wire


@dataclass(frozen=True)
class Caller:
    """Who is calling, as authentication found it."""

    tenant: TenantSpec
    label: str  # the metric label: the tenant's name, or "passthrough"
    namespace: str | None  # where its history lives; None: none is kept (no key to scope it)
    upstream_auth: str | None  # the Authorization header the upstream gets
    drop_headers: frozenset[str] = frozenset()  # client headers never forwarded (its proxy key)
    upstream_api_key: str | None = None  # sent as x-api-key (an upstream of Anthropic's format)
    # the upstream gets a key of the proxy's (a tenant's secret), not the client's own: no
    # client header that names a caller goes with it
    proxy_key: bool = False
    # ... and another tenant's requests go with that same key: the upstream account and what
    # it stores (files, batches, stored responses) are not this caller's alone
    shared_key: bool = False
    # the upstream's client as the config had it when the key above was taken from it: every
    # upstream call of the request goes through it, so a reload while it is in flight moves
    # neither (a tool round sent the old key to the new URL)
    upstream: UpstreamClient | None = field(default=None, compare=False, repr=False)

    def client(self, clients: Mapping[str, UpstreamClient]) -> UpstreamClient:
        """The upstream's client every call of this request goes through: the one the
        request began with, else the tenant's in ``clients``."""
        return self.upstream or clients[self.tenant.upstream]

    @property
    def holder(self) -> str:
        """Who holds a share of what the proxy bounds (connections, answers read whole):
        a tenant; in pass-through mode, where callers are told apart by their keys, each
        caller's namespace."""
        return (self.namespace or self.label) if self.label == "passthrough" else self.label

    @property
    def scope(self) -> str:
        """What per-caller state (a model's calibration) is kept apart by: the namespace
        (a tenant, a pass-through key), else the label."""
        return self.namespace or self.label

    def upstream_headers(self, client_headers: Iterable[tuple[str, str]],
                         body_as_sent: bool = False) -> CIMultiDict[str]:
        """What the upstream gets of ``client_headers`` for this caller, with the upstream
        key where its format wants it: every request the proxy forwards goes through this."""
        headers = upstream_headers(client_headers, self.upstream_auth, self.drop_headers,
                                   body_as_sent, self.proxy_key)
        if self.upstream_api_key:
            headers["x-api-key"] = self.upstream_api_key
        return headers

    def answer_headers(self, resp: UpstreamResponse) -> list[tuple[str, str]]:
        """What this caller is told of ``resp``'s headers: every answer the proxy relays
        goes through this. The account the key acts as only when the key is the caller's
        own; the key's rate limits only when no other caller's requests count against them
        (its own key, or a tenant's upstream key no other tenant has)."""
        return resp.forward_headers(own_key=not self.proxy_key,
                                    own_limits=not self.shared_key)


MAX_MODEL_CHARS = 256  # the longest model name a request may give (the longest real: ~60)
HISTORY_HEADER = "x-runloop-history"  # "server": the proxy supplies the stored conversation


@dataclass(frozen=True)
class Turn:
    """One client request in the conversation model, from an API adapter."""

    caller: Caller
    wire: Wire
    body: dict[str, Any]
    raw: bytes
    messages: list[Message]
    headers: list[tuple[str, str]]
    chained: str | None = None  # a Responses previous_response_id: the state is upstream
    tools: list[dict[str, Any]] | None = None  # the request's tools in chat form, if not
    counting: bool = False  # a count_tokens request: the window is sized, never sent

    def __post_init__(self) -> None:
        # a model's name keys caches, a calibration table, metric labels and log lines: a
        # client's name is bounded here, where every API's request becomes a turn
        if len(self.model) > MAX_MODEL_CHARS:
            raise InvalidRequest(f"model: a name of {len(self.model)} characters is longer "
                                 f"than any model's (at most {MAX_MODEL_CHARS})",
                                 param="model")

    @functools.cached_property
    def long_context(self) -> bool:
        """Whether the request asks for the model's 1M window (Anthropic's ``context-1m``
        beta, as Claude Code sends it for a ``[1m]`` model)."""
        return asks_long_context(v for k, v in self.headers if k.lower() == "anthropic-beta")

    @functools.cached_property
    def server_history(self) -> bool:
        """Whether the client asks the proxy to supply the stored conversation (the
        ``X-Runloop-History: server`` header): read here, for every API alike — the API that
        cannot serve it refuses it (``reconcile``) instead of ignoring it."""
        asked = {v.strip().lower() for k, v in self.headers if k.lower() == HISTORY_HEADER}
        if not asked <= {"server", "client"} or len(asked) > 1:  # a typo must not quietly
            # mean "client", nor two values one of them
            raise InvalidRequest(f"X-Runloop-History must be \"server\" (the proxy supplies "
                                 f"the stored conversation) or \"client\", not "
                                 f"{', '.join(sorted(repr(a[:40]) for a in asked))}",
                                 param="X-Runloop-History")
        return "server" in asked

    @functools.cached_property
    def stored_references(self) -> list[str]:
        """Where the request names what an upstream account stores (``references``: any
        field at any depth whose name or shape names a stored object — a response or
        conversation it continues, a stored prompt, a file, a vector store, a container, a
        skill, an item by id — never a tool's schema or a call's arguments)."""
        return stored_references(self.body)

    @property
    def chat_tools(self) -> list[dict[str, Any]] | None:
        """The client's tools in chat form: how they are counted and named."""
        return self.tools if self.tools is not None else self.body.get("tools")

    @property
    def model(self) -> str:
        return str(self.body["model"])

    @property
    def stream(self) -> bool:
        return bool(self.body.get("stream"))

    @property
    def policy(self) -> Policy:
        return self.caller.tenant.policy

    @functools.cached_property
    def large(self) -> bool:
        """Worked on off the event loop (offload.py): by the body's bytes or items, or the
        conversation's messages (a stored history can hold more than the body)."""
        return is_large_body(self.raw) or is_large(0, len(self.messages))


@dataclass(frozen=True)
class History:
    """What reconcile found.

    ``messages`` is the conversation the window works on (what the client sent; in
    server-history mode the stored conversation with the new messages after it), ``prepared``
    the same hashed and counted. ``earlier`` is what the store holds of this conversation that
    the client no longer sends (it trimmed its history): stored before ``prepared``, and read
    by nothing that reaches a model (the window, splicing and the proxy's tools see only
    ``messages``: a session nobody named reaches only what its request carries).
    ``appended`` (server-history mode): what this turn adds to the stored conversation, and
    how many of those are its system prompt. ``new_from``: the first position of
    ``messages`` no earlier request of the session carried or was answered with — the
    window records its events at the request points from there on (a request that brings
    several turns at once); None when not known: at this request's own point only.
    """

    messages: list[Message]
    prepared: list[Prepared]
    internal: dict[str, Any] = field(default_factory=dict)
    degraded: str | None = None
    earlier: list[Message] = field(default_factory=list)
    earlier_prepared: list[Prepared] = field(default_factory=list)
    earlier_at: int = 0  # where ``earlier`` goes in ``messages``: after the system prompt
    appended: tuple[list[Prepared], int] | None = None
    new_from: int | None = None
    large: bool = False  # what the store brought is large (server-history mode): off the loop
    # a chained request's previous_response_id as the upstream must read it: the last round
    # of a streamed answer the proxy's tools took several rounds over (``response_alias``);
    # and the outputs of the proxy's own calls in the response it chains on, which the
    # client never saw and the upstream needs beside the client's (``response_owed``)
    chain_to: str | None = None
    owed: list[dict[str, Any]] = field(default_factory=list)

    def to_store(self) -> list[Prepared]:
        """The whole conversation as it is stored: what the client sent, with what it
        trimmed (for the record only)."""
        at = self.earlier_at
        return [*self.prepared[:at], *self.earlier_prepared, *self.prepared[at:]]


@dataclass(frozen=True)
class Recent:
    """A session's last request on this replica: its messages, hashed and counted (the next
    request that starts with them hashes and counts only what it adds)."""

    messages: list[Message]
    prepared: list[Prepared]
    encoding: str
    size: int  # bytes, roughly: the canonical bodies twice (bodies, parsed dicts), and slots


@dataclass(frozen=True)
class Outgoing:
    """What goes upstream: the body, and when it is a window, the window and its parts."""

    body: bytes | dict[str, Any]
    tools: ProxyTools | None = None  # the proxy's tools, when they went out with it
    window: Window | None = None
    conversation: list[Message] = field(default_factory=list)  # what it was built from
    keys: list[str] = field(default_factory=list)
    # what its window did, counted and recorded once it is the window that goes (``taken``)
    steps: list[Callable[[], None]] = field(default_factory=list)

    def taken(self) -> None:
        """This body is the one that goes: its window's steps counted and recorded, once (a
        request built again in a learned window counts only the window it sent then)."""
        steps = list(self.steps)
        self.steps.clear()
        for step in steps:
            step()


@dataclass(frozen=True)
class Answer:
    """What the client gets: a body, or a stream of bytes (counted once it ends)."""

    status: int
    headers: dict[str, str]
    body: bytes = b""
    stream: AsyncIterator[bytes] | None = None
