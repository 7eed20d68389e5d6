"""The daemon on a real socket: status, list, errors, and bad input from clients."""

from __future__ import annotations

import functools
import json
import os
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from .conftest import EXAMPLES, Daemon, RawConn, daemon_in, eventually, start_daemon, write_set

#: This file's deadline for waits that outlast a loaded machine.
_wait_until = functools.partial(eventually, timeout=20.0)


@pytest.fixture(scope="module")
def shared() -> Iterator[Daemon]:
    """One daemon over the example sets for the tests that only ask it things.

    Tests that change what it serves, its files' modes, or its workspaces take their own
    (the ``daemon`` fixture, or ``start_daemon``).
    """
    def fill(home: Path, _: Path) -> None:
        shutil.copytree(EXAMPLES, home / "tools", dirs_exist_ok=True)

    with daemon_in("tsw-", fill) as d:
        yield d


def test_daemon_status_reports_its_state(shared: Daemon) -> None:
    """status answers every contract field with the daemon's own facts."""
    result = shared.call("status")["result"]
    assert set(result) == {
        "version", "pid", "uptimeSeconds", "socket", "home", "generation", "workspaces",
        "inFlight", "connections", "confinement", "watch",
    }
    assert result["pid"] == shared.proc.pid
    assert result["socket"] == str(shared.socket)
    assert result["home"] == str(shared.home)
    assert result["connections"] >= 1  # start_daemon's probe may not be reaped yet
    assert result["inFlight"] == 0


def test_daemon_socket_and_folder_are_private(shared: Daemon) -> None:
    """The socket is 0600 and its folder 0700."""
    assert stat.S_IMODE(os.stat(shared.socket).st_mode) == 0o600


def test_daemon_list_home_only_and_with_workspace(daemon: Daemon, workspace: Path) -> None:
    """list without a workspace serves home sets; with one, the project sets join them."""
    write_set(workspace / ".crystal" / "tools", "proj", {
        "runner": "exec", "description": "d", "schema": {"type": "object"}, "command": ["true"],
    })
    home_only = daemon.call("list")["result"]
    assert [t["name"] for t in home_only["tools"]] == [
        "notes_add", "notes_list", "notes_index", "hello", "swatch",
    ]
    with_ws = daemon.call("list", {"workspace": str(workspace)})["result"]
    names = [t["name"] for t in with_ws["tools"]]
    assert "proj" in names
    entry = next(t for t in with_ws["tools"] if t["name"] == "proj")
    assert entry["source"] == "project"
    assert entry["hash"].startswith("sha256:")
    assert daemon.call("status")["result"]["workspaces"] == [str(workspace.resolve())]


def test_daemon_list_catalog_filter(shared: Daemon) -> None:
    """list with catalog: plan omits Work-only tools."""
    plan = shared.call("list", {"catalog": "plan"})["result"]
    assert "notes_index" not in [t["name"] for t in plan["tools"]]
    work = shared.call("list", {"catalog": "work"})["result"]
    assert "notes_index" in [t["name"] for t in work["tools"]]


@pytest.mark.parametrize(
    ("params", "code", "needle"),
    [
        ({"workspace": "relative/path"}, -32006, "got a relative path"),
        ({"workspace": "/tmp/a\x00b"}, -32006, "NUL character"),
        ({"workspace": "/nonexistent/toolsetd/ws"}, -32006, "not a directory"),
        ({"workspace": 5}, -32602, "workspace"),
        ({"catalog": "review"}, -32602, "catalog"),
        ({"bogus": 1}, -32602, "bogus"),
    ],
)
def test_daemon_list_rejects_bad_params_naming_the_field(
    shared: Daemon, params: dict[str, object], code: int, needle: str
) -> None:
    """A bad list param gets the contract's code and a message naming the field."""
    error = shared.call("list", params)["error"]
    assert error["code"] == code
    assert needle in error["message"]


