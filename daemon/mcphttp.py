"""MCP over Streamable HTTP: ``/mcp`` on loopback, one MCP core session per HTTP session.

Theory of operation
-------------------
This module is a transport only: every MCP message is served by the MCP core session
(``mcp_session.McpSession``) that also serves the Unix socket and stdio; here messages are
only carried, and each request's own messages are kept on that request's stream.

* **Who may call** (``httpguard``): per connection, the peer's uid by the kernel (403 for
  another user); per request, ``Host`` and ``Origin`` (421/403), and the bearer token when
  the uid could not be established (401).
* **Sessions** (2025-06-18, 2025-11-25): a POST of ``initialize`` without
  ``Mcp-Session-Id`` opens a session bound to the URL's ``workspace`` (required, absolute,
  an existing directory: else 400), ``catalog`` and ``mode``; its answer carries the new
  ``Mcp-Session-Id``. Every later request names it (an unknown id is 404, a missing one
  400). ``DELETE`` ends the session: its calls are cancelled.
* **Stateless** (2026-07-28): a POST without a session id whose request is not
  ``initialize`` is one self-contained exchange: a core session lives for that request
  alone, bound to the URL's query, and ends with its answer.
* **POST** carries one JSON-RPC message. A notification, or a response (the host's answer
  to an elicitation), is ``202``. A request is served in the POST's own task and answered
  on that POST: as one JSON body when the core answers before it has posted anything for
  that request, or else as an SSE stream that begins with the first thing the core posts
  for the request (progress, the ``elicitation/create`` it asks) and ends with its
  response (a cancelled request has none: its stream ends empty, never 202). A client
  that closes the POST before the answer (it left mid-call) has the request cancelled
  through the core's own ``notifications/cancelled`` path, as a disconnect cancels calls
  on the Unix socket.
* **GET** opens the session's one server-to-client SSE stream (a second is 409). It is
  the session's outbox: what belongs to no request, ``notifications/tools/list_changed``
  above all; with no GET stream open, such messages are dropped (list_changed only says
  "list again").
* **Flow.** An outbox never makes the core wait (``post`` commits to the connection in
  order); progress a client is not keeping up with is dropped (the next one carries the
  same counters), everything else queues. ``drained`` lets the core wait until the
  client took what it posted.

Why one module of this size: the POST, GET and DELETE exchanges, the session table and
the two SSE outboxes share each session's state (its streams, its calls, its last
activity); the MCP semantics themselves live in ``mcp_session.py``.
"""

from __future__ import annotations

import base64
import decimal
import re
import secrets
import socket
import time
from collections import deque
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Protocol
from urllib.parse import urlsplit

import anyio
import anyio.abc
import orjson
import structlog
from toolsetd.protocol import errors as rpc_errors
from toolsetd.protocol.jsonrpc import is_request_id
from toolsetd.protocol.jsontext import dumps as json_dumps
from toolsetd.protocol.jsontext import is_utf8, is_utf8_bytes
from toolsetd.protocol.jsontext import loads as json_loads
from toolsetd.protocol.jsontext import loads_large as json_loads_large

from .exhaustion import out_of_memory_answer, out_of_memory_in
from .httpguard import ListenAddress, check_host_origin, check_token, peer_refusal
from .httpserver import Exchange, HttpRequest, HttpServer, HttpSettings, Refusal, Screen
from .large import LARGE_TEXT, LargeRequests
from .logs import Throttle
from .mcp_mapping import McpError, error_response
from .mcp_session import (
    CAPABILITIES_META,
    MODERN_VERSIONS,
    PROTOCOL_VERSION_META,
    SUPPORTED_VERSIONS,
    UNSUPPORTED_VERSION,
    malformed_envelope,
    meta_version,
    unsupported_version,
)
from .mcpschema import header_marks
from .peercred import PeerPolicy
from .tcppeer import tcp_peer, tcp_peer_credentials

__all__ = [
    "CoreSession",
    "McpHttpEndpoint",
    "McpHttpSettings",
    "Outbox",
    "SessionFactory",
    "bind_listen",
]

log = structlog.get_logger("toolsetd.mcphttp")

_SESSION_HEADER = "mcp-session-id"
_VERSION_HEADER = "mcp-protocol-version"
_SESSION_TWICE = "Bad request: Mcp-Session-Id is sent more than once; send it once."
#: The version the transports page has a server assume when the header is absent: a
#: client may also send it, and a handshake session takes it as its own.
_ASSUMED_VERSION = "2025-03-26"
_SSE_HEADERS = (
    ("content-type", "text/event-stream"),
    ("cache-control", "no-cache, no-transform"),
    ("x-accel-buffering", "no"),
)
#: Why a request whose connection ended is cancelled: the client closed it, or the
#: daemon did, the client having read nothing for the write timeout.
_DISCONNECTED = "the client disconnected"
_WRITE_TIMEOUT = "the client did not read its answer for the write timeout"
#: Droppable messages (periodic progress) waiting beyond this many are dropped.
_DROP_BEYOND = 64


@dataclass(frozen=True, slots=True)
class McpHttpSettings:
    """Limits of the MCP HTTP endpoint.

    Attributes:
        max_sessions: Sessions held at once; one more ``initialize`` ends the least
            recently used idle one (no request served, no stream open, unused for
            ``evict_after_seconds``), or is 503 when none is idle.
        session_idle_seconds: A session with no request and no stream this long ends.
        ping_seconds: Seconds between SSE comment lines on an idle GET stream, or on a
            POST's stream that has begun and sent nothing else for that long.
        evict_after_seconds: How long a session must have been unused before a full table
            may end it: a host's request still on its way (a body being uploaded or
            parsed, not yet counted as served) is not refused 404, and a flood of
            ``initialize`` ends only sessions idle that long.
    """

    max_sessions: int = 1024
    session_idle_seconds: float = 3600.0
    ping_seconds: float = 20.0
    evict_after_seconds: float = 60.0


class Outbox(Protocol):
    """Where a core session sends messages no response carries (``mcp_session.Outbox``)."""

    def post(self, message: dict[str, Any], *, droppable: bool = False) -> None:
        """Commit one message to the peer, in order; never waits."""

    async def drained(self) -> None:
        """Return once the peer has taken every message posted so far (or is gone)."""


class CoreSession(Protocol):
    """One MCP core session (``mcp_session.McpSession``), as this transport drives it."""

    async def receive(self, message: Any, outbox: Outbox | None = None) -> Any:
        """Serve one message from the host; returns the response, or None."""

    def close(self) -> None:
        """The host is gone: cancel its calls, end its waits and subscriptions."""

    def version_of(self, message: Any = None) -> str | None:
        """The protocol version a message will be served by, or None when not known yet."""

    async def tool_schema(self, name: str) -> tuple[str, Mapping[str, Any]] | None:
        """The hash (which covers the schema) and schema of the tool ``name`` as this
        session lists it, or None."""


