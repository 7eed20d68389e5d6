"""A soak in miniature: what the daemon holds after many rounds of churn over its three
faces is what it held after one.

Each round ends calls every way they end (answered, failed, cancelled, their client
gone before or after the start) on the Unix socket, through ``toolsetctl mcp`` (a pump
killed mid-call) and over MCP HTTP (a session ended by ``DELETE``, one abandoned, a
stateless call, a POST dropped mid-call). Once every call has ended, the daemon's
descriptors, children and open connections are counted from outside: the count after the
later rounds must equal the count after the first, which has loaded everything a round
loads. A table, a descriptor or a child kept per call, connection, session or pump would
grow with the rounds.

The descriptors of the call cgroups are left out of the count: emptied cgroups are kept
as spares for later calls (at most ``cgroup.SPARE_MAX``), as many as ran at once, which a
round's timing decides.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest

from .conftest import Daemon, RawConn, eventually, processes, shut_down, start_daemon
from .http_helpers import endpoint, http, initialize, listening_urls, rpc
from .mcp_helpers import RawPump, pump_args, write_test_sets

PY = sys.executable
MODERN = {
    "io.modelcontextprotocol/protocolVersion": "2026-07-28",
    "io.modelcontextprotocol/clientCapabilities": {},
}


@pytest.fixture
def churned(home: Path, workspace: Path, tmp_base: Path) -> Iterator[tuple[Daemon, str]]:
    write_test_sets(home)
    daemon = start_daemon(
        home, workspace, tmp_base, ["--mcp-listen", "127.0.0.1:0", "--kill-grace", "1"]
    )
    try:
        yield daemon, endpoint(listening_urls(daemon)[0], workspace)
    finally:
        shut_down(daemon)


def _invoke(tool: str, workspace: Path, **extra: Any) -> dict[str, Any]:
    return {"tool": tool, "arguments": {}, "workspace": str(workspace), **extra}


def _started(conn: RawConn) -> None:
    while conn.receive().get("method") != "started":
        pass


def _native_round(daemon: Daemon, workspace: Path, n: int) -> None:
    with daemon.raw(timeout=30) as conn:
        for tool in ("progress3", "fails", "big"):
            assert "result" in conn.request("invoke", _invoke(tool, workspace))
        # Cancelled from another connection once it runs.
        conn.send({"jsonrpc": "2.0", "id": "c", "method": "invoke",
                   "params": _invoke("sleeper", workspace, callId=f"churn-{n}")})
        _started(conn)
        assert daemon.call("cancel", {"callId": f"churn-{n}"})["result"] == {"cancelled": True}
        while (reply := conn.receive()).get("id") != "c":
            pass
        assert reply["result"]["status"] == "cancelled", reply
    # Its client gone once it runs, and before it was even judged.
    with daemon.raw(timeout=30) as gone:
        gone.send({"jsonrpc": "2.0", "id": 1, "method": "invoke",
                   "params": _invoke("sleeper", workspace)})
        _started(gone)
    with daemon.raw(timeout=30) as gone:
        gone.send({"jsonrpc": "2.0", "id": 1, "method": "invoke",
                   "params": _invoke("sleeper", workspace)})


def _stdio_round(daemon: Daemon, workspace: Path) -> None:
    (workspace / "sleeper.pid").unlink(missing_ok=True)
    pump = RawPump(pump_args(daemon, workspace))
    try:
        pump.request(1, "initialize", {"protocolVersion": "2025-06-18", "capabilities": {},
                                       "clientInfo": {"name": "churn", "version": "1"}})
        pump.send({"jsonrpc": "2.0", "method": "notifications/initialized"})
        reply = pump.request(2, "tools/call", {"name": "progress3", "arguments": {}})
        assert reply["result"]["isError"] is False, reply
        pump.send(rpc(3, "tools/call", {"name": "sleeper", "arguments": {}}))
        eventually(lambda: (workspace / "sleeper.pid").exists(), what="the pump's call ran")
    finally:
        pump.proc.send_signal(signal.SIGKILL)  # the host side dies mid-call
        pump.close()


def _http_round(url: str, workspace: Path, n: int) -> None:
    for ended in (True, False):  # ended by DELETE, or abandoned
        session = initialize(url)
        reply = http(url, body=rpc(2, "tools/call", {"name": "progress3", "arguments": {}}),
                     headers={"mcp-session-id": session})
        assert reply.status == 200, reply
        if ended:
            assert http(url, "DELETE", headers={"mcp-session-id": session}).status == 204
    stateless = http(
        url,
        body=rpc(3, "tools/call", {"name": "fails", "arguments": {}, "_meta": MODERN}),
        headers={"mcp-protocol-version": "2026-07-28", "mcp-method": "tools/call",
                 "mcp-name": "fails"},
    )
    assert stateless.status == 200, stateless
    # A POST whose client leaves while its call runs.
    (workspace / "sleeper.pid").unlink(missing_ok=True)
    target = urlsplit(url)
    body = json.dumps(rpc(4, "tools/call", {"name": "sleeper", "arguments": {}})).encode()
    session = initialize(url)
    with socket.create_connection((target.hostname, target.port), timeout=30) as sock:
        sock.sendall(
            f"POST {target.path}?{target.query} HTTP/1.1\r\nHost: {target.netloc}\r\n"
            "Content-Type: application/json\r\nAccept: application/json, text/event-stream\r\n"
            f"Mcp-Session-Id: {session}\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body
        )
        eventually(lambda: (workspace / "sleeper.pid").exists(), what=f"round {n}'s HTTP call")


def _round(daemon: Daemon, url: str, n: int) -> None:
    workspace = daemon.workspace
    _native_round(daemon, workspace, n)
    _stdio_round(daemon, workspace)
    _http_round(url, workspace, n)


def _held(daemon: Daemon) -> dict[str, Any]:
    """What the daemon holds once every call has ended, counted from outside."""
    pid = daemon.proc.pid

    def settled() -> bool:
        status = daemon.call("status")["result"]
        return status["inFlight"] == 0 and status["connections"] == 1

    eventually(settled, timeout=30, what="every call ended and every client gone")
    fds: dict[str, int] = {}
    for name in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{name}")
        except OSError:
            continue  # closed while listed
        if target.startswith("/sys/fs/cgroup/"):
            continue  # a running call's cgroup, or a spare's (see the module docstring)
        kind = target.split(":", 1)[0] if ":" in target else target
        fds[kind] = fds.get(kind, 0) + 1
    status = daemon.call("status")["result"]
    return {"fds": fds, "children": _children(pid), "workspaces": status["workspaces"]}


def _children(pid: int) -> list[str]:
    """The command line of each child of ``pid``, a zombie's (one never reaped) marked,
    sorted. A live child's state (S, R, D) is the moment's, not something held: the watch
    process, woken every 50 ms, was now and then caught R on a busy machine, and a first
    count that caught it could never be matched."""
    return sorted(
        ("Z " if fields[0] == b"Z" else "")
        + cmdline.replace(b"\0", b" ")[:80].decode(errors="replace")
        for _, fields, cmdline in processes()
        if int(fields[1]) == pid
    )


@pytest.mark.slow
def test_rounds_of_churn_over_three_faces_leave_what_one_round_left(
    churned: tuple[Daemon, str],
) -> None:
    daemon, url = churned
    _round(daemon, url, 0)
    first = _held(daemon)
    for n in range(1, 7):
        _round(daemon, url, n)
    last: dict[str, Any] = {}

    def as_after_one_round() -> bool:
        last.update(_held(daemon))
        return last == first

    try:
        eventually(as_after_one_round, timeout=30, what="what one round left")
    except AssertionError:
        pytest.fail(f"after 7 rounds the daemon holds {last}; after one it held {first}")
