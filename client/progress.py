"""The live progress line of ``toolsetctl invoke``.

It goes to stderr, and only when stderr is a terminal (not ``TERM=dumb``) and ``CI`` is
not set (in ``json`` and ``jsonl`` also not when stdout is that terminal too: the JSON
would be drawn over).
It is one line, redrawn in place (``\\r`` and erase-line), cut to the terminal's width
(80 columns when it reports 0: unknown),
and removed when the call ends. The tool's message is the tool's own text: its control
characters are shown as escapes (``printable``), never written to the terminal as they are.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping

from toolsetd.protocol.printable import inert_line

from .command import to_devnull
from .table import chunks, printable

TYPE_CHECKING = False  # not typing's: importing typing is a share of the start-up
if TYPE_CHECKING:
    from typing import Any, TextIO

__all__ = ["Progress", "progress_stream"]


def progress_stream(
    env: Mapping[str, str], stdout: TextIO, stderr: TextIO, *, json_output: bool
) -> TextIO | None:
    """Where the progress line goes: stderr when it is a terminal, never under CI nor on a
    terminal that cannot move the cursor (``TERM=dumb``).

    Args:
        env: The environment.
        stdout: Where results go.
        stderr: Where the line would go.
        json_output: Whether stdout carries JSON.

    Returns:
        ``stderr``, or None for no progress line.
    """
    if env.get("CI"):
        return None
    if env.get("TERM") == "dumb":  # Emacs' shell: no cursor movement, erase-line is garbage
        return None
    if not _isatty(stderr):
        return None
    if json_output and _isatty(stdout):
        return None  # the JSON lines would be drawn over
    return stderr


def _isatty(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False


def _number(value: Any) -> float | None:
    """A finite JSON number as a float, else None (booleans, strings, huge integers)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    try:
        number = float(value)
    except OverflowError:
        return None
    return number if number - number == 0 else None  # not inf, not nan


def _count(value: Any) -> int:
    number = _number(value)
    return int(number) if number is not None and number > 0 else 0


def _fit(text: str, columns: int) -> str:
    """``text`` cut to what fills ``columns`` cells of a terminal.

    Cut by characters, a line of wide characters (CJK, most emoji: two cells each) ran past
    the width and wrapped; the next redraw's ``\\r`` and erase-line reach only the row the
    cursor is on, so every update left a stale copy of the line above it.
    """
    return text[:columns] if text.isascii() else chunks(text, columns)[0]


class Progress:
    """The live progress line of ``invoke``: one line on a terminal, redrawn in place.

    It shows the tool, the elapsed time and the bytes written, and keeps the tool's last
    message and fraction until the tool sends new ones (periodic ticks carry neither).
    """

    def __init__(self, tool: str, stream: TextIO | None) -> None:
        self._tool = tool
        self._stream = stream
        self._started = time.monotonic()
        self._drawn = False
        self._elapsed_ms = 0.0
        self._bytes = 0
        self._message: str | None = None
        self._fraction: float | None = None

    def line(self) -> str:
        """The line as it reads now."""
        parts = [self._tool, f"{self._elapsed_ms / 1000:.1f}s", f"{self._bytes} bytes"]
        if self._fraction is not None:
            parts.append(f"{self._fraction:.0%}")
        if self._message:
            parts.append(self._message)
        return "  ".join(parts)

    def event(self, method: str, params: dict[str, Any]) -> None:
        """Update the line from one ``started``/``progress``/``completed`` event."""
        if method == "progress":
            # A member of the wrong type is skipped, not fatal: the line is decoration,
            # and an exception here would end the command while the call runs on.
            self._bytes = _count(params.get("stdoutBytes")) + _count(params.get("stderrBytes"))
            elapsed = _number(params.get("elapsedMs"))
            self._elapsed_ms = (
                elapsed if elapsed is not None else (time.monotonic() - self._started) * 1000
            )
            if isinstance(params.get("message"), str):
                self._message = params["message"]
            fraction = _number(params.get("fraction"))
            if fraction is not None:
                self._fraction = min(1.0, max(0.0, fraction))
            self._draw(self.line())
        elif method == "started":
            self._draw(f"{self._tool}  started (pid {params.get('pid')})")

    def _draw(self, text: str) -> None:
        if self._stream is None:
            return
        try:
            # 0: a pty whose size was never set (``script``, ``docker exec -t``): unknown
            columns = os.get_terminal_size(self._stream.fileno()).columns or 80
        except (AttributeError, ValueError, OSError):
            columns = 80
        self._write("\r\x1b[2K" + _fit(inert_line(printable(text)), max(columns - 1, 10)))
        self._drawn = True

    def stop(self) -> None:
        """Remove the line."""
        if self._stream is not None and self._drawn:
            self._write("\r\x1b[2K")
            self._drawn = False

    def _write(self, text: str) -> None:
        """Write to the terminal; one that is gone (hung up: EIO) ends the line, not the
        command, which still has a call to cancel or a result to give."""
        assert self._stream is not None
        try:
            self._stream.write(text)
            self._stream.flush()
        except OSError:
            to_devnull(self._stream)  # what it still buffers would fail again at exit
            self._stream = None
