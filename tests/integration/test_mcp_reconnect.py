"""``toolsetctl mcp`` across a daemon restart: a real daemon stopped (SIGTERM) or killed
(SIGKILL) and a new one started on the same socket, under one pump and one host.

The pump reconnects (never autostarting), binds again, replays the host's ``initialize``
(its response swallowed), tells a legacy host ``notifications/tools/list_changed``,
answers what the old daemon left unanswered, withdraws its questions to the host, and
sends the host's lines that waited. Each test starts its own daemons.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import signal
import socket
import struct
import subprocess
import sys
import termios
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import mcp_types as types
import pytest
from mcp import Client
from toolsetd.client.mcp import _WAITING_MAX

from .conftest import Daemon, eventually, start_daemon, write_set
from .mcp_helpers import (
    RawPump,
    pump_args,
    script,
    server,
    tool,
    write_project_asker,
    write_test_sets,
)

MODERN = "2026-07-28"
INIT = {
    "protocolVersion": "2025-11-25",
    "capabilities": {"elicitation": {}},
    "clientInfo": {"name": "reconnect-test", "version": "1"},
}
HELLO = {"name": "hello", "arguments": {"name": "again"}}
#: A call of some 1.5 MB: three of them pass the 4 MiB the pump holds while it reconnects.
BIG = {"name": "hello", "arguments": {"name": "x" * 1_500_000}}


@pytest.fixture
def sets(home: Path, workspace: Path) -> None:
    write_test_sets(home)
    write_project_asker(workspace)


@contextlib.contextmanager
def daemons(home: Path, workspace: Path, base: Path) -> Iterator[list[Daemon]]:
    """The daemons a test starts on one socket (the last is the current one); each is
    stopped at the end."""
    started: list[Daemon] = []
    try:
        yield started
    finally:
        for d in started:
            if d.proc.poll() is None:
                d.proc.kill()
                d.proc.wait()


@contextlib.contextmanager
def pumped(
    home: Path, workspace: Path, base: Path, **start: Any
) -> Iterator[tuple[list[Daemon], Daemon, RawPump]]:
    """The daemons started (``daemons``), the first of them (``start_daemon``'s keywords:
    ``extra_args``, ``launcher``), and a pump bound to it; the pump must end with 0 when
    its input is closed at the end."""
    with daemons(home, workspace, base) as started:
        d = start_daemon(home, workspace, base, **start)
        started.append(d)
        pump = RawPump(pump_args(d, workspace))
        try:
            yield started, d, pump
        finally:
            assert close(pump) == 0


def restart(started: list[Daemon], home: Path, workspace: Path, base: Path) -> Daemon:
    d = start_daemon(home, workspace, base)
    started.append(d)
    return d


def receive_until(pump: RawPump, done: Any) -> list[Any]:
    """Messages from the pump up to and with the first for which ``done`` is true."""
    seen = []
    while True:
        message = pump.receive()
        seen.append(message)
        if done(message):
            return seen


def receive_answers(pump: RawPump, ids: set[Any]) -> list[Any]:
    """Messages from the pump up to the answers to all of ``ids``, in whatever order."""
    seen: list[Any] = []
    while not ids <= {m.get("id") for m in seen if "method" not in m}:
        seen.append(pump.receive())
    return seen


def answer_to(request_id: Any) -> Any:
    return lambda m: m.get("id") == request_id and "method" not in m


def initialize(pump: RawPump) -> None:
    assert pump.request(1, "initialize", INIT)["result"]["protocolVersion"] == "2025-11-25"
    pump.send({"jsonrpc": "2.0", "method": "notifications/initialized"})


def initialize_as_written(pump: RawPump, params: str) -> None:
    """``initialize`` with ``params`` as this text (what ``json.dumps`` would not write)."""
    pump.send(b'{"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": %s}\n'
              % params.encode())
    assert pump.receive()["result"]["protocolVersion"] == "2025-11-25"
    pump.send({"jsonrpc": "2.0", "method": "notifications/initialized"})


def _killed_within_a_big_answer(pump: RawPump, d: Daemon) -> bytes:
    """Initialize ``pump``, call ``bigimage`` (id 2, a 20 MB answer), and SIGKILL ``d``
    once the answer's head is on the pump's stdout: the daemon is within that line (the
    rest waits, as the host reads nothing more yet). Returns the head read."""
    initialize(pump)
    pump.send({"jsonrpc": "2.0", "id": 2, "method": "tools/call",
               "params": {"name": "bigimage", "arguments": {}}})
    assert pump.proc.stdout is not None
    head = os.read(pump.proc.stdout.fileno(), 64)
    assert head.startswith(b'{"jsonrpc":"2.0","id":2,"result"'), head
    d.proc.kill()
    d.proc.wait()
    return head


def close(pump: RawPump) -> int:
    """Close the pump's stdin, wait for it to exit and read its stderr; its exit code."""
    with contextlib.suppress(BrokenPipeError):
        return pump.close()
    return pump.proc.wait()


def killed_under_call_2(
    pump: RawPump, d: Daemon, started: list[Daemon], home: Path, workspace: Path, base: Path
) -> None:
    """Kill ``d`` under the host's call of id 2, in flight, and start the next daemon: the
    pump answers the call once, as one that may have run."""
    d.proc.kill()
    d.proc.wait()
    restart(started, home, workspace, base)
    pump.send({"jsonrpc": "2.0", "id": 3, "method": "ping"})
    seen = receive_until(pump, answer_to(3))
    gone = [m for m in seen if m.get("id") == 2]
    assert len(gone) == 1, str(seen)[:500]
    assert "may have run" in gone[0]["result"]["content"][0]["text"], gone


def test_the_daemons_mcp_lines_begin_with_jsonrpc_then_id_or_method(
    sets: None, home: Path, workspace: Path, tmp_base: Path
) -> None:
    """The pump finds the id of each daemon line in its head (``_Pump._daemon_head``),
    never parsing a whole (maybe megabytes) line: every line the daemon writes on a bound
    connection begins ``{"jsonrpc":"2.0","id":`` (a response, a request of its own) or
    ``{"jsonrpc":"2.0","method":`` (a notification). Pinned here for each kind: results,
    errors (of the session, of the wire: bad JSON), an elicitation/create, a progress
    notification, list_changed and the error of a line over the size limit."""
    with daemons(home, workspace, tmp_base) as started:
        d = start_daemon(home, workspace, tmp_base, ["--max-message-bytes", "100000"])
        started.append(d)
        lines: list[bytes] = []
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(30)
            sock.connect(str(d.socket))
            reader = sock.makefile("rb")

            def send(message: Any) -> None:
                data = message if isinstance(message, bytes) else json.dumps(message).encode()
                sock.sendall(data + b"\n")

            def read() -> Any:
                line = reader.readline()
                assert line, "closed"
                lines.append(line)
                return json.loads(line)

            send({"jsonrpc": "2.0", "id": "b", "method": "mcp.bind",
                  "params": {"workspace": str(workspace)}})
            assert read()["result"]["bound"] is True
            lines.clear()  # the bind's answer is the native wire's, read by the pump itself
            send({"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": INIT})
            read()
            # The version agreed on comes first: the pump compares a replay's with it.
            assert lines[-1].startswith(
                b'{"jsonrpc":"2.0","id":1,"result":{"protocolVersion":"2025-11-25"'), lines
            # No question goes to a host before its initialized (the asker below).
            send({"jsonrpc": "2.0", "method": "notifications/initialized"})
            send({"method": "tools/list", "id": "x", "jsonrpc": "2.0"})  # the host's order
            read()
            send(b"{not json")
            assert read()["error"]["code"] == -32700
            send({"jsonrpc": "2.0", "id": 3, "method": "no/such"})
            assert read()["error"]["code"] == -32601
            send({"jsonrpc": "2.0", "id": 4, "method": "tools/call",
                  "params": {"name": "progress3", "arguments": {}, "_meta": {"progressToken": 7}}})
            assert "result" in receive_lines(read, 4)
            send({"jsonrpc": "2.0", "id": 5, "method": "tools/call",
                  "params": {"name": "asker", "arguments": {}}})
            asked = read()
            assert asked["method"] == "elicitation/create"
            send({"jsonrpc": "2.0", "id": asked["id"], "result": {"action": "decline"}})
            receive_lines(read, 5)
            meta = {"io.modelcontextprotocol/protocolVersion": MODERN,
                    "io.modelcontextprotocol/clientCapabilities": {}}
            send({"jsonrpc": "2.0", "id": "sub", "method": "subscriptions/listen",
                  "params": {"_meta": meta, "notifications": {"toolsListChanged": True}}})
            assert read()["method"] == "notifications/subscriptions/acknowledged"
            # The pump knows an acknowledgement, and its subscription, by this head.
            assert lines[-1].startswith(
                b'{"jsonrpc":"2.0","method":"notifications/subscriptions/acknowledged",'
                b'"params":{"_meta":{"io.modelcontextprotocol/subscriptionId":"sub"}'), lines
            (home / "tools" / "progress3" / "tools.json").unlink()
            told: set[str] = set()  # the session's (legacy) and the listen's
            while len(told) < 2:
                message = read()
                if message.get("method") == "notifications/tools/list_changed":
                    told.add(json.dumps(message.get("params")))
            send(b"[" * 200_000)
            assert read()["error"]["code"] == -32007
        kinds = set()
        for line in lines:
            assert line.startswith((b'{"jsonrpc":"2.0","id":', b'{"jsonrpc":"2.0","method":')), line
            message = json.loads(line)
            kinds.add("method" if "method" in message else "error" if "error" in message
                      else "result")
        assert kinds == {"method", "error", "result"}
        assert lines[-1].startswith(b'{"jsonrpc":"2.0","id":null,"error":{"code":-32007')


def receive_lines(read: Any, request_id: Any) -> Any:
    while True:
        message = read()
        if message.get("id") == request_id and "method" not in message:
            return message


