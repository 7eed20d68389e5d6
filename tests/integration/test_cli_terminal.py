"""toolsetctl against a real daemon: what reaches a terminal, and a reader that goes away.

A project set (a cloned repository's ``.crystal/tools``) whose names, descriptions and
errors carry escape sequences; a tool whose output and progress messages do. On a
terminal toolsetctl shows them escaped; into a pipe a tool's output stays byte for byte.
A closed stdout never turns a failed, timed-out or denied call into an exit 0.
"""

from __future__ import annotations

import fcntl
import json
import os
import pty
import re
import select
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import termios
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from .conftest import CtlTarget, eventually, start_daemon, write_set

OSC52 = "\x1b]52;c;cHduZWQ=\x07"
ESCAPES = f"{OSC52}\x1b]0;title\x07\x1b[2J\x9b31m\u202e"
#: What a terminal would act on; none of it may reach one from toolsetctl's own rendering.
RAW = ("\x1b", "\x07", "\x9b", "\u202e")

#: A tool's output that GitHub Actions and Azure Pipelines would obey, line by line.
CI_OUTPUT = "::add-mask::secret\n##vso[task.setvariable variable=x]y\n  ##[error]z\n"

TOOL_OUTPUT = (
    "import json, os, sys, time\n"
    "mode = json.load(sys.stdin).get('mode')\n"
    "if mode == 'escapes':\n"
    f"    sys.stdout.write('out ' + {ESCAPES!r} + ' line1\\rOVER\\r\\nnext\\n')\n"
    "elif mode == 'colour':\n"
    "    sys.stdout.write('\\x1b[1;31mred\\x1b[0m plain \\x1b[2J\\n')\n"
    "elif mode == 'conceal':\n"
    "    sys.stdout.write('\\x1b[8mhidden\\n')\n"
    "elif mode == 'progress':\n"
    "    with os.fdopen(int(os.environ['TOOLSETD_PROGRESS_FD']), 'w') as p:\n"
    f"        p.write(json.dumps({{'message': 'prog ' + {ESCAPES!r} + ' ##vso[task.setvariable "
    "variable=x]y', 'fraction': 0.5}) + '\\n')\n"
    "        p.flush()\n"
    "        time.sleep(2)\n"
    "elif mode == 'long':\n"
    "    for i in range(600):\n"
    "        print('tick', i, flush=True)\n"
    "        time.sleep(0.1)\n"
    "elif mode == 'fail':\n"
    "    sys.stdout.write('x' * 300000)\n"
    "    sys.exit(3)\n"
    "elif mode == 'sleep':\n"
    "    time.sleep(30)\n"
    "elif mode == 'brief':\n"
    "    time.sleep(0.3)\n"
    "elif mode == 'ci':\n"
    f"    sys.stdout.write({CI_OUTPUT!r})\n"
)


class Setup(CtlTarget):

    def env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if k not in ("TOOLSETD_SOCKET", "CI")}
        return {**env, "COLUMNS": "400"}

    def ctl(self, *args: str) -> subprocess.CompletedProcess[bytes]:
        return subprocess.run(self.argv(*args), capture_output=True, timeout=60,
                              env=self.env(), cwd=self.base, check=False)

    def piped(self, *args: str) -> int:
        """Run with stdout a pipe whose reader is gone; return the exit code."""
        read, write = os.pipe()
        os.close(read)
        try:
            proc = subprocess.run(self.argv(*args), stdout=write, stderr=subprocess.DEVNULL,
                                  timeout=60, env=self.env(), cwd=self.base, check=False)
        finally:
            os.close(write)
        return proc.returncode

    def on_terminal(self, *args: str) -> tuple[int, bytes]:
        """Run with stdout and stderr a pseudo-terminal; return the exit code and its bytes."""
        leader, follower = pty.openpty()
        fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 50, 200, 0, 0))
        proc = subprocess.Popen(self.argv(*args), stdin=subprocess.DEVNULL, stdout=follower,
                                stderr=follower, env=self.env(), cwd=self.base)
        os.close(follower)
        seen = bytearray()
        deadline = time.monotonic() + 60
        try:
            while time.monotonic() < deadline:
                ready, _, _ = select.select([leader], [], [], 0.1)
                if ready:
                    try:
                        chunk = os.read(leader, 65536)
                    except OSError:  # EIO: every writer closed the terminal
                        break
                    if not chunk:
                        break
                    seen += chunk
                elif proc.poll() is not None:
                    break
            return proc.wait(timeout=10), bytes(seen)
        finally:
            os.close(leader)
            if proc.poll() is None:
                proc.kill()


