"""The socket server: the accept loop, peer checks and connection limits.

Theory of operation
-------------------
One ``Server`` owns the listening socket and a task group. The accept loop (after trio's
``serve_listeners``) retries descriptor exhaustion after a short sleep and starts one
``Connection`` task per client; whatever goes wrong inside a connection is logged and
closes that connection only.

A peer is checked (``SO_PEERCRED`` against the ``PeerPolicy``), then the stop flag and
the connection limit; a refused peer gets one error line and the connection closes
gracefully (shut down writing, drain briefly and boundedly, close: a lingering close, so
the peer reads the error rather than a reset). When the table is full, the idlest
connection that holds nothing (no request in flight, no subscription) is closed to make
room, with a -32008 line saying why; only when every connection is busy is the newcomer
refused. Idle connections therefore cannot starve new ones.

The parts live in their own modules: ``wire.py`` (the socket transport and flow
control), ``connection.py`` (one client: reader, ordered sends, calls, subscriptions),
``dispatch.py`` (the JSON-RPC layer and the one exception boundary). ``Server`` ties them
together and is what a connection dispatches to.
"""

from __future__ import annotations

import contextlib
import errno
import itertools
import os
import socket
from collections.abc import Mapping

import anyio
import anyio.abc
import structlog
from toolsetd.protocol import errors as rpc_errors
from toolsetd.protocol.codec import Codec
from toolsetd.protocol.jsonrpc import error_message

from .connection import Connection, Handler, RequestContext, ServerSettings
from .dispatch import Dispatcher
from .exhaustion import Acceptor, out_of_memory_in
from .large import LargeRequests
from .logs import Throttle
from .observe import NO_OBSERVER, Observer
from .peercred import PeerPolicy, peer_credentials
from .sockpath import SUN_PATH_MAX

# Connection, Handler, RequestContext and ServerSettings are re-exported on purpose: the
# server is where the handlers and the composition root meet them.
__all__ = [
    "Connection",
    "Handler",
    "RequestContext",
    "Server",
    "ServerSettings",
    "bind_unix_socket",
]

log = structlog.get_logger("toolsetd.server")

#: The ``toolsetd_connections_refused_total`` reason of each refusal.
_REFUSAL_REASONS: dict[type[rpc_errors.RpcError], str] = {
    rpc_errors.PeerNotAllowed: "peer",
    rpc_errors.ServerBusy: "limit",
    rpc_errors.ShuttingDown: "stopping",
}
#: What a refused peer may still send before it sees the error and closes (lingering close).
_REFUSE_DRAIN_BYTES = 1024 * 1024


def _no_memory() -> rpc_errors.ServerBusy:
    """The refusal of a connection the daemon had no memory to open (its memory is
    bounded): made when needed, as every refusal is."""
    return rpc_errors.ServerBusy(
        "Server busy: toolsetd had no memory to open this connection (its memory is "
        "bounded); connect again when some calls have finished.",
        {"resource": "memory"},
    )


