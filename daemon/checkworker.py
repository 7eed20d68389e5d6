"""The check process: large arguments are checked against their schema away from the loop.

Theory of operation
-------------------
Checking a call's arguments is Python work, about a microsecond a value, and a schema's
``pattern`` runs in ``re``, a backtracking engine that holds the GIL for a whole match.
On the event loop, 11 MB of arguments held every other client for most of a second, and a
``pattern`` that backtracks over a long string held them until the check's time limit
(``validation.time_limit_for``: 0.1 s plus 1 s per MiB, 16 s for a 16 MiB message). A
worker thread helps with the first and not the second: the match holds the GIL, and only
the main thread's ``SIGALRM`` can stop it (``timelimit``).

So arguments past a size (``validation.off_loop``: more than 4,096 values or 64 Ki
characters of strings) are checked in a separate process, the *check process*: the same
``ArgumentValidators.errors_for`` on its own main thread, under its own alarm, on the
other CPU. The loop only encodes the arguments (the encoding a check on the loop would
make anyway, to size its time limit) and waits for the answer. Smaller arguments stay on
the loop: a check there takes a few milliseconds at most, and a ``pattern`` that
backtracks on them is stopped at 0.1 s and a little.

* **Lifetime.** The process is started by the first large check (``python -m
  toolsetd.daemon.checkworker``, about 0.2 s here) and kept for the next ones, unless a
  check left it holding more than ``_EXIT_GROWTH`` more memory than it started with (many
  small values: not all of it goes back to the system): then it says so in its answer and
  exits, and the next check starts another. It reads
  one request line at a time on stdin and answers one line on stdout; it leads its own
  session (a terminal's Ctrl-C does not reach it), and ends at EOF on stdin (the daemon
  closes it on a stop) or, by ``PR_SET_PDEATHSIG``, when the daemon dies however it dies.
* **One check at a time.** Concurrent large checks wait their turn (a lock); the answer
  read is always the request's own. A check whose caller goes away (cancelled) ends the
  process, which the next check starts again: an answer never outlives its request.
* **Bounded.** The process stops a check at its time limit itself and says so, as the loop
  would; its limit counts the process's CPU time (``run_limited(cpu=True)``), so a valid
  call's verdict does not depend on the machine's load (in wall time, a 12 MB call that
  takes 2.4 s of CPU to check was stopped at its 12 s on a fifth of a CPU). Should it not
  answer within ``_WALL_PER_CPU`` times the limit and ``_GRACE`` more (wall time: a
  process on a tenth of a CPU, its start and its parse included), it is killed and the
  call gets the same "was stopped" error: a process stopped or stuck where no signal
  reaches it (a stop signal, a C extension) holds its caller no longer.
  One that dies before answering (the OOM killer, whose first choice it makes itself:
  ``oom_score_adj`` 1000) gets an error that says so.
* **When no process can be had** (out of processes or descriptors, or one that exits by
  itself before its first answer: an install changed under the daemon), the check runs on
  the loop, as it did before the process existed: slower for the others, never refused.
  No other start is tried for ``_DOWN_SECONDS``; ``argument_check_process_failed`` is
  logged, once a minute at most.
* **An answer longer than ``_MAX_ANSWER``** (error paths into keys of megabytes) is not
  read: the process goes, and the call gets an error that says so.
* **Only the daemon's own code.** The process is started from the files on disk, which an
  upgrade in place replaces under a running daemon (``install``): run from other code, it
  checked with other rules (a verdict the daemon's own check on the loop does not give)
  or answered in another shape (every large call failed as an internal error). So its
  first line, before it reads anything, is the ``install.code_id`` of the code it runs,
  and the daemon sends it a request only if that is the one it took at its own start.
  Other code (or a process that cannot run while the install changed, or no interpreter
  at all: the venv removed) is not used: ``argument_check_process_upgraded`` is logged,
  once, with ``install.UPGRADED``, and large checks run on the loop until the daemon is
  restarted (served, not refused: the verdict is the daemon's own, and the others wait
  at most each check's time limit, as when no process can be had), or until the
  install changes again (another process is tried then: a
  reinstall of the same version, its files gone a moment, is given up for that moment
  only; ``_install_changed``). A process that greets with other code while the install
  reads as the daemon's own when it looks (it met such a reinstall half done, done since)
  is not given up: the next check starts another (``_other_code``).

Wire (the daemon's own, one JSON text a line): the process first says ``{"code": ...}``
(its ``install.code_id``); the daemon sends a blank line at once, and reads that (an
older process, which says nothing first, echoes the blank line at once, and is other
code too), then, from its own code only, the blank line's echo. The request is
``{"key", "size", "schema", "arguments"}`` (``key`` caches the compiled schema, ``size``
is the arguments' encoded length); the answer ``{"errors": [...]}``, or ``{"failure":
"..."}`` for an exception the check raised, which the daemon reports as an internal
error; either with ``"exit": true`` when the process exits after it. A blank line is
answered with a blank line: before it sends a request to a process that has answered
before, the daemon asks so, and one that died idle (its end not reported yet) is
replaced, not blamed on the call.
"""

