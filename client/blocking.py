"""A blocking, one-connection toolsetd client for ``toolsetctl``: no anyio, no pydantic.

Why a second transport beside ``Client``: ``toolsetctl`` runs one command and exits, and
its start-up is its cost. Importing asyncio and anyio alone is more than twice a bare
``python -c pass``; typing, dataclasses (which pulls in inspect and ast) and orjson
together cost about as much again. So this module is standard library only (socket, json)
and reads the wire with the smallest reader that is still strict: lines of at most
``MAX_LINE_BYTES``, each one JSON value, each a response (``result`` xor ``error``, with an
id) or a notification; anything else ends the connection as a protocol error, as in
``Client``. The errors are the same: ``RpcError.from_error`` rebuilds the daemon's, and
transport failures are ``ConnectError`` and ``ConnectionClosed``.

Theory of operation: ``BlockingClient.connect`` opens the Unix socket (bounded by the
connect timeout), then reads with no timeout unless the caller gives a deadline.
``send`` writes one request and returns its id; ``wait(id)`` reads messages until that
id is answered: answers to other ids sent are kept for their own ``wait`` (answers to ids
never sent, or answered already, are dropped), the events of a call (``started``,
``progress``, ``completed``) go to ``on_event``, other notifications are dropped.
Ctrl-C (``KeyboardInterrupt``) escapes ``wait`` with the connection still usable, so the
caller can send ``cancel`` and wait again.

An error whose ``id`` is null is the daemon's word on the whole connection (a refused
peer, a full server, a daemon shutting down); it is raised from every ``wait`` and
``send`` that follows. When a send fails because the daemon already closed, what it
wrote before closing is read first, so that sentence is what the caller sees, not the
broken pipe.
"""

from __future__ import annotations

import json
import signal
import socket
import time
from collections.abc import Callable, Mapping

from toolsetd.protocol.errors import RemoteProtocolError, RpcError

from .errors import ConnectError, ConnectionClosed, RequestTimeout, map_connect_errors
from .mcp import connect_within, shared_tmp_peer_refused, shared_tmp_squatted
from .termination import HELD

TYPE_CHECKING = False  # not typing's: importing typing is a share of the start-up
if TYPE_CHECKING:
    from typing import Any

__all__ = [
    "CALL_EVENTS",
    "MAX_LINE_BYTES",
    "BlockingClient",
    "RawJson",
    "WrittenNumber",
    "json_number",
    "read_json",
]

#: The longest line accepted from the daemon: the longest line the daemon sends
#: (``protocol.codec.MAX_DAEMON_LINE``; a test holds the two equal), so every legal result,
#: 32 MiB of images included, reaches ``toolsetctl``.
MAX_LINE_BYTES = 64 * 1024 * 1024

#: The notifications that belong to one ``invoke`` call.
CALL_EVENTS: frozenset[str] = frozenset({"started", "progress", "completed"})

_READ_CHUNK = 65536
#: Seconds spent reading what a daemon wrote before it closed, after a failed send.
_LAST_WORDS_SECONDS = 1.0


class WrittenNumber(float):
    """A JSON number with a fraction or an exponent (or an integer of more digits than
    Python converts), and its text as written (``text``).

    The daemon echoes a number as the caller wrote it (``1.50``, ``1e4``, ``1e400``), and
    ``toolsetctl`` prints it back so (``jsonout.dumps``): as a float it would print as
    ``1.5``, ``10000.0`` or ``Infinity`` (no JSON). Its value is the double it reads as
    (infinity past the double range); nothing here computes the exact integer, whose
    digits a ``1e2000000`` would have toolsetctl write out for a minute.
    """

    __slots__ = ("text",)
    text: str

    def __new__(cls, text: str) -> WrittenNumber:
        number = super().__new__(cls, text)
        number.text = text
        return number


