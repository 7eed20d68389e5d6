"""The cgroup tree: both ways into a call's cgroup, the kill, the usage, the removal.

These need a writable cgroup v2 tree (as root on this host) and skip with the probe's
reason elsewhere.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import anyio
import pytest
from toolsetd.daemon.cgroup import (
    JOIN_ARGV,
    JOIN_FAILED_EXIT,
    CallCgroup,
    CgroupError,
    CgroupTree,
    Limits,
)


@pytest.fixture
def tree() -> Iterator[CgroupTree]:
    found, reason = CgroupTree.probe("auto")
    if found is None:
        pytest.skip(f"no writable cgroup v2 tree: {reason}")
    try:
        yield found
    finally:
        found.close()


def _cgroup_of(text: str) -> str:
    return next(line[3:] for line in text.splitlines() if line.startswith("0::"))


def _relative(tree: CgroupTree, path: str) -> str:
    mount = str(tree.folder.parent)
    return "/" + os.path.relpath(path, mount) if path != mount else "/"


def test_cgroup_join_shell_moves_the_child_before_exec(tree: CgroupTree) -> None:
    """The joining shell puts itself in the cgroup and then runs the tool there."""
    call = tree.create(Limits(), "set 't'")
    argv = [*JOIN_ARGV, call.procs, "/bin/cat", "/proc/self/cgroup"]
    out = subprocess.run(argv, capture_output=True, check=True).stdout.decode()
    assert _cgroup_of(out).endswith("/" + Path(call.path).name)
    assert _cgroup_of(out).endswith(_relative(tree, call.path).split("/", 2)[-1])
    call.discard()


def test_cgroup_join_shell_refuses_to_run_outside(tmp_path: Path) -> None:
    """A cgroup that cannot be entered: the tool never runs; exit 125 and the marker."""
    marker = tmp_path / "ran"
    argv = [*JOIN_ARGV, str(tmp_path / "gone" / "cgroup.procs"), "/bin/touch", str(marker)]
    done = subprocess.run(argv, capture_output=True, check=False)
    assert done.returncode == JOIN_FAILED_EXIT
    assert done.stderr.startswith(b"toolsetd-join: cannot enter the cgroup")
    assert not marker.exists()


def test_cgroup_entered_spawns_inside_and_returns(tree: CgroupTree) -> None:
    """With the daemon stepped in, the child is born in the cgroup; the daemon goes back."""
    before = Path("/proc/self/cgroup").read_text()
    call = tree.create(Limits(), "set 't'")
    assert tree.can_enter
    with tree.entered(call):
        child = subprocess.Popen(
            ["/bin/cat", "/proc/self/cgroup"], stdout=subprocess.PIPE
        )
    out = child.communicate()[0].decode()
    assert _cgroup_of(out).endswith("/" + Path(call.path).name)
    assert Path("/proc/self/cgroup").read_text() == before
    call.discard()


def test_cgroup_entered_a_cgroup_removed_from_outside_says_so(tree: CgroupTree) -> None:
    """The call's cgroup removed from outside between its making and the spawn (a cleanup
    that sweeps the daemon's folder: an emptied spare, a new one, can go at any moment):
    stepping in failed with a bare OSError, and the call with "The external process
    failed to start: No such device". It is a ``CgroupError`` naming the cgroup, the
    daemon stays where it was, and nothing is spawned."""
    before = Path("/proc/self/cgroup").read_text()
    call = tree.create(Limits(), "set 't'")
    assert tree.can_enter
    Path(call.path).rmdir()
    with pytest.raises(CgroupError) as caught, tree.entered(call):
        pytest.fail("the block ran")  # pragma: no cover
    assert call.path in str(caught.value)
    assert "removed" in str(caught.value) or "cannot be entered" in str(caught.value)
    assert Path("/proc/self/cgroup").read_text() == before
    assert tree.can_enter
    call.discard()


@pytest.mark.anyio
async def test_cgroup_a_call_cgroup_removed_once_emptied_is_not_populated(
    tree: CgroupTree,
) -> None:
    """The tool has exited and a cleanup removed its emptied cgroup before the daemon read
    it (the kernel removes only an empty cgroup). Its kept ``cgroup.events`` no longer
    reads, and that was taken for "still populated": ``finish`` sent a kill to nobody and
    waited out the whole drain bound (2 s) before answering the call, and a sandboxed
    call's id stayed recorded. A cgroup that is gone holds no process."""
    call = tree.create(Limits(), "set 't'")
    with tree.entered(call):
        child = subprocess.Popen(["/bin/true"])
    assert child.wait(10) == 0
    with anyio.fail_after(10):  # its exit leaves the cgroup empty
        while Path(call.procs).read_text().strip():
            await anyio.sleep(0.01)
    Path(call.path).rmdir()
    assert call.populated() is False
    with anyio.fail_after(10):
        await call.finish()
    assert not os.path.exists(call.path)


