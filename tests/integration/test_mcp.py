"""MCP over stdio: the official MCP SDK client against ``toolsetctl mcp`` and a real daemon.

One daemon per module (per xdist worker) serves every test, over stdio and over HTTP
(``--mcp-listen``): the example sets plus the MCP test sets in its home. Each test brings
its own workspace (the ``workspace`` fixture) with its own project sets, so the files a
tool writes there (``sleeper.pid``) and the project catalog are the test's alone. What the
tests look up in the shared log they find by a call id or a tool name no other test uses;
a set added to the home gets a name of its own. Only the graceful-stop test, which ends
its daemon, starts one of its own (and the autostart test has the client start one).
"""

from __future__ import annotations

import base64
import contextlib
import dataclasses
import itertools
import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import anyio
import mcp_types as types
import pytest
from jsonschema import Draft202012Validator
from mcp import Client
from mcp.shared.exceptions import MCPError

from .conftest import (
    EXAMPLES,
    Daemon,
    RawConn,
    alive,
    daemon_in,
    eventually,
    start_daemon,
    write_set,
)
from .http_helpers import INIT_PARAMS, endpoint, http, listening_urls
from .mcp_helpers import (
    DOC_URL,
    PY,
    RawPump,
    RecipeHost,
    doc_commands,
    git_project,
    host_recipe,
    pump_args,
    script,
    server,
    tool,
    write_project_asker,
    write_test_sets,
)
from .npm_helpers import npm_program

pytestmark = pytest.mark.anyio

MODERN = "2026-07-28"
ASKER_OK = script("print('ran')\n")


@pytest.fixture
def mcp_sets(home: Path, workspace: Path) -> None:
    """The MCP test sets in the home, and a project set that asks, before the daemon starts."""
    write_test_sets(home)
    write_project_asker(workspace)


@pytest.fixture(scope="module")
def shared_daemon() -> Iterator[Daemon]:
    """The module's daemon: the example sets and the MCP test sets, MCP on the socket and
    on an ephemeral 127.0.0.1 port. Its ``mcp_url`` is that endpoint."""

    def fill(home: Path, _workspace: Path) -> None:
        shutil.copytree(EXAMPLES, home / "tools", dirs_exist_ok=True)
        write_test_sets(home)

    with daemon_in("tsm-", fill, ["--mcp-listen", "127.0.0.1:0"]) as d:
        d.mcp_url = listening_urls(d)[0]
        yield d


@pytest.fixture
def project(workspace: Path) -> None:
    """This test's workspace holds a project set that asks (``asker``)."""
    write_project_asker(workspace)


@pytest.fixture
def mcp_daemon(project: None, shared_daemon: Daemon) -> Daemon:
    """The module's daemon, for tests that speak to ``toolsetctl mcp`` over stdio."""
    return dataclasses.replace(shared_daemon, mcp_url=None)


@pytest.fixture(params=["stdio", "http"])
def mcp_host(request: pytest.FixtureRequest, project: None, shared_daemon: Daemon) -> Daemon:
    """The module's daemon as a host reaches it, over stdio (``toolsetctl mcp``) or HTTP.

    The tests that take it run once per transport: ``server(daemon, workspace)`` is the
    pump's stdio parameters, or the endpoint's URL when ``mcp_url`` is set.
    """
    url = shared_daemon.mcp_url if request.param == "http" else None
    return dataclasses.replace(shared_daemon, mcp_url=url)


def _unique(prefix: str) -> str:
    """A set or tool name no other test of the module daemon uses."""
    return f"{prefix}_{uuid.uuid4().hex[:10]}"


def _text(result: types.CallToolResult) -> str:
    return "".join(block.text for block in result.content if isinstance(block, types.TextContent))


# -- eras ----------------------------------------------------------------------------------


@pytest.mark.parametrize(("mode", "version"), [("auto", MODERN), ("legacy", "2025-11-25")])
async def test_mcp_era_lists_and_calls(
    mcp_host: Daemon, workspace: Path, mode: str, version: str
) -> None:
    """Both eras list the workspace's tools with the mapping's fields and run a call."""
    with anyio.fail_after(30):
        async with Client(server(mcp_host, workspace), mode=mode) as client:  # type: ignore[arg-type]
            assert client.protocol_version == version
            listed = await client.list_tools()
            by_name = {t.name: t for t in listed.tools}
            names = [t.name for t in listed.tools]
            assert names == sorted(names)
            assert {"hello", "swatch", "asker", "progress3"} <= set(by_name)
            hello = by_name["hello"]
            assert hello.input_schema["required"] == ["name"]
            assert hello.annotations is not None
            assert hello.annotations.read_only_hint is False
            assert hello.annotations.destructive_hint is True
            assert hello.meta is not None
            assert hello.meta["toolsetd/set"] == "hello"
            assert hello.meta["toolsetd/source"] == "home"
            assert hello.meta["toolsetd/hash"].startswith("sha256:")
            assert by_name["asker"].meta is not None
            assert by_name["asker"].meta["toolsetd/source"] == "project"
            result = await client.call_tool("hello", {"name": "Ada"})
            assert result.is_error is False
            assert "Hello, Ada!" in _text(result)


#: One tool more than a tools/list page holds (docs/mcp.md: pages of 1,000 tools).
PAGED = [f"paged_{n:04d}" for n in range(1001)]


@pytest.fixture(scope="module")
def paged_daemon() -> Iterator[Daemon]:
    """A daemon whose home holds one set of 1,001 tools, MCP on the socket and on HTTP."""

    def fill(home: Path, _workspace: Path) -> None:
        tools = [{"name": name, "description": f"Tool {name}.", "schema": {"type": "object"},
                  "command": ["paged.py"]} for name in PAGED]
        manifest = {"runner": "exec", "approval": "always", "tools": tools}
        write_set(home / "tools", "paged", manifest, **{"paged.py": script("print('paged')\n")})

    with daemon_in("tsp-", fill, ["--mcp-listen", "127.0.0.1:0"]) as d:
        d.mcp_url = listening_urls(d)[0]
        yield d


@pytest.mark.parametrize("transport", ["stdio", "http"])
@pytest.mark.parametrize(("mode", "version"), [("auto", MODERN), ("legacy", "2025-11-25")])
async def test_mcp_sdk_walks_the_tool_pages_by_cursor(
    paged_daemon: Daemon, transport: str, mode: str, version: str
) -> None:
    """The official client walks a list longer than a page by its ``nextCursor``, over
    both transports and in both eras: every tool once, in order, and the last page has
    no cursor; a tool of the second page is called."""
    host = paged_daemon if transport == "http" else dataclasses.replace(paged_daemon, mcp_url=None)
    with anyio.fail_after(60):
        async with Client(server(host, host.workspace), mode=mode) as client:  # type: ignore[arg-type]
            assert client.protocol_version == version
            names: list[str] = []
            cursors: list[str] = []
            cursor = None
            while True:
                page = await client.list_tools(cursor=cursor, cache_mode="bypass")
                names += [t.name for t in page.tools]
                cursor = page.next_cursor
                if cursor is None:
                    break
                cursors.append(cursor)
            assert names == PAGED
            assert len(cursors) == 1
            result = await client.call_tool(PAGED[-1], {})
            assert result.is_error is False
            assert "paged" in _text(result)


def test_mcp_discover_then_initialize_2025_06_18(mcp_daemon: Daemon, workspace: Path) -> None:
    """A host that probes server/discover and then initializes (2025-06-18) is served."""
    pump = RawPump(pump_args(mcp_daemon, workspace))
    try:
        meta = {
            "io.modelcontextprotocol/protocolVersion": MODERN,
            "io.modelcontextprotocol/clientCapabilities": {},
        }
        found = pump.request(1, "server/discover", {"_meta": meta})
        assert found["result"]["resultType"] == "complete"
        assert MODERN in found["result"]["supportedVersions"]
        assert found["result"]["capabilities"]["tools"]["listChanged"] is True
        assert "ttlMs" in found["result"]
        before = pump.request(2, "tools/list")
        assert before["error"]["code"] == -32602
        assert "initialize" in before["error"]["message"]
        init = pump.request(
            3,
            "initialize",
            {
                "protocolVersion": "2025-06-18",
                "capabilities": {},
                "clientInfo": {"name": "probe", "version": "1"},
            },
        )
        assert init["result"]["protocolVersion"] == "2025-06-18"
        assert init["result"]["capabilities"] == {"tools": {"listChanged": True}}
        pump.send({"jsonrpc": "2.0", "method": "notifications/initialized"})
        listed = pump.request(4, "tools/list")
        assert "resultType" not in listed["result"]
        assert any(t["name"] == "hello" for t in listed["result"]["tools"])
        odd = pump.request(
            5, "tools/list", {"_meta": {"io.modelcontextprotocol/protocolVersion": "1999-01-01"}}
        )
        assert odd["error"]["code"] == -32022
        assert MODERN in odd["error"]["data"]["supported"]
        assert pump.request(6, "resources/list")["error"]["code"] == -32601
    finally:
        assert pump.close() == 0


def test_mcp_ping_is_no_method_of_2026_07_28(mcp_daemon: Daemon, workspace: Path) -> None:
    """2026-07-28 removed ``ping``: a ping whose ``_meta`` names that revision is -32601,
    as any method the revision does not have (the official SDK's server answers it so; it
    was answered with a 2026-07-28 result). A ping that names no version is answered, and
    so is one in a legacy session."""
    meta = {
        "io.modelcontextprotocol/protocolVersion": MODERN,
        "io.modelcontextprotocol/clientCapabilities": {},
    }
    pump = RawPump(pump_args(mcp_daemon, workspace))
    try:
        removed = pump.request(1, "ping", {"_meta": meta})
        assert removed["error"]["code"] == -32601, removed
        assert "2026-07-28" in removed["error"]["message"]
        assert pump.request(2, "ping")["result"] == {}
        pump.request(3, "initialize", {"protocolVersion": "2025-11-25", "capabilities": {}, "clientInfo": {"name": "t", "version": "1"}})
        assert pump.request(4, "ping")["result"] == {}
        assert pump.request(5, "ping", {"_meta": meta})["error"]["code"] == -32601
    finally:
        assert pump.close() == 0


def test_mcp_a_method_toolsetd_lacks_is_not_found_before_initialize_too(
    mcp_daemon: Daemon, workspace: Path
) -> None:
    """A method toolsetd does not serve is -32601 whether or not initialize came first,
    as the SDK's server answers it ("clients probing a server before the handshake key off
    that code"); it was -32602 "send initialize first", which initialize does not cure.
    A method it serves is still told to initialize first."""
    pump = RawPump(pump_args(mcp_daemon, workspace))
    try:
        for n, method in enumerate(("resources/list", "prompts/list", "logging/setLevel",
                                    "tasks/get", "completion/complete")):
            reply = pump.request(n, method, {})
            assert reply["error"]["code"] == -32601, (method, reply)
            assert reply["error"]["data"] == {"method": method}, reply
        before = pump.request("list", "tools/list")
        assert before["error"]["code"] == -32602, before
        assert "initialize" in before["error"]["message"]
    finally:
        assert pump.close() == 0


def test_mcp_a_task_augmented_call_is_served_as_a_plain_call(
    mcp_daemon: Daemon, workspace: Path
) -> None:
    """toolsetd declares no ``tasks`` capability, so a ``tools/call`` carrying 2025-11-25's
    ``task`` augmentation is processed normally, the augmentation ignored (MCP: a receiver
    that does not declare the task capability for a request type MUST): the tool runs and
    its result is the answer, not a task. ``tasks/*`` are methods it does not have."""
    pump = RawPump(pump_args(mcp_daemon, workspace))
    try:
        init = pump.request(1, "initialize", {
            "protocolVersion": "2025-11-25", "clientInfo": {"name": "t", "version": "1"},
            "capabilities": {"tasks": {"requests": {"elicitation": {"create": {}}}}}})
        assert "tasks" not in init["result"]["capabilities"]
        pump.send({"jsonrpc": "2.0", "method": "notifications/initialized"})
        call = pump.request(2, "tools/call", {"name": "hello", "arguments": {"name": "Ada"},
                                              "task": {"ttl": 60000}})
        assert call["result"]["isError"] is False, call
        assert "Hello, Ada!" in call["result"]["content"][0]["text"]
        assert "task" not in call["result"]
        for n, method in enumerate(("tasks/get", "tasks/list", "tasks/result", "tasks/cancel")):
            assert pump.request(3 + n, method, {"taskId": "x"})["error"]["code"] == -32601
    finally:
        assert pump.close() == 0


def test_mcp_a_protocol_version_that_is_not_a_string_is_invalid_params(
    mcp_daemon: Daemon, workspace: Path
) -> None:
    """A ``_meta`` protocol version that is not a string is -32602 naming the field, not
    -32022: that error's ``data.requested`` is a string by the schema, and the value (an
    object, however large) was echoed there and in the message."""
    pump = RawPump(pump_args(mcp_daemon, workspace))
    try:
        for n, version in enumerate((5, ["2026-07-28"], {"v": "2026-07-28"}, True)):
            reply = pump.request(
                n, "tools/list", {"_meta": {"io.modelcontextprotocol/protocolVersion": version}}
            )
            assert reply["error"]["code"] == -32602, reply
            assert reply["error"]["data"] == {
                "field": "_meta.io.modelcontextprotocol/protocolVersion"
            }
        odd = pump.request(9, "tools/list", {"_meta": {
            "io.modelcontextprotocol/protocolVersion": "1999-01-01"}})
        assert odd["error"]["code"] == -32022
        assert odd["error"]["data"]["requested"] == "1999-01-01"
    finally:
        assert pump.close() == 0


def test_mcp_a_2026_request_without_client_capabilities_is_invalid_params(
    mcp_daemon: Daemon, workspace: Path
) -> None:
    """A 2026-07-28 request whose ``_meta`` lacks ``clientCapabilities`` (or whose value is
    not an object) is malformed: MCP has the server reject it with -32602 (it was served,
    as a host that declared nothing). ``{}`` is a host that declares nothing."""
    version = {"io.modelcontextprotocol/protocolVersion": MODERN}
    field = "_meta.io.modelcontextprotocol/clientCapabilities"
    pump = RawPump(pump_args(mcp_daemon, workspace))
    try:
        for n, method in enumerate(("tools/list", "server/discover", "ping")):
            for m, caps in enumerate(({}, {"x": None}, {"x": 5}, {"x": ["elicitation"]})):
                meta = {**version, **{field.removeprefix("_meta."): c for c in caps.values()}}
                reply = pump.request(f"{n}-{m}", method, {"_meta": meta})
                assert reply["error"]["code"] == -32602, (method, caps, reply)
                assert reply["error"]["data"] == {"field": field}
                assert "clientCapabilities" in reply["error"]["message"]
        meta = {**version, field.removeprefix("_meta."): {}}
        assert pump.request("ok", "tools/list", {"_meta": meta})["result"]["tools"]
    finally:
        assert pump.close() == 0


def test_mcp_garbage_on_stdin_is_answered_and_survived(mcp_daemon: Daemon, workspace: Path) -> None:
    """Lines that are not JSON, not JSON-RPC or a batch get errors; the session carries on."""
    pump = RawPump(pump_args(mcp_daemon, workspace))
    try:
        pump.send(b"this is not json\n")
        assert pump.receive()["error"]["code"] == -32700
        pump.send(b"\xff\xfe\x00 binary\n")
        assert pump.receive()["error"]["code"] == -32700
        pump.send([{"jsonrpc": "2.0", "id": 1, "method": "ping"}])
        assert pump.receive()["error"]["code"] == -32600
        pump.send(b"42\n")
        assert pump.receive()["error"]["code"] == -32600
        pump.send({"foo": 1})
        assert pump.receive()["error"]["code"] == -32600
        pump.send({"jsonrpc": "1.0", "id": 5, "method": "ping"})
        assert pump.receive() == {
            "jsonrpc": "2.0",
            "id": 5,
            "error": {
                "code": -32600,
                "message": "Invalid Request: 'jsonrpc' must be exactly \"2.0\".",
            },
        }
        init = pump.request(7, "initialize", {"protocolVersion": "2025-11-25", "capabilities": {}, "clientInfo": {"name": "t", "version": "1"}})
        assert init["result"]["protocolVersion"] == "2025-11-25"
        assert pump.request(8, "ping")["result"] == {}
    finally:
        assert pump.close() == 0


def test_mcp_arguments_deeper_than_the_cap_are_refused_naming_it(
    mcp_daemon: Daemon, workspace: Path
) -> None:
    """tools/call arguments nested past 64 levels get -32602 naming 'arguments', as a native
    invoke does; the session carries on."""
    deep: Any = 1
    for _ in range(300):
        deep = [deep]
    pump = RawPump(pump_args(mcp_daemon, workspace))
    try:
        init = pump.request(1, "initialize", {"protocolVersion": "2025-11-25", "capabilities": {}, "clientInfo": {"name": "t", "version": "1"}})
        assert "result" in init
        reply = pump.request(2, "tools/call", {"name": "hello", "arguments": {"name": deep}})
        assert reply["error"]["code"] == -32602, reply
        assert "'arguments'" in reply["error"]["message"] and "64" in reply["error"]["message"]
        assert pump.request(3, "ping")["result"] == {}
    finally:
        assert pump.close() == 0


