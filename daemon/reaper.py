"""The orphan guard: a sentinel process that kills the tools' process groups if the daemon dies.

Theory of operation
-------------------
The runner spawns every tool without a ``preexec_fn`` (one would force CPython to
``fork()`` instead of ``vfork()``, so each spawn would cost time proportional to the
daemon's heap). So ``PR_SET_PDEATHSIG`` cannot be set per child, and a tool does not learn
that the daemon died. The guard covers that case outside systemd (under systemd the unit's
``KillMode=mixed`` cgroup kill covers it, and the guard is a second line):

* :meth:`OrphanGuard.start` spawns one tiny helper, the *sentinel*
  (``sys.executable -S -c <script>``, cwd ``/``), in a new session (a terminal's Ctrl-C,
  hang-up, or a ``kill -<daemon pgid>`` does not reach it). Its stdin is the read end of a
  pipe whose write end only the daemon holds: the write end is ``O_CLOEXEC``, so no tool
  inherits it, and the sentinel is spawned with ``close_fds`` so it holds nothing else of
  the daemon's.
* The registered groups live in a table both processes see: a ``memfd`` (``MFD_CLOEXEC``,
  passed to the sentinel alone with ``pass_fds``) mapped into the daemon, one 32-bit slot per
  group, 0 for a free slot. After spawning a call's child the runner calls :meth:`register`,
  which stores the pgid in a free slot; after the child's final ``SIGKILL`` and reap,
  :meth:`unregister`, which zeroes it. Both are a store into shared memory, so the sentinel
  never wakes up during a call (a pipe line per event would wake a third process twice per
  tool run, on a two-core machine); ``register`` adds one non-blocking ``waitpid`` to notice
  a sentinel that died. The sentinel reads the table only after the daemon's end, so a group
  is guarded from the instant ``register`` returns. The table grows (``ftruncate`` + a new
  mapping) when every slot is taken. Each child leads its own session, so its pgid is its
  pid.
* When the daemon dies, however it dies (``SIGKILL`` and the OOM killer included), the
  kernel closes the write end; the sentinel reads EOF, reads the table, sends ``SIGKILL``
  to every process group still in it, and exits. The pipe's EOF plays the role of a
  parent-death signal for all the tools at once. (Without ``memfd_create`` the guard falls
  back to ``+<pgid>\\n`` / ``-<pgid>\\n`` lines on the pipe, which the sentinel also reads.)
* On a normal stop the daemon has already ended every group itself; :meth:`close` closes
  the pipe (nothing is registered any more) and waits briefly for the sentinel to exit.

With a cgroup tree (``cgroup.CgroupTree``) the sentinel is also given the daemon's cgroup
folder, and after the groups it writes that folder's ``cgroup.kill``: every call's
processes die, those that left their process group included. A tree made after the
sentinel started (a probe at start that was short of room, tried again by
``Confinement.retry_probes``) is told to it by a line on its pipe (``set_cgroup``).

A sentinel that could not start for want of processes, threads, memory or descriptors (a
daemon started at its ``TasksMax=``) is started by a later ``register`` (``start_later``),
at most every ``RETRY_SECONDS``: a spawn that just succeeded says there is room again, and
the groups registered meanwhile go into its table. Without that the daemon ran its whole
life without the guarantee because of a moment's shortage at start.

Registering never blocks and never fails. If the sentinel is gone (it exited, or in the
line fallback ``EPIPE`` or a full pipe), ``orphan_guard_lost`` is logged once: the daemon
keeps serving, without that guarantee. Limits: a grandchild that left its tool's process
group (``setsid``, a double-forking daemon) is out of reach, and so is everything if the
sentinel itself is killed together with the daemon (for example by ``kill -9 <daemon pid>
<sentinel pid>``); only a cgroup (systemd's, or the daemon's own with the sentinel's
``cgroup.kill``) or a sandbox's PID namespace covers those.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import signal
import subprocess
import sys
import time
from typing import Protocol

import structlog

__all__ = ["RETRY_SECONDS", "SENTINEL_SCRIPT", "NullGuard", "OrphanGuard", "ProcessGroupGuard"]

log = structlog.get_logger("toolsetd.reaper")

#: The sentinel's program: on EOF of stdin, kill the groups in the table (the memfd named by
#: ``argv[1]``, native 32-bit ints, 0 = free; -1: none) and those of ``+pgid``/``-pgid``
#: stdin lines, then write ``cgroup.kill`` of the cgroup folder ``argv[2]``, if given, or
#: of the last ``c<folder as hex>`` stdin line (a tree made after the start: ``set_cgroup``).
SENTINEL_SCRIPT = r"""# toolsetd orphan guard: on EOF, SIGKILL the registered process groups
import os, signal, sys
for s in (signal.SIGINT, signal.SIGHUP, signal.SIGPIPE):
    signal.signal(s, signal.SIG_IGN)
