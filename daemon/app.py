"""The composition root: builds every part of the daemon and runs it.

Theory of operation
-------------------
``main`` parses the command line into ``DaemonOptions`` and runs ``run_daemon`` on the
asyncio backend (never uvloop: it spawns by plain ``fork()``, which costs milliseconds
per call with a large heap). ``run_daemon`` is the only place that builds objects and
opens the top-level task group:

1. the systemd notifier and socket activation read (and remove) their variables first,
   so no child inherits them; then the orphan guard's sentinel starts
   (``reaper.OrphanGuard``), before any tool can be spawned;
2. without activation, the socket directory is prepared (0700), the instance lock is
   taken, a stale socket is replaced and a live one refused, and the socket is bound 0600
   (and made again, with its folder and lock, should a cleanup remove it: ``_keep_socket``);
3. registry, runner, handlers and server are built, the home catalog is loaded, and
   ``READY=1`` is sent once the listener accepts calls; a ``STATUS=`` line with the load
   follows whenever it changes (checked every ``status_interval`` seconds), and
   ``WATCHDOG=1`` every half ``WATCHDOG_USEC`` when systemd asks for it;
4. SIGHUP reloads; the first SIGTERM, SIGINT or SIGQUIT starts a graceful stop (``STOPPING=1``,
   the listener closes, in-flight calls get ``shutdown_grace`` seconds, then they are
   cancelled and their process groups killed, the connections closed after their last
   answer); a second one stops at once: every registered process group is SIGKILLed
   first, then every task is cancelled;
5. on the way out the socket is removed (unless systemd owns it, or the path names
   another file since), the lock released, and
   the orphan guard closed last (nothing is registered any more by then). Should the
   daemon die without this cleanup, the guard's sentinel kills the groups still running.

Why one module of this size: it is the composition root. Start-up, the signal task, the
graceful stop, the periodic status and the options-from-settings mapping each read or
change the one ``_State`` and the top-level task group, which no other module may hold.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import errno
import os
import signal
import socket
import sys
import traceback
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio
import anyio.abc
import structlog
from toolsetd.protocol import __version__, jsontext
from toolsetd.protocol.errors import InternalError, ServerBusy
from toolsetd.protocol.names import METHOD_MCP_BIND

from .activation import ActivationError, listen_fds
from .catalog import ManifestCache
from .checkworker import CheckWorker
from .confinement import Confinement, ConfinementConfig
from .connection import RequestContext
from .exhaustion import (
    check_allocations_if_they_can_fail,
    open_standard_streams,
    out_of_resources,
    raise_open_files_limit,
)
from .install import UPGRADED, at_start, sources_id
from .large import LargeRequests, raise_recursion_limit
from .logs import (
    configure_logging,
    drain_logs,
    finish_logging,
    holding,
    log_incident,
    log_interpreter_reports,
    say,
)
from .methods import Handlers
from .metrics import Metrics, MetricsSources, bind_metrics, serve_metrics
from .model import DEFAULT_RESERVED_NAMES, SetState, Source
from .observe import Observer, ObserverSet
from .paths import os_user_home
from .peercred import PeerPolicy
from .reaper import OrphanGuard
from .registry import Registry
from .runner import Runner, RunnerSettings
from .sdnotify import Notifier, scrub_environment
from .server import Server, ServerSettings, bind_unix_socket
from .service import Service, ServiceSettings
from .setcache import SetStore, default_cache_dir
from .settings import (
    ConfigError,
    Settings,
    SettingsReload,
    default_config_path,
    format_settings,
    key_fault,
    load_settings,
    parse_command_line,
    reload_settings,
    resolve_allow_group,
)
from .sockpath import (
    LockHandle,
    SocketPathError,
    acquire_instance_lock,
    check_stale,
    default_socket_path,
    prepare_socket_dir,
)
from .validation import ArgumentValidators, SchemaChecker

if TYPE_CHECKING:  # the HTTP endpoint's modules load only when --mcp-listen is given
    from .httpguard import ListenAddress
    from .mcp_session import McpServer
    from .watcher import Watcher  # and the watcher (with watchfiles) only when watching

__all__ = ["DaemonOptions", "main", "options_from_settings", "parse_args", "run_daemon"]

log = structlog.get_logger("toolsetd.app")


@dataclass(frozen=True, slots=True)
class DaemonOptions:
    """Everything the daemon is started with.

    Attributes:
        socket: The socket path, or None for the default (ignored under activation).
        home: The Crystal home.
        reserved: Tool names no external tool may take.
        server: Socket server limits.
        runner: Exec runner settings.
        max_running: Children running at once, daemon-wide; further calls wait.
        shutdown_grace: Seconds in-flight calls get on a graceful stop.
        status_interval: Seconds between checks whether systemd's ``STATUS=`` line changed.
        orphan_guard: Whether to run the sentinel that kills the tools' process groups
            if the daemon dies without cleaning up.
        workspace_idle_seconds: Workspaces unused this long are released.
        watch: Whether tool-set directories are watched for changes.
        max_watches: The most directories the watch takes (``Watcher``'s ``max_watches``).
        allow_gid: The gid of ``allow-group``, whose members may call besides our own uid
            and root; looked up once, at start (``settings.resolve_allow_group``).
        user_home: The OS user's home, for ``~`` in path arguments.
        metrics_listen: A loopback (host, port) to serve ``/metrics`` on, or None.
        traces: ``off``, ``otlp`` or ``console`` (OpenTelemetry, ``toolsetd[otel]``).
        tracer_provider: An OpenTelemetry ``TracerProvider`` to trace with (tests pass
            one with an in-memory exporter); None builds one from ``traces``.
        settings: The settings these options came from (a reload compares with them).
        args: The parsed flags (a reload merges them with the file again).
        confinement: The ``[confinement]`` table: cgroups, sandbox, per-set choices.
        mcp_listen: Loopback addresses to serve MCP over Streamable HTTP on (none: the
            endpoint is off, and its HTTP code is never imported).
        mcp_token_file: A 0600 file holding the bearer token for HTTP callers whose uid
            cannot be established.
        cache_dir: Where parsed tool sets are cached across restarts (``setcache.py``),
            or None for no persistent cache.
    """

    home: Path
    socket: Path | None = None
    reserved: frozenset[str] = DEFAULT_RESERVED_NAMES
    server: ServerSettings = field(default_factory=ServerSettings)
    runner: RunnerSettings = field(default_factory=RunnerSettings)
    max_running: int = 64
    shutdown_grace: float = 10.0
    status_interval: float = 2.0
    orphan_guard: bool = True
    workspace_idle_seconds: float = 3600.0
    watch: bool = True
    max_watches: int = 8192
    allow_gid: int | None = None
    user_home: Path = field(default_factory=Path.home)
    metrics_listen: tuple[str, int] | None = None
    traces: str = "off"
    tracer_provider: Any = None
    settings: Settings | None = None
    args: argparse.Namespace | None = None
    confinement: ConfinementConfig = field(default_factory=ConfinementConfig)
    mcp_listen: tuple[ListenAddress, ...] = ()
    mcp_token_file: Path | None = None
    cache_dir: Path | None = None


class _Stop(Exception):
    """Raised out of the signal task to end the daemon at once."""


class StartupError(Exception):
    """The daemon cannot start as asked (an address taken, an unsafe token file)."""


def _bind_mcp_http(options: DaemonOptions) -> tuple[list[tuple[Any, socket.socket]], str | None]:
    """Bind the MCP HTTP listeners and read the token, before anything is served.

    Imported here, not at the top: a daemon without ``--mcp-listen`` never loads h11.
    """
    if not options.mcp_listen:
        return [], None
    from .httpguard import TokenFileError, read_token_file
    from .mcphttp import bind_listen

    token = None
    if options.mcp_token_file is not None:
        try:
            token = read_token_file(options.mcp_token_file)
        except TokenFileError as exc:
            raise StartupError(str(exc)) from None
    bound: list[tuple[Any, socket.socket]] = []
    try:
        for address in options.mcp_listen:
            bound.append((address, bind_listen(address)))
    except OSError as exc:
        for _, sock in bound:
            sock.close()
        raise StartupError(
            f"--mcp-listen {address.url().removesuffix('/mcp')}: cannot listen there "
            f"({exc.strerror or exc})."
        ) from None
    return bound, token


def _bind_metrics(options: DaemonOptions) -> socket.socket | None:
    """Bind the ``/metrics`` listener before anything is served (None when it is off)."""
    if options.metrics_listen is None:
        return None
    host, port = options.metrics_listen
    try:
        return bind_metrics(options.metrics_listen)
    except OSError as exc:
        shown = f"[{host}]" if ":" in host else host
        raise StartupError(
            f"--metrics-listen {shown}:{port}: cannot listen there ({exc.strerror or exc})."
        ) from None


def _peer_policy(options: DaemonOptions) -> PeerPolicy:
    """Who may call: our uid and root, plus ``--allow-group``'s members."""
    policy = PeerPolicy.default()
    if options.allow_gid is None:
        return policy
    return policy.with_gids([options.allow_gid])


#: Seconds between two looks at whether the socket path still names the daemon's socket.
_SOCKET_CHECK_SECONDS = 2.0


class _OwnSocket:
    """The listening socket the daemon serves, and, when it made it, its path and lock.

    A cleanup can remove the socket, or its folder with the lock (systemd-tmpfiles ages
    ``/tmp/toolsetd-<uid>``, an operator's ``rm``): the daemon then served on, unreachable
    for good, and while its lock stayed no other daemon could start there either.
    ``_keep_socket`` makes them again (``remake``) and serves the new listener.
    """

    __slots__ = ("identity", "listener", "lock", "path")

    def __init__(self, path: Path, lock: LockHandle | None, identity: tuple[int, int] | None):
        self.path = path
        self.lock = lock
        #: The device and inode of the socket file the daemon made (None: systemd's).
        self.identity = identity
        self.listener: anyio.abc.SocketListener | None = None

    def remake(self) -> socket.socket:
        """Make the folder, the lock and the socket again, as at start (raises
        ``SocketPathError`` or ``OSError``: another daemon locked the path meanwhile, the
        folder is not safe, ...)."""
        prepare_socket_dir(self.path)
        if self.lock is None or not self.lock.names_path():
            lock = acquire_instance_lock(self.path)
            if self.lock is not None:
                self.lock.release()  # its file is gone: this only lets go of it
            self.lock = lock
        sock = bind_unix_socket(self.path)
        self.identity = _socket_identity(self.path)
        return sock

    async def aclose(self) -> None:
        """Close the listener (a graceful stop: no new connection)."""
        if self.listener is not None:
            await self.listener.aclose()


async def _keep_socket(
    own: _OwnSocket, server: Server, tg: anyio.abc.TaskGroup, state: _State
) -> None:
    """Make the socket again when the path no longer names it, and serve that one."""
    said: str | None = None  # the last failure or replacement logged, said once each
    while True:
        await anyio.sleep(_SOCKET_CHECK_SECONDS)
        if state.stopping:
            return
        found = _socket_identity(own.path)
        if found == own.identity:
            continue
        if found is not None:  # another file there now (not ours to remove): say so once
            if said != f"replaced {found}":
                said = f"replaced {found}"
                log.error("socket_replaced", socket=str(own.path))
            continue
        try:
            sock = own.remake()
        except (SocketPathError, OSError) as exc:
            error = str(exc) if isinstance(exc, SocketPathError) else exc.strerror or str(exc)
            if said != error:
                said = error
                log.error("socket_recreate_failed", socket=str(own.path), error=error)
            continue
        said = None
        listener = await anyio.abc.SocketListener.from_socket(sock)
        old, own.listener = own.listener, listener
        await tg.start(server.serve, listener)
        if old is not None:
            await old.aclose()
        log.warning("socket_recreated", socket=str(own.path))
        if state.stopping:  # the stop closed the old listener meanwhile
            await listener.aclose()
            return


def _socket_identity(path: Path) -> tuple[int, int] | None:
    """The device and inode the socket path names now (None: nothing there)."""
    try:
        found = os.stat(path, follow_symlinks=False)
    except OSError:
        return None
    return found.st_dev, found.st_ino


def _remove_socket(path: Path, identity: tuple[int, int] | None) -> None:
    """Unlink the daemon's socket, if the path still names it: a cleanup may have removed
    it, and another daemon may serve a socket of its own there since."""
    if identity is None or _socket_identity(path) != identity:
        return
    try:
        os.unlink(path)
    except OSError:
        pass


class _McpCore:
    """The daemon's one MCP core, built when the first MCP host arrives.

    A daemon that only native clients talk to never imports the MCP modules (~45 ms of
    every start); the first ``mcp.bind``, or ``--mcp-listen`` at start, builds it. They
    are imported only from the daemon's own code: after an upgrade in place (``install``)
    the files hold other code, which mixed into the daemon's ran with other rules or not at
    all (an ``ImportError``, reported as an internal error with an incident id), so the
    bind is refused with ``install.UPGRADED``: each bind until the install holds the
    daemon's code again (the restart; or the same version reinstalled, the files gone a
    moment: refused then for good, every MCP host after it was, until a restart).
    """

    def __init__(self, service: Service, sources: str) -> None:
        """``sources``: the daemon's ``install.sources_id``, taken at its start (its own
        code: the MCP modules load no library of the checks anew)."""
        self._service = service
        self._sources = sources
        #: Whether the MCP modules were imported (from the daemon's own code).
        self._loaded = False
        #: Whether the install was found changed by the last bind, said once (``_load``).
        self._upgraded = False
        self._server: McpServer | None = None
        #: A graceful stop has begun: a core built from now on answers listens at once.
        self._stopping = False

    def end_waits(self) -> None:
        """A graceful stop: every ``subscriptions/listen`` is answered, now and later (a
        core first built while stopping, by an ``mcp.bind`` on a connection still open
        during the calls' grace, too), and every call waiting for the operator's approval
        (``McpServer.end_waits``)."""
        self._stopping = True
        if self._server is not None:
            self._server.end_waits()

    def waiting(self) -> bool:
        """Whether a listen, or a call waiting for its approval, is still being served."""
        return self._server is not None and self._server.waiting()

    def _load(self) -> None:
        """Before the first import of the MCP modules: refuse if the install is no longer
        the daemon's code (one that cannot be read now, out of descriptors say, is not
        judged: the import then fails as it fails). Looked at again at each bind until
        they are imported (~3 ms a bind)."""
        if self._loaded:
            return
        with contextlib.suppress(OSError):
            if sources_id() != self._sources:
                if not self._upgraded:  # said once, not at each bind refused
                    self._upgraded = True
                    log.warning("mcp_code_upgraded", error=UPGRADED)
                raise InternalError(
                    "toolsetd was upgraded (or removed) under this daemon, which loads its "
                    "MCP code at its first MCP session: restart it"
                )
        self._loaded = True

    def get(self) -> McpServer:
        """The core, built on the first call.

        Raises:
            InternalError: The MCP modules are still to be imported, and toolsetd was
                upgraded under the daemon (``_load``).
        """
        if self._server is None:
            self._load()
            from .mcp_session import McpServer

            self._server = McpServer(self._service)
            if self._stopping:
                self._server.end_waits()
        return self._server

    async def bind(self, ctx: RequestContext, params: Any) -> dict[str, Any]:
        """The socket's ``mcp.bind`` (``mcp_socket.McpBinder``) over the core."""
        self._load()
        from .mcp_socket import McpBinder

        return await McpBinder(self.get()).bind(ctx, params)


def _mcp_http_endpoint(
    mcp: McpServer,
    policy: PeerPolicy,
    token: str | None,
    confinement: Confinement,
    large_requests: LargeRequests,
    max_body_bytes: int,
) -> Any:
    """The MCP HTTP endpoint over the daemon's one MCP core (imported only with --mcp-listen).

    Its body limit is the socket's line limit (``--max-message-bytes``): one message size,
    whichever face carries it, and one bound (four of them) on those in flight.
    """
    from .httpserver import HttpSettings
    from .mcp_session import Binding
    from .mcphttp import McpHttpEndpoint

    def open_session(
        bind: dict[str, Any], outbox: Any, calls: dict[str, anyio.Event], stateless: bool
    ) -> Any:
        return mcp.session(Binding.from_params(bind), outbox, calls, one_request=stateless)

    return McpHttpEndpoint(
        open_session,
        policy,
        token,
        http=HttpSettings(max_body_bytes=max_body_bytes),
        sandboxed=confinement.sandboxed_peer,
        large_requests=large_requests,
    )


async def run_daemon(
    options: DaemonOptions,
    *,
    task_status: anyio.abc.TaskStatus[str] = anyio.TASK_STATUS_IGNORED,
    process_exit: bool = False,
) -> None:
    """Run the daemon until SIGTERM, SIGINT or SIGQUIT (or cancellation).

    It raises the interpreter's recursion limit first (``large.raise_recursion_limit``),
    inside another program too, which the first large text raised before.

    Args:
        options: How to run.
        task_status: Receives the socket path once calls are accepted.
        process_exit: The process ends when this returns (``main``): the signals the
            daemon handles are ignored from the end of the run on
            (``_ignore_to_the_exit``), never at their default actions, and the signals
            it was started ignoring are set back to their defaults first
            (``_restore_ignored_signals``). Not for a daemon run inside another program
            (a test), which keeps its own signals.

    Raises:
        SocketPathError: The socket cannot be served (a live daemon holds it, or its
            directory is unsafe).
        ActivationError: systemd passed an unusable descriptor.
    """
    raise_recursion_limit()  # one limit for the argument check from the first call
    # Signals first: once the socket listens a client may connect, and a SIGHUP or
    # SIGTERM from then on must reach our handlers, not the default actions. SIGUSR1 and
    # SIGUSR2 too: their default action ends the daemon with no cleanup (a stray
    # ``kill -USR1``, an init passing them on), so they are logged and ignored. A handler,
    # not SIG_IGN, which a tool would inherit across its exec.
    with anyio.open_signal_receiver(*_HANDLED_SIGNALS) as signals:
        unblocked = _unblock_signals()  # after the handlers: a pending SIGTERM stops us
        if unblocked:
            log.info("signals_unblocked", signals=unblocked)
        # Only for a process of its own: inside another program the ignored signals are
        # that program's to keep (as in ``_ignore_to_the_exit``).
        restored = _restore_ignored_signals() if process_exit else []
        if restored:
            log.info("signals_restored", signals=restored)
        if process_exit:  # the child watcher is the process's, as the signals are
            _wait_for_children_by_pidfd()
        try:
            await _run(options, signals, task_status)
        finally:
            if process_exit:
                _ignore_to_the_exit()


def _wait_for_children_by_pidfd() -> None:
    """On Python 3.11, have asyncio wait for the check process through a pidfd, as 3.12
    does where the kernel has ``pidfd_open``.

    3.11's default (``ThreadedChildWatcher``) waits for each process in a thread of its
    own, started after the process. At the limit of processes and threads
    (``RLIMIT_NPROC``; a cgroup's ``pids.max``, a unit's ``TasksMax=`` its tools share)
    there was room for the process and none for the thread: the call whose large
    arguments started it was -32603, and the process was left running, unwaited, its
    pipes open in the daemon (``anyio.open_process`` does not close what it made).
    """
    if sys.version_info >= (3, 12):
        return
    try:
        os.close(os.pidfd_open(os.getpid()))
    except OSError:  # an older kernel: the threads, as before
        return
    watcher = _PidfdChildWatcher()
    asyncio.set_child_watcher(watcher)
    watcher.attach_loop(asyncio.get_running_loop())


if sys.version_info < (3, 12):  # the watchers are gone from 3.14
    from typing import TypeVarTuple

    _Ts = TypeVarTuple("_Ts")

    class _PidfdChildWatcher(asyncio.PidfdChildWatcher):
        """asyncio's pidfd child watcher, which leaves no process unwaited when it cannot
        watch one.

        ``pidfd_open`` runs after the spawn, and can fail there (``EMFILE`` at the
        descriptor limit, ``ENOMEM``): asyncio then raised with the process started and
        nobody to wait for it. The check process was left running, its two pipes open in
        the daemon, until the daemon ended (and another each time the next large check
        tried again). Here the process is killed and reaped at once (a child not reaped
        yet keeps its pid: the kill cannot reach another process), its transport is told
        it exited, so its pipes close, and the error is raised as before: the caller
        (``CheckWorker``) checks on the loop, as where no process can be had.
        """

        def add_child_handler(
            self, pid: int, callback: Callable[[int, int, *_Ts], object], *args: *_Ts
        ) -> None:
            try:
                super().add_child_handler(pid, callback, *args)
            except OSError:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
                try:
                    _, status = os.waitpid(pid, 0)  # killed: it ends at once
                except ChildProcessError:
                    returncode = 255  # reaped elsewhere: what asyncio says then
                else:
                    returncode = os.waitstatus_to_exitcode(status)
                callback(pid, returncode, *args)
                raise


def _ignore_to_the_exit() -> None:
    """Take the daemon's signals from the event loop and ignore them until the exit.

    Leaving the signal receiver puts back each signal's default action, and the process
    still winds down after that (the event loop's end, the last log lines, the spans): a
    SIGHUP then (a reload sent as it stopped), a stray SIGUSR1, a second SIGTERM or a
    Ctrl-C ended it by that signal instead of the stop's exit 0 (as process 1's child,
    the container's code was 128 + N). Each is ignored here and then taken from the loop,
    so the receiver finds none to put back. Ignored, not handled: nothing is spawned from
    here on, so no tool inherits it.

    Ignored first, and never at its default action on the way. The loop's own removal
    (``remove_signal_handler``) sets the default before anyone can ignore the signal, and
    a signal in that gap (two system calls, but a preempted daemon stays there a while:
    a whole run of the tests on a loaded machine met it) ended the daemon by it. So the
    loop is made to forget its handler without putting anything back. Its table of them
    is private (a dict by signal number, as in CPython's asyncio since 3.4); a loop
    without one (another implementation, a later Python) is given the public removal,
    gap and all.
    """
    loop = asyncio.get_running_loop()
    registered = getattr(loop, "_signal_handlers", None)
    for signum in _HANDLED_SIGNALS:
        signal.signal(signum, signal.SIG_IGN)
        if isinstance(registered, dict):
            registered.pop(signum, None)
        else:
            loop.remove_signal_handler(signum)
            signal.signal(signum, signal.SIG_IGN)
    if registered == {}:  # as the loop's removal of its last handler does
        with contextlib.suppress(ValueError, OSError):
            signal.set_wakeup_fd(-1)


def _unblock_signals() -> list[str]:
    """Clear the signal mask the daemon was started with; returns the names it held.

    A parent that blocks signals passes its mask on (a host's worker thread, a
    supervisor): blocked, SIGTERM and SIGINT never stopped the daemon and SIGHUP never
    reloaded it, and every tool inherited the mask (a child gets its spawning thread's),
    so a timed-out or cancelled tool never got its grace SIGTERM. systemd clears it for a
    service; this does so for any start. Called before any thread starts: a thread takes
    the mask of the one that starts it.
    """
    held = signal.pthread_sigmask(signal.SIG_SETMASK, ())
    return sorted(s.name if isinstance(s, signal.Signals) else f"SIG{int(s)}" for s in held)


#: Left ignored when the daemon starts so: SIGPIPE and SIGXFSZ, which the interpreter
#: ignores itself at start (it wants EPIPE and EFBIG; a child gets them back at their
#: default actions when it is spawned), and the terminal's job-control signals, which a
#: parent ignores so that a daemon writing to a terminal from the background is never
#: stopped (frozen, calls and all).
_KEPT_IGNORED = frozenset(
    {signal.SIGPIPE, signal.SIGXFSZ, signal.SIGTSTP, signal.SIGTTIN, signal.SIGTTOU}
)


def _restore_ignored_signals() -> list[str]:
    """Put back the default action of each signal the daemon was started ignoring; returns
    their names.

    ``SIG_IGN`` survives ``exec``: a parent that ignores SIGCHLD (to leave no zombies) or
    a non-interactive shell's ``toolsetd &`` (SIGQUIT) hands it on. With SIGCHLD ignored
    the kernel reaped every tool at once and the daemon never learnt how one ended (a tool
    that exited 5 was a call that went "ok" with exit code 0; bubblewrap's probe waited
    for its child until it timed out), and every tool inherited the ignored signals.
    systemd resets them for a service; this does so for any start. The signals the
    daemon handles are left to their handlers.
    """
    restored = []
    for signum in sorted(signal.valid_signals()):
        if signum in _KEPT_IGNORED or signum in _HANDLED_SIGNALS:
            continue
        try:
            if signal.getsignal(signum) != signal.SIG_IGN:
                continue
            signal.signal(signum, signal.SIG_DFL)
        except (OSError, ValueError):  # SIGKILL, SIGSTOP, the C library's own
            continue
        restored.append(signum.name if isinstance(signum, signal.Signals) else f"SIG{int(signum)}")
    return restored


async def _run(
    options: DaemonOptions,
    signals: AsyncIterator[int],
    task_status: anyio.abc.TaskStatus[str],
) -> None:
    notifier = Notifier.from_environ(os.environ)
    activated = listen_fds(os.environ)
    base_env = scrub_environment(os.environ)
    if activated:
        socket_path = Path(activated[0].getsockname() or "/")
    else:
        socket_path = options.socket or default_socket_path(os.environ)
    # Before the sentinel starts: it must know the cgroup tree it kills should we die.
    confinement = Confinement.probe(
        options.confinement, options.user_home, options.home, socket_path,
        http_peers=bool(options.mcp_listen), token_file=options.mcp_token_file,
    )  # fmt: skip
    # The groups are tracked with or without the sentinel: a forced stop SIGKILLs them.
    guard = OrphanGuard()
    # A tree a deferred probe makes later is the sentinel's to kill too.
    confinement.on_cgroup_tree = lambda folder: guard.set_cgroup(str(folder))
    if options.orphan_guard:
        try:
            cgroups = confinement.cgroups
            guard.start(cgroup=str(cgroups.folder) if cgroups is not None else None)
        except OSError as exc:  # the daemon still serves; the groups are still tracked
            log.error("orphan_guard_unavailable", error=exc.strerror or str(exc))
            if exc.errno == errno.EAGAIN or out_of_resources(exc):
                # A moment's shortage (its limit of tasks, say): a later spawn starts it.
                guard.start_later(cgroup=str(cgroups.folder) if cgroups is not None else None)
    try:
        await _serve(
            options, signals, task_status, notifier, activated, base_env, guard, confinement
        )
    finally:
        guard.close()
        confinement.close()


async def _serve(
    options: DaemonOptions,
    signals: AsyncIterator[int],
    task_status: anyio.abc.TaskStatus[str],
    notifier: Notifier,
    activated: list[socket.socket],
    base_env: dict[str, str],
    guard: OrphanGuard,
    confinement: Confinement,
) -> None:
    lock = None
    socket_path: Path
    if activated:
        sock = activated[0]
        socket_path = Path(sock.getsockname() or "")
        if activated[1:]:
            # A second ListenStream= (a drop-in): systemd listens there too, so its clients
            # connect and wait for ever; the journal must say which paths are not served.
            log.warning(
                "activation_sockets_ignored",
                served=str(socket_path),
                ignored=[str(extra.getsockname()) for extra in activated[1:]],
            )
        for extra in activated[1:]:
            extra.close()
        owns_socket = False
    else:
        socket_path = options.socket or default_socket_path(os.environ)
        prepare_socket_dir(socket_path)
        lock = acquire_instance_lock(socket_path)
        try:
            check_stale(socket_path)
            sock = bind_unix_socket(socket_path)
        except BaseException:
            # Another daemon answers there (its lock file a cleanup removed), or the bind
            # failed: this lock file is ours, and no daemon stopping would remove it.
            lock.release()
            raise
        owns_socket = True
    own = _OwnSocket(socket_path, lock, _socket_identity(socket_path) if owns_socket else None)
    try:
        listener = own.listener = await anyio.abc.SocketListener.from_socket(sock)
        http_sockets, http_token = _bind_mcp_http(options)
        metrics_socket = _bind_metrics(options)
        peer_policy = _peer_policy(options)
    except BaseException:
        # Nothing was served: leave no socket behind that the next start must judge stale.
        if owns_socket:
            _remove_socket(socket_path, own.identity)
        if lock is not None:
            lock.release()
        raise
    # The code this daemon runs, as installed at its start (before its modules loaded,
    # when run as toolsetd): what it starts or imports from disk later must be the same.
    libraries, sources, code = at_start()
    # The cache's files are read and written by orjson, for speed: a daemon whose
    # allocations can fail (``jsontext.check_allocations``) reads every set instead.
    store = (
        SetStore(options.cache_dir)
        if options.cache_dir is not None and not jsontext.allocations_checked()
        else None
    )
    registry = Registry(
        options.home,
        options.reserved,
        ManifestCache(store=store, schemas=SchemaChecker(libraries=libraries)),
        idle_seconds=options.workspace_idle_seconds,
    )
    limiter = anyio.CapacityLimiter(options.max_running)
    runner = Runner(
        options.runner,
        limiter,
        base_env,
        guard=guard,
        confinement=confinement,
        manifest_problem=registry.manifest_problem,
    )
    server: Server
    watcher: Watcher | None = None
    state = _State(options=options)

    def follow_workspace(workspace: Path) -> None:
        if watcher is not None:
            watcher.add_workspace(workspace)

    metrics = Metrics(
        MetricsSources(
            in_flight=lambda: len(service.calls),
            queued=lambda: limiter.statistics().tasks_waiting,
            connections_open=lambda: len(server.connections),
            connections_accepted=lambda: server.accepted,
            catalogs=lambda: [
                c for c in (registry.cached(k) for k in (None, *registry.workspaces)) if c
            ],
            generation=lambda: registry.generation,
            watch=lambda: watcher.status() if watcher is not None else None,
        )
    )
    observers: list[Observer] = [metrics]
    if options.tracer_provider is not None:
        from .tracing import Tracing  # the otel extra: imported only when tracing is on

        observers.append(Tracing(options.tracer_provider))
    observer = ObserverSet(observers)

    def reload_config() -> dict[str, Any]:
        return _reload_config(state, runner, limiter, server, registry)

    # Large requests: one bound on their bytes in flight and one worker slot, every face's.
    large_requests = LargeRequests()
    validators = ArgumentValidators(libraries=libraries)
    checks = CheckWorker(validators.time_limit, large_requests=large_requests, code=code)
    service = Service(
        ServiceSettings(socket=str(socket_path), home=options.home, user_home=options.user_home),
        registry,
        runner,
        validators,
        notifier,
        on_workspace=follow_workspace,
        observer=observer,
        confinement=confinement,
        checks=checks,
        large_requests=large_requests,
    )
    mcp = state.mcp = _McpCore(service, sources)
    handlers = Handlers(
        service,
        lambda: server.connections.values(),
        extra={METHOD_MCP_BIND: mcp.bind},
        reload_config=reload_config,
        metrics_text=metrics.exposition,
        watch_status=lambda: watcher.status() if watcher is not None else None,
    )
    server = Server(
        options.server,
        handlers.methods(),
        peer_policy,
        observer=observer,
        large_requests=large_requests,
    )

    async def on_change(changes: dict[Path | None, frozenset[tuple[str, str]] | None]) -> None:
        await handlers.reload_catalogs(None if None in changes else set(changes), changes)

    if options.watch:
        # Imported here: a daemon run with --no-watch never loads watchfiles (~4 ms a start).
        from .watcher import Watcher

        watcher = Watcher(options.home, on_change, max_watches=options.max_watches)

    try:
        async with anyio.create_task_group() as tg:
            if watcher is None:
                await registry.catalog(None)
            else:  # built after the watcher's baseline probe: see Watcher.run
                await tg.start(partial(watcher.run, prepare=partial(registry.catalog, None)))
            if metrics_socket is not None:
                await tg.start(serve_metrics, metrics, metrics_socket)
            await tg.start(server.serve, listener)
            if owns_socket:
                tg.start_soon(_keep_socket, own, server, tg, state)
            tg.start_soon(_evict_idle, registry, watcher, server, service)
            tg.start_soon(_drain_logs)
            interval = notifier.watchdog_interval()
            if interval:
                tg.start_soon(_watchdog, notifier, interval)
            if http_sockets:
                state.http = _mcp_http_endpoint(
                    mcp.get(),
                    peer_policy,
                    http_token,
                    confinement,
                    large_requests,
                    options.server.max_frame_size,
                )
                await tg.start(state.http.serve, http_sockets)
            log.info(
                "daemon_started",
                version=__version__,
                pid=os.getpid(),
                socket=str(socket_path),
                home=str(options.home),
                activated=bool(activated),
                config=str(options.settings.config_path)
                if options.settings and options.settings.config_path
                else None,
            )
            state.status = _status_text(registry, handlers, state)
            if not notifier.ready(state.status) and notifier.enabled:
                # systemd waits for it (Type=notify) and ends the start at TimeoutStartSec=:
                # without this line the journal gave no reason for that.
                log.error("ready_not_delivered", notify_socket=notifier.shown_address)
            if notifier.enabled:
                tg.start_soon(_report_status, notifier, registry, handlers, state)
            task_status.started(str(socket_path))
            await _handle_signals(signals, tg, server, handlers, own, notifier, guard, state)
    finally:
        with anyio.CancelScope(shield=True):
            await checks.aclose()
            if owns_socket:
                _remove_socket(socket_path, own.identity)
            if own.lock is not None:
                own.lock.release()
            log.info("daemon_stopped")


class _State:
    """What the status reporter, the signal handling and a config reload share.

    ``options`` is replaced whole by a config reload; readers take it afresh each time.
    A plain slotted class: nothing compares or prints it, and a dataclass would cost every
    start ~0.4 ms to create (``@dataclass`` compiles its methods with ``exec``).
    """

    __slots__ = ("http", "mcp", "options", "status", "stopping")

    def __init__(self, options: DaemonOptions) -> None:
        self.options = options
        self.stopping = False
        self.status = ""
        #: The MCP HTTP endpoint (``mcphttp.McpHttpEndpoint``) when ``--mcp-listen`` is on.
        self.http: Any = None
        #: The MCP core (``_McpCore``), once the handlers are built.
        self.mcp: _McpCore | None = None


def _reload_config(
    state: _State,
    runner: Runner,
    limiter: anyio.CapacityLimiter,
    server: Server,
    registry: Registry,
) -> dict[str, Any]:
    """Read the config file again and apply the keys that can change while running.

    Returns:
        ``reload``'s ``config`` member: ``applied``, ``restartNeeded``, ``error``.
        A bad file keeps every running setting (``error`` says why).
    """
    options = state.options
    if options.settings is None or options.args is None:
        return {"applied": [], "restartNeeded": [], "error": None}
    try:
        outcome = reload_settings(options.settings, options.args, os.environ)
        fresh = options_from_settings(outcome.settings, options.args)
        _check_next_start(outcome, options.args)
    except ConfigError as exc:
        log.error("config_reload_failed", error=str(exc))
        return {"applied": [], "restartNeeded": [], "error": str(exc)}
    runner.update_settings(
        replace(
            runner.settings,
            output_limit_chars=fresh.runner.output_limit_chars,
            kill_grace_seconds=fresh.runner.kill_grace_seconds,
            progress_interval_seconds=fresh.runner.progress_interval_seconds,
        )
    )
    limiter.total_tokens = fresh.max_running
    # A new value reaches the connections opened from now on (each keeps its own).
    server.settings = replace(
        server.settings,
        max_frame_size=fresh.server.max_frame_size,
        max_connections=fresh.server.max_connections,
        max_calls_per_connection=fresh.server.max_calls_per_connection,
        idle_timeout=fresh.server.idle_timeout,
    )
    if state.http is not None:
        state.http.set_max_body_bytes(fresh.server.max_frame_size)
    registry.idle_seconds = fresh.workspace_idle_seconds
    state.options = replace(
        options,
        runner=runner.settings,
        server=server.settings,
        max_running=fresh.max_running,
        shutdown_grace=fresh.shutdown_grace,
        status_interval=fresh.status_interval,
        workspace_idle_seconds=fresh.workspace_idle_seconds,
        settings=outcome.settings,
    )
    log.info(
        "config_reloaded",
        path=str(outcome.settings.config_path) if outcome.settings.config_path else None,
        applied=list(outcome.applied),
        restart_needed=list(outcome.restart_needed),
    )
    if outcome.restart_needed:
        log.warning("config_restart_needed", keys=list(outcome.restart_needed))
    return {
        "applied": list(outcome.applied),
        "restartNeeded": list(outcome.restart_needed),
        "error": None,
    }


def _check_next_start(outcome: SettingsReload, args: argparse.Namespace) -> None:
    """Refuse, with the start's own message, a file whose restart-only keys would stop
    the next start: an ``allow-group`` no group has, ``traces`` whose exporter is not
    installed, ``mcp-token-file`` without ``mcp-listen``, a listen address that does not
    parse. Such a reload applied the file's other keys and succeeded (so did
    ``systemctl reload``), and the next restart exited 2. Only a key the file changed is
    looked up again: a group removed since the start must not fail every reload.

    Raises:
        ConfigError: The next start would refuse the file.
    """
    changed = set(outcome.restart_needed)
    if not changed:
        return
    fresh = outcome.next_start
    options_from_settings(fresh, args)  # the listen addresses, the token without them
    if "allow-group" in changed:
        resolve_allow_group(fresh)
    if "traces" in changed and fresh.traces != "off":
        _tracer_check(fresh)


async def _reload_on_signal(handlers: Handlers) -> None:
    """SIGHUP's reload: the ``reload`` RPC's own (``Handlers.reload_all``: the config file,
    then every catalog), and what it raises is logged as the RPC's boundary logs it.

    One the daemon is too short of descriptors to do is a warning: SIGHUP again later.
    Anything else is an incident (``log_incident``, the shape of the RPC's
    ``request_failed``). Before, the config was re-read in the signal task itself, with
    only ``ConfigError`` caught: anything else a file could raise there (the OverflowError
    of a 400-digit ``kill-grace``) ended the daemon, where the RPC answered an internal
    error and the watcher logged it. A file is applied only once it was read and judged
    whole, so the running settings stay; so do the snapshots.
    """
    try:
        await handlers.reload_all()
    except ServerBusy as exc:
        log.warning("signal_reload_failed", error=exc.message)
    except Exception:
        log_incident(log, "signal_reload_crashed", signal="SIGHUP")


async def _handle_signals(
    signals: AsyncIterator[int],
    tg: anyio.abc.TaskGroup,
    server: Server,
    handlers: Handlers,
    listener: _OwnSocket,
    notifier: Notifier,
    guard: OrphanGuard,
    state: _State,
) -> None:
    async for signum in signals:
        if signum in _IGNORED_SIGNALS:
            log.info("signal_ignored", signal=signal.Signals(signum).name, stopping=False)
            continue
        if signum == signal.SIGHUP:
            log.info("reload_requested", signal="SIGHUP")
            tg.start_soon(_reload_on_signal, handlers)
            continue
        log.info(
            "stop_requested",
            signal=signal.Signals(signum).name,
            in_flight=len(handlers.service.calls),
        )
        state.stopping = True
        notifier.stopping()
        tg.start_soon(_graceful_stop, state, server, handlers, listener, state.http)
        async for again in signals:
            if again not in _STOP_SIGNALS:
                # A SIGHUP (no reload now: the daemon is stopping) or a stray SIGUSR1 in
                # the grace: said, as at any other time, not dropped unseen.
                log.info("signal_ignored", signal=signal.Signals(again).name, stopping=True)
                continue
            log.info(
                "stop_forced",
                signal=signal.Signals(again).name,
                in_flight=len(handlers.service.calls),
            )
            # SIGKILL every tool's group first: a call already in its shielded
            # SIGTERM-then-wait (the grace ran out) must not hold the exit for the
            # kill grace, and a child ignoring SIGTERM must not survive.
            guard.kill_all()
            for call in list(handlers.service.calls.values()):
                call.cancel.set()
            # Close every connection now: a client that is not reading must not hold
            # the exit while its answers wait for it.
            for conn in list(server.connections.values()):
                conn.abort()
            if state.http is not None:
                state.http.close()
            tg.cancel_scope.cancel()
            return
        return


async def _wait_until(done: Callable[[], bool], seconds: float) -> None:
    """Poll until ``done()`` holds or ``seconds`` pass (a stop is rare: polling is enough)."""
    with anyio.move_on_after(seconds):
        while not done():  # noqa: ASYNC110 -- done() is a plain predicate, no event to wait on
            await anyio.sleep(0.01)


async def _graceful_stop(
    state: _State,
    server: Server,
    handlers: Handlers,
    listener: _OwnSocket,
    http: Any = None,
) -> None:
    """No new calls; in-flight calls get the grace period; then cancel them and close."""
    options = state.options
    server.accepting = False
    handlers.service.stopping = True  # the MCP face too: no new calls on any face
    mcp = state.mcp
    if mcp is not None:
        # MCP's graceful closure: each subscriptions/listen gets its result before its
        # stream closes (a stream that just drops is an unexpected disconnect to a host),
        # and so does each call waiting for its approval, which may wait for minutes.
        mcp.end_waits()
    await listener.aclose()
    if http is not None:
        await http.stop_accepting()
    if mcp is not None:
        await _wait_until(lambda: not mcp.waiting(), 1.0)
    await _wait_until(lambda: not handlers.service.calls, options.shutdown_grace)
    if handlers.service.calls:
        log.info("calls_cancelled_at_stop", count=len(handlers.service.calls))
    for call in list(handlers.service.calls.values()):
        call.cancel.set()
    await _wait_until(lambda: not handlers.service.calls, options.runner.kill_grace_seconds + 5)
    if http is not None:
        http.close()
    for conn in list(server.connections.values()):
        conn.close_gracefully()
    await _wait_until(lambda: not server.connections, 5)
    for conn in list(server.connections.values()):
        conn.abort()
    # The accept loop has ended and every connection is closed: the task group finishes.
    raise _Stop


async def _drain_logs() -> None:
    """Let out the log lines held for a slow stderr reader when the daemon is quiet (a
    line that is logged lets them out too): every 0.1 s while some are held, else every
    second. Nothing to do unless stderr is a pipe or a socket."""
    while True:
        await anyio.sleep(0.1 if holding() else 1.0)
        drain_logs()


#: How long the idle and status checks sleep at most between two looks at their period
#: (``_until_due``): a reload that lowers ``workspace-idle`` or ``status-interval`` takes
#: effect within this, not after the old period.
_IDLE_CHECK_TICK = 1.0


async def _until_due(since: float, period: Callable[[], float]) -> float:
    """Sleep until ``period()`` seconds after ``since``, and return the time then.

    The period is read again at least every ``_IDLE_CHECK_TICK``: one a reload lowers
    counts from then on, not after the old one has run out.
    """
    while True:
        now = anyio.current_time()
        wait = since + period() - now
        if wait <= 0:
            return now
        await anyio.sleep(min(wait, _IDLE_CHECK_TICK))


async def _evict_idle(
    registry: Registry, watcher: Watcher | None, server: Server, service: Service
) -> None:
    """Release idle workspaces, and their watches with them, every quarter of the idle
    time in force (``registry.idle_seconds``, which a reload changes), 0.5 s to 300 s.

    A workspace some connection subscribed to is in use for as long as that connection
    lasts: releasing it would silently end the subscriber's catalogChanged.
    """
    checked = anyio.current_time()
    while True:
        checked = await _until_due(checked, lambda: max(0.5, min(registry.idle_seconds / 4, 300.0)))
        subscribed = {
            Path(key)
            for conn in server.connections.values()
            for key in conn.subscriptions
            if key is not None
        } | service.listened()
        for workspace in registry.evict_idle(in_use=subscribed):
            if watcher is not None:
                watcher.remove_workspace(workspace)


async def _watchdog(notifier: Notifier, interval: float) -> None:
    """Ping systemd's watchdog from the event loop: a hung loop stops the pings."""
    while True:
        if not notifier.watchdog():
            log.debug("watchdog_not_delivered")
        await anyio.sleep(interval)


async def _report_status(
    notifier: Notifier, registry: Registry, handlers: Handlers, state: _State
) -> None:
    """Send ``STATUS=`` whenever the load changed since the last one sent, checked every
    ``status_interval`` seconds in force (a reload changes it: as for the idle check, a
    lowered value counts within ``_IDLE_CHECK_TICK``, not after the old interval)."""
    checked = anyio.current_time()
    while True:
        checked = await _until_due(checked, lambda: state.options.status_interval)
        text = _status_text(registry, handlers, state)
        if text != state.status and notifier.status(text):
            state.status = text


def _status_text(registry: Registry, handlers: Handlers, state: _State) -> str:
    """The one-line load ``systemctl status`` shows: sets, workspaces, calls in flight, and
    edits that reach the catalog by the poll alone (``status``'s ``watch``)."""
    calls = len(handlers.service.calls)
    if state.stopping:
        return f"Stopping; {calls} calls in flight"
    home = registry.cached(None)
    sets = sum(1 for e in home.sets if e.state == SetState.LOADED) if home else 0
    workspaces = registry.workspaces
    for workspace in workspaces:
        catalog = registry.cached(workspace)
        if catalog is not None:
            sets += sum(
                1 for e in catalog.sets if e.source == Source.PROJECT and e.state == SetState.LOADED
            )
    text = f"Serving {sets} tool sets ({len(workspaces)} workspaces); {calls} calls in flight"
    watch = handlers.watch()
    if watch is None:  # --no-watch: by choice
        return text
    if watch["state"] == "polling":
        return f"{text}; the watch is unavailable, tool sets are polled"
    if watch["pastCap"]:
        return f"{text}; {watch['pastCap']} set folders past --max-watches are polled"
    return text


def _user_home() -> Path:
    """The OS user's home (``~``: ``HOME``, else the passwd entry's).

    Raises:
        ConfigError: There is none: ``HOME`` unset (or relative) and a uid without a
            passwd entry, as a container's arbitrary uid has. The daemon needs it for
            ``~`` in path arguments and the credential paths under it (``~/.ssh``), and
            ``Path.home()`` raised a traceback.
    """
    home = os_user_home(os.environ)
    if not os.path.isabs(home):
        why = (
            f"HOME is not an absolute path (got {home!r})"
            if os.environ.get("HOME")
            else f"HOME is unset and uid {os.getuid()} has no passwd entry"
        )
        raise ConfigError(
            f"no home directory: {why}; set HOME to the user's home (the daemon needs it "
            "for ~ in path arguments and for the credential paths under it)"
        )
    return Path(os.path.abspath(home))


def options_from_settings(
    settings: Settings, args: argparse.Namespace | None = None
) -> DaemonOptions:
    """The daemon's options from its effective settings.

    Args:
        settings: The merged settings (flags, environment, config file, defaults).
        args: The parsed flags, kept so a reload can merge them again.
    """
    user_home = _user_home()
    home = settings.home or user_home / ".crystal"
    mcp_listen: list[ListenAddress] = []
    if settings.mcp_listen:
        from .httpguard import ListenError, parse_listen  # only with the endpoint on

        for text in settings.mcp_listen:
            try:
                mcp_listen.append(parse_listen(text))
            except ListenError as exc:
                raise ConfigError(str(exc)) from None
    elif settings.mcp_token_file is not None:
        raise key_fault(
            settings,
            "mcp-token-file",
            "needs mcp-listen (the token is for the HTTP endpoint): set mcp-listen "
            "(--mcp-listen) too, or no token file",
        )
    return DaemonOptions(
        home=home,
        socket=settings.socket,
        reserved=DEFAULT_RESERVED_NAMES | frozenset(settings.reserve),
        server=ServerSettings(
            max_frame_size=settings.max_message_bytes,
            max_connections=settings.max_connections,
            max_calls_per_connection=settings.max_calls_per_connection,
            idle_timeout=settings.idle_timeout,
        ),
        runner=RunnerSettings(
            output_limit_chars=settings.output_limit,
            kill_grace_seconds=settings.kill_grace,
            progress_interval_seconds=settings.progress_interval,
            spawn_threads=settings.spawn_threads,
        ),
        max_running=settings.max_running,
        shutdown_grace=settings.shutdown_grace,
        status_interval=settings.status_interval,
        orphan_guard=not settings.no_orphan_guard,
        workspace_idle_seconds=settings.workspace_idle,
        watch=not settings.no_watch,
        max_watches=settings.max_watches,
        cache_dir=None
        if settings.no_cache
        else Path(os.path.abspath(settings.cache_dir or default_cache_dir(os.environ))),
        metrics_listen=settings.metrics_listen,
        traces=settings.traces,
        mcp_listen=tuple(mcp_listen),
        mcp_token_file=settings.mcp_token_file,
        settings=settings,
        args=args,
        confinement=settings.confinement,
        user_home=user_home,
    )


def parse_args(argv: Sequence[str] | None = None) -> DaemonOptions:
    """Parse the ``toolsetd`` command line and read the config file (contract section 3).

    Args:
        argv: The arguments, without the program name; None reads ``sys.argv``.

    Returns:
        The options.

    Raises:
        ConfigError: A flag value or the config file is unusable.
    """
    args = parse_command_line(argv, __version__)
    return _start_options(load_settings(args, os.environ), args)


def _start_options(settings: Settings, args: argparse.Namespace) -> DaemonOptions:
    """The options a start runs with: the settings', and the allow-group's gid.

    The group is looked up here, at start only, and once: allow-group applies from a
    restart, so a group removed since (or a group database that cannot be asked then)
    must not fail every reload.
    """
    options = replace(
        options_from_settings(settings, args), allow_gid=resolve_allow_group(settings)
    )
    if settings.traces != "off":
        _tracer_check(settings)  # before --print-config too: it checks what a start would
    return options


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``toolsetd``; returns the process exit code."""
    open_standard_streams()
    if os.getpid() == 1:
        code = _init_for_the_daemon()
        if code is not None:
            return code  # the init: the daemon ran as its child, and has ended
    try:
        args = parse_command_line(argv, __version__)
    except OSError as exc:  # --help or --version could not be written
        return _stdout_failed(exc)
    try:
        settings = load_settings(args, os.environ)
        options = _start_options(settings, args)
        if getattr(args, "print_config", False):
            resolved = {
                "socket": str(default_socket_path(os.environ)),
                "home": str(options.home),
            }
            if options.cache_dir is not None:  # XDG_CACHE_HOME's, or ~/.cache's
                resolved["cache-dir"] = str(options.cache_dir)
            text = format_settings(settings, resolved, default_config_path(os.environ))
            # UTF-8, the file's own encoding, whatever the locale (in LC_ALL=C a value
            # outside ASCII raised UnicodeEncodeError); a path's undecodable bytes as they were.
            data = text.encode("utf-8", "surrogateescape")
            try:
                sys.stdout.flush()
                sys.stdout.buffer.write(data)
                sys.stdout.buffer.flush()
            except OSError as exc:
                return _stdout_failed(exc)
            return 0
        if options.traces != "off":
            options = replace(options, tracer_provider=_tracer_provider(options.traces))
    except ConfigError as exc:
        say(f"toolsetd: {exc}")  # the operator's message (an error priority on the journal)
        return 2
    configure_logging(
        options.settings.log_format if options.settings else "json",
        options.settings.log_level if options.settings else "info",
    )
    # A thread's crash, an "Exception ignored in", a warning: log lines, not bare text.
    log_interpreter_reports(log)
    raised = raise_open_files_limit()
    if raised is not None:
        log.info("open_files_limit_raised", soft=raised[0], limit=raised[1])
    bounded = check_allocations_if_they_can_fail()
    if bounded is not None:
        log.info("json_allocations_checked", reason=bounded)
    try:
        anyio.run(partial(run_daemon, options, process_exit=True), backend="asyncio")
    except BaseException as exc:
        return _exit_code(exc)
    finally:
        # The last lines (stop_requested, daemon_stopped, what _exit_code says) reach a slow
        # stderr reader before the process ends; one that stopped reading holds it 2 s.
        finish_logging()
        if options.tracer_provider is not None:
            _flush_spans(options.tracer_provider)
            _settle_stdout()
    return 0


def _stdout_to_devnull() -> None:
    """Point stdout's descriptor at ``/dev/null``: what it still buffers, after a write that
    failed, would fail again at the interpreter's exit ("Exception ignored", exit 120)."""
    with contextlib.suppress(OSError, ValueError):
        devnull = os.open(os.devnull, os.O_WRONLY)
        try:
            os.dup2(devnull, sys.stdout.fileno())
        finally:
            os.close(devnull)


def _settle_stdout() -> None:
    """On the way out with ``traces = "console"``: the spans stdout could not take (a full
    disk, a terminal closed, a reader gone) are lost, as log lines are, and cost the exit
    nothing."""
    try:
        sys.stdout.flush()
    except OSError:
        _stdout_to_devnull()
    except ValueError:  # closed
        pass


def _stdout_failed(exc: OSError) -> int:
    """``--print-config``, ``--help`` or ``--version`` could not be written to stdout: a
    reader that went away (``| head``) is no failure; anything else (a full disk) is said.
    """
    _stdout_to_devnull()
    if isinstance(exc, BrokenPipeError):
        return 0
    say(f"toolsetd: cannot write to stdout: {exc.strerror or exc}")
    return 1


#: The signals that stop the daemon: the first gracefully, a second (of any of them) at
#: once. SIGQUIT too (a terminal's Ctrl-\, a supervisor's stop signal, as nginx and
#: php-fpm take it): at its default action it ended the daemon with no cleanup at all (the
#: socket and lock files left behind, the tools left to the orphan guard, a core dump of
#: the interpreter that tells an operator nothing).
_STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGQUIT)
#: The signals the daemon's handlers take (``_handle_signals``), and those of them that
#: are only logged.
_IGNORED_SIGNALS = (signal.SIGUSR1, signal.SIGUSR2)
_HANDLED_SIGNALS = (signal.SIGHUP, *_STOP_SIGNALS, *_IGNORED_SIGNALS)