class Server:
    """The JSON-RPC server over a listening Unix socket.

    Args:
        settings: Limits and timeouts.
        methods: Handlers by method name.
        peer_policy: Which peers may call.
        observer: Told of each refused connection (``observe.Observer``).
        large_requests: The daemon's large requests in flight and its worker slot for
            them (``large.LargeRequests``), shared with the other faces.
    """

    def __init__(
        self,
        settings: ServerSettings,
        methods: Mapping[str, Handler],
        peer_policy: PeerPolicy,
        observer: Observer = NO_OBSERVER,
        large_requests: LargeRequests | None = None,
    ) -> None:
        self.settings = settings
        self._observer = observer
        self._accepted = 0
        self._dispatcher = Dispatcher(methods)
        #: Methods the reader answers itself (see ``ServerSettings.inline_methods``).
        self.inline_methods = settings.inline_methods & self._dispatcher.names
        self.dispatch_one = self._dispatcher.dispatch_one
        self.dispatch_batch = self._dispatcher.dispatch_batch
        self._peer_policy = peer_policy
        self._ids = itertools.count(1)
        self.connections: dict[int, Connection] = {}
        #: The large requests in flight on every face (``connection._hold``).
        self.large_requests = large_requests if large_requests is not None else LargeRequests()
        # A peer can be refused as often as it connects: one line a minute per uid (per
        # reason for the connection limit), counting the refusals since the last line.
        self._refused_log = Throttle()

    @property
    def accepting(self) -> bool:
        """Whether new connections and new calls are taken (False once stopping)."""
        return self._dispatcher.accepting

    @accepting.setter
    def accepting(self, value: bool) -> None:
        self._dispatcher.accepting = value

    # -- accept loop -----------------------------------------------------------------

    async def serve(
        self,
        listener: anyio.abc.SocketListener,
        *,
        task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED,
    ) -> None:
        """Accept connections until the listener is closed or this task is cancelled.

        The server owns the listener from here on and closes it when it stops.
        """
        try:
            await self._accept_loop(listener, task_status)
        finally:
            with anyio.CancelScope(shield=True):
                await listener.aclose()

    async def _accept_loop(
        self, listener: anyio.abc.SocketListener, task_status: anyio.abc.TaskStatus[None]
    ) -> None:
        acceptor = Acceptor(listener, log, "accept")
        async with anyio.create_task_group() as tg:
            task_status.started()
            # A failure the acceptor raises ends the daemon with the error (a supervisor
            # restarts it) rather than leave it lingering deaf.
            while (stream := await acceptor.next()) is not None:
                tg.start_soon(self._serve_connection, stream)

    @property
    def accepted(self) -> int:
        """Connections accepted so far (refused ones included)."""
        return self._accepted

    async def _serve_connection(self, stream: anyio.abc.SocketStream) -> None:
        conn_id = self._accepted = next(self._ids)
        with structlog.contextvars.bound_contextvars(conn_id=conn_id):
            try:
                raw: socket.socket = stream.extra(anyio.abc.SocketAttribute.raw_socket)
                cred = peer_credentials(raw)
            except OSError:
                cred = None
            if cred is None or not self._peer_policy.allows(cred):
                uid = getattr(cred, "uid", None)
                said = self._refused_log.count(("peer", uid))
                if said is not None:
                    log.warning(
                        "peer_refused",
                        pid=getattr(cred, "pid", None),
                        uid=uid,
                        gid=getattr(cred, "gid", None),
                        refused=said,
                    )
                await self._refuse(
                    stream,
                    rpc_errors.PeerNotAllowed(
                        "This user may not call toolsetd: the daemon serves its own user "
                        "(and root) unless a group is allowed with --allow-group."
                    ),
                )
                return
            if not self.accepting:
                await self._refuse(stream, rpc_errors.ShuttingDown("toolsetd is shutting down."))
                return
            if len(self.connections) >= self.settings.max_connections and not self._make_room():
                limit = self.settings.max_connections
                said = self._refused_log.count("limit")
                if said is not None:
                    log.warning("connection_limit", limit=limit, refused=said)
                await self._refuse(
                    stream,
                    rpc_errors.ServerBusy(
                        f"Too many connections: toolsetd serves at most {limit} at once.",
                        {"limit": limit},
                    ),
                )
                return
            try:
                conn = Connection(conn_id, stream, self, cred)
            except MemoryError as exc:
                if not out_of_memory_in(exc):  # the daemon's memory is bounded, none left
                    raise
                log.warning("connection_out_of_memory", conn_id=conn_id)
                try:
                    await self._refuse(stream, _no_memory(), "memory")
                except MemoryError:
                    await stream.aclose()
                return
            self.connections[conn_id] = conn
            log.info("connection_opened", pid=cred.pid, uid=cred.uid, gid=cred.gid)
            try:
                await conn.serve()
            except Exception as exc:
                if out_of_memory_in(exc):  # the daemon's want: no bug
                    log.warning("connection_out_of_memory", conn_id=conn_id)
                else:
                    log.exception("connection_failed")
            finally:
                self.connections.pop(conn_id, None)
                log.info("connection_closed")

    def _make_room(self) -> bool:
        """Close the idlest connection that holds nothing, so a new one can be served.

        Idle means no request in flight, no subscription, nothing buffered either way;
        idlest means the longest since its last complete message (bytes of an incomplete
        line do not count). Connections evicted but not yet gone still count against
        the limit, so one eviction makes room for one newcomer.

        Returns:
            True when a connection was evicted.
        """
        candidates = [c for c in self.connections.values() if c.evictable]
        if not candidates:
            return False
        victim = min(candidates, key=lambda c: c.last_active)
        log.info(
            "connection_evicted",
            victim=victim.conn_id,
            idle_seconds=round(anyio.current_time() - victim.last_active, 3),
        )
        victim.evict()
        self.connections.pop(victim.conn_id, None)
        return True

    async def _refuse(
        self, stream: anyio.abc.SocketStream, error: rpc_errors.RpcError, reason: str = ""
    ) -> None:
        """Send one error line and close gracefully (a lingering close, as HTTP servers do).

        Closing with the peer's request still unread would make the kernel reset the
        connection, and the peer would likely see the reset instead of the error. So: send
        the error, shut down writing, drain what the peer sends (at most
        ``_REFUSE_DRAIN_BYTES``, for at most ``linger_seconds``) until its end of file, close.
        """
        self._observer.connection_refused(reason or _REFUSAL_REASONS.get(type(error), "other"))
        with anyio.CancelScope(shield=True):
            with anyio.move_on_after(1):
                try:
                    await stream.send(Codec().encode(error_message(None, error)))
                    await stream.send_eof()
                except (anyio.BrokenResourceError, anyio.ClosedResourceError, OSError):
                    pass
            with anyio.move_on_after(self.settings.linger_seconds):
                drained = 0
                try:
                    while drained < _REFUSE_DRAIN_BYTES:
                        drained += len(await stream.receive())
                except (
                    anyio.EndOfStream,
                    anyio.BrokenResourceError,
                    anyio.ClosedResourceError,
                    OSError,
                ):
                    pass
            with anyio.move_on_after(1):
                await stream.aclose()


