"""toolsetctl against a daemon that misbehaves: a fake server on a Unix socket.

Whatever the peer at the socket sends (lines nested past the decoder's recursion limit,
answers to ids never asked, silence, results of the wrong shape, events with members of the
wrong type, escape sequences), toolsetctl ends with one of its documented exit codes and
a message, bounded in memory and time, and prints nothing a terminal would act on.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from toolsetd.client import blocking, context
from toolsetd.client.blocking import BlockingClient
from toolsetd.client.cli import run

Reply = Callable[[socket.socket, dict[str, object]], None]


def _send(conn: socket.socket, value: object) -> None:
    conn.sendall(json.dumps(value).encode() + b"\n")


class FakeDaemon:
    """Accepts connections; answers each first request with ``reply``; records requests."""

    def __init__(self, path: Path, reply: Reply) -> None:
        self.path = path
        self.reply = reply
        self.requests: list[dict[str, object]] = []
        self._server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._server.bind(str(path))
        self._server.listen(8)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._server.accept()
            except OSError:
                return
            threading.Thread(target=self._handle, args=(conn,), daemon=True).start()

    def _handle(self, conn: socket.socket) -> None:
        with conn, conn.makefile("rb") as reader:
            try:
                line = reader.readline()
                if not line:
                    return
                request = json.loads(line)
                self.requests.append(request)
                self.reply(conn, request)
                self._stop.wait(5)  # hold the connection open for the client to read
            except OSError:
                pass

    def close(self) -> None:
        self._stop.set()
        self._server.close()


@pytest.fixture
def sockdir() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix="tshd-") as name:  # short: AF_UNIX path limit
        yield Path(name)


@pytest.fixture
def fake(sockdir: Path) -> Iterator[Callable[[Reply], FakeDaemon]]:
    made: list[FakeDaemon] = []

    def start(reply: Reply) -> FakeDaemon:
        daemon = FakeDaemon(sockdir / f"f{len(made)}.sock", reply)
        made.append(daemon)
        return daemon

    yield start
    for daemon in made:
        daemon.close()


def ctl(daemon: FakeDaemon, *args: str, fmt: str = "table") -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    code = run(["--socket", str(daemon.path), "--format", fmt, *args], stdout=out, stderr=err)
    return code, out.getvalue(), err.getvalue()


def _answer(result: object) -> Reply:
    def reply(conn: socket.socket, request: dict[str, object]) -> None:
        _send(conn, {"jsonrpc": "2.0", "id": request["id"], "result": result})

    return reply


ESCAPES = "\x1b]52;c;cHduZWQ=\x07\x1b]0;title\x07\x1b[2J\r\x9b31m\u202e\x7f"


def _no_controls(text: str) -> None:
    for char in "\x1b\x07\r\x9b\u202e\x7f":
        assert char not in text, repr(text)


def test_status_and_error_messages_from_the_daemon_are_shown_not_obeyed(
    fake: Callable[[Reply], FakeDaemon],
) -> None:
    daemon = fake(_answer({"version": ESCAPES, "socket": ESCAPES, "workspaces": [ESCAPES]}))
    code, out, _ = ctl(daemon, "status")
    assert code == 0
    _no_controls(out)
    assert "\\x1b]52;c;cHduZWQ=\\x07" in out

    def error(conn: socket.socket, request: dict[str, object]) -> None:
        _send(conn, {"jsonrpc": "2.0", "id": request["id"],
                     "error": {"code": -32001, "message": f"Unknown tool {ESCAPES}"}})

    daemon = fake(error)
    code, out, err = ctl(daemon, "invoke", "t")
    assert code == 2
    _no_controls(err)
    assert "\\u202e" in err


def test_json_output_escapes_what_a_terminal_acts_on_and_keeps_the_values(
    fake: Callable[[Reply], FakeDaemon],
) -> None:
    status = {"version": ESCAPES + "é😀\u200d"}
    daemon = fake(_answer(status))
    for fmt in ("json", "jsonl"):
        code, out, _ = ctl(daemon, "status", fmt=fmt)
        assert code == 0
        _no_controls(out)
        assert "é😀\u200d" in out  # ordinary text (a ZWJ emoji sequence too) stays as it is
        value = json.loads(out)
        assert (value["result"] if fmt == "jsonl" else value) == status


def test_a_lone_surrogate_from_the_daemon_is_printed_escaped(
    fake: Callable[[Reply], FakeDaemon],
) -> None:
    daemon = fake(lambda conn, request: conn.sendall(
        b'{"jsonrpc":"2.0","id":%d,"result":{"version":"a\\ud800b"}}\n' % request["id"]))
    code, out, _ = ctl(daemon, "status")
    assert code == 0
    assert "a\\ud800b" in out


# -- the shared /tmp default socket folder ---------------------------------------------


@pytest.fixture
def tmp_default(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """Point the ``/tmp/toolsetd-<uid>`` default at a folder of the test's own."""
    from toolsetd.client import mcp

    folder = tmp_path / f"toolsetd-{os.geteuid()}"
    monkeypatch.setattr(mcp, "_shared_tmp_folder", lambda: str(folder))
    return folder


