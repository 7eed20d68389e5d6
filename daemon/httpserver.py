"""A small HTTP/1.1 server: h11 (sans-IO) on anyio, every wait bounded.

Theory of operation
-------------------
h11 owns HTTP/1.1 framing, as our ``Codec`` owns NDJSON: bytes in, events out, no I/O.
This module drives it on an anyio socket stream, one task per connection, and hands each
complete request to a handler. It is imported only when ``--mcp-listen`` is given, so a
daemon without the endpoint never loads h11.

* **Reading a request.** The request head must arrive within ``head_timeout`` seconds of
  its first byte being awaited (a slowloris peer that trickles header bytes is answered
  ``408`` and closed); a head over ``max_header_bytes`` is ``431`` (h11's
  ``max_incomplete_event_size``); a body over ``max_body_bytes`` is ``413``; a body that
  stops arriving for ``body_timeout`` is ``408``; malformed framing (bad chunk sizes, a
  broken request line) is ``400``. After any of these the connection closes: h11 is
  poisoned by a protocol error, and we do not resynchronise. A keep-alive connection may
  sit idle between requests for ``idle_timeout``.
* **Answering.** The handler gets the request and an :class:`Exchange`: either one
  ``respond`` (a whole body with ``Content-Length``), or ``start_stream`` then any number
  of ``send`` and one ``end`` (chunked transfer coding, for server-sent events). Every
  write is bounded by ``write_timeout``; a peer that does not read is disconnected.
* **The peer leaving.** While the handler runs, a sibling task keeps reading the socket:
  bytes a client pipelines are handed to h11 (which keeps them for the next cycle), and
  EOF or a reset sets ``Exchange.disconnected`` and cancels the handler's scope (unless
  the handler cleared ``cancel_on_disconnect`` to end the work on its own terms), so a
  client that drops a stream mid-call cancels the call.
* **Who may connect.** ``admit(stream)`` runs once per connection before any byte is
  read; it returns None to serve, or a :class:`Refusal` that answers the first request
  with its status and message and closes.
"""

from __future__ import annotations

import errno
import http
import itertools
import math
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qs, urlsplit

import anyio
import anyio.abc
import h11
import orjson
import structlog

__all__ = [
    "Exchange",
    "HttpRequest",
    "HttpServer",
    "HttpSettings",
    "Refusal",
    "json_response_body",
]

log = structlog.get_logger("toolsetd.http")

_ACCEPT_RETRY_ERRNOS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})
_SERVER_HEADER = (b"server", b"toolsetd")
_READ_SIZE = 65536
_REASONS = {status.value: status.phrase.encode() for status in http.HTTPStatus}


@dataclass(frozen=True, slots=True)
class HttpSettings:
    """Limits of the HTTP server. Every wait on a peer has a bound.

    Attributes:
        max_header_bytes: The longest request head accepted (431 beyond).
        max_body_bytes: The largest request body accepted (413 beyond).
        head_timeout: Seconds a request head may take to arrive (408 beyond).
        body_timeout: Seconds the whole body may take to arrive (408 beyond).
        idle_timeout: Seconds a keep-alive connection may wait for its next request.
        write_timeout: Seconds one write may wait for a peer that does not read.
        max_connections: Connections served at once; one more is answered 503.
    """

    max_header_bytes: int = 16 * 1024
    max_body_bytes: int = 16 * 1024 * 1024
    head_timeout: float = 10.0
    body_timeout: float = 30.0
    idle_timeout: float = 60.0
    write_timeout: float = 30.0
    max_connections: int = 256


@dataclass(frozen=True, slots=True)
class HttpRequest:
    """One complete HTTP request.

    Attributes:
        method: ``GET``, ``POST``, ...
        target: The request target as sent (path and query).
        path: The path part of the target.
        query: The query parameters (every value of each name).
        headers: Header names (lower case) and values, in order, repeats kept.
        body: The whole body.
    """

    method: str
    target: str
    path: str
    query: dict[str, list[str]]
    headers: list[tuple[str, str]]
    body: bytes

    def header(self, name: str) -> str | None:
        """The first value of a header (name in lower case), or None."""
        for key, value in self.headers:
            if key == name:
                return value
        return None

    def header_count(self, name: str) -> int:
        """How many times a header (name in lower case) was sent."""
        return sum(1 for key, _ in self.headers if key == name)


@dataclass(frozen=True, slots=True)
class Refusal:
    """An answer given instead of serving a connection (a peer the policy refuses).

    Attributes:
        status: The HTTP status.
        message: The sentence for the client (and the log).
        headers: Extra response headers (``WWW-Authenticate``, ...).
    """

    status: int
    message: str
    headers: Sequence[tuple[str, str]] = ()


