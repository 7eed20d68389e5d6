"""Table tests for toolsetd.protocol.codec: framing, bad lines, limits, poisoning."""

from __future__ import annotations

from typing import Any

import pytest
from toolsetd.protocol.codec import (
    CLOSED,
    DEFAULT_MAX_FRAME_SIZE,
    NEED_DATA,
    BadMessage,
    Codec,
    Event,
    LargeLine,
    Message,
    encode,
    parse_line,
)
from toolsetd.protocol.errors import FrameTooLarge, LocalProtocolError, RemoteProtocolError

NOT_JSON = BadMessage("Parse error: line is not valid JSON")
NOT_UTF8 = BadMessage("Parse error: line is not valid UTF-8")


def drain(codec: Codec) -> list[Event]:
    """Return every event up to and including the first NEED_DATA or CLOSED."""
    events: list[Event] = []
    while True:
        event = codec.next_event()
        events.append(event)
        if event is NEED_DATA or event is CLOSED:
            return events


def feed(data: bytes, *, eof: bool = True, max_frame_size: int = 1024) -> list[Event]:
    """Feed one chunk (then EOF when asked) and return the events."""
    codec = Codec(max_frame_size)
    codec.receive_data(data)
    if eof:
        codec.receive_data(b"")
    return drain(codec)


@pytest.mark.parametrize(
    ("data", "expected"),
    [
        (b"", [CLOSED]),
        (b'{"a":1}\n', [Message({"a": 1}), CLOSED]),
        (b'{"a":1}\r\n', [Message({"a": 1}), CLOSED]),
        (b'1\n"two"\n[3]\nnull\ntrue\n', [Message(1), Message("two"), Message([3]),
                                         Message(None), Message(True), CLOSED]),
        (b"\n\n  \t \n\r\n1\n\n", [Message(1), CLOSED]),
        (b'  {"a": [1, 2.5, "\xc3\xa9"]}  \n', [Message({"a": [1, 2.5, "\u00e9"]}), CLOSED]),
        (b'[{"jsonrpc":"2.0","method":"x"}]\n', [Message([{"jsonrpc": "2.0", "method": "x"}]),
                                                CLOSED]),
        (b"   ", [CLOSED]),
        (b"\r", [CLOSED]),
        (b'{"a":1}\r\r\n', [Message({"a": 1}), CLOSED]),
    ],
    ids=["empty", "object", "crlf", "scalars", "blank-lines", "spaces-utf8", "batch",
         "trailing-blank", "trailing-cr", "double-cr"],
)
def test_codec_valid_frames(data: bytes, expected: list[Event]) -> None:
    """Complete lines decode to messages in order; blank lines and a CR before LF are ignored."""
    assert feed(data) == expected


@pytest.mark.parametrize(
    ("line", "expected"),
    [
        (b"{", NOT_JSON),
        (b"garbage", NOT_JSON),
        (b'{"a":1} {"b":2}', NOT_JSON),
        (b"NaN", NOT_JSON),
        (b"\xef\xbb\xbf{}", NOT_JSON),
        (b'"\\ud800"', NOT_JSON),
        (b"\x00", NOT_JSON),
        (b"\xff\xfe", NOT_UTF8),
        (b'"\xed\xa0\x80"', NOT_UTF8),
        (b'{"k":"\xc3"}', NOT_UTF8),
    ],
    ids=["open-brace", "word", "two-values", "nan", "bom", "escaped-surrogate", "nul",
         "ff-fe", "utf8-surrogate", "truncated-utf8"],
)
def test_codec_bad_line_is_reported_and_stream_continues(line: bytes, expected: Event) -> None:
    """A bad line yields BadMessage(-32700), saying why, and the next line still decodes."""
    bad, *rest = feed(line + b"\n2\n")
    assert rest == [Message(2), CLOSED]
    assert isinstance(bad, BadMessage) and isinstance(expected, BadMessage)
    assert bad.code == -32700
    assert bad.message.startswith(expected.message)


def test_codec_bad_line_names_the_problem_and_position() -> None:
    """The parse error carries the parser's reason and position, such as an unpaired surrogate."""
    (bad, *_) = feed(b'{"path": "\\ud800"}\n')
    assert isinstance(bad, BadMessage)
    assert "surrogate" in bad.message
    assert "line 1 column" in bad.message


