"""One exec call's values: its request, settings, events sink, running state and outcome.

Theory of operation
-------------------
These are the pieces the runner's rooms share (``runner`` orchestrates, ``streams``
drains and feeds the pipes, ``progress`` reads the progress fd, ``ending`` kills, reaps
and renders). ``CallState`` is the mutable state of one running call: its captures, why
it is being stopped (``timeout``, ``cancelled`` or ``io``), and the lock that serialises
its event emissions. ``CallOutcome.to_wire`` mirrors ``protocol.InvokeResult`` by hand:
building the pydantic model for every result would cost microseconds per call.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import anyio

from .model import LoadedTool

if TYPE_CHECKING:
    from .streams import Capture

__all__ = [
    "CallOutcome",
    "CallRequest",
    "CallState",
    "EventSink",
    "RunnerSettings",
    "elapsed_ms",
    "no_process_outcome",
]


@dataclass(frozen=True, slots=True)
class RunnerSettings:
    """Limits and timings of the runner (all injectable so tests can shrink them)."""

    output_limit_chars: int = 100_000
    spill_cap_bytes: int = 64 * 1024 * 1024
    spill_keep_files: int = 100  # prune beyond this many per folder
    spill_max_age_seconds: float = 7 * 24 * 3600
    kill_grace_seconds: float = 5.0
    drain_after_exit_seconds: float = 0.5
    progress_interval_seconds: float = 1.0
    progress_min_gap_seconds: float = 0.1  # rate limit for child-reported progress
    max_image_bytes: int = 20 * 1024 * 1024
    #: Worker threads that spawn children while other calls run and the CPUs are busy
    #: (spawns then overlap each other and the event loop instead of stalling it); a call
    #: running alone spawns on the loop's thread, and so does every call with 0.
    spawn_threads: int = 4
    #: A spawn on the loop's thread slower than this, twice in a row, sends the concurrent
    #: spawns of the next second to the worker threads (``Runner._run_child``). At 8
    #: callers on 2 idle CPUs 0.3% of the spawns took over 1 ms and 0.1% over 2 ms; with
    #: two CPU-bound processes beside, 70% took over 2 ms (median 7 ms).
    slow_spawn_seconds: float = 0.002


@dataclass(frozen=True, slots=True)
class CallRequest:
    """One exec call, validated and fenced.

    Attributes:
        call_id: The call id (client-supplied; sanitised before it names a file).
        loaded: The tool as loaded when the call started.
        arguments: The validated, path-rewritten arguments.
        workspace: The canonical absolute workspace.
        home: The Crystal home (global data = ``home/data/tools/<dir>``).
        session: ``CRYSTAL_SESSION``.
        approval_mode: ``CRYSTAL_APPROVAL``.
        images: Whether the caller can take images.
        extra_env: Added to the child's environment before toolsetd's own variables
            (``TRACEPARENT`` from ``observe``).
        every_progress_line: Report every line the child writes to its progress fd,
            without coalescing bursts (MCP hosts count them).
        approved_paths: The call's approved outside-workspace paths (a sandboxed call may
            write exactly these).
        user_home: The operator's user profile (content-mode image paths may not be its
            credential files); None for the process's home.
    """

    call_id: str
    loaded: LoadedTool
    arguments: Any
    workspace: Path
    home: Path
    session: str = ""
    approval_mode: str = ""
    images: bool = True
    extra_env: Mapping[str, str] = field(default_factory=dict)
    every_progress_line: bool = False
    approved_paths: tuple[str, ...] = ()
    user_home: Path | None = None


class EventSink(Protocol):
    """Where the runner reports a call's life (the server turns these into notifications)."""

    async def started(self, pid: int) -> None:
        """The child is running."""

    async def progress(
        self,
        *,
        elapsed_ms: int,
        stdout_bytes: int,
        stderr_bytes: int,
        message: str | None = None,
        fraction: float | None = None,
        queued: bool = False,
    ) -> None:
        """A periodic, child-reported or queued progress report."""


@dataclass(frozen=True, slots=True)
class CallOutcome:
    """What one call came to; ``to_wire`` gives the contract's call result."""

    status: str  # "ok" | "error" | "timeout" | "cancelled"
    exit_code: int | None  # None when killed or never started
    content: tuple[dict[str, Any], ...]
    is_error: bool
    truncated: bool
    output_path: str | None
    duration_ms: int
    stdout_bytes: int
    stderr_bytes: int
    started: bool  # a process was started (so the server sends completed)
    pid: int | None
    queue_ms: int = 0  # waited for a limiter slot
    spawn_failed: bool = False  # the process could not be started
    peak_memory_bytes: int | None = None  # the call's cgroup's memory.peak, when known
    cpu_ms: int | None = None  # the call's cgroup's CPU time, when known
    oom_killed: bool = False  # the OOM killer struck in the call's cgroup

    def to_wire(self, call_id: str) -> dict[str, Any]:
        """The contract's camelCase call result."""
        return {
            "callId": call_id,
            "status": self.status,
            "exitCode": self.exit_code,
            "content": [dict(block) for block in self.content],
            "isError": self.is_error,
            "truncated": self.truncated,
            "outputPath": self.output_path,
            "durationMs": self.duration_ms,
            "stdoutBytes": self.stdout_bytes,
            "stderrBytes": self.stderr_bytes,
        }


def elapsed_ms(t0: float) -> int:
    """Milliseconds since the monotonic time ``t0``."""
    return int((time.monotonic() - t0) * 1000)


def no_process_outcome(
    t0: float, text: str, status: str = "error", spawn_failed: bool = False
) -> CallOutcome:
    """The outcome of a call that ended before any process started."""
    return CallOutcome(
        status=status,
        exit_code=None,
        content=({"type": "text", "text": text},),
        is_error=True,
        truncated=False,
        output_path=None,
        duration_ms=elapsed_ms(t0),
        stdout_bytes=0,
        stderr_bytes=0,
        started=False,
        pid=None,
        spawn_failed=spawn_failed,
    )


class CallState:
    """Mutable state of one running call, shared by its tasks."""

    def __init__(self, t0: float, events: EventSink, out: Capture, err: Capture) -> None:
        self.t0 = t0
        self.events = events
        self.out = out
        self.err = err
        self.reason: str | None = None  # "timeout" | "cancelled" | "io"
        self.io_message = ""
        self.exited = False
        self.wait_scope: anyio.CancelScope | None = None
        self.lock = anyio.Lock()
        #: Report every progress line (no coalescing of bursts).
        self.every_progress_line = False

    def stop(self, reason: str, message: str = "") -> None:
        """End the wait for the leader for ``reason`` unless it already exited."""
        if self.exited or self.reason is not None:
            return
        self.reason = reason
        self.io_message = message
        if self.wait_scope is not None:
            self.wait_scope.cancel()

    async def progress(self, message: str | None = None, fraction: float | None = None) -> None:
        async with self.lock:
            await self.events.progress(
                elapsed_ms=elapsed_ms(self.t0),
                stdout_bytes=self.out.total,
                stderr_bytes=self.err.total,
                message=message,
                fraction=fraction,
            )