@pytest.fixture(scope="module")
def setup() -> Iterator[Setup]:
    base = Path(tempfile.mkdtemp(prefix="tst-"))
    home, workspace = base / "home", base / "ws"
    (home / "tools").mkdir(parents=True)
    workspace.mkdir()
    write_set(home / "tools", "h", {  # approval inherit: asks in default mode, so --approve
        "runner": "exec", "command": ["t.py"], "stdin": True,
        "tools": [{"name": "h_run", "description": "runs", "schema": {"type": "object"}}],
    }, **{"t.py": f"#!{sys.executable}\n{TOOL_OUTPUT}"})
    write_set(home / "tools", "slow", {
        "runner": "exec", "command": ["t.py"], "stdin": True, "approval": "always",
        "timeoutSeconds": 1,
        "tools": [{"name": "slow_run", "description": "times out", "schema": {"type": "object"}}],
    }, **{"t.py": f"#!{sys.executable}\n{TOOL_OUTPUT}"})
    project = workspace / ".crystal" / "tools"
    write_set(project, "proj", {
        "runner": "exec", "command": ["x"],
        "tools": [{"name": "pt", "description": f"desc {ESCAPES} end",
                   "schema": {"type": "object"}}],
    })
    write_set(project, "bad", {
        "runner": "exec", "command": ["x"],
        "tools": [{"name": f"bad{OSC52}\x1b[2K\rFAKE", "description": "d",
                   "schema": {"type": "object"}}],
    })
    # A pull request's sets that carry CI runners' workflow commands: a folder named as one
    # (invalid, still listed), a description, and a schema error that quotes its value.
    write_set(project, "::add-mask::x", {"runner": "exec", "command": ["x"]})
    write_set(project, "ci", {
        "runner": "exec", "command": ["x"],
        "tools": [{"name": "ci_run", "description": CI_DESCRIPTION,
                   "schema": {"type": "object"}}],
    })
    write_set(project, "cischema", {
        "runner": "exec", "command": ["x"],
        "tools": [{"name": "cs", "description": "d",
                   "schema": {"type": "object", "properties": {"a": {"type": CI_TYPE}}}}],
    })
    d = start_daemon(home, workspace, base, ["--no-watch"])
    try:
        yield Setup(d, workspace, base)
    finally:
        d.stop()
        shutil.rmtree(base, ignore_errors=True)


#: Workflow commands of GitHub Actions (``::name::`` starting a line, ``##[name]``
#: anywhere) and Azure Pipelines (``##vso[`` anywhere); wrapped at 60 columns, the
#: description's ``::set-output`` starts a line of ``show``.
CI_DESCRIPTION = "x" * 40 + " ::set-output name=ok::true ##vso[task.prependpath]/tmp/evil"
CI_TYPE = "##[set-output name=ok;]true"


def _runner_commands(data: bytes) -> list[str]:
    """The lines of ``data`` a CI runner would take for a command to itself."""
    lines = data.decode("utf-8", "replace").replace("\r", "\n").split("\n")
    return [
        line
        for line in lines
        if line.lstrip().startswith("::") or re.search(r"##[A-Za-z]*\[", line)
    ]


def _no_raw(data: bytes) -> None:
    text = data.decode("utf-8", "replace")
    for char in RAW:
        assert char not in text, f"{char!r} reached the output: {text!r}"


@pytest.mark.parametrize("fmt", ["table", "text"])
def test_list_shows_a_hostile_project_set_escaped(setup: Setup, fmt: str) -> None:
    """Names, descriptions and parse errors of a cloned repository's sets drive no terminal."""
    result = setup.ctl("--format", fmt, "list")
    assert result.returncode == 0, result.stderr
    _no_raw(result.stdout)
    _no_raw(result.stderr)
    assert b"Tool name 'bad\\x1b]52;c;cHduZWQ=\\x07\\x1b[2K\\rFAKE' is reserved or invalid." in (
        result.stdout
    )


