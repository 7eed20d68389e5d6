"""The SIGALRM time limit: it stops a runaway match, survives a finalizer, and leaves
nothing armed behind."""

from __future__ import annotations

import gc
import re
import signal
import sys
import threading
import time
from collections.abc import Iterator

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


def test_run_limited_off_the_main_thread_runs_the_call_as_is() -> None:
    """Only the main thread can be interrupted: elsewhere the call is not limited."""
    seen: list[BaseException | None] = []

    def work() -> None:
        try:
            run_limited(0.01, lambda: time.sleep(0.05))
            seen.append(None)
        except BaseException as exc:  # the test records whatever escapes
            seen.append(exc)

    thread = threading.Thread(target=work)
    thread.start()
    thread.join()
    time.sleep(0.05)  # an alarm armed by the thread would interrupt the main thread here
    assert seen == [None]
