"""Client-side transport errors, and the mapping from socket failures to them.

The wire's own errors (``RpcError`` and its subclasses, rebuilt by code from a response)
live in ``toolsetd.protocol.errors`` and are re-exported here so callers need one import.
Transport failures are mapped at the I/O edge, once, by ``map_connect_errors`` and
``map_stream_errors``, as httpcore's ``map_exceptions`` does::

    Exception
    ├── ClientError              a transport failure talking to toolsetd
    │   ├── ConnectError         could not reach the socket (ENOENT, ECONNREFUSED, EACCES, timeout)
    │   ├── ConnectionClosed     the connection ended while a call was waiting (EOF, broken, closed)
    │   └── RequestTimeout       a call got no response within the caller's timeout
    └── RpcError                 an error response from the daemon (toolsetd.protocol.errors)

``ConnectionClosed`` keeps anyio's distinction in its ``reason``: ``"closed"`` (closed by
us), ``"broken"`` (the peer broke the stream), ``"eof"`` (a clean end of stream) or
``"protocol"`` (the daemon sent bytes that break the framing).
"""

from __future__ import annotations

import errno
import os
import shlex
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from toolsetd.protocol.errors import (
    ApprovalRequired,
    InternalError,
    InvalidArguments,
    InvalidParams,
    InvalidRequest,
    InvalidWorkspace,
    MessageTooLarge,
    MethodNotFound,
    ParseError,
    PeerNotAllowed,
    PolicyDenied,
    ProtocolError,
    RemoteProtocolError,
    RpcError,
    ServerBusy,
    ShuttingDown,
    UnknownCall,
    UnknownTool,
)

__all__ = [
    "ApprovalRequired",
    "ClientError",
    "ConnectError",
    "ConnectionClosed",
    "InternalError",
    "InvalidArguments",
    "InvalidParams",
    "InvalidRequest",
    "InvalidWorkspace",
    "MessageTooLarge",
    "MethodNotFound",
    "ParseError",
    "PeerNotAllowed",
    "PolicyDenied",
    "ProtocolError",
    "RemoteProtocolError",
    "RequestTimeout",
    "RpcError",
    "ServerBusy",
    "ShuttingDown",
    "UnknownCall",
    "UnknownTool",
    "map_connect_errors",
    "map_stream_errors",
]


class ClientError(Exception):
    """A transport failure while talking to toolsetd."""


class ConnectError(ClientError):
    """The daemon's socket could not be reached.

    Attributes:
        path: The socket path that was tried.
        absent: Whether nothing listens there (no such socket, or the connection was
            refused); not when the socket may not be opened, did not answer in time, or
            is refused for another reason.
        not_socket: Whether the path is something that cannot be a socket (a regular file
            or a folder named by mistake): no daemon listens there either.
    """

    def __init__(
        self, message: str, path: str, *, absent: bool = False, not_socket: bool = False
    ) -> None:
        """Create the error.

        Args:
            message: An English sentence naming the socket path.
            path: The socket path.
            absent: Whether nothing listens there.
            not_socket: Whether the path is not a socket at all.
        """
        super().__init__(message)
        self.path = path
        self.absent = absent
        self.not_socket = not_socket


class ConnectionClosed(ClientError):
    """The connection ended; every call still waiting on it fails with this error.

    Attributes:
        reason: ``closed`` (by us), ``broken`` (by the peer), ``eof`` (clean end of
            stream) or ``protocol`` (the daemon sent bytes that break the framing).
    """

    def __init__(self, message: str, reason: str) -> None:
        """Create the error.

        Args:
            message: An English sentence.
            reason: One of ``closed``, ``broken``, ``eof``, ``protocol``.
        """
        super().__init__(message)
        self.reason = reason


class RequestTimeout(ClientError):
    """A call got no response within the timeout the caller gave."""


def _connect_message(path: str, exc: OSError) -> str:
    """Word a connect failure for the operator, naming the socket path."""
    if exc.errno in (errno.ENOENT, errno.ENOTDIR):
        return f"toolsetd is not running at {path} (no such socket){_start_it(path)}"
    if exc.errno == errno.ECONNREFUSED:
        kind = _not_a_socket(path)
        if kind is not None:
            return (
                f"Cannot connect to toolsetd: {path} is {kind}, not a socket; give --socket "
                "(or TOOLSETD_SOCKET) the path of toolsetd's socket."
            )
        return f"toolsetd is not running at {path} (connection refused){_start_it(path)}"
    if exc.errno in (errno.EACCES, errno.EPERM):
        return f"Permission denied connecting to toolsetd at {path}{_denied_by(path)}."
    detail = exc.strerror or str(exc)
    return f"Cannot connect to toolsetd at {path}: {detail}."


