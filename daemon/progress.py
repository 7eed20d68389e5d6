"""A call's progress fd: lines the child writes, parsed and rate-limited into events.

Theory of operation
-------------------
The child writes lines to the fd named in ``TOOLSETD_PROGRESS_FD``: a JSON object with
``message`` and/or ``fraction`` (clamped to 0..1), or any other line as a message. Lines are
bounded to 16 KiB (the rest of a longer line is skipped) and messages to 1,000 characters.
The line bound holds a JSON object whose message has those 1,000 characters each written
as an escape (``json.dumps`` escapes every non-ASCII one: 6 bytes, 12 past U+FFFF): a line
cut short is no JSON, and would reach the client as raw text without its fraction.
At most one event per ``gap`` seconds is sent: a burst is coalesced to its latest line,
which goes out when the gap has passed, and the last line is always sent at EOF (also when
the child ended it without a newline: EOF ends a line too). Each read is looked at from its
last line back, so a flood of short lines costs one parse per read, not one per line (a
child writing them at full speed held the event loop, and every client, for most of the
flood). A call with ``CallRequest.every_progress_line`` (MCP) gets every line, none
coalesced.

The reader ends at EOF, or when told to ``Finish``: the call is over (its leader exited
and its group was killed, or it timed out or was cancelled), but a process that left the
group may hold the pipe for ever. It then stops waiting for more: it reads what the pipe
holds (at most ``_FINISH_MAX`` bytes, as a writer may refill it as fast as it is read),
reports those lines too, and ends. It is not cancelled while it reports, but by the
call's time limit, or 0.5 s after a cancel (the runner's): the lines a child wrote before
it exited reach the client even when the client takes them slowly (an MCP host, for which
the face waits after each line).
"""

from __future__ import annotations

import math
import os
import time

import anyio
import anyio.lowlevel
import orjson
from toolsetd.protocol.jsontext import loads as json_loads

from .call import CallState

__all__ = ["Finish", "parse_progress", "read_progress"]

_PROGRESS_LINE_MAX = 16 * 1024
#: The most bytes a reader told to finish reads on (a progress pipe holds at most 1 MiB).
_FINISH_MAX = 1 << 20
_PROGRESS_MESSAGE_MAX = 1000
#: A line's report: its message and its fraction (either may be absent).
_Report = tuple[str | None, float | None]


def parse_progress(line: bytes) -> _Report | None:
    text = line.decode("utf-8", "replace").strip()
    if not text:
        return None
    if text.startswith("{"):
        try:
            value = json_loads(text)
        except (orjson.JSONDecodeError, MemoryError):
            value = None
        if isinstance(value, dict):
            raw_message = value.get("message")
            raw_fraction = value.get("fraction")
            message = raw_message[:_PROGRESS_MESSAGE_MAX] if isinstance(raw_message, str) else None
            fraction = None
            if (
                isinstance(raw_fraction, int | float)
                and not isinstance(raw_fraction, bool)
                and raw_fraction == raw_fraction  # not NaN
            ):
                # Compared before it is made a float: an integer past the double range
                # (400 digits) raised OverflowError in float() and failed the call as an
                # incident, and 1e999 (infinity, kept as a ``JsonNumber``) was dropped.
                # Both are numbers, clamped like 2 or -1.
                if raw_fraction >= 1:
                    fraction = 1.0
                elif raw_fraction <= 0:
                    fraction = 0.0
                else:
                    fraction = float(raw_fraction)
            if message is None and fraction is None:
                return None
            return message, fraction
    return text[:_PROGRESS_MESSAGE_MAX], None


class Finish:
    """Tells a progress reader to stop waiting for more lines (see the module docstring).

    Calling it ends the reader's wait for the pipe; the reader then reports what the pipe
    holds and ends (its ``done`` is set).
    """

    __slots__ = ("asked", "scope")

    def __init__(self) -> None:
        self.asked = False
        #: The scope of the reader's wait for the pipe, while it waits.
        self.scope: anyio.CancelScope | None = None

    def __call__(self) -> None:
        self.asked = True
        if self.scope is not None:
            self.scope.cancel()


