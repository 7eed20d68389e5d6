"""Errors that mean the daemon ran short of descriptors or memory, not that a peer erred.

Theory of operation
-------------------
``EMFILE``, ``ENFILE``, ``ENOBUFS`` and ``ENOMEM`` from ``accept``, ``open`` or ``pipe``
say nothing about the peer, the path or the tool: they pass when calls finish and
clients leave. So an accept loop waits and tries again (the connections in the backlog
keep waiting; stopping would leave a daemon nobody can reach), and a request that needed
the resource is told the daemon is busy (``ServerBusy``, -32008: retry later), never that
its workspace is not a directory, that a workspace has no tools, or that something
internal broke. A catalog build that runs short stops (``catalog.py``) rather than drop
the sets it could not read from the snapshot it would keep.

At start the daemon raises its soft limit of open files to the hard one
(``raise_open_files_limit``): systemd and most logins give 1,024 soft and far more hard,
and each client, call (four pipes, a pidfd, a cgroup's files) and workspace watch takes
descriptors; a hundred idle connections could otherwise hold every one. The .NET runtime
does the same for the reference host, so its tools ran with the raised limit too.
"""

from __future__ import annotations

import contextlib
import errno
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any, TypeGuard

import anyio
import anyio.abc
import structlog
from toolsetd.protocol import jsontext
from toolsetd.protocol.errors import ServerBusy
from toolsetd.protocol.jsonrpc import is_request_id

from .large import raise_recursion_limit
from .logs import Throttle

__all__ = [
    "ACCEPT_RETRY_SECONDS",
    "OUT_OF_DESCRIPTORS",
    "OUT_OF_RESOURCES",
    "OUT_OF_TASKS",
    "SHORT_OF_ROOM",
    "Acceptor",
    "ProbeShort",
    "Shortage",
    "allocations_can_fail",
    "busy_when_short",
    "check_allocations_if_they_can_fail",
    "out_of_memory_answer",
    "out_of_memory_frame",
    "out_of_memory_in",
    "out_of_resources",
    "out_of_tasks",
    "raise_open_files_limit",
    "request_out_of_memory",
]

log = structlog.get_logger("toolsetd.exhaustion")

#: The ``errno`` values of a daemon short of file descriptors (its own, or the system's).
OUT_OF_DESCRIPTORS = frozenset({errno.EMFILE, errno.ENFILE})
#: The ``errno`` values of a daemon short of descriptors or memory.
OUT_OF_RESOURCES = OUT_OF_DESCRIPTORS | {errno.ENOBUFS, errno.ENOMEM}
#: What a call whose process could not start for ``EAGAIN`` is told besides its words
#: ("Resource temporarily unavailable"), which name neither the limit nor what to do.
OUT_OF_TASKS = (
    "toolsetd is at its limit of processes and threads (RLIMIT_NPROC, or its cgroup's "
    "pids.max, such as a unit's TasksMax=); retry when some calls have finished."
)
#: A fork, an allocation, a ``mkdir`` in a cgroup tree or a pipe that failed for want of
#: processes, threads, memory, descriptors or room in a tree (``cgroup.max.descendants``):
#: it passes.
SHORT_OF_ROOM = frozenset({errno.EAGAIN, errno.ENOMEM, errno.EMFILE, errno.ENFILE})


class ProbeShort(Exception):
    """A probe at start (bubblewrap's, the cgroup tree's) could not run for want of room
    (``SHORT_OF_ROOM``), so it says nothing about this machine: it is tried again once
    there is room (``Confinement.retry_probes``). The message says what failed."""


#: How ``EAGAIN`` reads: a failed fork's words, the daemon's or bubblewrap's (its
#: ``die_with_error`` ends its line with ``strerror``).
_EAGAIN_WORDS = os.strerror(errno.EAGAIN)


def out_of_tasks(words: str) -> str:
    """A failure's own ``words``, with ``OUT_OF_TASKS`` after them where they end with a
    fork's ``EAGAIN`` ("Resource temporarily unavailable"): the daemon's fork of a call's
    process, or bubblewrap's own fork of its sandbox ("bwrap: Creating new namespace
    failed: Resource temporarily unavailable")."""
    return f"{words}: {OUT_OF_TASKS}" if words.endswith(_EAGAIN_WORDS) else words


def out_of_resources(exc: BaseException | None) -> TypeGuard[OSError]:
    """Whether ``exc`` is an ``OSError`` that means the daemon ran short of a resource."""
    return isinstance(exc, OSError) and exc.errno in OUT_OF_RESOURCES


#: Seconds between two ``accept`` attempts while the daemon is short of a resource.
ACCEPT_RETRY_SECONDS = 0.1


