"""The SIGALRM time limit: it stops a runaway match, survives a finalizer, and leaves
nothing armed behind."""

from __future__ import annotations

import gc
import re
import signal
import sys
import threading
import time
from collections.abc import Callable

import pytest
from toolsetd.daemon.timelimit import TimeLimitExceeded, run_limited

pytestmark = pytest.mark.usefixtures("own_sigalrm")


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
        end = time.monotonic() + 60
        while time.monotonic() < end:
            pass

    started = time.monotonic()
    with pytest.raises(TimeLimitExceeded):
        run_limited(0.05, work)
    # Stopped by an alarm, not by the work's own end: far below its 60 s whatever the load
    # (a bound of 1 s failed at 1.4 s beside a full test run on two cores).
    assert time.monotonic() - started < 30
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


def test_run_limited_refuses_to_run_off_the_main_thread() -> None:
    """No alarm reaches another thread, and nothing else stops ``re`` mid-match: the work is
    refused there, not run unlimited (large checks go to the check process instead)."""
    ran: list[bool] = []
    [refused] = _in_a_thread(lambda: run_limited(5, lambda: ran.append(True)))
    assert isinstance(refused, RuntimeError), refused
    assert "main thread" in str(refused)
    assert ran == []
    assert signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)


def test_a_cpu_limit_stops_work_by_its_cpu_time_and_rearms() -> None:
    """``cpu=True`` counts the process's CPU time (``ITIMER_PROF``): a runaway match is
    stopped as by the wall clock, and nothing is left armed."""
    for _ in range(2):
        started = time.process_time()
        with pytest.raises(TimeLimitExceeded):
            run_limited(0.05, _runaway, cpu=True)
        assert time.process_time() - started < 5
    assert run_limited(0.05, lambda: 7, cpu=True) == 7
    assert signal.getitimer(signal.ITIMER_PROF) == (0.0, 0.0)
    assert signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)


def test_a_cpu_limit_does_not_count_time_the_process_does_not_run() -> None:
    """Wall time the process spends off the CPU (asleep here; on a loaded machine, waiting
    for a CPU) does not count against a CPU limit: the work ends by itself. The same
    work under a wall limit is stopped: so this test tells the two clocks apart."""
    assert run_limited(0.05, lambda: time.sleep(0.3) or "done", cpu=True) == "done"
    with pytest.raises(TimeLimitExceeded):
        run_limited(0.05, lambda: time.sleep(0.3))


def test_a_late_cpu_alarm_outside_the_call_only_disarms() -> None:
    """A SIGPROF that lands after the limited call returned raises nothing, and stops."""
    run_limited(1, lambda: None, cpu=True)  # installs the handler
    signal.setitimer(signal.ITIMER_PROF, 0.01, 0.01)
    try:
        end = time.process_time() + 0.1
        while time.process_time() < end:  # the handler runs here, on CPU time
            pass
        assert signal.getitimer(signal.ITIMER_PROF) == (0.0, 0.0)
    finally:
        signal.setitimer(signal.ITIMER_PROF, 0)
