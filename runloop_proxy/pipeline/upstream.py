"""The upstream client: one pooled aiohttp session per upstream, retries, error mapping.

aiohttp rather than httpx on this path: measured on the 2-core dev machine at concurrency 32, a
plain httpx.AsyncClient pass-through reaches ~10% of direct throughput (its pool is the
bottleneck) while aiohttp reaches ~98% (see README, "Speed").
"""

from __future__ import annotations

import asyncio
import email.utils
import random
import re
import time
import zlib
from collections.abc import AsyncIterator, Callable, Iterable, Iterator, Mapping

import aiohttp
from multidict import CIMultiDict
from yarl import URL

from ..config import UpstreamSpec
from ..errors import (
    CredentialTooLong,
    UpstreamBadReply,
    UpstreamTimeout,
    UpstreamTooLarge,
    UpstreamUnreachable,
)
from .masking import (
    CREDENTIAL_HEADERS,
    PIECE,
    Masker,
    MaskTable,
    MaskTables,
    credentials_sent,
)
from .shares import Held, Shares

RETRY_STATUSES = frozenset({429, 500, 502, 503, 504, 529})  # 529: Anthropic's overloaded
# a connection's own headers (RFC 9110 §7.6.1, with RFC 2616's spellings and the
# Proxy-Connection clients still send), never relayed either way; nor any header a
# ``Connection`` names
HOP_BY_HOP = frozenset({
    "connection", "proxy-connection", "keep-alive", "proxy-authenticate",
    "proxy-authorization", "te", "trailer", "trailers", "transfer-encoding", "upgrade",
})
# how this hop's body is framed and who it is for: set again for the next hop
_FRAMING = frozenset({"host", "content-length", "content-encoding"})
_DROP_REQUEST = HOP_BY_HOP | _FRAMING | {"authorization", "accept-encoding",
                                         "x-runloop-history"}
# the client's credentials for the proxy itself, never forwarded in tenant mode
PROXY_KEY_HEADERS = frozenset(CREDENTIAL_HEADERS) - {"authorization"}
# headers that may name the caller to an upstream or a gateway in front of it (Portkey's,
# Cloudflare's, Google's keys, OpenAI's organization and project, a proxy's authorization)
IDENTITY = re.compile(r"(^|-)(auth|authentication|authorization|api-?key|apikey|key|token|"
                      r"secret|organization|org|project|account|user|cookie)($|-)")
# named like one, and no caller's: it differs on every request (a WebSocket handshake's
# nonce too), or it is the client program's
NOT_IDENTITY = frozenset({"idempotency-key", "user-agent", "sec-websocket-key"})
# What an upstream's answer may tell a client, whoever's key it was made with: a list of
# what is allowed (an upstream's new header says nothing until it is known to be harmless).
# What the body is, the ids the SDKs put in their errors and logs, and when to try again.
ANSWER_HEADERS = frozenset({
    "content-type", "content-disposition", "content-language", "content-range",
    "accept-ranges", "cache-control", "etag", "last-modified", "expires", "vary",
    "x-request-id", "request-id", "retry-after", "retry-after-ms", "x-should-retry",
    "openai-processing-ms", "openai-version",
})
# ... who the key acts as: the account's organization and project, only to the client
# whose own key went upstream (else they are the operator's)
ACCOUNT_HEADERS = frozenset({"openai-organization", "openai-project",
                             "anthropic-organization-id"})
# ... what the key has left of its rate limits: live counters of every request made with it,
# so only to a caller whose key no other caller uses (else a side channel on their traffic)
RATE_LIMITS = re.compile(r"(x-|anthropic-)?ratelimit(-.*)?")


def connection_named(headers: Iterable[tuple[str, str]]) -> frozenset[str]:
    """The (lower-case) headers a message's ``Connection`` (or ``Proxy-Connection``) names:
    they are for this hop only (RFC 9110 §7.6.1)."""
    return frozenset(t for k, v in headers if k.lower() in ("connection", "proxy-connection")
                     for t in (p.strip().lower() for p in v.split(",")) if t)


