"""toolsetctl as a subprocess against a real daemon: output formats, exit codes, Ctrl-C."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from .conftest import EXAMPLES, CtlTarget, eventually, start_daemon, write_set

HEADERS = ["Directory", "Source", "Enabled", "Effective", "Path", "Runner", "Catalogs",
           "Approval", "Tools"]


class Setup(CtlTarget):

    def ctl(self, *args: str, stdin: str | None = None, timeout: float = 30
            ) -> subprocess.CompletedProcess[str]:
        env = {k: v for k, v in os.environ.items() if k != "TOOLSETD_SOCKET"}
        return subprocess.run(
            self.argv(*args), capture_output=True, text=True, input=stdin, timeout=timeout,
            env=env, cwd=self.base,
        )


@pytest.fixture(scope="module")
def setup() -> Iterator[Setup]:
    """A daemon over the example sets plus a set 'c' of failing and slow tools."""
    base = Path(tempfile.mkdtemp(prefix="tsc-"))
    home = base / "home"
    shutil.copytree(EXAMPLES, home / "tools")
    tool = {"description": "d", "schema": {"type": "object"}}
    write_set(home / "tools", "c", {
        "runner": "exec", "stdin": False, "approval": "always",
        "tools": [
            {**tool, "name": "c_fail", "command": ["fail.sh"]},
            {**tool, "name": "c_slow", "command": ["slow.sh"]},
        ],
    }, **{
        "fail.sh": "#!/bin/sh\necho broken >&2\nexit 7\n",
        "slow.sh": '#!/bin/sh\necho $$ > "$CRYSTAL_WORKSPACE/slow-$TOOLSETD_CALL_ID.pid"\n'
                   "sleep 100 &\nwait\n",
    })
    write_set(home / "tools", "ct", {
        "runner": "exec", "description": "times out", "schema": {"type": "object"},
        "command": ["t.sh"], "stdin": False, "approval": "always", "timeoutSeconds": 1,
    }, **{"t.sh": "#!/bin/sh\nsleep 30\n"})
    workspace = base / "ws"
    workspace.mkdir()
    d = start_daemon(home, workspace, base, ["--no-watch"])
    try:
        yield Setup(d, workspace, base)
    finally:
        d.stop()
        shutil.rmtree(base, ignore_errors=True)


def _rows(s: Setup) -> list[list[str]]:
    tools = s.daemon.home / "tools"
    return [
        ["Acme.Notes", "Home", "Yes", "Yes", str(tools / "Acme.Notes" / "tools.json"), "exec",
         "Plan+Work", "inherit", "notes_add, notes_list (always), notes_index"],
        ["c", "Home", "Yes", "Yes", str(tools / "c" / "tools.json"), "exec", "Plan+Work",
         "always", "c_fail (always), c_slow (always)"],
        ["ct", "Home", "Yes", "Yes", str(tools / "ct" / "tools.json"), "exec", "Plan+Work",
         "always", "ct (always)"],
        ["hello", "Home", "Yes", "Yes", str(tools / "hello" / "tools.json"), "exec", "Plan+Work",
         "always", "hello (always)"],
        ["swatch", "Home", "Yes", "Yes", str(tools / "swatch" / "tools.json"), "exec", "Plan+Work",
         "always", "swatch (always)"],
    ]


# -- list, status, show, reload --------------------------------------------------------


def test_cli_list_wide_table_shows_columns_and_rows(setup: Setup) -> None:
    """The wide table (-w) shows every inventory column in full and one row per set."""
    r = setup.ctl("list", "-w")
    assert r.returncode == 0, r.stderr
    header = next(line for line in r.stdout.splitlines() if "Directory" in line)
    assert header.split() == HEADERS
    for row in _rows(setup):
        assert any(line.split()[:1] == [row[0]] and row[4] in line for line in r.stdout.splitlines()), row


def test_cli_list_text_exact(setup: Setup) -> None:
    """--format text prints the header and rows aligned with two spaces, exactly."""
    r = setup.ctl("list", "--format", "text")
    assert r.returncode == 0, r.stderr
    rows = _rows(setup)
    widths = [max(len(c) for c in column) for column in zip(HEADERS, *rows, strict=True)]

    def line(cells: list[str]) -> str:
        return "  ".join(c.ljust(w) for c, w in zip(cells, widths, strict=True)).rstrip()

    lines = r.stdout.splitlines()
    assert lines[0] == line(HEADERS)
    assert sorted(lines[1:6]) == sorted(line(row) for row in rows)


def test_cli_list_json(setup: Setup) -> None:
    """--format json prints the daemon's list result."""
    r = setup.ctl("list", "--format", "json")
    assert r.returncode == 0, r.stderr
    result = json.loads(r.stdout)
    assert {"tools", "sets", "notes"} <= set(result)
    assert "hello" in [t["name"] for t in result["tools"]]
    assert sorted(s["directory"] for s in result["sets"]) == ["Acme.Notes", "c", "ct", "hello", "swatch"]


