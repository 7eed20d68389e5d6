"""Tests for toolsetd.daemon.httpserver: real loopback sockets, malformed and slow peers."""

from __future__ import annotations

import contextlib
import datetime
import email.utils
import json
import socket
from collections.abc import AsyncIterator
from typing import Any

import anyio
import anyio.abc
import pytest
from toolsetd.daemon.httpserver import Exchange, HttpRequest, HttpServer, HttpSettings, Refusal
from toolsetd.protocol import errors as rpc_errors

pytestmark = pytest.mark.anyio

SETTINGS = HttpSettings(
    max_header_bytes=4096, max_body_bytes=1024, head_timeout=0.5, body_timeout=0.5,
    idle_timeout=0.5, write_timeout=1.0,
)


class Recorder:
    """A handler that echoes the request and records what it saw."""

    def __init__(self) -> None:
        self.requests: list[HttpRequest] = []
        self.cancelled = anyio.Event()

    async def __call__(self, request: HttpRequest, exchange: Exchange, peer: Any) -> None:
        self.requests.append(request)
        if request.path == "/gone":
            await exchange.respond(204)
            return
        if request.path == "/stream":
            await exchange.start_stream(200, [("content-type", "text/event-stream")])
            await exchange.send(b"data: one\n\n")
            try:
                await anyio.sleep(30)
            finally:
                self.cancelled.set()
        await exchange.respond_json(
            200, {"method": request.method, "path": request.path, "query": request.query,
                  "body": request.body.decode()},
        )


@contextlib.asynccontextmanager
async def _serve(settings: HttpSettings, handler: Recorder, refusal: Refusal | None = None
                 ) -> AsyncIterator[tuple[int, Recorder]]:
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    port = listener.getsockname()[1]
    server = HttpServer(settings, handler, lambda sock: (None, refusal))
    async with anyio.create_task_group() as tg:
        await tg.start(server.serve, [listener])
        yield port, handler
        tg.cancel_scope.cancel()


def served() -> contextlib.AbstractAsyncContextManager[tuple[int, Recorder]]:
    """A server with small limits on an ephemeral loopback port."""
    return _serve(SETTINGS, Recorder())


async def _exchange(port: int, data: bytes, *, read_until_close: bool = True) -> bytes:
    """Send raw bytes, then read until the server closes (or 3 s pass)."""
    async with await anyio.connect_tcp("127.0.0.1", port) as stream:
        await stream.send(data)
        chunks = []
        with anyio.move_on_after(3):
            while True:
                try:
                    chunk = await stream.receive()
                except (anyio.EndOfStream, anyio.BrokenResourceError):
                    break
                chunks.append(chunk)
                if not read_until_close:
                    break
        return b"".join(chunks)


def _status(response: bytes) -> int:
    return int(response.split(b" ", 2)[1])


def _body(response: bytes) -> Any:
    return json.loads(response.split(b"\r\n\r\n", 1)[1])


async def test_http_request_answered_and_kept_alive() -> None:
    """Two requests on one connection are both answered, with their bodies and queries."""
    async with served() as (port, handler):
        request = (b"POST /mcp?workspace=/tmp&x=1 HTTP/1.1\r\nHost: localhost\r\n"
                   b"Content-Length: 5\r\n\r\nhello")
        with anyio.fail_after(5):
            async with await anyio.connect_tcp("127.0.0.1", port) as stream:
                for _ in range(2):
                    await stream.send(request)
                    data = b""
                    while not data.endswith(b"}"):
                        data += await stream.receive()
                    assert _status(data) == 200
                    assert _body(data) == {"method": "POST", "path": "/mcp", "body": "hello",
                                           "query": {"workspace": ["/tmp"], "x": ["1"]}}
        assert len(handler.requests) == 2


async def test_http_origin_form_path_is_the_path_as_sent() -> None:
    """``//evil.example.com/mcp`` is an origin-form path whose first segment is empty, not
    an authority and the path /mcp (urlsplit's reading, which served the endpoint)."""
    async with served() as (port, _):
        with anyio.fail_after(5):
            data = await _exchange(port, b"GET //evil.example.com/mcp?x=1 HTTP/1.1\r\n"
                                         b"Host: localhost\r\nConnection: close\r\n\r\n")
    assert _body(data)["path"] == "//evil.example.com/mcp", data
    assert _body(data)["query"] == {"x": ["1"]}, data


