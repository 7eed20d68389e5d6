"""Blocking work off the event loop, in worker threads that end once idle.

Why not ``anyio.to_thread``: anyio keeps a worker thread after its job until another job
comes (it prunes idle workers only when it hands out the next one), so a daemon that read
its catalog in a thread at start keeps an idle thread for good. The number of threads
costs where the daemon steps into a call's cgroup to spawn (``cgroup.CgroupTree.entered``):
a write to ``cgroup.procs`` moves every thread of the process, and on the benchmark host
the move there and back takes ~30 µs with one thread and ~66 µs with two. Here a worker
waits ``IDLE_SECONDS`` for the next job, then ends. (The watcher's own threads, those of
``watchfiles``, stay while it watches: a daemon run with ``--no-watch`` has one thread
between bursts of blocking work, a watching one four.)

``run_sync`` behaves as ``anyio.to_thread.run_sync`` without ``abandon_on_cancel``: a
caller cancelled already starts nothing; one cancelled while the function runs waits for
it and gets its result (the cancellation reaches it at its next checkpoint); the function
runs in a copy of the caller's context (``contextvars``: the log's bound fields); an
exception it raises is raised in the caller (``StopIteration`` as a ``RuntimeError``, as
anyio does); at most ``MAX_THREADS`` workers run, further jobs wait for one.

A daemon at its limit of processes and threads (``RLIMIT_NPROC`` of its user, a cgroup's
``pids.max``, the kernel's ``threads-max``) or short of memory for a thread's stack cannot
start one. With a worker alive the job waits for it; with none, the job runs on the
caller's thread, the event loop's, holding the other clients meanwhile, as it would in a
daemon without threads: the callers (a workspace's first catalog read, a large request's
parse, a spill file, a spawn) had no answer to the ``RuntimeError`` but an internal error,
a connection closed unanswered, or a call whose tool had run answered as failed. Said once
per episode (``worker_thread_unavailable``), its end too (``worker_threads_resumed``,
with the jobs run on the loop meanwhile).
"""

from __future__ import annotations

import asyncio
import collections
import contextvars
import threading
from collections.abc import Callable
from typing import Any, TypeVar

import anyio
import anyio.lowlevel
import structlog

__all__ = ["IDLE_SECONDS", "MAX_THREADS", "alive", "run_sync"]

log = structlog.get_logger("toolsetd.threads")

T = TypeVar("T")

#: How long an idle worker waits for the next job before it ends.
IDLE_SECONDS = 1.0
#: Workers at most (as anyio's default thread limiter); more jobs wait for one.
MAX_THREADS = 40

#: (the caller's loop, the future it waits on, its context, the call)
_Job = tuple[
    asyncio.AbstractEventLoop, "asyncio.Future[Any]", contextvars.Context, Callable[[], Any]
]


class _Pool:
    """Worker threads taking jobs from one queue; a worker idle for ``IDLE_SECONDS`` ends."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._ready = threading.Condition(self._lock)
        self._jobs: collections.deque[_Job] = collections.deque()
        self._idle = 0
        #: Workers whose job is done and whose result is being handed back: each takes the
        #: next queued job without waiting, so a new job need not start a thread for itself.
        self._returning = 0
        self.threads = 0
        #: Jobs run on the caller's thread since a worker last started (the loop's only).
        self.unstarted = 0

    def submit(self, job: _Job) -> None:
        """Queue ``job``; start a worker for it unless an idle one (or the cap) will do.

        Raises:
            RuntimeError: No worker could be started and none is alive to take the job
                (the job is withdrawn: it never runs here; ``_run`` runs it itself).
        """
        with self._lock:
            self._jobs.append(job)
            if self._idle:
                self._ready.notify()
            if self._idle + self._returning >= len(self._jobs) or self.threads >= MAX_THREADS:
                return
            self.threads += 1
        try:
            threading.Thread(target=self._work, name="toolsetd-worker", daemon=True).start()
        except BaseException:
            with self._lock:
                self.threads -= 1
                if self.threads:  # a live worker takes it once free
                    return
                try:
                    self._jobs.remove(job)
                except ValueError:  # taken already: it runs
                    return
            raise
        if self.unstarted:
            log.info("worker_threads_resumed", jobs_on_loop=self.unstarted)
            self.unstarted = 0

    def _work(self) -> None:
        returning = False
        while True:
            with self._lock:
                if returning:
                    self._returning -= 1
                while not self._jobs:
                    self._idle += 1
                    woken = self._ready.wait(IDLE_SECONDS)
                    self._idle -= 1
                    if not woken and not self._jobs:
                        self.threads -= 1
                        return
                job = self._jobs.popleft()
            _run_job(job, self._done)
            returning = True
            del job  # nothing of a job outlives it in an idle worker

    def _done(self) -> None:
        """Count the calling worker as returning (its job done, its result not yet handed
        back): a job its caller's next job waited for (a limiter, a lock) is queued as soon
        as the result arrives, and then finds this worker instead of starting another one
        (a serial stream of jobs ran on two or three threads, each idling a second after)."""
        with self._lock:
            self._returning += 1


def _run_job(job: _Job, done: Callable[[], None]) -> None:
    loop, future, context, fn = job
    result: Any = None
    failure: BaseException | None = None
    try:
        result = context.run(fn)
    except StopIteration as exc:  # a future cannot carry it; anyio raises this instead
        failure = RuntimeError(f"the function raised StopIteration: {exc}")
        failure.__cause__ = exc
    except BaseException as exc:  # handed to the caller, raised there
        failure = exc
    done()
    _settle_soon(loop, future, result, failure)


def _settle_soon(
    loop: asyncio.AbstractEventLoop,
    future: asyncio.Future[Any],
    result: Any,
    exc: BaseException | None,
) -> None:
    try:
        loop.call_soon_threadsafe(_settle, future, result, exc)
    except RuntimeError:  # the loop is closed: nobody waits for the result any more
        pass


def _settle(future: asyncio.Future[Any], result: Any, exc: BaseException | None) -> None:
    if future.done():
        return
    if exc is None:
        future.set_result(result)
    else:
        future.set_exception(exc)


_POOL = _Pool()


def alive() -> int:
    """The worker threads alive now (busy or idle)."""
    return _POOL.threads


async def run_sync(
    fn: Callable[..., T], *args: Any, limiter: anyio.CapacityLimiter | None = None
) -> T:
    """Run ``fn(*args)`` in a worker thread and return its result (on this thread when
    no worker is alive and none can start).

    Args:
        fn: The blocking function.
        args: Its arguments.
        limiter: Taken for the job's duration, to bound how many such jobs run at once.
    """
    if limiter is not None:
        async with limiter:
            return await _run(fn, args)
    return await _run(fn, args)


async def _run(fn: Callable[..., T], args: tuple[Any, ...]) -> T:
    await anyio.lowlevel.checkpoint_if_cancelled()  # a cancelled caller starts nothing
    loop = asyncio.get_running_loop()
    future: asyncio.Future[T] = loop.create_future()
    context = contextvars.copy_context()
    try:
        _POOL.submit((loop, future, context, lambda: fn(*args)))
    except RuntimeError as exc:  # no thread could start, and no worker is alive
        if not _POOL.unstarted:
            log.warning("worker_thread_unavailable", error=str(exc))
        _POOL.unstarted += 1
        return fn(*args)
    with anyio.CancelScope(shield=True):
        result = await future
    return result