@pytest.mark.parametrize("fmt", ["table", "text", "json"])
@pytest.mark.parametrize("command", [["list"], ["show", "ci_run"], ["validate", "cischema"]])
def test_a_project_set_forges_no_ci_runner_command(
    setup: Setup, fmt: str, command: list[str]
) -> None:
    """A CI job that lists or validates a pull request's sets logs what they say: none of
    it becomes a workflow command of the runner (a mask, a step output, a PATH entry)."""
    env = {**setup.env(), "COLUMNS": "60", "CI": "true"}
    result = subprocess.run(setup.argv("--format", fmt, *command), capture_output=True,
                            timeout=60, env=env, cwd=setup.base, check=False)
    assert result.returncode == (2 if command[0] == "validate" else 0), result.stderr
    assert _runner_commands(result.stdout + b"\n" + result.stderr) == []
    if fmt == "json" and command[0] == "show":  # the same value, escaped
        assert json.loads(result.stdout)["description"] == CI_DESCRIPTION
    elif fmt == "json" and command[0] == "validate":
        assert CI_TYPE in json.loads(result.stdout)["problems"][0]
    elif command[0] == "list" and fmt != "json":  # the folder's row, shown and inert
        rows = {line.split()[0]: line for line in result.stdout.decode().splitlines() if line}
        hostile, plain = rows["\\x3a:add-mask::x"], rows["ci"]
        assert hostile.index(" Project") == plain.index(" Project")  # its columns line up


def test_the_daemons_log_of_such_sets_forges_no_ci_runner_command(setup: Setup) -> None:
    """docs/cli.md's CI script prints its daemon's log when the daemon fails; the log's
    notes quote the sets (``##[set-output ...`` from a schema): the same text, inert."""
    assert setup.ctl("list").returncode == 0
    assert _runner_commands(setup.daemon.log().encode()) == []
    messages = [str(event.get("message")) for event in setup.daemon.log_events()]
    assert any(CI_TYPE in message for message in messages)


def test_the_daemons_console_log_of_such_sets_forges_no_ci_runner_command() -> None:
    """The same in ``--log-format console``, whose values b276caf passes through
    ``inert_line``: the note quoting the schema's ``##[set-output`` is shown as
    ``\\x23#[set-output``, the set folder ``::add-mask::x`` as it is (mid-line)."""
    base = Path(tempfile.mkdtemp(prefix="tst-"))
    home, workspace = base / "home", base / "ws"
    (home / "tools").mkdir(parents=True)
    project = workspace / ".crystal" / "tools"
    write_set(project, "::add-mask::x", {"runner": "exec", "command": ["x"]})
    write_set(project, "cischema", {
        "runner": "exec", "command": ["x"],
        "tools": [{"name": "cs", "description": "d",
                   "schema": {"type": "object", "properties": {"a": {"type": CI_TYPE}}}}],
    })
    d = start_daemon(home, workspace, base, ["--no-watch", "--log-format", "console"])
    try:
        assert d.call("list", {"workspace": str(workspace)})["result"]["notes"]
        eventually(lambda: "set-output" in d.log(), what="the schema's note logged")
        assert _runner_commands(d.log().encode()) == []
        assert "\\x23#[set-output" in d.log()
    finally:
        d.stop()
        shutil.rmtree(base, ignore_errors=True)


@pytest.mark.parametrize("fmt", ["json", "jsonl"])
def test_a_tools_output_in_json_forges_no_ci_runner_command(setup: Setup, fmt: str) -> None:
    """docs/cli.md's way to run a tool whose output the job does not trust: in JSON its
    workflow commands are inside strings, and the same text once parsed."""
    result = setup.ctl("--format", fmt, "invoke", "h_run", "--approve", "--args",
                       '{"mode": "ci"}')
    assert result.returncode == 0, result.stderr
    assert _runner_commands(result.stdout) == []
    last = json.loads(result.stdout.splitlines()[-1] if fmt == "jsonl" else result.stdout)
    [content] = (last["result"] if fmt == "jsonl" else last)["content"]
    assert content["text"].endswith(CI_OUTPUT)


