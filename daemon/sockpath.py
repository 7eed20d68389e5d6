"""Where the daemon's socket lives, and making sure only one daemon serves it.

Theory of operation
-------------------
When systemd does not pass a socket (see :mod:`toolsetd.daemon.activation`), the daemon
binds the path itself, and four steps, in this order, make that safe:

1. :func:`default_socket_path` picks the path: ``$TOOLSETD_SOCKET``, else
   ``$XDG_RUNTIME_DIR/toolsetd/toolsetd.sock``, else ``/tmp/toolsetd-<uid>/toolsetd.sock``.
2. :func:`prepare_socket_dir` creates the socket's folder 0700 or checks the existing
   one: it must be a directory owned by us and writable by nobody else. In a
   world-writable ``/tmp`` another user can pre-create ``/tmp/toolsetd-<uid>`` (or a
   symlink by that name) to capture our socket and every call's arguments; such a
   folder is refused, never "repaired".
3. :func:`acquire_instance_lock` takes ``flock(LOCK_EX | LOCK_NB)`` on
   ``<socket>.lock``. Binding alone cannot keep a second daemon out, because binding
   means unlinking the old path first (anyio's ``create_unix_listener`` does so silently)
   and a second daemon would steal the path from the first. The lock is tied to the open
   file description, so the kernel releases it when the daemon dies, even by SIGKILL.
   Release unlinks the lock file *while still holding the lock*, and acquisition
   re-checks after locking that the path still names the locked inode; without that a
   waiter could lock an unlinked file while a third daemon locks a fresh one.
4. :func:`check_stale` looks at whatever is at the path: nothing is fine; a socket
   nobody listens on is a leftover of a crashed daemon and is removed; a socket that
   accepts a connection means another server (without our lock: an older or foreign
   one) is live, and startup fails; anything else (a regular file, a directory) is the
   operator's and is never deleted.

All four are synchronous and short (one ``connect`` with a small timeout at most): they
run at startup, before the event loop serves anything.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import socket
import stat
from collections.abc import Mapping
from pathlib import Path
from types import TracebackType

from toolsetd.protocol.sockfolder import folder_fault
from toolsetd.protocol.sockpath import default_socket_path as socket_path_rule

__all__ = [
    "SUN_PATH_MAX",
    "AlreadyRunning",
    "InstanceLocked",
    "LockHandle",
    "NotASocket",
    "SocketPathError",
    "UnsafeSocketDir",
    "acquire_instance_lock",
    "check_stale",
    "default_socket_path",
    "lock_path_for",
    "prepare_socket_dir",
]

# sizeof(sockaddr_un.sun_path) on Linux, including the terminating NUL.
SUN_PATH_MAX = 108
_LOCK_ATTEMPTS = 5


class SocketPathError(RuntimeError):
    """The socket path cannot be used; the message says why and what to do."""


class UnsafeSocketDir(SocketPathError):
    """The socket's folder is owned by someone else or writable by others."""


class InstanceLocked(SocketPathError):
    """Another toolsetd holds the instance lock for this socket path."""


class AlreadyRunning(SocketPathError):
    """A live server already accepts connections on this socket path."""


class NotASocket(SocketPathError):
    """Something that is not a socket occupies the socket path."""


def default_socket_path(environ: Mapping[str, str] = os.environ) -> Path:
    """Return the socket path the contract prescribes when ``--socket`` is not given.

    The rule is ``protocol.sockpath.default_socket_path``, which the clients apply too.

    Args:
        environ: The environment to read, ``os.environ`` by default.

    Returns:
        ``$TOOLSETD_SOCKET`` (``~`` expanded); else ``$XDG_RUNTIME_DIR/toolsetd/toolsetd.sock``
        when that variable is an absolute path (the XDG spec says to ignore a relative
        one); else ``/tmp/toolsetd-<uid>/toolsetd.sock``.
    """
    return Path(socket_path_rule(environ, os.geteuid(), os.path.expanduser))


def lock_path_for(socket_path: Path) -> Path:
    """Return the instance-lock path for a socket: ``<socket_path>.lock``.

    Args:
        socket_path: The socket path.

    Returns:
        The lock file's path, next to the socket.
    """
    return socket_path.with_name(socket_path.name + ".lock")


