"""A cgroup v2 per call: its limits, its kill, its peak memory and CPU time.

Theory of operation
-------------------
The daemon needs a cgroup v2 subtree it may write. ``CgroupTree.probe`` finds one:

* ``cgroup = "off"``: none (process groups, as without a writable tree);
* ``cgroup = "<path>"``: the named folder on a cgroup2 mount (created when its parent is
  writable); the operator enables the controllers in its parent;
* ``cgroup = "auto"`` (the default): the daemon's own cgroup, from ``/proc/self/cgroup``,
  when systemd delegated it (``Delegate=yes`` marks it with the ``trusted.delegate`` or
  ``user.delegate`` attribute) or when it is the root of the hierarchy (a container, or
  this host, where the unified hierarchy sits at ``/sys/fs/cgroup/unified``). In a
  delegated cgroup the daemon first moves itself into the leaf ``daemon`` (cgroup v2
  lets a cgroup that hands controllers to its children hold no process) and enables the
  controllers it was given for its children.

Under that base the daemon makes its own folder ``toolsetd-<pid>`` (so two daemons sharing
a base never touch each other's calls; a folder of a pid that is gone is a dead daemon's,
and is killed and removed at start, as is a folder of its own name, left by a dead process
that had its pid or namespace) with every controller of ``memory``, ``pids``, ``cpu`` it
can get enabled for its children, and one child ``c<n>`` per call. Between calls nothing
holds that folder, so it can be removed from outside while the daemon runs; the next call
makes it again (``_remake``) rather than failing, as every call did until a restart. A pid
means something in its PID namespace only: a daemon in another one (a container that sees
the host's cgroups, ``unshare --pid``) names its folder
``toolsetd-<namespace inode>-<pid>``, and each daemon sweeps the folders of its own namespace alone
(``_folder_name``). Named by pid alone, such a daemon took every host daemon's folder for
a dead one's and killed their calls, and two daemons of pid 2 in two containers shared one
folder.

A call's child is in its cgroup before the tool's first instruction, one of two ways:

* **The daemon steps in** (``CgroupTree.entered``): it writes ``0`` (itself, all its
  threads) to the call's ``cgroup.procs``, spawns the child, which is born there, and
  writes itself back to its own cgroup. Two writes, no extra process: the default.
  Not for a set with ``memory.max`` or ``pids.max``: for that moment the daemon's threads
  and the pages it touches would count against the call's limits (and an OOM kill inside
  could pick the daemon).
* **The child joins by itself**: the runner spawns
  ``/bin/sh -c 'echo 0 >"$1" || exit 125; shift; exec "$@"'`` (``JOIN_ARGV``) with the
  cgroup's ``cgroup.procs`` and the tool's argv. ``echo`` is a builtin, so the write
  (which moves the writer, pid 0 meaning "me") happens in the shell itself, and ``exec``
  then replaces it with the tool, already inside. It costs one ``exec`` of the shell.

Either way a ``fork`` or ``setsid`` the tool does is inside too. Python cannot reach
``clone3(CLONE_INTO_CGROUP)`` (glibc's ``pidfd_spawn`` with a cgroup attribute arrived in
2.39, ``os.posix_spawn`` has no such attribute), and moving the child from the daemon
after the spawn races with the tool's first ``fork``. ``bench/bench_confine.py`` measures
both ways against a blocker the daemon moves and then releases.

At the end of the call (the leader exited, timeout, cancel, shutdown) ``CallCgroup.kill``
writes ``cgroup.kill``: every process in it gets ``SIGKILL`` at once, ``setsid``'d
grandchildren included. ``finish`` then waits (bounded) until ``cgroup.events`` says
``populated 0``, reads ``memory.peak``, ``cpu.stat``'s ``usage_usec`` and
``memory.events``' ``oom_kill``, and removes the folder (a folder still busy is retried
at the next call and at close). A finished call's ``CallCgroup`` is spent: its ``kill``
and ``signal_all`` do nothing from then on.

**Spare cgroups.** In a tree with no controllers enabled for the calls (a cgroup v2
hierarchy whose controllers are bound to v1, as on this project's benchmark host, or a
delegation without them), a call gets an emptied cgroup of an earlier call when one is
spare (up to ``SPARE_MAX`` are kept, empty, instead of removed). Making and removing a
cgroup, and the kernel's set-up of the first process in a new one, cost ~65 µs per call,
a third of what a cgroup adds to an invoke. A cgroup is kept only if it is as ``create``
made it (``CallCgroup._clean``: empty, not frozen, no child cgroups, type ``domain``),
since the tool may have written its files. What
it reports stays the call's own: ``cpu.stat``'s ``usage_usec`` is counted from what it
read when the last call finished. With any controller every call gets a new cgroup:
``memory.peak`` cannot be restarted on every kernel, the page cache an earlier call left
stays charged, and a tool could have written its own ``pids.max`` or ``cpu.max``.

**Kept descriptors.** The files read or written on every call (``cgroup.procs``,
``cgroup.events``, ``cpu.stat``, ``cgroup.stat``, ``cgroup.type``) are opened once per
cgroup and kept while it lives, a spare's with it (``_Files``): a ``pread`` at offset 0
renders a cgroupfs file afresh, and each ``write`` to a kept ``cgroup.procs`` is one
command. That is ~1 µs a file instead of ~7 µs to open, read and close it, and halves the
cgroup's own CPU per call (the stepping in and out remains). The daemon's own
``cgroup.procs`` is opened with the tree (if it cannot be, the daemon never steps in). A
cgroup is made only when no spare is left, so the running calls' cgroups and the spares
together never outnumber the most calls that ran at once: at most five descriptors for
each, 320 with the default ``--max-running 64``. A ``_Files`` once closed opens nothing
again: a read gives None, a write fails.

Limits (``Limits``) are written before the child starts: ``memory.max`` (and
``memory.swap.max = 0`` and ``memory.oom.group = 1``, so the cap is real and an OOM kill
takes the whole call), ``pids.max`` and ``cpu.max``. A limit whose controller the tree
does not have raises ``CgroupError``: the call fails closed instead of running unlimited.

Why one module of this size: parsing the limits, creating, joining, reading and removing
a call's cgroup are one lifecycle over one tree; each step's failure mode (fail closed)
is easier to check in one place.
"""