@pytest.mark.parametrize("prefix", ["/", ""], ids=["no directory", "relative"])
def test_a_workspace_of_unclosed_variables_is_refused_while_others_are_served(
    daemon: Daemon, prefix: str
) -> None:
    """The message of a workspace that names no directory looks for a variable its host
    left unexpanded (``${workspaceFolder}``); from each "${" with no "}" after it, that
    search went over the rest of the path again, on the event loop. A client's 400 KB of
    "${" (a frame takes 16 MiB) held every face of the daemon for minutes; it is
    answered now, and so is the next client."""
    with daemon.raw(timeout=10) as conn:
        error = conn.request("list", {"workspace": prefix + "${" * 200_000})["error"]
    assert error["code"] == -32006
    assert daemon.call("status")["result"]["pid"] == daemon.proc.pid


def test_daemon_unknown_method_and_positional_params(shared: Daemon) -> None:
    """An unknown method names itself; positional params are refused as by-name only."""
    error = shared.call("deploy")["error"]
    assert error["code"] == -32601
    assert "'deploy'" in error["message"]
    with shared.raw() as conn:
        conn.send({"jsonrpc": "2.0", "method": "status", "params": [1], "id": 1})
        reply = conn.receive()
    assert reply["error"]["code"] == -32602
    assert "named" in reply["error"]["message"]


@pytest.mark.parametrize("method", ["status", "list", "reload", "metrics", "cancel", "invoke"])
def test_daemon_an_empty_params_array_is_positional_too(shared: Daemon, method: str) -> None:
    """``"params": []`` is an array: refused with -32602 as by-name only, like ``[1]``."""
    with shared.raw() as conn:
        conn.send({"jsonrpc": "2.0", "method": method, "params": [], "id": 7})
        reply = conn.receive()
    assert reply["id"] == 7
    assert reply["error"]["code"] == -32602
    assert "named" in reply["error"]["message"]


def test_daemon_an_id_of_minus_zero_is_an_integer_echoed_as_sent(shared: Daemon) -> None:
    """``-0`` is an integer in JSON's grammar: the request is answered, its id echoed as
    ``-0``; ``-0.0`` is a fraction and refused."""
    with shared.raw() as conn:
        conn.send_bytes(b'{"jsonrpc": "2.0", "method": "status", "id": -0}\n')
        conn.send_bytes(b'{"jsonrpc": "2.0", "method": "status", "id": -0.0}\n')
        while b"\n" not in conn._buffer or conn._buffer.count(b"\n") < 2:
            conn._buffer += conn.sock.recv(65536)
        first, second = conn._buffer.split(b"\n")[:2]
    assert b'"id":-0' in first and b'"result"' in first
    assert json.loads(second)["error"]["code"] == -32600


def test_daemon_garbage_and_bad_utf8_cost_only_that_line(shared: Daemon) -> None:
    """A garbage line and an invalid UTF-8 line each get a parse error; the connection goes on."""
    with shared.raw() as conn:
        conn.send_bytes(b"this is not json\n")
        assert conn.receive()["error"]["code"] == -32700
        conn.send_bytes(b'{"jsonrpc": "2.0", "method": "status", "id": "\xff\xfe"}\n')
        assert conn.receive()["error"]["code"] == -32700
        assert "result" in conn.request("status")


def test_daemon_oversized_line_closes_only_that_connection(
    home: Path, workspace: Path, tmp_base: Path
) -> None:
    """A line over the size limit gets -32007 and a close; other connections carry on."""
    d = start_daemon(home, workspace, tmp_base, ["--max-message-bytes", "4096"])
    try:
        with d.raw() as other, d.raw() as big:
            big.send_bytes(b'{"jsonrpc": "2.0", "method": "status", "params": {"x": "'
                           + b"a" * 10_000)
            reply = big.receive()
            assert reply["error"]["code"] == -32007
            assert "4096" in reply["error"]["message"]
            assert big.closed_by_peer()
            assert "result" in other.request("status")
    finally:
        assert d.stop() == 0


def test_daemon_silent_client_is_closed_after_idle_timeout(
    home: Path, workspace: Path, tmp_base: Path
) -> None:
    """A client that connects and sends nothing is closed after the idle timeout."""
    d = start_daemon(home, workspace, tmp_base, ["--idle-timeout", "0.5"])
    try:
        with d.raw() as silent, d.raw() as partial:
            partial.send_bytes(b'{"jsonrpc": "2.0", ')
            assert silent.closed_by_peer(timeout=10)
            assert partial.closed_by_peer(timeout=10)
        assert "result" in d.call("status")
    finally:
        assert d.stop() == 0


