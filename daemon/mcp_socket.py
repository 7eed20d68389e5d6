"""MCP on the daemon's Unix socket: the ``mcp.bind`` method and the connection's outbox.

Theory of operation
-------------------
``toolsetctl mcp`` (``client/mcp.py``) is a pump between an MCP host's stdio and the
daemon's socket. Its first frame is ``mcp.bind`` (``workspace``, ``catalog?``, ``mode?``,
``headless?``), a native request answered inline by the connection's reader, so the frames
the pump sends right behind it (the host's first request, pipelined) are already read as
MCP. The handler checks the binding and sets the connection's ``route`` to a new
``McpSession`` whose outbox is the connection itself: from then on every frame on that
connection goes to the session (``Connection._handle_message``), its responses and
notifications share the connection's ordered writer, and when the connection ends its
calls are cancelled (``Connection.cancel_calls`` sets their events and closes the route).
The bind answers ``{"bound": true, ...}``; the pump swallows that one response.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from toolsetd.protocol.errors import InvalidRequest

from .connection import Connection, RequestContext
from .mcp_session import SUPPORTED_VERSIONS, Binding, McpServer, McpSession

__all__ = ["McpBinder"]


class _ConnectionOutbox:
    """A connection as the session's ``Outbox``."""

    __slots__ = ("_connection",)

    def __init__(self, connection: Connection) -> None:
        self._connection = connection

    def post(self, message: dict[str, Any], *, droppable: bool = False) -> None:
        self._connection.post(message, droppable=droppable)

    async def drained(self) -> None:
        await self._connection.wait_drained()


class _SessionRoute:
    """An ``McpSession`` as the connection's ``Route`` (its default outbox is the connection)."""

    __slots__ = ("session",)

    def __init__(self, session: McpSession) -> None:
        self.session = session

    def announce(self, message: Any, release: Callable[[], None]) -> None:
        self.session.announce(message, release)

    async def receive(self, message: Any) -> Any:
        return await self.session.receive(message)

    def close(self) -> None:
        self.session.close()


class McpBinder:
    """The ``mcp.bind`` handler: binds a socket connection to an MCP session.

    Args:
        server: The daemon's MCP core.
    """

    def __init__(self, server: McpServer) -> None:
        self._server = server

    async def bind(self, ctx: RequestContext, params: Any) -> dict[str, Any]:
        """Bind the calling connection to MCP for one workspace, catalog and mode.

        It never waits (the reader answers it inline), so the next frame is already MCP.
        """
        connection = ctx.connection
        if not connection.may_bind:
            # Frames read before the bind (or beside it, in a batch) were taken as this
            # wire's; binding now would hand what follows them to MCP mid-stream.
            raise InvalidRequest(
                "Invalid Request: mcp.bind must be the connection's first frame, on its own "
                "(not in a batch); open a new connection and send it first."
            )
        binding = Binding.from_params(params)
        session = self._server.session(binding, _ConnectionOutbox(connection), connection.calls)
        connection.route = _SessionRoute(session)
        return {
            "bound": True,
            "session": session.session_id,
            "workspace": str(binding.workspace),
            "protocolVersions": list(SUPPORTED_VERSIONS),
            # The pump (``toolsetctl mcp``) holds no longer line of its host's to parse:
            # this connection refuses it unread.
            "maxMessageBytes": connection.max_line,
        }