from __future__ import annotations

import contextlib
import errno
import itertools
import os
import re
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import anyio
import structlog

from .exhaustion import SHORT_OF_ROOM, ProbeShort
from .logs import Throttle
from .mountinfo import parse_mountinfo
from .pidsignal import signal_listed

__all__ = [
    "CONTROLLERS",
    "JOIN_ARGV",
    "JOIN_FAILED_EXIT",
    "CallCgroup",
    "CallUsage",
    "CgroupError",
    "CgroupTree",
    "Limits",
    "cgroup2_mounts",
    "daemon_cgroup",
    "parse_limits",
]

log = structlog.get_logger("toolsetd.cgroup")

#: The controllers a call's limits use.
CONTROLLERS: tuple[str, ...] = ("memory", "pids", "cpu")
#: The exit status of the joining shell when it cannot enter the cgroup.
JOIN_FAILED_EXIT = 125
#: The argv prefix that moves the child into the cgroup named by the next argument, then
#: executes the rest. The tool's own argv follows the ``cgroup.procs`` path.
JOIN_ARGV: tuple[str, ...] = (
    "/bin/sh",
    "-c",
    '{ echo 0 >"$1"; } 2>/dev/null || { echo "toolsetd-join: cannot enter the cgroup $1" >&2; '
    f'exit {JOIN_FAILED_EXIT}; }}; shift; exec "$@"',
    "toolsetd-join",
)

_PREFIX = "toolsetd-"
#: The initial PID namespace's inode (the kernel's ``PROC_PID_INIT_INO``): a daemon there
#: names its folder by its pid alone.
_INITIAL_PID_NAMESPACE = 0xEFFFFFFC
#: Emptied call cgroups kept for reuse (see "Spare cgroups" above).
SPARE_MAX = 64
_DRAIN_BOUND_SECONDS = 2.0
_TRASH_MAX = 256
_SIZE = re.compile(r"^\s*(\d+)\s*([kKmMgGtT]?)[iI]?[bB]?\s*$")
_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
_PERIOD_USEC = 100_000
#: The largest ``memory-max`` taken (8388607T, under 2^63 bytes: ``memory.max`` is parsed
#: into 64 bits, and a larger number wraps or is refused at every call).
_MEMORY_MAX_MOST = 8388607 << 40
#: How many times ``_remake`` makes the folder again when it goes while being set up.
_REMAKE_TRIES = 3
#: The kernel's ``PID_MAX_LIMIT``: ``pids.max`` refuses more (EINVAL at every call).
_PIDS_MAX_MOST = 4194304


class CgroupError(Exception):
    """A cgroup that cannot be set up; the message names the setting and the fix."""


@dataclass(frozen=True, slots=True)
class Limits:
    """One set's cgroup limits (None: no limit).

    Attributes:
        memory_max: Bytes (``memory.max``).
        pids_max: Tasks (``pids.max``).
        cpu_max: ``cpu.max`` text, ``"<quota> <period>"`` in microseconds.
    """

    memory_max: int | None = None
    pids_max: int | None = None
    cpu_max: str | None = None

    def needs(self) -> tuple[str, ...]:
        """The controllers these limits need."""
        wanted = (
            ("memory", self.memory_max),
            ("pids", self.pids_max),
            ("cpu", self.cpu_max),
        )
        return tuple(name for name, value in wanted if value is not None)

    def describe(self) -> dict[str, object]:
        """The limits as the config spells them (for ``classify`` and logs)."""
        out: dict[str, object] = {}
        if self.memory_max is not None:
            out["memoryMax"] = self.memory_max
        if self.pids_max is not None:
            out["pidsMax"] = self.pids_max
        if self.cpu_max is not None:
            out["cpuMax"] = self.cpu_max
        return out


