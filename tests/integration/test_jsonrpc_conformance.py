"""JSON-RPC 2.0: the specification's examples section, against our server on a real socket.

The daemon's own methods take params by name only, so the examples' methods (subtract,
sum, update, get_data, notify_hello) are served by the daemon's ``Server`` class with a
method table of their own, on a real Unix socket, and spoken to over a real connection.
"""

from __future__ import annotations

import json
import socket
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anyio
import anyio.abc
import pytest
from toolsetd.daemon.peercred import PeerPolicy
from toolsetd.daemon.server import RequestContext, Server, ServerSettings, bind_unix_socket

pytestmark = pytest.mark.anyio


async def _subtract(ctx: RequestContext, params: Any) -> Any:
    if isinstance(params, list):
        return params[0] - params[1]
    return params["minuend"] - params["subtrahend"]


async def _sum(ctx: RequestContext, params: Any) -> Any:
    return sum(params)


async def _nothing(ctx: RequestContext, params: Any) -> Any:
    return None


async def _get_data(ctx: RequestContext, params: Any) -> Any:
    return ["hello", 5]


METHODS = {
    "subtract": _subtract,
    "sum": _sum,
    "update": _nothing,
    "notify_hello": _nothing,
    "notify_sum": _nothing,
    "get_data": _get_data,
}


class Line:
    """A blocking NDJSON connection driven from a worker thread."""

    def __init__(self, path: str) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(5)
        self.sock.connect(path)
        self.buffer = b""

    def exchange(self, raw: str) -> Any:
        """Send one raw line; return the next message."""
        self.sock.sendall(raw.encode() + b"\n")
        return self.receive()

    def receive(self) -> Any:
        while b"\n" not in self.buffer:
            chunk = self.sock.recv(65536)
            if not chunk:
                raise EOFError
            self.buffer += chunk
        line, self.buffer = self.buffer.split(b"\n", 1)
        return json.loads(line)


@pytest.fixture
async def server_path() -> AsyncIterator[str]:
    """Our Server with the spec's example methods, on a real temporary socket."""
    with tempfile.TemporaryDirectory(prefix="tsd-") as tmp:
        path = str(Path(tmp) / "rpc.sock")
        listener = await anyio.abc.SocketListener.from_socket(bind_unix_socket(path))
        server = Server(ServerSettings(), METHODS, PeerPolicy.default())
        async with anyio.create_task_group() as tg:
            await tg.start(server.serve, listener)
            yield path
            tg.cancel_scope.cancel()


async def exchange(path: str, *raws: str) -> list[Any]:
    """Send each raw line on one connection and collect one reply per line."""

    def run() -> list[Any]:
        line = Line(path)
        try:
            return [line.exchange(raw) for raw in raws]
        finally:
            line.sock.close()

    with anyio.fail_after(10):
        return await anyio.to_thread.run_sync(run)


EXAMPLES = [
    (
        '{"jsonrpc": "2.0", "method": "subtract", "params": [42, 23], "id": 1}',
        {"jsonrpc": "2.0", "result": 19, "id": 1},
    ),
    (
        '{"jsonrpc": "2.0", "method": "subtract", "params": [23, 42], "id": 2}',
        {"jsonrpc": "2.0", "result": -19, "id": 2},
    ),
    (
        '{"jsonrpc": "2.0", "method": "subtract", "params": {"subtrahend": 23, "minuend": 42}, "id": 3}',
        {"jsonrpc": "2.0", "result": 19, "id": 3},
    ),
    (
        '{"jsonrpc": "2.0", "method": "subtract", "params": {"minuend": 42, "subtrahend": 23}, "id": 4}',
        {"jsonrpc": "2.0", "result": 19, "id": 4},
    ),
    (
        '{"jsonrpc": "2.0", "method": "foobar", "id": "1"}',
        {"jsonrpc": "2.0", "error": {"code": -32601, "message": "Method not found"}, "id": "1"},
    ),
    (
        '{"jsonrpc": "2.0", "method": "foobar, "params": "bar", "baz]',
        {"jsonrpc": "2.0", "error": {"code": -32700, "message": "Parse error"}, "id": None},
    ),
    (
        '{"jsonrpc": "2.0", "method": 1, "params": "bar"}',
        {"jsonrpc": "2.0", "error": {"code": -32600, "message": "Invalid Request"}, "id": None},
    ),
    (
        '[{"jsonrpc": "2.0", "method": "sum", "params": [1,2,4], "id": "1"},{"jsonrpc": "2.0", "method"]',
        {"jsonrpc": "2.0", "error": {"code": -32700, "message": "Parse error"}, "id": None},
    ),
    (
        "[]",
        {"jsonrpc": "2.0", "error": {"code": -32600, "message": "Invalid Request"}, "id": None},
    ),
    (
        "[1]",
        [{"jsonrpc": "2.0", "error": {"code": -32600, "message": "Invalid Request"}, "id": None}],
    ),
    (
        "[1,2,3]",
        [{"jsonrpc": "2.0", "error": {"code": -32600, "message": "Invalid Request"}, "id": None}] * 3,
    ),
    (
        """[
        {"jsonrpc": "2.0", "method": "sum", "params": [1,2,4], "id": "1"},
        {"jsonrpc": "2.0", "method": "notify_hello", "params": [7]},
        {"jsonrpc": "2.0", "method": "subtract", "params": [42,23], "id": "2"},
        {"foo": "boo"},
        {"jsonrpc": "2.0", "method": "foo.get", "params": {"name": "myself"}, "id": "5"},
        {"jsonrpc": "2.0", "method": "get_data", "id": "9"}
        ]""".replace("\n", " "),
        [
            {"jsonrpc": "2.0", "result": 7, "id": "1"},
            {"jsonrpc": "2.0", "result": 19, "id": "2"},
            {"jsonrpc": "2.0", "error": {"code": -32600, "message": "Invalid Request"}, "id": None},
            {"jsonrpc": "2.0", "error": {"code": -32601, "message": "Method not found"}, "id": "5"},
            {"jsonrpc": "2.0", "result": ["hello", 5], "id": "9"},
        ],
    ),
]


