"""One client connection: the reader, ordered sends, in-flight calls, subscriptions.

Theory of operation
-------------------
A connection's socket is driven by the event loop's own socket transport (``Wire``, in
``wire.py``). A connection then has three parts:

* a reader that feeds received bytes to the sans-IO ``Codec``. A single request for one
  of the *inline* methods (``ServerSettings.inline_methods``: ``status`` and ``cancel``,
  whose handlers never wait) is dispatched and answered by the reader itself; everything
  else (``invoke``, ``list``, ``classify``, ``reload``, batches, errors) goes to a handler
  task, so requests are pipelined and answered in any order, and a long call never holds
  the reader up. A handler task that has answered waits for the connection's next message
  (up to ``_IDLE_HANDLERS`` of them wait), which costs less than starting a new task.
  After 64 inline answers in a row the reader yields to the other tasks.
  While the reader waits between requests (no partial line, no idle timer, nothing
  queued), a chunk that is one whole line is taken in the transport's own callback
  (``_answer_at_once``), without waking the reader: an inline request is answered (the
  wake-up was over a quarter of its cost), and any other message gets its handler task,
  as the reader would start it. A line over the frame limit, one that does not parse,
  and a chunk of more or less than one line are left to the reader;
* sending that never waits. ``send_message`` hands the frame to the transport unless
  its buffer is over ``send_buffer`` bytes (the peer is not reading) or older frames
  already wait. Then progress notifications are dropped (the next one carries the same
  counters) and everything else is committed to the connection's ordered queue: a
  sender (a runner slot, a reload announcing catalogChanged) is never held up by one
  client's socket, and a frame, once sent, cannot be lost to its sender's cancellation,
  so a call's started, completed and response always go out, in that order. While the
  queue is backlogged the reader takes no further requests from that client, which is
  what bounds the queue; a peer that takes nothing for the write timeout is
  disconnected by one timer per connection. Received bytes are bounded too: past
  256 KiB not yet taken by the reader, the transport stops reading;
* the set of calls it has in flight, cancelled when the client goes away. When the
  reader stops (EOF, idle timeout, framing error, ``close_gracefully``), the handlers
  finish and the transport flushes what is buffered, within the write timeout, then
  closes.

The connection does not know the methods: it hands each message to its ``Dispatch``
(the ``Server``, whose ``Dispatcher`` in ``dispatch.py`` is the JSON-RPC layer). A bind
method (``mcp.bind``, answered inline, so the frames pipelined behind it are read after
it) may set the connection's ``route``: from then on every message goes to that
``Route`` (an MCP session) instead, with no inline answers, and ``cancel_calls`` closes
the route too.

The limit of requests in flight (``max_calls_per_connection``) counts what may wait. On
the native wire that is every message that gets a task (``status`` and ``cancel`` are
answered inline and never wait; a request sent without an id still runs its method, so
it counts), and every item of a batch: the items past the free slots are answered -32008
in the batch's array and never run, so a batch carries no more work than the same
requests pipelined one per line (one line may hold hundreds of thousands). On a routed
connection it is the requests alone: a response to a request of the daemon's (an
elicitation's answer) or a notification (``notifications/cancelled``) frees a wait or a
slot, so it is never counted nor refused; the check is two key lookups, on the routed path
only. A routed request's slot (``_Slot``) is freed when its task ends, or before, when the
route calls the ``release`` it was announced with: MCP answers a cancelled request with
nothing, so its host counts it done while its tool is still being stopped. Until its task
ends it counts among the connection's ending requests; a request is admitted only while
they are fewer than the in-flight limit, so a host that sends calls and cancels them, over
and over, cannot pile up tasks that wait for a worker slot or a catalog (at most twice the
limit less one in all).

Why one module of this size: one connection's reader, ordered writer, stall timer and
in-flight table share its state; the framing lives in ``wire.py`` and the request
pipeline in ``dispatch.py``.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
import uuid
from collections.abc import Awaitable, Callable, Coroutine, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import anyio
import anyio.abc
import anyio.lowlevel
import orjson
import structlog
from toolsetd.protocol import errors as rpc_errors
from toolsetd.protocol.codec import (
    CLOSED,
    MAX_DAEMON_LINE,
    NEED_DATA,
    BadMessage,
    Codec,
    LargeLine,
    Message,
    encode,
    parse_large_line,
)
from toolsetd.protocol.jsonrpc import (
    InvalidEnvelope,
    Request,
    error_message,
    is_request_id,
    notification_message,
    parse_envelope,
)
from toolsetd.protocol.jsontext import loads
from toolsetd.protocol.names import METHOD_MCP_BIND

from .exhaustion import out_of_memory_frame, out_of_memory_in
from .large import LARGE_TEXT, LIMIT_TEXTS, LargeRequests
from .wire import Wire

__all__ = [
    "INLINE_METHODS",
    "CallTable",
    "Connection",
    "Dispatch",
    "Handler",
    "RequestContext",
    "Route",
    "ServerSettings",
]

log = structlog.get_logger("toolsetd.server")

#: A method handler: takes the request context and the params (an object, or an array
#: when the client sent positional params), and returns the result.
Handler = Callable[["RequestContext", Any], Awaitable[Any]]

#: Received bytes held for the reader before the socket stops being read.
_READ_BUFFER = 256 * 1024
_NEWLINE = 0x0A
#: The longest chunk ``_answer_at_once`` takes: requests are small, and a larger line is
#: left to the reader unread.
_AT_ONCE_MAX = 4096
#: Inline answers in one run of the reader before it lets other tasks run.
_INLINE_BURST = 64
#: Handler tasks a connection keeps waiting for its next message once theirs is answered.
#: Handing a message to one costs a future's wake-up; a new task costs anyio's task
#: set-up (its own cancel scope, its state, its done callback): about 40 µs more of an
#: ``invoke``'s path on a 2-vCPU KVM guest.
_IDLE_HANDLERS = 4
#: The items of a batch past the in-flight limit answered before other tasks run.
_REFUSE_SLICE = 1024
#: Methods answered in the reader itself: their handlers never wait on anything.
INLINE_METHODS: frozenset[str] = frozenset({"status", "cancel", METHOD_MCP_BIND})


@dataclass(frozen=True, slots=True)
class ServerSettings:
    """Limits of the socket server. Every wait on a peer has a bound.

    Attributes:
        max_frame_size: The longest line accepted (bytes).
        max_connections: Connections served at once; one more is refused with ServerBusy.
        max_calls_per_connection: Requests in flight per connection; beyond it, ServerBusy
            (a routed connection's responses and notifications never count).
        idle_timeout: Seconds a connection may hold an incomplete line, or stay without
            sending its first complete request, before it is closed.
        write_timeout: Seconds a response may wait for a slow reader before the
            connection is closed.
        send_buffer: Outgoing bytes buffered per connection beyond what the socket
            holds; past it progress notifications are dropped and other messages wait.
        inline_methods: Methods answered by the connection's reader itself, without a
            task: only handlers that never wait (they run to their end at once).
        linger_seconds: On closing, after shutting down our side, how long the peer's
            unread bytes are drained while waiting for its end of file (lingering close).
    """

    max_frame_size: int = 16 * 1024 * 1024
    max_connections: int = 256
    max_calls_per_connection: int = 128
    idle_timeout: float = 30.0
    write_timeout: float = 30.0
    send_buffer: int = 256 * 1024
    inline_methods: frozenset[str] = INLINE_METHODS
    linger_seconds: float = 2.0


@dataclass(slots=True)
class RequestContext:
    """What a handler knows about the request it serves.

    Attributes:
        connection: The client connection (for notifications and subscriptions).
        request_id: The JSON-RPC id, or None for a notification.
    """

    connection: Connection
    request_id: Any


if TYPE_CHECKING:
    _CallEvents = dict[str, anyio.Event]
else:  # ``anyio.Event`` evaluated at import loads anyio._core._tasks: ~3.5 ms of a cold start
    _CallEvents = dict


class CallTable(_CallEvents):
    """A connection's running invoke calls: their cancel events, by call id.

    A call registers once its id is checked, before it is judged, but its request's task
    may start after its client is gone: once ``closed`` (the reader stopped and the
    connection's calls were cancelled), a call that registers is cancelled as it
    registers, instead of running to its end for nobody.

    Nor may a ``cancel`` read right behind its ``invoke`` miss it: the reader answers a
    ``cancel`` at once, before the task serving the invoke has begun. So the call id an
    ``invoke`` names is announced when the invoke is read (``announce``); a cancel of an
    announced id is taken (``cancel_announced``) and the call is cancelled as it
    registers. The announcement ends when the call registers or its request is answered.
    """

    __slots__ = ("_announced", "closed")

    def __init__(self) -> None:
        super().__init__()
        self.closed = False
        #: Call ids of invokes read and not registered yet -> cancelled meanwhile.
        self._announced: dict[str, bool] = {}

    def __setitem__(self, call_id: str, cancel: anyio.Event) -> None:
        super().__setitem__(call_id, cancel)
        if self._announced.pop(call_id, False) or self.closed:
            cancel.set()

    def announce(self, call_id: str) -> bool:
        """An invoke naming ``call_id`` was read; False when that id is taken already."""
        if call_id in self._announced or call_id in self:
            return False
        self._announced[call_id] = False
        return True

    def cancel_announced(self, call_id: str) -> bool:
        """Cancel an announced call before it registers; False when none is announced."""
        if call_id not in self._announced:
            return False
        self._announced[call_id] = True
        return True

    def forget(self, call_id: str) -> None:
        """The announced call's request is answered (it registered, or it was refused)."""
        self._announced.pop(call_id, None)


def announced_call_id(value: Any) -> str | None:
    """The call id a native ``invoke`` request names, if any (``callId``, or its
    snake_case spelling, as the params check takes them)."""
    if type(value) is not dict or value.get("method") != "invoke":
        return None
    params = value.get("params")
    if type(params) is not dict:
        return None
    call_id = params.get("callId", params.get("call_id"))
    return call_id if type(call_id) is str else None


class Dispatch(Protocol):
    """What a connection needs of its server: the limits and the JSON-RPC layer."""

    settings: ServerSettings
    #: The large request lines in flight on all of its connections.
    large_requests: LargeRequests
    #: Methods the reader answers itself (see ``ServerSettings.inline_methods``).
    inline_methods: frozenset[str]

    async def dispatch_one(self, conn: Connection, value: Any) -> Any:
        """Answer one request object; None for a notification."""
        ...

    async def dispatch_batch(self, conn: Connection, items: list[Any]) -> Any:
        """Answer a batch; None if it holds no request."""
        ...


class Route(Protocol):
    """Another protocol a connection was bound to (MCP): it takes every later message."""

    def announce(self, message: Any, release: Callable[[], None]) -> None:
        """A request of the peer's was read and goes to a task that will ``receive`` it.

        ``release`` frees its in-flight slot before its task ends: for a request the peer
        cancelled, which gets no response (MCP), while its tool is still being stopped.
        """
        ...

    async def receive(self, message: Any) -> Any:
        """Serve one decoded message; the response to send, or None."""
        ...

    def close(self) -> None:
        """The peer is gone (or the connection closes): cancel what it has in flight."""
        ...


class _Slot:
    """A routed request's in-flight slot: freed once, by its task's end or, before that,
    by ``release`` (the peer cancelled it: MCP sends no response, so the peer counts it
    done). A slot released early counts among the connection's ending requests until its
    task ends."""

    __slots__ = ("_connection", "ending", "released")

    def __init__(self, connection: Connection) -> None:
        self._connection = connection
        self.released = False
        self.ending = False

    def release(self) -> None:
        self._connection._release_early(self)


@dataclass(frozen=True, slots=True)
class _Routed:
    """A request read on a routed connection, handed to a task with its slot."""

    message: Any
    slot: _Slot


class Connection:
    """One client connection: codec, bounded writes, in-flight calls, subscriptions."""

    def __init__(
        self,
        conn_id: int,
        stream: anyio.abc.SocketStream,
        server: Dispatch,
        peer: Any,
    ) -> None:
        self.conn_id = conn_id
        self.peer = peer
        self._stream = stream
        self._server = server
        self._settings = server.settings
        self._codec = Codec(max_frame_size=server.settings.max_frame_size, large_line=LARGE_TEXT)
        #: The longest chunk ``_answer_at_once`` takes: a line within the frame limit (the
        #: codec's to enforce: it answers -32007 and closes) and within ``_AT_ONCE_MAX``.
        self._at_once_max = min(_AT_ONCE_MAX, server.settings.max_frame_size + 1)
        self._wire: Wire | None = None
        self._closed = False
        self._aborted = False
        self._stop_reading = False
        self._in_flight = 0
        #: Routed requests the peer cancelled whose tasks have not ended (a tool being
        #: stopped, a wait for the worker slot or a catalog). A request is admitted only
        #: below ``max_calls_per_connection`` of them (and in flight): requests admitted
        #: and then cancelled may take them past it, so at most twice the limit less one
        #: tasks in all.
        self._ending = 0
        #: The bytes of an incomplete line over ``LARGE_TEXT`` counted in the server's
        #: ``large_requests`` (a line being received holds memory too).
        self._partial = 0
        #: True while the reader waits for a complete large line's parse: its request is in
        #: flight already (``evictable``).
        self._parsing = False
        #: Cancel events of this connection's running invoke calls, by call id.
        self.calls = CallTable()
        #: Workspace keys (a path string, or None for home) this client subscribed to.
        self.subscriptions: set[str | None] = set()
        #: Set by a bind method (``mcp.bind``): from then on every message goes to it.
        self.route: Route | None = None
        #: True only while the reader answers the connection's first frame inline: the one
        #: place where a bind method may take the connection over (``mcp.bind``).
        self.may_bind = False
        self._scope: anyio.CancelScope | None = None
        #: The task group of the message handlers while the connection is served.
        self._handlers: anyio.abc.TaskGroup | None = None
        #: Handler tasks waiting for a message (``_serve_messages``), most recent last.
        self._idle: list[asyncio.Future[tuple[Any, int] | None]] = []
        #: True only while the reader waits between requests with no timer (see
        #: ``_answer_at_once``); the loop's clock once the connection is served.
        self._between_requests = False
        self._clock: Callable[[], float] = time.monotonic
        #: When the last complete message arrived (the connection's start until then):
        #: the idlest connection without calls or subscriptions makes room for a new one.
        self.last_active = anyio.current_time()

    @property
    def evictable(self) -> bool:
        """Whether closing it loses nothing: no request in flight (a large line waiting
        for its parse included), no subscription, and not bound to MCP (a host's whole
        session, which it cannot open again unasked)."""
        return (
            not self._closed
            and self.route is None
            and self._in_flight == 0
            and not self._parsing
            and not self.calls
            and not self.subscriptions
            and not (self._wire is not None and (self._wire.has_data or self._wire.backlogged))
        )

    def evict(self) -> None:
        """Close an idle connection to make room: say why, then close gracefully."""
        limit = self._settings.max_connections
        self.post(
            error_message(
                None,
                rpc_errors.ServerBusy(
                    f"Connection closed to make room: toolsetd serves at most {limit} "
                    "connections, and this one was the longest idle (no request in flight, "
                    "no subscription). Connect again when needed.",
                    {"limit": limit},
                ),
            )
        )
        self.close_gracefully()

    @property
    def max_line(self) -> int:
        """The longest line this connection takes, in bytes (its newline not counted):
        ``--max-message-bytes`` as it was when it connected (a reload changes it for the
        connections made after)."""
        return self._settings.max_frame_size

    @property
    def closed(self) -> bool:
        """Whether the connection is closing or closed."""
        return self._closed

    async def send_message(self, message: Any, *, droppable: bool = False) -> None:
        """Send one JSON-RPC message, in the order of the calls; it never waits.

        A frame that cannot go out at once is committed to the connection's ordered queue,
        so it can neither hold up its sender (a runner slot) nor be lost to the sender's
        cancellation. A peer that takes nothing for the write timeout is disconnected.

        Args:
            message: A JSON-serialisable message.
            droppable: True for progress notifications, which are dropped rather than
                queued when the client is not keeping up.

        Raises:
            LocalProtocolError: The message cannot be serialised.
        """
        self.post(message, droppable=droppable)

    def post(self, message: Any, *, droppable: bool = False) -> None:
        """``send_message`` without a coroutine: commit the frame (or drop it) now."""
        if self._closed or self._wire is None:
            return
        try:
            frame = encode(message)
        except MemoryError as exc:
            if droppable and out_of_memory_in(exc):
                return  # dropped, as when the client is behind (the daemon's memory is bounded)
            raise
        self._commit(frame, droppable=droppable)

    def post_with_next(self, message: Any) -> None:
        """``post``, but the frame shares one write with the next one committed now.

        For a call's ``completed``, which its response follows in the same step of the
        event loop: one ``send`` and one wake-up of the client instead of two
        (``Wire.hold``).
        """
        if self._closed or self._wire is None:
            return
        self._wire.hold(encode(message))

    def _commit(self, frame: bytes, *, droppable: bool = False) -> None:
        wire = self._wire
        if self._closed or wire is None:
            return
        if droppable:
            wire.write_now(frame)  # dropped while the peer is behind
        else:
            wire.enqueue(frame)

    async def wait_drained(self) -> None:
        """Wait until every committed frame is with the transport (or the socket is gone).

        Bounded by the write timeout: a peer that takes nothing for it is disconnected.
        """
        if self._wire is not None:
            await self._wire.wait_drained()

    async def notify(
        self, method: str, params: Mapping[str, Any], *, droppable: bool = False
    ) -> None:
        """Send a notification to this client."""
        await self.send_message(notification_message(method, dict(params)), droppable=droppable)

    def abort(self) -> None:
        """Close the connection at once; in-flight calls are cancelled by the serve loop."""
        self._closed = True
        self._aborted = True
        # The handler tasks waiting for a message end now, as when the reader stops, not
        # by the cancellation: a task cancelled in its wait left a traceback that anyio's
        # task-done callback holds in a cycle, and with it the connection and its queued
        # frames, until the collector's next full pass.
        self._dismiss_idle()
        if self._scope is not None:
            self._scope.cancel()
        wire = self._wire
        if wire is not None and wire.transport is not None and not wire.lost:
            wire.transport.abort()  # also ends a final flush to a reader that stalled

    async def serve(self) -> None:
        """Serve this connection until the client leaves or an error closes it.

        Message handlers run beside the reader. When the reader stops (EOF, a framing
        error, the idle timeout, ``close_gracefully``), the client's calls are cancelled,
        the handlers finish (a cancelled call still sends its ``completed`` and response
        if the client can take them), and what is buffered is flushed, within the write
        timeout, before the socket closes.
        """
        loop = asyncio.get_running_loop()
        raw: socket.socket = self._stream.extra(anyio.abc.SocketAttribute.raw_socket)
        try:
            transport, wire = await loop.connect_accepted_socket(
                lambda: Wire(loop, _READ_BUFFER), sock=raw
            )
        except BaseException:
            self._closed = True
            with anyio.CancelScope(shield=True), anyio.move_on_after(1):
                await self._stream.aclose()
            raise
        transport.set_write_buffer_limits(high=self._settings.send_buffer)
        wire.stall_seconds = self._settings.write_timeout
        wire.on_stall = self.abort
        wire.stall_fields = {"conn_id": self.conn_id}
        wire.on_chunk = self._answer_at_once
        self._clock = loop.time
        self._wire = wire
        try:
            async with anyio.create_task_group() as handlers:
                self._scope = handlers.cancel_scope
                self._handlers = handlers
                try:
                    await self._reader(handlers)
                finally:
                    self._handlers = None
                    self._hold_partial(0)
                    self._dismiss_idle()
                self.cancel_calls()
            if not self._aborted and not wire.lost:
                # Every handler has answered: flush, then close (bounded like any write).
                with anyio.move_on_after(self._settings.write_timeout):
                    await wire.wait_drained()
                    await wire.linger(self._settings.linger_seconds)
                    await wire.wait_closed()
        except Exception as exc:
            if out_of_memory_in(exc) and not wire.lost and not self._closed:
                # The reader or a handler ran out (the daemon's memory is bounded): said
                # after what is queued, as a line it had no memory to parse is, and closed
                # once it is out, within the write timeout.
                with contextlib.suppress(Exception):
                    self._commit(out_of_memory_frame(None, said=False))
                    with anyio.CancelScope(shield=True):
                        with anyio.move_on_after(self._settings.write_timeout):
                            await wire.wait_drained()
            raise
        finally:
            self._closed = True
            self.cancel_calls()
            if not wire.lost:
                transport.abort()
            # The wire's callbacks are this connection's methods: a reference cycle, which
            # would keep the connection (and the partial line its codec holds, up to the
            # frame limit) until the collector's next full pass, however long that takes.
            wire.on_chunk = wire.on_stall = None

    def close_gracefully(self) -> None:
        """Stop reading; the calls in flight finish and their answers are sent first."""
        self._stop_reading = True
        if self._wire is not None:
            self._wire.wake_reader()

    def cancel_calls(self) -> None:
        """Cancel every invoke call this connection has in flight, and those that register
        later (still being judged now: ``CallTable``)."""
        self.calls.closed = True
        for event in list(self.calls.values()):
            event.set()
        if self.route is not None:
            self.route.close()

    async def _reader(self, tg: anyio.abc.TaskGroup) -> None:
        wire = self._wire
        assert wire is not None
        codec = self._codec
        inline = self._server.inline_methods
        timeout = self._settings.idle_timeout
        # The loop's clock is anyio's clock on asyncio (``anyio.current_time`` returns it),
        # read directly: 0.07 µs where anyio's lookup of its backend costs 0.7 per chunk.
        clock = asyncio.get_running_loop().time
        # The idle deadline: from connecting until the first complete line, then from the
        # first byte of each incomplete line. Bytes that arrive do not move it, so a line
        # dribbled one byte at a time still has to be complete within the idle timeout.
        deadline: float | None = clock() + timeout
        seen_request = False
        frames = 0  # complete lines read so far, good or bad
        while not self._closed and not self._stop_reading:
            if wire.backlogged:
                # The peer is not taking our answers: take no more of its requests (this
                # bounds what we hold; the stall timer ends a peer that never reads).
                await wire.wait_drained()
                continue
            if not wire.has_data and not wire.eof:
                if deadline is not None:
                    # Only the idle timer needs a cancel scope; a connection between
                    # requests waits without one.
                    try:
                        with anyio.fail_after(max(0.0, deadline - clock())):
                            await wire.wait_readable()
                    except TimeoutError:
                        log.info("connection_idle_closed", conn_id=self.conn_id)
                        return
                else:
                    self._between_requests = True  # a lone inline request is answered at once
                    try:
                        await wire.wait_readable()
                    finally:
                        self._between_requests = False
                continue
            if wire.lost:
                return
            data = wire.take()
            arrived = clock()
            self._hold_partial(0)  # the line it counted completes or grows: counted anew below
            try:
                codec.receive_data(data)
                answered_inline = 0
                completed = False
                while True:
                    event = codec.next_event()
                    if event is NEED_DATA or event is CLOSED:
                        break
                    held = 0
                    if type(event) is LargeLine:
                        held = len(event.line)
                        if not self._hold(held):
                            self._refuse_large(held)
                            return
                        # Off the loop (``large.LARGE_TEXT``); this connection's later lines
                        # wait, in order, as they wait for any await of the reader.
                        self._parsing = True
                        try:
                            parsed = await self._server.large_requests.parse(
                                parse_large_line, event.line
                            )
                        except BaseException:
                            self._release(held)
                            raise
                        finally:
                            self._parsing = False
                        # The parse may have waited behind other connections' (one at a
                        # time, daemon-wide) while this reader took nothing: a line begun
                        # in this chunk is timed from now, not from before that wait.
                        arrived = clock()
                        if type(parsed) is not Message:
                            self._release(held)
                            held = 0
                        if parsed is None:
                            continue  # a blank line, as the codec skips one
                        event = parsed
                    completed = True
                    frames += 1
                    if type(event) is BadMessage:
                        self.post(error_message(None, rpc_errors.ParseError(event.message)))
                        # Held back like a request's answer: half a megabyte of ``x`` lines,
                        # read at once, queued an answer to each (4 KiB a frame, as orjson
                        # allocates them: a gigabyte) for a peer that never read them.
                        if wire.backlogged:
                            await wire.wait_drained()
                        continue
                    assert isinstance(event, Message)
                    self.last_active = arrived
                    seen_request = True
                    value = event.value
                    # ``method`` may be anything the peer sent (a list is unhashable): only
                    # a string can name an inline method; the rest goes to the envelope check.
                    method = value.get("method") if type(value) is dict else None
                    if self.route is None and type(method) is str and method in inline:
                        self.may_bind = frames == 1
                        try:
                            await self._answer_inline(value)
                        finally:
                            self.may_bind = False
                            self._release(held)
                        answered_inline += 1
                        if answered_inline % _INLINE_BURST == 0:
                            # A long pipelined run must not starve the other connections.
                            await anyio.lowlevel.checkpoint()
                    else:
                        self._start_message(tg, value, held)
                    if wire.backlogged:
                        await wire.wait_drained()
                if event is CLOSED:
                    return
                if codec.has_partial_data:
                    if not self._hold_partial(codec.partial_bytes):
                        self._refuse_large(codec.partial_bytes)
                        return
                    if completed or deadline is None:
                        deadline = arrived + timeout  # a new line began in this chunk
                elif seen_request:
                    deadline = None  # between requests: no timer (a subscriber waits here)
            except rpc_errors.FrameTooLarge:
                limit = self._settings.max_frame_size
                await self.send_message(
                    error_message(
                        None,
                        rpc_errors.MessageTooLarge(
                            f"Message too large: a line may hold at most {limit} bytes; "
                            "the connection is closed.",
                            {"limit": limit},
                        ),
                    )
                )
                log.warning("connection_frame_too_large", conn_id=self.conn_id, limit=limit)
                return
            except MemoryError:
                # No memory to parse a line (``jsontext.loads``; a large one in the worker
                # slot): the daemon's want, not the peer's. Its id is not known, and the
                # peer would wait for its answer for ever: said, and the connection closed.
                await self.send_message(
                    error_message(
                        None,
                        rpc_errors.ServerBusy(
                            "Server busy: toolsetd had no memory to parse a line; the "
                            "connection is closed. Send it again when some calls have "
                            "finished.",
                            {"resource": "memory"},
                        ),
                    )
                )
                log.warning("connection_out_of_memory", conn_id=self.conn_id)
                return
            except rpc_errors.RemoteProtocolError as exc:
                log.info(
                    "connection_protocol_error", conn_id=self.conn_id, error=type(exc).__name__
                )
                return

    def _answer_at_once(self, data: bytes) -> bool:
        """Take a chunk that is one whole message in the transport's callback.

        Taken only while the reader waits between requests (it has seen a request, holds
        no partial line and no idle timer, and nothing waits to be sent), for a chunk of
        exactly one line that parses: what the reader would do with it is done here,
        without the future, the task step and the awaits that wake the reader. A request
        for an inline method is dispatched and answered; any other message gets its
        handler task (``_start_message``), as the reader would start it. The frame count
        only tells the reader's first frame (``may_bind``), which this never is. Anything
        else is left untouched (False), and the reader takes it as before.
        """
        if (
            not self._between_requests
            or self._closed
            or self._stop_reading
            or len(data) > self._at_once_max
            or data.find(_NEWLINE) != len(data) - 1
        ):
            return False
        wire, handlers = self._wire, self._handlers
        if wire is None or wire.backlogged or handlers is None:
            return False
        try:
            value = loads(data)
        except (orjson.JSONDecodeError, MemoryError):
            return False  # the reader answers it (or skips a blank line)
        self.last_active = self._clock()
        method = value.get("method") if type(value) is dict else None
        if (
            self.route is not None
            or type(method) is not str
            or method not in self._server.inline_methods
        ):
            self._start_message(handlers, value)
            return True
        # An inline handler never waits, so its coroutine runs to its end in one step.
        if self._post_at_once(self._server.dispatch_one(self, value)):
            return True
        # It waited: a bug in the method table, not in the request.
        incident = uuid.uuid4().hex[:12]
        log.error("inline_method_waited", method=method, incident=incident)
        self.post(
            error_message(
                value.get("id"),
                rpc_errors.InternalError(
                    f"Internal error (incident {incident}); the daemon log has the details.",
                    {"incident": incident},
                ),
            )
        )
        return True

    async def _answer_inline(self, value: Any) -> None:
        """Answer a quick method in the reader: dispatch, then commit the response.

        The handler itself never waits (that is what marks a method as inline), and
        committing a frame never waits either.
        """
        response = await self._server.dispatch_one(self, value)
        if response is not None:
            self._post_response(response)

    def _large_limit(self) -> int:
        """The daemon's bound on the bytes of large lines held (``LIMIT_TEXTS``)."""
        return LIMIT_TEXTS * self._settings.max_frame_size

    def _hold(self, size: int) -> bool:
        """Count a large line's bytes as held until its request is answered; False when
        that would take the daemon past its bound (``_large_limit``)."""
        return self._server.large_requests.hold(size, self._large_limit())

    def _hold_partial(self, size: int) -> bool:
        """Count the incomplete line's ``size`` bytes instead of what was counted for it
        (only a line over ``LARGE_TEXT``); False when the daemon holds too many."""
        counted, self._partial = self._partial, 0
        if size <= LARGE_TEXT:
            self._release(counted)
            return True
        if not self._server.large_requests.recount(counted, size, self._large_limit()):
            return False
        self._partial = size
        return True

    def _release(self, size: int) -> None:
        """The request of a large line (``_hold``) is answered, or never ran."""
        if size:
            self._server.large_requests.release(size)

    def _refuse_large(self, size: int) -> None:
        """Say why a large line is not taken (the daemon holds too many), before closing."""
        limit = self._large_limit()
        held = self._server.large_requests.held
        self.post(
            error_message(
                None,
                rpc_errors.ServerBusy(
                    f"Busy: lines of more than {LARGE_TEXT} bytes being received or in "
                    f"flight hold {held} bytes, and this one of {size} bytes would take them "
                    f"past {limit} (four times the line size limit); the connection is closed. "
                    "Send it again once some of those have been answered.",
                    {"resource": "memory", "limit": limit},
                ),
            )
        )
        log.warning("connection_large_lines_refused", conn_id=self.conn_id, size=size, held=held)

    def _start_message(self, tg: anyio.abc.TaskGroup, value: Any, held: int = 0) -> None:
        """Start serving one message; ``held`` is its line's size when ``_hold`` counted it
        (released once the message is answered)."""
        taken = False
        try:
            taken = self._start_held(tg, value, held)
        finally:
            if not taken:
                self._release(held)

    def _start_held(self, tg: anyio.abc.TaskGroup, value: Any, held: int) -> bool:
        """``_start_message``; True when a task took the message (and releases ``held``)."""
        route = self.route
        if route is not None:
            # On a routed (MCP) connection only a request asks for work that may wait. A
            # response (the host's answer to our elicitation/create) or a notification
            # (notifications/cancelled) ends a wait or a call, and the route answers
            # anything else at once: none of them counts or is refused for load, or the
            # answer that frees a slot would itself be refused for want of one. And none
            # gets a task: it is served here, so its answer is queued before the reader
            # takes the next line and the reader's backlog check holds a flood of them.
            if type(value) is not dict or "method" not in value or "id" not in value:
                self._deliver_at_once(route, value)
                return False
            limit = self._settings.max_calls_per_connection
            if self._in_flight >= limit or self._ending >= limit:
                request_id = value["id"]
                echo = request_id if is_request_id(request_id) else None
                self._post_response(error_message(echo, self._busy(ending=self._ending)))
                return False
            # In flight from now: a cancel the reader takes next is served at once, before
            # the task serving this request has begun; and frees the request's slot.
            slot = _Slot(self)
            route.announce(value, slot.release)
            value = _Routed(value, slot)
        elif type(value) is list and value:
            # Each item of a batch runs its method as a request of its own would, so each
            # counts: a batch must not carry more work past the limit than pipelining can.
            # A batch of one item too: its invoke is announced here, as a single one is
            # below (served as one, it was not, and a cancel right behind it was -32005).
            room = self._settings.max_calls_per_connection - self._in_flight
            if room <= 0:
                self._refuse_busy(value)
                return False
            items, overflow = value, []
            if len(value) > room:
                items, overflow = value[:room], value[room:]
            for item in items:  # at most the in-flight limit: see the single invoke below
                call_id = announced_call_id(item)
                if call_id is not None:
                    self.calls.announce(call_id)
            self._in_flight += len(items)
            tg.start_soon(self._handle_batch, items, overflow, held)
            return True
        elif self._in_flight >= self._settings.max_calls_per_connection:
            self._refuse_busy(value)
            return False
        else:
            call_id = announced_call_id(value)
            if call_id is not None:
                # In flight from now: a cancel the reader takes next is answered at once,
                # before the task serving this invoke has begun (``CallTable``).
                self.calls.announce(call_id)
        self._in_flight += 1
        idle = self._idle
        while idle:
            waiter = idle.pop()
            if not waiter.done():  # else its task was cancelled meanwhile
                waiter.set_result((value, held))
                return True
        tg.start_soon(self._serve_messages, value, held)
        return True

    def _busy(self, ending: int = 0) -> rpc_errors.ServerBusy:
        limit = self._settings.max_calls_per_connection
        if ending >= limit:
            return rpc_errors.ServerBusy(
                f"Too many cancelled requests still ending on this connection ({ending}; "
                f"new requests wait below {limit}): retry once they have ended.",
                {"limit": limit},
            )
        return rpc_errors.ServerBusy(
            f"Too many requests in flight on this connection: at most {limit}; "
            "wait for a response before sending more.",
            {"limit": limit},
        )

    def _refuse_busy(self, value: Any) -> None:
        """Answer a native message past the in-flight limit as its request would have been.

        A request gets -32008 with its id; an invalid envelope its -32600 (that costs
        nothing); a notification nothing (the native wire defines none from the client: a
        request sent without an id still runs its method, so it counts like any request);
        a batch one array with an answer per item that needs one (nothing when it holds
        only notifications).
        """
        if isinstance(value, list):
            if not value:
                response: Any = error_message(
                    None, rpc_errors.InvalidRequest("Invalid Request: a batch must not be empty.")
                )
            else:
                response = self._busy_answers(value) or None
        else:
            answers = self._busy_answers([value])
            response = answers[0] if answers else None
        if response is not None:
            self._post_response(response)

    def _busy_answers(self, items: list[Any]) -> list[Any]:
        """What the requests among ``items`` get past the in-flight limit, in order.

        A request gets -32008 with its id, an invalid envelope its -32600, a notification
        nothing (see ``_refuse_busy``).
        """
        busy = self._busy()
        answers: list[Any] = []
        for item in items:
            envelope = parse_envelope(item)
            if type(envelope) is Request:
                answers.append(error_message(envelope.id, busy))
            elif type(envelope) is InvalidEnvelope:
                answers.append(
                    error_message(envelope.id, rpc_errors.InvalidRequest(envelope.message))
                )
        return answers

    def _deliver_at_once(self, route: Route, value: Any) -> None:
        """Hand the route a message that is not a request (not counted: see above).

        The route never waits on one (it records an answer, cancels a call, or answers an
        invalid message), so its coroutine runs to its end in one step, as an inline
        method's does in ``_answer_at_once``.
        """
        if not self._post_at_once(route.receive(value)):  # it waited: the route's bug
            log.error("route_message_waited", incident=uuid.uuid4().hex[:12])

    def _post_at_once(self, step: Coroutine[Any, Any, Any]) -> bool:
        """Run a coroutine that never waits to its end in one step, and post its response.

        Returns:
            False when it waited after all (it is closed, nothing is posted).
        """
        try:
            step.send(None)
        except StopIteration as done:
            if done.value is not None:
                self._post_response(done.value)
            return True
        step.close()
        return False

    async def _serve_messages(self, value: Any, held: int) -> None:
        """A handler task: answer ``value``, then wait for the next message handed to it.

        Up to ``_IDLE_HANDLERS`` wait at once; the others end once answered, and every one
        ends when the reader stops (``_dismiss_idle``), so that the handlers' task group
        can finish.
        """
        loop = asyncio.get_running_loop()
        job: tuple[Any, int] | None = (value, held)
        del value
        while job is not None:
            await self._handle_message(*job)
            # Answered: the message is garbage now (its large line's bytes are released),
            # and a task that waits must not keep it (up to twenty times the line's size).
            job = None
            idle = self._idle
            if self._closed or self._handlers is None or len(idle) >= _IDLE_HANDLERS:
                return
            waiter: asyncio.Future[tuple[Any, int] | None] = loop.create_future()
            idle.append(waiter)
            try:
                job = await waiter
            except BaseException:
                # Cancelled (the connection ends): a message handed over meanwhile is
                # never served, and its large line's bytes must not stay counted.
                handed = waiter.result() if waiter.done() and not waiter.cancelled() else None
                if handed is not None:
                    self._release(handed[1])
                if waiter in idle:
                    idle.remove(waiter)
                raise

    def _dismiss_idle(self) -> None:
        """End the handler tasks waiting for a message: the reader takes no more."""
        idle, self._idle = self._idle, []
        for waiter in idle:
            if not waiter.done():
                waiter.set_result(None)

    async def _handle_message(self, value: Any, held: int = 0) -> None:
        slot: _Slot | None = None
        if type(value) is _Routed:
            value, slot = value.message, value.slot
        call_id = announced_call_id(value) if self.route is None else None
        try:
            try:
                if self.route is not None:
                    response: Any = await self.route.receive(value)
                elif isinstance(value, list):
                    response = await self._server.dispatch_batch(self, value)
                else:
                    response = await self._server.dispatch_one(self, value)
            except BaseException:
                self._settle(slot)
                raise
            await self._send_response(response, large=held > 0, slot=slot)
        finally:
            if call_id is not None:
                self.calls.forget(call_id)
            self._release(held)

    async def _handle_batch(self, items: list[Any], overflow: list[Any], held: int = 0) -> None:
        """Answer a batch whose ``items`` each hold an in-flight slot; the items of
        ``overflow``, past the limit, are refused, and their answers follow in the one array
        (a slice at a time: there may be hundreds of thousands). The array that answers a
        large line is encoded in the worker slot, as a single request's answer is.

        The items stay in flight until the answer is posted: while it is made, the
        connection is not idle, and no newcomer has it closed to make room.
        """
        try:
            response: Any = await self._server.dispatch_batch(self, items)
            if overflow:
                response = list(response or ())
                for start in range(0, len(overflow), _REFUSE_SLICE):
                    await anyio.lowlevel.checkpoint()
                    response += self._busy_answers(overflow[start : start + _REFUSE_SLICE])
            if response:
                self._post_response(response, await self._encode_large(response) if held else None)
        finally:
            self._in_flight -= len(items)
            for item in items:
                call_id = announced_call_id(item)
                if call_id is not None:
                    self.calls.forget(call_id)
            self._release(held)

    def _settle(self, slot: _Slot | None) -> None:
        """A request's task has ended: its in-flight slot is free, or it no longer counts
        among the ending requests if its slot was released early."""
        if slot is None:
            self._in_flight -= 1
        elif not slot.released:
            slot.released = True
            self._in_flight -= 1
        elif slot.ending:
            slot.ending = False
            self._ending -= 1

    def _release_early(self, slot: _Slot) -> None:
        """A routed request the peer cancelled: its slot is free now, and it counts among
        the ending requests until its task ends (``_settle``)."""
        if not slot.released:
            slot.released = slot.ending = True
            self._in_flight -= 1
            self._ending += 1

    async def _send_response(
        self, response: Any, *, large: bool = False, slot: _Slot | None = None
    ) -> None:
        """Send a response (of an in-flight call, which it ends).

        The response to a large line is encoded in the large requests' worker slot: a
        ``classify`` echoes its arguments, and four million fractions (orjson calls back
        into Python for each one kept as written) took 1.3 s to encode, on the loop.
        """
        try:
            if response is not None:
                self._post_response(response, await self._encode_large(response) if large else None)
        finally:
            self._settle(slot)

    async def _encode_large(self, response: Any) -> bytes | None:
        """The frame of the answer to a large line (a request's or a batch's), encoded in
        the large requests' worker slot; None when it cannot be (``_post_response`` says
        why)."""
        try:
            frame: bytes = await self._server.large_requests.check(encode, response)
        except rpc_errors.LocalProtocolError:
            return None
        except MemoryError as exc:
            if not out_of_memory_in(exc):
                raise
            return self._unwritten(response)
        return frame

    def _unwritten(self, response: Any) -> bytes:
        """The frame that stands for an answer the daemon had no memory to encode (its
        memory is bounded): busy under the request's id. A batch's answers are lost, ids
        and all, and they may take megabytes again: busy with id null, and the connection
        is closed after it, as for a line the daemon had no memory to parse."""
        if isinstance(response, dict):
            return out_of_memory_frame(response.get("id"))
        self.close_gracefully()
        return out_of_memory_frame(None)

    def _post_response(self, response: Any, frame: bytes | None = None) -> None:
        try:
            if frame is None:
                frame = encode(response)
        except MemoryError as exc:
            if not out_of_memory_in(exc):
                raise
            frame = self._unwritten(response)
        except rpc_errors.LocalProtocolError:
            # A result we cannot serialise is our bug: answer it, keep the connection.
            incident = uuid.uuid4().hex[:12]
            log.exception("response_not_serialisable", incident=incident)
            request_id = response.get("id") if isinstance(response, dict) else None
            self.post(
                error_message(
                    request_id,
                    rpc_errors.InternalError(
                        f"Internal error (incident {incident}); the daemon log has the details.",
                        {"incident": incident},
                    ),
                )
            )
            return
        if len(frame) > MAX_DAEMON_LINE:
            # Never send what our own client would refuse: say so instead.
            log.warning("response_too_large", conn_id=self.conn_id, size=len(frame))
            fitted = _fit_batch(response) if type(response) is list else None
            request_id = response.get("id") if isinstance(response, dict) else None
            frame = fitted or encode(_too_large(request_id, len(frame)))
        self._commit(frame)


def _too_large(request_id: Any, size: int) -> dict[str, Any]:
    """The error that stands for an answer of ``size`` bytes, over the daemon's line."""
    return error_message(
        request_id,
        rpc_errors.MessageTooLarge(
            f"Response too large: it would be a line of {size} bytes, and the daemon sends "
            f"at most {MAX_DAEMON_LINE}; ask for less (one catalog, a smaller result).",
            {"limit": MAX_DAEMON_LINE, "size": size},
        ),
    )


def _fit_batch(answers: list[Any]) -> bytes | None:
    """A batch's answer array within the daemon's line: its largest answers, one by one,
    replaced by ``_too_large`` under their own ids until it fits (each answer is legal on
    its own; only together are they too long). None when even that cannot make it fit
    (a batch of many small answers): the caller sends one error instead."""
    frames = [encode(answer)[:-1] for answer in answers]
    total = sum(map(len, frames)) + len(frames) + 2  # brackets, commas and the newline
    for index in sorted(range(len(frames)), key=lambda i: len(frames[i]), reverse=True):
        if total <= MAX_DAEMON_LINE:
            break
        answer = answers[index]
        request_id = answer.get("id") if isinstance(answer, dict) else None
        replacement = encode(_too_large(request_id, len(frames[index])))[:-1]
        if len(replacement) >= len(frames[index]):
            return None  # what is left is small: replacing it saves nothing
        total += len(replacement) - len(frames[index])
        frames[index] = replacement
    if total > MAX_DAEMON_LINE:
        return None
    return b"[" + b",".join(frames) + b"]\n"