def test_cli_status(setup: Setup) -> None:
    """status prints the daemon's pid, socket and home; json has every field."""
    r = setup.ctl("status", "--format", "text")
    assert r.returncode == 0, r.stderr
    assert str(setup.daemon.proc.pid) in r.stdout
    assert str(setup.daemon.socket) in r.stdout
    r = setup.ctl("status", "--format", "json")
    assert json.loads(r.stdout)["pid"] == setup.daemon.proc.pid


def test_cli_show_tool_and_set(setup: Setup) -> None:
    """show finds a tool by name and a set by directory name."""
    r = setup.ctl("show", "hello", "--format", "json")
    assert r.returncode == 0, r.stderr
    tool = json.loads(r.stdout)
    assert tool["name"] == "hello" and tool["approval"]["effective"] == "always"
    r = setup.ctl("show", "Acme.Notes", "--format", "text")
    assert r.returncode == 0, r.stderr
    assert "notes_add, notes_list (always), notes_index" in r.stdout
    # --format json prints the tool's tools[] entry, or the set's sets[] entry, of list
    # (docs/cli.md, show).
    listed = json.loads(setup.ctl("list", "--format", "json").stdout)
    assert tool == next(t for t in listed["tools"] if t["name"] == "hello")
    r = setup.ctl("show", "Acme.Notes", "--format", "json")
    entry = next(s for s in listed["sets"] if s["directory"] == "Acme.Notes")
    assert json.loads(r.stdout) == entry
    doc = (Path(__file__).resolve().parents[2] / "docs" / "cli.md").read_text()
    show = doc.split("### `show NAME", 1)[1].split("\n### ", 1)[0]
    assert "`--format json` prints the tool's `tools[]` entry" in show
    r = setup.ctl("show", "nope")
    assert r.returncode == 2
    assert "nope" in r.stderr


def test_cli_reload(setup: Setup) -> None:
    """reload prints what changed: a new set shows as added, then that nothing changed
    since that load, naming its generation (a reload after the watcher took an edit in
    is not told that the edit was ignored)."""
    # Load the workspace first: a reload is compared with what was loaded before, and
    # under xdist this test may be the first of its worker to use the workspace.
    assert setup.ctl("list").returncode == 0
    write_set(setup.workspace / ".crystal" / "tools", "fresh", {
        "runner": "exec", "description": "d", "schema": {"type": "object"}, "command": ["true"],
    })
    try:
        r = setup.ctl("reload", "--format", "text")
        assert r.returncode == 0, r.stderr
        assert "fresh" in r.stdout and "added" in r.stdout.lower()
        generation = json.loads(setup.ctl("reload", "--format", "json").stdout)["generation"]
        r = setup.ctl("reload")
        assert r.returncode == 0, r.stderr
        assert f"Nothing changed since the last load (generation {generation})." in r.stdout
    finally:
        shutil.rmtree(setup.workspace / ".crystal" / "tools")
        setup.ctl("reload")


# -- invoke exit codes -----------------------------------------------------------------


def test_cli_invoke_prints_the_content(setup: Setup) -> None:
    """invoke prints the tool's text and exits 0."""
    r = setup.ctl("invoke", "hello", "--args", '{"name":"Ada"}')
    assert (r.returncode, r.stdout) == (0, "exit 0\nHello, Ada!\n"), r.stderr


def test_cli_invoke_failing_tool_exits_1(setup: Setup) -> None:
    """A tool that reports an error exits 1, its text on stdout."""
    r = setup.ctl("invoke", "c_fail")
    assert r.returncode == 1, r.stderr
    assert r.stdout == "exit 7\nbroken\n"


def test_cli_invoke_invalid_arguments_exit_2(setup: Setup) -> None:
    """Schema errors, bad --args JSON and unknown tools exit 2 with a message."""
    r = setup.ctl("invoke", "hello", "--args", '{"name": 5}')
    assert r.returncode == 2 and "/name" in r.stderr
    r = setup.ctl("invoke", "hello", "--args", "{not json")
    assert r.returncode == 2 and "--args" in r.stderr
    r = setup.ctl("invoke", "hello", "--args", "[1]")
    assert r.returncode == 2 and "object" in r.stderr
    r = setup.ctl("invoke", "no_such_tool")
    assert r.returncode == 2 and "no_such_tool" in r.stderr


