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
from mcp.shared.exceptions import MCPError

from .conftest import Daemon, daemon_in, write_set
from .mcp_helpers import server

TOOL = {"runner": "exec", "description": "d", "schema": {"type": "object"}}


def _fill(home: Path, workspace: Path) -> None:
    tools, project = home / "tools", workspace / ".crystal" / "tools"
    # A home tool that asks (approval inherit), and a project one whose author wrote
    # "always", which the project sets' default host policy does not let count.
    write_set(tools, "fmt", {**TOOL, "command": ["/bin/echo", "formatted"]})
    write_set(project, "deploy", {**TOOL, "command": ["/bin/echo", "ran"], "approval": "always"})
    # A set the operator turned off, one whose field name is misspelt ("comand": the
    # shorthand then has no command), and a home set a project copy replaces whole.
    write_set(tools, "lint", {**TOOL, "command": ["/bin/true"], "enabled": False})
    write_set(tools, "typo", {**TOOL, "comand": ["/bin/true"]})
    shared = {"runner": "exec", "command": ["/bin/true"]}
    write_set(
        tools, "pair", {**shared, "tools": [{**TOOL, "name": "left"}, {**TOOL, "name": "right"}]}
    )
    write_set(project, "pair", {**shared, "tools": [{**TOOL, "name": "left"}]})


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
            except MCPError as exc:  # an unknown tool is -32602
                return None, exc.error.message
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


# -- a tool that is not loaded: which set has it, and why it did not load ---------------


@pytest.mark.parametrize(
    ("tool", "why"),
    [
        (
            "lint",
            "Tool set 'lint' (home, {home}/tools/lint/tools.json) declares it but is disabled: "
            'set "enabled": true in it, or run toolsetctl enable lint --source home.',
        ),
        (
            "typo",
            "Tool set 'typo' (home, {home}/tools/typo/tools.json) was skipped (toolsetctl "
            "validate typo lists every problem): exec requires a command array.",
        ),
        (
            "right",
            "Tool set 'pair' (home, {home}/tools/pair/tools.json) declares it but is hidden by "
            "the project tool set of the same directory name, which replaces it whole.",
        ),
    ],
)
@pytest.mark.anyio
async def test_unknown_tool_of_a_set_that_did_not_load_says_why(
    first_hour: Daemon, tool: str, why: str
) -> None:
    """Calling a tool whose set is disabled, skipped or hidden was "no such tool" and a
    list of loaded tools that does not name it. The refusal now names the set, its
    tools.json and the fix, the same on toolsetctl and MCP."""
    why = why.format(home=first_hour.home)
    r = ctl(first_hour, "invoke", tool, "--format", "json")
    assert r.returncode == 2
    error = _json(r)["error"]
    assert error["code"] == -32001
    assert error["message"].startswith(f"Unknown tool '{tool}': no such tool")
    assert error["message"].endswith(f"Loaded tools: deploy, fmt, left. {why}")
    is_error, text = await mcp_call(first_hour, tool)
    assert (is_error, text) == (None, error["message"])


def test_unknown_tool_nobody_declares_says_nothing_more(first_hour: Daemon) -> None:
    """A name no set on disk has keeps the plain refusal."""
    r = ctl(first_hour, "invoke", "nothing_has_this")
    assert r.returncode == 2
    assert r.stderr.rstrip().endswith("Loaded tools: deploy, fmt, left.")