#: Opens a core session: (bind params from the URL, the session's outbox, the
#: transport's in-flight calls, whether it serves one stateless request alone) -> session.
#: Raises ``InvalidWorkspace`` or ``InvalidParams`` for a query the core refuses (the
#: client gets 400).
SessionFactory = Callable[[dict[str, Any], Outbox, dict[str, anyio.Event], bool], CoreSession]


def bind_listen(address: ListenAddress, backlog: int = 256) -> socket.socket:
    """Bind and listen on a loopback address (``[::1]`` is IPv6 only, never both).

    Raises:
        OSError: The address is taken or cannot be bound.
    """
    sock = socket.socket(address.family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if address.family == socket.AF_INET6:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        sock.bind((address.host, address.port))
        sock.listen(backlog)
        sock.setblocking(False)
    except BaseException:
        sock.close()
        raise
    return sock


def _sse(message: Any, *, asked: bool = True) -> bytes:
    """A server message (a notification, or a request to the host) as a stream's event. A
    notification the daemon had no memory to write (its memory is bounded) is dropped
    (b""), as a progress notification is for a host that reads slowly; a request to the
    host raises, so that the call that asks it ends busy, unless no caller waits to be
    told (``asked`` false: the GET stream), where it is dropped too (that call waits for
    its answer as long as it would for a host's)."""
    try:
        return _event(json_dumps(message))
    except MemoryError as exc:
        if out_of_memory_in(exc) and ("id" not in message or not asked):
            return b""
        raise


def _event(data: bytes) -> bytes:
    return b"event: message\ndata: " + data + b"\n\n"


def _answer_body(response: Any) -> tuple[Any, bytes]:
    """A request's answer and its JSON; with no memory to write it (the daemon's memory is
    bounded), the busy answer to its id in its place (``exhaustion.out_of_memory_answer``),
    which the caller then answers as the error it is."""
    try:
        return response, json_dumps(response)
    except MemoryError as exc:
        if not out_of_memory_in(exc):
            raise
        return out_of_memory_answer(response.get("id") if isinstance(response, dict) else None)


class _PostOutbox:
    """A request's outbox: its POST, which turns into an SSE stream at the first message.

    ``post`` never waits: the stream's head and each event are committed to the
    connection in order. Progress (droppable) is dropped while the client is behind.

    Once the stream has begun, a comment line goes out every ``ping_seconds`` nothing
    else did, as on the GET stream: a stream that waits (a ``subscriptions/listen``, a
    call whose approval the operator has not answered yet, a tool silent between progress
    lines) would otherwise send nothing for minutes, and the SDKs' clients (a 5-minute
    read timeout) and proxies close such a stream, which cancels its request.
    """

    def __init__(
        self,
        exchange: Exchange,
        headers: list[tuple[str, str]],
        ping_seconds: float = 20.0,
        tg: anyio.abc.TaskGroup | None = None,
    ) -> None:
        self._exchange = exchange
        self._headers = headers
        self._ping_seconds = ping_seconds
        self._tg = tg
        self._sent = 0
        #: The keep-alive's scope, made when the stream begins: a request answered with
        #: JSON (most) has none to make or cancel. anyio's ``cancel`` formats the calling
        #: task's repr into its reason, ~15 µs of a ~1 ms ``tools/call``.
        self._pinging: anyio.CancelScope | None = None
        self.closed = False

    def post(self, message: dict[str, Any], *, droppable: bool = False) -> None:
        exchange = self._exchange
        if self.closed or exchange.finished or exchange.disconnected.is_set():
            return
        if droppable and exchange.backlogged:
            return
        if not exchange.streaming:
            self._begin()
        event = _sse(message)
        if event:
            exchange.send_now(event)
            self._sent += 1

    def _begin(self) -> None:
        self._exchange.start_stream_now(200, [*_SSE_HEADERS, *self._headers])
        if self._tg is not None:
            self._pinging = anyio.CancelScope()
            self._tg.start_soon(self._keep_alive, self._pinging)

    def keep_alive(self) -> None:
        """A call still unanswered after the ping interval with nothing sent: its POST
        becomes the event stream now, with a comment line (then one every interval), as
        a client's read timeout would cut off a silent POST and so cancel the call."""
        exchange = self._exchange
        if self.closed or exchange.streaming or exchange.finished:
            return
        if exchange.disconnected.is_set():
            return
        self._begin()
        exchange.send_now(b": ping\n\n")

    async def _keep_alive(self, scope: anyio.CancelScope) -> None:
        exchange = self._exchange
        with scope:
            seen = self._sent
            while True:
                await anyio.sleep(self._ping_seconds)
                if self.closed or exchange.finished or exchange.disconnected.is_set():
                    return
                if self._sent == seen and not exchange.backlogged:
                    exchange.send_now(b": ping\n\n")
                seen = self._sent

    def close(self) -> None:
        """The request is answered: nothing more goes out on its stream, no more pings."""
        self.closed = True
        if self._pinging is not None:
            self._pinging.cancel()

    async def drained(self) -> None:
        if not self.closed and not self._exchange.disconnected.is_set():
            await self._exchange.drained()


class _StreamOutbox:
    """A session's outbox: its GET stream.

    ``post`` queues and wakes the stream's writer; while no GET stream is open, messages
    are dropped. ``drained`` waits until the writer has sent what was posted before it
    was called, or the stream is gone.
    """

    def __init__(self) -> None:
        self._queue: deque[tuple[int, dict[str, Any], bool]] = deque()
        self._posted = 0
        self._sent = 0
        self.attached = False
        self.closed = False
        self._wake = anyio.Event()
        self._progress = anyio.Event()
        self._last_taken = 0

    def post(self, message: dict[str, Any], *, droppable: bool = False) -> None:
        if self.closed or not self.attached:
            return
        if droppable and len(self._queue) > _DROP_BEYOND:
            return
        self._posted += 1
        self._queue.append((self._posted, message, droppable))
        self._wake.set()

    async def drained(self) -> None:
        target = self._posted
        while self.attached and not self.closed and self._sent < target:
            await self._progress.wait()

    def pending(self) -> bool:
        """Whether messages wait to be written."""
        return bool(self._queue)

    async def wait(self) -> None:
        """Wait until something is posted (returns at once if something waits)."""
        if not self._queue:
            await self._wake.wait()
        self._wake = anyio.Event()

    def take(self) -> list[dict[str, Any]]:
        """Every waiting message, oldest first."""
        items = [message for _, message, _ in self._queue]
        if self._queue:
            self._last_taken = self._queue[-1][0]
        self._queue.clear()
        return items

    def mark_sent(self) -> None:
        """The messages last taken are with the socket."""
        self._sent = self._last_taken
        progress, self._progress = self._progress, anyio.Event()
        progress.set()

    def close(self) -> None:
        """The stream is gone: drop what waits, release every ``drained``."""
        self.closed = True
        self._queue.clear()
        self._wake.set()
        self._progress.set()


@dataclass(slots=True)
class _Session:
    """One HTTP session, or one stateless exchange, and its core session."""

    session_id: str | None
    outbox: _StreamOutbox
    core: CoreSession | None = None
    calls: dict[str, anyio.Event] = field(default_factory=dict)
    #: Requests being served (a count, not a set of ids: the core refuses a request whose
    #: id is in flight, and that refusal must not uncount the request it collided with).
    running: int = 0
    get_open: bool = False
    last_used: float = field(default_factory=time.monotonic)
    closed: bool = False


def _session_not_found(session_id: str) -> rpc_errors.RpcError:
    """The 404 of an unknown or ended session, on which the host starts a new one."""
    return rpc_errors.InvalidRequest(
        f"Session not found: Mcp-Session-Id {session_id!r} is not (or no longer) a session "
        "of this daemon; send initialize for a new one."
    )


def _is_request(message: dict[str, Any]) -> bool:
    return "method" in message and "id" in message


def _is_modern_notification(request: HttpRequest, message: dict[str, Any]) -> bool:
    """Whether ``message`` is a JSON-RPC 2.0 notification sent as a 2026-07-28 one (its
    ``MCP-Protocol-Version``, sent once, names that revision)."""
    return (
        "id" not in message
        and isinstance(message.get("method"), str)
        and message.get("jsonrpc") == "2.0"
        and request.header_count(_VERSION_HEADER) == 1
        and request.header(_VERSION_HEADER) in MODERN_VERSIONS
    )


class McpHttpEndpoint:
    """The ``/mcp`` endpoint: guards, sessions, POST, GET and DELETE.

    Args:
        factory: Opens a core session for an HTTP session (or a stateless exchange).
        policy: The Unix socket's peer policy.
        token: The bearer token, or None.
        settings: Session limits.
        http: HTTP limits.
        sandboxed: Why a peer socket made in a given cgroup is a sandboxed call's, else
            None (``Confinement.sandboxed_peer``).
        large_requests: The daemon's large requests in flight and its worker slot for
            them (``large.LargeRequests``): a body over ``LARGE_TEXT`` is counted there
            while it is received and answered, and parsed in that slot.
    """

    def __init__(
        self,
        factory: SessionFactory,
        policy: PeerPolicy,
        token: str | None = None,
        settings: McpHttpSettings | None = None,
        http: HttpSettings | None = None,
        sandboxed: Callable[[int | None], str | None] | None = None,
        large_requests: LargeRequests | None = None,
    ) -> None:
        self._factory = factory
        self._large = large_requests if large_requests is not None else LargeRequests()
        self._policy = policy
        self._token = token
        self._sandboxed = sandboxed
        self.settings = settings or McpHttpSettings()
        self.http_settings = http or HttpSettings()
        self.sessions: dict[str, _Session] = {}
        #: The POSTs of calls under way with nothing sent yet, by when they were read
        #: (oldest first: entries are only added, at the time they are read, or removed).
        self._quiet_calls: dict[_PostOutbox, float] = {}
        #: Set when a quiet call is added while none was (``_keep_calls_alive`` waits).
        self._quiet_added: anyio.Event | None = None
        self._servers: list[HttpServer] = []
        self._refused_log = Throttle()
        self._refused_requests = Throttle()
        self._marks = _HeaderMarks()
        #: The endpoint's task group (for cancelling the requests of clients that left).
        self._tg: anyio.abc.TaskGroup | None = None

    # -- serving -------------------------------------------------------------------------

    async def serve(
        self,
        sockets: Sequence[tuple[ListenAddress, socket.socket]],
        *,
        task_status: anyio.abc.TaskStatus[list[str]] = anyio.TASK_STATUS_IGNORED,
    ) -> None:
        """Serve on every bound socket until cancelled; reports the URLs served."""
        urls = []
        try:
            async with anyio.create_task_group() as tg:
                self._tg = tg
                for address, sock in sockets:
                    port = sock.getsockname()[1]
                    server = HttpServer(
                        self.http_settings,
                        self._handler(address, port),
                        self._admit,
                        self._large,
                        self._screen(address, port),
                    )
                    self._servers.append(server)
                    await tg.start(server.serve, [sock])
                    urls.append(address.url(port))
                    log.info("mcp_http_listening", url=address.url(port))
                tg.start_soon(self._expire_idle_sessions)
                tg.start_soon(self._keep_calls_alive)
                task_status.started(urls)
        finally:
            for session in list(self.sessions.values()):
                self._end_session(session)

    def set_max_body_bytes(self, limit: int) -> None:
        """A new body limit (``--max-message-bytes`` reloaded): requests from now on use it."""
        self.http_settings = replace(self.http_settings, max_body_bytes=limit)
        for server in self._servers:
            server.settings = self.http_settings

    async def stop_accepting(self) -> None:
        """Accept no more connections (a graceful stop); requests under way go on."""
        for server in self._servers:
            server.stop_accepting()

    def close(self) -> None:
        """End every session (cancelling its calls) and close every connection."""
        for session in list(self.sessions.values()):
            self._end_session(session)
        for server in self._servers:
            server.close_all()

    def _admit(self, raw: socket.socket) -> tuple[Any, Refusal | None]:
        peer = tcp_peer(raw)
        cred = tcp_peer_credentials(peer.uid) if peer is not None else None
        refused = peer_refusal(cred, self._policy, token=self._token is not None)
        sandboxed = False
        # An unknown peer (it closed before the lookup) that the token admits may be a
        # sandboxed call too: it is no more known than one whose cgroup is unknown.
        if refused is None and self._sandboxed is not None:
            why = self._sandboxed(peer.cgroup if peer is not None else None)
            if why is not None:
                refused, sandboxed = (403, why), True
        if refused is not None:
            uid = getattr(cred, "uid", None)
            # A peer can be refused as often as it connects: one line a minute per uid
            # (and one for sandboxed calls).
            said = self._refused_log.count(("sandboxed", uid) if sandboxed else uid)
            if said is not None:
                log.warning("mcp_http_peer_refused", uid=uid, refused=said, sandboxed=sandboxed)
            status, message = refused
            return cred, Refusal(status, rpc_errors.PeerNotAllowed(message))
        return cred, None

    def _handler(
        self, address: ListenAddress, port: int
    ) -> Callable[[HttpRequest, Exchange, Any], Awaitable[None]]:
        async def handle(request: HttpRequest, exchange: Exchange, peer: Any) -> None:
            await self._handle(request, exchange, peer, address, port)

        return handle

    def _screen(self, address: ListenAddress, port: int) -> Screen:
        def screen(request: HttpRequest, peer: Any) -> Refusal | None:
            return self._refusal(request, peer, address, port)

        return screen

    def _refusal(
        self, request: HttpRequest, peer: Any, address: ListenAddress, port: int
    ) -> Refusal | None:
        """Why the request's head alone refuses it (a wrong path, Host, Origin, token or
        method), or None. The server asks it before reading a large or chunked body
        (``HttpServer``'s ``screen``); the handler asks it of every request."""
        if request.path != "/mcp":
            return Refusal(
                404,
                rpc_errors.InvalidRequest(
                    f"Not found: {request.path!r}; the MCP endpoint is /mcp."
                ),
            )
        host = request.header("host")
        if not request.target.startswith("/"):
            # The absolute form (``POST http://name/mcp``): RFC 9112 3.2.2 has the server
            # take the target's authority as the host and ignore ``Host``; so it is the
            # one judged, else a request for another name would pass on a loopback Host.
            host = urlsplit(request.target).netloc
        # Every Origin sent is judged: a browser sends one, but judging only the first let
        # a loopback Origin in front of a foreign one pass.
        origins: list[str | None] = [v for k, v in request.headers if k == "origin"]
        for origin in origins or [None]:
            refused = check_host_origin(host, origin, address, port)
            if refused is not None:
                break
        if refused is None and peer is None and self._token is not None:
            refused = check_token(request.header("authorization"), self._token)
        if refused is not None:
            status, message = refused
            # Any web page the operator's browser opens can send these at will (a foreign
            # Origin, a rebinding Host): one line a minute per status, counting the rest.
            said = self._refused_requests.count(status)
            if said is not None:
                log.warning("mcp_http_refused", status=status, refused=said)
            headers = [("www-authenticate", "Bearer")] if status == 401 else []
            return Refusal(status, rpc_errors.InvalidRequest(message), headers)
        if request.method not in ("POST", "GET", "DELETE"):
            return Refusal(
                405,
                rpc_errors.InvalidRequest(
                    f"Method not allowed: {request.method}; /mcp takes POST, GET and DELETE."
                ),
                [("allow", "GET, POST, DELETE")],
            )
        return None

    async def _handle(
        self,
        request: HttpRequest,
        exchange: Exchange,
        peer: Any,
        address: ListenAddress,
        port: int,
    ) -> None:
        refusal = self._refusal(request, peer, address, port)
        if refusal is not None:
            await _rpc_error(exchange, refusal.status, None, refusal.error, refusal.headers)
        elif request.method == "POST":
            await self._post(request, exchange)
        elif request.method == "GET":
            await self._get(request, exchange)
        else:
            await self._delete(request, exchange)

    # -- POST ----------------------------------------------------------------------------

    async def _post(self, request: HttpRequest, exchange: Exchange) -> None:
        if not (request.accepts("application/json") and request.accepts("text/event-stream")):
            # A request's POST is answered with either (an event stream once the core has
            # more to say than the answer, or a call runs long), and the transport has the
            # client list both. One that refuses a stream (``application/json`` alone, or
            # a ``q=0``) was sent the stream anyway, which it cannot read; the SDKs'
            # servers answer it 406, before anything is served. One with no Accept at all
            # takes any type (RFC 9110 12.5.1) and is served, though the SDKs' servers
            # refuse it: 406 says the client refused every answer, which it did not.
            await _rpc_error(
                exchange,
                406,
                None,
                rpc_errors.InvalidRequest(
                    "Not acceptable: a POST to /mcp is answered with application/json or "
                    "text/event-stream; send 'Accept: application/json, text/event-stream'."
                ),
            )
            return
        content_type = (request.header("content-type") or "").split(";")[0].strip().lower()
        if content_type != "application/json":
            await _rpc_error(
                exchange,
                415,
                None,
                rpc_errors.InvalidRequest(
                    "Unsupported media type: a POST to /mcp carries one JSON-RPC message with "
                    "Content-Type: application/json."
                ),
            )
            return
        try:
            message = (  # numbers as written, as on the socket; a large body off the loop
                json_loads(request.body)
                if len(request.body) <= LARGE_TEXT
                else await self._large.parse(json_loads_large, request.body)
            )
        except orjson.JSONDecodeError as exc:
            # As the socket says it (orjson's words would be of surrogates, at 0).
            if not is_utf8_bytes(request.body):
                why = "Parse error: the body is not valid UTF-8."
            else:
                why = f"Parse error: the body is not JSON ({exc.msg} at character {exc.pos})."
            await _rpc_error(exchange, 400, None, rpc_errors.ParseError(why))
            return
        except MemoryError:  # the daemon's want, not the body's
            said = self._refused_requests.count("memory")
            if said is not None:  # every client can cause it: one line a minute, counted
                log.warning("mcp_http_out_of_memory", size=len(request.body), refused=said)
            await _rpc_error(
                exchange,
                503,
                None,
                rpc_errors.ServerBusy(
                    "Server busy: toolsetd had no memory to parse the body; send it again "
                    "when some calls have finished.",
                    {"resource": "memory"},
                ),
            )
            return
        if not isinstance(message, dict):
            await _rpc_error(
                exchange,
                400,
                None,
                rpc_errors.InvalidRequest(
                    "Invalid Request: the body must be one JSON-RPC message object; MCP takes no "
                    "batches."
                ),
            )
            return
        session_id = request.header(_SESSION_HEADER)
        fresh = False
        if (
            _is_request(message)
            and message.get("method") != "initialize"
            and meta_version(message) in MODERN_VERSIONS
        ):
            # A request with modern _meta is served statelessly by its own URL: 2026-07-28
            # has no sessions, and its server ignores an Mcp-Session-Id ("ignore it, and
            # do not mint or echo session IDs"), so an ended one is no 404 either.
            session_id = None
        elif request.header_count(_SESSION_HEADER) > 1:
            # Which session? An intermediary that reads the last one would see a request
            # of another session than the one served (as MCP-Protocol-Version twice).
            await _rpc_error(
                exchange,
                400,
                message.get("id"),
                rpc_errors.InvalidRequest(_SESSION_TWICE),
            )
            return
        if session_id is not None:
            session = self.sessions.get(session_id)
            if session is None:
                await _rpc_error(
                    exchange,
                    404,
                    message.get("id"),
                    _session_not_found(session_id),
                )
                return
        elif message.get("method") == "initialize" and "id" in message:
            # The version is being negotiated, so the header is not held to the body's;
            # but one toolsetd does not know is 400 before a session is opened, as for
            # every other request (the transport's MUST): served, it opened a session the
            # client's header said was of a version the daemon does not serve.
            refused = _unknown_version_header(request)
            if refused is not None:
                await _rpc_error(exchange, 400, message.get("id"), refused)
                return
            opened = await self._open(request, exchange, message, stateless=False)
            if opened is None:
                return
            session, fresh = opened, True
        elif _is_request(message):
            opened = await self._open(request, exchange, message, stateless=True)
            if opened is None:
                return
            session = opened
        elif _is_modern_notification(request, message):
            # 2026-07-28 has no sessions and defines no notification from the client over
            # HTTP (a client cancels by closing its POST), but clients still send some
            # (notifications/cancelled): the SDK's server acknowledges them, 202, and drops
            # them, as a notification is answered; refused 400, "needs its session", the
            # client was told of a session its revision does not have. Dropped here too: a
            # cancellation by an id the sender chose, with no session to scope it, could
            # name another client's request.
            await exchange.respond(202)
            return
        else:
            await _rpc_error(
                exchange,
                400,
                None,
                rpc_errors.InvalidRequest(
                    "Bad request: a notification or response needs its session's Mcp-Session-Id "
                    "header."
                ),
            )
            return
        session.last_used = time.monotonic()
        try:
            if not fresh:
                assert session.core is not None
                mismatch = _version_mismatch(
                    request, session.core, message, sessionless=session.session_id is None
                )
                if (
                    mismatch is None
                    and message.get("method") == "tools/call"
                    and session.core.version_of(message) in MODERN_VERSIONS
                ):
                    # Awaits the workspace's catalog (built on first use): a client that
                    # leaves meanwhile cancels this, and the stateless exchange still ends.
                    mismatch = await _param_headers_mismatch(
                        request, session.core, message, self._marks
                    )
                if mismatch is not None:
                    await _rpc_error(exchange, 400, message.get("id"), mismatch)
                    return
            await self._serve_message(session, message, exchange, fresh)
        finally:
            session.last_used = time.monotonic()
            # A session whose initialize was not answered (its client left first) has an
            # id nobody was told: no one can use it or DELETE it, so it ends now rather
            # than hold one of the max_sessions for the idle hour.
            if session.session_id is None or (fresh and not exchange.started):
                self._end_session(session)

    async def _open(
        self,
        request: HttpRequest,
        exchange: Exchange,
        message: dict[str, Any],
        *,
        stateless: bool,
    ) -> _Session | None:
        """A session (or a stateless exchange) bound to the URL's query, or a 400 answer."""
        request_id = message.get("id")
        bind: dict[str, Any] = {}
        # Every name goes to the core's one check of a binding (``Binding.from_params``),
        # which refuses an unknown one, as it does for ``mcp.bind`` on the socket: ignored,
        # ``catalgo=plan`` would serve every tool and ``headles=true`` ask where the host
        # meant deny.
        for name, values in request.query.items():
            workspace = name == "workspace"
            if not is_utf8(name):
                # Not echoed: JSON cannot carry it.
                await _rpc_error(
                    exchange,
                    400,
                    request_id,
                    rpc_errors.InvalidParams(
                        "Invalid params: a name in the URL's query is not UTF-8 once its "
                        "%-escapes are decoded; the query takes workspace, catalog, mode and "
                        "headless."
                    ),
                )
                return None
            if len(values) > 1:
                # Which one was meant? Guessing (the last wins) could run the call in
                # another workspace or mode than the host believes.
                problem = (
                    f"Invalid {'workspace' if workspace else 'params'}: '{name}' is given "
                    f"{len(values)} times in the URL; give it once."
                )
            elif not is_utf8(values[0]):
                # A name whose %-escapes are not UTF-8 cannot be honoured as given (as on
                # the socket, whose JSON cannot carry it); decoded with U+FFFD in their
                # place it would name another directory, which may exist.
                problem = (
                    f"Invalid {'workspace' if workspace else 'params'}: '{name}' in the URL "
                    "is not UTF-8 once its %-escapes are decoded; toolsetd takes UTF-8 names "
                    "only."
                )
            else:
                bind[name] = values[0]
                continue
            error_class = rpc_errors.InvalidWorkspace if workspace else rpc_errors.InvalidParams
            await _rpc_error(exchange, 400, request_id, error_class(problem, {"field": name}))
            return None
        if "headless" in bind:
            # The query carries text; the core takes a boolean and refuses anything else.
            bind["headless"] = {"true": True, "false": False}.get(
                bind["headless"], bind["headless"]
            )
        if "workspace" not in bind:
            await _rpc_error(
                exchange,
                400,
                request_id,
                rpc_errors.InvalidWorkspace(
                    "Invalid workspace: the URL must name the workspace, as "
                    "/mcp?workspace=/absolute/path (optionally &catalog=plan|work&mode=MODE).",
                    {"field": "workspace"},
                ),
            )
            return None
        evicted: _Session | None = None  # the idle session that makes room, when full
        if not stateless:
            await self._expire_idle()
            if len(self.sessions) >= self.settings.max_sessions:
                evicted = self._least_used()
                if evicted is None:
                    limit = self.settings.max_sessions
                    await _rpc_error(
                        exchange,
                        503,
                        request_id,
                        rpc_errors.ServerBusy(
                            f"Too many MCP sessions: at most {limit}; end one with DELETE first.",
                            {"limit": limit},
                        ),
                    )
                    return None
        outbox = _StreamOutbox()
        session = _Session(None if stateless else secrets.token_urlsafe(24), outbox)
        try:
            session.core = self._factory(bind, outbox, session.calls, stateless)
        except rpc_errors.RpcError as exc:
            # Busy passes (503: retry); anything else is the request's (400).
            status = 503 if isinstance(exc, rpc_errors.ServerBusy) else 400
            await _rpc_error(exchange, status, request_id, exc)
            return None
        if session.session_id is not None:
            # Room is made only now: a refused initialize (a bad query) ends no one's
            # session. Nothing awaited since the check, so that session is still idle.
            if evicted is not None:
                self._evict(evicted)
            self.sessions[session.session_id] = session
            log.info("mcp_http_session_opened", sessions=len(self.sessions))
        return session

    async def _serve_message(
        self, session: _Session, message: dict[str, Any], exchange: Exchange, fresh: bool
    ) -> None:
        core = session.core
        assert core is not None
        headers = [(_SESSION_HEADER, session.session_id)] if fresh and session.session_id else []
        if not _is_request(message):
            # A notification, or the host's answer to an elicitation: the core takes it. A
            # message that is neither (no method and no result, 'jsonrpc' not "2.0") is the
            # core's -32600, and input the server does not accept MUST be an error status.
            refused = await core.receive(message)
            if refused is not None:
                await exchange.respond(
                    400, [("content-type", "application/json"), *headers], json_dumps(refused)
                )
                return
            await exchange.respond(202, headers)
            return
        request_id = message["id"]
        # No JSON-RPC 2.0 request ('jsonrpc' not "2.0", an id that names no request): the
        # core answers it -32600, and input the server does not take is an error status.
        malformed = message.get("jsonrpc") != "2.0" or not is_request_id(request_id)
        outbox = _PostOutbox(exchange, headers, self.settings.ping_seconds, self._tg)
        if not malformed and message.get("method") == "tools/call":
            self._quiet_calls[outbox] = time.monotonic()
            if self._quiet_added is not None:
                self._quiet_added.set()
        # The request is answered by this task; a client that leaves does not cut it
        # off but has it cancelled through the core, which then ends it.
        exchange.cancel_on_disconnect = False
        exchange.on_disconnect = lambda: self._cancel_request(
            core, request_id, _WRITE_TIMEOUT if exchange.write_timed_out else _DISCONNECTED
        )
        session.running += 1
        try:
            response = await core.receive(message, outbox)
        finally:
            session.running -= 1
            self._quiet_calls.pop(outbox, None)
            outbox.close()
            # Served: a disconnect from now on cancels nothing (the id may already name
            # another request; a refused one, reusing an id in flight, never named its own).
            exchange.on_disconnect = None
        if exchange.disconnected.is_set():
            return
        body = b""
        if response is not None:
            response, body = _answer_body(response)
        if fresh and not exchange.streaming and isinstance(response, dict) and "error" in response:
            # The initialize failed (its catalog could not be read): no session was opened,
            # so none is kept (it held one of max_sessions, and its workspace, for the idle
            # hour) and its id is not given. Busy is 503, as the factory's busy is: retry.
            self._end_session(session)
            busy = response["error"].get("code") == rpc_errors.ServerBusy.CODE
            await exchange.respond(
                503 if busy else 400 if malformed else 200,
                [("content-type", "application/json")],
                body,
            )
            return
        if exchange.streaming:
            if response is not None:
                exchange.send_now(_event(body))
            await exchange.end()
        elif response is None:
            # No response (the request was cancelled), but a request's POST is answered
            # with an event stream or JSON, never 202: a stream that ends with no event.
            await exchange.respond(200, [*_SSE_HEADERS, *headers])
        else:
            status = 200
            code = response.get("error", {}).get("code") if isinstance(response, dict) else None
            if malformed:
                status = 400
            elif (
                code == rpc_errors.MethodNotFound.CODE
                and core.version_of(message) in MODERN_VERSIONS
            ):
                # 2026-07-28's transport: a method the server does not implement MUST be
                # 404 with -32601 (the JSON-RPC body tells it from a legacy server's 404).
                status = 404
            elif code == UNSUPPORTED_VERSION or malformed_envelope(response.get("error")):
                # A version we do not serve MUST be 400, whether the header named it (the
                # transport's check) or, with no header, the request's _meta (the core's);
                # so MUST a request whose _meta lacks a required field (or holds one of
                # another type), in a session too.
                status = 400
            elif (
                code is not None and session.session_id is None and core.version_of(message) is None
            ):
                # Neither a session nor a _meta version: a legacy request that needed the
                # session it did not name (the core's "initialize first"). The transport
                # has a server that needs one answer 400, as the SDKs' servers do.
                status = 400
            await exchange.respond(status, [("content-type", "application/json"), *headers], body)

    def _cancel_request(self, core: CoreSession, request_id: Any, reason: str) -> None:
        """The connection ended before the answer: cancel the request through the core."""
        if self._tg is None:
            return
        self._tg.start_soon(
            core.receive,
            {
                "jsonrpc": "2.0",
                "method": "notifications/cancelled",
                "params": {"requestId": request_id, "reason": reason},
            },
        )

    # -- GET and DELETE --------------------------------------------------------------------

    async def _session_of(self, request: HttpRequest, exchange: Exchange) -> _Session | None:
        session_id = request.header(_SESSION_HEADER)
        if session_id is None:
            await _rpc_error(
                exchange,
                400,
                None,
                rpc_errors.InvalidRequest("Bad request: the Mcp-Session-Id header is required."),
            )
            return None
        if request.header_count(_SESSION_HEADER) > 1:
            await _rpc_error(exchange, 400, None, rpc_errors.InvalidRequest(_SESSION_TWICE))
            return None
        session = self.sessions.get(session_id)
        if session is None:
            await _rpc_error(exchange, 404, None, _session_not_found(session_id))
            return None
        assert session.core is not None
        mismatch = _version_mismatch(request, session.core)
        if mismatch is not None:
            await _rpc_error(exchange, 400, None, mismatch)
            return None
        return session

    async def _get(self, request: HttpRequest, exchange: Exchange) -> None:
        if not request.accepts("text/event-stream"):
            await _rpc_error(
                exchange,
                406,
                None,
                rpc_errors.InvalidRequest(
                    "Not acceptable: GET /mcp answers with text/event-stream only."
                ),
            )
            return
        session = await self._session_of(request, exchange)
        if session is None:
            return
        if session.get_open:
            await _rpc_error(
                exchange,
                409,
                None,
                rpc_errors.InvalidRequest(
                    "Conflict: this session's server-to-client stream is already open."
                ),
            )
            return
        outbox = session.outbox
        session.get_open = True
        outbox.attached = True
        try:
            await exchange.start_stream(200, _SSE_HEADERS)
            while not outbox.closed:
                items = outbox.take()
                if items:
                    await exchange.send(b"".join(_sse(item, asked=False) for item in items))
                    outbox.mark_sent()
                    continue
                with anyio.move_on_after(self.settings.ping_seconds) as idle:
                    await outbox.wait()
                if idle.cancelled_caught:
                    await exchange.send(b": ping\n\n")
            await exchange.end()
        finally:
            session.get_open = False
            outbox.attached = False
            outbox.mark_sent()
            session.last_used = time.monotonic()

    async def _delete(self, request: HttpRequest, exchange: Exchange) -> None:
        session = await self._session_of(request, exchange)
        if session is None:
            return
        self._end_session(session)
        await exchange.respond(204)

    def _end_session(self, session: _Session) -> None:
        if session.closed:
            return
        session.closed = True
        if session.session_id is not None:
            self.sessions.pop(session.session_id, None)
            log.info("mcp_http_session_closed", sessions=len(self.sessions))
        session.outbox.close()
        if session.core is not None:
            session.core.close()
        for event in list(session.calls.values()):
            event.set()

    def _least_used(self) -> _Session | None:
        """The least recently used session with no request being served, no open stream,
        and unused for ``evict_after_seconds`` (None when there is none)."""
        cutoff = time.monotonic() - self.settings.evict_after_seconds
        idle = [
            s
            for s in self.sessions.values()
            if not s.running and not s.get_open and s.last_used <= cutoff
        ]
        return min(idle, key=lambda s: s.last_used) if idle else None

    def _evict(self, session: _Session) -> None:
        """Make room for a new session: end ``session`` (``_least_used``).

        Hosts that never ``DELETE`` (``claude mcp list`` opens two sessions a run) would
        otherwise fill the table within the idle hour, and every ``initialize`` after that
        would be 503. An evicted session's next request is 404, on which the spec has the
        host start a new session.
        """
        idle_seconds = round(time.monotonic() - session.last_used, 1)
        log.info("mcp_http_session_evicted", idle_seconds=idle_seconds)
        self._end_session(session)

    async def _expire_idle_sessions(self) -> None:
        """End idle sessions as they become idle, not only when another one is opened:
        a host that went away without DELETE and no newcomer left its session, and the
        workspace it listens to, for good."""
        interval = min(60.0, self.settings.session_idle_seconds / 2)
        while True:
            await anyio.sleep(interval)
            await self._expire_idle()

    async def _keep_calls_alive(self) -> None:
        """Turn the POST of each call unanswered for the ping interval, nothing sent on
        it (no progress token), into a kept-alive event stream (``keep_alive``), when the
        interval has passed: it woke every half interval, so the first comment line came
        up to 30 s after the call began where mcp-http.md says 20, and a client or proxy
        whose read timeout lies between them cut the call off (which cancels it)."""
        interval = self.settings.ping_seconds
        quiet = self._quiet_calls
        while True:
            if not quiet:
                self._quiet_added = anyio.Event()
                await self._quiet_added.wait()
                continue
            oldest = next(iter(quiet.values()))
            await anyio.sleep(max(0.0, oldest + interval - time.monotonic()))
            cutoff = time.monotonic() - interval
            for outbox, since in list(quiet.items()):
                if since > cutoff:
                    break  # and so are all after it
                del quiet[outbox]
                outbox.keep_alive()

    async def _expire_idle(self) -> None:
        """End sessions nobody used for ``session_idle_seconds`` (no request, no stream)."""
        cutoff = time.monotonic() - self.settings.session_idle_seconds
        for session in list(self.sessions.values()):
            if session.last_used < cutoff and not session.running and not session.get_open:
                log.info("mcp_http_session_expired")
                self._end_session(session)


def _version_mismatch(
    request: HttpRequest, core: CoreSession, message: Any = None, *, sessionless: bool = False
) -> McpError | None:
    """Why the ``MCP-Protocol-Version`` header refuses this request (400), or None.

    Without the header the session's own version holds (the spec's fallback). A version
    toolsetd does not know is refused as the core refuses one in ``_meta``. The stateless
    era binds the header to the body: a 2026-07-28 request's header must be its
    ``_meta``'s version, and a 2026-07-28 header must come with such a request
    (HeaderMismatch). Without a session such a header makes the request a 2026-07-28 one,
    whose ``_meta`` version is a required field: missing, the request is malformed
    (-32602, as the core answers one without ``clientCapabilities``), not a probe
    (``server/discover``, ``ping``). Among the handshake versions, a session answers by the one
    ``initialize`` agreed on whichever the header names, as the SDKs' servers do (the
    official conformance suite sends ``2025-03-26``, the spec's fallback, in a
    ``2025-11-25`` session).
    """
    refused = _unknown_version_header(request)
    if refused is not None:
        return refused
    header = request.header(_VERSION_HEADER)
    served = core.version_of(message)
    if header is None:
        if served in MODERN_VERSIONS:  # its POSTs MUST carry it
            return _header_mismatch(
                f"this request is served by protocol version {served!r}, whose requests "
                f"must carry the MCP-Protocol-Version header; send {served!r}"
            )
        return None
    if served in MODERN_VERSIONS and served == header and isinstance(message, dict):
        return _standard_headers_mismatch(request, message)
    version = meta_version(message)
    if version is not None and not isinstance(version, str):
        # The body's version is no string (the core's -32602): no header matches it. A
        # null is no version at all, as the core takes it (the session's own is served).
        return _header_mismatch(
            f"MCP-Protocol-Version is {header!r}, but the request's _meta names no protocol "
            "version (not a string)",
            {"header": header},
        )
    if served is None and sessionless and header in MODERN_VERSIONS:
        return McpError(
            -32602,
            f"Invalid params: MCP-Protocol-Version is {header!r}, so this is a {header} "
            f"request, which must carry '_meta.{PROTOCOL_VERSION_META}' (and "
            f"'_meta.{CAPABILITIES_META}'); it carries none.",
            {"field": f"_meta.{PROTOCOL_VERSION_META}"},
        )
    if served is None or served == header:
        return None
    if header not in MODERN_VERSIONS and served not in MODERN_VERSIONS:
        return None
    return _header_mismatch(
        f"MCP-Protocol-Version is {header!r}, but this request is served by protocol "
        f"version {served!r} (its _meta's, or the one initialize agreed on); send that one",
        {"header": header, "version": served},
    )


def _unknown_version_header(request: HttpRequest) -> McpError | None:
    """Why ``MCP-Protocol-Version`` refuses any request, ``initialize`` included, or None:
    sent twice (which one?), or naming a version toolsetd does not know (the transport:
    a server MUST answer an unsupported one 400; the SDK's server does so for
    ``initialize`` too)."""
    if request.header_count(_VERSION_HEADER) > 1:
        return _header_mismatch(f"{_VERSION_HEADER} is sent more than once; send it once")
    header = request.header(_VERSION_HEADER)
    if header is not None and header not in SUPPORTED_VERSIONS and header != _ASSUMED_VERSION:
        return unsupported_version(header)
    return None


def _header_mismatch(why: str, data: dict[str, Any] | None = None) -> McpError:
    """-32020 (``HeaderMismatch``, 2026-07-28): the headers do not say what the body does."""
    return McpError(-32020, f"Header mismatch: {why}.", data)


#: The 2026-07-28 standard request headers: ``Mcp-Name`` is the body's ``params`` member
#: named here, for these methods.
_NAMED_BY = {"tools/call": "name", "prompts/get": "name", "resources/read": "uri"}
_BASE64_SENTINEL = re.compile(r"=\?base64\?([A-Za-z0-9+/]*={0,2})\?=")


def _standard_headers_mismatch(request: HttpRequest, message: dict[str, Any]) -> McpError | None:
    """The 2026-07-28 ``Mcp-Method`` and ``Mcp-Name`` rules for one request, or None.

    The transport mirrors the body's ``method`` (every request) and ``params.name`` or
    ``params.uri`` (``tools/call``, ``prompts/get``, ``resources/read``) into headers so
    that intermediaries can route on them; a server MUST refuse a request whose headers
    are missing or differ from its body (``HeaderMismatch``), or an intermediary could
    route by one thing while the server does another. ``Mcp-Name`` may be sent in the
    Base64 sentinel form ``=?base64?...?=``.
    """
    method = message.get("method")
    if "id" not in message or not isinstance(method, str):
        return None  # not a request: the core answers it
    for name in ("mcp-method", "mcp-name"):
        if request.header_count(name) > 1:
            return _header_mismatch(f"{name} is sent more than once; send it once")
    sent = request.header("mcp-method")
    if sent != method:
        return _header_mismatch(
            f"Mcp-Method is {sent!r}, but the body's method is {method!r}; send the same"
            if sent is not None
            else f"a {method} request must carry the Mcp-Method header ({method!r})"
        )
    member = _NAMED_BY.get(method)
    params = message.get("params")
    named = params.get(member) if member is not None and isinstance(params, dict) else None
    if not isinstance(named, str):
        return None  # no name to mirror: the core refuses the params themselves
    header = request.header("mcp-name")
    if header is not None and (encoded := _BASE64_SENTINEL.fullmatch(header)) is not None:
        try:
            header = base64.b64decode(encoded[1], validate=True).decode("utf-8")
        except ValueError:
            return _header_mismatch("Mcp-Name's =?base64?...?= value is not base64 of UTF-8")
    if header != named:
        return _header_mismatch(
            f"Mcp-Name does not match the body's params.{member}; send the same"
            if header is not None
            else f"a {method} request must carry the Mcp-Name header (its params.{member})"
        )
    return None


#: The largest integer JavaScript holds exactly (``Number.MAX_SAFE_INTEGER``, 2^53 - 1).
_MAX_SAFE_INTEGER = 2**53 - 1
#: The characters a header value may hold (RFC 9110 5.5): visible ASCII, space and tab.
_HEADER_VALUE = re.compile(r"[\t\x20-\x7e]*")


async def _param_headers_mismatch(
    request: HttpRequest, core: CoreSession, message: dict[str, Any], marks: _HeaderMarks
) -> McpError | None:
    """The 2026-07-28 ``Mcp-Param-{Name}`` rule for a ``tools/call``, or None.

    A property of the tool's schema marked ``x-mcp-header`` (reached from the root through
    ``properties`` alone) has the client mirror its value into ``Mcp-Param-{Name}``, for
    intermediaries to route on. A server that reads the body MUST refuse (HeaderMismatch)
    a request whose header is missing while the body has a value there, differs from it
    (after decoding the Base64 sentinel; integers compared as numbers), holds characters a
    header may not, or is sent twice. A value that is absent or null (or not a primitive)
    takes no header, and one sent anyway is refused: it names a value the call lacks. A
    number outside JavaScript's safe integers may come without one (MCP keeps mirrored
    integers within them, and the TypeScript SDK's client mirrors none outside).
    """
    params = message.get("params")
    name = params.get("name") if isinstance(params, dict) else None
    arguments = params.get("arguments", {}) if isinstance(params, dict) else None
    if arguments is None:
        arguments = {}  # as the core takes them
    if not isinstance(name, str) or not isinstance(arguments, dict):
        return None  # the core refuses the params themselves
    found = await core.tool_schema(name)
    marked = marks.of(*found) if found is not None else None
    if marked is None:
        return None  # an unknown tool (the core answers it), or no header to check
    for path, header_name in marked:
        header = f"mcp-param-{header_name.lower()}"
        shown = f"Mcp-Param-{header_name}"
        if request.header_count(header) > 1:
            return _header_mismatch(f"{shown} is sent more than once; send it once")
        value: Any = arguments
        for key in path:
            value = value.get(key) if isinstance(value, dict) else None
        sent = request.header(header)
        where = ".".join(path)
        if value is None or not isinstance(value, (str, int, float)):
            # Absent or null (no header expected), or no primitive to mirror: a header
            # sent anyway names a value the body does not carry.
            if sent is not None:
                return _header_mismatch(
                    f"{shown} is sent, but the body's argument {where!r} has no value it "
                    "mirrors; leave the header out"
                )
            continue
        if sent is None:
            if not isinstance(value, (str, bool)) and not abs(value) <= _MAX_SAFE_INTEGER:
                # MCP keeps a mirrored integer within JavaScript's safe range, and the
                # TypeScript SDK's client mirrors none outside it: a valid call of such a
                # value came without its header and was refused (a header sent is checked).
                continue
            return _header_mismatch(
                f"the argument {where!r} is in the body, so the request must carry "
                f"{shown} (its schema marks it x-mcp-header)"
            )
        if not _HEADER_VALUE.fullmatch(sent):
            return _header_mismatch(f"{shown} holds characters a header value may not")
        if (encoded := _BASE64_SENTINEL.fullmatch(sent)) is not None:
            try:
                sent = base64.b64decode(encoded[1], validate=True).decode("utf-8")
            except ValueError:
                return _header_mismatch(f"{shown}'s =?base64?...?= value is not base64 of UTF-8")
        if not _mirrors(sent, value):
            return _header_mismatch(
                f"{shown} does not match the body's argument {where!r}; send the same"
            )
    return None


class _HeaderMarks:
    """The ``x-mcp-header`` marks of tools' schemas (``mcpschema.header_marks``), by tool hash.

    Every 2026-07-28 ``tools/call`` needs its tool's marks, and finding them walks the
    whole schema (~1 µs a node: 1 ms a call for a tool of 1,100 properties). The hash
    covers the schema, so a reload that changes it changes the key; the oldest entries
    go when ``max_entries`` is reached.
    """

    def __init__(self, max_entries: int = 4096) -> None:
        self._max_entries = max_entries
        self._marks: dict[str, list[tuple[tuple[str, ...], str]] | None] = {}

    def of(self, key: str, schema: Mapping[str, Any]) -> list[tuple[tuple[str, ...], str]] | None:
        """The marks of ``schema``, the schema of the tool whose hash is ``key``."""
        try:
            return self._marks[key]
        except KeyError:
            pass
        marked = header_marks(schema)
        while len(self._marks) >= self._max_entries:
            del self._marks[next(iter(self._marks))]
        self._marks[key] = marked
        return marked


def _mirrors(sent: str, value: str | int | float) -> bool:
    """Whether a header's (decoded) text says the body's value: a string as it is, a
    boolean as ``true``/``false``, a number compared as a number (``42.0`` is ``42``)."""
    if isinstance(value, bool):
        return sent == ("true" if value else "false")
    if isinstance(value, str):
        return sent == value
    try:
        return decimal.Decimal(sent) == decimal.Decimal(str(value))
    except (decimal.InvalidOperation, ValueError):
        return False


async def _rpc_error(
    exchange: Exchange,
    status: int,
    request_id: Any,
    error: rpc_errors.RpcError | McpError,
    headers: Sequence[tuple[str, str]] = (),
) -> None:
    """Answer with a JSON-RPC error (every error status of the endpoint carries one, as
    the SDK's server's do, so that a client reads why); the id is echoed by the MCP
    core's rule."""
    await exchange.respond_json(status, error_response(request_id, error.to_error()), headers)
