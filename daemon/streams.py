"""A call's pipes: draining stdout and stderr (read, readv, splice), and feeding stdin.

Theory of operation
-------------------
Output pipes are made with ``O_CLOEXEC`` (so concurrent spawns never inherit each other's
ends) and enlarged to 1 MiB with ``F_SETPIPE_SZ`` when the kernel allows it (silently not
otherwise).

stdout and stderr are drained by two sibling tasks reading non-blocking fds, waiting with
``anyio.wait_readable`` only when a pipe is empty. Each stream keeps a prefix of at most
``4 * (limit + 1)`` bytes (enough for ``limit + 1`` characters of any UTF-8), and counts
the rest. A stream that fills its prefix is streamed to the spill file (``spill.Spill``,
capped), so memory per call is bounded whatever the child writes. The prefixes are
decoded at the end (UTF-8, ``errors="replace"``, a leading byte order mark dropped, an
incomplete sequence at a cut not turned into U+FFFD) and cut to ``limit + 1`` characters
each. Reading goes in three steps,
so that the common small output costs nothing and a flood costs little: ``os.read`` of
64 KiB into fresh bytes (no buffer to zero or map) until a read fills 64 KiB or the prefix
is full; then ``os.readv`` into a 1 MiB buffer (kept by the ``Drainer`` for reuse, at most
four) until the prefix is full; past the prefix, ``os.splice`` moves the bytes from the
pipe into the spill file while it takes more, then into ``/dev/null``, so they are never
copied through the daemon (where ``splice`` fails, the readv path carries on).

stdin (when the set's ``stdin`` is true) is the compact JSON of the arguments (orjson: key
order kept, UTF-8, non-ASCII as is, every number as the caller wrote it), written at once
as far as the pipe takes it, the rest by a sibling task, then closed; otherwise stdin is
a pipe closed at once.
``BrokenPipeError`` on stdin is **not** an error: a child may exit (or close stdin) without
reading its input, and its exit code and output say what happened. Any other I/O error on
stdin or the output pipes ends the group and gives ``The external process stdin or output
failed: <message>``.
"""

from __future__ import annotations

import codecs
import errno
import fcntl
import os
from typing import Any

import anyio
import anyio.lowlevel
from toolsetd.protocol import jsontext

from .call import CallState
from .spill import Spill

__all__ = [
    "Capture",
    "Drainer",
    "Fds",
    "all_set_within",
    "decode",
    "encode_stdin",
    "output_pipe",
    "read_now",
    "read_once",
    "write_stdin",
    "write_stdin_now",
]

_READ_SIZE = 1 << 20  # a flood's read buffer: one full 1 MiB pipe per read
_FIRST_READ = 1 << 16  # reads before a stream proves to be a flood
_POOL_MAX = 4  # flood buffers a runner keeps for the next floods (4 MiB at most)
_PIPE_SIZE = 1 << 20
_HAVE_SPLICE = hasattr(os, "splice")


def encode_stdin(arguments: Any) -> bytes:
    # Numbers as the caller wrote them (JsonNumber text, integers of any width).
    return jsontext.dumps(arguments)


def output_pipe() -> tuple[int, int]:
    r, w = os.pipe2(os.O_CLOEXEC)
    try:
        fcntl.fcntl(w, fcntl.F_SETPIPE_SZ, _PIPE_SIZE)
    except OSError:  # EPERM beyond the per-user pipe budget: keep 64 KiB
        pass
    os.set_blocking(r, False)
    return r, w


def read_now(fd: int, capture: Capture) -> bool:
    """Feed what a pipe holds now; True at EOF (or a read error: the stream ends there).

    At most a pipe's size (and one read more, to see its end): past that, another process
    (a grandchild of an exited leader) is refilling the pipe as it is read, which can go on
    for ever, and this runs on the event loop. False then: the drainer reads the rest.
    """
    left = _PIPE_SIZE
    try:
        while data := os.read(fd, _FIRST_READ):
            capture.feed(data)
            left -= len(data)
            if left < 0:
                return False
    except BlockingIOError:
        return False
    except OSError:
        pass
    return True


def read_once(fd: int) -> bytes | None:
    """One non-blocking read: b"" at EOF, None when the pipe is empty but still open."""
    try:
        return os.read(fd, 65536)
    except BlockingIOError:
        return None
    except OSError:
        return b""


