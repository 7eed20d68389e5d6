"""Hold the cyclic garbage collector off while a burst of long-lived objects is built.

Why: a catalog build makes tens of objects per set (the store's decoded records, each
``ToolDef``, ``ToolSet``, ``SetEntry``, ``LoadedTool``), and every one of them survives
into the snapshot. With the collector on, each 700 allocations start a young collection
that traverses them, every tenth of those a middle one, and once enough of them were
promoted a full one that traverses the whole heap again. None of it can free anything the
build made. Measured in process (``bench_catalog``'s build of 10,000 sets from a warm
store, the build and one full collection after it, median of 7): 675 → 412 ms.

Holding the collector off only defers the young collections: the first one after the
pause traverses everything the build made (at 1,000 sets that was as slow as the
collections it replaced). So a pause asked to ``promote`` ends, on a clean exit, by moving
every young object straight into the oldest generation (``gc.freeze`` then
``gc.unfreeze``: two list splices, no traversal). Paired in process against a plain
pause: the build 0.87 of its time at 1,000 sets and 0.82 at 10,000.

A promotion moves *every* young object, including cyclic garbage other threads made
meanwhile, and neither it nor the counts it resets tell the collector that the oldest
generation grew: such garbage waits for a full collection, which the promotions
themselves never bring closer. So:

* **Young garbage from before is collected first.** The first holder of a promoting pause
  runs a young collection (``gc.collect(1)``) before turning the collector off; what is
  promoted is what was made during the pause. A period whose first holder did not ask
  to promote promotes nothing, whoever joins it.
* **Promotions are bounded.** At most ``PROMOTIONS_PER_FULL`` promoting pauses between two
  full collections (``gc.get_stats``) promote; after that a pause defers only, its objects
  reach the oldest generation the ordinary way, counted, and so bring the next full
  collection, which frees whatever earlier promotions carried along.
* **Only where the generations are the ones above.** CPython before 3.14 (whose
  incremental collector has other generations): elsewhere a pause defers only.

The pause itself:

* **Process-wide and nested.** ``gc.disable`` is global, so pauses are counted: the first
  holder turns the collector off (if it was on) and starts the period's clock; the last
  one to leave turns it on again, promoting first if a holder that asked for it left
  cleanly. Builds in two worker threads at once compose.
* **Bounded.** A period lasts ``MAX_PAUSE_SECONDS`` at most, however many holders come and
  go in it: ``expire_if_due`` (which the build reaches through ``tick``, once in 64 sets
  of its scan and load together) turns the collector back on for everyone once the first
  holder's deadline has passed, and an expired period promotes nothing. So a first start
  that parses thousands of manifests, overlapping builds, or a build while the event loop
  serves requests that make cyclic garbage, get the collector back within about half a
  second plus 64 sets' work (a ``stat`` that hangs on a network filesystem holds it
  longer). A parse of a large request (``large.parse_large``), which cannot tick, holds
  it for the parse: seconds at most, for a 16 MiB text of numbers. A pause never outlives
  its ``with`` block, whatever is raised.
* **Nothing else freezes.** The promotion's ``unfreeze`` would thaw objects some other
  code froze on purpose (``gc.freeze`` before a ``fork``): toolsetd freezes nothing else.
* **The collector is the pauses' while they last.** Code that turns it off during a period
  may find it turned on again (by the period's end or its expiry); code that turns it on
  ends the pause early. toolsetd does neither.
"""

from __future__ import annotations

import gc
import sys
import threading
import time
from collections.abc import Callable
from types import TracebackType

__all__ = ["MAX_PAUSE_SECONDS", "PROMOTIONS_PER_FULL", "TICKS_PER_CHECK", "GcPause"]

