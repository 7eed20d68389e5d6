"""Nothing lost, nothing garbled: numbers as written, limits that agree (issue 11).

One daemon for the module serves a few small sets written here. The tests speak raw bytes
on the socket where the exact text of a number matters (the test's own JSON parser would
otherwise hide what the daemon wrote).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest

from .conftest import Daemon, RawConn, daemon_in, write_set

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
    write_set(tools, "wide", {
        "runner": "exec", "description": "a schema with exact numbers", "command": ["echo.sh"],
        "stdin": True, "approval": "always", "argv": {"n": "--n"},
        "schema": {"type": "object", "properties": {"n": {
            "type": "number", "maximum": 123456789012345678901234567890, "multipleOf": 0.50,
        }}},
    }, **{"echo.sh": _ECHO})
    write_set(tools, "inline", {
        "runner": "exec", "description": "prints a content file", "command": ["cat.sh"],
        "stdin": False, "approval": "always", "output": "content",
        "schema": {"type": "object"}, "argv": {"spec": "--spec"},
    }, **{"cat.sh": _SH + 'cat "$2"\necho warn >&2\n'})
    write_set(tools, "reader", {
        "runner": "exec", "description": "reads a file", "command": ["read.sh"],
        "stdin": False, "approval": "always", "pathArguments": ["path"],
        "schema": {"type": "object"}, "argv": {"path": "--path"},
    }, **{"read.sh": _SH + 'cat "$2"\n'})
    write_set(tools, "bom", {
        "runner": "exec", "description": "starts each stream with a byte order mark",
        "command": ["bom.sh"], "stdin": False, "approval": "always", "schema": {"type": "object"},
    }, **{"bom.sh": _SH + "printf '\\357\\273\\277out'\nprintf '\\357\\273\\277err' >&2\n"})
    write_set(tools, "asker", {
        "runner": "exec", "description": "needs approval", "command": ["read.sh"],
        "stdin": False, "pathArguments": ["path"],
        "schema": {"type": "object"}, "argv": {"path": "--path"},
    }, **{"read.sh": _SH + 'cat "$2"\n'})


@pytest.fixture(scope="module")
def user_home() -> Iterator[Path]:
    """The daemon's $HOME, with a private key in ~/.ssh."""
    user = Path(tempfile.mkdtemp(prefix="tsu-"))
    (user / ".ssh").mkdir()
    (user / ".ssh" / "id_rsa").write_text("PRIVATE KEY")
    yield user
    shutil.rmtree(user, ignore_errors=True)


@pytest.fixture(scope="module")
def fid(user_home: Path) -> Iterator[Daemon]:
    with daemon_in("tsf-", lambda home, _: _write_sets(home / "tools"),
                   ["--progress-interval", "60"], env={"HOME": str(user_home)}) as d:
        yield d


def _lines(conn: RawConn, text: bytes) -> Iterator[bytes]:
    """Send one raw line; yield each raw line received after it."""
    conn.send_bytes(text + b"\n")
    while True:
        while b"\n" not in conn._buffer:  # the test's own helper
            chunk = conn.sock.recv(1 << 20)
            if not chunk:
                raise EOFError("connection closed")
            conn._buffer += chunk
        line, conn._buffer = conn._buffer.split(b"\n", 1)
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