@pytest.mark.parametrize("where", ["session", "tool", "workspace"])
def test_cli_names_that_are_not_utf8_exit_2(setup: Setup, where: str) -> None:
    """argv and folder names keep undecodable bytes; the wire cannot: a usage error."""
    odd = os.fsdecode(b"x\xff")
    workspace = setup.base / odd
    workspace.mkdir(exist_ok=True)
    args = {"session": ["invoke", "hello", "--session", odd],
            "tool": ["invoke", odd],
            "workspace": ["--workspace", str(workspace), "invoke", "hello"]}[where]
    env = {k: v for k, v in os.environ.items() if k != "TOOLSETD_SOCKET"}
    r = subprocess.run([os.fsencode(a) for a in setup.argv(*args)], capture_output=True,
                       timeout=30, env=env, cwd=setup.base, check=False)
    assert r.returncode == 2, r.stderr
    assert b"is not valid UTF-8, which toolsetd needs" in r.stderr
    assert b"Traceback" not in r.stderr


def test_cli_invoke_schema_error_printed_once(setup: Setup) -> None:
    """A single schema error is printed once, not repeated under its own summary."""
    r = setup.ctl("invoke", "notes_add", "--args", "{}")
    assert r.returncode == 2
    assert r.stderr.count("required property 'text' is missing") == 1, r.stderr


def test_cli_invoke_approval_required_exit_3(setup: Setup) -> None:
    """An ask exits 3 naming the reason; --approve runs it."""
    r = setup.ctl("invoke", "notes_add", "--args", '{"text":"cli note"}')
    assert r.returncode == 3
    assert "Approval required" in r.stderr and "default mode" in r.stderr
    assert not (setup.workspace / ".crystal" / "data" / "tools" / "Acme.Notes" / "notes.jsonl").exists()
    r = setup.ctl("invoke", "notes_add", "--args", '{"text":"cli note"}', "--approve")
    assert (r.returncode, r.stdout) == (0, "exit 0\nAdded note (8 characters).\n"), r.stderr


def test_cli_invoke_headless_ask_exit_3_at_once(setup: Setup) -> None:
    """--headless turns the ask into a denial: exit 3, quickly, naming the headless rule."""
    t0 = time.monotonic()
    r = setup.ctl("invoke", "notes_add", "--args", '{"text":"x"}', "--headless")
    assert r.returncode == 3
    assert "Headless" in r.stderr
    assert time.monotonic() - t0 < 10


@pytest.mark.slow
def test_cli_invoke_timeout_exit_4(setup: Setup) -> None:
    """A tool that times out exits 4 with the timeout sentence."""
    r = setup.ctl("invoke", "ct")
    assert r.returncode == 4, r.stderr
    assert r.stdout == "The command timed out after 1 second.\n"


def test_cli_unreachable_socket_exit_5(setup: Setup, tmp_path: Path) -> None:
    """Commands that need the daemon exit 5 when nobody listens on the socket."""
    for args in (["status"], ["invoke", "hello", "--args", '{"name":"x"}'], ["reload"],
                 ["classify", "hello"]):
        r = subprocess.run(
            [sys.executable, "-m", "toolsetd.client", "--socket", str(tmp_path / "none.sock"),
             "--workspace", str(setup.workspace), *args],
            capture_output=True, text=True, timeout=30,
        )
        assert r.returncode == 5, (args, r.stderr)
        assert str(tmp_path / "none.sock") in r.stderr
        assert "Traceback" not in r.stderr


def test_cli_socket_option_expands_a_leading_tilde(setup: Setup) -> None:
    """``--socket=~/s.sock`` (one word, which no shell expands) names the socket under the
    home, by the rule the daemon and TOOLSETD_SOCKET use: status answers, and so does the
    MCP pump (``mcp``, which parses its own options) looks for it there too."""
    env = {k: v for k, v in os.environ.items() if k != "TOOLSETD_SOCKET"}
    env["HOME"] = str(setup.base)  # the daemon's socket is base/s.sock
    assert setup.daemon.socket == setup.base / "s.sock"
    elsewhere = setup.base / "ws"  # a relative ~/s.sock would be looked for here
    r = subprocess.run(
        [sys.executable, "-m", "toolsetd.client", "--socket=~/s.sock",
         "--workspace", str(setup.workspace), "status", "--format", "json"],
        capture_output=True, text=True, timeout=30, env=env, cwd=elsewhere,
    )
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["pid"] == setup.daemon.proc.pid
    r = subprocess.run(
        [sys.executable, "-m", "toolsetd.client", "--socket=~/none.sock", "mcp",
         "--no-autostart"],
        input="", capture_output=True, text=True, timeout=30, env=env, cwd=elsewhere,
    )
    assert r.returncode == 5, r.stderr
    assert str(setup.base / "none.sock") in r.stderr