@pytest.mark.anyio
async def test_cgroup_finish_kills_everything_and_removes_it(tree: CgroupTree) -> None:
    """finish: cgroup.kill reaches a setsid'd process, then the cgroup is read and removed."""
    call = tree.create(Limits(), "set 't'")
    with tree.entered(call):
        child = subprocess.Popen(
            ["/bin/sh", "-c", "setsid sleep 1000 & sleep 1000"], start_new_session=True
        )
    with anyio.fail_after(10):
        while len(Path(call.procs).read_text().split()) < 2:
            await anyio.sleep(0.01)
        usage = await call.finish()
    child.wait(5)
    assert child.returncode == -9
    # Removed, or kept empty as a spare (a call without limits, no memory controller).
    assert not os.path.exists(call.path) or Path(call.procs).read_text() == ""
    assert os.path.exists(call.path) == tree.reuse
    assert usage.cpu_usec is not None
    assert usage.oom_killed is False


def _spawn_in(tree: CgroupTree, call: CallCgroup, argv: list[str]) -> subprocess.Popen[bytes]:
    with tree.entered(call):
        return subprocess.Popen(argv, start_new_session=True)


def _fds_under(folder: str) -> list[str]:
    """The paths of this process's open descriptors inside ``folder``."""
    found = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith(folder + "/"):
            found.append(target)
    return found


_BURN = ["/bin/sh", "-c", "i=0; while [ $i -lt 100000 ]; do i=$((i+1)); done"]


@pytest.mark.anyio
async def test_cgroup_spare_is_reused_and_reports_only_its_own_call(tree: CgroupTree) -> None:
    """A spare cgroup's next call reports its own CPU time, and the spent one kills nothing.

    Without the memory controller a finished call's cgroup (no limits) is the next call's;
    with it every call gets a new one.
    """
    first = tree.create(Limits(), "set 't'")
    _spawn_in(tree, first, _BURN).wait(30)
    burned = await first.finish()
    assert burned.cpu_usec is not None and burned.cpu_usec > 20_000
    second = tree.create(Limits(), "set 't'")
    assert (second.path == first.path) == tree.reuse
    if not tree.reuse:
        assert not os.path.exists(first.path)
    sleeper = _spawn_in(tree, second, ["/bin/sleep", "1000"])
    try:
        first.kill()  # spent: it must not reach the cgroup's new call
        first.signal_all(9)
        with pytest.raises(subprocess.TimeoutExpired):
            sleeper.wait(0.2)
        usage = await second.finish()
        assert sleeper.wait(5) == -9
    finally:
        sleeper.kill()
        sleeper.wait()
    assert usage.cpu_usec is not None
    assert usage.cpu_usec < burned.cpu_usec // 2


@pytest.mark.anyio
async def test_cgroup_grace_signal_never_reaches_the_daemon_stuck_inside(tmp_path: Path) -> None:
    """A daemon that could not leave a call's cgroup (``entered``, ``daemon_inside``) is
    listed in its ``cgroup.procs``: ``kill`` spares such a cgroup, and the grace SIGTERM of
    a sandboxed call's timeout (``terminate`` with ``members=pids``) must spare the daemon
    too; it reached the daemon, which then shut down. (A folder stands in for the cgroup.)"""
    from types import SimpleNamespace

    from toolsetd.daemon.ending import terminate

    leader = subprocess.Popen(["/bin/sleep", "30"], start_new_session=True)
    member = subprocess.Popen(["/bin/sleep", "30"])
    try:
        (tmp_path / "cgroup.procs").write_text(f"{leader.pid}\n{os.getpid()}\n{member.pid}\n")
        stuck = SimpleNamespace(daemon_inside=str(tmp_path))
        call = CallCgroup(stuck, str(tmp_path))  # type: ignore[arg-type]
        assert call.pids() == [leader.pid, member.pid]
        received: list[int] = []
        previous = signal.signal(signal.SIGTERM, lambda signum, frame: received.append(signum))
        try:
            await terminate(leader.pid, None, 0.05, call.kill, spare_leader=True, members=call.pids)
        finally:
            signal.signal(signal.SIGTERM, previous)
        assert received == []
        assert member.wait(5) == -signal.SIGTERM  # the call's own process got it
    finally:
        for proc in (leader, member):
            proc.kill()
            proc.wait()


