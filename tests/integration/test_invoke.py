"""invoke end to end: a real daemon, real children, every event and result on the wire.

One daemon (progress every 0.2 s) serves the example sets plus a home set ``t`` of small
``/bin/sh`` tools written here; a few tests start their own daemon for a setting
(``--max-running 1``). Every wait polls against a deadline; nothing sleeps a fixed time.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from .conftest import EXAMPLES, Daemon, RawConn, eventually, start_daemon, write_set

# -- the tools -------------------------------------------------------------------------

_SH = "#!/bin/sh\n"

T_TOOLS: dict[str, tuple[dict[str, Any], str]] = {
    # name: (extra tool fields, script body)
    "ok": ({}, 'echo out\necho err >&2\n'),
    "fail": ({}, 'echo bad\nexit 3\n'),
    "sleeper": ({}, 'sleep "${2:-1}"\necho slept\n'),
    "family": ({}, 'sleep 100 &\necho $! > "$CRYSTAL_PROJECT_DATA/$TOOLSETD_CALL_ID.pid"\nwait\n'),
    "env": ({}, "env\n"),
    "big": ({}, "head -c 300000 /dev/zero | tr '\\000' a\n"),
    "flood": ({}, "head -c 5000000 /dev/zero >&2 &\nhead -c 5000000 /dev/zero\nwait\n"),
    "echoid": ({}, 'echo "id=$TOOLSETD_CALL_ID"\n'),
    "render": ({"argv": {"obj": "--obj"}}, "echo should-not-run > ran-render\n"),
    "orphan": ({}, 'sleep 100 &\necho $!\n'),
    "fds": ({}, 'echo "$TOOLSETD_PROGRESS_FD"\nls /proc/$$/fd\n'),
    "pwd": ({}, "pwd\n"),
    "selfkill": ({}, "echo x\nkill -9 $$\n"),
    "uni": ({}, "head -c 150000 /dev/zero | tr '\\000' '\\001' | sed 's/\\x01/\\xc3\\xa9/g'\n"),
    "exact": ({"argv": {"n": "-n"}}, "head -c \"$2\" /dev/zero | tr '\\000' b\n"),
    "plainprog": ({}, '#!/bin/bash\necho "just text" >&$TOOLSETD_PROGRESS_FD\nsleep 0.4\n'),
    "longprog": ({}, "#!/bin/bash\nhead -c 10000 /dev/zero | tr '\\000' x >&$TOOLSETD_PROGRESS_FD\n"
                     "echo >&$TOOLSETD_PROGRESS_FD\nsleep 0.4\n"),
    "nonlprog": ({}, "#!/bin/bash\nprintf 'first\\n' >&$TOOLSETD_PROGRESS_FD\nsleep 0.3\n"
                     "printf 'last-without-newline' >&$TOOLSETD_PROGRESS_FD\nsleep 0.3\n"),
}


def _t_manifest() -> dict[str, Any]:
    tools = []
    for name, (extra, _) in T_TOOLS.items():
        tool: dict[str, Any] = {
            "name": name,
            "description": f"test tool {name}",
            "schema": {"type": "object"},
            "command": [f"{name}.sh"],
        }
        if name == "sleeper":
            tool["argv"] = {"secs": "--secs"}
        tool.update(extra)
        tools.append(tool)
    return {
        "runner": "exec", "command": [], "stdin": False, "approval": "always",
        "timeoutSeconds": 60, "tools": tools,
    }


def _write_sets(tools_root: Path) -> None:
    shutil.copytree(EXAMPLES, tools_root, dirs_exist_ok=True)
    files = {f"{name}.sh": body if body.startswith("#!") else _SH + body
             for name, (_, body) in T_TOOLS.items()}
    write_set(tools_root, "t", _t_manifest(), **files)
    write_set(tools_root, "slowset", {
        "runner": "exec", "description": "sleeps past its timeout", "schema": {"type": "object"},
        "command": ["slow.sh"], "stdin": False, "approval": "always", "timeoutSeconds": 1,
    }, **{"slow.sh": _SH + "echo before\nsleep 30\necho after\n"})
    write_set(tools_root, "prog", {
        "runner": "exec", "description": "reports progress", "schema": {"type": "object"},
        "command": ["prog.sh"], "stdin": False, "approval": "always",
    }, **{"prog.sh": "#!/bin/bash\n"
          "echo '{\"message\":\"half\",\"fraction\":0.5}' >&$TOOLSETD_PROGRESS_FD\n"
          "sleep 0.5\necho done\n"})
    write_set(tools_root, "stubborn", {
        "runner": "exec", "description": "ignores SIGTERM", "schema": {"type": "object"},
        "command": ["stubborn.sh"], "stdin": False, "approval": "always", "timeoutSeconds": 1,
    }, **{"stubborn.sh": _SH + "trap '' TERM\nsleep 30\n"})
    write_set(tools_root, "noread", {
        "runner": "exec", "description": "never reads stdin", "schema": {"type": "object"},
        "command": ["noread.sh"], "stdin": True, "approval": "always",
    }, **{"noread.sh": _SH + "echo quick\n"})
    write_set(tools_root, "noexec", {
        "runner": "exec", "description": "not executable", "schema": {"type": "object"},
        "command": ["noexec.sh"], "stdin": False, "approval": "always",
    }, **{"noexec.sh": _SH + "echo hi\n"})
    (tools_root / "noexec" / "noexec.sh").chmod(0o644)
    write_set(tools_root, "missing", {
        "runner": "exec", "description": "no such program", "schema": {"type": "object"},
        "command": ["toolsetd-no-such-program-xyz"], "stdin": False, "approval": "always",
    })


class Env:
    """The module's daemon and workspace."""

    def __init__(self, daemon: Daemon, workspace: Path) -> None:
        self.daemon = daemon
        self.workspace = workspace

    def params(self, tool: str, arguments: dict[str, Any] | None = None, **extra: Any) -> dict[str, Any]:
        return {"tool": tool, "arguments": arguments or {}, "workspace": str(self.workspace), **extra}

    def invoke(self, tool: str, arguments: dict[str, Any] | None = None, **extra: Any
               ) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        with self.daemon.raw(timeout=30) as conn:
            return conn.invoke(self.params(tool, arguments, **extra))

    def status(self) -> dict[str, Any]:
        return self.daemon.call("status")["result"]


