"""Tests for toolsetd.protocol.jsonrpc: the envelope check, builders and response parsing."""

from __future__ import annotations

from typing import Any

import orjson
import pytest
from toolsetd.protocol import codec, errors
from toolsetd.protocol.jsonrpc import (
    ErrorResponse,
    InvalidEnvelope,
    Notification,
    Request,
    Response,
    error_message,
    notification_message,
    parse_envelope,
    parse_response,
    result_message,
)
from toolsetd.protocol.models import CancelResult, ProgressParams

# Every request of the JSON-RPC 2.0 specification's examples section, batches flattened.
SPEC_EXAMPLES: list[tuple[str, object]] = [
    ('{"jsonrpc": "2.0", "method": "subtract", "params": [42, 23], "id": 1}',
     Request(1, "subtract", [42, 23])),
    ('{"jsonrpc": "2.0", "method": "subtract", "params": [23, 42], "id": 2}',
     Request(2, "subtract", [23, 42])),
    ('{"jsonrpc": "2.0", "method": "subtract", "params": {"subtrahend": 23, "minuend": 42}, '
     '"id": 3}', Request(3, "subtract", {"subtrahend": 23, "minuend": 42})),
    ('{"jsonrpc": "2.0", "method": "subtract", "params": {"minuend": 42, "subtrahend": 23}, '
     '"id": 4}', Request(4, "subtract", {"minuend": 42, "subtrahend": 23})),
    ('{"jsonrpc": "2.0", "method": "update", "params": [1,2,3,4,5]}',
     Notification("update", [1, 2, 3, 4, 5])),
    ('{"jsonrpc": "2.0", "method": "foobar"}', Notification("foobar")),
    ('{"jsonrpc": "2.0", "method": "foobar", "id": "1"}', Request("1", "foobar")),
    ('{"jsonrpc": "2.0", "method": 1, "params": "bar"}', InvalidEnvelope),
    ("1", InvalidEnvelope),
    ("2", InvalidEnvelope),
    ("3", InvalidEnvelope),
    ("[]", InvalidEnvelope),
    ('{"jsonrpc": "2.0", "method": "sum", "params": [1,2,4], "id": "1"}',
     Request("1", "sum", [1, 2, 4])),
    ('{"jsonrpc": "2.0", "method": "notify_hello", "params": [7]}',
     Notification("notify_hello", [7])),
    ('{"jsonrpc": "2.0", "method": "subtract", "params": [42,23], "id": "2"}',
     Request("2", "subtract", [42, 23])),
    ('{"foo": "boo"}', InvalidEnvelope),
    ('{"jsonrpc": "2.0", "method": "foo.get", "params": {"name": "myself"}, "id": "5"}',
     Request("5", "foo.get", {"name": "myself"})),
    ('{"jsonrpc": "2.0", "method": "get_data", "id": "9"}', Request("9", "get_data")),
    ('{"jsonrpc": "2.0", "method": "notify_sum", "params": [1,2,4]}',
     Notification("notify_sum", [1, 2, 4])),
]


@pytest.mark.parametrize(("text", "expected"), SPEC_EXAMPLES)
def test_jsonrpc_spec_examples(text: str, expected: object) -> None:
    """Every example request of the JSON-RPC 2.0 specification is classified as the spec says."""
    result = parse_envelope(orjson.loads(text))
    if expected is InvalidEnvelope:
        assert isinstance(result, InvalidEnvelope)
        assert result.id is None
        assert result.message.startswith("Invalid Request: ")
    else:
        assert result == expected


