"""Logging: structlog, one JSON object per line on stderr by default.

Events are snake_case past-tense names with key-value pairs. The argument JSON of a call,
environments and outputs are never logged (they may hold secrets): only their sizes.
``conn_id`` is bound once per connection through structlog's contextvars (see
``server.py``); ``method`` and ``request_id`` are set for each handler's run in one
variable of our own, ``REQUEST`` (see ``dispatch.py``), which ``merge_request`` adds
to every event: one ``ContextVar.set`` and ``reset`` a request, against 1.7 µs for
binding and resetting the two through structlog.

When stderr is the journal (systemd sets ``JOURNAL_STREAM`` to the device and inode of
the stream it connected, and they match file descriptor 2), every line starts with its
sd-daemon priority (``<3>`` error, ``<4>`` warning, ``<6>`` info, ``<7>`` debug), which
journald strips and stores as the entry's priority, so ``journalctl -p warning``
filters. The rest of the line is unchanged.

Events a peer can cause at will (a refused connection, a refused request) go through a
``Throttle``: one line per key and interval, carrying the count since the last.

A log line never makes the daemon wait for its reader. When stderr is a pipe or a socket
(journald's stream, a supervisor, ``toolsetd 2>&1 | less``), lines are written without
blocking (``LineWriter``), whole lines at a time: while the reader is stalled they are
held, up to ``HELD_LOG_BYTES``, and written once it reads again (before the next line, or
by ``drain_logs``, which the daemon runs a few times a second, or by ``finish_logging`` on
the way out, which waits up to 2 s); past that they are dropped and counted, and
``log_lines_dropped`` says how many, in their place. The standard library's records
(warning and up) take the same writer. Before, a reader that stopped reading
froze every client once 64 KiB of log had piled up in the pipe. A terminal or a file is
written as before, waiting.

What the interpreter itself prints on stderr (an exception that ends a thread, an
"Exception ignored in" of a ``__del__`` or a finalizer, a ``warnings.warn``) is taken into
the log too, by ``log_interpreter_reports``: as ``thread_crashed``, ``exception_ignored``
and ``warning_issued`` events, one line each, instead of bare multi-line text.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import select
import socket
import stat
import sys
import threading
import time
import uuid
import warnings
from collections.abc import Callable, Mapping, MutableMapping
from contextvars import ContextVar
from datetime import UTC, datetime
from functools import partial
from typing import Any, Literal

import structlog
from toolsetd.protocol.printable import inert_json, inert_line, printable

__all__ = [
    "HELD_LOG_BYTES",
    "MAX_LOGGED_ID",
    "PRIORITIES",
    "REQUEST",
    "LineLogger",
    "LineWriter",
    "Throttle",
    "configure_logging",
    "drain_logs",
    "finish_logging",
    "holding",
    "log_incident",
    "log_interpreter_reports",
    "merge_request",
    "say",
    "stderr_is_journal",
]

LogFormat = Literal["json", "console"]

#: sd-daemon(3) priority prefixes by log level.
PRIORITIES: Mapping[str, str] = {
    "debug": "<7>",
    "info": "<6>",
    "warning": "<4>",
    "error": "<3>",
    "critical": "<2>",
    "exception": "<3>",
}


#: The longest string request id logged whole; a longer one is cut, its length said.
MAX_LOGGED_ID = 128

#: The JSON-RPC request a handler serves, as (method, request id); None outside one.
REQUEST: ContextVar[tuple[str, Any] | None] = ContextVar("toolsetd_request", default=None)


def merge_request(
    _logger: Any, _method: str, event_dict: MutableMapping[str, Any]
) -> MutableMapping[str, Any]:
    """Add ``request_id`` and ``method`` of the request being served (a processor).

    Like structlog's ``merge_contextvars``, a key the event already has is kept.
    """
    request = REQUEST.get()
    if request is not None:
        request_id = request[1]
        if type(request_id) is str and len(request_id) > MAX_LOGGED_ID:
            # The client picks it, up to the line limit (16 MiB): a line per event that
            # long would flood the log and journald would cut it into dozens of entries.
            request_id = f"{request_id[:MAX_LOGGED_ID]}... ({len(request_id)} characters)"
        event_dict.setdefault("request_id", request_id)
        event_dict.setdefault("method", request[0])
    return event_dict


class Throttle:
    """At most one log line per key and interval, the next one counting what it stood for.

    For events a peer can cause at will (a refused connection): each is counted, and a
    line is due for the first of a key and then for the first after ``interval`` seconds,
    carrying how many happened since the last line (itself included).

    Args:
        interval: Seconds between two lines of one key.
        clock: Where the time comes from (seconds, monotonic).
    """

    def __init__(self, interval: float = 60.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.interval = interval
        self._clock = clock
        self._keys: dict[Any, tuple[float, int]] = {}

    def count(self, key: Any) -> int | None:
        """Count one event of ``key``; returns the count to log now, or None to stay quiet."""
        now = self._clock()
        said, since = self._keys.get(key, (None, 0))
        if said is not None and now - said < self.interval:
            self._keys[key] = (said, since + 1)
            return None
        self._keys[key] = (now, 0)
        return since + 1

    def reset(self) -> None:
        """Start afresh: the next event of every key is logged (a run of failures ended)."""
        self._keys.clear()


def stderr_is_journal(environ: Mapping[str, str] | None = None, fd: int = 2) -> bool:
    """Whether ``fd`` is the journal stream systemd announced in ``JOURNAL_STREAM``."""
    value = (os.environ if environ is None else environ).get("JOURNAL_STREAM", "")
    device, sep, inode = value.partition(":")
    # ASCII digits: str.isdigit() also says yes to "²", which int() refuses.
    if not sep or not (device + inode).isascii() or not device.isdigit() or not inode.isdigit():
        return False
    try:
        st = os.fstat(fd)
    except OSError:
        return False
    return st.st_dev == int(device) and st.st_ino == int(inode)


#: Log bytes held while stderr's reader is stalled; lines beyond are dropped and counted.
HELD_LOG_BYTES = 256 * 1024


class _WriterLock:
    """A lock that knows whether the calling thread is in it (``mine``), from before it
    waits for it to after it has let it go.

    A collection may run while a thread holds the ``LineWriter``'s lock (anything that
    allocates can start one: the ``BlockingIOError`` of a stalled reader), and a finalizer
    it runs may log (an "Exception ignored in" through ``log_interpreter_reports``,
    asyncio's "Task was destroyed"). That line waited for the lock its own thread held:
    the daemon hung at the line for good. ``LineWriter`` holds such a line instead.
    """

    __slots__ = ("_lock", "_mine")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._mine = threading.local()

    def mine(self) -> bool:
        return getattr(self._mine, "inside", False)

    def acquire(self, timeout: float = -1) -> bool:
        self._mine.inside = True
        if self._lock.acquire(timeout=timeout):
            return True
        self._mine.inside = False
        return False

    def release(self) -> None:
        self._lock.release()
        self._mine.inside = False

    def __enter__(self) -> None:
        self.acquire()

    def __exit__(self, *_exc: object) -> None:
        self.release()


class LineWriter:
    """Log lines for a stderr that is a pipe or a socket, never waiting for its reader.

    Each line goes out in non-blocking writes of whole lines, at most ``PIPE_BUF`` bytes at
    a time (a pipe takes such a write whole or not at all, so no other writer of the pipe,
    our own ``sys.stderr`` or a process sharing it, lands inside one of our lines). What the
    reader cannot take now is held and written before the next line, and by ``drain`` (the
    daemon calls it a few times a second, so a quiet daemon's last lines do not wait for the
    next one); past ``limit`` bytes held, whole lines are dropped and counted, and the next
    line kept is preceded by ``notice(count)``, where the gap is (``drain`` writes it
    once the held lines are out, if no line comes). ``finish`` writes what is
    held on the way out, waiting for the reader a bounded time. One lock guards it all:
    structlog's loggers (``LineLogger``) and ``drain`` may run on any thread. A line that
    the thread holding it logs (a finalizer's, ``_WriterLock``) is held after the rest,
    for the holder's writes, never dropped.

    Args:
        send: Writes bytes without blocking; returns how many went out, raises
            ``BlockingIOError`` when none can.
        notice: The rendered line (without newline) that says how many were dropped.
        limit: The most bytes held.
        fileno: The descriptor ``send`` writes to, for ``finish`` to wait on.
    """

    def __init__(
        self,
        send: Callable[[bytes | bytearray], int],
        notice: Callable[[int], str],
        limit: int = HELD_LOG_BYTES,
        fileno: int | None = None,
    ) -> None:
        self._send = send
        self._notice = notice
        self._limit = limit
        self._fileno = fileno
        self._lock = _WriterLock()
        # A bytearray: lines are appended and written-out bytes removed in place, not the
        # whole buffer copied per line (8 times a line's cost while a slow reader reads).
        self._held = bytearray()
        self.dropped = 0

    def line(self, text: str) -> None:
        """Write one line (``text`` without its newline), or hold or drop it."""
        data = (text + "\n").encode("utf-8", "backslashreplace")
        if self._held_for_the_holder(data):
            return
        with self._lock:
            if self._held:
                self._drain()
                if len(self._held) + len(data) > self._limit:  # the reader is still stalled
                    self.dropped += 1
                    return
            self._keep(data)

    def last(self, text: str) -> None:
        """Hold ``text`` (without its newline) for ``finish`` past the limit, never dropped:
        the operator's message on the way out (a start-up error, a traceback)."""
        data = (text + "\n").encode("utf-8", "backslashreplace")
        if self._held_for_the_holder(data):
            return
        with self._lock:
            self._keep(data)

    def _held_for_the_holder(self, data: bytes) -> bool:
        """Hold ``data`` if this thread is in the lock (a finalizer's line, ``_WriterLock``):
        after what is held, which the holder's drain writes to the end (or the next one)."""
        if not self._lock.mine():
            return False
        self._held += data
        return True

    def _keep(self, data: bytes) -> None:
        """Hold ``data`` and write what the reader takes; the drop count goes first, where
        the gap is. Called with the lock held."""
        if self.dropped:
            data = self._dropped_line() + data
        self._held += data
        self._drain()

    @property
    def holding(self) -> bool:
        """Whether lines (or a drop count) wait for the reader (a read without the lock: a
        hint)."""
        return bool(self._held) or self.dropped > 0

    def drain(self) -> None:
        """Write what the reader can take now of what is held; once it has taken it all,
        the count of the lines dropped meanwhile (a quiet daemon logs no next line)."""
        with self._lock:
            self._drain()
            if not self._held and self.dropped:
                self._held += self._dropped_line()
                self._drain()

    def finish(self, timeout: float) -> bool:
        """Write what is held (and a pending drop count), waiting up to ``timeout`` seconds.

        For the way out: a reader that is slow but reading gets the last lines (the stop,
        the reason for an exit) instead of losing them with the process. Returns whether
        nothing is left held.
        """
        deadline = time.monotonic() + timeout
        if not self._lock.acquire(timeout=timeout):
            return False
        try:
            if self.dropped:
                self._held += self._dropped_line()
            self._drain()
            while self._held and self._fileno is not None:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                poller = select.poll()
                poller.register(self._fileno, select.POLLOUT)
                if not poller.poll(left * 1000):
                    break
                self._drain()
            return not self._held
        finally:
            self._lock.release()

    def _dropped_line(self) -> bytes:
        text = self._notice(self.dropped) + "\n"
        self.dropped = 0
        return text.encode("utf-8", "backslashreplace")

    def _drain(self) -> None:
        held = self._held
        done = 0
        while done < len(held):
            # Whole lines, PIPE_BUF bytes at most when they fit (see the class doc); a
            # longer line goes out as the reader takes it.
            end = held.rfind(b"\n", done, done + select.PIPE_BUF) + 1
            if end <= done:
                end = held.find(b"\n", done) + 1 or len(held)
            try:
                sent = self._send(held[done:end])
            except BlockingIOError:
                break
            except InterruptedError:
                continue
            except OSError:  # the reader is gone: nothing to hold for
                done = len(held)
                break
            done += sent
        if done:
            del held[:done]


class LineLogger:
    """A structlog logger that hands each rendered line, whole, to ``line`` (a
    ``LineWriter``'s, or ``_print_line`` for a file or a terminal)."""

    __slots__ = ("_line",)

    def __init__(self, line: Callable[[str], object]) -> None:
        self._line = line

    def msg(self, message: str) -> None:
        self._line(message)

    log = debug = info = warn = warning = err = error = critical = exception = msg
    fatal = failure = msg


#: The writer of the daemon's log lines when stderr is a pipe or a socket, else None.
_WRITER: LineWriter | None = None


def holding() -> bool:
    """Whether log lines wait for stderr's reader."""
    return _WRITER is not None and _WRITER.holding


def drain_logs() -> None:
    """Write what stderr's reader can take now of the lines held for it (cheap when none)."""
    writer = _WRITER
    if writer is not None and writer.holding:
        writer.drain()


def finish_logging(timeout: float = 2.0) -> bool:
    """On the way out: write the lines still held for a slow stderr reader, waiting at most
    ``timeout`` seconds (a reader that stopped reading costs the exit no more than that).

    Returns whether nothing is left held (True when stderr is not a pipe or a socket).
    """
    return _WRITER.finish(timeout) if _WRITER is not None else True


def log_incident(logger: Any, event: str, **fields: Any) -> str:
    """Log the exception being handled, traceback and all, under a fresh incident id.

    The one shape of an unexpected failure, whatever face met it: the ``reload`` RPC's (and
    every method's, ``dispatch``) and SIGHUP's reload, which has no caller to answer.

    Args:
        logger: The structlog logger to log on.
        event: The event's name.
        fields: More key-value pairs for the line (``exc_info``: an exception other than
            the one being handled, as a (type, value, traceback) tuple).

    Returns:
        The incident id (12 hex digits), for the caller's answer.
    """
    incident = uuid.uuid4().hex[:12]
    logger.exception(event, incident=incident, **fields)
    return incident


#: Set on a thread while it runs one of the hooks of ``log_interpreter_reports``.
_REPORTING = threading.local()

#: The most characters of an object's ``repr`` an ``exception_ignored`` line quotes.
_MAX_OBJECT_REPR = 200


def log_interpreter_reports(logger: Any) -> None:
    """Log, on ``logger``, what the interpreter would print on stderr itself.

    Each of these was multi-line text on stderr, outside the log: no JSON object in a JSON
    log (journald, a log shipper), and a traceback or warning quoting a hostile set folder's
    ``::add-mask::`` or ``##vso[`` reached a CI job's log as a command. Now each is one
    event, rendered (and made inert) as every other:

    * ``threading.excepthook``: an exception that ends a thread, ``thread_crashed`` with
      an incident id (``log_incident``) and the traceback; ``SystemExit`` ends a thread
      quietly, as before;
    * ``sys.unraisablehook``: an exception Python cannot raise anywhere (a ``__del__``, a
      generator's finalizer, a weak reference's callback, a thread of ``_thread``),
      ``exception_ignored`` with an incident id, the object's ``repr`` (cut) and the
      traceback;
    * ``warnings.showwarning``: a warning the filters let through (a library's
      ``FutureWarning``, a ``ResourceWarning`` under ``-X dev``), ``warning_issued``
      with its category, message and where it was issued (the source line is not read).

    For the process's own start (``app.main``), never a program embedding the daemon, whose
    hooks are its own. A hook never raises and never recurses: a report made while one is
    being logged on the same thread (a warning that logging itself issued) is dropped, and
    so is one whose logging failed.
    """
    threading.excepthook = partial(_thread_crashed, logger)
    sys.unraisablehook = partial(_exception_ignored, logger)
    warnings.showwarning = partial(_warning_issued, logger)


def _reporting(report: Callable[[], object]) -> None:
    """Run ``report`` unless this thread is inside a report already; never raise."""
    if getattr(_REPORTING, "active", False):
        return
    _REPORTING.active = True
    try:
        report()
    except Exception:  # noqa: S110 -- nowhere left to say it: stderr is what this avoids
        pass
    finally:
        _REPORTING.active = False


def _thread_crashed(logger: Any, args: threading.ExceptHookArgs) -> None:
    if args.exc_type is SystemExit:  # as threading's own hook: a thread's quiet end
        return
    thread = args.thread.name if args.thread is not None else None
    exc_info = (args.exc_type, args.exc_value, args.exc_traceback)
    _reporting(lambda: log_incident(logger, "thread_crashed", thread=thread, exc_info=exc_info))


def _exception_ignored(logger: Any, unraisable: Any) -> None:
    def report() -> None:
        shown: str | None = None
        if unraisable.object is not None:
            try:
                shown = repr(unraisable.object)
            except Exception:
                shown = f"<{type(unraisable.object).__name__} object: repr() failed>"
            if len(shown) > _MAX_OBJECT_REPR:
                shown = f"{shown[:_MAX_OBJECT_REPR]}... ({len(shown)} characters)"
        fields: dict[str, Any] = {
            "message": unraisable.err_msg or "Exception ignored in",
            "object": shown,
        }
        if unraisable.exc_type is not None:
            fields["exc_info"] = (
                unraisable.exc_type,
                unraisable.exc_value,
                unraisable.exc_traceback,
            )
        log_incident(logger, "exception_ignored", **fields)

    _reporting(report)


def _warning_issued(
    logger: Any,
    message: Warning | str,
    category: type[Warning],
    filename: str,
    lineno: int,
    file: Any = None,
    line: str | None = None,
) -> None:
    _reporting(
        lambda: logger.warning(
            "warning_issued",
            category=category.__name__,
            message=str(message),
            where=f"{filename}:{lineno}",
        )
    )


def _inert_lines(text: str) -> str:
    """``text`` with its lines kept, each shown by a terminal and a CI runner, not obeyed
    (``printable``, then ``inert_line``)."""
    return "\n".join(inert_line(printable(line)) for line in text.split("\n"))


def say(text: str) -> None:
    """Write a plain message for the operator on stderr on the way out (a start-up error,
    a traceback): through the log writer when stderr is a pipe or a socket, so a reader that
    stopped reading cannot hold the exit (``finish_logging`` bounds the wait); else printed.

    On the journal each line starts ``<3>``: unprefixed, journald filed it at the stream's
    default priority (info), and ``journalctl -p warning`` left out why the daemon stopped.

    Each line is shown, not obeyed (``_inert_lines``, as the console log's): the message
    quotes paths, keys and values from flags, the environment, a config file or a checkout
    (a socket folder named with an ESC sequence, a key named ``##vso[task.setvariable
    ...]``), which reached a terminal or a CI job's log raw. Nothing parses these lines.
    """
    text = _inert_lines(text)
    if stderr_is_journal():
        text = _with_priority(PRIORITIES["error"], text)
    writer = _WRITER
    if writer is None:
        _print_line(text)  # the operator's message; lost, not raised, if it cannot be written
    else:
        writer.last(text)


#: ``_nonblocking_sender``'s writers by the (device, inode) they write to: configuring the
#: logs again (a benchmark does) opens no second descriptor.
_SENDERS: dict[tuple[int, int], Callable[[bytes | bytearray], int] | None] = {}


def _nonblocking_sender(fd: int) -> Callable[[bytes | bytearray], int] | None:
    """A non-blocking writer to ``fd`` when it is a pipe or a socket, else None.

    A pipe is opened again through ``/proc`` (a file description of our own, so its
    ``O_NONBLOCK`` reaches no other process holding the pipe); a socket is sent to with
    ``MSG_DONTWAIT``, which changes no flag at all.
    """
    try:
        st = os.fstat(fd)
    except OSError:
        return None
    key = (st.st_dev, st.st_ino)
    if key not in _SENDERS:
        _SENDERS[key] = _open_sender(fd, st.st_mode)
    return _SENDERS[key]


def _open_sender(fd: int, mode: int) -> Callable[[bytes | bytearray], int] | None:
    if stat.S_ISFIFO(mode):
        try:
            own = os.open(f"/proc/self/fd/{fd}", os.O_WRONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError:
            return None
        return lambda data: os.write(own, data)
    if stat.S_ISSOCK(mode):
        try:
            sock = socket.socket(fileno=os.dup(fd))
        except OSError:
            return None
        flags = socket.MSG_DONTWAIT | socket.MSG_NOSIGNAL
        return lambda data: sock.send(data, flags)
    return None


def _prefix_priority(_logger: Any, method: str, line: Any) -> str:
    """Put the sd-daemon priority in front of the rendered line (the last processor)."""
    text = line.decode() if isinstance(line, bytes) else line
    return _with_priority(PRIORITIES.get(method, "<6>"), text)


def _with_priority(prefix: str, text: str) -> str:
    """``prefix`` in front of every line of ``text``: journald files each line as an entry
    of its own, and a console traceback's lines after the first were filed as info."""
    if "\n" not in text:
        return prefix + text
    return "\n".join(prefix + line for line in text.split("\n"))


def _inert_dumps(value: Any, **options: Any) -> str:
    """A JSON log line no CI runner takes for a command to itself: the log of a daemon a
    job started is printed into the job's log (docs/cli.md's script does on a failure),
    and its notes quote a checkout's set names and schemas (``##vso[``, ``##[``)."""
    return inert_json(json.dumps(value, **options))


def _printable_values(
    _logger: Any, _method: str, event: MutableMapping[str, Any]
) -> MutableMapping[str, Any]:
    """Console form: every string value shown, not obeyed, by the terminal reading the log
    (nor, ``inert_line``, by a CI runner reading the job's log).

    The ``exception`` traceback keeps its lines (its other controls are escaped).
    """
    for key, value in event.items():
        if isinstance(value, str):
            if key == "exception":
                event[key] = _inert_lines(value)
            else:
                event[key] = inert_line(printable(value))
    return event


def configure_logging(
    fmt: LogFormat | str = "json", level: str = "info", *, journal: bool | None = None
) -> None:
    """Configure structlog for the daemon process.

    Args:
        fmt: ``json`` (one object per line) or ``console`` (for people at a terminal).
        level: A standard level name (debug, info, warning, error).
        journal: Prefix each line with its priority; None decides by ``JOURNAL_STREAM``.

    Raises:
        ValueError: The level name is unknown.
    """
    numeric = logging.getLevelName(level.upper())
    if not isinstance(numeric, int):
        raise ValueError(f"unknown log level {level!r}: use debug, info, warning or error")
    if journal is None:
        journal = stderr_is_journal()
    renderer: structlog.typing.Processor = (
        structlog.processors.JSONRenderer(serializer=_inert_dumps)
        if fmt == "json"
        else structlog.dev.ConsoleRenderer(
            colors=sys.stderr.isatty() and not journal,
            exception_formatter=structlog.dev.plain_traceback,
        )
    )
    processors: list[structlog.typing.Processor] = [
        structlog.contextvars.merge_contextvars,
        merge_request,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
        structlog.processors.format_exc_info,
        renderer,
    ]
    if fmt != "json":
        # JSON escapes control characters itself; the console form printed a client's
        # request id, workspace path or tool name as it came, ESC sequences included.
        processors.insert(-1, _printable_values)
    if journal:
        processors.append(_prefix_priority)
    global _WRITER

    def factory(*_args: Any) -> LineLogger:
        return LineLogger(_print_line)

    _WRITER = None
    send = _nonblocking_sender(sys.stderr.fileno()) if _has_fileno(sys.stderr) else None
    for handler in [h for h in logging.root.handlers if isinstance(h, _StdlibLines)]:
        logging.root.removeHandler(handler)  # configured again: not twice

    def render(level: str, event: dict[str, Any]) -> str:
        # As TimeStamper(fmt="iso", utc=True) writes the time.
        stamp = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
        fields = {**event, "level": level, "timestamp": stamp}
        if fmt != "json":
            _printable_values(None, level, fields)
        text = renderer(None, level, fields)
        return _with_priority(PRIORITIES.get(level, "<6>"), str(text)) if journal else str(text)

    if send is not None:

        def notice(dropped: int) -> str:
            return render("warning", {"event": "log_lines_dropped", "dropped": dropped})

        writer = _WRITER = LineWriter(send, notice, fileno=sys.stderr.fileno())

        def factory(*_args: Any) -> LineLogger:
            return LineLogger(writer.line)

        # The standard library's loggers (asyncio's "Exception in callback", OpenTelemetry's
        # exporter) would otherwise reach stderr through logging's last-resort handler, a
        # blocking write: the same writer takes them, rendered as our lines.
        logging.root.addHandler(_StdlibLines(writer.line, render, numeric))
    else:
        # A file or a terminal, written to waiting as our own lines are; through the
        # last-resort handler they were bare text, no JSON object in a JSON log.
        logging.root.addHandler(_StdlibLines(_print_line, render, numeric))

    structlog.configure(
        processors=processors,
        wrapper_class=structlog.make_filtering_bound_logger(numeric),
        logger_factory=factory,
        cache_logger_on_first_use=True,
    )


class _StdlibLines(logging.Handler):
    """The standard library's log records (warning and up, and none below the daemon's
    ``--log-level``), rendered as our lines and handed to ``write`` (a ``LineWriter``'s
    ``line``, or ``_print_line``)."""

    def __init__(
        self,
        write: Callable[[str], object],
        render: Callable[[str, dict[str, Any]], str],
        level: int = logging.WARNING,
    ) -> None:
        super().__init__(max(logging.WARNING, level))
        self._write = write
        self._render = render

    def emit(self, record: logging.LogRecord) -> None:
        try:
            event: dict[str, Any] = {"event": record.getMessage(), "logger": record.name}
            if record.exc_info:
                event["exception"] = logging.Formatter().formatException(record.exc_info)
            level = record.levelname.lower()
            self._write(self._render(level if level in PRIORITIES else "error", event))
        except Exception:  # logging's own rule: a handler never raises
            self.handleError(record)


#: One line at a time on a stderr that is a file or a terminal (any thread may log).
#: Reentrant: a finalizer that a collection runs while a line is written may log, and that
#: line waited for its own thread (see ``_WriterLock``). It is written there, whole: before
#: the line, or inside it only where a terminal took part of a write.
_PRINT_LOCK = threading.RLock()


def _print_line(text: str) -> None:
    """Write one line on stderr as it is now (a file or a terminal: waiting is fine).

    A line that cannot be written is lost: a log file on a full disk (ENOSPC), a terminal
    closed since the start (EIO). structlog's ``PrintLogger`` raised that OSError out of
    whatever logged, and the daemon exited at its next line (a call, a reload, the stop).
    The line goes to the descriptor itself, in UTF-8 as a pipe's lines do: ``sys.stderr``
    keeps what it could not write, and its flush at exit then failed again (exit 120).
    """
    data = (text + "\n").encode("utf-8", "backslashreplace")
    with _PRINT_LOCK:
        try:
            fd = sys.stderr.fileno()
        except (AttributeError, OSError, ValueError):  # pytest's capture: not a descriptor
            with contextlib.suppress(OSError):
                sys.stderr.write(text + "\n")
                sys.stderr.flush()
            return
        view = memoryview(data)
        try:
            while view:
                view = view[os.write(fd, view) :]
        except OSError:
            pass


def _has_fileno(stream: Any) -> bool:
    try:
        stream.fileno()
    except (AttributeError, OSError, ValueError):  # pytest's capture, a closed stderr
        return False
    return True