async def test_http_expect_100_continue_is_answered_before_the_body() -> None:
    """A client that sends ``Expect: 100-continue`` and waits is told ``100 Continue``
    (RFC 9110 10.1.1: a server reading the content MUST, at once): it waited for nothing,
    then sent the body anyway (curl after 1 s, for every body over 1 MiB) or never. A
    body whose declared size is refused gets its final status instead, and no 100."""
    head = (b"POST /mcp HTTP/1.1\r\nHost: localhost\r\nExpect: 100-continue\r\n"
            b"Content-Length: 5\r\n\r\n")
    async with served() as (port, handler):
        with anyio.fail_after(5):
            async with await anyio.connect_tcp("127.0.0.1", port) as stream:
                await stream.send(head)
                data = b""
                while b"\r\n\r\n" not in data:
                    data += await stream.receive()
                assert data.startswith(b"HTTP/1.1 100 "), data
                await stream.send(b"hello")
                data = data.split(b"\r\n\r\n", 1)[1]
                while not data.endswith(b"}"):
                    data += await stream.receive()
                assert _status(data) == 200
                assert _body(data)["body"] == "hello"
            data = await _exchange(port, head.replace(b": 5", b": 5000"))
        assert _status(data) == 413, data
        assert len(handler.requests) == 1


async def test_http_204_has_no_content_length() -> None:
    """A 204 (the answer to MCP's DELETE) carries no Content-Length (RFC 9110 8.6: a
    server MUST NOT send one with it), and the connection goes on."""
    async with served() as (port, _):
        request = b"DELETE /gone HTTP/1.1\r\nHost: localhost\r\n\r\n"
        follow = b"GET /mcp HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n"
        with anyio.fail_after(5):
            data = await _exchange(port, request + follow)
    first, _, rest = data.partition(b"\r\n\r\n")
    assert first.startswith(b"HTTP/1.1 204 "), data
    assert b"content-length" not in first.lower(), data
    assert _status(rest) == 200, data


async def test_http_every_response_carries_a_date() -> None:
    """A whole response, a stream's head and an error that closes the connection each
    carry ``Date`` in the IMF-fixdate form (RFC 9110 6.6.1: an origin server with a clock
    MUST send it in its 2xx and 4xx responses)."""
    async with served() as (port, _):
        with anyio.fail_after(10):
            whole = await _exchange(port, b"GET /a HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            stream = await _exchange(port, b"GET /stream HTTP/1.1\r\nHost: x\r\n\r\n",
                                     read_until_close=False)
            refused = await _exchange(port, b"GET /a HTTP/1.1\r\nHost: x\r\n"
                                            b"Content-Length: +1\r\n\r\n")
    assert (_status(whole), _status(stream), _status(refused)) == (200, 200, 400)
    for response in (whole, stream, refused):
        head = response.split(b"\r\n\r\n", 1)[0].decode().lower().split("\r\n")
        dates = [line.split(":", 1)[1].strip() for line in head if line.startswith("date:")]
        assert len(dates) == 1, response
        when = email.utils.parsedate_to_datetime(dates[0])
        assert when.utcoffset() == datetime.timedelta(0), dates
        assert dates[0].endswith(" gmt"), dates


async def test_http_chunked_body_is_assembled() -> None:
    """A chunked request body reaches the handler whole."""
    async with served() as (port, _handler):
        data = await _exchange(port, b"POST /a HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n"
                               b"\r\n3\r\nabc\r\n2\r\nde\r\n0\r\n\r\n", read_until_close=False)
        assert _body(data)["body"] == "abcde"