@pytest.mark.parametrize("token", [1.5, True, {"id": 1}, ["p"]], ids=repr)
def test_mcp_progress_token_of_another_type_is_refused_naming_it(
    mcp_daemon: Daemon, workspace: Path, token: Any
) -> None:
    """MCP: a progressToken MUST be a string or an integer. Any other type gets -32602 naming
    '_meta.progressToken' (it would be echoed in every progress notification); a string, an
    integer or null is taken, and the session carries on."""
    pump = RawPump(pump_args(mcp_daemon, workspace))
    try:
        init = pump.request(1, "initialize", {"protocolVersion": "2025-11-25", "capabilities": {}, "clientInfo": {"name": "t", "version": "1"}})
        assert "result" in init
        call = {"name": "hello", "arguments": {"name": "Ada"}}
        reply = pump.request(2, "tools/call", {**call, "_meta": {"progressToken": token}})
        assert reply["error"]["code"] == -32602, reply
        assert "'_meta.progressToken'" in reply["error"]["message"]
        assert reply["error"]["data"] == {"field": "_meta.progressToken"}
        for i, fine in enumerate((7, "p", None, 2**70)):
            answer = pump.request(3 + i, "tools/call", {**call, "_meta": {"progressToken": fine}})
            assert answer["result"]["isError"] is False, answer
    finally:
        assert pump.close() == 0


@pytest.mark.parametrize("meta", [5, "progress", ["p"], True, 1.5], ids=repr)
def test_mcp_a_meta_that_is_no_object_is_refused_naming_it(
    mcp_daemon: Daemon, workspace: Path, meta: Any
) -> None:
    """MCP's ``_meta`` is an object. One of another type was read as none: the call ran,
    and whatever the host meant by it (a progress token, a version) was lost unsaid. It
    is -32602 naming '_meta', on any request, as the SDK's server refuses it; null is
    taken as none, and the session carries on."""
    pump = RawPump(pump_args(mcp_daemon, workspace))
    try:
        hello = {"protocolVersion": "2025-11-25", "capabilities": {}, "clientInfo": {"name": "t", "version": "1"}}
        refused = pump.request(1, "initialize", {**hello, "_meta": meta})
        assert refused["error"]["data"] == {"field": "_meta"}, refused
        init = pump.request(1, "initialize", hello)
        assert "result" in init
        call = {"name": "hello", "arguments": {"name": "Ada"}}
        for request_id, (method, params) in enumerate(
                (("tools/call", call), ("tools/list", {}), ("ping", {})), start=2):
            reply = pump.request(request_id, method, {**params, "_meta": meta})
            assert reply["error"]["code"] == -32602, reply
            assert "'_meta' must be an object" in reply["error"]["message"]
            assert reply["error"]["data"] == {"field": "_meta"}
        answer = pump.request(9, "tools/call", {**call, "_meta": None})
        assert answer["result"]["isError"] is False, answer
    finally:
        assert pump.close() == 0


@pytest.mark.parametrize("token", [1.0, 1e3, -0.0], ids=repr)
def test_mcp_progress_token_an_integer_written_with_a_fraction_is_taken_and_echoed(
    mcp_daemon: Daemon, workspace: Path, token: float
) -> None:
    """MCP's schema types progressToken ``["string", "integer"]``, and JSON Schema's integer
    is any number with no fractional part: ``1.0`` (what a serialiser holding its integer
    as a double writes) is a token. It was -32602, the call refused. Its progress comes on
    the token as the host wrote it (Python's json reads that back as a float)."""
    pump = RawPump(pump_args(mcp_daemon, workspace))
    try:
        init = pump.request(1, "initialize", {"protocolVersion": "2025-11-25", "capabilities": {}, "clientInfo": {"name": "t", "version": "1"}})
        assert "result" in init
        pump.send({"jsonrpc": "2.0", "id": 2, "method": "tools/call",
                   "params": {"name": "progress3", "arguments": {}, "_meta": {"progressToken": token}}})
        progress = []
        while "id" not in (message := pump.receive()):
            if message["method"] == "notifications/progress":
                progress.append(message["params"]["progressToken"])
        assert "result" in message and message["result"]["isError"] is False, message
        assert progress, "no progress on the token"
        assert all(type(each) is float and each == token for each in progress), progress
    finally:
        assert pump.close() == 0


@pytest.mark.parametrize(
    "token", ["1.5e99999999999999999999999", "1e-99999999999999999999999"], ids=str
)
def test_mcp_progress_token_with_an_exponent_past_decimal_range_is_refused_naming_it(
    mcp_daemon: Daemon, workspace: Path, token: str
) -> None:
    """A token written with an exponent that ``decimal`` cannot hold (its construction
    raises ``InvalidOperation``) is no integer the host could mean: -32602 naming
    '_meta.progressToken', as for 1.5, not an internal error, and the session carries on."""
    pump = RawPump(pump_args(mcp_daemon, workspace))
    try:
        init = pump.request(1, "initialize", {"protocolVersion": "2025-11-25", "capabilities": {}, "clientInfo": {"name": "t", "version": "1"}})
        assert "result" in init
        pump.send(
            b'{"jsonrpc": "2.0", "id": 2, "method": "tools/call", "params": {"name": "hello", '
            b'"arguments": {"name": "Ada"}, "_meta": {"progressToken": ' + token.encode()
            + b"}}}\n"
        )
        reply = pump.receive()
        assert reply.get("id") == 2 and reply["error"]["code"] == -32602, reply
        assert reply["error"]["data"] == {"field": "_meta.progressToken"}
        assert pump.request(3, "ping")["result"] == {}
    finally:
        assert pump.close() == 0


def test_mcp_a_second_initialize_is_refused_and_the_first_stands(
    mcp_daemon: Daemon, workspace: Path
) -> None:
    """initialize is a session's first exchange, once: a second gets -32600 naming the
    version agreed, and the session goes on under the first one's terms."""
    pump = RawPump(pump_args(mcp_daemon, workspace))
    try:
        first = pump.request(1, "initialize", {"protocolVersion": "2025-06-18", "capabilities": {}, "clientInfo": {"name": "t", "version": "1"}})
        assert first["result"]["protocolVersion"] == "2025-06-18"
        again = pump.request(2, "initialize", {"protocolVersion": "2025-11-25", "capabilities": {}, "clientInfo": {"name": "t", "version": "1"}})
        assert again["error"]["code"] == -32600, again
        assert "already initialized (protocol 2025-06-18)" in again["error"]["message"]
        listed = pump.request(3, "tools/list")
        assert any(t["name"] == "hello" for t in listed["result"]["tools"])
    finally:
        assert pump.close() == 0


#: Malformed initialize params (MCP's InitializeRequestParams: protocolVersion a string,
#: capabilities an object, clientInfo an Implementation with string name and version) and
#: the field each -32602 names.
MALFORMED_INITIALIZE = [
    (None, "params"),
    ({"capabilities": {}, "clientInfo": {"name": "h", "version": "1"}}, "protocolVersion"),
    ({**INIT_PARAMS, "protocolVersion": 20251125}, "protocolVersion"),
    ({**INIT_PARAMS, "protocolVersion": None}, "protocolVersion"),
    ({"protocolVersion": "2025-11-25", "clientInfo": {"name": "h", "version": "1"}},
     "capabilities"),
    ({**INIT_PARAMS, "capabilities": "x"}, "capabilities"),
    ({**INIT_PARAMS, "capabilities": ["elicitation"]}, "capabilities"),
    ({"protocolVersion": "2025-11-25", "capabilities": {}}, "clientInfo"),
    ({**INIT_PARAMS, "clientInfo": "host 1.0"}, "clientInfo"),
    ({**INIT_PARAMS, "clientInfo": {"version": "1"}}, "clientInfo.name"),
    ({**INIT_PARAMS, "clientInfo": {"name": 7, "version": "1"}}, "clientInfo.name"),
    ({**INIT_PARAMS, "clientInfo": {"name": "h"}}, "clientInfo.version"),
    ({**INIT_PARAMS, "clientInfo": {"name": "h", "version": 1}}, "clientInfo.version"),
]


def test_mcp_a_malformed_initialize_is_invalid_params_naming_the_field(
    mcp_daemon: Daemon, workspace: Path
) -> None:
    """MCP's schema makes initialize's params, and in them ``protocolVersion`` (a string),
    ``capabilities`` (an object) and ``clientInfo`` (a name and a version, strings),
    required; the SDK's server refuses one without them with -32602. Each is -32602 naming
    the field (they were accepted, and a host that declared ``capabilities: "x"`` was
    served as one that declared nothing); the session is not initialized by it, so a
    well-formed initialize after it opens the session."""
    pump = RawPump(pump_args(mcp_daemon, workspace))
    try:
        for n, (params, field) in enumerate(MALFORMED_INITIALIZE):
            reply = pump.request(n, "initialize", params)
            assert reply["error"]["code"] == -32602, (params, reply)
            assert reply["error"]["data"] == {"field": field}, (params, reply)
            assert f"'{field}'" in reply["error"]["message"], reply
            assert pump.request(f"list-{n}", "tools/list")["error"]["code"] == -32602
        init = pump.request("ok", "initialize", INIT_PARAMS)
        assert init["result"]["protocolVersion"] == "2025-11-25", init
        # Extra fields are the host's own (title, icons, ...; the schema leaves it open).
        again = pump.request("again", "initialize", {**INIT_PARAMS, "x": 1})
        assert "already initialized" in again["error"]["message"], again
    finally:
        assert pump.close() == 0


def test_mcp_two_initializes_at_once_get_one_answer_and_one_refusal(
    mcp_daemon: Daemon, tmp_path: Path
) -> None:
    """Two initializes sent back to back (the second while the first may still be building
    a new workspace's catalog): exactly one succeeds."""
    fresh = tmp_path / "fresh"
    (fresh / ".crystal" / "tools").mkdir(parents=True)
    pump = RawPump(pump_args(mcp_daemon, fresh))
    try:
        for request_id in (1, 2):
            pump.send(
                {
                    "jsonrpc": "2.0",
                    "id": request_id,
                    "method": "initialize",
                    "params": {"protocolVersion": "2025-11-25", "capabilities": {}, "clientInfo": {"name": "t", "version": "1"}},
                }
            )
        answers = sorted((pump.receive() for _ in range(2)), key=lambda a: a["id"])
        assert sorted("result" in a for a in answers) == [False, True], answers
        refused = next(a for a in answers if "error" in a)
        assert refused["error"]["code"] == -32600
        assert "already initialized" in refused["error"]["message"]
    finally:
        assert pump.close() == 0


#: initialize, initialized and tools/list (id 2), as a host opens a session.
_OPENING = [
    {"jsonrpc": "2.0", "id": 1, "method": "initialize",
     "params": {"protocolVersion": "2025-11-25", "capabilities": {}, "clientInfo": {"name": "t", "version": "1"}}},
    {"jsonrpc": "2.0", "method": "notifications/initialized"},
    {"jsonrpc": "2.0", "id": 2, "method": "tools/list"},
]


def _pump_on_a_fresh_workspace(daemon: Daemon, tmp_path: Path) -> RawPump:
    """A pump bound to a workspace the daemon has not loaded (its catalog not built yet)."""
    fresh = tmp_path / "fresh"
    (fresh / ".crystal" / "tools").mkdir(parents=True)
    return RawPump(pump_args(daemon, fresh))


def test_mcp_a_cancel_of_initialize_is_ignored(mcp_daemon: Daemon, tmp_path: Path) -> None:
    """MCP: a client MUST NOT cancel its initialize, and a receiver may ignore a cancel of
    a request that cannot be cancelled. One sent right behind it (while a new workspace's
    catalog is built) withheld initialize's answer, yet the session was initialized by it:
    the host, told nothing, was refused "already initialized" when it sent it again. It is
    ignored: initialize is answered, and the session is the one it opened."""
    pump = _pump_on_a_fresh_workspace(mcp_daemon, tmp_path)
    try:
        init = {"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": INIT_PARAMS}
        cancel = {"jsonrpc": "2.0", "method": "notifications/cancelled",
                  "params": {"requestId": 1, "reason": "test"}}
        pump.send(json.dumps(init).encode() + b"\n" + json.dumps(cancel).encode() + b"\n")
        pump.send({"jsonrpc": "2.0", "id": 2, "method": "tools/list"})  # waits for it
        seen: dict[Any, Any] = {}
        while 2 not in seen:
            message = pump.receive()
            seen[message["id"]] = message
        pump.send({"jsonrpc": "2.0", "id": 3, "method": "ping"})  # whatever is on its way
        while 3 not in seen:
            message = pump.receive()
            seen[message["id"]] = message
        assert seen[2]["result"]["tools"] is not None, seen
        assert seen[1]["result"]["protocolVersion"] == "2025-11-25", seen
    finally:
        assert pump.close() == 0


def test_mcp_a_request_pipelined_behind_initialize_is_served_under_it(
    mcp_daemon: Daemon, tmp_path: Path
) -> None:
    """A tools/list written right behind initialize (in the same write, while initialize
    still builds a new workspace's catalog) waits for it and is served under the version
    it agrees on, never refused as sent 'before initialize': the host's order is kept."""
    pump = _pump_on_a_fresh_workspace(mcp_daemon, tmp_path)
    frames = [
        *_OPENING,
        {"jsonrpc": "2.0", "id": 3, "method": "tools/call",
         "params": {"name": "hello", "arguments": {"name": "Ada"}}},
    ]
    try:
        pump.send(b"".join(json.dumps(frame).encode() + b"\n" for frame in frames))
        answers = {a["id"]: a for a in (pump.receive() for _ in range(3))}
        assert answers[1]["result"]["protocolVersion"] == "2025-11-25", answers
        assert any(t["name"] == "hello" for t in answers[2]["result"]["tools"]), answers
        assert answers[3]["result"]["isError"] is False, answers
    finally:
        assert pump.close() == 0


def test_mcp_requests_read_before_stdin_closes_are_still_answered(
    mcp_daemon: Daemon, tmp_path: Path
) -> None:
    """A host (a script: printf ... | toolsetctl mcp) that writes its requests and closes
    stdin: only its tool calls are cancelled; initialize and tools/list, read before the
    end of input, are answered whether or not the new workspace's catalog was built by
    then, and the pump exits 0 once they are out."""
    pump = _pump_on_a_fresh_workspace(mcp_daemon, tmp_path)
    pump.send(b"".join(json.dumps(frame).encode() + b"\n" for frame in _OPENING))
    assert pump.close() == 0
    answers = {a["id"]: a for a in (json.loads(line) for line in pump.stdout_text.splitlines())}
    assert answers[1]["result"]["protocolVersion"] == "2025-11-25", answers
    assert any(t["name"] == "hello" for t in answers[2]["result"]["tools"]), answers


def test_mcp_the_last_request_needs_no_newline_before_the_end_of_input(
    mcp_daemon: Daemon, tmp_path: Path
) -> None:
    """The end of input ends the last message as a newline would (``printf '%s' "$json" |
    toolsetctl mcp``, as the SDK's own stdio server reads it): it is answered, not
    dropped as a line cut short."""
    pump = _pump_on_a_fresh_workspace(mcp_daemon, tmp_path)
    pump.send(b"\n".join(json.dumps(frame).encode() for frame in _OPENING))
    assert pump.close() == 0
    answers = {a["id"]: a for a in (json.loads(line) for line in pump.stdout_text.splitlines())}
    assert any(t["name"] == "hello" for t in answers[2]["result"]["tools"]), answers


# -- calls ---------------------------------------------------------------------------------


async def test_mcp_call_results_image_error_and_refusals(
    mcp_host: Daemon, workspace: Path
) -> None:
    """Images carry over; a failing tool, a schema error and a fence refusal are isError."""
    with anyio.fail_after(30):
        async with Client(server(mcp_host, workspace), mode="legacy") as client:
            swatch = await client.call_tool("swatch", {"color": "#00ff00"})
            assert swatch.is_error is False
            images = [b for b in swatch.content if isinstance(b, types.ImageContent)]
            assert images
            assert images[0].mime_type == "image/png"
            assert base64.b64decode(images[0].data).startswith(b"\x89PNG")
            failed = await client.call_tool("fails", {})
            assert failed.is_error is True
            assert "exit 3" in _text(failed)
            assert "it broke" in _text(failed)
            bad = await client.call_tool("swatch", {"color": 7})
            assert bad.is_error is True
            assert "/color" in _text(bad)
            missing = await client.call_tool("hello", {})
            assert missing.is_error is True
            assert "name" in _text(missing)
            with pytest.raises(MCPError) as unknown:
                await client.call_tool("no_such_tool", {})
            assert unknown.value.error.code == -32602
            assert "no_such_tool" in unknown.value.error.message


async def test_mcp_progress_delivers_every_tool_line(mcp_host: Daemon, workspace: Path) -> None:
    """Three progress lines 50 ms apart arrive as three notifications, in order, increasing."""
    seen: list[tuple[float, float | None, str | None]] = []

    async def on_progress(progress: float, total: float | None, message: str | None) -> None:
        seen.append((progress, total, message))

    with anyio.fail_after(30):
        async with Client(server(mcp_host, workspace)) as client:
            result = await client.call_tool("progress3", {}, progress_callback=on_progress)
    assert "counted" in _text(result)
    reported = [s for s in seen if s[2] is not None]
    assert [s[2] for s in reported] == ["0/100", "50/100", "100/100"]
    assert [(s[0], s[1]) for s in reported] == [(0.0, 100), (50.0, 100), (100.0, 100)]
    values = [s[0] for s in seen]
    assert all(a < b for a, b in itertools.pairwise(values))