def json_response_body(value: Any) -> bytes:
    """Serialise a JSON body."""
    return orjson.dumps(value)


class _Closed(Exception):
    """The connection cannot carry another request (peer gone, protocol error, timeout)."""


class Exchange:
    """The answering side of one request: a whole response, or a chunked stream."""

    def __init__(self, conn: _HttpConnection) -> None:
        self._conn = conn
        self.streaming = False
        self.finished = False
        #: Set when the peer closes or resets the connection while the handler runs.
        self.disconnected = anyio.Event()
        #: Whether the peer leaving cancels the handler (else it watches ``disconnected``
        #: and ends on its own terms).
        self.cancel_on_disconnect = True

    @property
    def started(self) -> bool:
        """Whether the response head went out."""
        return self.streaming or self.finished

    async def respond(
        self, status: int, headers: Sequence[tuple[str, str]] = (), body: bytes = b""
    ) -> None:
        """Send a whole response (``Content-Length`` framing)."""
        assert not self.started
        self.finished = True
        head = [(k.encode(), v.encode()) for k, v in headers]
        head.append((b"content-length", str(len(body)).encode()))
        await self._conn.send(
            h11.Response(
                status_code=status,
                headers=[_SERVER_HEADER, *head],
                reason=_REASONS.get(status, b""),
            )
        )
        if body:
            await self._conn.send(h11.Data(data=body))
        await self._conn.send(h11.EndOfMessage())

    async def respond_json(
        self, status: int, value: Any, headers: Sequence[tuple[str, str]] = ()
    ) -> None:
        """Send a JSON body."""
        await self.respond(
            status, [("content-type", "application/json"), *headers], json_response_body(value)
        )

    async def start_stream(self, status: int, headers: Sequence[tuple[str, str]] = ()) -> None:
        """Send the head of a streamed (chunked) response."""
        assert not self.started
        self.streaming = True
        head = [(k.encode(), v.encode()) for k, v in headers]
        await self._conn.send(
            h11.Response(
                status_code=status,
                headers=[_SERVER_HEADER, *head],
                reason=_REASONS.get(status, b""),
            )
        )

    async def send(self, data: bytes) -> None:
        """Send one piece of a streamed response."""
        assert self.streaming
        assert not self.finished
        if data:
            await self._conn.send(h11.Data(data=data))

    async def end(self) -> None:
        """End a streamed response."""
        if self.streaming and not self.finished:
            self.finished = True
            await self._conn.send(h11.EndOfMessage())


#: A request handler: the request, where to answer, and what ``admit`` learnt of the peer.
Handler = Callable[[HttpRequest, Exchange, Any], Awaitable[None]]
#: Decides whether a connection is served: (stream) -> (peer info, refusal or None).
Admit = Callable[[anyio.abc.SocketStream], tuple[Any, Refusal | None]]


@dataclass(slots=True)
class _HttpConnection:
    stream: anyio.abc.SocketStream
    settings: HttpSettings
    parser: h11.Connection = field(init=False)
    eof: bool = False

    def __post_init__(self) -> None:
        self.parser = h11.Connection(
            h11.SERVER, max_incomplete_event_size=self.settings.max_header_bytes
        )

    async def send(self, event: h11.Event) -> None:
        data = self.parser.send(event)
        if data:
            try:
                with anyio.fail_after(self.settings.write_timeout):
                    await self.stream.send(data)
            except (
                TimeoutError,
                anyio.BrokenResourceError,
                anyio.ClosedResourceError,
                OSError,
            ) as exc:
                self.parser.send_failed()
                raise _Closed("write failed") from exc

    async def receive_into_h11(self) -> None:
        if self.eof:
            return
        try:
            data = await self.stream.receive(_READ_SIZE)
        except (anyio.EndOfStream, anyio.BrokenResourceError, anyio.ClosedResourceError, OSError):
            data = b""
        if not data:
            self.eof = True
        self.parser.receive_data(data)

    async def next_event(self, deadline: float) -> h11.Event | type[h11.PAUSED]:
        """The next h11 event, reading as needed, within ``deadline`` seconds in all."""
        with anyio.fail_after(deadline):
            while True:
                event = self.parser.next_event()
                if event is h11.NEED_DATA:
                    if self.eof:
                        raise _Closed("peer closed")
                    await self.receive_into_h11()
                    continue
                return event  # type: ignore[return-value]  # NEED_DATA handled above