@pytest.fixture(scope="module")
def env() -> Iterator[Env]:
    """One daemon for the module: example sets plus the test sets, progress every 0.2 s."""
    base = Path(tempfile.mkdtemp(prefix="tsi-"))
    home = base / "home"
    _write_sets(home / "tools")
    workspace = base / "ws"
    workspace.mkdir()
    d = start_daemon(home, workspace, base, ["--progress-interval", "0.2", "--kill-grace", "2"])
    try:
        yield Env(d, workspace)
    finally:
        d.stop()
        shutil.rmtree(base, ignore_errors=True)


# -- helpers ---------------------------------------------------------------------------


def pid_gone(pid: int) -> bool:
    """Whether a process no longer runs (gone, or a zombie nobody reaped yet)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except (FileNotFoundError, ProcessLookupError):
        return True


def read_pidfile(path: Path, timeout: float = 10.0) -> int:
    eventually(lambda: path.exists() and path.read_text().strip() != "", timeout, f"{path}")
    return int(path.read_text().strip())


def check_event_order(events: list[dict[str, Any]], call_id: str, started: bool = True) -> None:
    """started once, progress only between it and completed (queued before), completed once."""
    mine = [e for e in events if e.get("params", {}).get("callId") == call_id]
    kinds = [e["method"] for e in mine]
    if not started:
        assert [k for k in kinds if k != "progress"] == [], kinds
        return
    assert kinds.count("started") == 1, kinds
    assert kinds.count("completed") == 1, kinds
    assert kinds[-1] == "completed", kinds
    first = kinds.index("started")
    for e in mine[:first]:
        assert e["method"] == "progress" and e["params"].get("queued") is True, mine
    for e in mine[first + 1:-1]:
        assert e["method"] == "progress" and "queued" not in e["params"], mine


def text_of(result: dict[str, Any]) -> str:
    return "".join(c["text"] for c in result["content"] if c["type"] == "text")


def start_call(conn: RawConn, params: dict[str, Any], request_id: Any = "slow") -> dict[str, Any]:
    """Send an invoke and read up to its started event; returns the started params."""
    conn.send({"jsonrpc": "2.0", "method": "invoke", "id": request_id, "params": params})
    while True:
        message = conn.receive()
        if message.get("method") == "started":
            return message["params"]
        assert "id" not in message, message


def finish_call(conn: RawConn, request_id: Any = "slow") -> tuple[list[dict[str, Any]], dict[str, Any]]:
    events = []
    while True:
        message = conn.receive()
        if message.get("id") == request_id and "method" not in message:
            return events, message
        events.append(message)


# -- events per outcome ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("tool", "arguments", "status", "exit_code", "is_error"),
    [
        ("ok", {}, "ok", 0, False),
        ("fail", {}, "error", 3, True),
        pytest.param("slowset", {}, "timeout", None, True, marks=pytest.mark.slow),
    ],
)
def test_invoke_events_started_progress_completed_then_response(
    env: Env, tool: str, arguments: dict[str, Any], status: str, exit_code: int | None,
    is_error: bool,
) -> None:
    """ok, error and timeout calls each yield one started, progress, one completed, then the response."""
    call_id = f"ev-{tool}"
    events, reply = env.invoke(tool, arguments, callId=call_id)
    result = reply["result"]
    check_event_order(events, call_id)
    started = events[0]["params"]
    assert started["tool"] == tool and started["set"] in ("t", "slowset")
    assert isinstance(started["pid"], int) and started["pid"] > 0
    completed = events[-1]["params"]
    assert completed == {
        "callId": call_id, "status": status, "exitCode": exit_code,
        "durationMs": result["durationMs"], "truncated": False,
    }
    assert result["callId"] == call_id
    assert (result["status"], result["exitCode"], result["isError"]) == (status, exit_code, is_error)
    assert result["truncated"] is False and result["outputPath"] is None
    if tool == "ok":
        assert result["content"] == [{"type": "text", "text": "exit 0\nout\n\nerr\n"}]
    elif tool == "fail":
        assert result["content"] == [{"type": "text", "text": "exit 3\nbad\n"}]
    else:
        assert result["content"] == [
            {"type": "text", "text": "The command timed out after 1 second."}
        ]
        assert 900 <= result["durationMs"] < 10_000
        assert len([e for e in events if e["method"] == "progress"]) >= 2


def test_invoke_render_error_gets_only_the_response(env: Env) -> None:
    """A call whose argv cannot be rendered starts nothing: no events, an isError result."""
    events, reply = env.invoke("render", {"obj": {"a": 1}}, callId="render-1")
    assert events == []
    result = reply["result"]
    assert result["isError"] is True
    assert result["status"] == "error"
    assert result["exitCode"] is None
    assert "Argument for '--obj' must be a string, number, boolean, or string array." in text_of(result)
    assert not (env.workspace / "ran-render").exists()


@pytest.mark.slow
def test_invoke_periodic_progress_counts_up(env: Env) -> None:
    """A 1 s child under a 0.2 s progress interval gets several progress events, elapsedMs rising."""
    events, reply = env.invoke("sleeper", {"secs": "1"}, callId="periodic-1")
    assert reply["result"]["status"] == "ok"
    check_event_order(events, "periodic-1")
    elapsed = [e["params"]["elapsedMs"] for e in events if e["method"] == "progress"]
    assert len(elapsed) >= 2, events
    assert elapsed == sorted(elapsed) and elapsed[0] < elapsed[-1]
    for e in events:
        if e["method"] == "progress":
            assert set(e["params"]) >= {"callId", "elapsedMs", "stdoutBytes", "stderrBytes"}


def test_invoke_child_progress_through_the_fd(env: Env) -> None:
    """A JSON line on TOOLSETD_PROGRESS_FD becomes a progress with its message and fraction."""
    events, reply = env.invoke("prog", callId="childprog-1")
    assert reply["result"]["content"][0]["text"] == "exit 0\ndone\n"
    check_event_order(events, "childprog-1")
    reported = [e["params"] for e in events if e["params"].get("message") == "half"]
    assert len(reported) == 1, events
    assert reported[0]["fraction"] == 0.5


# -- the example tools -----------------------------------------------------------------


def test_invoke_example_hello(env: Env) -> None:
    """hello greets by name with the exit line first."""
    _, reply = env.invoke("hello", {"name": "Ada"})
    assert reply["result"]["content"] == [{"type": "text", "text": "exit 0\nHello, Ada!\n"}]
    assert reply["result"]["status"] == "ok"


def test_invoke_example_notes_add_then_list(env: Env) -> None:
    """notes_add (stdin JSON, approved) writes into the project data folder; notes_list reads it back."""
    _, reply = env.invoke("notes_add", {"text": "buy milk", "tags": ["home", "x"]}, approved=True)
    assert reply["result"]["content"][0]["text"] == "exit 0\nAdded note (8 characters).\n"
    data = env.workspace / ".crystal" / "data" / "tools" / "Acme.Notes"
    assert (data / "notes.jsonl").is_file()
    _, reply = env.invoke("notes_list", {"limit": 5})
    assert "- buy milk [home, x]" in reply["result"]["content"][0]["text"]


def test_invoke_example_notes_add_needs_approval(env: Env) -> None:
    """notes_add inherits approval, so without approved it is refused with -32004."""
    _, reply = env.invoke("notes_add", {"text": "x"})
    assert reply["error"]["code"] == -32004


def test_invoke_example_notes_index_relative_path(env: Env) -> None:
    """notes_index gets its relative path argument as an absolute path and reports progress."""
    docs = env.workspace / "docs"
    docs.mkdir(exist_ok=True)
    for i in range(3):
        (docs / f"f{i}.txt").write_text("one two three\n")
    events, reply = env.invoke("notes_index", {"path": "docs"}, approved=True, callId="index-1")
    text = reply["result"]["content"][0]["text"]
    assert f"Indexed 3 files, 9 words under {docs.resolve()}." in text, text
    check_event_order(events, "index-1")
    messages = [e["params"].get("message") for e in events if e["method"] == "progress"]
    assert any(m and m.startswith("indexed ") and m.endswith(" of 3 files") for m in messages)


def test_invoke_example_swatch_images(env: Env) -> None:
    """swatch answers a text block and a PNG image block."""
    _, reply = env.invoke("swatch", {"color": "#00ff00"})
    result = reply["result"]
    assert result["isError"] is False
    kinds = [c["type"] for c in result["content"]]
    assert kinds == ["text", "image"]
    assert result["content"][0]["text"].startswith("Swatch #00ff00 = rgb(0, 255, 0)")
    image = result["content"][1]
    assert image["mimeType"] == "image/png"
    import base64
    assert base64.b64decode(image["data"]).startswith(b"\x89PNG\r\n\x1a\n")


def test_invoke_example_swatch_without_images(env: Env) -> None:
    """swatch for a caller that cannot take images fails with the reference text."""
    _, reply = env.invoke("swatch", {"color": "#00ff00"}, images=False)
    result = reply["result"]
    assert result["isError"] is True
    assert result["content"] == [{"type": "text", "text": "This model cannot accept tool images."}]


# -- environment and output ------------------------------------------------------------


def test_invoke_environment_of_the_child(env: Env) -> None:
    """The child gets the five CRYSTAL_ variables and toolsetd's two, and no systemd ones."""
    _, reply = env.invoke("env", callId="env-call.1", session="sess-42", mode="edit")
    text = reply["result"]["content"][0]["text"]
    assert text.startswith("exit 0\n")
    variables = dict(line.split("=", 1) for line in text.splitlines()[1:] if "=" in line)
    ws = env.workspace.resolve()
    assert variables["CRYSTAL_WORKSPACE"] == str(ws)
    assert variables["CRYSTAL_SESSION"] == "sess-42"
    assert variables["CRYSTAL_APPROVAL"] == "edit"
    assert variables["CRYSTAL_TOOL_DATA"] == str(env.daemon.home / "data" / "tools" / "t")
    assert variables["CRYSTAL_PROJECT_DATA"] == str(ws / ".crystal" / "data" / "tools" / "t")
    assert Path(variables["CRYSTAL_TOOL_DATA"]).is_dir()
    assert Path(variables["CRYSTAL_PROJECT_DATA"]).is_dir()
    assert variables["TOOLSETD_CALL_ID"] == "env-call.1"
    assert variables["TOOLSETD_PROGRESS_FD"].isdigit()
    for name in ("LISTEN_FDS", "LISTEN_PID", "LISTEN_FDNAMES", "NOTIFY_SOCKET"):
        assert name not in variables


