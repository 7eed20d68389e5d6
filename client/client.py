"""The async toolsetd client: one connection, many concurrent calls.

Theory of operation: ``Client.connect`` opens the Unix socket and starts one reader task
in a task group the client owns (entered by ``connect``, left by ``aclose``; use the
client as ``async with await Client.connect(path) as client`` so both happen in the same
task). Writers serialise whole lines under a lock; request ids are increasing integers.
The reader feeds bytes to the sans-IO ``Codec`` and routes each message:

* a response (``parse_response``: ``id`` with ``result`` or ``error``) fills the slot of the
  waiting call and sets its event; a response for an id nobody waits for (a call that was
  abandoned) is dropped;
* ``started``, ``progress`` and ``completed`` go, by ``params.callId``, to the event
  queue of the ``invoke`` that registered that call id before sending the request;
* every other notification (``catalogChanged``) goes into a bounded memory stream
  exposed by ``notifications()``; when nobody drains it the newest are dropped.

``invoke`` delivers its events to ``on_event`` from a task of the *caller's* task group,
never from the reader, so a slow or re-entrant handler (one that calls ``cancel``) can
neither stall nor deadlock the connection. Events queued before the response are all
delivered before ``invoke`` returns. Progress events are coalesced when the handler
falls behind (the oldest pending progress is dropped); ``started`` and ``completed``
never are.

An error response whose ``id`` is null is the daemon's word on the whole connection (a
refused peer, a full server, a daemon shutting down): every waiting call, and every call
made after it, fails with that ``RpcError``. When a send fails because the daemon has
already closed, the reader is given a moment to read what the daemon wrote first, so the
caller sees the daemon's sentence rather than a broken pipe.

When the connection ends (EOF, broken stream, ``aclose``, or anything from the daemon
that is not a response or a notification: a protocol violation ends the connection) every
waiting call fails with ``ConnectionClosed`` and the notification stream ends. An
``invoke`` that is cancelled by its caller sends ``cancel`` for its call id, shielded and
bounded, so an abandoned call does not keep a child running in the daemon.
"""

from __future__ import annotations

import inspect
import itertools
import math
import uuid
from collections import deque
from collections.abc import Awaitable, Callable
from pathlib import Path
from types import TracebackType
from typing import Any, Self

import anyio
import anyio.abc
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream
from toolsetd.protocol.codec import CLOSED, MAX_DAEMON_LINE, NEED_DATA, BadMessage, Codec, Message
from toolsetd.protocol.errors import RemoteProtocolError, RpcError
from toolsetd.protocol.jsonrpc import ErrorResponse, Notification, parse_response

from .errors import (
    ConnectionClosed,
    RequestTimeout,
    map_connect_errors,
    map_stream_errors,
)

__all__ = ["CALL_EVENTS", "Client", "EventHandler"]

#: The notifications that belong to one ``invoke`` call, routed by ``params.callId``.
CALL_EVENTS: frozenset[str] = frozenset({"started", "progress", "completed"})

#: An ``invoke`` event handler: ``(method, params)``, plain or async.
EventHandler = Callable[[str, dict[str, Any]], Awaitable[None] | None]

_READ_CHUNK = 65536
#: Seconds a failed send waits for the reader to take what the daemon wrote before closing.
_LAST_WORDS_SECONDS = 1.0
#: What the daemon may send is what its client accepts (docs/protocol.md, Limits).
_DEFAULT_MAX_FRAME = MAX_DAEMON_LINE


class _Pending:
    """The slot one call waits on: an event, then a result or an error."""

    __slots__ = ("error", "event", "result")

    def __init__(self) -> None:
        self.event = anyio.Event()
        self.result: Any = None
        self.error: BaseException | None = None

    def resolve(self, result: Any = None, error: BaseException | None = None) -> None:
        """Fill the slot once and wake the waiter."""
        if self.event.is_set():
            return
        self.result = result
        self.error = error
        self.event.set()