def prepare_socket_dir(path: Path) -> None:
    """Create the socket's parent folder 0700, or check that the existing one is safe.

    A folder we create gets mode 0700 (``mkdir`` with the mode, then ``chmod``, since the
    umask may have removed bits). An existing folder is accepted only if it is a
    directory owned by our effective uid and not writable by group or others; a symlink
    is followed only if we (or root) own the link itself. Missing ancestors are created
    with the default mode.

    Args:
        path: The socket path (not the folder).

    Raises:
        SocketPathError: The path is too long for ``AF_UNIX`` or the folder cannot be
            created.
        UnsafeSocketDir: The folder is not ours, is writable by others, or is not a
            directory.
    """
    encoded = os.fsencode(path)
    if len(encoded) >= SUN_PATH_MAX:
        raise SocketPathError(
            f"socket path {path} is {len(encoded)} bytes; AF_UNIX allows at most "
            f"{SUN_PATH_MAX - 1}: choose a shorter --socket"
        )
    parent = path.parent
    euid = os.geteuid()
    try:
        parent.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise SocketPathError(
            f"cannot create {parent.parent} for the socket: {exc.strerror}"
        ) from None
    try:
        parent.mkdir(mode=0o700)
    except FileExistsError:
        _check_existing_dir(parent, euid)
    except OSError as exc:
        raise SocketPathError(f"cannot create socket folder {parent}: {exc.strerror}") from None
    else:
        os.chmod(parent, 0o700)


def _check_existing_dir(parent: Path, euid: int) -> None:
    """Refuse an existing socket folder that someone else could tamper with."""
    link = parent.lstat()
    info = link
    if not stat.S_ISLNK(link.st_mode) or link.st_uid in (euid, 0):
        try:
            info = parent.stat()
        except OSError as exc:
            raise UnsafeSocketDir(f"socket folder {parent} is unusable: {exc.strerror}") from None
    fault = folder_fault(link.st_mode, link.st_uid, info.st_mode, info.st_uid, euid)
    if fault is None:
        return
    kind, value = fault
    if kind == "link":
        raise UnsafeSocketDir(
            f"socket folder {parent} is a symlink owned by uid {value}, not by us "
            f"(uid {euid}); refusing to use it: remove it or choose another --socket"
        )
    if kind == "not_directory":
        raise UnsafeSocketDir(f"socket folder {parent} exists and is not a directory")
    if kind == "owner":
        raise UnsafeSocketDir(
            f"socket folder {parent} is owned by uid {value}, not by us (uid {euid}); "
            "someone else may have created it to capture the socket: refusing to use it"
        )
    raise UnsafeSocketDir(
        f"socket folder {parent} is writable by group or others "
        f"(mode {value:04o}); run 'chmod 0700 {parent}' "
        "or choose another --socket"
    )


class LockHandle:
    """A held instance lock; release it (or leave the ``with`` block) on shutdown.

    The kernel drops the lock by itself if the process dies; :meth:`release` also
    removes the lock file.

    Attributes:
        path: The lock file.
    """

    def __init__(self, path: Path, fd: int) -> None:
        """Wrap an open, locked lock file.

        Args:
            path: The lock file's path.
            fd: The descriptor holding ``LOCK_EX``.
        """
        self.path = path
        self._fd: int | None = fd

    @property
    def held(self) -> bool:
        """Whether the lock is still held by this handle."""
        return self._fd is not None

    def names_path(self) -> bool:
        """Whether the lock file's path still names the locked file (a cleanup may have
        removed it, and a lock on a removed file keeps no other daemon out)."""
        return self._fd is not None and _same_file(self._fd, self.path)

    def release(self) -> None:
        """Unlink the lock file, then drop the lock. Safe to call twice.

        Only while the path still names the locked file: one a cleanup removed (and another
        daemon, serving the path since, made afresh) is that daemon's lock.
        """
        fd, self._fd = self._fd, None
        if fd is None:
            return
        try:
            # Unlink first, while still holding the lock: see the module docstring.
            if _same_file(fd, self.path):
                with contextlib.suppress(FileNotFoundError):
                    self.path.unlink()
        finally:
            os.close(fd)

    def __enter__(self) -> LockHandle:
        """Return the handle itself."""
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        """Release the lock."""
        self.release()