def test_mcp_progress_of_calls_side_by_side_precedes_each_answer(
    mcp_daemon: Daemon, workspace: Path
) -> None:
    """Over the pump, twelve ``progress3`` calls sent at once: each gets its three lines as
    notifications on its own token, every one before its call's answer (MCP: progress
    names only a request in flight; a host's SDK reports one after the answer as an
    unknown token's). Read raw, in the order the host reads them."""
    pump = RawPump(pump_args(mcp_daemon, workspace))
    try:
        pump.request(0, "initialize", {"protocolVersion": "2025-11-25", "capabilities": {},
                                       "clientInfo": {"name": "t", "version": "1"}})
        pump.send({"jsonrpc": "2.0", "method": "notifications/initialized"})
        calls = range(1, 13)
        for n in calls:
            pump.send({"jsonrpc": "2.0", "id": n, "method": "tools/call",
                       "params": {"name": "progress3", "arguments": {},
                                  "_meta": {"progressToken": f"t{n}"}}})
        answered: set[int] = set()
        lines: dict[str, list[str]] = {f"t{n}": [] for n in calls}
        while len(answered) < len(calls):
            message = pump.receive()
            if message.get("method") == "notifications/progress":
                token = message["params"]["progressToken"]
                assert int(token[1:]) not in answered, f"progress after its answer: {message}"
                if "total" in message["params"]:  # a line of the tool's (not a queued call's)
                    lines[token].append(message["params"]["message"])
            elif "method" not in message:
                assert "counted" in message["result"]["content"][0]["text"], message
                answered.add(message["id"])
        assert lines == {f"t{n}": ["0/100", "50/100", "100/100"] for n in calls}
    finally:
        assert pump.close() == 0


async def test_mcp_cancel_ends_the_call_and_its_child(mcp_host: Daemon, workspace: Path) -> None:
    """notifications/cancelled kills the tool's process group; the session carries on."""
    pid_file = workspace / "sleeper.pid"
    with anyio.fail_after(40):
        async with Client(server(mcp_host, workspace)) as client:
            with anyio.CancelScope() as scope:
                async with anyio.create_task_group() as tg:
                    tg.start_soon(client.call_tool, "sleeper", {})
                    while not pid_file.exists() or not pid_file.read_text():
                        await anyio.sleep(0.02)
                    scope.cancel()
            pid = int(pid_file.read_text())
            call_id = (workspace / "sleeper.call").read_text()
            deadline = time.monotonic() + 15
            while alive(pid):
                assert time.monotonic() < deadline, "the cancelled tool still runs"
                await anyio.sleep(0.05)
            assert "Hello, B!" in _text(await client.call_tool("hello", {"name": "B"}))
    finished = [
        e
        for e in mcp_host.log_events()
        if e.get("event") == "call_finished" and e.get("call_id") == call_id
    ]
    assert finished
    assert finished[0]["tool"] == "sleeper"
    assert finished[0]["status"] == "cancelled"


def test_mcp_stdin_closing_cancels_the_hosts_calls(mcp_daemon: Daemon, workspace: Path) -> None:
    """When the host goes away (stdin closes), its running call is cancelled and the pump exits."""
    pump = RawPump(pump_args(mcp_daemon, workspace))
    pump.request(1, "initialize", {"protocolVersion": "2025-11-25", "capabilities": {}, "clientInfo": {"name": "t", "version": "1"}})
    pump.send(
        {
            "jsonrpc": "2.0",
            "id": 2,
            "method": "tools/call",
            "params": {"name": "sleeper", "arguments": {}},
        }
    )
    pid_file = workspace / "sleeper.pid"
    eventually(
        lambda: pid_file.exists() and bool(pid_file.read_text()), what="the sleeper to start"
    )
    pid = int(pid_file.read_text())
    assert pump.close() == 0
    eventually(lambda: not alive(pid), timeout=15, what="the sleeper to be killed")


@pytest.mark.slow
@pytest.mark.timeout(300)  # the SDK client's own parse of a 20 MB line takes minutes when loaded
async def test_mcp_big_text_and_15_mib_image(mcp_host: Daemon, workspace: Path) -> None:
    """A 100,000-character result and a 15 MiB image arrive whole."""
    with anyio.fail_after(240):
        async with Client(server(mcp_host, workspace), mode="legacy") as client:
            big = await client.call_tool("big", {})
            assert big.is_error is False
            assert len(_text(big)) == 100_000  # the whole limit, not cut
            assert _text(big).count("y") == 99_993
            assert big.meta is not None
            assert big.meta["toolsetd/truncated"] is False
            image = await client.call_tool("bigimage", {})
    images = [b for b in image.content if isinstance(b, types.ImageContent)]
    assert len(images) == 1
    data = base64.b64decode(images[0].data)
    assert len(data) == 8 + 15 * 1024 * 1024
    assert data == (workspace / "big.png").read_bytes()


# -- catalog changes -----------------------------------------------------------------------


async def test_mcp_list_changed_after_editing_a_tools_json(
    mcp_host: Daemon, workspace: Path
) -> None:
    """Editing a tools.json sends notifications/tools/list_changed; the new tool lists."""
    # The home is the module daemon's: a name of its own, so neither transport's run finds
    # it there already. The catalog changes once, so no later test gets a late notification.
    name = _unique("greet2")
    changed = [anyio.Event()]  # the current wait's; each notification sets it

    async def on_message(message: Any) -> None:
        if isinstance(message, types.ToolListChangedNotification):
            changed[0].set()

    with anyio.fail_after(30):
        async with Client(
            server(mcp_host, workspace), mode="legacy", message_handler=on_message
        ) as client:
            assert name not in {t.name for t in (await client.list_tools()).tools}
            write_set(
                mcp_host.home / "tools", name, tool("g.py"), **{"g.py": f"#!{PY}\nprint(2)\n"}
            )
            # The watcher may see tools.json created empty, before its text: that reload
            # (the set refused) is announced too, and the next one adds the tool. Each
            # listing follows a notification; the tool must appear in one of them.
            while True:
                await changed[0].wait()  # the watcher saw an edit and reloaded
                changed[0] = anyio.Event()
                if name in {t.name for t in (await client.list_tools()).tools}:
                    break


async def test_mcp_list_changed_modern_listen(mcp_host: Daemon, workspace: Path) -> None:
    """On 2026-07-28, subscriptions/listen carries list_changed after a reload."""
    with anyio.fail_after(30):
        async with Client(server(mcp_host, workspace)) as client:
            async with client.listen(tools_list_changed=True) as sub:
                assert "fresh" not in {t.name for t in (await client.list_tools()).tools}
                write_set(
                    workspace / ".crystal" / "tools",
                    "fresh",
                    tool("f.py"),
                    **{"f.py": f"#!{PY}\nprint(1)\n"},
                )
                mcp_host.call("reload", {"workspace": str(workspace)})
                async for _event in sub:
                    break
            assert "fresh" in {t.name for t in (await client.list_tools()).tools}


def test_mcp_bind_says_the_connections_line_limit(tmp_base: Path) -> None:
    """The bind's answer says the longest line the connection takes (``maxMessageBytes``):
    the pump holds no longer line of its host's to parse, as the daemon refuses it
    unread."""
    with (
        daemon_in("tsm-", None, ["--no-watch", "--max-message-bytes", "100000"]) as d,
        d.raw() as conn,
    ):
        conn.send({"jsonrpc": "2.0", "id": "b", "method": "mcp.bind",
                   "params": {"workspace": str(d.workspace)}})
        assert conn.receive()["result"]["maxMessageBytes"] == 100000


def test_mcp_a_change_made_on_the_listens_acknowledgement_is_announced(tmp_base: Path) -> None:
    """A 2026-07-28 host edits a tool set as soon as its listen is acknowledged: the
    change is announced on the stream. The daemon acknowledged the listen before it took
    the snapshot a change is told against, and that snapshot (a workspace's first) was
    read after the edit: the reload found no difference, and the host was never told."""
    meta = {"io.modelcontextprotocol/protocolVersion": "2026-07-28",
            "io.modelcontextprotocol/clientCapabilities": {}}
    stream = {"io.modelcontextprotocol/subscriptionId": "sub"}
    with daemon_in("tsm-", None, ["--no-watch"]) as d, d.raw() as conn:
        conn.send({"jsonrpc": "2.0", "id": "b", "method": "mcp.bind",
                   "params": {"workspace": str(d.workspace)}})
        assert conn.receive()["result"]["bound"] is True
        conn.send({"jsonrpc": "2.0", "id": "sub", "method": "subscriptions/listen",
                   "params": {"_meta": meta, "notifications": {"toolsListChanged": True}}})
        acknowledged = conn.receive()
        assert acknowledged["method"] == "notifications/subscriptions/acknowledged"
        write_set(d.workspace / ".crystal" / "tools", "fresh", tool("f.py"),
                  **{"f.py": ASKER_OK})
        assert "result" in d.call("reload", {"workspace": str(d.workspace)})
        conn.send({"jsonrpc": "2.0", "id": 2, "method": "tools/list",
                   "params": {"_meta": meta}})
        seen = [conn.receive()]
        while seen[-1].get("id") != 2:
            seen.append(conn.receive())
        told = {"jsonrpc": "2.0", "method": "notifications/tools/list_changed",
                "params": {"_meta": stream}}
        assert seen[:-1] == [told], seen
        assert "fresh" in {t["name"] for t in seen[-1]["result"]["tools"]}


def test_mcp_list_changed_only_when_the_hosts_list_changed(tmp_base: Path) -> None:
    """A reload that leaves the host's tools/list as it was (a tool of the other catalog
    edited, a broken set broken another way) sends no list_changed; one that changes it
    does, once."""

    def plan_set(description: str) -> dict[str, Any]:
        return tool("p.py", catalogs=["plan"], description=description)

    def work_set(description: str) -> dict[str, Any]:
        return tool("w.py", catalogs=["work"], description=description)

    def fill(_home: Path, workspace: Path) -> None:
        sets = workspace / ".crystal" / "tools"
        write_set(sets, "planned", plan_set("Planned v1."), **{"p.py": ASKER_OK})
        write_set(sets, "worked", work_set("Worked v1."), **{"w.py": ASKER_OK})
        write_set(sets, "broken", "{ not json")

    with daemon_in("tsm-", fill, ["--no-watch"]) as d:
        sets = d.workspace / ".crystal" / "tools"
        pump = RawPump(pump_args(d, d.workspace, "--catalog", "plan"))
        try:
            pump.request(1, "initialize", {"protocolVersion": "2025-11-25", "capabilities": {}, "clientInfo": {"name": "t", "version": "1"}})
            pump.send({"jsonrpc": "2.0", "method": "notifications/initialized"})
            listed = pump.request(2, "tools/list")["result"]["tools"]
            assert [t["name"] for t in listed] == ["planned"]

            def reload() -> None:
                assert "result" in d.call("reload", {"workspace": str(d.workspace)})

            write_set(sets, "worked", work_set("Worked v2."))  # not in the plan catalog
            reload()
            write_set(sets, "broken", {"runner": "exec"})  # refused still, for another reason
            reload()
            write_set(sets, "planned", plan_set("Planned v2."))  # the host's list changes
            reload()
            pump.send({"jsonrpc": "2.0", "id": 3, "method": "ping"})
            seen = []
            while (message := pump.receive()).get("id") != 3:
                seen.append(message.get("method"))
            assert seen == ["notifications/tools/list_changed"]
            listed = pump.request(4, "tools/list")["result"]["tools"]
            assert [t["description"] for t in listed] == ["Planned v2."]
        finally:
            assert pump.close() == 0


# -- approvals -----------------------------------------------------------------------------


def _elicit(action: str, seen: list[str]) -> Any:
    async def callback(context: Any, params: types.ElicitRequestParams) -> types.ElicitResult:
        seen.append(params.message)
        return types.ElicitResult(action=action)  # type: ignore[arg-type]

    return callback


async def _ask(
    daemon: Daemon, workspace: Path, mode: str, action: str, name: str = "asker"
) -> tuple[Any, list[str]]:
    """Call an asking tool with a host that answers the approval with ``action``."""
    seen: list[str] = []
    with anyio.fail_after(30):
        async with Client(
            server(daemon, workspace),
            mode=mode,  # type: ignore[arg-type]
            elicitation_callback=_elicit(action, seen),
        ) as client:
            return await client.call_tool(name, {}), seen


@pytest.mark.parametrize(("version", "mode"), [("2025-06-18", None), ("2025-11-25", "form")])
def test_mcp_the_approval_request_has_its_versions_shape(
    mcp_daemon: Daemon, workspace: Path, version: str, mode: str | None
) -> None:
    """The approval's ``elicitation/create`` is shaped by the version the session agreed on:
    2025-06-18's has no ``mode`` (that revision has none), 2025-11-25's says ``form``; both
    ask with an empty form, and the host's accept runs the call."""
    pump = RawPump(pump_args(mcp_daemon, workspace))
    try:
        init = pump.request(1, "initialize", {
            "protocolVersion": version, "capabilities": {"elicitation": {}},
            "clientInfo": {"name": "t", "version": "1"}})
        assert init["result"]["protocolVersion"] == version
        pump.send({"jsonrpc": "2.0", "method": "notifications/initialized"})
        pump.send({"jsonrpc": "2.0", "id": 2, "method": "tools/call",
                   "params": {"name": "asker", "arguments": {}}})
        asked = pump.receive()
        assert asked["method"] == "elicitation/create", asked
        params = asked["params"]
        assert params.get("mode") == mode, params
        assert params["requestedSchema"] == {"type": "object", "properties": {}}
        assert "asker" in params["message"]
        pump.send({"jsonrpc": "2.0", "id": asked["id"],
                   "result": {"action": "accept", "content": {}}})
        done = pump.receive()
        assert done["id"] == 2, done
        assert "asked and ran" in done["result"]["content"][0]["text"]
    finally:
        assert pump.close() == 0


@pytest.mark.parametrize("mode", ["legacy", "auto"])
async def test_mcp_elicitation_accept_runs_the_call(
    mcp_host: Daemon, workspace: Path, mode: str
) -> None:
    """An ask is put to the operator (both eras) with the classification; accept runs it."""
    result, seen = await _ask(mcp_host, workspace, mode, "accept")
    assert result.is_error is False
    assert "asked and ran" in _text(result)
    assert len(seen) == 1
    assert "asker" in seen[0]
    assert "Scope: workspace" in seen[0]


@pytest.mark.parametrize("mode", ["legacy", "auto"])
@pytest.mark.parametrize("action", ["decline", "cancel"])
async def test_mcp_elicitation_decline_refuses(
    mcp_host: Daemon, workspace: Path, mode: str, action: str
) -> None:
    """Decline or cancel gives an isError result with the reference host's words for a
    denied prompt (it said "The operator declined this call; ..."); nothing ran."""
    # An asker of its own: the shared log holds other tests' calls of ``asker``.
    name = _unique("asker")
    write_project_asker(workspace, name)
    result, seen = await _ask(mcp_host, workspace, mode, action, name)
    assert result.is_error is True
    assert _text(result) == (
        "The user declined this action. Do not retry the same call. Change the approach or "
        "ask the user."
    )
    assert len(seen) == 1
    assert name in seen[0]
    assert not [
        e
        for e in mcp_host.log_events()
        if e.get("event") == "call_started" and e.get("tool") == name
    ]


@pytest.mark.parametrize("mode", ["legacy", "auto"])
async def test_mcp_an_accept_does_not_run_a_tool_edited_while_asked(
    mcp_host: Daemon, workspace: Path, mode: str
) -> None:
    """The operator accepts a call of a tool whose tools.json is edited (its command
    changed) while the question is open. The approval covered the classification alone
    (tool, set, paths, arguments), which the edit leaves as it was, so the accept ran the
    edited command, unseen. It covers the tool's definition too: over the legacy
    elicitation the call does not run (the approval no longer matches); a 2026-07-28
    retry is asked again, and only that second accept runs the new command."""
    name = _unique("asker")
    write_project_asker(workspace, name)
    seen: list[str] = []

    async def edit_then_accept(context: Any, params: types.ElicitRequestParams) -> types.ElicitResult:
        seen.append(params.message)
        if len(seen) == 1:
            edited = script("print('edited and ran')\n")
            write_set(workspace / ".crystal" / "tools", name, tool("edited.py"), **{"edited.py": edited})
            await anyio.to_thread.run_sync(
                lambda: mcp_host.call("reload", {"workspace": str(workspace)})
            )
        return types.ElicitResult(action="accept")

    with anyio.fail_after(30):
        async with Client(
            server(mcp_host, workspace),
            mode=mode,  # type: ignore[arg-type]
            elicitation_callback=edit_then_accept,
        ) as client:
            result = await client.call_tool(name, {})
    ran = [
        e for e in mcp_host.log_events() if e.get("event") == "call_started" and e.get("tool") == name
    ]
    if mode == "legacy":
        assert result.is_error is True
        assert "approval no longer matches it; it did not run" in _text(result)
        assert len(seen) == 1 and ran == []
    else:
        assert len(seen) == 2, seen  # asked again for the edited tool
        assert result.is_error is False and "edited and ran" in _text(result)
        assert len(ran) == 1


