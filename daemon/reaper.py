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
* After spawning a call's child the runner calls :meth:`register` (``+<pgid>\\n``); after
  its final ``SIGKILL`` and reap, :meth:`unregister` (``-<pgid>\\n``). Each child leads its
  own session, so its pgid is its pid.
* When the daemon dies, however it dies (``SIGKILL`` and the OOM killer included), the
  kernel closes the write end; the sentinel reads EOF, sends ``SIGKILL`` to every
  process group still registered, and exits. The pipe's EOF plays the role of a
  parent-death signal for all the tools at once.
* On a normal stop the daemon has already ended every group itself; :meth:`close` closes
  the pipe (nothing is registered any more) and waits briefly for the sentinel to exit.

Writes are a few bytes (atomic, below ``PIPE_BUF``) on a non-blocking descriptor, so they
never stall the event loop. If the sentinel is gone (``EPIPE``) or its pipe is full, the
write is dropped and ``orphan_guard_lost`` is logged once: the daemon keeps serving, without
that guarantee. Limits: a grandchild that left its tool's process group (``setsid``, a
double-forking daemon) is out of reach, and so is everything if the sentinel itself is
killed together with the daemon (for example by ``kill -9 <daemon pid> <sentinel pid>``);
only a cgroup (systemd) covers those.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from typing import Protocol

import structlog

__all__ = ["SENTINEL_SCRIPT", "NullGuard", "OrphanGuard", "ProcessGroupGuard"]

log = structlog.get_logger("toolsetd.reaper")

#: The sentinel's program: track ``+pgid``/``-pgid`` lines on stdin; on EOF kill the rest.
SENTINEL_SCRIPT = r"""# toolsetd orphan guard: on EOF, SIGKILL the registered process groups
import os, signal
for s in (signal.SIGINT, signal.SIGHUP, signal.SIGPIPE):
    signal.signal(s, signal.SIG_IGN)
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
for pgid in groups:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except OSError:
        pass
"""


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
    """The sentinel process and the daemon's end of its pipe.

    Args:
        python: The interpreter to run the sentinel with.
    """

    def __init__(self, python: str = sys.executable) -> None:
        self._python = python
        self._fd: int | None = None
        self._proc: subprocess.Popen[bytes] | None = None
        self._lost = False
        self._groups: set[int] = set()

    @property
    def pid(self) -> int | None:
        """The sentinel's pid, once started."""
        return self._proc.pid if self._proc is not None else None

    @property
    def active(self) -> bool:
        """Whether registrations still reach a sentinel."""
        return self._fd is not None and not self._lost

    def start(self) -> None:
        """Spawn the sentinel.

        Raises:
            OSError: The pipe or the process could not be created.
        """
        if self._proc is not None:
            raise RuntimeError("the orphan guard is already started")
        read_end, write_end = os.pipe2(os.O_CLOEXEC)
        try:
            self._proc = subprocess.Popen(  # noqa: S603, TID251 - fixed argv, no shell
                [self._python, "-S", "-c", SENTINEL_SCRIPT],
                stdin=read_end,
                stdout=subprocess.DEVNULL,
                cwd="/",
                close_fds=True,
                start_new_session=True,
            )
        except BaseException:
            os.close(write_end)
            raise
        finally:
            os.close(read_end)
        os.set_blocking(write_end, False)
        self._fd = write_end
        log.debug("orphan_guard_started", sentinel_pid=self._proc.pid)

    @property
    def groups(self) -> frozenset[int]:
        """The process groups registered now."""
        return frozenset(self._groups)

    def register(self, pgid: int) -> None:
        """Have the sentinel kill group ``pgid`` should the daemon die before it ends."""
        self._groups.add(pgid)
        self._write(b"+%d\n" % pgid)

    def unregister(self, pgid: int) -> None:
        """Group ``pgid`` is dead and reaped: forget it."""
        self._groups.discard(pgid)
        self._write(b"-%d\n" % pgid)

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

    def _write(self, data: bytes) -> None:
        if self._fd is None or self._lost:
            return
        try:
            os.write(self._fd, data)
        except OSError as exc:  # EPIPE: the sentinel is gone; EAGAIN: it stopped reading
            self._lost = True
            log.error("orphan_guard_lost", error=exc.strerror or str(exc),
                      sentinel_pid=self.pid)

    def close(self, wait: float = 2.0) -> None:
        """Close the pipe (the sentinel kills what is still registered, then exits).

        Args:
            wait: Seconds to wait for the sentinel to exit (and reap it); 0 to not wait.
        """
        fd, self._fd = self._fd, None
        if fd is not None:
            with contextlib.suppress(OSError):
                os.close(fd)
        proc = self._proc
        if proc is None:
            return
        try:
            proc.wait(timeout=wait) if wait > 0 else proc.poll()
        except subprocess.TimeoutExpired:
            log.warning("orphan_guard_slow_exit", sentinel_pid=proc.pid)
