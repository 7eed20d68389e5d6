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
   taken, a stale socket is replaced and a live one refused, and the socket is bound 0600;
3. registry, runner, handlers and server are built, the home catalog is loaded, and
   ``READY=1`` is sent once the listener accepts calls; a ``STATUS=`` line with the load
   follows whenever it changes (checked every ``status_interval`` seconds), and
   ``WATCHDOG=1`` every half ``WATCHDOG_USEC`` when systemd asks for it;
4. SIGHUP reloads; the first SIGTERM or SIGINT starts a graceful stop (``STOPPING=1``,
   the listener closes, in-flight calls get ``shutdown_grace`` seconds, then they are
   cancelled and their process groups killed, the connections closed after their last
   answer); a second one stops at once: every registered process group is SIGKILLed
   first, then every task is cancelled;
5. on the way out the socket is removed (unless systemd owns it), the lock released, and
   the orphan guard closed last (nothing is registered any more by then). Should the
   daemon die without this cleanup, the guard's sentinel kills the groups still running.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import sys
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import anyio
import anyio.abc
import structlog
from toolsetd.protocol import __version__

from .activation import ActivationError, listen_fds
from .logs import configure_logging
from .methods import Handlers, HandlerSettings
from .model import DEFAULT_RESERVED_NAMES, SetState, Source
from .peercred import PeerPolicy
from .reaper import OrphanGuard
from .registry import Registry
from .runner import Runner, RunnerSettings
from .sdnotify import Notifier, scrub_environment
from .server import Server, ServerSettings, bind_unix_socket
from .sockpath import (
    SocketPathError,
    acquire_instance_lock,
    check_stale,
    default_socket_path,
    prepare_socket_dir,
)
from .validation import ArgumentValidators
from .watcher import Watcher

__all__ = ["DaemonOptions", "main", "parse_args", "run_daemon"]

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
        allow_group: A group whose members may call, besides our own uid and root.
        user_home: The OS user's home, for ``~`` in path arguments.
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
    allow_group: str | None = None
    user_home: Path = field(default_factory=Path.home)


class _Stop(Exception):
    """Raised out of the signal task to end the daemon at once."""


async def run_daemon(
    options: DaemonOptions,
    *,
    task_status: anyio.abc.TaskStatus[str] = anyio.TASK_STATUS_IGNORED,
) -> None:
    """Run the daemon until SIGTERM or SIGINT (or cancellation).

    Args:
        options: How to run.
        task_status: Receives the socket path once calls are accepted.

    Raises:
        SocketPathError: The socket cannot be served (a live daemon holds it, or its
            directory is unsafe).
        ActivationError: systemd passed an unusable descriptor.
    """
    # Signals first: once the socket listens a client may connect, and a SIGHUP or
    # SIGTERM from then on must reach our handlers, not the default actions.
    with anyio.open_signal_receiver(signal.SIGHUP, signal.SIGTERM, signal.SIGINT) as signals:
        await _run(options, signals, task_status)


async def _run(
    options: DaemonOptions,
    signals: AsyncIterator[int],
    task_status: anyio.abc.TaskStatus[str],
) -> None:
    notifier = Notifier.from_environ(os.environ)
    activated = listen_fds(os.environ)
    base_env = scrub_environment(os.environ)
    guard = OrphanGuard() if options.orphan_guard else None
    if guard is not None:
        try:
            guard.start()
        except OSError as exc:  # the daemon still serves; the groups are still tracked
            log.error("orphan_guard_unavailable", error=exc.strerror or str(exc))
    try:
        await _serve(options, signals, task_status, notifier, activated, base_env, guard)
    finally:
        if guard is not None:
            guard.close()