def test_daemon_client_leaving_mid_line_harms_nobody(shared: Daemon) -> None:
    """A client that disconnects in the middle of a line costs only its own connection."""
    conn = shared.raw()
    conn.send_bytes(b'{"jsonrpc": "2.0", "method": "sta')
    conn.close()
    assert "result" in shared.call("status")


def test_daemon_second_instance_on_live_socket_is_refused(
    shared: Daemon
) -> None:
    """A second daemon on a live socket exits non-zero with a clear message."""
    proc = subprocess.run(
        [sys.executable, "-m", "toolsetd.daemon", "--home", str(shared.home),
         "--socket", str(shared.socket)],
        capture_output=True, text=True, timeout=30, check=False,
    )
    assert proc.returncode != 0
    assert "toolsetd:" in proc.stderr
    assert "result" in shared.call("status")


def _bound_and_closed(home: Path, workspace: Path, base: Path) -> None:
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stale.bind(str(base / "s.sock"))
    stale.close()


def _left_by_sigkill(home: Path, workspace: Path, base: Path) -> None:
    """A daemon SIGKILLed (the OOM killer, ``kill -9``) removes nothing: its socket and
    lock files stay, its lock released by the kernel."""
    first = start_daemon(home, workspace, base)
    assert first.stop(signal.SIGKILL) == -signal.SIGKILL
    assert (base / "s.sock").exists()


@pytest.mark.parametrize("leave", [_bound_and_closed, _left_by_sigkill])
def test_daemon_stale_socket_is_replaced(
    home: Path, workspace: Path, tmp_base: Path, leave: Callable[[Path, Path, Path], None]
) -> None:
    """A socket file nobody listens on is replaced at startup: one bound and closed, and
    the one a daemon that could not clean up (SIGKILL) left with its lock file."""
    leave(home, workspace, tmp_base)
    d = start_daemon(home, workspace, tmp_base)
    try:
        assert "result" in d.call("status")
    finally:
        assert d.stop() == 0
    assert not (tmp_base / "s.sock").exists()


def test_daemon_logs_never_hold_argument_values(shared: Daemon, workspace: Path) -> None:
    """The argument JSON of a call never reaches the log."""
    secret = "s3cr3t-token-value"  # noqa: S105 - a value to look for in the log
    with shared.raw() as conn:
        conn.invoke({"tool": "hello", "arguments": {"name": secret}, "workspace": str(workspace)})
        conn.request("classify", {"tool": "hello", "arguments": {"name": secret},
                                  "workspace": str(workspace)})
        conn.request("invoke", {"tool": "hello", "arguments": {"name": 5, "x": secret},
                                "workspace": str(workspace)})
    assert "call_finished" in shared.log()
    assert secret not in shared.log()


def test_daemon_many_connections_at_once(shared: Daemon) -> None:
    """Fifty concurrent connections are each served."""
    conns = [shared.raw() for _ in range(50)]
    try:
        for i, conn in enumerate(conns):
            conn.send({"jsonrpc": "2.0", "method": "status", "id": i})
        for i, conn in enumerate(conns):
            assert conn.receive()["id"] == i
    finally:
        for conn in conns:
            conn.close()


def test_daemon_connection_limit_refuses_extra_clients(
    home: Path, workspace: Path, tmp_base: Path
) -> None:
    """Past --max-connections, with every slot busy, a client gets ServerBusy and is closed.

    (Idle connections make room instead: tests/integration/test_hostile.py.)
    """
    d = start_daemon(home, workspace, tmp_base, ["--max-connections", "2"])
    try:
        with d.raw() as a:
            # Wait for start_daemon's readiness probe to be gone, so only `a` counts.
            while a.request("status")["result"]["connections"] != 1:
                pass
            assert "result" in a.request("list", {"subscribe": True})
            b = d.raw()
            assert "result" in b.request("list", {"subscribe": True})
            for _ in range(3):
                with d.raw() as c:
                    reply = c.receive()
                    assert reply["error"]["code"] == -32008
                    assert "2" in reply["error"]["message"]
            b.close()
    finally:
        assert d.stop() == 0
    # Refused as often as a client connects, logged once a minute with the count.
    said = [e for e in d.log_events() if e.get("event") == "connection_limit"]
    assert [(e["limit"], e["refused"]) for e in said] == [(2, 1)]