def parse_limits(table: dict[str, object], where: str) -> Limits:
    """Read ``memory-max``, ``pids-max`` and ``cpu-max`` of one config table.

    Args:
        table: The table (other keys are ignored here).
        where: The table's name, for messages (``sets.lint``).

    Raises:
        ValueError: A value of the wrong shape; the message names the key and the fix.
    """
    memory = table.get("memory-max")
    pids = table.get("pids-max")
    cpu = table.get("cpu-max")
    memory_max: int | None = None
    if memory is not None:
        match = _SIZE.match(str(memory)) if isinstance(memory, (int, str)) else None
        if match is None or isinstance(memory, bool):
            raise ValueError(
                f"{where}.memory-max: must be bytes as an integer or a size such as '512M' "
                f"or '2G'; got {memory!r}."
            )
        memory_max = int(match.group(1)) * _UNITS[match.group(2).lower()]
        if memory_max < 1 << 20:
            raise ValueError(f"{where}.memory-max: must be at least 1M; got {memory!r}.")
        if memory_max > _MEMORY_MAX_MOST:  # past 64 bits the kernel's parse wraps
            raise ValueError(
                f"{where}.memory-max: must be at most 8388607T; got {memory!r} (leave it "
                "out for no limit)."
            )
    if pids is not None and (
        not isinstance(pids, int) or isinstance(pids, bool) or not 1 <= pids <= _PIDS_MAX_MOST
    ):
        raise ValueError(
            f"{where}.pids-max: must be an integer from 1 to {_PIDS_MAX_MOST} (the kernel's "
            f"most); got {pids!r}."
        )
    cpu_max: str | None = None
    if cpu is not None:
        if isinstance(cpu, bool) or not isinstance(cpu, (int, float)) or not 0.01 <= cpu <= 1024:
            raise ValueError(
                f"{where}.cpu-max: must be a number of CPUs between 0.01 and 1024 (0.5 is half "
                f"a core); got {cpu!r}."
            )
        cpu_max = f"{round(cpu * _PERIOD_USEC)} {_PERIOD_USEC}"
    return Limits(memory_max, pids if isinstance(pids, int) else None, cpu_max)


@dataclass(frozen=True, slots=True)
class CallUsage:
    """What one call's cgroup used (None where the kernel does not tell).

    Attributes:
        peak_memory_bytes: ``memory.peak``.
        cpu_usec: ``cpu.stat`` ``usage_usec`` (user + system).
        oom_killed: ``memory.events`` counted an OOM kill.
    """

    peak_memory_bytes: int | None = None
    cpu_usec: int | None = None
    oom_killed: bool = False


# Raw descriptors, not open(): each call's cgroup is read and written several times per
# call, and a text-mode open() costs ~10-20 µs of Python before the syscall.


def _read(path: str) -> str | None:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        chunks = []
        while chunk := os.read(fd, 65536):
            chunks.append(chunk)
    except OSError:
        return None
    finally:
        os.close(fd)
    # os.fsdecode, not ASCII: /proc/self/mountinfo and /proc/self/cgroup hold paths, and a
    # mount point or cgroup named in any other bytes (/mnt/café) must not stop the daemon.
    return os.fsdecode(b"".join(chunks))


def _write(path: str, text: str) -> None:
    """Write ``text`` in one ``write`` (cgroupfs takes each write as one command)."""
    fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
    try:
        os.write(fd, text.encode("ascii"))
    finally:
        os.close(fd)


class _Files:
    """A call cgroup's files read or written on every call, each opened once.

    The descriptors live as long as the cgroup (a spare keeps them for the next call). A
    ``pread`` at offset 0 of a kept cgroupfs file gives it afresh (kernfs renders it again)
    and each ``write`` to a kept ``cgroup.procs`` is one command: ~1 µs each, against
    ~7 µs to open, read and close the file every time.
    """

    __slots__ = ("closed", "fds", "folder")

    def __init__(self, folder: str) -> None:
        self.folder = folder
        self.fds: dict[str, int] = {}
        self.closed = False

    def _fd(self, name: str, flags: int) -> int:
        fd = self.fds.get(name)
        if fd is None:
            if self.closed:  # the cgroup is gone or another call's: never reopen
                raise OSError(errno.EBADF, "the cgroup's files are closed", self.folder)
            fd = self.fds[name] = os.open(os.path.join(self.folder, name), flags | os.O_CLOEXEC)
        return fd

    def read(self, name: str) -> str | None:
        """The file's text (its first 64 KiB: the files read this way are a few lines)."""
        try:
            return os.pread(self._fd(name, os.O_RDONLY), 65536, 0).decode("ascii")
        except OSError:
            return None

    def open_for_writing(self, name: str) -> None:
        """Open ``name`` now (raises ``OSError``), so that a later ``write`` need not."""
        self._fd(name, os.O_WRONLY)

    def write(self, name: str, text: str) -> None:
        """One ``write`` of ``text`` (raises ``OSError``, as ``_write``)."""
        os.write(self._fd(name, os.O_WRONLY), text.encode("ascii"))

    def close(self) -> None:
        self.closed = True
        fds, self.fds = self.fds, {}
        for fd in fds.values():
            try:
                os.close(fd)
            except OSError:
                pass


