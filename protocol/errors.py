"""Protocol exceptions and the JSON-RPC error codes of the toolsetd wire.

Two families live here. Protocol errors concern framing and envelopes and never
cross the wire as such; RPC errors are the ``error`` member of a JSON-RPC response::

    Exception
    ├── ProtocolError               framing or envelope went wrong
    │   ├── LocalProtocolError      we built something invalid (a bug on our side)
    │   └── RemoteProtocolError     the peer sent garbage; the connection is closed
    │       └── FrameTooLarge       a line longer than the frame cap
    └── RpcError                    an error response: code, message, data
        ├── ParseError              -32700
        ├── InvalidRequest          -32600
        ├── MethodNotFound          -32601
        ├── InvalidParams           -32602
        ├── InternalError           -32603
        ├── UnknownTool             -32001
        ├── InvalidArguments        -32002
        ├── PolicyDenied            -32003
        ├── ApprovalRequired        -32004
        ├── UnknownCall             -32005
        ├── InvalidWorkspace        -32006
        ├── MessageTooLarge         -32007
        ├── ServerBusy              -32008
        ├── PeerNotAllowed          -32009
        └── ShuttingDown            -32010

Every ``RpcError`` subclass registers its ``CODE`` in one table, so
``RpcError.from_error`` rebuilds the right class from a response received off the wire.
"""

from __future__ import annotations

# Not ``typing.TYPE_CHECKING``: importing typing is a measurable share of toolsetctl's
# start-up, and the names below are only ever used in annotations (mypy honours any
# constant named TYPE_CHECKING).
TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any, ClassVar

__all__ = [
    "ERROR_CLASSES",
    "ApprovalRequired",
    "FrameTooLarge",
    "InternalError",
    "InvalidArguments",
    "InvalidParams",
    "InvalidRequest",
    "InvalidWorkspace",
    "LocalProtocolError",
    "MessageTooLarge",
    "MethodNotFound",
    "ParseError",
    "PeerNotAllowed",
    "PolicyDenied",
    "ProtocolError",
    "RemoteProtocolError",
    "RpcError",
    "ServerBusy",
    "ShuttingDown",
    "UnknownCall",
    "UnknownTool",
    "reject_json_constant",
    "workspace_not_a_directory",
    "workspace_relative",
]


class ProtocolError(Exception):
    """A framing or envelope failure; the base of the local/remote split."""


class LocalProtocolError(ProtocolError):
    """We tried to build or send something the protocol does not allow."""


class RemoteProtocolError(ProtocolError):
    """The peer sent bytes that break the framing; the connection cannot continue."""


class FrameTooLarge(RemoteProtocolError):
    """The peer sent a line longer than the codec's ``max_frame_size``."""


#: The one table from code to class; filled by ``RpcError.__init_subclass__``.
ERROR_CLASSES: dict[int, type[RpcError]] = {}


class RpcError(Exception):
    """An error that travels as the ``error`` member of a JSON-RPC response.

    Attributes:
        code: The JSON-RPC error code.
        message: A short English sentence naming the offending field and what was expected.
        data: Optional structured detail (JSON-serialisable), omitted on the wire when None.
    """

    CODE: ClassVar[int] = -32603
    MESSAGE: ClassVar[str] = "Internal error"

    def __init__(self, message: str | None = None, data: Any = None) -> None:
        """Create the error.

        Args:
            message: The message; the class's ``MESSAGE`` when None.
            data: Optional structured detail.
        """
        self.code: int = self.CODE
        self.message: str = self.MESSAGE if message is None else message
        self.data: Any = data
        super().__init__(self.message)

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "CODE" not in cls.__dict__:
            return  # a refinement of its parent (more for the daemon), the same on the wire
        if cls.CODE in ERROR_CLASSES:
            raise TypeError(f"error code {cls.CODE} is already taken")
        ERROR_CLASSES[cls.CODE] = cls

    def __repr__(self) -> str:
        return f"{type(self).__name__}(code={self.code}, message={self.message!r})"

    def to_error(self) -> dict[str, Any]:
        """Return the JSON-RPC ``error`` object.

        Returns:
            ``{"code", "message"}`` plus ``"data"`` when data is not None.
        """
        error: dict[str, Any] = {"code": self.code, "message": self.message}
        if self.data is not None:
            error["data"] = self.data
        return error

    @classmethod
    def from_error(cls, obj: dict[str, Any]) -> RpcError:
        """Rebuild an error from a JSON-RPC ``error`` object.

        Args:
            obj: The ``error`` member of a response.

        Returns:
            An instance of the subclass registered for the code, or a base ``RpcError``
            carrying the code when the code is unknown.
        """
        raw_code = obj.get("code")
        code = raw_code if type(raw_code) is int else InternalError.CODE
        raw_message = obj.get("message")
        message = raw_message if isinstance(raw_message, str) else None
        data = obj.get("data")
        klass = ERROR_CLASSES.get(code)
        if klass is not None:
            return klass(message, data)
        error = RpcError(message if message is not None else f"Error {code}", data)
        error.code = code
        return error


class ParseError(RpcError):
    """A line that is not valid UTF-8 or not valid JSON; the connection carries on."""

    CODE = -32700
    MESSAGE = "Parse error"