@pytest.mark.anyio
async def test_a_graceful_restart_keeps_the_sdk_hosts_session(
    sets: None, home: Path, workspace: Path, tmp_base: Path
) -> None:
    """SIGTERM, then a new daemon on the same socket: the SDK host keeps calling tools on
    the same pump; the replayed initialize keeps its elicitation capability (an asking
    tool asks the host again after the restart), and it is told list_changed."""
    seen: list[str] = []
    changed = anyio.Event()

    async def elicit(context: Any, params: types.ElicitRequestParams) -> types.ElicitResult:
        seen.append(params.message)
        return types.ElicitResult(action="accept")

    async def on_message(message: Any) -> None:
        if isinstance(message, types.ToolListChangedNotification):
            changed.set()

    with daemons(home, workspace, tmp_base) as started:
        d = restart(started, home, workspace, tmp_base)
        with anyio.fail_after(60):
            async with Client(
                server(d, workspace), mode="legacy", elicitation_callback=elicit,
                message_handler=on_message,
            ) as client:
                assert "asked and ran" in _text(await client.call_tool("asker", {}))
                assert len(seen) == 1
                assert d.stop() == 0
                restart(started, home, workspace, tmp_base)
                await changed.wait()
                hello = await client.call_tool("hello", {"name": "again"})
                assert hello.is_error is False
                assert "again" in _text(hello)
                asked = await client.call_tool("asker", {})
                assert "asked and ran" in _text(asked)
                assert len(seen) == 2  # asked again: the new session knows elicitation
                assert any(t.name == "hello" for t in (await client.list_tools()).tools)


def _text(result: Any) -> str:
    return "".join(getattr(c, "text", "") for c in result.content)


def test_a_graceful_restart_over_raw_lines(
    sets: None, home: Path, workspace: Path, tmp_base: Path
) -> None:
    """What the host sees of a graceful restart, line by line: the old daemon answers the
    call waiting on its approval and withdraws the question itself (the pump does neither
    again), the host never sees the replayed initialize's response, it gets list_changed,
    and a request it sends while no daemon answers waits for the new one."""
    with daemons(home, workspace, tmp_base) as started:
        d = restart(started, home, workspace, tmp_base)
        pump = RawPump(pump_args(d, workspace))
        try:
            initialize(pump)
            pump.send({"jsonrpc": "2.0", "id": 2, "method": "tools/call",
                       "params": {"name": "asker", "arguments": {}}})
            asked = pump.receive()
            assert asked["method"] == "elicitation/create"
            assert d.stop() == 0
            # No daemon now: this waits in the pump for the next one.
            pump.send({"jsonrpc": "2.0", "id": 3, "method": "tools/call", "params": HELLO})
            restart(started, home, workspace, tmp_base)
            seen = receive_until(pump, answer_to(3))
            assert "again" in seen[-1]["result"]["content"][0]["text"], seen
            pump.send({"jsonrpc": "2.0", "id": 4, "method": "ping"})
            seen += receive_until(pump, answer_to(4))
            answers = [m for m in seen if m.get("id") == 2]
            assert len(answers) == 1 and answers[0]["result"]["isError"] is True, seen
            assert "may have run" not in json.dumps(answers[0])  # the daemon's own answer
            withdrawn = [m for m in seen if m.get("method") == "notifications/cancelled"]
            assert [m["params"]["requestId"] for m in withdrawn] == [asked["id"]], seen
            assert {"jsonrpc": "2.0", "method": "notifications/tools/list_changed"} in seen
            assert all(m.get("id") in (2, 3, 4) for m in seen if "method" not in m), seen
        finally:
            assert close(pump) == 0


def test_sigkill_mid_call_is_answered_by_the_pump(
    sets: None, home: Path, workspace: Path, tmp_base: Path
) -> None:
    """A daemon killed under a running tools/call: the pump answers the call (an isError
    result saying toolsetd went away and that the tool may have run); later calls go to
    the new daemon."""
    pid_file = workspace / "sleeper.pid"
    with daemons(home, workspace, tmp_base) as started:
        d = restart(started, home, workspace, tmp_base)
        pump = RawPump(pump_args(d, workspace))
        try:
            initialize(pump)
            pump.send({"jsonrpc": "2.0", "id": 2, "method": "tools/call",
                       "params": {"name": "sleeper", "arguments": {}}})
            pump.send({"jsonrpc": "2.0", "id": 3, "method": "tools/list"})
            receive_until(pump, answer_to(3))
            eventually(lambda: pid_file.exists() and bool(pid_file.read_text()), what="sleeper")
            d.proc.kill()
            d.proc.wait()
            gone = receive_until(pump, answer_to(2))[-1]
            assert gone["result"]["isError"] is True, gone
            text = gone["result"]["content"][0]["text"]
            assert "went away" in text and "may have run" in text, text
            restart(started, home, workspace, tmp_base)
            hello = pump.request(4, "tools/call", HELLO)
            assert "again" in hello["result"]["content"][0]["text"], hello
        finally:
            with contextlib.suppress(OSError, ValueError):
                os.kill(int(pid_file.read_text()), signal.SIGKILL)
            assert close(pump) == 0


def test_a_request_under_an_id_in_flight_leaves_the_first_answered_at_a_restart(
    sets: None, home: Path, workspace: Path, tmp_base: Path
) -> None:
    """A host that sends a request under the id of one in flight (MCP forbids it) has it
    refused by the daemon (-32600, under that id), which serves the first. The pump took
    the refusal for the first's answer: when the daemon was killed under the call, nobody
    answered it, and the host waited for ever."""
    pid_file = workspace / "sleeper.pid"
    with pumped(home, workspace, tmp_base) as (started, d, pump):
        try:
            initialize(pump)
            pump.send({"jsonrpc": "2.0", "id": 2, "method": "tools/call",
                       "params": {"name": "sleeper", "arguments": {}}})
            eventually(lambda: pid_file.exists() and bool(pid_file.read_text()), what="sleeper")
            refused = pump.request(2, "ping")
            assert refused["error"]["code"] == -32600, refused
            assert "already in flight" in refused["error"]["message"], refused
            killed_under_call_2(pump, d, started, home, workspace, tmp_base)
        finally:
            with contextlib.suppress(OSError, ValueError):
                os.kill(int(pid_file.read_text()), signal.SIGKILL)


def test_a_question_pending_across_a_restart_is_withdrawn(
    sets: None, home: Path, workspace: Path, tmp_base: Path
) -> None:
    """The old daemon's elicitation/create, still open at the host when the daemon was
    killed, is withdrawn (notifications/cancelled) and the host's late answer to it goes
    nowhere: the new daemon numbers its questions from 1 again, and its own first one is
    not answered by that late answer (the pump gives the new daemon's a name of its own)."""
    with daemons(home, workspace, tmp_base) as started:
        d = restart(started, home, workspace, tmp_base)
        pump = RawPump(pump_args(d, workspace))
        try:
            initialize(pump)
            pump.send({"jsonrpc": "2.0", "id": 2, "method": "tools/call",
                       "params": {"name": "asker", "arguments": {}}})
            old = pump.receive()
            assert old["method"] == "elicitation/create"
            d.proc.kill()
            d.proc.wait()
            seen = receive_until(pump, lambda m: m.get("method") == "notifications/cancelled")
            assert seen[-1]["params"]["requestId"] == old["id"], seen
            assert [m["result"]["isError"] for m in seen if m.get("id") == 2] == [True], seen
            restart(started, home, workspace, tmp_base)
            pump.send({"jsonrpc": "2.0", "id": 3, "method": "tools/call",
                       "params": {"name": "asker", "arguments": {}}})
            new = receive_until(pump, lambda m: m.get("method") == "elicitation/create")[-1]
            assert new["id"] != old["id"]
            # The late accept of the withdrawn question, then a ping behind it: had the
            # accept reached the new daemon, the call would have run by the ping's answer.
            pump.send({"jsonrpc": "2.0", "id": old["id"],
                       "result": {"action": "accept", "content": {}}})
            pump.send({"jsonrpc": "2.0", "id": 4, "method": "ping"})
            seen = receive_until(pump, answer_to(4))
            assert all(m.get("id") != 3 for m in seen), seen
            pump.send({"jsonrpc": "2.0", "id": new["id"], "result": {"action": "decline"}})
            seen += receive_until(pump, answer_to(3))
            assert seen[-1]["result"]["isError"] is True, seen
            assert "asked and ran" not in json.dumps(seen), seen
        finally:
            assert close(pump) == 0


def test_a_stateless_host_across_a_restart(
    sets: None, home: Path, workspace: Path, tmp_base: Path
) -> None:
    """A 2026-07-28 host (no initialize: each request carries its _meta) goes on after a
    restart with nothing replayed and no list_changed (its era has it on a listen only)."""
    meta = {"io.modelcontextprotocol/protocolVersion": MODERN,
            "io.modelcontextprotocol/clientCapabilities": {}}
    with daemons(home, workspace, tmp_base) as started:
        d = restart(started, home, workspace, tmp_base)
        pump = RawPump(pump_args(d, workspace))
        try:
            assert pump.request(1, "tools/list", {"_meta": meta})["result"]["tools"]
            assert d.stop() == 0
            restart(started, home, workspace, tmp_base)
            pump.send({"jsonrpc": "2.0", "id": 2, "method": "tools/call",
                       "params": {**HELLO, "_meta": meta}})
            seen = receive_until(pump, answer_to(2))
            assert seen[-1]["result"]["resultType"] == "complete", seen
            assert "again" in seen[-1]["result"]["content"][0]["text"]
            assert len(seen) == 1, seen
        finally:
            assert close(pump) == 0


@pytest.mark.parametrize("autostart", [False, True])
def test_a_daemon_that_comes_back_within_the_window(
    sets: None, home: Path, workspace: Path, tmp_base: Path, autostart: bool
) -> None:
    """A daemon started a while after the old one stopped is found, with or without
    ``--no-autostart``; the request the host sent meanwhile is answered by it."""
    with daemons(home, workspace, tmp_base) as started:
        d = restart(started, home, workspace, tmp_base)
        pump = RawPump(pump_args(d, workspace, autostart=autostart))
        try:
            initialize(pump)
            assert d.stop() == 0
            pump.send({"jsonrpc": "2.0", "id": 2, "method": "tools/call", "params": HELLO})
            restart(started, home, workspace, tmp_base)
            hello = receive_until(pump, answer_to(2))[-1]
            assert "again" in hello["result"]["content"][0]["text"], hello
        finally:
            assert close(pump) == 0


