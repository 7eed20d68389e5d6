"""The asyncio end of one connection's socket: bytes in, frames out, flow control.

Theory of operation
-------------------
A connection's socket is driven by the event loop's own socket transport (``Wire``, an
``asyncio.Protocol``): the daemon runs on asyncio only, and the transport keeps the
socket registered with the selector for the connection's life, reads up to 256 KiB per
wake-up, and sends a frame at once when the socket has room, with no anyio checkpoint and
no ``add_reader``/``remove_reader`` per receive. Every wait in it is a plain future, so
anyio's cancel scopes (the idle and write timeouts, ``abort``, a forced stop) still reach
it.

``Wire`` holds no policy: the ``Connection`` (``connection.py``) decides what to read,
what to drop and when to close; the wire only buffers, pauses and reports.
"""

from __future__ import annotations

import asyncio
import fcntl
import socket
import struct
import termios
import threading
from collections import deque
from collections.abc import Callable
from typing import Any

import structlog

__all__ = ["Wire"]

log = structlog.get_logger("toolsetd.wire")

#: A frame at least this long may not fit the socket's send buffer (Linux: 208 KiB).
_LARGE_FRAME = 128 * 1024
#: The most a Unix socket's send buffer is raised to for one frame (what ``SO_SNDBUF``
#: reports; the kernel also caps it at twice ``net.core.wmem_max``).
_SOCKET_BUFFER_MAX = 1 << 20
#: What a peer must take in one stall period to count as reading (or half of what
#: waited, if that is less): a TCP peer's kernel takes a trickle of a backlog that its
#: application never reads, as it compacts its receive queue.
_READING_MIN = 64 * 1024


#: The most one read takes from a socket: what asyncio's transports read at once.
_READ_SIZE = 256 * 1024
_reads = threading.local()


def _read_buffer() -> memoryview:
    """The calling thread's read buffer, shared by its connections: a read is copied out
    before the loop does anything else (``Wire.buffer_updated``)."""
    buffer: memoryview | None = getattr(_reads, "buffer", None)
    if buffer is None:
        buffer = _reads.buffer = memoryview(bytearray(_READ_SIZE))
    return buffer