#: The daemon, with an operator who has a second to answer an approval request.
_SHORT_ELICITATION = (
    "import sys\n"
    "from toolsetd.daemon import mcp_session\n"
    "mcp_session.McpSettings.__init__.__defaults__ = (1000, 1.0, 600.0, 0)\n"
    "from toolsetd.daemon.app import main\n"
    "sys.exit(main(sys.argv[1:]))\n"
)


def test_mcp_an_approval_request_nobody_answers_is_withdrawn(
    mcp_sets: None, home: Path, workspace: Path, tmp_base: Path
) -> None:
    """No answer within the elicitation timeout: the call is answered (it did not run)
    and its elicitation/create withdrawn first, as MCP has a sender that stops waiting
    for its request do (lifecycle, Timeouts)."""
    d = start_daemon(home, workspace, tmp_base, launcher=[PY, "-c", _SHORT_ELICITATION])
    pump = RawPump(pump_args(d, workspace))
    try:
        capabilities = {"elicitation": {}}
        pump.request(1, "initialize", {"protocolVersion": "2025-11-25", "capabilities": capabilities, "clientInfo": {"name": "t", "version": "1"}})
        pump.send({"jsonrpc": "2.0", "method": "notifications/initialized"})
        call = {"name": "asker", "arguments": {}}
        pump.send({"jsonrpc": "2.0", "id": 2, "method": "tools/call", "params": call})
        asked = pump.receive()
        assert asked["method"] == "elicitation/create"
        withdrawn = pump.receive()
        answered = pump.receive()
        # A host that never sends notifications/initialized is never asked (its question
        # is held: no elicitation/create to withdraw), and its answer says why.
        mute = RawPump(pump_args(d, workspace))
        try:
            mute.request(1, "initialize", {**INIT_PARAMS, "capabilities": capabilities})
            mute.send({"jsonrpc": "2.0", "id": 2, "method": "tools/call", "params": call})
            unasked = mute.receive()  # the answer itself: no elicitation/create before it
        finally:
            mute.close()
    finally:
        pump.close()
        d.stop()
    assert withdrawn["method"] == "notifications/cancelled"
    assert withdrawn["params"]["requestId"] == asked["id"]
    assert answered["id"] == 2
    assert answered["result"]["isError"] is True
    assert "in time" in answered["result"]["content"][0]["text"]
    assert "never sent notifications/initialized" in unasked["result"]["content"][0]["text"]
    assert unasked["result"]["isError"] is True


@pytest.mark.parametrize("arguments", ["text", [1, 2], 5, True])
def test_mcp_arguments_that_are_not_an_object_are_invalid_params(
    mcp_daemon: Daemon, workspace: Path, arguments: Any
) -> None:
    """MCP's ``arguments`` is an object: anything else fails CallToolRequest's schema, a
    protocol error (-32602 naming the field), and no tool runs, not even one whose schema
    leaves ``type`` out (listed with ``type: "object"``)."""
    sets = workspace / ".crystal" / "tools"
    runs = script("open('ran', 'w').write('yes')\n")
    write_set(sets, "untyped", tool("untyped.py", schema={}), **{"untyped.py": runs})
    pump = RawPump(pump_args(mcp_daemon, workspace, "--mode", "full"))
    try:
        pump.request(1, "initialize", {"protocolVersion": "2025-11-25", "capabilities": {}, "clientInfo": {"name": "t", "version": "1"}})
        reply = pump.request(2, "tools/call", {"name": "untyped", "arguments": arguments})
    finally:
        pump.close()
    assert reply["error"]["code"] == -32602
    assert "'arguments' must be an object" in reply["error"]["message"]
    assert reply["error"]["data"] == {"field": "arguments"}
    assert not (workspace / "ran").exists()


def _approvals_held(daemon: Daemon, tool: str) -> int:
    """How many of ``tool``'s approval questions the daemon held for initialized."""
    return sum(
        e.get("event") == "mcp_approval_held" and e.get("tool") == tool
        for e in daemon.log_events()
    )


@contextlib.contextmanager
def _asker_before_initialized(
    daemon: Daemon, workspace: Path
) -> Iterator[tuple[str, Callable[[], int], RawPump]]:
    """A new project tool that asks for approval, and a pump initialized with elicitation
    but not yet told ``notifications/initialized``: the tool's name, the count of its
    questions held (``_approvals_held``), and the pump, which must exit 0."""
    name = _unique("asker")
    write_project_asker(workspace, name)
    pump = RawPump(pump_args(daemon, workspace))
    try:
        pump.request(1, "initialize", {**INIT_PARAMS, "capabilities": {"elicitation": {}}})
        yield name, lambda: _approvals_held(daemon, name), pump
    finally:
        assert pump.close() == 0


def test_mcp_no_approval_request_goes_out_before_initialized(
    mcp_daemon: Daemon, workspace: Path
) -> None:
    """MCP's lifecycle: the server SHOULD NOT send requests other than pings and logging
    before the host's notifications/initialized. A call that needs approval, sent after
    initialize but before initialized (a pipe, HTTP requests that overtake each other),
    holds its question until initialized comes, then asks it; the call is kept, not
    refused. It went out at once. A held call the host cancels puts no question at all."""
    with _asker_before_initialized(mcp_daemon, workspace) as (name, held, pump):
        call = {"name": name, "arguments": {}}
        pump.send({"jsonrpc": "2.0", "id": 2, "method": "tools/call", "params": call})
        eventually(lambda: held() == 1, what="the first call's question held")
        pump.send({"jsonrpc": "2.0", "method": "notifications/cancelled",
                   "params": {"requestId": 2}})
        pump.send({"jsonrpc": "2.0", "id": 3, "method": "tools/call", "params": call})
        eventually(lambda: held() == 2, what="the second call's question held")
        assert pump.request(4, "ping")["result"] == {}  # nothing went out before it
        pump.send({"jsonrpc": "2.0", "method": "notifications/initialized"})
        asked = pump.receive()
        assert asked["method"] == "elicitation/create", asked
        pump.send({"jsonrpc": "2.0", "id": asked["id"], "result": {"action": "accept"}})
        done = pump.receive()
        assert done["id"] == 3, done
        assert "asked and ran" in done["result"]["content"][0]["text"], done
        assert pump.request(5, "ping")["result"] == {}  # and nothing for the cancelled one


def test_mcp_an_answer_before_its_question_went_out_is_not_the_operators(
    mcp_daemon: Daemon, workspace: Path
) -> None:
    """A question held until notifications/initialized has its id already (the daemon's
    ``toolsetd-elicit-N``, numbered from 1 on each session), but nobody was asked yet: a
    response naming that id that comes before the question went out (a stale answer, an
    older daemon's question's, that a pump or a host sends on) is no operator's answer to
    it. It was taken as one: the call ran, accepted, with no elicitation/create ever
    shown. The question goes out once initialized comes, and only its answer counts."""
    with _asker_before_initialized(mcp_daemon, workspace) as (name, held, pump):
        pump.send({"jsonrpc": "2.0", "id": 2, "method": "tools/call",
                   "params": {"name": name, "arguments": {}}})
        eventually(lambda: held() == 1, what="the call's question held")
        pump.send({"jsonrpc": "2.0", "id": "toolsetd-elicit-1", "result": {"action": "accept"}})
        assert pump.request(3, "ping")["result"] == {}  # read before initialized comes
        pump.send({"jsonrpc": "2.0", "method": "notifications/initialized"})
        asked = pump.receive()
        assert asked.get("method") == "elicitation/create", asked
        pump.send({"jsonrpc": "2.0", "id": asked["id"], "result": {"action": "decline"}})
        done = pump.receive()
        assert done["id"] == 2, done
        assert done["result"]["isError"] is True, done
        assert "asked and ran" not in json.dumps(done), done


def test_mcp_the_first_answer_to_an_approval_request_stands(
    mcp_daemon: Daemon, workspace: Path
) -> None:
    """A request has one response (JSON-RPC): the host's first answer to an
    elicitation/create is the operator's; a second one for the same id (a host that
    answers twice), and one for an id toolsetd never sent, are ignored. The second used to
    overwrite the first when it came before the call took it: a decline then an accept in
    one write ran the call."""
    pump = RawPump(pump_args(mcp_daemon, workspace))
    try:
        pump.request(1, "initialize", {**INIT_PARAMS, "capabilities": {"elicitation": {}}})
        pump.send({"jsonrpc": "2.0", "method": "notifications/initialized"})
        pump.send({"jsonrpc": "2.0", "id": "toolsetd-elicit-99", "result": {"action": "accept"}})
        for n, (first, second) in enumerate((("decline", "accept"), ("accept", "decline"))):
            call = {"name": "asker", "arguments": {}}
            pump.send({"jsonrpc": "2.0", "id": 2 + n, "method": "tools/call", "params": call})
            asked = pump.receive()
            assert asked["method"] == "elicitation/create", asked
            pump.send(b"".join(
                json.dumps({"jsonrpc": "2.0", "id": asked["id"],
                            "result": {"action": action}}).encode() + b"\n"
                for action in (first, second)))
            done = pump.receive()
            assert done["id"] == 2 + n, done
            text = done["result"]["content"][0]["text"]
            assert ("asked and ran" in text) is (first == "accept"), (first, done)
        assert pump.request(9, "ping")["result"] == {}
    finally:
        assert pump.close() == 0


def test_mcp_an_approval_answer_with_both_result_and_error_is_no_accept(
    mcp_daemon: Daemon, workspace: Path
) -> None:
    """A JSON-RPC 2.0 response holds a result or an error, never both, and says its
    version: one that holds both, or says another version or none, is not the operator's
    accept, whatever its result says; nor is a result whose ``content`` is no object. It ran the call; it is the host's failure to ask now
    ("could not ask the operator"), and the call does not run."""
    pump = RawPump(pump_args(mcp_daemon, workspace))
    try:
        pump.request(1, "initialize", {**INIT_PARAMS, "capabilities": {"elicitation": {}}})
        pump.send({"jsonrpc": "2.0", "method": "notifications/initialized"})
        for n, answer in enumerate((
            {"result": {"action": "accept"}, "error": {"code": -1, "message": "no"}},
            {"result": {"action": "accept"}, "error": None},
            {"jsonrpc": "1.0", "result": {"action": "accept"}},
            {"jsonrpc": None, "result": {"action": "accept"}},  # sent without "jsonrpc"
            # No ElicitResult: its content, if any, is an object (a string one ran the call).
            {"result": {"action": "accept", "content": "x"}},
            {"result": {"action": "accept", "content": ["x"]}},
            {"result": {"action": "accept", "content": None}},  # null is none: it runs
            {"result": {"action": "accept"}},  # the control: a plain accept runs it
        )):
            call = {"name": "asker", "arguments": {}}
            pump.send({"jsonrpc": "2.0", "id": 2 + n, "method": "tools/call", "params": call})
            asked = pump.receive()
            assert asked["method"] == "elicitation/create", asked
            response = {"jsonrpc": "2.0", "id": asked["id"], **answer}
            if response["jsonrpc"] is None:
                del response["jsonrpc"]
            pump.send(response)
            done = pump.receive()
            assert done["id"] == 2 + n, done
            text = done["result"]["content"][0]["text"]
            ran = answer in ({"result": {"action": "accept"}},
                             {"result": {"action": "accept", "content": None}})
            assert ("asked and ran" in text) is ran, (answer, done)
            if not ran:
                assert "could not ask the operator" in text, done
    finally:
        assert pump.close() == 0


def test_mcp_a_cancelled_call_withdraws_its_approval_request(
    mcp_daemon: Daemon, workspace: Path
) -> None:
    """A call the host cancels while its elicitation/create is unanswered cancels that
    request too (MCP: the sender of a request it stops waiting for SHOULD send
    notifications/cancelled), so the host takes the question down: an accept given later
    would run nothing."""
    pump = RawPump(pump_args(mcp_daemon, workspace))
    try:
        capabilities = {"elicitation": {}}
        pump.request(1, "initialize", {"protocolVersion": "2025-11-25", "capabilities": capabilities, "clientInfo": {"name": "t", "version": "1"}})
        pump.send({"jsonrpc": "2.0", "method": "notifications/initialized"})
        call = {"name": "asker", "arguments": {}}
        pump.send({"jsonrpc": "2.0", "id": 2, "method": "tools/call", "params": call})
        asked = pump.receive()
        assert asked["method"] == "elicitation/create"
        pump.send(
            {"jsonrpc": "2.0", "method": "notifications/cancelled", "params": {"requestId": 2}}
        )
        pump.send({"jsonrpc": "2.0", "id": 3, "method": "ping"})
        seen = []
        while not seen or seen[-1].get("id") != 3:
            seen.append(pump.receive())
    finally:
        pump.close()
    assert [m.get("method") for m in seen[:-1]] == ["notifications/cancelled"]
    assert seen[0]["params"]["requestId"] == asked["id"]


@pytest.mark.parametrize("mode", ["legacy", "auto"])
async def test_mcp_an_input_schema_without_type_object_is_listed_with_it(
    mcp_host: Daemon, workspace: Path, mode: str
) -> None:
    """MCP requires ``type: "object"`` at an inputSchema's root, and a host that checks it
    (the SDK) refuses the whole tools/list otherwise: a schema that leaves ``type`` out, or
    allows other types beside object, is listed with it, and the tool still runs."""
    sets = workspace / ".crystal" / "tools"
    loose = {"properties": {"x": {"type": "string"}}, "required": ["x"]}
    write_set(sets, "untyped", tool("untyped.py", schema=loose), **{"untyped.py": ASKER_OK})
    several = {"type": ["object", "null"], "properties": {"x": {"type": "string"}}}
    write_set(sets, "several", tool("several.py", schema=several), **{"several.py": ASKER_OK})
    with anyio.fail_after(30):
        host = server(mcp_host, workspace, "--mode", "full")  # project sets run unasked
        async with Client(host, mode=mode) as client:  # type: ignore[arg-type]
            listed = {t.name: t for t in (await client.list_tools()).tools}
            result = await client.call_tool("untyped", {"x": "a"})
            refused = await client.call_tool("untyped", {})
    assert listed["untyped"].input_schema == {**loose, "type": "object"}
    assert listed["several"].input_schema == {**several, "type": "object"}
    assert result.is_error is False
    assert "ran" in _text(result)
    assert refused.is_error is True
    assert "x" in _text(refused)


async def test_mcp_boolean_root_properties_and_draft3_required_are_listed_as_mcp_has_them(
    mcp_host: Daemon, workspace: Path
) -> None:
    """MCP's schema has an object for each root property and a list of names for the
    root ``required``; the TypeScript SDK's client refuses the whole tools/list otherwise
    (test_mcp_ts_client.py drives it). A boolean property schema is listed as the object
    that says the same, a draft 3 boolean ``required`` at the root is left out, and the
    calls are validated against the schemas as declared."""
    sets = workspace / ".crystal" / "tools"
    booleans = {"type": "object", "properties": {"any": True, "never": False}}
    write_set(sets, "boolprops", tool("b.py", schema=booleans), **{"b.py": ASKER_OK})
    draft3 = {"$schema": "http://json-schema.org/draft-03/schema#", "required": True,
              "properties": {"x": {"type": "string", "required": True}}}
    write_set(sets, "draft3", tool("d.py", schema=draft3), **{"d.py": ASKER_OK})
    with anyio.fail_after(30):
        async with Client(server(mcp_host, workspace, "--mode", "full")) as client:
            listed = {t.name: t for t in (await client.list_tools()).tools}
            never = await client.call_tool("boolprops", {"never": 1})
            missing = await client.call_tool("draft3", {})
    assert listed["boolprops"].input_schema == {
        "type": "object", "properties": {"any": {}, "never": {"not": {}}}}
    assert listed["draft3"].input_schema == {  # as JSON Schema 2020-12 (test_mcpschema.py)
        "properties": {"x": {"type": "string"}}, "required": ["x"], "type": "object"}
    assert never.is_error is True
    assert missing.is_error is True
    assert "x" in _text(missing)