@pytest.mark.slow
@pytest.mark.parametrize("autostart", [False, True])
def test_a_daemon_that_never_comes_back(
    sets: None, home: Path, workspace: Path, tmp_base: Path, autostart: bool
) -> None:
    """No daemon comes back: the pump starts none (an operator who stopped toolsetd keeps
    it stopped), answers the request that waited with an error when the window has passed,
    says so in one line and exits 5."""
    with daemons(home, workspace, tmp_base) as started:
        d = restart(started, home, workspace, tmp_base)
        pump = RawPump(pump_args(d, workspace, autostart=autostart))
        try:
            initialize(pump)
            assert d.stop() == 0
            pump.send({"jsonrpc": "2.0", "id": 2, "method": "tools/list"})
            waited = receive_until(pump, answer_to(2))[-1]
            assert waited["error"]["code"] == -32603, waited
            assert "could not reconnect" in waited["error"]["message"]
            assert pump.proc.wait(timeout=60) == 5
            assert not d.socket.exists()  # nobody was started on it
        finally:
            code = close(pump)
        said = pump.stderr()
        assert said.count("\n") == 1 and "did not come back within 30 s" in said, said
        assert code == 5


def test_a_new_bind_refused_ends_the_pump_with_its_code(
    sets: None, home: Path, workspace: Path, tmp_base: Path
) -> None:
    """The workspace was removed while the daemon restarted: the new daemon refuses the
    bind, and the pump answers what waited and exits 2, as a first bind refused so would."""
    with daemons(home, workspace, tmp_base) as started:
        d = restart(started, home, workspace, tmp_base)
        pump = RawPump(pump_args(d, workspace))
        try:
            initialize(pump)
            assert d.stop() == 0
            shutil.rmtree(workspace)
            pump.send({"jsonrpc": "2.0", "id": 2, "method": "tools/list"})
            restart(started, home, workspace, tmp_base)
            waited = receive_until(pump, answer_to(2))[-1]
            assert waited["error"]["code"] == -32603, waited
            assert pump.proc.wait(timeout=30) == 2
        finally:
            code = close(pump)
        said = pump.stderr()
        assert said.count("\n") == 1 and "closed the connection" in said, said
        assert code == 2


def test_a_line_over_the_size_limit_is_not_a_restart(
    sets: None, home: Path, workspace: Path, tmp_base: Path
) -> None:
    """The daemon closes the connection after a line over its size limit, having said so
    (-32007, id null): the pump passes that on and exits 5, and neither reconnects (the
    host's next such line would only close the next one) nor sends the line again."""
    with daemons(home, workspace, tmp_base) as started:
        d = start_daemon(home, workspace, tmp_base, ["--max-message-bytes", "100000"])
        started.append(d)

        def opened() -> int:
            return sum(e.get("event") == "connection_opened" for e in d.log_events())

        probes = opened()  # the start's (one, or more where a probe timed out)
        pump = RawPump(pump_args(d, workspace))
        try:
            initialize(pump)
            pump.send({"jsonrpc": "2.0", "id": 2, "method": "tools/call",
                       "params": {"name": "hello", "arguments": {"name": "x" * 200_000}}})
            too_large = pump.receive()
            assert too_large["error"]["code"] == -32007 and too_large["id"] is None
            assert pump.proc.wait(timeout=30) == 5
        finally:
            code = close(pump)
        assert code == 5
        assert "over its size limit" in pump.stderr(), pump.stderr()
        assert d.proc.poll() is None
        assert opened() == probes + 1, d.log_events()  # the pump's one


def test_a_line_over_the_daemons_limit_goes_on_unheld(
    sets: None, home: Path, workspace: Path, tmp_base: Path
) -> None:
    """A host line over the daemon's size limit (``--max-message-bytes`` lowered) goes on
    as it comes: the daemon refuses it (-32007) before its end, and the pump neither holds
    it nor parses it whole. The pump held every line up to 16 MiB until its newline and
    parsed it (16 MiB of ``[],``: 1.6 s and 420 MB), for a daemon that reads none of it."""
    with daemons(home, workspace, tmp_base) as started:
        d = start_daemon(home, workspace, tmp_base, ["--max-message-bytes", "100000"])
        started.append(d)
        pump = RawPump(pump_args(d, workspace))
        try:
            initialize(pump)
            with contextlib.suppress(BrokenPipeError):  # the pump may be gone by its end
                pump.send(b'{"jsonrpc":"2.0","id":2,"method":"tools/call","params":{"name":'
                          b'"hello","arguments":{"name":"x","list":[' + b"[]," * 100_000)
            answered: list[Any] = []
            reader = threading.Thread(target=lambda: answered.append(pump.receive()))
            reader.daemon = True
            reader.start()
            reader.join(30)  # the line has no end yet: only the pump's streaming answers
            assert answered, "no answer before the line's end"
            assert answered[0]["error"]["code"] == -32007, answered
            assert pump.proc.wait(timeout=30) == 5
        finally:
            code = close(pump)
        assert code == 5
        assert "over its size limit" in pump.stderr(), pump.stderr()


def test_an_initialize_that_waited_for_the_new_daemon_is_sent_once(
    sets: None, home: Path, workspace: Path, tmp_base: Path
) -> None:
    """The host's initialize arrives while no daemon answers (its first request: the
    daemon went away right after the bind): it waits and goes to the new daemon as the
    host's own, answered to the host, and is not also replayed (a second initialize on
    one session is refused, and the host got that refusal)."""
    with daemons(home, workspace, tmp_base) as started:
        d = restart(started, home, workspace, tmp_base)
        pump = RawPump(pump_args(d, workspace))
        try:
            assert "result" in pump.request(0, "ping")  # bound
            assert d.stop() == 0
            pump.send({"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": INIT})
            pump.send({"jsonrpc": "2.0", "method": "notifications/initialized"})
            restart(started, home, workspace, tmp_base)
            seen = receive_until(pump, answer_to(1))
            assert seen[-1]["result"]["protocolVersion"] == "2025-11-25", seen
            assert len(seen) == 1, seen  # no list_changed: nothing was listed before
            hello = pump.request(2, "tools/call", HELLO)
            assert "again" in hello["result"]["content"][0]["text"], hello
        finally:
            assert close(pump) == 0


def test_a_line_cut_short_by_the_daemons_death_is_ended_and_its_call_answered(
    sets: None, home: Path, workspace: Path, tmp_base: Path
) -> None:
    """The daemon is killed while it writes a call's (20 MB) answer: the host gets the
    part written, ended by a newline (one line it cannot parse, not a line glued to the
    next), and then the pump's answer to that call, which the cut line did not give."""
    with daemons(home, workspace, tmp_base) as started:
        d = restart(started, home, workspace, tmp_base)
        pump = RawPump(pump_args(d, workspace))
        try:
            head = _killed_within_a_big_answer(pump, d)
            assert pump.proc.stdout is not None
            cut = head + pump.proc.stdout.readline()
            with pytest.raises(json.JSONDecodeError):
                json.loads(cut)
            gone = pump.receive()
            assert gone["id"] == 2 and gone["result"]["isError"] is True, gone
            assert "may have run" in gone["result"]["content"][0]["text"]
            restart(started, home, workspace, tmp_base)
            hello = pump.request(3, "tools/call", HELLO)
            assert "again" in hello["result"]["content"][0]["text"], hello
        finally:
            assert close(pump) == 0


#: The number of ``read`` on this machine (``/proc/<pid>/syscall``), where known.
_READ = {"x86_64": 0, "aarch64": 63}.get(os.uname().machine)


def _needs_syscall() -> None:
    """Skip a test that waits for ``_stdin_taken`` where it cannot be told."""
    if _READ is None or not Path("/proc/self/syscall").exists():
        pytest.skip("needs /proc/<pid>/syscall on x86-64 or arm64")


def _stdin_taken(pump: RawPump) -> bool:
    """Whether the pump has read all the host wrote and its stdin thread waits for more
    (in ``read`` on fd 0 again): the host's last line is handled, sent or held."""
    assert pump.proc.stdin is not None
    unread = fcntl.ioctl(pump.proc.stdin.fileno(), termios.FIONREAD, b"\0" * 4)
    if struct.unpack("i", unread)[0]:
        return False
    for task in Path(f"/proc/{pump.proc.pid}/task").iterdir():
        with contextlib.suppress(OSError):
            if (task / "syscall").read_text().startswith(f"{_READ} 0x0 "):  # read(0, ...)
                return True
    return False


def test_a_request_sent_before_the_pump_saw_the_daemon_go_waits_for_the_new_one(
    sets: None, home: Path, workspace: Path, tmp_base: Path
) -> None:
    """The daemon dies while the pump is still copying its last line to the host (a
    20 MB answer the host reads nothing more of yet): the host's next request reaches the
    pump before it has seen the connection close, and its send fails (nothing of it
    reached a daemon). It waits for the new daemon, as one sent a moment later does; it
    was answered "went away ... the tool may have run" (and the tests of a request sent
    after a restart failed so now and then on a loaded machine, the pump slower to see the
    close than the host to write)."""
    _needs_syscall()
    with daemons(home, workspace, tmp_base) as started:
        d = restart(started, home, workspace, tmp_base)
        pump = RawPump(pump_args(d, workspace))
        try:
            _killed_within_a_big_answer(pump, d)
            pump.send({"jsonrpc": "2.0", "id": 3, "method": "tools/call", "params": HELLO})
            eventually(lambda: _stdin_taken(pump), what="the request read by the pump")
            pump.proc.stdout.readline()  # the rest of the cut line: the pump sees the close
            seen = receive_until(pump, answer_to(2))
            assert seen[-1]["result"]["isError"] is True, seen
            assert all(m.get("id") != 3 for m in seen), seen
            restart(started, home, workspace, tmp_base)
            seen = receive_until(pump, answer_to(3))
            assert "again" in seen[-1]["result"]["content"][0]["text"], seen
            assert all(m.get("id") != 2 for m in seen), seen
        finally:
            assert close(pump) == 0


def test_host_lines_past_the_waiting_bound_are_answered_at_once(
    sets: None, home: Path, workspace: Path, tmp_base: Path
) -> None:
    """While no daemon answers, the host's lines wait up to 4 MiB; a request past that is
    answered at once with an error (the pump does not grow), and those that waited go to
    the new daemon."""
    with daemons(home, workspace, tmp_base) as started:
        d = restart(started, home, workspace, tmp_base)
        pump = RawPump(pump_args(d, workspace))
        try:
            initialize(pump)
            assert d.stop() == 0
            for n in (2, 3, 4):
                pump.send({"jsonrpc": "2.0", "id": n, "method": "tools/call", "params": BIG})
            over = receive_until(pump, answer_to(4))[-1]
            assert over["result"]["isError"] is True, str(over)[:300]
            assert "not sent" in over["result"]["content"][0]["text"]
            restart(started, home, workspace, tmp_base)
            seen = receive_until(pump, answer_to(3))
            answered = [m for m in seen if m.get("id") in (2, 3)]
            assert [m["id"] for m in answered] == [2, 3], str(seen)[:500]
            # The daemon's answers (hello takes its name on the command line, too long
            # here), not the pump's.
            assert all("toolsetd/status" in m["result"]["_meta"] for m in answered)
        finally:
            assert close(pump) == 0


