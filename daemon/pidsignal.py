"""Signalling the processes a list names (``cgroup.procs``, a ``/proc`` scan), only those.

Theory of operation
-------------------
A pid read from a list is a name, not a handle: between the read and the ``kill`` the
process may exit, be reaped, and its pid be given to a new process, which the ``kill``
then reaches (a grace ``SIGTERM`` of a timed-out call hitting some other program).

:func:`signal_listed` opens a pidfd (``os.pidfd_open``) for each pid as soon as the list is
read, then reads the list again and signals, through its pidfd
(``signal.pidfd_send_signal``), each pid still listed. A pidfd holds the process that had
the pid when it was opened, and that process keeps the pid as long as it is not reaped: if
it is alive and its pid is listed after the pidfd was opened, it is the listed process; if
it has gone, the signal reaches nobody. A pid listed the first time only (its process left,
or its pid went to another process between the read and the ``pidfd_open``) is not
signalled.

Where a pidfd cannot be had (no ``pidfd_open``: Linux before 5.3, a seccomp filter), that
pid is signalled with ``kill`` as it was read, as before. A daemon short of descriptors
(``EMFILE``, ``ENFILE``: a call with more processes than it has descriptors free) pins in
rounds, with one descriptor kept free (``reserve``) for reading the list again: without
it that read failed, and every process pinned went unsignalled. When ``pidfd_open`` runs
out, the pinned ones are signalled and closed, and the rest are pinned in the next round;
only when not one pidfd can be had are the rest signalled by pid, as read.
"""

from __future__ import annotations

import contextlib
import errno
import os
import signal
from collections.abc import Callable, Iterable

__all__ = ["signal_listed"]

#: ``pidfd_open``'s errors when the daemon is out of descriptors (its own, or the system's).
_OUT_OF_DESCRIPTORS = frozenset({errno.EMFILE, errno.ENFILE})


def signal_listed(
    listed: Callable[[], Iterable[int]], sig: int, *, spare: int | None = None
) -> None:
    """Send ``sig`` to the processes ``listed`` names, never to a pid reused meanwhile.

    Args:
        listed: Reads the list (called once, then again after each round of pidfds).
        sig: The signal.
        spare: A pid never to signal (a sandboxed call's bubblewrap).
    """
    pending = [pid for pid in listed() if pid != spare]
    while pending:
        pinned: dict[int, int] = {}
        unpinned: list[int] = []
        try:
            # A descriptor kept free for reading the list again (see the module doc).
            reserve = os.open("/", os.O_PATH | os.O_CLOEXEC)
        except OSError:
            reserve, unpinned, pending = None, pending, []
        try:
            rest: list[int] = []
            for index, pid in enumerate(pending):
                try:
                    pinned[pid] = os.pidfd_open(pid)
                except ProcessLookupError:
                    continue  # gone already
                except OSError as exc:
                    if exc.errno in _OUT_OF_DESCRIPTORS and pinned:
                        rest = pending[index:]  # the next round, once these are closed
                        break
                    unpinned.append(pid)  # no pidfd here: as read, as before
                except AttributeError:
                    unpinned.append(pid)
            pending = rest
            if reserve is not None:
                os.close(reserve)
                reserve = None
            still = set(listed()) if pinned else set()
            for pid, fd in pinned.items():
                if pid in still:
                    with contextlib.suppress(OSError):
                        signal.pidfd_send_signal(fd, sig)
        finally:
            if reserve is not None:
                os.close(reserve)
            for fd in pinned.values():
                os.close(fd)
        for pid in unpinned:
            with contextlib.suppress(OSError):
                os.kill(pid, sig)