@pytest.mark.parametrize(
    "line",
    [b'{"jsonrpc": "2.0", "method": "foobar, "params": "bar", "baz]',
     b'[{"jsonrpc": "2.0", "method": "sum", "params": [1,2,4], "id": "1"},{"jsonrpc": "2.0", "method"]'],
)
def test_jsonrpc_spec_invalid_json_examples_are_parse_errors(line: bytes) -> None:
    """The spec's invalid-JSON examples come out of the codec as -32700 BadMessage."""
    c = codec.Codec()
    c.receive_data(line + b"\n")
    event = c.next_event()
    assert isinstance(event, codec.BadMessage)
    assert event.code == errors.ParseError.CODE


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ({"jsonrpc": "2.0", "method": "m", "id": None}, Request(None, "m")),
        ({"jsonrpc": "2.0", "method": "m", "id": 0}, Request(0, "m")),
        ({"jsonrpc": "2.0", "method": "m", "id": -7}, Request(-7, "m")),
        ({"jsonrpc": "2.0", "method": "m", "id": ""}, Request("", "m")),
        ({"jsonrpc": "2.0", "method": "m", "params": {}, "id": 1}, Request(1, "m", {})),
        ({"jsonrpc": "2.0", "method": "m", "params": []}, Notification("m", [])),
        ({"jsonrpc": "2.0", "method": ""}, Notification("")),
    ],
    ids=["null-id", "zero-id", "negative-id", "empty-str-id", "empty-params", "empty-array",
         "empty-method"],
)
def test_jsonrpc_valid_envelopes(value: dict[str, Any], expected: object) -> None:
    """Valid envelopes, null ids included, become a Request or a Notification."""
    assert parse_envelope(value) == expected


@pytest.mark.parametrize(
    ("value", "expected_id", "fragment"),
    [
        ({"jsonrpc": "2.0", "method": "m", "id": True}, None, "'id'"),
        ({"jsonrpc": "2.0", "method": "m", "id": False}, None, "'id'"),
        ({"jsonrpc": "2.0", "method": "m", "id": 1.0}, None, "'id'"),
        ({"jsonrpc": "2.0", "method": "m", "id": 1.5}, None, "'id'"),
        ({"jsonrpc": "2.0", "method": "m", "id": [1]}, None, "'id'"),
        ({"jsonrpc": "2.0", "method": "m", "id": {}}, None, "'id'"),
        ({"method": "m", "id": 3}, 3, "'jsonrpc'"),
        ({"jsonrpc": "1.0", "method": "m", "id": 3}, 3, "'jsonrpc'"),
        ({"jsonrpc": 2.0, "method": "m", "id": 3}, 3, "'jsonrpc'"),
        ({"jsonrpc": "2.0", "id": "a"}, "a", "'method'"),
        ({"jsonrpc": "2.0", "method": None, "id": "a"}, "a", "'method'"),
        ({"jsonrpc": "2.0", "method": "m", "params": "x", "id": 4}, 4, "'params'"),
        ({"jsonrpc": "2.0", "method": "m", "params": None, "id": 4}, 4, "'params'"),
        ({"jsonrpc": "2.0", "method": "m", "params": 5}, None, "'params'"),
        ({"jsonrpc": "2.0", "method": "m", "id": 5, "extra": 1}, 5, "'extra'"),
        ({"jsonrpc": "2.0", "method": "m", "result": 1}, None, "'result'"),
        ({"jsonrpc": "2.0", "method": "m", "id": True, "extra": 1}, None, "'id'"),
        ({}, None, "'jsonrpc'"),
        ([], None, "object"),
        ([{"jsonrpc": "2.0", "method": "m"}], None, "object"),
        ("text", None, "object"),
        (None, None, "object"),
        (7, None, "object"),
    ],
    ids=["true-id", "false-id", "float-int-id", "float-id", "list-id", "object-id",
         "missing-jsonrpc", "wrong-version", "numeric-version", "missing-method",
         "null-method", "string-params", "null-params", "notification-bad-params",
         "extra-member", "response-member", "bad-id-wins", "empty-object", "empty-array",
         "batch", "string", "null", "number"],
)
def test_jsonrpc_invalid_envelopes(value: Any, expected_id: Any, fragment: str) -> None:
    """Invalid envelopes name the offending member and keep the id only when it was valid."""
    result = parse_envelope(value)
    assert isinstance(result, InvalidEnvelope)
    assert result.id == expected_id
    assert type(result.id) is type(expected_id)
    assert fragment in result.message


def test_jsonrpc_invalid_envelope_never_echoes_values() -> None:
    """An invalid envelope's message names members but never their values."""
    result = parse_envelope({"jsonrpc": "9-secret", "method": "m", "id": 1})
    assert isinstance(result, InvalidEnvelope)
    assert "secret" not in result.message


