"""The daemon on a real socket: status, list, errors, and bad input from clients."""

from __future__ import annotations

import os
import socket
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from .conftest import Daemon, RawConn, start_daemon, write_set


def test_daemon_status_reports_its_state(daemon: Daemon) -> None:
    """status answers every contract field with the daemon's own facts."""
    result = daemon.call("status")["result"]
    assert set(result) == {
        "version", "pid", "uptimeSeconds", "socket", "home", "generation", "workspaces",
        "inFlight", "connections",
    }
    assert result["pid"] == daemon.proc.pid
    assert result["socket"] == str(daemon.socket)
    assert result["home"] == str(daemon.home)
    assert result["connections"] >= 1  # start_daemon's probe may not be reaped yet
    assert result["inFlight"] == 0


def test_daemon_socket_and_folder_are_private(daemon: Daemon) -> None:
    """The socket is 0600 and its folder 0700."""
    assert stat.S_IMODE(os.stat(daemon.socket).st_mode) == 0o600


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


def test_daemon_list_catalog_filter(daemon: Daemon) -> None:
    """list with catalog: plan omits Work-only tools."""
    plan = daemon.call("list", {"catalog": "plan"})["result"]
    assert "notes_index" not in [t["name"] for t in plan["tools"]]
    work = daemon.call("list", {"catalog": "work"})["result"]
    assert "notes_index" in [t["name"] for t in work["tools"]]


@pytest.mark.parametrize(
    ("params", "code", "needle"),
    [
        ({"workspace": "relative/path"}, -32006, "absolute"),
        ({"workspace": "/nonexistent/toolsetd/ws"}, -32006, "not a directory"),
        ({"workspace": 5}, -32602, "workspace"),
        ({"catalog": "review"}, -32602, "catalog"),
        ({"bogus": 1}, -32602, "bogus"),
    ],
)
def test_daemon_list_rejects_bad_params_naming_the_field(
    daemon: Daemon, params: dict[str, object], code: int, needle: str
) -> None:
    """A bad list param gets the contract's code and a message naming the field."""
    error = daemon.call("list", params)["error"]
    assert error["code"] == code
    assert needle in error["message"]


def test_daemon_unknown_method_and_positional_params(daemon: Daemon) -> None:
    """An unknown method names itself; positional params are refused as by-name only."""
    error = daemon.call("deploy")["error"]
    assert error["code"] == -32601
    assert "'deploy'" in error["message"]
    with daemon.raw() as conn:
        conn.send({"jsonrpc": "2.0", "method": "status", "params": [1], "id": 1})
        reply = conn.receive()
    assert reply["error"]["code"] == -32602
    assert "named" in reply["error"]["message"]


def test_daemon_garbage_and_bad_utf8_cost_only_that_line(daemon: Daemon) -> None:
    """A garbage line and an invalid UTF-8 line each get a parse error; the connection goes on."""
    with daemon.raw() as conn:
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


def test_daemon_client_leaving_mid_line_harms_nobody(daemon: Daemon) -> None:
    """A client that disconnects in the middle of a line costs only its own connection."""
    conn = daemon.raw()
    conn.send_bytes(b'{"jsonrpc": "2.0", "method": "sta')
    conn.close()
    assert "result" in daemon.call("status")


def test_daemon_second_instance_on_live_socket_is_refused(
    daemon: Daemon, tmp_base: Path
) -> None:
    """A second daemon on a live socket exits non-zero with a clear message."""
    proc = subprocess.run(  # noqa: S603
        [sys.executable, "-m", "toolsetd.daemon", "--home", str(daemon.home),
         "--socket", str(daemon.socket)],
        capture_output=True, text=True, timeout=30, check=False,
    )
    assert proc.returncode != 0
    assert "toolsetd:" in proc.stderr
    assert "result" in daemon.call("status")


def test_daemon_stale_socket_is_replaced(home: Path, workspace: Path, tmp_base: Path) -> None:
    """A socket file nobody listens on is replaced at startup."""
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stale.bind(str(tmp_base / "s.sock"))
    stale.close()
    d = start_daemon(home, workspace, tmp_base)
    try:
        assert "result" in d.call("status")
    finally:
        assert d.stop() == 0
    assert not (tmp_base / "s.sock").exists()


def test_daemon_logs_never_hold_argument_values(daemon: Daemon, workspace: Path) -> None:
    """The argument JSON of a call never reaches the log."""
    secret = "s3cr3t-token-value"
    with daemon.raw() as conn:
        conn.invoke({"tool": "hello", "arguments": {"name": secret}, "workspace": str(workspace)})
        conn.request("classify", {"tool": "hello", "arguments": {"name": secret},
                                  "workspace": str(workspace)})
        conn.request("invoke", {"tool": "hello", "arguments": {"name": 5, "x": secret},
                                "workspace": str(workspace)})
    assert "call_finished" in daemon.log()
    assert secret not in daemon.log()


def test_daemon_many_connections_at_once(daemon: Daemon) -> None:
    """Fifty concurrent connections are each served."""
    conns = [daemon.raw() for _ in range(50)]
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
    """Past --max-connections a client gets ServerBusy and is closed."""
    d = start_daemon(home, workspace, tmp_base, ["--max-connections", "2"])
    try:
        with d.raw() as a:
            # Wait for start_daemon's readiness probe to be gone, so only `a` counts.
            while a.request("status")["result"]["connections"] != 1:
                pass
            b = d.raw()
            assert "result" in b.request("status")
            with d.raw() as c:
                reply = c.receive()
                assert reply["error"]["code"] == -32008
                assert "2" in reply["error"]["message"]
            b.close()
    finally:
        assert d.stop() == 0


def test_daemon_batch_mixes_our_methods(daemon: Daemon) -> None:
    """A batch of our methods answers each request once, in order, and skips notifications."""
    with daemon.raw() as conn:
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
    """A client running as another user gets PeerNotAllowed and is closed."""
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
            conn = RawConn(daemon.socket)
            reply = conn.receive()
            os.write(write_fd, str(reply["error"]["code"]).encode())
        except BaseException as exc:  # noqa: BLE001 - report anything to the parent
            os.write(write_fd, f"error {exc!r}".encode())
        finally:
            os._exit(0)
    os.close(write_fd)
    os.waitpid(pid, 0)
    with os.fdopen(read_fd) as f:
        answer = f.read()
    assert answer == "-32009"
