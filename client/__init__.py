"""toolsetd client library and CLI.

``Client`` is the async (anyio) connection to a toolsetd daemon; the errors it raises are
re-exported here: the transport errors (``ConnectError``, ``ConnectionClosed``,
``RequestTimeout``) and the daemon's ``RpcError`` subclasses, rebuilt by code.
"""

from __future__ import annotations

from toolsetd.client.client import Client, EventHandler
from toolsetd.client.errors import (
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