def test_daemon_batch_mixes_our_methods(shared: Daemon) -> None:
    """A batch of our methods answers each request once, in order, and skips notifications."""
    with shared.raw() as conn:
        conn.send([
            {"jsonrpc": "2.0", "method": "status", "id": "a"},
            {"jsonrpc": "2.0", "method": "status"},
            {"jsonrpc": "2.0", "method": "nope", "id": "b"},
            {"jsonrpc": "2.0", "method": "list", "params": {"catalog": "work"}, "id": "c"},
        ])
        replies = conn.receive()
    assert [r["id"] for r in replies] == ["a", "b", "c"]
    assert replies[1]["error"]["code"] == -32601


def test_daemon_refuses_peer_with_other_uid(daemon: Daemon) -> None:
    """A client running as another user gets PeerNotAllowed and is closed, each time; the
    refusals are logged once a minute per uid, not once each."""
    if os.geteuid() != 0:
        pytest.skip("needs root to connect as another user")
    import pwd

    nobody = pwd.getpwnam("nobody")
    # Let nobody reach the socket file, so the daemon's own peer check is what refuses it.
    os.chmod(daemon.socket.parent, 0o755)
    os.chmod(daemon.socket, 0o666)
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: become nobody, connect, report the reply
        os.close(read_fd)
        try:
            os.setgid(nobody.pw_gid)
            os.setuid(nobody.pw_uid)
            codes = []
            for _ in range(3):
                conn = RawConn(daemon.socket)
                codes.append(str(conn.receive()["error"]["code"]))
                conn.close()
            os.write(write_fd, " ".join(codes).encode())
        except BaseException as exc:  # report anything to the parent
            os.write(write_fd, f"error {exc!r}".encode())
        finally:
            os._exit(0)
    os.close(write_fd)
    os.waitpid(pid, 0)
    with os.fdopen(read_fd) as f:
        answer = f.read()
    assert answer == "-32009 -32009 -32009"
    said = [e for e in daemon.log_events() if e.get("event") == "peer_refused"]
    assert [(e["uid"], e["refused"]) for e in said] == [(nobody.pw_uid, 1)]


# -- a client that does not read --------------------------------------------------------

SH_TOOL = {
    "runner": "exec", "description": "run a script", "command": ["/bin/sh", "-c"],
    "schema": {"type": "object", "properties": {"script": {"type": "string"}},
               "required": ["script"]},
    "argv": {"script": "--"}, "stdin": False, "approval": "always",
}


def _sh_daemon(home: Path, workspace: Path, tmp_base: Path, timeout: int = 120) -> Daemon:
    # argv renders "--" then the script: sh -c 'eval "$2"' sh -- SCRIPT
    tool = {**SH_TOOL, "command": ["/bin/sh", "-c", 'eval "$2"', "sh"]}
    write_set(home / "tools", "sh", {**tool, "timeoutSeconds": timeout})
    return start_daemon(home, workspace, tmp_base, ["--no-watch"])


def _rss_kib(pid: int, which: str = "VmRSS:") -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(which):
                return int(line.split()[1])
    raise AssertionError(f"no {which}")


def _in_flight(d: Daemon) -> int:
    return int(d.call("status")["result"]["inFlight"])


@pytest.mark.slow
def test_daemon_unread_flood_keeps_memory_bounded(
    home: Path, workspace: Path, tmp_base: Path
) -> None:
    """A client pipelining requests it never reads stops being read; the daemon's memory stays flat."""
    d = start_daemon(home, workspace, tmp_base, ["--no-watch"])
    flood = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        before = _rss_kib(d.proc.pid)
        flood.connect(str(d.socket))
        line = b'{"jsonrpc": "2.0", "method": "status", "id": 1}\n' * 1000
        stop = threading.Event()

        def pour() -> None:
            try:
                while not stop.is_set():
                    flood.sendall(line)
            except OSError:
                pass

        writer = threading.Thread(target=pour, daemon=True)
        writer.start()
        deadline = time.monotonic() + 4
        peak = 0
        while time.monotonic() < deadline:  # a flood the daemon kept reading grew ~80 MB/s
            peak = max(peak, _rss_kib(d.proc.pid) - before)
            time.sleep(0.1)
        assert peak < 64 * 1024, f"daemon RSS grew by {peak} KiB"
        assert "result" in d.call("status")  # everyone else is still served
        stop.set()
    finally:
        flood.close()
        assert d.stop() == 0