@pytest.mark.parametrize(
    ("raw", "status", "code"),
    [
        pytest.param(b"POST /a HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
                     b"zz\r\nabc\r\n0\r\n\r\n", 400, -32600, id="bad-chunk-size"),
        pytest.param(b"POST /a HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
                     b"3\r\nabcdef\r\n0\r\n\r\n", 400, -32600, id="chunk-longer-than-its-size"),
        # RFC 9112 6.1: an HTTP/1.0 message with Transfer-Encoding MUST be taken as faulty
        # framing (a 1.0 intermediary reads no chunks: what follows the 0 chunk would be
        # its next request), and the connection closed: the GET after it is not served.
        pytest.param(b"POST /a HTTP/1.0\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
                     b"3\r\nabc\r\n0\r\n\r\nGET /b HTTP/1.1\r\nHost: x\r\n\r\n", 400, -32600,
                     id="transfer-encoding-in-http-1.0"),
        pytest.param(b"GARBAGE\r\n\r\n", 400, -32600, id="bad-request-line"),
        pytest.param(b"GET /a HTTP/1.1\r\n\r\n", 400, -32600, id="no-host"),
        pytest.param(b"GET /a HTTP/1.1\r\nHost: x\r\nX: " + b"a" * 8000 + b"\r\n\r\n", 431, -32007,
                     id="huge-header"),
        pytest.param(b"POST /a HTTP/1.1\r\nHost: x\r\nContent-Length: 2000\r\n\r\n" + b"a" * 2000,
                     413, -32007, id="body-too-large"),
        pytest.param(b"POST /a HTTP/1.1\r\nHost: x\r\nContent-Length: 10\r\n\r\nabc", 408, -32600,
                     id="body-never-completes"),
    ],
)
async def test_http_malformed_request_answered_and_closed(
    raw: bytes, status: int, code: int
) -> None:
    """Malformed or oversized requests get their 4xx and the connection closes. The body
    is a JSON-RPC error, as MCP's transport has error statuses carry and its clients read
    (it was ``{"error": "..."}``, which the SDK's client reads as "Server returned an error
    response"): an oversized head or body is -32007, as the socket answers a long line."""
    async with served() as (port, handler):
        with anyio.fail_after(5):
            data = await _exchange(port, raw)
        assert _status(data) == status
        body = _body(data)
        assert (body["jsonrpc"], body["id"], body["error"]["code"]) == ("2.0", None, code), body
        assert body["error"]["message"], body
        if code == -32007:
            assert body["error"]["data"]["limit"] in (SETTINGS.max_header_bytes,
                                                      SETTINGS.max_body_bytes), body
        assert handler.requests == []


async def test_http_an_unknown_transfer_coding_is_501_and_says_so() -> None:
    """A transfer coding other than chunked (``gzip``) is 501 (RFC 9112 6.1: one the
    server does not understand), and the message says that, not "Bad request: malformed"
    under a status that says the request may be well formed; the connection closes."""
    async with served() as (port, handler):
        with anyio.fail_after(5):
            data = await _exchange(port, b"POST /a HTTP/1.1\r\nHost: x\r\n"
                                         b"Transfer-Encoding: gzip\r\n\r\n3\r\nabc\r\n0\r\n\r\n")
        assert _status(data) == 501, data
        message = _body(data)["error"]["message"]
        assert message.startswith("Not implemented: "), message
        assert "chunked" in message, message
        assert handler.requests == []


async def test_http_slowloris_head_is_cut_off() -> None:
    """A peer trickling its request head is answered 408 within the head timeout."""
    async with served() as (port, handler):
        with anyio.fail_after(5):
            async with await anyio.connect_tcp("127.0.0.1", port) as stream:
                data = b""
                for byte in b"GET /a HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 100:
                    await stream.send(bytes([byte]))
                    with anyio.move_on_after(0.05):
                        data += await stream.receive()
                    if data:
                        break
                with anyio.move_on_after(2):
                    while b"}" not in data:
                        data += await stream.receive()
        assert _status(data) == 408
        assert handler.requests == []


async def test_http_silent_connection_is_closed() -> None:
    """A connection that never sends a byte is closed after the head timeout."""
    async with served() as (port, _handler):
        with anyio.fail_after(5):
            assert await _exchange(port, b"") == b""


async def test_http_stream_disconnect_cancels_handler() -> None:
    """A client closing a streamed response cancels the handler serving it."""
    async with served() as (port, handler):
        with anyio.fail_after(5):
            async with await anyio.connect_tcp("127.0.0.1", port) as stream:
                await stream.send(b"GET /stream HTTP/1.1\r\nHost: x\r\n\r\n")
                data = b""
                while b"data: one" not in data:
                    data += await stream.receive()
                assert b"transfer-encoding: chunked" in data.lower()
            await handler.cancelled.wait()


async def test_http_refusal_answers_and_closes() -> None:
    """A refused peer gets the refusal's status and message, and the handler never runs."""
    refusal = Refusal(403, rpc_errors.PeerNotAllowed("Forbidden: no."))
    async with _serve(SETTINGS, Recorder(), refusal) as (port, handler):
        with anyio.fail_after(5):
            data = await _exchange(port, b"GET /a HTTP/1.1\r\nHost: x\r\n\r\n")
        assert _status(data) == 403
        assert _body(data) == {"jsonrpc": "2.0", "id": None,
                               "error": {"code": -32009, "message": "Forbidden: no."}}
        assert handler.requests == []


def test_http_settings_defaults_bound_every_wait() -> None:
    """Every timeout of the defaults is finite."""
    settings = HttpSettings()
    assert all(
        0 < t < 3600 for t in (settings.head_timeout, settings.body_timeout,
                               settings.idle_timeout, settings.write_timeout)
    )
    assert socket.AF_INET  # the module under test needs IPv4 loopback
