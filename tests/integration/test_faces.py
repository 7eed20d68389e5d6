"""One core, three faces: the same call through ``invoke``, ``toolsetctl mcp`` and HTTP.

The faces only translate shapes (contract §7); the decision, ``isError`` and the text the
model reads must be the same on each. One daemon for the module; each case is sent through
all three faces (``faces.py``) and their outcomes compared.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from http.client import HTTPConnection
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest

from .conftest import Daemon, RawConn, eventually, shut_down, write_set
from .faces import FACES, Binding, Faces, disagreement
from .http_helpers import INIT_PARAMS, JSON_HEADERS, endpoint, http, rpc, start_http_daemon
from .mcp_helpers import RawPump, script

#: Prints the arguments as the child gets them: the bytes on its stdin.
ECHO = script("import sys\nprint('args', sys.stdin.read())\n")
NONUTF8 = script("import sys\nsys.stdout.buffer.write(b'ok \\xff\\xfe \\xed\\xa0\\x80 end\\n')\n")
SURROGATE_OUT = script('print(\'{"text": "x\\\\ud800y"}\')\n')
FLOOD = script("import sys\nsys.stdout.write('z' * 150_000)\n")
SIGNALLED = script("import os, signal\nprint('dying', flush=True)\nos.kill(os.getpid(), 11)\n")
FAILS = script("import sys\nprint('out')\nprint('it broke', file=sys.stderr)\nsys.exit(3)\n")
#: Starts a grandchild in its process group, writes both pids, then sleeps.
SLEEPER = script(
    "import json, os, subprocess, sys, time\n"
    "tag = json.load(sys.stdin)['tag']\n"
    "kid = subprocess.Popen(['sleep', '60'])\n"
    "open(tag + '.tmp', 'w').write(f'{os.getpid()} {kid.pid}')\n"
    "os.rename(tag + '.tmp', tag)\n"
    "time.sleep(60)\n"
)
PROGRESS = script(
    "import json, os\n"
    "fd = int(os.environ['TOOLSETD_PROGRESS_FD'])\n"
    "for n in (0, 50, 100):\n"
    "    line = json.dumps({'message': f'{n}/100', 'fraction': n / 100}) + '\\n'\n"
    "    os.write(fd, line.encode())\n"
    "print('counted')\n"
)


def _tool(name: str, command: str, **extra: Any) -> dict[str, Any]:
    return {
        "name": name,
        "description": f"Test tool {name}.",
        "schema": {"type": "object"},
        "command": [command],
        "approval": "always",
        **extra,
    }


def _write_sets(home: Path, workspace: Path) -> None:
    tools = home / "tools"
    write_set(
        tools,
        "echoes",
        {
            "runner": "exec",
            "stdin": True,
            "timeoutSeconds": 60,
            "tools": [
                _tool("echo", "echo.py", pathArguments=["path", "paths", "obj"]),
                _tool("echo_ask", "echo.py", approval="inherit", pathArguments=["path"]),
                _tool("echo_plan", "echo.py", catalogs=["plan"]),
                _tool("echo_work", "echo.py", catalogs=["work"]),
                _tool(
                    "typed",
                    "echo.py",
                    schema={
                        "type": "object",
                        "additionalProperties": False,
                        "properties": {"n": {"type": "integer"}, "s": {"type": "string"}},
                        "required": ["n"],
                    },
                ),
                _tool("nonutf8", "nonutf8.py"),
                _tool("surrogate_out", "surrogate.py", output="content"),
                _tool("flood", "flood.py"),
                _tool("signalled", "signalled.py"),
                _tool("fails", "fails.py"),
                _tool("progress", "progress.py"),
                _tool("sleeper", "sleeper.py"),
            ],
        },
        **{
            "echo.py": ECHO,
            "nonutf8.py": NONUTF8,
            "surrogate.py": SURROGATE_OUT,
            "flood.py": FLOOD,
            "signalled.py": SIGNALLED,
            "fails.py": FAILS,
            "progress.py": PROGRESS,
            "sleeper.py": SLEEPER,
        },
    )
    (workspace / "inside.txt").write_text("in\n")
    (workspace / "out").symlink_to("/etc")
    (workspace / "keys").symlink_to(Path.home() / ".ssh")


@pytest.fixture(scope="module")
def faces() -> Iterator[Faces]:
    base = Path(tempfile.mkdtemp(prefix="tsd-faces-"))
    home, workspace = base / "home", base / "ws"
    (home / "tools").mkdir(parents=True)
    workspace.mkdir()
    _write_sets(home, workspace)
    daemon: Daemon | None = None
    try:
        daemon, url = start_http_daemon(home, workspace, base)
        f = Faces(daemon, url, workspace)
        try:
            yield f
        finally:
            f.close()
    finally:
        if daemon is not None:
            shut_down(daemon)
        shutil.rmtree(base, ignore_errors=True)


HOME = os.path.expanduser("~")
PATHS = [
    "inside.txt",
    "./inside.txt",
    "nothere/new.txt",
    "..",
    "../ws/inside.txt",
    "/etc/passwd",
    "out/passwd",
    "keys",
    "keys/id_rsa",
    "~/.ssh",
    f"{HOME}/.ssh/id_rsa",
    "~/.gnupg",
    "/proc/self/root/etc",
    "/proc/self/cwd/inside.txt",
    "/proc/1/root/etc",
    "/proc/999999/cwd",
    "a\x00b",
    "a\nb",
    " inside.txt\n",
    "x" * 5000,
    "y/" * 3000,
    "\udcff",
    "caf\u00e9",
    "~root/x",
    "",
    "   ",
]
CASES: list[tuple[str, Any, Binding]] = [
    *[("echo", {"path": p}, Binding()) for p in PATHS],
    *[("echo", {"paths": [p]}, Binding()) for p in PATHS[6:16]],
    *[("echo", {"obj": {"deep": [p]}}, Binding()) for p in ("inside.txt", "~/.ssh", "/proc/self")],
    *[("echo", {"path": p}, Binding(headless=True)) for p in ("inside.txt", "/etc", "~/.ssh")],
    *[
        ("echo", {"path": p}, Binding(mode=m))
        for p in ("/etc", "~/.ssh")
        for m in ("plan", "review", "full", "audit")
    ],
    *[
        ("echo_ask", {"path": "inside.txt"}, Binding(mode=m, headless=h))
        for m in ("plan", "default", "review", "audit", "full", " YOLO ")
        for h in (False, True)
    ],
    ("echo_plan", {}, Binding(catalog="work")),
    ("echo_plan", {}, Binding(catalog="plan")),
    ("echo_work", {}, Binding(catalog="plan")),
    ("nope", {}, Binding()),
    ("typed", {"n": "x"}, Binding()),
    ("typed", {"n": 1, "s": 2, "extra": 3}, Binding()),
    ("typed", {}, Binding()),
    ("typed", {"n": 10**30}, Binding()),
    ("typed", {"n": 1.0}, Binding()),
    ("typed", {"n": 1, "s": "\ud800"}, Binding()),
    ("echo", {"s": "\ud800"}, Binding()),
    ("echo", {"k": "v" * 200_000}, Binding()),
    ("nonutf8", {}, Binding()),
    ("surrogate_out", {}, Binding()),
    ("flood", {}, Binding()),
    ("signalled", {}, Binding()),
    ("fails", {}, Binding()),
    ("progress", {}, Binding()),
]


@pytest.mark.parametrize(("tool", "arguments", "binding"), CASES)
def test_faces_agree(faces: Faces, tool: str, arguments: Any, binding: Binding) -> None:
    outcomes = faces.call(tool, arguments, binding)
    problem = disagreement(outcomes, faces.workspace)
    assert problem is None, problem


RAW = [
    b'{"path": "/etc", "path": "inside.txt"}',
    b'{"path": "inside.txt", "path": "~/.ssh"}',
    b'{"n": -0, "m": 1.50, "o": {"a": 1, "a": 2}, "e": 1E+2}',
    b'{"n": -0}',
    b'{"n": 1e400}',
    b'{"n": 123456789012345678901234567890}',
    b'{"s": "\\ud800"}',
    b'{"path": "\\ud800"}',
    b"[]",
    b'"x"',
]


@pytest.mark.parametrize("arguments", RAW)
def test_faces_agree_raw(faces: Faces, arguments: bytes) -> None:
    outcomes = faces.call_raw("echo", arguments)
    problem = disagreement(outcomes, faces.workspace)
    assert problem is None, problem


def test_progress_lines_reach_every_face(faces: Faces) -> None:
    """The tool's three progress lines, in order, on both MCP faces (every line: the wire
    coalesces a burst to its latest line, docs/protocol.md, so it has the last at least)."""
    with RawConn(faces.daemon.socket, timeout=60) as conn:
        events, _ = conn.invoke(
            {"tool": "progress", "arguments": {}, "workspace": str(faces.workspace)}
        )
    native = [e["params"]["message"] for e in events if "message" in e["params"]]
    call = rpc(
        0, "tools/call", {"name": "progress", "arguments": {}, "_meta": {"progressToken": 1}}
    )
    stdio = faces.pump()
    stdio.send({**call, "id": "p"})
    seen = []
    while (message := stdio.receive()).get("id") != "p":
        seen.append(message)
    reply = http(faces.endpoint(), body=call, headers={"mcp-session-id": faces.session()})
    over_http = reply.messages()[:-1]
    for messages in (seen, over_http):
        lines = [m["params"].get("message") for m in messages]
        assert [line for line in lines if line] == ["0/100", "50/100", "100/100"]
    assert native[-1:] == ["100/100"]


def _running(pid: int) -> bool:
    """Whether ``pid`` is a process that still runs (a zombie waiting for its reaper is not)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def _group(tag: Path) -> list[int]:
    eventually(tag.exists, what=f"{tag.name} written")
    return [int(pid) for pid in tag.read_text().split()]


