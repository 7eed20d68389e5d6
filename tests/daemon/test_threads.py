"""Blocking work in worker threads that end once idle (``daemon/threads.py``)."""

from __future__ import annotations

import contextvars
import threading
import time

import anyio
import pytest
from structlog.testing import capture_logs
from toolsetd.daemon import threads

pytestmark = pytest.mark.anyio

_VAR: contextvars.ContextVar[str] = contextvars.ContextVar("test_threads", default="unset")


async def test_threads_result_exception_and_context_reach_the_caller() -> None:
    """The result comes back, an exception is raised in the caller, the caller's context
    (the log's bound fields live there) is the function's, and it runs off the loop."""
    loop_thread = threading.get_ident()
    _VAR.set("bound")

    def look() -> tuple[str, int]:
        return _VAR.get(), threading.get_ident()

    value, where = await threads.run_sync(look)
    assert value == "bound"
    assert where != loop_thread

    def fail(message: str) -> None:
        raise LookupError(message)

    with pytest.raises(LookupError, match="named"):
        await threads.run_sync(fail, "named")


async def test_threads_idle_workers_end(monkeypatch: pytest.MonkeyPatch) -> None:
    """A worker waits for the next job only ``IDLE_SECONDS``, then ends: no thread stays
    behind for good (anyio's do until their next job)."""
    monkeypatch.setattr(threads, "IDLE_SECONDS", 0.05)
    before = {t.ident for t in threading.enumerate()}
    results: list[int] = []

    async def one(i: int) -> None:
        await threads.run_sync(time.sleep, 0.05)
        results.append(i)

    async with anyio.create_task_group() as tg:
        for i in range(4):
            tg.start_soon(one, i)
    assert sorted(results) == [0, 1, 2, 3]
    deadline = time.monotonic() + 5
    while threads.alive() and time.monotonic() < deadline:
        await anyio.sleep(0.01)
    assert threads.alive() == 0
    stayed = [
        t for t in threading.enumerate() if t.ident not in before and t.name == "toolsetd-worker"
    ]
    assert stayed == []


async def test_threads_jobs_run_at_once_and_a_limiter_bounds_them() -> None:
    """Jobs run concurrently (8 that wait for each other all finish); with a limiter, no
    more than its tokens run at a time: two jobs held running, the other four wait for the
    limiter, not for a worker. (Jobs of 20 ms counted on overlapping: a worker the OS ran
    20 ms late, on a loaded machine, ran its job alone.)"""
    barrier = threading.Barrier(8, timeout=5)
    async with anyio.create_task_group() as tg:
        for _ in range(8):
            tg.start_soon(threads.run_sync, barrier.wait)
    running = peak = 0
    lock = threading.Lock()
    release = threading.Event()

    def job() -> None:
        nonlocal running, peak
        with lock:
            running += 1
            peak = max(peak, running)
        release.wait(10)
        with lock:
            running -= 1

    limiter = anyio.CapacityLimiter(2)
    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            for _ in range(6):
                tg.start_soon(lambda: threads.run_sync(job, limiter=limiter))
            while not (peak > 2 or (running == 2 and limiter.statistics().tasks_waiting == 4)):
                await anyio.sleep(0.01)
            held = peak
            release.set()
    assert held == 2
    assert peak == 2


async def test_threads_a_cancelled_caller_waits_for_its_job() -> None:
    """Cancelled meanwhile, the caller still waits for the function and gets its result;
    the cancellation reaches it after. (Cancelled once the job runs, not after a fixed
    time: on a loaded machine 20 ms passed before the job started, and a caller cancelled
    that early rightly starts nothing.)"""
    started = threading.Event()
    release = threading.Event()
    done = threading.Event()

    def slow() -> str:
        started.set()
        release.wait(10)
        done.set()
        return "finished"

    got = []
    with anyio.CancelScope() as scope:

        async def cancel_once_running() -> None:
            while not started.is_set():
                await anyio.sleep(0.001)
            scope.cancel()
            with anyio.CancelScope(shield=True):
                await anyio.sleep(0.05)  # the caller stays in run_sync meanwhile
            release.set()

        async with anyio.create_task_group() as tg:
            tg.start_soon(cancel_once_running)
            got.append(await threads.run_sync(slow))
            await anyio.sleep(1)  # the pending cancellation lands here
            got.append("not reached")
    assert scope.cancelled_caught
    assert done.is_set()
    assert got == ["finished"]