def _field(text: str | None, name: str) -> int | None:
    if text is None:
        return None
    for line in text.splitlines():
        key, _, value = line.partition(" ")
        if key == name and value.strip().isdigit():
            return int(value)
    return None


def cgroup2_mounts() -> list[str]:
    """Where cgroup v2 is mounted, as ``/proc/self/mountinfo`` says."""
    text = _read("/proc/self/mountinfo") or ""
    return [point for _, _, point, _, kind in parse_mountinfo(text) if kind == "cgroup2"]


def _on_cgroup2(path: Path, mounts: list[str]) -> bool:
    text = str(path)
    return any(text == m or text.startswith(m.rstrip("/") + "/") for m in mounts)


def _own_path() -> str | None:
    """The daemon's cgroup v2 path, from the root of its cgroup namespace, as the ``0::``
    line of ``/proc/self/cgroup`` names it (None: no such line). Lines end at ``"\n"``
    alone: the kernel does not escape a cgroup's name, which may hold U+2028 or ``"\r"``.
    """
    text = _read("/proc/self/cgroup") or ""
    return next((line[3:] for line in text.split("\n") if line.startswith("0::")), None)


def _own_folders() -> list[tuple[Path, bool]]:
    """Where the cgroup v2 mounts show the daemon's own cgroup: each folder, and whether it
    is the mount point itself (the root of what that mount shows).

    ``/proc/self/cgroup`` names the cgroup from the root of the daemon's cgroup namespace,
    and a mount shows the cgroup its ``mountinfo`` root names (``/..`` where it lies above
    that namespace's root): the folder is the mount point and the rest of the path below
    that root. Joined to any mount point, a daemon outside its namespace's root
    (``0::/..``, as ``nsenter --cgroup`` leaves one) named a folder above the mount
    (``/sys/fs/cgroup``), and one in a namespace whose root is not the mount's (a
    container's, with the host's mount) a cgroup that is not its own: at ``0::/``, the
    hierarchy's root, where the calls' tree was made and where the daemon "went back"
    after a spawn, leaving its own cgroup and its limits.
    """
    relative = _own_path()
    if relative is None or ".." in relative.split("/"):
        return []
    found = []
    for _, root, point, _, kind in parse_mountinfo(_read("/proc/self/mountinfo") or ""):
        if kind != "cgroup2" or ".." in root.split("/"):
            continue
        top, path = root.rstrip("/") + "/", relative.rstrip("/") + "/"
        if path.startswith(top):  # at or below this mount's root
            rest = path[len(top) :].strip("/")
            found.append((Path(point, rest) if rest else Path(point), not rest))
    return found


def _own_cgroup() -> Path | None:
    """The daemon's own cgroup folder (where it returns after a spawn), if it can be found."""
    for folder, _ in _own_folders():
        if (folder / "cgroup.procs").exists() and os.access(folder / "cgroup.procs", os.W_OK):
            return folder
    return None


def daemon_cgroup() -> str | None:
    """The daemon's own cgroup v2 folder, where calls without a cgroup of their own run.

    None at the root of the hierarchy (it has no limits to read, and showing it would show
    every cgroup) or where no cgroup v2 mount shows it (``_own_folders``): a daemon outside
    its namespace's root, joined to a mount, named a folder above it, which sandboxed
    calls were shown again with every cgroup in it.
    """
    for folder, at_root in _own_folders():
        if not at_root and folder.is_dir():
            return str(folder)
    return None


def _folder_name(pid: int) -> str:
    """The daemon's folder under the base: ``toolsetd-<pid>`` in the initial PID namespace,
    ``toolsetd-<namespace inode>-<pid>`` in any other (where pids repeat those of the host
    and of other containers, and say nothing of their processes)."""
    try:
        namespace = os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        namespace = _INITIAL_PID_NAMESPACE  # no /proc/self/ns: as before
    if namespace == _INITIAL_PID_NAMESPACE:
        return f"{_PREFIX}{pid}"
    return f"{_PREFIX}{namespace}-{pid}"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _kill_tree(folder: str) -> None:
    """Kill everything in ``folder`` and below, then remove the folders (best effort).

    Blocking, bounded: for start-up and stop only.
    """
    with contextlib.suppress(OSError):
        _write(os.path.join(folder, "cgroup.kill"), "1")
    deadline = time.monotonic() + _DRAIN_BOUND_SECONDS
    events = os.path.join(folder, "cgroup.events")
    while _field(_read(events), "populated") == 1 and time.monotonic() < deadline:
        time.sleep(0.005)
    for root, dirs, _ in os.walk(folder, topdown=False):
        for name in dirs:
            with contextlib.suppress(OSError):
                os.rmdir(os.path.join(root, name))
    with contextlib.suppress(OSError):
        os.rmdir(folder)