def acquire_instance_lock(socket_path: Path) -> LockHandle:
    """Take the exclusive instance lock for a socket path, without waiting.

    The lock file ``<socket_path>.lock`` is created 0600 and gets our pid, so the
    error a second daemon prints names the first.

    Args:
        socket_path: The socket path the daemon is about to serve.

    Returns:
        The held lock.

    Raises:
        InstanceLocked: Another process holds the lock.
        SocketPathError: The lock file cannot be opened.
    """
    lock_path = lock_path_for(socket_path)
    for _ in range(_LOCK_ATTEMPTS):
        try:
            fd = os.open(lock_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
        except OSError as exc:
            raise SocketPathError(f"cannot open lock file {lock_path}: {exc.strerror}") from None
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            # A FIFO (or a socket) there: ftruncate below failed with EINVAL, a traceback.
            os.close(fd)
            raise SocketPathError(
                f"lock file {lock_path} is not a regular file: move it away"
            ) from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            holder = _read_pid(fd)
            os.close(fd)
            if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise SocketPathError(f"cannot lock {lock_path}: {exc.strerror}") from None
            who = f" (pid {holder})" if holder is not None else ""
            raise InstanceLocked(
                f"another toolsetd is already serving {socket_path}{who}"
            ) from None
        if _same_file(fd, lock_path):
            os.fchmod(fd, 0o600)
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode("ascii"), 0)
            return LockHandle(lock_path, fd)
        # The holder unlinked the file between our open and our flock: start over.
        os.close(fd)
    raise SocketPathError(f"cannot lock {lock_path}: it keeps being replaced")


def _same_file(fd: int, path: Path) -> bool:
    """Whether ``path`` still names the file open on ``fd`` (not when it cannot be looked
    at: its folder gone, or a file in the folder's place, ``ENOTDIR``)."""
    try:
        on_disk = os.stat(path, follow_symlinks=False)
    except OSError:
        return False
    held = os.fstat(fd)
    return (held.st_dev, held.st_ino) == (on_disk.st_dev, on_disk.st_ino)


def _read_pid(fd: int) -> int | None:
    """The pid recorded in a lock file, if it holds one."""
    try:
        raw = os.pread(fd, 32, 0)
        return int(raw.decode("ascii").strip())
    except (OSError, ValueError, UnicodeDecodeError):
        return None


def check_stale(socket_path: Path, timeout: float = 0.5) -> None:
    """Remove a leftover socket file, or fail if a live server owns the path.

    Call it while holding the instance lock, just before binding.

    Args:
        socket_path: The socket path.
        timeout: How long to wait for a busy server to accept, in seconds.

    Raises:
        AlreadyRunning: A server accepts connections on the path.
        NotASocket: Something other than a socket is at the path (it is left alone).
        SocketPathError: The path cannot be probed or removed.
    """
    try:
        info = os.lstat(socket_path)
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(info.st_mode):
        raise NotASocket(
            f"{socket_path} exists and is not a socket; refusing to replace it: "
            "move it away or choose another --socket"
        )
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.settimeout(timeout)
        probe.connect(os.fspath(socket_path))
    except (ConnectionRefusedError, FileNotFoundError):
        pass  # Nobody listens: a crashed daemon's leftover.
    except (TimeoutError, BlockingIOError):
        # The listen backlog is full: someone is listening, just busy.
        raise AlreadyRunning(f"toolsetd is already running on {socket_path}") from None
    except OSError as exc:
        raise SocketPathError(f"cannot probe {socket_path}: {exc.strerror}") from None
    else:
        raise AlreadyRunning(f"toolsetd is already running on {socket_path}")
    finally:
        probe.close()
    try:
        socket_path.unlink(missing_ok=True)
    except OSError as exc:
        raise SocketPathError(f"cannot remove stale socket {socket_path}: {exc.strerror}") from None