#: What the init passes on to the daemon (``_init_for_the_daemon``).
_INIT_FORWARDS = (
    signal.SIGHUP,
    signal.SIGINT,
    signal.SIGQUIT,
    signal.SIGTERM,
    signal.SIGUSR1,
    signal.SIGUSR2,
)


def _init_for_the_daemon() -> int | None:
    """As process 1 (a container's entry point, ``unshare --pid --fork``): become a minimal
    init, and run the daemon as its child.

    Process 1 inherits every orphan of its namespace: a tool's background child killed at
    the call's end, bubblewrap's own child. The daemon waits for its own children only, so
    each of them stayed a zombie, one more per such call, until the namespace ran out of
    processes. The init reaps every child, passes the signals above on to the daemon, and
    exits with the daemon's code (128 + N for a signal N), as ``tini`` does. Called before
    any thread starts (``fork``). The daemon leads its own process group: a terminal's
    Ctrl-C reaches it once, through the init, not a second time as a forced stop.

    Returns:
        None in the daemon (the child), which goes on to start; the exit code in the init.
    """
    try:
        child = os.fork()
    except OSError:
        return None  # no child to be: serve as process 1, without the reaping
    if child == 0:
        os.setpgid(0, 0)
        if os.environ.get("LISTEN_PID") == "1":
            # Sockets passed to process 1 (a container runtime's socket activation) are
            # the daemon's: it holds them too, and serves them as its own.
            os.environ["LISTEN_PID"] = str(os.getpid())
        return None
    for signum in _INIT_FORWARDS:
        signal.signal(signum, lambda received, _frame: _pass_on(child, received))
    while True:
        try:
            pid, status = os.waitpid(-1, 0)  # an orphan, or the daemon
        except ChildProcessError:
            return 0
        if pid == child:
            code = os.waitstatus_to_exitcode(status)
            return code if code >= 0 else 128 - code


