"""The watch process: watchfiles runs in a process of its own, which may die alone.

Theory of operation
-------------------
watchfiles' Rust watcher (notify) starts a thread when it is made. At the limit of
processes and threads (``RLIMIT_NPROC``, a cgroup's ``pids.max``: a unit's ``TasksMax=``,
which the tools' processes share) that thread cannot start, and notify panics, then panics
again in its destructor: the process aborts (SIGABRT). Made in the daemon, that was the
daemon. Checking first that threads can start leaves a race: a tool's fork (or any other
process of the user) can take the last place between the check and the watcher's thread,
and nothing in the daemon can hold a place for a thread another library starts.

So the watch runs in a child, ``python -P -c <_BOOTSTRAP> <daemon pid>``, the **watch
process**; :func:`watch_in_process` is an async iterator with ``watchfiles.awatch``'s
signature (the ``Watcher``'s ``watch_factory``) that starts it and reads its batches. Where
its watcher cannot start its thread, the watch process aborts, and the daemon sees it end
(``the watch process ended (killed by SIGABRT; it said: ...)``, the last line it wrote
on stderr, notify's panic): the watch failed as any other, the poll
serves on, and the watch is tried again later. Where the process itself cannot start, the
spawn fails (``EAGAIN``) the same way. The daemon starts no thread for a watch.

* **Code.** The process runs ``watchchild`` (its ``main``) and ``pdeath``, made from their
  source as the daemon read it when it imported this module (``_MODULES``), not the
  package on disk: after an upgrade in place under a running daemon (``pip install -U``,
  a ``git pull`` in an editable install) its watch processes still run the code it loaded,
  whose wire matches its own. And they import the standard library and watchfiles only,
  not the ``toolsetd.daemon`` package (structlog) nor this module's imports (anyio's
  streams, tempfile, subprocess). watchfiles itself is imported from disk as ever, where
  the daemon finds it: the process runs with the daemon's ``-I``/``-E``/``-s``/``-S``
  (``install.interpreter_flags``), or a daemon run by ``python -E`` watched with a
  watchfiles on a ``PYTHONPATH`` it ignores (each watch ended at its start, where that
  one could not load).
* **Wire** (one JSON text a line). The daemon writes the code on the process's stdin,
  ``[path, modules]`` (``_BOOTSTRAP`` says what it does with it), then one request,
  ``{"paths", "debounce", "step", "recursive", "timeout"}``, and leaves stdin open: EOF is
  the stop (seen within one ``step``). The process answers ``{"ready": true}`` once its
  watcher is made and watching (:meth:`ProcessWatch.established`), then
  ``{"changes": [[change, path], ...]}`` per batch (``watchchild.CHUNK`` to a line at
  most: a batch of more comes as several, each but the last with ``"more": true``, and is
  one batch again in the daemon, as watchfiles made it), or ``{"error", "message"}`` (the
  exception's type name and text) when watchfiles raised, and exits. The daemon raises
  that error again (a builtin type of that name, else ``RuntimeError``), so a name
  watchfiles cannot decode is still told apart (``watcher._undecodable_name``).
* **Lifetime.** One process per awatch generation. The daemon kills it when the generation
  ends (``aclose``); the kernel kills it when the daemon dies (``PR_SET_PDEATHSIG``). It
  leads its own session: a terminal's Ctrl-C for the daemon does not reach it.
* **Cost.** A Python process (about 17 MB resident and 0.05 s of CPU to start, 0.1-0.15 s
  to watching here, against 26 MB and 0.1 s of CPU when it imported the package; two tasks,
  as the awatch's two threads were in the daemon) per watch, and a start per restart; the
  events of a restart's gap are taken in by the poll that follows ``established``.
"""

from __future__ import annotations

import builtins
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterable
from pathlib import Path
from types import ModuleType
from typing import IO, Any

import anyio
import anyio.abc
from anyio.streams.buffered import BufferedByteReceiveStream
from watchfiles import Change

from . import pdeath, watchchild
from .install import interpreter_flags

__all__ = ["ProcessWatch", "watch_in_process"]

