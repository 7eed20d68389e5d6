"""MCP over Streamable HTTP against a real daemon: sessions, guards, streams, the SDK client.

One daemon per module (per xdist worker) serves the tests that take ``http_daemon``: the
example sets and the test sets in its home, MCP on an ephemeral 127.0.0.1 port. Each test
brings its own workspace with its own ``asker`` project set, so the pid file the sleeper
writes there is the test's alone; the shared log is searched by the call id the sleeper
writes beside its pid, and a set added to the home gets a name of its own. The tests of a
start-up setting (a token file, two listen addresses) start a daemon of their own.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import re
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from http.client import HTTPConnection, HTTPException
from pathlib import Path
from typing import Any
from urllib.parse import SplitResult, urlsplit

import anyio
import httpx2 as httpx
import pytest
from mcp import types
from mcp.client.client import Client
from toolsetd.daemon.app import parse_args
from toolsetd.daemon.settings import ConfigError

from .conftest import (
    EXAMPLES,
    CpuByThread,
    Daemon,
    alive,
    daemon_in,
    descriptors_limited,
    eventually,
    memory_limited,
    shut_down,
    start_daemon,
    write_set,
)
from .http_helpers import (
    INIT_PARAMS,
    JSON_HEADERS,
    HttpReply,
    endpoint,
    http,
    initialize,
    listening_urls,
    rpc,
    sdk_oracle,
    start_http_daemon,
)
from .mcp_helpers import PROGRESS3, script

PY = sys.executable
#: An interpreter another user can run (the venv's lives under root's home).
SYSTEM_PY = "/usr/bin/python3"


def _tool(command: str, **extra: Any) -> dict[str, Any]:
    return {
        "runner": "exec", "description": f"Test tool {command}.", "schema": {"type": "object"},
        "command": [command], "stdin": True, "approval": "always", "timeoutSeconds": 60, **extra,
    }


#: Writes its call id, then its pid (so the id is there once the pid is), reports progress
#: (so the POST turns into SSE), then sleeps.
SLEEPER = script(
    "import json, os, time\n"
    "open('sleeper.call', 'w').write(os.environ['TOOLSETD_CALL_ID'])\n"
    "open('sleeper.pid', 'w').write(str(os.getpid()))\n"
    "fd = int(os.environ['TOOLSETD_PROGRESS_FD'])\n"
    "os.write(fd, b'{\"message\": \"sleeping\", \"fraction\": 0.1}\\n')\n"
    "time.sleep(60)\n"
)
ASKER = script("print('asked and ran')\n")


@pytest.fixture(scope="module")
def shared_http_daemon() -> Iterator[tuple[Daemon, str]]:
    """The module's daemon serving MCP over HTTP on 127.0.0.1, with the test tool sets."""

    def fill(home: Path, _workspace: Path) -> None:
        tools = home / "tools"
        shutil.copytree(EXAMPLES, tools, dirs_exist_ok=True)
        write_set(tools, "progress3", _tool("progress3.py"), **{"progress3.py": PROGRESS3})
        write_set(tools, "sleeper", _tool("sleeper.py"), **{"sleeper.py": SLEEPER})

    with daemon_in("tsh-", fill, ["--mcp-listen", "127.0.0.1:0"]) as daemon:
        yield daemon, listening_urls(daemon)[0]


@pytest.fixture
def http_daemon(
    shared_http_daemon: tuple[Daemon, str], workspace: Path
) -> tuple[Daemon, str]:
    """The module's daemon and its MCP URL; this test's workspace holds the ``asker`` set."""
    write_set(workspace / ".crystal" / "tools", "asker", _tool("asker.py"),
              **{"asker.py": ASKER})
    return shared_http_daemon


# -- sessions, over raw HTTP ----------------------------------------------------------------


def test_http_session_initialize_list_call_delete(http_daemon, workspace: Path) -> None:
    """initialize opens a session; tools/list and tools/call answer in it; DELETE ends it."""
    _, base = http_daemon
    url = endpoint(base, workspace)
    session = initialize(url)
    headers = {"mcp-session-id": session}
    listed = http(url, body=rpc(2, "tools/list"), headers=headers)
    assert listed.status == 200
    names = {t["name"] for t in listed.json()["result"]["tools"]}
    assert {"hello", "progress3", "sleeper", "asker"} <= names
    called = http(url, body=rpc(3, "tools/call", {"name": "hello", "arguments": {"name": "Ada"}}),
                  headers=headers)
    assert called.status == 200
    assert called.headers["content-type"] == "application/json"
    result = called.json()["result"]
    assert result["isError"] is False
    assert "Ada" in result["content"][0]["text"]
    assert http(url, "DELETE", headers=headers).status == 204
    gone = http(url, body=rpc(4, "tools/list"), headers=headers)
    assert gone.status == 404
    assert "initialize" in gone.json()["error"]["message"]


def test_http_the_tools_session_is_toolsetds_name_never_the_session_header(
    http_daemon, workspace: Path
) -> None:
    """A call's ``CRYSTAL_SESSION`` is toolsetd's name for the MCP session, one per HTTP
    session: the ``Mcp-Session-Id`` the host presents is the credential of that session
    (anyone holding it can act in it), so no tool may read it."""
    _, base = http_daemon
    env = "#!/bin/sh\nenv\n"
    write_set(workspace / ".crystal" / "tools", "envdump", _tool("env.sh"), **{"env.sh": env})
    url = endpoint(base, workspace, mode="full")  # a project set: full runs it unasked

    def session_seen(header: str, request_id: int) -> tuple[str, str]:
        called = http(url, body=rpc(request_id, "tools/call", {"name": "envdump", "arguments": {}}),
                      headers={"mcp-session-id": header})
        assert called.status == 200, called
        text = called.json()["result"]["content"][0]["text"]
        assert header not in text, "the session header reached the tool"
        lines = [line for line in text.splitlines() if line.startswith("CRYSTAL_SESSION=")]
        assert len(lines) == 1, text
        return lines[0].partition("=")[2], text

    first = initialize(url)
    seen, _ = session_seen(first, 2)
    assert seen.startswith("mcp-"), seen
    assert session_seen(first, 3)[0] == seen  # one name for the session's calls
    assert session_seen(initialize(url), 2)[0] not in ("", seen)  # another for another


def test_http_numbers_reach_the_tool_and_the_list_as_written(http_daemon, workspace: Path) -> None:
    """Over HTTP as on the socket: 1.50 and a 90-bit integer reach argv as typed, and a schema
    holding such an integer is listed exactly (no float, no failed tools/list)."""
    _, base = http_daemon
    wide = 123456789012345678901234567890
    echo = "#!/bin/sh\nfor a in \"$@\"; do printf '%s\\n' \"$a\"; done\n"
    write_set(workspace / ".crystal" / "tools", "numbers", _tool(
        "echo.sh", argv={"n": "--n", "big": "--big"},
        schema={"type": "object", "properties": {"big": {"type": "integer", "maximum": wide * 10}}},
    ), **{"echo.sh": echo})
    url = endpoint(base, workspace, mode="full")  # a project set: full runs it unasked
    headers = {"mcp-session-id": initialize(url)}
    listed = http(url, body=rpc(2, "tools/list"), headers=headers)
    assert listed.status == 200
    assert f'"maximum":{wide * 10}'.encode() in listed.body, listed.body[:300]
    body = (b'{"jsonrpc":"2.0","id":3,"method":"tools/call","params":{"name":"numbers",'
            b'"arguments":{"n":1.50,"big":' + str(wide).encode() + b"}}}")
    called = http(url, body=body, headers=headers)
    assert called.status == 200, called
    text = called.json()["result"]["content"][0]["text"]
    assert f"--n\n1.50\n--big\n{wide}" in text, text


@pytest.mark.parametrize(
    ("workspace_value", "needle"),
    [
        pytest.param(None, "must name the workspace", id="missing"),
        pytest.param("relative/path", "absolute path", id="relative"),
        pytest.param("/no/such/dir/anywhere", "not a directory", id="not-a-directory"),
    ],
)
def test_http_bad_workspace_is_400(http_daemon, workspace_value: str | None, needle: str) -> None:
    """A missing or bad workspace in the URL is a 400 whose message says what to send."""
    _, base = http_daemon
    reply = http(endpoint(base, workspace_value), body=rpc(1, "initialize", INIT_PARAMS))
    assert reply.status == 400
    error = reply.json()["error"]
    assert error["code"] == -32006
    assert needle in error["message"]


def test_http_bad_catalog_or_mode_is_400(http_daemon, workspace: Path) -> None:
    """A catalog or mode the core refuses is a 400 naming the field."""
    _, base = http_daemon
    for query, field in (({"catalog": "nope"}, "catalog"), ({"mode": "wild"}, "mode")):
        reply = http(endpoint(base, workspace, **query), body=rpc(1, "initialize", INIT_PARAMS))
        assert reply.status == 400
        assert f"'{field}'" in reply.json()["error"]["message"]


def test_http_a_query_parameter_given_twice_is_400(http_daemon, workspace: Path) -> None:
    """mode=default&mode=plan (or two workspaces): refused naming it, never a guess."""
    _, base = http_daemon
    for extra, field in (("&mode=default&mode=plan", "mode"), (f"&workspace={workspace}", "workspace")):
        reply = http(endpoint(base, workspace) + extra, body=rpc(1, "initialize", INIT_PARAMS))
        assert reply.status == 400, reply
        error = reply.json()["error"]
        assert f"'{field}' is given 2 times" in error["message"], error
        assert error["data"]["field"] == field
        # The message's lead names the same kind of error as its code.
        lead = "Invalid workspace:" if field == "workspace" else "Invalid params:"
        assert error["code"] == (-32006 if field == "workspace" else -32602), error
        assert error["message"].startswith(lead), error


def test_http_an_unknown_query_parameter_is_400(http_daemon, workspace: Path) -> None:
    """catalgo=plan or headles=true is refused naming it, as mcp.bind refuses an unknown
    field: ignored, the session would serve every tool, or ask where the host meant deny."""
    _, base = http_daemon
    meta = {"io.modelcontextprotocol/protocolVersion": "2026-07-28",
            "io.modelcontextprotocol/clientCapabilities": {}}
    modern = {"mcp-protocol-version": "2026-07-28", "mcp-method": "tools/list"}
    opening = ((rpc(1, "initialize", INIT_PARAMS), {}),
               (rpc(2, "tools/list", {"_meta": meta}), modern))  # a session, a stateless one
    for query, field in (("&catalgo=plan", "catalgo"), ("&headles=true", "headles"),
                         ("&mode=default&Mode=plan", "Mode")):
        for body, headers in opening:
            reply = http(endpoint(base, workspace) + query, body=body, headers=headers)
            assert reply.status == 400, (query, reply)
            error = reply.json()["error"]
            assert error["code"] == -32602, error
            assert f"unknown field '{field}'" in error["message"], error
            assert error["data"] == {"field": field}, error
            assert "mcp-session-id" not in reply.headers
    # A name that is not UTF-8 is refused too, without echoing it.
    reply = http(endpoint(base, workspace) + "&%ff=1", body=rpc(1, "initialize", INIT_PARAMS))
    assert reply.status == 400, reply
    assert "not UTF-8" in reply.json()["error"]["message"]


def test_http_a_query_value_that_is_not_utf8_is_400(http_daemon, workspace: Path) -> None:
    """workspace=<dir>/%ff names the directory whose name is the byte 0xff: refused (as on
    the socket), never read as U+FFFD, which names another directory that may exist."""
    _, base = http_daemon
    (workspace / "\ufffd").mkdir()
    reply = http(endpoint(base, workspace) + "/%ff", body=rpc(1, "initialize", INIT_PARAMS))
    assert reply.status == 400, reply
    error = reply.json()["error"]
    assert error["code"] == -32006, error
    assert "'workspace' in the URL is not UTF-8" in error["message"], error
    assert "mcp-session-id" not in reply.headers
    reply = http(endpoint(base, workspace) + "&mode=%ff", body=rpc(1, "initialize", INIT_PARAMS))
    assert reply.status == 400, reply
    assert reply.json()["error"]["data"] == {"field": "mode"}


def test_http_error_answers_echo_only_ids_that_name_a_request(
    http_daemon, workspace: Path
) -> None:
    """The transport's own errors (unknown session, no workspace) echo an id by the core's
    rule: a string or an integer as sent, an object, a float or a bool as null."""
    _, base = http_daemon
    for request_id, echoed in (({"x": [1, {"y": 2}]}, None), (1.5, None), (True, None),
                               ("a", "a"), (7, 7)):
        gone = http(endpoint(base, workspace), body=rpc(request_id, "ping"),
                    headers={"mcp-session-id": "nope"})
        assert gone.status == 404
        assert gone.json()["id"] == echoed, (request_id, gone.body)
        for method in ("initialize", "tools/list"):
            bad = http(endpoint(base, None), body=rpc(request_id, method, INIT_PARAMS))
            assert bad.status == 400
            assert bad.json()["id"] == echoed, (request_id, method, bad.body)


def test_http_request_without_session_or_modern_meta(http_daemon, workspace: Path) -> None:
    """A legacy request with no session is 400 with the core's error (initialize first):
    the transport has a server that needs a session answer such a request 400, as the
    SDKs' servers do (it was 200). A ping, served before initialize, stays 200."""
    _, base = http_daemon
    url = endpoint(base, workspace)
    for headers in ({}, {"mcp-protocol-version": "2025-11-25"}):
        reply = http(url, body=rpc(1, "tools/list"), headers=headers)
        assert reply.status == 400, (headers, reply)
        assert reply.json()["id"] == 1
        assert "initialize first" in reply.json()["error"]["message"]
    assert http(url, body=rpc(2, "ping")).status == 200
    # A method toolsetd lacks is -32601 (initialize would not make it one), still 400.
    lacking = http(url, body=rpc(4, "resources/list"))
    assert lacking.status == 400, lacking
    assert lacking.json()["error"]["code"] == -32601, lacking.body
    # A 2026-07-28 request is served without a session: its errors stay 200.
    meta = {"io.modelcontextprotocol/protocolVersion": "2026-07-28",
            "io.modelcontextprotocol/clientCapabilities": {}}
    unknown = http(url, body=rpc(3, "tools/call", {"_meta": meta, "name": "nope"}), headers={
        "mcp-protocol-version": "2026-07-28", "mcp-method": "tools/call", "mcp-name": "nope"})
    assert unknown.status == 200, unknown
    assert unknown.json()["error"]["code"] == -32602


def test_http_a_malformed_initialize_is_invalid_params_and_opens_no_session(
    http_daemon, workspace: Path
) -> None:
    """An initialize without the params MCP's schema requires (protocolVersion a string,
    capabilities an object, clientInfo with string name and version) is the core's -32602
    naming the field, on the POST's 200 as the SDK's server answers it, and opens no
    session (no Mcp-Session-Id): the host sends a well-formed one."""
    from .test_mcp import MALFORMED_INITIALIZE

    _, base = http_daemon
    url = endpoint(base, workspace)
    for n, (params, field) in enumerate(MALFORMED_INITIALIZE):
        reply = http(url, body=rpc(n, "initialize", params))
        assert reply.status == 200, (params, reply)
        assert "mcp-session-id" not in reply.headers, (params, reply.headers)
        assert reply.json()["error"]["code"] == -32602, (params, reply.body)
        assert reply.json()["error"]["data"] == {"field": field}, (params, reply.body)
    assert "mcp-session-id" in http(url, body=rpc("ok", "initialize", INIT_PARAMS)).headers


def test_http_no_approval_request_goes_out_before_initialized(
    http_daemon, workspace: Path
) -> None:
    """A call that needs approval, POSTed in a session whose notifications/initialized has
    not come yet (HTTP requests may overtake each other), holds its question until it
    comes (MCP's lifecycle: no server request before it), then asks it on the call's
    stream; the accept runs the call. It went out at once."""
    daemon, base = http_daemon
    name = f"asker_{uuid.uuid4().hex[:10]}"
    write_set(workspace / ".crystal" / "tools", name, _tool(f"{name}.py"),
              **{f"{name}.py": ASKER})
    url = endpoint(base, workspace)
    opened = http(url, body=rpc(1, "initialize", {**INIT_PARAMS,
                                                  "capabilities": {"elicitation": {}}}))
    session = {"mcp-session-id": opened.headers["mcp-session-id"]}
    target = urlsplit(url)
    conn = HTTPConnection(target.hostname, target.port, timeout=30)
    try:
        conn.request("POST", f"{target.path}?{target.query}",
                     body=json.dumps(rpc(2, "tools/call", {"name": name, "arguments": {}})),
                     headers={**JSON_HEADERS, **session})
        eventually(lambda: any(e.get("event") == "mcp_approval_held" and e.get("tool") == name
                               for e in daemon.log_events()), what="the question held")
        note = http(url, body={"jsonrpc": "2.0", "method": "notifications/initialized"},
                    headers=session)
        assert note.status == 202, note
        stream = conn.getresponse()
        assert stream.headers["content-type"] == "text/event-stream"

        def event() -> Any:
            while True:
                line = stream.readline()
                assert line, "the stream ended"
                if line.startswith(b"data:"):
                    return json.loads(line[5:])

        asked = event()
        assert asked["method"] == "elicitation/create", asked
        answer = {"jsonrpc": "2.0", "id": asked["id"], "result": {"action": "accept"}}
        assert http(url, body=answer, headers=session).status == 202
        done = event()
        assert done["id"] == 2, done
        assert "asked and ran" in done["result"]["content"][0]["text"], done
    finally:
        conn.close()


def test_http_stateless_2026_request_needs_no_session(http_daemon, workspace: Path) -> None:
    """A 2026-07-28 request is one exchange: no session id, an answer with resultType."""
    _, base = http_daemon
    meta = {"io.modelcontextprotocol/protocolVersion": "2026-07-28",
            "io.modelcontextprotocol/clientCapabilities": {}}
    modern = {"mcp-protocol-version": "2026-07-28"}
    reply = http(endpoint(base, workspace), body=rpc(1, "tools/list", {"_meta": meta}),
                 headers={**modern, "mcp-method": "tools/list"})
    assert reply.status == 200
    assert "mcp-session-id" not in reply.headers
    result = reply.json()["result"]
    assert result["resultType"] == "complete"
    assert any(t["name"] == "hello" for t in result["tools"])
    discover = http(endpoint(base, workspace), body=rpc(2, "server/discover", {"_meta": meta}),
                    headers={**modern, "mcp-method": "server/discover"})
    assert "2026-07-28" in discover.json()["result"]["supportedVersions"]


def test_http_2026_request_headers_must_mirror_the_body(http_daemon, workspace: Path) -> None:
    """2026-07-28: MCP-Protocol-Version, Mcp-Method and (tools/call) Mcp-Name are required
    and must match the body, or an intermediary routes by one thing while the server does
    another: 400 with -32020 (HeaderMismatch)."""
    _, base = http_daemon
    url = endpoint(base, workspace)
    meta = {"io.modelcontextprotocol/protocolVersion": "2026-07-28",
            "io.modelcontextprotocol/clientCapabilities": {}}
    call = rpc(1, "tools/call", {"_meta": meta, "name": "hello", "arguments": {"name": "Ada"}})
    good = {"mcp-protocol-version": "2026-07-28", "mcp-method": "tools/call", "mcp-name": "hello"}
    assert http(url, body=call, headers=good).status == 200
    sentinel = "=?base64?" + base64.b64encode(b"hello").decode() + "?="
    assert http(url, body=call, headers={**good, "mcp-name": sentinel}).status == 200
    for headers in (
        {k: v for k, v in good.items() if k != "mcp-protocol-version"},
        {k: v for k, v in good.items() if k != "mcp-method"},
        {k: v for k, v in good.items() if k != "mcp-name"},
        {**good, "mcp-method": "tools/list"},
        {**good, "mcp-name": "asker"},
        {**good, "mcp-name": "=?base64?not base64?="},
    ):
        bad = http(url, body=call, headers=headers)
        assert bad.status == 400, (headers, bad)
        assert bad.json()["error"]["code"] == -32020, (headers, bad.body)
        assert bad.json()["id"] == 1