def test_codec_bad_message_never_echoes_input() -> None:
    """The BadMessage text is ours: no byte of the offending line appears in it."""
    (event, *_) = feed(b"sekrit-token-value\n")
    assert isinstance(event, BadMessage)
    assert event.code == -32700
    assert "sekrit" not in event.message


def test_codec_need_data_until_newline() -> None:
    """A partial line gives NEED_DATA until its newline arrives, then the message."""
    codec = Codec()
    codec.receive_data(b'{"a"')
    assert codec.next_event() is NEED_DATA
    codec.receive_data(b":1}")
    assert codec.next_event() is NEED_DATA
    codec.receive_data(b"\n{")
    assert drain(codec) == [Message({"a": 1}), NEED_DATA]
    codec.receive_data(b"}\n")
    assert drain(codec) == [Message({}), NEED_DATA]


def test_codec_cr_split_from_lf_is_tolerated() -> None:
    """A CR arriving in one chunk and its LF in the next still frames one message."""
    codec = Codec()
    codec.receive_data(b"[1]\r")
    assert codec.next_event() is NEED_DATA
    codec.receive_data(b"\n")
    assert codec.next_event() == Message([1])


@pytest.mark.parametrize("partial", [b"{", b'{"a":1}', b"  x", b"\xff"])
def test_codec_eof_mid_line_raises_and_poisons(partial: bytes) -> None:
    """EOF after a non-blank partial line raises RemoteProtocolError, and so does every later call."""
    codec = Codec()
    codec.receive_data(b"1\n" + partial)
    assert codec.next_event() == Message(1)
    codec.receive_data(b"")
    with pytest.raises(RemoteProtocolError, match="middle of a line"):
        codec.next_event()
    assert codec.poisoned
    with pytest.raises(RemoteProtocolError):
        codec.next_event()
    with pytest.raises(RemoteProtocolError):
        codec.receive_data(b"\n")


def test_codec_closed_is_sticky() -> None:
    """After CLOSED, next_event keeps returning CLOSED and a repeated EOF is accepted."""
    codec = Codec()
    codec.receive_data(b"")
    assert codec.next_event() is CLOSED
    codec.receive_data(b"")
    assert codec.next_event() is CLOSED


def test_codec_data_after_eof_is_a_local_error() -> None:
    """Feeding bytes after EOF is a caller bug and raises LocalProtocolError."""
    codec = Codec()
    codec.receive_data(b"")
    with pytest.raises(LocalProtocolError):
        codec.receive_data(b"1\n")


@pytest.mark.parametrize(
    ("data", "events_before"),
    [
        (b"x" * 11 + b"\n", []),
        (b"1\n" + b"x" * 11 + b"\n", [Message(1)]),
        (b"1\n" + b" " * 11 + b"\n", [Message(1)]),
        (b"x" * 11, []),
        (b"2\n" + b"x" * 11, [Message(2)]),
    ],
    ids=["complete", "after-message", "blank-oversize", "partial", "partial-after-message"],
)
def test_codec_oversize_line_raises_frame_too_large(data: bytes, events_before: list[Event]) -> None:
    """A line over the cap raises FrameTooLarge, with or without its newline, after earlier lines."""
    codec = Codec(max_frame_size=10)
    codec.receive_data(data)
    for expected in events_before:
        assert codec.next_event() == expected
    with pytest.raises(FrameTooLarge):
        codec.next_event()


@pytest.mark.parametrize("line", [b"1" * 10, b"1" * 9 + b"\r", b" " * 8 + b"[]"])
def test_codec_line_at_cap_is_accepted(line: bytes) -> None:
    """A line of exactly max_frame_size bytes (CR included) is accepted."""
    codec = Codec(max_frame_size=10)
    codec.receive_data(line + b"\n")
    assert isinstance(codec.next_event(), Message)


def test_codec_oversize_detected_before_newline_in_small_chunks() -> None:
    """A line growing past the cap in small chunks raises as soon as it is over, without a newline."""
    codec = Codec(max_frame_size=100)
    for _ in range(10):
        codec.receive_data(b"x" * 10)
        assert codec.next_event() is NEED_DATA
    codec.receive_data(b"x")
    with pytest.raises(FrameTooLarge):
        codec.next_event()