class CallCgroup:
    """One call's cgroup."""

    __slots__ = (
        "cpu_before",
        "emptied",
        "files",
        "path",
        "procs",
        "reusable",
        "sandbox_id",
        "spent",
        "tree",
    )

    def __init__(
        self,
        tree: CgroupTree,
        path: str,
        *,
        reusable: bool = False,
        cpu_before: int = 0,
        files: _Files | None = None,
    ) -> None:
        self.tree = tree
        self.path = path
        self.procs = os.path.join(path, "cgroup.procs")
        self.files = files if files is not None else _Files(path)
        self.reusable = reusable  # no limits written: it may be a later call's spare
        self.cpu_before = cpu_before  # usage_usec when this call got it (a spare's)
        self.spent = False  # finished or discarded: the cgroup may be another call's now
        self.emptied = False  # seen empty once: nothing can enter it again by itself
        self.sandbox_id: int | None = None  # its id, while a sandboxed call has it

    def kill(self) -> None:
        """SIGKILL every process in the cgroup at once (never one the daemon is stuck in)."""
        if self.spent or self.tree.daemon_inside == self.path:
            return
        try:
            _write(os.path.join(self.path, "cgroup.kill"), "1")  # rare: not kept open
        except OSError:
            # No cgroup.kill (kernel < 5.14; the probe refuses such a tree) or gone.
            signal_listed(self._procs, signal.SIGKILL)

    def signal_all(self, sig: int) -> None:
        """Send ``sig`` to every process in the cgroup (the grace signal of a timeout)."""
        signal_listed(self.pids, sig)

    def _procs(self) -> list[int]:
        """Every pid ``cgroup.procs`` lists now."""
        return [int(line) for line in (_read(self.procs) or "").split() if line.isdigit()]

    def pids(self) -> list[int]:
        """The processes in the cgroup now (none once it is spent), never the daemon.

        The daemon stands in a call's cgroup while it spawns there (``CgroupTree.entered``),
        and stays when it cannot leave (``daemon_inside``): a signal meant for the call's
        processes (the grace ``SIGTERM`` of a timeout) must not reach it.
        """
        if self.spent:
            return []
        me = os.getpid()
        return [pid for pid in self._procs() if pid != me]

    def mark_sandboxed(self) -> None:
        """Record that a sandboxed call runs here, until it ends (``CgroupTree.sandboxed``).

        A socket keeps the cgroup it was created in; the id is the folder's inode number.
        """
        self.sandbox_id = os.stat(self.path).st_ino
        self.tree.sandboxed[self.sandbox_id] = self.path

    def _spend(self, *, emptied: bool = True) -> None:
        """The call is over: the cgroup may be another call's from now on.

        A sandboxed call's id stays recorded while processes of it may be left (a drain
        that timed out): they are still the sandbox's, until the cgroup can be removed.
        """
        self.spent = True
        if self.sandbox_id is not None and emptied:
            self.tree.sandboxed.pop(self.sandbox_id, None)
            self.sandbox_id = None

    def discard(self) -> None:
        """Remove the cgroup of a child that never started."""
        self._spend()
        self.tree.remove(self.path, self.files)

    def populated(self) -> bool:
        """Whether any process is still in the cgroup.

        Asked only once the call's leader has exited (so a joining shell has joined or
        given up). From then on, once empty it stays empty (no process is left inside to
        fork, and only the daemon or the joining shell moves one in), so that answer is
        kept and not read again. A cgroup removed from outside is empty (the kernel
        removes no other).
        """
        if self.emptied:
            return False
        events = self.files.read("cgroup.events")
        if events is None and not os.path.exists(self.path):
            # Removed from outside (a cleanup's sweep): the kernel removes only an empty
            # cgroup, so nothing is left to kill or wait for.
            self.emptied = True
            return False
        busy = _field(events, "populated") != 0
        self.emptied = not busy
        return busy

    async def finish(self) -> CallUsage:
        """Kill what is left, wait (bounded) until it is empty, read the usage, remove it.

        An emptied cgroup without limits is kept as a spare instead (``CgroupTree.spare``).
        """
        busy = self.populated()
        if busy:  # usually not: the leader is reaped and nothing stayed behind
            self.kill()
            delay = 0.0002
            with anyio.move_on_after(_DRAIN_BOUND_SECONDS):
                while busy := self.populated():
                    await anyio.sleep(delay)
                    delay = min(delay * 2, 0.02)
        cpu_total = _field(self.files.read("cpu.stat"), "usage_usec")
        usage = self.usage(cpu_total)
        self._spend(emptied=not busy)
        if self.reusable and cpu_total is not None and not busy and self._clean():
            self.tree.spare(self.path, cpu_total, self.files)
        else:
            self.tree.remove(self.path, self.files)
        return usage

    def _clean(self) -> bool:
        """Whether the cgroup is as ``create`` made it, so a later call may have it.

        The tool runs as the daemon's user and may write its own cgroup's files. In a
        tree without controllers (the only kind that keeps spares) the files that change
        what a process in it gets are ``cgroup.freeze`` (``frozen`` in ``cgroup.events``),
        child cgroups and ``cgroup.type``; ``cgroup.subtree_control`` can enable nothing
        where the parent enabled nothing. Read afresh, not from the kept ``emptied``: a
        process that left the cgroup may have come back.
        """
        files = self.files
        events = files.read("cgroup.events")
        if _field(events, "populated") != 0 or _field(events, "frozen") not in (0, None):
            return False
        if _field(files.read("cgroup.stat"), "nr_descendants") != 0:
            return False
        return (files.read("cgroup.type") or "").strip() == "domain"

    def usage(self, cpu_total: int | None) -> CallUsage:
        """Peak memory, CPU time and whether the OOM killer struck.

        Args:
            cpu_total: ``cpu.stat``'s ``usage_usec`` as ``finish`` read it (None: unknown).
        """
        cpu = cpu_total - self.cpu_before if cpu_total is not None else None
        if "memory" not in self.tree.controllers:  # no memory.* files to read
            return CallUsage(cpu_usec=cpu)
        events = _read(os.path.join(self.path, "memory.events"))
        peak = _read(os.path.join(self.path, "memory.peak"))
        return CallUsage(
            peak_memory_bytes=int(peak) if peak is not None and peak.strip().isdigit() else None,
            cpu_usec=cpu,
            oom_killed=(_field(events, "oom_kill") or 0) > 0
            or (_field(events, "oom_group_kill") or 0) > 0,
        )


