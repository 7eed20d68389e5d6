"""The progress line of ``toolsetctl invoke`` fits one terminal row, whatever its characters."""

from __future__ import annotations

import io
import os

import pytest
from toolsetd.client import progress
from toolsetd.client.progress import Progress

from .cells import cells


class _Terminal(io.StringIO):
    def fileno(self) -> int:
        return 2


@pytest.mark.parametrize(
    "message",
    [
        "step " + "x" * 200,
        "第1步 " + "进度" * 60,  # two cells a character
        "build \U0001f680" * 40,  # an emoji: two cells
        "e\u0301" * 100,  # a combining accent takes no cell
    ],
)
def test_the_progress_line_never_wraps(monkeypatch: pytest.MonkeyPatch, message: str) -> None:
    """A line cut by characters, not cells, wrapped on the terminal: each redraw's ``\\r``
    and erase-line cleared only the row the cursor was on, and every update of a message in
    CJK (or with emoji) left a stale copy of the line on the screen above the output."""
    monkeypatch.setattr(progress.os, "get_terminal_size", lambda fd: os.terminal_size((40, 24)))
    stream = _Terminal()
    line = Progress("tool", stream)
    line.event("progress", {"elapsedMs": 5, "message": message, "fraction": 0.5})
    drawn = stream.getvalue().split("\r\x1b[2K")[-1]
    assert 30 <= cells(drawn) <= 39, drawn
    assert message[:4] in drawn


def test_a_terminal_of_unknown_width_gets_a_whole_line(monkeypatch: pytest.MonkeyPatch) -> None:
    """A pty that reports 0 columns (``script -qc`` in a CI job, ``docker exec -t`` before
    its size is set) has an unknown width, not a width of 0: the line was cut to 10 cells,
    the tool's name alone, so the elapsed time, bytes and message never showed. As for the
    tables (no limit there) and Python's ``shutil.get_terminal_size``, 80 columns are assumed."""
    monkeypatch.setattr(progress.os, "get_terminal_size", lambda fd: os.terminal_size((0, 0)))
    stream = _Terminal()
    line = Progress("tool", stream)
    line.event("progress", {"elapsedMs": 5, "message": "compiling", "fraction": 0.5})
    drawn = stream.getvalue().split("\r\x1b[2K")[-1]
    assert "compiling" in drawn
    assert cells(drawn) <= 79