def test_cli_invoke_args_from_file_and_stdin(setup: Setup, tmp_path: Path) -> None:
    """--args @FILE and --args - read the argument object."""
    args_file = tmp_path / "args.json"
    args_file.write_text('{"name": "File"}')
    r = setup.ctl("invoke", "hello", "--args", f"@{args_file}")
    assert (r.returncode, r.stdout) == (0, "exit 0\nHello, File!\n"), r.stderr
    r = setup.ctl("invoke", "hello", "--args", "-", stdin='{"name": "Stdin", "shout": true}')
    assert (r.returncode, r.stdout) == (0, "exit 0\nHELLO, STDIN!\n"), r.stderr
    r = setup.ctl("invoke", "hello", "--args", f"@{tmp_path / 'missing.json'}")
    assert r.returncode == 2 and "missing.json" in r.stderr


# A signal sent as the first event of the call (its ``started``) is handled: once the client
# has taken its line from what it read, before the line is owed to stdout. A signal comes
# there only by chance; the trace hook puts it there every time, to the main thread (see
# tests/client/test_cli_offline.py's _SIGNAL_AS_END_BEGINS).
_SIGNAL_AT_THE_FIRST_EVENT = """\
import os, signal, sys, threading
from toolsetd.client.blocking import BlockingClient
from toolsetd.client.render import Output, _json_text

code = {where}.__code__
sent = []

def hook(frame, event, arg):
    if event == "call" and frame.f_code is code and not sent:
        sent.append(True)
        signal.pthread_kill(threading.main_thread().ident, signal.{name})
    return None

signal.signal(signal.SIGINT, signal.default_int_handler)  # as a terminal's command starts
sys.argv = ["toolsetctl", *sys.argv[1:]]
sys.settrace(hook)
from toolsetd.client.__main__ import main
main()
"""


def _signalled(
    setup: Setup, where: str, name: str, code: int, *args: str
) -> subprocess.CompletedProcess[bytes]:
    """``toolsetctl *args`` with signal ``name`` sent at the first call of ``where``; checks
    that it exits with ``code`` and no traceback."""
    argv = setup.argv(*args)
    script = _SIGNAL_AT_THE_FIRST_EVENT.format(where=where, name=name)
    env = {k: v for k, v in os.environ.items() if k != "TOOLSETD_SOCKET"}
    proc = subprocess.run(
        [sys.executable, "-c", script, *argv[3:]],
        capture_output=True, timeout=60, check=False, env=env,
    )
    assert proc.returncode == code, proc.stderr
    assert b"Traceback" not in proc.stderr, proc.stderr
    return proc


@pytest.mark.parametrize("where", ["BlockingClient._route", "Output.json"])
@pytest.mark.parametrize(("name", "code"), [("SIGINT", 130), ("SIGTERM", -signal.SIGTERM)])
def test_cli_a_signal_as_an_event_is_handled_loses_no_event(
    setup: Setup, where: str, name: str, code: int
) -> None:
    """A Ctrl-C or a SIGTERM that came as ``--format jsonl`` handled the call's first event
    (its line taken from what was read, not yet printed) raised there, and the event was
    lost: the log began at the cancelled call's ``completed``, with no ``started`` (a whole
    run of the tests on a loaded machine met it once). The event is printed first, then
    the call is cancelled."""
    proc = _signalled(setup, where, name, code, "invoke", "c_slow", "--format", "jsonl")
    lines = [json.loads(line) for line in proc.stdout.splitlines()]
    assert [line.get("method") for line in lines[:1]] == ["started"], lines
    assert lines[-1]["result"]["status"] == "cancelled", lines
    assert lines[-1]["result"]["callId"] == lines[0]["params"]["callId"]
    eventually(lambda: setup.daemon.call("status")["result"]["inFlight"] == 0, 10, "idle")


@pytest.mark.parametrize(("name", "code"), [("SIGINT", 130), ("SIGTERM", -signal.SIGTERM)])
def test_cli_a_signal_as_the_json_document_is_encoded_leaves_it_whole(
    setup: Setup, name: str, code: int
) -> None:
    """``--format json``: a signal while the result's document was encoded (a tenth of a
    second for 4 MB) threw the encoded call away, and the error document took its place.
    The signal waits until the document is owed to stdout: the call's result is printed,
    one document, and the exit code says the signal."""
    proc = _signalled(setup, "_json_text", name, code,
                      "invoke", "hello", "--args", '{"name": "Sig"}', "--format", "json")
    result = json.loads(proc.stdout)
    assert (result["status"], result["content"][0]["text"]) == ("ok", "exit 0\nHello, Sig!\n")