@pytest.mark.slow
def test_daemon_unread_mcp_flood_of_non_requests_keeps_memory_bounded(
    home: Path, workspace: Path, tmp_base: Path
) -> None:
    """An MCP client pouring messages that are not requests (uncounted; each gets an error
    answer) and never reading: the daemon stops reading it, and its peak memory stays flat
    (it grew ~75 MB when each message got a task of its own)."""
    line = b'{"jsonrpc": "2.0"}\n'

    d = start_daemon(home, workspace, tmp_base, ["--no-watch"])
    flood = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        flood.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        flood.connect(str(d.socket))
        bind = {"jsonrpc": "2.0", "id": "b", "method": "mcp.bind",
                "params": {"workspace": str(workspace)}}
        flood.sendall(json.dumps(bind).encode() + b"\n")
        assert b'"result"' in flood.recv(65536)
        before = _rss_kib(d.proc.pid, "VmHWM:")
        flood.settimeout(10)
        try:
            flood.sendall(line * (4 << 20 >> 5))  # ~4 MB of lines (each one a task, before)
        except OSError:
            pass  # the daemon stopped reading: what it should do
        time.sleep(1)
        grew = _rss_kib(d.proc.pid, "VmHWM:") - before
        assert grew < 32 * 1024, f"daemon's peak RSS grew by {grew} KiB"
        assert "result" in d.call("status")
    finally:
        flood.close()
        assert d.stop() == 0


@pytest.mark.slow
def test_daemon_unread_flood_of_lines_that_are_not_json_keeps_memory_bounded(
    home: Path, workspace: Path, tmp_base: Path
) -> None:
    """A client pouring lines that do not parse (each answered -32700) and never reading:
    the daemon stops reading it once the answers back up, as for requests. It used to
    answer every line of what it had read at once: 40 KB of ``x`` lines cost it 72 MB
    (each answer a frame of 4 KiB, as orjson allocates them), half a megabyte of them a
    gigabyte."""
    d = start_daemon(home, workspace, tmp_base, ["--no-watch"])
    flood = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        flood.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        flood.connect(str(d.socket))
        assert b'"result"' in _status_bytes(flood)
        before = _rss_kib(d.proc.pid, "VmHWM:")
        flood.settimeout(5)
        try:
            flood.sendall(b"x\n" * (4 << 20 >> 1))  # 4 MB of lines
        except OSError:
            pass  # the daemon stopped reading: what it should do
        time.sleep(1)
        grew = _rss_kib(d.proc.pid, "VmHWM:") - before
        assert grew < 32 * 1024, f"daemon's peak RSS grew by {grew} KiB"
        assert "result" in d.call("status")  # everyone else is still served
    finally:
        flood.close()
        assert d.stop() == 0


def _status_bytes(sock: socket.socket) -> bytes:
    """Send one status request on ``sock`` and read its answer's bytes."""
    sock.sendall(b'{"jsonrpc": "2.0", "id": 1, "method": "status"}\n')
    sock.settimeout(10)
    answer = b""
    while not answer.endswith(b"\n"):
        chunk = sock.recv(65536)
        if not chunk:
            break
        answer += chunk
    return answer