async def test_mcp_lists_every_schema_as_json_schema_2020_12_and_checks_calls_as_declared(
    mcp_host: Daemon, workspace: Path
) -> None:
    """Claude's API refuses every request of a session when one tool's schema is not JSON
    Schema 2020-12, or holds ``anyOf``/``allOf``/``oneOf`` at its root: a draft 7 schema
    is listed as the 2020-12 schema that says the same, without its ``$schema``, and a root
    ``anyOf`` moves under ``"if": true, "then"``. A schema whose root type takes no object
    can take no MCP call: it is left out, and the catalog says why. Calls are checked
    against the schemas as declared."""
    sets = workspace / ".crystal" / "tools"
    draft7 = {"$schema": "http://json-schema.org/draft-07/schema#", "type": "object",
              "properties": {"t": {"type": "array", "items": [{"type": "string"}],
                                   "additionalItems": {"type": "integer"}}},
              "dependencies": {"a": ["t"]}}
    write_set(sets, "draft7", tool("d.py", schema=draft7), **{"d.py": ASKER_OK})
    either = {"type": "object", "properties": {"a": {"type": "string"}, "b": {"type": "string"}},
              "anyOf": [{"required": ["a"]}, {"required": ["b"]}]}
    write_set(sets, "either", tool("e.py", schema=either), **{"e.py": ASKER_OK})
    write_set(sets, "arrayroot", tool("r.py", schema={"type": "array"}), **{"r.py": ASKER_OK})
    # Valid draft 3 (which checks nothing in ``definitions``), invalid once 2020-12.
    loose = {"$schema": "http://json-schema.org/draft-03/schema#", "type": "object",
             "definitions": {"x": {"type": 5}}}
    write_set(sets, "loose3", tool("l.py", schema=loose), **{"l.py": ASKER_OK})
    with anyio.fail_after(30):
        async with Client(server(mcp_host, workspace, "--mode", "full")) as client:
            listed = {t.name: t for t in (await client.list_tools()).tools}
            results = [
                await client.call_tool("draft7", {"t": ["a", 1, 2], "a": 1}),
                await client.call_tool("draft7", {"t": ["a", "b"]}),
                await client.call_tool("draft7", {"a": 1}),
                await client.call_tool("either", {"b": "x"}),
                await client.call_tool("either", {}),
            ]
    assert listed["draft7"].input_schema == {
        "type": "object",
        "properties": {"t": {"type": "array", "prefixItems": [{"type": "string"}],
                             "items": {"type": "integer"}}},
        "dependentRequired": {"a": ["t"]},
    }
    assert listed["either"].input_schema == {
        "type": "object", "properties": either["properties"],
        "if": True, "then": {"anyOf": either["anyOf"]},
    }
    for schema in (listed["draft7"].input_schema, listed["either"].input_schema):
        Draft202012Validator.check_schema(schema)
    assert [r.is_error for r in results] == [False, True, True, False, True]
    assert "arrayroot" not in listed
    assert "loose3" not in listed
    notes = mcp_host.call("list", {"workspace": str(workspace)})["result"]["notes"]
    (loose_note,) = [n["message"] for n in notes if n["set"] == "loose3"]
    assert "converted to JSON Schema 2020-12" in loose_note
    (noted,) = [n["message"] for n in notes if n["set"] == "arrayroot"]
    assert 'root type is "array"' in noted
    assert "MCP hosts send arguments as an object" in noted


#: (set, schema as declared, arguments): the listing (2020-12) and the daemon's check (by
#: the schema's own draft) must agree on each call.
_AGREEING: list[tuple[str, dict[str, Any], list[dict[str, Any]]]] = [
    (
        "unevaluated",  # jsonschema's 2019-09 read the additionalProperties schema as a map
        {"$schema": "https://json-schema.org/draft/2019-09/schema", "type": "object",
         "additionalProperties": {"type": "string"}, "unevaluatedProperties": False},
        [{"x": "a"}, {"x": 1}],
    ),
    (
        "passedby",  # a draft 7 $ref into a keyword draft 7 does not know
        {"$schema": "http://json-schema.org/draft-07/schema#", "type": "object",
         "properties": {"a": {"$ref": "#/dependentSchemas/x"}},
         "dependentSchemas": {"x": {"type": "string"}}},
        [{"a": "s"}, {"a": 1}],
    ),
    (
        "rootref",  # a $ref to a root that takes arrays, beside a subschema with its own $id
        {"type": ["object", "array"],
         "properties": {"kids": {"$ref": "#"}, "n": {"$id": "n.json", "type": "string"}}},
        [{"kids": [{"n": "a"}]}, {"kids": {"n": 1}}],
    ),
]


async def test_mcp_a_listing_and_the_daemons_check_agree_on_each_call(
    mcp_host: Daemon, workspace: Path
) -> None:
    """What a host that checks a tool's listed inputSchema lets through, the daemon takes,
    and what it refuses the daemon refuses: a 2019-09 ``unevaluatedProperties`` beside a
    schema-valued ``additionalProperties`` (the daemon refused what the listing took), a
    draft 7 ``$ref`` into a keyword it does not know (the listing's ref led nowhere), and a
    ``$ref`` to a root that takes arrays beside an ``$id`` (the listing took objects only)."""
    sets = workspace / ".crystal" / "tools"
    for name, schema, _ in _AGREEING:
        write_set(sets, name, tool("t.py", schema=schema), **{"t.py": ASKER_OK})
    with anyio.fail_after(30):
        async with Client(server(mcp_host, workspace, "--mode", "full")) as client:
            listed = {t.name: t.input_schema for t in (await client.list_tools()).tools}
            ran = {
                name: [not (await client.call_tool(name, args)).is_error for args in calls]
                for name, _, calls in _AGREEING
            }
    verdicts = {}
    for name, _, calls in _AGREEING:
        Draft202012Validator.check_schema(listed[name])
        try:
            host: Any = [Draft202012Validator(listed[name]).is_valid(args) for args in calls]
        except Exception as exc:  # a $ref of the listing that leads nowhere
            host = type(exc).__name__
        verdicts[name] = (host, ran[name])
    assert verdicts == {name: ([True, False], [True, False]) for name, _, _ in _AGREEING}


async def test_mcp_a_schema_whose_header_marks_break_mcp_rules_is_listed_without_them(
    mcp_host: Daemon, workspace: Path
) -> None:
    """A 2026-07-28 SDK client drops a tool whose ``x-mcp-header`` marks break MCP's rules
    (Python's on every transport), so the host never saw it; the daemon checks no header
    of such a schema, so the marks are left out of its listing (the catalog notes why) and
    the tool lists and runs. A schema whose marks keep the rules is listed with them."""
    sets = workspace / ".crystal" / "tools"
    broken = {
        "on_number": {"type": "object", "properties": {
            "region": {"type": "string", "x-mcp-header": "Region"},
            "ratio": {"type": "number", "x-mcp-header": "Ratio"}}},
        "off_chain": {"type": "object", "properties": {"list": {
            "type": "array", "items": {"type": "string", "x-mcp-header": "Item"}}}},
    }
    good = {"type": "object", "properties": {
        "region": {"type": "string", "x-mcp-header": "Region"}}}
    for name, schema in [("routed", good), *broken.items()]:
        write_set(sets, name, tool(f"{name}.py", schema=schema), **{f"{name}.py": ASKER_OK})
    with anyio.fail_after(30):
        async with Client(server(mcp_host, workspace, "--mode", "full")) as client:
            assert client.protocol_version == MODERN
            listed = {t.name: t for t in (await client.list_tools()).tools}
            results = [
                await client.call_tool("on_number", {"region": "us-west1", "ratio": 0.5}),
                await client.call_tool("off_chain", {"list": ["a"]}),
                await client.call_tool("routed", {"region": "us-west1"}),
            ]
    assert set(broken) | {"routed"} <= set(listed)
    assert listed["on_number"].input_schema == {"type": "object", "properties": {
        "region": {"type": "string"}, "ratio": {"type": "number"}}}
    assert listed["off_chain"].input_schema == {"type": "object", "properties": {
        "list": {"type": "array", "items": {"type": "string"}}}}
    assert listed["routed"].input_schema == good
    assert [r.is_error for r in results] == [False] * 3, [_text(r) for r in results]
    notes = mcp_host.call("list", {"workspace": str(workspace)})["result"]["notes"]
    noted = {n["set"]: n["message"] for n in notes if n["set"] in {*broken, "routed"}}
    assert set(noted) == set(broken)
    assert noted["on_number"] == (
        "External tool 'on_number' is listed to MCP hosts without its x-mcp-header marks: the "
        "one on 'ratio' is on a type other than string, integer or boolean, which MCP's rules "
        "refuse (its 2026-07-28 clients drop such a tool), so no argument of it is mirrored "
        "into a header, nor checked in one.")
    assert "one is not on a property reached from the root" in noted["off_chain"]


@pytest.mark.parametrize("mode", ["legacy", "auto"])
async def test_mcp_without_elicitation_says_how_to_allow(
    mcp_host: Daemon, workspace: Path, mode: str
) -> None:
    """A host without elicitation gets an isError result that says why and how to allow it."""
    with anyio.fail_after(30):
        async with Client(server(mcp_host, workspace), mode=mode) as client:  # type: ignore[arg-type]
            result = await client.call_tool("asker", {})
    assert result.is_error is True
    text = _text(result)
    assert "Approval required" in text
    assert "elicitation" in text
    assert "--approve" in text


async def test_mcp_forbidden_call_passes_only_an_explicit_accept(
    mcp_host: Daemon, workspace: Path
) -> None:
    """In full mode a call on a credential path still asks; only the operator's accept runs it."""
    call = {"path": ".ssh/id_rsa"}
    with anyio.fail_after(30):
        async with Client(server(mcp_host, workspace, "--mode", "full"), mode="legacy") as bare:
            unasked = await bare.call_tool("reader", call)
            allowed = await bare.call_tool("reader", {"path": "notes.txt"})
        seen: list[str] = []
        async with Client(
            server(mcp_host, workspace, "--mode", "full"),
            mode="legacy",
            elicitation_callback=_elicit("accept", seen),
        ) as asking:
            accepted = await asking.call_tool("reader", call)
    assert allowed.is_error is False  # full mode runs a workspace call unasked
    assert unasked.is_error is True
    assert "no mode or grant passes it" in _text(unasked)
    assert "forbidden path" in seen[0]
    assert accepted.is_error is False
    assert "read" in _text(accepted)


def test_mcp_bind_only_as_the_first_frame(mcp_daemon: Daemon, workspace: Path) -> None:
    """A bind behind other frames, or in a batch, is refused; the wire stays native."""
    bind = {"jsonrpc": "2.0", "id": "b", "method": "mcp.bind"}
    bind["params"] = {"workspace": str(workspace)}
    listing = {"jsonrpc": "2.0", "id": 1, "method": "list", "params": {"workspace": str(workspace)}}
    with mcp_daemon.raw() as conn:  # a list pipelined just before the bind
        conn.send_bytes(json.dumps(listing).encode() + b"\n" + json.dumps(bind).encode() + b"\n")
        replies = {r["id"]: r for r in (conn.receive(), conn.receive())}
        assert "tools" in replies[1]["result"], replies[1]  # answered natively, not as MCP
        assert replies["b"]["error"]["code"] == -32600
        assert "first frame" in replies["b"]["error"]["message"]
        assert "version" in conn.request("status")["result"]  # still the native wire
    with mcp_daemon.raw() as conn:
        conn.send([bind])
        (reply,) = conn.receive()
        assert reply["error"]["code"] == -32600 and "batch" in reply["error"]["message"]
        assert "version" in conn.request("status")["result"]
    with mcp_daemon.raw() as conn:  # first and alone: bound, and the next frame is MCP
        conn.send(bind)
        assert conn.receive()["result"]["bound"] is True
        conn.send({"jsonrpc": "2.0", "id": 2, "method": "status"})
        assert "error" in conn.receive()  # MCP now: no native status here


def test_mcp_an_id_of_minus_zero_is_an_integer_echoed_as_sent(
    shared_daemon: Daemon, workspace: Path
) -> None:
    """``-0`` is an integer in JSON's grammar, on the MCP faces as on the native wire: a
    request with that id is answered and the id echoed as ``-0``, over a bound socket
    (what ``toolsetctl mcp`` relays) and over HTTP."""
    bind = {"jsonrpc": "2.0", "id": "b", "method": "mcp.bind"}
    bind["params"] = {"workspace": str(workspace)}
    init = {"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": INIT_PARAMS}
    with shared_daemon.raw() as conn:
        conn.send(bind)
        assert conn.receive()["result"]["bound"] is True
        conn.send(init)
        assert "result" in conn.receive()
        conn.send_bytes(b'{"jsonrpc": "2.0", "id": -0, "method": "ping"}\n')
        while b"\n" not in conn._buffer:
            conn._buffer += conn.sock.recv(65536)
        line = conn._buffer.split(b"\n")[0]
    assert b'"id":-0' in line and b'"result"' in line, line
    assert shared_daemon.mcp_url is not None
    url = endpoint(shared_daemon.mcp_url, workspace)
    body = b'{"jsonrpc": "2.0", "id": -0, "method": "initialize", "params": %s}' % (
        json.dumps(INIT_PARAMS).encode()
    )
    reply = http(url, body=body, headers={"mcp-method": "initialize"})
    assert reply.status == 200, reply
    assert b'"id":-0' in reply.body and b'"result"' in reply.body, reply.body


def test_mcp_odd_ids_and_params_keep_the_session(mcp_daemon: Daemon, workspace: Path) -> None:
    """An object or array where an id belongs, or params as an array, ends nothing."""
    pump = RawPump(pump_args(mcp_daemon, workspace))
    try:
        pump.request(1, "initialize", {"protocolVersion": "2025-11-25", "capabilities": {}, "clientInfo": {"name": "t", "version": "1"}})
        for request_id in ({"a": 1}, [1]):  # unhashable: no request in flight has it
            cancelled = {"requestId": request_id, "reason": "test"}
            pump.send({"jsonrpc": "2.0", "method": "notifications/cancelled", "params": cancelled})
            pump.send({"jsonrpc": "2.0", "id": request_id, "result": {}})  # a "response"
        assert pump.request(2, "ping")["result"] == {}
        reply = pump.request(3, "tools/list", [])  # type: ignore[arg-type]
        assert reply["error"]["code"] == -32602, reply
        assert "by name" in reply["error"]["message"]
        pump.send({"jsonrpc": "2.0", "id": 4})  # neither a request nor a response
        reply = pump.receive()
        assert (reply["id"], reply["error"]["code"]) == (4, -32600), reply
        assert pump.request(5, "ping")["result"] == {}
    finally:
        assert pump.close() == 0
    assert "connection_failed" not in {e.get("event") for e in mcp_daemon.log_events()}


def test_mcp_a_method_that_is_no_string_is_invalid_and_keeps_the_session(
    mcp_daemon: Daemon, workspace: Path
) -> None:
    """A request whose ``method`` is an array or an object is -32600 under its id, and the
    session goes on. Its flight was made with a set lookup of the method, which raised
    TypeError for an unhashable one: the host's connection ended, its calls and all (the
    pump answered the request as cut off by toolsetd going away, and bound again)."""
    logged = len(mcp_daemon.log_events())
    pump = RawPump(pump_args(mcp_daemon, workspace))
    try:
        pump.request(1, "initialize", {"protocolVersion": "2025-11-25", "capabilities": {}, "clientInfo": {"name": "t", "version": "1"}})
        for request_id, method in ((2, [1]), (3, {"a": "tools/call"})):
            pump.send({"jsonrpc": "2.0", "id": request_id, "method": method})
            reply = pump.receive()  # first, no list_changed of a pump that bound again
            assert (reply.get("id"), reply.get("error", {}).get("code")) == (request_id, -32600), reply
        assert pump.request(4, "ping")["result"] == {}
    finally:
        assert pump.close() == 0
    errors = [e for e in mcp_daemon.log_events()[logged:] if e.get("level") == "error"]
    assert not errors, errors


def test_mcp_no_response_after_cancel(mcp_daemon: Daemon, workspace: Path) -> None:
    """After notifications/cancelled nothing more goes out for that request."""
    pump = RawPump(pump_args(mcp_daemon, workspace))
    try:
        pump.request(1, "initialize", {"protocolVersion": "2025-11-25", "capabilities": {}, "clientInfo": {"name": "t", "version": "1"}})
        params = {"name": "sleeper", "arguments": {}, "_meta": {"progressToken": "p"}}
        pump.send({"jsonrpc": "2.0", "id": 2, "method": "tools/call", "params": params})
        pid_file = workspace / "sleeper.pid"
        eventually(lambda: pid_file.exists() and bool(pid_file.read_text()), what="the sleeper")
        pid = int(pid_file.read_text())
        call_id = (workspace / "sleeper.call").read_text()
        pump.send(
            {
                "jsonrpc": "2.0",
                "method": "notifications/cancelled",
                "params": {"requestId": 2, "reason": "test"},
            }
        )
        eventually(lambda: not alive(pid), timeout=15, what="the sleeper to be killed")
        eventually(
            lambda: any(
                e.get("event") == "call_finished" and e.get("call_id") == call_id
                for e in mcp_daemon.log_events()
            ),
            what="the call to end",
        )
        pump.send({"jsonrpc": "2.0", "id": 3, "method": "ping"})
        while True:  # everything up to the ping's answer: no response for the cancelled call
            message = pump.receive()
            assert message.get("id") != 2, message
            if message.get("id") == 3:
                break
    finally:
        assert pump.close() == 0


#: A JSON value nested a thousand deep: within the daemon's parser (1,024 levels), past what
#: Python's ``str`` of it can recurse through (RecursionError).
_DEEP = b"[" * 1000 + b"]" * 1000


def _reply_to(pump: RawPump, request_id: Any) -> Any:
    """The pump's next answer under ``request_id``; none under another id comes first."""
    while True:
        message = pump.receive()
        if "method" in message:
            continue
        assert message.get("id") == request_id, message
        return message