class InvalidRequest(RpcError):
    """A JSON value that is not a valid JSON-RPC 2.0 request (bad envelope, empty batch)."""

    CODE = -32600
    MESSAGE = "Invalid Request"


class MethodNotFound(RpcError):
    """A request for a method the daemon does not have."""

    CODE = -32601
    MESSAGE = "Method not found"


class InvalidParams(RpcError):
    """Params that fail the method's model; ``data`` lists ``{field, message}``, never values."""

    CODE = -32602
    MESSAGE = "Invalid params"


class InternalError(RpcError):
    """An unexpected failure in the daemon; the message is generic, the log has the detail."""

    CODE = -32603
    MESSAGE = "Internal error"


class UnknownTool(RpcError):
    """No such tool in the workspace's catalog, or not in the requested catalog."""

    CODE = -32001
    MESSAGE = "Unknown tool"


class InvalidArguments(RpcError):
    """Arguments fail the tool's JSON Schema; ``data.errors[]`` is ``{path, message}``."""

    CODE = -32002
    MESSAGE = "Invalid arguments"


class PolicyDenied(RpcError):
    """The classification says ``deny``; ``data`` is the classification."""

    CODE = -32003
    MESSAGE = "Policy denied"


class ApprovalRequired(RpcError):
    """An ``ask`` or ``review`` decision without ``approved: true``.

    ``data`` is the classification.
    """

    CODE = -32004
    MESSAGE = "Approval required"


class UnknownCall(RpcError):
    """``cancel`` of a call id that is not in flight on this daemon."""

    CODE = -32005
    MESSAGE = "Unknown call"


class InvalidWorkspace(RpcError):
    """A workspace that is not an absolute path or not a directory."""

    CODE = -32006
    MESSAGE = "Invalid workspace"


class MessageTooLarge(RpcError):
    """A line over the size limit; sent just before the daemon closes the connection."""

    CODE = -32007
    MESSAGE = "Message too large"


class ServerBusy(RpcError):
    """A connection or in-flight limit is reached; the client may retry later."""

    CODE = -32008
    MESSAGE = "Server busy"


class PeerNotAllowed(RpcError):
    """The connecting peer's credentials (``SO_PEERCRED``) are not allowed to call."""

    CODE = -32009
    MESSAGE = "Peer not allowed"


class ShuttingDown(RpcError):
    """The daemon is stopping and takes no new calls, or ended an in-flight one."""

    CODE = -32010
    MESSAGE = "Shutting down"


#: A variable its host left unexpanded in a path: ``${workspaceFolder}``, ``$PWD``. A
#: ``${`` looks no further than the next ``$``: with ``[^}]*`` each unclosed one went over
#: the rest of the path again (a client's 400 KB of ``${`` held the event loop minutes).
_UNEXPANDED = r"\$\{[^}$]*\}|\$[A-Za-z_][A-Za-z0-9_]*"


def workspace_not_a_directory(path: str) -> str:
    """``InvalidWorkspace``'s message for a workspace that names no directory (the daemon's
    on every face, and toolsetctl's when no daemon answers).

    A host's config names the workspace with its own variable (``${workspaceFolder}``),
    which Cursor and VS Code leave as it is when no folder is open: the path then holds
    the variable's name, and the message says so.
    """
    return _unexpanded(
        path,
        f"Invalid workspace: {path!r} is not a directory; 'workspace' must be an absolute "
        "path to an existing directory.",
    )


def workspace_relative(path: str) -> str:
    """``InvalidWorkspace``'s message for a relative workspace, as sent by a client that
    does not make it absolute (an HTTP URL's ``workspace=``, a client of the socket); the
    variable a host left in it is named as ``workspace_not_a_directory`` names it."""
    return _unexpanded(
        path,
        "Invalid workspace: 'workspace' must be an absolute path to a directory; got a "
        "relative path.",
    )


def _unexpanded(path: str, message: str) -> str:
    """``message``, and when ``path`` holds a host's variable, that it does and the fix.

    The variable is quoted as the path is (``repr``): a ``${...}`` holds anything but
    ``}`` and ``$``, and bare it ran into the sentence (``It holds ${my folder}, a``), and
    every face shows a control character in it as its escape, the same text as a
    backslash typed there; quoted, the two differ, as they do in the path."""
    import re  # a failure's path only: toolsetctl's start-up does not import it

    unexpanded = re.search(_UNEXPANDED, path)
    if unexpanded is None:
        return message
    return (
        f"{message} It holds {unexpanded.group()!r}, a variable its host did not expand "
        "(Cursor and VS Code leave ${workspaceFolder} so when no folder is open): open a "
        "folder, or give the folder's own path."
    )


def reject_json_constant(name: str) -> object:
    """A ``parse_constant`` hook for the standard library's ``json``: refuse ``NaN``,
    ``Infinity`` and ``-Infinity``, which are Python's extensions, not JSON.

    Here, not in ``jsontext``: this module loads nothing (``toolsetctl`` imports it on every
    start, and ``jsontext`` would load orjson).
    """
    raise ValueError(f"{name} is not a valid JSON value.")
