"""Who is on the other end of a Unix socket, and may they talk to us (``SO_PEERCRED``).

Theory of operation
-------------------
The socket file's mode (0600, or 0660 with a group for the system service) is the first
gate; this module is the second, checked by the server on every accepted connection
before a single byte is read. A connection that fails it is answered with
``PeerNotAllowed`` and closed.

* :func:`peer_credentials` asks the kernel: ``SO_PEERCRED`` gives the pid, uid and gid
  the peer had when it called ``connect()`` (three native ``int``), and
  ``SO_PEERGROUPS`` (Linux 4.13+) its supplementary groups at that same moment. Both are
  snapshots taken by the kernel, so the peer cannot lie about them.
* :class:`PeerPolicy` is a pure value: allowed uids and allowed gids. A peer is allowed
  when its uid is allowed, or its primary gid is allowed, or one of its supplementary
  groups is. The default allows the daemon's own effective uid and root, and no group.
* Supplementary groups are only looked up when a group could decide (the uid did not
  match and the policy has gids). When ``SO_PEERGROUPS`` is unavailable the lookup falls
  back to the ``Groups:`` line of ``/proc/<pid>/status``, best-effort: the process may
  have exited (or, worse, its pid been reused), so the fallback only trusts the line
  when that process's real and effective uid still equal the credential's uid, and any
  failure means "no supplementary groups", never "allowed".
"""

from __future__ import annotations

import contextlib
import errno
import os
import socket
import struct
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

__all__ = ["PeerCred", "PeerPolicy", "peer_credentials", "proc_supplementary_groups"]

# struct ucred { pid_t pid; uid_t uid; gid_t gid; }: one signed and two unsigned 32-bit
# ints (the same 12 bytes as "3i", but a uid above 2**31, as in user namespaces, stays
# positive).
_UCRED = struct.Struct("iII")
_NO_ID = 0xFFFFFFFF  # (uid_t)-1: what the kernel reports for a socket with no peer
_GID = struct.Struct("I")  # gid_t, one per entry in the SO_PEERGROUPS array
# SO_PEERGROUPS is 59 in asm-generic (x86, arm, riscv...); Python does not export it.
_SO_PEERGROUPS: int = getattr(socket, "SO_PEERGROUPS", 59)
_NGROUPS_MAX = 65536


@dataclass(frozen=True, slots=True)
class PeerCred:
    """The credentials of a connected peer.

    Attributes:
        pid: The peer's process id at ``connect()`` time.
        uid: Its effective user id.
        gid: Its effective (primary) group id.
        groups: Its supplementary groups when the kernel reported them
            (``SO_PEERGROUPS``), else ``None`` (look them up in ``/proc`` if needed).
    """

    pid: int
    uid: int
    gid: int
    groups: frozenset[int] | None = None


def peer_credentials(sock: socket.socket) -> PeerCred:
    """Read the credentials of the peer of a connected ``AF_UNIX`` socket.

    Args:
        sock: A connected Unix stream socket (an accepted connection, or one end of
            ``socket.socketpair()``).

    Returns:
        The peer's pid, uid, gid and, where the kernel supports it, supplementary groups.

    Raises:
        OSError: The socket has no peer (``ENOTCONN``), or is not a socket.
    """
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size)
    pid, uid, gid = _UCRED.unpack(raw)
    if pid == 0 and uid == _NO_ID:
        # Linux answers an unconnected socket with pid 0 and uid/gid -1, not an error.
        raise OSError(errno.ENOTCONN, "socket has no connected peer")
    return PeerCred(pid=pid, uid=uid, gid=gid, groups=_peer_groups(sock))


def _peer_groups(sock: socket.socket) -> frozenset[int] | None:
    """The peer's supplementary groups via ``SO_PEERGROUPS``, or ``None`` if unsupported."""
    if not sys.platform.startswith("linux"):
        return None
    for size in (64 * _GID.size, _NGROUPS_MAX * _GID.size):
        try:
            raw = sock.getsockopt(socket.SOL_SOCKET, _SO_PEERGROUPS, size)
        except OSError as exc:
            if exc.errno == errno.ERANGE:
                continue  # More groups than the buffer holds: try the largest.
            # ENOPROTOOPT (a kernel before 4.13) or ENODATA: the /proc fallback remains.
            return None
        return frozenset(gid for (gid,) in _GID.iter_unpack(raw))
    return None


def proc_supplementary_groups(cred: PeerCred, proc: Path = Path("/proc")) -> frozenset[int]:
    """Read a peer's supplementary groups from ``/proc/<pid>/status``, best-effort.

    The line is trusted only while the process at that pid still has the credential's
    uid as both real and effective uid (a weak guard against a reused pid).

    Args:
        cred: The peer, as :func:`peer_credentials` returned it.
        proc: The procfs mount point (a parameter so tests can point elsewhere).

    Returns:
        The groups, or an empty set when the process is gone, unreadable or changed.
    """
    try:
        text = (proc / str(cred.pid) / "status").read_text(encoding="ascii", errors="replace")
    except OSError:
        return frozenset()
    uids: list[int] = []
    groups: frozenset[int] = frozenset()
    with contextlib.suppress(ValueError):
        for line in text.splitlines():
            key, _, value = line.partition(":")
            if key == "Uid":
                uids = [int(field) for field in value.split()]
            elif key == "Groups":
                groups = frozenset(int(field) for field in value.split())
    if len(uids) < 2 or uids[0] != cred.uid or uids[1] != cred.uid:
        return frozenset()
    return groups


@dataclass(frozen=True, slots=True)
class PeerPolicy:
    """Which peers may use the daemon: a set of uids and a set of gids.

    Attributes:
        allowed_uids: Users allowed whatever their groups.
        allowed_gids: Groups whose members (primary or supplementary) are allowed.
    """

    allowed_uids: frozenset[int]
    allowed_gids: frozenset[int] = frozenset()

    @classmethod
    def default(cls) -> PeerPolicy:
        """Allow the daemon's own effective uid and root, and no group.

        Returns:
            The default policy.
        """
        return cls(allowed_uids=frozenset({os.geteuid(), 0}))

    def with_gids(self, gids: Iterable[int]) -> PeerPolicy:
        """Return a copy that also allows ``gids``.

        Args:
            gids: Group ids to add.

        Returns:
            The new policy.
        """
        return PeerPolicy(self.allowed_uids, self.allowed_gids | frozenset(gids))

    def allows(self, cred: PeerCred, proc: Path = Path("/proc")) -> bool:
        """Decide whether a peer may use the daemon.

        Args:
            cred: The peer's credentials.
            proc: The procfs mount point, for the supplementary-group fallback.

        Returns:
            ``True`` when the uid is allowed, the primary gid is allowed, or one of the
            peer's supplementary groups is allowed.
        """
        if cred.uid in self.allowed_uids:
            return True
        if not self.allowed_gids:
            return False
        if cred.gid in self.allowed_gids:
            return True
        groups = cred.groups
        if groups is None:
            groups = proc_supplementary_groups(cred, proc)
        return not self.allowed_gids.isdisjoint(groups)