#: Appends a line to counter.log each time it runs.
COUNTER = script("open('counter.log', 'a').write('ran\\n')\nprint('counted')\n")


def test_a_cancel_past_the_waiting_bound_still_cancels_its_request(
    sets: None, home: Path, workspace: Path, tmp_base: Path
) -> None:
    """The host cancels a call that waits for the new daemon when the lines that wait
    fill the pump's 4 MiB: the call never runs. The cancel, held like any line, was
    dropped silently past the bound while its call went to the new daemon, and ran."""
    write_set(home / "tools", "counter", tool("counter.py"), **{"counter.py": COUNTER})

    def line(request_id: int, name: str, arguments: dict[str, Any]) -> bytes:
        return json.dumps({"jsonrpc": "2.0", "id": request_id, "method": "tools/call",
                           "params": {"name": name, "arguments": arguments}}).encode() + b"\n"

    counted = line(2, "counter", {})
    first = line(3, "hello", {"name": "x" * 2_000_000})
    # The third fills the bound but for 8 bytes: the cancel (some 90) does not fit.
    room = _WAITING_MAX - len(counted) - len(first) - len(line(4, "hello", {"name": ""})) - 8
    filling = line(4, "hello", {"name": "x" * room})
    cancel = {"jsonrpc": "2.0", "method": "notifications/cancelled",
              "params": {"requestId": 2, "reason": "the user gave up"}}
    _needs_syscall()
    with pumped(home, workspace, tmp_base) as (started, d, pump):
        initialize(pump)
        assert "result" in pump.request(9, "ping")  # initialized went: nothing waits
        assert d.stop() == 0
        for waiting in (counted, first, filling):
            pump.send(waiting)
        pump.send(cancel)
        # All of it read (the cancel too) while no daemon answers.
        eventually(lambda: _stdin_taken(pump), what="the lines read by the pump")
        restart(started, home, workspace, tmp_base)
        seen = receive_answers(pump, {3, 4})
        # The daemon's answers (hello takes its name on the command line, too long).
        answers = [m for m in seen if m.get("id") in (3, 4)]
        assert all("toolsetd/status" in m["result"].get("_meta", {}) for m in answers), [
            str(m)[:300] for m in answers]
        again = pump.request(5, "tools/call", {"name": "counter", "arguments": {}})
        assert "counted" in again["result"]["content"][0]["text"], again
        assert (workspace / "counter.log").read_text() == "ran\n"  # call 5's only
        assert all(m.get("id") != 2 for m in seen), str(seen)[:500]


#: A toolsetd whose first initialize waits (its event loop held) until the file named
#: by its first argument exists: a new daemon slow to answer the replayed initialize.
_SLOW_INITIALIZE = (
    "import os, sys, time\n"
    "import toolsetd.daemon.mcp_session as session\n"
    "gate = sys.argv.pop(1)\n"
    "check = session._check_initialize\n"
    "def slow(params):\n"
    "    while not os.path.exists(gate):\n"
    "        time.sleep(0.01)\n"
    "    check(params)\n"
    "session._check_initialize = slow\n"
    "from toolsetd.daemon.app import main\n"
    "sys.exit(main())\n"
)


def test_a_request_past_the_bound_while_the_replay_is_unanswered_is_answered(
    sets: None, home: Path, workspace: Path, tmp_base: Path
) -> None:
    """The new daemon is bound but has not answered the replayed initialize: the host's
    lines still wait, and one past the 4 MiB is answered by the pump, once the daemon
    has answered (between its lines), not kept for a reconnect that never comes."""
    _needs_syscall()
    gate = tmp_base / "answer-initialize"
    with pumped(home, workspace, tmp_base) as (started, d, pump):
        initialize(pump)
        assert d.stop() == 0
        started.append(start_daemon(home, workspace, tmp_base, launcher=[
            sys.executable, "-c", _SLOW_INITIALIZE, str(gate)]))
        # Told once the pump is bound and has sent the replay: its lines wait now.
        receive_until(pump, lambda m: m.get("method") == "notifications/tools/list_changed")
        for n in (2, 3, 4):
            pump.send({"jsonrpc": "2.0", "id": n, "method": "tools/call", "params": BIG})
        eventually(lambda: _stdin_taken(pump), what="the lines read by the pump")
        gate.touch()
        seen = receive_answers(pump, {2, 3})  # the daemon's
        over = [m for m in seen if m.get("id") == 4]
        assert len(over) == 1, str(seen)[:500]
        assert "not sent" in over[0]["result"]["content"][0]["text"], over


def test_the_rest_of_a_long_line_does_not_go_to_the_new_daemon(
    sets: None, home: Path, workspace: Path, tmp_base: Path
) -> None:
    """A host line over 16 MiB goes to the daemon as it comes (the pump holds no more);
    when that daemon dies in the middle of it, the rest is not sent to the new one, which
    would read it as a line of its own (a parse error the host never caused). The request
    is answered by the pump, at its end, as not run: it went unanswered, and the host
    waited for ever (its id last in the line, as a TypeScript host writes it)."""
    args = ["--max-message-bytes", "40000000"]
    line = json.dumps({"method": "tools/call", "jsonrpc": "2.0",
                       "params": {"name": "hello", "arguments": {"name": "x" * 20_000_000}},
                       "id": 2})
    half = 17 * 1024 * 1024
    with pumped(home, workspace, tmp_base, extra_args=args) as (started, d, pump):
        initialize(pump)
        pump.send(line[:half].encode())
        d.proc.kill()
        d.proc.wait()
        started.append(start_daemon(home, workspace, tmp_base, args))
        receive_until(pump, lambda m: m.get("method") == "notifications/tools/list_changed")
        pump.send(line[half:].encode() + b"\n")  # now the new daemon is bound
        seen = receive_until(pump, answer_to(2))  # and says nothing unasked
        assert seen[-1]["result"]["isError"] is True, str(seen)[:500]
        assert "was not run" in seen[-1]["result"]["content"][0]["text"], seen[-1]
        pump.send({"jsonrpc": "2.0", "id": 3, "method": "ping"})
        seen += receive_until(pump, answer_to(3))
        assert [m for m in seen if m.get("id") is None] == [], str(seen)[:500]
        assert len([m for m in seen if m.get("id") == 2]) == 1, str(seen)[:500]


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def test_a_long_line_while_the_replay_is_unanswered_does_not_jump_the_gate(
    sets: None, home: Path, workspace: Path, tmp_base: Path
) -> None:
    """The host's lines wait until the new daemon agrees to the replayed initialize; one
    over 16 MiB, which the pump cannot hold, went to the daemon at once, ahead of the
    lines that waited before it and of the host's session: the daemon took a request
    the host sent after a ping before the ping. It goes nowhere now, and is answered as
    not run; the ping is the daemon's to answer."""
    _needs_syscall()
    gate = tmp_base / "answer-initialize"
    args = ["--max-message-bytes", "40000000"]
    line = json.dumps({"jsonrpc": "2.0", "id": 3, "method": "tools/call",
                       "params": {"name": "hello", "arguments": {"name": "x" * 17_000_000}}})
    with pumped(home, workspace, tmp_base, extra_args=args) as (started, d, pump):
        initialize(pump)
        assert d.stop() == 0
        started.append(start_daemon(home, workspace, tmp_base, args, launcher=[
            sys.executable, "-c", _SLOW_INITIALIZE, str(gate)]))
        receive_until(pump, lambda m: m.get("method") == "notifications/tools/list_changed")
        pump.send({"jsonrpc": "2.0", "id": 2, "method": "ping"})
        # By a thread: a pump that sends the line on blocks (the daemon, held, reads
        # nothing), and so does this write.
        assert pump.proc.stdin is not None
        fd, data = pump.proc.stdin.fileno(), line.encode() + b"\n"
        writer = threading.Thread(target=_write_all, args=(fd, data), daemon=True)
        writer.start()
        eventually(lambda: not writer.is_alive() and _stdin_taken(pump),
                   what="the lines read by the pump")
        gate.touch()
        seen = receive_answers(pump, {2, 3})
        long = [m for m in seen if m.get("id") == 3]
        assert len(long) == 1, str(seen)[:500]
        assert "was not run" in long[0]["result"]["content"][0]["text"], str(long)[:500]


#: What goes before the long call: nothing, or a line the daemon answers as a parse error,
#: short (the pump knows) or itself over 16 MiB (only the daemon knows), as a request or not.
_REFUSED_BEFORE = {
    "alone": b"",
    "after-a-nan": b'{"jsonrpc":"2.0","id":5,"method":"ping","params":{"n":NaN}}\n',
    "after-a-long-nan": b'{"jsonrpc":"2.0","id":5,"method":"ping","params":{"p":"'
    + b"x" * 17_000_000
    + b'","n":NaN}}\n',
    "after-a-long-nan-notification": b'{"jsonrpc":"2.0","method":"notifications/progress",'
    b'"params":{"p":"' + b"x" * 17_000_000 + b'","n":NaN}}\n',
}


@pytest.mark.parametrize("before", list(_REFUSED_BEFORE))
def test_a_long_line_in_flight_when_its_daemon_dies_is_answered(
    before: str, sets: None, home: Path, workspace: Path, tmp_base: Path
) -> None:
    """A tools/call over 16 MiB that reached the daemon whole (it went on as it came, the
    pump holding none of it) is in flight like any other: when the daemon is killed under
    it, the pump answers it ("went away ... may have run"). It was never noted, and the
    host waited for ever. The pump tells whether the daemon took it by the parse errors
    the daemon answered up to it: one of a line before it (``NaN``) is not its own,
    whether the pump knows the daemon refuses it (a short line) or not (one over 16 MiB:
    its parse error was counted as the call's, the call taken for refused, and the host
    waited for ever)."""
    args = ["--max-message-bytes", "40000000"]
    call = {"name": "sleeper", "arguments": {"pad": "x" * 17_000_000}}
    pid_file = workspace / "sleeper.pid"
    with pumped(home, workspace, tmp_base, extra_args=args) as (started, d, pump):
        try:
            initialize(pump)
            if _REFUSED_BEFORE[before]:
                pump.send(_REFUSED_BEFORE[before])
            pump.send({"jsonrpc": "2.0", "method": "tools/call", "params": call, "id": 2})
            eventually(lambda: pid_file.exists() and bool(pid_file.read_text()), what="sleeper")
            assert pump.request(4, "ping")["result"] == {}  # read after the pump's verdict
            d.proc.kill()
            d.proc.wait()
            gone = receive_until(pump, answer_to(2))[-1]
            assert gone["result"]["isError"] is True, gone
            assert "may have run" in gone["result"]["content"][0]["text"], gone
            restart(started, home, workspace, tmp_base)
            assert pump.request(3, "ping")["result"] == {}
        finally:
            with contextlib.suppress(OSError, ValueError):
                os.kill(int(pid_file.read_text()), signal.SIGKILL)