def test_a_number_past_the_double_range_is_a_number(fid: Daemon) -> None:
    """1e999 is valid JSON: it reaches the child as written, and a schema bound refuses it."""
    workspace = json.dumps(str(fid.workspace)).encode()
    with fid.raw() as conn:
        frame = (b'{"jsonrpc":"2.0","id":7,"method":"invoke","params":{"tool":"nums",'
                 b'"arguments":{"n":1e999,"m":-1E+400},"workspace":' + workspace + b"}}")
        response = json.loads(_response(conn, frame, b"7"))
        text = response["result"]["content"][0]["text"]
        assert text.split("\n")[1:5] == ["--n", "1e999", "--m", "-1E+400"], text
        frame = (b'{"jsonrpc":"2.0","id":8,"method":"invoke","params":{"tool":"wide",'
                 b'"arguments":{"n":1e999},"workspace":' + workspace + b"}}")
        error = json.loads(_response(conn, frame, b"8"))["error"]
        assert error["code"] == -32002, error  # over its maximum, not a parse error
        wide = b"1" + b"0" * 400  # an integer past the double range: orjson's "infinity" too
        frame = (b'{"jsonrpc":"2.0","id":9,"method":"invoke","params":{"tool":"nums",'
                 b'"arguments":{"n":' + wide + b'},"workspace":' + workspace + b"}}")
        text = json.loads(_response(conn, frame, b"9"))["result"]["content"][0]["text"]
        assert text.split("\n")[1:3] == ["--n", wide.decode()], text
        frame = (b'{"jsonrpc":"2.0","id":10,"method":"invoke","params":{"tool":"wide",'
                 b'"arguments":{"n":' + wide + b'},"workspace":' + workspace + b"}}")
        error = json.loads(_response(conn, frame, b"10"))["error"]
        assert error["code"] == -32002, error  # over its maximum, no crash
        # A multiple of 0.50, decided exactly though no double holds it: only the bound fails.
        messages = [e["message"] for e in error["data"]["errors"]]
        assert len(messages) == 1, error
        assert messages[0].startswith("/n: expected a number <= 1234567890"), error


def test_toolsetctl_invoke_passes_the_numbers_as_typed(fid: Daemon) -> None:
    """The whole chain: --args text, the wire, the daemon, argv and stdin of the child."""
    proc = _ctl(fid, "invoke", "nums", "--args", _NUMBERS.decode())
    assert proc.returncode == 0, proc.stderr
    assert "--n\n1.50\n--m\n1e3\n--big\n123456789012345678901234567890\n--z\n-0" in proc.stdout
    assert "stdin=" + _NUMBERS.replace(b" ", b"").decode() in proc.stdout, proc.stdout


def test_classify_echoes_the_numbers_as_written(fid: Daemon) -> None:
    frame = (b'{"jsonrpc":"2.0","id":2,"method":"classify","params":{"tool":"nums","arguments":'
             + _NUMBERS + b',"workspace":' + json.dumps(str(fid.workspace)).encode() + b"}}")
    with fid.raw() as conn:
        line = _response(conn, frame, b"2")
    assert b'"arguments":' + _NUMBERS.replace(b" ", b"") in line, line


def test_a_schema_with_a_wide_integer_is_listed_exactly(fid: Daemon) -> None:
    """A manifest's integer past 64 bits reaches list as written; list never fails on it."""
    frame = b'{"jsonrpc":"2.0","id":3,"method":"list"}'
    with fid.raw() as conn:
        line = _response(conn, frame, b"3")
    assert b'"maximum":123456789012345678901234567890' in line, line[:300]
    tool = next(t for t in json.loads(line)["result"]["tools"] if t["name"] == "wide")
    assert tool["inputSchema"]["properties"]["n"]["maximum"] == 123456789012345678901234567890
    with fid.raw() as conn:  # and the tool runs, its argument checked against that schema
        _events, reply = conn.invoke({"tool": "wide", "arguments": {"n": 2.5},
                                     "workspace": str(fid.workspace)})
    assert reply["result"]["status"] == "ok", reply


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


def _inventory_sets(home: Path, workspace: Path) -> None:
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
    # Invalid names whose order is .NET's ordinal one (UTF-16), not Python's code points'.
    for odd in ("\U0001f600x", "\ue000x"):
        write_set(tools, odd, {"runner": "exec", "tools": [{**tool, "name": "odd"}]})
    # A valid dotnet manifest: parsed, then skipped with a note (no .NET runtime). Its row
    # must not depend on whether a daemon answers.
    write_set(tools, "dn", {"runner": "dotnet", "assembly": "a.dll", "tools": {
        "dn_x": {"catalogs": ["plan"]}, "dn_y": {"approval": "always"}}})


@pytest.fixture(scope="module")
def inventory_daemon() -> Iterator[Daemon]:
    """Sets that did not load, each a different way, plus a two-catalog set."""
    with daemon_in("tsv-", _inventory_sets, ["--no-watch"]) as d:
        yield d