@pytest.mark.parametrize("face", FACES)
def test_cancel_ends_the_process_group_on_every_face(faces: Faces, face: str) -> None:
    """Native ``cancel``, ``notifications/cancelled`` on stdio and a closed HTTP POST each
    end the tool and its grandchild."""
    tag = faces.workspace / f"cancel-{face}"
    arguments = {"tag": tag.name}
    if face == "native":
        with RawConn(faces.daemon.socket, timeout=60) as conn:
            params = {"tool": "sleeper", "arguments": arguments, "callId": f"c-{face}"}
            conn.send(rpc(1, "invoke", {**params, "workspace": str(faces.workspace)}))
            pids = _group(tag)
            assert faces.daemon.call("cancel", {"callId": f"c-{face}"})["result"]
            while "id" not in (reply := conn.receive()):
                pass
            assert reply["result"]["status"] == "cancelled"
    elif face == "stdio":
        pump = faces.pump()
        pump.send(rpc("s", "tools/call", {"name": "sleeper", "arguments": arguments}))
        pids = _group(tag)
        pump.send(
            {"jsonrpc": "2.0", "method": "notifications/cancelled", "params": {"requestId": "s"}}
        )
    else:
        parts = urlsplit(faces.endpoint())
        conn = HTTPConnection(parts.hostname, parts.port, timeout=60)
        body = rpc("h", "tools/call", {"name": "sleeper", "arguments": arguments})
        headers = {**JSON_HEADERS, "mcp-session-id": faces.session()}
        conn.request("POST", f"{parts.path}?{parts.query}", json.dumps(body), headers)
        pids = _group(tag)
        conn.close()
    eventually(lambda: not any(_running(pid) for pid in pids), 30, "the process group gone")