async def test_threads_stop_iteration_is_raised_as_runtime_error() -> None:
    """A future cannot carry StopIteration: the caller gets a RuntimeError (as from anyio),
    not a wait that never ends."""

    def stop() -> None:
        raise StopIteration("done")

    with anyio.fail_after(5), pytest.raises(RuntimeError, match="StopIteration"):
        await threads.run_sync(stop)


async def test_threads_a_caller_cancelled_already_starts_nothing() -> None:
    """Cancelled before it asks, the caller runs no job."""
    ran = threading.Event()
    with anyio.CancelScope() as scope:
        scope.cancel()
        await threads.run_sync(ran.set)
    assert scope.cancelled_caught
    time.sleep(0.05)
    assert not ran.is_set()


async def test_threads_at_most_max_threads_run(monkeypatch: pytest.MonkeyPatch) -> None:
    """Beyond ``MAX_THREADS`` busy workers, jobs wait for one instead of each taking a
    new thread; all of them still run."""
    monkeypatch.setattr(threads, "MAX_THREADS", 2)
    monkeypatch.setattr(threads, "IDLE_SECONDS", 0.05)
    deadline = time.monotonic() + 5  # the earlier tests' workers end first
    while threads.alive() and time.monotonic() < deadline:
        await anyio.sleep(0.01)
    assert threads.alive() == 0
    seen: list[int] = []

    def job() -> None:
        seen.append(threads.alive())
        time.sleep(0.02)

    async with anyio.create_task_group() as tg:
        for _ in range(8):
            tg.start_soon(threads.run_sync, job)
    assert len(seen) == 8
    assert max(seen) <= 2


async def test_threads_a_job_no_worker_can_start_for_runs_on_the_callers_thread(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """No worker alive and none can start (a thread limit): the job runs at once on the
    caller's thread (the loop's), once, never again on a worker started afterwards; that
    is said once per episode, and its end when a worker starts again. (It raised
    RuntimeError, which every caller answered as an internal error.)"""
    monkeypatch.setattr(threads, "IDLE_SECONDS", 0.02)
    deadline = time.monotonic() + 5
    while threads.alive() and time.monotonic() < deadline:
        await anyio.sleep(0.01)
    assert threads.alive() == 0

    def refuse(self: threading.Thread) -> None:
        raise RuntimeError("can't start new thread")

    ran: list[int] = []
    with capture_logs() as logs:
        with monkeypatch.context() as patch:
            patch.setattr(threading.Thread, "start", refuse)
            for _ in range(2):
                await threads.run_sync(lambda: ran.append(threading.get_ident()))
        assert threads.alive() == 0
        assert await threads.run_sync(lambda: "next") == "next"
    assert ran == [threading.get_ident()] * 2
    assert [(e["event"], e.get("error"), e.get("jobs_on_loop")) for e in logs] == [
        ("worker_thread_unavailable", "can't start new thread", None),
        ("worker_threads_resumed", None, 2),
    ]


async def test_threads_a_serial_stream_of_jobs_runs_on_one_worker(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Jobs that wait for each other (a limiter of one: the daemon's large-text parser)
    run on one worker: a worker whose result is handed back counts as free for the next
    job even before it is back waiting (here it is held there a while, as a thread the
    OS has not run yet), where each job started a thread of its own, idle a second after
    (a CI run saw five threads for one large-line slot)."""
    deadline = time.monotonic() + 5
    while threads.alive() and time.monotonic() < deadline:
        await anyio.sleep(0.01)
    assert threads.alive() == 0
    hand_back = threads._settle_soon

    def slow_hand_back(*args: object) -> None:
        hand_back(*args)  # type: ignore[arg-type]
        time.sleep(0.05)

    monkeypatch.setattr(threads, "_settle_soon", slow_hand_back)
    limiter = anyio.CapacityLimiter(1)
    peak = 0

    async def one() -> None:
        nonlocal peak
        await threads.run_sync(lambda: None, limiter=limiter)
        peak = max(peak, threads.alive())

    async with anyio.create_task_group() as tg:
        for _ in range(5):
            tg.start_soon(one)
    assert peak == 1