@pytest.mark.anyio
async def test_cgroup_grace_signal_reaches_only_processes_still_listed(tmp_path: Path) -> None:
    """The grace SIGTERM of a sandboxed call's timeout went by pid to what ``cgroup.procs``
    listed a moment before: a process gone since, whose pid another process outside the
    call has now, got it. The pids are now pinned by pidfds and the list read again: the
    call's processes get the signal, a pid no longer listed does not. (A folder stands in
    for the cgroup; the stranger is a live process whose pid the list drops after the
    first read, as when its pid was reused: real pid reuse cannot be forced here.)"""
    from types import SimpleNamespace

    from toolsetd.daemon.ending import terminate

    leader = subprocess.Popen(["/bin/sleep", "30"], start_new_session=True)
    members = [subprocess.Popen(["/bin/sleep", "30"]) for _ in range(3)]
    stranger = subprocess.Popen(["/bin/sleep", "30"], start_new_session=True)
    procs = tmp_path / "cgroup.procs"
    try:
        ours = [leader.pid, *(m.pid for m in members)]
        procs.write_text("".join(f"{pid}\n" for pid in [*ours, stranger.pid]))
        call = CallCgroup(SimpleNamespace(daemon_inside=None), str(tmp_path))  # type: ignore[arg-type]

        def listed() -> list[int]:
            found = call.pids()
            procs.write_text("".join(f"{pid}\n" for pid in ours))  # the stranger is not ours
            return found

        await terminate(leader.pid, None, 0.05, None, spare_leader=True, members=listed)
        for member in members:
            assert member.wait(5) == -signal.SIGTERM  # every process of the call got it
        assert stranger.poll() is None  # the pid no longer listed got nothing
    finally:
        for proc in (leader, *members, stranger):
            proc.kill()
            proc.wait()