@pytest.mark.parametrize("args", [("list",), ("list", "--catalog", "plan"),
                                  ("list", "--catalog", "work"), ("show", "off"),
                                  ("show", "web", "--source", "home"), ("show", "bad name"),
                                  ("show", "dup"), ("show", "dn")])
def test_inventory_agrees_with_and_without_a_daemon(inventory_daemon: Daemon, args: tuple[str, ...]) -> None:
    d = inventory_daemon
    online = _ctl(d, *args)
    offline = _ctl(d, *args, online=False)
    assert "not running" in offline.stderr and "not running" not in online.stderr
    assert online.stdout == offline.stdout, (online.stdout, offline.stdout)
    assert online.returncode == offline.returncode


def _discovery_off_sets(home: Path, workspace: Path) -> None:
    _inventory_sets(home, workspace)
    (home / "config.json").write_text('{"externalTools": false}')


@pytest.mark.parametrize("args", [("list",), ("list", "--catalog", "plan"), ("show", "off"),
                                  ("show", "web")])
def test_inventory_with_discovery_off_lists_the_files(args: tuple[str, ...]) -> None:
    """With ``externalTools: false`` the inventory still lists the sets on disk.

    The reference host's ``tools list``/``show`` read the manifests whatever discovery
    says, then add the discovery-off line; so did toolsetctl without a daemon. With a
    daemon (which scans nothing then) it printed ``No tool sets.`` and ``show`` failed
    with ``Tool set 'off' was not found.``.
    """
    with daemon_in("tsv-", _discovery_off_sets, ["--no-watch"]) as d:
        online = _ctl(d, *args, "--format", "text")
        offline = _ctl(d, *args, "--format", "text", online=False)
    assert online.returncode == offline.returncode == 0, (online.stderr, offline.stderr)
    assert online.stdout == offline.stdout, (online.stdout, offline.stdout)
    assert "No tool sets." not in online.stdout
    assert online.stdout.rstrip().endswith("until external tool discovery is turned on.")


def test_inventory_tools_cells(inventory_daemon: Daemon) -> None:
    d = inventory_daemon
    out = _ctl(d, "list").stdout
    rows = [line.strip() for line in out.splitlines()]
    off = next(row for row in rows if row.startswith("off "))
    assert off.endswith("off_a (always), off_b"), out
    web_home = next(row for row in rows if row.startswith("web ") and "Home" in row)
    assert web_home.endswith(" web"), out
    assert "m_work" not in _ctl(d, "list", "--catalog", "plan").stdout
    # A dotnet set's declared tools are its overlays, as the reference host lists them
    # (they were "-", on the wire "declaredTools": []), though it never loads.
    dn = next(row for row in rows if row.startswith("dn "))
    assert dn.endswith("dn_x, dn_y (always)"), out
    work = _ctl(d, "list", "--catalog", "work").stdout
    assert next(r for r in work.splitlines() if r.startswith("dn ")).endswith(" dn_y (always)")
    entry = next(s for s in d.call("list")["result"]["sets"] if s["directory"] == "dn")
    assert (entry["state"], entry["tools"], entry["declaredTools"]) == ("refused", [], [
        {"name": "dn_x", "approval": "inherit", "catalogs": ["plan"]},
        {"name": "dn_y", "approval": "always", "catalogs": ["plan", "work"]}])


def test_invalid_name_error_cell_on_the_wire(inventory_daemon: Daemon) -> None:
    entry = next(s for s in inventory_daemon.call("list")["result"]["sets"]
                 if s["directory"] == "bad name")
    assert entry["error"] == "directory name is invalid."
    # path is the set's folder, not its tools.json (docs/protocol.md, list).
    assert entry["path"] == str(inventory_daemon.home / "tools" / "bad name")
    doc = (_REPO / "docs" / "protocol.md").read_text()
    assert "* `directory`, `source`, `path` (the set's folder" in doc


# -- item 3: what the daemon may send, its client accepts ---------------------------------

