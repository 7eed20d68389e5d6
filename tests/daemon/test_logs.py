"""journald detection (JOURNAL_STREAM must name the very stream on file descriptor 2), and
the throttle of log lines a peer can cause at will."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import structlog
from toolsetd.daemon.logs import (
    PRIORITIES,
    LineWriter,
    Throttle,
    configure_logging,
    stderr_is_journal,
)


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
        # str.isdigit() says yes to "²", which int() refuses: the start ended in a ValueError.
        for bad in ("", "12", "a:b", "1:2:3", f"{value}x", "²:5", f"{value}²"):
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


def _pipe(size: int = 4096) -> tuple[int, int]:
    """A real pipe whose write end does not block, shrunk to ``size`` bytes."""
    import fcntl

    read_fd, write_fd = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
    fcntl.fcntl(write_fd, fcntl.F_SETPIPE_SZ, size)
    return read_fd, write_fd


def _read_all(fd: int) -> bytes:
    out = b""
    while True:
        try:
            chunk = os.read(fd, 65536)
        except BlockingIOError:
            return out
        if not chunk:
            return out
        out += chunk


def test_logs_line_writer_holds_then_drops_whole_lines_and_says_how_many() -> None:
    """With the reader stalled, lines are held up to the limit, then dropped and counted;
    once it reads again, the held lines go out whole, then the count, then the new line."""
    read_fd, write_fd = _pipe()
    try:
        writer = LineWriter(
            lambda data: os.write(write_fd, data), lambda n: f"dropped {n}", limit=8192
        )

        def line(i: int) -> None:
            writer.line(f"line {i:04d} " + "x" * 90)

        for i in range(200):  # 20 KB: 4 KB in the pipe, 8 KB held, the rest dropped
            line(i)
        assert writer.dropped > 0
        dropped = writer.dropped
        first = _read_all(read_fd)  # the reader wakes up
        rest = b""
        for i in range(200, 210):  # each line written lets out up to a pipe's worth held
            line(i)
            rest += _read_all(read_fd)
        text = (first + rest).decode()
        lines = text.splitlines()
        assert text.endswith("\n")
        assert f"dropped {dropped}" in lines
        got = [int(s.split()[1]) for s in lines if s.startswith("line ")]
        # Whole lines only, in order, none twice; the dropped ones are a gap before 200.
        assert all(len(s) == 100 for s in lines if s.startswith("line "))
        assert got == sorted(set(got))
        assert len([i for i in got if i < 200]) == 200 - dropped
        assert got[-10:] == list(range(200, 210))
        assert lines.index(f"dropped {dropped}") == got.index(200)
    finally:
        os.close(read_fd)
        os.close(write_fd)


def test_logs_line_writer_forgets_what_a_gone_reader_cannot_take() -> None:
    """A reader that closed its end is no reason to hold lines (or to raise)."""
    read_fd, write_fd = _pipe()
    os.close(read_fd)
    try:
        writer = LineWriter(lambda data: os.write(write_fd, data), lambda n: f"dropped {n}")
        for _ in range(3):
            writer.line("a line")
        assert writer.dropped == 0
    finally:
        os.close(write_fd)


def test_logs_line_writer_never_cuts_a_line_a_pipe_can_take_whole() -> None:
    """Held lines go out in whole-line writes of at most PIPE_BUF bytes: a full pipe takes
    such a write whole or not at all, so another writer of the pipe (sys.stderr, a process
    sharing it) never lands inside one of our lines."""
    read_fd, write_fd = _pipe()
    try:
        writer = LineWriter(lambda data: os.write(write_fd, data), lambda n: f"dropped {n}")
        for i in range(100):
            writer.line(f"line {i:04d} " + "x" * 90)
        taken = _read_all(read_fd)
        assert taken.endswith(b"\n")  # the pipe holds whole lines only
        writer.drain()  # what was held goes out when the reader reads, without a new line
        rest = _read_all(read_fd)
        assert rest.endswith(b"\n") and rest.startswith(b"line ")
    finally:
        os.close(read_fd)
        os.close(write_fd)


def test_logs_line_writer_finish_writes_what_is_held_for_a_slow_reader() -> None:
    """On the way out, the held lines (and a pending drop count) reach a reader that is
    slow but reading; a reader that never reads gets what fits, and finish says so."""
    import threading
    import time

    read_fd, write_fd = _pipe()
    try:
        writer = LineWriter(
            lambda data: os.write(write_fd, data), lambda n: f"dropped {n}", 8192, write_fd
        )
        for i in range(200):
            writer.line(f"line {i:04d} " + "x" * 90)
        got: list[bytes] = []

        def slow_reader() -> None:
            for _ in range(40):
                time.sleep(0.01)
                got.append(_read_all(read_fd))

        reader = threading.Thread(target=slow_reader)
        reader.start()
        assert writer.finish(timeout=30.0)
        reader.join()
        lines = b"".join(got).decode().splitlines()
        assert lines[-1].startswith("dropped ")
        assert all(s.startswith(("line ", "dropped ")) for s in lines)
        stalled = LineWriter(lambda data: os.write(write_fd, data), str, 8192, write_fd)
        for _ in range(100):
            stalled.line("y" * 99)
        assert not stalled.finish(timeout=0.2)
    finally:
        os.close(read_fd)
        os.close(write_fd)


def test_logs_line_writer_drain_says_the_drop_count_of_a_quiet_daemon() -> None:
    """Once the reader has taken what was held, ``drain`` (the daemon's quiet-time timer)
    also lets out the count of the lines dropped meanwhile: a daemon that logs nothing more
    does not leave the gap unexplained until its next line."""
    read_fd, write_fd = _pipe()
    try:
        writer = LineWriter(
            lambda data: os.write(write_fd, data), lambda n: f"dropped {n}", limit=8192
        )
        for i in range(200):  # past the pipe and the limit: some are dropped
            writer.line(f"line {i:04d} " + "x" * 90)
        dropped = writer.dropped
        assert dropped > 0
        text = b""
        for _ in range(10):  # the reader reads; the daemon logs nothing, its timer drains
            text += _read_all(read_fd)
            writer.drain()
        text += _read_all(read_fd)
        assert text.decode().splitlines()[-1] == f"dropped {dropped}"
        assert writer.dropped == 0
    finally:
        os.close(read_fd)
        os.close(write_fd)


def test_logs_the_standard_librarys_records_take_the_same_writer(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """asyncio's "Exception in callback" and other standard-library records go through the
    non-blocking writer as JSON lines: logging's last-resort handler would write them to
    stderr with a blocking write, and a stalled reader would hold the daemon there."""
    import logging
    import threading

    from toolsetd.daemon import logs

    read_fd, write_fd = _pipe(65536)
    stderr = os.fdopen(write_fd, "w", closefd=False)
    monkeypatch.setattr("sys.stderr", stderr)
    try:
        configure_logging("json", "info", journal=False)
        try:
            raise ValueError("boom")
        except ValueError:
            logging.getLogger("asyncio").error("Exception in callback", exc_info=True)  # noqa: G201 - asyncio's own call
        line = _read_all(read_fd).decode().splitlines()[-1]
        record = json.loads(line)
        assert (record["event"], record["logger"], record["level"]) == (
            "Exception in callback", "asyncio", "error")
        assert "ValueError: boom" in record["exception"]
        # The reader stalls: a flood of such records must not block the caller.
        flood = threading.Thread(
            target=lambda: [logging.getLogger("asyncio").error("x" * 500) for _ in range(2000)]
        )
        flood.start()
        flood.join(timeout=60)
        assert not flood.is_alive()
    finally:
        for handler in logging.root.handlers[:]:
            if type(handler).__name__ == "_StdlibLines":
                logging.root.removeHandler(handler)
        logs._WRITER = None  # back to no writer for the other tests
        structlog.reset_defaults()
        os.close(read_fd)
        os.close(write_fd)


@pytest.mark.parametrize("fmt", ["json", "console"])
def test_logs_the_standard_librarys_records_are_lines_on_a_file_too(
    fmt: str, tmp_path: Path
) -> None:
    """With stderr a file or a terminal (no non-blocking writer), a standard-library record
    (an OpenTelemetry exporter's "Failed to export spans", asyncio's "Exception in
    callback") went through logging's last-resort handler as bare text: a line that is no
    JSON object in a JSON log (``jq`` stops there), unescaped in the console one. It is
    rendered as the daemon's own lines are, on any stderr. (In a process of its own: pytest's
    handlers on the root logger would stand in for the last-resort one.)"""
    code = (
        "import logging\n"
        "from toolsetd.daemon.logs import configure_logging\n"
        f"configure_logging({fmt!r}, 'info', journal=False)\n"
        "logging.getLogger('opentelemetry.exporter').warning('Failed to export \\x1b[31m')\n"
    )
    path = tmp_path / "daemon.log"
    with open(path, "w") as stderr:
        subprocess.run([sys.executable, "-c", code], stderr=stderr, check=True, timeout=60)
    lines = path.read_text().splitlines()
    assert len(lines) == 1, lines
    if fmt == "json":
        record = json.loads(lines[0])
        assert (record["event"], record["logger"], record["level"]) == (
            "Failed to export \x1b[31m", "opentelemetry.exporter", "warning")
    else:
        assert "Failed to export \\x1b[31m" in lines[0] and "\x1b" not in lines[0]
        assert "opentelemetry.exporter" in lines[0]


def test_logs_the_standard_librarys_records_follow_the_log_level(tmp_path: Path) -> None:
    """``--log-level error`` left out the daemon's own warnings, but a standard-library
    warning (an OpenTelemetry exporter's, asyncio's) still came out: its handler took
    warning and up whatever the level said."""
    code = (
        "import logging\n"
        "from toolsetd.daemon.logs import configure_logging\n"
        "configure_logging('json', 'error', journal=False)\n"
        "logging.getLogger('opentelemetry.exporter').warning('left out')\n"
        "logging.getLogger('asyncio').error('kept')\n"
    )
    path = tmp_path / "daemon.log"
    with open(path, "w") as stderr:
        subprocess.run([sys.executable, "-c", code], stderr=stderr, check=True, timeout=60)
    assert [json.loads(line)["event"] for line in path.read_text().splitlines()] == ["kept"]


def test_logs_every_line_of_a_console_traceback_carries_its_priority(tmp_path: Path) -> None:
    """``--log-format console`` on the journal: an error's traceback (``request_failed``, a
    standard-library record with one) is several lines, and only the first carried ``<3>``;
    journald files each line as an entry of its own, so the rest were info, and
    ``journalctl -p err`` showed the event without its traceback. Every line carries it."""
    code = (
        "import logging, structlog\n"
        "from toolsetd.daemon.logs import configure_logging\n"
        "configure_logging('console', 'info', journal=True)\n"
        "try:\n"
        "    1 / 0\n"
        "except ZeroDivisionError:\n"
        "    structlog.get_logger('t').exception('request_failed', incident='i-1')\n"
        "    logging.getLogger('asyncio').error('Exception in callback', exc_info=True)\n"
    )
    path = tmp_path / "daemon.log"
    with open(path, "w") as stderr:
        subprocess.run([sys.executable, "-c", code], stderr=stderr, check=True, timeout=60)
    lines = path.read_text().splitlines()
    assert sum("ZeroDivisionError: division by zero" in line for line in lines) == 2
    assert [line for line in lines if not line.startswith("<3>")] == []


#: The start of a fresh interpreter whose own reports are log lines, on logger ``log``.
_REPORTS_LOGGED = (
    "import structlog\n"
    "from toolsetd.daemon.logs import configure_logging, log_interpreter_reports\n"
    "configure_logging('json', 'info', journal=False)\n"
    "log = structlog.get_logger('t')\n"
    "log_interpreter_reports(log)\n"
)


def _logged_run(code: str, tmp_path: Path, stderr: str = "file") -> tuple[str, list[Any]]:
    """Run ``code`` after ``_REPORTS_LOGGED``, stderr a ``file`` or a ``pipe``: its stdout,
    and its log lines (each a JSON object)."""
    path = tmp_path / "daemon.log"
    with open(path, "w") as log_file:
        done = subprocess.run(
            [sys.executable, "-c", _REPORTS_LOGGED + code],
            stderr=subprocess.PIPE if stderr == "pipe" else log_file,
            stdout=subprocess.PIPE, check=True, timeout=30,
        )
    text = done.stderr if stderr == "pipe" else path.read_bytes()
    return done.stdout.decode(), [json.loads(line) for line in text.decode().splitlines()]


def test_logs_a_report_made_while_one_is_logged_neither_loops_nor_ends_the_process(
    tmp_path: Path,
) -> None:
    """The interpreter's reports (``log_interpreter_reports``) never recurse: here the
    ``repr`` of a weak reference's callback, which the report of its exception quotes, lets
    another such callback raise, whose report would quote it again, until the stack ran
    out. One line is written, the failing ``repr`` said as such; a warning issued while a
    report is logged is dropped too; and the process goes on."""
    code = (
        "import warnings, weakref\n"
        "class Target:\n"
        "    pass\n"
        "def drop():\n"
        "    target = Target()\n"
        "    ref = weakref.ref(target, Loop())\n"
        "    del target\n"
        "class Loop:\n"
        "    def __call__(self, ref):\n"
        "        raise RuntimeError('from a weakref callback')\n"
        "    def __repr__(self):\n"
        "        drop()\n"
        "        warnings.warn('from a repr')\n"
        "        raise ValueError('no repr')\n"
        "drop()\n"
        "print('alive')\n"
    )
    out, lines = _logged_run(code, tmp_path)
    assert out == "alive\n"
    assert [(e["event"], e.get("object")) for e in lines] == [
        ("exception_ignored", "<Loop object: repr() failed>")
    ]
    assert "RuntimeError: from a weakref callback" in lines[0]["exception"]


@pytest.mark.parametrize("stderr", ["pipe", "file"])
def test_logs_a_line_logged_while_this_thread_writes_one_neither_waits_nor_is_lost(
    stderr: str, tmp_path: Path
) -> None:
    """A collection can run while a thread writes a line, the writer's lock held (a
    ``BlockingIOError`` of a stalled reader is an allocation), and a finalizer it runs may
    log: an "Exception ignored in" (``log_interpreter_reports``), asyncio's "Task was
    destroyed". That line waited for the lock its own thread held: the daemon hung for
    good at its next log line. Here a collection runs at the first ``os.write`` of a line
    (a profile hook), on a pipe (the non-blocking writer) and on a file; both lines are
    written, whole, and the process goes on."""
    code = (
        "import gc, os, sys\n"
        "class Cycle:\n"
        "    def __init__(self):\n"
        "        self.me = self  # only a collection frees it\n"
        "    def __del__(self):\n"
        "        raise RuntimeError('from a finalizer')\n"
        "fired = []\n"
        "def collect_there(frame, event, arg):\n"
        "    if event == 'c_call' and arg is os.write and not fired:\n"
        "        fired.append(True)\n"
        "        Cycle()\n"
        "        gc.collect()\n"
        "sys.setprofile(collect_there)\n"
        "log.info('first')\n"
        "sys.setprofile(None)\n"
        "log.info('second')\n"
        "print('alive', fired)\n"
    )
    out, lines = _logged_run(code, tmp_path, stderr)
    assert out == "alive [True]\n"
    assert sorted(e["event"] for e in lines) == ["exception_ignored", "first", "second"]
    assert lines[-1]["event"] == "second"
    ignored = next(e for e in lines if e["event"] == "exception_ignored")
    assert "RuntimeError: from a finalizer" in ignored["exception"]