#: How long one period of pauses holds the collector off at most.
MAX_PAUSE_SECONDS = 0.5
#: ``tick`` looks at the clock once in this many calls (a power of two).
TICKS_PER_CHECK = 64
#: Promoting pauses allowed between two full collections.
PROMOTIONS_PER_FULL = 8
#: Whether ``gc.freeze`` / ``gc.unfreeze`` promote young objects as described above.
CAN_PROMOTE = sys.implementation.name == "cpython" and sys.version_info < (3, 14)

_lock = threading.Lock()
#: Pauses held now.
_holders = 0
#: Whether the collector was on when the period began (so its end turns it on again).
_was_enabled = False
#: When the period's pause ends at the latest (the first holder's clock).
_deadline = 0.0
#: Whether the period's pause ended early (the collector is on again).
_expired = False
#: Whether a holder that asked to promote left cleanly during the period.
_promote = False
#: Whether the period began with a young collection (only then may it promote).
_collected = False
#: Promotions since the full collection counted in ``_full_seen``.
_promotions = 0
_full_seen = -1


def _full_collections() -> int:
    return int(gc.get_stats()[-1]["collections"])


def _hold(now: float, max_seconds: float, promote: bool) -> None:
    global _holders, _was_enabled, _deadline, _expired, _promote, _collected
    with _lock:
        if _holders == 0:
            _was_enabled = gc.isenabled()
            _deadline = now + max_seconds
            _expired = False
            _promote = False
            _collected = False
            if _was_enabled:
                if promote and CAN_PROMOTE:
                    gc.collect(1)  # so what is promoted is what the pause made
                    _collected = True
                gc.disable()
        _holders += 1


def _expire(now: float) -> None:
    global _expired
    with _lock:
        if _holders and not _expired and now >= _deadline:
            _expired = True
            if _was_enabled:
                gc.enable()


def _release(promote: bool) -> None:
    global _holders, _promote, _promotions, _full_seen
    with _lock:
        _holders -= 1
        _promote = _promote or promote
        if _holders or _expired or not _was_enabled:
            return
        if _promote and _collected:
            full = _full_collections()
            if full != _full_seen:
                _full_seen, _promotions = full, 0
            if _promotions < PROMOTIONS_PER_FULL:
                _promotions += 1
                gc.freeze()  # every tracked object into the permanent generation,
                gc.unfreeze()  # and all of them back into the oldest one
        gc.enable()


class GcPause:
    """A context manager that holds the collector off (see the module docstring).

    Args:
        max_seconds: How long the period this pause begins may last; None for
            ``MAX_PAUSE_SECONDS``. A pause that joins a period keeps that period's end.
        promote: On a clean exit, move the young objects into the oldest generation
            before the collector comes back (for a block whose objects outlive it).
        clock: A monotonic clock (injectable for tests).
    """

    __slots__ = ("_clock", "_held", "_max_seconds", "_promote", "_ticks")

    def __init__(
        self,
        max_seconds: float | None = None,
        *,
        promote: bool = False,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._max_seconds = max_seconds
        self._promote = promote
        self._clock = clock
        self._held = False
        self._ticks = 0

    def __enter__(self) -> GcPause:
        if self._held:
            raise RuntimeError("a GcPause is held already; use a new one")
        limit = MAX_PAUSE_SECONDS if self._max_seconds is None else self._max_seconds
        self._held = True  # before the hold: __exit__ releases what __enter__ took
        try:
            _hold(self._clock(), limit, self._promote)
        except BaseException:
            self._held = False
            raise
        return self

    def expire_if_due(self) -> None:
        """Turn the collector back on if the period is past its deadline."""
        if self._held:
            _expire(self._clock())

    def tick(self) -> None:
        """One unit of the block's work is done: every ``TICKS_PER_CHECK``-th call is an
        ``expire_if_due`` (a loop over thousands of sets calls this once a set)."""
        self._ticks += 1
        if not self._ticks & (TICKS_PER_CHECK - 1):
            self.expire_if_due()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._held:
            self._held = False
            _release(self._promote and exc_type is None)
