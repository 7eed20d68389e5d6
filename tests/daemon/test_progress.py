"""The progress fd reader: what a burst of lines is reported as, coalesced or line by line.

The reader looks at a coalesced burst from its last line back (one parse per read for a
flood of short lines); these tests hold it to the plain reading, every line parsed in
order: the same reports, cut at 16 KiB, across reads and at end of file.
"""

from __future__ import annotations

import json
import math
import os
import random
import tempfile
from collections.abc import Iterator
from typing import Any

import anyio
import pytest
from toolsetd.daemon import progress
from toolsetd.daemon.progress import parse_progress, read_progress

from tests.budget import examples

pytestmark = pytest.mark.anyio

_READ = 65536  # what the reader takes from its descriptor at once
_LINE_MAX = progress._PROGRESS_LINE_MAX
_PIECES = [
    b"x", b"", b"   ", b"{}", b'{"other": 1}', b'{"fraction": 0.25}', b"\r", b"{broken",
    b'{"message": "m"}', b'{"message": "n", "fraction": 2}', b"y" * 5000, b"w" * 20_000,
    b'{"fraction": 1e999}', b'{"fraction": -' + b"9" * 400 + b"}",
    b"z" * 70_000,
    b"\xff\xfe", b"caf\xc3\xa9",
]


class _Call:
    """The two things the reader needs of a ``CallState``."""

    def __init__(self, every_line: bool) -> None:
        self.every_progress_line = every_line
        self.reports: list[tuple[str | None, float | None]] = []

    async def progress(self, message: str | None = None, fraction: float | None = None) -> None:
        self.reports.append((message, fraction))


def _stream(seed: int) -> bytes:
    rng = random.Random(seed)  # noqa: S311 (reproducible streams, not secrets)
    lines = []
    for i in range(rng.randrange(1, 400)):
        piece = rng.choice(_PIECES)
        lines.append(piece + (b" %d" % i if piece in (b"x", b"y" * 5000) else b""))
    data = b"\n".join(lines)
    return data + b"\n" if rng.random() < 0.5 else data


def _lines(data: bytes) -> Iterator[tuple[int, Any]]:
    """(offset of the line's end, its report or None) for every line, the plain way."""
    start = 0
    while start < len(data):
        nl = data.find(b"\n", start)
        end = len(data) if nl < 0 else nl
        yield end, parse_progress(data[start : min(end, start + _LINE_MAX)])
        start = end + 1


async def _read(data: bytes, every_line: bool) -> list[tuple[str | None, float | None]]:
    call = _Call(every_line)
    with tempfile.TemporaryFile() as f:  # a file: the reads take exactly 64 KiB each
        f.write(data)
        f.flush()
        fd = os.open(f"/proc/self/fd/{f.fileno()}", os.O_RDONLY)
        try:
            await read_progress(fd, call, anyio.Event(), math.inf)  # type: ignore[arg-type]
        finally:
            os.close(fd)
    return call.reports


@pytest.mark.parametrize("seed", range(examples(60)))
async def test_a_coalesced_burst_reports_its_latest_line(seed: int) -> None:
    """With an endless gap: the first read that holds a report sends its latest one at once;
    the rest wait, and end of file sends the latest of all."""
    data = _stream(seed)
    # Each report with the read that ended its line (end of file for an unended last one).
    reports = [
        (end // _READ if end < len(data) else math.inf, r)
        for end, r in _lines(data)
        if r is not None
    ]
    expected = []
    if reports:
        first_read = reports[0][0]
        first = max(i for i, (read, _) in enumerate(reports) if read == first_read)
        expected.append(reports[first][1])
        if first != len(reports) - 1:
            expected.append(reports[-1][1])
    assert await _read(data, every_line=False) == expected


@pytest.mark.parametrize("seed", range(examples(30)))
async def test_every_line_is_reported_when_asked(seed: int) -> None:
    data = _stream(seed)
    expected = [r for _, r in _lines(data) if r is not None]
    assert await _read(data, every_line=True) == expected


async def test_a_flood_of_short_lines_costs_one_parse_per_read(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A million lines (12 MB): the reader parses the last line of each read, not every line
    (parsing each held the event loop, and so every client, for most of a flood)."""
    data = b"".join(b"step %d\n" % i for i in range(1_000_000))
    parsed: list[bytes] = []

    def counted(line: bytes) -> Any:
        parsed.append(line)
        return parse_progress(line)

    monkeypatch.setattr(progress, "parse_progress", counted)  # counts; the real parse runs
    reports = await _read(data, every_line=False)
    assert reports[-1] == ("step 999999", None)
    reads = -(-len(data) // _READ)
    assert len(parsed) <= reads + 1, (len(parsed), reads)


@pytest.mark.parametrize("every_line", [False, True])
@pytest.mark.parametrize("character", ["\u4f60", "\U0001f600"])
async def test_a_json_line_with_a_message_of_the_longest_kind_is_read_whole(
    every_line: bool, character: str
) -> None:
    """A JSON line whose message has the 1,000 characters a message may have, written as
    the docs show (``json.dumps``, which escapes every non-ASCII character: ``\\u4f60``,
    an emoji as a pair of escapes, 12 bytes), is read as JSON: its message and fraction.
    At 4 KiB such a line (6 or 12 KB) was cut, and its first 1,000 characters of raw JSON
    text reached the client as the message, the fraction lost."""
    message = character * 1000
    line = json.dumps({"message": message, "fraction": 0.5}).encode()
    assert len(line) > 4096
    reports = await _read(line + b"\n" + line, every_line)
    assert reports
    assert set(reports) == {(message, 0.5)}


@pytest.mark.parametrize(
    ("line", "report"),
    [
        (b'{"fraction": 2}', (None, 1.0)),
        (b'{"fraction": -1, "message": "m"}', ("m", 0.0)),
        (b'{"fraction": 0.25}', (None, 0.25)),
        (b'{"fraction": 1.50}', (None, 1.0)),
        # Past the double range: numbers all the same, clamped. 1e999 (infinity) was
        # dropped, a line of it alone was no report at all; a 400-digit integer raised
        # OverflowError in float(), and the call failed as the daemon's incident.
        (b'{"fraction": 1e999}', (None, 1.0)),
        (b'{"fraction": -1e999, "message": "m"}', ("m", 0.0)),
        (b'{"fraction": ' + b"9" * 400 + b"}", (None, 1.0)),
        (b'{"fraction": -' + b"9" * 400 + b', "message": "m"}', ("m", 0.0)),
        (b'{"fraction": true}', None),
        (b'{"fraction": "0.5"}', None),
    ],
)
def test_a_fraction_is_clamped_whatever_its_size(line: bytes, report: Any) -> None:
    """A fraction is any JSON number, clamped to 0..1, however far past the double range
    (compared before it is made a float); a boolean or a string is no fraction."""
    assert parse_progress(line) == report
