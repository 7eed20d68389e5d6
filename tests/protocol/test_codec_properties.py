"""Hypothesis properties of the codec: round trip, chunking invariance, fuzzing."""

from __future__ import annotations

import itertools
from typing import Any

import orjson
from hypothesis import given
from hypothesis import strategies as st
from toolsetd.protocol.codec import CLOSED, NEED_DATA, BadMessage, Codec, Event, Message, encode
from toolsetd.protocol.errors import RemoteProtocolError

# JSON values orjson round-trips exactly: 64-bit integers, finite floats, any text.
json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**63), max_value=2**64 - 1)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(),
    lambda children: st.lists(children, max_size=5)
    | st.dictionaries(st.text(max_size=10), children, max_size=5),
    max_leaves=25,
)

# Streams mixing valid lines, blank lines, CRLF endings and bad lines.
lines = st.one_of(
    json_values.map(encode),
    json_values.map(lambda v: orjson.dumps(v) + b"\r\n"),
    st.sampled_from([b"\n", b"  \n", b"\r\n", b"{\n", b"\xff\n", b"nope\n", b'"\xc3"\n']),
)
streams = st.lists(lines, max_size=12).map(b"".join)


def decode_all(chunks: list[bytes], max_frame_size: int = 1 << 20) -> list[Event]:
    """Feed chunks then EOF and collect every Message/BadMessage until CLOSED."""
    codec = Codec(max_frame_size)
    events: list[Event] = []
    for chunk in [*chunks, b""]:
        codec.receive_data(chunk)
        while (event := codec.next_event()) is not NEED_DATA:
            if event is CLOSED:
                return events
            events.append(event)
    raise AssertionError("no CLOSED after EOF")


def split(data: bytes, cuts: list[int]) -> list[bytes]:
    """Split data at the given (sorted, deduplicated) offsets."""
    points = sorted({c % (len(data) + 1) for c in cuts})
    bounds = [0, *points, len(data)]
    return [data[a:b] for a, b in itertools.pairwise(bounds) if b > a]


@given(json_values)
def test_codec_encode_then_decode_is_identity(value: Any) -> None:
    """Any JSON value encoded then decoded comes back equal."""
    assert decode_all([encode(value)]) == [Message(value)]


@given(st.lists(json_values, max_size=8))
def test_codec_many_values_round_trip_in_order(values: list[Any]) -> None:
    """A stream of encoded values decodes to the same values in the same order."""
    assert decode_all([b"".join(encode(v) for v in values)]) == [Message(v) for v in values]


@given(streams, st.lists(st.integers(min_value=0), max_size=20))
def test_codec_any_chunking_gives_same_events(data: bytes, cuts: list[int]) -> None:
    """Splitting a stream into arbitrary chunks yields the same events as one chunk."""
    assert decode_all(split(data, cuts)) == decode_all([data])


@given(streams)
def test_codec_one_byte_chunks_give_same_events(data: bytes) -> None:
    """Feeding a stream one byte at a time yields the same events as one chunk."""
    assert decode_all([data[i : i + 1] for i in range(len(data))]) == decode_all([data])


def outcome(chunks: list[bytes], cap: int) -> tuple[list[Event], type[Exception] | None]:
    """Collect events until CLOSED or the first RemoteProtocolError, and which error it was."""
    codec = Codec(cap)
    events: list[Event] = []
    try:
        for chunk in [*chunks, b""]:
            codec.receive_data(chunk)
            while (event := codec.next_event()) is not NEED_DATA:
                if event is CLOSED:
                    return events, None
                events.append(event)
    except RemoteProtocolError as exc:
        return events, type(exc)
    raise AssertionError("no CLOSED after EOF")


@given(st.binary(max_size=200), st.lists(st.integers(min_value=0), max_size=8),
       st.integers(min_value=1, max_value=64))
def test_codec_random_bytes_parse_or_raise_remote_error(
    data: bytes, cuts: list[int], cap: int
) -> None:
    """Random bytes in random chunks decode or raise only RemoteProtocolError, whatever the split."""
    events, error = outcome(split(data, cuts), cap)
    assert all(isinstance(e, Message | BadMessage) for e in events)
    assert (events, error) == outcome([data], cap)