def answer_header(name: str, own_key: bool = False, own_limits: bool = False) -> bool:
    """Whether an upstream's answer header (lower-case) is relayed to the client:
    ``own_key``, the key that made it is the client's own; ``own_limits``, no other caller
    uses that key (the client's own, or a tenant's alone)."""
    return name in ANSWER_HEADERS or (own_key and name in ACCOUNT_HEADERS) \
        or (own_limits and RATE_LIMITS.fullmatch(name) is not None)


class UpstreamResponse:
    """An upstream answer whose body is read or streamed; always closed by its consumer.

    Its body is never read unbounded: ``read`` takes the most it may hold (decompressed: a
    gzip answer of 100 KB can inflate to gigabytes) and ``iter_chunks`` yields what arrives
    in the pieces aiohttp decompresses, each bounded. A body cut short (a broken connection, a
    read timeout) raises, so a relay can end its own answer as cut and never as whole."""

    def __init__(self, resp: aiohttp.ClientResponse, raw: bool = False,
                 on_close: Callable[[], None] | None = None, masks: MaskTable | None = None,
                 held: Held | None = None):
        self._resp = resp
        self.held = held or Held(None, "")  # the answer's bytes read whole, as they are held
        self._on_close = on_close  # told once, at the first close
        self.status = resp.status
        self.first_byte_at: float | None = None
        # the credentials the request carried, masked in the answer whatever the path it
        # takes to a client (an upstream refusing a key quotes it: a tenant read the
        # operator's key), in its headers and its body: an error's body is read inflated
        # to be searched; a body passed through as encoded is searched when it is plain
        self._table = masks
        encoded = resp.headers.get("content-encoding", "identity").lower().strip() != "identity"
        self._masked = masks if resp.status >= 400 or not (raw and encoded) else None
        self.raw = raw and not (self._masked and encoded)

    @property
    def headers(self) -> Mapping[str, str]:
        return self._resp.headers

    @property
    def body_size(self) -> int | None:
        """The size of the body as it will be read, when known before reading it: the
        Content-Length, unless the body is compressed and will be read decompressed."""
        encoded = self._resp.headers.get("content-encoding", "identity").lower() != "identity"
        return None if encoded and not self.raw else self._resp.content_length

    def forward_headers(self, own_key: bool = False,
                        own_limits: bool = False) -> list[tuple[str, str]]:
        """The answer's headers for the client: those ``answer_header`` allows (the key's
        account and its rate limits only to a caller they describe alone), never a hop's own
        or one its ``Connection`` names; a raw body keeps the headers that say how it is
        encoded and how long it is."""
        keep = {"content-encoding", "content-length"} if self.raw and not self._masked \
            else {"content-encoding"} if self.raw else set()
        out = []
        masker = Masker(self._table) if self._table else None
        items = list(self._resp.headers.items())
        hop = connection_named(items)
        for k, v in items:
            lk = k.lower()
            if lk in hop or lk in HOP_BY_HOP \
                    or not (lk in keep or answer_header(lk, own_key, own_limits)):
                continue
            if masker is not None:
                v = masker.whole(v.encode("utf-8", "surrogateescape")).decode("utf-8", "replace")
            if v.isascii() or _latin1(v):  # a header a client can be sent (HTTP's bytes)
                out.append((k, v))
        return out

    async def read(self, limit: int, keep: bool = False) -> bytes:
        """The whole body, at most ``limit`` bytes of it as read (UpstreamTooLarge beyond),
        each chunk held against the caller's share of answers held whole (``held``: given
        back at the end, or by the caller when it ``keep``s it, once done with the body)."""
        chunks: list[bytes] = []
        size = 0
        try:
            async for chunk in self.iter_chunks():
                size += len(chunk)
                if size > limit:
                    raise UpstreamTooLarge(
                        f"the upstream's answer exceeds {limit} bytes "
                        f"(server.max_answer_bytes), more than the proxy holds whole")
                self.held.take(len(chunk), "room for answers read whole")
                chunks.append(chunk)
        except BaseException:
            self.held.release()
            raise
        finally:
            self.close()
        if not keep:
            self.held.release()
        self.first_byte_at = self.first_byte_at or time.perf_counter()
        return b"".join(chunks)

    async def iter_chunks(self) -> AsyncIterator[bytes]:
        """The body as it arrives, with the request's credentials masked (``masking``:
        what a chunk's end may still begin, at most 11 bytes, waits for the next)."""
        if self._masked is None:
            async for chunk in self._chunks():
                yield chunk
            return
        masker = Masker(self._masked)
        try:
            async for chunk in self._chunks():
                for at in range(0, len(chunk), PIECE):  # the loop served between pieces
                    out = masker.feed(chunk[at:at + PIECE] if len(chunk) > PIECE else chunk)
                    if out:
                        yield out
                    if len(chunk) > PIECE:
                        await asyncio.sleep(0)
        except Exception:  # what was held back goes too, before a body cut short says so
            out = masker.end()  # (not when the reader closes it: nothing is read then)
            if out:
                yield out
            raise
        out = masker.end()
        if out:
            yield out

    async def _chunks(self) -> AsyncIterator[bytes]:
        """The body as it arrives, inflated here (not by aiohttp, which inflates what one
        read brings in one go: 64 KB of gzip became 64 MB in one call on the event loop) in
        pieces of ``INFLATE_PIECE`` bytes, the loop served between them."""
        encoding = self._resp.headers.get("content-encoding", "identity").lower().strip()
        inflater = None if self.raw or encoding == "identity" else Inflater(encoding)
        try:
            async for chunk in self._resp.content.iter_any():
                if self.first_byte_at is None:
                    self.first_byte_at = time.perf_counter()
                if inflater is None:
                    yield chunk
                    continue
                for piece in inflater.feed(chunk):
                    yield piece
                    await asyncio.sleep(0)
            if inflater is not None:
                tail = inflater.flush()
                if tail:
                    yield tail
        except TimeoutError as exc:
            raise UpstreamTimeout("upstream stopped sending (read timeout)") from exc
        except aiohttp.ClientError as exc:
            raise UpstreamUnreachable("the upstream's connection broke while it was sending "
                                      "its answer") from exc

    def close(self) -> None:
        self._resp.release() if self._resp.content.at_eof() else self._resp.close()
        told, self._on_close = self._on_close, None
        if told is not None:
            told()