table = int(sys.argv[1]) if len(sys.argv) > 1 else -1
cgroup = sys.argv[2] if len(sys.argv) > 2 else ""
groups = set()
pending = b""
while True:
    try:
        chunk = os.read(0, 65536)
    except InterruptedError:
        continue
    except OSError:
        chunk = b""
    if not chunk:
        break
    pending += chunk
    *lines, pending = pending.split(b"\n")
    for line in lines:
        if line[:1] == b"c":
            try:
                cgroup = os.fsdecode(bytes.fromhex(line[1:].decode()))
            except ValueError:
                pass
            continue
        try:
            pgid = int(line[1:])
        except ValueError:
            continue
        if pgid <= 1:
            continue
        if line[:1] == b"+":
            groups.add(pgid)
        elif line[:1] == b"-":
            groups.discard(pgid)
if table >= 0:
    try:
        data = os.pread(table, os.fstat(table).st_size, 0)
    except OSError:
        data = b""
    for i in range(0, len(data) - 3, 4):
        pgid = int.from_bytes(data[i : i + 4], sys.byteorder, signed=True)
        if pgid > 1:
            groups.add(pgid)
for pgid in groups:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except OSError:
        pass
if cgroup:
    try:
        with open(os.path.join(cgroup, "cgroup.kill"), "w") as f:
            f.write("1")
    except OSError:
        pass