def test_invoke_environment_defaults_session_and_mode(env: Env) -> None:
    """Without session and mode the child sees an empty session and mode 'default'."""
    _, reply = env.invoke("env")
    lines = reply["result"]["content"][0]["text"].splitlines()
    assert "CRYSTAL_SESSION=" in lines
    assert "CRYSTAL_APPROVAL=default" in lines


def test_invoke_truncation_spills_the_whole_output(env: Env) -> None:
    """300,000 characters are cut with the marker and hint; outputPath holds all of them."""
    events, reply = env.invoke("big", callId="big-1")
    result = reply["result"]
    assert result["truncated"] is True
    assert events[-1]["params"]["truncated"] is True
    folder = env.workspace.resolve() / ".crystal" / "data" / "tools" / "t" / "tool-output"
    path = Path(result["outputPath"])
    assert path.parent == folder
    assert path.name.startswith("big-1")
    assert path.read_text() == "a" * 300_000
    assert result["stdoutBytes"] == 300_000
    text = text_of(result)
    marker = "\n[truncated to 100000 characters]"
    head, _, tail = text.partition(marker)
    assert head == ("exit 0\n" + "a" * 300_000)[:100_000]
    assert tail == f"\n[full output: {path} (300000 bytes); read it with a file tool]"


def test_invoke_large_stdout_and_stderr_counted_exactly(env: Env) -> None:
    """5 MB on each of stdout and stderr at once: the call completes with exact byte counts."""
    events, reply = env.invoke("flood", callId="flood-1")
    result = reply["result"]
    assert result["status"] == "ok", result["status"]
    assert result["stdoutBytes"] == 5_000_000
    assert result["stderrBytes"] == 5_000_000
    assert result["truncated"] is True
    check_event_order(events, "flood-1")