class Shortage:
    """One listener's ``accept`` failures for want of descriptors or memory, said the way
    every listener of the daemon says them: once per episode (``<event>_retry``, with the
    ``errno`` and its words), and its end with the count of retries (``<event>_resumed``).

    Args:
        log: The logger to say it with.
        event: The events' prefix (``accept``, ``metrics_accept``, ``http_accept``).
    """

    def __init__(self, log: Any, event: str) -> None:
        self._log = log
        self._event = event
        self._retries = 0  # accept()s failed in a row for want of descriptors or memory

    def failed(self, error: OSError) -> None:
        """Count one failed ``accept``; the first of an episode is said."""
        if not self._retries:
            self._log.warning(f"{self._event}_retry", errno=error.errno, error=error.strerror)
        self._retries += 1

    def accepted(self) -> None:
        """An ``accept`` succeeded: an episode that was going on is over, and said so."""
        if self._retries:
            self._log.info(f"{self._event}_resumed", retries=self._retries)
            self._retries = 0


class Acceptor:
    """Takes connections from an anyio listener the way every listener of the daemon must.

    A peer that left before it was taken is skipped; running short of descriptors or
    memory is waited out, retrying every ``ACCEPT_RETRY_SECONDS`` (the connections in the
    backlog wait there until a call ends or a client leaves), said once per episode
    (``Shortage``); anything else is logged (``<event>_failed``) and raised: it is not the
    peer's doing and will not pass.

    Args:
        listener: The listener to accept on.
        log: The logger to say it with.
        event: The events' prefix (``accept``, ``metrics_accept``).
    """

    def __init__(self, listener: anyio.abc.SocketListener, log: Any, event: str) -> None:
        self._listener = listener
        self._log = log
        self._event = event
        self._shortage = Shortage(log, event)

    async def next(self) -> anyio.abc.SocketStream | None:
        """The next connection; None once the listener is closed (by us: a stop).

        Raises:
            anyio.BrokenResourceError, OSError: ``accept`` failed for another reason.
        """
        while True:
            try:
                stream = await self._listener.accept()
            except anyio.ClosedResourceError:
                return None
            except (anyio.BrokenResourceError, OSError) as exc:
                # anyio wraps accept()'s OSError in BrokenResourceError (its __cause__);
                # the listening socket itself is still good.
                error = exc.__cause__ if isinstance(exc, anyio.BrokenResourceError) else exc
                if isinstance(error, ConnectionAbortedError):
                    continue  # the peer left before we took it: nothing to serve
                if not out_of_resources(error):
                    failed = error if error is not None else exc
                    self._log.error(f"{self._event}_failed", error=repr(failed))
                    raise
                self._shortage.failed(error)
                await anyio.sleep(ACCEPT_RETRY_SECONDS)
                continue
            self._shortage.accepted()
            return stream


@contextlib.contextmanager
def busy_when_short(doing: str) -> Iterator[None]:
    """Inside, running short of a resource is ``ServerBusy`` (-32008) saying what failed.

    Args:
        doing: What the daemon could not do, after "could not" ("read the tool sets").
    """
    try:
        yield
    except OSError as exc:
        if not out_of_resources(exc):
            raise
        resource = "descriptors" if exc.errno in OUT_OF_DESCRIPTORS else "memory"
        raise ServerBusy(
            f"Server busy: toolsetd could not {doing} ({exc.strerror}); retry when some "
            "calls have finished.",
            {"resource": resource},
        ) from None


def raise_open_files_limit() -> tuple[int, int] | None:
    """Raise the soft limit of open files to the hard limit.

    Returns:
        The (old, new) soft limit when it was raised; None when it already was the hard
        limit or could not be changed.
    """
    import resource  # once, at start

    try:
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if soft == hard or (hard != resource.RLIM_INFINITY and 0 <= hard < soft):
            return None
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    except (OSError, ValueError):
        return None
    return soft, hard


#: ``request_out_of_memory``'s log lines: once a minute at most.
_OUT_OF_MEMORY_LOG = Throttle()
#: What a request the daemon ran out of memory serving is told.
_NO_MEMORY = (
    "Server busy: toolsetd ran out of memory serving this request (its memory is bounded); "
    "a tool call's tool may have run. Send it again when some calls have finished."
)
#: The answer ``out_of_memory_frame`` sends, but for its id and end: made at import, so
#: that it needs no memory when there is none.
_BUSY_ERROR: dict[str, Any] = {
    "code": ServerBusy.CODE,
    "message": _NO_MEMORY,
    "data": {"resource": "memory"},
}
_BUSY_HEAD = b'{"jsonrpc":"2.0","error":' + jsontext.dumps(_BUSY_ERROR) + b',"id":'


def out_of_memory_in(exc: BaseException) -> bool:
    """Whether ``exc`` is a ``MemoryError`` of a daemon whose memory is bounded
    (``jsontext.allocations_checked``), or a group (a task group's) of nothing else. In
    any other daemon it is an impossible size, a bug, and so is a group that holds any
    other error: those keep their incident."""
    if not jsontext.allocations_checked():
        return False
    if isinstance(exc, MemoryError):
        return True
    return isinstance(exc, BaseExceptionGroup) and exc.split(MemoryError)[1] is None