def test_the_default_tmp_folder_is_refused_unless_it_is_ours_alone(tmp_default: Path) -> None:
    from toolsetd.client.mcp import shared_tmp_squatted

    sock = str(tmp_default / "toolsetd.sock")
    assert shared_tmp_squatted(sock) is None  # missing: the connect reports it
    tmp_default.mkdir(mode=0o700)
    os.chmod(tmp_default, 0o700)
    assert shared_tmp_squatted(sock) is None
    os.chmod(tmp_default, 0o777)
    reason = shared_tmp_squatted(sock)
    assert reason is not None and "writable by group or others" in reason
    os.chmod(tmp_default, 0o700)
    assert shared_tmp_squatted("/elsewhere/toolsetd.sock") is None  # --socket elsewhere


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a folder to another user needs root")
def test_a_default_tmp_folder_owned_by_someone_else_is_not_connected_to(
    tmp_default: Path, sockdir: Path
) -> None:
    """Another user's ``/tmp/toolsetd-<uid>`` with a live socket in it: never connected to."""
    from toolsetd.client.mcp import shared_tmp_squatted

    tmp_default.mkdir(mode=0o700)
    daemon = FakeDaemon(tmp_default / "toolsetd.sock", _answer({"status": "ok"}))
    try:
        os.chown(tmp_default, 65534, 65534)
        sock = str(tmp_default / "toolsetd.sock")
        reason = shared_tmp_squatted(sock)
        assert reason is not None and "belongs to uid 65534" in reason
        with pytest.raises(blocking.ConnectError, match="refusing to connect"):
            BlockingClient.connect(sock)
        out, err = io.StringIO(), io.StringIO()
        code = run(["--socket", sock, "invoke", "t", "--args", '{"token": "s3cret"}'],
                   stdout=out, stderr=err)
        assert code == 5
        assert daemon.requests == []  # the arguments never left
    finally:
        daemon.close()


def _foreign_listener(path: Path, seen: Path, uid: int) -> int:
    """Fork a process that listens at ``path`` as ``uid`` and appends what it receives to
    ``seen``; return its pid once it listens."""
    ready_r, ready_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        try:
            os.close(ready_r)
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)
            os.umask(0)
            server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            server.bind(str(path))
            server.listen(8)
            os.write(ready_w, b"1")
            while True:
                conn, _ = server.accept()
                conn.settimeout(1)
                try:
                    data = conn.recv(65536)
                except OSError:
                    data = b""
                with open(seen, "ab") as out:
                    out.write(data)
                conn.close()
        finally:
            os._exit(0)
    os.close(ready_w)
    with os.fdopen(ready_r, "rb") as ready:
        assert ready.read(1) == b"1"
    return pid


@pytest.mark.skipif(os.geteuid() != 0, reason="a listener of another user needs root")
def test_a_listener_of_another_user_in_our_default_folder_is_sent_nothing(
    tmp_default: Path,
) -> None:
    """The folder passed its check, but someone else listens (they swapped their folder in
    between the check and the connect): the connection is dropped before anything is sent."""
    import shutil
    import signal

    from toolsetd.client import mcp

    staging = Path(tempfile.mkdtemp(prefix="tsfl-"))  # in /tmp: pytest's tmp_path is 0700
    os.chmod(staging, 0o777)
    seen = staging / "seen"
    pid = _foreign_listener(staging / "s.sock", seen, 65534)
    try:
        tmp_default.mkdir(mode=0o700)
        os.chmod(tmp_default, 0o700)
        sock = str(tmp_default / "toolsetd.sock")
        os.rename(staging / "s.sock", sock)  # as the swapped-in folder would have it
        assert mcp.shared_tmp_squatted(sock) is None  # the folder is ours alone
        with pytest.raises(blocking.ConnectError, match="runs as uid 65534"):
            BlockingClient.connect(sock)
        out, err = io.StringIO(), io.StringIO()
        code = run(["--socket", sock, "invoke", "t", "--args", '{"token": "s3cret"}'],
                   stdout=out, stderr=err)
        assert code == 5, err.getvalue()
        with pytest.raises(mcp._Refused, match="runs as uid 65534"):
            mcp._connect(sock)
        time.sleep(1.2)  # the listener's recv gives up after 1 s
        assert not seen.exists() or seen.read_bytes() == b""  # nothing ever left
    finally:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        shutil.rmtree(staging, ignore_errors=True)


