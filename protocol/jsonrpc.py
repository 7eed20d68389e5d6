"""The JSON-RPC 2.0 envelope: a cheap hand-written check and the message builders.

The check runs once per request on the hot path, so it is plain ``type()`` tests on
a dict, not jsonschema and not pydantic (performance.md: jsonrpcserver's schema check
alone costs ~48 µs a request). It follows the JSON-RPC 2.0 specification:

* the value is an object whose ``"jsonrpc"`` member is exactly ``"2.0"``;
* ``"method"`` is a string;
* ``"params"``, when present, is an object or an array (the contract passes params by
  name; the server rejects arrays, this module only says whether they were positional);
* ``"id"``, when present, is a string, an integer (not a boolean) or null. A request
  with ``"id": null`` is a request, not a notification. Fractional ids are refused;
* no other member is allowed (the message names the first one found).

A value that fails becomes ``InvalidEnvelope``, which carries the request's id when
that id was itself valid, so the error response can be matched; otherwise None.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Final, TypeAlias, TypeGuard

from .errors import RemoteProtocolError, RpcError
from .jsontext import JsonNumber

__all__ = [
    "JSONRPC_VERSION",
    "ErrorResponse",
    "InvalidEnvelope",
    "Notification",
    "Request",
    "RequestId",
    "Response",
    "error_message",
    "is_request_id",
    "notification_message",
    "parse_envelope",
    "parse_response",
    "result_message",
]

JSONRPC_VERSION: Final = "2.0"

#: A request id: a string, an integer (never a boolean), or null.
RequestId: TypeAlias = str | int | None
#: Params as received: an object, an array, or None when absent.
Params: TypeAlias = dict[str, Any] | list[Any] | None

_MEMBERS: Final = frozenset({"jsonrpc", "method", "params", "id"})
_RESPONSE_MEMBERS: Final = frozenset({"jsonrpc", "id", "result", "error"})


# Not frozen: a frozen dataclass's __init__ costs about three times as much, once per
# message on the hot path. Treat instances as immutable.
@dataclass(slots=True)
class Request:
    """A call that expects a response.

    Attributes:
        id: The request id (None when the peer sent ``"id": null``).
        method: The method name.
        params: The params object or array, or None when absent.
    """

    id: RequestId
    method: str
    params: Params = None

    @property
    def positional(self) -> bool:
        """Whether params were given as an array rather than by name."""
        return type(self.params) is list


@dataclass(slots=True)
class Notification:
    """A message without an id: no response is sent.

    Attributes:
        method: The method (or notification) name.
        params: The params object or array, or None when absent.
    """

    method: str
    params: Params = None

    @property
    def positional(self) -> bool:
        """Whether params were given as an array rather than by name."""
        return type(self.params) is list


@dataclass(slots=True)
class InvalidEnvelope:
    """A value that is not a valid JSON-RPC 2.0 request: answer -32600 (Invalid Request).

    Attributes:
        id: The request's id when it was a valid id, else None.
        message: Why, naming the offending member; it never echoes values.
    """

    id: RequestId
    message: str


@dataclass(slots=True)
class Response:
    """A successful response, as the client sees it.

    Attributes:
        id: The id of the request it answers.
        result: The result value.
    """

    id: RequestId
    result: Any


@dataclass(slots=True)
class ErrorResponse:
    """An error response, as the client sees it.

    Attributes:
        id: The id of the request it answers (None when the server could not tell).
        error: The error, rebuilt as its ``RpcError`` subclass.
    """

    id: RequestId
    error: RpcError


_ABSENT: Final = object()


def is_request_id(value: Any) -> TypeGuard[str | int]:
    """Whether a value can name a request, so an answer echoes it: a string or an integer
    (a bool is neither). ``null`` is a valid id that names none; every face answers what
    it cannot echo with ``null``.

    ``-0`` is an integer in JSON's grammar; ``jsontext`` keeps it as a ``JsonNumber`` only
    so that its sign is written back, and it is echoed as sent, on every face.
    """
    kind = type(value)
    return kind is str or kind is int or (kind is JsonNumber and value.text == "-0")


def _valid_id(value: Any) -> bool:
    """Whether a value is an acceptable request id (str, int but not bool, or None)."""
    return value is None or is_request_id(value)


def parse_envelope(value: Any) -> Request | Notification | InvalidEnvelope:
    """Check one decoded JSON value against the JSON-RPC 2.0 request envelope.

    Args:
        value: One parsed JSON value (a single element when the peer sent a batch).

    Returns:
        ``Request``, ``Notification``, or ``InvalidEnvelope`` with the reason.
    """
    if type(value) is not dict:
        return InvalidEnvelope(None, "Invalid Request: expected a JSON object")
    request_id = value.get("id", _ABSENT)
    kind = type(request_id)
    if not (
        kind is str
        or kind is int
        or request_id is None
        or request_id is _ABSENT
        or is_request_id(request_id)  # the rest of the one rule (``-0``), past the fast tests
    ):
        return InvalidEnvelope(None, "Invalid Request: 'id' must be a string, an integer or null")
    echo_id = None if request_id is _ABSENT else request_id
    if len(value) > 4 or not _MEMBERS.issuperset(value):
        extra = next(key for key in value if key not in _MEMBERS)
        return InvalidEnvelope(echo_id, f"Invalid Request: unexpected member '{extra}'")
    if value.get("jsonrpc") != JSONRPC_VERSION:
        return InvalidEnvelope(echo_id, "Invalid Request: 'jsonrpc' must be exactly \"2.0\"")
    method = value.get("method")
    if type(method) is not str:
        return InvalidEnvelope(echo_id, "Invalid Request: 'method' must be a string")
    params = value.get("params", _ABSENT)
    if params is _ABSENT:
        params = None
    elif type(params) is not dict and type(params) is not list:
        return InvalidEnvelope(echo_id, "Invalid Request: 'params' must be an object or an array")
    if request_id is _ABSENT:
        return Notification(method, params)
    return Request(request_id, method, params)


def _wire(value: Any) -> Any:
    """Dump a pydantic model to its camelCase JSON form; pass anything else through."""
    # Duck-typed so this module does not import pydantic (the CLI uses it at every start).
    dump = getattr(value, "model_dump", None)
    if dump is not None:
        return dump(mode="json", by_alias=True)
    return value


def result_message(id: RequestId, result: Any) -> dict[str, Any]:
    """Build a success response.

    Args:
        id: The id of the request answered.
        result: The result: a JSON value, or a pydantic model dumped by alias.

    Returns:
        The response object, ready for ``encode``.
    """
    return {"jsonrpc": JSONRPC_VERSION, "id": id, "result": _wire(result)}


def error_message(id: RequestId, err: RpcError) -> dict[str, Any]:
    """Build an error response.

    Args:
        id: The id of the request answered; None when it could not be determined.
        err: The error to send.

    Returns:
        The response object, ready for ``encode``.
    """
    return {"jsonrpc": JSONRPC_VERSION, "id": id, "error": err.to_error()}


def notification_message(method: str, params: Any = None) -> dict[str, Any]:
    """Build a notification (a message without an id).

    Args:
        method: The notification name.
        params: The params: a dict, a pydantic model dumped by alias, or None to omit.

    Returns:
        The notification object, ready for ``encode``.
    """
    if params is None:
        return {"jsonrpc": JSONRPC_VERSION, "method": method}
    return {"jsonrpc": JSONRPC_VERSION, "method": method, "params": _wire(params)}


def parse_response(value: Any) -> Response | ErrorResponse | Notification:
    """Classify one decoded JSON value received by a client.

    Args:
        value: One parsed JSON value from the daemon (one element of a batch response).

    Returns:
        ``Response``, ``ErrorResponse`` or, for a server notification, ``Notification``.

    Raises:
        RemoteProtocolError: The value is neither a valid response nor a notification.
    """
    if type(value) is not dict:
        raise RemoteProtocolError("response is not a JSON object")
    if value.get("jsonrpc") != JSONRPC_VERSION:
        raise RemoteProtocolError("response 'jsonrpc' member is not \"2.0\"")
    if "method" in value and "id" not in value:
        method = value["method"]
        params = value.get("params")
        if type(method) is not str or (
            params is not None and type(params) is not dict and type(params) is not list
        ):
            raise RemoteProtocolError("malformed notification from the server")
        return Notification(method, params)
    if not value.keys() <= _RESPONSE_MEMBERS:
        raise RemoteProtocolError("response has unexpected members")
    if "id" not in value or not _valid_id(value["id"]):
        raise RemoteProtocolError("response has no valid 'id'")
    has_result = "result" in value
    has_error = "error" in value
    if has_result == has_error:
        raise RemoteProtocolError("response must have exactly one of 'result' and 'error'")
    if has_result:
        return Response(value["id"], value["result"])
    error = value["error"]
    if (
        type(error) is not dict
        or type(error.get("code")) is not int
        or type(error.get("message")) is not str
    ):
        raise RemoteProtocolError("response 'error' is not a valid error object")
    return ErrorResponse(value["id"], RpcError.from_error(error))
