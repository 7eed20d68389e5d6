"""The official TypeScript SDK client (``@modelcontextprotocol/sdk``) against toolsetd.

Most Node hosts (Claude Code, Cursor, OpenCode, Gemini CLI, the MCP Inspector) build on
this client: its zod schemas check every message toolsetd sends, and its transports speak
stdio (spawning ``toolsetctl mcp``) and Streamable HTTP (``--mcp-listen``). Each test runs
one Node process (``ts_client/client.mjs``) through named steps on one connection, over
each transport, and asserts on the report it prints. Over stdio the pump gets the
environment the SDK passes when a host gives none (``HOME``, ``PATH`` and a few more), so
the daemon's socket is named in its arguments. The MCP Inspector's CLI mode (built on
the same client) lists and calls too. Both are installed from npm into the tests' cache
folder (``npm_helpers``); without node, npm or a registry the tests skip with the reason.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from .conftest import EXAMPLES, Daemon, alive, daemon_in, eventually, write_set
from .http_helpers import endpoint, listening_urls
from .mcp_helpers import (
    DOC_URL,
    PY,
    doc_commands,
    host_recipe,
    pump_args,
    script,
    tool,
    write_project_asker,
    write_test_sets,
)
from .npm_helpers import node, npm_installed

SDK_VERSION = "1.32.2"
#: The newest client: the 2.x SDK's own package (its zod checks each root property's
#: schema as JSON values, where 1.x takes any object).
CLIENT2_VERSION = "2.4.0"
CLIENT = Path(__file__).parent / "ts_client" / "client.mjs"
#: One tool more than a tools/list page holds (docs/mcp.md: pages of 1,000 tools).
PAGED = [f"paged_{n:04d}" for n in range(1001)]
TRANSPORTS = ["stdio", "http"]
#: Valid JSON Schema whose root properties are boolean schemas (MCP's schema has objects).
BOOLEAN_PROPERTIES = {"type": "object", "properties": {"any": True, "never": False}}
#: Valid draft 3 JSON Schema whose root ``required`` is a boolean (MCP's has a list).
DRAFT3_REQUIRED = {
    "$schema": "http://json-schema.org/draft-03/schema#", "type": "object", "required": True,
    "properties": {"x": {"type": "string", "required": True}},
}
#: A schema with ``anyOf`` at its root, which Claude's API refuses there.
ROOT_ANY_OF = {
    "type": "object", "properties": {"a": {"type": "string"}, "b": {"type": "string"}},
    "anyOf": [{"required": ["a"]}, {"required": ["b"]}],
}
#: A schema that marks an integer for the 2026-07-28 ``Mcp-Param-N`` header.
ROUTED = {"type": "object", "properties": {"n": {"type": "integer", "x-mcp-header": "N"}}}
#: A draft 7 schema with a mark in its tuple ``items``, where MCP's rules refuse one.
TUPLE_MARK = {
    "$schema": "http://json-schema.org/draft-07/schema#", "type": "object",
    "properties": {"t": {"type": "array", "items": [{"type": "string", "x-mcp-header": "T"}]}},
}
#: Draft 7 schemas with a mark under a keyword draft 7 does not know, so of any shape: in
#: ``prefixItems`` written as one schema, in ``$defs`` written as a list. The TypeScript
#: SDK's 2.x client looks there all the same, and MCP's rules refuse a mark there.
SHAPE_MARKS = {
    "prefixmark": {
        "$schema": "http://json-schema.org/draft-07/schema#", "type": "object",
        "properties": {"t": {"type": "array",
                             "prefixItems": {"type": "string", "x-mcp-header": "P"}}},
    },
    "defsmark": {
        "$schema": "http://json-schema.org/draft-07/schema#", "type": "object",
        "properties": {"t": {"type": "array"}},
        "$defs": [{"type": "string", "x-mcp-header": "D"}],
    },
}
#: Valid JSON Schema holding an integer no double holds (JavaScript reads it as Infinity).
HUGE_INTEGER = {"type": "object", "properties": {"n": {"type": "integer", "maximum": 10**400}}}


@pytest.fixture(scope="module")
def sdk() -> Path:
    """The folder holding the TypeScript SDK from npm (installed once)."""
    return npm_installed(
        f"ts-sdk-{SDK_VERSION}", [f"@modelcontextprotocol/sdk@{SDK_VERSION}"],
        "node_modules/@modelcontextprotocol/sdk/package.json",
    )


@pytest.fixture(scope="module")
def sdk2() -> Path:
    """The folder holding the TypeScript SDK's 2.x client from npm (installed once)."""
    return npm_installed(
        f"ts-client-{CLIENT2_VERSION}", [f"@modelcontextprotocol/client@{CLIENT2_VERSION}"],
        "node_modules/@modelcontextprotocol/client/package.json",
    )


