"""Who owns the other end of a loopback TCP connection (``sock_diag``, ``/proc/net/tcp``).

Theory of operation
-------------------
A Unix socket tells its server the peer's uid (``SO_PEERCRED``); TCP does not. On
loopback, though, both ends of a connection are sockets of this very kernel, and the
kernel records the uid that created each one. The peer of an accepted connection is the
socket whose local address is our remote address and whose remote address is our local
address. :func:`tcp_peer` asks for exactly that socket:

1. through ``sock_diag`` netlink (``NETLINK_SOCK_DIAG``, ``SOCK_DIAG_BY_FAMILY``, an
   exact lookup by the four-tuple: one request, one answer, no table walk), which carries
   the owner uid in ``inet_diag_msg``;
2. failing that (a kernel without ``inet_diag``, a seccomp filter), by reading
   ``/proc/net/tcp`` and ``/proc/net/tcp6`` (only ``tcp6`` for an IPv6 connection; an
   IPv4 one's peer may be a dual-stack IPv6 socket) and finding the line of that
   four-tuple; its ``uid`` column is the same field.

Both answers are the kernel's: the peer cannot forge them. A connection whose peer the
kernel no longer knows (it closed at once) has no answer, and an unknown peer is never
allowed. Neither is a peer socket that no file holds any more (inode 0): a client that
sent its request and closed. Its socket is an orphan or, once the FIN has been answered,
a ``TIME_WAIT`` mini-socket, and the kernel reports uid **0** for those: taken at its word,
any local user would be root by closing before the daemon looked.

``sock_diag`` also says which cgroup (v2) the peer socket was created in
(``INET_DIAG_CGROUP_ID``, Linux 5.7; the cgroup folder's inode number). The daemon uses it
to refuse connections made from inside a sandboxed call (``Confinement.sandboxed_peer``).
The pid of a TCP peer is not known; the allow-group check uses the uid's groups from the
user database instead (:func:`tcp_peer_credentials`).
"""

from __future__ import annotations

import contextlib
import errno
import ipaddress
import os
import pwd
import socket
import struct
from pathlib import Path
from typing import NamedTuple

from .peercred import PeerCred

__all__ = [
    "TcpPeer",
    "peer_from_proc",
    "peer_from_sock_diag",
    "tcp_peer",
    "tcp_peer_credentials",
]

_NETLINK_SOCK_DIAG = 4
_SOCK_DIAG_BY_FAMILY = 20
_NLMSG_ERROR = 2
_NLM_F_REQUEST = 1
_NLMSG_HDR = struct.Struct("=IHHII")  # len, type, flags, seq, pid
# inet_diag_req_v2: family, protocol, ext, pad, states, then inet_diag_sockid.
_REQ_HEAD = struct.Struct("=BBBxI")
# inet_diag_sockid: sport, dport (big-endian), src[4], dst[4] (network order), if, cookie[2].
_SOCKID = struct.Struct("!HH16s16s")
_SOCKID_TAIL = struct.Struct("=III")
_INET_DIAG_NOCOOKIE = 0xFFFFFFFF
# inet_diag_msg: family, state, timer, retrans, sockid (48 bytes), expires, rqueue,
# wqueue, uid, inode.
_MSG_HEAD = struct.Struct("=BBBB")
_MSG_TAIL = struct.Struct("=IIIII")
_SOCKID_SIZE = _SOCKID.size + _SOCKID_TAIL.size
_NLATTR = struct.Struct("=HH")  # len, type
_INET_DIAG_CGROUP_ID = 21
_U64 = struct.Struct("=Q")


class TcpPeer(NamedTuple):
    """The socket at the other end of a loopback connection, as the kernel knows it.

    Attributes:
        uid: Who created it.
        cgroup: The id of the cgroup (v2) it was created in, or None where the lookup
            cannot say (``/proc/net/tcp``, a kernel before 5.7).
    """

    uid: int
    cgroup: int | None = None


def _cgroup_attribute(data: bytes, start: int, end: int) -> int | None:
    """``INET_DIAG_CGROUP_ID`` among the netlink attributes in ``data[start:end]``."""
    while start + _NLATTR.size <= end:
        length, kind = _NLATTR.unpack_from(data, start)
        if length < _NLATTR.size or start + length > end:
            return None
        if kind == _INET_DIAG_CGROUP_ID and length >= _NLATTR.size + _U64.size:
            return int(_U64.unpack_from(data, start + _NLATTR.size)[0])
        start += (length + 3) & ~3
    return None


def _packed_address(family: int, host: str) -> bytes:
    """An address as the 16 bytes of ``inet_diag_sockid`` (IPv4 in the first four)."""
    raw = socket.inet_pton(family, host)
    return raw.ljust(16, b"\x00")


def peer_from_sock_diag(
    family: int, local: tuple[str, int], remote: tuple[str, int], timeout: float = 1.0
) -> TcpPeer | None:
    """Ask ``sock_diag`` for the socket at ``remote`` connected to ``local``.

    Args:
        family: ``AF_INET`` or ``AF_INET6``.
        local: Our end of the connection (host, port).
        remote: The peer's end (host, port).
        timeout: Seconds to wait for the kernel's answer.

    Returns:
        Its owner and cgroup, or None when the kernel knows no such socket or no file
        holds it any more (see the module's docstring).

    Raises:
        OSError: Netlink or ``inet_diag`` is unavailable.
    """
    sockid = _SOCKID.pack(
        remote[1], local[1], _packed_address(family, remote[0]), _packed_address(family, local[0])
    ) + _SOCKID_TAIL.pack(0, _INET_DIAG_NOCOOKIE, _INET_DIAG_NOCOOKIE)
    body = _REQ_HEAD.pack(family, socket.IPPROTO_TCP, 0, 0xFFFFFFFF) + sockid
    seq = 1
    message = (
        _NLMSG_HDR.pack(_NLMSG_HDR.size + len(body), _SOCK_DIAG_BY_FAMILY, _NLM_F_REQUEST, seq, 0)
        + body
    )
    with socket.socket(socket.AF_NETLINK, socket.SOCK_DGRAM, _NETLINK_SOCK_DIAG) as nl:
        nl.settimeout(timeout)
        nl.sendto(message, (0, 0))
        data = nl.recv(65536)
    return _diag_answer(data)


