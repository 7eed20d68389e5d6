"""The socket server: accept loop, connections, and the JSON-RPC layer.

Theory of operation
-------------------
One ``Server`` owns the listening socket and a task group. The accept loop (after trio's
``serve_listeners``) retries descriptor exhaustion after a short sleep and starts one
``Connection`` task per client; whatever goes wrong inside a connection is logged and
closes that connection only.

A connection has three parts:

* a reader that feeds bytes to the sans-IO ``Codec`` and starts one task per complete
  message, so requests are pipelined and answered in any order;
* a writer task draining a bounded queue of outgoing frames, so a slow reader cannot make
  the daemon buffer without limit. Progress notifications are dropped when that queue is
  full (the next one carries the same counters); responses and every other notification
  wait, up to the write timeout, after which the connection is closed;
* the set of calls it has in flight, cancelled when the client goes away.

JSON-RPC: we parse the envelope ourselves (a cheap hand-written check instead of
jsonrpcserver's per-request schema validation, and correct batch and extra-member
handling), then hand each single request to jsonrpcserver for dispatch with identity
(de)serialisers. ``_boundary`` wraps every handler: it is the one place where exceptions
become wire errors, and no exception text or traceback ever reaches a client.
"""

from __future__ import annotations

import errno
import itertools
import os
import socket
import time
import uuid
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

import anyio
import anyio.abc
import structlog
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream
from jsonrpcserver import Error, Success
from jsonrpcserver.async_dispatcher import dispatch_request
from jsonrpcserver.dispatcher import to_response
from jsonrpcserver.request import Request as JsonRpcRequest
from jsonrpcserver.response import ErrorResponse, SuccessResponse
from jsonrpcserver.sentinels import NODATA, NOID
from pydantic import ValidationError

from toolsetd.protocol import errors as rpc_errors
from toolsetd.protocol.codec import CLOSED, NEED_DATA, BadMessage, Codec, Message
from toolsetd.protocol.jsonrpc import (
    InvalidEnvelope,
    Notification,
    Request,
    error_message,
    notification_message,
    parse_envelope,
)
from toolsetd.protocol.models import params_error

from .peercred import PeerPolicy, peer_credentials

__all__ = ["Connection", "Handler", "RequestContext", "Server", "ServerSettings"]

log = structlog.get_logger("toolsetd.server")

#: A method handler: takes the request context and the params (an object, or an array
#: when the client sent positional params), and returns the result.
Handler = Callable[["RequestContext", Any], Awaitable[Any]]

_ACCEPT_RETRY_ERRNOS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})
_RECEIVE_SIZE = 256 * 1024


@dataclass(frozen=True, slots=True)
class ServerSettings:
    """Limits of the socket server. Every wait on a peer has a bound.

    Attributes:
        max_frame_size: The longest line accepted (bytes).
        max_connections: Connections served at once; one more is refused with ServerBusy.
        max_calls_per_connection: Requests in flight per connection; beyond it, ServerBusy.
        idle_timeout: Seconds a connection may hold an incomplete line, or stay without
            sending its first complete request, before it is closed.
        write_timeout: Seconds a response may wait for a slow reader before the
            connection is closed.
        send_queue: Outgoing frames buffered per connection.
    """

    max_frame_size: int = 16 * 1024 * 1024
    max_connections: int = 256
    max_calls_per_connection: int = 128
    idle_timeout: float = 30.0
    write_timeout: float = 30.0
    send_queue: int = 256


@dataclass(slots=True)
class RequestContext:
    """What a handler knows about the request it serves.

    Attributes:
        connection: The client connection (for notifications and subscriptions).
        request_id: The JSON-RPC id, or None for a notification.
    """

    connection: Connection
    request_id: Any


@dataclass(slots=True)
class _Outgoing:
    frame: bytes
    droppable: bool