async def all_set_within(seconds: float, *events: anyio.Event) -> None:
    """Wait at most ``seconds`` for every event (no scope and no loop pass if all are set)."""
    if all(event.is_set() for event in events):
        return
    with anyio.move_on_after(seconds):
        for event in events:
            if not event.is_set():  # waiting on a set anyio Event still costs a loop pass
                await event.wait()


def decode(prefix: bytes | bytearray, complete: bool, limit: int) -> str:
    """A stream's kept prefix as text, at most ``limit + 1`` characters.

    utf-8-sig: a leading byte order mark is dropped, as the reference host's StreamReader
    (detectEncodingFromByteOrderMarks) drops it; one later in the stream is text. Invalid
    bytes become U+FFFD. A stream that ended is decoded in one call, which is what the
    incremental decoder's final call does, without building one (two of these per call,
    after the child exits: 2.7 µs each before, 0.1 for an empty stream). It differs in one
    case, for the better: output that is only the start of a byte order mark (``EF`` or
    ``EF BB``) is U+FFFD, which the incremental decoder's final call dropped. A stream cut
    at the prefix goes through the incremental decoder, which leaves out a character the
    cut split instead of replacing it.

    A prefix longer than ``limit + 1`` bytes is decoded only as far as the first
    ``limit + 1`` characters reach (``_decode_upto``): the prefix holds up to four bytes a
    character, and a flood of invalid bytes (one U+FFFD each) would otherwise be decoded
    four times over on the event loop, to be cut at once.
    """
    if not prefix:
        return ""
    size = len(prefix)
    if size > limit + 1 and size > _SHORTEST_CUT:
        return _decode_upto(prefix, complete, limit + 1)
    if complete:
        return prefix.decode("utf-8-sig", "replace")[: limit + 1]
    decoder = codecs.getincrementaldecoder("utf-8-sig")("replace")
    return decoder.decode(bytes(prefix), final=False)[: limit + 1]


#: Below this many bytes a prefix is decoded whole: it may be only the start of a byte order
#: mark, which the one-call decode shows as U+FFFD and the incremental decoder drops.
_SHORTEST_CUT = len(codecs.BOM_UTF8)


def _decode_upto(prefix: bytes | bytearray, complete: bool, want: int) -> str:
    """The first ``want`` characters of the prefix's text, decoding no more than it takes.

    Each step decodes as many bytes as the characters still wanted would take at the bytes
    per character seen so far (at least one a character), so ASCII or invalid bytes take
    one step and any UTF-8 a few. The incremental decoder gives the same text in pieces as
    in one call (a sequence split between two pieces is kept for the next), and its final
    call (the whole prefix of an ended stream taken) replaces an incomplete sequence at the
    end as the one-call decode does.
    """
    decoder = codecs.getincrementaldecoder("utf-8-sig")("replace")
    view = memoryview(prefix)
    parts: list[str] = []
    have = pos = 0
    end = len(prefix)
    while have < want and pos < end:
        per_char = pos / have if have else 1.0
        step = max(int((want - have) * per_char) + 4, 64)
        stop = min(end, pos + step)
        text = decoder.decode(view[pos:stop], final=complete and stop == end)
        parts.append(text)
        have += len(text)
        pos = stop
    return "".join(parts)[:want]


class Capture:
    """One output stream: a bounded prefix, a byte count, and the spill beyond the prefix."""

    __slots__ = ("keep", "prefix", "spill", "total", "which")

    def __init__(self, which: int, keep: int, spill: Spill) -> None:
        self.which = which
        self.keep = keep
        self.prefix = bytearray()
        self.total = 0
        self.spill = spill

    def feed(self, data: bytes | memoryview) -> None:
        total = self.total
        self.total = total + len(data)
        if total >= self.keep:
            self.spill.write(self.which, data)
            return
        room = self.keep - total
        self.prefix += data[:room]
        if len(data) >= room:
            # The prefix is full: from now on the stream lives on disk (the file starts
            # with the prefix, also when the prefix filled exactly and more comes later).
            self.spill.write(self.which, self.prefix)
            if len(data) > room:
                self.spill.write(self.which, data[room:])

    @property
    def complete(self) -> bool:
        return self.total <= self.keep


class Fds:
    """The daemon's ends of a call's pipes; each closed exactly once."""

    def __init__(self) -> None:
        self._open: set[int] = set()

    def __contains__(self, fd: int) -> bool:
        return fd in self._open

    def add(self, *fds: int) -> None:
        self._open.update(fds)

    def close(self, fd: int) -> None:
        if fd in self._open:
            self._open.discard(fd)
            try:  # (not contextlib.suppress: eight of these per call, on the hot path)
                os.close(fd)
            except OSError:
                pass

    def close_all(self) -> None:
        for fd in list(self._open):
            self.close(fd)


