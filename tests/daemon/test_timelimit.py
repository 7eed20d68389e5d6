"""The SIGALRM time limit: it stops a runaway match, and leaves nothing armed behind."""

from __future__ import annotations

import re
import signal
import threading
import time
from collections.abc import Iterator

import pytest

from toolsetd.daemon.timelimit import TimeLimitExceeded, time_limit


@pytest.fixture(autouse=True)
def _keep_sigalrm() -> Iterator[None]:
    """pytest-timeout's signal method owns SIGALRM in this process: give it back after."""
    handler = signal.getsignal(signal.SIGALRM)
    yield
    signal.signal(signal.SIGALRM, handler)


def _runaway() -> None:
    re.search(r"^(a+)+$", "a" * 60 + "!")  # ~2**60 steps: never ends by itself


def test_time_limit_stops_a_backtracking_match_and_rearms() -> None:
    for _ in range(2):  # the second block is limited too: the first left no state behind
        started = time.monotonic()
        with pytest.raises(TimeLimitExceeded), time_limit(0.05):
            _runaway()
        assert time.monotonic() - started < 5
    with time_limit(0.05):
        pass
    time.sleep(0.1)  # a finished block's alarm, if any were left armed, would land here


def test_time_limit_off_the_main_thread_runs_the_block_as_is() -> None:
    """Only the main thread can be interrupted: elsewhere the block is not limited."""
    seen: list[BaseException | None] = []

    def work() -> None:
        try:
            with time_limit(0.01):
                time.sleep(0.05)
            seen.append(None)
        except BaseException as exc:  # the test records whatever escapes
            seen.append(exc)

    thread = threading.Thread(target=work)
    thread.start()
    thread.join()
    time.sleep(0.05)  # an alarm armed by the thread would interrupt the main thread here
    assert seen == [None]