_PNG = b"\x89PNG\r\n\x1a\n"
_MIB = 1024 * 1024


def _content_tool(tools: Path) -> None:
    # Prints the content JSON given in $1 (a file name in the workspace), then floods stderr
    # with $2 bytes of \x01, the character with the longest JSON escape.
    write_set(tools, "pics", {
        "runner": "exec", "description": "returns images", "command": ["pics.sh"],
        "stdin": False, "approval": "always", "output": "content",
        "schema": {"type": "object"}, "argv": {"spec": "--spec", "noise": "--noise"},
    }, **{"pics.sh": _SH + 'cat "$2"\nhead -c "$4" /dev/zero | tr "\\000" "\\001" >&2\n'})


def _image(path: Path, size: int) -> None:
    with open(path, "wb") as f:
        f.write(_PNG)
        f.truncate(size)


@pytest.fixture(scope="module")
def big() -> Iterator[Daemon]:
    """A daemon at the largest output limit, with the content tool."""
    with daemon_in("tsb-", lambda home, _: _content_tool(home / "tools"),
                   ["--progress-interval", "60", "--output-limit", "1000000"]) as d:
        yield d


def _invoke_with_client(d: Daemon, arguments: dict[str, Any]) -> dict[str, Any]:
    from toolsetd.client.client import Client

    async def go() -> dict[str, Any]:
        async with await Client.connect(d.socket) as client:
            try:
                return await client.invoke("pics", arguments, d.workspace, images=True)
            finally:
                # aclose leaves the notification stream's receiving end open (a
                # ResourceWarning when it is collected): close it here.
                client.notifications().close()

    return anyio.run(go)


@pytest.mark.slow
def test_the_largest_legal_result_reaches_the_bundled_client(big: Daemon) -> None:
    """32 MiB of images by path plus a text at the largest output limit, all escapes."""
    _image(big.workspace / "a.png", 20 * _MIB)
    _image(big.workspace / "b.png", 12 * _MIB)
    (big.workspace / "spec.json").write_text(json.dumps({"text": "t", "images": [
        {"mimeType": "image/png", "path": "a.png"}, {"mimeType": "image/png", "path": "b.png"}]}))
    result = _invoke_with_client(big, {"spec": "spec.json", "noise": 1_100_000})
    assert result["status"] == "ok", result["content"][0]["text"][:300]
    text, first, second = result["content"]
    assert text["text"].startswith("t\n\x01") and "[truncated to 1000000 characters]" in text["text"]
    assert len(first["data"]) == (20 * _MIB + 2) // 3 * 4
    assert len(second["data"]) == (12 * _MIB + 2) // 3 * 4


def test_a_15_mib_image_by_path_reaches_the_bundled_client(big: Daemon) -> None:
    _image(big.workspace / "c.png", 15 * _MIB)
    (big.workspace / "c.json").write_text(json.dumps({"images": [
        {"mimeType": "image/png", "path": "c.png"}]}))
    result = _invoke_with_client(big, {"spec": "c.json", "noise": 0})
    assert result["status"] == "ok"
    assert len(result["content"][1]["data"]) == 15 * _MIB // 3 * 4


def test_images_over_the_result_limit_say_so(big: Daemon) -> None:
    for name in ("d1", "d2"):
        _image(big.workspace / f"{name}.png", 17 * _MIB)
    (big.workspace / "d.json").write_text(json.dumps({"images": [
        {"mimeType": "image/png", "path": "d1.png"}, {"mimeType": "image/png", "path": "d2.png"}]}))
    result = _invoke_with_client(big, {"spec": "d.json", "noise": 0})
    assert result["status"] == "error"
    assert result["content"][0]["text"].startswith(
        "The images of this result exceed the 32 MiB limit of one result"), result