def json_number(text: str) -> float:
    """A ``parse_float`` hook: a JSON number with a fraction or an exponent, as a
    ``WrittenNumber`` (its double, and its text to print back)."""
    return WrittenNumber(text)


def _json_int(text: str) -> int | float:
    """A ``parse_int`` hook: the integer, or a ``WrittenNumber`` keeping its text where an
    ``int`` would not: ``-0`` (its sign), and past the interpreter's digit limit (int()
    refuses it), as for ``1e5000``."""
    if text == "-0":
        return WrittenNumber(text)
    try:
        return int(text)
    except ValueError:
        return WrittenNumber(text)


def read_json(text: str | bytes) -> Any:
    """Parse one JSON text as ``toolsetctl`` reads the daemon's lines.

    A number with a fraction or an exponent is a ``WrittenNumber`` (``json_number``). An
    integer of more digits than ``sys.get_int_max_str_digits`` (4,300 unless
    ``PYTHONINTMAXSTRDIGITS`` says otherwise) is one too: a daemon whose limit is higher
    (or none) echoes an argument or a schema's bound as written, and ``int()``'s refusal
    made the whole answer an invalid message. So is an integer ``-0``, which an ``int``
    would print as ``0``. Only a text that holds ``-0`` at all, or fails the first parse,
    is parsed with the hook that keeps them, so no other line pays for it.

    Args:
        text: The JSON text.

    Returns:
        The value.

    Raises:
        ValueError: It is not JSON.
        RecursionError: It is nested deeper than the standard library's decoder recurses.
    """
    if "-0" not in text if isinstance(text, str) else b"-0" not in text:
        try:
            return json.loads(text, parse_float=json_number)
        except ValueError:
            pass
    return json.loads(text, parse_float=json_number, parse_int=_json_int)


class RawJson:
    """A params member sent as the caller's own JSON text (numbers keep their spelling).

    Args:
        text: One JSON value, already checked to parse.
    """

    __slots__ = ("text",)

    def __init__(self, text: str) -> None:
        # A raw line break in valid JSON is whitespace (strings cannot hold one): fold it
        # so the value stays on the request's one line.
        self.text = text.replace("\r", " ").replace("\n", " ").strip()


def _frame(message: Mapping[str, Any]) -> bytes:
    """Encode one request as a line; ``RawJson`` params members are spliced in as written."""
    params = message.get("params")
    head = {key: value for key, value in message.items() if key != "params"}
    text = json.dumps(head, ensure_ascii=False, separators=(",", ":"))
    if params is None:
        return (text + "\n").encode()
    members = [
        json.dumps(key, ensure_ascii=False)
        + ":"
        + (value.text if isinstance(value, RawJson) else json.dumps(value, ensure_ascii=False))
        for key, value in params.items()
    ]
    return f'{text[:-1]},"params":{{{",".join(members)}}}}}\n'.encode()