#: The longest line read from the process (a chunk of ``watchchild.CHUNK`` changes of long
#: paths).
_MAX_LINE = 64 * 1024 * 1024
#: Seconds the daemon waits for the process's exit status after its output ended.
_EXIT_WAIT = 1.0
#: Seconds a watch process has to say it watches (0.15 s here; a few seconds under load):
#: one stopped or stuck before that fails as any other watch, rather than leave the daemon
#: on the poll with nothing logged.
_READY_TIMEOUT = 60.0
#: How much of the start and of the end of the process's stderr is read for what its
#: ending says (a Rust panic's message, the last line of a Python traceback).
_STDERR_TAIL = 2048
#: The watch process's program, given with ``-c``: it reads one line on stdin, ``[path,
#: modules]``, sets its import path to ``path`` unless that is null, and runs each module's
#: source (``[name, file, source]``) as the module of that name, in order, then the last
#: one's ``main()``. The modules are ``_MODULES``; ``path`` is null unless the process was
#: started through ``/proc/self/exe`` (``-S``): that binary is the bare interpreter behind
#: the daemon's venv, and left to its own path its site-packages and the user's came before
#: the daemon's folders, where another version of what the process imports (an older
#: ``watchfiles``) was imported instead of the daemon's. The code comes on stdin rather than
#: in the command line: ``ps`` shows these few lines, not two modules' source.
_BOOTSTRAP = """\
import json, sys, types
path, modules = json.loads(sys.stdin.buffer.readline())
if path is not None:
    sys.path[:] = path
for name, file, source in modules:
    module = sys.modules[name] = types.ModuleType(name)
    module.__file__, module.__package__ = file, name.rpartition(".")[0]
    exec(compile(source, file, "exec"), module.__dict__)
module.main()
"""


def _module(module: ModuleType) -> list[str]:
    """``[name, file, source]`` of ``module`` for ``_BOOTSTRAP``: its source read now.

    Raises:
        OSError: The module has no source file to read (an install of ``.pyc`` files only),
            or it cannot be read.
        ValueError: It is not UTF-8.
    """
    file = module.__file__
    if file is None or not file.endswith(".py"):
        raise OSError(f"{module.__name__} has no source file ({file})")
    return [module.__name__, file, Path(file).read_text(encoding="utf-8")]


def _read_modules() -> tuple[str | None, str]:
    """``_MODULES`` and, where it could not be read, why (else '')."""
    try:
        return json.dumps([_module(pdeath), _module(watchchild)]), ""
    except (OSError, ValueError) as exc:
        return None, str(exc)


#: The watch process's code, read once, when the daemon imports this module: every watch
#: process runs the code the daemon loaded, whatever an upgrade in place (``pip install
#: -U``, a ``git pull`` in an editable install) put on disk since, and imports no more of
#: toolsetd than these two modules, neither of which imports more than the standard
#: library and watchfiles (not the ``toolsetd.daemon`` package, whose ``__init__`` imports
#: structlog). In JSON, for ``_BOOTSTRAP``. None where it could not be read
#: (``_UNREADABLE`` says why): the daemon starts all the same, and each watch fails at its
#: start, saying so, as any watch that cannot start (the poll serves).
_MODULES, _UNREADABLE = _read_modules()