def _pass_on(child: int, signum: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(child, signum)


#: Seconds the exit waits for the spans still batched, as it waits for the log's reader.
_SPAN_FLUSH_SECONDS = 2.0


def _flush_spans(provider: Any, seconds: float = _SPAN_FLUSH_SECONDS) -> None:
    """Shut the tracer provider down (flushing its batched spans), waiting ``seconds`` at most.

    The SDK's shutdown joins its exporter's thread for 30 s: a collector that hangs, or a
    stdout nobody reads under ``traces = "console"``, held the exit that long after
    ``daemon_stopped``, past systemd's ``TimeoutStopSec=`` with the graces. Spans not out
    by then are lost, as lines past the log's bound are. The thread is a daemon thread, and
    the SDK's own exit hook finds the provider already shut down.
    """
    import threading  # only with tracing on

    flush = threading.Thread(target=provider.shutdown, name="toolsetd-span-flush", daemon=True)
    flush.start()
    flush.join(seconds)


def _tracer_provider(kind: str) -> Any:
    """The OpenTelemetry tracer provider for ``traces = kind``, from the otel extra
    (``_start_options`` checked that it is installed)."""
    from .tracing import tracer_provider  # the otel extra: only when asked for

    return tracer_provider(kind)


def _tracer_check(settings: Settings) -> None:
    """Refuse ``settings.traces`` when the otel extra (or, for ``otlp``, its exporter) is
    not installed, as a start refuses it, without making a provider; the error names
    where ``traces`` was set."""
    kind = settings.traces
    try:
        from .tracing import check_exporter  # the otel extra: only when asked for
    except ImportError:
        raise key_fault(
            settings,
            "traces",
            f'{kind} needs OpenTelemetry: install the extra (pipx install "toolsetd[otel]", '
            'or /opt/toolsetd/bin/pip install "toolsetd[otel]"), or set traces = "off"',
        ) from None
    try:
        check_exporter(kind)
    except ConfigError as exc:
        raise key_fault(settings, "traces", exc.reason) from None


def _exit_code(exc: BaseException) -> int:
    """Map what ended the daemon to an exit code, printing operator errors plainly."""
    leaves = list(_leaves(exc))
    if all(isinstance(e, _Stop) for e in leaves):
        return 0
    startup = [e for e in leaves if isinstance(e, SocketPathError | ActivationError | StartupError)]
    if startup:
        for error in startup:
            say(f"toolsetd: {error}")  # through the log writer: never waits unbounded
        return 1
    if any(isinstance(e, KeyboardInterrupt) for e in leaves):
        return 130
    exits = [e for e in leaves if isinstance(e, SystemExit)]
    if exits and all(isinstance(e, SystemExit | _Stop) for e in leaves):
        return _system_exit(exits[0])
    # Said, never raised for the interpreter to print: printed by it, the traceback would
    # wait for a stalled reader forever, and reached a terminal or a CI job's log raw (an
    # exception's message quotes paths and values: an ESC sequence, a "::set-output" line).
    say("".join(traceback.format_exception(exc)).rstrip("\n"))
    return 1


def _system_exit(exc: SystemExit) -> int:
    """Exit 1 for a ``SystemExit`` raised inside the run (a library's ``sys.exit``), saying
    in one line the code it asked for (``None`` 0, an integer itself, text 1 and its
    ``message``) and where it came from.

    The run has ended as a stop does (the calls cancelled, the socket removed), but no one
    asked the daemon to stop: it is a failure, for a supervisor to restart. Not the code
    asked for: 0 (or ``None``) would pass for an ordered stop, and 2 for a configuration
    error, which the units' ``RestartPreventExitStatus=2`` never restarts. Before, it was
    a crash with a traceback said on stderr.
    """
    code = exc.code
    fields: dict[str, Any] = {}
    if code is None:
        asked = 0
    elif isinstance(code, int):
        asked = code
    else:
        asked = 1
        fields["message"] = str(code)
    log.error("system_exit_raised", code=asked, exc_info=exc, **fields)
    return 1


def _leaves(exc: BaseException) -> list[BaseException]:
    if isinstance(exc, BaseExceptionGroup):
        return [leaf for inner in exc.exceptions for leaf in _leaves(inner)]
    return [exc]
