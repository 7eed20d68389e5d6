"""Large requests: the daemon's bound on their bytes in flight, and its one worker slot.

Theory of operation
-------------------
A request text over ``LARGE_TEXT`` (64 KiB), a line on the Unix socket or a body over
HTTP, is parsed in a worker thread, not on the event loop: keeping every number's text
(``jsontext``) costs about a quarter of a second per MiB of numbers, so one 16 MiB text
held the loop, and every other client and call, for seconds. Below it a text costs at most
a few milliseconds, less than the thread hop.

Such work holds the GIL as it runs, and the event loop needs it too: with one parse per
connection at once, 200 connections each sending lines of numbers had 40 worker threads
parsing, and the loop got the GIL so rarely that another client's status took 37 s (it
had taken 53 s on the loop). So it goes to the workers one job at a time on every face
together (``slot``), with the depth checks of large arguments (``check_large``): the loop
keeps half of the GIL, and the other workers (spawns, catalog reads) stay free. Both run
with the cyclic collector held off (``gcpause``). (The schema checks of large arguments
go to another process: ``checkworker``.)

A large request also holds memory until it is answered: parsed, a text takes up to twenty
times its size (16 MiB of ``[]`` is 341 MB of lists), and an ``invoke`` keeps its
arguments while it waits for a runner slot or its child. ``held`` counts the bytes of the
large texts being received or whose requests are not answered yet, on every face; ``hold``
refuses one that would take them past the face's bound, unless none is held (a lone one
always may). Without a bound one client could send 16 MiB requests until the daemon ran
out of memory.

The composition root makes one ``LargeRequests`` and hands it to each face and the
service; each makes its own when built alone, as in tests.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import TypeVar

import anyio
from toolsetd.protocol import jsontext

from . import threads
from .gcpause import GcPause

__all__ = [
    "LARGE_TEXT",
    "LIMIT_TEXTS",
    "PARSE_RECURSION_LIMIT",
    "LargeRequests",
    "check_large",
    "parse_large",
    "raise_recursion_limit",
]

T = TypeVar("T")
V = TypeVar("V")

#: Texts longer than this are large (``jsontext.LARGE_TEXT``): parsed in a worker thread,
#: by ``jsontext.loads_large``, and counted in ``held``.
LARGE_TEXT = jsontext.LARGE_TEXT
#: The interpreter's recursion limit while a large text is parsed: orjson's 1,024 levels,
#: and room for the worker thread's frames beneath the parse.
PARSE_RECURSION_LIMIT = 1024 + 200
#: The bound a face passes to ``hold``: this many times the longest text it takes (its
#: message size limit, ``--max-message-bytes``, for a line and an HTTP body alike).
LIMIT_TEXTS = 4


class LargeRequests:
    """The bytes of large requests in flight on every face, and the one worker slot."""

    __slots__ = ("_slot", "held")

    def __init__(self) -> None:
        self.held = 0
        self._slot: anyio.CapacityLimiter | None = None

    @property
    def slot(self) -> anyio.CapacityLimiter:
        """Taken for a worker job that holds the GIL (made on first use, in the event loop
        that uses it)."""
        if self._slot is None:
            self._slot = anyio.CapacityLimiter(1)
        return self._slot

    def hold(self, size: int, limit: int) -> bool:
        """Count ``size`` bytes as held until ``release``; False (nothing counted) when that
        would take ``held`` past ``limit`` while something else is held."""
        return self.recount(0, size, limit)

    def recount(self, counted: int, size: int, limit: int) -> bool:
        """Count a text still being received at ``size`` bytes instead of the ``counted``
        ones; False when that would take ``held`` past ``limit`` while something else is
        held, and then nothing is counted for it any more (it is refused)."""
        self.held -= counted
        if self.held and self.held + size > limit:
            return False
        self.held += size
        return True

    def release(self, size: int) -> None:
        """Stop counting ``size`` bytes ``hold`` counted."""
        self.held -= size

    async def parse(self, parse: Callable[[bytes], T], text: bytes) -> T:
        """``parse(text)`` for a large text, in the worker slot (``parse_large``)."""
        return await threads.run_sync(parse_large, parse, text, limiter=self.slot)

    async def check(self, check: Callable[[V], T], value: V) -> T:
        """``check(value)`` on a large request's value, or an encode of it, in the worker
        slot (``check_large``)."""
        return await threads.run_sync(check_large, check, value, limiter=self.slot)


def parse_large(parse: Callable[[bytes], T], text: bytes) -> T:
    """``parse(text)`` for a large text, with the cyclic collector held off meanwhile (run
    it in ``slot``'s worker thread).

    A text of numbers makes millions of objects that all survive the parse, and each full
    collection the growing heap starts traverses all of them again, in the parsing thread,
    holding the GIL: the event loop, and every other client, waited up to half a second
    at a time, longer as the heap grew (a 16 MB line of numbers: seventeen gaps of 35 to
    522 ms). Held off, and its objects promoted at the end (``GcPause``), the parse makes
    none of them.

    The parse (``jsontext.loads_large``) is the standard library's, which spends a level of
    the interpreter's recursion limit on each level of nesting: the limit is raised, once,
    so that it reads every depth orjson reads (1,024 levels) on top of this thread's own
    frames, and orjson is left only texts it refuses.
    """
    raise_recursion_limit()
    with GcPause(promote=True):
        return parse(text)


def raise_recursion_limit() -> None:
    """Raise the interpreter's recursion limit to ``PARSE_RECURSION_LIMIT`` (never lower
    it), for the process's whole life.

    The limit is the process's, and the argument check spends it too: raised only by the
    first large text, the same deep arguments got "nested too deeply to validate" before
    it and the schema's own answer after. So every daemon raises it as it starts
    (``app.run_daemon``, and the check process through ``exhaustion``), and each parse
    here again, for a parse made outside a daemon.
    """
    if sys.getrecursionlimit() < PARSE_RECURSION_LIMIT:
        sys.setrecursionlimit(PARSE_RECURSION_LIMIT)


def check_large(check: Callable[[V], T], value: V) -> T:
    """``check(value)`` on a large request's parsed value, with the cyclic collector held
    off meanwhile (run it in ``slot``'s worker thread).

    The depth walk of five million ``{}`` (``Service.check_request``) stacks a tuple for
    each: the collector's full passes, each over all of them, held the GIL, and so the
    loop, 135 to 554 ms at a time, sixteen times. What a check makes is garbage once it
    returns, so nothing is promoted.
    """
    with GcPause():
        return check(value)