@pytest.fixture(scope="module")
def ts_daemon() -> Iterator[Daemon]:
    """The module's daemon: the example sets, the MCP test sets, a set of 1,001 tools (two
    pages), seven tools whose schemas MCP's shape does not take as declared, one whose
    schema marks an integer for a 2026-07-28 header and a project set that asks; MCP on the
    socket and on a 127.0.0.1 port."""

    def fill(home: Path, workspace: Path) -> None:
        shutil.copytree(EXAMPLES, home / "tools", dirs_exist_ok=True)
        write_test_sets(home)
        tools = [{"name": name, "description": f"Tool {name}.", "schema": {"type": "object"},
                  "command": ["paged.py"]} for name in PAGED]
        manifest = {"runner": "exec", "approval": "always", "tools": tools}
        write_set(home / "tools", "paged", manifest, **{"paged.py": script("print('paged')\n")})
        write_project_asker(workspace)
        write_set(home / "tools", "boolprops", tool("b.py", schema=BOOLEAN_PROPERTIES),
                  **{"b.py": script("print('took it')\n")})
        write_set(home / "tools", "draft3", tool("d.py", schema=DRAFT3_REQUIRED),
                  **{"d.py": script("print('took it')\n")})
        write_set(home / "tools", "anyofroot", tool("a.py", schema=ROOT_ANY_OF),
                  **{"a.py": script("print('took it')\n")})
        write_set(home / "tools", "hugeint", tool("h.py", schema=HUGE_INTEGER),
                  **{"h.py": script("print('took it')\n")})
        write_set(home / "tools", "tuplemark", tool("t.py", schema=TUPLE_MARK),
                  **{"t.py": script("print('took it')\n")})
        for name, schema in SHAPE_MARKS.items():
            write_set(home / "tools", name, tool("t.py", schema=schema),
                      **{"t.py": script("print('took it')\n")})
        write_set(home / "tools", "routed", tool("r.py", schema=ROUTED),
                  **{"r.py": script("import sys\nprint('took', sys.stdin.read())\n")})

    with daemon_in("tst-", fill, ["--mcp-listen", "127.0.0.1:0"]) as d:
        d.mcp_url = listening_urls(d)[0]
        yield d


def run_client(
    sdk: Path, daemon: Daemon, transport: str, steps: list[str], **extra: Any
) -> dict[str, Any]:
    """Run ``client.mjs`` through ``steps`` over ``transport``; returns its report."""
    assert daemon.mcp_url is not None
    config = {
        "sdk": str(sdk), "transport": transport, "workspace": str(daemon.workspace),
        "command": [PY, *pump_args(daemon, daemon.workspace)],
        "url": endpoint(daemon.mcp_url, daemon.workspace), **extra,
    }
    path = daemon.log_path.parent / f"ts-{uuid.uuid4().hex[:8]}.json"
    path.write_text(json.dumps(config))
    done = subprocess.run([node(), str(CLIENT), str(path), *steps], capture_output=True,
                          text=True, timeout=120, check=False)
    assert done.returncode == 0, f"{done.stdout}\n{done.stderr}\n{daemon.log()[-4000:]}"
    report: dict[str, Any] = json.loads(done.stdout.splitlines()[-1])
    assert "connect" not in report, f"{report}\n{daemon.log()[-4000:]}"
    assert report["errors"] == [], report
    for step in steps:
        assert report["steps"][step]["ok"] is True, f"{step}: {report}\n{daemon.log()[-4000:]}"
    return report