# -- cancel and disconnect -------------------------------------------------------------


def test_invoke_cancel_from_another_connection_kills_the_group(env: Env) -> None:
    """cancel from a second connection ends the call as cancelled and kills child and grandchild."""
    call_id = "cancel-1"
    with env.daemon.raw(timeout=30) as caller, env.daemon.raw() as other:
        started = start_call(caller, env.params("family", callId=call_id))
        pidfile = env.workspace / ".crystal" / "data" / "tools" / "t" / f"{call_id}.pid"
        grandchild = read_pidfile(pidfile)
        assert not pid_gone(started["pid"]) and not pid_gone(grandchild)
        assert other.request("cancel", {"callId": call_id})["result"] == {"cancelled": True}
        events, reply = finish_call(caller)
    result = reply["result"]
    assert result["status"] == "cancelled"
    assert result["exitCode"] is None
    check_event_order([{"method": "started", "params": started}, *events], call_id)
    assert events[-1]["params"]["status"] == "cancelled"
    eventually(lambda: pid_gone(started["pid"]), 5, "child gone")
    eventually(lambda: pid_gone(grandchild), 5, "grandchild gone")
    assert env.status()["inFlight"] == 0


@pytest.mark.parametrize("batch", [0, 1, 2], ids=["single", "alone-in-a-batch", "in-a-batch"])
def test_invoke_cancel_written_right_behind_it_cancels_it(env: Env, batch: int) -> None:
    """An invoke (alone, or in a batch) and a cancel of its id in one write (the cancel read
    before the invoke's task has begun, as when a client gives up at once, or the daemon
    was busy and both queued up): the invoke was read first, so the cancel reaches it and
    the call ends cancelled, never -32005 with the tool left to run to its end. A batch of
    one item too, which was served as a single message and so never announced its call:
    its cancel was -32005 and the tool ran its 30 s."""
    call_id = f"behind-{batch}"
    invoke: Any = {"jsonrpc": "2.0", "id": 1, "method": "invoke",
                   "params": env.params("sleeper", {"secs": "30"}, callId=call_id)}
    if batch:
        invoke = [invoke, {"jsonrpc": "2.0", "id": 3, "method": "status"}][:batch]
    cancel = {"jsonrpc": "2.0", "id": 2, "method": "cancel", "params": {"callId": call_id}}
    answers: dict[Any, dict[str, Any]] = {}
    with env.daemon.raw(timeout=30) as conn:
        conn.send_bytes(json.dumps(invoke).encode() + b"\n" + json.dumps(cancel).encode() + b"\n")
        while len(answers) < 2:
            message = conn.receive()
            if isinstance(message, list):
                message = message[0]
            if "method" not in message:
                answers[message["id"]] = message
    assert answers[2].get("result") == {"cancelled": True}, answers[2]
    assert answers[1]["result"]["status"] == "cancelled", answers[1]
    assert env.status()["inFlight"] == 0


