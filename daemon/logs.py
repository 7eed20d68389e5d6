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
"""

from __future__ import annotations

import logging
import os
import sys
import time
from collections.abc import Callable, Mapping, MutableMapping
from contextvars import ContextVar
from typing import Any, Literal

import structlog

__all__ = [
    "MAX_LOGGED_ID",
    "PRIORITIES",
    "REQUEST",
    "Throttle",
    "configure_logging",
    "merge_request",
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


def stderr_is_journal(environ: Mapping[str, str] | None = None, fd: int = 2) -> bool:
    """Whether ``fd`` is the journal stream systemd announced in ``JOURNAL_STREAM``."""
    value = (os.environ if environ is None else environ).get("JOURNAL_STREAM", "")
    device, sep, inode = value.partition(":")
    if not sep or not device.isdigit() or not inode.isdigit():
        return False
    try:
        st = os.fstat(fd)
    except OSError:
        return False
    return st.st_dev == int(device) and st.st_ino == int(inode)


def _prefix_priority(_logger: Any, method: str, line: Any) -> str:
    """Put the sd-daemon priority in front of the rendered line (the last processor)."""
    text = line.decode() if isinstance(line, bytes) else line
    return PRIORITIES.get(method, "<6>") + text


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
        structlog.processors.JSONRenderer()
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
    if journal:
        processors.append(_prefix_priority)
    structlog.configure(
        processors=processors,
        wrapper_class=structlog.make_filtering_bound_logger(numeric),
        logger_factory=structlog.PrintLoggerFactory(sys.stderr),
        cache_logger_on_first_use=True,
    )
