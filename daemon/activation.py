"""systemd socket activation (``sd_listen_fds``) without libsystemd.

Theory of operation
-------------------
When ``toolsetd.socket`` starts the service, systemd has already created, bound and
put into listening state the Unix socket, and passes it as an inherited file descriptor:

* the descriptors are numbered from ``SD_LISTEN_FDS_START`` (3) upwards;
* ``LISTEN_FDS`` says how many there are;
* ``LISTEN_PID`` names the process they are meant for. The variables are inherited by
  anything that forks, so a process that is not ``LISTEN_PID`` must ignore them (it
  would otherwise adopt descriptors that are not sockets at all);
* ``LISTEN_FDNAMES`` optionally names them (``FileDescriptorName=``), colon-separated.

:func:`listen_fds` follows ``sd_listen_fds(3)``: it checks the pid, marks every passed
descriptor close-on-exec (systemd leaves them inheritable, and a spawned tool must not
hold the listening socket: it would keep the socket "alive" after the daemon died),
removes the three variables from the environment, validates that each descriptor is a
listening ``AF_UNIX``/``SOCK_STREAM`` socket bound to a filesystem path (not an abstract
name), and wraps it in a ``socket.socket``.

Under activation systemd owns the socket path: the daemon must not create the socket
directory, take the instance lock, probe for a stale socket, or unlink the path on
exit (see :mod:`toolsetd.daemon.sockpath`, which is for the non-activated start only).
The returned sockets are left in blocking mode; the server's listener wrapper (for
example ``anyio.abc.SocketListener.from_socket``) makes them non-blocking.
"""

from __future__ import annotations

import os
import socket
import stat
from collections.abc import MutableMapping
from dataclasses import dataclass

__all__ = [
    "LISTEN_ENV_VARS",
    "SD_LISTEN_FDS_START",
    "ActivationError",
    "ListenSocket",
    "listen_fds",
    "listen_fds_with_names",
]

#: The first descriptor systemd passes (``SD_LISTEN_FDS_START`` in ``sd-daemon.h``).
SD_LISTEN_FDS_START = 3

#: The variables :func:`listen_fds` consumes.
LISTEN_ENV_VARS = ("LISTEN_PID", "LISTEN_FDS", "LISTEN_FDNAMES")


class ActivationError(RuntimeError):
    """The socket-activation environment is malformed or names an unusable descriptor."""


@dataclass(frozen=True, slots=True)
class ListenSocket:
    """One socket passed by systemd.

    Attributes:
        name: Its ``FileDescriptorName=`` (``LISTEN_FDNAMES``), or ``"unknown"`` when
            systemd passed no names (the same placeholder libsystemd uses).
        socket: The listening socket, close-on-exec.
    """

    name: str
    socket: socket.socket


def listen_fds(
    environ: MutableMapping[str, str] = os.environ, unset: bool = True
) -> list[socket.socket]:
    """Return the listening sockets systemd passed to this process, if any.

    Args:
        environ: The environment to read, ``os.environ`` by default.
        unset: Remove ``LISTEN_PID``, ``LISTEN_FDS`` and ``LISTEN_FDNAMES`` from
            ``environ`` (always, whether or not they were meant for us), so no child
            inherits them.

    Returns:
        The sockets in descriptor order, starting at fd 3; an empty list when the
        process was not socket-activated (no ``LISTEN_PID``, or one naming another
        process, or ``LISTEN_FDS=0``).

    Raises:
        ActivationError: The variables are not integers, the names do not match the
            count, or a descriptor is closed or is not a listening ``AF_UNIX``
            ``SOCK_STREAM`` socket. The message names the descriptor and the problem.
    """
    return [entry.socket for entry in listen_fds_with_names(environ, unset)]


def listen_fds_with_names(
    environ: MutableMapping[str, str] = os.environ, unset: bool = True
) -> list[ListenSocket]:
    """Like :func:`listen_fds`, but keep each socket's ``LISTEN_FDNAMES`` name.

    Args:
        environ: The environment to read, ``os.environ`` by default.
        unset: Remove the activation variables from ``environ`` afterwards.

    Returns:
        One :class:`ListenSocket` per passed descriptor, in descriptor order.

    Raises:
        ActivationError: As for :func:`listen_fds`.
    """
    try:
        count = _passed_count(environ)
        if count == 0:
            return []
        names = _names(environ, count)
        result: list[ListenSocket] = []
        try:
            for offset, name in enumerate(names):
                result.append(ListenSocket(name, _adopt(SD_LISTEN_FDS_START + offset)))
        except ActivationError:
            # Leave the descriptors open (systemd owns them) but drop our wrappers.
            for entry in result:
                entry.socket.detach()
            raise
        return result
    finally:
        if unset:
            for key in LISTEN_ENV_VARS:
                environ.pop(key, None)