@pytest.mark.skipif(os.geteuid() != 0, reason="a listener of another user needs root")
def test_the_pump_names_a_listener_of_another_user_and_starts_no_daemon(
    tmp_default: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``toolsetctl mcp`` dropped such a connection as if nothing listened, started a daemon
    that found the path taken, and told the host "toolsetd is already running" (or, with
    --no-autostart, "toolsetd is not running"): now it says who listens, exit 5."""
    import shutil
    import signal

    from toolsetd.client import mcp

    staging = Path(tempfile.mkdtemp(prefix="tsfl-"))  # in /tmp: pytest's tmp_path is 0700
    os.chmod(staging, 0o777)
    pid = _foreign_listener(staging / "s.sock", staging / "seen", 65534)
    try:
        tmp_default.mkdir(mode=0o700)
        os.chmod(tmp_default, 0o700)
        sock = str(tmp_default / "toolsetd.sock")
        os.rename(staging / "s.sock", sock)  # as the swapped-in folder would have it
        for extra in ([], ["--no-autostart"]):
            assert mcp.main(["--socket", sock, "--workspace", str(staging), *extra]) == 5
            err = capsys.readouterr().err
            assert "runs as uid 65534" in err, err
            assert "already running" not in err and "not running" not in err
        assert not (tmp_default / "toolsetd.log").exists()  # no daemon was started
    finally:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        shutil.rmtree(staging, ignore_errors=True)


def test_a_line_nested_past_the_decoder_is_a_lost_connection(fake: Callable[[Reply], FakeDaemon]) -> None:
    """``[[[[...`` deeper than the stdlib decoder recurses: exit 5, not a RecursionError (9)."""
    daemon = fake(lambda conn, _: conn.sendall(b"[" * 200_000 + b"\n"))
    code, _, err = ctl(daemon, "status")
    assert code == 5
    assert "toolsetd sent an invalid message: a line nested too deeply" in err


@pytest.mark.parametrize("number", [b"1e5000", b"1e99999999999999999999999"])
def test_a_number_past_the_double_range_is_shown_as_written(
    fake: Callable[[Reply], FakeDaemon], number: bytes
) -> None:
    """A number past the double range was read as its exact integer: one of more digits
    than Python prints was an invalid message (exit 5), one whose exponent is past what
    ``decimal`` holds raised ``InvalidOperation`` (exit 9). It is kept as written, and
    shown so, as the daemon's own messages show a number."""
    line = b'{"jsonrpc": "2.0", "id": %d, "result": {"version": "0", "uptimeSeconds": %s}}\n'
    daemon = fake(lambda conn, request: conn.sendall(line % (request["id"], number)))
    code, out, err = ctl(daemon, "status")
    assert code == 0, err
    assert f"{number.decode()} s\n" in out


@pytest.fixture
def digit_limit() -> Iterator[int]:
    """Python's lowest limit on integer digits, for this test only."""
    limit = sys.get_int_max_str_digits()
    sys.set_int_max_str_digits(640)
    try:
        yield 640
    finally:
        sys.set_int_max_str_digits(limit)


@pytest.mark.parametrize("fmt", ["text", "json"])  # text: one line per field, never wrapped
def test_an_integer_past_the_digit_limit_is_shown_as_written(
    fake: Callable[[Reply], FakeDaemon], digit_limit: int, fmt: str
) -> None:
    """An integer of more digits than this Python converts (a daemon whose limit is higher,
    ``PYTHONINTMAXSTRDIGITS=0``, echoes one as written) made ``int()`` refuse the whole
    answer: "toolsetd sent an invalid message", exit 5. It is kept as written, and shown
    so, as a ``1e5000`` is."""
    number = "-" + "7" * (digit_limit + 1)
    line = '{"jsonrpc": "2.0", "id": %d, "result": {"version": "0", "uptimeSeconds": %s}}\n'
    daemon = fake(lambda conn, request: conn.sendall((line % (request["id"], number)).encode()))
    code, out, err = ctl(daemon, "status", fmt=fmt)
    assert (code, err) == (0, "")
    if fmt == "json":
        assert f'"uptimeSeconds": {number}\n' in out
    else:
        assert f"{number} s\n" in out


def test_answers_to_ids_never_sent_are_dropped() -> None:
    """Only answers to requests in flight are kept: a flood of others cannot grow memory."""
    left, right = socket.socketpair()
    with left, right:
        client = BlockingClient(left, "pair")
        request_id = client.send("status")
        for stray in (request_id + 1, request_id + 1000, 0, -5):
            _send(right, {"jsonrpc": "2.0", "id": stray, "result": {"stray": True}})
        _send(right, {"jsonrpc": "2.0", "id": request_id, "result": {"ok": True}})
        _send(right, {"jsonrpc": "2.0", "id": request_id, "result": {"again": True}})
        assert client.wait(request_id, timeout=5) == {"ok": True}
        client.send("status")  # read on, past the duplicate answer
        _send(right, {"jsonrpc": "2.0", "id": request_id + 1, "result": {"next": True}})
        assert client.wait(request_id + 1, timeout=5) == {"next": True}
        assert client._answers == {}  # nothing kept: neither the strays nor the duplicate


def test_a_silent_daemon_fails_requests_after_the_request_timeout(
    fake: Callable[[Reply], FakeDaemon], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A daemon that accepts and never answers: ``status`` exits 5 instead of hanging."""
    monkeypatch.setattr(context, "REQUEST_TIMEOUT", 0.5)
    daemon = fake(lambda conn, request: None)
    code, _, err = ctl(daemon, "status")
    assert code == 5
    assert "No response within 0.5 s" in err
    assert "accepted the connection but did not answer" in err  # not "lost the connection"


@pytest.mark.parametrize("result", [[1, 2], "text", 7])
def test_an_invoke_result_that_is_not_an_object_is_a_protocol_failure(
    fake: Callable[[Reply], FakeDaemon], result: object
) -> None:
    daemon = fake(_answer(result))
    code, _, err = ctl(daemon, "invoke", "t")
    assert code == 5
    assert "not an object" in err
    assert "unexpected error" not in err


def test_content_items_of_the_wrong_shape_are_skipped(fake: Callable[[Reply], FakeDaemon]) -> None:
    daemon = fake(
        _answer({"status": "ok", "exitCode": 0, "content": [1, None, "x", {"type": "text", "text": "hi"}]})
    )
    code, out, err = ctl(daemon, "invoke", "t")
    assert (code, out, err) == (0, "hi\n", "")


def test_progress_events_with_members_of_the_wrong_type_do_not_end_the_command(
    fake: Callable[[Reply], FakeDaemon],
) -> None:
    def reply(conn: socket.socket, request: dict[str, object]) -> None:
        for params in (
            {"callId": "c", "stdoutBytes": "lots", "stderrBytes": None, "elapsedMs": "x"},
            {"callId": "c", "stdoutBytes": 10**400, "fraction": 10**400, "message": 5},
            {"callId": "c", "stdoutBytes": -3, "fraction": True},
        ):
            _send(conn, {"jsonrpc": "2.0", "method": "progress", "params": params})
        _send(conn, {"jsonrpc": "2.0", "id": request["id"], "result": {
            "status": "ok", "exitCode": 0, "content": [{"type": "text", "text": "done"}]}})

    daemon = fake(reply)
    code, out, err = ctl(daemon, "invoke", "t")
    assert (code, out, err) == (0, "done\n", "")


# -- the MCP pump (``toolsetctl mcp``) -------------------------------------------------


def _pump(daemon: FakeDaemon) -> subprocess.CompletedProcess[bytes]:
    """Run ``toolsetctl mcp`` against the fake, its stdin held open (a host that waits)."""
    import sys

    read, write = os.pipe()
    try:
        return subprocess.run(
            [sys.executable, "-m", "toolsetd.client", "--socket", str(daemon.path), "mcp",
             "--no-autostart"],
            stdin=read, capture_output=True, timeout=60, check=False,
        )
    finally:
        os.close(read)
        os.close(write)


def _full_backlog(path: Path) -> tuple[socket.socket, list[socket.socket]]:
    """A listener on ``path`` that accepts nothing, and the connections that fill its
    backlog until one more connect would have to wait."""
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(str(path))
    server.listen(0)
    waiting: list[socket.socket] = []
    while True:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.setblocking(False)
        try:
            sock.connect(str(path))
        except BlockingIOError:
            sock.close()
            return server, waiting
        waiting.append(sock)


def test_the_pump_gives_up_on_a_backlog_that_stays_full(sockdir: Path) -> None:
    """A listener that accepts nothing (a stopped or hung daemon) with its backlog full: the
    pump's blocking connect waited for room as long as the backlog stayed full, so the
    host's MCP start-up hung forever. Now it waits toolsetctl's connect timeout, says why
    in one line, and exits 5; it starts no daemon beside the one holding the path."""
    import sys

    path = sockdir / "wedged.sock"
    server, waiting = _full_backlog(path)
    read, write = os.pipe()
    try:
        began = time.monotonic()
        result = subprocess.run(
            [sys.executable, "-m", "toolsetd.client", "--socket", str(path), "mcp"],
            stdin=read, capture_output=True, timeout=60, check=False,
        )
        took = time.monotonic() - began
    finally:
        os.close(read)
        os.close(write)
        for sock in waiting:
            sock.close()
        server.close()
    assert result.returncode == 5, result.stderr
    assert result.stderr == (
        f"toolsetctl mcp: toolsetd at {path} accepts no connection: its listen backlog "
        "stayed full for 5 s (is the daemon stopped or hung?)\n"
    ).encode()
    assert 4.5 < took < 30
    assert not (sockdir / "toolsetd.log").exists()  # no daemon was started


def test_the_pump_bounds_an_answer_to_bind_that_never_ends(
    fake: Callable[[Reply], FakeDaemon],
) -> None:
    """A peer that streams one endless line: exit 5 with one line, not unbounded memory."""

    def endless(conn: socket.socket, request: dict[str, object]) -> None:
        try:
            for _ in range(64):  # 64 MiB, far past the bound
                conn.sendall(b"a" * (1 << 20))
        except OSError:
            pass  # the pump gave up and closed: what the test wants

    result = _pump(fake(endless))
    assert result.returncode == 5
    assert b"answered mcp.bind with more than" in result.stderr
    assert b"Traceback" not in result.stderr


def test_the_pump_reports_a_bind_answer_nested_past_the_decoder_in_one_line(
    fake: Callable[[Reply], FakeDaemon],
) -> None:
    result = _pump(fake(lambda conn, _: conn.sendall(b"[" * 200_000 + b"\n")))
    assert result.returncode == 5
    assert result.stderr == b"toolsetctl mcp: the daemon's answer to mcp.bind is not JSON\n"


def test_the_pump_shows_a_bind_error_escaped(fake: Callable[[Reply], FakeDaemon]) -> None:
    def error(conn: socket.socket, request: dict[str, object]) -> None:
        _send(conn, {"jsonrpc": "2.0", "id": request["id"],
                     "error": {"code": -32602, "message": f"bad {ESCAPES}"}})

    result = _pump(fake(error))
    assert result.returncode == 2
    _no_controls(result.stderr.decode())
    assert b"bad \\x1b]52;c;cHduZWQ=\\x07" in result.stderr


def test_the_pump_at_a_daemon_that_does_not_know_bind_exits_9_not_usage(
    fake: Callable[[Reply], FakeDaemon],
) -> None:
    """An older toolsetd (still running after an upgrade) answers mcp.bind -32601: exit 9,
    as any command gets for a code it does not know, with what to do. It was 2, which
    sends the operator to the options, the workspace and the mode."""

    def unknown(conn: socket.socket, request: dict[str, object]) -> None:
        _send(conn, {"jsonrpc": "2.0", "id": request["id"],
                     "error": {"code": -32601, "message": "Method not found"}})

    result = _pump(fake(unknown))
    assert result.returncode == 9, result.stderr
    assert result.stderr == (
        b"toolsetctl mcp: this toolsetd does not serve MCP (mcp.bind is unknown): "
        b"upgrade it and restart it\n"
    )


def test_a_wait_with_a_timeout_is_a_deadline_not_a_limit_per_read() -> None:
    """Events trickling in (a daemon's progress ticks) do not stretch a bounded wait: the
    Ctrl-C wait for a cancelled call's result ("up to 5 seconds") and REQUEST_TIMEOUT."""
    from toolsetd.client.errors import RequestTimeout

    left, right = socket.socketpair()
    stop = threading.Event()

    def trickle() -> None:
        event = {"jsonrpc": "2.0", "method": "progress", "params": {"callId": "c"}}
        for _ in range(200):  # 10 s of ticks, then the peer closes
            if stop.wait(0.05):
                return
            try:
                _send(right, event)
            except OSError:
                return
        right.close()

    thread = threading.Thread(target=trickle, daemon=True)
    with left:
        client = BlockingClient(left, "pair")
        request_id = client.send("status")
        thread.start()
        try:
            # Without a deadline the ticks keep every read short of its timeout until the
            # peer closes: ConnectionClosed, 10 s later, instead of RequestTimeout.
            with pytest.raises(RequestTimeout):
                client.wait(request_id, on_event=lambda method, params: None, timeout=0.5)
        finally:
            stop.set()
            thread.join()
    right.close()


def test_a_full_backlog_is_waited_for_not_a_daemon_unreachable(sockdir: Path) -> None:
    """A daemon whose listen backlog is full (a burst of CI jobs, a restart behind systemd's
    socket) is there: toolsetctl's connect has a timeout, so the socket is non-blocking and
    a Unix connect failed at once with EAGAIN, exit 5 "Resource temporarily unavailable".
    Now it is tried again until the connect timeout, and served once there is room."""
    path = sockdir / "full.sock"
    server, waiting = _full_backlog(path)

    def serve() -> None:
        time.sleep(0.5)  # the client is waiting by now
        for _ in range(len(waiting) + 1):
            conn, _ = server.accept()
            waiting.append(conn)
        conn.settimeout(10)
        request = json.loads(conn.makefile("rb").readline())
        result = {"version": "0", "pid": 1, "uptimeSeconds": 0, "socket": str(path),
                  "home": "/h", "generation": 1, "workspaces": [], "inFlight": 0,
                  "connections": 1}
        _send(conn, {"jsonrpc": "2.0", "id": request["id"], "result": result})

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        out, err = io.StringIO(), io.StringIO()
        code = run(["--socket", str(path), "--format", "json", "status"], stdout=out, stderr=err)
        assert code == 0, err.getvalue()
        assert json.loads(out.getvalue())["generation"] == 1
    finally:
        thread.join(10)
        for sock in waiting:
            sock.close()
        server.close()


@pytest.mark.parametrize(
    "command",
    [["status"], ["list"], ["show", "x"], ["classify", "t"], ["reload"], ["metrics"],
     ["enable", "x"]],
)
@pytest.mark.parametrize("result", [[1, 2], "text", None])
def test_a_result_that_is_not_an_object_is_a_protocol_failure_for_every_command(
    fake: Callable[[Reply], FakeDaemon], command: list[str], result: object
) -> None:
    """A daemon of another protocol (or version) answering with a non-object result is a
    lost connection (exit 5, -32092), as for ``invoke``: never a traceback's exit 9, and
    never ``enable`` editing the default home because ``status`` named none."""
    daemon = fake(_answer(result))
    code, _, err = ctl(daemon, *command)
    assert code == 5, err
    assert f"toolsetd sent a {daemon.requests[0]['method']} result that is not an object" in err
    assert "unexpected error" not in err
    code, out, _ = ctl(daemon, *command, fmt="json")
    assert code == 5
    assert json.loads(out)["error"]["code"] == -32092


@pytest.mark.parametrize("kind", ["a regular file", "a directory"])
def test_a_socket_path_that_is_no_socket_is_named_as_such(sockdir: Path, kind: str) -> None:
    """``--socket`` (or ``TOOLSETD_SOCKET``) naming a file or a folder by mistake: the
    connect is refused as for a stopped daemon, but "not running (connection refused)"
    sent the CI author looking for a daemon; the message says what is at the path."""
    path = sockdir / "not-a-socket"
    if kind == "a directory":
        path.mkdir()
    else:
        path.write_text("")
    out, err = io.StringIO(), io.StringIO()
    code = run(["--socket", str(path), "status"], stdout=out, stderr=err)
    assert code == 5
    assert f"{path} is {kind}, not a socket" in err.getvalue()
    out, err = io.StringIO(), io.StringIO()
    code = run(["--socket", str(path), "--home", str(sockdir), "list"], stdout=out, stderr=err)
    assert code == 0
    assert f"{path} is {kind}, not a socket" in err.getvalue()
    assert "Showing the tool sets on disk." in err.getvalue()


_TOOL = {"name": "t", "set": "s", "source": "home", "catalogs": ["plan"], "pathArguments": []}
_SET = {"directory": "s", "source": "home", "path": "/h/tools/s", "tools": ["t"], "notes": []}


@pytest.mark.parametrize(
    ("command", "result", "member"),
    [
        (["list"], {"tools": "t", "sets": [], "notes": []}, "tools is not an array"),
        (["list"], {"tools": [], "sets": [1], "notes": []}, "sets[0] is not an object"),
        (["list"], {"tools": [], "sets": [], "notes": "n"}, "notes is not an array"),
        (["show", "s"], {"tools": [], "sets": [{**_SET, "directory": ["s"]}]},
         "sets[0].directory is not a string"),
        (["show", "t"], {"tools": [{**_TOOL, "pathArguments": [1]}], "sets": []},
         "tools[0].pathArguments[0] is not a string"),
        (["show", "t"], {"tools": [{**_TOOL, "runner": 5}], "sets": []},
         "tools[0].runner is not a string"),
        (["status"], {"confinement": {"cgroup": "on"}}, "confinement.cgroup is not an object"),
        (["classify", "t"], {"decision": "allow", "paths": [True]}, "paths[0] is not an object"),
        (["classify", "t"], {"decision": "allow", "reason": 5}, "reason is not a string"),
        (["reload"], {"changed": [], "notes": [], "config": "x"}, "config is not an object"),
        (["reload"], {"changed": [], "config": {"applied": 5}}, "config.applied is not an array"),
        (["invoke", "t", "--tool-exit-code"], {"status": "ok", "exitCode": "3", "content": []},
         "exitCode is not an integer"),
        (["invoke", "t"], {"status": "ok", "exitCode": 0, "isError": "false"},
         "isError is not true or false"),
    ],
)
def test_a_result_whose_members_have_the_wrong_type_is_a_protocol_failure(
    fake: Callable[[Reply], FakeDaemon], command: list[str], result: object, member: str
) -> None:
    """A daemon of another protocol (or version) whose result is an object, but with a
    member toolsetctl reads of the wrong type (``tools`` a string, an ``exitCode`` in
    text): a lost connection naming the member (exit 5, -32092) in every format, never a
    traceback's exit 9, and never an outcome read wrong (an exit 0)."""
    daemon = fake(_answer(result))
    for fmt in ("table", "text", "json", "jsonl"):
        code, out, err = ctl(daemon, *command, fmt=fmt)
        method = daemon.requests[-1]["method"]
        assert code == 5, (fmt, out, err)
        said = err if fmt in ("table", "text") else json.loads(out)["error"]
        text = said if isinstance(said, str) else said["message"]
        assert f"toolsetd sent a{'n' if method == 'invoke' else ''} {method} result whose " \
            f"{member}." in text, text
        assert "unexpected error" not in text
        if not isinstance(said, str):
            assert said["code"] == -32092


@pytest.mark.parametrize(
    "result",
    [
        {"status": "refused", "exitCode": None, "content": []},
        {"status": "OK", "exitCode": 0, "isError": False, "content": []},
        {"exitCode": 0, "content": [{"type": "text", "text": "hi"}]},
    ],
)
def test_an_invoke_result_whose_status_is_none_of_the_four_is_a_protocol_failure(
    fake: Callable[[Reply], FakeDaemon], result: dict[str, object]
) -> None:
    """A status toolsetctl does not know (a newer daemon's, a typo), or none at all, says
    nothing of the outcome: it is no success a CI step may pass on (exit 0), but a
    protocol failure naming the member (exit 5)."""
    daemon = fake(_answer(result))
    for extra in ([], ["--tool-exit-code"]):
        code, _, err = ctl(daemon, "invoke", "t", *extra)
        assert code == 5, err
        assert "toolsetd sent an invoke result whose status is " in err


@pytest.mark.parametrize("there", ["a regular file", "a full backlog"])
@pytest.mark.parametrize("command", ["enable", "disable"])
def test_enable_never_edits_the_default_home_when_the_socket_could_not_be_asked(
    sockdir: Path, monkeypatch: pytest.MonkeyPatch, there: str, command: str
) -> None:
    """``enable``/``disable`` with no home named (``--home``, ``$CRYSTAL_HOME``) edit the
    home of the daemon at ``--socket``. When a socket is there that could not be asked (a
    socket the user may not open, a daemon whose backlog stays full), ``~/.crystal`` was
    edited instead and the command exited 0: a CI job changed a file the daemon it meant
    does not serve. Then nothing is written (exit 5), unless a home is named. A regular
    file at ``--socket`` (named by mistake) is no daemon: the contract's "works when no
    daemon runs", so ``~/.crystal`` is edited, as with no socket."""
    user = sockdir / "user"
    manifest = user / ".crystal" / "tools" / "s" / "tools.json"
    manifest.parent.mkdir(parents=True)
    manifest_object = {"enabled": command == "disable", "runner": "exec", "description": "d",
                       "schema": {"type": "object"}, "command": ["run.sh"]}
    text = json.dumps(manifest_object) + "\n"
    manifest.write_text(text)
    monkeypatch.delenv("CRYSTAL_HOME", raising=False)
    monkeypatch.setenv("HOME", str(user))
    path = sockdir / "d.sock"
    server, waiting = None, []
    if there == "a regular file":
        path.write_text("")
    else:
        server, waiting = _full_backlog(path)
    argv = ["--socket", str(path), "--workspace", str(sockdir)]
    try:
        out, err = io.StringIO(), io.StringIO()
        code = run([*argv, command, "s"], stdout=out, stderr=err)
        if there == "a regular file":
            assert code == 0, err.getvalue()
            assert manifest.read_text() != text
            return
        assert code == 5, err.getvalue()
        assert manifest.read_text() == text  # nothing written
        assert str(path) in err.getvalue()
        assert "--home" in err.getvalue()
        named = (
            ([*argv, "--home", str(user / ".crystal")], {}),  # --home names the home
            (argv, {"CRYSTAL_HOME": str(user / ".crystal")}),  # so does $CRYSTAL_HOME
        )
        for options, environment in named:
            manifest.write_text(text)
            with monkeypatch.context() as patched:
                for key, value in environment.items():
                    patched.setenv(key, value)
                out, err = io.StringIO(), io.StringIO()
                code = run([*options, command, "s"], stdout=out, stderr=err)
            assert code == 0, err.getvalue()  # a home named: no need to ask
            assert manifest.read_text() != text
    finally:
        for sock in waiting:
            sock.close()
        if server is not None:
            server.close()


@pytest.mark.parametrize(
    "answer",
    [
        b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n",  # another server's socket
        b'{"jsonrpc": "2.0", "id": "toolsetctl-mcp-bind", "result": [1]}\n',
        b'{"hello": "world"}\n',
        b"[" * 200_000 + b"\n",
    ],
)
def test_the_pump_takes_a_peer_that_does_not_answer_bind_as_toolsetd_for_a_protocol_failure(
    fake: Callable[[Reply], FakeDaemon], answer: bytes
) -> None:
    """``--socket`` naming another program's socket (an HTTP server's, say), or a peer whose
    answer to ``mcp.bind`` is JSON but no JSON-RPC response: the protocol is broken, exit 5
    as for every command (the daemon unreachable, or a protocol failure), not the exit 2 of
    a bad option, workspace or mode, which sent the operator to check those."""
    result = _pump(fake(lambda conn, _: conn.sendall(answer)))
    assert result.returncode == 5, result.stderr
    assert result.stderr.count(b"\n") == 1
    assert b"mcp.bind" in result.stderr


def test_the_pump_exits_9_for_an_internal_error_of_the_daemon_at_bind(
    fake: Callable[[Reply], FakeDaemon],
) -> None:
    """An error toolsetctl does not know the code of (the daemon's -32603, an incident) is
    exit 9 for every command; at the bind it was the exit 2 of a bad option, workspace or
    mode, which sent the operator to check those instead of the daemon's log."""

    def error(conn: socket.socket, request: dict[str, object]) -> None:
        _send(conn, {"jsonrpc": "2.0", "id": request["id"],
                     "error": {"code": -32603, "message": "Internal error (incident 7)"}})

    result = _pump(fake(error))
    assert result.returncode == 9, result.stderr
    assert result.stderr == b"toolsetctl mcp: Internal error (incident 7)\n"


def test_the_pump_says_when_the_peer_never_answered_the_bind_before_stdin_closed(
    sockdir: Path,
) -> None:
    """A peer that accepts and never answers (a wedged daemon, a program that is no
    toolsetd): once the host closed stdin, the pump waited its grace and exited 0 without a
    word, as if the session had ended well (``printf ... | toolsetctl mcp`` in a script got
    no answer and a success). It now says the bind was never answered, exit 5."""
    import sys

    path = sockdir / "silent.sock"
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(str(path))
    server.listen(1)
    held: list[socket.socket] = []
    thread = threading.Thread(target=lambda: held.append(server.accept()[0]), daemon=True)
    thread.start()
    try:
        result = subprocess.run(
            [sys.executable, "-m", "toolsetd.client", "--socket", str(path), "mcp",
             "--no-autostart"],
            input=b'{"jsonrpc": "2.0", "id": 1, "method": "ping"}\n', capture_output=True,
            timeout=60, check=False,
        )
    finally:
        thread.join(10)
        for conn in held:
            conn.close()
        server.close()
    assert result.returncode == 5, result.stderr
    assert result.stderr == f"toolsetctl mcp: toolsetd at {path} did not answer mcp.bind\n".encode()
    assert result.stdout == b""


def test_the_pump_exits_5_when_the_daemon_closes_while_the_host_is_sending(
    sockdir: Path,
) -> None:
    """The daemon closes the bound connection (it stopped, or restarted) while the host is
    writing to the pump: the send failing in the stdin thread was taken for the end of the
    host's input, and the pump then exited 0 without a word, about one time in two, as if
    its host had left. The host is still there and its server went away: the pump
    reconnects (here to a peer whose answer to the new bind is no JSON: exit 5 and the
    line that says so), every time."""
    import sys

    path = sockdir / "closing.sock"
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(str(path))
    server.listen(8)

    def serve() -> None:
        accepted = 0
        while True:
            try:
                conn, _ = server.accept()
            except OSError:
                return
            accepted += 1
            with conn:
                request = json.loads(conn.makefile("rb").readline())
                if accepted % 2 == 0:  # each pump's reconnect
                    conn.sendall(b"not json\n")
                    continue
                _send(conn, {"jsonrpc": "2.0", "id": request["id"], "result": {"bound": True}})
                time.sleep(0.3)  # the host's stream fills the socket meanwhile

    threading.Thread(target=serve, daemon=True).start()
    try:
        for _ in range(10):
            proc = subprocess.Popen(
                [sys.executable, "-m", "toolsetd.client", "--socket", str(path), "mcp",
                 "--no-autostart"],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            )
            assert proc.stdin is not None and proc.stderr is not None

            def feed(stream: Any = proc.stdin) -> None:
                try:
                    while True:
                        stream.write(b"x" * 65535 + b"\n")
                except (OSError, ValueError):
                    pass

            threading.Thread(target=feed, daemon=True).start()
            assert proc.wait(60) == 5
            said = proc.stderr.read()
            assert said.startswith(b"toolsetctl mcp: ") and said.count(b"\n") == 1, said
            assert str(path).encode() in said
            for stream in (proc.stdin, proc.stdout, proc.stderr):
                with contextlib.suppress(OSError):
                    stream.close()
    finally:
        server.close()


def test_a_status_uptime_past_the_double_range_is_printed(
    fake: Callable[[Reply], FakeDaemon],
) -> None:
    """An ``uptimeSeconds`` of 401 digits (a hostile or broken peer: the reader keeps a
    number past the double range as its exact integer) ended ``status`` in OverflowError,
    exit 9; it is printed as the integer it is."""
    daemon = fake(_answer({"version": "0", "uptimeSeconds": 10**400}))
    for fmt in ("table", "text"):
        code, out, err = ctl(daemon, "status", fmt=fmt)
        assert (code, err) == (0, "")
    assert f"{10**400} s\n" in out  # text: one line per field, never wrapped