def test_mcp_a_cancel_whose_reason_is_no_string_cancels_and_keeps_the_session(
    mcp_daemon: Daemon, workspace: Path
) -> None:
    """MCP's ``reason`` is a string, and the daemon logged whatever came as ``str()`` of
    it: a list nested a thousand deep (a line the parser takes) raised RecursionError
    before the cancel was taken, and ended the host's connection, its calls and all (the
    pump took that for a restart, bound again and told the host list_changed). The call is
    cancelled (no answer for it), the session goes on, and the daemon logs no error (the
    connection's end was "connection_failed", or asyncio's "Fatal error" when the line
    came in a read of its own)."""
    logged = len(mcp_daemon.log_events())
    pump = RawPump(pump_args(mcp_daemon, workspace))
    try:
        pump.request(1, "initialize", {"protocolVersion": "2025-11-25", "capabilities": {}, "clientInfo": {"name": "t", "version": "1"}})
        pump.send({"jsonrpc": "2.0", "id": 2, "method": "tools/call",
                   "params": {"name": "sleeper", "arguments": {}}})
        pid_file = workspace / "sleeper.pid"
        eventually(lambda: pid_file.exists() and bool(pid_file.read_text()), what="the sleeper")
        pid = int(pid_file.read_text())
        pump.send(b'{"jsonrpc":"2.0","method":"notifications/cancelled",'
                  b'"params":{"requestId":2,"reason":' + _DEEP + b"}}\n")
        eventually(lambda: not alive(pid), timeout=15, what="the sleeper to be killed")
        pump.send({"jsonrpc": "2.0", "id": 3, "method": "ping"})
        assert pump.receive() == {"jsonrpc": "2.0", "id": 3, "result": {}}  # nothing before
    finally:
        assert pump.close() == 0
    errors = [e for e in mcp_daemon.log_events()[logged:] if e.get("level") == "error"]
    assert not errors, errors


def test_mcp_a_cursor_or_request_state_that_is_no_string_is_invalid_params(
    mcp_daemon: Daemon, workspace: Path
) -> None:
    """A forged ``cursor`` or ``requestState`` is -32602 naming it, whatever JSON it is: the
    daemon read each as ``str()`` of it, and one nested a thousand deep raised
    RecursionError, answered -32603 with an incident, as the daemon's own fault."""
    pump = RawPump(pump_args(mcp_daemon, workspace))
    meta = json.dumps({"io.modelcontextprotocol/protocolVersion": MODERN,
                       "io.modelcontextprotocol/clientCapabilities": {"elicitation": {}}}).encode()
    try:
        pump.send(b'{"jsonrpc":"2.0","id":1,"method":"tools/list","params":{"_meta":' + meta
                  + b',"cursor":' + _DEEP + b"}}\n")
        listed = _reply_to(pump, 1)
        assert (listed["error"]["code"], listed["error"]["data"]) == (-32602, {"field": "cursor"}), listed
        pump.send(b'{"jsonrpc":"2.0","id":2,"method":"tools/call","params":{"_meta":' + meta
                  + b',"name":"asker","arguments":{},"inputResponses":{"toolsetd_approval":'
                  b'{"action":"accept"}},"requestState":' + _DEEP + b"}}\n")
        called = _reply_to(pump, 2)
        assert (called["error"]["code"], called["error"]["data"]) == (-32602, {"field": "requestState"}), called
    finally:
        assert pump.close() == 0


def _mcp_sets(home: Path, workspace: Path) -> None:
    write_test_sets(home)
    write_project_asker(workspace)


def test_mcp_answers_and_cancels_pass_the_in_flight_limit() -> None:
    """At the connection's limit of requests in flight, the host's elicitation answer and
    its notifications/cancelled still get through (they free slots; they never take one);
    only a request is refused, with -32008 and its id."""
    args = ["--no-watch", "--max-calls-per-connection", "2"]
    with daemon_in("tsl-", _mcp_sets, args) as d, d.raw() as conn:
        bind = {"workspace": str(d.workspace)}
        conn.send({"jsonrpc": "2.0", "id": "b", "method": "mcp.bind", "params": bind})
        assert conn.receive()["result"]["bound"] is True
        hello = {"protocolVersion": "2025-11-25", "capabilities": {"elicitation": {}}, "clientInfo": {"name": "t", "version": "1"}}
        conn.send({"jsonrpc": "2.0", "id": "i", "method": "initialize", "params": hello})
        assert "result" in conn.receive()
        conn.send({"jsonrpc": "2.0", "method": "notifications/initialized"})

        def call(request_id: str, name: str) -> None:
            params = {"name": name, "arguments": {}}
            conn.send(
                {"jsonrpc": "2.0", "id": request_id, "method": "tools/call", "params": params}
            )

        def ping(request_id: str) -> dict[str, Any]:
            conn.send({"jsonrpc": "2.0", "id": request_id, "method": "ping"})
            reply: dict[str, Any] = conn.receive()
            assert reply["id"] == request_id, reply
            return reply

        call("c0", "asker")
        call("c1", "asker")
        asked = [conn.receive(), conn.receive()]
        assert [m["method"] for m in asked] == ["elicitation/create"] * 2, asked
        call("c2", "asker")  # a third request: refused, naming it
        busy = conn.receive()
        assert (busy["id"], busy["error"]["code"]) == ("c2", -32008), busy
        # Both slots taken: the answer to the first question still runs its call.
        conn.send({"jsonrpc": "2.0", "id": asked[0]["id"], "result": {"action": "accept"}})
        ran = conn.receive()
        assert ran["id"] in ("c0", "c1"), ran
        assert ran["result"]["isError"] is False, ran
        assert "asked and ran" in ran["result"]["content"][0]["text"]
        waiting = "c1" if ran["id"] == "c0" else "c0"
        # Both slots taken again (one call still asks, a sleeper runs): the cancel ends it.
        call("s", "sleeper")
        pid_file = d.workspace / "sleeper.pid"
        eventually(lambda: pid_file.exists() and bool(pid_file.read_text()), what="the sleeper")
        pid = int(pid_file.read_text())
        cancelled = {"requestId": "s", "reason": "test"}
        # The cancelled call gives its slot back at once: it gets no response, so the host
        # counts it done. A ping in the same write was refused busy ("wait for a response")
        # until the daemon had stopped the tool, up to the kill grace later.
        behind = {"jsonrpc": "2.0", "id": "p", "method": "ping"}
        conn.send_bytes(json.dumps({"jsonrpc": "2.0", "method": "notifications/cancelled",
                                    "params": cancelled}).encode()
                        + b"\n" + json.dumps(behind).encode() + b"\n")
        assert conn.receive() == {"jsonrpc": "2.0", "id": "p", "result": {}}
        eventually(lambda: not alive(pid), timeout=15, what="the sleeper to be killed")
        assert "result" in ping("p2")
        # One call in flight: an answer and a request behind it in one write both pass.
        answer = {"jsonrpc": "2.0", "id": asked[1]["id"], "result": {"action": "decline"}}
        last = {"jsonrpc": "2.0", "id": "last", "method": "ping"}
        conn.send_bytes(json.dumps(answer).encode() + b"\n" + json.dumps(last).encode() + b"\n")
        replies = {m["id"]: m for m in (conn.receive(), conn.receive())}
        assert replies.keys() == {waiting, "last"}, replies
        assert replies["last"]["result"] == {}, replies
        assert replies[waiting]["result"]["isError"] is True, replies
        assert "declined" in replies[waiting]["result"]["content"][0]["text"], replies


#: A tool that ignores SIGTERM: a call cancelled is stopped only at the kill grace.
_STUBBORN = script(
    "import os, signal, time\n"
    "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
    "open(f'stubborn.{os.getpid()}', 'w').close()\n"
    "time.sleep(60)\n"
)


def _stubborn_set(home: Path, workspace: Path) -> None:
    write_set(home / "tools", "stubborn", tool("stubborn.py"), **{"stubborn.py": _STUBBORN})


def test_mcp_cancelled_requests_still_ending_are_bounded_too() -> None:
    """A cancelled request gives its slot back at once, but until its task ends it counts
    among the connection's ending requests, at most as many as may be in flight: a host
    that called and cancelled over and over piled up tasks without end (a reviewer's flood
    of calls whose arguments wait for the worker slot: 890 MB after 20,000 pairs). Past
    the bound a request is -32008 saying why, and once the tools have stopped (the kill
    grace) requests are served again."""
    args = ["--no-watch", "--max-calls-per-connection", "2", "--kill-grace", "2"]
    with daemon_in("tse-", _stubborn_set, args) as d, d.raw() as conn:
        conn.send({"jsonrpc": "2.0", "id": "b", "method": "mcp.bind",
                   "params": {"workspace": str(d.workspace)}})
        assert conn.receive()["result"]["bound"] is True
        hello = {"protocolVersion": "2025-11-25", "capabilities": {},
                 "clientInfo": {"name": "t", "version": "1"}}
        conn.send({"jsonrpc": "2.0", "id": "i", "method": "initialize", "params": hello})
        assert "result" in conn.receive()
        conn.send({"jsonrpc": "2.0", "method": "notifications/initialized"})
        for request_id in ("c0", "c1"):
            conn.send({"jsonrpc": "2.0", "id": request_id, "method": "tools/call",
                       "params": {"name": "stubborn", "arguments": {}}})
        eventually(lambda: len(list(d.workspace.glob("stubborn.*"))) == 2, what="two tools")
        pids = [int(p.name.split(".")[1]) for p in d.workspace.glob("stubborn.*")]
        cancels = b"".join(
            json.dumps({"jsonrpc": "2.0", "method": "notifications/cancelled",
                        "params": {"requestId": r}}).encode() + b"\n" for r in ("c0", "c1"))
        ping = {"jsonrpc": "2.0", "id": "p0", "method": "ping"}
        conn.send_bytes(cancels + json.dumps(ping).encode() + b"\n")
        busy = conn.receive()
        assert (busy["id"], busy["error"]["code"], busy["error"]["data"]) == (
            "p0", -32008, {"limit": 2}), busy
        assert "cancelled requests still ending" in busy["error"]["message"], busy
        eventually(lambda: not any(alive(pid) for pid in pids), timeout=15,
                   what="the tools killed at the grace")
        pings = itertools.count(1)

        def served() -> bool:
            request_id = f"p{next(pings)}"
            conn.send({"jsonrpc": "2.0", "id": request_id, "method": "ping"})
            reply = conn.receive()
            assert reply["id"] == request_id, reply
            return "result" in reply

        eventually(served, what="served again")


async def test_mcp_headless_denies_an_ask(mcp_host: Daemon, workspace: Path) -> None:
    """--headless turns an ask into a deny: an isError with the reason, never a question."""
    seen: list[str] = []
    params = server(mcp_host, workspace, "--headless")
    with anyio.fail_after(30):
        async with Client(
            params, mode="legacy", elicitation_callback=_elicit("accept", seen)
        ) as client:
            result = await client.call_tool("asker", {})
    assert result.is_error is True
    assert _text(result).startswith("Denied:")
    assert seen == []


def test_mcp_modern_request_state_is_checked(mcp_daemon: Daemon, workspace: Path) -> None:
    """A forged or foreign requestState is refused; an input-required result names the
    approval; an accepted state runs its call once, and sent again it asks again."""
    pump = RawPump(pump_args(mcp_daemon, workspace))
    meta = {
        "io.modelcontextprotocol/protocolVersion": MODERN,
        "io.modelcontextprotocol/clientCapabilities": {"elicitation": {}},
    }
    try:
        first = pump.request(1, "tools/call", {"name": "asker", "arguments": {}, "_meta": meta})
        assert first["result"]["resultType"] == "input_required"
        state = first["result"]["requestState"]
        (key,) = first["result"]["inputRequests"]
        accept = {key: {"action": "accept", "content": {}}}

        def retry(request_id: int, state: str, arguments: dict[str, Any], answer: Any = accept) -> Any:
            params = {"name": "asker", "arguments": arguments, "_meta": meta}
            params |= {"inputResponses": answer, "requestState": state}
            return pump.request(request_id, "tools/call", params)

        forged = retry(2, state[:-2] + "AA", {})
        assert forged["error"]["code"] == -32602
        other = retry(3, state, {"x": 1})
        assert other["error"]["code"] == -32602
        # An answer that is no ElicitResult (its content no object) is none: asked again,
        # and the state is not spent.
        malformed = retry(6, state, {}, {key: {"action": "accept", "content": "x"}})
        assert malformed["result"]["resultType"] == "input_required", malformed
        ran = retry(4, state, {})
        assert ran["result"]["isError"] is False
        replayed = retry(5, state, {})  # the accept ran its call once: now it asks again
        assert replayed["result"]["resultType"] == "input_required", replayed
        assert replayed["result"]["requestState"] != state
    finally:
        assert pump.close() == 0


# -- many at once --------------------------------------------------------------------------


async def test_mcp_two_hosts_and_a_native_client(
    mcp_host: Daemon, workspace: Path, tmp_base: Path
) -> None:
    """Two hosts on two workspaces and a native client share a daemon; each sees its own."""
    other = tmp_base / "ws2"
    other.mkdir()
    write_project_asker(other, "otherasker")
    changed: dict[str, anyio.Event] = {"a": anyio.Event(), "b": anyio.Event()}

    def watch(key: str) -> Any:
        async def on_message(message: Any) -> None:
            if isinstance(message, types.ToolListChangedNotification):
                changed[key].set()

        return on_message

    with anyio.fail_after(40):
        async with (
            Client(server(mcp_host, workspace), mode="legacy", message_handler=watch("a")) as a,
            Client(server(mcp_host, other), mode="legacy", message_handler=watch("b")) as b,
        ):
            names_a = {t.name for t in (await a.list_tools()).tools}
            names_b = {t.name for t in (await b.list_tools()).tools}
            assert "asker" in names_a
            assert "asker" not in names_b
            assert "otherasker" in names_b
            assert "otherasker" not in names_a
            results: dict[str, Any] = {}

            async def native() -> None:
                def run() -> Any:
                    with RawConn(mcp_host.socket) as conn:
                        return conn.invoke(
                            {
                                "tool": "hello",
                                "arguments": {"name": "N"},
                                "workspace": str(workspace),
                            }
                        )

                results["native"] = await anyio.to_thread.run_sync(run)

            async def host(key: str, client: Client) -> None:
                results[key] = await client.call_tool("progress3", {})

            async with anyio.create_task_group() as tg:
                tg.start_soon(native)
                tg.start_soon(host, "a", a)
                tg.start_soon(host, "b", b)
            events, response = results["native"]
            assert "Hello, N!" in response["result"]["content"][0]["text"]
            assert events[0]["method"] == "started"
            assert "counted" in _text(results["a"])
            assert "counted" in _text(results["b"])
            write_set(
                other / ".crystal" / "tools",
                "late",
                tool("l.py"),
                **{"l.py": f"#!{PY}\nprint(3)\n"},
            )
            mcp_host.call("reload", {"workspace": str(other)})
            await changed["b"].wait()
            assert "late" in {t.name for t in (await b.list_tools()).tools}
            assert "late" not in {t.name for t in (await a.list_tools()).tools}
            assert not changed["a"].is_set()


# -- autostart -----------------------------------------------------------------------------


def test_mcp_autostart_waits_for_the_daemon_that_holds_the_path(
    home: Path, workspace: Path, tmp_base: Path
) -> None:
    """A cleanup removed the socket of a running daemon, which makes it again within 2 s
    (``socket_recreated``). A pump started in that window found no socket and started a
    daemon, which exited (the running one holds the path's lock), and the pump said
    "cannot start toolsetd" and exit 5: the host's MCP server failed while a daemon was
    about to answer. It waits for that daemon's socket instead, and starts no second one."""
    (home / "tools").mkdir(parents=True, exist_ok=True)
    first = start_daemon(home, workspace, tmp_base, ["--no-watch"])
    try:
        first.socket.unlink()
        pump = RawPump(
            ["-m", "toolsetd.client", "--socket", str(first.socket),
             "--workspace", str(workspace), "mcp"],
            env={**os.environ, "CRYSTAL_HOME": str(home)},
        )
        try:
            reply = pump.request(0, "initialize", INIT_PARAMS)
            assert "result" in reply, reply
        finally:
            code = pump.close()
        assert code == 0, pump.stderr()
        with RawConn(first.socket) as conn:
            assert conn.request("status")["result"]["pid"] == first.proc.pid
    finally:
        first.stop()


def test_mcp_a_workspace_path_that_is_not_utf8_is_refused_before_anything(
    tmp_base: Path,
) -> None:
    """Run in a folder whose name is not UTF-8, the pump says so and exits 2, and starts
    no daemon: it used to start one, send the path, and print the daemon's "Parse error:
    ... invalid high surrogate"."""
    folder = os.path.join(os.fsencode(tmp_base), b"\xff")
    os.mkdir(folder)
    missing = tmp_base / "none.sock"
    proc = subprocess.run(
        [PY, "-m", "toolsetd.client", "--socket", str(missing), "mcp"],
        input=b"", capture_output=True, timeout=20, check=False, cwd=folder,
    )
    assert proc.returncode == 2, proc.stderr
    assert b"is not UTF-8" in proc.stderr and b"\\xff" in proc.stderr
    assert not missing.exists()


def test_mcp_no_autostart_fails_with_one_clear_line(tmp_base: Path, workspace: Path) -> None:
    """With --no-autostart and no daemon, one stderr line and exit code 5; it says how to
    start a daemon on that socket, as every other command does (it said `toolsetd` alone,
    which serves the default socket, not the one given)."""
    missing = tmp_base / "none.sock"
    proc = subprocess.run(
        [PY, "-m", "toolsetd.client", "--socket", str(missing), "mcp", "--no-autostart"],
        input=b"",
        capture_output=True,
        timeout=20,
        check=False,
    )
    assert proc.returncode == 5
    lines = proc.stderr.decode().strip().splitlines()
    assert len(lines) == 1
    assert str(missing) in lines[0]
    assert "--no-autostart" in lines[0]
    assert f"start it (toolsetd --socket {missing})" in lines[0]
    assert proc.stdout == b""


