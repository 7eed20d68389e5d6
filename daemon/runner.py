"""The exec runner: one call of one exec tool, from argv to the model-facing result.

Theory of operation
-------------------
``Runner.run`` builds the argv (``argv.build_argv``; a failure is an ``isError`` result
with ``started=False``), waits for a slot of the daemon-wide ``CapacityLimiter`` (sending
``queued=True`` progress at the progress interval while it waits; a cancel while queued
ends the call without a process), makes sure both data folders exist (their paths are
computed once per home, workspace and set; each call costs one ``stat`` per folder, and a
folder deleted meanwhile is created again), then spawns the child:

* Pipes are made here with ``O_CLOEXEC`` (so concurrent spawns never inherit each other's
  ends), stdout/stderr enlarged to 1 MiB with ``F_SETPIPE_SZ`` when the kernel allows it
  (silently not otherwise). The progress pipe's write end is passed with ``pass_fds`` and
  named in ``TOOLSETD_PROGRESS_FD``. Every child end is closed in the daemon right after
  the spawn, and every daemon end in ``finally``.
* The child is spawned with ``subprocess.Popen`` (argv list, no shell, explicit env and cwd,
  ``start_new_session=True`` so it leads its own process group) and watched through a
  pidfd on the event loop. This is what ``anyio.open_process`` does minus its stream
  wrappers and the asyncio child watcher thread: the pidfd tells us when the leader has
  exited *without reaping it*, and an unreaped leader keeps its pid reserved as the
  group id, so every ``killpg`` below can never hit a recycled group. There is no
  ``preexec_fn`` (it would force ``fork()``), so no ``PR_SET_PDEATHSIG``: the optional
  ``guard`` (``reaper.OrphanGuard``) is told the group right after the spawn and again
  after the final reap, and kills the groups still registered if the daemon dies.
* stdout and stderr are drained by two sibling tasks reading non-blocking fds, waiting
  with ``anyio.wait_readable`` only when a pipe is empty. Each stream keeps a prefix of at
  most ``4 * (limit + 1)`` bytes (enough for ``limit + 1`` characters of any UTF-8), and
  counts the rest. A stream that fills its prefix is streamed to the spill file
  (``spill.Spill``, capped), so memory per call is bounded whatever the child writes. The
  prefixes are decoded at the end (UTF-8, ``errors="replace"``, an incomplete sequence at a
  cut is not turned into U+FFFD) and cut to ``limit + 1`` characters each. Reading goes in
  three steps, so that the common small output costs nothing and a flood costs little:
  ``os.read`` of 64 KiB into fresh bytes (no buffer to zero or map) until a read fills
  64 KiB or the prefix is full; then ``os.readv`` into a 1 MiB buffer (kept by the runner
  for reuse, at most four) until the prefix is full; past the prefix, ``os.splice`` moves
  the bytes from the pipe into the spill file while it takes more, then into ``/dev/null``,
  so they are never copied through the daemon (where ``splice`` fails, the readv path
  carries on).
* stdin (when the set's ``stdin`` is true) is the compact JSON of the arguments (orjson: key
  order kept, UTF-8, non-ASCII as is), written by a third sibling task, then closed;
  otherwise stdin is a pipe closed at once. ``BrokenPipeError`` on stdin is **not** an
  error: a child may exit (or close stdin) without reading its input, and its exit code and
  output say what happened. Any other I/O error on stdin or the output pipes ends the group
  and gives ``The external process stdin or output failed: <message>``.
* Events: ``started(pid)`` once the child runs; ``progress`` every
  ``progress_interval_seconds`` with elapsed time and byte counts; and a progress for each
  line the child writes to its progress fd (a JSON object with ``message`` and/or
  ``fraction``, else the line as a message), at most one per ``progress_min_gap_seconds``
  (a burst is coalesced to its latest line, which is sent when the gap has passed). Lines
  are bounded to 4 KiB. Event emissions are serialised by a lock. The task that watches
  ``cancel`` and sends the periodic progress starts only when the leader is still running
  5 ms after the spawn (a trivial tool is done by then, and its call never starts, nor
  cancels, that task); a cancel set earlier is acted on at that point.

Ending
------
* The leader exits: wait at most ``drain_after_exit_seconds`` for both pipes to reach EOF
  (a grandchild may hold them), then ``SIGKILL`` the rest of the group (no grandchild
  outlives the call), wait the same bound again for EOF, stop draining, reap the leader.
* Timeout (the set's ``timeoutSeconds``, timed from the spawn; none for ``"unlimited"``)
  or cancel (the ``cancel`` event) or an I/O failure: ``SIGTERM`` to the group, wait up to
  ``kill_grace_seconds`` for the leader, ``SIGKILL`` to the group (also when the leader
  already went but members remain), reap, all shielded and bounded. ``exitCode`` is null.
* If ``run`` itself is cancelled (daemon shutdown), the group is killed at once, the leader
  reaped under a shield, and the cancellation re-raised.

Exit codes: a child that exits normally reports its code. A child killed by a signal it did
not get from us reports ``128 + signum`` (``exit 137`` for SIGKILL), which is what the
reference host's .NET ``Process.ExitCode`` reports on Unix; it is an error like any non-zero
exit. A child we killed (timeout, cancel, I/O failure) reports null.

Truncation and spill: when a text block is longer than the limit it is cut with the
reference marker and, if the spill file could be written, followed by one hint line:
``\\n[full output: <path> (<n> bytes); read it with a file tool]`` (``(first <cap> of <n>
bytes)`` when the cap was hit). ``outputPath`` names the file. See ``spill`` for its format.
"""