class ProcessWatch:
    """One awatch generation in a watch process (made by :func:`watch_in_process`).

    Args:
        paths: The directories to watch.
        stop_event: Set to end the iteration (within one ``step``; at once, here).
        request: The process's request (see the module docstring).
        python: The interpreter to run the process with.
    """

    def __init__(
        self, paths: Iterable[str], stop_event: anyio.Event, request: dict[str, Any], python: str
    ) -> None:
        self._stop = stop_event
        self._request = {"paths": [str(path) for path in paths], **request}
        self._python = python
        self._proc: anyio.abc.Process | None = None
        self._stdout: BufferedByteReceiveStream | None = None
        #: The process's stderr: an unnamed file, read only once the process ended.
        self._stderr: IO[bytes] | None = None
        self._ready = False
        #: The changes of a batch whose last line has not come yet.
        self._partial: set[tuple[Change, str]] = set()
        #: Batches read and not yet taken (one came before the process said it was ready).
        self._batches: list[set[tuple[Change, str]]] = []

    def __aiter__(self) -> ProcessWatch:
        return self

    async def established(self) -> None:
        """Return once the watcher is made and watching (or the stop is set): an event
        from then on is reported. Raises as :meth:`__anext__` does, and ``RuntimeError``
        when the process has not said it watches within ``_READY_TIMEOUT``."""
        with anyio.move_on_after(_READY_TIMEOUT) as waited:
            while not self._ready:
                message = await self._message()
                if message is None:
                    return
                self._take(message)
        if waited.cancelled_caught:
            raise RuntimeError(
                f"the watch process did not start watching within {_READY_TIMEOUT:g} s"
            )

    async def __anext__(self) -> set[tuple[Change, str]]:
        while not self._batches:
            message = await self._message()
            if message is None:
                raise StopAsyncIteration
            self._take(message)
        return self._batches.pop(0)

    async def aclose(self) -> None:
        """End the process (killed: it holds nothing to finish) and reap it."""
        proc, self._proc = self._proc, None
        stderr, self._stderr = self._stderr, None
        if stderr is not None:
            stderr.close()
        if proc is None:
            return
        with anyio.CancelScope(shield=True):
            if proc.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
            await proc.aclose()

    def _take(self, message: dict[str, Any]) -> None:
        """Take in one line of the process: ready, a batch, or its error (raised again)."""
        if "error" in message:
            kind = getattr(builtins, str(message["error"]), None)
            if not (isinstance(kind, type) and issubclass(kind, Exception)):
                kind = RuntimeError
            raise kind(message["message"])
        if message.get("ready"):
            self._ready = True
        else:
            self._partial.update((Change(change), path) for change, path in message["changes"])
            if not message.get("more"):
                self._batches.append(self._partial)
                self._partial = set()

    async def _message(self) -> dict[str, Any] | None:
        """The process's next line (None once the stop is set); the process is started by
        the first call."""
        if self._stop.is_set():
            return None
        if self._stdout is None:
            self._stdout = await self._start()
        stdout = self._stdout
        line: bytes | None = None
        too_long = False
        async with anyio.create_task_group() as tg:

            async def stop() -> None:
                await self._stop.wait()
                tg.cancel_scope.cancel()

            tg.start_soon(stop)
            try:
                line = await stdout.receive_until(b"\n", _MAX_LINE)
            except (anyio.EndOfStream, anyio.IncompleteRead, anyio.BrokenResourceError):
                line = b""
            except anyio.DelimiterNotFound:
                too_long = True
            tg.cancel_scope.cancel()
        if too_long:
            raise RuntimeError(f"the watch process wrote a line longer than {_MAX_LINE} bytes")
        if line is None:
            return None
        if not line:
            raise RuntimeError(f"the watch process ended ({await self._ended()})")
        message: dict[str, Any] = json.loads(line)
        return message

    async def _start(self) -> BufferedByteReceiveStream:
        modules = _MODULES
        if modules is None:
            raise RuntimeError(
                f"the watch process's code could not be read when the daemon started "
                f"({_UNREADABLE}); reinstall toolsetd with its source files and restart it"
            )
        try:
            # Its stderr goes to a file, not a pipe: nothing reads it while the process
            # runs (a pipe left full would block it), and what it holds is read once the
            # process ended, for the log line that says so. Where the daemon has no
            # temporary folder it may write (a unit with a read-only /tmp), the watch
            # runs all the same, its words unkept: they only explain its end.
            self._stderr = stderr = _stderr_file()
            try:
                pid = str(os.getpid())
                # The daemon's -I/-E/-s/-S: its watchfiles is found where the daemon's is.
                flags = interpreter_flags()
                path: list[str] | None = None
                try:
                    command = [self._python, *flags, "-P", "-c", _BOOTSTRAP, pid]
                    proc = await _spawn(command, stderr)
                except PermissionError:
                    # The daemon's user may not reach its interpreter by its path (a folder
                    # on the way only root may search, the daemon started by a launcher
                    # that could): the running binary, by /proc, with the daemon's import
                    # path.
                    path = [entry for entry in sys.path if os.path.isabs(entry)]
                    command = ["/proc/self/exe", *flags, "-S", "-P", "-c", _BOOTSTRAP, pid]
                    proc = await _spawn(command, stderr)
            except BaseException:
                self._stderr = None
                if stderr is not None:
                    stderr.close()
                raise
        except OSError as exc:  # EAGAIN at the limit of processes and threads, EMFILE, ...
            raise type(exc)(
                exc.errno, f"the watch process could not start: {exc.strerror}"
            ) from None
        self._proc = proc
        assert proc.stdin is not None
        assert proc.stdout is not None
        with contextlib.suppress(anyio.BrokenResourceError):  # its end is read as such
            program = f"[{json.dumps(path)}, {modules}]\n"
            await proc.stdin.send(f"{program}{json.dumps(self._request)}\n".encode())
        return BufferedByteReceiveStream(proc.stdout)

    async def _ended(self) -> str:
        """How the process ended, once its output did (killed if it lingers)."""
        proc = self._proc
        assert proc is not None
        with anyio.move_on_after(_EXIT_WAIT):
            await proc.wait()
        code = proc.returncode
        if code is None:
            how = "its output closed"
        elif code < 0:
            try:
                how = f"killed by {signal.Signals(-code).name}"
            except ValueError:
                how = f"killed by signal {-code}"
        else:
            how = f"exit status {code}"
        said = self._said()
        return f"{how}; it said: {said}" if said else how

    def _said(self) -> str:
        """What the process said on stderr, printable, or '': its first Rust panic (the
        ``panicked at`` line and the message after it, within the first
        ``_STDERR_TAIL`` bytes: later panics are the abort's own), else its last line (a
        Python traceback's exception, within the last ``_STDERR_TAIL`` bytes)."""
        stderr = self._stderr
        if stderr is None:
            return ""
        try:
            size = os.fstat(stderr.fileno()).st_size
            head = os.pread(stderr.fileno(), _STDERR_TAIL, 0)
            tail = os.pread(stderr.fileno(), _STDERR_TAIL, max(0, size - _STDERR_TAIL))
        except OSError:
            return ""
        lines = _lines(head)
        panic = next((n for n, line in enumerate(lines) if " panicked at " in line), None)
        said = lines[panic : panic + 2] if panic is not None else _lines(tail)[-1:]
        return "".join(c if c.isprintable() else "?" for c in " ".join(said))