def test_cli_invoke_json_prints_the_result(setup: Setup) -> None:
    """--format json prints the call result object."""
    r = setup.ctl("invoke", "hello", "--args", '{"name":"J"}', "--format", "json")
    assert r.returncode == 0, r.stderr
    result = json.loads(r.stdout)
    assert result["status"] == "ok"
    assert result["content"] == [{"type": "text", "text": "exit 0\nHello, J!\n"}]
    r = setup.ctl("invoke", "c_fail", "--format", "json")
    assert r.returncode == 1
    assert json.loads(r.stdout)["exitCode"] == 7


@pytest.mark.parametrize("fmt", ["table", "jsonl"])
@pytest.mark.parametrize(
    ("sig", "code"),
    [(signal.SIGINT, 130), (signal.SIGTERM, -signal.SIGTERM), (signal.SIGHUP, -signal.SIGHUP)],
)
def test_cli_ctrl_c_cancels_the_call(
    setup: Setup, sig: signal.Signals, code: int, fmt: str
) -> None:
    """SIGINT to a running invoke exits 130 after cancelling: the child dies, inFlight returns to 0.

    SIGTERM (a CI runner stopping the job, ``timeout``) and SIGHUP (a closed terminal) do
    the same, then end toolsetctl by the signal (docs/cli.md): a jsonl log ends with the
    cancelled call's result, where it used to stop at the last progress line. They come
    twice here, as ``timeout`` sends them (to the command, then to its group): the second
    must not cut the wait for that result short."""
    before = set(setup.workspace.glob("slow-*.pid"))
    env = {k: v for k, v in os.environ.items() if k != "TOOLSETD_SOCKET"}
    proc = subprocess.Popen(
        setup.argv("invoke", "c_slow", "--format", fmt),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env,
    )
    try:
        eventually(lambda: setup.daemon.call("status")["result"]["inFlight"] == 1, 15, "started")
        eventually(lambda: len(set(setup.workspace.glob("slow-*.pid")) - before) == 1, 10, "pidfile")
        (pidfile,) = set(setup.workspace.glob("slow-*.pid")) - before
        eventually(lambda: pidfile.read_text().strip() != "", 5, "pid written")
        child = int(pidfile.read_text())
        proc.send_signal(sig)
        if sig != signal.SIGINT:
            proc.send_signal(sig)
        out, err = proc.communicate(timeout=15)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == code, err
    assert b"Traceback" not in err
    name = "" if sig == signal.SIGINT else f" by {sig.name}"
    assert f"Interrupted{name}; cancelling the call.".encode() in err, err
    if fmt == "jsonl":
        lines = [json.loads(line) for line in out.splitlines()]
        assert lines[0]["method"] == "started", lines
        assert lines[-1]["result"]["status"] == "cancelled", lines
        assert lines[-1]["result"]["callId"] == lines[0]["params"]["callId"]
    else:
        assert out == b"The call was cancelled.\n", (out, err)
    eventually(lambda: setup.daemon.call("status")["result"]["inFlight"] == 0, 10, "idle")

    def gone() -> bool:
        try:
            os.kill(child, 0)
        except ProcessLookupError:
            return True
        return False

    eventually(gone, 10, "child gone")
    log = setup.daemon.log_events()
    cancelled = [e for e in log if e.get("event") == "call_finished" and e.get("tool") == "c_slow"]
    assert cancelled and cancelled[-1]["status"] == "cancelled", cancelled


def test_cli_classify_full_headless(setup: Setup) -> None:
    """classify --mode full --headless prints the decision."""
    r = setup.ctl("classify", "notes_add", "--args", '{"text":"x"}', "--mode", "full",
                  "--headless", "--format", "text")
    assert r.returncode == 0, r.stderr
    decision = next(line for line in r.stdout.splitlines() if line.startswith("Decision"))
    assert decision.split() == ["Decision", "allow"]
    r = setup.ctl("classify", "notes_add", "--args", '{"text":"x"}', "--headless", "--format", "json")
    assert json.loads(r.stdout)["decision"] == "deny"
    r = setup.ctl("classify", "notes_add", "--mode", "bogus")
    assert r.returncode == 2 and "mode" in r.stderr