async def _serve(
    options: DaemonOptions,
    signals: AsyncIterator[int],
    task_status: anyio.abc.TaskStatus[str],
    notifier: Notifier,
    activated: list[socket.socket],
    base_env: dict[str, str],
    guard: OrphanGuard | None,
) -> None:
    lock = None
    socket_path: Path
    if activated:
        sock = activated[0]
        for extra in activated[1:]:
            extra.close()
        socket_path = Path(sock.getsockname() or "")
        owns_socket = False
    else:
        socket_path = options.socket or default_socket_path(os.environ)
        prepare_socket_dir(socket_path)
        lock = acquire_instance_lock(socket_path)
        check_stale(socket_path)
        sock = bind_unix_socket(socket_path)
        owns_socket = True
    listener = await anyio.abc.SocketListener.from_socket(sock)

    peer_policy = PeerPolicy.default()
    if options.allow_group:
        peer_policy = PeerPolicy.from_group_name(options.allow_group, peer_policy)
    registry = Registry(options.home, options.reserved, idle_seconds=options.workspace_idle_seconds)
    runner = Runner(
        options.runner, anyio.CapacityLimiter(options.max_running), base_env, guard=guard
    )
    server: Server
    watcher: Watcher | None = None

    def follow_workspace(workspace: Path) -> None:
        if watcher is not None:
            watcher.add_workspace(workspace)

    handlers = Handlers(
        HandlerSettings(socket=str(socket_path), home=options.home, user_home=options.user_home),
        registry,
        runner,
        ArgumentValidators(),
        notifier,
        lambda: server.connections.values(),
        on_workspace=follow_workspace,
    )
    server = Server(options.server, handlers.methods(), peer_policy)

    async def on_change(keys: set[Path | None]) -> None:
        await handlers.reload_catalogs(None if None in keys else keys)

    if options.watch:
        watcher = Watcher(options.home, on_change)

    try:
        async with anyio.create_task_group() as tg:
            await registry.catalog(None)
            if watcher is not None:
                await tg.start(watcher.run)
            await tg.start(server.serve, listener)
            tg.start_soon(_evict_idle, registry, watcher, server, options.workspace_idle_seconds)
            interval = notifier.watchdog_interval()
            if interval:
                tg.start_soon(_watchdog, notifier, interval)
            state = _State()
            log.info(
                "daemon_started",
                version=__version__,
                pid=os.getpid(),
                socket=str(socket_path),
                home=str(options.home),
                activated=bool(activated),
            )
            state.status = _status_text(registry, handlers, state)
            notifier.ready(state.status)
            if notifier.enabled:
                tg.start_soon(_report_status, notifier, registry, handlers, state,
                              options.status_interval)
            task_status.started(str(socket_path))
            await _handle_signals(
                signals, tg, options, server, handlers, listener, notifier, guard, state
            )
    finally:
        with anyio.CancelScope(shield=True):  # noqa: ASYNC100 -- it shields the awaits below
            if owns_socket:
                try:
                    os.unlink(socket_path)
                except OSError:
                    pass
            if lock is not None:
                lock.release()
            log.info("daemon_stopped")


@dataclass(slots=True)
class _State:
    """What the status reporter shares with the signal handling."""

    stopping: bool = False
    status: str = ""


async def _handle_signals(
    signals: AsyncIterator[int],
    tg: anyio.abc.TaskGroup,
    options: DaemonOptions,
    server: Server,
    handlers: Handlers,
    listener: anyio.abc.SocketListener,
    notifier: Notifier,
    guard: OrphanGuard | None,
    state: _State,
) -> None:
    async for signum in signals:
        if signum == signal.SIGHUP:
            log.info("reload_requested", signal="SIGHUP")
            tg.start_soon(handlers.reload_catalogs, None)
            continue
        log.info("stop_requested", signal=signal.Signals(signum).name,
                 in_flight=len(handlers.calls))
        state.stopping = True
        notifier.stopping()
        tg.start_soon(_graceful_stop, options, server, handlers, listener)
        async for again in signals:
            if again in (signal.SIGTERM, signal.SIGINT):
                log.info("stop_forced", signal=signal.Signals(again).name,
                         in_flight=len(handlers.calls))
                # SIGKILL every tool's group first: a call already in its shielded
                # SIGTERM-then-wait (the grace ran out) must not hold the exit for the
                # kill grace, and a child ignoring SIGTERM must not survive.
                if guard is not None:
                    guard.kill_all()
                for call in list(handlers.calls.values()):
                    call.cancel.set()
                # Close every connection now: a client that is not reading must not hold
                # the exit while its answers wait for it.
                for conn in list(server.connections.values()):
                    conn.abort()
                tg.cancel_scope.cancel()
                return
        return