@pytest.mark.anyio
async def test_cgroup_grace_signal_without_pidfds_goes_by_pid_as_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where pidfd_open is refused (Linux before 5.3, a seccomp filter), the grace SIGTERM
    still reaches every process of the call, by pid."""
    import errno
    from types import SimpleNamespace

    from toolsetd.daemon.ending import terminate

    def refused(pid: int, flags: int = 0) -> int:
        raise OSError(errno.ENOSYS, os.strerror(errno.ENOSYS))

    leader = subprocess.Popen(["/bin/sleep", "30"], start_new_session=True)
    members = [subprocess.Popen(["/bin/sleep", "30"]) for _ in range(2)]
    try:
        pids = [leader.pid, *(m.pid for m in members)]
        (tmp_path / "cgroup.procs").write_text("".join(f"{pid}\n" for pid in pids))
        call = CallCgroup(SimpleNamespace(daemon_inside=None), str(tmp_path))  # type: ignore[arg-type]
        monkeypatch.setattr(os, "pidfd_open", refused)
        await terminate(leader.pid, None, 0.05, None, spare_leader=True, members=call.pids)
        for member in members:
            assert member.wait(5) == -signal.SIGTERM
    finally:
        for proc in (leader, *members):
            proc.kill()
            proc.wait()


@pytest.mark.parametrize("free", [1, 2, 3, 4])
def test_cgroup_grace_signal_reaches_every_process_when_descriptors_run_out(
    tmp_path: Path, free: int
) -> None:
    """A daemon with fewer descriptors free than the call has processes pinned what it
    could, and then could not read the list again (no descriptor left to open it): the
    processes it had pinned got no SIGTERM at all. Every process of the call gets it."""
    import resource
    from types import SimpleNamespace

    from toolsetd.daemon.pidsignal import signal_listed

    leader = subprocess.Popen(["/bin/sleep", "30"], start_new_session=True)
    members = [subprocess.Popen(["/bin/sleep", "30"]) for _ in range(6)]
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    fillers: list[int] = []
    try:
        pids = [leader.pid, *(m.pid for m in members)]
        (tmp_path / "cgroup.procs").write_text("".join(f"{pid}\n" for pid in pids))
        call = CallCgroup(SimpleNamespace(daemon_inside=None), str(tmp_path))  # type: ignore[arg-type]
        resource.setrlimit(
            resource.RLIMIT_NOFILE, (max(len(os.listdir("/proc/self/fd")) + 64, 128), hard)
        )
        try:
            while True:
                fillers.append(os.dup(0))
        except OSError:
            pass
        for _ in range(free):  # fewer descriptors free than the call has members
            os.close(fillers.pop())
        signal_listed(call.pids, signal.SIGTERM, spare=leader.pid)
        for fd in fillers:
            os.close(fd)
        fillers.clear()
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
        for member in members:
            assert member.wait(5) == -signal.SIGTERM
        assert leader.poll() is None  # spared
    finally:
        for fd in fillers:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
        for proc in (leader, *members):
            proc.kill()
            proc.wait()


def test_cgroup_limit_without_controller_is_refused(tree: CgroupTree) -> None:
    """A limit the tree has no controller for is refused with a message naming it."""
    missing = [name for name in ("memory", "pids", "cpu") if name not in tree.controllers]
    if not missing:
        pytest.skip("every controller is enabled here")
    limits = {"memory": Limits(memory_max=1 << 30), "pids": Limits(pids_max=9),
              "cpu": Limits(cpu_max="50000 100000")}[missing[0]]
    problem = tree.check(limits, "set 'x'")
    assert problem is not None
    assert f"need the {missing[0]} controller" in problem


def test_cgroup_probe_sweeps_a_dead_daemons_folder(tree: CgroupTree) -> None:
    """A toolsetd-<pid> folder of a pid that is gone: its processes are killed, it is
    removed; the folder of a live pid is left alone. In a base of the test's own: at the
    shared one, a daemon another test started swept the dead folder between its mkdir and
    the orphan's move into it (the write failed, FileNotFoundError)."""
    base = tree.folder.parent / f"toolsetd-sweep-{os.getpid()}"  # no daemon's to sweep
    dead = base / "toolsetd-4194303"  # above any pid_max default: never a live process here
    orphan = subprocess.Popen(["/bin/sleep", "1000"], start_new_session=True)
    keeper = subprocess.Popen(["/bin/sleep", "1000"], start_new_session=True)
    live = base / f"toolsetd-{keeper.pid}"
    again = None
    try:
        (dead / "c1").mkdir(parents=True)
        (dead / "c1" / "cgroup.procs").write_text(str(orphan.pid))
        (live / "c1").mkdir(parents=True)
        (live / "c1" / "cgroup.procs").write_text(str(keeper.pid))
        again, reason = CgroupTree.probe(str(base))
        assert again is not None, reason
        assert orphan.wait(5) == -9
        assert not dead.exists()
        assert keeper.poll() is None
        assert (live / "c1").exists()
    finally:
        if again is not None:
            again.close()
        for process in (orphan, keeper):
            process.kill()
            process.wait()
        for folder in (dead / "c1", dead, live / "c1", live, base):
            with contextlib.suppress(OSError):
                folder.rmdir()


def test_cgroup_a_stale_folder_of_our_own_name_is_made_afresh(tree: CgroupTree) -> None:
    """A folder with our name is a dead process's that had our pid (pids wrap), or our
    namespace inode and pid (a restarted container: the kernel hands the lowest free inode
    out again, and the daemon is its pid 2 each time). It was taken over as it was, with
    the call cgroups (spares too) of the daemon that died: the first call's ``c1`` existed,
    and every call failed with "File exists". Its processes are killed and it is made
    again."""
    base = tree.folder.parent / f"toolsetd-stale-{os.getpid()}"  # no daemon's to sweep
    mine = base / f"toolsetd-{os.getpid()}"
    orphan = subprocess.Popen(["/bin/sleep", "1000"], start_new_session=True)
    found = None
    try:
        (mine / "c1").mkdir(parents=True)
        (mine / "c1" / "cgroup.procs").write_text(str(orphan.pid))
        found, reason = CgroupTree.probe(str(base))
        assert found is not None, reason
        assert orphan.wait(5) == -9
        call = found.create(Limits(), "set 't'")
        assert Path(call.procs).exists()
    finally:
        if found is not None:
            found.close()
        orphan.kill()
        orphan.wait()
        for folder in (mine / "c1", mine, base):
            with contextlib.suppress(OSError):
                folder.rmdir()


