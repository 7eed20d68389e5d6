"""The orphan guard: a sentinel that SIGKILLs registered process groups when its pipe ends."""

from __future__ import annotations

import os
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

import anyio
import pytest
from structlog.testing import capture_logs
from toolsetd.daemon.reaper import OrphanGuard
from toolsetd.daemon.runner import CallRequest, Runner, RunnerSettings

from tests.daemon.conftest import Env, RecordingSink, sh_tool


class Groups:
    """Session-leading ``sleep`` processes the test spawns, all killed at the end."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen[bytes]] = []

    def spawn(self, *, inherit_all: bool = False) -> subprocess.Popen[bytes]:
        proc = subprocess.Popen(
            ["sleep", "30"], start_new_session=True, close_fds=not inherit_all
        )
        self.procs.append(proc)
        return proc

    def cleanup(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


@pytest.fixture
def groups() -> Iterator[Groups]:
    """Spawns process-group leaders; kills and reaps every one at teardown."""
    g = Groups()
    try:
        yield g
    finally:
        g.cleanup()


@pytest.fixture
def guard() -> Iterator[OrphanGuard]:
    """A started guard, closed (and its sentinel reaped) at teardown."""
    g = OrphanGuard()
    g.start()
    try:
        yield g
    finally:
        g.close()
        proc = g._proc
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait()


def test_orphan_guard_kills_registered_group_when_pipe_closes(
    guard: OrphanGuard, groups: Groups
) -> None:
    """Closing the write end (as the daemon's death does) makes the sentinel SIGKILL the group."""
    child = groups.spawn()
    guard.register(child.pid)
    guard.close()
    assert child.wait(timeout=5) == -signal.SIGKILL
    assert guard._proc is not None
    assert guard._proc.returncode == 0  # the sentinel exited on its own after the kill


def test_orphan_guard_spares_unregistered_groups(guard: OrphanGuard, groups: Groups) -> None:
    """A group unregistered (or never registered) survives the sentinel's EOF."""
    killed, unregistered, never = groups.spawn(), groups.spawn(), groups.spawn()
    guard.register(killed.pid)
    guard.register(unregistered.pid)
    guard.unregister(unregistered.pid)
    guard.close()
    assert killed.wait(timeout=5) == -signal.SIGKILL
    assert unregistered.poll() is None
    assert never.poll() is None


def test_orphan_guard_sentinel_runs_in_its_own_session(guard: OrphanGuard) -> None:
    """The sentinel leads its own session, so a terminal's signals or ``kill -<pgid>`` miss it."""
    assert guard.pid is not None
    assert os.getsid(guard.pid) == guard.pid
    assert os.getpgid(guard.pid) != os.getpgid(0)


def test_orphan_guard_pipe_is_not_inherited_by_children(
    guard: OrphanGuard, groups: Groups
) -> None:
    """A child spawned even with close_fds=False does not hold the pipe open past the close."""
    child = groups.spawn(inherit_all=True)
    assert guard._fd is not None
    assert not os.get_inheritable(guard._fd)
    guard.close(wait=5)
    assert guard._proc is not None
    assert guard._proc.returncode == 0  # EOF arrived although the child still runs
    assert child.poll() is None


def test_orphan_guard_survives_a_lost_sentinel(guard: OrphanGuard, groups: Groups) -> None:
    """With the sentinel gone, registering raises nothing and logs orphan_guard_lost once."""
    assert guard._proc is not None
    guard._proc.kill()
    guard._proc.wait()
    child = groups.spawn()
    with capture_logs() as logs:
        guard.register(child.pid)
        guard.register(child.pid + 1)
        guard.unregister(child.pid)
    assert [e["event"] for e in logs] == ["orphan_guard_lost"]
    assert not guard.active
    assert child.poll() is None


def test_orphan_guard_kill_all_signals_every_registered_group(
    guard: OrphanGuard, groups: Groups
) -> None:
    """kill_all (the forced stop) SIGKILLs exactly the groups still registered."""
    a, b, c = groups.spawn(), groups.spawn(), groups.spawn()
    for proc in (a, b, c):
        guard.register(proc.pid)
    guard.unregister(c.pid)
    assert guard.groups == {a.pid, b.pid}
    assert guard.kill_all() == 2
    assert a.wait(timeout=5) == -signal.SIGKILL
    assert b.wait(timeout=5) == -signal.SIGKILL
    assert c.poll() is None


def test_orphan_guard_closed_twice_is_harmless(guard: OrphanGuard) -> None:
    """close is idempotent and later registrations are ignored."""
    guard.close()
    guard.close()
    guard.register(12345)
    assert guard._proc is not None
    assert guard._proc.returncode == 0


class RecordingGuard:
    """Records the runner's register/unregister calls with whether the leader was unreaped."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, int, bool]] = []

    def register(self, pgid: int) -> None:
        self.calls.append(("register", pgid, os.path.exists(f"/proc/{pgid}")))

    def unregister(self, pgid: int) -> None:
        self.calls.append(("unregister", pgid, os.path.exists(f"/proc/{pgid}")))


@pytest.mark.anyio
async def test_runner_registers_each_group_and_unregisters_after_the_reap(env: Env) -> None:
    """The runner tells the guard the child's group at spawn and again once it is reaped."""
    recording = RecordingGuard()
    runner = Runner(
        RunnerSettings(kill_grace_seconds=0.5, drain_after_exit_seconds=0.3),
        anyio.CapacityLimiter(1),
        os.environ,
        guard=recording,
    )
    sink = RecordingSink()
    request = CallRequest(
        call_id="c1", loaded=sh_tool(env.set_dir, "echo hi"), arguments={},
        workspace=Path(env.workspace), home=env.home,
    )
    with anyio.fail_after(20):
        outcome = await runner.run(request, sink, anyio.Event())
    assert outcome.status == "ok"
    pid = sink.of("started")[0]["pid"]
    assert recording.calls == [("register", pid, True), ("unregister", pid, False)]
