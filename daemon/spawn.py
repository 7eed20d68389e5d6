"""Starting a call's child: CPython's ``fork_exec`` with an environment encoded once.

Theory of operation
-------------------
``subprocess.Popen`` is general: for every spawn it checks two dozen options, encodes the
whole environment again (two ``os.fsencode`` calls and two concatenations a variable) and
builds the list of executables to try. A call's child needs none of that per call. Its
argv is a list of str, its streams are the runner's pipes, its session is new, and its
environment is the daemon's (fixed for the runner) plus seven or eight variables of the
call.

``Spawner`` keeps the runner's environment as the ``KEY=value`` byte strings that
``execve`` takes, and starts a child with ``_posixsubprocess.fork_exec``, the function
``Popen._execute_child`` calls, with the arguments it passes for the same options
(``close_fds``, ``pass_fds``, ``cwd``, ``start_new_session``, ``restore_signals``, vfork
allowed), then reads the exec-status pipe as ``Popen`` does. So the child, its file
descriptors and its errors are ``Popen``'s: a failed exec is an ``OSError`` naming the
file it failed on (the executable, or the working directory when ``chdir`` failed).

Two things ``Popen`` does beside the spawn are kept. A failure before the exec is raised
as this Python's ``Popen`` raises it (3.13 reports a failed ``chdir`` as ``noexec:chdir``
and names no file for the other steps; 3.11 and 3.12 name the working directory for
both). A child the runner could not reap within its bound is handed back
(``keep_unreaped``) and reaped by a later spawn, as ``Popen``'s ``_cleanup`` reaps an
instance dropped unreaped: no zombie is left for the daemon's lifetime.

``fork_exec`` is CPython's private API. Python 3.11 to 3.13 take the same 23 arguments
(checked against each version's ``subprocess.py``; 3.14 drops the last); on any other
version, or when ``direct`` is off, ``Spawner`` starts the child with ``Popen`` itself,
from the same environment.

Why: the parent's side of a ``/bin/true`` spawn with a call's pipes and a 42-variable
environment took 157 µs with ``Popen`` and 99 µs here, hot (medians of 2,000); with 2 ms
idle between spawns, as between a client's calls, 205 and 115 µs (docs/benchmarks.md,
the eleventh pass).
"""

from __future__ import annotations

import builtins
import os
import subprocess
import sys
import threading
from collections.abc import Iterable, Mapping, Sequence
from typing import Protocol

__all__ = ["Child", "Spawner", "env_path"]

from _posixsubprocess import fork_exec as _fork_exec  # CPython on POSIX: the daemon's platform

#: The versions whose ``fork_exec`` takes the arguments ``Spawner.spawn`` passes.
_DIRECT_VERSIONS = ((3, 11), (3, 12), (3, 13))
#: Most bytes read from the exec-status pipe (``Popen``'s bound).
_ERRPIPE_MAX = 50_000


class Child(Protocol):
    """A started child, as the runner uses it (``subprocess.Popen`` is one)."""

    @property
    def pid(self) -> int: ...

    @property
    def returncode(self) -> int | None: ...

    def poll(self) -> int | None:
        """Reap the child if it has exited (never blocks); its return code, else None."""


class _Started:
    """A child started by ``fork_exec``: its pid and, once reaped, its return code."""

    __slots__ = ("pid", "returncode")

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        """As ``Popen.poll``: reap without blocking; a child someone else reaped counts as 0."""
        if self.returncode is None:
            try:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:
                self.returncode = 0  # Popen's answer when the child is not ours to wait for
            else:
                if pid == self.pid:
                    self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode


class Spawner:
    """Starts children with one environment, encoded once.

    Args:
        base_env: The environment every child starts from. The call's own variables
            (``spawn``'s ``fixed``) are always set by the call: a value for one of them
            here is dropped.
        fixed: The names every call sets (its values come with each spawn).
        direct: Start children with ``fork_exec`` (None: where this Python's is known).
    """

    def __init__(
        self,
        base_env: Mapping[str, str],
        fixed: Iterable[str | bytes],
        direct: bool | None = None,
    ) -> None:
        encode = os.fsencode
        self._fixed = frozenset(encode(name) for name in fixed)
        env = {encode(k): encode(v) for k, v in base_env.items()}
        for name in self._fixed:
            env.pop(name, None)
        self._base_keys = frozenset(env)
        self._base = [k + b"=" + v for k, v in env.items()]
        if direct is None:
            direct = sys.version_info[:2] in _DIRECT_VERSIONS
        self.direct = direct
        #: Children handed back unreaped (``keep_unreaped``), and the lock spawns in worker
        #: threads take to reap them.
        self._unreaped: list[Child] = []
        self._unreaped_lock = threading.Lock()

    def keep_unreaped(self, child: Child) -> None:
        """Take a child that could not be reaped yet: the next spawns reap it once it exits.

        ``Popen`` does this for an instance dropped unreaped (its ``__del__`` and
        ``_cleanup``); a child started by ``fork_exec`` would stay a zombie instead.
        """
        with self._unreaped_lock:
            self._unreaped.append(child)

    def _reap_kept(self) -> None:
        with self._unreaped_lock:
            self._unreaped = [c for c in self._unreaped if c.poll() is None]

    def environment(
        self, extra: Mapping[str, str], fixed: Iterable[tuple[bytes, bytes]]
    ) -> list[bytes]:
        """A call's environment: the base, ``extra`` over it, then the fixed variables.

        Raises:
            ValueError: A name or value the file system encoding cannot carry, or a name
                holding ``=``.
        """
        env = self._base.copy()
        if extra:
            encode = os.fsencode
            added = {encode(k): encode(v) for k, v in extra.items()}
            if any(b"=" in k for k in added):
                raise ValueError("illegal environment variable name")
            if not added.keys().isdisjoint(self._base_keys):  # rare: replace in place
                env = [
                    k + b"=" + added.pop(k) if (k := e.partition(b"=")[0]) in added else e
                    for e in env
                ]
            env.extend(k + b"=" + v for k, v in added.items() if k not in self._fixed)
        env.extend(k + b"=" + v for k, v in fixed)
        return env

    def spawn(
        self,
        argv: list[str],
        *,
        env: list[bytes],
        cwd: str,
        stdin: int,
        stdout: int,
        stderr: int,
        pass_fds: tuple[int, ...],
    ) -> Child:
        """Start ``argv`` in a new session with these descriptors as its 0, 1 and 2.

        Every other descriptor of the daemon but ``pass_fds`` is closed in the child.

        Raises:
            OSError: The exec (or the ``chdir`` before it) failed, with the file named;
                or a fork, pipe or descriptor failure in the daemon.
            ValueError: An argument, the working directory or the environment holds a
                NUL byte.
            subprocess.SubprocessError: The child failed in a way ``Popen`` reports so.
        """
        if self._unreaped:
            self._reap_kept()
        if not self.direct:
            return subprocess.Popen(  # noqa: TID251 - the runner waits by pidfd, reaps once
                argv,
                stdin=stdin,
                stdout=stdout,
                stderr=stderr,
                cwd=cwd,
                env=dict(e.split(b"=", 1) for e in env),
                start_new_session=True,
                pass_fds=pass_fds,
            )
        # Popen._execute_child's POSIX path for these options, its checks left out.
        executable = os.fsencode(argv[0])
        if os.path.dirname(executable):
            executables: tuple[bytes, ...] = (executable,)
        else:  # as Popen (and os._execvpe): each folder of the child's PATH
            path = env_path(env)
            folders = os.get_exec_path({"PATH": path} if path is not None else {})
            executables = tuple(os.path.join(os.fsencode(d), executable) for d in folders)
        sys.audit("subprocess.Popen", argv[0], argv, cwd, env)
        errpipe_read, errpipe_write = os.pipe()
        low: list[int] = []
        while errpipe_write < 3:  # as Popen: never one of the child's standard descriptors
            low.append(errpipe_write)
            errpipe_write = os.dup(errpipe_write)
        for fd in low:
            os.close(fd)
        try:
            try:
                pid = _fork_exec(
                    argv,
                    executables,
                    True,  # close_fds
                    tuple(sorted({*pass_fds, errpipe_write})),
                    cwd,
                    env,
                    stdin,
                    -1,
                    -1,
                    stdout,
                    -1,
                    stderr,
                    errpipe_read,
                    errpipe_write,
                    True,  # restore_signals
                    True,  # start_new_session
                    -1,  # process_group
                    None,  # gid
                    None,  # extra groups
                    None,  # uid
                    -1,  # umask
                    None,  # type: ignore[arg-type]  # preexec_fn: none, as Popen passes it
                    getattr(subprocess, "_USE_VFORK", True),
                )
            finally:
                os.close(errpipe_write)
            data = bytearray()
            while True:  # EOF once the exec succeeded; the failure's report otherwise
                part = os.read(errpipe_read, _ERRPIPE_MAX)
                data += part
                if not part or len(data) > _ERRPIPE_MAX:
                    break
        finally:
            os.close(errpipe_read)
        if data:
            _raise_failure(pid, bytes(data), argv[0], cwd)
        return _Started(pid)


def env_path(env: Sequence[bytes]) -> str | None:
    """The ``PATH`` of an environment in ``execve``'s form (None: it has none)."""
    path = next((e[5:] for e in env if e.startswith(b"PATH=")), None)
    return os.fsdecode(path) if path is not None else None


def _raise_failure(pid: int, data: bytes, executable: str, cwd: str) -> None:
    """Reap the child that failed before its exec, and raise what it reported, as Popen."""
    try:
        os.waitpid(pid, 0)
    except ChildProcessError:
        pass
    try:
        name, hex_errno, message_bytes = data.split(b":", 2)
        message = message_bytes.decode()
    except ValueError:
        raise subprocess.SubprocessError(f"Bad exception data from child: {data!r}") from None
    kind = getattr(builtins, name.decode("ascii", "replace"), subprocess.SubprocessError)
    if isinstance(kind, type) and issubclass(kind, OSError) and hex_errno:
        number = int(hex_errno, 16)
        filename: str | None = executable
        if message == "noexec:chdir":  # 3.13 on: the chdir(cwd) before the exec failed
            filename, message = cwd, ""
        elif message == "noexec":  # a step before the exec; before 3.13 it was the chdir
            filename, message = (cwd if sys.version_info < (3, 13) else None), ""
        text = os.strerror(number) if number else message
        raise kind(number, text) if filename is None else kind(number, text, filename)
    if isinstance(kind, type) and issubclass(kind, BaseException):
        raise kind(message)
    raise subprocess.SubprocessError(message)