class _CallEvents:
    """The events of one ``invoke`` call, queued by the reader, drained by the caller.

    Bounded: beyond ``max_progress`` pending progress events the oldest one is dropped.
    """

    def __init__(self, max_progress: int = 64) -> None:
        self._items: deque[tuple[str, dict[str, Any]]] = deque()
        self._progress = 0
        self._max_progress = max_progress
        self._wakeup = anyio.Event()
        self._closed = False

    def put(self, method: str, params: dict[str, Any]) -> None:
        """Queue one event (never blocks)."""
        if self._closed:
            return
        if method == "progress":
            if self._progress >= self._max_progress:
                for index, (name, _) in enumerate(self._items):
                    if name == "progress":
                        del self._items[index]
                        self._progress -= 1
                        break
            self._progress += 1
        self._items.append((method, params))
        self._wakeup.set()

    def close(self) -> None:
        """Mark the end: the drain finishes once the queue is empty."""
        self._closed = True
        self._wakeup.set()

    async def get(self) -> tuple[str, dict[str, Any]] | None:
        """Return the next event, or None once closed and drained."""
        while not self._items:
            if self._closed:
                return None
            self._wakeup = anyio.Event()
            await self._wakeup.wait()
        method, params = self._items.popleft()
        if method == "progress":
            self._progress -= 1
        return method, params