def _lines(text: bytes) -> list[str]:
    """The lines of ``text`` that are not blank, stripped."""
    return [line.strip() for line in text.decode("utf-8", "replace").splitlines() if line.strip()]


def _stderr_file() -> IO[bytes] | None:
    """An unnamed temporary file for the watch process's stderr, or None where none can
    be made (no temporary folder the daemon may write: its stderr is then dropped)."""
    try:
        return tempfile.TemporaryFile()  # closed by aclose
    except OSError:
        return None


async def _spawn(command: list[str], stderr: IO[bytes] | None) -> anyio.abc.Process:
    """The watch process, in a session of its own (a terminal's Ctrl-C for the daemon does
    not reach it); its stderr to ``stderr``, else dropped."""
    return await anyio.open_process(
        command,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=stderr if stderr is not None else subprocess.DEVNULL,
        cwd="/",
        start_new_session=True,
    )


def watch_in_process(
    *paths: Path | str,
    stop_event: anyio.Event,
    debounce: int,
    step: int,
    recursive: bool,
    rust_timeout: int,
    python: str = sys.executable,
    **_ignored: Any,
) -> ProcessWatch:
    """``watchfiles.awatch`` in a watch process (``watch_filter`` and ``yield_on_timeout``
    are ignored: every change is reported, and no empty batch).

    Args:
        paths: The directories to watch.
        stop_event: Set to end the iteration.
        debounce: awatch's grouping window for one batch, in ms.
        step: How often the watcher looks at the stop, in ms.
        recursive: Whether directories are watched recursively.
        rust_timeout: The watcher returns to Python this often with no events, in ms.
        python: The interpreter to run the process with.
        _ignored: awatch's other arguments.
    """
    request = {"debounce": debounce, "step": step, "recursive": recursive, "timeout": rust_timeout}
    return ProcessWatch([str(path) for path in paths], stop_event, request, python)