async def _wait_until(done: Callable[[], bool], seconds: float) -> None:
    """Poll until ``done()`` holds or ``seconds`` pass (a stop is rare: polling is enough)."""
    with anyio.move_on_after(seconds):
        while not done():  # noqa: ASYNC110 -- done() is a plain predicate, no event to wait on
            await anyio.sleep(0.05)


async def _graceful_stop(
    options: DaemonOptions,
    server: Server,
    handlers: Handlers,
    listener: anyio.abc.SocketListener,
) -> None:
    """No new calls; in-flight calls get the grace period; then cancel them and close."""
    server.accepting = False
    await listener.aclose()
    await _wait_until(lambda: not handlers.calls, options.shutdown_grace)
    if handlers.calls:
        log.info("calls_cancelled_at_stop", count=len(handlers.calls))
    for call in list(handlers.calls.values()):
        call.cancel.set()
    await _wait_until(lambda: not handlers.calls, options.runner.kill_grace_seconds + 5)
    for conn in list(server.connections.values()):
        conn.close_gracefully()
    await _wait_until(lambda: not server.connections, 5)
    for conn in list(server.connections.values()):
        conn.abort()
    # The accept loop has ended and every connection is closed: the task group finishes.
    raise _Stop


async def _evict_idle(
    registry: Registry, watcher: Watcher | None, server: Server, idle_seconds: float
) -> None:
    """Release idle workspaces, and their watches with them.

    A workspace some connection subscribed to is in use for as long as that connection
    lasts: releasing it would silently end the subscriber's catalogChanged.
    """
    period = max(0.5, min(idle_seconds / 4, 300.0))
    while True:
        await anyio.sleep(period)
        subscribed = {
            Path(key)
            for conn in server.connections.values()
            for key in conn.subscriptions
            if key is not None
        }
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
    notifier: Notifier, registry: Registry, handlers: Handlers, state: _State, interval: float
) -> None:
    """Send ``STATUS=`` whenever the load changed since the last one sent."""
    while True:
        await anyio.sleep(interval)
        text = _status_text(registry, handlers, state)
        if text != state.status and notifier.status(text):
            state.status = text


def _status_text(registry: Registry, handlers: Handlers, state: _State) -> str:
    """The one-line load ``systemctl status`` shows: sets, workspaces, calls in flight."""
    calls = len(handlers.calls)
    if state.stopping:
        return f"Stopping; {calls} calls in flight"
    home = registry.cached(None)
    sets = sum(1 for e in home.sets if e.state == SetState.LOADED) if home else 0
    workspaces = registry.workspaces
    for workspace in workspaces:
        catalog = registry.cached(workspace)
        if catalog is not None:
            sets += sum(
                1 for e in catalog.sets
                if e.source == Source.PROJECT and e.state == SetState.LOADED
            )
    return f"Serving {sets} tool sets ({len(workspaces)} workspaces); {calls} calls in flight"