from __future__ import annotations

import contextlib
import errno
import math
import os
import signal
import subprocess
import sys
from typing import TYPE_CHECKING, Any

import anyio
import anyio.abc
import structlog
from anyio.streams.buffered import BufferedByteReceiveStream
from toolsetd.protocol.jsontext import JsonNumber
from toolsetd.protocol.jsontext import dumps as json_dumps
from toolsetd.protocol.jsontext import loads as json_loads

from .exhaustion import check_allocations_if_they_can_fail
from .install import UPGRADED, code_id, interpreter_flags
from .large import LargeRequests
from .logs import Throttle
from .pdeath import die_with
from .validation import ArgumentValidators, stopped_message, time_limit_for

if TYPE_CHECKING:
    from .model import LoadedTool

__all__ = ["CheckProcessFailed", "CheckWorker", "main"]

log = structlog.get_logger("toolsetd.checkworker")

#: Seconds past ``_WALL_PER_CPU`` times a check's own time limit (CPU seconds) before its
#: process is killed: its start (~0.2 s here, seconds on a loaded machine) and the
#: transfer and parse of up to 16 MiB.
_GRACE = 10.0
#: Wall seconds a check process may take for each CPU second of its limit: one on a tenth
#: of a CPU still answers.
_WALL_PER_CPU = 10.0
#: The longest answer line read (100 errors, each with a JSON Pointer into the arguments).
_MAX_ANSWER = 64 * 1024 * 1024
_TOO_LONG_MESSAGE = (
    "checking the arguments against the tool's input schema failed: the errors found are "
    f"longer than {_MAX_ANSWER} bytes (their paths name keys that long); send smaller "
    "values, with shorter names"
)
#: Seconds after a process could not be started (or exited at its start) during which large
#: checks run on the loop without trying to start another.
_DOWN_SECONDS = 60.0
#: What an interpreter that cannot be started says when its install is gone or broken (the
#: venv removed or moved), not short of a resource.
_NOT_INSTALLED = frozenset({errno.ENOENT, errno.ENOTDIR, errno.EACCES, errno.ENOEXEC})
#: The longest first line read from a process (its ``{"code": ...}``, 30 bytes).
_MAX_HELLO = 4096
#: Seconds a stopping daemon waits for the process to end at EOF before killing it.
_CLOSE_WAIT = 1.0
#: A process whose resident memory grew by more than this since its start exits once it
#: has answered (saying so in its answer), and the next check starts a new one: what a
#: check of many small values took is not all given back to the system (1.5 million
#: integers left the process at ~64 MB, against ~25 at its start). Long strings are.
_EXIT_GROWTH = 32 * 1024 * 1024


class CheckProcessFailed(Exception):
    """The check raised in the check process (a bug, reported as an internal error)."""