"""

_FIRST_SLOTS = 1024  # 4 KiB: one page of 32-bit slots; doubled when full
#: Seconds at least between two starts of a sentinel that could not start (``start_later``).
RETRY_SECONDS = 2.0


class ProcessGroupGuard(Protocol):
    """What the runner tells about the process groups it spawns and ends."""

    def register(self, pgid: int) -> None:
        """A child leading process group ``pgid`` was just spawned."""

    def unregister(self, pgid: int) -> None:
        """Group ``pgid`` was killed and its leader reaped."""


class NullGuard:
    """A guard that guards nothing (the runner's default, and for tests)."""

    def register(self, pgid: int) -> None:
        """Do nothing."""

    def unregister(self, pgid: int) -> None:
        """Do nothing."""


class OrphanGuard:
    """The sentinel process, the daemon's end of its pipe, and the shared table of groups.

    Never started (``--no-orphan-guard``) or failed to start, it still keeps the groups
    registered, for ``kill_all`` (a forced stop).

    Args:
        python: The interpreter to run the sentinel with.
    """

    def __init__(self, python: str = sys.executable) -> None:
        self._python = python
        self._fd: int | None = None
        self._proc: subprocess.Popen[bytes] | None = None  # noqa: TID251 -- the sentinel, see Popen below
        self._lost = False
        self._groups: dict[int, int] = {}  # pgid -> its slot in the table (-1: line fallback)
        self._table_fd: int | None = None
        self._map: mmap.mmap | None = None
        self._slots: memoryview | None = None  # the map as native ints
        self._free: list[int] = []
        self._used = 0  # slots ever handed out (the rest of the table is untouched zeros)
        #: When ``register`` may start the sentinel again (``start_later``), else None.
        self._retry_at: float | None = None
        self._cgroup: str | None = None

    @property
    def pid(self) -> int | None:
        """The sentinel's pid, once started."""
        return self._proc.pid if self._proc is not None else None

    @property
    def active(self) -> bool:
        """Whether registrations still reach a sentinel."""
        return self._fd is not None and not self._lost

    def start(self, cgroup: str | None = None) -> None:
        """Spawn the sentinel.

        Args:
            cgroup: The daemon's cgroup folder (``cgroup.CgroupTree.folder``): the
                sentinel also writes its ``cgroup.kill``, which reaches the tools'
                processes that left their groups.

        Raises:
            OSError: The pipe or the process could not be created.
        """
        if self._proc is not None:
            raise RuntimeError("the orphan guard is already started")
        table = self._open_table()
        try:
            read_end, write_end = os.pipe2(os.O_CLOEXEC)
        except BaseException:
            self._close_table()
            raise
        argv = [self._python, "-S", "-c", SENTINEL_SCRIPT, str(table if table is not None else -1)]
        if cgroup is not None:
            argv.append(cgroup)
        try:
            self._proc = subprocess.Popen(  # noqa: TID251 -- fixed argv, no shell; it must outlive the loop
                argv,
                stdin=read_end,
                stdout=subprocess.DEVNULL,
                cwd="/",
                close_fds=True,
                pass_fds=() if table is None else (table,),
                start_new_session=True,
            )
        except BaseException:
            os.close(write_end)
            self._close_table()
            raise
        finally:
            os.close(read_end)
        os.set_blocking(write_end, False)
        self._fd = write_end
        log.debug("orphan_guard_started", sentinel_pid=self._proc.pid, table=table is not None)

    def start_later(self, cgroup: str | None = None) -> None:
        """Have ``register`` start the sentinel (``start``'s ``cgroup``), at most every
        ``RETRY_SECONDS``: ``start`` failed for want of processes, threads, memory or
        descriptors, which pass."""
        self._cgroup = cgroup
        self._retry_at = time.monotonic() + RETRY_SECONDS

    def set_cgroup(self, cgroup: str) -> None:
        """The daemon's cgroup folder, made after ``start``: the sentinel writes its
        ``cgroup.kill`` too (a line on its pipe; one not started yet gets it at its start)."""
        self._cgroup = cgroup
        if self._proc is not None:
            self._write(b"c%s\n" % os.fsencode(cgroup).hex().encode())

    def _start_again(self) -> None:
        """Start the sentinel ``start_later`` asked for, and guard the groups held meanwhile."""
        try:
            self.start(self._cgroup)
        except OSError:
            self._retry_at = time.monotonic() + RETRY_SECONDS
            return
        self._retry_at = None
        held = list(self._groups)
        self._groups.clear()
        for pgid in held:
            self.register(pgid)
        log.info("orphan_guard_started_late", sentinel_pid=self.pid, groups=len(held))

    def _open_table(self) -> int | None:
        """Create the shared table; None (line fallback) where memfd or mmap is unavailable."""
        try:
            fd = os.memfd_create("toolsetd-orphan-guard", os.MFD_CLOEXEC)
        except (AttributeError, OSError):
            return None
        self._table_fd = fd
        try:
            self._map_table(_FIRST_SLOTS)
        except (OSError, ValueError):
            self._close_table()
            return None
        return fd

    def _map_table(self, slots: int) -> None:
        assert self._table_fd is not None
        os.ftruncate(self._table_fd, slots * 4)  # new bytes read as zeros: free slots
        if self._slots is not None:
            self._slots.release()
        if self._map is not None:
            self._map.close()
        self._map = mmap.mmap(self._table_fd, slots * 4)
        self._slots = memoryview(self._map).cast("i")

    def _close_table(self) -> None:
        if self._slots is not None:
            self._slots.release()
            self._slots = None
        if self._map is not None:
            self._map.close()
            self._map = None
        if self._table_fd is not None:
            with contextlib.suppress(OSError):
                os.close(self._table_fd)
            self._table_fd = None

    @property
    def groups(self) -> frozenset[int]:
        """The process groups registered now."""
        return frozenset(self._groups)

    def register(self, pgid: int) -> None:
        """Have the sentinel kill group ``pgid`` should the daemon die before it ends."""
        if pgid in self._groups:
            return
        if self._retry_at is not None and time.monotonic() >= self._retry_at:
            self._start_again()
        slots = self._slots
        if slots is None or self._fd is None:
            self._groups[pgid] = -1
            self._write(b"+%d\n" % pgid)
            return
        if self._free:
            slot = self._free.pop()
        else:
            slot = self._used
            if slot >= len(slots):
                try:
                    self._map_table(2 * len(slots))
                except (OSError, ValueError) as exc:
                    self._groups[pgid] = -1
                    self._write(b"+%d\n" % pgid)
                    log.warning("orphan_guard_table_full", error=str(exc))
                    return
                assert self._slots is not None
                slots = self._slots
            self._used = slot + 1
        slots[slot] = pgid
        self._groups[pgid] = slot
        self._check_alive()

    def unregister(self, pgid: int) -> None:
        """Group ``pgid`` is dead and reaped: forget it."""
        slot = self._groups.pop(pgid, None)
        if slot is None:
            return
        if slot < 0:
            self._write(b"-%d\n" % pgid)
        elif self._slots is not None:
            self._slots[slot] = 0
            self._free.append(slot)

    def kill_all(self, sig: int = signal.SIGKILL) -> int:
        """Signal every registered group now (a forced stop); returns how many were signalled.

        Safe against recycled ids: a group stays registered until its leader is reaped,
        and an unreaped leader keeps its pid (the group id) reserved.
        """
        count = 0
        for pgid in list(self._groups):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pgid, sig)
                count += 1
        return count

    def _check_alive(self) -> None:
        # A store into the table cannot fail, so ask whether the sentinel still runs
        # (waitpid WNOHANG: one cheap system call, and nothing wakes up).
        proc = self._proc
        if not self._lost and proc is not None and proc.poll() is not None:
            self._lose(f"the sentinel exited ({proc.returncode})")

    def _lose(self, error: str) -> None:
        self._lost = True
        log.error("orphan_guard_lost", error=error, sentinel_pid=self.pid)

    def _write(self, data: bytes) -> None:
        if self._fd is None or self._lost:
            return
        try:
            os.write(self._fd, data)
        except OSError as exc:  # EPIPE: the sentinel is gone; EAGAIN: it stopped reading
            self._lose(exc.strerror or str(exc))

    def close(self, wait: float = 2.0) -> None:
        """Close the pipe (the sentinel kills what is still registered, then exits).

        Args:
            wait: Seconds to wait for the sentinel to exit (and reap it); 0 to not wait.
        """
        fd, self._fd = self._fd, None
        if fd is not None:
            with contextlib.suppress(OSError):
                os.close(fd)
        self._close_table()  # the sentinel holds its own descriptor of the table
        proc = self._proc
        if proc is None:
            return
        try:
            proc.wait(timeout=wait) if wait > 0 else proc.poll()
        except subprocess.TimeoutExpired:
            log.warning("orphan_guard_slow_exit", sentinel_pid=proc.pid)
