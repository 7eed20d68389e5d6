"""A closed connection is freed at once, with what it buffered, without the cyclic collector.

The daemon lives long and its cyclic collector runs a full pass rarely: an object graph
that only that pass can free stays in memory until it comes, however much it holds.
"""

from __future__ import annotations

import contextlib
import gc
import json
import socket
import tempfile
import weakref
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import anyio
import anyio.abc
import anyio.to_thread
import pytest
from toolsetd.daemon.connection import RequestContext
from toolsetd.daemon.peercred import PeerPolicy
from toolsetd.daemon.server import Server, ServerSettings, bind_unix_socket

pytestmark = pytest.mark.anyio


@pytest.fixture
def collector_off() -> Iterator[None]:
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


@pytest.mark.usefixtures("collector_off")
@pytest.mark.parametrize("ending", ["client closes mid-line", "idle timeout", "oversize line"])
async def test_a_closed_connection_and_its_partial_line_are_freed_at_once(ending: str) -> None:
    """A client that left (or was closed) with 1 MiB of an unfinished line: once its
    connection is gone from the table, nothing keeps the connection object (and so the
    line) alive. The wire's callbacks, bound to the connection, made a cycle that kept
    every closed connection's buffers until a full collection: 30 clients that each left
    15 MiB of a line grew the daemon by 400 MiB, every time."""
    settings = ServerSettings(idle_timeout=0.5, max_frame_size=4 << 20, linger_seconds=0.1)
    async with _serving(settings, {}) as (server, client):
        send = anyio.to_thread.run_sync  # the server reads on this thread's loop
        await send(client.sendall, b'{"x": "' + b"a" * (1 << 20))
        with anyio.fail_after(10):
            ref = await _the_connection(server)
            if ending == "client closes mid-line":
                client.close()
            elif ending == "oversize line":
                await send(client.sendall, b"a" * (4 << 20))
            await _gone_and_freed(server, ref)


def _answers(client: socket.socket, count: int) -> list[dict[str, object]]:
    """Read ``count`` answer lines (blocking; run in a worker thread)."""
    buffered = b""
    while buffered.count(b"\n") < count:
        chunk = client.recv(65536)
        if not chunk:
            raise EOFError(f"closed with {count} answers wanted: {buffered!r}")
        buffered += chunk
    return [json.loads(line) for line in buffered.splitlines()]


def _gather_method(wave: int, result: Any = None) -> dict[str, Any]:
    """The method of the tests below: ``gather`` answers once ``wave`` calls of it are in
    (so ``wave`` handler tasks exist at once), then a new wave begins; it answers
    ``result``, or its params when that is None."""
    state: dict[str, Any] = {"arrived": wave, "all_in": anyio.Event()}

    async def gather(ctx: RequestContext, params: Any) -> Any:
        if state["arrived"] == wave:  # the last wave is complete: this call starts one
            state.update(arrived=0, all_in=anyio.Event())
        all_in = state["all_in"]
        state["arrived"] += 1
        if state["arrived"] == wave:
            all_in.set()
        await all_in.wait()
        return params if result is None else result

    return {"gather": gather}


def _gather_lines(wave: int, tag: str) -> bytes:
    return b"".join(
        json.dumps(
            # The list makes the params a container the collector tracks (so found below).
            {"jsonrpc": "2.0", "id": i, "method": "gather", "params": {"tag": tag, "n": [i]}}
        ).encode()
        + b"\n"
        for i in range(wave)
    )


def _requests_alive(tag: str) -> int:
    """The parsed requests of ``_gather_lines(..., tag)`` still in memory."""
    return sum(
        1
        for o in gc.get_objects()
        if type(o) is dict and type(o.get("params")) is dict and o["params"].get("tag") == tag
    )


@contextlib.asynccontextmanager
async def _serving(
    settings: ServerSettings, methods: dict[str, Any]
) -> AsyncIterator[tuple[Server, socket.socket]]:
    """A server with ``methods`` on a fresh socket, and a client connected to it."""
    with tempfile.TemporaryDirectory(prefix="tsd-") as tmp:
        path = str(Path(tmp) / "s.sock")
        listener = await anyio.abc.SocketListener.from_socket(bind_unix_socket(path))
        server = Server(settings, methods, PeerPolicy.default())
        async with anyio.create_task_group() as tg:
            await tg.start(server.serve, listener)
            client = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                client.connect(path)
                yield server, client
            finally:
                client.close()
                tg.cancel_scope.cancel()


