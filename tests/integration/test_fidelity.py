"""Nothing lost, nothing garbled: numbers as written, limits that agree (issue 11).

One daemon for the module serves a few small sets written here. The tests speak raw bytes
on the socket where the exact text of a number matters (the test's own JSON parser would
otherwise hide what the daemon wrote).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from .conftest import Daemon, RawConn, start_daemon, write_set

_SH = "#!/bin/sh\n"

# Prints each argv word on its own line, then the stdin it was given.
_ECHO = _SH + 'for a in "$@"; do printf "%s\\n" "$a"; done\nprintf "stdin=%s" "$(cat)"\n'


def _write_sets(tools: Path) -> None:
    write_set(tools, "nums", {
        "runner": "exec", "description": "echoes numbers", "command": ["echo.sh"],
        "stdin": True, "approval": "always",
        "schema": {"type": "object"},
        "argv": {"n": "--n", "m": "--m", "big": "--big", "z": "--z"},
    }, **{"echo.sh": _ECHO})


@pytest.fixture(scope="module")
def fid() -> Iterator[Daemon]:
    base = Path(tempfile.mkdtemp(prefix="tsf-"))
    home = base / "home"
    _write_sets(home / "tools")
    workspace = base / "ws"
    workspace.mkdir()
    d = start_daemon(home, workspace, base, ["--progress-interval", "60"])
    try:
        yield d
    finally:
        d.stop()
        shutil.rmtree(base, ignore_errors=True)


def _lines(conn: RawConn, text: bytes) -> Iterator[bytes]:
    """Send one raw line; yield each raw line received after it."""
    conn.send_bytes(text + b"\n")
    while True:
        while b"\n" not in conn._buffer:  # noqa: SLF001 (the test's own helper)
            chunk = conn.sock.recv(1 << 20)
            if not chunk:
                raise EOFError("connection closed")
            conn._buffer += chunk  # noqa: SLF001
        line, conn._buffer = conn._buffer.split(b"\n", 1)  # noqa: SLF001
        yield line


def _response(conn: RawConn, text: bytes, request_id: bytes) -> bytes:
    """The raw response line to a request sent as raw text."""
    for line in _lines(conn, text):
        if b'"method"' not in line[:40] and b'"id":' + request_id in line:
            return line
    raise AssertionError("unreachable")


_NUMBERS = b'{"n": 1.50, "m": 1e3, "big": 123456789012345678901234567890, "z": -0}'


def test_numbers_reach_argv_and_stdin_as_written(fid: Daemon) -> None:
    frame = (b'{"jsonrpc":"2.0","id":1,"method":"invoke","params":{"tool":"nums","arguments":'
             + _NUMBERS + b',"workspace":' + json.dumps(str(fid.workspace)).encode() + b"}}")
    with fid.raw() as conn:
        response = json.loads(_response(conn, frame, b"1"))
    text = response["result"]["content"][0]["text"]
    words = text.split("\n")
    assert words.pop(0) == "exit 0", text
    assert words[:8] == ["--n", "1.50", "--m", "1e3", "--big", "123456789012345678901234567890",
                         "--z", "-0"], text
    assert words[8] == "stdin=" + _NUMBERS.replace(b" ", b"").decode(), text


def test_classify_echoes_the_numbers_as_written(fid: Daemon) -> None:
    frame = (b'{"jsonrpc":"2.0","id":2,"method":"classify","params":{"tool":"nums","arguments":'
             + _NUMBERS + b',"workspace":' + json.dumps(str(fid.workspace)).encode() + b"}}")
    with fid.raw() as conn:
        line = _response(conn, frame, b"2")
    assert b'"arguments":' + _NUMBERS.replace(b" ", b"") in line, line


def test_a_wide_integer_id_is_echoed_exactly(fid: Daemon) -> None:
    # 2**70: wider than 64 bits, a valid JSON-RPC integer id; never a float.
    wide = str(2**70).encode()
    with fid.raw() as conn:
        line = _response(conn, b'{"jsonrpc":"2.0","id":' + wide + b',"method":"status"}', wide)
    value = json.loads(line)
    assert value["id"] == 2**70 and "result" in value, line


# -- item 2: the inventory is the same with and without a daemon ---------------------------


def _ctl(d: Daemon, *args: str, online: bool = True) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "TOOLSETD_SOCKET"}
    socket_path = d.socket if online else d.socket.with_name("none.sock")
    return subprocess.run(
        [sys.executable, "-m", "toolsetd.client", "--socket", str(socket_path),
         "--workspace", str(d.workspace), "--home", str(d.home), *args],
        capture_output=True, text=True, timeout=30, env=env, check=False,
    )


@pytest.fixture(scope="module")
def inventory_daemon() -> Iterator[Daemon]:
    """Sets that did not load, each a different way, plus a two-catalog set."""
    base = Path(tempfile.mkdtemp(prefix="tsv-"))
    home, workspace = base / "home", base / "ws"
    tool = {"description": "d", "schema": {"type": "object"}, "command": ["x"]}
    tools = home / "tools"
    write_set(tools, "off", {"runner": "exec", "enabled": False, "tools": [
        {**tool, "name": "off_a", "approval": "always"}, {**tool, "name": "off_b"}]})
    write_set(tools, "web", {"runner": "exec", "tools": [{**tool, "name": "web"}]})
    write_set(workspace / ".crystal" / "tools", "web", {
        "runner": "exec", "tools": [{**tool, "name": "web_project"}]})
    write_set(tools, "bad name", {"runner": "exec", "tools": [{**tool, "name": "bad"}]})
    write_set(tools, "dup", {"runner": "exec", "tools": [{**tool, "name": "web_project"}]})
    write_set(tools, "mixed", {"runner": "exec", "tools": [
        {**tool, "name": "m_plan", "catalogs": ["plan"]},
        {**tool, "name": "m_work", "catalogs": ["work"]}]})
    write_set(tools, "broken", '{"runner": "exec", "tools": [')
    d = start_daemon(home, workspace, base, ["--no-watch"])
    try:
        yield d
    finally:
        d.stop()
        shutil.rmtree(base, ignore_errors=True)


@pytest.mark.parametrize("args", [("list",), ("list", "--catalog", "plan"),
                                  ("list", "--catalog", "work"), ("show", "off"),
                                  ("show", "web", "--source", "home"), ("show", "bad name"),
                                  ("show", "dup")])
def test_inventory_agrees_with_and_without_a_daemon(inventory_daemon: Daemon, args: tuple[str, ...]) -> None:
    d = inventory_daemon
    online = _ctl(d, *args)
    offline = _ctl(d, *args, online=False)
    assert "not running" in offline.stderr and "not running" not in online.stderr
    assert online.stdout == offline.stdout, (online.stdout, offline.stdout)
    assert online.returncode == offline.returncode


def test_inventory_tools_cells(inventory_daemon: Daemon) -> None:
    d = inventory_daemon
    out = _ctl(d, "list").stdout
    rows = [line.strip() for line in out.splitlines()]
    off = next(row for row in rows if row.startswith("off "))
    assert off.endswith("off_a (always), off_b"), out
    web_home = next(row for row in rows if row.startswith("web ") and "Home" in row)
    assert web_home.endswith(" web"), out
    assert "m_work" not in _ctl(d, "list", "--catalog", "plan").stdout


def test_invalid_name_error_cell_on_the_wire(inventory_daemon: Daemon) -> None:
    entry = next(s for s in inventory_daemon.call("list")["result"]["sets"]
                 if s["directory"] == "bad name")
    assert entry["error"] == "directory name is invalid."