def test_invoke_cancel_unknown_call(env: Env) -> None:
    """cancel of an id that is not in flight answers UnknownCall -32005."""
    error = env.daemon.call("cancel", {"callId": "no-such-call"})["error"]
    assert error["code"] == -32005
    assert "no-such-call" in error["message"]


def test_invoke_disconnect_kills_the_call(env: Env) -> None:
    """Closing the socket mid-call kills child and grandchild; the daemon keeps serving."""
    call_id = "disc-1"
    conn = env.daemon.raw(timeout=30)
    started = start_call(conn, env.params("family", callId=call_id))
    grandchild = read_pidfile(env.workspace / ".crystal" / "data" / "tools" / "t" / f"{call_id}.pid")
    conn.close()
    eventually(lambda: pid_gone(started["pid"]), 8, "child gone")
    eventually(lambda: pid_gone(grandchild), 8, "grandchild gone")
    eventually(lambda: env.status()["inFlight"] == 0, 8, "inFlight 0")
    _, reply = env.invoke("hello", {"name": "again"})
    assert reply["result"]["status"] == "ok"


# -- concurrency and ids ---------------------------------------------------------------


def test_invoke_hundred_calls_over_ten_connections(env: Env) -> None:
    """100 pipelined calls over 10 connections each get their events in order and one answer."""
    results: dict[int, Any] = {}
    errors: list[BaseException] = []

    def worker(n: int) -> None:
        try:
            with env.daemon.raw(timeout=60) as conn:
                ids = [f"conc-{n}-{i}" for i in range(10)]
                for i, call_id in enumerate(ids):
                    conn.send({"jsonrpc": "2.0", "method": "invoke", "id": i,
                               "params": env.params("echoid", callId=call_id)})
                messages = []
                answered: dict[Any, int] = {}
                while len(answered) < 10:
                    message = conn.receive()
                    messages.append(message)
                    if "method" not in message:
                        answered[message["id"]] = answered.get(message["id"], 0) + 1
                results[n] = (ids, messages)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(n,)) for n in range(10)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(90)
    assert not errors, errors
    pids = []
    for ids, messages in results.values():
        responses = [m for m in messages if "method" not in m]
        assert sorted(r["id"] for r in responses) == list(range(10))
        for i, call_id in enumerate(ids):
            reply = next(r for r in responses if r["id"] == i)
            assert reply["result"]["callId"] == call_id
            assert reply["result"]["content"][0]["text"] == f"exit 0\nid={call_id}\n"
            position = messages.index(reply)
            before = [m for m in messages[:position] if "method" in m]
            check_event_order(before, call_id)
            after = [m for m in messages[position:] if m.get("params", {}).get("callId") == call_id]
            assert after == [], after
            pids.append(next(m["params"]["pid"] for m in before
                             if m["method"] == "started" and m["params"]["callId"] == call_id))
    assert len(results) == 10
    eventually(lambda: env.status()["inFlight"] == 0, 10, "inFlight 0")
    eventually(lambda: all(pid_gone(p) for p in pids), 10, "children gone")