@pytest.mark.timeout(900)  # a fresh machine installs from npm first
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_ts_client_initializes_pages_and_calls(
    sdk: Path, ts_daemon: Daemon, transport: str
) -> None:
    """The TS client initializes (2025-11-25), walks both pages of tools/list by cursor,
    and calls: a text result, an isError one, progress as onprogress, an unknown tool;
    then six calls side by side, each with its own progress, and a ping among them."""
    report = run_client(sdk, ts_daemon, transport, ["initialize", "list", "call", "parallel"])
    init = report["steps"]["initialize"]
    assert init["server"]["name"] == "toolsetd"
    assert init["capabilities"]["tools"] == {"listChanged": True}
    if transport == "http":
        assert init["sessionId"]
        assert init["protocolVersion"] == "2025-11-25"
    listed = report["steps"]["list"]
    assert listed["pages"] == 2
    assert listed["count"] == listed["unique"] >= len(PAGED) + 4
    assert {"hello", "asker", "progress3", "fails"} <= set(listed["names"])
    assert listed["hello"]["inputSchema"]["required"] == ["name"]
    call = report["steps"]["call"]
    assert call["hello"] == {"isError": False, "text": call["hello"]["text"]}
    assert "Hello, Ada!" in call["hello"]["text"]
    assert call["fails"]["isError"] is True
    assert "it broke" in call["fails"]["text"]
    assert "counted" in call["progress3"]["text"]
    messages = [p.get("message") for p in call["progress3"]["progress"] if p.get("message")]
    assert messages == ["0/100", "50/100", "100/100"]
    assert call["unknown"]["code"] == -32602
    assert "no_such_tool" in call["unknown"]["message"]
    parallel = report["steps"]["parallel"]
    assert parallel["pong"] == {}
    assert [r["progress"] for r in parallel["results"]] == [["0/100", "50/100", "100/100"]] * 6
    assert all(r["isError"] is False and "counted" in r["text"] for r in parallel["results"])
    assert report["stderr"] == ""


@pytest.mark.timeout(900)  # a fresh machine installs from npm first
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_ts_client_2x_takes_progress_and_aborts_as_1x_does(
    sdk2: Path, ts_daemon: Daemon, transport: str
) -> None:
    """The 2.x client gets each call's progress as ``onprogress`` (alone and six calls side
    by side), and an AbortSignal ends a call and kills its tool, as the 1.x client does.
    Its ``callTool`` takes the options second (1.x: third, after a result schema):
    ``client.mjs`` passed them third, where the 2.x client drops them, so its calls saw no
    progress and no abort (and no test ran its call steps to notice)."""
    for name in ("sleeper.pid", "sleeper.call"):
        (ts_daemon.workspace / name).unlink(missing_ok=True)
    report = run_client(sdk2, ts_daemon, transport, ["call", "parallel", "cancel"],
                        package="client")
    call = report["steps"]["call"]
    assert "counted" in call["progress3"]["text"]
    messages = [p.get("message") for p in call["progress3"]["progress"] if p.get("message")]
    assert messages == ["0/100", "50/100", "100/100"]
    parallel = report["steps"]["parallel"]["results"]
    assert [r["progress"] for r in parallel] == [["0/100", "50/100", "100/100"]] * 6
    cancel = report["steps"]["cancel"]
    assert "the host gave up" in cancel["error"]["message"], cancel
    assert "Hello, B!" in cancel["after"]
    eventually(lambda: not alive(cancel["pid"]), timeout=15, what="the sleeper killed")


#: A stdio server (its argv) whose progress notifications reach the host only with the
#: next other line, in one write: what a host too busy to read sees (it reads them in one
#: chunk), here every time.
COALESCER = """\
import subprocess, sys
child = subprocess.Popen(sys.argv[1:], stdout=subprocess.PIPE)
held = b''
for line in child.stdout:
    held += line
    if b'"method":"notifications/progress"' not in line:
        sys.stdout.buffer.write(held)
        sys.stdout.buffer.flush()
        held = b''
sys.stdout.buffer.write(held)
sys.stdout.buffer.flush()
sys.exit(child.wait())
"""