def test_show_and_json_escape_a_hostile_description(setup: Setup) -> None:
    shown = setup.ctl("show", "pt")
    assert shown.returncode == 0, shown.stderr
    _no_raw(shown.stdout)
    assert b"desc \\x1b]52;c;cHduZWQ=\\x07" in shown.stdout
    as_json = setup.ctl("--format", "json", "show", "pt")
    _no_raw(as_json.stdout)
    assert json.loads(as_json.stdout)["description"] == f"desc {ESCAPES} end"


def test_a_tools_output_is_byte_exact_into_a_pipe(setup: Setup) -> None:
    result = setup.ctl("invoke", "h_run", "--approve", "--args", '{"mode": "escapes"}')
    assert result.returncode == 0, result.stderr
    assert result.stdout.endswith(f"out {ESCAPES} line1\rOVER\r\nnext\n".encode())


def test_a_tools_output_on_a_terminal_is_shown_escaped(setup: Setup) -> None:
    code, seen = setup.on_terminal("invoke", "h_run", "--approve", "--args", '{"mode": "escapes"}')
    assert code == 0, seen
    # The progress line's own erase sequence is toolsetctl's: drop it, then nothing raw stays.
    _no_raw(seen.replace(b"\r\x1b[2K", b""))
    assert b"out \\x1b]52;c;cHduZWQ=\\x07" in seen
    assert b"line1\\rOVER" in seen


def test_a_tools_colours_reach_a_terminal_and_nothing_else_does(setup: Setup) -> None:
    """A linter's colours (SGR) are shown as colours; any other sequence, escaped."""
    code, seen = setup.on_terminal("invoke", "h_run", "--approve", "--args", '{"mode": "colour"}')
    assert code == 0, seen
    assert b"\x1b[1;31mred\x1b[0m plain \\x1b[2J" in seen


def test_a_tools_colours_are_reset_after_its_output_on_a_terminal(setup: Setup) -> None:
    """A tool that leaves a colour or concealed text on does not paint what follows."""
    code, seen = setup.on_terminal("invoke", "h_run", "--approve", "--args", '{"mode": "conceal"}')
    assert code == 0, seen
    assert b"\x1b[8mhidden\r\n\x1b[0m" in seen


def test_a_progress_message_on_a_terminal_is_shown_escaped(setup: Setup) -> None:
    code, seen = setup.on_terminal("invoke", "h_run", "--approve", "--args", '{"mode": "progress"}')
    assert code == 0, seen
    assert b"prog \\x1b]52;c;cHduZWQ=\\x07" in seen
    _no_raw(seen.replace(b"\r\x1b[2K", b""))
    # A terminal a CI runner reads (a PTY, CI unset): the tool's message commands nothing.
    assert b"\\x23#vso[task.setvariable" in seen
    assert _runner_commands(seen) == []


def test_a_closed_stdout_keeps_the_outcome_exit_code(setup: Setup) -> None:
    """A failed (1), timed-out (4) or denied (3) call is never exit 0 for want of a reader."""
    assert setup.piped("invoke", "h_run", "--approve", "--args", '{"mode": "fail"}') == 1
    assert setup.piped("invoke", "slow_run", "--approve", "--args", '{"mode": "sleep"}') == 4
    assert setup.piped("invoke", "h_run", "--headless") == 3
    assert setup.piped("--format", "json", "invoke", "h_run", "--headless") == 3
    assert setup.piped("list") == 0


def test_a_closed_stdout_keeps_the_verdict_of_classify_and_validate(
    setup: Setup, tmp_path: Path
) -> None:
    """``classify`` (3 for a decision that is not allow) and ``validate`` (2 for a set with
    problems) exit with their verdict whether or not anyone read it."""
    assert setup.piped("classify", "h_run", "--headless") == 3
    assert setup.piped("--format", "json", "classify", "h_run", "--headless") == 3
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "tools.json").write_text("{", encoding="utf-8")
    assert setup.piped("validate", str(broken)) == 2
    assert setup.piped("--format", "json", "validate", str(broken)) == 2