class Connection:
    """One client connection: codec, bounded writer, in-flight calls, subscriptions."""

    def __init__(
        self,
        conn_id: int,
        stream: anyio.abc.SocketStream,
        server: Server,
        peer: Any,
    ) -> None:
        self.conn_id = conn_id
        self.peer = peer
        self._stream = stream
        self._server = server
        self._settings = server.settings
        self._codec = Codec(max_frame_size=server.settings.max_frame_size)
        send, receive = anyio.create_memory_object_stream[_Outgoing](server.settings.send_queue)
        self._send: MemoryObjectSendStream[_Outgoing] = send
        self._receive: MemoryObjectReceiveStream[_Outgoing] = receive
        self._closed = False
        self._in_flight = 0
        #: Cancel events of this connection's running invoke calls, by call id.
        self.calls: dict[str, anyio.Event] = {}
        #: Workspace keys (a path string, or None for home) this client subscribed to.
        self.subscriptions: set[str | None] = set()
        self._scope: anyio.CancelScope | None = None
        self._reader_scope: anyio.CancelScope | None = None

    @property
    def closed(self) -> bool:
        """Whether the connection is closing or closed."""
        return self._closed

    async def send_message(self, message: Any, *, droppable: bool = False) -> None:
        """Queue one JSON-RPC message for the writer.

        Args:
            message: A JSON-serialisable message.
            droppable: True for progress notifications, which are dropped rather than
                waited for when the client is not keeping up.
        """
        if self._closed:
            return
        item = _Outgoing(self._codec.encode(message), droppable)
        if droppable:
            try:
                self._send.send_nowait(item)
            except (anyio.WouldBlock, anyio.BrokenResourceError, anyio.ClosedResourceError):
                pass
            return
        try:
            with anyio.fail_after(self._settings.write_timeout):
                await self._send.send(item)
        except TimeoutError:
            log.warning("connection_write_timeout", conn_id=self.conn_id)
            self.abort()
        except (anyio.BrokenResourceError, anyio.ClosedResourceError):
            pass

    async def notify(self, method: str, params: Mapping[str, Any], *, droppable: bool = False) -> None:
        """Send a notification to this client."""
        await self.send_message(notification_message(method, dict(params)), droppable=droppable)

    def abort(self) -> None:
        """Close the connection at once; in-flight calls are cancelled by the serve loop."""
        self._closed = True
        if self._scope is not None:
            self._scope.cancel()

    async def serve(self) -> None:
        """Serve this connection until the client leaves or an error closes it.

        The writer runs beside a nested task group of message handlers. When the reader
        stops (EOF, a framing error, the idle timeout), the client's calls are cancelled,
        the handlers finish (a cancelled call still sends its ``completed`` and response if
        the client can take them), and then the writer drains and ends.
        """
        try:
            async with anyio.create_task_group() as outer:
                self._scope = outer.cancel_scope
                outer.start_soon(self._writer)
                async with anyio.create_task_group() as handlers:
                    with anyio.CancelScope() as self._reader_scope:
                        await self._reader(handlers)
                    self.cancel_calls()
                await self._send.aclose()
        finally:
            self._closed = True
            self.cancel_calls()
            self._send.close()
            self._receive.close()
            with anyio.CancelScope(shield=True), anyio.move_on_after(1):
                await self._stream.aclose()

    def close_gracefully(self) -> None:
        """Stop reading; the calls in flight finish and their answers are sent first."""
        if self._reader_scope is not None:
            self._reader_scope.cancel()

    def cancel_calls(self) -> None:
        """Cancel every invoke call this connection has in flight."""
        for event in list(self.calls.values()):
            event.set()

    async def _writer(self) -> None:
        async with self._receive:
            async for item in self._receive:
                try:
                    with anyio.fail_after(self._settings.write_timeout):
                        await self._stream.send(item.frame)
                except (TimeoutError, anyio.BrokenResourceError, anyio.ClosedResourceError, OSError):
                    self.abort()
                    return

    async def _reader(self, tg: anyio.abc.TaskGroup) -> None:
        seen_request = False
        while not self._closed:
            waiting_for_line = not seen_request or self._codec.has_partial_data
            try:
                with anyio.fail_after(self._settings.idle_timeout if waiting_for_line else None):
                    data = await self._stream.receive(_RECEIVE_SIZE)
            except TimeoutError:
                log.info("connection_idle_closed", conn_id=self.conn_id)
                return
            except anyio.EndOfStream:
                data = b""
            except (anyio.BrokenResourceError, anyio.ClosedResourceError, OSError):
                return
            try:
                self._codec.receive_data(data)
                while True:
                    event = self._codec.next_event()
                    if event is NEED_DATA or event is CLOSED:
                        break
                    if isinstance(event, BadMessage):
                        await self.send_message(
                            error_message(None, rpc_errors.ParseError(event.message))
                        )
                        continue
                    assert isinstance(event, Message)
                    seen_request = True
                    self._start_message(tg, event.value)
                if event is CLOSED:
                    return
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
            except rpc_errors.RemoteProtocolError as exc:
                log.info("connection_protocol_error", conn_id=self.conn_id, error=type(exc).__name__)
                return

    def _start_message(self, tg: anyio.abc.TaskGroup, value: Any) -> None:
        if self._in_flight >= self._settings.max_calls_per_connection:
            envelope = parse_envelope(value) if not isinstance(value, list) else None
            request_id = envelope.id if isinstance(envelope, Request) else None
            limit = self._settings.max_calls_per_connection
            tg.start_soon(
                self.send_message,
                error_message(
                    request_id,
                    rpc_errors.ServerBusy(
                        f"Too many requests in flight on this connection: at most {limit}; "
                        "wait for a response before sending more.",
                        {"limit": limit},
                    ),
                ),
            )
            return
        self._in_flight += 1
        tg.start_soon(self._handle_message, value)

    async def _handle_message(self, value: Any) -> None:
        try:
            if isinstance(value, list):
                response: Any = await self._server.dispatch_batch(self, value)
            else:
                response = await self._server.dispatch_one(self, value)
            if response is not None:
                try:
                    await self.send_message(response)
                except rpc_errors.LocalProtocolError:
                    # A result we cannot serialise is our bug: answer it, keep the connection.
                    incident = uuid.uuid4().hex[:12]
                    log.exception("response_not_serialisable", incident=incident)
                    request_id = response.get("id") if isinstance(response, dict) else None
                    await self.send_message(
                        error_message(
                            request_id,
                            rpc_errors.InternalError(
                                f"Internal error (incident {incident}); the daemon log has "
                                "the details.",
                                {"incident": incident},
                            ),
                        )
                    )
        finally:
            self._in_flight -= 1