def _passed_count(environ: MutableMapping[str, str]) -> int:
    """How many descriptors systemd passed to *this* process (0 when none)."""
    raw_pid = environ.get("LISTEN_PID")
    if raw_pid is None:
        return 0
    pid = _parse_int("LISTEN_PID", raw_pid)
    if pid != os.getpid():
        # Inherited from a socket-activated ancestor: the descriptors are not ours.
        return 0
    raw_count = environ.get("LISTEN_FDS")
    if raw_count is None:
        raise ActivationError("LISTEN_PID is set but LISTEN_FDS is missing")
    count = _parse_int("LISTEN_FDS", raw_count)
    if count < 0:
        raise ActivationError(f"LISTEN_FDS must not be negative, got {raw_count!r}")
    import resource  # once, at start

    # Descriptors past the hard limit cannot exist; a count that large (a typo, a stray
    # variable) made a list of that many names first: LISTEN_FDS=2000000000 took 16 GB.
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    if hard != resource.RLIM_INFINITY and count > hard - SD_LISTEN_FDS_START:
        raise ActivationError(
            f"LISTEN_FDS is {count}, more descriptors than this process may hold "
            f"(its limit is {hard})"
        )
    return count


def _names(environ: MutableMapping[str, str], count: int) -> list[str]:
    """The descriptor names, ``"unknown"`` for each when systemd sent none."""
    raw = environ.get("LISTEN_FDNAMES")
    if raw is None:
        return ["unknown"] * count
    names = raw.split(":")
    if len(names) != count:
        raise ActivationError(
            f"LISTEN_FDNAMES has {len(names)} names but LISTEN_FDS is {count}: {raw!r}"
        )
    return names


def _parse_int(key: str, raw: str) -> int:
    """Parse a decimal environment value, naming the variable on failure."""
    try:
        return int(raw.strip())
    except ValueError:
        raise ActivationError(f"{key} must be a decimal integer, got {raw!r}") from None


def _adopt(fd: int) -> socket.socket:
    """Mark ``fd`` close-on-exec, check it is a listening Unix stream socket, wrap it."""
    try:
        mode = os.fstat(fd).st_mode
    except OSError as exc:
        raise ActivationError(f"passed descriptor {fd} is not open: {exc.strerror}") from None
    os.set_inheritable(fd, False)
    if not stat.S_ISSOCK(mode):
        raise ActivationError(f"passed descriptor {fd} is not a socket")
    sock = socket.socket(fileno=fd)
    try:
        if sock.family != socket.AF_UNIX:
            raise ActivationError(
                f"passed descriptor {fd} is a {_label(sock.family)} socket; expected AF_UNIX "
                "(ListenStream= must name a filesystem path)"
            )
        if sock.type != socket.SOCK_STREAM:
            raise ActivationError(
                f"passed descriptor {fd} is a {_label(sock.type)} socket; expected SOCK_STREAM "
                "(use ListenStream=, not ListenDatagram= or ListenSequentialPacket=)"
            )
        if not sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
            raise ActivationError(
                f"passed descriptor {fd} is not listening (Accept=yes is not supported)"
            )
        name = sock.getsockname()
        if not isinstance(name, str) or not name:
            # An abstract name (ListenStream=@name) comes back as bytes, an unnamed one as
            # b"" or "": the daemon names its socket by path (status, the sandbox's view),
            # and took such a name into a Path with a TypeError traceback.
            raise ActivationError(
                f"passed descriptor {fd} is an abstract or unnamed AF_UNIX socket; "
                "ListenStream= must name a filesystem path"
            )
    except ActivationError:
        # Give the descriptor back rather than closing what systemd owns.
        sock.detach()
        raise
    return sock


def _label(value: object) -> str:
    """An enum member's name (``AF_INET``), or the raw number Python could not name."""
    return str(getattr(value, "name", value))