def _jsonl_closed_after_started(
    setup: Setup, mode: str
) -> tuple[subprocess.Popen[bytes], dict[str, Any], str]:
    """``--format jsonl invoke h_run`` in ``mode``, its stdout closed once ``started`` was
    read (``| head -n1``); returns the ended process, that event, and its stderr."""
    proc = subprocess.Popen(
        setup.argv("--format", "jsonl", "invoke", "h_run", "--approve", "--args",
                   json.dumps({"mode": mode})),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=setup.env(), cwd=setup.base,
    )
    assert proc.stdout is not None and proc.stderr is not None
    first = json.loads(proc.stdout.readline())
    assert first["method"] == "started"
    proc.stdout.close()
    proc.wait(timeout=60)
    said = proc.stderr.read().decode()
    proc.stderr.close()
    return proc, first, said


def test_a_closed_event_stream_cancels_the_call_and_exits_141(setup: Setup) -> None:
    """``--format jsonl invoke ... | head -n1``: the call is cancelled, never reported as a success."""
    proc, first, said = _jsonl_closed_after_started(setup, "long")  # while the tool runs
    assert proc.returncode == 141
    assert "cancelling the call" in said
    call_id = first["params"]["callId"]
    eventually(
        lambda: any(event.get("call_id") == call_id and event.get("status") == "cancelled"
                    for event in setup.daemon.log_events()),
        timeout=20, what="the call cancelled in the daemon",
    )


def test_an_event_stream_closed_before_completed_says_the_call_ended(setup: Setup) -> None:
    """The reader goes away and the next event is ``completed`` (a brief call, no progress
    in between): the call is over, so nothing is cancelled and nothing says so; the exit
    code is the call's (0). It said "cancelling the call" after a call that succeeded."""
    # Closed before the call ends (it sleeps 0.3 s; the first periodic progress is due at
    # 1 s: the 141 tests above need it, to notice their closed stream).
    proc, _, said = _jsonl_closed_after_started(setup, "brief")
    assert proc.returncode == 0
    assert "cancelling" not in said, said
    assert "The output was closed; the call had already ended." in said, said


def test_a_closed_event_stream_shared_with_stderr_still_exits_141(setup: Setup) -> None:
    """``... 2>&1 | head -n1``: the notice on stderr cannot be written either; still 141."""
    read, write = os.pipe()
    proc = subprocess.Popen(
        setup.argv("--format", "jsonl", "invoke", "h_run", "--approve", "--args",
                   '{"mode": "long"}'),
        stdout=write, stderr=write, env=setup.env(), cwd=setup.base,
    )
    os.close(write)
    with os.fdopen(read, "rb") as reader:
        first = json.loads(reader.readline())
    assert first["method"] == "started"  # the reader (and so stderr's too) is gone now
    assert proc.wait(timeout=60) == 141
    call_id = first["params"]["callId"]
    eventually(
        lambda: any(event.get("call_id") == call_id and event.get("status") == "cancelled"
                    for event in setup.daemon.log_events()),
        timeout=20, what="the call cancelled in the daemon",
    )


def test_a_hung_up_terminal_still_gets_the_call_cancelled_and_its_result(setup: Setup) -> None:
    """The terminal that shows the progress line closes (SIGHUP, then every write to it
    fails with EIO) while stdout is a log: the call is cancelled and the log ends with its
    result, then toolsetctl ends by the SIGHUP. Erasing the progress line failed first,
    so nothing was cancelled and the log ended with an unexpected OSError."""
    leader, follower = pty.openpty()
    proc = subprocess.Popen(
        setup.argv("--format", "jsonl", "invoke", "h_run", "--approve", "--args",
                   '{"mode": "long"}'),
        stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=follower,
        env=setup.env(), cwd=setup.base,
    )
    os.close(follower)
    try:
        assert proc.stdout is not None
        first = json.loads(proc.stdout.readline())
        assert first["method"] == "started"
        drawn = bytearray()
        while b"h_run" not in drawn:  # the progress line is on the terminal
            assert select.select([leader], [], [], 30)[0], drawn
            drawn += os.read(leader, 65536)
    finally:
        os.close(leader)  # hung up
    proc.send_signal(signal.SIGHUP)
    out, _ = proc.communicate(timeout=30)
    assert proc.returncode == -signal.SIGHUP
    last = json.loads(out.splitlines()[-1])
    assert "result" in last, last
    assert last["result"]["status"] == "cancelled", out
    assert last["result"]["callId"] == first["params"]["callId"]