class Wire(asyncio.BufferedProtocol):
    """The asyncio end of one connection's socket: bytes in, frames out, flow control.

    The daemon runs on asyncio only (``app.py``), so a connection uses the loop's socket
    transport directly rather than anyio's socket stream: the socket stays registered
    with the selector for the connection's life, a ``send`` goes out at once when the
    socket has room, and no receive or send passes through a checkpoint. Every wait here
    is a plain future, so anyio's cancel scopes (timeouts, ``abort``) still reach it.

    * A read goes into a buffer kept for the loop's thread and is copied out at its size
      (``get_buffer``, ``buffer_updated``). asyncio's plain protocols get each read from
      ``recv(256 KiB)``: a fresh 256 KiB block cut down to the chunk, which glibc maps
      and unmaps afresh in some states of the heap (two page faults, an ``munmap`` and a
      TLB flush for every request, ~15 µs of system time; docs/benchmarks.md, thirty-
      seventh pass). Whether a daemon was in that state depended on what its start-up had
      allocated.
    * Received bytes wait as chunks until the reader takes them; past ``max_buffered``
      bytes the transport stops reading, so a peer cannot make us buffer without limit.
    * ``on_chunk``, when set, sees each chunk that arrives while the reader waits with
      nothing buffered; returning True, it has taken the chunk (the connection answered
      it then and there), and the reader is not woken.
    * ``write_now`` hands a frame to the transport unless the transport's buffer is over
      its high-water mark (``pause_writing``) or older frames are already waiting; then
      frames that must not be dropped queue in ``_pending`` and go out, oldest first,
      when the peer catches up (``resume_writing``).
    """

    def __init__(self, loop: asyncio.AbstractEventLoop, max_buffered: int) -> None:
        self._loop = loop
        self.transport: asyncio.Transport | None = None
        self._chunks: list[bytes] = []
        self._buffered = 0
        self._max_buffered = max_buffered
        self._reading_paused = False
        self._reader: asyncio.Future[None] | None = None
        #: The peer closed its sending side (our answers may still go out).
        self.eof = False
        #: The socket is closed, by either side.
        self.lost = False
        #: Our writing side is shut down (``linger``): frames committed now are dropped, as
        #: for a closed socket (asyncio raises on a write after ``write_eof``).
        self.shut = False
        self._lost_waiters: list[asyncio.Future[None]] = []
        self._write_paused = False
        #: Frames committed in order but not yet handed to the transport.
        self._pending: deque[bytes] = deque()
        self._drained_waiters: list[asyncio.Future[None]] = []
        #: A frame waiting to share the next frame's write (``hold``).
        self._held: bytes | None = None
        self._stall_timer: asyncio.TimerHandle | None = None
        #: The transport's unsent bytes when the stall timer was armed.
        self._stall_mark = 0
        #: Seconds the peer may leave us unable to write before ``on_stall`` runs.
        self.stall_seconds = 30.0
        #: Called (once) when the peer has not taken a byte for ``stall_seconds``, after
        #: ``connection_write_timeout`` is logged with ``stall_fields`` (which connection).
        self.on_stall: Callable[[], None] | None = None
        self.stall_fields: dict[str, Any] = {}
        #: Offered each chunk that arrives while the reader waits and nothing is buffered;
        #: True means it took the chunk (``Connection._answer_at_once``).
        self.on_chunk: Callable[[bytes], bool] | None = None
        #: Lingering close: received bytes are counted and dropped, not buffered.
        self._discarding = False
        self.discarded = 0
        self._eof_waiters: list[asyncio.Future[None]] = []
        #: The Unix socket's send buffer in bytes once looked at; None until a large frame.
        self._socket_buffer: int | None = None
        self._read_into = _read_buffer()  # made on the loop's thread, as every read is

    # -- asyncio.BufferedProtocol --------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport

    def get_buffer(self, sizehint: int) -> memoryview:
        return self._read_into

    def buffer_updated(self, nbytes: int) -> None:
        self.data_received(bytes(self._read_into[:nbytes]))

    def data_received(self, data: bytes) -> None:
        if self._discarding:
            self.discarded += len(data)
            return
        on_chunk = self.on_chunk
        if (
            on_chunk is not None
            and self._reader is not None
            and not self._chunks
            and on_chunk(data)
        ):
            return
        self._chunks.append(data)
        self._buffered += len(data)
        if self._buffered > self._max_buffered and not self._reading_paused:
            self._reading_paused = True
            assert self.transport is not None
            self.transport.pause_reading()
        self.wake_reader()

    def eof_received(self) -> bool:
        self.eof = True
        self.wake_reader()
        self._wake_eof()
        return True  # keep our side open: the answers to what was sent still go out

    def _wake_eof(self) -> None:
        for waiter in self._eof_waiters:
            if not waiter.done():
                waiter.set_result(None)
        self._eof_waiters.clear()

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = self.eof = True
        self._disarm_stall()
        self._pending.clear()
        self._held = None
        self.wake_reader()
        for waiter in (*self._drained_waiters, *self._lost_waiters):
            if not waiter.done():
                waiter.set_result(None)
        self._drained_waiters.clear()
        self._wake_eof()

    def pause_writing(self) -> None:
        self._write_paused = True
        self._arm_stall()

    def resume_writing(self) -> None:
        self._write_paused = False
        pending = self._pending
        transport = self.transport
        assert transport is not None
        while pending and not self._write_paused:
            self._write(transport, pending.popleft())
        if self.backlogged:
            self._disarm_stall()  # the peer is reading: its clock starts again
            self._arm_stall()
        else:
            self._disarm_stall()
            for waiter in self._drained_waiters:
                if not waiter.done():
                    waiter.set_result(None)
            self._drained_waiters.clear()

    def _arm_stall(self) -> None:
        if self._stall_timer is None and not self.lost:
            self._stall_mark = self._unsent()
            self._stall_timer = self._loop.call_later(self.stall_seconds, self._stalled)

    def _unsent(self) -> int:
        """Bytes the peer has not taken: the transport's buffer and the socket's queue.

        The kernel's part counts because a socket only reports itself writable once most
        of its queue is read (a quarter, for a Unix socket): with a send buffer raised for
        a large frame, a slow reader takes a megabyte before the transport's count moves.
        """
        transport = self.transport
        if transport is None:
            return 0
        unsent = transport.get_write_buffer_size()
        sock = transport.get_extra_info("socket")
        if sock is not None:
            try:  # SIOCOUTQ (the same number as TIOCOUTQ on Linux)
                queued = fcntl.ioctl(sock.fileno(), termios.TIOCOUTQ, b"\0\0\0\0")
                unsent += struct.unpack("i", queued)[0]
            except OSError:
                pass  # closed meanwhile
        return unsent

    def _disarm_stall(self) -> None:
        if self._stall_timer is not None:
            self._stall_timer.cancel()
            self._stall_timer = None

    def _stalled(self) -> None:
        self._stall_timer = None
        if not self.backlogged or self.on_stall is None:
            return
        taken = self._stall_mark - self._unsent()
        if taken > 0 and taken >= self._reading_min():
            # The peer took bytes since the timer was armed: it reads slowly (a big frame
            # to a slow host), it has not stopped. Its clock starts again. A trickle (its
            # kernel's, not its reader's: 37 KB of 4 MB in 30 s) does not count.
            self._arm_stall()
            return
        # The daemon's decision, said the same on every face that rides a wire.
        log.warning("connection_write_timeout", seconds=self.stall_seconds, **self.stall_fields)
        self.on_stall()

    def _reading_min(self) -> int:
        """What the peer must have taken in a stall period to count as reading.

        Over TCP, ``_READING_MIN`` (or half of what waited, if less): its kernel takes a
        trickle its application never reads, counted to the byte. A Unix socket's peer
        takes nothing it does not read, and what it took is counted per buffer it emptied
        (37,120 bytes each on Linux, 36 KiB of data): any byte is reading. Held to 64 KiB,
        a peer reading 96 KiB a period was cut off when a period emptied one buffer.
        """
        transport = self.transport
        sock = transport.get_extra_info("socket") if transport is not None else None
        if sock is not None and sock.family == socket.AF_UNIX:
            return 1
        return min(_READING_MIN, self._stall_mark // 2)

    # -- the connection's side -----------------------------------------------------------

    @property
    def has_data(self) -> bool:
        """Whether received bytes wait to be taken."""
        return bool(self._chunks)

    def take(self) -> bytes:
        """Every received byte not taken yet (``b""`` when none)."""
        chunks = self._chunks
        if not chunks:
            return b""
        data = chunks[0] if len(chunks) == 1 else b"".join(chunks)
        chunks.clear()
        self._buffered = 0
        if self._reading_paused and not self.lost:
            self._reading_paused = False
            assert self.transport is not None
            self.transport.resume_reading()
        return data

    async def wait_readable(self) -> None:
        """Wait until bytes arrive, the peer sends EOF, or ``wake_reader`` is called."""
        waiter = self._reader = self._loop.create_future()
        try:
            await waiter
        finally:
            self._reader = None

    def wake_reader(self) -> None:
        """End a pending ``wait_readable``."""
        waiter = self._reader
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    @property
    def backlogged(self) -> bool:
        """Whether frames wait for the peer to read (the reader takes no input meanwhile)."""
        return not self.lost and (self._write_paused or bool(self._pending))

    def write_now(self, frame: bytes) -> bool:
        """Hand a frame to the transport if it may go now; False if it would have to wait.

        Frames for a closed socket, or one whose writing side is shut down, are discarded
        (True: there is nothing to wait for). A held frame goes first.
        """
        if self._held is not None:
            self.release()
        if self.lost or self.shut:
            return True
        if self._write_paused or self._pending:
            return False
        assert self.transport is not None
        self._write(self.transport, frame)
        return True

    def _write(self, transport: asyncio.Transport, frame: bytes) -> None:
        if len(frame) >= _LARGE_FRAME:
            self._fit(transport, len(frame))
        transport.write(frame)

    def _fit(self, transport: asyncio.Transport, size: int) -> None:
        """Let a Unix socket's send buffer take a large frame in one ``send``.

        With the default buffer (208 KiB on Linux), an 850 KB ``list`` answer goes out in
        five sends, each waiting for the peer to read and for the loop to see the socket
        writable again; the transport meanwhile copies what is left into its own buffer.
        With room for the frame the kernel takes it at once: 7.6 ms against 5.6 ms a
        ``list`` of 1,000 tools, paired, client decode included. Only connections that get
        such frames grow, up to ``_SOCKET_BUFFER_MAX``; TCP keeps its own autotuning (a
        set ``SO_SNDBUF`` would switch it off).

        What ``SO_SNDBUF`` reports is what one ``send`` may queue (a little more, in fact:
        212,992 reported, 219,264 taken). The kernel doubles what is asked for, so the
        daemon asks for half. ``net.core.wmem_max`` caps the request: at Linux's default
        (212,992) a buffer reaches 416 KiB, and the frame goes in fewer sends, not one.
        """
        known = self._socket_buffer
        if known is not None and (size <= known or known >= _SOCKET_BUFFER_MAX):
            return
        sock = transport.get_extra_info("socket")
        if sock is None or sock.family != socket.AF_UNIX:
            self._socket_buffer = _SOCKET_BUFFER_MAX  # never look again
            return
        want = min(size, _SOCKET_BUFFER_MAX)
        try:
            if known is None:
                known = sock.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF)
                if size <= known:
                    self._socket_buffer = known
                    return
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, (want + 1) // 2)
            got = sock.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF)
        except OSError:
            got = _SOCKET_BUFFER_MAX  # cannot grow: stop trying
        # Capped below what was asked (wmem_max): do not ask again for every frame.
        self._socket_buffer = got if got >= want else _SOCKET_BUFFER_MAX

    def enqueue(self, frame: bytes) -> None:
        """Commit a frame to go out after every frame committed before it; never waits.

        What bounds the queue is the reader: it takes no input while ``backlogged``, so
        only the answers and events of calls already in flight can join it.
        """
        held = self._held
        if held is not None:
            self._held = None
            frame = held + frame
        if not self.write_now(frame):
            self._pending.append(frame)
            self._arm_stall()

    def hold(self, frame: bytes) -> None:
        """Commit ``frame`` to go out with the next frame committed in this loop step.

        The two share one ``transport.write``: one ``send``, one wake-up of the peer.
        Nothing is held past the current step of the event loop: with no frame after it,
        the held frame goes out alone at the start of the next one. Order is kept: a
        frame committed later, by any path, goes after it.
        """
        if self.lost or self.shut:
            return
        if self._held is None:
            self._held = frame
            self._loop.call_soon(self.release)
        else:
            self._held += frame

    def release(self) -> None:
        """Commit the held frame now (``enqueue``), if there is one."""
        frame, self._held = self._held, None
        if frame is not None:
            self.enqueue(frame)

    async def wait_drained(self) -> None:
        """Wait until every committed frame is with the transport (or the socket is gone)."""
        self.release()
        if not self.backlogged:
            return
        waiter = self._loop.create_future()
        self._drained_waiters.append(waiter)
        await waiter

    async def linger(self, seconds: float) -> None:
        """Close as HTTP servers do their lingering close: nothing sent is lost to a reset.

        Closing a socket whose receive buffer holds unread bytes makes the kernel send a
        reset, and a peer that gets it may never read the answer waiting for it (an
        asyncio client usually sees only ``ConnectionResetError``). So: shut down our
        writing side once what is buffered has gone out (``write_eof``), then read and
        drop whatever the peer still sends until it closes its side or ``seconds`` pass,
        then close.

        Args:
            seconds: The longest wait for the peer's end of file.
        """
        self.release()  # (already empty after wait_drained; nothing may follow write_eof)
        transport = self.transport
        if transport is None or self.lost:
            return
        self._discarding = True
        self._chunks.clear()
        self._buffered = 0
        if self._reading_paused:
            self._reading_paused = False
            transport.resume_reading()
        if not self.eof:
            if transport.can_write_eof():
                # A frame committed from now on (a catalogChanged, the notice of an
                # eviction to make room) is dropped: the peer is told nothing more.
                self.shut = True
                transport.write_eof()
            waiter = self._loop.create_future()
            self._eof_waiters.append(waiter)
            timer = self._loop.call_later(seconds, self._wake_eof)
            try:
                await waiter
            finally:
                timer.cancel()
        transport.close()

    async def wait_closed(self) -> None:
        """Wait until the socket is closed (after ``close`` it has flushed first)."""
        if self.lost:
            return
        waiter = self._loop.create_future()
        self._lost_waiters.append(waiter)
        await waiter