class Client:
    """One connection to toolsetd.

    Create it with ``await Client.connect(path)``; close it with ``aclose()`` or by using
    it as an async context manager, in the task that connected.
    """

    def __init__(
        self,
        stream: anyio.abc.ByteStream,
        *,
        path: str,
        max_frame_size: int = _DEFAULT_MAX_FRAME,
        notification_buffer: int = 64,
    ) -> None:
        """Wrap an open byte stream. Prefer ``Client.connect``.

        Args:
            stream: The connected byte stream.
            path: The socket path (for messages).
            max_frame_size: The largest line accepted from the daemon.
            notification_buffer: How many unsolicited notifications are kept undrained.
        """
        self.path = path
        self._stream = stream
        self._codec = Codec(max_frame_size=max_frame_size)
        self._ids = itertools.count(1)
        self._send_lock = anyio.Lock()
        self._pending: dict[int, _Pending] = {}
        self._calls: dict[str, _CallEvents] = {}
        self._closed: ConnectionClosed | None = None
        #: The daemon's error for the whole connection (an error response with a null id).
        self._refusal: RpcError | None = None
        self._reader_done = anyio.Event()
        self._task_group: anyio.abc.TaskGroup | None = None
        send, receive = anyio.create_memory_object_stream[dict[str, Any]](notification_buffer)
        self._notify_send: MemoryObjectSendStream[dict[str, Any]] = send
        self._notify_receive: MemoryObjectReceiveStream[dict[str, Any]] = receive
        #: Whether a caller took the notification stream (then it is theirs to close).
        self._notifications_taken = False

    # -- lifecycle -------------------------------------------------------------------

    @classmethod
    async def connect(cls, path: str | Path, *, timeout: float = 5.0) -> Client:  # noqa: ASYNC109 -- public API: a connect bound
        """Connect to the daemon's socket and start the reader.

        Args:
            path: The Unix socket path.
            timeout: Seconds allowed for the connect.

        Returns:
            A connected client.

        Raises:
            ConnectError: The socket is missing, refuses, is forbidden, or the connect timed out.
        """
        with map_connect_errors(path, timeout):
            with anyio.fail_after(timeout):
                stream = await anyio.connect_unix(str(path))
        client = cls(stream, path=str(path))
        await client._start()
        return client

    async def _start(self) -> None:
        """Enter the client's task group and start the reader task."""
        task_group = anyio.create_task_group()
        await task_group.__aenter__()
        self._task_group = task_group
        try:
            await task_group.start(self._read_loop)
        except BaseException:
            task_group.cancel_scope.cancel()
            await task_group.__aexit__(None, None, None)
            raise

    async def aclose(self) -> None:
        """Close the connection; waiting calls fail with ``ConnectionClosed``. Idempotent."""
        self._shutdown(ConnectionClosed("The connection to toolsetd is closed.", "closed"))
        await self._stream.aclose()
        task_group, self._task_group = self._task_group, None
        if task_group is not None:
            task_group.cancel_scope.cancel()
            await task_group.__aexit__(None, None, None)
        if not self._notifications_taken:
            self._notify_receive.close()  # nobody will drain it; anyio warns if left open

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    @property
    def closed(self) -> bool:
        """Whether the connection has ended."""
        return self._closed is not None

    def notifications(self) -> MemoryObjectReceiveStream[dict[str, Any]]:
        """Return the stream of unsolicited notifications (``{"method", "params"}``).

        It ends when the connection ends. Only one consumer should drain it, and closes it.
        """
        self._notifications_taken = True
        return self._notify_receive

    # -- calls -----------------------------------------------------------------------

    async def call(
        self,
        method: str,
        params: dict[str, Any] | None = None,
        *,
        timeout: float | None = None,  # noqa: ASYNC109 -- public API: a per-call bound
    ) -> Any:
        """Send one request and wait for its response.

        Args:
            method: The method name.
            params: The params object; omitted from the request when None.
            timeout: Seconds to wait for the response; None waits as long as it takes.

        Returns:
            The response's ``result``.

        Raises:
            RpcError: The daemon answered with an error (the subclass for its code).
            ConnectionClosed: The connection ended first.
            RequestTimeout: No response within ``timeout``.
        """
        if self._refusal is not None:
            raise self._refusal
        if self._closed is not None:
            raise self._closed_error()
        request_id = next(self._ids)
        message: dict[str, Any] = {"jsonrpc": "2.0", "id": request_id, "method": method}
        if params is not None:
            message["params"] = params
        slot = _Pending()
        self._pending[request_id] = slot
        try:
            try:
                await self._send(message)
            except ConnectionClosed:
                with anyio.move_on_after(_LAST_WORDS_SECONDS):
                    await self._reader_done.wait()
                if self._refusal is not None:
                    raise self._refusal from None
                raise
            with anyio.move_on_after(math.inf if timeout is None else timeout) as scope:
                await slot.event.wait()
            if scope.cancelled_caught:
                raise RequestTimeout(f"No response to {method} within {timeout:g} s.")
        finally:
            self._pending.pop(request_id, None)
        if isinstance(slot.error, ConnectionClosed):
            if self._refusal is not None:
                raise self._refusal
            raise self._closed_error()
        if slot.error is not None:
            raise slot.error
        return slot.result

    async def invoke(
        self,
        tool: str,
        arguments: dict[str, Any],
        workspace: str | Path,
        *,
        call_id: str | None = None,
        mode: str | None = None,
        headless: bool | None = None,
        approved: bool | None = None,
        catalog: str | None = None,
        session: str | None = None,
        images: bool | None = None,
        traceparent: str | None = None,
        on_event: EventHandler | None = None,
    ) -> dict[str, Any]:
        """Run a tool and wait for its result, delivering its events to ``on_event``.

        Only the params that are set are sent. The handler is registered under the call
        id before the request goes out, so no event is missed. If the caller cancels this
        call, ``cancel`` is sent for it (shielded, bounded) before the cancellation goes on.

        Args:
            tool: The tool name.
            arguments: The argument object.
            workspace: The absolute workspace path.
            call_id: The call id; a fresh uuid4 hex when None.
            mode: The approval mode.
            headless: Whether every ``ask`` becomes ``deny``.
            approved: Whether the operator approved the call.
            catalog: ``plan`` or ``work``.
            session: The session string passed to the child.
            images: Whether the caller can take image content.
            traceparent: The caller's W3C trace context; the daemon's span (or, without
                tracing, the tool) continues that trace.
            on_event: Called as ``on_event(method, params)`` for ``started``, ``progress``
                and ``completed``, plain or async, from the caller's task.

        Returns:
            The call result (``callId``, ``status``, ``content``, ``isError``, ...).

        Raises:
            RpcError: The daemon refused the call (``UnknownTool``, ``InvalidArguments``,
                ``PolicyDenied``, ``ApprovalRequired``, ...).
            ConnectionClosed: The connection ended first.
            Exception: Whatever ``on_event`` raised; the call is cancelled in the daemon.
        """
        call_id = call_id or uuid.uuid4().hex
        params: dict[str, Any] = {
            "tool": tool,
            "arguments": arguments,
            "workspace": str(workspace),
            "callId": call_id,
        }
        optional = {
            "mode": mode,
            "headless": headless,
            "approved": approved,
            "catalog": catalog,
            "session": session,
            "images": images,
            "traceparent": traceparent,
        }
        params.update({key: value for key, value in optional.items() if value is not None})
        if call_id in self._calls:
            raise ValueError(f"call id {call_id!r} is already in flight on this connection")
        events = _CallEvents()
        self._calls[call_id] = events
        handler_error: list[Exception] = []
        outcome: list[Any] = []
        failure: list[BaseException] = []
        finished = False
        try:
            async with anyio.create_task_group() as task_group:
                task_group.start_soon(
                    self._deliver, events, on_event, handler_error, task_group.cancel_scope
                )
                try:
                    outcome.append(await self.call("invoke", params))
                except Exception as exc:  # re-raised below, unwrapped by the task group
                    failure.append(exc)
                finally:
                    self._calls.pop(call_id, None)
                    events.close()
            finished = True
        finally:
            if not finished or handler_error:
                await self._cancel_quietly(call_id)
        if handler_error:
            raise handler_error[0]
        if failure:
            raise failure[0]
        result: dict[str, Any] = outcome[0]
        return result

    @staticmethod
    async def _deliver(
        events: _CallEvents,
        on_event: EventHandler | None,
        handler_error: list[Exception],
        scope: anyio.CancelScope,
    ) -> None:
        """Drain one call's events into its handler; on a handler error stop the call."""
        while (item := await events.get()) is not None:
            if on_event is None or handler_error:
                continue
            try:
                maybe = on_event(*item)
                if inspect.isawaitable(maybe):
                    await maybe
            except Exception as exc:
                handler_error.append(exc)
                scope.cancel()
                return

    async def _cancel_quietly(self, call_id: str) -> None:
        """Ask the daemon to cancel an abandoned call: shielded, bounded, errors ignored."""
        if self._closed is not None:
            return
        with anyio.CancelScope(shield=True), anyio.move_on_after(2.0):
            try:
                await self.call("cancel", {"callId": call_id})
            except (RpcError, ConnectionClosed, RequestTimeout):
                pass

    async def cancel(self, call_id: str) -> bool:
        """Cancel an in-flight ``invoke`` by its call id.

        Args:
            call_id: The call id.

        Returns:
            The daemon's ``cancelled`` flag.

        Raises:
            UnknownCall: The call is not in flight on the daemon.
        """
        result = await self.call("cancel", {"callId": call_id})
        return bool(result.get("cancelled")) if isinstance(result, dict) else False

    async def status(self) -> dict[str, Any]:
        """Return the daemon status (``version``, ``pid``, ``generation``, ...)."""
        result: dict[str, Any] = await self.call("status")
        return result

    async def list(
        self,
        workspace: str | Path | None = None,
        *,
        catalog: str | None = None,
        subscribe: bool | None = None,
    ) -> dict[str, Any]:
        """Return the catalog: ``generation``, ``tools``, ``sets``, ``notes``.

        Args:
            workspace: The absolute workspace; without it only home sets.
            catalog: ``plan`` or ``work``; without it every loaded tool.
            subscribe: Ask for ``catalogChanged`` notifications on this connection.
        """
        params: dict[str, Any] = {}
        if workspace is not None:
            params["workspace"] = str(workspace)
        if catalog is not None:
            params["catalog"] = catalog
        if subscribe is not None:
            params["subscribe"] = subscribe
        result: dict[str, Any] = await self.call("list", params)
        return result

    async def classify(
        self,
        tool: str,
        arguments: dict[str, Any],
        workspace: str | Path,
        *,
        mode: str | None = None,
        headless: bool | None = None,
    ) -> dict[str, Any]:
        """Return the classification of a prospective call (nothing runs).

        Args:
            tool: The tool name.
            arguments: The argument object.
            workspace: The absolute workspace path.
            mode: The approval mode.
            headless: Whether every ``ask`` becomes ``deny``.
        """
        params: dict[str, Any] = {"tool": tool, "arguments": arguments, "workspace": str(workspace)}
        if mode is not None:
            params["mode"] = mode
        if headless is not None:
            params["headless"] = headless
        result: dict[str, Any] = await self.call("classify", params)
        return result

    async def reload(self, workspace: str | Path | None = None) -> dict[str, Any]:
        """Reload the catalog; returns ``generation``, ``changed``, ``notes``.

        Args:
            workspace: The absolute workspace to reload as well as home.
        """
        params: dict[str, Any] = {} if workspace is None else {"workspace": str(workspace)}
        result: dict[str, Any] = await self.call("reload", params)
        return result

    # -- I/O -------------------------------------------------------------------------

    async def _send(self, message: dict[str, Any]) -> None:
        """Write one line under the lock."""
        data = self._codec.encode(message)
        async with self._send_lock:
            if self._closed is not None:
                raise self._closed_error()
            with map_stream_errors():
                await self._stream.send(data)

    async def _read_loop(self, *, task_status: anyio.abc.TaskStatus[None]) -> None:
        """Read messages until the connection ends; never raises into the task group."""
        task_status.started()
        reason = ConnectionClosed("toolsetd closed the connection.", "eof")
        try:
            while True:
                event = self._codec.next_event()
                if event is NEED_DATA:
                    try:
                        data = await self._stream.receive(_READ_CHUNK)
                    except anyio.EndOfStream:
                        data = b""
                    self._codec.receive_data(data)
                elif event is CLOSED:
                    break
                elif isinstance(event, Message):
                    self._route(event.value)
                elif isinstance(event, BadMessage):
                    raise RemoteProtocolError(event.message)
        except anyio.ClosedResourceError:
            reason = ConnectionClosed("The connection to toolsetd is closed.", "closed")
        except (anyio.BrokenResourceError, OSError):
            reason = ConnectionClosed("The connection to toolsetd was broken.", "broken")
        except RemoteProtocolError as exc:
            reason = ConnectionClosed(f"toolsetd sent an invalid message: {exc}", "protocol")
        finally:
            self._shutdown(reason)
            self._reader_done.set()

    def _route(self, value: Any) -> None:
        """Route one decoded message (or a batch of them).

        Raises:
            RemoteProtocolError: The value is neither a response nor a notification.
        """
        if isinstance(value, list):
            for item in value:
                self._route(item)
            return
        message = parse_response(value)
        if isinstance(message, Notification):
            params = message.params if isinstance(message.params, dict) else {}
            self._notify(message.method, params)
            return
        if message.id is None and isinstance(message, ErrorResponse):
            # Not an answer to one request: the daemon's word on the whole connection.
            if self._refusal is None:
                self._refusal = message.error
            for waiting in list(self._pending.values()):
                waiting.resolve(error=message.error)
            return
        slot = self._pending.get(message.id) if type(message.id) is int else None
        if slot is None:
            return  # an abandoned call
        if isinstance(message, ErrorResponse):
            slot.resolve(error=message.error)
        else:
            slot.resolve(result=message.result)

    def _notify(self, method: str, params: dict[str, Any]) -> None:
        """Route a notification to its call, or to the unsolicited stream."""
        if method in CALL_EVENTS:
            call = self._calls.get(str(params.get("callId")))
            if call is not None:
                call.put(method, params)
            return
        try:
            self._notify_send.send_nowait({"method": method, "params": params})
        except (anyio.WouldBlock, anyio.BrokenResourceError, anyio.ClosedResourceError):
            pass  # nobody drains the stream: drop rather than stall the reader

    def _closed_error(self) -> ConnectionClosed:
        """Return a fresh ``ConnectionClosed`` for the reason the connection ended."""
        reason = self._closed
        if reason is None:
            return ConnectionClosed("The connection to toolsetd is closed.", "closed")
        return ConnectionClosed(str(reason), reason.reason)

    def _shutdown(self, reason: ConnectionClosed) -> None:
        """Fail every waiter with ``reason`` and end the notification stream (once)."""
        if self._closed is not None:
            return
        self._closed = reason
        for slot in list(self._pending.values()):
            slot.resolve(error=reason)
        for call in list(self._calls.values()):
            call.close()
        self._notify_send.close()