def _latin1(v: str) -> bool:
    try:
        v.encode("latin-1")
    except UnicodeEncodeError:
        return False
    return True



INFLATE_PIECE = 256 * 1024  # bytes inflated per step (~0.1 ms of zlib)
ACCEPTED_ENCODINGS = "gzip, deflate"  # what the proxy inflates itself


class Inflater:
    """A gzip or deflate body inflated incrementally, ``INFLATE_PIECE`` bytes at a time
    whatever the compression ratio."""

    def __init__(self, encoding: str):
        if encoding not in ("gzip", "x-gzip", "deflate"):
            raise UpstreamBadReply(f"the upstream's answer is encoded as {encoding!r}, which "
                                   f"the proxy did not ask for")
        self._deflate = encoding == "deflate"
        # gzip, or zlib-wrapped deflate (32 + window: either header); raw deflate is tried
        # when a deflate body has no zlib header, as servers send both
        self._z = zlib.decompressobj(32 + zlib.MAX_WBITS)
        self._started = False
        self._head = b""

    def feed(self, data: bytes) -> Iterator[bytes]:
        try:
            if self._deflate and not self._started:
                data = self._head = self._head + data  # two bytes tell zlib from raw
                if len(data) < 2:
                    return
                self._started = True
                if not _zlib_header(data):
                    self._z = zlib.decompressobj(-zlib.MAX_WBITS)
            while data:
                piece = self._z.decompress(data, INFLATE_PIECE)
                data = self._z.unconsumed_tail
                if self._z.eof and self._z.unused_data:  # a next gzip member
                    data = self._z.unused_data + data
                    self._z = zlib.decompressobj(32 + zlib.MAX_WBITS)
                if piece:
                    yield piece
        except zlib.error as exc:
            raise UpstreamBadReply(f"the upstream's compressed answer is corrupt: {exc}") \
                from exc

    def flush(self) -> bytes:
        try:
            head = b"" if self._started else self._z.decompress(self._head)  # 1 byte held
            return head + self._z.flush()
        except zlib.error as exc:
            raise UpstreamBadReply(f"the upstream's compressed answer is corrupt: {exc}") \
                from exc


