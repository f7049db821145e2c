"""Which requests form one conversation (pure).

A session id given by the client is trusted as given; without one, a fingerprint of the
conversation's opening names the session.
"""

from __future__ import annotations

import hashlib
import urllib.parse
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from .messages import Message, message_hash

MAX_ID_CHARS = 256


class SessionKind(StrEnum):
    EXPLICIT = "explicit"  # the client named it
    FINGERPRINT = "fingerprint"  # derived from the conversation's opening


@dataclass(frozen=True)
class Session:
    id: str
    kind: SessionKind
    source: str  # where the id came from: "header", "metadata.session_id", "fingerprint", …

    @property
    def header_value(self) -> str:
        """The id as a response header can carry it (percent-encoded beyond visible ASCII)."""
        if all(0x20 < ord(c) < 0x7F for c in self.id):
            return self.id
        return urllib.parse.quote(self.id, safe="")


def identify(headers: list[tuple[str, str]], body: dict[str, Any], messages: list[Message],
             namespace: str, session_header: str) -> Session:
    """Header, then prompt_cache_key, metadata.session_id, user; else a fingerprint of the
    namespace and the conversation's first non-system message."""
    name = session_header.lower()
    for k, v in headers:
        if k.lower() == name and v:
            return Session(v[:MAX_ID_CHARS], SessionKind.EXPLICIT, "header")
    meta = body.get("metadata")
    for source, candidate in (("prompt_cache_key", body.get("prompt_cache_key")),
                              ("metadata.session_id",
                               meta.get("session_id") if isinstance(meta, dict) else None),
                              ("user", body.get("user"))):
        if isinstance(candidate, str) and candidate:
            return Session(candidate[:MAX_ID_CHARS], SessionKind.EXPLICIT, source)
    first = next((m for m in messages if m.get("role") not in ("system", "developer")),
                 messages[0])
    digest = hashlib.sha256(f"{namespace}\0{message_hash(first)}".encode()).hexdigest()
    return Session("fp-" + digest[:32], SessionKind.FINGERPRINT, "fingerprint")
