"""A small HTTP/1.1 server: h11 (sans-IO) on anyio, every wait bounded.

Theory of operation
-------------------
h11 owns HTTP/1.1 framing, as our ``Codec`` owns NDJSON: bytes in, events out, no I/O.
This module drives it on the event loop's socket transport (the ``Wire`` the Unix socket
connections use), one task per connection, and hands each complete request to a handler.
It is imported only when ``--mcp-listen`` is given, so a daemon without the endpoint never
loads h11.

* **Reading a request.** The request head must arrive within ``head_timeout`` seconds of
  its first byte being awaited (a slowloris peer that trickles header bytes is answered
  ``408`` and closed); a head over ``max_header_bytes`` is ``431`` (h11's
  ``max_incomplete_event_size``); a body over ``max_body_bytes`` is ``413``; a client
  waiting on ``Expect: 100-continue`` is told ``100 Continue`` before its body is read; a body that
  stops arriving for ``body_timeout`` is ``408``; malformed framing (bad chunk sizes, a
  broken request line, both ``Transfer-Encoding`` and ``Content-Length``, a
  ``Transfer-Encoding`` in an HTTP/1.0 request) is ``400``, a transfer coding other than
  chunked ``501``. Each is answered with a JSON-RPC error (``error_body``: ``-32007``
  for a head or body over its limit, as the socket answers a long line), which MCP's
  clients read. After any of these the connection closes: h11 is poisoned by a
  protocol error, and we do not resynchronise. A keep-alive connection may sit idle
  between requests for ``idle_timeout``. The body of a ``GET``, ``HEAD`` or ``DELETE``,
  whose content means nothing, is read and dropped before the handler runs: it is not
  held (in memory, or in ``LargeRequests``) while, say, a GET's event stream stays open.
* **Answering.** The handler gets the request and an :class:`Exchange`: either one
  ``respond`` (a whole body with ``Content-Length``), or ``start_stream`` then any number
  of ``send`` and one ``end`` (chunked transfer coding, for server-sent events). Every
  write is bounded by ``write_timeout``; a peer that does not read is disconnected.
  The answer to a ``HEAD`` goes out without its body, whatever the handler writes.
* **The peer leaving.** The wire reports EOF and resets as they happen: while a handler
  runs, either sets ``Exchange.disconnected`` and cancels the connection's scope (unless
  the handler cleared ``cancel_on_disconnect`` to end the work on its own terms), so a
  client that drops a stream mid-call cancels the call. Bytes a client pipelines wait in
  the wire for the next cycle; past the read buffer, reading pauses and the peer's
  hang-up is looked for once a second instead (``_HttpWire``).
* **Cost.** A request costs no task and no cancel scope of its own: deadlines are loop
  timers that wake the reader, and writes go to the transport at once. What is already
  received is served without a wait, so a connection lets the loop run other tasks every
  ``_REQUESTS_PER_TURN`` pipelined requests and every ``_PIECES_PER_TURN`` body chunks.
* **Who may connect.** ``admit(sock)`` runs once per connection before any byte is
  read; it returns None to serve, or a :class:`Refusal`. A refused connection, and one
  past ``max_connections``, is answered at once, before its request arrives (its status
  and message, ``Connection: close``), and closed after a short linger; it does not count
  toward ``max_connections``, so peers that are refused cannot crowd out those that are
  not. As many refusals again may be under way; beyond, a connection is closed unanswered.

Why one module of this size: the exchange, the connection's read loop (pipelining,
keep-alive, the body and idle timeouts) and the accept loop all drive one h11
``Connection`` state machine; h11's own examples keep them together for the same reason.
"""

from __future__ import annotations

import asyncio
import contextlib
import email.utils
import errno
import http
import itertools
import re
import select
import socket
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qs, urlsplit

import anyio
import anyio.abc
import anyio.lowlevel
import h11
import structlog
from toolsetd.protocol import errors as rpc_errors
from toolsetd.protocol.jsontext import dumps as json_dumps

from .exhaustion import ACCEPT_RETRY_SECONDS, Shortage, out_of_resources
from .large import LARGE_TEXT, LIMIT_TEXTS, LargeRequests
from .logs import Throttle
from .wire import Wire

__all__ = [
    "Exchange",
    "HttpRequest",
    "HttpServer",
    "HttpSettings",
    "Refusal",
    "Screen",
    "error_body",
    "json_response_body",
]

log = structlog.get_logger("toolsetd.http")