class Drainer:
    """Drains output pipes into captures, keeping up to four 1 MiB flood buffers for reuse."""

    def __init__(self) -> None:
        self._buffers: list[bytearray] = []  # flood read buffers, reused (no zeroing per call)

    async def drain(self, fd: int, capture: Capture, done: anyio.Event, call: CallState) -> None:
        read = os.read
        feed = capture.feed
        keep = capture.keep
        reads = 0
        buf: bytearray | None = None
        try:
            # Most tools write little: read into fresh small bytes (nothing to zero or map)
            # until the prefix is full or one read fills _FIRST_READ (the pipe holds a flood).
            while True:
                try:
                    data = read(fd, _FIRST_READ)
                except BlockingIOError:
                    await anyio.wait_readable(fd)
                    continue
                if not data:
                    return
                feed(data)
                if capture.total >= keep or len(data) == _FIRST_READ:
                    break
                reads += 1
                if not reads & 3:  # a child keeping the pipe non-empty must not starve the loop
                    await anyio.lowlevel.checkpoint()
            splicing = _HAVE_SPLICE
            while True:
                if splicing and capture.total >= keep:
                    if await self._splice(fd, capture):
                        return
                    splicing = False  # splice refused: read and write the bytes instead
                if buf is None:
                    buf = self._buffers.pop() if self._buffers else bytearray(_READ_SIZE)
                    view = memoryview(buf)
                try:
                    n = os.readv(fd, (buf,))
                except BlockingIOError:
                    await anyio.wait_readable(fd)
                    continue
                if not n:
                    return
                feed(view[:n])
                reads += 1
                if not reads & 3:  # a flooding child never blocks us: stay fair to the loop
                    await anyio.lowlevel.checkpoint()
        except OSError as exc:
            call.stop("io", exc.strerror or str(exc))
        finally:
            if buf is not None and len(self._buffers) < _POOL_MAX:
                self._buffers.append(buf)
            done.set()

    @staticmethod
    async def _splice(fd: int, capture: Capture) -> bool:
        """Drain past the prefix without copying through the daemon; True at EOF.

        The bytes go to the spill file while it takes more, then to ``/dev/null``, both
        with ``splice`` (a pipe's pages dropped into ``/dev/null`` are never copied).
        False when ``splice`` fails: nothing was lost, the caller reads the rest.
        """
        spill, which = capture.spill, capture.which
        null = -1
        moves = 0
        try:
            while True:
                try:
                    n = spill.splice(which, fd, _READ_SIZE)
                    if n is None:
                        if null < 0:
                            null = os.open(os.devnull, os.O_WRONLY | os.O_CLOEXEC)
                        n = os.splice(fd, null, _READ_SIZE, flags=os.SPLICE_F_NONBLOCK)
                except BlockingIOError:
                    await anyio.wait_readable(fd)
                    continue
                except OSError:
                    return False
                if not n:
                    return True
                capture.total += n
                moves += 1
                if not moves & 3:  # a flooding child never blocks us: stay fair to the loop
                    await anyio.lowlevel.checkpoint()
        finally:
            if null >= 0:
                os.close(null)


def write_stdin_now(fd: int, data: bytes, fds: Fds, call: CallState) -> memoryview | None:
    """Write what the pipe takes now (usually all); returns the rest, None when done."""
    view = memoryview(data)
    try:
        while view:
            view = view[os.write(fd, view) :]
    except BlockingIOError:
        return view
    except OSError as exc:  # see write_stdin
        if exc.errno != errno.EPIPE:
            call.stop("io", exc.strerror or str(exc))
    view.release()
    fds.close(fd)
    return None


async def write_stdin(fd: int, data: bytes | memoryview, fds: Fds, call: CallState) -> None:
    view = memoryview(data)
    try:
        while view:
            try:
                n = os.write(fd, view)
            except BlockingIOError:
                await anyio.wait_writable(fd)
                continue
            view = view[n:]
    except BrokenPipeError:
        pass  # the child closed stdin without reading it all: its exit code tells the story
    except OSError as exc:
        if exc.errno != errno.EPIPE:
            call.stop("io", exc.strerror or str(exc))
    finally:
        view.release()
        fds.close(fd)
