"""The SIGALRM time limit: it stops a runaway match, survives a finalizer, and leaves
nothing armed behind."""

from __future__ import annotations

import contextlib
import functools
import gc
import re
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator

import pytest

from toolsetd.daemon.timelimit import TimeLimitExceeded, run_limited


@pytest.fixture(autouse=True)
def _own_sigalrm() -> Iterator[None]:
    """pytest-timeout's signal method owns SIGALRM and the real timer in this process:
    set them aside for the test (run_limited leaves a running timer alone), then give
    them back."""
    handler = signal.getsignal(signal.SIGALRM)
    left, _ = signal.setitimer(signal.ITIMER_REAL, 0)
    yield
    signal.signal(signal.SIGALRM, handler)
    if left:
        signal.setitimer(signal.ITIMER_REAL, left)


def _runaway() -> None:
    re.search(r"^(a+)+$", "a" * 60 + "!")  # ~2**60 steps: never ends by itself


def test_run_limited_stops_a_backtracking_match_and_rearms() -> None:
    for _ in range(2):  # the second call is limited too: the first left no state behind
        started = time.monotonic()
        with pytest.raises(TimeLimitExceeded):
            run_limited(0.05, _runaway)
        assert time.monotonic() - started < 5
    assert run_limited(0.05, lambda: 7) == 7
    assert signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)  # nothing left armed


def test_an_alarm_swallowed_by_a_finalizer_does_not_lift_the_limit(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Python swallows an exception raised in ``__del__``; the next alarm stops the work."""
    swallowed: list[object] = []
    monkeypatch.setattr(sys, "unraisablehook", swallowed.append)  # Python's own, not pytest's

    class Slow:
        cycle: object

        def __del__(self) -> None:
            end = time.monotonic() + 0.1
            while time.monotonic() < end:  # the first alarm lands in here
                pass

    def work() -> None:
        slow = Slow()
        slow.cycle = slow
        del slow
        gc.collect()
        end = time.monotonic() + 5
        while time.monotonic() < end:
            pass

    started = time.monotonic()
    with pytest.raises(TimeLimitExceeded):
        run_limited(0.05, work)
    assert time.monotonic() - started < 1
    assert swallowed, "the first alarm did land in the finalizer"


def test_a_late_alarm_outside_the_call_only_disarms() -> None:
    """An alarm that lands after the limited call returned raises nothing, and stops."""
    run_limited(1, lambda: None)  # installs the handler
    signal.setitimer(signal.ITIMER_REAL, 0.01, 0.01)  # what a race in the cleanup leaves
    try:
        time.sleep(0.05)  # the handler runs here, with no run_limited on the stack
        assert signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)


def _in_a_thread(work: Callable[[], object]) -> list[object]:
    """Run ``work`` in a new thread; what it returned or raised."""
    seen: list[object] = []

    def run() -> None:
        try:
            seen.append(work())
        except BaseException as exc:  # the test records whatever escapes
            seen.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(30)  # pytest-timeout's alarm is set aside here: a hang must fail instead
    assert not thread.is_alive(), "the call hung"
    return seen


def _busy(seconds: float) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        pass


def _spin() -> None:
    while True:
        pass


def test_run_limited_off_the_main_thread_stops_python_work() -> None:
    """A worker thread's call is stopped by a timer thread, and the main thread is left
    alone: no alarm is armed for it."""
    started = time.monotonic()
    [stopped] = _in_a_thread(lambda: run_limited(0.05, _spin))
    assert isinstance(stopped, TimeLimitExceeded)
    assert time.monotonic() - started < 5
    assert signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)
    assert _in_a_thread(lambda: run_limited(5, lambda: 7)) == [7]


def test_off_the_main_thread_nothing_is_raised_after_the_call_returned() -> None:
    """Calls that end about when their limit does: the exception comes out of the call or
    not at all, never in the code that runs after it (the timer's raise is withdrawn)."""

    def calls() -> tuple[int, int]:
        stopped = late = 0
        for i in range(120):
            # The timer thread needs the GIL to raise, which it gets within the switch
            # interval (5 ms): calls of 0 to 29 ms against a 10 ms limit end before, about
            # when and after the raise.
            try:
                run_limited(0.01, functools.partial(_busy, 0.001 * (i % 30)))
            except TimeLimitExceeded:
                stopped += 1
            try:
                _busy(0.002)  # a late exception would land in here
            except TimeLimitExceeded:
                late += 1
        return stopped, late

    [(stopped, late)] = _in_a_thread(calls)
    assert late == 0
    assert stopped > 0, "no call ran into its limit: the boundary was not tested"


def test_off_the_main_thread_a_raise_swallowed_by_a_finalizer_does_not_lift_the_limit(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """As with the alarm: Python swallows an exception raised in ``__del__``, so the timer
    raises again until the call ends, and the next raise stops the work."""
    swallowed: list[object] = []
    monkeypatch.setattr(sys, "unraisablehook", swallowed.append)  # Python's own, not pytest's

    class Slow:
        cycle: object

        def __del__(self) -> None:
            _busy(0.2)  # the first raise lands in here

    def work() -> str:
        slow = Slow()
        slow.cycle = slow
        del slow
        gc.collect()
        _busy(3)
        return "ran to the end"

    started = time.monotonic()
    [stopped] = _in_a_thread(lambda: run_limited(0.05, work))
    assert swallowed, "the first raise did land in the finalizer"
    assert isinstance(stopped, TimeLimitExceeded), stopped
    assert time.monotonic() - started < 1.5


def test_off_the_main_thread_a_limit_that_passes_while_the_timer_starts_ends_the_timer() -> None:
    """A limit shorter than the timer thread's start: the raise can land in ``start()``.
    It comes out of ``run_limited`` like any other, and the timer ends with the call:
    nothing is raised in the code after it, and the next calls start their timers."""
    outcome: list[object] = []

    def calls() -> None:
        late = 0
        for _ in range(300):
            with contextlib.suppress(TimeLimitExceeded):
                run_limited(1e-6, functools.partial(_busy, 0.0005))
            try:
                _busy(0.002)  # a timer left raising would land in here
            except TimeLimitExceeded:
                late += 1
        outcome.append(late)

    thread = threading.Thread(target=calls, daemon=True)
    thread.start()
    thread.join(30)  # pytest-timeout's alarm is set aside here: a hang must fail instead
    assert not thread.is_alive(), "a call hung (its timer raised in the next timer's start)"
    assert outcome == [0]
    eventually_no_timer = time.monotonic() + 1
    while time.monotonic() < eventually_no_timer and _timers():
        time.sleep(0.01)
    assert not _timers(), "a timer thread outlived its call"


def _timers() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "toolsetd-timelimit"]