@pytest.mark.timeout(900)  # a fresh machine installs from npm first
def test_ts_client_takes_progress_read_in_one_chunk_with_its_response(
    sdk: Path, ts_daemon: Daemon
) -> None:
    """Progress that toolsetd sent before its call's response, read by the host in the
    same chunk as that response (a loaded host), reaches ``onprogress``, and the client
    reports no "progress notification for an unknown token". The SDK (1.32.2) handles a
    chunk's response at once but its notifications a microtask later, so the response
    retired the token first (typescript-sdk#2580). The harness's host hands each response
    on a microtask later (``client.mjs``), so an unknown token it still reports is
    progress that came after its response on the wire: toolsetd's fault, not the SDK's."""
    coalescer = ts_daemon.log_path.parent / "coalescer.py"
    coalescer.write_text(COALESCER)
    command = [PY, str(coalescer), PY, *pump_args(ts_daemon, ts_daemon.workspace)]
    report = run_client(sdk, ts_daemon, "stdio", ["call", "parallel"], command=command)
    assert "counted" in report["steps"]["call"]["progress3"]["text"]
    messages = [p.get("message") for p in report["steps"]["call"]["progress3"]["progress"]]
    assert messages == ["0/100", "50/100", "100/100"]
    parallel = report["steps"]["parallel"]["results"]
    assert [r["progress"] for r in parallel] == [["0/100", "50/100", "100/100"]] * 6


@pytest.mark.timeout(900)  # a fresh machine installs from npm first
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_ts_client_lists_tools_whose_schemas_mcp_shapes_otherwise(
    sdk: Path, ts_daemon: Daemon, transport: str
) -> None:
    """A root property that is a boolean schema (``"any": true``, valid JSON Schema) is
    listed as the object that says the same, and a draft 3 boolean ``required`` at the
    root is left out: the TS client's zod refused the whole tools/list over either (MCP's
    schema has an object, a list of names there), so the host saw no tool at all. A root
    ``anyOf`` (which Claude's API refuses there) is listed under ``"if": true, "then"``,
    and the client takes it. The calls are still validated against the schemas as
    declared."""
    calls = [
        {"name": "boolprops", "arguments": {"any": [1]}},
        {"name": "boolprops", "arguments": {"never": 1}},
        {"name": "draft3", "arguments": {"x": "a"}},
        {"name": "draft3", "arguments": {}},
        {"name": "anyofroot", "arguments": {"b": "x"}},
        {"name": "anyofroot", "arguments": {}},
    ]
    report = run_client(sdk, ts_daemon, transport, ["list", "calls"], calls=calls)
    listed = report["steps"]["list"]["tools"]
    assert listed["boolprops"]["inputSchema"] == {
        "type": "object", "properties": {"any": {}, "never": {"not": {}}},
    }
    assert listed["draft3"]["inputSchema"] == {  # as JSON Schema 2020-12 (test_mcpschema.py)
        "type": "object", "properties": {"x": {"type": "string"}}, "required": ["x"],
    }
    assert listed["anyofroot"]["inputSchema"] == {
        "type": "object", "properties": ROOT_ANY_OF["properties"],
        "if": True, "then": {"anyOf": ROOT_ANY_OF["anyOf"]},
    }
    took, refused, ran, missing, either, neither = report["steps"]["calls"]["results"]
    assert either["isError"] is False
    assert neither["isError"] is True
    assert took["isError"] is False
    assert "took it" in took["text"]
    assert refused["isError"] is True
    assert "Invalid arguments" in refused["text"]
    assert ran["isError"] is False
    assert missing["isError"] is True
    assert "x" in missing["text"]


@pytest.mark.timeout(900)  # a fresh machine installs from npm first
@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("major", [1, 2])
def test_ts_client_lists_every_tool_but_one_whose_schema_no_double_holds(
    sdk: Path, sdk2: Path, ts_daemon: Daemon, transport: str, major: int
) -> None:
    """An integer of 400 digits in one tool's schema (valid JSON Schema) reads as Infinity
    in JavaScript: the 2.x client's zod refused the whole tools/list over it, and the 1.x
    client showed the tool with ``null`` in its place. That tool is left out of the
    listing (the catalog notes why), every other tool lists, and a call of it still runs,
    validated against its schema as declared."""
    folder, extra = (sdk, {}) if major == 1 else (sdk2, {"package": "client"})
    calls = [{"name": "hugeint", "arguments": {"n": 5}},
             {"name": "hugeint", "arguments": {"n": "5"}}]
    report = run_client(folder, ts_daemon, transport, ["list", "calls"], calls=calls, **extra)
    listed = report["steps"]["list"]
    assert "hugeint" not in listed["names"]
    assert {"hello", "boolprops", "draft3", "anyofroot", "tuplemark"} <= set(listed["names"])
    assert listed["count"] >= len(PAGED) + 4
    took, refused = report["steps"]["calls"]["results"]
    assert took["isError"] is False
    assert "took it" in took["text"]
    assert refused["isError"] is True
    notes = ts_daemon.call("list", {"workspace": str(ts_daemon.workspace)})["result"]["notes"]
    noted = [n["message"] for n in notes if n["set"] == "hugeint"]
    assert len(noted) == 1
    assert "not listed to MCP hosts" in noted[0]
    assert "/properties/n/maximum" in noted[0]