def _comparable(message: Any) -> Any:
    """The spec's view of a reply: our messages start with the spec's text, then say more.

    The contract requires every message to name the offending field and what was
    expected, so "Method not found" is followed by the method's name; ``data`` carries
    details the spec leaves open.
    """
    if isinstance(message, list):
        return [_comparable(m) for m in message]
    if "error" in message:
        error = dict(message["error"])
        error.pop("data", None)
        return {**message, "error": error}
    return message


@pytest.mark.parametrize(("raw", "expected"), EXAMPLES)
async def test_jsonrpc_spec_example_answers_as_specified(
    server_path: str, raw: str, expected: Any
) -> None:
    """Each example of the JSON-RPC 2.0 specification gets the specified response."""
    (reply,) = await exchange(server_path, raw)
    got = _comparable(reply)
    if isinstance(expected, list):
        assert isinstance(got, list)
        assert len(got) == len(expected)
        pairs = list(zip(got, expected, strict=True))
    else:
        pairs = [(got, expected)]
    for one, want in pairs:
        if "error" in want:
            assert one["id"] == want["id"]
            assert one["error"]["code"] == want["error"]["code"]
            assert one["error"]["message"].startswith(want["error"]["message"])
            assert set(one) == {"jsonrpc", "error", "id"}
        else:
            assert one == want


@pytest.mark.parametrize(
    "raw",
    [
        '{"jsonrpc": "2.0", "method": "update", "params": [1,2,3,4,5]}',
        '{"jsonrpc": "2.0", "method": "foobar"}',
        '[{"jsonrpc": "2.0", "method": "notify_sum", "params": [1,2,4]},'
        '{"jsonrpc": "2.0", "method": "notify_hello", "params": [7]}]',
    ],
)
async def test_jsonrpc_notifications_get_no_response(server_path: str, raw: str) -> None:
    """A notification, or a batch of only notifications, is answered with nothing."""
    probe = '{"jsonrpc": "2.0", "method": "get_data", "id": "probe"}'

    def run() -> Any:
        line = Line(server_path)
        try:
            line.sock.sendall(raw.encode() + b"\n")
            return line.exchange(probe)
        finally:
            line.sock.close()

    with anyio.fail_after(10):
        reply = await anyio.to_thread.run_sync(run)
    assert reply == {"jsonrpc": "2.0", "result": ["hello", 5], "id": "probe"}


@pytest.mark.parametrize(
    ("raw", "member"),
    [
        ('{"jsonrpc": "2.0", "method": "get_data", "id": 1, "extra": true}', "extra"),
        ('{"jsonrpc": "1.0", "method": "get_data", "id": 1}', "jsonrpc"),
        ('{"method": "get_data", "id": 1}', "jsonrpc"),
        ('{"jsonrpc": "2.0", "method": "get_data", "id": true}', "id"),
        ('{"jsonrpc": "2.0", "method": "get_data", "params": 5, "id": 1}', "params"),
    ],
)
async def test_jsonrpc_invalid_envelope_names_the_member(
    server_path: str, raw: str, member: str
) -> None:
    """An envelope with an extra, missing or mistyped member is an Invalid Request naming it."""
    (reply,) = await exchange(server_path, raw)
    assert reply["error"]["code"] == -32600
    assert member in reply["error"]["message"]


async def test_jsonrpc_handler_exception_never_leaks_its_text() -> None:
    """A handler that raises answers Internal error with an incident id, not the exception text."""

    async def boom(ctx: RequestContext, params: Any) -> Any:
        raise RuntimeError("secret token 1234 leaked")

    with tempfile.TemporaryDirectory(prefix="tsd-") as tmp:
        path = str(Path(tmp) / "rpc.sock")
        listener = await anyio.abc.SocketListener.from_socket(bind_unix_socket(path))
        server = Server(ServerSettings(), {"boom": boom}, PeerPolicy.default())
        async with anyio.create_task_group() as tg:
            await tg.start(server.serve, listener)
            (reply,) = await exchange(path, '{"jsonrpc": "2.0", "method": "boom", "id": 7}')
            tg.cancel_scope.cancel()
    assert reply["id"] == 7
    assert reply["error"]["code"] == -32603
    assert "secret" not in json.dumps(reply)
    assert "RuntimeError" not in json.dumps(reply)
    assert reply["error"]["data"]["incident"]


async def test_jsonrpc_unserialisable_result_is_an_internal_error_not_a_lost_connection() -> None:
    """A result that cannot be serialised answers Internal error, and the connection lives on."""

    async def bad(ctx: RequestContext, params: Any) -> Any:
        return {1, 2, 3}

    with tempfile.TemporaryDirectory(prefix="tsd-") as tmp:
        path = str(Path(tmp) / "rpc.sock")
        listener = await anyio.abc.SocketListener.from_socket(bind_unix_socket(path))
        server = Server(ServerSettings(), {"bad": bad, **METHODS}, PeerPolicy.default())
        async with anyio.create_task_group() as tg:
            await tg.start(server.serve, listener)
            first, second = await exchange(
                path,
                '{"jsonrpc": "2.0", "method": "bad", "id": 1}',
                '{"jsonrpc": "2.0", "method": "get_data", "id": 2}',
            )
            tg.cancel_scope.cancel()
    assert first["id"] == 1
    assert first["error"]["code"] == -32603
    assert second == {"jsonrpc": "2.0", "result": ["hello", 5], "id": 2}