def request_out_of_memory(method: Any) -> ServerBusy:
    """The answer to a request the daemon ran out of memory serving, on any face, when its
    memory is bounded (``jsontext.allocations_checked``; elsewhere a ``MemoryError`` is an
    impossible size, a bug, and the faces keep their incident): the daemon's want, not
    the request's, as for a line it had no memory to parse, so busy (``-32008`` with
    ``{"resource": "memory"}``). Logs ``request_out_of_memory`` once a minute at most,
    ``refused`` counting, ``method`` the request's (the peer's text, cut)."""
    said = _OUT_OF_MEMORY_LOG.count("memory")
    if said is not None:
        shown = method[:64] if isinstance(method, str) else None
        log.warning("request_out_of_memory", method=shown, refused=said)
    return ServerBusy(_NO_MEMORY, {"resource": "memory"})


def out_of_memory_frame(request_id: Any, *, said: bool = True) -> bytes:
    """The line of ``request_out_of_memory``'s answer to ``request_id``, for an answer the
    daemon had no memory to write (``-32008``, ``id`` null if even the id cannot be). Made
    first, and only then said (``said``: logged as ``request_out_of_memory``), if the
    memory is there to say it."""
    try:
        shown = jsontext.dumps(request_id) if is_request_id(request_id) else b"null"
    except MemoryError:
        shown = b"null"
    frame = _BUSY_HEAD + shown + b"}\n"
    if said:
        with contextlib.suppress(MemoryError):
            request_out_of_memory(None)
    return frame


def out_of_memory_answer(request_id: Any) -> tuple[dict[str, Any], bytes]:
    """``out_of_memory_frame``'s answer as a message, and its JSON (no line end)."""
    frame = out_of_memory_frame(request_id)
    message = {"jsonrpc": "2.0", "error": _BUSY_ERROR, "id": request_id}
    return message, frame[:-1]


#: Where the kernel says whether it refuses allocations past what it can back (``2``).
OVERCOMMIT_SETTING = Path("/proc/sys/vm/overcommit_memory")


def allocations_can_fail(overcommit: Path = OVERCOMMIT_SETTING) -> str | None:
    """Why this process's memory allocations can fail, if they can: ``"RLIMIT_AS"`` or
    ``"RLIMIT_DATA"`` (a soft limit set), or ``"vm.overcommit_memory=2"``; None when only
    the OOM killer stops it (no limit, a cgroup's ``MemoryMax=``).

    Read at start: a limit set on a running daemon (``prlimit --pid``) is not seen.
    """
    import resource  # once, at start

    for name in ("RLIMIT_AS", "RLIMIT_DATA"):
        soft, _ = resource.getrlimit(getattr(resource, name))
        if soft != resource.RLIM_INFINITY:
            return name
    try:
        strict = overcommit.read_bytes().strip() == b"2"
    except OSError:  # no procfs: nothing says it
        strict = False
    return "vm.overcommit_memory=2" if strict else None


def check_allocations_if_they_can_fail() -> str | None:
    """At a process's start, before it parses anything: if its allocations can fail
    (``allocations_can_fail``), JSON is parsed and written by code that checks them
    (``jsontext.check_allocations``), every text by the standard library's parser.

    In every case the recursion limit is raised (``large.raise_recursion_limit``: as deep
    as orjson parses, and one limit for the argument check from the first call): the check
    process and toolsetctl's offline commands start here.

    Returns:
        Why checking was turned on (``allocations_can_fail``'s reason), or None.
    """
    raise_recursion_limit()
    bounded = allocations_can_fail()
    if bounded is not None:
        jsontext.check_allocations()
    return bounded


def open_standard_streams() -> None:
    """Open ``/dev/null`` on any of descriptors 0, 1 and 2 the daemon was started without.

    A supervisor or a shell (``toolsetd 2>&- &``) may start the daemon with one of them
    closed. Python then has ``sys.stderr`` (or ``stdout``, ``stdin``) ``None``, and the
    next descriptor the daemon opens takes the free number: the log writer crashed on the
    ``None`` before the daemon answered anything (exit 1, with no message where the
    operator could read one), and a descriptor that landed on 1 or 2 (asyncio's wake-up
    socket, a client's connection) would receive whatever is printed there. Called first
    thing in ``main``, before anything is opened. (``client/command.py`` does the same for
    ``toolsetctl``, which cannot import the daemon's modules.)
    """
    import io
    import os
    import sys

    for fd in (0, 1, 2):
        try:
            os.fstat(fd)
        except OSError:
            null = os.open(os.devnull, os.O_RDWR)  # the lowest free number: fd itself
            if null != fd:
                os.dup2(null, fd)
                os.close(null)
            os.set_inheritable(fd, True)  # a standard one: children get it (os.open's is not)
    if sys.stdin is None:
        sys.stdin = io.TextIOWrapper(io.FileIO(0, "r", closefd=False))
    if sys.stdout is None:
        sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), write_through=True)
    if sys.stderr is None:
        sys.stderr = io.TextIOWrapper(
            io.FileIO(2, "w", closefd=False), errors="backslashreplace", write_through=True
        )