def _zlib_header(data: bytes) -> bool:
    """Whether ``data`` opens with a zlib header (RFC 1950), not raw deflate."""
    return len(data) >= 2 and data[0] & 0x0F == 8 and (data[0] << 8 | data[1]) % 31 == 0


class UpstreamClient:
    def __init__(self, name: str, spec: UpstreamSpec, shown: str | None = None,
                 masks: MaskTables | None = None, tenant_share: float = 1.0,
                 answers: Shares | None = None,
                 refused: Callable[[str, str], None] | None = None,
                 summary_connections: int = 0):
        self.name = name
        self.spec = spec
        self.shown = shown or name  # what an error calls it
        # the tables masking credentials in answers (the process's, in bytes; none kept
        # by a client made without them)
        self.masks = masks or MaskTables(0)
        # its connections, a share each tenant (a caller's ``Caller.holder``), and the
        # process's room for answers read whole (pipeline/shares.py)
        self.connections = Shares(f"connections to {self.shown}", spec.max_connections,
                                  tenant_share, refused)
        self.answers = answers
        # connections beside max_connections for the summaries (``server.summary_calls``,
        # bounded in history/summaries.py): a tenant's requests never wait behind them
        self.summary_connections = summary_connections
        self._session: aiohttp.ClientSession | None = None
        self._open = 0  # answers given and not yet closed
        self._last_used = time.monotonic()

    async def start(self) -> None:
        timeout = aiohttp.ClientTimeout(total=self.spec.total_timeout,
                                        sock_connect=self.spec.connect_timeout,
                                        sock_read=self.spec.read_timeout)
        connector = aiohttp.TCPConnector(limit=self.spec.max_connections
                                         + self.summary_connections, limit_per_host=0,
                                         ttl_dns_cache=300, keepalive_timeout=30)
        self._session = aiohttp.ClientSession(
            timeout=timeout, connector=connector, auto_decompress=False,
            skip_auto_headers=("User-Agent",), raise_for_status=False)

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def close_when_idle(self, idle_s: float, poll_s: float = 1.0) -> None:
        """Close once no answer of it is open and none was for ``idle_s``: a client a reload
        replaced goes on serving the requests that began on it — their later tool rounds
        too, which the request's caller sends through it (``Caller.upstream``) — however
        long they run."""
        while self._open or time.monotonic() - self._last_used < idle_s:
            await asyncio.sleep(poll_s)
        await self.close()

    def _answered(self) -> None:
        self._open -= 1
        self._last_used = time.monotonic()

    def url(self, path: str) -> str:
        return self.spec.url + path

    async def request(self, method: str, path: str, headers: CIMultiDict[str] | dict[str, str],
                      body: bytes | None, query: str = "", raw: bool = False,
                      holder: str | None = None) -> UpstreamResponse:
        """Send with retries (connect errors, 429, 5xx) while nothing reached the client yet.
        ``raw``: the answer's body is kept as the upstream encoded it (pass-through).
        ``holder``: the tenant the call is for, which holds one of the connections (its
        share at most: TenantOverShare, ProxyFull) until the answer is closed."""
        if holder is None:
            return await self._request(method, path, headers, body, query, raw, None)
        self.connections.take(holder, 1, "connections to the upstream")

        def closed() -> None:
            self.connections.give(holder)

        try:
            resp = await self._request(method, path, headers, body, query, raw, closed)
        except BaseException:
            closed()
            raise
        resp.held = Held(self.answers, holder)
        return resp

    async def _request(self, method: str, path: str,
                       headers: CIMultiDict[str] | dict[str, str], body: bytes | None,
                       query: str, raw: bool, closed: Callable[[], None] | None
                       ) -> UpstreamResponse:
        assert self._session is not None, "UpstreamClient.start() was not called"
        self._last_used = time.monotonic()
        # encoded as given: the path is the proxy's own or v1_subpath's (re-encoded), the
        # query the client's raw one; parsed again, %2e%2e would become a dot segment
        url = URL(self.url(path) + (f"?{query}" if query else ""), encoded=True)
        try:  # refused before anything is sent: what masking a credential costs is bounded
            values = credentials_sent(headers)
        except ValueError as exc:
            raise CredentialTooLong(str(exc)) from exc
        masks = await self.masks.made(values)
        attempt = 0
        while True:
            try:
                if not raw:
                    headers = CIMultiDict(headers)
                    headers["Accept-Encoding"] = ACCEPTED_ENCODINGS
                resp = await self._session.request(method, url, headers=headers, data=body,
                                                   allow_redirects=False)
            except (aiohttp.ConnectionTimeoutError, aiohttp.ClientConnectorError,
                    aiohttp.ServerDisconnectedError, aiohttp.ClientOSError) as exc:
                if attempt >= self.spec.max_retries:
                    if isinstance(exc, aiohttp.ConnectionTimeoutError):
                        raise UpstreamTimeout(f"upstream {self.shown} connect timed out") from exc
                    raise UpstreamUnreachable(f"upstream {self.shown} could not be reached "
                                              f"(connection refused or lost)") from exc
                await asyncio.sleep(self._backoff(attempt, None))
                attempt += 1
                continue
            except TimeoutError as exc:
                raise UpstreamTimeout(f"upstream {self.shown} timed out") from exc
            except aiohttp.ClientError as exc:
                raise UpstreamUnreachable(f"upstream {self.shown} sent no valid HTTP answer"
                                          ) from exc
            if resp.status in RETRY_STATUSES and attempt < self.spec.max_retries:
                wait = self._backoff(attempt, resp.headers.get("Retry-After"))
                if wait is not None:
                    resp.release()
                    await asyncio.sleep(wait)
                    attempt += 1
                    continue
            self._open += 1

            def answered() -> None:
                self._answered()
                if closed is not None:
                    closed()

            return UpstreamResponse(resp, raw, answered, masks)

    def _backoff(self, attempt: int, retry_after: str | None) -> float:
        if retry_after is not None:
            hinted = parse_retry_after(retry_after)
            if hinted is not None:
                # Honour the server's hint, but never hold a client longer than the cap allows.
                return min(hinted, self.spec.backoff_max)
        base = self.spec.backoff_base * (2 ** attempt)
        return float(min(self.spec.backoff_max, base * (0.5 + random.random())))