@pytest.mark.timeout(900)  # a fresh machine installs from npm first
def test_ts_client_2026_calls_a_marked_integer_outside_javascripts_safe_range(
    sdk2: Path, ts_daemon: Daemon
) -> None:
    """On 2026-07-28 over HTTP the 2.x client mirrors a marked argument into
    ``Mcp-Param-N``, but no integer outside JavaScript's safe range (which MCP keeps
    mirrored integers within): the daemon refused such a valid call (-32020, the header
    missing), so the host got an error. It runs now; a safe integer is still mirrored and
    checked, and the value still validated against the schema."""
    calls = [{"name": "routed", "arguments": {"n": 2**60}},
             {"name": "routed", "arguments": {"n": -(2**53)}},
             {"name": "routed", "arguments": {"n": 5}},
             {"name": "routed", "arguments": {"n": "5"}}]
    report = run_client(sdk2, ts_daemon, "http", ["initialize", "calls"], calls=calls,
                        package="client", negotiation="auto")
    assert report["steps"]["initialize"]["era"] == "modern"
    big, low, small, text = report["steps"]["calls"]["results"]
    assert big == {"isError": False, "text": big["text"]}
    assert '"n":1152921504606847000' in big["text"]  # 2**60 as JavaScript writes it
    assert low["isError"] is False
    assert '"n":-9007199254740992' in low["text"]
    assert small["isError"] is False
    assert '"n":5' in small["text"]
    assert text["isError"] is True  # "5" is no integer


@pytest.mark.timeout(900)  # a fresh machine installs from npm first
def test_ts_client_2026_lists_a_tool_whose_mark_in_tuple_items_breaks_mcp_rules(
    sdk2: Path, ts_daemon: Daemon
) -> None:
    """A mark in draft 7's tuple ``items`` breaks MCP's rules: the 2.x client on 2026-07-28
    over HTTP looks there and dropped the tool, while the daemon did not look and listed its
    marks. The daemon looks there too: the tool is listed without the mark, and runs."""
    calls = [{"name": "tuplemark", "arguments": {"t": ["a"]}}]
    report = run_client(sdk2, ts_daemon, "http", ["initialize", "list", "calls"], calls=calls,
                        package="client", negotiation="auto")
    assert report["steps"]["initialize"]["era"] == "modern"
    listed = report["steps"]["list"]["tools"]
    assert "tuplemark" in listed
    assert listed["tuplemark"]["inputSchema"]["properties"]["t"] == {  # 2020-12's tuple
        "type": "array", "prefixItems": [{"type": "string"}]}
    (ran,) = report["steps"]["calls"]["results"]
    assert ran["isError"] is False


@pytest.mark.timeout(900)  # a fresh machine installs from npm first
@pytest.mark.parametrize("name", sorted(SHAPE_MARKS))
def test_ts_client_2026_lists_a_tool_whose_mark_under_a_keyword_its_draft_lacks_breaks_mcp_rules(
    sdk2: Path, ts_daemon: Daemon, name: str
) -> None:
    """A keyword the schema's draft does not know takes a value of any shape, and the 2.x
    client on 2026-07-28 over HTTP looks for marks in it as it does where the keyword is
    known: a list's items, an object as a schema (a map keyword's: its values). The daemon
    looked in a list keyword's list only and in a map keyword's object only, so it listed
    the mark and the client dropped the tool. It is listed without it: listed as JSON
    Schema 2020-12, the schema loses the keyword its draft passes by, and the mark in it."""
    calls = [{"name": name, "arguments": {"t": ["a"]}}]
    report = run_client(sdk2, ts_daemon, "http", ["initialize", "list", "calls"], calls=calls,
                        package="client", negotiation="auto")
    assert report["steps"]["initialize"]["era"] == "modern"
    listed = report["steps"]["list"]["tools"]
    assert name in listed
    assert "x-mcp-header" not in json.dumps(listed[name]["inputSchema"])
    (ran,) = report["steps"]["calls"]["results"]
    assert ran["isError"] is False
    # Listed as JSON Schema 2020-12, the keyword draft 7 does not know (and so passes by)
    # is left out with its mark, so there is no mark to note (test_mcpschema.py).
    notes = ts_daemon.call("list", {"workspace": str(ts_daemon.workspace)})["result"]["notes"]
    assert [n["message"] for n in notes if n["set"] == name] == []


