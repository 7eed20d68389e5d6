"""toolsetd client library and CLI.

``Client`` is the async (anyio) connection to a toolsetd daemon; the errors it raises are
re-exported here: the transport errors (``ConnectError``, ``ConnectionClosed``,
``RequestTimeout``) and the daemon's ``RpcError`` subclasses, rebuilt by code.

The names are loaded on first use (PEP 562): importing a submodule such as the stdlib-only
``toolsetd.client.mcp`` pump must not pay for anyio and pydantic.
"""

from __future__ import annotations

import importlib

TYPE_CHECKING = False  # not typing's: importing typing is a share of toolsetctl's start-up

# The list below repeats errors.py's re-exports on purpose: it is the public API, spelled
# out for type checkers while the names themselves load lazily.
if TYPE_CHECKING:
    from typing import Any

    from .client import Client, EventHandler
    from .errors import (
        ApprovalRequired,
        ClientError,
        ConnectError,
        ConnectionClosed,
        InternalError,
        InvalidArguments,
        InvalidParams,
        InvalidRequest,
        InvalidWorkspace,
        MessageTooLarge,
        MethodNotFound,
        ParseError,
        PeerNotAllowed,
        PolicyDenied,
        ProtocolError,
        RemoteProtocolError,
        RequestTimeout,
        RpcError,
        ServerBusy,
        ShuttingDown,
        UnknownCall,
        UnknownTool,
    )

_HOMES = {"Client": "client", "EventHandler": "client"}

__all__ = [
    "ApprovalRequired",
    "Client",
    "ClientError",
    "ConnectError",
    "ConnectionClosed",
    "EventHandler",
    "InternalError",
    "InvalidArguments",
    "InvalidParams",
    "InvalidRequest",
    "InvalidWorkspace",
    "MessageTooLarge",
    "MethodNotFound",
    "ParseError",
    "PeerNotAllowed",
    "PolicyDenied",
    "ProtocolError",
    "RemoteProtocolError",
    "RequestTimeout",
    "RpcError",
    "ServerBusy",
    "ShuttingDown",
    "UnknownCall",
    "UnknownTool",
]


def __getattr__(name: str) -> Any:
    """Import a public name from its module the first time it is asked for."""
    if name not in __all__:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    module = importlib.import_module(f".{_HOMES.get(name, 'errors')}", __name__)
    value = getattr(module, name)
    globals()[name] = value
    return value