def bind_unix_socket(path: os.PathLike[str] | str, backlog: int = 1024) -> socket.socket:
    """Create a listening Unix socket at ``path`` with mode 0600.

    The socket's own mode is set to 0600 before ``bind`` (Linux makes the file with it,
    less the umask), and the file is chmod'ed to 0600 again before it listens. The umask
    is not tightened around ``bind``: it is the process's, and a tool spawned in a worker
    thread meanwhile would inherit it, since the socket is made again while the daemon
    serves. The path
    appears only once the socket
    listens: it is bound under a temporary name in the same folder
    (``.<random>.sock``), listens, and is then
    linked to ``path`` (``link`` fails rather than replace whatever took the path since
    ``check_stale`` looked) and the temporary name removed. Bound at ``path`` directly, a
    client that waits for the file (a script after ``toolsetd &``, a supervisor) could
    find it and be refused (83 to 177 connects in 1,000 were, between ``bind`` and
    ``listen``).
    When the temporary name would not fit ``sun_path``, or the file system has no hard
    links, it is bound directly.
    """
    final = os.fspath(path)
    # Random, not the pid alone: two daemons in two pid namespaces may share the folder
    # (a toolbox container binds $XDG_RUNTIME_DIR) and have the same pid.
    temporary = os.path.join(os.path.dirname(final), f".{os.urandom(4).hex()}.sock")
    if len(os.fsencode(temporary)) >= SUN_PATH_MAX:
        return _listening(final, final, backlog)
    sock = _listening(temporary, final, backlog)
    try:
        os.link(temporary, final)
    except OSError as exc:
        sock.close()
        _unlink_quietly(temporary)
        if exc.errno == errno.EEXIST:
            raise OSError(exc.errno, exc.strerror, final) from None
        # A file system without hard links (some FUSE ones): bound in place, as before.
        return _listening(final, final, backlog)
    except BaseException:
        sock.close()
        _unlink_quietly(temporary)
        raise
    _unlink_quietly(temporary)
    return sock


def _listening(at: str, named: str, backlog: int) -> socket.socket:
    """A Unix socket bound at ``at`` with mode 0600, then listening; an error names
    ``named``, the path the operator gave."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        # Linux makes the socket file with the socket's own mode (less the umask): 0600
        # from its first instant, with the process's umask left alone.
        os.fchmod(sock.fileno(), 0o600)
        sock.bind(at)
    except OSError as exc:
        sock.close()
        raise OSError(exc.errno, exc.strerror, named) from None
    except BaseException:
        sock.close()
        raise
    try:
        os.chmod(at, 0o600)
        sock.listen(backlog)
    except BaseException as exc:
        sock.close()
        if at != named:
            _unlink_quietly(at)
        if isinstance(exc, OSError):
            raise OSError(exc.errno, exc.strerror, named) from None
        raise
    return sock


def _unlink_quietly(path: str) -> None:
    with contextlib.suppress(OSError):
        os.unlink(path)
