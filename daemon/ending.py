"""The end of a call: killing its group, reaping its leader, and rendering its outcome.

Theory of operation
-------------------
* The leader exits: wait at most ``drain_after_exit_seconds`` for stdout and stderr to
  reach EOF (a grandchild may hold them; not for the progress pipe, which every background
  process inherits unawares), then ``SIGKILL`` the rest of the group (no grandchild
  outlives the call), wait the same bound again for EOF, stop draining, reap the leader.
  The progress reader is not stopped with them but told to finish (``progress.Finish``):
  it reports what its pipe holds, however slowly the client takes it, within the call's
  time limit.
* Timeout (the set's ``timeoutSeconds``, timed from the spawn; none for ``"unlimited"``)
  or cancel (the ``cancel`` event) or an I/O failure: ``SIGTERM`` to the group (a
  sandboxed call's: to all of it but bubblewrap, see ``terminate``), then ``SIGCONT`` (a
  stopped process acts on the SIGTERM only once continued), wait up to
  ``kill_grace_seconds`` for the leader, ``SIGKILL`` to the group (a sandboxed call's
  namespace init first, ``kill_sandbox``; also when the leader already went but members
  remain), reap, all shielded and bounded. ``exitCode`` is null.
* If ``run`` itself is cancelled (a forced stop, a connection aborted for a stalled peer),
  the group is killed at once, the leader reaped under a shield, what it spilled removed
  (no outcome names it), and the cancellation re-raised.

Exit codes: a child that exits normally reports its code. A child killed by a signal it did
not get from us reports ``128 + signum`` (``exit 137`` for SIGKILL), which is what the
reference host's .NET ``Process.ExitCode`` reports on Unix; it is an error like any non-zero
exit. A child we killed (timeout, cancel, I/O failure) reports null.

``wait_exit`` watches the leader through its pidfd without reaping it: an unreaped leader
keeps its pid reserved as the group id, so no ``killpg`` here can hit a recycled group.

Truncation and spill: when a text block is longer than the limit it is cut with the
reference marker and, if the spill file could be written, followed by one hint line:
``\\n[full output: <path> (<n> bytes); read it with a file tool]`` (``(first <cap> of <n>
bytes)`` when the cap was hit). ``outputPath`` names the file. See ``spill`` for its format.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from collections.abc import Callable
from typing import Any

import anyio

from . import threads
from .call import CallOutcome, CallRequest, CallState, RunnerSettings, elapsed_ms
from .cgroup import CallUsage
from .model import OutputMode
from .output import (
    CANCELLED_TEXT,
    content_result,
    io_failure_text,
    text_result,
    timeout_text,
    truncate,
)
from .pidsignal import signal_listed
from .spill import Spill, SpillResult
from .streams import decode

__all__ = [
    "build_outcome",
    "exited_within",
    "kill_sandbox",
    "killpg",
    "reap",
    "terminate",
    "wait_exit",
]

_REAP_BOUND_SECONDS = 5.0


def killpg(pgid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


async def wait_exit(pid: int, pidfd: int | None) -> None:
    """Return once the leader has exited, leaving it unreaped (its pid stays reserved)."""
    if pidfd is not None:
        await anyio.wait_readable(pidfd)
        return
    delay = 0.001
    while True:  # no pidfd (old kernel): peek with WNOWAIT
        try:
            info = os.waitid(  # noqa: ASYNC222 -- WNOHANG: never blocks
                os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT
            )
        except ChildProcessError:
            return
        if info is not None:
            return
        await anyio.sleep(delay)
        delay = min(delay * 2, 0.05)


async def exited_within(pid: int, pidfd: int | None, seconds: float) -> bool:
    """Whether the leader exits within ``seconds`` (left unreaped, as by ``wait_exit``).

    With a pidfd this waits on the event loop directly: a reader on the pidfd and a
    timer settle one future. anyio's ``move_on_after`` around ``wait_readable`` costs a
    cancel scope, an event and a loop pass more, and most calls wait here once.
    Cancellation reaches the ``await`` as it reaches any (anyio cancels the task).
    """
    if pidfd is None:
        with anyio.move_on_after(seconds):
            await wait_exit(pid, pidfd)
            return True
        return False
    loop = asyncio.get_running_loop()
    waiter: asyncio.Future[bool] = loop.create_future()
    loop.add_reader(pidfd, _settle, waiter, True)
    timer = loop.call_later(seconds, _settle, waiter, False)
    try:
        return await waiter
    finally:
        timer.cancel()
        loop.remove_reader(pidfd)


def _settle(waiter: asyncio.Future[bool], value: bool) -> None:
    if not waiter.done():
        waiter.set_result(value)


def _members_but_leader(pgid: int) -> list[int]:
    """The processes of group ``pgid`` other than its leader (read from ``/proc``).

    Twice per timeout or cancel of a sandboxed call without a cgroup (one with reads its
    ``cgroup.procs`` instead), before and after its pids are pinned (``pidsignal``): a pass
    over ``/proc``, about a millisecond per thousand processes.
    """
    return [pid for pid in _with_stat_field(_PGRP, pgid) if pid != pgid]


def _children(pid: int) -> list[int]:
    """The children of ``pid``: ``/proc/<pid>/task/<pid>/children``, else a pass over ``/proc``."""
    try:
        with open(f"/proc/{pid}/task/{pid}/children", "rb") as f:
            return [int(child) for child in f.read().split()]
    except FileNotFoundError:
        pass  # a kernel without CONFIG_PROC_CHILDREN, or the process is gone
    except OSError:
        return []
    return _with_stat_field(_PPID, pid)


#: Fields of ``/proc/<pid>/stat`` after the command's closing parenthesis (``proc(5)``).
_PPID, _PGRP = 1, 2


def _with_stat_field(field: int, value: int) -> list[int]:
    """The processes whose ``/proc/<pid>/stat`` has ``value`` at ``field`` (counted after
    the command's closing parenthesis: ``_PPID``, ``_PGRP``). A process that goes meanwhile
    is left out; a ``/proc`` that cannot be listed gives none (the callers' signals to the
    group and the cgroup still go out)."""
    wanted = b"%d" % value
    found = []
    with contextlib.suppress(OSError):
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                with open(f"/proc/{entry}/stat", "rb") as f:
                    fields = f.read().rsplit(b")", 1)[1].split()
            except OSError:
                continue
            if len(fields) > field and fields[field] == wanted:
                found.append(int(entry))
    return found


def kill_sandbox(leader: int) -> None:
    """SIGKILL the init of a sandboxed call's PID namespace (its bubblewrap's child): the
    kernel then kills every process of the namespace, wherever they moved.

    Otherwise the namespace ends only through that init's parent-death signal
    (``--die-with-parent``) once bubblewrap is killed, and a tool can take that away: the
    init runs as the tool's user, without capabilities, and is dumpable, so the tool can
    ptrace it (or write its ``/proc/1/mem``), clear the signal and move it to a session of
    its own; then neither the group's SIGKILL nor bubblewrap's death reaches it, and
    without a cgroup (whose ``cgroup.kill`` would) the call's processes outlive it. Called
    while bubblewrap still lives, so its child is still listed as one; each pid is pinned
    and checked again before the signal (``signal_listed``).
    """
    signal_listed(lambda: _children(leader), signal.SIGKILL)


async def terminate(
    pgid: int,
    pidfd: int | None,
    grace: float,
    kill_all: Callable[[], None] | None = None,
    *,
    spare_leader: bool = False,
    members: Callable[[], list[int]] | None = None,
) -> bool:
    """SIGTERM (and SIGCONT) the group, give the leader the grace period, then SIGKILL the group.

    Args:
        pgid: The group (its leader's pid).
        pidfd: The leader's pidfd, if any.
        grace: Seconds between SIGTERM and SIGKILL.
        kill_all: Also called with the SIGKILL: the call's ``cgroup.kill``, which reaches the
            processes that left the group.
        spare_leader: SIGTERM every process of the group but the leader. The leader of a
            sandboxed call is bubblewrap, which SIGTERM kills at once, and the kernel then
            SIGKILLs the whole sandbox (``--die-with-parent``, the PID namespace): the
            tool would get no grace period. Spared, bubblewrap exits when the tool does.
            (Its process inside, the namespace's init, ignores a signal from outside but
            SIGKILL, which it gets first once the grace is over: ``kill_sandbox``.)
        members: With ``spare_leader``, where to find the call's processes (its cgroup's
            ``CallCgroup.pids``, those that left the group included); else the group's,
            from ``/proc``. They are signalled through pidfds (``pidsignal``), so a pid
            reused since the list was read is not.

    Returns:
        Whether the leader exited within the grace period.
    """
    exited = False
    with anyio.CancelScope(shield=True):
        # Then SIGCONT, as systemd sends it: a stopped process (SIGSTOP) acts on its
        # SIGTERM only once continued, and would sit out the grace to die by SIGKILL.
        if spare_leader:
            listed = members if members is not None else lambda: _members_but_leader(pgid)
            signal_listed(listed, signal.SIGTERM, spare=pgid)
            signal_listed(listed, signal.SIGCONT, spare=pgid)
        else:
            killpg(pgid, signal.SIGTERM)
            killpg(pgid, signal.SIGCONT)
        with anyio.move_on_after(grace):
            await wait_exit(pgid, pidfd)
            exited = True
        if spare_leader:
            kill_sandbox(pgid)
        killpg(pgid, signal.SIGKILL)
        if kill_all is not None:
            kill_all()
    return exited


async def reap(pid: int, pidfd: int | None, gone: bool, poll: Callable[[], object]) -> None:
    """Reap the leader (``poll``), first waiting a bounded time unless it is known gone."""
    if not gone:
        with anyio.move_on_after(_REAP_BOUND_SECONDS):
            await wait_exit(pid, pidfd)
    poll()


async def build_outcome(
    request: CallRequest,
    pid: int,
    returncode: int | None,
    call: CallState,
    spill: Spill,
    s: RunnerSettings,
    usage: CallUsage | None = None,
) -> CallOutcome:
    """Render a finished call: status, exit code, the model-facing text, truncation, spill.

    ``usage`` is what the call's cgroup reported, when it had one.
    """
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
        code = returncode
        exit_code = 128 - code if code is not None and code < 0 else code
        if exit_code is None:  # could not be reaped within the bound: treat as killed
            exit_code = 128 + signal.SIGKILL
        limit = s.output_limit_chars
        stdout = decode(call.out.prefix, call.out.complete, limit)
        stderr = decode(call.err.prefix, call.err.complete, limit)
        if request.loaded.tool.output == OutputMode.CONTENT:
            blocks, is_error = await threads.run_sync(
                lambda: content_result(
                    stdout,
                    stderr,
                    exit_code or 0,
                    limit=limit,
                    images_ok=request.images,
                    workspace=request.workspace,
                    max_image_bytes=s.max_image_bytes,
                    stdout_bytes=call.out.total,
                    user_home=request.user_home,
                    crystal_home=request.home,
                )
            )
        else:
            blocks = [{"type": "text", "text": text_result(exit_code, stdout, stderr)}]
            is_error = exit_code != 0
        status = "error" if is_error else "ok"
        cut = [i for i, b in enumerate(blocks) if b["type"] == "text" and len(b["text"]) > limit]
        if cut:
            truncated = True
            result = await _finish_spill(spill, call)
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
        duration_ms=elapsed_ms(call.t0),
        stdout_bytes=call.out.total,
        stderr_bytes=call.err.total,
        started=True,
        pid=pid,
        peak_memory_bytes=usage.peak_memory_bytes if usage is not None else None,
        cpu_ms=usage.cpu_usec // 1000 if usage is not None and usage.cpu_usec is not None else None,
        oom_killed=usage.oom_killed if usage is not None else False,
    )


async def _finish_spill(spill: Spill, call: CallState) -> SpillResult | None:
    out, err = call.out, call.err

    def finish() -> SpillResult | None:  # it prunes the folder too
        return spill.finish(bytes(out.prefix), bytes(err.prefix), out.total, err.total)

    result: SpillResult | None = None
    with anyio.CancelScope(shield=True):
        result = await threads.run_sync(finish)
    return result