def test_daemon_unread_client_does_not_hold_other_clients_calls(
    home: Path, workspace: Path, tmp_base: Path
) -> None:
    """Calls of a client that stops reading never keep another client's call from running."""
    d = _sh_daemon(home, workspace, tmp_base)
    stuck = d.raw()
    try:
        for i in range(8):  # answers the stuck client never reads fill its socket
            stuck.send({"jsonrpc": "2.0", "id": f"big{i}", "method": "invoke", "params": {
                "tool": "sh", "workspace": str(workspace), "arguments": {"script": "seq 1 300000"}}})
        _wait_until(lambda: _in_flight(d) == 0)
        for i in range(70):  # more calls than --max-running's default of 64, behind them
            stuck.send({"jsonrpc": "2.0", "id": i, "method": "invoke", "params": {
                "tool": "sh", "workspace": str(workspace), "arguments": {"script": "true"}}})
        with d.raw(timeout=10) as other:  # the write timeout is 30 s: a stall would show
            events, reply = other.invoke(
                {"tool": "sh", "workspace": str(workspace), "arguments": {"script": "echo hi"}}
            )
        assert reply["result"]["status"] == "ok", reply
        assert [e["method"] for e in events if e["method"] != "progress"] == [
            "started", "completed"
        ]
    finally:
        stuck.close()
        assert d.stop() == 0


@pytest.mark.slow
def test_daemon_started_is_never_lost_behind_a_backlog(
    home: Path, workspace: Path, tmp_base: Path
) -> None:
    """A call that times out while its started waits behind unread answers still yields started first."""
    d = _sh_daemon(home, workspace, tmp_base, timeout=1)
    try:
        with d.raw(timeout=30) as conn:
            # The invoke first, then enough unread answers behind it that its started
            # has to wait in the connection's queue while the call times out.
            invoke = {"jsonrpc": "2.0", "id": "inv", "method": "invoke", "params": {
                "tool": "sh", "workspace": str(workspace), "arguments": {"script": "sleep 5"}}}
            conn.send_bytes(json.dumps(invoke).encode() + b"\n"
                            + b'{"jsonrpc": "2.0", "method": "status", "id": "s"}\n' * 1500)
            _wait_until(lambda: _in_flight(d) == 1)
            _wait_until(lambda: _in_flight(d) == 0)  # timed out while we were not reading
            seen: list[str] = []
            while True:
                message = conn.receive()
                if message.get("id") == "s":
                    continue
                seen.append(message.get("method") or "response")
                if message.get("id") == "inv":
                    break
        assert [m for m in seen if m != "progress"] == ["started", "completed", "response"]
    finally:
        assert d.stop() == 0


def test_daemon_forced_stop_is_not_held_by_an_unread_client(
    home: Path, workspace: Path, tmp_base: Path
) -> None:
    """A second SIGTERM ends the daemon promptly even while a client leaves its answers unread."""
    d = _sh_daemon(home, workspace, tmp_base)
    stuck = d.raw()
    try:
        for i in range(4):  # calls that outlast the stop, started first so they are read
            stuck.send({"jsonrpc": "2.0", "id": i, "method": "invoke", "params": {
                "tool": "sh", "workspace": str(workspace),
                "arguments": {"script": "trap '' TERM; sleep 100"}}})
        _wait_until(lambda: _in_flight(d) == 4)
        for i in range(8):  # then answers the client never reads fill its socket
            stuck.send({"jsonrpc": "2.0", "id": f"big{i}", "method": "invoke", "params": {
                "tool": "sh", "workspace": str(workspace), "arguments": {"script": "seq 1 300000"}}})
        _wait_until(lambda: _in_flight(d) == 4)
        d.proc.send_signal(signal.SIGTERM)
        # Signals of one kind do not queue: send the second once the first was handled.
        _wait_until(lambda: "stop_requested" in d.log())
        d.proc.send_signal(signal.SIGTERM)
        d.proc.wait(timeout=10)  # the write timeout (30 s) must not hold the exit
    finally:
        stuck.close()
        d.stop()


def _big_sets(home: Path, count: int) -> Path:
    """``count`` sets whose manifests are each just under the 1 MiB manifest limit (a
    description of ~1 MB): a ``list`` of 70 passes the daemon's 64 MiB line."""
    description = "d" * (1_000_000 - 300)
    for i in range(count):
        write_set(home / "tools", f"big{i:02d}", {
            "runner": "exec", "description": description, "schema": {"type": "object"},
            "command": ["true"], "approval": "always",
        })
    return home


