"""Helpers for the MCP tests: test tool sets, the pump's command line, a raw stdio pump."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

from mcp import StdioServerParameters

from .conftest import REPO, Daemon, write_set

PY = sys.executable
#: The interpreter of the test tools' scripts: the venv's own interpreter file, outside the
#: checkout, so a sandboxed project tool (whose /tmp is private) still finds it when the
#: checkout lives under /tmp. The tools use the standard library only.
TOOL_PY = os.path.realpath(sys.executable)


def script(body: str) -> str:
    """An executable Python script for a tool set."""
    return f"#!{TOOL_PY}\n{body}"


def tool(command: str, *, schema: dict[str, Any] | None = None, **extra: Any) -> dict[str, Any]:
    """A shorthand tools.json with one exec tool."""
    return {
        "runner": "exec",
        "description": f"Test tool {command}.",
        "schema": schema or {"type": "object"},
        "command": [command],
        "stdin": True,
        "approval": "always",
        "timeoutSeconds": 60,
        **extra,
    }


PROGRESS3 = script(
    "import json, os, time\n"
    "fd = int(os.environ['TOOLSETD_PROGRESS_FD'])\n"
    "for n in (0, 50, 100):\n"
    "    os.write(fd, (json.dumps({'message': f'{n}/100', 'fraction': n / 100}) + '\\n').encode())\n"
    "    time.sleep(0.05)\n"
    "print('counted')\n"
)
#: Writes its call id, then its pid (so the id is there once the pid is), then sleeps.
SLEEPER = script(
    "import os, time\n"
    "open('sleeper.call', 'w').write(os.environ['TOOLSETD_CALL_ID'])\n"
    "open('sleeper.pid', 'w').write(str(os.getpid()))\n"
    "time.sleep(60)\n"
)
BIG = script("import sys\nsys.stdout.write('y' * 99_993)\n")
BIG_IMAGE = script(
    "import json, os\n"
    "with open('big.png', 'wb') as f:\n"
    "    f.write(b'\\x89PNG\\r\\n\\x1a\\n' + os.urandom(15 * 1024 * 1024))\n"
    "print(json.dumps({'text': 'a big one', 'images': [{'mimeType': 'image/png', 'path': 'big.png'}]}))\n"
)
FAILS = script("import sys\nprint('it broke', file=sys.stderr)\nsys.exit(3)\n")
ASKER = script("print('asked and ran')\n")
READER = script("import json, sys\nprint('read', json.load(sys.stdin)['path'])\n")


def write_test_sets(home: Path) -> None:
    """The home tool sets the MCP tests call (all run unasked: approval always)."""
    tools = home / "tools"
    write_set(tools, "progress3", tool("progress3.py"), **{"progress3.py": PROGRESS3})
    write_set(tools, "sleeper", tool("sleeper.py"), **{"sleeper.py": SLEEPER})
    write_set(tools, "big", tool("big.py"), **{"big.py": BIG})
    write_set(
        tools, "bigimage", tool("bigimage.py", output="content"), **{"bigimage.py": BIG_IMAGE}
    )
    write_set(tools, "fails", tool("fails.py"), **{"fails.py": FAILS})
    reader = tool(
        "reader.py",
        schema={"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]},
        pathArguments=["path"],
    )
    write_set(tools, "reader", reader, **{"reader.py": READER})


def write_project_asker(workspace: Path, name: str = "asker") -> None:
    """A project set: the host policy makes its calls ask in the default mode."""
    write_set(workspace / ".crystal" / "tools", name, tool(f"{name}.py"), **{f"{name}.py": ASKER})


def pump_args(daemon: Daemon, workspace: Path, *extra: str, autostart: bool = False) -> list[str]:
    """``python -m toolsetd.client ... mcp ...`` for this daemon and workspace."""
    args = [
        "-m",
        "toolsetd.client",
        "--socket",
        str(daemon.socket),
        "--workspace",
        str(workspace),
        "mcp",
        *extra,
    ]
    if not autostart:
        args.append("--no-autostart")
    return args


def server(daemon: Daemon, workspace: Path, *extra: str) -> StdioServerParameters | str:
    """What the SDK's ``Client`` connects to for ``daemon``: ``toolsetctl mcp`` over stdio,
    or, when ``daemon.mcp_url`` is set (it serves ``--mcp-listen``), the endpoint's URL with
    the pump's options (``--mode M``, ``--catalog C``, ``--headless``) in its query."""
    url = daemon.mcp_url
    if url is None:
        return StdioServerParameters(
            command=PY, args=pump_args(daemon, workspace, *extra), env=dict(os.environ)
        )
    query = {"workspace": str(workspace)}
    args = list(extra)
    while args:
        flag = args.pop(0)
        if flag == "--headless":
            query["headless"] = "true"
        else:
            query[flag.removeprefix("--")] = args.pop(0)
    return f"{url}?{urlencode(query)}"