@pytest.mark.parametrize(
    ("params", "positional"), [([1], True), ({"a": 1}, False), (None, False)]
)
def test_jsonrpc_positional_flag(params: Any, positional: bool) -> None:
    """Requests and notifications say whether their params were positional."""
    assert Request(1, "m", params).positional is positional
    assert Notification("m", params).positional is positional


def test_jsonrpc_builders_produce_spec_messages() -> None:
    """The builders produce the JSON-RPC 2.0 response and notification shapes."""
    assert result_message(1, {"a": 1}) == {"jsonrpc": "2.0", "id": 1, "result": {"a": 1}}
    assert result_message("x", None) == {"jsonrpc": "2.0", "id": "x", "result": None}
    assert error_message(None, errors.InvalidRequest("Invalid Request: bad")) == {
        "jsonrpc": "2.0", "id": None,
        "error": {"code": -32600, "message": "Invalid Request: bad"},
    }
    assert notification_message("started", {"callId": "c"}) == {
        "jsonrpc": "2.0", "method": "started", "params": {"callId": "c"},
    }
    assert notification_message("ping") == {"jsonrpc": "2.0", "method": "ping"}


def test_jsonrpc_builders_dump_models_by_alias() -> None:
    """Pydantic models given to the builders are dumped with camelCase names."""
    progress = ProgressParams(call_id="c", elapsed_ms=5, stdout_bytes=1, stderr_bytes=2)
    assert notification_message("progress", progress)["params"] == {
        "callId": "c", "elapsedMs": 5, "stdoutBytes": 1, "stderrBytes": 2,
    }
    assert result_message(2, CancelResult(cancelled=True))["result"] == {"cancelled": True}


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ({"jsonrpc": "2.0", "id": 1, "result": {"x": 1}}, Response(1, {"x": 1})),
        ({"jsonrpc": "2.0", "id": "a", "result": None}, Response("a", None)),
        ({"jsonrpc": "2.0", "method": "progress", "params": {"callId": "c"}},
         Notification("progress", {"callId": "c"})),
        ({"jsonrpc": "2.0", "method": "catalogChanged"}, Notification("catalogChanged")),
    ],
)
def test_jsonrpc_parse_response_success_and_notifications(value: Any, expected: object) -> None:
    """The client classifies results and server notifications."""
    assert parse_response(value) == expected


@pytest.mark.parametrize("cls", list(errors.ERROR_CLASSES.values()))
def test_jsonrpc_parse_response_rebuilds_error_subclass(cls: type[errors.RpcError]) -> None:
    """An error response is rebuilt as the RpcError subclass of its code, data included."""
    wire = orjson.loads(codec.encode(error_message(9, cls("why", {"k": [1]}))))
    parsed = parse_response(wire)
    assert isinstance(parsed, ErrorResponse)
    assert parsed.id == 9
    assert type(parsed.error) is cls
    assert (parsed.error.message, parsed.error.data) == ("why", {"k": [1]})


@pytest.mark.parametrize(
    "value",
    [
        [],
        "x",
        {"id": 1, "result": 1},
        {"jsonrpc": "1.0", "id": 1, "result": 1},
        {"jsonrpc": "2.0", "id": 1},
        {"jsonrpc": "2.0", "result": 1},
        {"jsonrpc": "2.0", "id": True, "result": 1},
        {"jsonrpc": "2.0", "id": 1, "result": 1, "error": {"code": 1, "message": "m"}},
        {"jsonrpc": "2.0", "id": 1, "result": 1, "extra": 0},
        {"jsonrpc": "2.0", "id": 1, "error": "boom"},
        {"jsonrpc": "2.0", "id": 1, "error": {"code": "x", "message": "m"}},
        {"jsonrpc": "2.0", "id": 1, "error": {"code": 1}},
        {"jsonrpc": "2.0", "method": 3},
        {"jsonrpc": "2.0", "method": "m", "params": "p"},
    ],
)
def test_jsonrpc_parse_response_rejects_garbage(value: Any) -> None:
    """Anything that is neither a response nor a notification raises RemoteProtocolError."""
    with pytest.raises(errors.RemoteProtocolError):
        parse_response(value)