#: accept(2)'s errors that belong to the one connection being taken (a peer that left,
#: the network errors it says to treat like EAGAIN, a firewall's refusal): skipped.
_PEER_ACCEPT_ERRNOS = frozenset(
    {
        errno.ECONNABORTED,
        errno.EPROTO,
        errno.ENOPROTOOPT,
        errno.EHOSTDOWN,
        errno.ENONET,
        errno.EHOSTUNREACH,
        errno.EOPNOTSUPP,
        errno.ENETDOWN,
        errno.ENETUNREACH,
        errno.EPERM,
    }
)
_SERVER_HEADER = (b"server", b"toolsetd")
#: Received bytes held for the parser before the socket stops being read.
_READ_BUFFER = 256 * 1024
#: Body pieces (chunks) parsed before the reader lets the loop run other tasks.
_PIECES_PER_TURN = 256
#: Requests served on one connection before the loop runs other tasks.
_REQUESTS_PER_TURN = 16
#: Outgoing bytes the transport buffers before a writer waits for the peer.
_SEND_BUFFER = 256 * 1024
_REASONS = {status.value: status.phrase.encode() for status in http.HTTPStatus}
#: What HTTP counts as whitespace around a list member and its parameters (RFC 9110 5.6.3).
_HTTP_SPACE = " \t"
#: A weight (RFC 9110 12.4.2): 0 to 1, at most three decimals.
_QVALUE = re.compile(r"0(?:\.[0-9]{0,3})?|1(?:\.0{0,3})?")
#: Methods whose request content has no defined meaning (RFC 9110 9.3.1, 9.3.2, 9.3.5):
#: a body sent with one is read and dropped before the handler runs.
_NO_CONTENT = frozenset((b"GET", b"HEAD", b"DELETE"))


#: The ``Date`` header's value and the second it names (RFC 9110 6.6.1: an origin server
#: with a clock sends it); formatted once a second, not per response.
_date: tuple[int, tuple[bytes, bytes]] = (0, (b"date", b""))