def test_invoke_duplicate_in_flight_call_id(env: Env) -> None:
    """A second invoke with a callId that is still in flight is refused with -32602."""
    with env.daemon.raw(timeout=30) as first, env.daemon.raw() as second:
        start_call(first, env.params("sleeper", {"secs": "30"}, callId="dup-1"))
        _, reply = second.invoke(env.params("echoid", callId="dup-1"))
        assert reply["error"]["code"] == -32602
        assert "callId" in reply["error"]["message"]
        assert second.request("cancel", {"callId": "dup-1"})["result"] == {"cancelled": True}
        _, done = finish_call(first)
        assert done["result"]["status"] == "cancelled"


@pytest.mark.parametrize("call_id", ["bad id", "a/b", "", "x" * 129, "é"])
def test_invoke_bad_call_id_characters(env: Env, call_id: str) -> None:
    """A callId outside [A-Za-z0-9._:-]{1,128} is refused with -32602 naming callId."""
    events, reply = env.invoke("echoid", callId=call_id)
    assert events == []
    assert reply["error"]["code"] == -32602
    assert "callId" in reply["error"]["message"]


@pytest.mark.slow
def test_invoke_max_running_queues_the_second_call(tmp_base: Path) -> None:
    """With --max-running 1 the second of two slow calls reports queued progress before started."""
    home = tmp_base / "home"
    _write_sets(home / "tools")
    workspace = tmp_base / "ws"
    workspace.mkdir()
    d = start_daemon(home, workspace, tmp_base, ["--max-running", "1", "--progress-interval", "0.2"])
    try:
        with d.raw(timeout=30) as conn:
            for i in (1, 2):
                conn.send({"jsonrpc": "2.0", "method": "invoke", "id": i, "params": {
                    "tool": "sleeper", "arguments": {"secs": "0.6"}, "workspace": str(workspace),
                    "callId": f"q-{i}"}})
            messages = []
            while sum(1 for m in messages if "method" not in m) < 2:
                messages.append(conn.receive())
        for call_id in ("q-1", "q-2"):
            check_event_order([m for m in messages if "method" in m], call_id)
        second = [m for m in messages if m.get("params", {}).get("callId") == "q-2"]
        first_started = next(i for i, m in enumerate(second) if m["method"] == "started")
        assert any(m["params"].get("queued") is True for m in second[:first_started]), second
        # Exactly one ran at a time: q-2 started after q-1 completed.
        order = [(m["method"], m["params"]["callId"]) for m in messages
                 if m.get("method") in ("started", "completed")]
        assert order.index(("started", "q-2")) > order.index(("completed", "q-1")), order
    finally:
        d.stop()


# -- more child behaviour --------------------------------------------------------------


def test_invoke_plain_text_progress_line(env: Env) -> None:
    """A plain text line on the progress fd becomes a progress message, without a fraction."""
    events, _ = env.invoke("plainprog", callId="plainprog-1")
    check_event_order(events, "plainprog-1")
    reported = [e["params"] for e in events if e["params"].get("message") == "just text"]
    assert len(reported) == 1, events
    assert "fraction" not in reported[0]


def test_invoke_last_progress_line_without_newline(env: Env) -> None:
    """A last progress line the child ends by exiting, without a newline, is still reported."""
    events, _ = env.invoke("nonlprog", callId="nonlprog-1")
    check_event_order(events, "nonlprog-1")
    messages = [e["params"].get("message") for e in events if e["method"] == "progress"]
    assert [m for m in messages if m is not None] == ["first", "last-without-newline"]


def test_invoke_progress_line_is_bounded(env: Env) -> None:
    """A 10,000-character progress line reaches the client cut to 1,000 characters."""
    events, _ = env.invoke("longprog", callId="longprog-1")
    check_event_order(events, "longprog-1")
    messages = [e["params"]["message"] for e in events if "message" in e.get("params", {})]
    assert messages, events
    assert all(len(m) <= 1000 for m in messages), [len(m) for m in messages]
    assert messages[0].startswith("xxxx")


def test_invoke_grandchild_holding_stdout_is_killed(env: Env) -> None:
    """A grandchild that keeps stdout open does not hold the call: it is killed soon after the leader exits."""
    t0 = time.monotonic()
    events, reply = env.invoke("orphan", callId="orphan-1")
    assert time.monotonic() - t0 < 10
    result = reply["result"]
    assert result["status"] == "ok"
    grandchild = int(result["content"][0]["text"].split("\n")[1])
    eventually(lambda: pid_gone(grandchild), 5, "grandchild gone")
    check_event_order(events, "orphan-1")