@pytest.mark.timeout(900)  # a fresh machine installs from npm first
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_ts_client_abort_cancels_the_call_and_its_child(
    sdk: Path, ts_daemon: Daemon, transport: str
) -> None:
    """An AbortSignal ends the call at the host (notifications/cancelled goes out), the
    tool's process is killed, and the same connection calls again."""
    for name in ("sleeper.pid", "sleeper.call"):
        (ts_daemon.workspace / name).unlink(missing_ok=True)
    report = run_client(sdk, ts_daemon, transport, ["cancel"])
    cancel = report["steps"]["cancel"]
    assert "the host gave up" in cancel["error"]["message"], cancel
    assert "Hello, B!" in cancel["after"]
    eventually(lambda: not alive(cancel["pid"]), timeout=15, what="the sleeper killed")
    call_id = (ts_daemon.workspace / "sleeper.call").read_text()
    finished = [e for e in ts_daemon.log_events()
                if e.get("event") == "call_finished" and e.get("call_id") == call_id]
    assert [e["status"] for e in finished] == ["cancelled"]


@pytest.mark.timeout(900)  # a fresh machine installs from npm first
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_ts_client_answers_approvals(sdk: Path, ts_daemon: Daemon, transport: str) -> None:
    """The approval comes as an elicitation/create the TS client's schema takes (form mode,
    an empty form): an accept runs the call; a decline, or a handler that throws (the
    host cannot ask: the client answers with an error), refuses it as isError. A call the
    host aborts while its question is up withdraws the question: the daemon's
    notifications/cancelled aborts the handler's signal, so the host can take it down."""
    report = run_client(
        sdk, ts_daemon, transport, ["withdrawn", "approvals"],
        answers=["accept", "decline", "throw"],
    )
    withdrawn = report["steps"]["withdrawn"]
    assert "the host gave up" in withdrawn["error"]["message"]
    assert len(withdrawn["withdrawn"]) == 1  # the handler's signal was aborted
    approvals = report["steps"]["approvals"]
    assert approvals["accept"] == {"isError": False, "text": approvals["accept"]["text"]}
    assert "asked and ran" in approvals["accept"]["text"]
    assert approvals["decline"]["isError"] is True
    assert "declined" in approvals["decline"]["text"]
    assert approvals["throw"]["isError"] is True  # the host could not ask
    assert "did not run" in approvals["throw"]["text"]
    assert [a["mode"] for a in approvals["asked"]] == ["form"] * 4
    assert all("asker" in a["message"] for a in approvals["asked"])


@pytest.mark.timeout(900)  # a fresh machine installs from npm first
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_ts_client_hears_list_changed(sdk: Path, ts_daemon: Daemon, transport: str) -> None:
    """A tools.json written while the TS client is connected reaches it as
    notifications/tools/list_changed, and the new tool lists."""
    name = f"fresh_{uuid.uuid4().hex[:10]}"
    folder = ts_daemon.home / "tools" / name
    write = {str(folder / "f.py"): script("print('fresh')\n"),
             str(folder / "tools.json"): json.dumps(tool("f.py"))}
    report = run_client(sdk, ts_daemon, transport, ["list_changed"], write=write, expect=name)
    changed = report["steps"]["list_changed"]
    assert changed["before"] is False
    assert changed["notifications"] >= 1


@pytest.mark.timeout(900)  # a fresh machine installs from npm first
def test_ts_client_ends_its_http_session_and_starts_another(
    sdk: Path, ts_daemon: Daemon
) -> None:
    """terminateSession() sends DELETE and the session ends; a host that comes back with
    the old id is told it is gone (404), and a new connection gets a new session."""
    report = run_client(sdk, ts_daemon, "http", ["initialize", "terminate"])
    ended = report["steps"]["terminate"]
    assert ended["old"] == report["steps"]["initialize"]["sessionId"]
    assert ended["cleared"] is None
    assert ended["stale"] is not None
    assert ended["stale"]["code"] == 404, ended
    assert ended["renewed"] not in (None, ended["old"])
    assert ended["count"] >= len(PAGED)
    assert "Hello, C!" in ended["hello"]