class Server:
    """The JSON-RPC server over a listening Unix socket.

    Args:
        settings: Limits and timeouts.
        methods: Handlers by method name.
        peer_policy: Which peers may call.
    """

    def __init__(
        self,
        settings: ServerSettings,
        methods: Mapping[str, Handler],
        peer_policy: PeerPolicy,
    ) -> None:
        self.settings = settings
        self._methods = dict(methods)
        self._jsonrpc_methods = {name: _boundary(name, fn) for name, fn in self._methods.items()}
        self._peer_policy = peer_policy
        self._ids = itertools.count(1)
        self.connections: dict[int, Connection] = {}
        self.accepting = True
        #: Methods refused once a graceful stop has begun.
        self.refused_while_stopping: frozenset[str] = frozenset({"invoke", "reload"})

    # -- accept loop -----------------------------------------------------------------

    async def serve(
        self,
        listener: anyio.abc.SocketListener,
        *,
        task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED,
    ) -> None:
        """Accept connections until the listener is closed or this task is cancelled.

        The server owns the listener from here on and closes it when it stops.
        """
        try:
            await self._accept_loop(listener, task_status)
        finally:
            with anyio.CancelScope(shield=True):
                await listener.aclose()

    async def _accept_loop(
        self, listener: anyio.abc.SocketListener, task_status: anyio.abc.TaskStatus[None]
    ) -> None:
        async with anyio.create_task_group() as tg:
            task_status.started()
            while True:
                try:
                    stream = await listener.accept()
                except (anyio.ClosedResourceError, anyio.BrokenResourceError):
                    return
                except OSError as exc:
                    if exc.errno in _ACCEPT_RETRY_ERRNOS:
                        log.warning("accept_retry", errno=exc.errno)
                        await anyio.sleep(0.1)
                        continue
                    raise
                tg.start_soon(self._serve_connection, stream)

    async def _serve_connection(self, stream: anyio.abc.SocketStream) -> None:
        conn_id = next(self._ids)
        with structlog.contextvars.bound_contextvars(conn_id=conn_id):
            try:
                raw: socket.socket = stream.extra(anyio.abc.SocketAttribute.raw_socket)
                cred = peer_credentials(raw)
            except OSError:
                cred = None
            if cred is None or not self._peer_policy.allows(cred):
                log.warning(
                    "peer_refused",
                    pid=getattr(cred, "pid", None),
                    uid=getattr(cred, "uid", None),
                    gid=getattr(cred, "gid", None),
                )
                await self._refuse(
                    stream,
                    rpc_errors.PeerNotAllowed(
                        "This user may not call toolsetd: the daemon serves its own user "
                        "(and root) unless a group is allowed with --allow-group."
                    ),
                )
                return
            if not self.accepting:
                await self._refuse(stream, rpc_errors.ShuttingDown("toolsetd is shutting down."))
                return
            if len(self.connections) >= self.settings.max_connections:
                limit = self.settings.max_connections
                log.warning("connection_limit", limit=limit)
                await self._refuse(
                    stream,
                    rpc_errors.ServerBusy(
                        f"Too many connections: toolsetd serves at most {limit} at once.",
                        {"limit": limit},
                    ),
                )
                return
            conn = Connection(conn_id, stream, self, cred)
            self.connections[conn_id] = conn
            log.info("connection_opened", pid=cred.pid, uid=cred.uid, gid=cred.gid)
            try:
                await conn.serve()
            except Exception:
                log.exception("connection_failed")
            finally:
                self.connections.pop(conn_id, None)
                log.info("connection_closed")

    async def _refuse(self, stream: anyio.abc.SocketStream, error: rpc_errors.RpcError) -> None:
        with anyio.CancelScope(shield=True), anyio.move_on_after(1):
            try:
                await stream.send(Codec().encode(error_message(None, error)))
            except (anyio.BrokenResourceError, anyio.ClosedResourceError, OSError):
                pass
            await stream.aclose()

    # -- JSON-RPC ----------------------------------------------------------------------

    async def dispatch_batch(self, conn: Connection, items: list[Any]) -> Any:
        """Answer a batch: one response per request item, in order; None if there are none."""
        if not items:
            return error_message(
                None, rpc_errors.InvalidRequest("Invalid Request: a batch must not be empty.")
            )
        responses: list[Any] = [None] * len(items)

        async def one(index: int, item: Any) -> None:
            responses[index] = await self.dispatch_one(conn, item)

        async with anyio.create_task_group() as tg:
            for index, item in enumerate(items):
                tg.start_soon(one, index, item)
        answered = [r for r in responses if r is not None]
        return answered or None

    async def dispatch_one(self, conn: Connection, value: Any) -> Any:
        """Answer one request object; None for a notification."""
        envelope = parse_envelope(value)
        if isinstance(envelope, InvalidEnvelope):
            return error_message(envelope.id, rpc_errors.InvalidRequest(envelope.message))
        if isinstance(envelope, Request):
            request_id: Any = envelope.id
        else:
            assert isinstance(envelope, Notification)
            request_id = _NO_ID
        method = envelope.method
        if method not in self._jsonrpc_methods:
            known = ", ".join(sorted(self._methods))
            error = rpc_errors.MethodNotFound(
                f"Method not found: '{method}'. Methods: {known}.", {"method": method}
            )
            return None if request_id is _NO_ID else error_message(request_id, error)
        if not self.accepting and method in self.refused_while_stopping:
            error = rpc_errors.ShuttingDown(
                f"toolsetd is shutting down: no new '{method}' calls are accepted."
            )
            return None if request_id is _NO_ID else error_message(request_id, error)
        params = envelope.params
        request = JsonRpcRequest(method, {} if params is None else params, _request_id(request_id))
        context = RequestContext(conn, None if request_id is _NO_ID else request_id)
        # jsonrpcserver's per-request pipeline (method lookup, argument binding, call).
        # Its batch-level entry points run even one request through asyncio.gather,
        # outside anyio's cancel scopes, where a handler's shielded cleanup (killing a
        # child, reaping it) can be cut short; this entry point awaits the handler here.
        _, result = await dispatch_request(self._jsonrpc_methods, context, request)
        if request_id is _NO_ID:
            return None
        return _to_wire(_unwrap(to_response(request, result)))