def test_invoke_child_inherits_no_daemon_descriptors(env: Env) -> None:
    """The child holds stdin, stdout, stderr, the progress fd and nothing of the daemon's.

    The progress fd is the call's own (its number is whatever the daemon's next free
    descriptor was: read from an earlier call, it failed when another descriptor was open
    in between)."""
    _, reply = env.invoke("fds")
    # The text starts with the exit line (the reference host's "exit N").
    _, progress_fd, *listed = reply["result"]["content"][0]["text"].splitlines()
    fds = set(listed)
    assert progress_fd in fds, fds
    # sh keeps its script open on a high fd (10 for dash); that is the shell's own.
    extra = {fd for fd in fds - {"0", "1", "2", progress_fd} if int(fd) != 10}
    assert extra == set(), fds


@pytest.mark.parametrize(
    ("tool", "text", "file", "fix"),
    [
        ("noexec", "The external process failed to start: Permission denied: ", "/noexec/noexec.sh",
         "is not executable: run chmod +x {file}."),
        ("missing", "The external process failed to start: No such file or directory: ",
         "toolsetd-no-such-program-xyz",
         "is neither a file in {set_dir} nor found on PATH (toolsetd searches its own PATH)."),
    ],
)
def test_invoke_start_failure_gets_no_events(
    env: Env, tool: str, text: str, file: str, fix: str
) -> None:
    """A child that cannot be spawned is an isError result with the reference text naming
    the file, then the sentence validate prints for it, which names the fix."""
    events, reply = env.invoke(tool)
    assert events == []
    result = reply["result"]
    assert (result["status"], result["exitCode"], result["isError"]) == ("error", None, True)
    [item] = result["content"]
    named, said = item["text"].split(". ", 1)
    assert named.startswith(text) and named.endswith(file), item
    named = named.removeprefix(text)
    set_dir = env.daemon.home / "tools" / tool
    assert said.endswith(fix.format(file=named, set_dir=set_dir)), item


def test_invoke_working_directory_is_the_canonical_workspace(env: Env, tmp_path: Path) -> None:
    """Given through a symlink, the workspace is resolved: the child runs in the real folder."""
    link = tmp_path / "wslink"
    link.symlink_to(env.workspace)
    with env.daemon.raw() as conn:
        _, reply = conn.invoke({"tool": "pwd", "arguments": {}, "workspace": str(link)})
    assert reply["result"]["content"][0]["text"] == f"exit 0\n{env.workspace.resolve()}\n"


def test_invoke_child_killed_by_its_own_signal(env: Env) -> None:
    """A child killed by a signal we did not send reports 128 + signum as an error."""
    events, reply = env.invoke("selfkill", callId="selfkill-1")
    result = reply["result"]
    assert (result["status"], result["exitCode"], result["isError"]) == ("error", 137, True)
    assert result["content"][0]["text"] == "exit 137\nx\n"
    assert events[-1]["params"]["exitCode"] == 137


def test_invoke_truncation_counts_characters_not_bytes(env: Env) -> None:
    """150,000 two-byte characters are cut at 100,000 characters, not bytes."""
    _, reply = env.invoke("uni", callId="uni-1")
    result = reply["result"]
    assert result["stdoutBytes"] == 300_000
    assert result["truncated"] is True
    head = text_of(result).split("\n[truncated to 100000 characters]")[0]
    assert head == "exit 0\n" + "é" * (100_000 - 7)
    assert Path(result["outputPath"]).read_text() == "é" * 150_000


@pytest.mark.parametrize(("chars", "cut"), [(99_993, False), (99_994, True)])
def test_invoke_truncation_boundary(env: Env, chars: int, cut: bool) -> None:
    """Exactly 100,000 characters of text are kept whole; one more is cut."""
    _, reply = env.invoke("exact", {"n": chars})
    result = reply["result"]
    assert result["truncated"] is cut
    text = text_of(result)
    if cut:
        assert text.startswith("exit 0\n" + "b" * 99_993 + "\n[truncated to 100000 characters]")
        assert result["outputPath"] is not None
    else:
        assert text == "exit 0\n" + "b" * chars
        assert result["outputPath"] is None


@pytest.mark.slow
def test_invoke_timeout_escalates_to_sigkill(env: Env) -> None:
    """A child that ignores SIGTERM is killed after the grace period; the call is a timeout."""
    t0 = time.monotonic()
    events, reply = env.invoke("stubborn", callId="stubborn-1")
    elapsed = time.monotonic() - t0
    result = reply["result"]
    assert result["status"] == "timeout" and result["exitCode"] is None
    assert result["content"] == [{"type": "text", "text": "The command timed out after 1 second."}]
    assert 2.5 < elapsed < 10, elapsed  # 1 s timeout + 2 s kill grace
    eventually(lambda: pid_gone(events[0]["params"]["pid"]), 5, "child gone")