_NO_LIMITS = Limits()


class CgroupTree:
    """The daemon's own cgroup folder, and its calls' cgroups below it.

    Args:
        folder: The daemon's folder (``<base>/toolsetd-<pid>``), created by ``probe``.
        controllers: The controllers enabled for the calls' cgroups.
    """

    def __init__(self, folder: Path, controllers: frozenset[str], home: Path | None = None) -> None:
        self.folder = folder
        self.controllers = controllers
        #: The controllers the probe enabled: a remake tries each again (``_remake``).
        self._probed = controllers
        self._home: _Files | None = None
        if home is not None:
            files = _Files(str(home))
            try:
                files.open_for_writing("cgroup.procs")
            except OSError as exc:
                log.warning("cgroup_home_unwritable", cgroup=str(home), error=exc.strerror)
            else:
                self._home = files
        self._counter = itertools.count(1)
        self._trash: list[str] = []
        self._remove_failed = Throttle()
        #: (path, usage_usec when it was emptied, its open files)
        self._spares: list[tuple[str, int, _Files]] = []
        self.reuse = not controllers  # see "Spare cgroups" in the module doc
        self.daemon_inside: str | None = None  # a call cgroup the daemon failed to leave
        #: The ids of the call cgroups sandboxed calls run in, and their folders
        #: (``CallCgroup.mark_sandboxed``).
        self.sandboxed: dict[int, str] = {}

    @property
    def can_enter(self) -> bool:
        """Whether the daemon may step into a call's cgroup to spawn its child there."""
        return self._home is not None and self.daemon_inside is None

    @contextlib.contextmanager
    def entered(self, call: CallCgroup) -> Iterator[None]:
        """Run the block (the spawn) with the whole daemon inside ``call``'s cgroup.

        The child is then born inside: no helper process, no race with its first fork. Only
        for cgroups without ``memory.max`` or ``pids.max``: the daemon's threads and pages
        would count against them. If the daemon cannot leave again, that cgroup is never
        killed (``kill`` falls back to the process group) and entering stops.

        Raises:
            CgroupError: The daemon cannot step in (the cgroup was removed from outside
                since ``create``); the block does not run.
        """
        assert self._home is not None
        try:
            call.files.write("cgroup.procs", "0")
        except OSError as exc:  # removed from outside since ``create`` (a cleanup's sweep)
            raise CgroupError(
                f"the call's cgroup {call.path} cannot be entered (removed from outside?): "
                f"{exc.strerror}"
            ) from exc
        try:
            yield
        finally:
            try:
                self._home.write("cgroup.procs", "0")
            except OSError as exc:
                self.daemon_inside = call.path
                log.error("cgroup_leave_failed", cgroup=call.path, error=exc.strerror)

    @classmethod
    def probe(cls, setting: str) -> tuple[CgroupTree | None, str]:
        """Find and claim a writable cgroup v2 subtree.

        Args:
            setting: ``auto``, ``off`` or an absolute path.

        Returns:
            The tree, or None and why not (one sentence, for the log and ``status``).

        Raises:
            ProbeShort: Making a folder, moving the daemon or enabling a controller failed
                for want of room (``EAGAIN``: ``cgroup.max.descendants`` reached; ``ENOMEM``;
                out of descriptors): that says nothing about the tree, so it is tried again.
        """
        if setting == "off":
            return None, 'cgroups are off in the config (cgroup = "off")'
        mounts = cgroup2_mounts()
        if not mounts:
            return None, "no cgroup v2 hierarchy is mounted (/proc/self/mountinfo has no cgroup2)"
        try:
            if setting == "auto":
                base = cls._own_base()
            else:
                # Judged by the path it names: ``..`` may lead off the mount its text is on.
                base = Path(os.path.normpath(setting))
                if not base.is_absolute() or not _on_cgroup2(base, mounts):
                    return None, (
                        f"cgroup = {setting!r} is not a folder on a cgroup v2 mount "
                        f"({', '.join(mounts)})"
                    )
                base.mkdir(exist_ok=True)
            return cls._claim(base), ""
        except CgroupError as exc:
            return None, str(exc)
        except OSError as exc:
            why = f"the cgroup subtree cannot be written: {exc.strerror} ({exc.filename})"
            if exc.errno in SHORT_OF_ROOM:
                raise ProbeShort(why) from exc
            return None, why

    @staticmethod
    def _own_base() -> Path:
        relative = _own_path()
        if relative is None:
            raise CgroupError("the daemon is in no cgroup v2 (/proc/self/cgroup has no 0:: line)")
        own = next((f for f, _ in _own_folders() if (f / "cgroup.procs").exists()), None)
        if own is None:
            raise CgroupError(
                f"no cgroup v2 mount shows the daemon's cgroup ({relative} in its cgroup "
                "namespace, which a mount made outside the namespace does not name): mount "
                'cgroup2 inside it, or name a writable subtree with cgroup = "<path>"'
            )
        if relative == "/":
            if not os.access(own, os.W_OK):
                raise CgroupError(f"the cgroup v2 root {own} is not writable by the daemon")
            return own
        delegated = False
        for attr in ("trusted.delegate", "user.delegate"):
            with contextlib.suppress(OSError):
                delegated = delegated or os.getxattr(own, attr) == b"1"
        if not delegated:
            raise CgroupError(
                f"the daemon's cgroup {own} is not delegated to it (add Delegate=yes to the "
                'unit, or name a writable subtree with cgroup = "/sys/fs/cgroup/...")'
            )
        leaf = own / "daemon"
        leaf.mkdir(exist_ok=True)
        _write(str(leaf / "cgroup.procs"), "0")  # the whole daemon, so own may hand out controllers
        available = (_read(str(own / "cgroup.controllers")) or "").split()
        for name in CONTROLLERS:
            if name in available:
                try:
                    _write(str(own / "cgroup.subtree_control"), f"+{name}")
                except OSError as exc:
                    if exc.errno in SHORT_OF_ROOM:  # not refused: tried again (``probe``)
                        raise
        return own

    @classmethod
    def _claim(cls, base: Path) -> CgroupTree:
        mine = _folder_name(os.getpid())
        ours = mine[: mine.rindex("-") + 1]  # the prefix of this PID namespace's folders
        for entry in base.iterdir():
            name = entry.name
            if name.startswith(ours) and name[len(ours) :].isdigit():
                pid = int(name[len(ours) :])
                if pid != os.getpid() and not _pid_alive(pid):
                    log.info("cgroup_stale_removed", folder=str(entry))
                    _kill_tree(str(entry))
        folder = base / mine
        if folder.exists():
            # Ours by name only: a dead process's that had this pid (pids wrap) or this
            # namespace and pid (a restarted container gets the lowest free namespace inode
            # again, and the daemon is its pid 2). Taken over, its calls' cgroups clashed
            # with ours (``c1`` existed: every call failed).
            log.info("cgroup_stale_removed", folder=str(folder))
            _kill_tree(str(folder))
        folder.mkdir(exist_ok=True)
        if not (folder / "cgroup.kill").exists():
            _kill_tree(str(folder))
            raise CgroupError(
                "the kernel has no cgroup.kill (Linux 5.14 or later is needed to kill a "
                "call's processes at once)"
            )
        available = (_read(str(folder / "cgroup.controllers")) or "").split()
        enabled = []
        for name in CONTROLLERS:
            if name in available:
                try:
                    _write(str(folder / "cgroup.subtree_control"), f"+{name}")
                except OSError as exc:
                    if exc.errno in SHORT_OF_ROOM:  # not refused: tried again (``probe``)
                        _kill_tree(str(folder))
                        raise
                    continue
                enabled.append(name)
        own = _own_cgroup()
        return cls(folder, frozenset(enabled), own)

    def describe(self) -> str:
        """One phrase for ``status``: where, and which controllers."""
        controllers = ", ".join(sorted(self.controllers)) or "none"
        return f"{self.folder} (controllers: {controllers})"

    def check(self, limits: Limits, what: str) -> str | None:
        """Why ``limits`` cannot be enforced here (a controller is missing), else None."""
        missing = [name for name in limits.needs() if name not in self.controllers]
        if not missing:
            return None
        offered = ", ".join(sorted(self.controllers)) or "none"
        return (
            f"the limits of {what} need the {', '.join(missing)} controller(s), which the "
            f"cgroup tree {self.folder} does not offer (enabled: {offered}); enable them "
            "in its parent's cgroup.subtree_control or remove the limits from toolsetd.toml"
        )

    def create(self, limits: Limits, what: str) -> CallCgroup:
        """Make one call's cgroup with its limits.

        Args:
            limits: The set's limits.
            what: The set, for messages (``set 'lint'``).

        Raises:
            CgroupError: A limit's controller is missing, or the folder cannot be made.
        """
        problem = self.check(limits, what)
        if problem is not None:
            raise CgroupError(problem)
        self._empty_trash()
        reusable = self.reuse and limits == _NO_LIMITS
        while reusable and self._spares:
            path, cpu_before, files = self._spares.pop()
            if files.read("cgroup.events") is not None:
                return CallCgroup(self, path, reusable=True, cpu_before=cpu_before, files=files)
            files.close()  # removed from outside (with the folder, see ``_remake``)
        path = os.path.join(self.folder, f"c{next(self._counter)}")
        try:
            try:
                os.mkdir(path)
            except FileNotFoundError:
                self._remake()
                os.mkdir(path)
            if limits.memory_max is not None:
                _write(os.path.join(path, "memory.max"), str(limits.memory_max))
                with contextlib.suppress(OSError):  # no swap accounting: nothing to cap
                    _write(os.path.join(path, "memory.swap.max"), "0")
                with contextlib.suppress(OSError):
                    _write(os.path.join(path, "memory.oom.group"), "1")
            if limits.pids_max is not None:
                _write(os.path.join(path, "pids.max"), str(limits.pids_max))
            if limits.cpu_max is not None:
                _write(os.path.join(path, "cpu.max"), limits.cpu_max)
        except OSError as exc:
            with contextlib.suppress(OSError):
                os.rmdir(path)
            raise CgroupError(
                f"the call's cgroup under {self.folder} cannot be set up: {exc.strerror}"
            ) from exc
        return CallCgroup(self, path, reusable=reusable)

    def _remake(self) -> None:
        """Make the daemon's folder again: it was removed from outside while the daemon ran.

        Nothing holds it while no call runs (its emptied call cgroups can be removed
        first), so a cleanup or a cgroup manager's sweep may take it; without it every
        call failed until a restart. The spares went with it. A named base
        (``cgroup = "<path>"``) that went too is made again, as ``probe`` made it (the
        daemon's own cgroup, the other base, holds the daemon: it cannot go). A controller
        that cannot be enabled again is dropped, so a set whose limits need it fails
        closed, saying so. A folder removed again while it is set up (a sweep that runs
        on) is made again, a few times: its controllers' writes failed with it, and are
        not taken for ones the kernel refuses. Each remake tries every controller the
        probe enabled.

        Raises:
            OSError: The folder cannot be made.
        """
        for _, _, files in self._spares:
            files.close()
        self._spares.clear()
        for _ in range(_REMAKE_TRIES):
            self.folder.parent.mkdir(exist_ok=True)
            self.folder.mkdir(exist_ok=True)
            enabled = []
            for name in sorted(self._probed):
                with contextlib.suppress(OSError):
                    _write(str(self.folder / "cgroup.subtree_control"), f"+{name}")
                    enabled.append(name)
            if os.path.isdir(self.folder):  # not removed again while it was being set up
                break
        self.controllers = frozenset(enabled)
        log.warning("cgroup_folder_remade", folder=str(self.folder), controllers=enabled)

    def spare(self, path: str, cpu_total: int, files: _Files) -> None:
        """Keep an emptied call cgroup without limits for a later call (else remove it)."""
        if len(self._spares) < SPARE_MAX and self.daemon_inside != path:
            self._spares.append((path, cpu_total, files))
        else:
            self.remove(path, files)

    def remove(self, path: str, files: _Files | None = None) -> None:
        """Remove an emptied call cgroup now, or later if the kernel still holds it."""
        if files is not None:
            files.close()
        try:
            os.rmdir(path)
        except FileNotFoundError:
            self._forget(path)  # gone already: only this says so
            return
        except OSError as exc:
            if exc.errno != errno.EBUSY:
                # Still there (EACCES, EPERM, ...): a sandboxed call's id stays recorded,
                # or a peer in it would pass for no call's; retried with the trash.
                said = self._remove_failed.count(exc.errno)  # retried at every create
                if said is not None:
                    log.warning(
                        "cgroup_remove_failed", cgroup=path, error=exc.strerror, failed=said
                    )
                if len(self._trash) < _TRASH_MAX:
                    self._trash.append(path)
                return
            # A tool may make child cgroups in its own (a cgroup with children cannot be
            # removed): ``cgroup.kill`` emptied them with it, so remove them first. Left
            # alone, the call's folder stayed for good and every later call retried it.
            with contextlib.suppress(OSError):
                for root, dirs, _ in os.walk(path, topdown=False):
                    for name in dirs:
                        with contextlib.suppress(OSError):
                            os.rmdir(os.path.join(root, name))
                os.rmdir(path)
                self._forget(path)
                return
            if len(self._trash) < _TRASH_MAX:
                self._trash.append(path)
        else:
            self._forget(path)

    def _forget(self, path: str) -> None:
        """A removed call cgroup is no sandboxed call's any more (one whose drain timed out
        stays recorded until then)."""
        if self.sandboxed:
            for found in [k for k, v in self.sandboxed.items() if v == path]:
                del self.sandboxed[found]

    def _empty_trash(self) -> None:
        if self._trash:
            pending, self._trash = self._trash, []
            for path in pending:
                self.remove(path)

    def close(self) -> None:
        """Kill whatever is still in the tree and remove it (the daemon stops)."""
        for _, _, files in self._spares:
            files.close()
        self._spares.clear()
        if self._home is not None:
            self._home.close()
        if self.daemon_inside is None:
            _kill_tree(str(self.folder))