#: A toolsetd that dies (SIGKILL) within the first line it writes that names "cut-me": it
#: hands the socket the first half of it, then kills itself.
_DIES_WITHIN_A_LINE = (
    "import os, signal, sys\n"
    "import toolsetd.daemon.wire as wire\n"
    "write = wire.Wire._write\n"
    "def cut(self, transport, frame):\n"
    "    if b'cut-me' not in frame:\n"
    "        return write(self, transport, frame)\n"
    "    transport.write(frame[: len(frame) // 2])\n"
    "    os.kill(os.getpid(), signal.SIGKILL)\n"
    "wire.Wire._write = cut\n"
    "from toolsetd.daemon.app import main\n"
    "sys.exit(main())\n"
)


def test_a_short_line_cut_by_the_daemons_death_never_reaches_the_host(
    sets: None, home: Path, workspace: Path, tmp_base: Path
) -> None:
    """The daemon dies within a line of a few kilobytes (an answer, a progress
    notification): the pump holds such a line until its end, and the host sees none of
    it, only the pump's answer to its call. The half the pump had was copied on and ended
    with a newline: a message no host can parse, and an SDK host's reader fails on it."""
    call = {"name": "hello", "arguments": {"name": "cut-me" + "x" * 4000}}
    launcher = [sys.executable, "-c", _DIES_WITHIN_A_LINE]
    with pumped(home, workspace, tmp_base, launcher=launcher) as (started, d, pump):
        initialize(pump)
        pump.send({"jsonrpc": "2.0", "id": 2, "method": "tools/call", "params": call})
        gone = receive_until(pump, answer_to(2))  # each line parsed
        assert len(gone) == 1, str(gone)[:500]
        assert "may have run" in gone[0]["result"]["content"][0]["text"], gone
        assert d.proc.wait() == -signal.SIGKILL
        restart(started, home, workspace, tmp_base)
        assert pump.request(3, "ping")["result"] == {}


def test_a_new_daemons_withdrawal_names_the_question_as_the_host_knows_it(
    sets: None, home: Path, workspace: Path, tmp_base: Path
) -> None:
    """After a restart the pump gives the new daemon's questions ids of its own; when that
    daemon withdraws one (it stops gracefully under a call waiting on its approval), the
    host's notifications/cancelled names the id the host was asked under, once."""
    with daemons(home, workspace, tmp_base) as started:
        d = restart(started, home, workspace, tmp_base)
        pump = RawPump(pump_args(d, workspace))
        try:
            initialize(pump)
            assert d.stop() == 0
            d = restart(started, home, workspace, tmp_base)
            pump.send({"jsonrpc": "2.0", "id": 2, "method": "tools/call",
                       "params": {"name": "asker", "arguments": {}}})
            asked = receive_until(pump, lambda m: m.get("method") == "elicitation/create")[-1]
            assert asked["id"] != "toolsetd-elicit-1"
            assert d.stop() == 0
            restart(started, home, workspace, tmp_base)
            pump.send({"jsonrpc": "2.0", "id": 3, "method": "ping"})
            seen = receive_until(pump, answer_to(3))
            withdrawn = [m["params"]["requestId"] for m in seen
                         if m.get("method") == "notifications/cancelled"]
            assert withdrawn == [asked["id"]], seen
            assert [m["result"]["isError"] for m in seen if m.get("id") == 2] == [True], seen
        finally:
            assert close(pump) == 0


@pytest.mark.parametrize("over_16_mib", [False, True], ids=["held", "over-16-MiB"])
def test_a_request_with_a_long_integer_id_is_answered_once_across_a_restart(
    over_16_mib: bool, sets: None, home: Path, workspace: Path, tmp_base: Path
) -> None:
    """JSON-RPC bounds no id: a host's integer id of 250 digits (the daemon keeps every
    digit) is answered by the daemon, and not again by the pump at the next restart. The
    pump read the daemon's answer only to its first 256 bytes, took the id cut short for
    another, and kept the request in flight: the restart answered it a second time. So
    too for a request in a line over 16 MiB, which the pump sends on as it comes and reads
    for its id as it goes (``_LongLine``): its id did not make the head read longer."""
    args = ["--max-message-bytes", "40000000"] if over_16_mib else []
    long_id = 10**250
    name = "x" * (17_000_000 if over_16_mib else 5)
    with pumped(home, workspace, tmp_base, extra_args=args) as (started, d, pump):
        initialize(pump)
        pump.send({"jsonrpc": "2.0", "id": long_id, "method": "tools/call",
                   "params": {"name": "hello", "arguments": {"name": name}}})
        assert "result" in receive_until(pump, answer_to(long_id))[-1]
        d.proc.kill()
        d.proc.wait()
        started.append(start_daemon(home, workspace, tmp_base, args))
        pump.send({"jsonrpc": "2.0", "id": 2, "method": "ping"})
        seen = receive_until(pump, answer_to(2))
        assert all(m.get("id") != long_id for m in seen), str(seen)[:500]


def test_a_line_the_daemon_cannot_parse_is_not_answered_at_a_restart(
    sets: None, home: Path, workspace: Path, tmp_base: Path
) -> None:
    """Python's json reads ``NaN`` and a lone surrogate (``\\udcff``: how Python writes a
    file name's undecodable byte), which the daemon's parser refuses: it answers such a
    line with a parse error whose id is null, as it cannot tell whose it is. The pump had
    noted the call in it as in flight, for ever, and the next restart answered it:
    "toolsetd went away ... the tool may have run", of a call that never ran."""
    call = b'{"jsonrpc":"2.0","id":%d,"method":"tools/call","params":{"name":"hello",'
    with pumped(home, workspace, tmp_base) as (started, d, pump):
        initialize(pump)
        pump.send(call % 2 + b'"arguments":{"name":"x","n":NaN}}}\n')
        pump.send(call % 3 + b'"arguments":{"name":"caf\\udce9"}}}\n')
        pump.send({"jsonrpc": "2.0", "id": 4, "method": "ping"})
        seen = receive_until(pump, answer_to(4))
        assert [m["error"]["code"] for m in seen if "error" in m] == [-32700, -32700], seen
        d.proc.kill()
        d.proc.wait()
        restart(started, home, workspace, tmp_base)
        pump.send({"jsonrpc": "2.0", "id": 5, "method": "ping"})
        seen += receive_until(pump, answer_to(5))
        assert [m for m in seen if m.get("id") in (2, 3)] == [], seen


#: A value nested 1,005 levels: the daemon's parser (orjson) reads 1,024, Python's json
#: some 990 (its recursion limit), where the pump read it.
_DEEP = "[" * 1005 + "]" * 1005


def test_a_request_nested_deeper_than_pythons_json_reads_is_answered_at_a_restart(
    sets: None, home: Path, workspace: Path, tmp_base: Path
) -> None:
    """The daemon serves a request nested past what Python's json reads (here in its
    ``_meta``, which nothing checks). The pump took its line for one the daemon refuses,
    with no request in it: when the daemon was killed under the call, nobody answered
    it, and the host waited for ever."""
    pid_file = workspace / "sleeper.pid"
    line = ('{"jsonrpc":"2.0","id":2,"method":"tools/call","params":{"name":"sleeper",'
            f'"arguments":{{}},"_meta":{{"x":{_DEEP}}}}}}}\n')
    with pumped(home, workspace, tmp_base) as (started, d, pump):
        try:
            initialize(pump)
            pump.send(line.encode())
            eventually(lambda: pid_file.exists() and bool(pid_file.read_text()), what="sleeper")
            killed_under_call_2(pump, d, started, home, workspace, tmp_base)
        finally:
            with contextlib.suppress(OSError, ValueError):
                os.kill(int(pid_file.read_text()), signal.SIGKILL)


@pytest.mark.parametrize(
    "wrong",
    ["[" * 1022 + "]" * 1022, "[1,,2]", '{"a" 1}', "NaN", '"caf\\udce9"'],
    ids=["deep", "comma", "colon", "nan", "surrogate"],
)
def test_a_long_line_the_daemon_cannot_parse_is_not_answered_at_a_restart(
    wrong: str, sets: None, home: Path, workspace: Path, tmp_base: Path
) -> None:
    """A line over 16 MiB that is no JSON within its params (a daemon whose line limit is
    raised takes it), or nested 1,025 levels, past the daemon's parser: the daemon refuses
    it as a parse error, whose id is null. The pump reads such a line only for its outer
    object as it streams, took its call for one in flight, and the restart answered it
    ("the tool may have run"), after that refusal. (A line ``null`` before it is JSON,
    refused otherwise, -32600: no parse error of the daemon's.)"""
    args = ["--max-message-bytes", "40000000"]
    line = ('{"jsonrpc":"2.0","id":2,"method":"tools/call","params":{"name":"hello",'
            f'"arguments":{{"name":"{"x" * 17_000_000}","wrong":{wrong}}}}}}}\n')
    with pumped(home, workspace, tmp_base, extra_args=args) as (started, d, pump):
        initialize(pump)
        pump.send(b"null\n" + line.encode())
        pump.send({"jsonrpc": "2.0", "id": 3, "method": "ping"})
        seen = receive_until(pump, answer_to(3))
        errors = [(m["id"], m["error"]["code"]) for m in seen if "error" in m]
        assert errors == [(None, -32600), (None, -32700)], errors
        d.proc.kill()
        d.proc.wait()
        started.append(start_daemon(home, workspace, tmp_base, args))
        pump.send({"jsonrpc": "2.0", "id": 4, "method": "ping"})
        seen = receive_until(pump, answer_to(4))
        assert [m for m in seen if m.get("id") == 2] == [], str(seen)[:500]