@pytest.mark.parametrize(
    ("options", "shown"),
    [
        (["mcp", "--x\x1b]0;title\x07"], "--x\\x1b]0;title\\x07"),
        (["--socket", "{base}/s\x1b]52;c;eA==\x07.sock", "mcp", "--no-autostart"],
         "s\\x1b]52;c;eA==\\x07.sock"),
    ],
)
def test_mcp_failure_lines_show_control_characters_escaped(
    tmp_base: Path, options: list[str], shown: str
) -> None:
    """The pump's failure line quoted an option as typed and the socket path raw: an ESC
    in them retitled the terminal or wrote its clipboard (OSC 52), where every other
    command prints it as an escape (docs/cli.md, What reaches the terminal)."""
    argv = [PY, "-m", "toolsetd.client", *(o.format(base=tmp_base) for o in options)]
    proc = subprocess.run(argv, input=b"", capture_output=True, timeout=20, check=False)
    assert proc.returncode in (2, 5), proc.stderr
    assert b"\x1b" not in proc.stderr and b"\x07" not in proc.stderr
    assert shown in proc.stderr.decode()


@pytest.mark.parametrize(
    "socket_name",
    ["s##vso[task.setvariable variable=A]1.sock", "s\n::add-mask::x\n  ::set-output name=a::b.sock"],
)
def test_mcp_failure_lines_command_no_ci_runner(tmp_base: Path, socket_name: str) -> None:
    """The pump's own stderr lines escaped control characters but not a CI runner's
    commands: a socket path (``--socket``, ``$TOOLSETD_SOCKET``, built from a branch or a
    checkout's name in a job) holding ``##vso[`` set a pipeline variable, and one holding a
    newline put ``::add-mask::`` at the start of a line of the job's log (a host that logs
    its servers' stderr does). They are shown, not obeyed, as toolsetctl's other output."""
    argv = [PY, "-m", "toolsetd.client", "--socket", str(tmp_base / socket_name), "mcp",
            "--no-autostart"]
    proc = subprocess.run(argv, input=b"", capture_output=True, timeout=20, check=False)
    assert proc.returncode == 5, proc.stderr
    err = proc.stderr.decode()
    assert "toolsetctl mcp: " in err
    assert "##vso[" not in err, err
    assert not any(line.lstrip().startswith("::") for line in err.splitlines()), err


@pytest.mark.parametrize(
    ("option", "hint"),
    [
        ("--sock=x", "; did you mean --socket? (options are spelled in full)"),
        ("--cat", "; did you mean --catalog? (options are spelled in full)"),
        ("--headles", "; did you mean --headless? (options are spelled in full)"),
        ("--no-autostrat", "; did you mean --no-autostart?"),
        ("--json", ""),  # --format is taken, but the pump's output is MCP whatever it says
    ],
)
def test_mcp_unknown_option_names_the_one_meant(option: str, hint: str) -> None:
    """docs/cli.md: an abbreviation is a usage error "as it is for mcp", and the error
    names the option meant; the pump's own parser named none."""
    argv = [PY, "-m", "toolsetd.client", "mcp", option]
    proc = subprocess.run(argv, input=b"", capture_output=True, timeout=20, check=False)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.decode().splitlines()[-1] == (
        f"toolsetctl mcp: error: unrecognized argument: {option}{hint}"
    ), proc.stderr


@pytest.mark.parametrize(
    ("options", "code"),
    [
        (["-w", "mcp", "--format", "json", "--home", "/nonexistent"], 5),
        (["mcp", "--wide", "--no-autostart"], 5),
        (["mcp", "--widest"], 2),
    ],
)
def test_mcp_takes_the_global_options(tmp_base: Path, options: list[str], code: int) -> None:
    """toolsetctl's global options are accepted before or after mcp; an unknown one is not."""
    missing = tmp_base / "none.sock"
    argv = [PY, "-m", "toolsetd.client", "--socket", str(missing), *options, "--no-autostart"]
    proc = subprocess.run(argv, input=b"", capture_output=True, timeout=20, check=False)
    assert proc.returncode == code, proc.stderr
    if code == 2:
        assert "unrecognized argument: --widest" in proc.stderr.decode()
    assert proc.stdout == b""


def test_mcp_bad_workspace_is_one_clear_line(mcp_daemon: Daemon, tmp_base: Path) -> None:
    """A workspace that is not a directory is refused at bind time, on stderr, exit 2."""
    proc = subprocess.run(
        [
            PY,
            "-m",
            "toolsetd.client",
            "--socket",
            str(mcp_daemon.socket),
            "--workspace",
            str(tmp_base / "nope"),
            "mcp",
            "--no-autostart",
        ],
        input=b"",
        capture_output=True,
        timeout=20,
        check=False,
    )
    assert proc.returncode == 2
    assert "not a directory" in proc.stderr.decode()
    assert proc.stdout == b""


def test_mcp_a_busy_daemon_is_exit_8_not_a_usage_error(tmp_base: Path, workspace: Path) -> None:
    """The daemon refuses the bind's connection (-32008: every slot held by a subscriber):
    its sentence on stderr and exit 8, as every toolsetctl command says a busy daemon; exit
    2 is a bad option, workspace or mode ("each code means one thing")."""
    with daemon_in("tsb-", args=["--no-watch", "--max-connections", "1"]) as d, d.raw() as holder:
        assert "result" in holder.request("list", {"subscribe": True})
        proc = subprocess.run(
            [PY, *pump_args(d, workspace)], input=b"", capture_output=True, timeout=20,
            check=False,
        )
    assert proc.returncode == 8, proc
    assert "Too many connections" in proc.stderr.decode()
    assert proc.stdout == b""


@pytest.fixture
def autostart_base() -> Iterator[Path]:
    """A short folder for an autostarted daemon's socket, which is stopped afterwards."""
    base = Path(tempfile.mkdtemp(prefix="tsa-"))
    try:
        yield base
    finally:
        pid_file = base / "pid"
        if pid_file.exists():
            try:
                os.kill(int(pid_file.read_text()), signal.SIGTERM)
            except ProcessLookupError:
                pass
        shutil.rmtree(base, ignore_errors=True)


def _autostarted(
    autostart_base: Path,
    workspace: Path,
    tmp_base: Path,
    socket_arg: str,
    served: Path,
    env: dict[str, str] | None = None,
    cwd: Path | None = None,
    then: Callable[[RawPump], None] | None = None,
) -> RawPump:
    """``toolsetctl --socket SOCKET_ARG mcp`` with no daemon there: the pump starts one (its
    home the example sets), is initialized (and ``then``), and closes; the daemon it
    started answers at ``served`` with that home (its pid is kept for ``autostart_base``
    to stop). Returns the closed pump, for its stderr."""
    home = tmp_base / "autohome"
    shutil.copytree(EXAMPLES, home / "tools")
    env = {**os.environ, "CRYSTAL_HOME": str(home), **(env or {})}
    env.pop("TOOLSETD_SOCKET", None)
    pump = RawPump(
        ["-m", "toolsetd.client", "--socket", socket_arg, "--workspace", str(workspace), "mcp"],
        env,
        cwd=cwd,
    )
    try:
        init = pump.request(1, "initialize", {"protocolVersion": "2025-11-25", "capabilities": {}, "clientInfo": {"name": "t", "version": "1"}})
        assert init["result"]["serverInfo"]["name"] == "toolsetd"
        if then is not None:
            then(pump)
    finally:
        assert pump.close() == 0
    with RawConn(served) as conn:
        status = conn.request("status")["result"]
    (autostart_base / "pid").write_text(str(status["pid"]))
    assert status["home"] == str(home)
    return pump


def test_mcp_autostarts_a_daemon(autostart_base: Path, workspace: Path, tmp_base: Path) -> None:
    """With no daemon on the socket, toolsetctl mcp starts one and says where it logs."""
    sock = autostart_base / "run" / "t.sock"

    def call(pump: RawPump) -> None:
        called = pump.request(2, "tools/call", {"name": "hello", "arguments": {"name": "Auto"}})
        assert "Hello, Auto!" in called["result"]["content"][0]["text"]

    pump = _autostarted(autostart_base, workspace, tmp_base, str(sock), sock, then=call)
    log = sock.parent / "toolsetd.log"
    said = pump.stderr()
    assert str(log) in said
    assert str(sock) in said
    assert log.exists()


def test_mcp_autostarts_a_daemon_on_a_relative_socket(
    autostart_base: Path, workspace: Path, tmp_base: Path
) -> None:
    """A relative --socket names the same socket for the daemon the pump starts (which runs
    in /) as for the pump. Passed on as given, the daemon served /<path> while the pump
    waited at ./<path>. (``proc/``: the daemon that looks under / fails there, writing
    nothing.)"""
    served = autostart_base / "proc" / "t.sock"
    _autostarted(autostart_base, workspace, tmp_base, "proc/t.sock", served, cwd=autostart_base)


def test_mcp_sigint_ends_the_pump_without_a_traceback(
    mcp_daemon: Daemon, workspace: Path
) -> None:
    """A host stopping its servers sends SIGINT: the pump printed a KeyboardInterrupt
    traceback on stderr (no command prints one; a failure is one line). Now it exits 130
    (interrupted) quietly, and its connection closes with it."""
    # Started as a host starts it, with SIGINT at its default. A suite started in the
    # background (``make test &`` in a script, ``nohup``) has SIGINT ignored, and the
    # pump, as every program, keeps an ignored SIGINT ignored: it then never ended.
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        pump = RawPump(pump_args(mcp_daemon, workspace))
    finally:
        signal.signal(signal.SIGINT, previous)
    init = pump.request(1, "initialize", {"protocolVersion": "2025-11-25", "capabilities": {}, "clientInfo": {"name": "t", "version": "1"}})
    assert init["result"]["serverInfo"]["name"] == "toolsetd"
    assert pump.proc.poll() is None, "the pump ended before the SIGINT"
    pump.proc.send_signal(signal.SIGINT)
    # Its stdin stays open until it has exited: the SIGINT alone must end it (closed at
    # once, as communicate() does, an EOF could race the signal).
    assert pump.proc.wait(timeout=15) == 130
    _, err = pump.proc.communicate(timeout=15)
    assert "Traceback" not in err.decode()


def test_mcp_sigint_is_blocked_in_every_pump_thread_but_the_main_one(
    mcp_daemon: Daemon, workspace: Path
) -> None:
    """The kernel hands a signal sent to a process to any thread that does not block it.
    Taken by the pump's stdin thread, a SIGINT left the main thread in its socket read
    until the daemon closed or the exit timer ended the pump with 0 (a full run saw 0,
    not 130). The other threads block SIGINT, so it always interrupts the main one."""
    pump = RawPump(pump_args(mcp_daemon, workspace))
    try:
        init = pump.request(1, "initialize", {"protocolVersion": "2025-11-25", "capabilities": {}, "clientInfo": {"name": "t", "version": "1"}})
        assert init["result"]["serverInfo"]["name"] == "toolsetd"
        bit = 1 << (signal.SIGINT - 1)
        blocked = {}
        for task in Path(f"/proc/{pump.proc.pid}/task").iterdir():
            fields = dict(
                line.split(":", 1) for line in (task / "status").read_text().splitlines()
            )
            blocked[int(task.name)] = bool(int(fields["SigBlk"], 16) & bit)
        assert blocked.pop(pump.proc.pid) is False
        assert blocked
        assert all(blocked.values()), blocked
    finally:
        pump.proc.kill()
        pump.proc.communicate()


def test_mcp_autostart_with_a_fifo_for_its_log_fails_instead_of_hanging(
    autostart_base: Path,
) -> None:
    """A FIFO where the autostarted daemon's log goes (``toolsetd.log`` beside the socket):
    opening it to append blocked until someone read it, so the pump, and the host waiting
    for its first answer, hung forever. Now the start fails with one line, exit 5."""
    folder = autostart_base / "run"
    folder.mkdir(mode=0o700)
    os.mkfifo(folder / "toolsetd.log")
    env = {k: v for k, v in os.environ.items() if k != "TOOLSETD_SOCKET"}
    done = subprocess.run(
        [PY, "-m", "toolsetd.client", "--socket", str(folder / "t.sock"), "mcp"],
        input=b"", capture_output=True, timeout=30, env=env, check=False,
    )
    assert done.returncode == 5
    assert f"cannot open the log {folder / 'toolsetd.log'}" in done.stderr.decode()
    assert not (folder / "t.sock").exists()


def test_mcp_autostarted_daemon_does_not_notify_the_hosts_systemd(
    autostart_base: Path, workspace: Path, tmp_base: Path
) -> None:
    """A host run by systemd (Type=notify, NotifyAccess=all) has NOTIFY_SOCKET set; the
    daemon its pump started inherited it and told the host's unit READY=1, a STATUS= line
    and, when it stopped, STOPPING=1. The pump now starts it without the host's systemd
    variables: nothing arrives on that socket."""
    sock = autostart_base / "run" / "t.sock"
    notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    notify.bind(str(autostart_base / "notify"))
    notify.setblocking(False)
    env = {"NOTIFY_SOCKET": str(autostart_base / "notify")}
    _autostarted(autostart_base, workspace, tmp_base, str(sock), sock, env=env)
    with notify, pytest.raises(BlockingIOError):  # READY=1 comes before the first answer
        notify.recv(4096)


# -- a real host ---------------------------------------------------------------------------


#: The Claude Code the tests run, pinned as the other hosts are: an unpinned install took
#: whatever the registry served that day, and a cache folder kept the first one for good.
CLAUDE_CODE_VERSION = "2.1.197"


@pytest.fixture(scope="session")
def claude_cli() -> Path:
    """Claude Code from npm, installed once into a cache folder outside the repository."""
    return npm_program(
        f"claude-code-{CLAUDE_CODE_VERSION}",
        f"@anthropic-ai/claude-code@{CLAUDE_CODE_VERSION}",
        "claude",
    )


@pytest.mark.slow
@pytest.mark.timeout(900)  # a fresh machine installs Claude Code from npm first
def test_mcp_claude_code_connects(
    claude_cli: Path, mcp_daemon: Daemon, workspace: Path, tmp_base: Path
) -> None:
    """``claude mcp add`` then ``claude mcp list`` reports toolsetctl mcp as Connected."""
    env = {**os.environ, "HOME": str(tmp_base / "claude-home")}
    (tmp_base / "claude-home").mkdir()
    command = [PY, *pump_args(mcp_daemon, workspace)]
    subprocess.run(
        [str(claude_cli), "mcp", "add", "tools", "--", *command],
        cwd=workspace,
        env=env,
        capture_output=True,
        timeout=60,
        check=True,
    )
    listed = subprocess.run(
        [str(claude_cli), "mcp", "list"],
        cwd=workspace,
        env=env,
        capture_output=True,
        timeout=120,
        check=False,
    )
    out = listed.stdout.decode()
    assert "tools:" in out
    assert "Connected" in out, out


@pytest.mark.slow
@pytest.mark.timeout(900)  # a fresh machine installs Claude Code from npm first
def test_mcp_claude_code_lists_and_gets_both_transports(
    claude_cli: Path, project: None, shared_daemon: Daemon, workspace: Path, tmp_base: Path
) -> None:
    """Claude Code connects to toolsetd over stdio (``toolsetctl mcp``) and over HTTP (the
    workspace in the URL): ``claude mcp list`` and ``claude mcp get`` report each as
    Connected and print nothing on stderr."""
    home = tmp_base / "claude-home"
    home.mkdir()
    env = {**os.environ, "HOME": str(home)}
    assert shared_daemon.mcp_url is not None
    url = endpoint(shared_daemon.mcp_url, workspace)
    for add in (["tools", "--", PY, *pump_args(shared_daemon, workspace)],
                ["--transport", "http", "toolshttp", url]):
        subprocess.run([str(claude_cli), "mcp", "add", *add], cwd=workspace, env=env,
                       capture_output=True, timeout=60, check=True)
    listed = subprocess.run([str(claude_cli), "mcp", "list"], cwd=workspace, env=env,
                            capture_output=True, text=True, timeout=120, check=False)
    lines = {line.split(":", 1)[0]: line for line in listed.stdout.splitlines() if ": " in line}
    assert "Connected" in lines.get("tools", ""), listed.stdout
    assert "Connected" in lines.get("toolshttp", ""), listed.stdout
    assert "(HTTP)" in lines["toolshttp"], listed.stdout
    assert listed.stderr == "", listed.stderr
    for name, kind in (("tools", "stdio"), ("toolshttp", "http")):
        got = subprocess.run([str(claude_cli), "mcp", "get", name], cwd=workspace, env=env,
                             capture_output=True, text=True, timeout=120, check=False)
        assert got.returncode == 0, got
        assert "Connected" in got.stdout, got.stdout
        assert f"Type: {kind}" in got.stdout, got.stdout
        assert got.stderr == "", got.stderr