@pytest.mark.slow
def test_daemon_response_over_the_line_budget_is_an_error_naming_sizes(
    workspace: Path, tmp_base: Path
) -> None:
    """A list that would exceed the daemon's 64 MiB line is answered -32007 with both sizes;
    the connection and the daemon go on serving."""
    home = _big_sets(tmp_base / "home", 70)
    d = start_daemon(home, workspace, tmp_base, ["--no-watch"])
    try:
        with d.raw(timeout=60) as conn:
            error = conn.request("list")["error"]
            assert error["code"] == -32007, error
            assert error["data"]["limit"] == 64 * 1024 * 1024
            assert error["data"]["size"] > error["data"]["limit"]
            assert "Response too large" in error["message"] and "ask for less" in error["message"]
            assert "result" in conn.request("status")  # the same connection goes on
        assert "response_too_large" in d.log()
    finally:
        assert d.stop() == 0


@pytest.mark.slow
def test_daemon_batch_answer_over_the_line_budget_keeps_its_array_and_ids(
    workspace: Path, tmp_base: Path
) -> None:
    """A batch whose answers together would exceed the daemon's 64 MiB line (two lists of
    40 MB, each legal on its own) is still answered with one array, each answer under its
    own id: the largest answers become -32007 errors until the array fits, and the rest
    (a status, the other list) arrive whole. Never one error with id null, which says
    nothing of which requests ran and reads as the daemon's word on the connection."""
    home = _big_sets(tmp_base / "home", 40)
    d = start_daemon(home, workspace, tmp_base, ["--no-watch"])
    try:
        with d.raw(timeout=60) as conn:
            conn.send([
                {"jsonrpc": "2.0", "id": "a", "method": "list"},
                {"jsonrpc": "2.0", "id": "s", "method": "status"},
                {"jsonrpc": "2.0", "id": "b", "method": "list"},
            ])
            answers = conn.receive()
            assert isinstance(answers, list), str(answers)[:500]
            assert [a["id"] for a in answers] == ["a", "s", "b"]
            assert "result" in answers[1]
            lists = [answers[0], answers[2]]
            errors = [a["error"] for a in lists if "error" in a]
            assert len(errors) == 1, [sorted(a) for a in lists]
            assert errors[0]["code"] == -32007
            assert errors[0]["data"]["size"] > 40_000_000
            assert "Response too large" in errors[0]["message"]
            whole = next(a for a in lists if "result" in a)
            assert len(whole["result"]["tools"]) == 40
            assert "result" in conn.request("status")  # the same connection goes on
        assert "response_too_large" in d.log()
    finally:
        assert d.stop() == 0


def test_a_workspace_at_the_homes_parent_loads_the_home_sets_as_project_sets() -> None:
    """A workspace whose .crystal/tools is the home's tools folder (the home's parent: ``~``
    with the default home) has that folder scanned twice, as the reference host's
    ``ToolSetDiscovery.Collect`` does: each set loads as a project set under the project
    policy (host: ``approval: always`` does not count), its home copy hidden, each note
    twice. The home-only catalog keeps them as home sets (docs/manifest.md)."""
    base = Path(tempfile.mkdtemp(prefix="tsp-"))
    try:
        workspace = base / "user"
        home = workspace / ".crystal"
        write_set(home / "tools", "acme", {
            "runner": "exec", "description": "d", "schema": {"type": "object"},
            "command": ["true"], "approval": "always",
        })
        write_set(home / "tools", "bad", "{")
        d = start_daemon(home, workspace, base, ["--no-watch"])
        try:
            project = d.call("list", {"workspace": str(workspace)})["result"]
            home_only = d.call("list")["result"]
        finally:
            d.stop()
    finally:
        shutil.rmtree(base, ignore_errors=True)
    assert [(s["directory"], s["source"], s["state"]) for s in project["sets"]] == [
        ("acme", "home", "hidden"), ("acme", "project", "loaded"),
        ("bad", "home", "hidden"), ("bad", "project", "refused"),
    ]
    [tool] = project["tools"]
    assert (tool["source"], tool["approval"]["effective"]) == ("project", "inherit")
    assert [(n["source"], n["set"]) for n in project["notes"]] == [
        ("home", "bad"), ("project", "bad"),
    ]
    [tool] = home_only["tools"]
    assert (tool["source"], tool["approval"]["effective"]) == ("home", "always")