class CheckWorker:
    """The daemon's end of the check process (see the module docstring)."""

    def __init__(
        self,
        time_limit: float,
        python: str = sys.executable,
        large_requests: LargeRequests | None = None,
        code: str | None = None,
    ) -> None:
        """Nothing is started until the first check.

        Args:
            time_limit: ``ArgumentValidators``' base time limit, in seconds.
            python: The interpreter that runs the process.
            large_requests: The daemon's worker slot for large requests
                (``large.LargeRequests``): the arguments are encoded for the process
                there, not on the loop (three million fractions took most of a second).
            code: The daemon's ``install.code_id``, taken at its start (by default, now):
                a process that runs other code is not used.
        """
        self._time_limit = time_limit
        self._python = python
        self._large = large_requests if large_requests is not None else LargeRequests()
        self._proc: anyio.abc.Process | None = None
        self._stdout: BufferedByteReceiveStream | None = None
        self._lock = anyio.Lock()
        self._failures = Throttle()
        self._closed = False
        self._hello = json_dumps({"code": code if code is not None else code_id()})
        #: The install's code (``_installed_code``) when a process of other code, or none,
        #: was had from it: no process is started again until it changes (None: not so).
        self._given_up: bytes | None = None
        #: Whether ``argument_check_process_upgraded`` was said.
        self._said_upgraded = False
        #: Whether the last process was of other code while the install read as the
        #: daemon's own (``_other_code``): another such is given up.
        self._doubted = False
        #: Whether the running process said it runs the daemon's code.
        self._same_code = False
        #: Until when (``anyio.current_time``) no process is started after one could not be.
        self._down_until = -math.inf
        #: Answers the running process has given.
        self._answered = 0
        #: Processes started (for tests and ``status``-like reports).
        self.started = 0

    @property
    def pid(self) -> int | None:
        """The running check process's pid, if one runs."""
        return self._proc.pid if self._proc is not None else None

    async def errors(self, loaded: LoadedTool, arguments: Any) -> list[dict[str, str]] | None:
        """The check of ``arguments`` against the tool's schema, made in the check process.

        Returns:
            What ``ArgumentValidators.errors`` returns; None when no process can be had
            (the caller checks on the loop instead).

        Raises:
            CheckProcessFailed: The check raised in the process.
        """
        text = await self._large.check(json_dumps, arguments)
        schema = loaded.tool.schema
        request = b"".join(
            (
                b'{"key":',
                json_dumps(loaded.hash),
                b',"size":%d,"schema":' % len(text),
                json_dumps(schema),
                b',"arguments":',
                text,
                b"}\n",
            )
        )
        limit = time_limit_for(self._time_limit, len(text))
        patience = limit * _WALL_PER_CPU + _GRACE
        del text
        async with self._lock:
            if self._closed or anyio.current_time() < self._down_until:
                return None
            if self._given_up is not None and not await self._install_changed():
                return None
            try:
                proc, stdout = await self._process()
            except OSError as exc:
                self._down(str(exc), exc.errno in _NOT_INSTALLED)
                return None
            try:
                with anyio.fail_after(patience):
                    if self._answered and not await _alive(proc, stdout):
                        # It died idle since its last answer (the OOM killer's first choice,
                        # an operator's kill): not this call's doing, so another is started.
                        code = await self._discard(wait=_CLOSE_WAIT)
                        log.info("argument_check_process_gone_idle", returncode=code)
                        try:
                            proc, stdout = await self._process()
                        except OSError as exc:
                            self._down(str(exc), exc.errno in _NOT_INSTALLED)
                            return None
                    if not self._same_code:
                        said = await _code_of(proc, stdout)
                        if said != self._hello:
                            await self._discard()
                            self._other_code(said.decode(errors="replace")[:100])
                            return None
                        await stdout.receive_until(b"\n", 1)  # the blank line's echo
                        self._same_code = True
                        self._doubted = False
                    assert proc.stdin is not None
                    await proc.stdin.send(request)
                    del request
                    answer = await stdout.receive_until(b"\n", _MAX_ANSWER)
            except TimeoutError:
                await self._discard()
                log.warning("argument_check_process_killed", seconds=round(patience, 1))
                return [{"path": "", "message": stopped_message(limit, self._time_limit, schema)}]
            except anyio.DelimiterNotFound:
                # Its answer goes on past the bound (error paths into keys of megabytes):
                # the rest is unread, so the process goes.
                await self._discard()
                log.warning("argument_check_answer_too_long", limit=_MAX_ANSWER)
                return [{"path": "", "message": _TOO_LONG_MESSAGE}]
            except (
                anyio.BrokenResourceError,
                anyio.EndOfStream,
                anyio.IncompleteRead,
            ) as exc:
                answered = self._answered
                code = await self._discard(wait=_CLOSE_WAIT)
                if not answered and code is not None and code >= 0:
                    # It ended by itself before its first answer: it could not run (an
                    # install changed under the daemon, say), not this call's doing.
                    self._down(f"the check process exited with status {code} at its start", True)
                    return None
                log.warning(
                    "argument_check_process_lost", returncode=code, error=type(exc).__name__
                )
                return [{"path": "", "message": _lost_message(code)}]
            except BaseException:
                # Cancelled mid-check (the caller went away): its answer must not be read
                # as the next request's, so the process goes; the next check starts one.
                await self._discard()
                raise
            self._answered += 1
            reply = json_loads(answer)
            if reply.get("exit"):  # it exits now: wait for it, as the next check would
                await self._discard(wait=_CLOSE_WAIT)
        if "failure" in reply:
            raise CheckProcessFailed(reply["failure"])
        errors: list[dict[str, str]] = reply["errors"]
        return errors

    async def _process(self) -> tuple[anyio.abc.Process, BufferedByteReceiveStream]:
        """The running process, started if there is none (or the last one ended)."""
        proc = self._proc
        if proc is not None and proc.returncode is None:
            assert self._stdout is not None
            return proc, self._stdout
        if proc is not None:
            await self._discard()
        # A session of its own: a terminal's Ctrl-C for the daemon does not reach it.
        proc = await anyio.open_process(
            [
                self._python,
                *interpreter_flags(),
                "-P",  # no current folder on sys.path (it is /, but nothing is assumed)
                "-m",
                "toolsetd.daemon.checkworker",
                str(os.getpid()),
                repr(self._time_limit),
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            cwd="/",
            start_new_session=True,
        )
        assert proc.stdout is not None
        self._proc, self._stdout = proc, BufferedByteReceiveStream(proc.stdout)
        self._answered = 0
        self._same_code = False
        self.started += 1
        log.debug("argument_check_process_started", pid=proc.pid)
        return proc, self._stdout

    def _down(self, error: str, install: bool) -> None:
        """No process could be had: checks run on the loop for ``_DOWN_SECONDS``, or for
        good when ``install`` may be why and it is no longer the daemon's (``_other_code``);
        not when it cannot be read now (out of descriptors, say)."""
        if install:
            installed = _installed_code()
            if installed is not None and installed != self._hello:
                self._other_code(error, installed)
                return
        self._down_until = anyio.current_time() + _DOWN_SECONDS
        said = self._failures.count("start")
        if said is not None:
            log.warning("argument_check_process_failed", error=error, failures=said)

    def _other_code(self, said: str, installed: bytes | None = None) -> None:
        """The process runs other code than the daemon, or none can run from the install as
        it is now (``installed``, if just looked at): no process is started again until
        the install changes, and the operator is told once.

        Not when the install reads as the daemon's own now, the first time: the process
        met a reinstall of the same version half done (its files gone a moment), which was
        done when the daemon looked. Given up then "until the install changes", it was
        given up for good, every large check on the loop and the log saying toolsetd was
        upgraded. The next check tries another; a second such process is given up (what it
        finds is not what the daemon finds: another Python under the same path, say)."""
        if installed is None:
            installed = _installed_code()
        if installed == self._hello and not self._doubted:
            self._doubted = True
            log.info("argument_check_process_other_code", said=said)
            return
        self._given_up = installed if installed is not None else b""
        if not self._said_upgraded:
            self._said_upgraded = True
            log.warning("argument_check_process_upgraded", error=UPGRADED, said=said)

    async def _install_changed(self) -> bool:
        """Whether the install changed since a process of other code, or none, was had
        from it: another is tried then. Looked at at each large check until it did, in a
        worker thread (~4 ms); not while it stays as it was (another Python under the same
        path, say: a process would greet with other code again)."""
        installed = await anyio.to_thread.run_sync(_installed_code)
        if installed is None or installed == self._given_up:
            return False
        self._given_up = None
        return True

    async def _discard(self, wait: float = 0.0) -> int | None:
        """Kill the process (unless it ends within ``wait`` seconds) and reap it; its exit
        status (None if none ran).

        One that ended by itself is waited for, not killed: ``Popen.send_signal`` reaps a
        process that has exited before it signals, and the child watcher's own wait then
        finds none and reports 255 in place of the real status.
        """
        proc, self._proc, self._stdout = self._proc, None, None
        if proc is None:
            return None
        with anyio.CancelScope(shield=True):
            if wait > 0:
                with anyio.move_on_after(wait):
                    await proc.wait()
            if proc.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
            await proc.aclose()
        return proc.returncode

    async def aclose(self) -> None:
        """End the process (EOF on its stdin; killed if it does not end at once)."""
        self._closed = True
        proc = self._proc
        if proc is None:
            return
        with anyio.CancelScope(shield=True):
            assert proc.stdin is not None
            with contextlib.suppress(anyio.BrokenResourceError, anyio.ClosedResourceError):
                await proc.stdin.aclose()
        await self._discard(wait=_CLOSE_WAIT)


async def _alive(proc: anyio.abc.Process, stdout: BufferedByteReceiveStream) -> bool:
    """Whether an idle check process still answers: a blank line, echoed.

    Its end may not be known yet when the next check comes (the kernel is still tearing it
    down, or the child watcher has not reported it): without this, that check's request
    went to a process already gone, and the call failed as if its own check had killed it.
    """
    assert proc.stdin is not None
    try:
        await proc.stdin.send(b"\n")
        return await stdout.receive_until(b"\n", 1) == b""
    except (
        anyio.BrokenResourceError,
        anyio.EndOfStream,
        anyio.IncompleteRead,
        anyio.DelimiterNotFound,
    ):
        return False


async def _code_of(proc: anyio.abc.Process, stdout: BufferedByteReceiveStream) -> bytes:
    """What a process just started says first: its ``{"code": ...}``, or a blank line (an
    older process, which answers the blank line sent here at once). The blank line's echo
    is still to be read after a ``{"code": ...}``: only the daemon's own code's is read,
    other code's need not come.

    Raises:
        anyio.BrokenResourceError, anyio.EndOfStream, anyio.IncompleteRead: It ended.
    """
    assert proc.stdin is not None
    await proc.stdin.send(b"\n")
    try:
        return await stdout.receive_until(b"\n", _MAX_HELLO)
    except anyio.DelimiterNotFound:
        return b"a first line longer than %d bytes" % _MAX_HELLO


def _installed_code() -> bytes | None:
    """The first line, but its end, of a process started now from the install, as far as
    the daemon can tell (its own Python's version); None when what is installed cannot be
    read now (out of descriptors, say)."""
    try:
        return json_dumps({"code": code_id()})
    except OSError:
        return None


def _lost_message(returncode: int | None) -> str:
    """The error of a check whose process ended before it answered."""
    if returncode is not None and returncode < 0:
        try:
            how = f"killed by {signal.Signals(-returncode).name}"
        except ValueError:
            how = f"killed by signal {-returncode}"
    else:
        how = f"exit status {returncode}"
    return (
        f"checking the arguments against the tool's input schema failed: the check "
        f"process ended ({how}) before it answered; send smaller values"
    )


# -- the process ----------------------------------------------------------------------------


def _plain_floats(value: Any) -> Any:
    """The schema as the daemon holds it: each ``JsonNumber`` a plain ``float`` again.

    tools.json's fractions are plain floats, which a message shows as Python writes them
    (``expected a number >= 1e-07``); read back from the request they are ``JsonNumber``s,
    shown as orjson wrote them (``1e-7``). The double is the same (orjson writes the
    shortest text that reads back as it).
    """
    kind = type(value)
    if kind is JsonNumber:
        return float(value)
    if kind is dict:
        return {key: _plain_floats(item) for key, item in value.items()}
    if kind is list:
        return [_plain_floats(item) for item in value]
    return value


def _first_to_go() -> None:
    """Have the OOM killer choose this process before the daemon.

    It holds a second copy of the arguments it checks (12 MB of ``[]`` took 394 MB
    parsed, in the daemon and here alike): out of memory, losing it fails one call
    (``argument_check_process_lost``), losing the daemon fails every client. Raising
    one's own score needs no privilege; where it cannot be written, nothing changes.
    """
    with contextlib.suppress(OSError), open("/proc/self/oom_score_adj", "w") as score:
        score.write("1000")


def main() -> None:
    """The check process: answer request lines on stdin until EOF."""
    parent, time_limit = int(sys.argv[1]), float(sys.argv[2])
    die_with(parent)
    _first_to_go()
    for signum in (signal.SIGINT, signal.SIGHUP):
        signal.signal(signum, signal.SIG_IGN)
    check_allocations_if_they_can_fail()  # the daemon's limits are this process's too
    validators = ArgumentValidators(time_limit=time_limit, cpu_time=True)
    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    try:  # first, which code this is: the daemon uses only its own (see ``install``)
        stdout.write(json_dumps({"code": code_id()}) + b"\n")
        stdout.flush()
    except BrokenPipeError:
        return
    baseline = _resident()
    while line := stdin.readline():
        if line == b"\n":  # the daemon asks whether it still answers (``_alive``)
            try:
                stdout.write(line)
                stdout.flush()
            except BrokenPipeError:
                return
            continue
        request = json_loads(line)
        del line
        try:
            answer: dict[str, Any] = {
                "errors": validators.errors_for(
                    request["key"],
                    _plain_floats(request["schema"]),
                    request["arguments"],
                    request["size"],
                )
            }
        except Exception as exc:
            answer = {"failure": f"{type(exc).__name__}: {exc}"}
        del request
        grown = _resident() - baseline > _EXIT_GROWTH
        if grown:
            answer["exit"] = True
        try:
            stdout.write(json_dumps(answer) + b"\n")
            stdout.flush()
        except BrokenPipeError:
            return
        if grown:
            return  # its answer said so: the daemon starts another for the next check


def _resident() -> int:
    """This process's resident memory, in bytes."""
    with open("/proc/self/statm", "rb") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


if __name__ == "__main__":
    main()