_PROBE_IN_A_NAMESPACE = """
from toolsetd.daemon.cgroup import CgroupTree
found, why = CgroupTree.probe("auto")
assert found is not None, why
print(found.folder.name)
found.close()
"""


def test_cgroup_a_daemon_in_another_pid_namespace_leaves_ours_alone(tree: CgroupTree) -> None:
    """A daemon in another PID namespace (a container that sees the host's cgroups,
    ``unshare --pid``) took every ``toolsetd-<pid>`` folder whose pid it could not see for
    a dead daemon's, and killed its calls: ours, whose pid means nothing there. It names
    and sweeps the folders of its own namespace alone."""
    import shutil

    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("needs root and unshare --pid")
    sleeper = subprocess.Popen(["/bin/sleep", "1000"], start_new_session=True)
    call = tree.folder / "c-namespace-test"
    call.mkdir()
    try:
        (call / "cgroup.procs").write_text(str(sleeper.pid))
        done = subprocess.run(
            ["unshare", "--pid", "--fork", "--mount-proc", sys.executable, "-c",
             _PROBE_IN_A_NAMESPACE],
            capture_output=True, text=True, timeout=60,
        )
        if done.returncode != 0 and "unshare" in done.stderr:
            pytest.skip(f"unshare --pid failed: {done.stderr.strip()}")
        assert done.returncode == 0, done.stderr
        assert tree.folder.exists(), done.stdout
        assert sleeper.poll() is None  # our call is still running
        name = done.stdout.strip().splitlines()[-1]  # theirs: toolsetd-<namespace>-1
        assert name.startswith("toolsetd-") and name.endswith("-1") and name.count("-") == 2
    finally:
        sleeper.kill()
        sleeper.wait()
        with contextlib.suppress(OSError):
            call.rmdir()


def test_cgroup_probe_named_subtree_and_bad_names(tree: CgroupTree) -> None:
    """A named subtree on cgroup2 is claimed (made when missing); other paths say why not."""
    named = tree.folder.parent / f"toolsetd-named-{os.getpid()}"
    found, reason = CgroupTree.probe(str(named))
    try:
        assert found is not None, reason
        assert found.folder == named / f"toolsetd-{os.getpid()}"
    finally:
        if found is not None:
            found.close()
        named.rmdir()
    missing, reason = CgroupTree.probe("/var/tmp")
    assert missing is None
    assert "is not a folder on a cgroup v2 mount" in reason
    off, reason = CgroupTree.probe("off")
    assert off is None
    assert reason == 'cgroups are off in the config (cgroup = "off")'


def test_cgroup_a_named_subtree_that_leaves_the_mount_by_dot_dot_is_refused(
    tree: CgroupTree, tmp_path: Path
) -> None:
    """``cgroup = "/sys/fs/cgroup/../../tmp/x"`` passed the "on a cgroup v2 mount" check by
    its text: the probe made the folder outside cgroupfs, swept it for dead daemons'
    folders (removing their empty subfolders) and then said the kernel had no
    cgroup.kill. It is judged by the path it names."""
    mount = tree.folder.parent
    outside = tmp_path / "not-a-cgroup"
    escape = str(mount) + "/.." * len(mount.parts) + str(outside)
    found, reason = CgroupTree.probe(escape)
    assert found is None
    assert "is not a folder on a cgroup v2 mount" in reason, reason
    assert not outside.exists()


def test_cgroup_a_named_subtree_removed_from_outside_is_made_again(tree: CgroupTree) -> None:
    """``cgroup = "<path>"``: the probe makes the named folder when it is missing, so a
    cleanup that removed it (with the daemon's folder inside) while the daemon ran had
    every call fail, "cannot be set up: No such file or directory", until a restart. The
    next call makes both again, as the probe did."""
    named = tree.folder.parent / f"toolsetd-named-{os.getpid()}"
    found, reason = CgroupTree.probe(str(named))
    assert found is not None, reason
    try:
        found.create(Limits(), "set 't'").discard()
        found.folder.rmdir()
        named.rmdir()
        call = found.create(Limits(), "set 't'")
        assert Path(call.path).parent == found.folder
        assert (found.folder / "cgroup.kill").exists()
        call.discard()
    finally:
        found.close()
        with contextlib.suppress(OSError):
            named.rmdir()