def test_inline_base64_over_the_output_limit_names_sizes_and_path(fid: Daemon) -> None:
    inline = {"images": [{"mimeType": "image/png", "base64": "A" * 200 * 1024}]}
    (fid.workspace / "inline.json").write_text(json.dumps(inline))
    with fid.raw() as conn:
        _, response = conn.invoke({"tool": "inline", "arguments": {"spec": "inline.json"},
                                   "workspace": str(fid.workspace), "images": True})
    text = response["result"]["content"][0]["text"]
    size = len(json.dumps(inline)) + 0
    assert text.startswith("Tool output exceeds the output limit."), text
    assert f"{size:,} bytes" in text and "100,000 characters" in text and '"path"' in text, text


def test_output_limit_above_the_line_budget_is_refused(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "toolsetd.daemon", "--output-limit", "1000001",
                           "--socket", str(tmp_path / "s.sock")],
                          capture_output=True, text=True, timeout=30, check=False)
    assert proc.returncode == 2 and "--output-limit: must be at most 1000000" in proc.stderr


def test_images_refused_without_the_multimodal_channel_stand_alone(fid: Daemon) -> None:
    """images: false and declared images: the reference message alone, no stderr (docs)."""
    (fid.workspace / "one.json").write_text(json.dumps(
        {"text": "t", "images": [{"mimeType": "image/png", "base64": "iVBORw0KGgo="}]}))
    with fid.raw() as conn:
        _, response = conn.invoke({"tool": "inline", "arguments": {"spec": "one.json"},
                                   "workspace": str(fid.workspace), "images": False})
    result = response["result"]
    assert result["isError"] is True
    assert result["content"] == [{"type": "text", "text": "This model cannot accept tool images."}]


# -- item 9: credential paths by identity --------------------------------------------------


def test_a_hard_link_to_a_key_is_forbidden_not_workspace(fid: Daemon, user_home: Path) -> None:
    key = user_home / ".ssh" / "id_rsa"
    link = fid.workspace / "notes.txt"
    if not link.exists():
        os.link(key, link)
    params = {"tool": "reader", "arguments": {"path": "notes.txt"}, "workspace": str(fid.workspace)}
    result = fid.call("classify", params)["result"]
    assert result["paths"][0]["scope"] == "forbidden", result
    direct = fid.call("classify", {**params, "arguments": {"path": str(key)}})["result"]
    assert result["decision"] == direct["decision"] != "allow", (result, direct)
    assert "hard link" in result["reason"], result
    with fid.raw() as conn:
        _, response = conn.invoke(params)
    assert response["error"]["code"] in (-32003, -32004), response
    assert "PRIVATE KEY" not in json.dumps(response)


def test_an_image_path_hard_linked_to_a_key_is_refused(fid: Daemon, user_home: Path) -> None:
    key = user_home / ".ssh" / "id_rsa"
    link = fid.workspace / "pic.png"
    if not link.exists():
        os.link(key, link)
    (fid.workspace / "pic.json").write_text(json.dumps(
        {"images": [{"mimeType": "image/png", "path": "pic.png"}]}))
    with fid.raw() as conn:
        _, response = conn.invoke({"tool": "inline", "arguments": {"spec": "pic.json"},
                                   "workspace": str(fid.workspace), "images": True})
    text = response["result"]["content"][0]["text"]
    assert text.startswith("Reading credential paths is not allowed."), text


_PNG_1X1 = bytes.fromhex(
    "89504e470d0a1a0a0000000d49484452000000010000000108060000001f15c489"
    "0000000d49444154789c63f8cfc0f01f0005000201a5f0a1a60000000049454e44ae426082"
)


@pytest.mark.parametrize(
    ("path", "expected"),
    [
        (" dot.png\n", "image"),
        ("~/dot.png", "Path is outside the workspace."),
    ],
    ids=["trimmed", "tilde-is-the-user-profile"],
)
def test_an_image_path_is_resolved_as_the_reference_host_resolves_it(
    fid: Daemon, user_home: Path, path: str, expected: str
) -> None:
    """A content image ``path`` is trimmed and ``~`` expands, as Workspace.TryNormalize does.

    toolsetd joined the text as sent to the workspace: ``" dot.png\\n"`` was ``File not
    found:  dot.png`` and ``~/dot.png`` was looked up as ``<ws>/~/dot.png`` (``File not
    found``) where the reference host answers ``Path is outside the workspace.``
    """
    (fid.workspace / "dot.png").write_bytes(_PNG_1X1)
    (user_home / "dot.png").write_bytes(_PNG_1X1)
    (fid.workspace / "dot.json").write_text(json.dumps(
        {"images": [{"mimeType": "image/png", "path": path}]}))
    with fid.raw() as conn:
        _, response = conn.invoke({"tool": "inline", "arguments": {"spec": "dot.json"},
                                   "workspace": str(fid.workspace), "images": True})
    content = response["result"]["content"]
    if expected == "image":
        assert [block["type"] for block in content] == ["text", "image"], content
    else:
        assert content[0]["text"].startswith(expected), content