class HttpServer:
    """Serves HTTP/1.1 on one or more listeners with one handler.

    Args:
        settings: Limits and timeouts.
        handler: Answers each request.
        admit: Decides, per connection, whether the peer is served.
    """

    def __init__(self, settings: HttpSettings, handler: Handler, admit: Admit) -> None:
        self.settings = settings
        self._handler = handler
        self._admit = admit
        self._ids = itertools.count(1)
        self.connections = 0
        self._scopes: set[anyio.CancelScope] = set()

    async def serve(
        self,
        listeners: Sequence[anyio.abc.SocketListener],
        *,
        task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED,
    ) -> None:
        """Accept on every listener until cancelled; the listeners are closed at the end."""
        try:
            async with anyio.create_task_group() as tg:
                for listener in listeners:
                    tg.start_soon(self._accept_loop, listener, tg)
                task_status.started()
        finally:
            with anyio.CancelScope(shield=True):
                for listener in listeners:
                    await listener.aclose()

    def close_all(self) -> None:
        """Cancel every connection (a stop)."""
        for scope in list(self._scopes):
            scope.cancel()

    async def _accept_loop(
        self, listener: anyio.abc.SocketListener, tg: anyio.abc.TaskGroup
    ) -> None:
        while True:
            try:
                stream = await listener.accept()
            except (anyio.ClosedResourceError, anyio.BrokenResourceError):
                return
            except OSError as exc:
                if exc.errno in _ACCEPT_RETRY_ERRNOS:
                    log.warning("http_accept_retry", errno=exc.errno)
                    await anyio.sleep(0.1)
                    continue
                raise
            tg.start_soon(self._serve_connection, stream)

    async def _serve_connection(self, stream: anyio.abc.SocketStream) -> None:
        conn_id = next(self._ids)
        conn = _HttpConnection(stream, self.settings)
        self.connections += 1
        scope = anyio.CancelScope()
        self._scopes.add(scope)
        try:
            with structlog.contextvars.bound_contextvars(http_conn_id=conn_id), scope:
                peer, refusal = self._admit(stream)
                if refusal is None and self.connections > self.settings.max_connections:
                    refusal = Refusal(
                        503,
                        f"Too many connections: toolsetd serves at most "
                        f"{self.settings.max_connections} HTTP connections at once.",
                    )
                try:
                    await self._serve_requests(conn, peer, refusal)
                except _Closed:
                    pass
                except Exception:
                    log.exception("http_connection_failed")
        finally:
            self.connections -= 1
            self._scopes.discard(scope)
            with anyio.CancelScope(shield=True), anyio.move_on_after(1):
                await stream.aclose()

    async def _serve_requests(
        self, conn: _HttpConnection, peer: Any, refusal: Refusal | None
    ) -> None:
        settings = self.settings
        first = True
        while True:
            if not first:
                try:
                    conn.parser.start_next_cycle()
                except h11.LocalProtocolError:
                    return
            # Wait for a request's first byte: a new connection for the head timeout, a
            # keep-alive one for the idle timeout; then the whole head must follow within
            # the head timeout (a slowloris peer is cut off there).
            if not conn.parser.trailing_data[0] and not conn.eof:
                with anyio.move_on_after(settings.head_timeout if first else settings.idle_timeout):
                    await conn.receive_into_h11()
                if not conn.parser.trailing_data[0] and not conn.eof:
                    return
            first = False
            try:
                event = await conn.next_event(settings.head_timeout)
            except TimeoutError:
                await self._fail(
                    conn,
                    408,
                    "Request timeout: the request head did not arrive "
                    f"within {settings.head_timeout:g} s.",
                )
                return
            except h11.RemoteProtocolError as exc:
                await self._fail(conn, exc.error_status_hint, _protocol_message(exc))
                return
            if isinstance(event, h11.ConnectionClosed) or event is h11.PAUSED:
                return
            assert isinstance(event, h11.Request), event
            if sum(len(k) + len(v) + 4 for k, v in event.headers) > settings.max_header_bytes:
                # h11 bounds only a head still incomplete; one that arrived whole in a
                # single read is measured here.
                await self._fail(
                    conn,
                    431,
                    f"Request header fields too large: at most {settings.max_header_bytes} bytes.",
                )
                return
            try:
                body = await self._read_body(conn)
            except TimeoutError:
                await self._fail(
                    conn,
                    408,
                    f"Request timeout: the body did not arrive within {settings.body_timeout:g} s.",
                )
                return
            except h11.RemoteProtocolError as exc:
                await self._fail(conn, exc.error_status_hint, _protocol_message(exc))
                return
            except _BodyTooLarge:
                await self._fail(
                    conn, 413, f"Request body too large: at most {settings.max_body_bytes} bytes."
                )
                return
            request = _request(event, body)
            exchange = Exchange(conn)
            if refusal is not None:
                log.warning("http_refused", status=refusal.status, path=request.path)
                await exchange.respond_json(
                    refusal.status, {"error": refusal.message}, refusal.headers
                )
                return
            await self._run_handler(conn, request, exchange, peer)
            if not exchange.finished:
                return  # the handler gave up mid-stream (the peer left): nothing to reuse
            if conn.parser.our_state is h11.MUST_CLOSE or conn.parser.their_state is not h11.DONE:
                return

    async def _read_body(self, conn: _HttpConnection) -> bytes:
        parts: list[bytes] = []
        size = 0
        # One deadline for the whole body: a peer trickling bytes cannot hold us longer.
        with anyio.fail_after(self.settings.body_timeout):
            while True:
                event = await conn.next_event(math.inf)
                if isinstance(event, h11.Data):
                    size += len(event.data)
                    if size > self.settings.max_body_bytes:
                        raise _BodyTooLarge
                    parts.append(bytes(event.data))
                elif isinstance(event, h11.EndOfMessage):
                    return b"".join(parts)
                else:
                    raise h11.RemoteProtocolError("unexpected event in the request body")

    async def _run_handler(
        self, conn: _HttpConnection, request: HttpRequest, exchange: Exchange, peer: Any
    ) -> None:
        async with anyio.create_task_group() as tg:

            async def watch_peer() -> None:
                # Keep reading: pipelined bytes go to h11 for the next cycle; EOF or a
                # reset means the client left, which cancels what it asked for.
                while not conn.eof:
                    await conn.receive_into_h11()
                exchange.disconnected.set()
                if exchange.cancel_on_disconnect:
                    tg.cancel_scope.cancel()

            tg.start_soon(watch_peer)
            try:
                await self._handler(request, exchange, peer)
            except _Closed:
                exchange.disconnected.set()
            finally:
                tg.cancel_scope.cancel()
        if exchange.disconnected.is_set():
            return
        if not exchange.started:
            log.error("http_handler_no_answer", path=request.path)
            await exchange.respond_json(500, {"error": "Internal error: no answer was made."})
        elif not exchange.finished:
            await exchange.end()

    async def _fail(self, conn: _HttpConnection, status: int, message: str) -> None:
        """Answer a request we cannot serve (if a response may still go out), then close."""
        log.info("http_bad_request", status=status, message=message)
        if conn.parser.our_state not in (h11.IDLE, h11.SEND_RESPONSE):
            return
        body = json_response_body({"error": message})
        try:
            await conn.send(
                h11.Response(
                    status_code=status,
                    reason=_REASONS.get(status, b""),
                    headers=[
                        _SERVER_HEADER,
                        (b"content-type", b"application/json"),
                        (b"content-length", str(len(body)).encode()),
                        (b"connection", b"close"),
                    ],
                )
            )
            await conn.send(h11.Data(data=body))
            await conn.send(h11.EndOfMessage())
        except (_Closed, h11.LocalProtocolError):
            return
        await _linger(conn.stream)


