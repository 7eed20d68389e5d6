"""A time limit for CPU-bound work on the event loop's thread, enforced with ``SIGALRM``.

Theory of operation
-------------------
Checking a call's arguments runs JSON Schema's ``pattern`` and ``patternProperties``
through Python's ``re``, a backtracking engine: ``^(a+)+$`` against 28 ``a`` and a ``!``
takes ten seconds, and each more character doubles it. The schema comes from a tool set
and the arguments from a model, so one call could stop the event loop, and every other
client with it, for as long as it liked. ``re`` holds the GIL while it matches, so a worker
thread would not help.

``re``'s matcher does check for signals every few thousand steps, and a Python signal
handler runs in the main thread, the event loop's. So ``time_limit`` arms a one-shot
``ITIMER_REAL`` timer and a ``SIGALRM`` handler that raises ``TimeLimitExceeded`` while,
and only while, the limited block runs: the match stops with the exception, the block's
caller reports it, and the loop goes on. Arming and disarming is two ``setitimer`` calls
(~1.5 µs together). Outside the main thread the block runs unlimited: the handler could
only interrupt the main thread, whatever it was doing.

An alarm that arrives after the block ended (between the flag being cleared and the timer
being disarmed) finds the flag clear and does nothing; the handler clears the flag itself,
so one alarm raises once. Children never see the timer: an
interval timer is not inherited across ``fork``, and ``exec`` resets the handler.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType

__all__ = ["TimeLimitExceeded", "time_limit"]


class TimeLimitExceeded(BaseException):
    """The limited block ran past its time (raised inside it, by the alarm's handler).

    A ``BaseException``, so that no ``except Exception`` in the library code the block
    runs swallows it and lets the work go on unlimited.
    """


_active = False


def _on_alarm(signum: int, frame: FrameType | None) -> None:
    global _active
    if _active:
        _active = False  # one alarm, one exception, even if it lands in the cleanup
        raise TimeLimitExceeded


@contextmanager
def time_limit(seconds: float) -> Iterator[None]:
    """Stop the block with ``TimeLimitExceeded`` once it has run ``seconds``.

    Only on the main thread (elsewhere the block runs unlimited), and not nested. The
    block must not ``await``: the alarm interrupts whatever the main thread runs. The
    exception can also come out of the ``with`` statement itself, when the alarm lands
    just as the block ends.

    Args:
        seconds: The limit, wall time; 0 or less means none.
    """
    global _active
    if seconds <= 0 or _active or threading.current_thread() is not threading.main_thread():
        yield
        return
    if signal.getsignal(signal.SIGALRM) is not _on_alarm:
        signal.signal(signal.SIGALRM, _on_alarm)
    _active = True
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        _active = False
        signal.setitimer(signal.ITIMER_REAL, 0)