def parse_args(argv: Sequence[str] | None = None) -> DaemonOptions:
    """Parse the ``toolsetd`` command line (contract section 3).

    Args:
        argv: The arguments, without the program name; None reads ``sys.argv``.

    Returns:
        The options.
    """
    parser = argparse.ArgumentParser(
        prog="toolsetd",
        description="Serve operator tool sets (tools.json) to coding agents over a Unix socket.",
    )
    parser.add_argument("--socket", type=Path, default=None,
                        help="socket path (env TOOLSETD_SOCKET; default "
                        "$XDG_RUNTIME_DIR/toolsetd/toolsetd.sock, else /tmp/toolsetd-<uid>/toolsetd.sock)")
    parser.add_argument("--home", type=Path, default=None,
                        help="the Crystal home (else $CRYSTAL_HOME, else ~/.crystal)")
    parser.add_argument("--reserve", action="append", default=[], metavar="NAME",
                        help="reserve one more tool name (repeatable)")
    parser.add_argument("--log-format", choices=["json", "console"], default="json")
    parser.add_argument("--log-level", default="info",
                        choices=["debug", "info", "warning", "error"])
    parser.add_argument("--no-watch", action="store_true", help="do not watch tool-set folders")
    parser.add_argument("--allow-group", default=None, metavar="GROUP",
                        help="also serve members of this group")
    parser.add_argument("--max-running", type=int, default=64, metavar="N",
                        help="children running at once; further calls wait (default 64)")
    parser.add_argument("--output-limit", type=int, default=100_000, metavar="CHARS",
                        help="characters of output returned to the caller (default 100000)")
    parser.add_argument("--kill-grace", type=float, default=5.0, metavar="SECONDS",
                        help="seconds between SIGTERM and SIGKILL for a timed-out call (default 5)")
    parser.add_argument("--progress-interval", type=float, default=1.0, metavar="SECONDS",
                        help="seconds between progress notifications (default 1)")
    parser.add_argument("--shutdown-grace", type=float, default=10.0, metavar="SECONDS",
                        help="seconds in-flight calls get when stopping (default 10)")
    parser.add_argument("--status-interval", type=float, default=2.0, metavar="SECONDS",
                        help="seconds between checks of the STATUS= line sent to systemd "
                        "(default 2)")
    parser.add_argument("--no-orphan-guard", action="store_true",
                        help="do not run the sentinel process that kills the tools if the "
                        "daemon dies (under systemd the unit's cgroup does that too)")
    parser.add_argument("--max-connections", type=int, default=256, metavar="N")
    parser.add_argument("--max-calls-per-connection", type=int, default=128, metavar="N")
    parser.add_argument("--idle-timeout", type=float, default=30.0, metavar="SECONDS",
                        help="close a connection that holds an incomplete request this long")
    parser.add_argument("--max-message-bytes", type=int, default=16 * 1024 * 1024, metavar="N")
    parser.add_argument("--workspace-idle", type=float, default=3600.0, metavar="SECONDS",
                        help="release a workspace unused this long (default 3600)")
    parser.add_argument("--version", action="version", version=f"toolsetd {__version__}")
    args = parser.parse_args(argv)
    for name in ("max_running", "output_limit", "max_connections", "max_calls_per_connection",
                 "max_message_bytes"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    for name in ("kill_grace", "progress_interval", "shutdown_grace", "idle_timeout",
                 "workspace_idle", "status_interval"):
        if getattr(args, name) <= 0:
            parser.error(f"--{name.replace('_', '-')} must be a positive number of seconds")
    configure_logging(args.log_format, args.log_level)
    home = args.home or Path(os.environ.get("CRYSTAL_HOME") or Path.home() / ".crystal")
    socket_path = args.socket or (
        Path(os.environ["TOOLSETD_SOCKET"]) if os.environ.get("TOOLSETD_SOCKET") else None
    )
    return DaemonOptions(
        home=Path(os.path.abspath(home)),
        socket=Path(os.path.abspath(socket_path)) if socket_path else None,
        reserved=DEFAULT_RESERVED_NAMES | frozenset(args.reserve),
        server=ServerSettings(
            max_frame_size=args.max_message_bytes,
            max_connections=args.max_connections,
            max_calls_per_connection=args.max_calls_per_connection,
            idle_timeout=args.idle_timeout,
        ),
        runner=RunnerSettings(
            output_limit_chars=args.output_limit,
            kill_grace_seconds=args.kill_grace,
            progress_interval_seconds=args.progress_interval,
        ),
        max_running=args.max_running,
        shutdown_grace=args.shutdown_grace,
        status_interval=args.status_interval,
        orphan_guard=not args.no_orphan_guard,
        workspace_idle_seconds=args.workspace_idle,
        watch=not args.no_watch,
        allow_group=args.allow_group,
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``toolsetd``; returns the process exit code."""
    options = parse_args(argv)
    try:
        anyio.run(run_daemon, options, backend="asyncio")
    except BaseException as exc:
        return _exit_code(exc)
    return 0


def _exit_code(exc: BaseException) -> int:
    """Map what ended the daemon to an exit code, printing operator errors plainly."""
    leaves = list(_leaves(exc))
    if all(isinstance(e, _Stop) for e in leaves):
        return 0
    startup = [e for e in leaves if isinstance(e, SocketPathError | ActivationError)]
    if startup:
        for error in startup:
            print(f"toolsetd: {error}", file=sys.stderr)  # noqa: T201 - the operator's message
        return 1
    if any(isinstance(e, KeyboardInterrupt) for e in leaves):
        return 130
    raise exc


def _leaves(exc: BaseException) -> list[BaseException]:
    if isinstance(exc, BaseExceptionGroup):
        return [leaf for inner in exc.exceptions for leaf in _leaves(inner)]
    return [exc]
