"""Sans-IO NDJSON framing: bytes in, JSON values out, and back.

Theory of operation
-------------------
The wire is one UTF-8 JSON value per line, lines ending in ``\\n`` (a ``\\r`` just
before it is tolerated). ``Codec`` never touches a socket: the caller feeds it
whatever bytes arrived with ``receive_data`` (``b""`` meaning end of file) and then
calls ``next_event`` until it returns ``NEED_DATA`` (or ``CLOSED``), the way h11's
``Connection`` is driven::

    codec.receive_data(chunk)
    while (event := codec.next_event()) is not NEED_DATA:
        ...

``next_event`` returns, in stream order:

* ``Message(value)`` for a line that parsed as JSON (numbers kept exactly as written,
  see ``jsontext``);
* ``BadMessage(message)`` for a line that is not UTF-8 or not JSON. The line is
  consumed and the stream stays usable: the server answers -32700 and carries on.
  The message is ours and never echoes the input;
* ``LargeLine(line)``, only with ``large_line`` set, for a line longer than that, not yet
  parsed: ``parse_large_line`` parses it (a caller with threads does it off its event
  loop: a 16 MiB line of numbers takes seconds to parse with every number's text kept);
* ``NEED_DATA`` when no complete line is buffered;
* ``CLOSED`` after end of file once every buffered line has been returned.

Blank lines (only whitespace) are skipped.

Invariants:

* The buffer holds at most one partial line of ``max_frame_size`` bytes plus
  whatever the last ``receive_data`` added: a partial line longer than the cap
  raises ``FrameTooLarge`` as soon as ``next_event`` sees it, without waiting for
  its newline.
* Each byte is searched for ``\\n`` once: ``_scanned`` remembers how far the last
  search got, so a big line arriving in many small chunks costs O(n), not O(n²).
* Any ``RemoteProtocolError`` (an oversize line, end of file in the middle of a
  line) poisons the codec: every later call raises ``RemoteProtocolError``. The
  caller closes the connection rather than trying to resynchronise.
* Decoding raises only ``RemoteProtocolError`` (and ``FrameTooLarge``); ``encode``
  raises only ``LocalProtocolError``.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Final, Literal, TypeAlias

import orjson

from .errors import FrameTooLarge, LocalProtocolError, ParseError, RemoteProtocolError
from .jsontext import dumps, is_utf8_bytes, loads, loads_large

__all__ = [
    "CLOSED",
    "DEFAULT_MAX_FRAME_SIZE",
    "MAX_DAEMON_LINE",
    "NEED_DATA",
    "BadMessage",
    "Codec",
    "Event",
    "LargeLine",
    "Message",
    "Sentinel",
    "encode",
    "parse_large_line",
    "parse_line",
]

#: The default cap on one line: 16 MiB (contract section 4). The daemon accepts lines
#: this long from a client (``--max-message-bytes``).
DEFAULT_MAX_FRAME_SIZE: Final = 16 * 1024 * 1024
#: The longest line the daemon ever sends, and so the cap its own client reads with: the
#: largest legal result (32 MiB of images as base64, a text of the largest output limit)
#: fits, and a response that would not is replaced by a -32007 error. See docs/protocol.md.
MAX_DAEMON_LINE: Final = 64 * 1024 * 1024

_NEWLINE: Final = b"\n"
_CR: Final = 0x0D
_MSG_NOT_UTF8: Final = "Parse error: line is not valid UTF-8"
_MSG_NOT_JSON: Final = "Parse error: line is not valid JSON"


class Sentinel(enum.Enum):
    """Markers ``next_event`` returns when it has no message to give."""

    NEED_DATA = "NEED_DATA"
    CLOSED = "CLOSED"

    def __repr__(self) -> str:
        return self.value


#: No complete line is buffered: call ``receive_data`` with more bytes.
NEED_DATA: Final = Sentinel.NEED_DATA
#: The peer closed its side and every buffered line has been returned.
CLOSED: Final = Sentinel.CLOSED


# Not frozen: a frozen dataclass's __init__ costs about three times as much, once per
# message on the hot path. Treat instances as immutable.
@dataclass(slots=True)
class Message:
    """One line that parsed as JSON.

    Attributes:
        value: The parsed JSON value (dict, list, str, int, float, bool or None).
    """

    value: Any


@dataclass(slots=True)
class BadMessage:
    """One line that is not valid UTF-8 or not valid JSON; the stream stays usable.

    Attributes:
        message: Our English description; it never contains the peer's bytes.
        code: The JSON-RPC code to answer with (always -32700, parse error).
    """

    message: str
    code: int = ParseError.CODE


class LargeLine:
    """A line longer than the codec's ``large_line``, left for ``parse_large_line``.

    A plain class, not a dataclass like its siblings: building one more dataclass costs
    every daemon start ~0.35 ms, and this one is made only for a line over 64 KiB.

    Attributes:
        line: The line, without its newline (and a ``\\r`` before it).
    """

    __slots__ = ("line",)

    def __init__(self, line: bytes) -> None:
        self.line = line

    def __eq__(self, other: object) -> bool:
        return type(other) is LargeLine and other.line == self.line

    __hash__ = None  # type: ignore[assignment]  # mutable, as the dataclasses beside it

    def __repr__(self) -> str:
        return f"LargeLine(line=<{len(self.line)} bytes>)"


Event: TypeAlias = Message | BadMessage | LargeLine | Literal[Sentinel.NEED_DATA, Sentinel.CLOSED]


def parse_line(
    line: bytes | bytearray, parse: Callable[[bytes | bytearray], Any] = loads
) -> Message | BadMessage | None:
    """Parse one line as ``next_event`` does: None for a blank line (skipped). ``parse``
    is ``jsontext.loads`` (a default argument, not a wrapper: this is every small line's
    path), or ``loads_large`` from ``parse_large_line``."""
    try:
        return Message(parse(line))
    except orjson.JSONDecodeError as exc:
        if line.isspace() or not line:
            return None
        return BadMessage(_describe_bad_line(line, exc))


def parse_large_line(line: bytes | bytearray) -> Message | BadMessage | None:
    """``parse_line`` for a ``LargeLine``, by ``jsontext.loads_large``.

    Args:
        line: The line, without its newline.

    Returns:
        The event ``parse_line`` gives.

    Raises:
        MemoryError: There was no memory to parse it (never a crash).
    """
    return parse_line(line, loads_large)


def encode(value: Any) -> bytes:
    """Serialise one JSON value as a wire line.

    Args:
        value: A JSON-serialisable value (dicts with str keys, lists, str, int of any
            width, float, ``JsonNumber``, bool, None).

    Returns:
        The compact UTF-8 JSON followed by ``\\n``.

    Raises:
        LocalProtocolError: The value cannot be serialised.
    """
    try:
        return dumps(value, orjson.OPT_APPEND_NEWLINE)
    except orjson.JSONEncodeError as exc:
        raise LocalProtocolError(f"cannot encode message as JSON: {exc}") from exc


class Codec:
    """The NDJSON framing state of one connection (both directions).

    Args:
        max_frame_size: The longest accepted line in bytes, not counting its newline.
        large_line: Lines longer than this many bytes are returned unparsed, as
            ``LargeLine`` (None: every line is parsed here).
    """

    __slots__ = ("_buffer", "_eof", "_error", "_large", "_max", "_scanned", "_start")

    def __init__(
        self, max_frame_size: int = DEFAULT_MAX_FRAME_SIZE, large_line: int | None = None
    ) -> None:
        if max_frame_size < 1:
            raise ValueError("max_frame_size must be at least 1")
        self._max = max_frame_size
        self._large = large_line
        self._buffer = bytearray()
        # Offset of the first byte not yet returned as a line.
        self._start = 0
        # Offset up to which the buffer is known to hold no newline.
        self._scanned = 0
        self._eof = False
        self._error: str | None = None

    @property
    def max_frame_size(self) -> int:
        """The longest accepted line in bytes."""
        return self._max

    @property
    def has_partial_data(self) -> bool:
        """Whether bytes of an incomplete line are buffered (the server's idle timer)."""
        return len(self._buffer) > self._start

    @property
    def partial_bytes(self) -> int:
        """How many bytes of an incomplete line are buffered."""
        return len(self._buffer) - self._start

    @property
    def poisoned(self) -> bool:
        """Whether an earlier framing error made the codec unusable."""
        return self._error is not None

    @staticmethod
    def encode(value: Any) -> bytes:
        """Serialise one JSON value as a wire line; see the module-level ``encode``.

        Args:
            value: A JSON-serialisable value.

        Returns:
            The compact UTF-8 JSON followed by ``\\n``.

        Raises:
            LocalProtocolError: The value cannot be serialised.
        """
        return encode(value)

    def receive_data(self, data: bytes) -> None:
        """Buffer bytes received from the peer.

        Args:
            data: The bytes read; ``b""`` means the peer closed its side.

        Raises:
            RemoteProtocolError: The codec is poisoned by an earlier error.
            LocalProtocolError: Non-empty data after end of file (a caller bug).
        """
        if self._error is not None:
            raise RemoteProtocolError(self._error)
        if data:
            if self._eof:
                raise LocalProtocolError("data received after end of file")
            self._buffer += data
        else:
            self._eof = True

    def next_event(self) -> Event:
        """Return the next framing event.

        Returns:
            ``Message``, ``BadMessage``, ``LargeLine`` (see ``large_line``), ``NEED_DATA``
            or ``CLOSED``.

        Raises:
            FrameTooLarge: A line is longer than ``max_frame_size``.
            RemoteProtocolError: End of file in the middle of a line, or the codec is
                poisoned by an earlier error.
        """
        if self._error is not None:
            raise RemoteProtocolError(self._error)
        buffer = self._buffer
        while True:
            start = self._start
            newline = buffer.find(_NEWLINE, self._scanned)
            if newline < 0:
                return self._no_line()
            self._start = self._scanned = newline + 1
            if newline - start > self._max:
                self._poison(f"line of {newline - start} bytes exceeds the limit of {self._max}")
            end = newline - 1 if newline > start and buffer[newline - 1] == _CR else newline
            line = buffer[start:end]
            if self._large is not None and len(line) > self._large:
                return LargeLine(bytes(line))
            event = parse_line(line)
            if event is not None:
                return event

    def _no_line(self) -> Event:
        """Handle a buffer without a complete line: wait, close, or fail."""
        buffer = self._buffer
        pending = len(buffer) - self._start
        if pending > self._max:
            self._poison(f"line of more than {self._max} bytes")
        if self._start:
            # Drop returned lines so the buffer holds only the partial one.
            del buffer[: self._start]
            self._start = 0
        self._scanned = len(buffer)
        if not self._eof:
            return NEED_DATA
        if buffer and not buffer.isspace():
            self._error = "connection closed in the middle of a line"
            raise RemoteProtocolError(self._error)
        buffer.clear()
        self._scanned = 0
        return CLOSED

    def _poison(self, detail: str) -> None:
        """Poison the codec and raise ``FrameTooLarge``."""
        self._buffer = bytearray()
        self._start = self._scanned = 0
        self._error = f"codec unusable after an oversize frame ({detail})"
        raise FrameTooLarge(detail)


def _describe_bad_line(line: bytes | bytearray, exc: orjson.JSONDecodeError) -> str:
    """Say why a line is not a message, without echoing it.

    orjson's own text names the problem and its position (``unexpected character: line
    1 column 9 (char 8)``, ``no low surrogate in string: ...``) and never quotes the
    input, so it is passed on.
    """
    if not is_utf8_bytes(line):
        return _MSG_NOT_UTF8
    detail = str(exc.msg if hasattr(exc, "msg") else exc)
    position = f": line {exc.lineno} column {exc.colno} (char {exc.pos})" if exc.lineno else ""
    return f"{_MSG_NOT_JSON} ({detail}{position})"
