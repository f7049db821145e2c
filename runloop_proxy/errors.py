"""Every error the proxy raises, and the OpenAI-shaped body a client sees for it.

    ProxyError
    ├── ClientError                 the request is at fault (4xx, shown to the client)
    │   ├── InvalidRequest          400 invalid_request_error (names the field)
    │   │   └── CredentialTooLong   400 a credential longer than the proxy forwards
    │   ├── ContextLengthExceeded   400 context_length_exceeded
    │   ├── AuthenticationFailed    401 invalid_api_key
    │   ├── NotFound                404
    │   └── PayloadTooLarge         413
    ├── UpstreamError               the upstream is at fault (5xx or its own status)
    │   ├── UpstreamUnreachable     502
    │   ├── UpstreamBadReply        502 an answer of the wrong shape, or one cut short
    │   ├── UpstreamTooLarge        502 an answer larger than the proxy may hold whole
    │   └── UpstreamTimeout         504
    ├── Unavailable                 503: this request cannot be served now (Retry-After)
    │   ├── StoreUnavailable        server-history mode while the store is away
    │   ├── TenantOverShare         429: the caller holds its share of a resource already
    │   └── ProxyFull               503: the process's bound of a resource is reached
    ├── StoreError                  Redis failed: the proxy degrades, the client never sees it
    │   └── StoreLimitExceeded      a session outgrew its configured bounds
    ├── EmbeddingError              memory's embedding model failed: words alone answer
    └── ConfigError                 a config file is invalid (file, field, why)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import orjson


class ProxyError(Exception):
    """Base of every error raised by runloop-proxy."""

    @property
    def log_text(self) -> str:
        """What a log line says of this error: its message, less any text it quotes from
        an upstream's answer (which can quote the prompt; the client reads it whole)."""
        return str(self)


class ClientError(ProxyError):
    status = 400
    error_type = "invalid_request_error"
    code: str | None = None

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param
        if code is not None:
            self.code = code

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.error_type, self.param, self.code)


class InvalidRequest(ClientError):
    pass


class CredentialTooLong(InvalidRequest):
    """A credential that would go upstream is longer than the proxy forwards (masking
    it in the answer costs by its length): refused before anything is sent."""

    code = "credential_too_long"


class ContextLengthExceeded(ClientError):
    """A request that cannot fit. Its OpenAI-shaped message opens in OpenAI's own words, as
    an upstream's would: clients tell this error by its text (LiteLLM raises its
    ContextWindowExceededError, and falls back to a larger model, on "This model's maximum
    context length is"), as Anthropic's clients do by "prompt is too long"."""

    code = "context_length_exceeded"

    def __init__(self, message: str, *, param: str | None = None, needed: int | None = None,
                 allowed: int | None = None):
        super().__init__(message, param=param)
        self.needed = needed  # the prompt's tokens after compression
        self.allowed = allowed  # what the model's window leaves for it

    def body(self) -> dict[str, Any]:
        said = self.message
        if self.needed is not None and self.allowed is not None:
            said = (f"This model's maximum context length is {self.allowed} tokens for the "
                    f"messages here. However, your messages resulted in {self.needed} tokens. "
                    f"{said}")
        return error_body(said, self.error_type, self.param, self.code)


class AuthenticationFailed(ClientError):
    status = 401
    error_type = "invalid_request_error"
    code = "invalid_api_key"


class PermissionDenied(ClientError):
    status = 403
    error_type = "permission_error"
    code = "permission_denied"


class NotFound(ClientError):
    status = 404
    code = "not_found"


class Conflict(ClientError):
    status = 409
    code = "conflict"


class PayloadTooLarge(ClientError):
    status = 413
    code = "request_too_large"


class UpstreamError(ProxyError):
    status = 502
    error_type = "upstream_error"
    code = "upstream_error"

    def __init__(self, message: str, status: int | None = None, *, quoted: str = ""):
        """``quoted``: the upstream's own text, shown to the client after ``message`` and
        never logged."""
        super().__init__(message + quoted)
        self.logged = message if not quoted else \
            f"{message or 'the upstream reported an error'} [{len(quoted)} characters of " \
            f"its text, not logged]"
        if status is not None:
            self.status = status

    @property
    def log_text(self) -> str:
        return self.logged

    def body(self) -> dict[str, Any]:
        return error_body(str(self), self.error_type, None, self.code)


class UpstreamKeyRefused(UpstreamError):
    """The upstream refused the key the proxy holds for a tenant: the client's own key for
    the proxy was good, so it is not told it was not (a 401 would say so)."""

    status = 502
    code = "upstream_auth_failed"

    def __init__(self, status: int):
        super().__init__(f"the upstream refused the key this proxy holds for your tenant "
                         f"({status}); your own key was accepted: the proxy's operator must "
                         f"fix the tenant's upstream key")


class UpstreamUnreachable(UpstreamError):
    status = 502
    code = "upstream_unreachable"


class UpstreamBadReply(UpstreamError):
    status = 502
    code = "upstream_bad_response"


class UpstreamTooLarge(UpstreamError):
    status = 502
    code = "upstream_answer_too_large"


class UpstreamTimeout(UpstreamError):
    status = 504
    code = "upstream_timeout"


class Unavailable(ProxyError):
    status = 503
    error_type = "service_unavailable"
    code = "service_unavailable"

    def __init__(self, message: str, retry_after: float = 1.0):
        super().__init__(message)
        self.retry_after = retry_after

    def body(self) -> dict[str, Any]:
        return error_body(str(self), self.error_type, None, self.code)


class StoreUnavailable(Unavailable):
    code = "store_unavailable"


class TenantOverShare(Unavailable):
    """The caller (a tenant) already holds its share of something the proxy bounds
    (``pipeline/shares.py``): its own excess, a 429, never another tenant's wait."""

    status = 429
    error_type = "rate_limit_error"
    code = "tenant_share_exceeded"


class ProxyFull(Unavailable):
    """All of something the proxy bounds is held (by several tenants, each within its
    share): a 503 with Retry-After."""

    code = "proxy_full"


class ShuttingDown(Unavailable):
    """A request the proxy aborted because its operator asked it to stop at once (a second
    Ctrl-C): answered with a 503 in the API's shape, never a traceback."""

    code = "shutting_down"


# the message a request's task is cancelled with when the proxy aborts it (``serving``)
ABORTED = "runloop-proxy: aborted at shutdown"


class StoreError(ProxyError):
    pass


class StoreLimitExceeded(StoreError):
    pass


class EmbeddingError(ProxyError):
    """Long-term memory's embedding model cannot be had or failed: search ranks by words
    alone and says so (fail open); the client never sees it."""


class ConfigError(ProxyError):
    """``file: field: why``; ``also``: more problems found in the same pass, one a line."""

    def __init__(self, file: str, field: str, why: str, also: Sequence[ConfigError] = ()):
        lines = [f"{file}: {field}: {why}" if field else f"{file}: {why}", *map(str, also)]
        super().__init__("\n".join(lines))
        self.file = file
        self.field = field
        self.why = why
        self.also = list(also)


def error_body(
    message: str, error_type: str, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    return {"error": {"message": message, "type": error_type, "param": param, "code": code}}


def error_bytes(message: str, error_type: str, param: str | None = None,
                code: str | None = None) -> bytes:
    return orjson.dumps(error_body(message, error_type, param, code))
