"""The text a call's output becomes (``streams.decode``), and reading a pipe at once."""

from __future__ import annotations

import codecs
import fcntl
import os
import random
from pathlib import Path

import pytest
from toolsetd.daemon.spill import Spill
from toolsetd.daemon.streams import _PIPE_SIZE, Capture, decode, output_pipe, read_now

_BOM = codecs.BOM_UTF8
_SAMPLES = [
    b"",
    b"plain text\n",
    _BOM,
    _BOM + b"after a byte order mark",
    b"a byte order mark later " + _BOM + b"is text",
    _BOM + _BOM + b"two",
    b"invalid \xff\xfe bytes",
    b"\xc3",  # a two-byte character cut after its first byte
    b"cut in a character: \xe2\x9c",
    b"a whole one: \xe2\x9c\x93",
    _BOM[:1],  # the start of a byte order mark, and nothing else
    _BOM[:2],
    "é ✓ 𝄞".encode(),
]


def _incremental(data: bytes, complete: bool, limit: int) -> str:
    """What ``decode`` returned before it had a path of its own for a complete stream."""
    decoder = codecs.getincrementaldecoder("utf-8-sig")("replace")
    return decoder.decode(data, final=complete)[: limit + 1]


@pytest.mark.parametrize("complete", [True, False], ids=["ended", "cut"])
@pytest.mark.parametrize("data", _SAMPLES)
@pytest.mark.parametrize("limit", [0, 3, 1000])
def test_decode_is_the_incremental_utf8_sig_decoder(data: bytes, complete: bool, limit: int) -> None:
    """A byte order mark at the start is dropped, invalid bytes become U+FFFD, and a
    character split at the end is replaced when the stream ended, left out when it was cut
    at the prefix; from bytes or from the capture's bytearray alike."""
    expected = _incremental(data, complete, limit)
    if complete and data and len(data) < len(_BOM) and _BOM.startswith(data):
        # The incremental decoder's final call drops the start of a byte order mark that
        # the output ends in (a CPython quirk): the bytes were output, so they show.
        expected = "\ufffd"[: limit + 1]
    assert decode(data, complete, limit) == expected
    assert decode(bytearray(data), complete, limit) == expected


def test_decode_examples() -> None:
    """The cases above, spelled out."""
    assert decode(_BOM + b"out", True, 100) == "out"
    assert decode(b"x" + _BOM, True, 100) == "x\ufeff"
    assert decode(b"a\xffb", True, 100) == "a\ufffdb"
    assert decode(b"ok \xe2\x9c", True, 100) == "ok \ufffd"
    assert decode(b"ok \xe2\x9c", False, 100) == "ok "
    assert decode(b"abcdef", True, 2) == "abc"
    assert decode(b"\xef\xbb", True, 100) == "\ufffd"  # the incremental decoder gave ""
    assert decode(b"\xef\xbb", False, 100) == ""  # cut: the rest may be the mark's


_PIECES = [b"a", b"plain ", _BOM, b"\xff", b"\xc3", b"\xc3\xa9", b"\xe2\x9c", b"\xe2\x9c\x93",
           "𝄞".encode(), "𝄞".encode()[:3], b"\x80", b"\n"]


def test_decode_of_a_long_prefix_is_the_whole_decode_cut() -> None:
    """A prefix longer than the limit is decoded only as far as the limit reaches, and the
    text is the same as decoding it whole and cutting it: for mixes of ASCII, byte order
    marks, invalid bytes and characters of two, three and four bytes (whole and split),
    up to four bytes a character, ended or cut (3,000 seeded cases)."""
    rng = random.Random(20261206)  # noqa: S311 - seeded cases, not a secret
    for _ in range(3000):
        data = b"".join(rng.choices(_PIECES, k=rng.randrange(1, 500)))
        limit = rng.randrange(0, max(1, len(data)))
        complete = rng.random() < 0.5
        expected = _incremental(data, complete, limit)
        if complete and data and len(data) < len(_BOM) and _BOM.startswith(data):
            expected = "\ufffd"[: limit + 1]
        assert decode(bytearray(data), complete, limit) == expected, (data, complete, limit)


class _Bounded(Capture):
    """A capture that stops a reader gone past ``most`` bytes (so a failing test ends)."""

    __slots__ = ("most",)

    def __init__(self, spill: Spill, most: int) -> None:
        super().__init__(0, 4 * 1024, spill)
        self.most = most

    def feed(self, data: bytes | memoryview) -> None:
        super().feed(data)
        if self.total > self.most:
            raise AssertionError(f"read_now went on reading: {self.total} bytes so far")


def test_read_now_takes_at_most_what_a_pipe_holds(tmp_path: Path) -> None:
    """``read_now`` reads on the event loop, after a leader exited within the first window.
    A pipe a grandchild refills as fast as it is read never runs dry: with three processes
    splicing into a tool's stdout, one ``read_now`` read 2.5 GB in a single pass, and the
    daemon served no client for the 243 ms it took (in principle, for ever). It now reads
    no more than the pipe can hold (all of it when its writers are gone) and leaves the
    rest to the drainer, which yields to the loop. A source that never runs dry stands in
    for the refilled pipe here."""
    spill = Spill(tmp_path, tmp_path / "out", "c", 1 << 20, keep=1, max_age_seconds=60)
    capture = _Bounded(spill, 64 * _PIPE_SIZE)
    fd = os.open("/dev/zero", os.O_RDONLY | os.O_CLOEXEC)
    try:
        assert read_now(fd, capture) is False  # not at the end
    finally:
        os.close(fd)
        spill.discard()
    assert _PIPE_SIZE <= capture.total <= 2 * _PIPE_SIZE


def test_read_now_reads_a_full_pipe_to_its_end() -> None:
    """A pipe filled to its size by a writer that is gone is read whole, to its end."""
    r, w = output_pipe()
    try:
        size = fcntl.fcntl(w, fcntl.F_GETPIPE_SZ)
        assert os.write(w, b"x" * size) == size
        os.close(w)
        w = -1
        spill = Spill(Path("/nonexistent"), Path("/nonexistent/out"), "c", 0, keep=1,
                      max_age_seconds=60)
        capture = Capture(0, size + 1, spill)
        assert read_now(r, capture) is True
        assert capture.total == size
    finally:
        os.close(r)
        if w >= 0:
            os.close(w)