async def read_progress(
    fd: int,
    call: CallState,
    done: anyio.Event,
    gap: float,
    first: bytes | None = None,
    finish: Finish | None = None,
) -> None:
    """Read progress lines until EOF (or ``finish``), reporting them through ``call``; then
    set ``done``."""
    try:
        await _read_progress_lines(fd, call, gap, first, finish or Finish())
    finally:
        done.set()


async def _read_progress_lines(
    fd: int, call: CallState, gap: float, first: bytes | None, finish: Finish
) -> None:
    line = bytearray()  # the first 16 KiB of the line not yet ended
    pending: _Report | None = None
    last = -math.inf
    finishing = 0  # bytes read since ``finish`` was asked
    while True:
        if finish.asked and finishing > _FINISH_MAX:
            break  # a writer that left the group refills the pipe as fast as it is read
        try:
            if first:  # bytes read before this task started
                chunk, first = first, None
            else:
                chunk = os.read(fd, 65536)
        except BlockingIOError:
            if finish.asked:
                break  # the pipe is empty and the call over: no more lines will count
            with anyio.CancelScope() as finish.scope:  # ``finish`` ends this wait
                if pending is None:
                    await anyio.wait_readable(fd)
                    continue
                wait = last + gap - time.monotonic()
                if wait > 0:
                    with anyio.move_on_after(wait):
                        await anyio.wait_readable(fd)
                    continue
            finish.scope = None
            if finish.asked or pending is None:
                continue  # asked to finish: read what the pipe holds first
            last = time.monotonic()
            await call.progress(*pending)
            pending = None
            continue
        except OSError:
            break  # the pipe failed: what was read so far is still the tool's
        if not chunk:
            break
        if finish.asked:
            finishing += len(chunk)
        await anyio.lowlevel.checkpoint()  # a chatty child must not monopolise the loop
        start = 0
        if call.every_progress_line:
            while (nl := chunk.find(b"\n", start)) >= 0:
                parsed = parse_progress(_ended(line, chunk, start, nl))
                line.clear()
                if parsed is not None:
                    await call.progress(*parsed)  # no coalescing: every line counts
                start = nl + 1
        elif (nl := chunk.rfind(b"\n")) >= 0:
            # Coalesced: only the latest line that makes a report counts (module docstring).
            parsed = _latest_report(line, chunk, nl)
            line.clear()
            if parsed is not None:
                pending = parsed
            start = nl + 1
        line += chunk[start : start + _PROGRESS_LINE_MAX - len(line)]  # the rest is skipped
        if pending is not None and time.monotonic() - last >= gap:
            last = time.monotonic()
            await call.progress(*pending)
            pending = None
    if line and (parsed := parse_progress(bytes(line))) is not None:
        pending = parsed  # a last line without its newline; sent at once, coalesced or not
    if pending is not None:
        await call.progress(*pending)


def _ended(head: bytearray, chunk: bytes, start: int, end: int) -> bytes:
    """The first 16 KiB of the line ``head + chunk[start:end]`` (``head`` holds at most 16 KiB
    of its beginning, carried over from earlier reads)."""
    return bytes(head) + chunk[start : min(end, start + _PROGRESS_LINE_MAX - len(head))]


def _latest_report(head: bytearray, chunk: bytes, end: int) -> _Report | None:
    """The report of the latest line ending at or before ``chunk[end]`` that makes one.

    The lines end at the newlines of ``chunk[: end + 1]``; the first of them begins with
    ``head``. None when none of them is a report (blank lines, objects without members).
    """
    while True:
        start = chunk.rfind(b"\n", 0, end) + 1
        if start == 0:
            return parse_progress(_ended(head, chunk, 0, end))
        parsed = parse_progress(chunk[start : min(end, start + _PROGRESS_LINE_MAX)])
        if parsed is not None:
            return parsed
        end = start - 1