class BlockingClient:
    """One blocking connection to toolsetd.

    Create it with ``BlockingClient.connect(path)``; close it with ``close()`` or use it
    as a context manager.
    """

    def __init__(self, sock: socket.socket, path: str) -> None:
        """Wrap a connected socket. Prefer ``BlockingClient.connect``.

        Args:
            sock: The connected Unix stream socket.
            path: The socket path (for messages).
        """
        self.path = path
        self._sock = sock
        self._buffer = bytearray()
        self._scanned = 0
        self._eof = False
        self._next_id = 1
        #: Answers read for requests nobody waits on yet: ``(error, result)``.
        self._answers: dict[int, tuple[RpcError | None, Any]] = {}
        #: The ids sent and not yet answered.
        self._pending: set[int] = set()
        #: The daemon's error for the whole connection (an error with a null id).
        self._refusal: RpcError | None = None
        self._closed: ConnectionClosed | None = None

    @classmethod
    def connect(cls, path: str, *, timeout: float = 5.0) -> BlockingClient:
        """Connect to the daemon's socket.

        Args:
            path: The Unix socket path.
            timeout: Seconds allowed for the connect.

        Returns:
            A connected client.

        Raises:
            ConnectError: The socket is missing, refuses, is forbidden, or timed out.
        """
        squatted = shared_tmp_squatted(path)
        if squatted is not None:
            raise ConnectError(f"Not connecting to toolsetd at {path}: {squatted}.", path)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            with map_connect_errors(path, timeout):
                connect_within(sock, path, timeout)
        except BaseException:
            sock.close()
            raise
        refused = shared_tmp_peer_refused(sock, path)  # the folder may have changed since
        if refused is not None:
            sock.close()
            raise ConnectError(f"Not connecting to toolsetd at {path}: {refused}.", path)
        sock.settimeout(None)
        return cls(sock, path)

    def __enter__(self) -> BlockingClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Close the connection. Idempotent."""
        self._sock.close()

    # -- requests --------------------------------------------------------------------

    def send(self, method: str, params: Mapping[str, Any] | None = None) -> int:
        """Send one request and return its id.

        Args:
            method: The method name.
            params: The params object (``RawJson`` members go as written); None omits it.

        Raises:
            RpcError: The daemon already refused this connection (its own sentence).
            ConnectionClosed: The connection is gone.
        """
        self._raise_if_ended()
        request_id = self._next_id
        self._next_id += 1
        message: dict[str, Any] = {"jsonrpc": "2.0", "id": request_id, "method": method}
        if params is not None:
            message["params"] = dict(params)
        self._pending.add(request_id)
        try:
            self._sock.sendall(_frame(message))
        except OSError as exc:
            self._read_last_words()
            self._raise_if_ended()
            raise ConnectionClosed("The connection to toolsetd was broken.", "broken") from exc
        return request_id

    def wait(
        self,
        request_id: int,
        *,
        on_event: Callable[[str, dict[str, Any]], None] | None = None,
        timeout: float | None = None,
    ) -> Any:
        """Read until ``request_id`` is answered; return its result.

        Args:
            request_id: The id ``send`` returned.
            on_event: Called with ``(method, params)`` for each call event read meanwhile.
            timeout: Seconds to wait at most; None waits as long as it takes.

        Raises:
            RpcError: The daemon answered with an error (or refused the connection).
            ConnectionClosed: The connection ended first.
            RequestTimeout: No answer within ``timeout``.
            KeyboardInterrupt: Ctrl-C; the connection stays usable.
        """
        # A deadline for the whole wait, not for each read: a peer that trickles other
        # messages (events, answers to other ids) must not keep it waiting for ever.
        deadline = None if timeout is None else time.monotonic() + timeout
        self._sock.settimeout(timeout)
        try:
            while request_id not in self._answers:
                self._raise_if_ended()
                if deadline is not None:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise RequestTimeout(f"No response within {timeout:g} s.")
                    self._sock.settimeout(left)
                try:
                    self._read_once(on_event)
                except TimeoutError as exc:
                    raise RequestTimeout(f"No response within {timeout:g} s.") from exc
        finally:
            if self._sock.fileno() != -1:
                self._sock.settimeout(None)
        error, result = self._answers.pop(request_id)
        if error is not None:
            raise error
        return result

    def call(
        self,
        method: str,
        params: Mapping[str, Any] | None = None,
        *,
        on_event: Callable[[str, dict[str, Any]], None] | None = None,
    ) -> Any:
        """Send one request and wait for its result (see ``send`` and ``wait``)."""
        return self.wait(self.send(method, params), on_event=on_event)

    # -- reading ---------------------------------------------------------------------

    def _raise_if_ended(self) -> None:
        if self._refusal is not None:
            raise self._refusal
        if self._closed is not None:
            raise ConnectionClosed(str(self._closed), self._closed.reason)

    def _read_once(self, on_event: Callable[[str, dict[str, Any]], None] | None) -> None:
        """Route one buffered line, or read one chunk; a bad line ends the connection."""
        try:
            newline = self._buffer.find(b"\n", self._scanned)
            if newline < 0:
                self._scanned = len(self._buffer)
                if self._scanned > MAX_LINE_BYTES:
                    raise RemoteProtocolError(f"line of more than {MAX_LINE_BYTES} bytes")
                if self._eof:
                    self._end(ConnectionClosed("toolsetd closed the connection.", "eof"))
                    return
                try:
                    data = self._sock.recv(_READ_CHUNK)
                except TimeoutError:
                    raise
                except OSError:
                    self._end(ConnectionClosed("The connection to toolsetd was broken.", "broken"))
                    return
                self._eof = not data
                self._buffer += data
                return
            # From the line taken to its event delivered (a ``jsonl`` line owed to stdout),
            # Ctrl-C, SIGTERM and SIGHUP are held: raised in between, they lost the event
            # (a log that began at the cancelled call's ``completed``). One that came
            # meanwhile is raised once it is delivered, or from a wait for a lagging
            # reader of stdout (``Output._drain`` lets them in there).
            mask = signal.pthread_sigmask(signal.SIG_BLOCK, HELD)
            try:
                line = bytes(self._buffer[:newline])
                del self._buffer[: newline + 1]
                self._scanned = 0
                if line.strip():
                    try:
                        value = read_json(line)
                    except ValueError as exc:
                        raise RemoteProtocolError("a line that is not JSON") from exc
                    except RecursionError as exc:  # the stdlib decoder recurses per level
                        raise RemoteProtocolError("a line nested too deeply") from exc
                    self._route(value, on_event)
            finally:
                signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        except RemoteProtocolError as exc:
            self._end(ConnectionClosed(f"toolsetd sent an invalid message: {exc}", "protocol"))

    def _end(self, reason: ConnectionClosed) -> None:
        if self._closed is None:
            self._closed = reason

    def _route(self, value: Any, on_event: Callable[[str, dict[str, Any]], None] | None) -> None:
        """Route one message (or a batch): keep an answer, deliver an event, note a refusal."""
        if isinstance(value, list):
            for item in value:
                self._route(item, on_event)
            return
        if type(value) is not dict or value.get("jsonrpc") != "2.0":
            raise RemoteProtocolError("a message that is not a JSON-RPC 2.0 object")
        if "id" not in value:
            method, params = value.get("method"), value.get("params")
            if type(method) is not str:
                raise RemoteProtocolError("a message with neither an id nor a method")
            if on_event is not None and method in CALL_EVENTS and type(params) is dict:
                on_event(method, params)
            return
        request_id = value["id"]
        error = value.get("error")
        if ("result" in value) == ("error" in value) or (
            "error" in value
            and not (
                type(error) is dict
                and type(error.get("code")) is int
                and type(error.get("message")) is str
            )
        ):
            raise RemoteProtocolError("a response without exactly one valid result or error")
        rebuilt = RpcError.from_error(error) if error is not None else None
        if request_id is None:
            # Not an answer to one request: the daemon's word on the whole connection.
            if rebuilt is not None and self._refusal is None:
                self._refusal = rebuilt
            return
        if type(request_id) is int and request_id in self._pending:
            # Only answers to requests sent and not yet answered are kept (as ``Client``
            # drops an abandoned call's): a daemon that answers ids nobody asked for must
            # not grow this dict without bound.
            self._pending.discard(request_id)
            self._answers[request_id] = (rebuilt, value.get("result"))

    def _read_last_words(self) -> None:
        """After a failed send: read, briefly, what the daemon wrote before it closed."""
        self._sock.settimeout(_LAST_WORDS_SECONDS)
        try:
            while self._refusal is None and self._closed is None:
                self._read_once(None)
        except OSError:  # the timeout: whatever it wrote has been read
            pass