@pytest.mark.slow
@pytest.mark.timeout(900)  # a fresh machine installs Claude Code from npm first
def test_mcp_claude_code_recipe_of_the_docs_runs_as_written(
    claude_cli: Path, tmp_base: Path
) -> None:
    """docs/mcp.md's Claude Code recipe, run as written with the checkout's ``toolsetctl``
    on ``PATH`` (only the URL's port and folder filled in): the local server, the
    ``.mcp.json`` one once approved as it says, and the HTTP one each report what the docs
    show, and the tools run in the folder the docs say: the one ``claude`` runs in (a
    subfolder's when it is started there), and over HTTP the URL's."""
    recipe = host_recipe("Claude Code")
    local, http_add = re.findall(r"```sh\n(.*?)```", recipe, flags=re.S)
    [mcp_json] = re.findall(r"```json\n(.*?)```", recipe, flags=re.S)
    [project_add] = re.findall(r"`(claude mcp add -s project [^`]*)`", recipe)
    [approval] = re.findall(r"`(\"enabledMcpjsonServers\": [^`]*)` in", recipe)
    with daemon_in("tsc-", args=["--mcp-listen", "127.0.0.1:0"]) as daemon:
        claude = RecipeHost("claude", claude_cli, tmp_base / "claude-home", daemon)
        served = claude.served
        # The local server, from the project's root and then from a subfolder.
        root = git_project(tmp_base, "app")
        add, listing = doc_commands(local)
        claude(root, add)
        shown = local.splitlines()[1].split("# ", 1)[1]
        assert shown in claude(root, listing).splitlines()
        assert served() == {str(root)}
        assert shown in claude(root / "sub", listing).splitlines()
        assert served() == {str(root), str(root / "sub")}
        # The project's .mcp.json, as the docs show it, pending until approved their way.
        team = git_project(tmp_base, "team")
        claude(team, shlex.split(project_add))
        assert json.loads((team / ".mcp.json").read_text()) == json.loads(mcp_json)
        assert "Pending approval" in claude(team, listing)
        (team / ".claude").mkdir()
        (team / ".claude" / "settings.local.json").write_text("{" + approval + "}")
        assert shown in claude(team, listing).splitlines()
        assert str(team) in served()
        # Over HTTP the URL's folder is served, not the one claude runs in.
        web = git_project(tmp_base, "web")
        url = endpoint(listening_urls(daemon)[0], daemon.workspace)
        [http_argv] = doc_commands(http_add.replace(DOC_URL, url))
        claude(web, http_argv)
        assert f"tools: {url} (HTTP) - \u2714 Connected" in claude(web, listing).splitlines()
        assert str(daemon.workspace) in served()
        assert str(web) not in served()


OPENCODE_VERSION = "1.18.33"


@pytest.fixture(scope="session")
def opencode_cli() -> Path:
    """OpenCode from npm (its Node launcher and the platform's binary), installed once."""
    return npm_program(f"opencode-{OPENCODE_VERSION}", f"opencode-ai@{OPENCODE_VERSION}", "opencode")


@pytest.mark.slow
@pytest.mark.timeout(900)  # a fresh machine installs OpenCode from npm first
def test_mcp_opencode_recipe_of_the_docs_runs_as_written(
    opencode_cli: Path, tmp_base: Path
) -> None:
    """docs/mcp.md's OpenCode recipe, run as written with the checkout's ``toolsetctl``
    on ``PATH``: ``opencode mcp add`` then ``opencode mcp list`` shows what the docs show,
    and so does the project's ``opencode.json`` as the docs give it; each serves the folder
    ``opencode`` runs in, a subfolder's when it is started there."""
    recipe = host_recipe("OpenCode")
    [block] = re.findall(r"```sh\n(.*?)```", recipe, flags=re.S)
    [config] = re.findall(r"```json\n(.*?)```", recipe, flags=re.S)
    add, listing = doc_commands(block)
    shown = block.splitlines()[1].split("# ", 1)[1]
    home = tmp_base / "opencode-home"
    with daemon_in("tso-") as daemon:
        opencode = RecipeHost("opencode", opencode_cli, home, daemon, xdg=True)
        served = opencode.served
        root = git_project(tmp_base, "app")
        opencode(root, add)
        assert shown in opencode(root, listing)
        assert served() == {str(root)}
        # The project's opencode.json alone (the user's config set aside), and a subfolder.
        user = home / "config" / "opencode"
        for written in user.glob("opencode.json*"):
            written.rename(written.with_suffix(".set-aside"))
        (root / "opencode.json").write_text(config)
        assert shown in opencode(root / "sub", listing)
        assert served() == {str(root), str(root / "sub")}


GEMINI_VERSION = "0.61.0"


@pytest.fixture(scope="session")
def gemini_cli() -> Path:
    """Gemini CLI from npm, installed once into a cache folder outside the repository."""
    return npm_program(
        f"gemini-cli-{GEMINI_VERSION}", f"@google/gemini-cli@{GEMINI_VERSION}", "gemini"
    )


@pytest.mark.slow
@pytest.mark.timeout(900)  # a fresh machine installs Gemini CLI from npm first
def test_mcp_gemini_cli_recipe_of_the_docs_runs_as_written(
    gemini_cli: Path, tmp_base: Path
) -> None:
    """docs/mcp.md's Gemini CLI recipe, run as written in trusted folders with the
    checkout's ``toolsetctl`` on ``PATH``: ``gemini mcp add`` writes the settings the docs
    show and ``gemini mcp list`` what they show, the pump's flags go after ``--`` as they
    say, and the HTTP form connects and serves the URL's folder."""
    recipe = host_recipe("Gemini CLI")
    [block] = re.findall(r"```sh\n(.*?)```", recipe, flags=re.S)
    [settings] = re.findall(r"```json\n(.*?)```", recipe, flags=re.S)
    [flagged] = re.findall(r"`(gemini mcp add tools toolsetctl mcp -- [^`]*)`", recipe)
    [http_add] = re.findall(r"`(gemini mcp add --transport http [^`]*)`", recipe)
    add, listing = doc_commands(block)
    shown = block.splitlines()[1].split("# ", 1)[1]
    home = tmp_base / "gemini-home"
    (home / ".gemini").mkdir(parents=True)
    folders = {name: tmp_base / name for name in ("app", "flags", "web")}
    trusted = {str(folder): "TRUST_FOLDER" for folder in folders.values()}
    (home / ".gemini" / "trustedFolders.json").write_text(json.dumps(trusted))

    def written(folder: Path) -> Any:
        return json.loads((folder / ".gemini" / "settings.json").read_text())

    with daemon_in("tsg-", args=["--mcp-listen", "127.0.0.1:0"]) as daemon:
        gemini = RecipeHost("gemini", gemini_cli, home, daemon)
        for folder in folders.values():
            folder.mkdir()
        root = folders["app"]
        gemini(root, add)
        assert written(root) == json.loads(settings)
        assert shown in gemini(root, listing)
        assert gemini.served() == {str(root)}
        gemini(folders["flags"], shlex.split(flagged))
        assert written(folders["flags"])["mcpServers"]["tools"]["args"] == ["mcp", "--mode", "full"]
        url = endpoint(listening_urls(daemon)[0], daemon.workspace)
        gemini(folders["web"], shlex.split(http_add.replace(DOC_URL, url)))
        assert written(folders["web"])["mcpServers"]["tools"] == {"url": url, "type": "http"}
        assert f"\u2713 tools: {url} (http) - Connected" in gemini(folders["web"], listing)
        assert str(folders["web"]) not in gemini.served()


@pytest.mark.slow
def test_mcp_no_new_call_during_a_graceful_stop(
    mcp_sets: None, home: Path, workspace: Path, tmp_base: Path
) -> None:
    """After SIGTERM a new tools/call is refused (-32010), which the pump keeps from the
    host: the call waits for the next daemon (none comes here, and it is answered as not
    sent once the input ends); the running one is cancelled."""
    d = start_daemon(home, workspace, tmp_base, ["--shutdown-grace", "2"])
    pump = RawPump(pump_args(d, workspace))
    try:
        pump.request(1, "initialize", {"protocolVersion": "2025-11-25", "capabilities": {}, "clientInfo": {"name": "t", "version": "1"}})
        call = {"name": "sleeper", "arguments": {}}
        pump.send({"jsonrpc": "2.0", "id": 2, "method": "tools/call", "params": call})
        pid_file = workspace / "sleeper.pid"
        eventually(lambda: pid_file.exists() and bool(pid_file.read_text()), what="the sleeper")
        d.proc.send_signal(signal.SIGTERM)
        eventually(lambda: "stop_requested" in d.log(), what="the stop to begin")
        pump.send({"jsonrpc": "2.0", "id": 3, "method": "tools/call",
                   "params": {"name": "hello", "arguments": {"name": "x"}}})
        cancelled = pump.receive()
        assert cancelled["id"] == 2
        assert cancelled["result"]["isError"] is True
        assert d.proc.wait(timeout=20) == 0
        assert not alive(int(pid_file.read_text()))
        assert pump.close() == 5  # the daemon went away under the host: one line says so
        assert "closed the connection" in pump.stderr()
        waited = [json.loads(line) for line in pump.stdout_text.splitlines()]
        assert [m["id"] for m in waited] == [3], waited
        assert "was not sent" in waited[0]["result"]["content"][0]["text"], waited
    finally:
        if pump.proc.poll() is None:
            pump.close()
        if d.proc.poll() is None:
            d.proc.kill()
            d.proc.wait()


def test_mcp_a_graceful_stop_answers_a_call_waiting_on_its_approval(
    mcp_sets: None, home: Path, workspace: Path, tmp_base: Path
) -> None:
    """A call whose approval the operator has not answered yet when the daemon stops
    gracefully is answered (an isError result: it did not run), and its elicitation/create
    is withdrawn, before the connection closes: a host is not left with a request that
    just drops, nor an approval form for a call that can no longer run."""
    d = start_daemon(home, workspace, tmp_base)
    pump = RawPump(pump_args(d, workspace))
    try:
        capabilities = {"elicitation": {}}
        pump.request(1, "initialize", {"protocolVersion": "2025-11-25", "capabilities": capabilities, "clientInfo": {"name": "t", "version": "1"}})
        pump.send({"jsonrpc": "2.0", "method": "notifications/initialized"})
        call = {"name": "asker", "arguments": {}}
        pump.send({"jsonrpc": "2.0", "id": 2, "method": "tools/call", "params": call})
        asked = pump.receive()
        assert asked["method"] == "elicitation/create"
        d.proc.send_signal(signal.SIGTERM)
        withdrawn = pump.receive()
        assert withdrawn["method"] == "notifications/cancelled"
        assert withdrawn["params"]["requestId"] == asked["id"]
        answered = pump.receive()
        assert answered["id"] == 2
        assert answered["result"]["isError"] is True
        assert "stopping" in answered["result"]["content"][0]["text"]
        assert d.proc.wait(timeout=20) == 0
        assert pump.close() == 5
    finally:
        if pump.proc.poll() is None:
            pump.close()
        if d.proc.poll() is None:
            d.proc.kill()
            d.proc.wait()
    assert not [e for e in d.log_events() if e.get("event") == "call_started"]


def test_mcp_meta_traceparent_reaches_the_child_and_a_bad_one_is_ignored(
    home: Path, workspace: Path, tmp_base: Path
) -> None:
    """tools/call's _meta.traceparent is the invoke's traceparent (the child gets it as
    TRACEPARENT without tracing); an invalid one, or one with a trailing newline, starts no
    trace and fails no call (W3C: a receiver that cannot parse it starts afresh)."""
    write_set(
        home / "tools",
        "trace",
        tool("show.py"),
        **{"show.py": script("import os\nprint(repr(os.environ.get('TRACEPARENT')))\n")},
    )
    d = start_daemon(home, workspace, tmp_base)
    pump = RawPump(pump_args(d, workspace))
    try:
        init = pump.request(1, "initialize", {"protocolVersion": "2025-11-25", "capabilities": {}, "clientInfo": {"name": "t", "version": "1"}})
        assert "result" in init
        parent = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
        expected = {parent: repr(parent), "00-xyz": "None", parent + "\n": "None"}
        for i, (sent, shown) in enumerate(expected.items()):
            call = {"name": "trace", "arguments": {}, "_meta": {"traceparent": sent}}
            reply = pump.request(2 + i, "tools/call", call)
            assert reply["result"]["isError"] is False, reply
            assert reply["result"]["content"][0]["text"].strip() == f"exit 0\n{shown}"
    finally:
        assert pump.close() == 0
        d.stop()


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
@pytest.mark.parametrize(
    ("options", "code"),
    [(["mcp", "--socket="], 2), (["mcp", "--no-autostart"], 5), (["mcp"], 0)],
)
def test_mcp_a_failing_stderr_keeps_the_exit_code_and_the_autostart(
    autostart_base: Path, tmp_base: Path, options: list[str], code: int
) -> None:
    """``toolsetctl mcp 2>>log`` on a full disk: the pump's stderr line raised, Python
    exited 1 for a usage error (2) or no daemon (5), and an autostart failed before the
    daemon was spawned, because its "starting toolsetd" line could not be written. The
    line is lost; the code and the start stand."""
    sock = autostart_base / "run" / "t.sock"
    home = tmp_base / "fullhome"
    home.mkdir()
    env = {**os.environ, "CRYSTAL_HOME": str(home)}
    env.pop("TOOLSETD_SOCKET", None)
    init = {"jsonrpc": "2.0", "id": 1, "method": "initialize",
            "params": {"protocolVersion": "2025-11-25", "capabilities": {}, "clientInfo": {"name": "t", "version": "1"}}}
    with open("/dev/full", "w") as full:
        proc = subprocess.run(
            [PY, "-m", "toolsetd.client", "--socket", str(sock), *options],
            input=json.dumps(init).encode() + b"\n",
            stdout=subprocess.PIPE,
            stderr=full,
            env=env,
            timeout=30,
            check=False,
        )
    if sock.exists():
        with RawConn(sock) as conn:
            (autostart_base / "pid").write_text(str(conn.request("status")["result"]["pid"]))
    assert proc.returncode == code, proc.stdout
    assert (autostart_base / "pid").exists() == (code == 0)  # the daemon it started answers


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
def test_mcp_a_failing_stdout_is_said_as_such_not_a_lost_daemon(
    mcp_daemon: Daemon, workspace: Path
) -> None:
    """``toolsetctl mcp > /dev/full`` (a full disk): the pump's write to stdout failed and
    it said "lost the connection to toolsetd at <socket>: No space left on device", exit 5
    (the daemon is unreachable), sending the operator after a daemon that was fine. The
    line names stdout; exit 9."""
    init = {"jsonrpc": "2.0", "id": 1, "method": "initialize",
            "params": {"protocolVersion": "2025-11-25", "capabilities": {}, "clientInfo": {"name": "t", "version": "1"}}}
    with open("/dev/full", "w") as full:
        proc = subprocess.Popen(
            [PY, "-m", "toolsetd.client", "--socket", str(mcp_daemon.socket),
             "--workspace", str(workspace), "mcp", "--no-autostart"],
            stdin=subprocess.PIPE, stdout=full, stderr=subprocess.PIPE,
        )
    assert proc.stdin is not None and proc.stderr is not None
    proc.stdin.write(json.dumps(init).encode() + b"\n")
    proc.stdin.flush()  # and left open: the host is still there when the answer comes
    try:
        proc.wait(timeout=30)
        said = proc.stderr.read().decode()
    finally:
        proc.kill()
        proc.stdin.close()
        proc.stderr.close()
    assert said.splitlines() == [
        "toolsetctl mcp: cannot write to stdout: [Errno 28] No space left on device"
    ]
    assert proc.returncode == 9


@pytest.mark.parametrize("full", [True, False])
def test_mcp_help_into_a_failing_or_closed_stdout_is_no_traceback(
    tmp_base: Path, full: bool
) -> None:
    """``toolsetctl mcp --help > /dev/full`` and ``toolsetctl mcp --help | true`` printed a
    traceback and exited 1 (docs/cli.md: no command prints one; 1 means a tool failed). A
    closed pipe is exit 0, as ``toolsetctl --help | true``; a full disk one line, exit 9."""
    if full and not os.path.exists("/dev/full"):
        pytest.skip("needs /dev/full")
    argv = [PY, "-m", "toolsetd.client", "mcp", "--help"]
    if full:
        with open("/dev/full", "w") as out:
            proc = subprocess.run(
                argv, stdout=out, stderr=subprocess.PIPE, timeout=30, check=False
            )
    else:
        read, write = os.pipe()
        os.close(read)  # nobody reads: the first write breaks the pipe
        try:
            proc = subprocess.run(
                argv, stdout=write, stderr=subprocess.PIPE, timeout=30, check=False
            )
        finally:
            os.close(write)
    assert b"Traceback" not in proc.stderr
    assert proc.returncode == (9 if full else 0), proc.stderr
    if full:
        assert proc.stderr.decode().splitlines() == [
            "toolsetctl mcp: cannot write to stdout: [Errno 28] No space left on device"
        ]


@pytest.mark.parametrize("mode", ["--mode=", "--mode=sometimes"])
def test_mcp_an_empty_or_unknown_mode_is_refused(mcp_daemon: Daemon, mode: str) -> None:
    """``--mode "$UNSET"`` is refused at bind time (exit 2) as invoke's and classify's
    empty --mode are, never bound in the default mode without a word."""
    proc = subprocess.run(
        [PY, "-m", "toolsetd.client", "--socket", str(mcp_daemon.socket), "mcp", mode,
         "--no-autostart"],
        input=b"",
        capture_output=True,
        timeout=20,
        check=False,
    )
    assert proc.returncode == 2, proc.stderr
    assert "invalid mode" in proc.stderr.decode()
    assert proc.stdout == b""