def test_codec_poisoned_after_frame_too_large() -> None:
    """After FrameTooLarge every call raises RemoteProtocolError and the buffer is released."""
    codec = Codec(max_frame_size=4)
    codec.receive_data(b"123456\n1\n")
    with pytest.raises(FrameTooLarge):
        codec.next_event()
    assert codec.poisoned
    for call in (codec.next_event, lambda: codec.receive_data(b"1\n"),
                 lambda: codec.receive_data(b"")):
        with pytest.raises(RemoteProtocolError):
            call()
    assert len(codec._buffer) == 0


def test_codec_buffer_holds_only_the_partial_line() -> None:
    """Returned lines are dropped from the buffer once a partial line is all that is left."""
    codec = Codec()
    codec.receive_data(b"1\n" * 1000 + b"[")
    assert drain(codec)[-1] is NEED_DATA
    assert bytes(codec._buffer) == b"["


def test_codec_default_cap_is_16_mib() -> None:
    """The default frame cap is the contract's 16 MiB."""
    assert DEFAULT_MAX_FRAME_SIZE == 16 * 1024 * 1024
    assert Codec().max_frame_size == DEFAULT_MAX_FRAME_SIZE


def test_codec_rejects_nonpositive_cap() -> None:
    """A cap below one byte is refused at construction."""
    with pytest.raises(ValueError, match="max_frame_size"):
        Codec(0)


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ({"jsonrpc": "2.0", "id": 1, "result": None},
         b'{"jsonrpc":"2.0","id":1,"result":null}\n'),
        ("\u00e9\n", b'"\xc3\xa9\\n"\n'),
        ([], b"[]\n"),
    ],
)
def test_codec_encode_is_compact_line(value: Any, expected: bytes) -> None:
    """encode gives compact UTF-8 JSON with one trailing newline, as a method and a function."""
    assert encode(value) == expected
    assert Codec.encode(value) == expected
    assert Codec().encode(value) == expected


@pytest.mark.parametrize("value", [object(), {1: "non-str key"}, {"k": {b"bytes-key": 1}}])
def test_codec_encode_unserialisable_raises_local_error(value: Any) -> None:
    """A value orjson cannot serialise raises LocalProtocolError."""
    with pytest.raises(LocalProtocolError):
        encode(value)


def test_codec_big_line_in_tiny_chunks_scans_linearly() -> None:
    """A 1 MiB line arriving in 4 KiB chunks is searched for a newline once, not re-scanned."""
    codec = Codec()
    payload = b'"' + b"a" * (1 << 20) + b'"'
    searched = 0
    original_find = bytearray.find

    class CountingBuffer(bytearray):
        def find(self, sub: Any, start: Any = 0, *args: Any) -> int:  # type: ignore[override]
            nonlocal searched
            searched += len(self) - start
            return original_find(self, sub, start, *args)

    codec._buffer = CountingBuffer()
    for offset in range(0, len(payload), 4096):
        codec.receive_data(payload[offset : offset + 4096])
        assert codec.next_event() is NEED_DATA
    codec.receive_data(b"\n")
    assert codec.next_event() == Message("a" * (1 << 20))
    assert searched <= 2 * len(payload)


def test_codec_leaves_a_large_line_for_parse_line() -> None:
    """With ``large_line``, a longer line comes back unparsed; ``parse_line`` then gives what
    ``next_event`` would have (a message, a parse error, or None for a blank line)."""
    codec = Codec(large_line=8)
    codec.receive_data(b'{"a":1}\n{"a": 1.50}\nnot json at all\n' + b" " * 20 + b"\n")
    assert codec.next_event() == Message({"a": 1})
    big = codec.next_event()
    assert big == LargeLine(b'{"a": 1.50}')
    parsed = parse_line(big.line)
    assert isinstance(parsed, Message) and str(parsed.value["a"]) == "1.50"
    bad = codec.next_event()
    assert isinstance(bad, LargeLine) and isinstance(parse_line(bad.line), BadMessage)
    blank = codec.next_event()
    assert isinstance(blank, LargeLine) and parse_line(blank.line) is None
    assert codec.next_event() is NEED_DATA