@pytest.mark.anyio
@pytest.mark.parametrize("poison", ["frozen", "child cgroup"])
async def test_cgroup_a_cgroup_its_tool_changed_is_never_a_spare(
    tree: CgroupTree, poison: str
) -> None:
    """The tool may write its own cgroup's files: a changed cgroup is removed, not reused.

    The next call then gets a new cgroup and runs (a frozen spare would hang it). The
    changed cgroup is a spare already, so the check reads it through the descriptors kept
    from its first call: they must show it as it is now, and be closed with it.
    """
    if not tree.reuse:
        pytest.skip("this tree keeps no spares (it has controllers)")
    warm = tree.create(Limits(), "set 't'")
    _spawn_in(tree, warm, ["/bin/true"]).wait(10)
    await warm.finish()
    first = tree.create(Limits(), "set 't'")
    assert first.path == warm.path
    _spawn_in(tree, first, ["/bin/true"]).wait(10)
    if poison == "frozen":
        Path(first.path, "cgroup.freeze").write_text("1")
    else:
        Path(first.path, "nested").mkdir()
    await first.finish()
    assert _fds_under(first.path) == []  # its kept files are closed with it
    assert first.files.read("cgroup.events") is None  # and never opened again
    second = tree.create(Limits(), "set 't'")
    assert second.path != first.path
    child = _spawn_in(tree, second, ["/bin/true"])
    assert child.wait(5) == 0
    await second.finish()
    # Removed, child cgroup and all (one left behind kept its folder for good, retried by
    # every later call).
    assert not os.path.exists(first.path)


def test_sandboxed_peer_knows_the_cgroups_of_running_sandboxed_calls(
    tree: CgroupTree, tmp_path: Path
) -> None:
    """With --mcp-listen, a sandboxed call that keeps the network has its cgroup recorded
    from ``prepare`` to its end: a TCP peer socket made there is refused, one made
    elsewhere is not. A peer whose cgroup the kernel did not say (it closed first) is
    refused whenever such calls may run, before, during and after one: a connection is
    judged when accepted, which may be long after the call that made it ended. A call
    whose network is denied is not recorded, and beside it an unknown peer is not refused
    on that account."""
    import socket

    from toolsetd.daemon.confinement import Confinement, parse_confinement
    from toolsetd.daemon.mcphttp import McpHttpEndpoint
    from toolsetd.daemon.model import RunnerKind, Source, ToolSet
    from toolsetd.daemon.peercred import PeerPolicy

    ws = tmp_path / "ws"
    ws.mkdir()
    toolset = ToolSet(directory="net", source=Source.PROJECT,
                      path=ws / ".crystal" / "tools" / "net", runner=RunnerKind.EXEC)
    data = (str(tmp_path / "data"), str(ws / ".crystal" / "data"))

    def confinement(network: bool) -> Confinement:
        return Confinement(
            parse_confinement({"project": {"network": network}}), tree, "", "/usr/bin/bwrap",
            "", tmp_path / "home", tmp_path / "home" / ".crystal", http_peers=True,
            no_userns=True,
        )  # fmt: skip

    quiet = confinement(network=False).prepare(toolset, ["/bin/true"], str(ws), data, ())
    assert quiet.sandboxed and quiet.cgroup is not None
    assert tree.sandboxed == {}
    assert confinement(network=False).sandboxed_peer(None) is None
    c = confinement(network=True)
    assert "cannot tell" in (c.sandboxed_peer(None) or "")  # none runs yet: still refused
    prepared = c.prepare(toolset, ["/bin/true"], str(ws), data, ())
    for fd in (*(prepared.status or ()), *(quiet.status or ())):
        os.close(fd)
    assert prepared.cgroup is not None
    own = os.stat(prepared.cgroup.path).st_ino
    assert set(tree.sandboxed) == {own}
    assert "inside a sandboxed call" in (c.sandboxed_peer(own) or "")
    assert c.sandboxed_peer(os.stat(tree.folder).st_ino) is None
    assert "cannot tell" in (c.sandboxed_peer(None) or "")
    # A peer that closed before the lookup is unknown, which the bearer token admits:
    # while such a call runs it may be that call's (one that read the token elsewhere).
    endpoint = McpHttpEndpoint(lambda *_: None, PeerPolicy.default(), "token",
                               sandboxed=c.sandboxed_peer)  # fmt: skip
    with socket.create_server(("127.0.0.1", 0)) as server:
        socket.create_connection(server.getsockname()[:2]).close()
        accepted, _ = server.accept()
        with accepted:
            _, refused = endpoint._admit(accepted)
    assert refused is not None and "cannot tell" in refused.error.message
    anyio.run(prepared.cgroup.finish)
    assert tree.sandboxed == {}
    assert c.sandboxed_peer(own) is None
    assert "cannot tell" in (c.sandboxed_peer(None) or "")  # ended: still refused
    quiet.cgroup.discard()