def test_an_initialize_nested_deeper_than_pythons_json_reads_is_replayed(
    sets: None, home: Path, workspace: Path, tmp_base: Path
) -> None:
    """The host's initialize nested past what Python's json reads (an experimental
    capability), which the daemon takes: the pump did not note it, replayed nothing to the
    new daemon after a restart, and the host's next request was refused there, as one of
    a session never initialized."""
    params = json.dumps(INIT).replace('"capabilities": {',
                                      f'"capabilities": {{"experimental": {{"x": {_DEEP}}}, ')
    with pumped(home, workspace, tmp_base) as (started, d, pump):
        initialize_as_written(pump, params)
        d.proc.kill()
        d.proc.wait()
        restart(started, home, workspace, tmp_base)
        listed = pump.request(2, "tools/list")  # it waits for the new daemon, if need be
        assert "hello" in {t["name"] for t in listed["result"]["tools"]}, listed


def test_an_initialize_with_a_number_past_the_double_range_is_replayed_as_written(
    sets: None, home: Path, workspace: Path, tmp_base: Path
) -> None:
    """JSON has no range: the daemon takes an initialize whose params hold ``1e999`` (an
    experimental capability, here). The pump replayed it to the new daemon parsed and
    written again, as ``Infinity``, which no JSON parser takes: the new daemon answered a
    parse error with id null, the replay stayed unanswered, and every line of the host's
    waited behind it. The ping, read once the input has ended, was never answered."""
    params = json.dumps(INIT).replace('"capabilities": {',
                                      '"capabilities": {"experimental": {"x": {"n": 1e999}}, ')
    with daemons(home, workspace, tmp_base) as started:
        d = restart(started, home, workspace, tmp_base)
        pump = RawPump(pump_args(d, workspace))
        initialize_as_written(pump, params)
        d.proc.kill()
        d.proc.wait()
        restart(started, home, workspace, tmp_base)
        receive_until(pump, lambda m: m.get("method") == "notifications/tools/list_changed")
        pump.send({"jsonrpc": "2.0", "id": 2, "method": "ping"})
        assert close(pump) == 0
        seen = [json.loads(line) for line in pump.stdout_text.splitlines()]
        assert seen == [{"jsonrpc": "2.0", "id": 2, "result": {}}], seen


def test_a_host_request_with_the_pumps_ping_id_is_answered(
    sets: None, home: Path, workspace: Path, tmp_base: Path
) -> None:
    """The pump pings the daemon under an id of its own (``toolsetctl-mcp-flush``) to
    write its answer to a cut long line between the daemon's lines, and swallows the
    ping's answer. A host request with that same id (JSON-RPC lets the host choose any)
    had its answer swallowed too, with no ping of the pump's out: the host waited for
    ever. Read once the input has ended: the daemon answers what it was sent, then
    closes, and the pump writes all of it before it exits."""
    with daemons(home, workspace, tmp_base) as started:
        d = restart(started, home, workspace, tmp_base)
        pump = RawPump(pump_args(d, workspace))
        initialize(pump)
        pump.send({"jsonrpc": "2.0", "id": "toolsetctl-mcp-flush", "method": "ping"})
        assert close(pump) == 0
        seen = [json.loads(line) for line in pump.stdout_text.splitlines()]
        assert seen == [{"jsonrpc": "2.0", "id": "toolsetctl-mcp-flush", "result": {}}], seen


#: A tool that ends once the file ``go`` is in its folder (the workspace).
_WAITS_FOR_GO = script(
    "import os, time\n"
    "while not os.path.exists('go'):\n"
    "    time.sleep(0.01)\n"
    "print('went')\n"
)


def test_a_host_request_with_the_pumps_ping_id_while_its_ping_is_out_gets_its_answer(
    sets: None, home: Path, workspace: Path, tmp_base: Path
) -> None:
    """The pump pings a new daemon when it answers a long line cut by a restart, and
    swallowed the first answer with the ping's id while the ping was out. A host request
    of that id (``toolsetctl-mcp-flush``: the host may choose it) answered in that time
    had its answer swallowed, and the host got the ping's ``{}`` as its call's result.
    Here the call is answered while the pump writes a 20 MB answer the host does not
    read yet, and the host's long line, begun while the daemon was away, ends after it."""
    write_set(home / "tools", "waits", tool("waits.py"), **{"waits.py": _WAITS_FOR_GO})
    args = ["--max-message-bytes", "40000000"]
    line = json.dumps({"jsonrpc": "2.0", "id": 2, "method": "tools/call",
                       "params": {"name": "hello", "arguments": {"name": "x" * 20_000_000}}})
    half = 17 * 1024 * 1024
    big = {"jsonrpc": "2.0", "id": 3, "method": "tools/call",
           "params": {"name": "bigimage", "arguments": {}}}
    waits = {"jsonrpc": "2.0", "id": "toolsetctl-mcp-flush", "method": "tools/call",
             "params": {"name": "waits", "arguments": {}}}
    with pumped(home, workspace, tmp_base, extra_args=args) as (started, d, pump):
        initialize(pump)
        d.proc.kill()
        d.proc.wait()
        pump.send(json.dumps(big).encode() + b"\n" + json.dumps(waits).encode() + b"\n")
        assert pump.proc.stdin is not None
        assert pump.proc.stdout is not None
        _write_all(pump.proc.stdin.fileno(), line[:half].encode())  # goes nowhere
        d = start_daemon(home, workspace, tmp_base, args)
        started.append(d)
        receive_until(pump, lambda m: m.get("method") == "notifications/tools/list_changed")
        head = pump.proc.stdout.read(64)  # the pump writes the rest as the host reads it
        assert head.startswith(b'{"jsonrpc":"2.0","id":3,"result"'), head
        (workspace / "go").touch()
        eventually(lambda: '"tool": "waits"' in d.log() or '"tool":"waits"' in d.log(),
                   what="the waiting call's end")
        _write_all(pump.proc.stdin.fileno(), line[half:].encode() + b"\n")
        pump.proc.stdout.readline()  # the rest of the 20 MB
        seen = receive_answers(pump, {2, "toolsetctl-mcp-flush"})
        assert "was not run" in answer_to_text(seen, 2)
        assert "went" in answer_to_text(seen, "toolsetctl-mcp-flush"), str(seen)[:500]


def answer_to_text(seen: list[Any], request_id: Any) -> str:
    """The text of the one tools/call result for ``request_id`` among ``seen``."""
    results = [m["result"] for m in seen if m.get("id") == request_id and "method" not in m]
    assert len(results) == 1, str(seen)[:500]
    return str(results[0].get("content", [{}])[0].get("text"))


def test_a_late_answer_to_a_question_the_old_daemon_withdrew_reaches_no_new_one(
    sets: None, home: Path, workspace: Path, tmp_base: Path
) -> None:
    """A graceful stop withdraws the daemon's open elicitation/create itself. A host that
    shows it on (many ignore a cancel of a question) sends the operator's accept late,
    once the new daemon asks its own first question, which has the same id as the daemon
    knows it (it numbers from 1 again). The pump sent the late accept on, and the new
    daemon took it for the approval of the other call: that call ran, the operator's
    decline of it came too late. Only an answer to a question open now goes on."""
    ask = {"name": "asker", "arguments": {}}
    with pumped(home, workspace, tmp_base) as (started, d, pump):
        initialize(pump)
        pump.send({"jsonrpc": "2.0", "id": 2, "method": "tools/call", "params": ask})
        old = pump.receive()
        assert old["method"] == "elicitation/create"
        assert d.stop() == 0
        restart(started, home, workspace, tmp_base)
        pump.send({"jsonrpc": "2.0", "id": 3, "method": "tools/call", "params": ask})
        new = receive_until(pump, lambda m: m.get("method") == "elicitation/create")[-1]
        pump.send({"jsonrpc": "2.0", "id": old["id"],
                   "result": {"action": "accept", "content": {}}})
        pump.send({"jsonrpc": "2.0", "id": new["id"], "result": {"action": "decline"}})
        seen = receive_until(pump, answer_to(3))
        assert seen[-1]["result"]["isError"] is True, seen
        assert "asked and ran" not in json.dumps(seen), seen


def test_a_renamed_question_is_answered_with_the_hosts_numbers_as_written(
    sets: None, home: Path, workspace: Path, tmp_base: Path
) -> None:
    """After a restart the pump gives the new daemon's questions ids of its own, and sends
    the host's answer back under the daemon's. It parsed the answer and wrote it again:
    a number past the double range (``1e999``, which JSON and the daemon take; here in
    the answer's ``_meta``) became ``Infinity``, which no parser takes, and the daemon
    never had the operator's accept: the call waited for it. Only the id is rewritten."""
    ask = {"name": "asker", "arguments": {}}
    with pumped(home, workspace, tmp_base) as (started, d, pump):
        initialize(pump)
        d.proc.kill()
        d.proc.wait()
        restart(started, home, workspace, tmp_base)
        pump.send({"jsonrpc": "2.0", "id": 2, "method": "tools/call", "params": ask})
        asked = receive_until(pump, lambda m: m.get("method") == "elicitation/create")[-1]
        assert asked["id"] != "toolsetd-elicit-1", asked
        pump.send(b'{"jsonrpc": "2.0", "id": %s, "result": {"action": "accept", "content": {},'
                  b' "_meta": {"n": 1e999}}}\n' % json.dumps(asked["id"]).encode())
        # Up to the call's answer, or the daemon's refusal of a line it cannot parse.
        seen = receive_until(pump, lambda m: m.get("id") in (2, None) and "method" not in m)
        assert "asked and ran" in answer_to_text(seen, 2), str(seen)[:500]


def _long_accept(asked_id: Any, *, id_last: bool = False) -> bytes:
    """An accept over 16 MiB (its ``_meta`` padded), its id first or (as a TypeScript
    host writes a response) last."""
    result = {"action": "accept", "content": {}, "_meta": {"pad": "x" * 17_000_000}}
    if id_last:
        return json.dumps({"result": result, "jsonrpc": "2.0", "id": asked_id}).encode() + b"\n"
    return json.dumps({"jsonrpc": "2.0", "id": asked_id, "result": result}).encode() + b"\n"