def _diag_answer(data: bytes) -> TcpPeer | None:
    """The peer in a ``sock_diag`` answer (see :func:`peer_from_sock_diag`).

    A message that is not whole, or too short for what it says it is, is no answer.
    """
    offset = 0
    while offset + _NLMSG_HDR.size <= len(data):
        length, kind, _, _, _ = _NLMSG_HDR.unpack_from(data, offset)
        if length < _NLMSG_HDR.size or offset + length > len(data):
            break  # not a whole message: no answer (the kernel sends whole ones)
        payload = offset + _NLMSG_HDR.size
        if kind == _NLMSG_ERROR and length >= _NLMSG_HDR.size + 4:
            (code,) = struct.unpack_from("=i", data, payload)
            if code == -errno.ENOENT:
                return None
            raise OSError(-code, os.strerror(-code))
        tail = payload + _MSG_HEAD.size + _SOCKID_SIZE
        if kind == _SOCK_DIAG_BY_FAMILY and tail + _MSG_TAIL.size <= offset + length:
            _, _, _, uid, inode = _MSG_TAIL.unpack_from(data, tail)
            if inode == 0:  # closed: an orphan or a TIME_WAIT mini-socket (uid 0)
                return None
            attributes = tail + _MSG_TAIL.size
            return TcpPeer(int(uid), _cgroup_attribute(data, attributes, offset + length))
        offset += (length + 3) & ~3
    return None


def _proc_address(text: str, family: int) -> tuple[str, int]:
    """Decode ``0100007F:1F90`` (host-order words in hex) into (host, port)."""
    host_hex, _, port_hex = text.partition(":")
    raw = bytes.fromhex(host_hex)
    # The kernel prints each 32-bit word of the address in host byte order.
    words = [raw[i : i + 4] for i in range(0, len(raw), 4)]
    native = b"".join(w[::-1] if struct.pack("=I", 1)[0] == 1 else w for w in words)
    return socket.inet_ntop(family, native), int(port_hex, 16)


def _plain(host: str, port: int) -> tuple[ipaddress.IPv4Address | ipaddress.IPv6Address, int]:
    """An address to compare: ``::ffff:127.0.0.1`` (an IPv6 socket's IPv4) as ``127.0.0.1``."""
    address = ipaddress.ip_address(host)
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped, port
    return address, port


def peer_from_proc(
    family: int, local: tuple[str, int], remote: tuple[str, int], proc: Path = Path("/proc")
) -> TcpPeer | None:
    """Find the peer's socket in ``/proc/net/tcp`` and ``tcp6`` (its owner; no cgroup).

    An IPv4 connection's peer may be an IPv6 socket (a dual-stack client, as Java's are
    by default, reaches 127.0.0.1 as ``::ffff:127.0.0.1``): the kernel lists it in
    ``tcp6``, so both files are read for an IPv4 connection (``sock_diag`` finds such a
    socket by the IPv4 four-tuple alone).

    Args:
        family: ``AF_INET`` or ``AF_INET6``.
        local: Our end of the connection (host, port).
        remote: The peer's end (host, port).
        proc: The procfs mount point (a parameter so tests can point elsewhere).

    Returns:
        Its owner, or None when no line matches or no file holds the socket (inode 0).
    """
    want_local, want_remote = _plain(*remote), _plain(*local)
    tables = [("tcp6", socket.AF_INET6)]
    if family != socket.AF_INET6:
        tables.insert(0, ("tcp", socket.AF_INET))
    for name, listed in tables:
        try:
            lines = (proc / "net" / name).read_text(encoding="ascii").splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if len(fields) < 10:
                continue
            with contextlib.suppress(ValueError, OSError):
                if (
                    _plain(*_proc_address(fields[1], listed)) == want_local
                    and _plain(*_proc_address(fields[2], listed)) == want_remote
                ):
                    return TcpPeer(int(fields[7])) if fields[9] != "0" else None
    return None


def tcp_peer(sock: socket.socket) -> TcpPeer | None:
    """The other end of an accepted loopback TCP connection.

    Args:
        sock: The accepted connection.

    Returns:
        The peer socket's owner (and cgroup), or None when the kernel no longer knows
        the peer, the peer has closed, or ``sock`` is not connected.
    """
    family = sock.family
    try:
        local = sock.getsockname()[:2]
        remote = sock.getpeername()[:2]
    except OSError:
        return None
    try:
        return peer_from_sock_diag(family, local, remote)
    except OSError:
        return peer_from_proc(family, local, remote)


def tcp_peer_credentials(uid: int) -> PeerCred:
    """A TCP peer's uid as a :class:`PeerCred` for ``PeerPolicy``.

    The pid is unknown (0); the primary and supplementary groups are the uid's own in
    the user database, which is what ``--allow-group`` means for a TCP caller.
    """
    try:
        entry = pwd.getpwuid(uid)
    except KeyError:
        return PeerCred(pid=0, uid=uid, gid=0xFFFFFFFF, groups=frozenset())
    try:
        groups = frozenset(os.getgrouplist(entry.pw_name, entry.pw_gid))
    except OSError:
        groups = frozenset({entry.pw_gid})
    return PeerCred(pid=0, uid=uid, gid=entry.pw_gid, groups=groups)
