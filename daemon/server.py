"""The socket server: the accept loop, peer checks and connection limits.

Theory of operation
-------------------
One ``Server`` owns the listening socket and a task group. The accept loop (after trio's
``serve_listeners``) retries descriptor exhaustion after a short sleep and starts one
``Connection`` task per client; whatever goes wrong inside a connection is logged and
closes that connection only.

A peer is checked (``SO_PEERCRED`` against the ``PeerPolicy``), then the stop flag and
the connection limit; a refused peer gets one error line and the connection closes.

The parts live in their own modules: ``wire.py`` (the socket transport and flow
control), ``connection.py`` (one client: reader, ordered sends, calls, subscriptions),
``dispatch.py`` (the JSON-RPC layer and the one exception boundary). ``Server`` ties them
together and is what a connection dispatches to.
"""

from __future__ import annotations

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
from .observe import NO_OBSERVER, Observer
from .peercred import PeerPolicy, peer_credentials

# Connection, Handler, RequestContext and ServerSettings are re-exported on purpose: the
# server is where the handlers and the composition root meet them.
__all__ = ["Connection", "Handler", "RequestContext", "Server", "ServerSettings", "bind_unix_socket"]

log = structlog.get_logger("toolsetd.server")

_ACCEPT_RETRY_ERRNOS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})
#: The ``toolsetd_connections_refused_total`` reason of each refusal.
_REFUSAL_REASONS: dict[type[rpc_errors.RpcError], str] = {
    rpc_errors.PeerNotAllowed: "peer",
    rpc_errors.ServerBusy: "limit",
    rpc_errors.ShuttingDown: "stopping",
}


class Server:
    """The JSON-RPC server over a listening Unix socket.

    Args:
        settings: Limits and timeouts.
        methods: Handlers by method name.
        peer_policy: Which peers may call.
        observer: Told of each refused connection (``observe.Observer``).
    """

    def __init__(
        self,
        settings: ServerSettings,
        methods: Mapping[str, Handler],
        peer_policy: PeerPolicy,
        observer: Observer = NO_OBSERVER,
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

    @property
    def accepting(self) -> bool:
        """Whether new connections and new calls are taken (False once stopping)."""
        return self._dispatcher.accepting

    @accepting.setter
    def accepting(self, value: bool) -> None:
        self._dispatcher.accepting = value

        self.refused_while_stopping: frozenset[str] = frozenset({"invoke", "reload"})

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
        async with anyio.create_task_group() as tg:
            task_status.started()
            while True:
                try:
                    stream = await listener.accept()
                except (anyio.ClosedResourceError, anyio.BrokenResourceError):
                    return
                except OSError as exc:
                    if exc.errno in _ACCEPT_RETRY_ERRNOS:
                        log.warning("accept_retry", errno=exc.errno)
                        await anyio.sleep(0.1)
                        continue
                    raise
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
                log.warning(
                    "peer_refused",
                    pid=getattr(cred, "pid", None),
                    uid=getattr(cred, "uid", None),
                    gid=getattr(cred, "gid", None),
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
            if len(self.connections) >= self.settings.max_connections:
                limit = self.settings.max_connections
                log.warning("connection_limit", limit=limit)
                await self._refuse(
                    stream,
                    rpc_errors.ServerBusy(
                        f"Too many connections: toolsetd serves at most {limit} at once.",
                        {"limit": limit},
                    ),
                )
                return
            conn = Connection(conn_id, stream, self, cred)
            self.connections[conn_id] = conn
            log.info("connection_opened", pid=cred.pid, uid=cred.uid, gid=cred.gid)
            try:
                await conn.serve()
            except Exception:
                log.exception("connection_failed")
            finally:
                self.connections.pop(conn_id, None)
                log.info("connection_closed")

    async def _refuse(self, stream: anyio.abc.SocketStream, error: rpc_errors.RpcError) -> None:
        self._observer.connection_refused(_REFUSAL_REASONS.get(type(error), "other"))
        with anyio.CancelScope(shield=True), anyio.move_on_after(1):
            try:
                await stream.send(Codec().encode(error_message(None, error)))
            except (anyio.BrokenResourceError, anyio.ClosedResourceError, OSError):
                pass
            await stream.aclose()


def bind_unix_socket(path: os.PathLike[str] | str, backlog: int = 1024) -> socket.socket:
    """Create a listening Unix socket at ``path`` with mode 0600.

    The umask is tightened around ``bind`` so the socket is never reachable by others,
    not even for the moment before the chmod.
    """
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old_umask = os.umask(0o177)
    try:
        sock.bind(os.fspath(path))
    except BaseException:
        sock.close()
        raise
    finally:
        os.umask(old_umask)
    os.chmod(path, 0o600)
    sock.listen(backlog)
    return sock