# -- the MCP Inspector's CLI mode ----------------------------------------------------------

INSPECTOR_VERSION = "0.21.2"


@pytest.fixture(scope="module")
def inspector() -> Path:
    """The MCP Inspector's entry point from npm (installed once)."""
    folder = npm_installed(
        f"mcp-inspector-{INSPECTOR_VERSION}",
        [f"@modelcontextprotocol/inspector@{INSPECTOR_VERSION}"],
        "node_modules/@modelcontextprotocol/inspector/cli/build/cli.js",
    )
    return folder / "node_modules/@modelcontextprotocol/inspector/cli/build/cli.js"


def run_inspector(inspector: Path, daemon: Daemon, transport: str, *method: str) -> Any:
    """``mcp-inspector --cli`` against the daemon over ``transport``; returns its JSON."""
    assert daemon.mcp_url is not None
    target = (
        [PY, *pump_args(daemon, daemon.workspace)]
        if transport == "stdio"
        else [endpoint(daemon.mcp_url, daemon.workspace), "--transport", "http"]
    )
    done = subprocess.run(
        [node(), str(inspector), "--cli", *target, "--method", *method],
        capture_output=True, text=True, timeout=120, check=False,
    )
    assert done.returncode == 0, f"{done.stdout}\n{done.stderr}\n{daemon.log()[-4000:]}"
    return json.loads(done.stdout)


@pytest.mark.slow  # several Node processes each, after a 271-package install
@pytest.mark.timeout(900)  # a fresh machine installs from npm first
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_inspector_cli_lists_and_calls(
    inspector: Path, ts_daemon: Daemon, transport: str
) -> None:
    """The Inspector's CLI mode lists the tools (the first page, with its cursor) and calls
    one with an argument, over both transports."""
    listed = run_inspector(inspector, ts_daemon, transport, "tools/list")
    names = [t["name"] for t in listed["tools"]]
    assert len(names) == 1000
    assert "hello" in names
    assert listed["nextCursor"]
    called = run_inspector(
        inspector, ts_daemon, transport, "tools/call", "--tool-name", "hello",
        "--tool-arg", "name=Ada",
    )
    assert called["isError"] is False
    assert "Hello, Ada!" in called["content"][0]["text"]
    failed = run_inspector(inspector, ts_daemon, transport, "tools/call", "--tool-name", "fails")
    assert failed["isError"] is True


@pytest.mark.slow  # two Node processes, after a 271-package install
@pytest.mark.timeout(900)  # a fresh machine installs from npm first
def test_inspector_recipe_of_the_docs_runs_as_written(inspector: Path, ts_daemon: Daemon) -> None:
    """docs/mcp.md's MCP Inspector lines, run as written in the workspace with the
    checkout's ``toolsetctl`` on ``PATH`` (``npx`` runs the installed Inspector; only the
    URL's port and folder filled in), list the workspace's tools over both transports."""
    [block] = re.findall(r"```sh\n(.*?)```", host_recipe("The MCP Inspector"), flags=re.S)
    assert ts_daemon.mcp_url is not None
    url = endpoint(ts_daemon.mcp_url, ts_daemon.workspace)
    lines = doc_commands(block.replace(DOC_URL, url))
    assert len(lines) == 2
    bin_dir = str(Path(sys.executable).parent)  # the checkout's toolsetctl, as installed
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ.get('PATH', '/usr/bin:/bin')}"}
    env["TOOLSETD_SOCKET"] = str(ts_daemon.socket)
    for argv in lines:
        assert argv[:2] == ["npx", "@modelcontextprotocol/inspector"], argv
        done = subprocess.run(
            [node(), str(inspector), *argv[2:]], cwd=ts_daemon.workspace, env=env,
            capture_output=True, text=True, timeout=120, check=False,
        )
        assert done.returncode == 0, f"{done.stdout}\n{done.stderr}"
        names = [t["name"] for t in json.loads(done.stdout)["tools"]]
        assert "hello" in names, argv