class RawPump:
    """``toolsetctl mcp`` as a subprocess spoken to line by line (for what the SDK won't send)."""

    def __init__(
        self, args: list[str], env: dict[str, str] | None = None, cwd: Path | None = None
    ) -> None:
        self.proc = subprocess.Popen(
            [PY, *args],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=env,
            cwd=cwd,
        )
        self._stderr = ""
        self.stdout_text = ""

    def send(self, message: Any) -> None:
        """Write one message (or raw bytes) to the pump's stdin."""
        assert self.proc.stdin is not None
        data = message if isinstance(message, bytes) else json.dumps(message).encode() + b"\n"
        self.proc.stdin.write(data)
        self.proc.stdin.flush()

    def receive(self) -> Any:
        """Read one message from the pump's stdout."""
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise EOFError("the pump closed its stdout")
        return json.loads(line)

    def request(self, request_id: Any, method: str, params: dict[str, Any] | None = None) -> Any:
        """Send a request and return its response (skipping notifications)."""
        message: dict[str, Any] = {"jsonrpc": "2.0", "id": request_id, "method": method}
        if params is not None:
            message["params"] = params
        self.send(message)
        while True:
            reply = self.receive()
            if reply.get("id") == request_id and "method" not in reply:
                return reply

    def close(self, timeout: float = 15.0) -> int:
        """Close stdin and wait for the pump to exit."""
        assert self.proc.stdin is not None
        assert self.proc.stdout is not None
        assert self.proc.stderr is not None
        self.proc.stdin.close()
        try:
            code = self.proc.wait(timeout=timeout)
        finally:
            self._stderr = self.proc.stderr.read().decode(errors="replace")
            #: What the pump wrote on stdout and nobody read before it exited.
            self.stdout_text = self.proc.stdout.read().decode(errors="replace")
            self.proc.stdout.close()
            self.proc.stderr.close()
        return code

    def stderr(self) -> str:
        """What the pump wrote on stderr (read when it exited)."""
        return self._stderr


def host_recipe(host: str) -> str:
    """docs/mcp.md's paragraphs on registering one host, from its bold name to the next's."""
    text = (REPO / "docs" / "mcp.md").read_text(encoding="utf-8")
    return text.split(f"\n**{host}**", 1)[1].split("\n**", 1)[0]


def doc_commands(block: str) -> list[list[str]]:
    """The command lines of a docs ``sh`` block, split as a shell splits them, comments
    dropped."""
    return [shlex.split(line, comments=True) for line in block.splitlines() if line.strip()]


#: The endpoint docs/mcp.md's recipes show; a test puts its daemon's in its place.
DOC_URL = "http://127.0.0.1:8765/mcp?workspace=/abs/project"


@dataclass
class RecipeHost:
    """An MCP host's CLI run as docs/mcp.md's recipes run it: the checkout's
    ``toolsetctl`` first on ``PATH``, a home of its own (and, with ``xdg``, XDG folders of
    its own), the daemon's socket in ``TOOLSETD_SOCKET`` and no ``CRYSTAL_HOME``."""

    name: str
    cli: Path
    home: Path
    daemon: Daemon
    xdg: bool = False
    env: dict[str, str] = field(init=False)

    def __post_init__(self) -> None:
        drop = ("CRYSTAL_HOME", "XDG_") if self.xdg else ("CRYSTAL_HOME",)
        env = {k: v for k, v in os.environ.items() if not k.startswith(drop)}
        bin_dir = str(Path(sys.executable).parent)  # the checkout's toolsetctl, as installed
        env |= {"HOME": str(self.home), "PATH": f"{bin_dir}:{env.get('PATH', '/usr/bin:/bin')}"}
        env["TOOLSETD_SOCKET"] = str(self.daemon.socket)
        if self.xdg:
            env |= {f"XDG_{k}_HOME": str(self.home / k.lower()) for k in ("CONFIG", "DATA", "STATE", "CACHE")}
        self.home.mkdir(parents=True, exist_ok=True)
        self.env = env

    def __call__(self, folder: Path, argv: list[str]) -> str:
        """Run one of the recipe's command lines in ``folder``; its output, colours off."""
        assert argv[0] == self.name, argv
        done = subprocess.run(
            [str(self.cli), *argv[1:]], cwd=folder, env=self.env, stdin=subprocess.DEVNULL,
            capture_output=True, text=True, timeout=180, check=False,
        )
        assert done.returncode == 0, done
        return re.sub(r"\x1b\[[0-9;]*m", "", done.stdout + done.stderr)

    def served(self) -> set[str]:
        """The workspaces the daemon serves now (its status)."""
        return set(self.daemon.call("status")["result"]["workspaces"])


def git_project(base: Path, name: str) -> Path:
    """A git repository ``base/name`` with an empty ``sub`` folder: a project's root."""
    folder = base / name
    (folder / "sub").mkdir(parents=True)
    subprocess.run(["git", "init", "-q", str(folder)], check=True, timeout=30)
    return folder