from __future__ import annotations

import codecs
import contextlib
import errno
import fcntl
import json
import math
import os
import signal
import subprocess
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import anyio
import anyio.lowlevel
import orjson

from toolsetd.daemon.argv import ArgvError, build_argv
from toolsetd.daemon.model import LoadedTool, OutputMode
from toolsetd.daemon.output import (
    CANCELLED_TEXT,
    content_result,
    io_failure_text,
    start_failure_text,
    text_result,
    timeout_text,
    truncate,
)
from toolsetd.daemon.reaper import NullGuard, ProcessGroupGuard
from toolsetd.daemon.spill import SPILL_FOLDER, Spill, SpillResult, prune

__all__ = ["CallOutcome", "CallRequest", "EventSink", "Runner", "RunnerSettings"]

_READ_SIZE = 1 << 20  # a flood's read buffer: one full 1 MiB pipe per read
_FIRST_READ = 1 << 16  # reads before a stream proves to be a flood
_POOL_MAX = 4  # flood buffers a runner keeps for the next floods (4 MiB at most)
_PIPE_SIZE = 1 << 20
_PATHS_MAX = 1024  # (home, workspace, set) entries of the folder cache
_HAVE_SPLICE = hasattr(os, "splice")
_READERS_AFTER_SECONDS = 0.005  # a call running longer gets its reader and watcher tasks
_PROGRESS_LINE_MAX = 4096
_PROGRESS_MESSAGE_MAX = 1000
_REAP_BOUND_SECONDS = 5.0


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
    """

    call_id: str
    loaded: LoadedTool
    arguments: Any
    workspace: Path
    home: Path
    session: str = ""
    approval_mode: str = ""
    images: bool = True


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


# ---------------------------------------------------------------------------------------
# helpers


def _elapsed_ms(t0: float) -> int:
    return int((time.monotonic() - t0) * 1000)


def _encode_stdin(arguments: Any) -> bytes:
    try:
        return orjson.dumps(arguments)
    except (TypeError, orjson.JSONEncodeError):
        # orjson refuses integers beyond 64 bits, which JSON allows.
        return json.dumps(arguments, ensure_ascii=False, separators=(",", ":")).encode()


def _output_pipe() -> tuple[int, int]:
    r, w = os.pipe2(os.O_CLOEXEC)
    with contextlib.suppress(OSError):  # EPERM beyond the per-user pipe budget: keep 64 KiB
        fcntl.fcntl(w, fcntl.F_SETPIPE_SZ, _PIPE_SIZE)
    os.set_blocking(r, False)
    return r, w


def _killpg(pgid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def _read_now(fd: int, capture: _Capture) -> bool:
    """Feed what a pipe holds now; True at EOF (or a read error: the stream ends there)."""
    try:
        while data := os.read(fd, _FIRST_READ):
            capture.feed(data)
    except BlockingIOError:
        return False
    except OSError:
        pass
    return True


def _read_once(fd: int) -> bytes | None:
    """One non-blocking read: b"" at EOF, None when the pipe is empty but still open."""
    try:
        return os.read(fd, 65536)
    except BlockingIOError:
        return None
    except OSError:
        return b""


async def _all_set_within(seconds: float, *events: anyio.Event) -> None:
    """Wait at most ``seconds`` for every event (no scope and no loop pass if all are set)."""
    if all(event.is_set() for event in events):
        return
    with anyio.move_on_after(seconds):
        for event in events:
            if not event.is_set():  # waiting on a set anyio Event still costs a loop pass
                await event.wait()


def _decode(prefix: bytes | bytearray, complete: bool, limit: int) -> str:
    decoder = codecs.getincrementaldecoder("utf-8")("replace")
    return decoder.decode(bytes(prefix), final=complete)[: limit + 1]


def _parse_progress(line: bytes) -> tuple[str | None, float | None] | None:
    text = line.decode("utf-8", "replace").strip()
    if not text:
        return None
    if text.startswith("{"):
        try:
            value = orjson.loads(text)
        except orjson.JSONDecodeError:
            value = None
        if isinstance(value, dict):
            raw_message = value.get("message")
            raw_fraction = value.get("fraction")
            message = raw_message[:_PROGRESS_MESSAGE_MAX] if isinstance(raw_message, str) else None
            fraction = None
            if (
                isinstance(raw_fraction, int | float)
                and not isinstance(raw_fraction, bool)
                and math.isfinite(raw_fraction)
            ):
                fraction = min(1.0, max(0.0, float(raw_fraction)))
            if message is None and fraction is None:
                return None
            return message, fraction
    return text[:_PROGRESS_MESSAGE_MAX], None


class _Capture:
    """One output stream: a bounded prefix, a byte count, and the spill beyond the prefix."""

    __slots__ = ("keep", "prefix", "spill", "total", "which")

    def __init__(self, which: int, keep: int, spill: Spill) -> None:
        self.which = which
        self.keep = keep
        self.prefix = bytearray()
        self.total = 0
        self.spill = spill

    def feed(self, data: bytes | memoryview) -> None:
        total = self.total
        self.total = total + len(data)
        if total >= self.keep:
            self.spill.write(self.which, data)
            return
        room = self.keep - total
        self.prefix += data[:room]
        if len(data) >= room:
            # The prefix is full: from now on the stream lives on disk (the file starts
            # with the prefix, also when the prefix filled exactly and more comes later).
            self.spill.write(self.which, self.prefix)
            if len(data) > room:
                self.spill.write(self.which, data[room:])

    @property
    def complete(self) -> bool:
        return self.total <= self.keep


class _Call:
    """Mutable state of one running call, shared by its tasks."""

    def __init__(self, t0: float, events: EventSink, out: _Capture, err: _Capture) -> None:
        self.t0 = t0
        self.events = events
        self.out = out
        self.err = err
        self.reason: str | None = None  # "timeout" | "cancelled" | "io"
        self.io_message = ""
        self.exited = False
        self.wait_scope: anyio.CancelScope | None = None
        self.lock = anyio.Lock()

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
                elapsed_ms=_elapsed_ms(self.t0),
                stdout_bytes=self.out.total,
                stderr_bytes=self.err.total,
                message=message,
                fraction=fraction,
            )


class _Fds:
    """The daemon's ends of a call's pipes; each closed exactly once."""

    def __init__(self) -> None:
        self._open: set[int] = set()

    def __contains__(self, fd: int) -> bool:
        return fd in self._open

    def add(self, *fds: int) -> None:
        self._open.update(fds)

    def close(self, fd: int) -> None:
        if fd in self._open:
            self._open.discard(fd)
            with contextlib.suppress(OSError):
                os.close(fd)

    def close_all(self) -> None:
        for fd in list(self._open):
            self.close(fd)


class _CallPaths:
    """The folders of one (home, workspace, set), computed once per runner."""

    __slots__ = ("project_data", "spill_folder", "tool_data", "workspace")

    def __init__(self, workspace: str, tool_data: str, project_data: str, spill: Path) -> None:
        self.workspace = workspace
        self.tool_data = tool_data
        self.project_data = project_data
        self.spill_folder = spill


# ---------------------------------------------------------------------------------------
# the runner


class Runner:
    """Runs exec calls.

    Args:
        settings: Limits and timings.
        limiter: The daemon-wide limit on running children.
        base_env: The environment every child starts from (the daemon's).
        guard: Told each child's process group right after the spawn and again once the
            group is killed and its leader reaped (``reaper.OrphanGuard``: the groups are
            killed should the daemon die meanwhile). Default: nothing is told.
    """

    def __init__(
        self,
        settings: RunnerSettings,
        limiter: anyio.CapacityLimiter,
        base_env: Mapping[str, str],
        guard: ProcessGroupGuard | None = None,
    ) -> None:
        self._s = settings
        self._limiter = limiter
        self._base_env = dict(base_env)
        self._guard: ProcessGroupGuard = guard if guard is not None else NullGuard()
        self._paths: dict[tuple[Path, Path, str], _CallPaths] = {}
        self._buffers: list[bytearray] = []  # flood read buffers, reused (no zeroing per call)

    # -- outcomes without a process --------------------------------------------------------

    def _no_process(self, t0: float, text: str, status: str = "error") -> CallOutcome:
        return CallOutcome(
            status=status,
            exit_code=None,
            content=({"type": "text", "text": text},),
            is_error=True,
            truncated=False,
            output_path=None,
            duration_ms=_elapsed_ms(t0),
            stdout_bytes=0,
            stderr_bytes=0,
            started=False,
            pid=None,
        )

    async def run(
        self, request: CallRequest, events: EventSink, cancel: anyio.Event
    ) -> CallOutcome:
        """Run one exec call to its outcome.

        Args:
            request: The call.
            events: Where ``started`` and ``progress`` go (never ``completed``).
            cancel: Set it to end the call (status ``cancelled``).

        Returns:
            The outcome; a failing tool is an outcome with ``is_error``, never an exception.
        """
        t0 = time.monotonic()
        try:
            argv = build_argv(request.loaded, request.arguments)
        except ArgvError as exc:
            return self._no_process(t0, exc.message)
        stdin_data = _encode_stdin(request.arguments) if request.loaded.toolset.stdin else None
        if cancel.is_set() or not await self._acquire(t0, events, cancel):
            return self._no_process(t0, CANCELLED_TEXT, "cancelled")
        try:
            return await self._run_child(request, argv, stdin_data, events, cancel, t0)
        finally:
            self._limiter.release()

    async def _acquire(self, t0: float, events: EventSink, cancel: anyio.Event) -> bool:
        """Take a limiter slot, reporting ``queued`` progress while waiting; False if cancelled."""
        try:
            self._limiter.acquire_nowait()
        except anyio.WouldBlock:
            pass
        else:
            return True
        acquired = False
        interval = self._s.progress_interval_seconds

        async def report_queued() -> None:
            while True:
                await events.progress(
                    elapsed_ms=_elapsed_ms(t0), stdout_bytes=0, stderr_bytes=0, queued=True
                )
                await anyio.sleep(interval)

        async with anyio.create_task_group() as tg:

            async def watch_cancel() -> None:
                await cancel.wait()
                tg.cancel_scope.cancel()

            tg.start_soon(report_queued)
            tg.start_soon(watch_cancel)
            await self._limiter.acquire()
            acquired = True
            tg.cancel_scope.cancel()
        if acquired and cancel.is_set():
            self._limiter.release()
            return False
        return acquired

    def _call_paths(self, request: CallRequest) -> _CallPaths:
        """The call's data folders, created if missing (a cached check: one stat each)."""
        directory = request.loaded.toolset.directory
        key = (request.home, request.workspace, directory)
        paths = self._paths.get(key)
        if paths is None:
            if len(self._paths) >= _PATHS_MAX:
                self._paths.clear()
            project_data = request.workspace / ".crystal" / "data" / "tools" / directory
            paths = _CallPaths(
                str(request.workspace),
                str(request.home / "data" / "tools" / directory),
                str(project_data),
                project_data / SPILL_FOLDER,
            )
            self._paths[key] = paths
        for folder in (paths.tool_data, paths.project_data):
            # isdir is one stat; a folder deleted meanwhile is simply created again.
            if not os.path.isdir(folder):
                with contextlib.suppress(OSError):
                    os.makedirs(folder, exist_ok=True)
        return paths

    def _environment(self, request: CallRequest, paths: _CallPaths, fd: int) -> dict[str, str]:
        env = self._base_env.copy()
        env.update(
            CRYSTAL_WORKSPACE=paths.workspace,
            CRYSTAL_SESSION=request.session,
            CRYSTAL_APPROVAL=request.approval_mode,
            CRYSTAL_TOOL_DATA=paths.tool_data,
            CRYSTAL_PROJECT_DATA=paths.project_data,
            TOOLSETD_CALL_ID=request.call_id,
            TOOLSETD_PROGRESS_FD=str(fd),
        )
        return env

    async def _run_child(
        self,
        request: CallRequest,
        argv: list[str],
        stdin_data: bytes | None,
        events: EventSink,
        cancel: anyio.Event,
        t0: float,
    ) -> CallOutcome:
        s = self._s
        toolset = request.loaded.toolset
        fds = _Fds()
        out_r, out_w = _output_pipe()
        fds.add(out_r, out_w)
        try:
            err_r, err_w = _output_pipe()
            fds.add(err_r, err_w)
            in_r, in_w = os.pipe2(os.O_CLOEXEC)
            fds.add(in_r, in_w)
            prog_r, prog_w = os.pipe2(os.O_CLOEXEC)
            fds.add(prog_r, prog_w)
            os.set_blocking(prog_r, False)  # only our end: the child's end stays blocking
        except OSError as exc:
            fds.close_all()
            return self._no_process(t0, start_failure_text(exc.strerror))
        paths = self._call_paths(request)
        env = self._environment(request, paths, prog_w)
        try:
            proc = subprocess.Popen(  # noqa: TID251 -- see the module docstring: pidfd, no watcher
                argv,
                stdin=in_r,
                stdout=out_w,
                stderr=err_w,
                cwd=paths.workspace,
                env=env,
                start_new_session=True,
                pass_fds=(prog_w,),
            )
        except (OSError, ValueError, subprocess.SubprocessError) as exc:
            fds.close_all()
            message = exc.strerror if isinstance(exc, OSError) else str(exc)
            return self._no_process(t0, start_failure_text(message))
        finally:
            for fd in (in_r, out_w, err_w, prog_w):
                fds.close(fd)
        self._guard.register(proc.pid)  # it leads its own session: pgid == pid
        try:
            pidfd: int | None = os.pidfd_open(proc.pid)
        except OSError:
            pidfd = None
        spill = Spill(request.workspace, paths.spill_folder, request.call_id, s.spill_cap_bytes)
        keep = 4 * (s.output_limit_chars + 1)
        call = _Call(t0, events, _Capture(0, keep, spill), _Capture(1, keep, spill))
        done_out, done_err, done_progress = anyio.Event(), anyio.Event(), anyio.Event()
        killed = False
        leader_gone = False  # the leader is known to have exited (so reaping it cannot block)
        try:
            os.set_blocking(in_w, False)
            if stdin_data is None or not stdin_data:
                fds.close(in_w)
            deadline = math.inf
            if toolset.timeout_seconds is not None:
                deadline = anyio.current_time() + toolset.timeout_seconds
            async with anyio.create_task_group() as tg:
                readers = False  # the drains, the progress reader and the watcher are started
                with anyio.CancelScope(deadline=deadline) as wait_scope:
                    call.wait_scope = wait_scope
                    await events.started(proc.pid)
                    if stdin_data:
                        rest = self._write_stdin_now(in_w, stdin_data, fds, call)
                        if rest is not None:
                            tg.start_soon(self._write_stdin, in_w, rest, fds, call)
                    # Most tools are done within a few milliseconds, their output waiting in
                    # the pipes: only a call that runs longer gets its reader tasks.
                    with anyio.move_on_after(_READERS_AFTER_SECONDS):
                        await self._wait_exit(proc.pid, pidfd)
                        call.exited = leader_gone = True
                    if not call.exited:
                        readers = True
                        tg.start_soon(self._drain, out_r, call.out, done_out, call)
                        tg.start_soon(self._drain, err_r, call.err, done_err, call)
                        tg.start_soon(self._read_progress, prog_r, call, done_progress)
                        tg.start_soon(self._watch, cancel, call)
                        await self._wait_exit(proc.pid, pidfd)
                        call.exited = leader_gone = True
                if not readers:
                    # The leader is gone: what it wrote is in the pipes, complete unless
                    # another process (a grandchild) still holds one. Read it now, and
                    # start a reader only for a pipe still open.
                    for fd, capture, done in (
                        (out_r, call.out, done_out),
                        (err_r, call.err, done_err),
                    ):
                        if _read_now(fd, capture):
                            done.set()
                        else:
                            tg.start_soon(self._drain, fd, capture, done, call)
                    first = _read_once(prog_r)
                    if first == b"":
                        done_progress.set()
                    else:
                        tg.start_soon(self._read_progress, prog_r, call, done_progress, first)
                if call.exited:
                    await _all_set_within(
                        s.drain_after_exit_seconds, done_out, done_err, done_progress
                    )
                    _killpg(proc.pid, signal.SIGKILL)
                else:
                    call.reason = call.reason or "timeout"
                    leader_gone = await self._terminate(proc.pid, pidfd)
                killed = True
                await _all_set_within(s.drain_after_exit_seconds, done_out, done_err)
                if readers or not (
                    done_out.is_set()
                    and done_err.is_set()
                    and done_progress.is_set()
                    and in_w not in fds
                ):
                    tg.cancel_scope.cancel()  # (costly: it formats the task's repr)
        finally:
            with anyio.CancelScope(shield=True):
                if not killed:
                    _killpg(proc.pid, signal.SIGKILL)
                await self._reap(proc, pidfd, leader_gone)
                self._guard.unregister(proc.pid)
                fds.close_all()
                if pidfd is not None:
                    os.close(pidfd)
                if not call.exited or call.reason is not None:
                    spill.discard()
        return await self._outcome(request, proc, call, spill)

    # -- supervision -----------------------------------------------------------------------

    @staticmethod
    async def _wait_exit(pid: int, pidfd: int | None) -> None:
        """Return once the leader has exited, leaving it unreaped (its pid stays reserved)."""
        if pidfd is not None:
            await anyio.wait_readable(pidfd)
            return
        delay = 0.001
        while True:  # no pidfd (old kernel): peek with WNOWAIT
            try:
                info = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
            except ChildProcessError:
                return
            if info is not None:
                return
            await anyio.sleep(delay)
            delay = min(delay * 2, 0.05)

    async def _terminate(self, pgid: int, pidfd: int | None) -> bool:
        """SIGTERM the group, give the leader the grace period, then SIGKILL the group.

        Returns:
            Whether the leader exited within the grace period.
        """
        exited = False
        with anyio.CancelScope(shield=True):
            _killpg(pgid, signal.SIGTERM)
            with anyio.move_on_after(self._s.kill_grace_seconds):
                await self._wait_exit(pgid, pidfd)
                exited = True
            _killpg(pgid, signal.SIGKILL)
        return exited

    async def _reap(self, proc: subprocess.Popen[bytes], pidfd: int | None, gone: bool) -> None:
        if not gone:
            with anyio.move_on_after(_REAP_BOUND_SECONDS):
                await self._wait_exit(proc.pid, pidfd)
        proc.poll()

    async def _watch(self, cancel: anyio.Event, call: _Call) -> None:
        """Stop the call when ``cancel`` is set; meanwhile and after, the periodic progress."""
        interval = self._s.progress_interval_seconds
        while not cancel.is_set():
            with anyio.move_on_after(interval):
                await cancel.wait()
            if not cancel.is_set():
                await call.progress()
        call.stop("cancelled")
        while True:
            await anyio.sleep(interval)
            await call.progress()

    async def _drain(self, fd: int, capture: _Capture, done: anyio.Event, call: _Call) -> None:
        read = os.read
        feed = capture.feed
        keep = capture.keep
        reads = 0
        buf: bytearray | None = None
        try:
            # Most tools write little: read into fresh small bytes (nothing to zero or map)
            # until the prefix is full or one read fills _FIRST_READ (the pipe holds a flood).
            while True:
                try:
                    data = read(fd, _FIRST_READ)
                except BlockingIOError:
                    await anyio.wait_readable(fd)
                    continue
                if not data:
                    return
                feed(data)
                if capture.total >= keep or len(data) == _FIRST_READ:
                    break
                reads += 1
                if not reads & 3:  # a child keeping the pipe non-empty must not starve the loop
                    await anyio.lowlevel.checkpoint()
            splicing = _HAVE_SPLICE
            while True:
                if splicing and capture.total >= keep:
                    if await self._splice(fd, capture):
                        return
                    splicing = False  # splice refused: read and write the bytes instead
                if buf is None:
                    buf = self._buffers.pop() if self._buffers else bytearray(_READ_SIZE)
                    view = memoryview(buf)
                try:
                    n = os.readv(fd, (buf,))
                except BlockingIOError:
                    await anyio.wait_readable(fd)
                    continue
                if not n:
                    return
                feed(view[:n])
                reads += 1
                if not reads & 3:  # a flooding child never blocks us: stay fair to the loop
                    await anyio.lowlevel.checkpoint()
        except OSError as exc:
            call.stop("io", exc.strerror or str(exc))
        finally:
            if buf is not None and len(self._buffers) < _POOL_MAX:
                self._buffers.append(buf)
            done.set()

    @staticmethod
    async def _splice(fd: int, capture: _Capture) -> bool:
        """Drain past the prefix without copying through the daemon; True at EOF.

        The bytes go to the spill file while it takes more, then to ``/dev/null``, both
        with ``splice`` (a pipe's pages dropped into ``/dev/null`` are never copied).
        False when ``splice`` fails: nothing was lost, the caller reads the rest.
        """
        spill, which = capture.spill, capture.which
        null = -1
        moves = 0
        try:
            while True:
                try:
                    n = spill.splice(which, fd, _READ_SIZE)
                    if n is None:
                        if null < 0:
                            null = os.open(os.devnull, os.O_WRONLY | os.O_CLOEXEC)
                        n = os.splice(fd, null, _READ_SIZE, flags=os.SPLICE_F_NONBLOCK)
                except BlockingIOError:
                    await anyio.wait_readable(fd)
                    continue
                except OSError:
                    return False
                if not n:
                    return True
                capture.total += n
                moves += 1
                if not moves & 3:  # a flooding child never blocks us: stay fair to the loop
                    await anyio.lowlevel.checkpoint()
        finally:
            if null >= 0:
                os.close(null)

    @staticmethod
    def _write_stdin_now(fd: int, data: bytes, fds: _Fds, call: _Call) -> memoryview | None:
        """Write what the pipe takes now (usually all); returns the rest, None when done."""
        view = memoryview(data)
        try:
            while view:
                view = view[os.write(fd, view) :]
        except BlockingIOError:
            return view
        except OSError as exc:  # see _write_stdin
            if exc.errno != errno.EPIPE:
                call.stop("io", exc.strerror or str(exc))
        view.release()
        fds.close(fd)
        return None

    @staticmethod
    async def _write_stdin(fd: int, data: bytes | memoryview, fds: _Fds, call: _Call) -> None:
        view = memoryview(data)
        try:
            while view:
                try:
                    n = os.write(fd, view)
                except BlockingIOError:
                    await anyio.wait_writable(fd)
                    continue
                view = view[n:]
        except BrokenPipeError:
            pass  # the child closed stdin without reading it all: its exit code tells the story
        except OSError as exc:
            if exc.errno != errno.EPIPE:
                call.stop("io", exc.strerror or str(exc))
        finally:
            view.release()
            fds.close(fd)

    async def _read_progress(
        self, fd: int, call: _Call, done: anyio.Event, first: bytes | None = None
    ) -> None:
        try:
            await self._read_progress_lines(fd, call, first)
        finally:
            done.set()

    async def _read_progress_lines(self, fd: int, call: _Call, first: bytes | None) -> None:
        gap = self._s.progress_min_gap_seconds
        line = bytearray()
        overlong = False
        pending: tuple[str | None, float | None] | None = None
        last = -math.inf
        while True:
            try:
                if first:  # bytes read before this task started
                    chunk, first = first, None
                else:
                    chunk = os.read(fd, 65536)
            except BlockingIOError:
                if pending is None:
                    await anyio.wait_readable(fd)
                    continue
                wait = last + gap - time.monotonic()
                if wait > 0:
                    with anyio.move_on_after(wait):
                        await anyio.wait_readable(fd)
                    continue
                last = time.monotonic()
                await call.progress(*pending)
                pending = None
                continue
            except OSError:
                return
            if not chunk:
                break
            await anyio.lowlevel.checkpoint()  # a chatty child must not monopolise the loop
            start = 0
            while True:
                nl = chunk.find(b"\n", start)
                end = len(chunk) if nl < 0 else nl
                if not overlong:  # keep the first 4 KiB of a line, skip the rest of it
                    room = _PROGRESS_LINE_MAX - len(line)
                    line += chunk[start : min(end, start + room)]
                    overlong = end - start > room
                if nl < 0:
                    break
                parsed = _parse_progress(bytes(line))
                line.clear()
                overlong = False
                if parsed is not None:
                    pending = parsed
                start = nl + 1
            if pending is not None and time.monotonic() - last >= gap:
                last = time.monotonic()
                await call.progress(*pending)
                pending = None
        if pending is not None:
            await call.progress(*pending)

    # -- the result ------------------------------------------------------------------------

    async def _outcome(
        self, request: CallRequest, proc: subprocess.Popen[bytes], call: _Call, spill: Spill
    ) -> CallOutcome:
        s = self._s
        toolset = request.loaded.toolset
        exit_code: int | None = None
        truncated = False
        output_path: str | None = None
        if call.reason == "timeout":
            status, is_error = "timeout", True
            blocks: list[dict[str, Any]] = [
                {"type": "text", "text": timeout_text(toolset.timeout_seconds or 0)}
            ]
        elif call.reason == "cancelled":
            status, is_error = "cancelled", True
            blocks = [{"type": "text", "text": CANCELLED_TEXT}]
        elif call.reason == "io":
            status, is_error = "error", True
            blocks = [{"type": "text", "text": io_failure_text(call.io_message)}]
        else:
            code = proc.returncode
            exit_code = 128 - code if code is not None and code < 0 else code
            if exit_code is None:  # could not be reaped within the bound: treat as killed
                exit_code = 128 + signal.SIGKILL
            limit = s.output_limit_chars
            stdout = _decode(call.out.prefix, call.out.complete, limit)
            stderr = _decode(call.err.prefix, call.err.complete, limit)
            if request.loaded.tool.output == OutputMode.CONTENT:
                blocks, is_error = await anyio.to_thread.run_sync(
                    lambda: content_result(
                        stdout,
                        stderr,
                        exit_code or 0,
                        limit=limit,
                        images_ok=request.images,
                        workspace=request.workspace,
                        max_image_bytes=s.max_image_bytes,
                    )
                )
            else:
                blocks = [{"type": "text", "text": text_result(exit_code, stdout, stderr)}]
                is_error = exit_code != 0
            status = "error" if is_error else "ok"
            cut = [
                i for i, b in enumerate(blocks) if b["type"] == "text" and len(b["text"]) > limit
            ]
            if cut:
                truncated = True
                result = await self._finish_spill(spill, call)
                for i in cut:
                    text, _ = truncate(blocks[i]["text"], limit)
                    if result is not None:
                        text += result.hint(s.spill_cap_bytes)
                    blocks[i] = {"type": "text", "text": text}
                if result is not None:
                    output_path = str(result.path)
            else:
                spill.discard()
        return CallOutcome(
            status=status,
            exit_code=exit_code,
            content=tuple(blocks),
            is_error=is_error,
            truncated=truncated,
            output_path=output_path,
            duration_ms=_elapsed_ms(call.t0),
            stdout_bytes=call.out.total,
            stderr_bytes=call.err.total,
            started=True,
            pid=proc.pid,
        )

    async def _finish_spill(self, spill: Spill, call: _Call) -> SpillResult | None:
        s = self._s
        out, err = call.out, call.err

        def finish() -> SpillResult | None:
            result = spill.finish(bytes(out.prefix), bytes(err.prefix), out.total, err.total)
            if result is not None:
                prune(
                    spill.folder,
                    keep=s.spill_keep_files,
                    max_age_seconds=s.spill_max_age_seconds,
                )
            return result

        with anyio.CancelScope(shield=True):
            return await anyio.to_thread.run_sync(finish)