def _start_it(path: str) -> str:
    """The way out of a daemon that is not running, for an operator or a CI job that
    has not started one (or points at another socket than the one it serves)."""
    return (
        f": start it (toolsetd --socket {shlex.quote(path)}), or give --socket (or "
        "TOOLSETD_SOCKET) the socket a running toolsetd serves."
    )


def _denied_by(path: str) -> str:
    """Who refused the connect: the socket, or a folder on its way the user may not search,
    with its owner and mode, and the way out; "" when that cannot be told."""
    import stat

    refused = os.path.abspath(path)
    try:
        os.stat(refused)
    except PermissionError:  # a folder on the way: the first one that may not be searched
        refused = next(
            (
                folder
                for folder in _ancestors(os.path.dirname(refused))
                if not os.access(folder, os.X_OK)
            ),
            "",
        )
    except OSError:
        return ""
    if not refused:
        return ""
    try:
        info = os.stat(refused)
    except OSError:
        return ""
    owner = f"{_user_name(info.st_uid)}:{_group_name(info.st_gid)}"
    return (
        f": {refused} belongs to {owner}, mode {stat.S_IMODE(info.st_mode):04o}; run "
        "toolsetctl as the daemon's user, or have it serve a group of yours (--allow-group, "
        "on a socket that group may open: see docs/operations.md)"
    )


def _ancestors(folder: str) -> list[str]:
    """``folder`` and the folders above it, from the root down."""
    chain = [folder]
    while os.path.dirname(chain[-1]) != chain[-1]:
        chain.append(os.path.dirname(chain[-1]))
    return chain[::-1]


def _user_name(uid: int) -> str:
    try:
        import pwd

        return pwd.getpwuid(uid).pw_name
    except (ImportError, KeyError):
        return str(uid)


def _group_name(gid: int) -> str:
    try:
        import grp

        return grp.getgrgid(gid).gr_name
    except (ImportError, KeyError):
        return str(gid)


def _not_a_socket(path: str) -> str | None:
    """What is at ``path`` when it is no socket (the connect is refused as for a stopped
    daemon: a mistyped ``--socket`` naming a file or folder), else None."""
    import stat

    try:
        mode = os.stat(path).st_mode
    except OSError:
        return None
    if stat.S_ISSOCK(mode):
        return None
    if stat.S_ISDIR(mode):
        return "a directory"
    if stat.S_ISREG(mode):
        return "a regular file"
    return "a FIFO" if stat.S_ISFIFO(mode) else "a device or special file"


@contextmanager
def map_connect_errors(path: str | Path, timeout: float) -> Iterator[None]:
    """Turn the failures of opening the socket into ``ConnectError``.

    Args:
        path: The socket path being connected to (for the message).
        timeout: The connect timeout in seconds (for the message).

    Raises:
        ConnectError: For a missing socket, a refused or forbidden connect, any other
            ``OSError`` and a connect timeout.
    """
    where = str(path)
    try:
        yield
    except TimeoutError as exc:
        raise ConnectError(
            f"Timed out after {timeout:g} s connecting to toolsetd at {where}.", where
        ) from exc
    except OSError as exc:
        absent = exc.errno in (errno.ENOENT, errno.ENOTDIR, errno.ECONNREFUSED)
        not_socket = exc.errno == errno.ECONNREFUSED and _not_a_socket(where) is not None
        if not_socket:
            absent = False  # something else is there: say what (list's fallback too)
        raise ConnectError(
            _connect_message(where, exc), where, absent=absent, not_socket=not_socket
        ) from exc


@contextmanager
def map_stream_errors() -> Iterator[None]:
    """Turn the failures of sending on an open connection into ``ConnectionClosed``.

    Raises:
        ConnectionClosed: ``closed`` when we closed the stream, ``broken`` when the peer
            broke it (or any other ``OSError``).
    """
    import anyio  # here, not at the top: the CLI imports this module without anyio

    try:
        yield
    except anyio.ClosedResourceError as exc:
        raise ConnectionClosed("The connection to toolsetd is closed.", "closed") from exc
    except (anyio.BrokenResourceError, OSError) as exc:
        raise ConnectionClosed("The connection to toolsetd was broken.", "broken") from exc
