"""A time limit for CPU-bound work on a process's main thread, enforced with ``SIGALRM``
(or ``SIGPROF``, counting CPU time).

Theory of operation
-------------------
Checking a call's arguments runs JSON Schema's ``pattern`` and ``patternProperties``
through Python's ``re``, a backtracking engine: ``^(a+)+$`` against 28 ``a`` and a ``!``
takes ten seconds, and each more character doubles it. The schema comes from a tool set
and the arguments from a model, so one call could stop the event loop, and every other
client with it, for as long as it liked. ``re`` holds the GIL while it matches, so a worker
thread would not help (large arguments go to another process instead, ``checkworker``,
which limits its checks with this module on its own main thread).

``re``'s matcher does check for signals every few thousand steps, and a Python signal
handler runs in the main thread, the event loop's. So ``run_limited(seconds, fn)`` arms an
``ITIMER_REAL`` timer and calls ``fn``; the ``SIGALRM`` handler raises
``TimeLimitExceeded`` when, and only when, ``run_limited``'s own frame is on the stack it
interrupts. So the exception can only come out of ``fn`` (or ``run_limited`` itself), never
out of the event loop, a task or a callback that happens to run when a late alarm lands;
such an alarm only disarms the timer. After the first alarm the timer fires again every
``_AGAIN`` seconds until ``run_limited`` disarms it: an exception raised inside a finalizer
that the garbage collector ran during ``fn`` is swallowed by Python, and the next alarm
stops ``fn`` then. Arming and disarming is two ``setitimer`` calls (~1.5 µs together).

The check process counts its CPU time instead (``cpu=True``: ``ITIMER_PROF``, whose
``SIGPROF`` the same handler takes): it does nothing else, and a limit in wall time there
made the verdict on a valid call depend on the machine's load (a 12 MB call that takes
2.4 s of CPU to check was stopped at its 12 s on a fifth of a CPU).

While another timer of the same kind runs (a caller's own, or ``run_limited`` inside
``run_limited``), ``fn`` runs unlimited: one process has one such timer. Children never
see the timer: an interval timer is not inherited across ``fork``, and ``exec`` resets the
handler.

Outside the main thread no signal handler can reach the call, and nothing else can stop
``re`` mid-match: ``run_limited`` refuses to run there (``RuntimeError``) rather than run
the work unlimited.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable
from types import FrameType
from typing import TypeVar

__all__ = ["TimeLimitExceeded", "run_limited"]

T = TypeVar("T")

#: After the first alarm, how often it fires again until ``run_limited`` disarms it.
_AGAIN = 0.01


class TimeLimitExceeded(BaseException):
    """``run_limited``'s call ran past its time (raised inside it, by the alarm's handler).

    A ``BaseException``, so that no ``except Exception`` in the library code the call runs
    swallows it and lets the work go on.
    """


def run_limited(seconds: float, fn: Callable[[], T], *, cpu: bool = False) -> T:
    """Call ``fn``; stop it with ``TimeLimitExceeded`` once it has run ``seconds``.

    ``fn`` must not ``await`` or hand control to other work: the alarm interrupts
    whatever runs under this frame.

    Args:
        seconds: The limit; 0 or less means none.
        fn: The work.
        cpu: Count the process's CPU time (``ITIMER_PROF``, ``SIGPROF``), not wall time:
            for a process that does nothing else, whose verdict must not depend on how
            loaded the machine is (the check process). The event loop's own checks count
            wall time, which is what every other client waits. Only for a process of one
            thread: the kernel may give ``SIGPROF`` to another thread, and Python runs
            the handler when the main thread next runs bytecode, late. A profiler's own
            ``ITIMER_PROF`` already running leaves ``fn`` unlimited.

    Returns:
        What ``fn`` returns.

    Raises:
        RuntimeError: Called outside the main thread, where no alarm can stop ``fn``.
    """
    if threading.current_thread() is not threading.main_thread():
        raise RuntimeError("run_limited runs only on the main thread: no alarm reaches another")
    if seconds <= 0:
        return fn()
    signum = signal.SIGPROF if cpu else signal.SIGALRM
    which = _TIMER_OF[signum]
    if signal.getitimer(which)[0] > 0:
        return fn()
    if signal.getsignal(signum) is not _on_alarm:
        signal.signal(signum, _on_alarm)
    signal.setitimer(which, seconds, _AGAIN)
    try:
        return fn()
    finally:
        signal.setitimer(which, 0)


_LIMITED = run_limited.__code__
#: The interval timer whose expiry each signal tells: wall time, and the process's CPU time.
_TIMER_OF: dict[int, int] = {signal.SIGALRM: signal.ITIMER_REAL, signal.SIGPROF: signal.ITIMER_PROF}


def _on_alarm(signum: int, frame: FrameType | None) -> None:
    while frame is not None:
        if frame.f_code is _LIMITED:
            raise TimeLimitExceeded
        frame = frame.f_back
    signal.setitimer(_TIMER_OF[signum], 0)  # run_limited has returned: a late alarm