@pytest.mark.skipif(shutil.which("strace") is None, reason="needs strace")
def test_http_a_stateless_call_checks_its_workspace_once(http_daemon, workspace: Path) -> None:
    """A 2026-07-28 tools/call over HTTP is one exchange whose core session is bound to the
    URL's workspace for that request alone: the workspace is checked there (open, name,
    identity), and the call's judging takes that check rather than make it again (it was
    made twice per request). Counted by the daemon's own system calls (strace), the
    checks of a workspace directory being its O_PATH opens."""
    daemon, base = http_daemon
    called = workspace.parent / f"called-{uuid.uuid4().hex[:8]}"  # opened by the call alone
    called.mkdir()
    meta = {"io.modelcontextprotocol/protocolVersion": "2026-07-28",
            "io.modelcontextprotocol/clientCapabilities": {}}
    call = rpc(1, "tools/call", {"_meta": meta, "name": "hello", "arguments": {"name": "Ada"}})
    headers = {"mcp-protocol-version": "2026-07-28", "mcp-method": "tools/call",
               "mcp-name": "hello"}
    url = endpoint(base, called)
    assert http(url, body=call, headers=headers).status == 200  # its catalog built
    trace = workspace.parent / f"strace-{uuid.uuid4().hex[:8]}"
    tracer = subprocess.Popen(
        ["strace", "-f", "-e", "trace=openat", "-o", str(trace), "-p", str(daemon.proc.pid)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    try:

        def attached() -> bool:  # a ping binds its URL's workspace: traced once attached
            assert http(endpoint(base, workspace), body=rpc(0, "ping")).status == 200
            return trace.exists() and f'"{workspace}"' in trace.read_text()

        eventually(attached, what="strace attached")
        reply = http(url, body=call, headers=headers)
        assert reply.status == 200 and reply.json()["result"]["isError"] is False, reply
    finally:
        tracer.send_signal(signal.SIGINT)
        tracer.wait(timeout=30)
    opens = [line for line in trace.read_text().splitlines()
             if f'"{called}"' in line and "O_PATH" in line]
    assert len(opens) == 1, opens


def test_http_2026_request_ignores_mcp_session_id(http_daemon, workspace: Path) -> None:
    """A 2026-07-28 request is served statelessly by its own URL, whatever Mcp-Session-Id
    it carries (that revision: "ignore it, and do not mint or echo session IDs"; a
    dual-era server serves a request with modern _meta statelessly). It was bound to the
    named session (that session's workspace, not the URL's), and an ended session's id
    was 404."""
    _, base = http_daemon
    other = workspace.parent / "other-ws"
    other.mkdir()
    session = initialize(endpoint(base, workspace))  # this workspace has the asker set
    meta = {"io.modelcontextprotocol/protocolVersion": "2026-07-28",
            "io.modelcontextprotocol/clientCapabilities": {}}
    modern = {"mcp-protocol-version": "2026-07-28", "mcp-method": "tools/list"}
    for named in (session, "an-ended-session"):
        reply = http(endpoint(base, other), body=rpc(1, "tools/list", {"_meta": meta}),
                     headers={**modern, "mcp-session-id": named})
        assert reply.status == 200, (named, reply)
        assert "mcp-session-id" not in reply.headers
        names = {t["name"] for t in reply.json()["result"]["tools"]}
        assert "hello" in names and "asker" not in names, (named, names)
    legacy = http(endpoint(base, workspace), body=rpc(2, "tools/list"),
                  headers={"mcp-session-id": session})
    assert "asker" in {t["name"] for t in legacy.json()["result"]["tools"]}


def test_http_a_2026_notification_is_acknowledged_without_a_session(
    http_daemon, workspace: Path
) -> None:
    """A notification sent as a 2026-07-28 one (its MCP-Protocol-Version) needs no session,
    which that revision does not have: 202 with no body, and dropped, as the SDK's server
    answers it (it was 400, "needs its session's Mcp-Session-Id"). A legacy one without a
    session, and a response, are still 400."""
    _, base = http_daemon
    url = endpoint(base, workspace)
    modern = {"mcp-protocol-version": "2026-07-28"}
    for method, params in (("notifications/cancelled", {"requestId": 1}),
                           ("notifications/initialized", None)):
        note = {"jsonrpc": "2.0", "method": method, **({"params": params} if params else {})}
        reply = http(url, body=note, headers={**modern, "mcp-method": method})
        assert (reply.status, reply.body) == (202, b""), (method, reply)
        assert "mcp-session-id" not in reply.headers
    legacy = http(url, body={"jsonrpc": "2.0", "method": "notifications/initialized"})
    assert legacy.status == 400, legacy
    response = http(url, body={"jsonrpc": "2.0", "id": 5, "result": {}}, headers=modern)
    assert response.status == 400, response
    assert response.json()["error"]["code"] == -32600


def test_http_2026_mcp_param_headers_must_mirror_the_body(
    http_daemon, workspace: Path
) -> None:
    """2026-07-28: a tool whose schema marks a property ``x-mcp-header`` has the client
    mirror its value into ``Mcp-Param-<name>``; the server MUST check the header against
    the body (missing with the value in the body, another value, invalid characters, sent
    twice: 400, -32020), decoding the Base64 sentinel and comparing integers as numbers. A
    value that is absent or null needs no header. They were not checked at all."""
    _, base = http_daemon
    schema = {"type": "object", "properties": {
        "region": {"type": "string", "x-mcp-header": "Region"},
        "opts": {"type": "object", "properties": {
            "n": {"type": "integer", "x-mcp-header": "N"},
            "on": {"type": "boolean", "x-mcp-header": "On"}}},
    }}
    write_set(workspace / ".crystal" / "tools", "routed",
              _tool("routed.py", schema=schema, approval="inherit"),
              **{"routed.py": script("print('ran')\n")})
    url = endpoint(base, workspace)
    meta = {"io.modelcontextprotocol/protocolVersion": "2026-07-28",
            "io.modelcontextprotocol/clientCapabilities": {}}
    std = {"mcp-protocol-version": "2026-07-28", "mcp-method": "tools/call",
           "mcp-name": "routed"}

    def call(arguments: dict[str, Any], headers: dict[str, str]) -> Any:
        body = rpc(1, "tools/call", {"_meta": meta, "name": "routed", "arguments": arguments})
        return http(url, body=body, headers={**std, **headers})

    full = {"region": "us-west1", "opts": {"n": 42, "on": True}}
    good = {"mcp-param-region": "us-west1", "mcp-param-n": "42", "mcp-param-on": "true"}
    for arguments, headers in (
        (full, good),
        (full, {**good, "mcp-param-n": "42.0"}),  # numerically equal
        ({**full, "region": "Hello, \u4e16\u754c"},
         {**good, "mcp-param-region": "=?base64?"
          + base64.b64encode("Hello, \u4e16\u754c".encode()).decode() + "?="}),
        ({"region": None}, {}),  # null or absent: no header expected
        ({}, {}),
    ):
        reply = call(arguments, headers)
        assert reply.status == 200, (arguments, headers, reply)
        assert "error" not in reply.json(), reply.body
    for arguments, headers in (
        (full, {k: v for k, v in good.items() if k != "mcp-param-region"}),
        (full, {k: v for k, v in good.items() if k != "mcp-param-n"}),
        (full, {**good, "mcp-param-region": "eu-west1"}),
        (full, {**good, "mcp-param-n": "43"}),
        (full, {**good, "mcp-param-on": "True"}),
        (full, {**good, "mcp-param-region": "=?base64?not base64?="}),
        (full, {**good, "mcp-param-region": "us-west1\x7f"}),
    ):
        reply = call(arguments, headers)
        assert reply.status == 400, (arguments, headers, reply)
        assert reply.json()["error"]["code"] == -32020, (headers, reply.body)
        assert reply.json()["id"] == 1
    twice = http_raw_twice(url, rpc(1, "tools/call", {
        "_meta": meta, "name": "routed", "arguments": full}), {**std, **good},
        ("Mcp-Param-Region", "us-west1"))
    assert twice.status == 400, twice
    assert twice.json()["error"]["code"] == -32020


def test_http_2026_mcp_param_headers_follow_a_changed_schema(
    http_daemon, workspace: Path
) -> None:
    """The marks a tool's schema gives (which Mcp-Param headers a 2026-07-28 call needs)
    are worked out once per tool, not on every call: a reload that changes the schema
    changes them, and the next call is checked against the new schema, not the old."""
    daemon, base = http_daemon
    tools = workspace / ".crystal" / "tools"
    url = endpoint(base, workspace)
    meta = {"io.modelcontextprotocol/protocolVersion": "2026-07-28",
            "io.modelcontextprotocol/clientCapabilities": {}}
    std = {"mcp-protocol-version": "2026-07-28", "mcp-method": "tools/call",
           "mcp-name": "moved"}
    arguments = {"region": "us-west1", "zone": "b"}

    def write(marked: str) -> None:
        schema = {"type": "object", "properties": {
            name: {"type": "string", **({"x-mcp-header": name.title()} if name == marked
                                        else {})} for name in ("region", "zone")}}
        write_set(tools, "moved", _tool("moved.py", schema=schema),
                  **{"moved.py": script("print('ran')\n")})

    def call(headers: dict[str, str]) -> HttpReply:
        body = rpc(1, "tools/call", {"_meta": meta, "name": "moved", "arguments": arguments})
        return http(url, body=body, headers={**std, **headers})

    write("region")
    assert call({"mcp-param-region": "us-west1"}).status == 200
    assert call({"mcp-param-zone": "b"}).status == 400
    write("zone")
    assert "result" in daemon.call("reload", {})
    eventually(lambda: call({"mcp-param-zone": "b"}).status == 200,
               what="the call checked against the changed schema")
    refused = call({"mcp-param-region": "us-west1"})
    assert refused.status == 400, refused
    assert refused.json()["error"]["code"] == -32020


def test_http_2026_mcp_param_headers_as_the_sdk_server_checks_them(
    http_daemon, workspace: Path
) -> None:
    """As the official SDK's server: a header for an argument the body does not carry
    (absent, null) is refused too (an intermediary would route on a value the call never
    had), and a schema whose x-mcp-header annotations break MCP's constraints (on a
    ``number``, off the ``properties`` chain, twice in any case) validates nothing, as
    conforming clients drop such a tool and mirror no header for it."""
    _, base = http_daemon
    tools = workspace / ".crystal" / "tools"
    good = {"type": "object", "properties": {
        "region": {"type": "string", "x-mcp-header": "Region"}}}
    broken = {
        "on-number": {"type": "object", "properties": {
            "region": {"type": "string", "x-mcp-header": "Region"},
            "ratio": {"type": "number", "x-mcp-header": "Ratio"}}},
        "off-chain": {"type": "object", "properties": {
            "region": {"type": "string", "x-mcp-header": "Region"},
            "list": {"type": "array", "items": {"type": "string", "x-mcp-header": "Item"}}}},
        "twice": {"type": "object", "properties": {
            "region": {"type": "string", "x-mcp-header": "Region"},
            "zone": {"type": "string", "x-mcp-header": "REGION"}}},
    }
    for name, schema in [("routed", good), *broken.items()]:
        write_set(tools, name, _tool(f"{name}.py", schema=schema, approval="inherit"),
                  **{f"{name}.py": script("print('ran')\n")})
    url = endpoint(base, workspace)
    meta = {"io.modelcontextprotocol/protocolVersion": "2026-07-28",
            "io.modelcontextprotocol/clientCapabilities": {}}

    def call(tool: str, arguments: dict[str, Any] | None, headers: dict[str, str]) -> Any:
        body = rpc(1, "tools/call", {"_meta": meta, "name": tool, "arguments": arguments})
        return http(url, body=body, headers={
            "mcp-protocol-version": "2026-07-28", "mcp-method": "tools/call",
            "mcp-name": tool, **headers})

    for arguments in ({}, {"region": None}, None):
        reply = call("routed", arguments, {"mcp-param-region": "us-west1"})
        assert reply.status == 400, (arguments, reply)
        assert reply.json()["error"]["code"] == -32020, reply.body
    for name in broken:
        reply = call(name, {"region": "us-west1", "ratio": 0.5, "zone": "z"}, {})
        assert reply.status == 200, (name, reply)
        assert "error" not in reply.json(), (name, reply.body)


def http_raw_twice(
    url: str, body: Any, headers: dict[str, str], extra: tuple[str, str]
) -> HttpReply:
    """A POST that sends the header ``extra`` once more beside ``headers``."""
    parts = urlsplit(url)
    conn = HTTPConnection(parts.hostname, parts.port, timeout=30)
    try:
        conn.putrequest("POST", parts.path + "?" + parts.query)
        data = json.dumps(body).encode()
        for key, value in {"content-type": "application/json",
                           "accept": "application/json, text/event-stream",
                           "content-length": str(len(data)), **headers}.items():
            conn.putheader(key, value)
        conn.putheader(*extra)
        conn.endheaders(data)
        response = conn.getresponse()
        return HttpReply(response.status, {k.lower(): v for k, v in response.getheaders()},
                         response.read())
    finally:
        conn.close()


def test_http_a_task_augmented_call_is_served_as_a_plain_call(
    http_daemon, workspace: Path
) -> None:
    """Over HTTP too: a ``tools/call`` with 2025-11-25's ``task`` augmentation runs and is
    answered as a plain call (toolsetd declares no ``tasks`` capability, so MCP has it
    ignore the augmentation)."""
    _, base = http_daemon
    url = endpoint(base, workspace)
    session = initialize(url)
    reply = http(url, body=rpc(2, "tools/call", {"name": "hello", "arguments": {"name": "Ada"},
                                                 "task": {"ttl": 60000}}),
                 headers={"mcp-session-id": session})
    assert reply.status == 200, reply
    result = reply.messages()[-1]["result"]
    assert result["isError"] is False, result
    assert "Hello, Ada!" in result["content"][0]["text"]
    assert "task" not in result


def test_http_2026_unknown_method_is_404(http_daemon, workspace: Path) -> None:
    """A 2026-07-28 request for a method toolsetd does not serve is HTTP 404 with -32601,
    as that revision's transport requires; in a legacy session it stays 200. ``ping`` is
    one: 2026-07-28 removed it (it was answered 200 with a 2026-07-28 result)."""
    _, base = http_daemon
    url = endpoint(base, workspace)
    meta = {"io.modelcontextprotocol/protocolVersion": "2026-07-28",
        "io.modelcontextprotocol/clientCapabilities": {}}
    for method in ("resources/list", "no/such", "ping"):
        reply = http(url, body=rpc(1, method, {"_meta": meta}), headers={
            "mcp-protocol-version": "2026-07-28", "mcp-method": method})
        assert reply.status == 404, (method, reply)
        assert reply.json()["error"]["code"] == -32601, reply.body
        assert reply.json()["id"] == 1
    legacy = http(url, body=rpc(2, "resources/list"),
                  headers={"mcp-session-id": initialize(url)})
    assert legacy.status == 200, legacy
    assert legacy.json()["error"]["code"] == -32601


def test_http_a_protocol_version_that_is_not_a_string(http_daemon, workspace: Path) -> None:
    """A ``_meta`` protocol version that is not a string: with an MCP-Protocol-Version
    header it cannot match it (400, -32020, as any mismatch); without one it is the
    core's -32602 naming the field (it was -32022 on a 200, echoing the value)."""
    _, base = http_daemon
    url = endpoint(base, workspace)
    body = rpc(1, "tools/list", {"_meta": {"io.modelcontextprotocol/protocolVersion": 5}})
    mismatch = http(url, body=body, headers={
        "mcp-protocol-version": "2026-07-28", "mcp-method": "tools/list"})
    assert mismatch.status == 400, mismatch
    assert mismatch.json()["error"]["code"] == -32020
    bare = http(url, body=body, headers={"mcp-method": "tools/list"})
    assert bare.json()["error"]["code"] == -32602, bare
    assert bare.json()["error"]["data"] == {
        "field": "_meta.io.modelcontextprotocol/protocolVersion"}


def test_http_a_2026_request_without_client_capabilities_is_400(
    http_daemon, workspace: Path
) -> None:
    """A 2026-07-28 request whose ``_meta`` lacks ``clientCapabilities`` is malformed: MCP
    has the server reject it with -32602 and, on HTTP, ``400 Bad Request``, stateless or
    in a session (it was served, as a host that declared nothing). So is a malformed
    protocol version sent without the header (it was -32602 on a 200 in a session)."""
    _, base = http_daemon
    url = endpoint(base, workspace)
    field = "_meta.io.modelcontextprotocol/clientCapabilities"
    version = {"io.modelcontextprotocol/protocolVersion": "2026-07-28"}
    body = rpc(1, "tools/list", {"_meta": version})
    headers = {"mcp-protocol-version": "2026-07-28", "mcp-method": "tools/list"}
    for session in ({}, {"mcp-session-id": initialize(url)}):
        reply = http(url, body=body, headers={**headers, **session})
        assert reply.status == 400, (session, reply)
        assert reply.json()["error"]["code"] == -32602
        assert reply.json()["error"]["data"] == {"field": field}
        assert reply.json()["id"] == 1
        odd = rpc(2, "tools/list", {"_meta": {"io.modelcontextprotocol/protocolVersion": 5}})
        reply = http(url, body=odd, headers={"mcp-method": "tools/list", **session})
        assert reply.status == 400, (session, reply)
        assert reply.json()["error"]["code"] == -32602
    body["params"]["_meta"]["io.modelcontextprotocol/clientCapabilities"] = {}
    reply = http(url, body=body, headers=headers)
    assert reply.status == 200, reply
    assert reply.json()["result"]["tools"]


def test_http_an_unsupported_meta_version_is_400(http_daemon, workspace: Path) -> None:
    """A version toolsetd does not serve named by the request's ``_meta`` alone (no
    MCP-Protocol-Version header), stateless or in a session, is 400 with -32022, as one
    the header names is: the transport MUST answer it 400 (it was -32022 on a 200)."""
    _, base = http_daemon
    url = endpoint(base, workspace)
    body = rpc(1, "tools/list", {"_meta": {
        "io.modelcontextprotocol/protocolVersion": "1999-01-01"}})
    for headers in ({"mcp-method": "tools/list"}, {"mcp-session-id": initialize(url)}):
        reply = http(url, body=body, headers=headers)
        assert reply.status == 400, (headers, reply)
        assert reply.json()["error"]["code"] == -32022
        assert reply.json()["error"]["data"]["requested"] == "1999-01-01"
        assert reply.json()["id"] == 1


def test_http_a_null_protocol_version_is_no_version(http_daemon, workspace: Path) -> None:
    """A ``_meta`` protocol version that is null is absent, to the transport as to the
    core: a 2025-11-25 session's request carrying it with its MCP-Protocol-Version header
    is served by the session's version, as it is without the header (it was 400, -32020,
    "not a string", with the header only)."""
    _, base = http_daemon
    url = endpoint(base, workspace)
    session = initialize(url)
    body = rpc(2, "tools/list", {"_meta": {"io.modelcontextprotocol/protocolVersion": None}})
    for headers in ({}, {"mcp-protocol-version": "2025-11-25"}):
        reply = http(url, body=body, headers={"mcp-session-id": session, **headers})
        assert reply.status == 200, (headers, reply)
        assert "tools" in reply.json()["result"], reply


def test_http_a_2026_header_on_a_request_without_its_meta_is_400(
    http_daemon, workspace: Path
) -> None:
    """A request without a session whose MCP-Protocol-Version header says 2026-07-28 is a
    2026-07-28 request, and its ``_meta`` protocol version is a required field: missing
    (no ``_meta`` at all, or one without the version) it is malformed, -32602 naming the
    field with ``400 Bad Request``, as MCP has it (and as the official SDK's server and
    conformance suite answer it). ``server/discover`` and ``ping`` were served as probes
    (200), and tools/list was told to send initialize first."""
    _, base = http_daemon
    url = endpoint(base, workspace)
    field = "_meta.io.modelcontextprotocol/protocolVersion"
    caps = {"io.modelcontextprotocol/clientCapabilities": {}}
    for n, method in enumerate(("server/discover", "ping", "tools/list")):
        for m, params in enumerate((None, {}, {"_meta": caps})):
            headers = {"mcp-protocol-version": "2026-07-28", "mcp-method": method}
            reply = http(url, body=rpc(f"{n}-{m}", method, params), headers=headers)
            assert reply.status == 400, (method, params, reply)
            assert reply.json()["error"]["code"] == -32602, (method, params, reply.body)
            assert reply.json()["error"]["data"] == {"field": field}
            assert reply.json()["id"] == f"{n}-{m}"
            assert "mcp-session-id" not in reply.headers
    # Without the header, a bare server/discover or ping is still the probe it was.
    for method in ("server/discover", "ping"):
        assert http(url, body=rpc(9, method)).status == 200


def test_http_protocol_version_header_is_checked(http_daemon, workspace: Path) -> None:
    """MCP-Protocol-Version: absent, or a handshake version (the session answers by its
    own), it is served; one toolsetd does not know is 400 (-32022), and a 2026-07-28 one
    on a request not served by 2026-07-28, or the reverse, is 400 (-32020): on POST, GET
    and DELETE."""
    _, base = http_daemon
    url = endpoint(base, workspace)
    session = initialize(url)  # 2025-11-25
    headers = {"mcp-session-id": session}
    assert http(url, body=rpc(2, "ping"), headers=headers).status == 200
    for version in ("2025-11-25", "2025-06-18", "2025-03-26"):
        ok = http(url, body=rpc(3, "ping"), headers={**headers, "mcp-protocol-version": version})
        assert ok.status == 200, (version, ok)
    for version, code in (("1999-01-01", -32022), ("garbage", -32022), ("2026-07-28", -32020)):
        versioned = {**headers, "mcp-protocol-version": version}
        bad = http(url, body=rpc(4, "ping"), headers=versioned)
        assert bad.status == 400, (version, bad)
        assert bad.json()["error"]["code"] == code, (version, bad.body)
        assert bad.json()["id"] == 4
        note = http(url, body={"jsonrpc": "2.0", "method": "notifications/initialized"},
                    headers=versioned)
        assert note.status == 400, (version, note)
        get = http(url, "GET", headers={**versioned, "accept": "text/event-stream"})
        assert get.status == 400, (version, get)
        assert http(url, "DELETE", headers=versioned).status == 400
    meta = {"io.modelcontextprotocol/protocolVersion": "2026-07-28",
            "io.modelcontextprotocol/clientCapabilities": {}}
    modern = http(url, body=rpc(5, "tools/list", {"_meta": meta}),
                  headers={"mcp-protocol-version": "2025-11-25"})
    assert modern.status == 400, modern
    assert modern.json()["error"]["code"] == -32020
    assert http(url, "DELETE", headers={**headers, "mcp-protocol-version": "2025-11-25"}
                ).status == 204


@pytest.fixture(scope="module")
def sdk_server() -> Iterator[str]:
    """The official SDK's Streamable HTTP server: the oracle beside the module's daemon."""
    with sdk_oracle() as url:
        yield url


def test_http_initialize_with_an_unknown_protocol_version_is_400(
    http_daemon, workspace: Path, sdk_server: str
) -> None:
    """An ``initialize`` whose MCP-Protocol-Version names a version toolsetd does not know
    is 400 with -32022 and opens no session, as every other request with it is: the
    transport has a server answer an unsupported version 400, and the SDK's server (asked
    the same here) does. It was served, and opened a session. A known version is still
    served whatever the body negotiates, and the header sent twice is 400 -32020."""
    _, base = http_daemon
    url = endpoint(base, workspace)
    for server in (url, sdk_server):
        reply = http(server, body=rpc(1, "initialize", INIT_PARAMS),
                     headers={"mcp-protocol-version": "1999-01-01"})
        assert reply.status == 400, (server, reply)
        assert "mcp-session-id" not in reply.headers, (server, reply.headers)
        assert reply.json()["id"] == 1, (server, reply.body)
    refused = http(url, body=rpc(1, "initialize", INIT_PARAMS),
                   headers={"mcp-protocol-version": "garbage"}).json()
    assert refused["error"]["code"] == -32022, refused
    assert refused["error"]["data"]["requested"] == "garbage"
    for version in ("2025-06-18", "2025-03-26"):
        served = http(url, body=rpc(1, "initialize", INIT_PARAMS),
                      headers={"mcp-protocol-version": version})
        assert served.status == 200 and "mcp-session-id" in served.headers, (version, served)
        assert served.json()["result"]["protocolVersion"] == INIT_PARAMS["protocolVersion"]
    body = json.dumps(rpc(1, "initialize", INIT_PARAMS)).encode()
    twice = _post_raw(base, url, ["Content-Type: application/json",
                                  "Accept: application/json, text/event-stream",
                                  "MCP-Protocol-Version: 2025-11-25",
                                  "MCP-Protocol-Version: 1999-01-01"], body)
    assert twice.status == 400 and "mcp-session-id" not in twice.headers, twice
    assert twice.json()["error"]["code"] == -32020


def test_http_delete_answers_as_the_sdk_server(
    http_daemon, workspace: Path, sdk_server: str
) -> None:
    """DELETE without a session id is 400, of an unknown or already ended session 404, and
    an ended session's next request 404, from the daemon as from the SDK's server (asked the
    same here); ending one is 2xx from both (204 here, the SDK's 200 with an empty body),
    and a second DELETE of it is 404."""
    _, base = http_daemon
    for server in (endpoint(base, workspace), sdk_server):
        reply = http(server, body=rpc(1, "initialize", INIT_PARAMS))
        assert reply.status == 200, (server, reply)
        session = {"mcp-session-id": reply.headers["mcp-session-id"]}
        assert http(server, "DELETE").status == 400, server
        assert http(server, "DELETE", headers={"mcp-session-id": "nope"}).status == 404, server
        ended = http(server, "DELETE", headers=session)
        assert ended.status in (200, 204), (server, ended)
        assert ended.body == b"", (server, ended)
        assert http(server, "DELETE", headers=session).status == 404, server
        assert http(server, body=rpc(2, "tools/list"), headers=session).status == 404, server


def test_http_post_rejects_bad_bodies(http_daemon, workspace: Path) -> None:
    """Not JSON, a batch, the wrong content type: 4xx with a JSON-RPC error saying why."""
    _, base = http_daemon
    url = endpoint(base, workspace)
    reply = http(url, body=b"{nope")
    assert reply.status == 400
    assert reply.json()["error"]["code"] == -32700
    reply = http(url, body=[rpc(1, "ping")])
    assert reply.status == 400
    assert "batches" in reply.json()["error"]["message"]
    reply = http(url, body=b"{}", headers={"content-type": "text/plain"})
    assert reply.status == 415
    assert http(url, "PUT", body=b"").status == 405
    assert http(base.replace("/mcp", "/other"), "GET").status == 404


def test_http_a_message_neither_notification_nor_response_is_400(
    http_daemon, workspace: Path
) -> None:
    """A POST whose message is neither a request, a notification nor a response (no
    method and no result, a 'jsonrpc' other than "2.0") is 400 with the core's -32600, as
    the transport requires of input the server does not accept; it was 202, as if taken."""
    _, base = http_daemon
    url = endpoint(base, workspace)
    session = initialize(url)
    for body in ({"foo": 1}, {"jsonrpc": "2.0", "id": 7},
                 {"jsonrpc": "1.0", "method": "notifications/initialized"}):
        reply = http(url, body=body, headers={"mcp-session-id": session})
        assert reply.status == 400, (body, reply)
        assert reply.json()["error"]["code"] == -32600, (body, reply.body)
    # A request that is no JSON-RPC 2.0 request ('jsonrpc' missing or not "2.0", an id
    # that is neither a string nor an integer) is input not taken too, in a session or
    # not, an initialize included: 400 with the core's -32600 (it was 200).
    malformed = ({"jsonrpc": "1.0", "id": 1, "method": "ping"}, {"id": 2, "method": "ping"},
                 {"jsonrpc": "2.0", "id": None, "method": "ping"},
                 {"jsonrpc": "2.0", "id": 1.5, "method": "tools/list"},
                 {"jsonrpc": "2.0", "id": True, "method": "ping"})
    for headers in ({"mcp-session-id": session}, {}):
        for body in malformed:
            reply = http(url, body=body, headers=headers)
            assert reply.status == 400, (headers, body, reply)
            assert reply.json()["error"]["code"] == -32600, (body, reply.body)
    for bad_id in (None, 1.5):
        reply = http(url, body={**rpc(1, "initialize", INIT_PARAMS), "id": bad_id})
        assert reply.status == 400, reply
        assert "mcp-session-id" not in reply.headers
    # A notification and a response (to no request of ours) are still taken: 202.
    for body in ({"jsonrpc": "2.0", "method": "notifications/initialized"},
                 {"jsonrpc": "2.0", "id": 99, "result": {}}):
        reply = http(url, body=body, headers={"mcp-session-id": session})
        assert (reply.status, reply.body) == (202, b""), (body, reply)


def test_http_head_is_answered_without_a_body(http_daemon, workspace: Path) -> None:
    """HEAD is 405 on /mcp and 404 elsewhere, head only, and the connection goes on."""
    daemon, base = http_daemon
    target = urlsplit(endpoint(base, workspace))
    path = f"{target.path}?{target.query}"
    failed = sum(e.get("event") == "http_connection_failed" for e in daemon.log_events())
    conn = HTTPConnection(target.hostname, target.port, timeout=10)
    try:
        for where, status in ((path, 405), ("/nope", 404)):
            conn.request("HEAD", where)
            reply = conn.getresponse()
            assert (reply.status, reply.read()) == (status, b"")
        assert reply.getheader("content-type") == "application/json"
        conn.request("POST", path, body=json.dumps(rpc(1, "initialize", INIT_PARAMS)),
                     headers={"content-type": "application/json",
                              "accept": "application/json, text/event-stream"})
        assert conn.getresponse().status == 200
    finally:
        conn.close()
    # A malformed request right after a HEAD, on the same connection, still gets its 400
    # with a body: the HEAD's no-body rule ends with the HEAD.
    head = b"HEAD /nope HTTP/1.1\r\nHost: %s:%d\r\n\r\n" % (
        str(target.hostname).encode(), target.port or 80)
    with socket.create_connection((target.hostname, target.port), timeout=10) as raw:
        raw.sendall(head + b"THIS IS NOT HTTP\r\n\r\n")
        answer = b""
        while chunk := raw.recv(65536):
            answer += chunk
    assert answer.startswith(b"HTTP/1.1 404"), answer
    assert b"HTTP/1.1 400" in answer, answer
    assert answer.rstrip().endswith(b"}"), answer  # the 400's JSON body
    assert sum(e.get("event") == "http_connection_failed" for e in daemon.log_events()) == failed


def test_http_get_stream_needs_session_and_is_single(http_daemon, workspace: Path) -> None:
    """GET needs a known session and text/event-stream; a second stream is 409."""
    _, base = http_daemon
    url = endpoint(base, workspace)
    assert http(url, "GET", headers={"accept": "text/event-stream"}).status == 400
    assert http(url, "GET", headers={"accept": "text/event-stream",
                                     "mcp-session-id": "nope"}).status == 404
    session = initialize(url)
    assert http(url, "GET", headers={"accept": "application/json",
                                     "mcp-session-id": session}).status == 406
    with httpx.Client(timeout=10) as client, client.stream(
        "GET", url, headers={"accept": "text/event-stream", "mcp-session-id": session}
    ) as first:
        assert first.status_code == 200
        assert first.headers["content-type"] == "text/event-stream"
        second = http(url, "GET", headers={"accept": "text/event-stream",
                                           "mcp-session-id": session})
        assert second.status == 409


def _get_status(base: str, url: str, session: str, accept: list[str]) -> int:
    """The status of a GET of the session's stream, with these Accept lines (the stream,
    when it opens, is closed at once)."""
    target = urlsplit(url)
    head = (f"GET {target.path}?{target.query} HTTP/1.1\r\nHost: {target.netloc}\r\n"
            f"Mcp-Session-Id: {session}\r\n" + "".join(f"Accept: {a}\r\n" for a in accept))
    with socket.create_connection(_address(base), timeout=20) as sock:
        sock.sendall(head.encode() + b"\r\n")
        data = b""
        while b"\r\n" not in data and (chunk := sock.recv(4096)):
            data += chunk
    return int(data.split(b" ", 2)[1])


@pytest.mark.parametrize(
    ("accept", "status"),
    [
        (["text/*"], 200),
        (["application/json", "text/event-stream"], 200),
        (["TEXT/Event-Stream; q=0.5"], 200),
        (["text/event-stream;q=0"], 406),
        (["text/event-stream, */*;q=0"], 200),
        (["*/*, text/event-stream;q=0"], 406),
        (["text/event-streams"], 406),
        (["application/text/event-stream"], 406),
        ([], 200),
        ([""], 406),
    ],
)
def test_http_get_accept_is_read_as_media_ranges(
    http_daemon, workspace: Path, accept: list[str], status: int
) -> None:
    """GET's Accept is a list of media ranges (RFC 9110 12.5.1), in any number of lines:
    ``text/*`` names the stream (the SDKs' servers take it), a range with ``q=0`` refuses
    it, the most specific range decides, and a longer type that merely contains
    ``text/event-stream`` is another type. No Accept at all takes any type (12.5.1); an
    empty one takes none."""
    _, base = http_daemon
    url = endpoint(base, workspace)
    session = initialize(url)
    assert _get_status(base, url, session, accept) == status


def _post_raw(base: str, url: str, headers: list[str], body: bytes) -> HttpReply:
    """A POST of ``body`` with exactly these header lines (beside Host and the framing),
    read whole on a connection it closes."""
    target = urlsplit(url)
    head = (f"POST {target.path}?{target.query} HTTP/1.1\r\nHost: {target.netloc}\r\n"
            + "".join(f"{line}\r\n" for line in headers)
            + f"Connection: close\r\nContent-Length: {len(body)}\r\n\r\n")
    return _raw_reply(base, head.encode() + body)


def _raw_reply(base: str, request: bytes) -> HttpReply:
    """The whole answer to raw request bytes (the daemon closes the connection)."""
    with socket.create_connection(_address(base), timeout=20) as sock:
        sock.sendall(request)
        data = b""
        with contextlib.suppress(ConnectionResetError):
            while chunk := sock.recv(65536):
                data += chunk
    first, _, rest = data.partition(b"\r\n")
    fields, _, content = rest.partition(b"\r\n\r\n")
    found = dict(line.decode().split(": ", 1) for line in fields.split(b"\r\n"))
    return HttpReply(int(first.split(b" ", 2)[1]),
                     {k.lower(): v for k, v in found.items()}, content)


@pytest.mark.parametrize(
    ("accept", "status"),
    [
        ([], 200),
        ([""], 406),
        (["application/json"], 406),
        (["text/event-stream"], 406),
        (["application/json, text/event-stream;q=0"], 406),
        (["application/json;q=0, text/event-stream"], 406),
        (["application/json", "text/event-stream"], 200),
        (["application/*, text/*"], 200),
        (["*/*"], 200),
    ],
)
def test_http_post_accept_must_admit_json_and_the_stream(
    http_daemon, workspace: Path, accept: list[str], status: int
) -> None:
    """A request's POST is answered with JSON or an event stream, so the transport has the
    client list both in ``Accept``. One that refuses either (an empty Accept, JSON alone,
    or a ``q=0``) is 406 with a JSON-RPC error, as the SDK's server answers it, and
    nothing is served: it was served, and a call that ran long (or asked for approval)
    answered it with the event stream it had refused. No Accept at all is served: HTTP
    has its absence mean any type (RFC 9110 12.5.1), and it was 406, "not acceptable",
    to a client that had refused nothing (a script on urllib, which sends none)."""
    _, base = http_daemon
    url = endpoint(base, workspace)
    body = json.dumps(rpc(1, "initialize", INIT_PARAMS)).encode()
    reply = _post_raw(base, url, ["Content-Type: application/json",
                                  *(f"Accept: {a}" for a in accept)], body)
    assert reply.status == status, reply
    if status == 406:
        assert "mcp-session-id" not in reply.headers
        assert reply.headers["content-type"] == "application/json"
        assert reply.json() == {"jsonrpc": "2.0", "id": None, "error": {
            "code": -32600, "message": reply.json()["error"]["message"]}}
        assert "Accept: application/json, text/event-stream" in reply.json()["error"]["message"]
    else:
        assert reply.json()["result"]["protocolVersion"] == INIT_PARAMS["protocolVersion"]


# -- the guards --------------------------------------------------------------------------------


def test_http_dns_rebinding_host_and_origin(http_daemon, workspace: Path) -> None:
    """A foreign Host is 421 and a foreign Origin 403; loopback names are served."""
    _, base = http_daemon
    url = endpoint(base, workspace)
    port = base.split(":")[2].split("/")[0]
    body = rpc(1, "initialize", INIT_PARAMS)
    assert http(url, body=body, headers={"host": "evil.example.com"}).status == 421
    assert http(url, body=body, headers={"host": f"evil.example.com:{port}"}).status == 421
    assert http(url, body=body, headers={"host": "localhost:1"}).status == 421
    refused = http(url, body=body, headers={"origin": "http://evil.example.com"})
    assert refused.status == 403
    assert "DNS rebinding" in refused.json()["error"]["message"]
    for host in (f"localhost:{port}", f"127.0.0.1:{port}", "localhost"):
        ok = http(url, body=body, headers={"host": host, "origin": f"http://{host}"})
        assert ok.status == 200, (host, ok)


def test_http_every_origin_sent_is_judged(http_daemon, workspace: Path) -> None:
    """An Origin sent twice is judged in each: a foreign one is 403 whether it comes
    first or second (only the first was judged, so a loopback Origin in front of a
    foreign one was served); two loopback ones are served."""
    _, base = http_daemon
    target = urlsplit(endpoint(base, workspace))
    body = json.dumps(rpc(1, "initialize", INIT_PARAMS)).encode()

    def status(*origins: str) -> bytes:
        with socket.create_connection(_address(base), timeout=20) as sock:
            head = (
                f"POST {target.path}?{target.query} HTTP/1.1\r\n"
                f"Host: {target.netloc}\r\nContent-Type: application/json\r\nAccept: application/json, text/event-stream\r\n"
                + "".join(f"Origin: {origin}\r\n" for origin in origins)
                + f"Connection: close\r\nContent-Length: {len(body)}\r\n\r\n"
            )
            sock.sendall(head.encode() + body)
            data = b""
            while chunk := sock.recv(65536):
                data += chunk
        return data.split(b" ")[1]

    local = f"http://{target.netloc}"
    assert status(local, "http://evil.example.com") == b"403"
    assert status("http://evil.example.com", local) == b"403"
    assert status(local, "null") == b"403"
    assert status(local, "http://localhost") == b"200"
    # An Origin whose authority cannot be read (an IPv6 literal never closed): urlsplit
    # raised, and the request was a traceback in the log and a connection closed
    # unanswered.
    assert status("http://[::1") == b"403"
    assert status(local, "http://[::1") == b"403"


def test_http_a_session_id_sent_twice_is_400(http_daemon, workspace: Path) -> None:
    """Mcp-Session-Id names one session: sent twice (two sessions, or one twice) it is
    400 on POST, GET and DELETE, as MCP-Protocol-Version twice is, and neither session
    is touched (the first was served, and a DELETE ended it, while an intermediary that
    reads the last one saw a request of the other session)."""
    _, base = http_daemon
    url = endpoint(base, workspace)
    target = urlsplit(url)
    first, second = initialize(url), initialize(url)
    body = json.dumps(rpc(2, "ping")).encode()

    def status(method: str, *sessions: str) -> bytes:
        with socket.create_connection(_address(base), timeout=20) as sock:
            head = (
                f"{method} {target.path}?{target.query} HTTP/1.1\r\n"
                f"Host: {target.netloc}\r\nContent-Type: application/json\r\n"
                "Accept: application/json, text/event-stream\r\n"
                + "".join(f"Mcp-Session-Id: {session}\r\n" for session in sessions)
                + f"Connection: close\r\nContent-Length: {len(body)}\r\n\r\n"
            )
            sock.sendall(head.encode() + body)
            data = b""
            while chunk := sock.recv(65536):
                data += chunk
        return data.split(b" ")[1]

    for method in ("POST", "GET", "DELETE"):
        assert status(method, first, second) == b"400", method
        assert status(method, first, first) == b"400", method
    for session in (first, second):
        assert http(url, body=rpc(3, "ping"), headers={"mcp-session-id": session}).status == 200


def test_http_absolute_form_target_is_judged_by_its_authority(
    http_daemon, workspace: Path
) -> None:
    """``POST http://evil.example.com/mcp`` names its host in the target, which RFC 9112
    has the server take instead of ``Host``: a foreign one is 421 whatever ``Host`` says
    (it used to be served on a loopback ``Host``); a loopback one is served. A target of
    another scheme than http or https names no resource of this server (as /metrics has
    it): ``POST ftp://127.0.0.1:PORT/mcp`` was served as the endpoint, 404 now."""
    _, base = http_daemon
    target = urlsplit(endpoint(base, workspace))
    body = json.dumps(rpc(1, "initialize", INIT_PARAMS)).encode()

    def status(authority: str, scheme: str = "http") -> bytes:
        with socket.create_connection(_address(base), timeout=20) as sock:
            sock.sendall(
                f"POST {scheme}://{authority}{target.path}?{target.query} HTTP/1.1\r\n"
                f"Host: {target.netloc}\r\nContent-Type: application/json\r\nAccept: application/json, text/event-stream\r\n"
                f"Connection: close\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body
            )
            data = b""
            while chunk := sock.recv(65536):
                data += chunk
        return data.split(b" ")[1]

    assert status("evil.example.com") == b"421"
    assert status(f"evil.example.com:{target.port}") == b"421"
    assert status(target.netloc) == b"200"
    assert status(target.netloc, "HTTPS") == b"200"
    assert status(target.netloc, "ftp") == b"404"
    assert status(target.netloc, "ws") == b"404"
    # An authority that cannot be read (an IPv6 literal never closed): urlsplit raised,
    # and the request was a traceback in the log and a connection closed unanswered.
    assert status("[::1") == b"404"


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to connect as another user")
@pytest.mark.skipif(not os.access(SYSTEM_PY, os.X_OK), reason=f"no {SYSTEM_PY} for the other user")
def test_http_a_flood_of_foreign_origins_is_logged_once_a_minute(
    tmp_base: Path, workspace: Path
) -> None:
    """Any web page the operator's browser opens can POST to the loopback endpoint with its
    own Origin, as often as it likes: each 403 was a warning line of its own (3,000 in
    0.6 s on one keep-alive connection), enough to push the daemon's other lines past
    journald's rate limit. mcp_http_refused is said once a minute per status now, with
    ``refused`` counting the refusals since the last line."""
    home = tmp_base / "home"
    (home / "tools").mkdir(parents=True, exist_ok=True)
    daemon, base = start_http_daemon(home, workspace, tmp_base)
    try:
        target = urlsplit(endpoint(base, workspace))
        body = json.dumps(rpc(1, "initialize", INIT_PARAMS)).encode()
        count = 500

        def flood(host: str, origin: str) -> None:
            head = (
                f"POST {target.path}?{target.query} HTTP/1.1\r\nHost: {host}\r\n"
                f"Content-Type: application/json\r\nAccept: application/json, text/event-stream\r\n"
                f"Origin: {origin}\r\nContent-Length: {len(body)}\r\n\r\n"
            ).encode() + body
            with socket.create_connection(_address(base), timeout=30) as sock:
                sock.sendall(head * count)
                answers = b""
                while answers.count(b"HTTP/1.1 ") < count:
                    chunk = sock.recv(1 << 20)
                    assert chunk, answers[-300:]
                    answers += chunk
            assert answers.count(b"HTTP/1.1 403 ") + answers.count(b"HTTP/1.1 421 ") == count

        flood(target.netloc, "http://evil.example.com")  # 403
        flood("evil.example.com", f"http://{target.netloc}")  # 421
        refused = [e for e in daemon.log_events() if e["event"] == "mcp_http_refused"]
        assert [(e["status"], e["refused"]) for e in refused] == [(403, 1), (421, 1)]
        assert all(e["level"] == "warning" for e in refused)
    finally:
        daemon.stop()


def test_http_every_error_status_carries_a_json_rpc_error(http_daemon, workspace: Path) -> None:
    """Every error status of the endpoint, its own (404, 405, GET's and DELETE's 400, 404,
    406 and 409, the guards' 421 and 403) and HTTP's (413, 431, 501), carries a JSON-RPC
    error with no id, as the SDK's server's do and MCP's clients read: they were
    ``{"error": "..."}``, which the SDK's client reports as "Server returned an error
    response" (or, for a 404, "Session terminated"), not why. An oversized body or head
    is -32007 with the limit, as the socket answers a line over its limit."""
    _, base = http_daemon
    url = endpoint(base, workspace)
    session = initialize(url)
    stream = {"accept": "text/event-stream"}
    target = urlsplit(url)
    host, port = _address(base)
    replies = {
        "path": http(base.replace("/mcp", "/other"), body=rpc(1, "ping")),
        "method": http(url, "PUT", body=b""),
        "get without session": http(url, "GET", headers=stream),
        "get unknown session": http(url, "GET", headers={**stream, "mcp-session-id": "nope"}),
        "get json": http(url, "GET", headers={"accept": "application/json",
                                              "mcp-session-id": session}),
        "delete without session": http(url, "DELETE"),
        "host": http(url, body=rpc(1, "ping"), headers={"host": "evil.example.com"}),
        "origin": http(url, body=rpc(1, "ping"), headers={"origin": "http://evil.example.com"}),
        "body too large": _raw_reply(base, _post_head(base, workspace, 17 * 1024 * 1024)),
        "head too large": _raw_reply(
            base, f"GET {target.path}?{target.query}&x={'a' * 17000} HTTP/1.1\r\n"
                  f"Host: {host}:{port}\r\n\r\n".encode()),
        "transfer coding": _raw_reply(
            base, _post_head(base, workspace, 0).replace(
                b"Content-Length: 0", b"Transfer-Encoding: gzip") + b"3\r\nabc\r\n0\r\n\r\n"),
    }
    assert http(url, "DELETE", headers={"mcp-session-id": session}).status == 204
    replies["delete ended session"] = http(url, "DELETE", headers={"mcp-session-id": session})
    second = initialize(url)
    with httpx.Client(timeout=10) as client, client.stream(
        "GET", url, headers={**stream, "mcp-session-id": second}
    ) as first:
        assert first.status_code == 200
        replies["second stream"] = http(url, "GET", headers={**stream,
                                                             "mcp-session-id": second})
    statuses = {name: reply.status for name, reply in replies.items()}
    assert statuses == {
        "path": 404, "method": 405, "get without session": 400, "get unknown session": 404,
        "get json": 406, "delete without session": 400, "host": 421, "origin": 403,
        "body too large": 413, "head too large": 431, "transfer coding": 501,
        "delete ended session": 404, "second stream": 409,
    }, statuses
    for name, reply in replies.items():
        assert reply.headers["content-type"] == "application/json", (name, reply)
        body = reply.json()
        assert (body["jsonrpc"], body["id"]) == ("2.0", None), (name, body)
        assert isinstance(body["error"]["message"], str), (name, body)
        code = -32007 if name.endswith("too large") else -32600
        assert body["error"]["code"] == code, (name, body)
    assert replies["body too large"].json()["error"]["data"] == {"limit": 16 * 1024 * 1024}
    assert replies["method"].headers["allow"] == "GET, POST, DELETE"


def test_sdk_client_reads_why_a_body_is_too_large(
    home: Path, workspace: Path, tmp_base: Path
) -> None:
    """The SDK's client surfaces a 413's JSON-RPC error, so a host shows why its call was
    refused (the body over the message size limit); the body was ``{"error": "..."}`` and
    the client said only "Server returned an error response"."""
    daemon, base = start_http_daemon(home, workspace, tmp_base,
                                     ["--max-message-bytes", "100000"])
    try:
        async def main() -> BaseException | None:
            with anyio.fail_after(60):
                async with _sdk(endpoint(base, workspace)) as client:
                    try:
                        await client.call_tool("progress3", {"text": "x" * 200_000})
                    except Exception as exc:  # what the client raises
                        return exc
            return None

        raised = anyio.run(main)
    finally:
        assert daemon.stop() == 0
    assert raised is not None
    assert "Request body too large: at most 100000 bytes" in str(raised), repr(raised)


def test_http_a_flood_of_bad_requests_is_logged_once_a_second(
    tmp_base: Path, workspace: Path
) -> None:
    """A web page can make the browser send requests the server refuses before any handler
    (a target of 70,000 characters is 431) on new connections as fast as it goes: each was
    an http_bad_request line of its own, over a thousand a second. It is said once a second
    per status now, with ``refused`` counting the refusals since the last line."""
    home = tmp_base / "home"
    (home / "tools").mkdir(parents=True, exist_ok=True)
    daemon, base = start_http_daemon(home, workspace, tmp_base)
    try:
        head = b"GET /mcp?x=" + b"a" * 70_000 + b" HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"
        began = time.monotonic()
        for _ in range(200):
            answer = _raw_reply(base, head)
            assert answer.status == 431, answer
        seconds = time.monotonic() - began
        bad = [e for e in daemon.log_events() if e["event"] == "http_bad_request"]
        assert 1 <= len(bad) <= seconds + 2, (len(bad), seconds)  # a line a second at most
        assert bad[0]["status"] == 431 and bad[0]["refused"] == 1
    finally:
        daemon.stop()


def test_http_other_user_is_refused_403(http_daemon, workspace: Path) -> None:
    """A client running as nobody is refused with 403 and a message naming its uid."""
    _, base = http_daemon
    code = (
        "import http.client, sys, json\n"
        "host, port = sys.argv[1], int(sys.argv[2])\n"
        "c = http.client.HTTPConnection(host, port, timeout=10)\n"
        "c.request('POST', sys.argv[3], body=b'{}', headers={'content-type': 'application/json'})\n"
        "r = c.getresponse()\n"
        "print(json.dumps({'status': r.status, 'body': r.read().decode()}))\n"
    )
    host_port = base.split("//")[1].split("/")[0]
    host, port = host_port.rsplit(":", 1)
    out = subprocess.run(
        [SYSTEM_PY, "-S", "-c", code, host, port, "/mcp?workspace=/"], user=65534, group=65534,
        extra_groups=[], capture_output=True, text=True, timeout=30, check=True, cwd="/",
    )
    reply = json.loads(out.stdout)
    assert reply["status"] == 403
    assert "uid 65534 may not call toolsetd" in reply["body"]


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to connect as another user")
@pytest.mark.skipif(not os.access(SYSTEM_PY, os.X_OK), reason=f"no {SYSTEM_PY} for the other user")
def test_http_refused_peers_cannot_fill_the_connection_slots(http_daemon, workspace: Path) -> None:
    """300 idle connections from another user are each answered 403 before they send a
    byte and hold none of the 256 slots: the owner's own request is still served, and the
    refusals are logged once, with their count, not once each."""
    daemon, base = http_daemon
    host, port = _address(base)
    code = (
        "import socket, sys\n"
        "socks = [socket.create_connection((sys.argv[1], int(sys.argv[2]))) for _ in range(300)]\n"
        "socks[0].settimeout(5)\n"
        "first = b''\n"
        "try:\n"
        "    while b'\\r\\n' not in first:\n"
        "        first += socks[0].recv(1024) or b'\\r\\n'\n"
        "except OSError as exc:\n"
        "    first = repr(exc).encode()\n"
        "print(first.split(b'\\r\\n')[0].decode(), flush=True)\n"
        "sys.stdin.read()\n"  # hold every connection until told
    )

    def refused_lines() -> list[dict[str, Any]]:
        return [e for e in daemon.log_events()
                if e.get("event") == "mcp_http_peer_refused" and e.get("uid") == 65534]

    before = len(refused_lines())
    with subprocess.Popen(
        [SYSTEM_PY, "-S", "-c", code, host, str(port)], user=65534, group=65534,
        extra_groups=[], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd="/",
    ) as holder:
        assert holder.stdin is not None
        assert holder.stdout is not None
        try:
            # Read while the 300 are still open: the answer came without a request.
            assert holder.stdout.readline().startswith("HTTP/1.1 403 ")
            reply = http(endpoint(base, workspace), body=rpc(1, "initialize", INIT_PARAMS))
            assert reply.status == 200, reply
        finally:
            holder.stdin.close()
            holder.wait(30)
    assert len(refused_lines()) - before <= 1


def test_http_non_loopback_bind_refused(tmp_base: Path) -> None:
    """--mcp-listen on a non-loopback address is refused at start-up, saying why."""
    for value in ("0.0.0.0:0", "[::]:0", "192.0.2.1:8080", "example.com:80", "127.0.0.1:99999",
                  "::1:80"):
        with pytest.raises(ConfigError, match="--mcp-listen"):
            parse_args(["--home", str(tmp_base), "--mcp-listen", value])
    # The real command line says so too, with exit status 2.
    out = subprocess.run(
        [PY, "-m", "toolsetd.daemon", "--home", str(tmp_base), "--socket", str(tmp_base / "x.sock"),
         "--mcp-listen", "0.0.0.0:8765"], capture_output=True, text=True, timeout=60, check=False,
    )
    assert out.returncode == 2
    assert "not a loopback address" in out.stderr


def test_http_token_file_must_be_private(home: Path, workspace: Path, tmp_base: Path) -> None:
    """A token file others can read stops the start with the fix; a 0600 one is served."""
    token = tmp_base / "token"
    token.write_text("s3cret\n")
    token.chmod(0o644)
    out = subprocess.run(
        [PY, "-m", "toolsetd.daemon", "--home", str(home), "--socket", str(tmp_base / "t.sock"),
         "--mcp-listen", "127.0.0.1:0", "--mcp-token-file", str(token)],
        capture_output=True, text=True, timeout=30, check=False,
    )
    assert out.returncode == 1
    assert "chmod 600" in out.stderr
    token.chmod(0o600)
    daemon, base = start_http_daemon(home, workspace, tmp_base, ["--mcp-token-file", str(token)])
    try:
        # Our own uid is established, so no token is needed.
        assert http(endpoint(base, workspace), body=rpc(1, "initialize", INIT_PARAMS)).status == 200
    finally:
        shut_down(daemon)


def test_http_ipv6_and_ipv4_together(home: Path, workspace: Path, tmp_base: Path) -> None:
    """--mcp-listen is repeatable: 127.0.0.1 and [::1] both serve."""
    if not socket.has_ipv6:
        pytest.skip("no IPv6 on this machine")
    daemon = start_daemon(
        home, workspace, tmp_base, ["--mcp-listen", "127.0.0.1:0", "--mcp-listen", "[::1]:0"]
    )
    try:
        urls = listening_urls(daemon, 2)
        assert urls[0].startswith("http://127.0.0.1:")
        assert urls[1].startswith("http://[::1]:")
        for url in urls:
            reply = http(endpoint(url, workspace), body=rpc(1, "initialize", INIT_PARAMS))
            assert reply.status == 200
    finally:
        shut_down(daemon)


# -- streams and disconnects ------------------------------------------------------------------


def _sleeper_cancelled(daemon: Daemon, workspace: Path, after: str) -> None:
    """The sleeper tool (its pid and call id in the workspace) is killed, and its call is
    logged as finished ``cancelled``."""
    pid = int((workspace / "sleeper.pid").read_text())
    call_id = (workspace / "sleeper.call").read_text()
    eventually(lambda: not alive(pid), what=f"the sleeper killed after {after}")
    eventually(
        lambda: any(e.get("event") == "call_finished" and e.get("call_id") == call_id
                    and e.get("status") == "cancelled" for e in daemon.log_events()),
        what="call_finished cancelled",
    )


def _progress3_call(url: str, session: str) -> HttpReply:
    """``progress3`` called with a progressToken in ``session``: answered as SSE."""
    reply = http(url, body=rpc(7, "tools/call", {"name": "progress3", "arguments": {},
                                                 "_meta": {"progressToken": "p1"}}),
                 headers={"mcp-session-id": session})
    assert reply.headers["content-type"] == "text/event-stream"
    return reply


def test_http_progress_comes_as_sse_before_the_answer(http_daemon, workspace: Path) -> None:
    """A call with a progressToken answers as SSE: every progress line, then the result."""
    _, base = http_daemon
    url = endpoint(base, workspace)
    session = initialize(url)
    reply = _progress3_call(url, session)
    messages = reply.messages()
    progress = [m["params"] for m in messages if m.get("method") == "notifications/progress"]
    assert [p["progressToken"] for p in progress] == ["p1"] * len(progress)
    values = [p["progress"] for p in progress]
    assert values == sorted(set(values))
    assert {"0/100", "50/100", "100/100"} <= {p.get("message") for p in progress}
    assert messages[-1]["id"] == 7
    assert "counted" in messages[-1]["result"]["content"][0]["text"]


def test_http_dropped_sse_stream_cancels_the_call(http_daemon, workspace: Path) -> None:
    """A client closing its POST's SSE stream mid-call has the tool's process killed."""
    daemon, base = http_daemon
    url = endpoint(base, workspace)
    session = initialize(url)
    pid_file = workspace / "sleeper.pid"
    with httpx.Client(timeout=10) as client, client.stream(
        "POST", url, headers={"content-type": "application/json",
                              "accept": "application/json, text/event-stream",
                              "mcp-session-id": session},
        content=json.dumps(rpc(9, "tools/call", {"name": "sleeper", "arguments": {},
                                                 "_meta": {"progressToken": 9}})),
    ) as response:
        assert response.headers["content-type"] == "text/event-stream"
        for line in response.iter_lines():
            if line.startswith("data:"):
                break  # the first progress event: the tool runs
    eventually(lambda: pid_file.exists() and pid_file.read_text() != "", what="the sleeper's pid")
    _sleeper_cancelled(daemon, workspace, "the disconnect")
    # The session goes on.
    again = http(url, body=rpc(10, "tools/list"), headers={"mcp-session-id": session})
    assert again.status == 200


def _post_listen(sock: socket.socket, target: SplitResult, body: bytes) -> None:
    """Send a 2026-07-28 ``subscriptions/listen`` POST of ``body`` to ``target``, as bytes
    on a raw socket (the test reads the event stream itself)."""
    sock.sendall(
        f"POST {target.path}?{target.query} HTTP/1.1\r\n"
        f"Host: {target.netloc}\r\nContent-Type: application/json\r\n"
        "Accept: application/json, text/event-stream\r\n"
        "MCP-Protocol-Version: 2026-07-28\r\nMcp-Method: subscriptions/listen\r\n"
        f"Content-Length: {len(body)}\r\n\r\n".encode() + body
    )


def test_http_listen_whose_client_left_while_its_catalog_was_built_ends(
    http_daemon, tmp_path: Path
) -> None:
    """A client that leaves a ``subscriptions/listen`` while the workspace's catalog is
    still being built (its first use) has the listen end, and its connection closed; it
    used to find no wait to cancel then, sleep for good and hold the connection (one of
    the 256) until the daemon stopped."""
    _, base = http_daemon
    meta = {"io.modelcontextprotocol/protocolVersion": "2026-07-28",
        "io.modelcontextprotocol/clientCapabilities": {}}
    body = json.dumps(rpc(3, "subscriptions/listen", {
        "notifications": {"toolsListChanged": True}, "_meta": meta})).encode()
    for attempt in range(3):
        # Many project sets: the first use of the workspace takes a while to build.
        fresh = tmp_path / f"ws{attempt}"
        for k in range(200):
            write_set(fresh / ".crystal" / "tools", f"s{k}", _tool(f"t{k}.py"),
                      **{f"t{k}.py": "print(1)\n"})
        target = urlsplit(endpoint(base, fresh))
        with socket.create_connection((target.hostname, target.port), timeout=20) as sock:
            _post_listen(sock, target, body)
            seen = b""
            while b"acknowledged" not in seen:  # posted before the catalog is built
                chunk = sock.recv(65536)
                assert chunk, seen
                seen += chunk
            sock.shutdown(socket.SHUT_WR)  # the client leaves (and says so)
            try:
                while sock.recv(65536):
                    pass  # the daemon ends the listen and closes: EOF
            except TimeoutError:
                pytest.fail("the listen of a client that left went on; its connection held")


def _post_2026(sock: socket.socket, target: SplitResult, method: str, body: bytes,
               extra: str = "") -> None:
    """Send a 2026-07-28 POST of ``body`` to ``target`` as bytes on a raw socket."""
    sock.sendall(
        f"POST {target.path}?{target.query} HTTP/1.1\r\n"
        f"Host: {target.netloc}\r\nContent-Type: application/json\r\n"
        "Accept: application/json, text/event-stream\r\n"
        f"MCP-Protocol-Version: 2026-07-28\r\nMcp-Method: {method}\r\n{extra}"
        f"Content-Length: {len(body)}\r\n\r\n".encode() + body
    )


def _unread_by_peer(sock: socket.socket) -> int:
    """Bytes ``sock`` sent over TCP that the process at its other end has not read yet
    (that end's receive queue in ``/proc/net/tcp``; the peer is on this host)."""
    def hexed(address: tuple[str, int]) -> str:
        return f"{socket.inet_aton(address[0])[::-1].hex().upper()}:{address[1]:04X}"

    local, remote = hexed(sock.getpeername()), hexed(sock.getsockname())
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        if fields[1] == local and fields[2] == remote:
            return int(fields[4].split(":")[1], 16)
    raise AssertionError(f"no TCP socket {local} -> {remote}")


def test_http_a_2026_call_whose_client_left_while_its_catalog_was_built_holds_nothing(
    tmp_path: Path,
) -> None:
    """A 2026-07-28 ``tools/call`` whose client leaves while it waits for the workspace's
    catalog (built on its first use, here for another request) for the ``Mcp-Param-*``
    check ends its stateless exchange. The exchange's core listened to the workspace and
    was never closed, so the workspace counted as in use for as long as the daemon ran:
    never released when idle, its catalog kept, and every reload called a listener that
    nobody reads."""
    meta = {"io.modelcontextprotocol/protocolVersion": "2026-07-28",
            "io.modelcontextprotocol/clientCapabilities": {}}
    listing = json.dumps(rpc(1, "tools/list", {"_meta": meta})).encode()
    call = json.dumps(rpc(2, "tools/call", {"name": "t0", "arguments": {}, "_meta": meta}))
    with daemon_in("tsh-", None, ["--mcp-listen", "127.0.0.1:0",
                                  "--workspace-idle", "1"]) as daemon:
        base = listening_urls(daemon)[0]
        # The call must be read (it then waits in the check) and its client leave before
        # the build ends (the list is not answered yet): else the attempt proves nothing,
        # and is made again with a new workspace whose schemas are twice as large (a
        # faster machine builds them sooner).
        for attempt in range(4):
            fresh = tmp_path / f"ws{attempt}"
            for k in range(3):  # large schemas: the first use takes seconds to check them
                big = {"type": "object", "properties": {
                    f"p{k}_{i}": {"type": "string", "pattern": "^[a-z]+$"}
                    for i in range(1500 << attempt)}}
                write_set(fresh / ".crystal" / "tools", f"s{k}",
                          _tool(f"t{k}.py", schema=big), **{f"t{k}.py": "print(1)\n"})
            target = urlsplit(endpoint(base, fresh))
            with socket.create_connection((target.hostname, target.port), timeout=60) as first, \
                    socket.create_connection((target.hostname, target.port), timeout=60) as sock:
                _post_2026(first, target, "tools/list", listing)  # starts the build
                _post_2026(sock, target, "tools/call", call.encode(), "Mcp-Name: t0\r\n")
                eventually(lambda: _unread_by_peer(sock) == 0, timeout=60,
                           what="the call read by the daemon")
                built = bool(select.select([first], [], [], 0)[0])
                sock.shutdown(socket.SHUT_WR)  # the client leaves: its EOF ends the exchange
                with contextlib.suppress(OSError):
                    while sock.recv(65536):
                        pass
                assert b"200 OK" in first.recv(65536)
            if not built:
                break
        else:
            pytest.fail("every catalog was built before its call's client could leave")
        eventually(lambda: str(fresh) not in daemon.call("status")["result"]["workspaces"],
                   timeout=30, what="the workspace released (it is never, while pinned)")


#: Runs the daemon with SSE comment lines every 0.3 s (no option sets that interval).
_SHORT_PING = (
    "import sys\n"
    "from toolsetd.daemon import mcphttp\n"
    "mcphttp.McpHttpSettings.__init__.__defaults__ = (1024, 3600.0, 0.3, 60.0)\n"
    "from toolsetd.daemon.app import main\n"
    "sys.exit(main(sys.argv[1:]))\n"
)


def test_http_a_waiting_post_stream_is_kept_alive(
    home: Path, workspace: Path, tmp_base: Path
) -> None:
    """A POST's event stream that waits (a ``subscriptions/listen``; a call whose approval
    the operator has not answered) gets a comment line whenever it sent nothing for the
    ping interval, as the GET stream does: it sent nothing at all after its first event,
    and the SDKs' clients (a 5-minute read timeout) and proxies closed it, which cancels
    the request."""
    daemon = start_daemon(home, workspace, tmp_base, ["--mcp-listen", "127.0.0.1:0"],
                          launcher=[PY, "-c", _SHORT_PING])
    try:
        target = urlsplit(endpoint(listening_urls(daemon)[0], workspace))
        body = json.dumps(rpc(3, "subscriptions/listen", {
            "notifications": {"toolsListChanged": True},
            "_meta": {"io.modelcontextprotocol/protocolVersion": "2026-07-28",
                "io.modelcontextprotocol/clientCapabilities": {}}})).encode()
        with socket.create_connection((target.hostname, target.port), timeout=20) as sock:
            _post_listen(sock, target, body)
            seen = b""
            deadline = time.monotonic() + 10
            while seen.count(b": ping") < 2 and time.monotonic() < deadline:
                chunk = sock.recv(65536)
                assert chunk, seen
                seen += chunk
        assert b"acknowledged" in seen, seen
        assert seen.count(b": ping") >= 2, seen
        assert seen.index(b"acknowledged") < seen.index(b": ping"), seen
    finally:
        daemon.stop()


def test_http_a_long_call_without_a_progress_token_is_kept_alive(
    home: Path, workspace: Path, tmp_base: Path
) -> None:
    """A ``tools/call`` with no progress token whose tool runs past the ping interval gets
    its POST turned into an event stream with comment lines, then its result: it used to
    be one JSON body at the end, nothing before it, so the SDKs' clients (a 5-minute read
    timeout) and proxies cut a long call off (and so cancelled it) that ``toolsetctl mcp``
    runs to its end."""
    go = workspace / "slowcall-go"  # the call ends once the test has seen it kept alive
    slow = f"import os, time\nwhile not os.path.exists({str(go)!r}):\n    time.sleep(0.02)\n"
    write_set(home / "tools", "slowcall", _tool("slow.py"),
              **{"slow.py": script(slow + "print('slept')\n")})
    daemon = start_daemon(home, workspace, tmp_base, ["--mcp-listen", "127.0.0.1:0"],
                          launcher=[PY, "-c", _SHORT_PING])
    try:
        url = endpoint(listening_urls(daemon)[0], workspace)
        session = initialize(url)
        target = urlsplit(url)
        body = json.dumps(rpc(4, "tools/call", {"name": "slowcall", "arguments": {}})).encode()
        with socket.create_connection((target.hostname, target.port), timeout=20) as sock:
            sock.sendall(
                f"POST {target.path}?{target.query} HTTP/1.1\r\n"
                f"Host: {target.netloc}\r\nContent-Type: application/json\r\n"
                "Accept: application/json, text/event-stream\r\n"
                f"Mcp-Session-Id: {session}\r\n"
                f"Content-Length: {len(body)}\r\n\r\n".encode() + body
            )
            seen = b""
            for awaited in (b": ping", b"slept"):  # a ping, however long it takes; the end
                while awaited not in seen:
                    chunk = sock.recv(65536)
                    assert chunk, seen
                    seen += chunk
                go.touch()
        assert b"text/event-stream" in seen.split(b"\r\n\r\n", 1)[0], seen
        assert b": ping" in seen and seen.index(b": ping") < seen.index(b"slept"), seen
    finally:
        daemon.stop()


def test_a_graceful_stop_answers_every_listen(
    home: Path, workspace: Path, tmp_base: Path
) -> None:
    """At a graceful stop each ``subscriptions/listen`` gets its completion result, with
    its subscription id, before its stream closes (MCP's graceful closure), on the socket
    and over HTTP (whose stream then ends properly); they used to be cut off unanswered,
    which a host takes for an unexpected disconnect."""
    daemon = start_daemon(home, workspace, tmp_base, ["--mcp-listen", "127.0.0.1:0"])
    meta = {"io.modelcontextprotocol/protocolVersion": "2026-07-28",
        "io.modelcontextprotocol/clientCapabilities": {}}
    listen = {"notifications": {"toolsListChanged": True}, "_meta": meta}
    try:
        target = urlsplit(endpoint(listening_urls(daemon)[0], workspace))
        unix = socket.socket(socket.AF_UNIX)
        unix.settimeout(20)
        unix.connect(str(daemon.socket))
        bind = rpc("b", "mcp.bind", {"workspace": str(workspace)})
        unix.sendall((json.dumps(bind) + "\n" + json.dumps(rpc(7, "subscriptions/listen", listen))
                      + "\n").encode())
        body = json.dumps(rpc(8, "subscriptions/listen", listen)).encode()
        tcp = socket.create_connection((target.hostname, target.port), timeout=20)
        _post_listen(tcp, target, body)
        seen = {7: b"", 8: b""}
        for key, sock in ((7, unix), (8, tcp)):
            while b"acknowledged" not in seen[key]:
                chunk = sock.recv(65536)
                assert chunk, seen
                seen[key] += chunk
        daemon.proc.send_signal(signal.SIGTERM)
        for key, sock in ((7, unix), (8, tcp)):
            while chunk := sock.recv(65536):
                seen[key] += chunk
            sock.close()
        assert daemon.proc.wait(30) == 0
        lines = [json.loads(line) for line in seen[7].splitlines()]
        assert lines[-1]["id"] == 7, lines
        assert lines[-1]["result"]["resultType"] == "complete"
        assert lines[-1]["result"]["_meta"]["io.modelcontextprotocol/subscriptionId"] == 7
        http_body = seen[8].split(b"\r\n\r\n", 1)[1]
        assert http_body.endswith(b"\r\n0\r\n\r\n"), seen[8]  # the chunked stream ended
        events = [json.loads(line[6:]) for line in http_body.split(b"\n")
                  if line.startswith(b"data: ")]
        assert events[-1]["id"] == 8, events
        assert events[-1]["result"]["_meta"]["io.modelcontextprotocol/subscriptionId"] == 8
    finally:
        daemon.stop()


def test_a_cancel_read_right_behind_its_request_on_the_socket_cancels_it(
    home: Path, workspace: Path, tmp_base: Path
) -> None:
    """A request read on an MCP socket connection goes to a task, while a notification is
    served at once: a ``notifications/cancelled`` in the same read as its request was
    served before that task had begun, found nothing in flight, and was lost; the listen
    then went on, and a graceful stop answered it. A request is in flight from when it is
    read now: the cancelled listen gets no response, the next one its completion."""
    daemon = start_daemon(home, workspace, tmp_base, [])
    meta = {"io.modelcontextprotocol/protocolVersion": "2026-07-28",
        "io.modelcontextprotocol/clientCapabilities": {}}
    listen = {"notifications": {"toolsListChanged": True}, "_meta": meta}
    try:
        unix = socket.socket(socket.AF_UNIX)
        unix.settimeout(20)
        unix.connect(str(daemon.socket))
        unix.sendall((json.dumps(rpc("b", "mcp.bind", {"workspace": str(workspace)})) + "\n")
                     .encode())
        seen = b""
        while b'"bound"' not in seen:
            chunk = unix.recv(65536)
            assert chunk, seen
            seen += chunk
        cancel = {"jsonrpc": "2.0", "method": "notifications/cancelled",
                  "params": {"requestId": 7, "_meta": meta}}
        unix.sendall("".join(json.dumps(m) + "\n" for m in (
            rpc(7, "subscriptions/listen", listen), cancel,
            rpc(8, "subscriptions/listen", listen))).encode())

        def acknowledged_8() -> bool:
            return any(
                m.get("method") == "notifications/subscriptions/acknowledged"
                and "8" in json.dumps(m.get("params"))
                for m in (json.loads(line) for line in seen.splitlines())
            )

        while not acknowledged_8():
            chunk = unix.recv(65536)
            assert chunk, seen
            seen += chunk
        daemon.proc.send_signal(signal.SIGTERM)
        while chunk := unix.recv(65536):
            seen += chunk
        unix.close()
        assert daemon.proc.wait(30) == 0
        answered = [m["id"] for m in (json.loads(line) for line in seen.splitlines())
                    if "id" in m and "method" not in m]
        assert answered == ["b", 8], seen
    finally:
        daemon.stop()


def test_a_listen_on_a_core_built_while_stopping_is_answered(
    home: Path, workspace: Path, tmp_base: Path
) -> None:
    """A daemon no MCP host had used yet builds its MCP core at the first ``mcp.bind``: one
    sent during a graceful stop (a connection stays open while calls get their grace) built
    a core that did not know of the stop, and its ``subscriptions/listen`` waited unanswered
    until the connection was cut, which a host takes for an unexpected disconnect."""
    write_set(home / "tools", "sleeper", _tool("sleeper.py"), **{"sleeper.py": SLEEPER})
    daemon = start_daemon(home, workspace, tmp_base, ["--shutdown-grace", "3"])
    listen = {"notifications": {"toolsListChanged": True},
              "_meta": {"io.modelcontextprotocol/protocolVersion": "2026-07-28",
                  "io.modelcontextprotocol/clientCapabilities": {}}}
    try:
        with socket.socket(socket.AF_UNIX) as native, socket.socket(socket.AF_UNIX) as host:
            for sock in (native, host):
                sock.settimeout(20)
                sock.connect(str(daemon.socket))
            invoke = rpc(1, "invoke", {"workspace": str(workspace), "tool": "sleeper",
                                       "arguments": {}, "headless": True, "approved": True,
                                       "callId": "rm25-sleeper"})
            native.sendall((json.dumps(invoke) + "\n").encode())
            eventually(lambda: (workspace / "sleeper.pid").exists())
            daemon.proc.send_signal(signal.SIGTERM)
            eventually(lambda: any(e.get("event") == "stop_requested"
                                  for e in daemon.log_events()))
            bind = rpc("b", "mcp.bind", {"workspace": str(workspace)})
            host.sendall((json.dumps(bind) + "\n"
                          + json.dumps(rpc(7, "subscriptions/listen", listen)) + "\n").encode())
            seen = b""
            while chunk := host.recv(65536):
                seen += chunk
        assert daemon.proc.wait(30) == 0
        lines = [json.loads(line) for line in seen.splitlines()]
        assert lines[-1].get("id") == 7, lines  # not cut off after its acknowledgement
        assert lines[-1]["result"]["resultType"] == "complete", lines
    finally:
        daemon.stop()


def test_http_an_initialize_whose_client_left_opens_no_session(
    http_daemon, tmp_path: Path
) -> None:
    """A client that leaves before its initialize is answered (here while the workspace's
    catalog is built, on its first use) never learns the session's id: the session ends
    at once instead of holding one of the 1,024 for the idle hour (enough such clients,
    a host retrying a slow initialize, and every initialize was 503)."""
    daemon, base = http_daemon
    body = json.dumps(rpc(1, "initialize", INIT_PARAMS)).encode()
    before = len(daemon.log_events())
    for attempt in range(3):
        fresh = tmp_path / f"ws{attempt}"
        for k in range(200):
            write_set(fresh / ".crystal" / "tools", f"s{k}", _tool(f"t{k}.py"),
                      **{f"t{k}.py": "print(1)\n"})
        target = urlsplit(endpoint(base, fresh))
        with socket.create_connection(_address(base), timeout=20) as sock:
            sock.sendall(
                f"POST {target.path}?{target.query} HTTP/1.1\r\nHost: {target.netloc}\r\n"
                "Content-Type: application/json\r\nAccept: application/json, text/event-stream"
                f"\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body
            )
            sock.shutdown(socket.SHUT_WR)  # gone before the answer
            with contextlib.suppress(OSError):
                while sock.recv(65536):
                    pass

    def counts() -> tuple[int, int]:
        events = [e.get("event") for e in daemon.log_events()[before:]]
        return events.count("mcp_http_session_opened"), events.count("mcp_http_session_closed")

    eventually(lambda: counts()[0] == 3, what="three sessions opened")
    eventually(lambda: counts()[1] == 3, what="each ended with its client gone")


def test_http_a_client_that_pipelined_much_and_left_has_its_call_cancelled(
    http_daemon, workspace: Path
) -> None:
    """A client that pipelined more than the read buffer behind a call, then left: its
    EOF sits behind bytes the daemon does not read while the call runs. The call is
    cancelled all the same (the hang-up is looked for); it used to run to its end."""
    daemon, base = http_daemon
    url = endpoint(base, workspace)
    session = initialize(url)
    target = urlsplit(url)
    pid_file = workspace / "sleeper.pid"

    def post(body: bytes) -> bytes:
        return (f"POST {target.path}?{target.query} HTTP/1.1\r\nHost: {target.netloc}\r\n"
                f"Content-Type: application/json\r\nAccept: application/json, text/event-stream\r\nMcp-Session-Id: {session}\r\n"
                f"Content-Length: {len(body)}\r\n\r\n").encode() + body

    call = post(json.dumps(rpc(7, "tools/call", {"name": "sleeper", "arguments": {}})).encode())
    with socket.create_connection(_address(base), timeout=20) as sock:
        sock.sendall(call)
        eventually(lambda: pid_file.exists() and pid_file.read_text() != "",
                   what="the sleeper's pid")
        # More than the daemon's read buffer (256 KiB), so it stops reading; but by less than
        # the smallest window the daemon's socket offers (tcp_rmem's default of 128 KiB, half
        # of it a window): what it leaves unread must fit there, or the FIN waits behind it in
        # this socket and never reaches the daemon. 384 KiB failed so under load.
        sock.sendall(post(b"x" * (300 << 10)))
    _sleeper_cancelled(daemon, workspace, "the client left")


def test_http_delete_cancels_the_sessions_calls(http_daemon, workspace: Path) -> None:
    """DELETE ends the session and cancels the calls it has in flight."""
    _, base = http_daemon
    url = endpoint(base, workspace)
    session = initialize(url)
    pid_file = workspace / "sleeper.pid"
    replies: list[Any] = []
    caller = threading.Thread(target=lambda: replies.append(http(
        url, body=rpc(1, "tools/call", {"name": "sleeper", "arguments": {}}),
        headers={"mcp-session-id": session})))
    caller.start()
    eventually(lambda: pid_file.exists() and pid_file.read_text() != "", what="the sleeper's pid")
    pid = int(pid_file.read_text())
    assert http(url, "DELETE", headers={"mcp-session-id": session}).status == 204
    eventually(lambda: not alive(pid), what="the sleeper killed by DELETE")
    caller.join(20)
    assert replies
    # Cancelled: no response, but still an answer a request may get (not 202).
    assert replies[0].status == 200
    assert replies[0].headers["content-type"] == "text/event-stream"
    assert replies[0].messages() == []


#: Runs the daemon with sessions idle after half a second (no option sets that limit).
_SHORT_IDLE = (
    "import sys\n"
    "from toolsetd.daemon import mcphttp\n"
    "mcphttp.McpHttpSettings.__init__.__defaults__ = (1024, 0.5, 20.0, 60.0)\n"
    "from toolsetd.daemon.app import main\n"
    "sys.exit(main(sys.argv[1:]))\n"
)


def test_http_a_reused_in_flight_id_is_refused_and_the_session_does_not_expire(
    home: Path, workspace: Path, tmp_base: Path
) -> None:
    """A request whose id is in flight in its session is refused (-32600, the core's one
    rule), and leaves the first request counted: a session with a running call never
    expires under it (another session, idle for less long, expires; this one, and its
    call, go on)."""
    write_set(home / "tools", "sleeper", _tool("sleeper.py"), **{"sleeper.py": SLEEPER})
    daemon = start_daemon(home, workspace, tmp_base, ["--mcp-listen", "127.0.0.1:0"],
                          launcher=[PY, "-c", _SHORT_IDLE])
    try:
        url = endpoint(listening_urls(daemon)[0], workspace)
        headers = {"mcp-session-id": initialize(url)}
        pid_file = workspace / "sleeper.pid"
        call = rpc(5, "tools/call", {"name": "sleeper", "arguments": {}})
        replies: list[Any] = []
        caller = threading.Thread(
            target=lambda: replies.append(http(url, body=call, headers=headers, timeout=60)))
        caller.start()
        eventually(lambda: pid_file.exists() and pid_file.read_text() != "",
                   what="the sleeper's pid")
        pid = int(pid_file.read_text())
        again = http(url, body=call, headers=headers)
        assert again.status == 200, again
        assert again.json()["id"] == 5
        assert again.json()["error"]["code"] == -32600
        assert "already in flight" in again.json()["error"]["message"]
        # Another session, opened after this one was last used: once it has expired
        # as idle, so would this one have, but for its running call.
        initialize(url)
        eventually(lambda: any(e.get("event") == "mcp_http_session_expired"
                               for e in daemon.log_events()),
                   what="the other session expired")
        ping = http(url, body=rpc(6, "ping"), headers=headers)
        assert ping.status == 200, ping
        assert alive(pid), "the session's running call was ended"
        assert [e.get("event") for e in daemon.log_events()].count(
            "mcp_http_session_expired") == 1
        assert http(url, "DELETE", headers=headers).status == 204
        caller.join(20)
        eventually(lambda: not alive(pid), what="the sleeper killed by DELETE")
    finally:
        daemon.stop()


def test_http_an_idle_session_ends_without_another_initialize(
    home: Path, workspace: Path, tmp_base: Path
) -> None:
    """A session nobody uses is ended once idle for the limit, as docs/mcp-http.md says,
    though no other host opens one (the check ran only at an initialize, so an abandoned
    session, and the workspace it listens to, stayed for good)."""
    daemon = start_daemon(home, workspace, tmp_base, ["--mcp-listen", "127.0.0.1:0"],
                          launcher=[PY, "-c", _SHORT_IDLE])
    try:
        url = endpoint(listening_urls(daemon)[0], workspace)
        headers = {"mcp-session-id": initialize(url)}
        eventually(lambda: any(e.get("event") == "mcp_http_session_expired"
                               for e in daemon.log_events()),
                   what="the idle session expired")
        assert http(url, body=rpc(2, "ping"), headers=headers).status == 404
    finally:
        daemon.stop()


_THREE_SESSIONS = _SHORT_IDLE.replace("(1024, 0.5, 20.0, 60.0)", "(3, 3600.0, 20.0, 0.0)")
#: Three sessions, none of which a full table may end before it is an hour unused.
_THREE_RECENT = _SHORT_IDLE.replace("(1024, 0.5, 20.0, 60.0)", "(3, 3600.0, 20.0, 3600.0)")


def test_http_a_full_session_table_ends_its_least_recently_used_idle_session(
    home: Path, workspace: Path, tmp_base: Path
) -> None:
    """With the table full, an initialize ends the least recently used session that has no
    request served and no stream open (its next request is 404: the host starts anew);
    with none idle it is 503. Hosts that never DELETE (``claude mcp list``) filled the
    table within the idle hour, and every initialize after that was 503."""
    daemon = start_daemon(home, workspace, tmp_base, ["--mcp-listen", "127.0.0.1:0"],
                          launcher=[PY, "-c", _THREE_SESSIONS])
    try:
        url = endpoint(listening_urls(daemon)[0], workspace)

        def ping(session: str) -> int:
            return http(url, body=rpc(9, "ping"), headers={"mcp-session-id": session}).status

        first, second, third = initialize(url), initialize(url), initialize(url)
        assert ping(first) == 200  # the second is now the least recently used
        fourth = initialize(url)
        assert ping(second) == 404
        assert [ping(s) for s in (first, third, fourth)] == [200, 200, 200]
        with httpx.Client(timeout=10) as client, contextlib.ExitStack() as streams:
            for session in (first, third, fourth):
                stream = streams.enter_context(client.stream(
                    "GET", url, headers={"accept": "text/event-stream", "mcp-session-id": session}))
                assert stream.status_code == 200
            busy = http(url, body=rpc(1, "initialize", INIT_PARAMS))
            assert busy.status == 503, busy
            assert busy.json()["error"]["data"] == {"limit": 3}
        events = [e.get("event") for e in daemon.log_events()]
        assert events.count("mcp_http_session_evicted") == 1
    finally:
        daemon.stop()


def test_http_a_full_table_ends_no_session_used_lately(
    home: Path, workspace: Path, tmp_base: Path
) -> None:
    """A full table ends only a session unused for a while (a minute; an hour here): a
    host whose request is still on its way (its body uploading, not yet counted as served)
    is not answered 404, and a flood of initialize cannot end the sessions of hosts at
    work. With none that old, the initialize is 503 and every session stays."""
    daemon = start_daemon(home, workspace, tmp_base, ["--mcp-listen", "127.0.0.1:0"],
                          launcher=[PY, "-c", _THREE_RECENT])
    try:
        url = endpoint(listening_urls(daemon)[0], workspace)
        sessions = [initialize(url) for _ in range(3)]
        busy = http(url, body=rpc(1, "initialize", INIT_PARAMS))
        assert busy.status == 503, busy
        assert busy.json()["error"]["data"] == {"limit": 3}
        for session in sessions:
            ping = http(url, body=rpc(9, "ping"), headers={"mcp-session-id": session})
            assert ping.status == 200, ping
        assert "mcp_http_session_evicted" not in [e.get("event") for e in daemon.log_events()]
    finally:
        daemon.stop()


def test_http_a_refused_initialize_ends_no_session_of_a_full_table(
    home: Path, workspace: Path, tmp_base: Path
) -> None:
    """An initialize the endpoint refuses (an unknown query name, a workspace that is no
    folder) opens no session, so it makes no room either: with the table full, it ended
    the least recently used idle session first, and then was 400. Anyone who can reach
    the endpoint could end every idle host's session with requests that are refused."""
    daemon = start_daemon(home, workspace, tmp_base, ["--mcp-listen", "127.0.0.1:0"],
                          launcher=[PY, "-c", _THREE_SESSIONS])
    try:
        base = listening_urls(daemon)[0]
        url = endpoint(base, workspace)
        sessions = [initialize(url), initialize(url), initialize(url)]
        for bad in (endpoint(base, workspace, catalgo="plan"),
                    endpoint(base, workspace / "missing")):
            refused = http(bad, body=rpc(1, "initialize", INIT_PARAMS))
            assert refused.status == 400, refused
        pings = [http(url, body=rpc(9, "ping"), headers={"mcp-session-id": s}).status
                 for s in sessions]
        assert pings == [200, 200, 200]
        events = [e.get("event") for e in daemon.log_events()]
        assert events.count("mcp_http_session_evicted") == 0
        assert initialize(url)  # a good one still makes room
        events = [e.get("event") for e in daemon.log_events()]
        assert events.count("mcp_http_session_evicted") == 1
    finally:
        daemon.stop()


def test_http_a_cancelled_requests_post_ends_as_an_empty_stream(
    http_daemon, workspace: Path
) -> None:
    """notifications/cancelled from another POST: the call ends, and its own POST is
    answered 200 with an event stream that carries no response (202 is for notifications)."""
    _, base = http_daemon
    url = endpoint(base, workspace)
    headers = {"mcp-session-id": initialize(url)}
    pid_file = workspace / "sleeper.pid"
    replies: list[Any] = []
    caller = threading.Thread(target=lambda: replies.append(http(
        url, body=rpc("A", "tools/call", {"name": "sleeper", "arguments": {}}),
        headers=headers)))
    caller.start()
    eventually(lambda: pid_file.exists() and pid_file.read_text() != "", what="the sleeper's pid")
    pid = int(pid_file.read_text())
    cancel = http(url, body={"jsonrpc": "2.0", "method": "notifications/cancelled",
                             "params": {"requestId": "A"}}, headers=headers)
    assert (cancel.status, cancel.body) == (202, b"")
    caller.join(20)
    assert replies
    assert replies[0].status == 200, replies[0]
    assert replies[0].headers["content-type"] == "text/event-stream"
    assert replies[0].messages() == []
    eventually(lambda: not alive(pid), what="the sleeper killed by the cancel")


FLOOD = script(
    "import json, os\n"
    "open('flood.pid', 'w').write(str(os.getpid()))\n"
    "fd = int(os.environ['TOOLSETD_PROGRESS_FD'])\n"
    "for i in range(10 ** 7):\n"
    "    os.write(fd, (json.dumps({'message': 'm%d' % i + 'x' * 200}) + '\\n').encode())\n"
)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_http_a_client_that_does_not_read_is_dropped_by_the_write_timeout(
    http_daemon, workspace: Path
) -> None:
    """A client that never reads its POST's stream while the tool floods progress is
    dropped after the write timeout, logged as the daemon's decision
    (connection_write_timeout, as on the socket), and its call cancelled for that reason."""
    daemon, base = http_daemon
    write_set(workspace / ".crystal" / "tools", "flood", _tool("flood.py"), **{"flood.py": FLOOD})
    url = endpoint(base, workspace, mode="full")  # a project set: full runs it unasked
    session = initialize(url)
    body = json.dumps(rpc("f", "tools/call", {"name": "flood", "arguments": {},
                                              "_meta": {"progressToken": "t"}})).encode()
    target = urlsplit(url)
    sock = socket.socket()
    try:
        sock.connect(_address(base))
        sock.sendall(
            f"POST {target.path}?{target.query} HTTP/1.1\r\nHost: {target.netloc}\r\n"
            f"Content-Type: application/json\r\nAccept: application/json, text/event-stream\r\n"
            f"Mcp-Session-Id: {session}\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body
        )
        pid_file = workspace / "flood.pid"
        eventually(lambda: pid_file.exists() and pid_file.read_text() != "", what="the flood")
        eventually(
            lambda: any(e.get("event") == "connection_write_timeout" and "http_conn_id" in e
                        and e.get("seconds") == 30 for e in daemon.log_events()),
            timeout=60, what="connection_write_timeout",
        )
        eventually(
            lambda: any(e.get("event") == "call_finished" and e.get("tool") == "flood"
                        and e.get("status") == "cancelled" for e in daemon.log_events()),
            what="call_finished cancelled",
        )
        cancelled = [e for e in daemon.log_events() if e.get("event") == "mcp_request_cancelled"]
        assert any("write timeout" in e.get("reason", "") for e in cancelled), cancelled
    finally:
        sock.close()


def test_http_get_stream_carries_list_changed(http_daemon, workspace: Path) -> None:
    """After a reload that changes the catalog, the GET stream carries tools/list_changed."""
    daemon, base = http_daemon
    url = endpoint(base, workspace)
    session = initialize(url)
    # The home is the module daemon's: a set name no other run has added there.
    name = f"newset_{uuid.uuid4().hex[:10]}"
    with httpx.Client(timeout=20) as client, client.stream(
        "GET", url, headers={"accept": "text/event-stream", "mcp-session-id": session}
    ) as stream:
        write_set(daemon.home / "tools", name, _tool("asker.py"), **{"asker.py": ASKER})
        assert "result" in daemon.call("reload", {})
        for line in stream.iter_lines():
            if line.startswith("data:"):
                assert json.loads(line[5:])["method"] == "notifications/tools/list_changed"
                break


def test_http_streams_are_not_resumable(http_daemon, workspace: Path) -> None:
    """Resumption is not offered (docs/mcp-http.md): no SSE event carries an ``id``, so a
    host has no Last-Event-ID to send, and a GET that sends one anyway opens the session's
    stream afresh: nothing of a POST's stream is replayed on it, the next message is the
    next thing the session is told."""
    daemon, base = http_daemon
    url = endpoint(base, workspace)
    session = initialize(url)
    reply = _progress3_call(url, session)
    assert len(reply.messages()) >= 4  # progress, then the result
    fields = {line.split(":", 1)[0] for line in reply.body.decode().splitlines() if line}
    assert fields == {"event", "data"}, reply.body
    name = f"resumed_{uuid.uuid4().hex[:10]}"
    headers = {"accept": "text/event-stream", "mcp-session-id": session, "last-event-id": "0"}
    with httpx.Client(timeout=20) as client, client.stream("GET", url, headers=headers) as stream:
        assert stream.status_code == 200
        write_set(daemon.home / "tools", name, _tool("asker.py"), **{"asker.py": ASKER})
        assert "result" in daemon.call("reload", {})
        for line in stream.iter_lines():
            assert not line.startswith("id:"), line
            if line.startswith("data:"):
                assert json.loads(line[5:])["method"] == "notifications/tools/list_changed"
                break


def test_http_64_concurrent_sessions(http_daemon, workspace: Path) -> None:
    """64 sessions at once each initialize, list and call, and all are answered."""
    _, base = http_daemon
    url = endpoint(base, workspace)

    async def one(client: httpx.AsyncClient, n: int) -> str:
        reply = await client.post(url, json=rpc(1, "initialize", INIT_PARAMS))
        session = reply.headers["mcp-session-id"]
        headers = {"mcp-session-id": session}
        await client.post(url, json={"jsonrpc": "2.0", "method": "notifications/initialized"},
                          headers=headers)
        listed = await client.post(url, json=rpc(2, "tools/list"), headers=headers)
        assert listed.status_code == 200
        called = await client.post(
            url, json=rpc(3, "tools/call", {"name": "hello", "arguments": {"name": f"n{n}"}}),
            headers=headers,
        )
        assert (await client.delete(url, headers=headers)).status_code == 204
        return str(called.json()["result"]["content"][0]["text"])

    async def main() -> list[str]:
        results: list[str] = [""] * 64
        limits = httpx.Limits(max_connections=64, max_keepalive_connections=64)
        async with httpx.AsyncClient(timeout=60, limits=limits,
                                     headers={"accept": "application/json, text/event-stream"}
                                     ) as client:

            async def run(n: int) -> None:
                results[n] = await one(client, n)

            with anyio.fail_after(90):
                async with anyio.create_task_group() as tg:
                    for n in range(64):
                        tg.start_soon(run, n)
        return results

    results = anyio.run(main)
    assert all(f"n{n}" in text for n, text in enumerate(results))


def _address(base: str) -> tuple[str, int]:
    """The endpoint's host and port, for a raw socket."""
    host, port = base.split("//")[1].split("/")[0].rsplit(":", 1)
    return host, int(port)


def _post_head(base: str, workspace: Path, length: int) -> bytes:
    """A POST's head to the endpoint, declaring a JSON body of ``length`` bytes."""
    host, port = _address(base)
    return (
        f"POST /mcp?workspace={workspace} HTTP/1.1\r\nHost: {host}:{port}\r\n"
        f"Content-Type: application/json\r\nAccept: application/json, text/event-stream\r\nContent-Length: {length}\r\n\r\n"
    ).encode()


def test_http_malformed_requests_leave_the_daemon_serving(http_daemon, workspace: Path) -> None:
    """Bad chunking and a huge header are refused, and the next client is served."""
    daemon, base = http_daemon
    for raw in (
        b"POST /mcp HTTP/1.1\r\nHost: localhost\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
        b"GET /mcp HTTP/1.1\r\nHost: localhost\r\nX-Big: " + b"a" * 70000 + b"\r\n\r\n",
    ):
        with socket.create_connection(_address(base), timeout=10) as sock:
            sock.sendall(raw)
            data = b""
            try:
                while chunk := sock.recv(65536):
                    data += chunk
            except ConnectionResetError:
                pass
        assert data.split(b" ")[1] in (b"400", b"431"), data[:200]
    assert http(endpoint(base, workspace), body=rpc(1, "initialize", INIT_PARAMS)).status == 200
    assert daemon.proc.poll() is None


def test_http_a_head_over_16_kib_is_431_whatever_part_is_long(
    http_daemon, workspace: Path
) -> None:
    """The 16 KiB bound is the whole head's: a request line (its target's query) that
    takes the head past it is 431 as a long header is, even when the head arrives in
    one read (h11 bounds only a head still incomplete)."""
    _, base = http_daemon
    body = json.dumps(rpc(1, "initialize", INIT_PARAMS)).encode()
    head = _post_head(base, workspace, len(body))
    line, rest = head.split(b" HTTP/1.1", 1)
    long_head = line + b"&pad=" + b"a" * 20_000 + b" HTTP/1.1" + rest
    with socket.create_connection(_address(base), timeout=10) as sock:
        sock.sendall(long_head + body)
        data = b""
        with contextlib.suppress(ConnectionResetError):
            while b"\r\n" not in data and (chunk := sock.recv(65536)):
                data += chunk
    assert data.split(b" ")[1] == b"431", data[:200]


@pytest.mark.timeout(180)  # a body sent one byte at a time (~15 s in CI, 40 at a load of 10)
@pytest.mark.slow
def test_http_a_body_in_one_byte_chunks_costs_its_size_not_fifty_times_it(
    home: Path, workspace: Path, tmp_base: Path
) -> None:
    """A chunked body is held as its bytes: 1 MiB sent as a million 1-byte chunks grew the
    daemon's peak memory by ~50 MB (a bytes object and a list slot per chunk), so the
    16 MiB a body may have cost ~800 MB.

    A quarter of that is sent: each chunk costs the daemon ~12 µs in h11, and a million
    of them took over a minute on a loaded 2-core machine (the per-test timeout). The
    body grows the peak by ~1.4 MiB here; a list of the pieces grew it by 34 to 43 MiB
    (at the 50 bytes a chunk said above, 12 MiB): 6 MiB lies between."""
    daemon, base = start_http_daemon(home, workspace, tmp_base, ["--no-watch"])
    try:
        before = _rss_kib(daemon.proc.pid, "VmHWM:")
        head = _post_head(base, workspace, 0).replace(
            b"Content-Length: 0", b"Transfer-Encoding: chunked"
        )
        body = b"1\r\n{\r\n" + b"1\r\n \r\n" * (1 << 18) + b"1\r\n}\r\n0\r\n\r\n"
        with socket.create_connection(_address(base), timeout=60) as sock:
            sock.sendall(head + body)
            data = b""
            while b"}}" not in data and (chunk := sock.recv(65536)):
                data += chunk
        assert data.split(b" ")[1] == b"400" and b"-32600" in data, data[:300]
        grew = _rss_kib(daemon.proc.pid, "VmHWM:") - before
        assert grew < 6 * 1024, f"daemon's peak RSS grew by {grew} KiB"
    finally:
        assert daemon.stop() == 0


def _stopped(pid: int) -> bool:
    """Whether the process is stopped (SIGSTOP taken: state ``T``)."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    return stat[stat.rindex(")") + 2] in "Tt"


def _served_during(daemon: Daemon, base: str, head: bytes, flood: bytes) -> bytes:
    """Whether another client is served while a flood already received is worked through;
    returns every byte the flood's connection was answered, to its close.

    ``head`` (a complete request, answered before the flood) makes sure the connection is
    being served; then, the daemon stopped (SIGSTOP), ``flood`` goes to it, and a client
    connects to the Unix socket. Once the daemon goes on, both are there in one wake-up:
    the flood in one read (it fits the socket's buffer), the newcomer in the listen queue.
    ``flood`` ends in a malformed request or body, answered 400 and logged
    ``http_bad_request``, once everything before it was worked through; the newcomer is
    logged ``connection_opened`` once it is served. The order of the two lines is the
    proof, not a count or a time: a daemon that lets the loop run between small runs of
    the flood's work serves the newcomer within a few runs, one that works through a whole
    read at once (as the flood tests measured before: seconds for a large one) serves it
    only after the flood's 400. The newcomer is then answered a ``status`` too.
    """
    pid = daemon.proc.pid
    with socket.create_connection(_address(base), timeout=60) as sock:
        sock.sendall(head)
        first = b""
        while b"\r\n\r\n" not in first:
            chunk = sock.recv(65536)
            assert chunk, first
            first += chunk
        fields, _, content = first.partition(b"\r\n\r\n")
        length = int(next(line.split(b":")[1] for line in fields.split(b"\r\n")
                          if line.lower().startswith(b"content-length:")))
        while len(content) < length:
            content += sock.recv(65536)
        logged = len(daemon.log_events())
        answers: list[bytes] = []

        def read_all() -> None:
            with contextlib.suppress(OSError):
                while chunk := sock.recv(1 << 20):
                    answers.append(chunk)

        reader = threading.Thread(target=read_all, daemon=True)
        os.kill(pid, signal.SIGSTOP)
        try:
            eventually(lambda: _stopped(pid), what="the daemon stopped")
            sock.sendall(flood)  # into the stopped daemon's socket buffer, whole
            newcomer = daemon.raw(timeout=60)  # waits in the listen queue
        finally:
            os.kill(pid, signal.SIGCONT)
        reader.start()
        with newcomer:
            assert "result" in newcomer.request("status")
        reader.join(60)
        assert not reader.is_alive(), "the flood's connection was not closed"
    events = [e.get("event") for e in daemon.log_events()[logged:]]
    assert "http_bad_request" in events, events
    assert "connection_opened" in events, events
    assert events.index("connection_opened") < events.index("http_bad_request"), (
        "the newcomer was served only once the whole flood had been worked through"
    )
    assert daemon.proc.poll() is None
    return b"".join(answers)


def test_http_a_body_in_tiny_chunks_does_not_hold_other_clients(
    home: Path, workspace: Path, tmp_base: Path
) -> None:
    """Chunks already received parse without a wait, and the loop runs other tasks between
    runs of them: a client pouring 1-byte chunks had each read's ~40,000 of them parsed in
    one run (a status on the Unix socket took ~1.7 s while it went on). A newcomer is
    served before a body of ~7,000 chunks received in one read is through, and the body,
    ending in a chunk size that is no number, is answered 400 and closed."""
    daemon, base = start_http_daemon(home, workspace, tmp_base, ["--no-watch"])
    host, port = _address(base)
    head = f"GET /x HTTP/1.1\r\nHost: {host}:{port}\r\n\r\n".encode()
    post = _post_head(base, workspace, 0).replace(
        b"Content-Length: 0", b"Transfer-Encoding: chunked"
    )
    flood = post + b"1\r\n{\r\n" + b"1\r\n \r\n" * 7_000 + b"zz\r\n\r\n"
    try:
        answer = _served_during(daemon, base, head, flood)
        assert answer.startswith(b"HTTP/1.1 400 "), answer[:300]
        assert answer.count(b"HTTP/1.1 4") == 1, answer  # the one answer
    finally:
        assert daemon.stop() == 0


def test_http_a_pipelined_flood_does_not_hold_other_clients(
    home: Path, workspace: Path, tmp_base: Path
) -> None:
    """Pipelined requests already received are served without a wait, and the loop runs
    other tasks between runs of them: one pouring small requests (404s) had each read's
    served in one run (a status on the Unix socket took 4 s and more while it went on). A
    newcomer is served before 1,000 pipelined requests received in one read are through;
    each is answered 404, in order, and the malformed one after them 400, and closed."""
    daemon, base = start_http_daemon(home, workspace, tmp_base, ["--no-watch"])
    host, port = _address(base)
    request = f"GET /x HTTP/1.1\r\nHost: {host}:{port}\r\n\r\n".encode()
    requests = 1_000
    try:
        answer = _served_during(daemon, base, request, request * requests + b"BROKEN\r\n\r\n")
        statuses = re.findall(rb"HTTP/1\.1 ([0-9]{3}) ", answer)
        assert statuses == [b"404"] * requests + [b"400"], (len(statuses), answer[-300:])
    finally:
        assert daemon.stop() == 0


def _rss_kib(pid: int, which: str) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(which):
                return int(line.split()[1])
    raise AssertionError(f"no {which}")


def test_http_a_request_framed_two_ways_is_400_and_closed(http_daemon, workspace: Path) -> None:
    """Transfer-Encoding and Content-Length together (request smuggling through a proxy
    that reads the other one): 400 and the connection closes; what followed is not
    served as a request of its own."""
    _, base = http_daemon
    target = urlsplit(endpoint(base, workspace))
    body = json.dumps(rpc(1, "ping", {"_meta": {
        "io.modelcontextprotocol/protocolVersion": "2026-07-28",
        "io.modelcontextprotocol/clientCapabilities": {}}})).encode()
    head = (f"POST {target.path}?{target.query} HTTP/1.1\r\nHost: {target.netloc}\r\n"
            "Content-Type: application/json\r\nAccept: application/json, text/event-stream\r\nMCP-Protocol-Version: 2026-07-28\r\n"
            "Mcp-Method: ping\r\n")
    smuggled = (head + "Content-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n").encode() + (
        b"%x\r\n" % len(body) + body + b"\r\n0\r\n\r\n")
    after = (head + f"Content-Length: {len(body)}\r\n\r\n").encode() + body
    with socket.create_connection(_address(base), timeout=20) as sock:
        sock.sendall(smuggled + after)
        data = b""
        try:
            while chunk := sock.recv(65536):
                data += chunk
        except (ConnectionResetError, TimeoutError):
            pass  # a timeout: the connection was kept open (the assertions say so)
    assert data.startswith(b"HTTP/1.1 400 "), data[:300]
    assert b"Transfer-Encoding and Content-Length" in data, data
    assert data.count(b"HTTP/1.1 ") == 1, data


def test_http_client_gone_mid_body_is_no_incident(http_daemon, workspace: Path) -> None:
    """A client that closes in the middle of its body is a bad request, not a failure.

    It half-closes and waits for the daemon to close: a client that has closed its socket
    altogether before the daemon asks the kernel who it is is no one (refused at accept).
    """
    daemon, base = http_daemon
    head = _post_head(base, workspace, 100) + b"{"  # then the client closes

    def count(event: str) -> int:
        # http_bad_request is said once a second per status, ``refused`` counting each.
        return sum(e.get("refused", 1) for e in daemon.log_events() if e.get("event") == event)

    def gone_mid_body() -> None:
        with socket.create_connection(_address(base), timeout=5) as sock:
            sock.sendall(head)
            sock.shutdown(socket.SHUT_WR)
            while sock.recv(65536):
                pass

    bad, failed = count("http_bad_request"), count("http_connection_failed")
    for _ in range(5):
        gone_mid_body()
    assert http(endpoint(base, workspace), body=rpc(1, "initialize", INIT_PARAMS)).status == 200
    time.sleep(1.1)  # past the throttle's second: the next line counts the five
    gone_mid_body()
    eventually(lambda: count("http_bad_request") >= bad + 6, what="the six bad requests")
    assert count("http_connection_failed") == failed


def test_http_declared_body_over_the_limit_is_413_at_once(http_daemon, workspace: Path) -> None:
    """A Content-Length past 16 MiB is refused from the head, not after the body's timeout."""
    _, base = http_daemon
    with socket.create_connection(_address(base), timeout=5) as sock:  # < the body timeout
        sock.sendall(_post_head(base, workspace, 20_000_000))
        data = sock.recv(65536)
    assert data.startswith(b"HTTP/1.1 413 "), data[:200]
    assert b"at most 16777216 bytes" in data


def test_http_a_large_body_is_parsed_without_holding_other_clients(
    http_daemon, workspace: Path
) -> None:
    """A body of 1.5 million numbers takes seconds to parse (each keeps its text). On the
    event loop that held every client of every face: one status on the socket, sent
    meanwhile, waited for the whole parse. As for a large line on the socket, it is parsed
    in a worker thread. Told by thread (``CpuByThread``), from before the body's last byte
    is sent (its parse cannot have begun) to the answer's first byte: a count of the
    statuses answered meanwhile depended on how loaded the machine was."""
    daemon, base = http_daemon
    body = b'{"jsonrpc":"2.0","id":1,"method":"ping","params":{"x":['
    body += b"1.5," * 1_500_000 + b"1]}}"
    with socket.create_connection(_address(base), timeout=120) as sock:
        sock.sendall(_post_head(base, workspace, len(body)) + body[:-1])
        cpu = CpuByThread(daemon.proc.pid)
        sock.sendall(body[-1:])
        sock.recv(1, socket.MSG_PEEK)
        cpu.assert_off_the_loop("the body was parsed")
        data = sock.recv(65536)
    assert data.startswith(b"HTTP/1.1 "), data[:200]


_MAX_BODY = 16 * 1024 * 1024


def _reply_head(sock: socket.socket) -> bytes:
    """What the daemon answered on this socket, read until it closes (TimeoutError when
    it says nothing within the socket's timeout)."""
    data = sock.recv(65536)
    with contextlib.suppress(ConnectionResetError, TimeoutError):
        while chunk := sock.recv(65536):
            data += chunk
    return data


@pytest.mark.parametrize(
    ("change", "status"),
    [
        ({"Origin": "http://evil.example.com"}, 403),
        ({"Host": "evil.example.com"}, 421),
        ({"path": "/x"}, 404),
        ({"method": "PUT"}, 405),
    ],
)
@pytest.mark.parametrize("framing", ["length", "chunked"])
def test_http_a_large_body_its_head_refuses_is_not_read(
    http_daemon, workspace: Path, change: dict[str, str], status: int, framing: str
) -> None:
    """Any web page the operator's browser opens can POST to the endpoint (a no-cors
    fetch needs no preflight) with a body of 16 MiB, or a chunked one, and its own Origin.
    Such a request was refused only once its body had been read: a few pages' uploads held
    the daemon's memory and its bound on large requests (four bodies of 16 MiB), and the
    operator's own large requests, on every face, were 503 meanwhile. A request whose head
    refuses it (a foreign Origin or Host, a wrong path or method) with a body over 64 KiB
    or chunked is answered at its head, before any of the body is sent, and closed; the
    four refused, a large request of the operator's is taken."""
    _, base = http_daemon
    target = urlsplit(endpoint(base, workspace))
    fields = {"Host": target.netloc, "Content-Type": "application/json",
              "Accept": "application/json, text/event-stream",
              **{k: v for k, v in change.items() if k not in ("path", "method")}}
    if framing == "chunked":
        fields["Transfer-Encoding"] = "chunked"
    else:
        fields["Content-Length"] = str(_MAX_BODY)
    head = (f"{change.get('method', 'POST')} {change.get('path', target.path)}?{target.query} "
            "HTTP/1.1\r\n" + "".join(f"{k}: {v}\r\n" for k, v in fields.items()) + "\r\n")
    refused = [socket.create_connection(_address(base), timeout=60) for _ in range(4)]
    try:
        for sock in refused:
            sock.sendall(head.encode())  # the head alone: its body never comes
            data = _reply_head(sock)
            assert data.startswith(f"HTTP/1.1 {status} ".encode()), data[:300]
            assert b"\r\nconnection: close\r\n" in data.lower(), data[:300]
            assert data.rstrip().endswith(b"}"), data  # the JSON-RPC error
        body = json.dumps(rpc(1, "ping", {"pad": "x" * 200_000})).encode()
        with socket.create_connection(_address(base), timeout=60) as mine:
            mine.sendall(_post_head(base, workspace, len(body)) + body)
            data = mine.recv(65536)
        assert data.startswith(b"HTTP/1.1 ") and not data.startswith(b"HTTP/1.1 503"), data[:300]
    finally:
        for sock in refused:
            sock.close()


def test_http_large_bodies_in_flight_are_bounded(http_daemon, workspace: Path) -> None:
    """Each body up to 16 MiB is taken, but not any number of them at once: received and
    then parsed (up to twenty times its size), they are what exhausts the daemon's memory.
    Four bodies of 16 MiB being received hold the daemon's bound on large requests (four
    times the body limit): a fifth is refused with 503 at its head, and taken again once
    one of the four has gone."""
    _daemon, base = http_daemon
    head = _post_head(base, workspace, _MAX_BODY)
    holders = [socket.create_connection(_address(base), timeout=30) for _ in range(4)]
    try:
        for sock in holders:
            sock.sendall(head + b"{")  # the head, and a body that is still to come
        answers: list[bytes] = []

        def fifth_refused() -> bool:  # until the daemon has read the four heads
            with socket.create_connection(_address(base), timeout=30) as fifth:
                fifth.sendall(head)
                fifth.settimeout(0.5)
                with contextlib.suppress(TimeoutError):
                    answers.append(_reply_head(fifth))
                    return True
            return False  # taken (its body awaited): closed, so it holds nothing now

        eventually(fifth_refused, what="a fifth large body refused")
        data = answers[-1]
        assert data.startswith(b"HTTP/1.1 503 "), data[:300]
        assert b"retry-after: 1" in data.lower(), data[:300]
        assert b"would take them past 67108864 (four times the message size limit)" in data, data
        holders.pop().close()  # the daemon sees the body end early, and lets it go
        pad = _MAX_BODY - 100
        body = json.dumps(rpc(1, "ping", {"pad": "x" * pad})).encode()
        body += b" " * (_MAX_BODY - len(body))
        with socket.create_connection(_address(base), timeout=60) as fifth:
            fifth.sendall(head + body)
            data = fifth.recv(65536)
        assert data.startswith(b"HTTP/1.1 ") and not data.startswith(b"HTTP/1.1 503"), data[:300]
    finally:
        for sock in holders:
            sock.close()


def test_http_bodies_and_socket_lines_share_one_bound(workspace: Path, tmp_path: Path) -> None:
    """The bound on large requests is the daemon's, not each face's: with the message limit
    at 1 MB (``--max-message-bytes 1000000``, so 4 MB for all in flight), four 1 MB bodies
    being received over HTTP leave no room for a 200 KB line on the socket, which gets
    -32008 until one of the bodies has gone."""
    home = tmp_path / "home"
    (home / "tools").mkdir(parents=True)
    daemon, base = start_http_daemon(home, workspace, tmp_path, ["--max-message-bytes", "1000000"])
    try:
        line = json.dumps(rpc("big", "status", {"pad": "y" * 200_000})).encode() + b"\n"

        def answer() -> dict[str, Any]:
            with daemon.raw(timeout=30) as conn:
                conn.send_bytes(line)
                return dict(conn.receive()["error"])  # taken: status takes no params

        bodies = [socket.create_connection(_address(base), timeout=30) for _ in range(4)]
        try:
            for body in bodies:
                body.sendall(_post_head(base, workspace, 1_000_000) + b"{")
            refused: list[dict[str, Any]] = []
            eventually(lambda: refused.append(answer()) or refused[-1]["code"] == -32008,
                       what="the socket's line refused while the bodies are received")
            assert refused[-1]["data"] == {"resource": "memory", "limit": 4_000_000}
            bodies.pop().close()
            eventually(lambda: answer()["code"] == -32602,
                       what="the socket's line taken once a body has gone")
        finally:
            for body in bodies:
                body.close()
    finally:
        shut_down(daemon)


def _declared_answer(base: str, workspace: Path, length: int) -> bytes:
    """What the daemon says to a POST head declaring ``length`` bytes (b"" when it waits
    for the body instead)."""
    with socket.create_connection(_address(base), timeout=30) as sock:
        sock.sendall(_post_head(base, workspace, length))
        sock.settimeout(1)
        with contextlib.suppress(TimeoutError):
            return sock.recv(65536)
    return b""


def test_http_body_limit_is_the_message_limit_and_reloads(workspace: Path, tmp_path: Path) -> None:
    """One message size whichever face carries it: ``max-message-bytes`` bounds an HTTP
    body as it bounds a socket line, and a config reload changes it for new connections."""
    home = tmp_path / "home"
    (home / "tools").mkdir(parents=True)
    config = tmp_path / "toolsetd.toml"
    config.write_text("max-message-bytes = 1000000\n")
    daemon, base = start_http_daemon(home, workspace, tmp_path, ["--config", str(config)])
    try:
        data = _declared_answer(base, workspace, 1_000_001)
        assert data.startswith(b"HTTP/1.1 413 "), data[:200]
        assert b"at most 1000000 bytes" in data, data[:300]
        assert _declared_answer(base, workspace, 1_000_000) == b""  # its body awaited
        config.write_text("max-message-bytes = 2000000\n")
        assert daemon.call("reload", {})["result"]["config"]["applied"] == ["max-message-bytes"]
        assert _declared_answer(base, workspace, 1_000_001) == b""
        data = _declared_answer(base, workspace, 2_000_001)
        assert b"at most 2000000 bytes" in data, data[:300]
    finally:
        shut_down(daemon)


def test_http_a_get_streams_body_is_not_held_while_it_streams(
    workspace: Path, tmp_path: Path
) -> None:
    """A GET's body means nothing, and its stream may stay open for good (an idle session
    whose stream is open never expires): sent with a body, it must not hold the bound on
    large requests while it streams. It did: four such streams refused every large request
    on both faces for as long as they stayed open. With the message limit at 1 MB
    (``--max-message-bytes 1000000``, so 4 MB for all in flight), four streams opened with
    1 MB bodies, a 200 KB line is taken while they are open."""
    home = tmp_path / "home"
    (home / "tools").mkdir(parents=True)
    daemon, base = start_http_daemon(home, workspace, tmp_path, ["--max-message-bytes", "1000000"])
    try:
        host, port = _address(base)
        size = 1_000_000
        streams = [socket.create_connection((host, port), timeout=30) for _ in range(4)]
        try:
            for stream in streams:
                session = initialize(endpoint(base, workspace))
                stream.sendall(
                    f"GET /mcp?workspace={workspace} HTTP/1.1\r\nHost: {host}:{port}\r\n"
                    f"Accept: text/event-stream\r\nMcp-Session-Id: {session}\r\n"
                    f"Content-Length: {size}\r\n\r\n".encode()
                    + b" " * size
                )
                assert stream.recv(65536).startswith(b"HTTP/1.1 200 "), "a stream did not open"
            line = json.dumps(rpc("big", "status", {"pad": "y" * 200_000})).encode() + b"\n"
            with daemon.raw(timeout=30) as conn:
                conn.send_bytes(line)
                error = conn.receive()["error"]
            assert error["code"] == -32602, error  # taken: status takes no params
        finally:
            for stream in streams:
                stream.close()
    finally:
        shut_down(daemon)


# -- the official SDK client (streamable_http_client) ----------------------------------------


def _sdk(url: str, **kwargs: Any) -> Client:
    return Client(url, mode=kwargs.pop("mode", "legacy"), **kwargs)


def test_sdk_lists_and_calls_over_http(http_daemon, workspace: Path) -> None:
    """The SDK's Streamable HTTP client lists the tool sets and calls one, with progress."""
    _, base = http_daemon
    seen: list[float] = []

    async def on_progress(progress: float, total: float | None, message: str | None) -> None:
        seen.append(progress)

    async def main() -> tuple[list[str], types.CallToolResult]:
        with anyio.fail_after(60):
            async with _sdk(endpoint(base, workspace)) as client:
                tools = await client.list_tools()
                result = await client.call_tool("progress3", {}, progress_callback=on_progress)
        return [t.name for t in tools.tools], result

    names, result = anyio.run(main)
    assert "progress3" in names
    assert result.is_error is False
    assert seen == sorted(set(seen))
    assert len(seen) >= 3


@pytest.mark.parametrize("action", ["accept", "decline"])
def test_sdk_elicitation_legacy_era(http_daemon, workspace: Path, action: str) -> None:
    """An ask call is put to the operator by elicitation/create on the POST's stream."""
    _, base = http_daemon
    asked: list[str] = []

    async def elicit(context: Any, params: Any) -> types.ElicitResult:
        asked.append(params.message)
        return types.ElicitResult(action=action, content={} if action == "accept" else None)

    async def main() -> types.CallToolResult:
        with anyio.fail_after(60):
            async with _sdk(endpoint(base, workspace), elicitation_callback=elicit) as client:
                return await client.call_tool("asker", {})

    result = anyio.run(main)
    assert asked
    assert "asker" in asked[0]
    text = result.content[0].text  # type: ignore[union-attr]
    if action == "accept":
        assert result.is_error is False
        assert "asked and ran" in text
    else:
        assert result.is_error is True
        assert "declined" in text


def test_sdk_elicitation_2026_era(http_daemon, workspace: Path) -> None:
    """In the 2026-07-28 era the approval is an input-required round trip, stateless."""
    _, base = http_daemon
    asked: list[str] = []

    async def elicit(context: Any, params: Any) -> types.ElicitResult:
        asked.append(params.message)
        return types.ElicitResult(action="accept", content={})

    async def main() -> types.CallToolResult:
        with anyio.fail_after(60):
            async with _sdk(endpoint(base, workspace), mode="2026-07-28",
                            elicitation_callback=elicit) as client:
                return await client.call_tool("asker", {})

    result = anyio.run(main)
    assert asked
    assert result.is_error is False
    assert "asked and ran" in result.content[0].text  # type: ignore[union-attr]


def test_sdk_2026_era_mirrors_x_mcp_header_arguments(http_daemon, workspace: Path) -> None:
    """The official SDK client (2026-07-28) mirrors x-mcp-header arguments into the
    Mcp-Param headers that toolsetd checks: its call passes, nested and Base64 alike."""
    _, base = http_daemon
    schema = {"type": "object", "properties": {
        "region": {"type": "string", "x-mcp-header": "Region"},
        "opts": {"type": "object", "properties": {
            "n": {"type": "integer", "x-mcp-header": "N"}}}}}
    write_set(workspace / ".crystal" / "tools", "routed",
              _tool("routed.py", schema=schema), **{"routed.py": script("print('ran')\n")})

    async def main() -> list[types.CallToolResult]:
        with anyio.fail_after(60):
            async with _sdk(endpoint(base, workspace, mode="full"), mode="2026-07-28") as client:
                return [await client.call_tool("routed", arguments) for arguments in (
                    {"region": "us-west1", "opts": {"n": 42}},
                    {"region": " Hello, \u4e16\u754c "},
                    {},
                )]

    for result in anyio.run(main):
        assert result.is_error is False, result
        assert "ran" in result.content[0].text  # type: ignore[union-attr]


def test_sdk_cancelled_call_kills_the_tool(http_daemon, workspace: Path) -> None:
    """A call the SDK client abandons (cancel scope) ends the tool's process group."""
    _, base = http_daemon
    pid_file = workspace / "sleeper.pid"

    async def main() -> None:
        with anyio.fail_after(60):
            async with _sdk(endpoint(base, workspace)) as client, \
                    anyio.create_task_group() as tg:
                tg.start_soon(client.call_tool, "sleeper", {})
                while not pid_file.exists() or not pid_file.read_text():
                    await anyio.sleep(0.02)
                tg.cancel_scope.cancel()

    anyio.run(main)
    pid = int(pid_file.read_text())
    eventually(lambda: not alive(pid), what="the sleeper killed after the cancel")


@contextlib.contextmanager
def _unconfined_http_daemon(
    tmp_path: Path, home: Path, workspace: Path
) -> Iterator[tuple[Daemon, str, Path]]:
    """A daemon serving MCP over HTTP with confinement off (the tests that starve it of
    descriptors would starve the sandbox first), and its folder; stopped afterwards."""
    config = tmp_path / "unconfined.toml"
    config.write_text('[confinement]\ncgroup = "off"\nsandbox = "off"\n')
    base = Path(tempfile.mkdtemp(prefix="tsb-"))
    d, url = start_http_daemon(home, workspace, base, ["--no-watch", "--config", str(config)])
    try:
        yield d, url, base
    finally:
        shut_down(d)
        shutil.rmtree(base, ignore_errors=True)


def _initialize_post(
    url: str, workspace: Path
) -> tuple[HTTPConnection, str, dict[str, str], bytes]:
    """A kept-alive connection to ``workspace``'s endpoint, and the target, headers and body
    of an initialize POST on it."""
    target = urlsplit(endpoint(url, workspace))
    headers = {"content-type": "application/json",
               "accept": "application/json, text/event-stream"}
    body = json.dumps(rpc(1, "initialize", INIT_PARAMS)).encode()
    conn = HTTPConnection(target.hostname, target.port, timeout=30)
    return conn, f"{target.path}?{target.query}", headers, body


def test_http_a_session_opened_short_of_descriptors_is_503_busy(
    tmp_path: Path, home: Path, workspace: Path
) -> None:
    """Out of descriptors at a new session's workspace check: 503 and -32008 (retry
    later), not 400 (the request's fault); the next initialize opens the session."""
    with _unconfined_http_daemon(tmp_path, home, workspace) as (d, url, _):
        conn, path, headers, body = _initialize_post(url, workspace)
        try:
            conn.request("POST", path, body=body, headers=headers)
            opened = conn.getresponse()
            opened.read()
            assert opened.status == 200, opened.status
            with descriptors_limited(d.proc.pid):
                conn.request("POST", path, body=body, headers=headers)
                busy = conn.getresponse()
                answer = json.loads(busy.read())
            assert busy.status == 503, (busy.status, answer)
            assert answer["error"]["code"] == -32008, answer
            assert answer["error"]["data"] == {"resource": "descriptors"}, answer
        finally:
            conn.close()
        assert initialize(endpoint(url, workspace))


def test_http_an_initialize_whose_catalog_is_short_of_descriptors_opens_no_session(
    tmp_path: Path, home: Path, workspace: Path
) -> None:
    """Out of descriptors while the initialize builds its workspace's catalog (the
    workspace check passed): 503 and -32008, retry later, as docs/mcp-http.md says, and
    no session: its id is not sent, and it holds none of the 1,024 (each failed
    initialize kept one for the idle hour, its workspace held with it)."""
    with _unconfined_http_daemon(tmp_path, home, workspace) as (d, url, base):
        other = base / "other"  # a workspace no catalog was built for yet
        write_set(other / ".crystal" / "tools", "asker", _tool("asker.py"),
                  **{"asker.py": ASKER})
        conn, path, headers, body = _initialize_post(url, other)
        try:
            # Connected (and accepted) first: a stateless server/discover, which reads no
            # catalog.
            conn.request("POST", path, body=json.dumps(rpc(0, "server/discover", {"_meta": {
                "io.modelcontextprotocol/protocolVersion": "2026-07-28",
                "io.modelcontextprotocol/clientCapabilities": {}}})).encode(),
                headers={**headers, "mcp-protocol-version": "2026-07-28",
                         "mcp-method": "server/discover"})
            assert conn.getresponse().read()
            with descriptors_limited(d.proc.pid, free=1):
                conn.request("POST", path, body=body, headers=headers)
                busy = conn.getresponse()
                answer = json.loads(busy.read())
            assert answer["error"]["code"] == -32008, answer
            assert busy.status == 503, (busy.status, answer)
            assert busy.getheader("mcp-session-id") is None
        finally:
            conn.close()
        held = [e for e in d.log_events()
                if e.get("event") in ("mcp_http_session_opened", "mcp_http_session_closed")]
        assert held and held[-1]["event"] == "mcp_http_session_closed", held
        assert held[-1]["sessions"] == 0, held
        assert initialize(endpoint(url, other))


#: Two 15 MB bodies parsed as far as memory goes: orjson at the memory limit is slow (some
#: 13 s of the daemon's CPU for the second body alone, each small allocation crawling
#: through glibc's failed brk and its mmap fallback; 35 s for the test at a load of 5, and
#: past its client's 150 s wait at a load of 11). The client waits for the answer however
#: long it takes; the test's timeout is there against a hang only.
@pytest.mark.timeout(900)
def test_http_a_body_the_daemon_has_no_memory_to_parse_is_503_busy(
    tmp_path: Path, home: Path, workspace: Path
) -> None:
    """A valid body the daemon had no memory to parse (RLIMIT_AS) is 503 and -32008
    ``{"resource": "memory"}``, retry later: not 400 "the body is not JSON" (orjson's
    "Not enough memory" error), nor a handler failure once the objects ran short."""
    body = b'{"jsonrpc":"2.0","id":1,"method":"ping","params":{"x":[' + b"[]," * 5_000_000
    body += b"[]]}}"
    with _unconfined_http_daemon(tmp_path, home, workspace) as (d, url, _):
        target = urlsplit(endpoint(url, workspace))
        started = time.monotonic()
        for headroom in (150 << 20, 300 << 20):  # orjson's buffer fails; then the objects
            conn = HTTPConnection(target.hostname, target.port)  # no timeout: see above
            try:
                with memory_limited(d.proc.pid, headroom):
                    conn.request("POST", f"{target.path}?{target.query}", body=body, headers={
                        "content-type": "application/json",
                        "accept": "application/json, text/event-stream"})
                    busy = conn.getresponse()
                    answer = json.loads(busy.read())
            finally:
                conn.close()
            assert busy.status == 503, (busy.status, answer)
            assert answer["error"]["code"] == -32008, answer
            assert answer["error"]["data"] == {"resource": "memory"}, answer
        assert initialize(endpoint(url, workspace))
        events = d.log_events()
        assert "http_connection_failed" not in [e.get("event") for e in events]
        said = [e for e in events if e.get("event") == "mcp_http_out_of_memory"]
        # One line a minute: the second body is said too only if it came a minute after
        # the first (a heavily loaded machine parses it slowly).
        lines = 1 if time.monotonic() - started < 60 else len(said)
        assert 1 <= len(said) <= 2, said
        assert [(e["size"], e["refused"]) for e in said] == [(len(body), 1)] * lines, said


@pytest.mark.timeout(600)
def test_http_a_large_body_at_any_memory_headroom_is_answered_and_the_daemon_lives(
    tmp_path: Path, home: Path, workspace: Path
) -> None:
    """A 15 MB body of one string, POSTed with the daemon's memory bounded (RLIMIT_AS) at
    every headroom from 10 to 300 MiB, 2 MiB apart: each gets a response, 200 or 503
    -32008 busy, and the daemon lives. Short of memory to join the body's pieces, the
    connection was reset unanswered, with an error and its traceback in the log for each;
    orjson, short of it for the string, killed the daemon (SIGSEGV)."""
    request = {"jsonrpc": "2.0", "id": 1, "method": "ping", "params": {"s": "a" * (15 << 20)}}
    body = json.dumps(request).encode()
    with _unconfined_http_daemon(tmp_path, home, workspace) as (d, url, _):
        target = urlsplit(endpoint(url, workspace))
        statuses = set()
        busy: list[str] = []
        for headroom in range(10 << 20, 300 << 20, 2 << 20):
            conn = HTTPConnection(target.hostname, target.port, timeout=150)
            try:
                with memory_limited(d.proc.pid, headroom):
                    # Refused before the whole body is sent, the daemon drains the rest for
                    # a second only: past it, the response is read as a browser reads it.
                    with contextlib.suppress(BrokenPipeError, ConnectionResetError):
                        conn.request("POST", f"{target.path}?{target.query}", body=body,
                                     headers={"content-type": "application/json",
                                              "accept": "application/json, text/event-stream"})
                    reply = conn.getresponse()
                    answer = json.loads(reply.read())
            except (ConnectionError, HTTPException) as exc:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    d.proc.wait(timeout=5)
                pytest.fail(f"no response at {headroom >> 20} MiB of headroom ({exc!r}); the "
                            f"daemon's exit status: {d.proc.poll()}")
            finally:
                conn.close()
            statuses.add(reply.status)
            if reply.status == 503:
                busy.append(answer["error"]["message"])
                assert answer["error"]["code"] == -32008, answer
                assert answer["error"]["data"] == {"resource": "memory"}, answer
            else:  # parsed: a ping before initialize is answered without a session
                assert reply.status == 200 and answer["id"] == 1, (reply.status, answer)
        assert statuses == {200, 503}, statuses  # the sweep crossed the limit
        assert initialize(endpoint(url, workspace))
        events = [e.get("event") for e in d.log_events()]
        assert "http_connection_failed" not in events
        if any("no memory to read the body" in m for m in busy):
            assert "http_out_of_memory" in events, events


def test_http_an_accept_short_of_descriptors_is_said_once_per_episode(
    tmp_path: Path, home: Path, workspace: Path
) -> None:
    """Out of descriptors, the HTTP listener retries its accept every 0.1 s, and said so
    each time: a warning ten times a second for as long as the shortage lasted (an hour
    of it, 36,000 lines). It says it once, and its end with the count, as the socket's
    and the metrics' listeners do; the connection that waited is served."""
    def said(event: str) -> list[dict[str, Any]]:
        return [e for e in d.log_events() if e.get("event") == event]

    with _unconfined_http_daemon(tmp_path, home, workspace) as (d, url, _):
        target = urlsplit(url)
        # An episode of one retry proves nothing (a loaded machine may retry once in the
        # window): then there is another, until one had a few.
        for episode in range(1, 11):
            with descriptors_limited(d.proc.pid):
                waiting = socket.create_connection((target.hostname, target.port), timeout=30)
                eventually(lambda: len(said("http_accept_retry")) >= episode,  # noqa: B023
                           what="http_accept_retry")
                time.sleep(0.5)  # a window for a few retries (every 0.1 s), not a measure
            with waiting:
                waiting.sendall(b"GET /nowhere HTTP/1.1\r\nHost: " + target.netloc.encode()
                                + b"\r\nConnection: close\r\n\r\n")
                assert waiting.recv(64).startswith(b"HTTP/1.1 "), "the connection that waited"
            resumed = said("http_accept_resumed")
            assert len(resumed) == episode, resumed
            if resumed[-1]["retries"] > 1:
                break
        else:
            pytest.fail(f"no episode of more than one retry: {resumed}")
        retried = said("http_accept_retry")
        assert len(retried) == episode, retried
        assert retried[0]["error"] == os.strerror(retried[0]["errno"]), retried
        assert initialize(endpoint(url, workspace))


def test_http_events_carry_the_connection_id_the_docs_name(
    http_daemon: tuple[Daemon, str], workspace: Path
) -> None:
    """An MCP HTTP connection's events carry ``http_conn_id``, not the socket's
    ``conn_id``; docs/operations.md names it where it lists what every event carries, so
    a log query for one HTTP client's lines can be written from the page."""
    daemon, base = http_daemon
    initialize(endpoint(base, workspace))
    opened = [e for e in daemon.log_events() if e["event"] == "mcp_http_session_opened"]
    assert opened
    assert all("http_conn_id" in e and "conn_id" not in e for e in opened), opened
    logs = (Path(__file__).resolve().parents[2] / "docs" / "operations.md").read_text()
    carried = logs.split("Every event has `event`", 1)[1].split("\n\n", 1)[0]
    assert "`http_conn_id`" in carried