async def _the_connection(server: Server) -> weakref.ref[Any]:
    """The server's one connection, once it has it."""
    while not server.connections:
        await anyio.sleep(0.01)
    return weakref.ref(next(iter(server.connections.values())))


async def _gone_and_freed(server: Server, ref: weakref.ref[Any] | None = None) -> None:
    """Wait for the server's one connection (``ref``, else the one it has) to go, then for
    nothing to keep it."""
    if ref is None:
        ref = await _the_connection(server)
    while server.connections:
        await anyio.sleep(0.01)
    for _ in range(20):  # the serving task lets go of it within a step or two
        if ref() is None:
            break
        await anyio.sleep(0.01)
    assert ref() is None, gc.get_referrers(ref())


@pytest.mark.usefixtures("collector_off")
async def test_handler_tasks_serve_later_messages_and_end_with_the_connection() -> None:
    """A message that is not answered inline gets a handler task, which, once it has
    answered, waits for the connection's next message instead of ending. Checked: more
    pipelined requests than the tasks kept waiting all run at once (each waits for all of
    them), twice (the second run handed to the first run's tasks); and when the client
    leaves, the waiting tasks end, so the connection goes and is freed. Kept waiting, they
    held the connection's task group, and so the connection, open for ever."""
    wave = 6  # more than the handler tasks a connection keeps waiting
    settings = ServerSettings(linger_seconds=0.1)
    async with _serving(settings, _gather_method(wave)) as (server, client):
        send = anyio.to_thread.run_sync  # the server reads on this thread's loop
        with anyio.fail_after(10):
            for run in range(2):
                await send(client.sendall, _gather_lines(wave, f"run {run}"))
                answers = await send(_answers, client, wave)
                assert sorted(a["id"] for a in answers) == list(range(wave))  # type: ignore[type-var]
                assert all(a["result"] == {"tag": f"run {run}", "n": [a["id"]]} for a in answers)
            client.shutdown(socket.SHUT_WR)
            await _gone_and_freed(server)


async def test_an_answered_request_is_not_kept_by_its_waiting_handler_task() -> None:
    """Once answered, a request's parsed value is garbage: its large line's bytes are no
    longer counted (``_release``), so nothing may keep it. A handler task waiting for the
    connection's next message kept the last one it served in its frame (up to four per
    connection, each up to twenty times the line limit, for as long as the client stays
    quiet), out of sight of the large-line budget."""
    wave = 6  # more than the handler tasks a connection keeps waiting
    settings = ServerSettings(linger_seconds=0.1)
    async with _serving(settings, _gather_method(wave, "ok")) as (_, client):
        send = anyio.to_thread.run_sync
        with anyio.fail_after(10):
            await send(client.sendall, _gather_lines(wave, "kept?"))
            assert len(await send(_answers, client, wave)) == wave
            # Two more lines in one chunk, so that the reader's own last message (its
            # frame keeps that one) is not one of the wave's.
            other = b'{"jsonrpc": "2.0", "id": "x", "method": "nothing"}\n'
            await send(client.sendall, other * 2)
            assert len(await send(_answers, client, 2)) == 2
            await anyio.sleep(0.05)
        assert _requests_alive("kept?") == 0


@pytest.mark.usefixtures("collector_off")
async def test_a_connection_closed_for_a_stalled_peer_is_freed_at_once() -> None:
    """A peer that stops reading is disconnected at the write timeout (``abort``), which
    cancels the connection's handler tasks. The ones waiting for a next message were
    cancelled in their wait, and the cancellation's traceback (kept in a cycle by anyio's
    task-done callback) held each one's frame, and so the connection with its queued
    frames, until a full collection."""
    wave = 6
    settings = ServerSettings(linger_seconds=0.1, write_timeout=0.3, send_buffer=4096)
    methods = _gather_method(wave, "x" * (256 * 1024))
    async with _serving(settings, methods) as (server, client):
        with anyio.fail_after(10):
            # Never read: 1.5 MiB of answers cannot all go out, and the peer is cut.
            await anyio.to_thread.run_sync(client.sendall, _gather_lines(wave, "stalled"))
            await _gone_and_freed(server)
