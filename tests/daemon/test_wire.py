"""The wire's stall timer: a peer that reads slowly is not a peer that stopped reading."""

from __future__ import annotations

import asyncio
import socket

import anyio
import pytest
from toolsetd.daemon.wire import Wire

pytestmark = pytest.mark.anyio

_FRAME = 4 * 1024 * 1024


def _tcp_pair() -> tuple[socket.socket, socket.socket]:
    """A loopback TCP pair whose client side has a small receive buffer, so that its
    window opens as it reads, a few KiB at a time."""
    with socket.create_server(("127.0.0.1", 0)) as listener:
        theirs = socket.socket()
        theirs.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        theirs.connect(listener.getsockname())
        ours, _ = listener.accept()
    return ours, theirs


async def _serve(
    stall: float, *, tcp: bool = False
) -> tuple[Wire, asyncio.Transport, socket.socket, list[bool]]:
    loop = asyncio.get_running_loop()
    ours, theirs = _tcp_pair() if tcp else socket.socketpair()
    transport, wire = await loop.connect_accepted_socket(lambda: Wire(loop, 1 << 20), sock=ours)
    transport.set_write_buffer_limits(high=64 * 1024)
    stalled: list[bool] = []
    wire.stall_seconds = stall
    wire.on_stall = lambda: stalled.append(True)
    theirs.setblocking(False)
    return wire, transport, theirs, stalled


async def _read(peer: socket.socket, total: int, chunk: int, pause: float) -> int:
    loop = asyncio.get_running_loop()
    got = 0
    while got < total:
        data = await loop.sock_recv(peer, chunk)
        if not data:
            break
        got += len(data)
        await anyio.sleep(pause)
    return got


@pytest.mark.slow
async def test_wire_slow_reader_of_a_big_frame_is_not_stalled() -> None:
    """A peer taking a 4 MiB frame in 256 KiB steps over ~1.5 s outlasts a 0.3 s stall timer."""
    with anyio.fail_after(20):
        wire, transport, peer, stalled = await _serve(0.3)
        try:
            wire.enqueue(b"x" * _FRAME)
            got = await _read(peer, _FRAME, 256 * 1024, 0.1)
        finally:
            transport.abort()
            peer.close()
    assert got == _FRAME
    assert stalled == []


async def test_wire_peer_that_takes_nothing_is_stalled() -> None:
    """A peer that takes nothing of a big frame is reported once the stall timer runs out."""
    with anyio.fail_after(20):
        wire, transport, peer, stalled = await _serve(0.3)
        try:
            wire.enqueue(b"x" * _FRAME)
            await anyio.sleep(0.8)
        finally:
            transport.abort()
            peer.close()
    assert stalled == [True]


async def test_wire_peer_that_takes_a_trickle_is_stalled() -> None:
    """A peer that takes a few KiB per stall period of a 4 MiB backlog is stalled too.

    Over TCP the peer's kernel may take a little of a backlog its application never reads
    (it compacts its receive queue and opens the window a crack): 37 KB in 30 s in one
    run of the MCP write-timeout test, which then re-armed the timer for as long as that
    went on. Less than 64 KiB (or half of what waited) in a period is not reading.
    """
    with anyio.fail_after(20):
        wire, transport, peer, stalled = await _serve(0.3, tcp=True)  # counted to the byte
        try:
            wire.enqueue(b"x" * _FRAME)
            with anyio.move_on_after(1.5):
                await _read(peer, _FRAME, 1024, 0.05)  # ~6 KiB a period
        finally:
            transport.abort()
            peer.close()
    assert stalled == [True]


async def test_wire_unix_peer_that_empties_a_buffer_a_period_is_reading() -> None:
    """A Unix socket's peer takes nothing it does not read, and what it took is counted per
    kernel buffer it emptied (37,120 bytes on Linux): one read of 48 KiB is reading. Held
    to the TCP rule (64 KiB a period), a peer reading 96 KiB every period was cut off in
    a period that happened to empty one buffer. A period in which it reads nothing is
    still a stall.

    The stall timer's period is ended by hand (``_stalled``), so nothing here is timed.
    """
    with anyio.fail_after(20):
        wire, transport, peer, stalled = await _serve(3600.0)
        try:
            wire.enqueue(b"x" * _FRAME)
            got = 0
            while got < 48 * 1024:
                got += len(await asyncio.get_running_loop().sock_recv(peer, 48 * 1024 - got))
            wire._disarm_stall()
            wire._stalled()  # the period ends: it read
            assert stalled == []
            wire._disarm_stall()
            wire._stalled()  # the next one ends: it read nothing
            assert stalled == [True]
        finally:
            transport.abort()
            peer.close()