@pytest.fixture
def linked_workspace(faces: Faces) -> Iterator[tuple[Path, str]]:
    """A workspace with a project tool, and a name of it through a link and ``..``: the
    kernel takes ``<other>/link/..`` to the workspace, a lexical fold to ``<other>``."""
    base = Path(tempfile.mkdtemp(prefix="tsd-faces-ws-"))
    try:
        workspace, other = base / "project", base / "other"
        (workspace / "sub").mkdir(parents=True)
        other.mkdir()
        (other / "link").symlink_to(workspace / "sub")
        write_set(
            workspace / ".crystal" / "tools",
            "projtool",
            {
                "runner": "exec",
                "description": "A project tool.",
                "command": ["p.sh"],
                "schema": {"type": "object"},
            },
            **{"p.sh": "#!/bin/sh\necho project\n"},
        )
        yield workspace, f"{other}/link/.."
    finally:
        shutil.rmtree(base, ignore_errors=True)


def test_a_workspace_through_a_link_and_dotdot_is_one_folder_on_every_face(
    faces: Faces, linked_workspace: tuple[Path, str]
) -> None:
    """``..`` after a link climbs from the link's target on every face, as the kernel and
    the daemon read it: ``toolsetctl`` and ``toolsetctl mcp`` do not fold it away first."""
    _, given = linked_workspace
    with RawConn(faces.daemon.socket) as conn:
        native = conn.request("list", {"workspace": given})["result"]["tools"]
    assert "projtool" in [t["name"] for t in native]
    url = endpoint(faces.url, given)
    session = http(url, body=rpc(1, "initialize", INIT_PARAMS)).headers["mcp-session-id"]
    listed = http(url, body=rpc(2, "tools/list", {}), headers={"mcp-session-id": session})
    assert "projtool" in [t["name"] for t in listed.json()["result"]["tools"]]
    pump = RawPump(
        [
            "-m",
            "toolsetd.client",
            "--socket",
            str(faces.daemon.socket),
            "--workspace",
            given,
            "mcp",
            "--no-autostart",
        ],
        env=dict(os.environ),
    )
    try:
        pump.request(1, "initialize", INIT_PARAMS)
        pump.send({"jsonrpc": "2.0", "method": "notifications/initialized"})
        tools = pump.request(2, "tools/list", {})["result"]["tools"]
    finally:
        pump.close()
    assert "projtool" in [t["name"] for t in tools]
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "toolsetd.client",
            "--socket",
            str(faces.daemon.socket),
            "--workspace",
            given,
            "--format",
            "json",
            "list",
        ],
        capture_output=True,
        timeout=60,
        check=True,
    )
    assert "projtool" in [t["name"] for t in json.loads(done.stdout)["tools"]]