def _head(head: Sequence[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
    """Every response's own headers (``Server``, ``Date``), then ``head``."""
    global _date
    now = int(time.time())
    if now != _date[0]:
        _date = (now, (b"date", email.utils.formatdate(now, usegmt=True).encode()))
    return [_SERVER_HEADER, _date[1], *head]


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
        query: The query parameters (every value of each name), %-decoded as UTF-8;
            bytes that are not UTF-8 are kept as lone surrogates (``surrogateescape``).
        headers: Header names (lower case) and values, in order, repeats kept.
        body: The whole body (empty for ``GET``, ``HEAD`` and ``DELETE``: a body sent
            with one is read and dropped).
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

    def accepts(self, media_type: str) -> bool:
        """Whether ``Accept`` admits ``media_type`` (lower case), by RFC 9110 12.5.1.

        Its media ranges, over every ``Accept`` line, are matched whole: the most
        specific range that names the type (``text/event-stream``, then ``text/*``, then
        ``*/*``) decides, and one weighted ``q=0`` refuses it. A type that merely
        contains the name (``text/event-streams``) is another type; a member whose
        weight is not a qvalue is skipped. No ``Accept`` at all admits every type: RFC
        9110 12.5.1 has its absence mean the client takes any (MCP has its clients send
        one, but says nothing of a server refusing a request without it); one sent empty
        admits none.
        """
        ranks = {media_type: 2, media_type.split("/")[0] + "/*": 1, "*/*": 0}
        best: tuple[int, float] | None = None
        sent = False
        for key, value in self.headers:
            if key != "accept":
                continue
            sent = True
            for member in value.split(","):
                media_range, *params = member.split(";")
                rank = ranks.get(media_range.strip(_HTTP_SPACE).lower())
                if rank is None:
                    continue
                weight = 1.0
                for param in params:
                    name, _, text = param.partition("=")
                    if name.strip(_HTTP_SPACE).lower() == "q":
                        text = text.strip(_HTTP_SPACE)
                        weight = float(text) if _QVALUE.fullmatch(text) else -1.0
                if weight >= 0 and (best is None or (rank, weight) > best):
                    best = (rank, weight)
        if not sent:
            return True
        return best is not None and best[1] > 0


@dataclass(frozen=True, slots=True)
class Refusal:
    """An answer given instead of serving a connection (a peer the policy refuses).

    Attributes:
        status: The HTTP status.
        error: What the client is told (its body: ``error_body``).
        headers: Extra response headers (``WWW-Authenticate``, ...).
    """

    status: int
    error: rpc_errors.RpcError
    headers: Sequence[tuple[str, str]] = ()


def json_response_body(value: Any) -> bytes:
    """Serialise a JSON body (numbers as the request wrote them: ``jsontext``)."""
    return json_dumps(value)


def error_body(error: rpc_errors.RpcError) -> bytes:
    """The body of an error this server answers itself: a JSON-RPC error response with no
    id (none was read), as MCP's transport has a server's error statuses carry, so that a
    client reads the reason (the SDKs' clients surface such a body's error; another body
    is "Server returned an error response")."""
    return json_dumps({"jsonrpc": "2.0", "id": None, "error": error.to_error()})


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
        #: Called (once, without waiting) when the peer leaves while the handler runs.
        self.on_disconnect: Callable[[], None] | None = None

    @property
    def started(self) -> bool:
        """Whether the response head went out."""
        return self.streaming or self.finished

    async def respond(
        self, status: int, headers: Sequence[tuple[str, str]] = (), body: bytes = b""
    ) -> None:
        """Send a whole response (``Content-Length`` framing; a 204 has no body and no
        ``Content-Length``, which RFC 9110 8.6 forbids with it)."""
        assert not self.started
        assert status != 204 or not body
        self.finished = True
        head = [(k.encode(), v.encode()) for k, v in headers]
        if status != 204:
            head.append((b"content-length", str(len(body)).encode()))
        # One write for the whole response: head, body and end go out in one segment.
        await self._conn.send(
            h11.Response(
                status_code=status,
                headers=_head(head),
                reason=_REASONS.get(status, b""),
            ),
            h11.Data(data=body),
            h11.EndOfMessage(),
        )

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
                headers=_head(head),
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

    # -- without waiting (for senders that must never wait, such as an MCP outbox) --------

    def start_stream_now(self, status: int, headers: Sequence[tuple[str, str]] = ()) -> None:
        """``start_stream`` without waiting: the head is committed to go out in order."""
        assert not self.started
        self.streaming = True
        head = [(k.encode(), v.encode()) for k, v in headers]
        self._conn.post(
            h11.Response(
                status_code=status,
                headers=_head(head),
                reason=_REASONS.get(status, b""),
            )
        )

    def send_now(self, data: bytes) -> None:
        """``send`` without waiting: committed to go out after what was sent before it."""
        assert self.streaming
        if data and not self.finished:
            self._conn.post(h11.Data(data=data))

    @property
    def write_timed_out(self) -> bool:
        """Whether the connection ended because the peer read nothing for the write
        timeout (our decision, logged as ``connection_write_timeout``), not the peer's."""
        return self._conn.write_timed_out

    @property
    def backlogged(self) -> bool:
        """Whether written bytes wait for a peer that is not reading."""
        return self._conn.wire.backlogged

    async def drained(self) -> None:
        """Wait until everything written is with the socket (or the peer is gone)."""
        await self._conn.wire.wait_drained()


#: A request handler: the request, where to answer, and what ``admit`` learnt of the peer.
Handler = Callable[[HttpRequest, Exchange, Any], Awaitable[None]]
#: Decides whether a connection is served: (socket) -> (peer info, refusal or None).
Admit = Callable[[socket.socket], tuple[Any, Refusal | None]]
#: Judges a request by its head: (the request, its body left empty; the peer info) ->
#: refusal or None.
Screen = Callable[[HttpRequest, Any], Refusal | None]


#: Seconds between looks for a peer's hang-up while reading is paused (see below).
_HANGUP_POLL = 1.0


class _HttpWire(Wire):
    """The connection's ``Wire``, telling the connection when the peer leaves.

    While reading is paused (the peer pipelined more than the read buffer behind the
    request being answered), its EOF sits behind those bytes and is never read: the peer
    could leave and the request go on to its end. So while paused, the socket is asked
    once a second whether the peer hung up (``POLLRDHUP``, which sees past unread bytes).
    """

    on_gone: Callable[[], None] | None = None
    _hangup_timer: asyncio.TimerHandle | None = None

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self._reading_paused and self._hangup_timer is None:
            self._hangup_timer = self._loop.call_later(_HANGUP_POLL, self._look_for_hangup)

    def _look_for_hangup(self) -> None:
        self._hangup_timer = None
        if not self._reading_paused or self.lost or self.eof or self.transport is None:
            return
        if _hung_up(self.transport):
            self.eof = True  # the peer is gone: nothing it sent after this is read anyway
            self.wake_reader()
            if self.on_gone is not None:
                self.on_gone()
            return
        self._hangup_timer = self._loop.call_later(_HANGUP_POLL, self._look_for_hangup)

    def eof_received(self) -> bool:
        keep = super().eof_received()
        if self.on_gone is not None:
            self.on_gone()
        return keep

    def connection_lost(self, exc: Exception | None) -> None:
        super().connection_lost(exc)
        if self.on_gone is not None:
            self.on_gone()


def _hung_up(transport: asyncio.Transport) -> bool:
    """Whether the peer of a socket transport hung up, unread bytes or not (Linux)."""
    sock = transport.get_extra_info("socket")
    rdhup = getattr(select, "POLLRDHUP", 0)
    if sock is None or not rdhup:
        return False
    poller = select.poll()
    poller.register(sock.fileno(), rdhup)
    try:
        return any(
            events & (rdhup | select.POLLHUP | select.POLLERR) for _, events in poller.poll(0)
        )
    except OSError:
        return False


class _HttpConnection:
    """One HTTP connection: h11 over the loop's socket transport (``Wire``).

    Reads wait on plain futures with a loop timer as their deadline, and writes never
    wait unless the peer is behind (then the wire's stall timer bounds the wait): a
    request costs no cancel scope and no task of its own.
    """

    def __init__(self, wire: _HttpWire, settings: HttpSettings) -> None:
        self.wire = wire
        self.settings = settings
        self.parser = h11.Connection(
            h11.SERVER, max_incomplete_event_size=settings.max_header_bytes
        )
        self.loop = asyncio.get_running_loop()
        #: The exchange whose handler is running (told when the peer leaves).
        self.exchange: Exchange | None = None
        self.scope: anyio.CancelScope | None = None
        #: The request being answered is a HEAD: what is written goes out without a body.
        self.head_request = False
        #: The daemon dropped the peer for not reading (the write timeout), not the peer.
        self.write_timed_out = False
        wire.on_gone = self._gone

    @property
    def eof(self) -> bool:
        return self.wire.eof

    def _gone(self) -> None:
        exchange = self.exchange
        if exchange is not None and not exchange.disconnected.is_set():
            exchange.disconnected.set()
            if exchange.on_disconnect is not None:
                exchange.on_disconnect()
            if exchange.cancel_on_disconnect and self.scope is not None:
                self.scope.cancel()

    def _encode(self, events: Sequence[h11.Event]) -> bytes:
        if self.head_request:
            # A response to HEAD has its head only (RFC 9110 9.3.2), whatever the handler
            # writes; h11 would refuse the body and poison the connection.
            events = [event for event in events if not isinstance(event, h11.Data)]
        return b"".join(self.parser.send(event) or b"" for event in events)

    def post(self, *events: h11.Event) -> None:
        """Commit events to go out in order without waiting (dropped if the peer is gone)."""
        if self.wire.lost:
            return
        data = self._encode(events)
        if data:
            self.wire.enqueue(data)

    async def send(self, *events: h11.Event) -> None:
        parser = self.parser
        data = self._encode(events)
        wire = self.wire
        if wire.lost:
            parser.send_failed()
            raise _Closed("the peer is gone")
        if data:
            wire.enqueue(data)
            if wire.backlogged:
                # The peer is behind: wait for it (the wire's stall timer ends a peer
                # that takes nothing for the write timeout).
                await wire.wait_drained()
                if wire.lost:
                    parser.send_failed()
                    raise _Closed("the peer is gone")

    async def fill(self, deadline: float) -> None:
        """Hand h11 the bytes received, waiting for some until ``deadline`` (loop time).

        Raises:
            TimeoutError: Nothing arrived by the deadline.
        """
        wire = self.wire
        if not wire.has_data and not wire.eof:
            if deadline <= self.loop.time():
                raise TimeoutError
            timer = self.loop.call_at(deadline, wire.wake_reader)
            try:
                await wire.wait_readable()
            finally:
                timer.cancel()
            if not wire.has_data and not wire.eof:
                raise TimeoutError
        data = wire.take()
        if data:
            self.parser.receive_data(data)
        elif wire.eof and not self.parser.trailing_data[1]:
            self.parser.receive_data(b"")

    async def next_event(self, deadline: float) -> h11.Event | type[h11.PAUSED]:
        """The next h11 event, reading as needed, by ``deadline`` (loop time)."""
        while True:
            event = self.parser.next_event()
            if event is h11.NEED_DATA:
                if self.parser.trailing_data[1]:
                    raise _Closed("peer closed")
                await self.fill(deadline)
                continue
            return event  # type: ignore[return-value]  # NEED_DATA handled above

    async def close(self) -> None:
        """Flush what is queued (bounded by the stall timer), then close the socket."""
        wire = self.wire
        transport = wire.transport
        if transport is None or wire.lost:
            return
        await wire.wait_drained()
        transport.close()
        with anyio.move_on_after(self.settings.write_timeout):
            await wire.wait_closed()
        if not wire.lost:
            transport.abort()

    def stalled(self) -> None:
        """The peer took nothing for the write timeout (the wire logged it): drop it."""
        self.write_timed_out = True
        self.abort()

    def abort(self) -> None:
        transport = self.wire.transport
        if transport is not None and not self.wire.lost:
            transport.abort()

    async def linger(self, seconds: float = 1.0) -> None:
        """Close our sending side, then drain the peer's bytes briefly before the close.

        Closing a socket with unread input sends a reset, and a reset can destroy the
        error response the peer has not read yet (a slow peer still sending its head).
        """
        wire = self.wire
        transport = wire.transport
        if transport is None or wire.lost:
            return
        await wire.wait_drained()
        if wire.eof or wire.lost:
            return  # the peer has closed: nothing of its to drain, and it may have reset us
        if transport.can_write_eof():
            try:
                transport.write_eof()
            except OSError:  # ENOTCONN: the peer reset the connection meanwhile
                return
        deadline = self.loop.time() + seconds
        while not wire.eof and not wire.lost and self.loop.time() < deadline:
            wire.take()
            timer = self.loop.call_at(deadline, wire.wake_reader)
            try:
                await wire.wait_readable()
            finally:
                timer.cancel()


class HttpServer:
    """Serves HTTP/1.1 on one or more listeners with one handler.

    Args:
        settings: Limits and timeouts.
        handler: Answers each request.
        admit: Decides, per connection, whether the peer is served.
        large_requests: The daemon's large requests in flight (``large.LargeRequests``): a
            body over ``LARGE_TEXT`` is counted there from its head (or once it grows past
            that) until its request is answered, and refused with 503 when it would take
            them past ``LIMIT_TEXTS`` times ``max_body_bytes``.
        screen: Judges a request by its head (the request without its body, the peer), for
            one whose body is over ``LARGE_TEXT`` or chunked: a refusal is answered before
            that body is read (or counted), and the connection closed.
    """

    def __init__(
        self,
        settings: HttpSettings,
        handler: Handler,
        admit: Admit,
        large_requests: LargeRequests | None = None,
        screen: Screen | None = None,
    ) -> None:
        self.settings = settings
        self._handler = handler
        self._admit = admit
        self._screen = screen
        self._large = large_requests if large_requests is not None else LargeRequests()
        self._ids = itertools.count(1)
        #: Connections being served (at most ``max_connections``).
        self.connections = 0
        #: Refused connections still being answered (as many again at most; beyond,
        #: they are closed unanswered).
        self._refusing = 0
        self._limit_log = Throttle()
        self._bad_log = Throttle(1.0)
        self._memory_log = Throttle()
        self._scopes: set[anyio.CancelScope] = set()
        self._accepting: anyio.CancelScope | None = None

    async def serve(
        self,
        sockets: Sequence[socket.socket],
        *,
        task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED,
    ) -> None:
        """Accept on every listening socket until cancelled; they are closed at the end.

        After ``stop_accepting`` the connections already open are served to their end.
        """
        try:
            # The connections' group outlives the accept loops' (``stop_accepting``).
            async with (
                anyio.create_task_group() as connections,
                anyio.create_task_group() as accepting,
            ):
                self._accepting = accepting.cancel_scope
                for sock in sockets:
                    sock.setblocking(False)
                    accepting.start_soon(self._accept_loop, sock, connections)
                task_status.started()
        finally:
            for sock in sockets:
                sock.close()

    def stop_accepting(self) -> None:
        """Accept no more connections (a graceful stop); open ones go on."""
        if self._accepting is not None:
            self._accepting.cancel()

    def close_all(self) -> None:
        """Cancel every connection (a stop)."""
        self.stop_accepting()
        for scope in list(self._scopes):
            scope.cancel()

    async def _accept_loop(self, sock: socket.socket, tg: anyio.abc.TaskGroup) -> None:
        loop = asyncio.get_running_loop()
        shortage = Shortage(log, "http_accept")  # said once per episode, as the others
        while True:
            try:
                conn, _ = await loop.sock_accept(sock)
            except OSError as exc:
                if exc.errno in _PEER_ACCEPT_ERRNOS:
                    continue  # that connection's trouble (accept(2)): take the next one
                if out_of_resources(exc):
                    shortage.failed(exc)
                    await anyio.sleep(ACCEPT_RETRY_SECONDS)
                    continue
                raise
            shortage.accepted()
            tg.start_soon(self._serve_connection, conn)

    async def _serve_connection(self, raw: socket.socket) -> None:
        conn_id = next(self._ids)
        # Answers are written whole; waiting for the peer's ACK (Nagle) would only add
        # the delayed-ACK pause to every response and SSE event.
        with contextlib.suppress(OSError):
            raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        # Whether the connection is served is known before its first byte: a refused one
        # is answered at once and closed, and never holds one of the slots of those served
        # (a peer the endpoint refuses cannot crowd out its owner by idling).
        peer, refusal = self._admit(raw)
        limit = self.settings.max_connections
        if refusal is None and self.connections >= limit:
            refusal = Refusal(
                503,
                rpc_errors.ServerBusy(
                    f"Too many connections: toolsetd serves at most {limit} HTTP connections "
                    "at once.",
                    {"limit": limit},
                ),
            )
            said = self._limit_log.count(None)
            if said is not None:
                log.warning("http_connection_limit", limit=limit, refused=said)
        if refusal is None:
            self.connections += 1
        elif self._refusing >= limit:
            raw.close()  # refusals flood in: not even their answer is owed
            return
        else:
            self._refusing += 1
        scope = anyio.CancelScope()
        self._scopes.add(scope)
        conn: _HttpConnection | None = None
        try:
            with structlog.contextvars.bound_contextvars(http_conn_id=conn_id), scope:
                loop = asyncio.get_running_loop()
                raw.setblocking(False)
                transport, wire = await loop.connect_accepted_socket(
                    lambda: _HttpWire(loop, _READ_BUFFER), sock=raw
                )
                transport.set_write_buffer_limits(high=_SEND_BUFFER)
                wire.stall_seconds = self.settings.write_timeout
                conn = _HttpConnection(wire, self.settings)
                wire.on_stall = conn.stalled
                wire.stall_fields = {"http_conn_id": conn_id}
                conn.scope = scope
                try:
                    if refusal is not None:
                        await self._answer_and_close(
                            conn, refusal.status, refusal.error, refusal.headers
                        )
                    else:
                        await self._serve_requests(conn, peer)
                    await conn.close()
                except _Closed:
                    pass
                except Exception:
                    log.exception("http_connection_failed")
        finally:
            if refusal is None:
                self.connections -= 1
            else:
                self._refusing -= 1
            self._scopes.discard(scope)
            if conn is not None:
                conn.abort()
            else:
                raw.close()

    async def _serve_requests(self, conn: _HttpConnection, peer: Any) -> None:
        settings = conn.settings
        loop = conn.loop
        parser = conn.parser
        first = True
        back_to_back = 0
        while True:
            if not first:
                try:
                    parser.start_next_cycle()
                except h11.LocalProtocolError:
                    return
                conn.head_request = False  # a 400 or 408 before the next head has a body
                back_to_back += 1
                if back_to_back % _REQUESTS_PER_TURN == 0:
                    # Pipelined requests already received are served without a wait (and
                    # a peer reading its answers is never waited for): a long run of them
                    # must not starve the other clients.
                    await anyio.lowlevel.checkpoint()
            # Wait for a request's first byte: a new connection for the head timeout, a
            # keep-alive one for the idle timeout; then the whole head must follow within
            # the head timeout (a slowloris peer is cut off there).
            if not parser.trailing_data[0]:
                wait = settings.head_timeout if first else settings.idle_timeout
                try:
                    await conn.fill(loop.time() + wait)
                except TimeoutError:
                    return
                if not parser.trailing_data[0]:
                    return  # closed between requests
            first = False
            deadline = loop.time() + settings.head_timeout
            try:
                event = await conn.next_event(deadline)
            except TimeoutError:
                await self._fail(
                    conn,
                    408,
                    rpc_errors.InvalidRequest(
                        "Request timeout: the request head did not arrive "
                        f"within {settings.head_timeout:g} s."
                    ),
                )
                return
            except h11.RemoteProtocolError as exc:
                await self._fail(conn, exc.error_status_hint, _protocol_error(exc, settings))
                return
            if isinstance(event, h11.ConnectionClosed) or event is h11.PAUSED:
                return
            assert isinstance(event, h11.Request), event
            conn.head_request = event.method == b"HEAD"
            head_size = len(event.method) + len(event.target) + len(event.http_version) + 9
            head_size += sum(len(k) + len(v) + 4 for k, v in event.headers)
            if head_size > settings.max_header_bytes:
                # h11 bounds only a head still incomplete; one that arrived whole in a
                # single read is measured here, request line (a long target) included.
                await self._fail(conn, 431, _head_too_large(settings))
                return
            declared = next((v for k, v in event.headers if k == b"content-length"), None)
            chunked = any(k == b"transfer-encoding" for k, _ in event.headers)
            if declared is not None and chunked:
                # Framed two ways: an intermediary that reads the other one sees another
                # request boundary (request smuggling). RFC 9112 6.3 lets a server refuse it,
                # and has it close the connection after answering it in any case.
                await self._fail(
                    conn,
                    400,
                    rpc_errors.InvalidRequest(
                        "Bad request: both Transfer-Encoding and Content-Length are given; "
                        "send one."
                    ),
                )
                return
            if chunked and event.http_version == b"1.0":
                # HTTP/1.0 has no transfer codings: a 1.0 intermediary reads no chunks, and
                # takes what follows the body's first bytes as another request. RFC 9112 6.1
                # has a server treat such framing as faulty and close the connection.
                await self._fail(
                    conn,
                    400,
                    rpc_errors.InvalidRequest(
                        "Bad request: Transfer-Encoding in an HTTP/1.0 request, which has no "
                        "transfer codings; send Content-Length."
                    ),
                )
                return
            if declared is not None and int(declared) > settings.max_body_bytes:
                # h11 checked it is a number: refuse now, not after waiting for the body.
                await self._fail(conn, 413, _body_too_large(settings))
                return
            if self._screen is not None and (
                chunked or (declared is not None and int(declared) > LARGE_TEXT)
            ):
                # A request its head refuses (a web page's foreign Origin, a wrong path)
                # is not worth its body: read, a large one held memory and the daemon's
                # bound on large requests (a few pages' uploads had the operator's own
                # large requests 503, on every face) for an answer decided without it.
                refusal = self._screen(_request(event, b""), peer)
                if refusal is not None:
                    await self._answer_and_close(
                        conn, refusal.status, refusal.error, refusal.headers
                    )
                    return
            held = _Held()
            try:
                if not await self._serve_one(conn, event, declared, peer, held):
                    return
            finally:
                self._large.release(held.size)

    async def _serve_one(
        self,
        conn: _HttpConnection,
        event: h11.Request,
        declared: bytes | None,
        peer: Any,
        held: _Held,
    ) -> bool:
        """Read one request's body and run the handler; True when the connection may carry
        another request. ``held`` counts a large body's bytes (the caller releases them
        once the request is answered)."""
        settings = conn.settings
        parser = conn.parser
        size = int(declared) if declared is not None else 0
        if size > LARGE_TEXT and not self._hold(conn, held, size):
            await self._refuse_large(conn, size)
            return False
        if parser.they_are_waiting_for_100_continue:
            # The body will be read: a client that waits to be asked for it (Expect:
            # 100-continue, as curl sends for a body over 1 MiB) MUST be told at once
            # (RFC 9110 10.1.1), else it waits for nothing (or until our body timeout).
            await conn.send(
                h11.InformationalResponse(status_code=100, headers=[], reason=b"Continue")
            )
        try:
            body: bytes | None = await self._read_body(
                conn, conn.loop.time() + settings.body_timeout, held
            )
        except TimeoutError:
            await self._fail(
                conn,
                408,
                rpc_errors.InvalidRequest(
                    f"Request timeout: the body did not arrive within {settings.body_timeout:g} s."
                ),
            )
            return False
        except h11.RemoteProtocolError as exc:
            await self._fail(conn, exc.error_status_hint, _protocol_error(exc, settings))
            return False
        except _BodyTooLarge:
            await self._fail(conn, 413, _body_too_large(settings))
            return False
        except _LargeRefused as refused:
            await self._refuse_large(conn, refused.size)
            return False
        except MemoryError:
            body = None  # answered below, once the traceback and the pieces it holds are gone
        if body is None:
            # The daemon's want, not the peer's (its memory is bounded, ``LimitAS=``): said
            # as a parse without memory is, and the connection closed (its body is unread).
            said = self._memory_log.count("body")
            if said is not None:  # every client can cause it: one line a minute, counted
                log.warning("http_out_of_memory", size=size, refused=said)
            await self._answer_and_close(conn, 503, _no_memory_for_body())
            return False
        if event.method in _NO_CONTENT:
            # Dropped, and no longer counted: the handler never reads it, and a GET's
            # stream may stay open for good (four with 16 MiB bodies held the daemon's
            # bound on large requests, on every face, as long as they stayed open).
            body = b""
            self._large.release(held.size)
            held.size = 0
        request = _request(event, body)
        del body
        exchange = Exchange(conn)
        await self._run_handler(conn, request, exchange, peer)
        if not exchange.finished or exchange.disconnected.is_set():
            return False  # the handler gave up mid-stream (the peer left): nothing to reuse
        return parser.our_state is not h11.MUST_CLOSE and parser.their_state is h11.DONE

    @staticmethod
    def _large_limit(conn: _HttpConnection) -> int:
        """The bound this face passes for large requests: ``LIMIT_TEXTS`` bodies at most."""
        return LIMIT_TEXTS * conn.settings.max_body_bytes

    def _hold(self, conn: _HttpConnection, held: _Held, size: int) -> bool:
        """Count a large body at ``size`` bytes instead of what was counted for it (its
        declared length stays counted while less has arrived); False (nothing counted for
        it any more) when that would take the daemon's large requests past their bound."""
        if size <= held.size:
            return True
        counted, held.size = held.size, 0
        if not self._large.recount(counted, size, self._large_limit(conn)):
            return False
        held.size = size
        return True

    async def _refuse_large(self, conn: _HttpConnection, size: int) -> None:
        """Say why a large body is not taken (the daemon holds too many), and close."""
        limit = self._large_limit(conn)
        others = self._large.held
        log.warning("http_large_bodies_refused", size=size, held=others)
        await self._answer_and_close(
            conn,
            503,
            rpc_errors.ServerBusy(
                f"Busy: requests of more than {LARGE_TEXT} bytes being received or in flight "
                f"hold {others} bytes, and this body of {size} bytes would take them past "
                f"{limit} (four times the message size limit); the connection is closed. "
                "Send it again once some of those have been answered.",
                {"resource": "memory", "limit": limit},
            ),
            [("retry-after", "1")],
        )

    async def _read_body(self, conn: _HttpConnection, deadline: float, held: _Held) -> bytes:
        """The whole body, by one deadline: a peer trickling bytes cannot hold us longer.

        A body that grows past ``LARGE_TEXT`` with no ``Content-Length`` (chunked) is
        counted as it grows.
        """
        # One buffer, not a list of the pieces: a body sent in 1-byte chunks would cost a
        # bytes object and a list slot per byte (~140 bytes each: 16 MiB held ~2 GB).
        first: bytes | None = None
        joined: bytearray | None = None
        size = 0
        pieces = 0
        while True:
            event = await conn.next_event(deadline)
            if isinstance(event, h11.Data):
                pieces += 1
                if pieces % _PIECES_PER_TURN == 0:
                    # Tiny chunks already received parse without a wait: let the loop serve
                    # the other clients between runs of them.
                    await anyio.lowlevel.checkpoint()
                size += len(event.data)
                if size > conn.settings.max_body_bytes:
                    raise _BodyTooLarge
                if size > LARGE_TEXT and not self._hold(conn, held, size):
                    raise _LargeRefused(size)
                if first is None:
                    first = bytes(event.data)
                else:
                    if joined is None:
                        joined = bytearray(first)
                    joined += event.data
            elif isinstance(event, h11.EndOfMessage):
                if joined is not None:
                    return bytes(joined)
                return first if first is not None else b""
            else:
                raise h11.RemoteProtocolError("unexpected event in the request body")

    async def _run_handler(
        self, conn: _HttpConnection, request: HttpRequest, exchange: Exchange, peer: Any
    ) -> None:
        # The peer leaving while the handler runs sets ``exchange.disconnected`` and, unless
        # the handler cleared ``cancel_on_disconnect``, cancels the connection's scope (the
        # connection cannot carry another request anyway). Pipelined bytes wait in the wire.
        conn.exchange = exchange
        if conn.eof:
            conn._gone()
        try:
            await self._handler(request, exchange, peer)
        except _Closed:
            exchange.disconnected.set()
        finally:
            conn.exchange = None
        if exchange.disconnected.is_set():
            return
        if not exchange.started:
            log.error("http_handler_no_answer", path=request.path)
            await exchange.respond(
                500,
                [("content-type", "application/json")],
                error_body(rpc_errors.InternalError("Internal error: no answer was made.")),
            )
        elif not exchange.finished:
            await exchange.end()

    async def _fail(self, conn: _HttpConnection, status: int, error: rpc_errors.RpcError) -> None:
        """Answer a request we cannot serve (if a response may still go out), then close."""
        # A web page can have the browser send these as fast as it opens connections (a
        # long target is 431): one line a second per status, counting the rest.
        said = self._bad_log.count(status)
        if said is not None:
            log.info("http_bad_request", status=status, message=error.message, refused=said)
        await self._answer_and_close(conn, status, error)

    async def _answer_and_close(
        self,
        conn: _HttpConnection,
        status: int,
        error: rpc_errors.RpcError,
        headers: Sequence[tuple[str, str]] = (),
    ) -> None:
        """Send an error response with ``Connection: close`` (whether or not a request
        arrived), then linger so the peer reads it rather than a reset."""
        if conn.parser.our_state not in (h11.IDLE, h11.SEND_RESPONSE):
            return
        body = error_body(error)
        try:
            await conn.send(
                h11.Response(
                    status_code=status,
                    reason=_REASONS.get(status, b""),
                    headers=_head(
                        [
                            (b"content-type", b"application/json"),
                            (b"content-length", str(len(body)).encode()),
                            (b"connection", b"close"),
                            *((k.encode(), v.encode()) for k, v in headers),
                        ]
                    ),
                ),
                h11.Data(data=body),
                h11.EndOfMessage(),
            )
        except (_Closed, h11.LocalProtocolError):
            return
        await conn.linger()


class _Held:
    """One request's large body as counted in ``LargeRequests`` (``HttpServer._hold``)."""

    __slots__ = ("size",)

    def __init__(self) -> None:
        self.size = 0


class _LargeRefused(Exception):
    """A chunked body grew past what the daemon's large requests may hold."""

    def __init__(self, size: int) -> None:
        super().__init__(size)
        self.size = size


class _BodyTooLarge(Exception):
    """The request body exceeded ``max_body_bytes``."""


def _protocol_error(exc: h11.RemoteProtocolError, settings: HttpSettings) -> rpc_errors.RpcError:
    if exc.error_status_hint == 431:
        return _head_too_large(settings)
    if exc.error_status_hint == 501:
        # h11's 501s: a transfer coding it does not implement (gzip, identity, ...), or
        # Transfer-Encoding given on more than one line.
        return rpc_errors.InvalidRequest(
            f"Not implemented: {exc}; send the body with Content-Length or the chunked "
            "transfer coding alone."
        )
    return rpc_errors.InvalidRequest(f"Bad request: malformed HTTP/1.1 ({exc}).")


def _head_too_large(settings: HttpSettings) -> rpc_errors.RpcError:
    """431, as the socket answers a line over its limit (``-32007``)."""
    limit = settings.max_header_bytes
    return rpc_errors.MessageTooLarge(
        f"Request header fields too large: at most {limit} bytes.", {"limit": limit}
    )


def _body_too_large(settings: HttpSettings) -> rpc_errors.RpcError:
    """413, as the socket answers a line over its limit (``-32007``)."""
    limit = settings.max_body_bytes
    return rpc_errors.MessageTooLarge(
        f"Request body too large: at most {limit} bytes.", {"limit": limit}
    )


def _no_memory_for_body() -> rpc_errors.RpcError:
    """503, as the socket answers a line it had no memory for (``-32008``)."""
    return rpc_errors.ServerBusy(
        "Server busy: toolsetd had no memory to read the body; the connection is closed. "
        "Send it again when some calls have finished.",
        {"resource": "memory"},
    )


def _request(event: h11.Request, body: bytes) -> HttpRequest:
    target = event.target.decode("ascii", errors="replace")
    if target.startswith("/"):
        # The origin form is a path and a query, nothing else (RFC 9112 3.2.1): urlsplit
        # would read ``//evil.example.com/mcp`` as an authority and the path /mcp, and
        # serve the endpoint for a target that is not /mcp, judged by its Host only.
        path, _, query = target.partition("?")
    else:
        try:
            parts = urlsplit(target)
        except ValueError:  # an authority it cannot read (``http://[::1/mcp``)
            parts = None
        path, query = (parts.path, parts.query) if parts is not None else (target, "")
        if parts is None or parts.scheme.lower() not in ("http", "https"):
            # The absolute form names an http(s) URI (RFC 9112 3.2.2); another scheme
            # (``ftp://host/mcp``), the authority form of a CONNECT, or an authority that
            # cannot be read names no resource of this server: the whole target is the
            # path, which no handler serves.
            path, query = target, ""
    return HttpRequest(
        method=event.method.decode("ascii", errors="replace"),
        target=target,
        path=path,
        # Undecodable %-escapes stay lone surrogates, never U+FFFD (which names another
        # file): the handler can tell them and refuse them.
        query=parse_qs(query, keep_blank_values=True, errors="surrogateescape"),
        headers=[
            (k.decode("ascii", errors="replace"), v.decode("latin-1")) for k, v in event.headers
        ],
        body=body,
    )