@pytest.mark.parametrize("id_last", [False, True], ids=["id-first", "id-last"])
def test_an_answer_over_16_mib_to_a_renamed_question_reaches_the_daemon_under_its_id(
    id_last: bool, sets: None, home: Path, workspace: Path, tmp_base: Path
) -> None:
    """A host answer over 16 MiB goes on as it comes; to a question a new daemon asked
    (which the pump gave an id of its own) it went under the pump's id, which the daemon
    does not know: the call waited for an answer it never had, and the host's next
    answer to that question (a decline, here) was sent on, renamed, as if it were the
    first. Now the accept goes under the daemon's id; one whose id comes last, after the
    16 MiB the pump holds, goes nowhere, and the daemon is told the answer failed."""
    args = ["--max-message-bytes", "40000000"]
    ask = {"name": "asker", "arguments": {}}
    with pumped(home, workspace, tmp_base, extra_args=args) as (started, d, pump):
        initialize(pump)
        d.proc.kill()
        d.proc.wait()
        started.append(start_daemon(home, workspace, tmp_base, args))
        pump.send({"jsonrpc": "2.0", "id": 2, "method": "tools/call", "params": ask})
        asked = receive_until(pump, lambda m: m.get("method") == "elicitation/create")[-1]
        assert asked["id"] != "toolsetd-elicit-1", asked
        pump.send(_long_accept(asked["id"], id_last=id_last))
        pump.send({"jsonrpc": "2.0", "id": asked["id"], "result": {"action": "decline"}})
        done = receive_until(pump, answer_to(2))[-1]
        text = json.dumps(done)
        if id_last:
            assert "could not ask the operator" in text, done
        else:
            assert "asked and ran" in text, done


def test_a_question_answered_over_16_mib_is_not_withdrawn_at_the_next_restart(
    sets: None, home: Path, workspace: Path, tmp_base: Path
) -> None:
    """The pump withdraws (notifications/cancelled) the questions a daemon that went away
    left open at the host; one the host had answered with a line over 16 MiB was still
    open for it, and withdrawn after its answer."""
    args = ["--max-message-bytes", "40000000"]
    ask = {"name": "asker", "arguments": {}}
    with pumped(home, workspace, tmp_base, extra_args=args) as (started, d, pump):
        initialize(pump)
        pump.send({"jsonrpc": "2.0", "id": 2, "method": "tools/call", "params": ask})
        asked = receive_until(pump, lambda m: m.get("method") == "elicitation/create")[-1]
        pump.send(_long_accept(asked["id"]))
        assert "asked and ran" in json.dumps(receive_until(pump, answer_to(2))[-1])
        d.proc.kill()
        d.proc.wait()
        started.append(start_daemon(home, workspace, tmp_base, args))
        pump.send({"jsonrpc": "2.0", "id": 3, "method": "ping"})
        seen = receive_until(pump, answer_to(3))
        assert [m for m in seen if m.get("method") == "notifications/cancelled"] == [], seen


def test_a_request_cancelled_while_it_waited_is_not_answered_at_the_next_restart(
    sets: None, home: Path, workspace: Path, tmp_base: Path
) -> None:
    """A request the host sent and then cancelled while the pump reconnected goes to the
    new daemon with its cancel behind it, and gets no answer (MCP: none after a cancel).
    The pump must not keep it as in flight: at the next restart it answered it, a response
    to a request the host had given up."""
    with daemons(home, workspace, tmp_base) as started:
        d = restart(started, home, workspace, tmp_base)
        pump = RawPump(pump_args(d, workspace))
        pid_file = workspace / "sleeper.pid"

        def listed(m: Any) -> bool:
            return bool(m.get("method") == "notifications/tools/list_changed")

        try:
            initialize(pump)
            assert d.stop() == 0
            pump.send({"jsonrpc": "2.0", "id": 2, "method": "tools/call",
                       "params": {"name": "sleeper", "arguments": {}}})
            pump.send({"jsonrpc": "2.0", "method": "notifications/cancelled",
                       "params": {"requestId": 2, "reason": "the user gave up"}})
            d = restart(started, home, workspace, tmp_base)
            seen = receive_until(pump, listed)
            assert pump.request(3, "ping") == {"jsonrpc": "2.0", "id": 3, "result": {}}
            d.proc.kill()
            d.proc.wait()
            restart(started, home, workspace, tmp_base)
            seen += receive_until(pump, listed)
            assert pump.request(4, "ping")["result"] == {}
            assert all(m.get("id") != 2 for m in seen), seen
        finally:
            assert close(pump) == 0
            if pid_file.exists() and pid_file.read_text():
                with contextlib.suppress(OSError):
                    os.kill(int(pid_file.read_text()), signal.SIGKILL)


@pytest.mark.slow
def test_a_daemon_that_keeps_dying_ends_the_pump(
    sets: None, home: Path, workspace: Path, tmp_base: Path
) -> None:
    """A daemon that binds, answers, then dies, over and over (a crash loop): each answer
    restarted the reconnect window, so the pump reconnected for ever. More than 10 losses
    within 60 s end it: exit 5 and a line that says so."""
    with daemons(home, workspace, tmp_base) as started:
        d = restart(started, home, workspace, tmp_base)
        pump = RawPump(pump_args(d, workspace))
        try:
            initialize(pump)
            for n in range(2, 13):
                d.proc.kill()
                d.proc.wait()
                if pump.proc.poll() is not None:
                    break
                d = restart(started, home, workspace, tmp_base)
                with contextlib.suppress(BrokenPipeError, EOFError):
                    # Answered by this daemon (it bound), or the pump gave up already.
                    pump.send({"jsonrpc": "2.0", "id": n, "method": "ping"})
                    receive_until(pump, answer_to(n))
            assert pump.proc.wait(timeout=60) == 5
            assert pump.proc.stderr is not None
            said = pump.proc.stderr.read().decode()
        finally:
            pump.proc.kill()
            pump.proc.wait()
            for pipe in (pump.proc.stdin, pump.proc.stdout, pump.proc.stderr):
                with contextlib.suppress(OSError):
                    if pipe is not None:
                        pipe.close()
        assert said.count("\n") == 1 and "11 times within 60 s" in said, said


@pytest.mark.slow
def test_a_full_backlog_during_the_reconnect_is_tried_again(
    sets: None, home: Path, workspace: Path, tmp_base: Path
) -> None:
    """While the pump reconnects, the listener at the socket has a full backlog for longer
    than a first connect waits (5 s): a daemon starting or busy. The pump does not give up
    (it exited 5 at once): it tries again within its window, and the request that waited
    is answered by the daemon that then comes.

    That daemon is started beforehand at a socket of its own, linked at the path once the
    backlog is gone: started then, its start took what the full backlog had left of the
    window (30 s) on a loaded machine, and the pump gave up as it should."""
    with daemons(home, workspace, tmp_base) as started:
        d = restart(started, home, workspace, tmp_base)
        (tmp_base / "next").mkdir()
        coming = start_daemon(home, workspace, tmp_base / "next")
        started.append(coming)
        pump = RawPump(pump_args(d, workspace))
        try:
            initialize(pump)
            d.proc.kill()
            d.proc.wait()
            # Someone listening that accepts nothing, its backlog full (listen(0) holds one).
            d.socket.unlink()
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as stuck:
                stuck.bind(str(d.socket))
                stuck.listen(0)
                filler = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                filler.connect(str(d.socket))
                pump.send({"jsonrpc": "2.0", "id": 2, "method": "tools/call", "params": HELLO})
                with pytest.raises(subprocess.TimeoutExpired):
                    pump.proc.wait(timeout=7)  # more than the 5 s a first connect waits
                filler.close()
            d.socket.unlink()
            os.link(coming.socket, d.socket)
            seen = receive_until(pump, answer_to(2))
            assert "again" in seen[-1]["result"]["content"][0]["text"], seen
        finally:
            assert close(pump) == 0


META = {"io.modelcontextprotocol/protocolVersion": MODERN,
        "io.modelcontextprotocol/clientCapabilities": {}}
LISTEN = {"_meta": META, "notifications": {"toolsListChanged": True}}
ACKNOWLEDGED = "notifications/subscriptions/acknowledged"
LIST_CHANGED = "notifications/tools/list_changed"


def on_stream(method: str, subscription: Any) -> Any:
    """Whether a message is a ``method`` notification on the listen ``subscription``."""
    return lambda m: m.get("method") == method and m["params"]["_meta"] == {
        "io.modelcontextprotocol/subscriptionId": subscription}


def listen(pump: RawPump, subscription: Any) -> list[Any]:
    """Open a listen stream (list_changed) and read up to its acknowledgement."""
    pump.send({"jsonrpc": "2.0", "id": subscription, "method": "subscriptions/listen",
               "params": LISTEN})
    return receive_until(pump, on_stream(ACKNOWLEDGED, subscription))


def test_a_listen_open_during_a_sigkill_goes_on_with_the_new_daemon(
    sets: None, home: Path, workspace: Path, tmp_base: Path
) -> None:
    """A 2026-07-28 host's subscriptions/listen, open when the daemon is killed: the pump
    sends it to the new daemon (same id, same params) instead of answering it with an
    error, tells the stream list_changed (the catalog may differ now), and the new daemon's
    list_changed then comes on the host's same stream. The stream is acknowledged once:
    the new daemon's acknowledgement of the resent listen (it came to the host a second
    time) is the pump's, not the host's."""
    with pumped(home, workspace, tmp_base) as (started, d, pump):
        listen(pump, "sub")
        d.proc.kill()
        d.proc.wait()
        restart(started, home, workspace, tmp_base)
        seen = receive_until(pump, on_stream(LIST_CHANGED, "sub"))  # the pump's
        # The new daemon has the catalog (the listen's snapshot to differ from).
        pump.send({"jsonrpc": "2.0", "id": 2, "method": "tools/list",
                   "params": {"_meta": META}})
        seen += receive_until(pump, answer_to(2))
        assert "progress3" in {t["name"] for t in seen[-1]["result"]["tools"]}
        (home / "tools" / "progress3" / "tools.json").unlink()
        # The new daemon's, which it sends only once the listen is acknowledged.
        seen += receive_until(pump, on_stream(LIST_CHANGED, "sub"))
        assert all(m.get("id") != "sub" for m in seen), seen  # not ended
        assert not [m for m in seen if on_stream(ACKNOWLEDGED, "sub")(m)], seen
        tools = pump.request(3, "tools/list", {"_meta": META})["result"]["tools"]
        assert "progress3" not in {t["name"] for t in tools}