def test_a_workspace_under_tilde_is_one_folder_for_toolsetctl_and_its_mcp(
    faces: Faces, linked_workspace: tuple[Path, str]
) -> None:
    """``--workspace ~/project`` (a host's config, where no shell expands it) is the
    home's ``project`` for ``toolsetctl mcp`` as for ``toolsetctl``'s other commands."""
    workspace, _ = linked_workspace
    env = {**os.environ, "HOME": str(workspace.parent)}
    argv = ["-m", "toolsetd.client", "--socket", str(faces.daemon.socket)]
    argv += ["--workspace", "~/project"]
    done = subprocess.run(
        [sys.executable, *argv, "--format", "json", "list"],
        capture_output=True,
        timeout=60,
        check=True,
        env=env,
    )
    assert "projtool" in [t["name"] for t in json.loads(done.stdout)["tools"]]
    pump = RawPump([*argv, "mcp", "--no-autostart"], env=env)
    try:
        pump.request(1, "initialize", INIT_PARAMS)
        pump.send({"jsonrpc": "2.0", "method": "notifications/initialized"})
        tools = pump.request(2, "tools/list", {})["result"]["tools"]
    except EOFError:
        tools = []
    finally:
        code = pump.close()
    assert "projtool" in [t["name"] for t in tools], (code, pump.stderr())


def test_bytes_that_are_not_utf8_are_named_so_on_every_face(faces: Faces) -> None:
    """A message with a byte that is no UTF-8 is -32700 "not valid UTF-8" on each face,
    not a parser's words about surrogates at a position the byte is not at."""
    call = b'{"jsonrpc": "2.0", "id": 0, "method": "tools/call", "params": {"name": "echo", '
    call += b'"arguments": {"s": "\xff"}}}'
    native = faces.native("echo", None, raw=call.replace(b"tools/call", b"invoke") + b"\n")
    answers = [
        native,
        faces.stdio("echo", None, raw=call + b"\n"),
        faces.http("echo", None, raw=call),
    ]
    for answer in answers:
        assert answer["error"]["code"] == -32700
        assert "not valid UTF-8" in answer["error"]["message"], answer
        assert "surrogate" not in answer["error"]["message"], answer


def test_the_way_to_allow_a_call_names_each_mcp_face(faces: Faces) -> None:
    """A host without elicitation is told how the operator can allow the call: with a
    mode, which over HTTP is the endpoint URL's ``mode=``, not only ``toolsetctl mcp``'s
    ``--mode`` (an HTTP host has no command line to change)."""
    for face in ("stdio", "http"):
        reply = getattr(faces, face)("echo_ask", {"path": "inside.txt"})
        text = reply["result"]["content"][0]["text"]
        assert text.startswith("Approval required: "), text
        assert "`mode=full`" in text, text
        assert "--mode full" in text, text
