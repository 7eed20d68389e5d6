"""journald detection (JOURNAL_STREAM must name the very stream on file descriptor 2), and
the throttle of log lines a peer can cause at will."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import structlog

from toolsetd.daemon.logs import PRIORITIES, Throttle, configure_logging, stderr_is_journal


def _stream_of(path: Path) -> tuple[int, str]:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
    st = os.fstat(fd)
    return fd, f"{st.st_dev}:{st.st_ino}"


def test_logs_journal_stream_matches_only_its_own_file(tmp_path: Path) -> None:
    """The device:inode of the descriptor decides; another file, garbage or nothing do not."""
    fd, value = _stream_of(tmp_path / "journal")
    other, other_value = _stream_of(tmp_path / "other")
    try:
        assert stderr_is_journal({"JOURNAL_STREAM": value}, fd=fd)
        assert not stderr_is_journal({"JOURNAL_STREAM": other_value}, fd=fd)
        assert not stderr_is_journal({}, fd=fd)
        for bad in ("", "12", "a:b", "1:2:3", f"{value}x"):
            assert not stderr_is_journal({"JOURNAL_STREAM": bad}, fd=fd)
    finally:
        os.close(fd)
        os.close(other)
    assert not stderr_is_journal({"JOURNAL_STREAM": value}, fd=fd)  # closed: no match


@pytest.mark.parametrize(
    ("level", "prefix"), [("debug", "<7>"), ("info", "<6>"), ("warning", "<4>"), ("error", "<3>")]
)
def test_logs_priority_prefix_per_level(
    level: str, prefix: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """With journal=True each rendered line starts with its level's sd-daemon priority."""
    configure_logging("json", "debug", journal=True)
    try:
        getattr(structlog.get_logger("t"), level)("something_happened", n=1)
        line = capsys.readouterr().err.strip()
        assert line.startswith(prefix + "{")
        assert PRIORITIES[level] == prefix
        assert '"event": "something_happened"' in line
    finally:
        structlog.reset_defaults()


def test_logs_throttle_says_each_key_once_per_interval_with_the_count() -> None:
    """The first event of a key is said, the rest of the interval counted, and the first
    after it said with that count; each key keeps its own interval."""
    now = [0.0]
    throttle = Throttle(60.0, clock=lambda: now[0])
    assert throttle.count(1) == 1
    assert [throttle.count(1) for _ in range(4)] == [None] * 4
    assert throttle.count(2) == 1
    now[0] = 59.9
    assert throttle.count(1) is None
    now[0] = 60.0
    assert throttle.count(1) == 6
    assert throttle.count(1) is None