# -- item 10: the docs say what the daemon does ---------------------------------------------

_REPO = Path(__file__).resolve().parents[2]


def test_parse_error_transcripts_match_the_daemon(fid: Daemon) -> None:
    """The Framing transcript's -32700 answers are what the daemon sends, byte for byte."""
    lines = (_REPO / "docs" / "protocol.md").read_text().splitlines()
    pairs = [(lines[i][2:], lines[i + 1][2:]) for i in range(len(lines) - 1)
             if lines[i].startswith("→ ") and "-32700" in lines[i + 1]]
    assert len(pairs) == 2, pairs
    with fid.raw() as conn:
        for sent, expected in pairs:
            data = sent.encode().decode("unicode_escape").encode("latin-1")
            conn.send_bytes(data + b"\n")
            assert conn.receive() == json.loads(expected), sent


def test_error_transcripts_match_the_daemon(daemon: Daemon) -> None:
    """Every error answer protocol.md prints in full (nothing shortened with ``...``) for a
    request on the bundled example sets is what a daemon over them answers: the
    message, the code and the data (the transcripts' workspace is this test's)."""
    lines = (_REPO / "docs" / "protocol.md").read_text().splitlines()
    demo_only = re.compile(r"\b(build|spew|fdcheck|envdump|hang)\b")  # the page's own sets
    pairs = [
        (lines[i][2:], lines[i + 1][2:])
        for i in range(len(lines) - 1)
        if lines[i].startswith("→ ")
        and lines[i + 1].startswith("← ")
        and '"error":{"code"' in lines[i + 1]
        and "..." not in lines[i + 1]
        and not re.search(r"-32(700|007)", lines[i + 1])  # framing: the test above, Limits
        and not demo_only.search(lines[i] + lines[i + 1])
    ]
    assert len(pairs) >= 8, pairs
    workspace = str(daemon.workspace)
    with daemon.raw() as conn:
        for sent, expected in pairs:
            conn.send(json.loads(sent.replace("/tmp/tsd.Udb2/ws", workspace)))
            answer = json.loads(expected.replace("/tmp/tsd.Udb2/ws", workspace))
            assert conn.receive() == answer, sent


def test_the_path_fence_runs_before_the_approval_decision(fid: Daemon) -> None:
    """An ask tool with an unusable path: -32002 (the fence), not -32004 (docs/protocol.md)."""
    params = {"tool": "asker", "arguments": {"path": "a\x00b"}, "workspace": str(fid.workspace)}
    assert fid.call("classify", params)["result"]["decision"] == "ask"
    with fid.raw() as conn:
        _, response = conn.invoke(params)
    assert response["error"]["code"] == -32002, response


def test_a_leading_byte_order_mark_is_dropped_from_each_stream(fid: Daemon) -> None:
    """A UTF-8 BOM at the start of stdout or stderr is not part of the text.

    The reference host reads both pipes with a StreamReader that detects and drops it, so
    a tool that starts its output with a BOM shows the model `exit 0\\nout\\nerr`; a BOM
    later in the stream is text and stays.
    """
    with fid.raw() as conn:
        _, reply = conn.invoke({"tool": "bom", "arguments": {}, "workspace": str(fid.workspace)})
    assert reply["result"]["content"] == [{"type": "text", "text": "exit 0\nout\nerr"}]
    assert reply["result"]["stdoutBytes"] == 6