@pytest.mark.slow  # the stop waits for the sleeper's call to end
@pytest.mark.parametrize("double", [False, True], ids=["alone", "then-one-under-its-id"])
def test_a_call_sent_while_the_daemon_stops_goes_to_the_next_one(
    double: bool, sets: None, home: Path, workspace: Path, tmp_base: Path
) -> None:
    """A graceful stop waits for the calls that run (a sleeper, here); a call the host
    sends meanwhile is refused by the stopping daemon before it starts anything (-32010).
    It was passed on: a restart that should have kept the session failed the call. The
    pump sends it to the next daemon instead, as one sent a moment later, and the host
    gets that daemon's answer. A second call the host sent under its id while it was in
    flight (MCP forbids it; JSON-RPC leaves ids to the host) kept its line in the first's
    place: the next daemon ran the second call as the first's retry."""
    pid_file = workspace / "sleeper.pid"
    with pumped(home, workspace, tmp_base) as (started, d, pump):
        initialize(pump)
        listen(pump, "sub")
        pump.send({"jsonrpc": "2.0", "id": 2, "method": "tools/call",
                   "params": {"name": "sleeper", "arguments": {}}})
        eventually(lambda: pid_file.exists() and bool(pid_file.read_text()), what="sleeper")
        d.proc.send_signal(signal.SIGTERM)
        seen = receive_until(pump, answer_to("sub"))  # ended: the daemon is stopping
        call = {"jsonrpc": "2.0", "id": 3, "method": "tools/call", "params": HELLO}
        second = {**call, "params": {**HELLO, "arguments": {"name": "the second"}}}
        pump.send(json.dumps(call).encode() + b"\n" + (json.dumps(second).encode() + b"\n"
                                                       if double else b""))
        seen += receive_until(pump, answer_to(2))  # the sleeper's, cancelled by the stop
        assert d.proc.wait(timeout=30) == 0
        restart(started, home, workspace, tmp_base)
        def answered(m: Any) -> bool:  # not the second's refusal, when there is one
            return bool(answer_to(3)(m)) and "result" in m

        if not [m for m in seen if answered(m)]:  # the stopping daemon's refusal, else
            seen += receive_until(pump, answered)
        answers = [m for m in seen if answered(m)]
        assert len(answers) == 1, seen
        assert "again" in answers[0]["result"]["content"][0]["text"], answers


def test_a_listen_opened_again_after_a_graceful_restart_is_told_list_changed(
    sets: None, home: Path, workspace: Path, tmp_base: Path
) -> None:
    """A graceful stop ends the host's listen with its completion result; the host opens
    it again, and the new daemon acknowledges it. What changed while no daemon served it
    was told to no stream: the pump tells the new stream list_changed after its
    acknowledgement, as it tells a legacy host after a restart (and a listen it resent
    after a crash). It was told nothing, and went on with the old daemon's list."""
    with pumped(home, workspace, tmp_base) as (started, d, pump):
        listen(pump, "sub")
        assert d.stop() == 0
        ended = receive_until(pump, answer_to("sub"))[-1]
        assert ended["result"]["resultType"] == "complete", ended
        (home / "tools" / "progress3" / "tools.json").unlink()  # in the gap
        # Sent again while no daemon answers: it waits for the new one.
        pump.send({"jsonrpc": "2.0", "id": "sub2", "method": "subscriptions/listen",
                   "params": LISTEN})
        restart(started, home, workspace, tmp_base)
        seen = receive_until(pump, on_stream(ACKNOWLEDGED, "sub2"))
        pump.send({"jsonrpc": "2.0", "id": 2, "method": "ping"})
        seen += receive_until(pump, answer_to(2))
        # Acknowledged once, and told after that (MCP: nothing on a stream before).
        stream = [m["method"] for m in seen
                  if "method" in m and m["params"]["_meta"] == {
                      "io.modelcontextprotocol/subscriptionId": "sub2"}]
        assert stream == [ACKNOWLEDGED, LIST_CHANGED], seen
        # Only a stream opened again: a listen the host opens later is not told.
        seen = listen(pump, "sub3")
        pump.send({"jsonrpc": "2.0", "id": 3, "method": "ping"})
        seen += receive_until(pump, answer_to(3))
        assert not [m for m in seen if m.get("method") == LIST_CHANGED], seen


@pytest.mark.anyio
async def test_the_sdk_hosts_listen_across_a_graceful_restart(
    sets: None, home: Path, workspace: Path, tmp_base: Path
) -> None:
    """The SDK host (2026-07-28) sees its listen end gracefully when the daemon stops, and
    listens again ("re-listen and refetch"): the new stream's first event is the change
    made while no daemon served it."""
    with daemons(home, workspace, tmp_base) as started:
        d = restart(started, home, workspace, tmp_base)
        with anyio.fail_after(30):
            async with Client(server(d, workspace)) as client:
                async with client.listen(tools_list_changed=True) as sub:
                    assert d.stop() == 0
                    assert [event async for event in sub] == []  # ended, not lost
                (home / "tools" / "progress3" / "tools.json").unlink()
                restart(started, home, workspace, tmp_base)
                async with client.listen(tools_list_changed=True) as sub:
                    async for _event in sub:
                        break
                tools = {t.name for t in (await client.list_tools()).tools}
                assert "progress3" not in tools
                assert "hello" in tools


#: A toolsetd that no longer serves what the host agreed on (a downgrade): its main, run
#: with the MCP session serving 2025-06-18 only, or refusing every initialize.
_DOWNGRADED = (
    "import sys\n"
    "import toolsetd.daemon.mcp_session as session\n"
    "from toolsetd.daemon.mcp_mapping import McpError\n"
    "def refuse(params):\n"
    "    raise McpError(-32602, 'Invalid params: not this one')\n"
    "if sys.argv.pop(1) == 'version':\n"
    "    session.HANDSHAKE_VERSIONS = ('2025-06-18',)\n"
    "else:\n"
    "    session._check_initialize = refuse\n"
    "from toolsetd.daemon.app import main\n"
    "sys.exit(main())\n"
)


@pytest.mark.parametrize("how", ["version", "refused"])
def test_a_new_daemon_that_does_not_agree_to_the_hosts_session_ends_the_pump(
    sets: None, home: Path, workspace: Path, tmp_base: Path, how: str
) -> None:
    """The new daemon answers the replayed initialize with another protocol version than
    the one the host was given (a toolsetd downgraded across the restart), or with an
    error: the host would go on speaking a version the session did not agree on, so the
    pump ends (exit 5, one line on stderr): the host starts the server again and
    negotiates anew. A call that waited for the new daemon is not sent to it before it
    has agreed (it went right behind the replay, and may have run, in a session the host
    never had): the pump answers it as not sent."""
    with daemons(home, workspace, tmp_base) as started:
        d = restart(started, home, workspace, tmp_base)
        pump = RawPump(pump_args(d, workspace))
        try:
            initialize(pump)
            assert d.stop() == 0
            pump.send({"jsonrpc": "2.0", "id": 2, "method": "tools/call", "params": HELLO})
            started.append(start_daemon(
                home, workspace, tmp_base, launcher=[sys.executable, "-c", _DOWNGRADED, how]))
            assert pump.proc.wait(timeout=30) == 5
        finally:
            code = close(pump)
        said = pump.stderr()
        answers = [json.loads(line) for line in pump.stdout_text.splitlines()]
        waited = [m for m in answers if m.get("id") == 2]
        assert len(waited) == 1, answers
        assert waited[0]["result"]["isError"] is True, waited
        assert "was not sent" in waited[0]["result"]["content"][0]["text"], waited
        expected = "2025-06-18" if how == "version" else "refused the host's initialize"
        assert said.count("\n") == 1 and expected in said, said
        assert code == 5


def test_a_listen_cancelled_while_the_replay_is_unanswered_ends_at_the_new_daemon(
    sets: None, home: Path, workspace: Path, tmp_base: Path
) -> None:
    """A host that initialized and listens (both eras, one connection): the daemon is
    killed, and the pump sends the new one the replayed initialize and the open listen.
    The host cancels the listen before the replay is answered. A cancel never waits, and
    this one was dropped: the listen the new daemon has was never cancelled, and its
    list_changed kept coming on a stream the host had ended. The cancel goes to the
    daemon that has the listen. (Its acknowledgement may still come, sent before the
    cancel arrived: MCP has the host ignore what comes after its cancel.)"""
    _needs_syscall()
    gate = tmp_base / "answer-initialize"
    with pumped(home, workspace, tmp_base) as (started, d, pump):
        initialize(pump)
        listen(pump, "sub")
        d.proc.kill()
        d.proc.wait()
        started.append(start_daemon(home, workspace, tmp_base, launcher=[
            sys.executable, "-c", _SLOW_INITIALIZE, str(gate)]))
        # Told once the pump is bound and has sent the replay and the listen.
        seen = receive_until(pump, lambda m: m.get("method") == LIST_CHANGED
                             and "params" not in m)
        pump.send({"jsonrpc": "2.0", "method": "notifications/cancelled",
                   "params": {"requestId": "sub"}})
        eventually(lambda: _stdin_taken(pump), what="the cancel read by the pump")
        gate.touch()
        pump.send({"jsonrpc": "2.0", "id": 2, "method": "ping"})
        seen += receive_until(pump, answer_to(2))
        (home / "tools" / "progress3" / "tools.json").unlink()
        asked = iter(range(3, 1000))

        def reloaded() -> bool:  # the change is in the new daemon's catalog
            request_id = next(asked)
            pump.send({"jsonrpc": "2.0", "id": request_id, "method": "tools/list",
                       "params": {"_meta": META}})
            seen.extend(receive_until(pump, answer_to(request_id)))
            return "progress3" not in {t["name"] for t in seen[-1]["result"]["tools"]}

        eventually(reloaded, what="the set removed")
        pump.send({"jsonrpc": "2.0", "id": 2000, "method": "ping"})
        seen += receive_until(pump, answer_to(2000))
        on_sub = [m["method"] for m in seen if "method" in m and m.get("params", {}).get(
            "_meta") == {"io.modelcontextprotocol/subscriptionId": "sub"}]
        # The pump's list_changed as it resent the listen, before the cancel; none of the
        # new daemon's for the change made after it.
        assert on_sub.count(LIST_CHANGED) == 1, seen
        assert on_sub[0] == LIST_CHANGED, seen
        assert all(m.get("id") != "sub" for m in seen), seen  # cancelled: no answer
