"""The exec runner: one call of one exec tool, from argv to the model-facing result.

Theory of operation
-------------------
``Runner.run`` builds the argv (``argv.build_argv``; a failure is an ``isError`` result
with ``started=False``), waits for a slot of the daemon-wide ``CapacityLimiter`` (sending
``queued=True`` progress at the progress interval while it waits; a cancel while queued
ends the call without a process), makes sure both data folders exist (their paths are
computed once per home, workspace and set; each call costs one ``stat`` per folder, and a
folder deleted meanwhile is created again), then spawns the child:

* Pipes are made with ``O_CLOEXEC`` (``streams.output_pipe``; so concurrent spawns never
  inherit each other's ends). The progress pipe's write end is passed with ``pass_fds``
  and named in ``TOOLSETD_PROGRESS_FD``. Every child end is closed in the daemon right
  after the spawn, and every daemon end in ``finally``.
* The child is spawned by ``spawn.Spawner`` (what ``subprocess.Popen`` does for these
  options, without its per-spawn checks and environment encoding: argv list, no shell,
  explicit env and cwd, a new session so it leads its own process group) and watched
  through a pidfd on the event loop. This is what ``anyio.open_process`` does minus its
  stream wrappers and the asyncio child watcher thread: the pidfd tells us when the leader has
  exited *without reaping it*, and an unreaped leader keeps its pid reserved as the
  group id, so every ``killpg`` below can never hit a recycled group. There is no
  ``preexec_fn`` (it would force ``fork()``), so no ``PR_SET_PDEATHSIG``: the optional
  ``guard`` (``reaper.OrphanGuard``) is told the group right after the spawn and again
  after the final reap, and kills the groups still registered if the daemon dies.
* stdout and stderr are drained by two sibling tasks (``streams.Drainer``), stdin is
  written by a third when the pipe does not take it at once, and the progress fd is read
  by a fourth (``progress.read_progress``).
* Events: ``started(pid)`` once the child runs; ``progress`` every
  ``progress_interval_seconds`` with elapsed time and byte counts; and a progress for each
  line the child writes to its progress fd (a JSON object with ``message`` and/or
  ``fraction``, else the line as a message), at most one per ``progress_min_gap_seconds``
  (a burst is coalesced to its latest line, which is sent when the gap has passed; with
  ``CallRequest.every_progress_line``, as MCP asks, every line is reported). Lines
  are bounded to 16 KiB. Event emissions are serialised by a lock.
* Most tools are done within a few milliseconds. For 5 ms after the spawn the runner
  waits for the leader's pidfd on the event loop itself (``ending.exited_within``: one
  future, one timer). A leader gone by then, whose pipes are all at EOF when read once,
  finishes the call there: no task group, no cancel scope, no reader task, no watcher
  (a task group, a deadline scope, a shield, a ``move_on_after`` and three events
  fewer: 29 µs when those anyio objects alone are timed on this project's benchmark
  host). Any other call goes to ``_supervise``. A leader gone within the 5 ms whose
  pipe another process still holds (or refills as fast as it is read: that read on
  the loop stops at a pipe's size, ``streams.read_now``), or that wrote progress lines,
  gets readers for what is left, bounded by ``drain_after_exit_seconds`` (the progress
  lines by the call's time limit, or the drain's once cancelled: ``progress.Finish``).
  A leader still running after them, or a call whose stdin the pipe did not take at
  once (it goes there straight after the spawn), gets the readers, the stdin writer,
  the task that watches ``cancel`` and sends the periodic progress, and the deadline's
  scope. A cancel set within the first 5 ms is acted on only then: a call over by then
  is not cancelled.
* The environment is encoded to ``KEY=value`` bytes once per runner (``Popen`` would
  encode it again at every spawn) and the call's own variables once per call.

The rooms: ``call`` (the call's values and state), ``streams`` (draining stdout and
stderr, feeding stdin), ``progress`` (the progress fd), ``ending`` (killing, reaping,
rendering the outcome). ``Runner`` orchestrates them in ``_run_child``.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import math
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import replace
from pathlib import Path

import anyio

from . import threads
from .argv import ArgvError, build_argv, env_failure, executable_problem
from .call import (
    CallOutcome,
    CallRequest,
    CallState,
    EventSink,
    RunnerSettings,
    elapsed_ms,
    no_process_outcome,
)
from .cgroup import CallCgroup, CallUsage, CgroupError
from .confinement import (
    Confinement,
    ConfinementError,
    ExecutableError,
    Prepared,
    built_sandbox,
    command_failure,
    setup_failure,
    usage_text,
)
from .ending import (
    build_outcome,
    exited_within,
    kill_sandbox,
    killpg,
    reap,
    terminate,
    wait_exit,
)
from .exhaustion import out_of_tasks
from .model import ToolSet
from .output import CANCELLED_TEXT, start_failure_text, timeout_text
from .progress import Finish, read_progress
from .reaper import NullGuard, ProcessGroupGuard
from .spawn import Spawner, env_path
from .spill import SPILL_FOLDER, Spill, open_folder_within
from .streams import (
    Capture,
    Drainer,
    Fds,
    all_set_within,
    encode_stdin,
    output_pipe,
    read_now,
    read_once,
    write_stdin,
    write_stdin_now,
)

# CallOutcome, CallRequest, EventSink and RunnerSettings are re-exported on purpose: the
# runner is where the handlers and the composition root meet them.
__all__ = ["CallOutcome", "CallRequest", "EventSink", "Runner", "RunnerSettings"]

_PATHS_MAX = 1024  # (home, workspace, set) entries of the folder cache
_READERS_AFTER_SECONDS = 0.005  # a call running longer gets its reader and watcher tasks
#: Spawns on the loop whose parent side took longer than ``slow_spawn_seconds``,
#: ``_SLOW_SPAWNS`` in a row, say the CPUs are contended: the next concurrent spawns, for
#: ``_THREADS_FOR_SECONDS``, go to the worker threads.
_SLOW_SPAWNS = 2
_THREADS_FOR_SECONDS = 1.0
#: The variables every call sets in its child's environment, in ``_environment``'s order.
_CALL_VARIABLES = (
    b"CRYSTAL_WORKSPACE",
    b"CRYSTAL_SESSION",
    b"CRYSTAL_APPROVAL",
    b"CRYSTAL_TOOL_DATA",
    b"CRYSTAL_PROJECT_DATA",
    b"TOOLSETD_CALL_ID",
    b"TOOLSETD_PROGRESS_FD",
)
#: The W3C trace context variables of the daemon's own environment (a daemon started
#: inside a traced job): they name the daemon's parent span, not a call's. A child gets
#: ``TRACEPARENT`` only when its call carries a trace, and never a ``TRACESTATE`` that
#: belongs to another span.
_DAEMON_TRACE_VARIABLES = frozenset({"TRACEPARENT", "TRACESTATE"})


class _CallPaths:
    """The folders of one (home, workspace, set), computed once per runner."""

    __slots__ = ("project_data", "spill_folder", "tool_data", "workspace")

    def __init__(self, workspace: str, tool_data: str, project_data: str, spill: Path) -> None:
        self.workspace = workspace
        self.tool_data = tool_data
        self.project_data = project_data
        self.spill_folder = spill


def _kill_rest(pgid: int, cgroup: CallCgroup | None) -> None:
    """The leader has exited: SIGKILL what is left of its group, and of its cgroup."""
    killpg(pgid, signal.SIGKILL)
    if cgroup is not None and cgroup.populated():  # one read, most calls
        cgroup.kill()


def _env_failure_said(outcome: CallOutcome, command: str, search_path: str | None) -> CallOutcome:
    """Add to a call that exited 127 the sentence naming the interpreter its script's
    ``#!/usr/bin/env NAME`` line asked for and ``env`` did not find (``argv.env_failure``),
    after the tool's text, which has only ``env``'s own "No such file or directory"."""
    if "/" not in command:  # looked up on the child's PATH, as the spawn did
        found = shutil.which(command, path=os.defpath if search_path is None else search_path)
        if found is None:
            return outcome
        command = found
    problem = env_failure(command, search_path)
    if not problem:
        return outcome
    note = f"toolsetd: {problem}"
    blocks = list(outcome.content)
    if blocks and blocks[0].get("type") == "text":
        text = blocks[0]["text"]
        sep = "" if text.endswith("\n") else "\n"
        blocks[0] = {"type": "text", "text": f"{text}{sep}{note}"}
    else:
        blocks.insert(0, {"type": "text", "text": note})
    return replace(outcome, content=tuple(blocks))


class _Pipes:
    """The daemon's ends of a call's pipes, and what was read of them before supervision."""

    __slots__ = (
        "err",
        "err_done",
        "out",
        "out_done",
        "progress",
        "progress_read",
        "stdin",
        "stdin_rest",
    )

    def __init__(
        self,
        out: int,
        err: int,
        progress: int,
        stdin: int,
        out_done: bool,
        err_done: bool,
        progress_read: bytes | None,
        stdin_rest: memoryview | None,
    ) -> None:
        self.out = out
        self.err = err
        self.progress = progress
        self.stdin = stdin
        #: stdout and stderr read to their EOF already.
        self.out_done = out_done
        self.err_done = err_done
        #: The progress pipe's first read (b"" at EOF, None when nothing was read).
        self.progress_read = progress_read
        #: What the stdin pipe did not take at once.
        self.stdin_rest = stdin_rest


class Runner:
    """Runs exec calls.

    Args:
        settings: Limits and timings.
        limiter: The daemon-wide limit on running children.
        base_env: The environment every child starts from (the daemon's).
        guard: Told each child's process group right after the spawn and again once the
            group is killed and its leader reaped (``reaper.OrphanGuard``: the groups are
            killed should the daemon die meanwhile). Default: nothing is told.
        confinement: The cgroup per call and the sandbox (``confinement.Confinement``).
            Default: neither (process groups, no sandbox).
        manifest_problem: Asked once a call has its runner slot, just before its process
            starts: None, or why the manifest in its set's folder no longer loads, as the
            call's result text (``Registry.manifest_problem``); such a call starts no
            process. Default: nothing is asked.
    """

    def __init__(
        self,
        settings: RunnerSettings,
        limiter: anyio.CapacityLimiter,
        base_env: Mapping[str, str],
        guard: ProcessGroupGuard | None = None,
        confinement: Confinement | None = None,
        manifest_problem: Callable[[ToolSet], Awaitable[str | None]] | None = None,
    ) -> None:
        self._s = settings
        self._confinement = confinement
        self._manifest_problem = manifest_problem
        self._limiter = limiter
        self._spawner = Spawner(
            {k: v for k, v in base_env.items() if k not in _DAEMON_TRACE_VARIABLES},
            _CALL_VARIABLES,
        )
        self._guard: ProcessGroupGuard = guard if guard is not None else NullGuard()
        self._paths: dict[tuple[Path, Path, str], _CallPaths] = {}
        self._drainer = Drainer()
        self._spawners = (
            anyio.CapacityLimiter(settings.spawn_threads) if settings.spawn_threads > 0 else None
        )
        #: Calls between their limiter slot and their outcome (see ``_run_child``'s spawn).
        self._running = 0
        #: Until when concurrent spawns go to the worker threads, and the slow spawns on
        #: the loop in a row (see ``_run_child``).
        self._threads_until = 0.0
        self._slow_spawns = 0
        #: Spawns done in a worker thread so far (for the tests and the profiles).
        self.threaded_spawns = 0

    @property
    def settings(self) -> RunnerSettings:
        """The limits and timings new calls start with."""
        return self._s

    def update_settings(self, settings: RunnerSettings) -> None:
        """Use new limits from the next call on (a call keeps the ones it started with)."""
        self._s = settings

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
            return no_process_outcome(t0, exc.message)
        stdin_data = encode_stdin(request.arguments) if request.loaded.toolset.stdin else None
        if cancel.is_set() or not await self._acquire(t0, events, cancel):
            return no_process_outcome(t0, CANCELLED_TEXT, "cancelled")
        queue_ms = elapsed_ms(t0)
        self._running += 1
        try:
            if self._manifest_problem is not None:
                problem = await self._manifest_problem(request.loaded.toolset)
                if problem is not None:
                    return no_process_outcome(t0, problem)
            outcome = await self._run_child(request, argv, stdin_data, events, cancel, t0)
        finally:
            self._running -= 1
            self._limiter.release()
        return replace(outcome, queue_ms=queue_ms) if queue_ms else outcome

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
                    elapsed_ms=elapsed_ms(t0), stdout_bytes=0, stderr_bytes=0, queued=True
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
        # isdir is one stat; a folder deleted meanwhile is simply created again. The project
        # data folder is in the workspace, whose content the daemon does not trust: it is
        # made without following links (one on the way leaves it missing).
        if not os.path.isdir(paths.tool_data):
            with contextlib.suppress(OSError):
                os.makedirs(paths.tool_data, exist_ok=True)
        if not os.path.isdir(paths.project_data):
            with contextlib.suppress(OSError, ValueError):
                os.close(open_folder_within(paths.workspace, paths.project_data))
        return paths

    def _environment(self, request: CallRequest, paths: _CallPaths, fd: int) -> list[bytes]:
        """The child's environment, as the ``KEY=value`` bytes ``execve`` takes."""
        encode = os.fsencode
        values = (
            encode(paths.workspace),
            encode(request.session),
            encode(request.approval_mode),
            encode(paths.tool_data),
            encode(paths.project_data),
            encode(request.call_id),
            b"%d" % fd,
        )
        return self._spawner.environment(
            request.extra_env, zip(_CALL_VARIABLES, values, strict=True)
        )

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
        command = argv[0]  # a sandboxed call's argv starts with bubblewrap below
        fds = Fds()
        try:
            out_r, out_w = output_pipe()
            fds.add(out_r, out_w)
            err_r, err_w = output_pipe()
            fds.add(err_r, err_w)
            in_r, in_w = os.pipe2(os.O_CLOEXEC)
            fds.add(in_r, in_w)
            prog_r, prog_w = os.pipe2(os.O_CLOEXEC)
            fds.add(prog_r, prog_w)
            os.set_blocking(prog_r, False)  # only our end: the child's end stays blocking
        except OSError as exc:
            fds.close_all()
            return no_process_outcome(t0, start_failure_text(exc.strerror), spawn_failed=True)
        paths = self._call_paths(request)
        try:
            env = self._environment(request, paths, prog_w)
        except ValueError as exc:  # a value the file system encoding cannot encode
            fds.close_all()
            return no_process_outcome(t0, start_failure_text(str(exc)), spawn_failed=True)
        prepared: Prepared | None = None
        if self._confinement is not None:
            try:
                prepared = self._confinement.prepare(
                    toolset,
                    argv,
                    paths.workspace,
                    (paths.tool_data, paths.project_data),
                    request.approved_paths,
                    env_path(env),
                )
            except ConfinementError as exc:
                fds.close_all()
                return no_process_outcome(t0, str(exc))
            except ExecutableError as exc:
                fds.close_all()
                return no_process_outcome(t0, start_failure_text(str(exc)), spawn_failed=True)
            except OSError as exc:  # the sandbox's status pipe: out of descriptors, as above
                fds.close_all()
                return no_process_outcome(t0, start_failure_text(exc.strerror), spawn_failed=True)
            argv = prepared.argv
        status_w = -1  # bubblewrap's status pipe (a sandboxed call's), see ``setup_failure``
        if prepared is not None and prepared.status is not None:
            fds.add(*prepared.status)
            status_w = prepared.status[1]
        block_r = -1  # bubblewrap waits on it, the sandbox built (``_sandbox_checked``)
        if prepared is not None and prepared.block is not None:
            fds.add(*prepared.block)
            block_r = prepared.block[0]
        cgroup = prepared.cgroup if prepared is not None else None
        kill_all = cgroup.kill if cgroup is not None else None
        usage = CallUsage()
        spawning = prepared.spawning() if prepared is not None else contextlib.nullcontext()
        spawn = functools.partial(
            self._spawner.spawn,
            argv,
            env=env,
            cwd=paths.workspace,
            stdin=in_r,
            stdout=out_w,
            stderr=err_w,
            pass_fds=tuple(fd for fd in (prog_w, status_w, block_r) if fd >= 0),
        )
        try:
            # Where the parent side of the spawn runs (~0.2 ms here, most of it the kernel's
            # vfork and exec). On the loop's thread it costs nothing more, but holds the loop
            # meanwhile; in a worker thread it overlaps other calls' spawns and the loop's
            # work, for a thread hand-off each time. On an idle machine the loop is faster
            # (8 callers: 0.97 against 0.83 of bare asyncio's calls/s); when the CPUs are
            # contended the child waits for one, the spawn holds the loop for milliseconds,
            # and the threads are faster (0.85 against 0.55 with two CPU-bound processes
            # beside). So spawns go to the loop until ``_SLOW_SPAWNS`` in a row there took
            # over ``slow_spawn_seconds``; the concurrent ones then go to the threads for
            # ``_THREADS_FOR_SECONDS``; after that, two slow ones in a row again. A
            # call alone always spawns on the loop. So does a spawn that enters a cgroup:
            # that moves the whole daemon into the call's cgroup for the spawn, so such
            # spawns go one at a time. So does a sandboxed spawn: bubblewrap's
            # ``--die-with-parent`` is ``PR_SET_PDEATHSIG``, whose "parent" is the *thread*
            # that spawned it, and a worker thread ends once idle for a second, which would
            # SIGKILL the sandbox in the middle of its call. Shielded: a child once spawned
            # always gets an owner.
            plain = isinstance(spawning, contextlib.nullcontext)  # no cgroup to step into
            now = time.monotonic()
            if (
                not plain
                or (prepared is not None and prepared.sandboxed)
                or self._spawners is None
                or self._running <= 1
                or now >= self._threads_until
            ):
                with spawning:
                    proc = spawn()
                if plain:  # a spawn timed with the cgroup moves says nothing of the CPUs
                    self._timed_spawn(time.monotonic() - now)
            else:
                self.threaded_spawns += 1
                with anyio.CancelScope(shield=True):
                    proc = await threads.run_sync(spawn, limiter=self._spawners)
        except CgroupError as exc:  # stepping into the call's cgroup failed: nothing ran
            fds.close_all()
            if cgroup is not None:
                cgroup.discard()
            return no_process_outcome(t0, f"toolsetd: {exc}. The call did not run.")
        except (OSError, ValueError, subprocess.SubprocessError) as exc:
            fds.close_all()
            if cgroup is not None:
                cgroup.discard()
            message = exc.strerror if isinstance(exc, OSError) else str(exc)
            if isinstance(exc, OSError) and exc.filename:
                message = f"{message}: {exc.filename}"  # say which file: the fix is there
                if os.fsdecode(exc.filename) == argv[0]:  # not the workspace chdir failed on
                    hint = executable_problem(argv[0], toolset.path, env_path(env))
                    message += f". {hint}" if hint else ""  # and the fix, as validate says it
            elif isinstance(exc, OSError) and exc.errno == errno.EAGAIN:
                message = out_of_tasks(str(message))  # fork's words name no limit
            return no_process_outcome(t0, start_failure_text(message), spawn_failed=True)
        finally:
            for fd in (in_r, out_w, err_w, prog_w, status_w, block_r):
                fds.close(fd)
        self._guard.register(proc.pid)  # it leads its own session: pgid == pid
        try:
            pidfd: int | None = os.pidfd_open(proc.pid)
        except OSError:
            pidfd = None
        spill = Spill(
            request.workspace,
            paths.spill_folder,
            request.call_id,
            s.spill_cap_bytes,
            keep=s.spill_keep_files,
            max_age_seconds=s.spill_max_age_seconds,
        )
        keep = 4 * (s.output_limit_chars + 1)
        call = CallState(t0, events, Capture(0, keep, spill), Capture(1, keep, spill))
        call.every_progress_line = request.every_progress_line
        killed = False
        leader_gone = False  # the leader is known to have exited (so reaping it cannot block)
        status = b""
        try:
            deadline = math.inf
            if toolset.timeout_seconds is not None:
                deadline = anyio.current_time() + toolset.timeout_seconds
            if prepared is not None and prepared.block is not None:
                status, refused, stopped = await _sandbox_checked(
                    prepared, proc.pid, cancel, deadline
                )
                if stopped == "timeout":
                    refused = timeout_text(toolset.timeout_seconds or 0)
                if refused:
                    return no_process_outcome(t0, refused, stopped)
                fds.close(prepared.block[1])
            os.set_blocking(in_w, False)
            if stdin_data is None or not stdin_data:
                fds.close(in_w)
            await events.started(proc.pid)
            rest = write_stdin_now(in_w, stdin_data, fds, call) if stdin_data else None
            # Most tools are done within a few milliseconds, their output waiting in the
            # pipes: such a call is finished here, without a task group, a cancel scope or
            # a reader task. Only a call that runs longer, or whose stdin the pipe did not
            # take at once, goes on to ``_supervise``.
            out_done = err_done = False
            progress: bytes | None = None
            if rest is None and call.reason is None:
                window = min(_READERS_AFTER_SECONDS, deadline - anyio.current_time())
                if window > 0 and await exited_within(proc.pid, pidfd, window):
                    call.exited = leader_gone = True
                    # What it wrote is in the pipes, complete unless another process (a
                    # grandchild) still holds one.
                    out_done = read_now(out_r, call.out)
                    err_done = read_now(err_r, call.err)
                    progress = read_once(prog_r)
            if call.exited and out_done and err_done and progress == b"":
                _kill_rest(proc.pid, cgroup)
                killed = True
            else:
                leader_gone = await self._supervise(
                    _Pipes(out_r, err_r, prog_r, in_w, out_done, err_done, progress, rest),
                    proc.pid,
                    pidfd,
                    call,
                    fds,
                    cancel,
                    deadline,
                    cgroup,
                    s,
                    prepared is not None and prepared.sandboxed,
                )
                killed = True
        finally:
            if not killed:
                if prepared is not None and prepared.sandboxed:
                    kill_sandbox(proc.pid)
                killpg(proc.pid, signal.SIGKILL)
                if kill_all is not None:
                    kill_all()
            if leader_gone and cgroup is None:
                proc.poll()  # the leader has exited: reaping it cannot block
            else:
                with anyio.CancelScope(shield=True):
                    await reap(proc.pid, pidfd, leader_gone, proc.poll)
                    if cgroup is not None:
                        usage = await cgroup.finish()
            if proc.returncode is None:  # not reaped within the bound: a later spawn reaps it
                self._spawner.keep_unreaped(proc)
            self._guard.unregister(proc.pid)
            if prepared is not None and prepared.status is not None:
                status += read_once(prepared.status[0]) or b""
            fds.close_all()
            if pidfd is not None:
                os.close(pidfd)
            # No outcome will name the spill file: the call was stopped, or ``run`` was
            # cancelled from outside (a connection aborted, a forced stop).
            if not killed or not call.exited or call.reason is not None:
                spill.discard()
        measured = usage if cgroup is not None else None
        try:
            outcome = await build_outcome(
                request, proc.pid, proc.returncode, call, spill, s, measured
            )
        except BaseException:
            spill.discard()  # cancelled from outside while rendering (a no-op once finished)
            raise
        if prepared is not None:
            outcome = self._confined(
                outcome, prepared, proc.returncode, call, usage, status,
                (toolset.path, env),
            )  # fmt: skip
        if outcome.exit_code == 127:  # what env exits with when it finds no interpreter
            outcome = _env_failure_said(outcome, command, env_path(env))
        return outcome

    def _timed_spawn(self, seconds: float) -> None:
        """Count a spawn on the loop's thread: two slow ones in a row open a thread window."""
        if seconds <= self._s.slow_spawn_seconds:
            self._slow_spawns = 0
            return
        self._slow_spawns += 1
        if self._slow_spawns >= _SLOW_SPAWNS:
            self._slow_spawns = 0  # after the window, two in a row again
            self._threads_until = time.monotonic() + _THREADS_FOR_SECONDS

    def _confined(
        self,
        outcome: CallOutcome,
        prepared: Prepared,
        returncode: int | None,
        call: CallState,
        usage: CallUsage,
        status: bytes = b"",
        command: tuple[Path, Sequence[bytes]] = (Path(os.curdir), ()),
    ) -> CallOutcome:
        """Say why a confined call failed to start or was OOM-killed (``outcome`` has its usage).

        ``status`` is what bubblewrap wrote on the status pipe of a sandboxed call;
        ``command`` the set's folder and the child's environment, whose ``PATH`` a command
        that could not be executed in its sandbox is looked for in, as an unsandboxed
        start's is (read only then: ``command_failure``).
        """
        stderr = bytes(call.err.prefix[:4096])
        failed = command_failure(prepared, returncode, stderr, status, *command)
        if failed is not None:
            return replace(
                outcome,
                status="error",
                is_error=True,
                exit_code=None,
                spawn_failed=True,
                content=({"type": "text", "text": start_failure_text(failed)},),
            )
        failure = setup_failure(prepared, returncode, stderr, status)
        if failure is not None:
            return replace(
                outcome,
                status="error",
                is_error=True,
                exit_code=None,
                content=({"type": "text", "text": failure},),
            )
        assert self._confinement is not None
        note = usage_text(usage, prepared.limits)
        if note is None:
            return outcome
        blocks = list(outcome.content)
        if blocks and blocks[0].get("type") == "text":
            blocks[0] = {"type": "text", "text": f"{note}\n{blocks[0]['text']}"}
        else:
            blocks.insert(0, {"type": "text", "text": note})
        return replace(outcome, status="error", is_error=True, content=tuple(blocks))

    async def _supervise(
        self,
        pipes: _Pipes,
        pid: int,
        pidfd: int | None,
        call: CallState,
        fds: Fds,
        cancel: anyio.Event,
        deadline: float,
        cgroup: CallCgroup | None,
        s: RunnerSettings,
        sandboxed: bool = False,
    ) -> bool:
        """See a call to its end that ``_run_child`` could not finish at once.

        That is a call whose leader outlived the first window (the reader tasks, the
        watcher of ``cancel`` and the deadline take over), whose stdin the pipe did not take
        at once, or whose leader exited leaving a pipe open (a grandchild holds it). Kills
        the group once the leader is gone or the wait ends (timeout, cancel, an I/O
        failure).

        ``s`` are the settings the call started with: a reload while it runs changes
        the next call's timings, not this one's grace, drain or progress interval.

        Returns:
            Whether the leader is known to have exited (so reaping it cannot block).
        """
        gap = s.progress_min_gap_seconds
        kill_all = cgroup.kill if cgroup is not None else None
        leader_gone = call.exited
        done_out, done_err, done_progress = anyio.Event(), anyio.Event(), anyio.Event()
        finish_progress = Finish()
        async with anyio.create_task_group() as tg:
            if pipes.stdin_rest is not None:
                tg.start_soon(write_stdin, pipes.stdin, pipes.stdin_rest, fds, call)
            if call.exited:
                # Read what is left of each pipe another process still holds.
                for fd, capture, done, finished in (
                    (pipes.out, call.out, done_out, pipes.out_done),
                    (pipes.err, call.err, done_err, pipes.err_done),
                ):
                    if finished:
                        done.set()
                    else:
                        tg.start_soon(self._drainer.drain, fd, capture, done, call)
                if pipes.progress_read == b"":
                    done_progress.set()
                else:
                    tg.start_soon(
                        read_progress,
                        pipes.progress,
                        call,
                        done_progress,
                        gap,
                        pipes.progress_read,
                        finish_progress,
                    )
            else:
                with anyio.CancelScope(deadline=deadline) as wait_scope:
                    call.wait_scope = wait_scope
                    if call.reason is not None:  # stdin failed before there was a scope
                        wait_scope.cancel()
                    tg.start_soon(self._drainer.drain, pipes.out, call.out, done_out, call)
                    tg.start_soon(self._drainer.drain, pipes.err, call.err, done_err, call)
                    progress = (pipes.progress, call, done_progress, gap, None, finish_progress)
                    tg.start_soon(read_progress, *progress)
                    tg.start_soon(self._watch, cancel, call, s.progress_interval_seconds)
                    await wait_exit(pid, pidfd)
                    call.exited = leader_gone = True
            if call.exited:
                # Not the progress pipe: every background process holds it unawares (one
                # whose output went to /dev/null held the call the whole bound), and its
                # reader is told to finish below, reporting what the pipe holds.
                await all_set_within(s.drain_after_exit_seconds, done_out, done_err)
                _kill_rest(pid, cgroup)
            else:
                call.reason = call.reason or "timeout"
                leader_gone = await terminate(
                    pid,
                    pidfd,
                    s.kill_grace_seconds,
                    kill_all,
                    spare_leader=sandboxed,
                    members=cgroup.pids if cgroup is not None else None,
                )
            await all_set_within(s.drain_after_exit_seconds, done_out, done_err)
            # The progress reader reports what the pipe holds, however slowly the client
            # takes it (an MCP host: no line the tool wrote is dropped), within the call's
            # time limit; it is not cancelled with the rest. A cancel (also one already
            # set) bounds that wait by the drain's: a client that stopped taking lines
            # would otherwise hold a call without a time limit for ever.
            finish_progress()
            if not done_progress.is_set():
                with anyio.CancelScope(deadline=deadline) as progress_scope:
                    tg.start_soon(_shorten_on, cancel, progress_scope, s.drain_after_exit_seconds)
                    await done_progress.wait()
            tg.cancel_scope.cancel()  # the readers of pipes still held, the watcher
        return leader_gone

    async def _watch(self, cancel: anyio.Event, call: CallState, interval: float) -> None:
        """Stop the call when ``cancel`` is set; meanwhile and after, the periodic progress
        (every ``interval`` seconds).

        A tick is skipped while a line the child wrote is being reported (it holds the
        lock, and is progress itself): over MCP that line waits for the host, and waiting
        behind it, this task would not see ``cancel`` while the host reads nothing.

        The ticks keep one schedule through the cancel: it started a new interval, so the
        gap around it reached nearly two (1.47 s in a contract audit), where the contract
        says at least once a second. A tick that comes late (a slow host) moves the
        schedule on rather than firing the missed ones at once.
        """
        tick = anyio.current_time() + interval
        while not cancel.is_set():
            with anyio.CancelScope(deadline=tick):
                await cancel.wait()
            if cancel.is_set():
                break
            if not call.lock.locked():
                await call.progress()
            tick = _next_tick(tick, interval)
        call.stop("cancelled")
        while True:
            await anyio.sleep_until(tick)
            await call.progress()
            tick = _next_tick(tick, interval)


def _next_tick(tick: float, interval: float) -> float:
    """The periodic progress's next time: one interval on, or now when that has passed
    (one tick, never each one missed, one after another)."""
    return max(tick + interval, anyio.current_time())


async def _shorten_on(cancel: anyio.Event, scope: anyio.CancelScope, seconds: float) -> None:
    """Once ``cancel`` is set, end ``scope`` within ``seconds`` (if it ends no sooner)."""
    await cancel.wait()
    scope.deadline = min(scope.deadline, anyio.current_time() + seconds)


#: How often the runner looks whether a sandbox is built (``_sandbox_checked``), and for
#: how long at most (a bound against a hang only: bubblewrap takes milliseconds).
_SANDBOX_POLL_SECONDS = 0.0005
_SANDBOX_BUILT_SECONDS = 60.0


async def _sandbox_checked(
    prepared: Prepared, pid: int, cancel: anyio.Event, deadline: float
) -> tuple[bytes, str, str]:
    """Let a sandboxed call's tool run once its built sandbox binds what was checked.

    bubblewrap builds the sandbox, then waits on the block pipe; meanwhile the daemon
    compares each bind with what it checked (``confinement.built_sandbox``), then
    writes the byte that lets the tool start. A mismatch (a path swapped for a link while
    the sandbox was made) kills the call's process group before the tool runs; so do the
    call's time limit (``deadline``, timed from the spawn) and ``cancel``, should the
    sandbox take that long.

    Args:
        prepared: The call (``block`` and ``status`` set).
        pid: bubblewrap's pid (it leads the call's process group).
        cancel: The call's cancel.
        deadline: The call's time limit (``anyio.current_time``).

    Returns:
        What bubblewrap wrote on its status pipe so far; the call's result text when it
        must not run, else ""; and then the call's status (``error``, ``timeout``,
        ``cancelled``; the text of a timeout is the caller's).
    """
    assert prepared.block is not None
    assert prepared.status is not None
    status = b""
    verdict = "wait"
    stopped = "error"
    bound = time.monotonic() + _SANDBOX_BUILT_SECONDS
    while verdict == "wait" and time.monotonic() < bound:
        chunk = read_once(prepared.status[0])
        status += chunk or b""
        verdict = built_sandbox(prepared, status)
        if verdict == "wait" and chunk == b"":
            # The end of the status pipe without a sandbox: bubblewrap (or the cgroup
            # join before it) exited before it made one, and its own error follows.
            verdict = "gone"
        if verdict != "wait":
            break
        if cancel.is_set():
            verdict, stopped = CANCELLED_TEXT, "cancelled"
        elif anyio.current_time() >= deadline:
            verdict, stopped = "timeout", "timeout"
        else:
            await anyio.sleep(_SANDBOX_POLL_SECONDS)
    if verdict == "wait":
        verdict = "toolsetd: the call's sandbox was not built in time. The call did not run."
    if verdict in ("", "gone"):
        with contextlib.suppress(OSError):
            os.write(prepared.block[1], b"x")
        return status, "", ""
    killpg(pid, signal.SIGKILL)
    return status, verdict, stopped