async def _linger(stream: anyio.abc.SocketStream, seconds: float = 1.0) -> None:
    """Close our sending side, then drain the peer's bytes briefly before the close.

    Closing a socket with unread input sends a reset, and a reset can destroy the error
    response the peer has not read yet (a slow peer still sending its head).
    """
    with anyio.move_on_after(seconds):
        try:
            await stream.send_eof()
            while await stream.receive(_READ_SIZE):
                pass
        except (anyio.EndOfStream, anyio.BrokenResourceError, anyio.ClosedResourceError, OSError):
            pass


class _BodyTooLarge(Exception):
    """The request body exceeded ``max_body_bytes``."""


def _protocol_message(exc: h11.RemoteProtocolError) -> str:
    if exc.error_status_hint == 431:
        return "Request header fields too large."
    return f"Bad request: malformed HTTP/1.1 ({exc})."


def _request(event: h11.Request, body: bytes) -> HttpRequest:
    target = event.target.decode("ascii", errors="replace")
    parts = urlsplit(target)
    return HttpRequest(
        method=event.method.decode("ascii", errors="replace"),
        target=target,
        path=parts.path,
        query=parse_qs(parts.query, keep_blank_values=True),
        headers=[
            (k.decode("ascii", errors="replace"), v.decode("latin-1")) for k, v in event.headers
        ],
        body=body,
    )