def parse_retry_after(value: str) -> float | None:
    value = value.strip()
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    return max(0.0, when.timestamp() - time.time())


def names_caller(header: str) -> bool:
    """Whether a (lower-case) header may tell an upstream who is calling."""
    return bool(IDENTITY.search(header)) and header not in NOT_IDENTITY


def upstream_headers(client_headers: Iterable[tuple[str, str]], authorization: str | None,
                     drop: frozenset[str] = frozenset(), body_as_sent: bool = False,
                     proxy_key: bool = False) -> CIMultiDict[str]:
    """The client's headers minus hop-by-hop ones (the standard set and those its
    ``Connection`` names) and proxy-control ones (and ``drop``), with the
    upstream's auth. ``body_as_sent``: the client's body goes upstream byte for byte, so the
    header that says how it is encoded goes with it (a rewritten body is sent plain).
    ``proxy_key``: the upstream gets the proxy's key, not the client's, so nothing that names
    a caller goes with it (an organization or project header would pick where the operator's
    key acts; a cookie or a gateway's key would act as someone the operator never named)."""
    out: CIMultiDict[str] = CIMultiDict()
    client_headers = list(client_headers)
    hop = connection_named(client_headers)
    for k, v in client_headers:
        lk = k.lower()
        if lk in drop or lk in hop or lk.startswith("x-runloop-") \
                or (proxy_key and names_caller(lk)) \
                or (lk in _DROP_REQUEST and not (body_as_sent and lk == "content-encoding")):
            continue
        out.add(k, v)
    if authorization:
        out["Authorization"] = authorization
    return out


def json_headers(base: CIMultiDict[str]) -> CIMultiDict[str]:
    out = CIMultiDict(base)
    out["Content-Type"] = "application/json"
    return out