def test_invoke_child_not_reading_large_stdin_is_fine(env: Env) -> None:
    """A child that exits without reading 5 MB of stdin is not an I/O failure."""
    _, reply = env.invoke("noread", {"blob": "y" * 5_000_000})
    result = reply["result"]
    assert result["status"] == "ok", result
    assert result["content"] == [{"type": "text", "text": "exit 0\nquick\n"}]


def test_invoke_same_connection_keeps_serving_mid_call(env: Env) -> None:
    """While an invoke runs, the same connection gets status and cancel answered first."""
    with env.daemon.raw(timeout=30) as conn:
        start_call(conn, env.params("sleeper", {"secs": "30"}, callId="samecon-1"))
        assert conn.request("status")["result"]["inFlight"] >= 1
        assert conn.request("cancel", {"callId": "samecon-1"})["result"] == {"cancelled": True}
        _, reply = finish_call(conn)
    assert reply["result"]["status"] == "cancelled"


def test_invoke_cancel_twice_and_after_completion(env: Env) -> None:
    """A second cancel of a finished call answers UnknownCall."""
    with env.daemon.raw(timeout=30) as conn, env.daemon.raw() as other:
        start_call(conn, env.params("sleeper", {"secs": "30"}, callId="twice-1"))
        assert other.request("cancel", {"callId": "twice-1"})["result"] == {"cancelled": True}
        finish_call(conn)
        assert other.request("cancel", {"callId": "twice-1"})["error"]["code"] == -32005


def test_invoke_cancel_and_disconnect_while_queued(tmp_base: Path) -> None:
    """With --max-running 1 a queued call cancelled or abandoned never starts a process."""
    home = tmp_base / "home"
    _write_sets(home / "tools")
    workspace = tmp_base / "ws"
    workspace.mkdir()
    d = start_daemon(home, workspace, tmp_base, ["--max-running", "1", "--progress-interval", "0.1"])
    try:
        def params(call_id: str) -> dict[str, Any]:
            return {"tool": "family", "arguments": {}, "workspace": str(workspace), "callId": call_id}

        with d.raw(timeout=30) as conn, d.raw() as other:
            start_call(conn, params("run-1"), request_id=1)
            conn.send({"jsonrpc": "2.0", "method": "invoke", "id": 2, "params": params("wait-1")})
            while True:
                message = conn.receive()
                if message.get("params", {}).get("callId") == "wait-1":
                    assert message["params"].get("queued") is True, message
                    break
            assert other.request("cancel", {"callId": "wait-1"})["result"] == {"cancelled": True}
            events, reply = finish_call(conn, 2)
            assert reply["result"]["status"] == "cancelled"
            assert [e for e in events if e["method"] != "progress"] == []
            # Abandon a queued call: close the socket while it waits.
            waiting = d.raw(timeout=30)
            waiting.send({"jsonrpc": "2.0", "method": "invoke", "id": 1, "params": params("gone-1")})
            eventually(lambda: d.call("status")["result"]["inFlight"] == 2, 5, "queued")
            waiting.close()
            eventually(lambda: d.call("status")["result"]["inFlight"] == 1, 5, "abandoned")
            # Its pid file written before it is cancelled: "started" is the spawn, and on a
            # loaded machine the cancel can reach the shell before its first line has run.
            pidfile = workspace / ".crystal" / "data" / "tools" / "t" / "run-1.pid"
            eventually(pidfile.exists, 10, "run-1's pid file")
            assert other.request("cancel", {"callId": "run-1"})["result"] == {"cancelled": True}
            finish_call(conn, 1)
            eventually(lambda: d.call("status")["result"]["inFlight"] == 0, 5, "idle")
        data = workspace / ".crystal" / "data" / "tools" / "t"
        assert (data / "run-1.pid").exists()
        assert not (data / "wait-1.pid").exists()
        assert not (data / "gone-1.pid").exists()
    finally:
        d.stop()


@pytest.mark.slow
def test_invoke_daemon_stop_kills_in_flight_children(tmp_base: Path) -> None:
    """SIGTERM to the daemon with a call in flight kills the child and grandchild; nothing outlives it."""
    home = tmp_base / "home"
    _write_sets(home / "tools")
    workspace = tmp_base / "ws"
    workspace.mkdir()
    d = start_daemon(home, workspace, tmp_base, ["--shutdown-grace", "0.5", "--kill-grace", "0.5"])
    try:
        conn = d.raw(timeout=30)
        started = start_call(conn, {"tool": "family", "arguments": {}, "workspace": str(workspace),
                                    "callId": "stop-1"})
        grandchild = read_pidfile(workspace / ".crystal" / "data" / "tools" / "t" / "stop-1.pid")
        assert d.stop(timeout=15) == 0
        eventually(lambda: pid_gone(started["pid"]), 5, "child gone")
        eventually(lambda: pid_gone(grandchild), 5, "grandchild gone")
        conn.close()
    finally:
        d.stop()
