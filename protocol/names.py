"""The names of the methods and notifications on the wire.

Pure constants (no pydantic): the daemon's native face builds its method table from them
at every start; ``models`` re-exports them beside the models of each method.
"""

from __future__ import annotations

TYPE_CHECKING = False  # not typing's: ``toolsetctl mcp`` imports this at every start (errors.py)
if TYPE_CHECKING:
    from typing import Final

__all__ = [
    "METHODS",
    "METHOD_CANCEL",
    "METHOD_CLASSIFY",
    "METHOD_INVOKE",
    "METHOD_LIST",
    "METHOD_MCP_BIND",
    "METHOD_METRICS",
    "METHOD_RELOAD",
    "METHOD_STATUS",
    "NOTIFICATIONS",
    "NOTIFICATION_CATALOG_CHANGED",
    "NOTIFICATION_COMPLETED",
    "NOTIFICATION_PROGRESS",
    "NOTIFICATION_STARTED",
]

METHOD_STATUS: Final = "status"
METHOD_LIST: Final = "list"
METHOD_CLASSIFY: Final = "classify"
METHOD_INVOKE: Final = "invoke"
METHOD_CANCEL: Final = "cancel"
METHOD_RELOAD: Final = "reload"
#: toolsetd's own method (not in the contract's table): the Prometheus exposition.
METHOD_METRICS: Final = "metrics"
METHODS: Final = (
    METHOD_STATUS,
    METHOD_LIST,
    METHOD_CLASSIFY,
    METHOD_INVOKE,
    METHOD_CANCEL,
    METHOD_RELOAD,
    METHOD_METRICS,
)

#: The first frame of ``toolsetctl mcp`` on the daemon's socket: the connection is MCP after
#: it (``daemon/mcp_socket.py``; not a method of the native face's table).
METHOD_MCP_BIND: Final = "mcp.bind"

NOTIFICATION_STARTED: Final = "started"
NOTIFICATION_PROGRESS: Final = "progress"
NOTIFICATION_COMPLETED: Final = "completed"
NOTIFICATION_CATALOG_CHANGED: Final = "catalogChanged"
NOTIFICATIONS: Final = (
    NOTIFICATION_STARTED,
    NOTIFICATION_PROGRESS,
    NOTIFICATION_COMPLETED,
    NOTIFICATION_CATALOG_CHANGED,
)
