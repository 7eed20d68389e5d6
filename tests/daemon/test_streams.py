"""The text a call's output becomes (``streams.decode``)."""

from __future__ import annotations

import codecs

import pytest

from toolsetd.daemon.streams import decode

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
