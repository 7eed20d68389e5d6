"""An operator's and a CI job's first hour: the mistakes people make, and what they are told.

A real daemon serves tool sets written with those mistakes; ``toolsetctl`` (a subprocess)
and ``toolsetctl mcp`` (the MCP SDK's client over stdio) call them. Each refusal must name
the file or field at fault and the fix, and say it the same on both faces: one core
words it.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest
from mcp import Client

from .conftest import Daemon, daemon_in, write_set
from .mcp_helpers import server

TOOL = {"runner": "exec", "description": "d", "schema": {"type": "object"}}


def _fill(home: Path, workspace: Path) -> None:
    tools, project = home / "tools", workspace / ".crystal" / "tools"
    # A home tool that asks (approval inherit), and a project one whose author wrote
    # "always", which the project sets' default host policy does not let count.
    write_set(tools, "fmt", {**TOOL, "command": ["/bin/echo", "formatted"]})
    write_set(project, "deploy", {**TOOL, "command": ["/bin/echo", "ran"], "approval": "always"})


@pytest.fixture(scope="module")
def first_hour() -> Iterator[Daemon]:
    with daemon_in("tfh-", _fill, ["--no-watch"]) as daemon:
        yield daemon


def ctl(daemon: Daemon, *args: str) -> subprocess.CompletedProcess[str]:
    """``toolsetctl`` against the module's daemon and workspace, as a CI step runs it."""
    argv = [sys.executable, "-m", "toolsetd.client", "--socket", str(daemon.socket)]
    argv += ["--workspace", str(daemon.workspace), *args]
    return subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False)


async def mcp_call(daemon: Daemon, tool: str, *options: str) -> tuple[bool | None, str]:
    """``tools/call`` through ``toolsetctl mcp``: (isError, the text), or (None, the
    JSON-RPC error's message)."""
    with anyio.fail_after(30):
        async with Client(server(daemon, daemon.workspace, *options)) as client:
            try:
                result = await client.call_tool(tool, {})
            except Exception as exc:  # noqa: BLE001 - the SDK raises MCPError for -32602
                return None, str(getattr(getattr(exc, "error", None), "message", exc))
    text = "".join(getattr(block, "text", "") for block in result.content)
    return result.is_error, text


def _json(r: subprocess.CompletedProcess[str]) -> Any:
    return json.loads(r.stdout)


# -- approval: what would let the call run --------------------------------------------


HOST_IGNORES = (
    "The tool declares approval 'always', which does not count for project tool sets: "
    "externalToolApproval.project in the Crystal home's config.json is host; set it to "
    "author to let the declaration count."
)


def test_project_always_that_asks_says_the_policy_ignores_it(first_hour: Daemon) -> None:
    """A project set's "approval": "always" reads as inherit under the host policy: the
    call asks, and the operator who wrote "always" is told why and what to change."""
    r = ctl(first_hour, "invoke", "deploy")
    assert r.returncode == 3, r.stderr
    assert HOST_IGNORES in r.stderr
    assert "run the command again with --approve" in r.stderr
    headless = ctl(first_hour, "invoke", "deploy", "--headless", "--format", "json")
    assert headless.returncode == 3
    assert HOST_IGNORES in _json(headless)["error"]["message"]


@pytest.mark.anyio
async def test_headless_denial_names_the_fix_and_the_fix_works(first_hour: Daemon) -> None:
    """A CI job's headless call that needs approval is denied with what would let it run,
    the same on toolsetctl and MCP; and the named fix (--mode full) does run it."""
    fix = (
        'To let it run headless, declare "approval": "always" for the tool in its '
        "tools.json, or run in full mode (--mode full)."
    )
    r = ctl(first_hour, "invoke", "fmt", "--headless")
    assert r.returncode == 3
    assert r.stderr.startswith("Denied: Headless run:")
    assert fix in r.stderr
    is_error, text = await mcp_call(first_hour, "fmt", "--headless")
    assert is_error is True
    assert fix in text
    assert text in r.stderr
    ran = ctl(first_hour, "invoke", "fmt", "--headless", "--mode", "full")
    assert (ran.returncode, ran.stdout) == (0, "exit 0\nformatted\n"), ran.stderr
    # Under the host policy a declaration does not count: only the mode is offered there,
    # besides the sentence about the policy.
    project = ctl(first_hour, "invoke", "deploy", "--headless")
    assert 'declare "approval"' not in project.stderr
    assert HOST_IGNORES in project.stderr