class _NoId:
    """Marks a JSON-RPC notification (no id member), distinct from ``"id": null``."""


_NO_ID: Any = _NoId()


def _request_id(request_id: Any) -> Any:
    """Our notification marker as jsonrpcserver's."""
    return NOID if request_id is _NO_ID else request_id


def _unwrap(either: Any) -> Any:
    """jsonrpcserver hands responses over as oslash ``Left``/``Right``; take the value."""
    return either._value if hasattr(either, "_value") else either._error


def _to_wire(response: Any) -> Any:
    if response is None:
        return None
    if isinstance(response, SuccessResponse):
        return {"jsonrpc": "2.0", "result": response.result, "id": response.id}
    assert isinstance(response, ErrorResponse)
    error: dict[str, Any] = {"code": response.code, "message": response.message}
    if response.data is not NODATA:
        error["data"] = response.data
    return {"jsonrpc": "2.0", "error": error, "id": response.id}


def _boundary(name: str, handler: Handler) -> Callable[..., Awaitable[Any]]:
    """Wrap a handler so that it is the one place exceptions become wire errors.

    jsonrpcserver's own catch-all would send ``str(exc)`` to the client; this wrapper
    never lets an exception reach it.
    """

    async def method(context: RequestContext, /, *args: Any, **kwargs: Any) -> Any:
        # jsonrpcserver spreads params into arguments; gather them back unchanged.
        params: Any = list(args) if args else kwargs
        started = time.perf_counter()
        with structlog.contextvars.bound_contextvars(method=name, request_id=context.request_id):
            try:
                result = await handler(context, params)
            except rpc_errors.RpcError as exc:
                log.info("request_refused", code=exc.code, ms=_ms(started))
                return Error(exc.code, exc.message, NODATA if exc.data is None else exc.data)
            except ValidationError as exc:
                error = params_error(exc)
                log.info("request_refused", code=error.code, ms=_ms(started))
                return Error(error.code, error.message, error.data)
            except Exception:
                incident = uuid.uuid4().hex[:12]
                log.exception("request_failed", incident=incident)
                return Error(
                    rpc_errors.InternalError.CODE,
                    f"Internal error (incident {incident}); the daemon log has the details.",
                    {"incident": incident},
                )
            log.debug("request_served", ms=_ms(started))
            return Success(result)

    method.__name__ = name
    return method


def _ms(started: float) -> float:
    return round((time.perf_counter() - started) * 1000, 3)


def bind_unix_socket(path: os.PathLike[str] | str, backlog: int = 1024) -> socket.socket:
    """Create a listening Unix socket at ``path`` with mode 0600.

    The umask is tightened around ``bind`` so the socket is never reachable by others,
    not even for the moment before the chmod.
    """
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old_umask = os.umask(0o177)
    try:
        sock.bind(os.fspath(path))
    except BaseException:
        sock.close()
        raise
    finally:
        os.umask(old_umask)
    os.chmod(path, 0o600)
    sock.listen(backlog)
    return sock