def test_a_sandboxed_id_left_by_a_drain_that_timed_out_goes_with_its_cgroup(
    tree: CgroupTree,
) -> None:
    """A sandboxed call whose cgroup could not be emptied keeps its id recorded (its
    processes are still the sandbox's) until the cgroup is removed, not for good: an
    id left for good kept refusing MCP peers whose cgroup is unknown."""
    call = tree.create(Limits(), "set 't'")
    call.mark_sandboxed()
    child = subprocess.Popen([*JOIN_ARGV, call.procs, "/bin/sleep", "30"])
    try:
        assert _wait_populated(call)
        call._spend(emptied=False)  # as finish() does when the drain timed out
        tree.remove(call.path)  # busy: into the trash
        assert list(tree.sandboxed.values()) == [call.path]
    finally:
        child.kill()
        child.wait()
    tree._empty_trash()  # as the next call's create() does
    assert tree.sandboxed == {}
    assert not os.path.exists(call.path)


def _wait_populated(call: CallCgroup) -> bool:
    import time

    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if call.pids():
            return True
        time.sleep(0.01)
    return False


def _removed_as_nobody(tree: CgroupTree, path: str) -> tuple[list[int], list[str]]:
    """``tree.remove(path)`` in a forked child running as uid 65534, whom the folder's
    parent refuses (EACCES even to root's folders); its tree's sandboxed ids and trash."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        try:
            os.close(read)
            os.setgroups([])
            os.setgid(65534)
            os.setuid(65534)
            tree.remove(path)
            os.write(write, json.dumps([list(tree.sandboxed), tree._trash]).encode())
        finally:
            os._exit(0)
    os.close(write)
    with os.fdopen(read, "rb") as pipe:
        data = pipe.read()
    os.waitpid(pid, 0)
    ids, trash = json.loads(data)
    return ids, trash


@pytest.mark.parametrize("error", ["ENOTEMPTY", "EACCES"])
def test_a_sandboxed_id_stays_while_its_cgroup_cannot_be_removed(
    tmp_path: Path, error: str
) -> None:
    """Only ENOENT says a call's cgroup is gone: another ``rmdir`` error (permission
    denied, not empty) leaves it there, so a sandboxed call's id stays recorded (a peer
    in it must not pass for no call's) and the removal is retried; once it is gone, the
    id goes. (A folder stands in for the cgroup: the errors are rmdir's own.)"""
    tree = CgroupTree(tmp_path / "tree", frozenset())
    path = tmp_path / "tree" / "c1"
    path.mkdir(parents=True)
    own = os.stat(path).st_ino
    tree.sandboxed[own] = str(path)
    if error == "ENOTEMPTY":
        (path / "left").write_text("")
        tree.remove(str(path))
        ids, trash = list(tree.sandboxed), tree._trash
    else:
        if os.geteuid() != 0:
            pytest.skip("needs root, to run the removal as another user")
        ids, trash = _removed_as_nobody(tree, str(path))
    assert path.is_dir()
    assert ids == [own]
    assert trash == [str(path)]
    (path / "left").unlink(missing_ok=True)
    path.rmdir()  # it went (another way): the retry meets ENOENT
    tree.remove(str(path))
    assert tree.sandboxed == {}
