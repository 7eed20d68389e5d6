"""Logging: structlog, one JSON object per line on stderr by default.

Events are snake_case past-tense names with key-value pairs. The argument JSON of a call,
environments and outputs are never logged (they may hold secrets): only their sizes.
``conn_id`` is bound once per connection and ``method`` and ``request_id`` for each
handler's run, through contextvars (see ``server.py``).
"""

from __future__ import annotations

import logging
import sys
from typing import Literal

import structlog

__all__ = ["configure_logging"]

LogFormat = Literal["json", "console"]


def configure_logging(fmt: LogFormat = "json", level: str = "info") -> None:
    """Configure structlog for the daemon process.

    Args:
        fmt: ``json`` (one object per line) or ``console`` (for people at a terminal).
        level: A standard level name (debug, info, warning, error).

    Raises:
        ValueError: The level name is unknown.
    """
    numeric = logging.getLevelName(level.upper())
    if not isinstance(numeric, int):
        raise ValueError(f"unknown log level {level!r}: use debug, info, warning or error")
    renderer: structlog.typing.Processor = (
        structlog.processors.JSONRenderer()
        if fmt == "json"
        else structlog.dev.ConsoleRenderer(colors=sys.stderr.isatty())
    )
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(numeric),
        logger_factory=structlog.PrintLoggerFactory(sys.stderr),
        cache_logger_on_first_use=True,
    )