def _record_writes(transport: asyncio.Transport) -> list[bytes]:
    """Every ``transport.write`` from now on, as it was called (the transport still writes)."""
    written: list[bytes] = []
    write = transport.write

    def recording(data: bytes | bytearray | memoryview) -> None:
        written.append(bytes(data))
        write(data)

    transport.write = recording  # type: ignore[method-assign]
    return written


async def test_wire_held_frame_shares_the_next_frames_write_and_keeps_order() -> None:
    """hold: the next frame committed in the same step goes out in the same write, after it."""
    with anyio.fail_after(10):
        wire, transport, peer, _ = await _serve(30)
        written = _record_writes(transport)
        loop = asyncio.get_running_loop()
        try:
            wire.hold(b"completed\n")
            wire.enqueue(b"response\n")
            assert written == [b"completed\nresponse\n"]
            assert await loop.sock_recv(peer, 1 << 16) == b"completed\nresponse\n"
            # With nothing after it, a held frame goes out alone once this step ends.
            wire.hold(b"alone\n")
            assert await loop.sock_recv(peer, 1 << 16) == b"alone\n"
            # A droppable frame written right after it still goes second.
            wire.hold(b"first\n")
            assert wire.write_now(b"second\n")
            assert written[-2:] == [b"first\n", b"second\n"]
        finally:
            transport.abort()
            peer.close()


async def test_wire_wait_drained_sends_a_held_frame() -> None:
    """A final flush (wait_drained, as before a close) never leaves a held frame behind."""
    with anyio.fail_after(10):
        wire, transport, peer, _ = await _serve(30)
        written = _record_writes(transport)
        try:
            wire.hold(b"last\n")
            await wire.wait_drained()
            assert written == [b"last\n"]
        finally:
            transport.abort()
            peer.close()


def _send_buffer(sock: socket.socket) -> int:
    return sock.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF)  # what one send may queue


def _wmem_max() -> int:
    with open("/proc/sys/net/core/wmem_max") as f:
        return int(f.read())


async def test_wire_large_frame_fits_a_unix_socket_in_one_write() -> None:
    """A 900 KB frame raises a Unix socket's send buffer: the kernel takes it all at once."""
    frame = b"x" * 900_000 + b"\n"
    with anyio.fail_after(10):
        wire, transport, peer, _ = await _serve(30)
        ours = transport.get_extra_info("socket")
        try:
            before = _send_buffer(ours)
            if before >= len(frame):
                pytest.skip(f"the default send buffer ({before}) already holds the frame")
            if 2 * _wmem_max() < len(frame):
                pytest.skip(f"net.core.wmem_max ({_wmem_max()}) caps the buffer below the frame")
            assert wire.write_now(b"small\n")
            assert _send_buffer(ours) == before  # small frames never touch it
            assert wire.write_now(frame)
            assert _send_buffer(ours) >= len(frame)
            assert transport.get_write_buffer_size() == 0  # nothing left in userspace
            got = await _read(peer, len(frame) + 6, 1 << 20, 0)
        finally:
            transport.abort()
            peer.close()
    assert got == len(frame) + 6


async def test_wire_send_buffer_growth_is_capped_and_tcp_keeps_its_own() -> None:
    """Past 1 MiB the rest waits in the transport (backpressure); TCP's buffer is not set."""
    with anyio.fail_after(10):
        wire, transport, peer, _ = await _serve(30)
        try:
            wire.enqueue(b"x" * _FRAME)
            assert _send_buffer(transport.get_extra_info("socket")) <= (1 << 20) + 2
            assert wire.backlogged
        finally:
            transport.abort()
            peer.close()
        loop = asyncio.get_running_loop()
        listener = socket.create_server(("127.0.0.1", 0))
        client = socket.create_connection(listener.getsockname())
        accepted, _ = listener.accept()
        listener.close()
        transport, wire = await loop.connect_accepted_socket(
            lambda: Wire(loop, 1 << 20), sock=accepted
        )
        try:
            before = _send_buffer(accepted)
            wire.enqueue(b"x" * 900_000)
            assert _send_buffer(accepted) == before
        finally:
            transport.abort()
            client.close()
