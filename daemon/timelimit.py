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
handler runs in the main thread, the event loop's. So ``run_limited(seconds, fn)`` arms an
``ITIMER_REAL`` timer and calls ``fn``; the ``SIGALRM`` handler raises
``TimeLimitExceeded`` when, and only when, ``run_limited``'s own frame is on the stack it
interrupts. So the exception can only come out of ``fn`` (or ``run_limited`` itself), never
out of the event loop, a task or a callback that happens to run when a late alarm lands;
such an alarm only disarms the timer. After the first alarm the timer fires again every
``_AGAIN`` seconds until ``run_limited`` disarms it: an exception raised inside a finalizer
that the garbage collector ran during ``fn`` is swallowed by Python, and the next alarm
stops ``fn`` then. Arming and disarming is two ``setitimer`` calls (~1.5 µs together).

While another ``ITIMER_REAL`` timer runs (a caller's own, or ``run_limited`` inside
``run_limited``), ``fn`` runs unlimited: one process has one such timer. Children never
see the timer: an interval timer is not inherited across ``fork``, and ``exec`` resets the
handler.

Outside the main thread a signal handler cannot reach the call, so a timer thread stops it
instead: once ``seconds`` have passed it raises ``TimeLimitExceeded`` in the calling
thread with ``PyThreadState_SetAsyncExc``, which Python delivers at that thread's next
bytecode. Code in C runs to the end of its call first, ``re``'s matcher included: give a
worker thread only work made of Python steps (the daemon gives one the check of arguments
against a schema without ``pattern``, ``validation.ArgumentValidators.off_loop``). A lock
orders the timer against the call's end, and an exception set but not yet delivered when
the call ends is withdrawn: here too it can only come out of ``fn`` or ``run_limited``.
It too raises again every ``_AGAIN`` seconds until the call ends, for an exception a
finalizer swallowed.
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


def run_limited(seconds: float, fn: Callable[[], T]) -> T:
    """Call ``fn``; stop it with ``TimeLimitExceeded`` once it has run ``seconds``.

    ``fn`` must not ``await`` or hand control to other work: the alarm interrupts
    whatever runs under this frame.

    Args:
        seconds: The limit, wall time; 0 or less means none.
        fn: The work.

    Returns:
        What ``fn`` returns.
    """
    if seconds <= 0:
        return fn()
    if threading.current_thread() is not threading.main_thread():
        return _run_limited_in_thread(seconds, fn)
    if signal.getitimer(signal.ITIMER_REAL)[0] > 0:
        return fn()
    if signal.getsignal(signal.SIGALRM) is not _on_alarm:
        signal.signal(signal.SIGALRM, _on_alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds, _AGAIN)
    try:
        return fn()
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)


def _run_limited_in_thread(seconds: float, fn: Callable[[], T]) -> T:
    """``run_limited`` outside the main thread: a timer thread raises in this one."""
    raise_in = _async_raiser()  # ctypes imported now, not while the work holds the GIL
    ident = threading.get_ident()
    lock = threading.Lock()
    ended = threading.Event()
    running = [True]

    def expire() -> None:
        # Again every _AGAIN seconds until the call ends, as the alarm does: Python
        # swallows an exception raised in a finalizer that the collector ran during fn.
        wait = seconds
        while not ended.wait(wait):
            with lock:
                if not running[0]:
                    return
                raise_in(ident, TimeLimitExceeded)
            wait = _AGAIN

    timer = threading.Thread(target=expire, name="toolsetd-timelimit", daemon=True)
    try:
        # Inside: a short limit can pass while start() waits for the thread, and a raise
        # that lands there must end the timer too (or it raises in this thread for good).
        timer.start()
        return fn()
    finally:
        with lock:
            running[0] = False
        raise_in(ident, None)  # withdraw one set but not delivered yet
        # Only then, with nothing pending to land inside it (and leave its lock taken),
        # end the timer thread (if a raise landed above, it ends within _AGAIN).
        ended.set()


def _async_raiser() -> Callable[[int, type[BaseException] | None], None]:
    """A function that has thread ``ident`` raise ``exc`` at its next bytecode (None:
    withdraw one not delivered yet)."""
    import ctypes  # only a limited call in a worker thread needs it

    set_async_exc = ctypes.pythonapi.PyThreadState_SetAsyncExc

    def raise_in(ident: int, exc: type[BaseException] | None) -> None:
        set_async_exc(ctypes.c_ulong(ident), None if exc is None else ctypes.py_object(exc))

    return raise_in


_LIMITED = run_limited.__code__


def _on_alarm(signum: int, frame: FrameType | None) -> None:
    while frame is not None:
        if frame.f_code is _LIMITED:
            raise TimeLimitExceeded
        frame = frame.f_back
    signal.setitimer(signal.ITIMER_REAL, 0)  # run_limited has returned: a late alarm
