"""toolsetctl for CI jobs and operators (issue 12), as a subprocess against a real daemon.

Each test runs ``python -m toolsetd.client`` (the real CLI) against a daemon on a
temporary socket; where a terminal matters, the CLI's stderr or stdout is a pty from the
stdlib ``pty`` module. The exit-code table of docs/cli.md is tested row by row here and in
test_cli_daemon.py (Ctrl-C).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import pty
import re
import select
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import termios
import threading
import time
from collections.abc import Callable, Iterator
from decimal import Decimal
from pathlib import Path
from typing import Any

import anyio
import pytest
from toolsetd.client import Client, ServerBusy
from toolsetd.client.parser import COMMANDS

from .conftest import EXAMPLES, REPO, Daemon, RawConn, eventually, start_daemon, write_set

SH = "#!/bin/sh\n"
TOOL = {"description": "d", "schema": {"type": "object"}}
PROGRESS = (
    SH
    + 'printf \'{"message": "step 1 of 5", "fraction": 0.2}\\n\' > "/dev/fd/$TOOLSETD_PROGRESS_FD"\n'
    'echo working\ni=0\nwhile [ ! -e "$CRYSTAL_WORKSPACE/go" ] && [ $i -lt 200 ]; do\n'
    "  sleep 0.05; i=$((i+1))\ndone\necho done\n"
)


class Ctl:
    """A daemon over the examples plus test sets, and a way to run toolsetctl against it."""

    def __init__(self, daemon: Daemon, base: Path) -> None:
        self.daemon = daemon
        self.base = base
        self.workspace = daemon.workspace

    def argv(self, *args: str) -> list[str]:
        return [
            sys.executable,
            "-m",
            "toolsetd.client",
            "--socket",
            str(self.daemon.socket),
            "--workspace",
            str(self.workspace),
            *args,
        ]

    def env(self, **extra: str) -> dict[str, str]:
        env = {
            k: v
            for k, v in os.environ.items()
            if k not in ("TOOLSETD_SOCKET", "CRYSTAL_HOME", "CI", "COLUMNS")
        }
        env["HOME"] = str(self.base / "user")  # not the daemon's home: ~ is somewhere else
        env.update(extra)
        return env

    def run(
        self, *args: str, stdin: str | None = None, **env: str
    ) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            self.argv(*args),
            capture_output=True,
            text=True,
            input=stdin,
            timeout=60,
            env=self.env(**env),
            cwd=self.base,
        )


def one_document(r: subprocess.CompletedProcess[str]) -> Any:
    """stdout holds exactly one JSON document; return it."""
    return json.loads(r.stdout)


@pytest.fixture(scope="module")
def ctl() -> Iterator[Ctl]:
    base = Path(tempfile.mkdtemp(prefix="tso-"))
    home = base / "home"
    shutil.copytree(EXAMPLES, home / "tools")
    (base / "user").mkdir()
    write_set(
        home / "tools",
        "c",
        {
            "runner": "exec",
            "stdin": False,
            "approval": "always",
            "tools": [
                {**TOOL, "name": "c_fail", "command": ["fail.sh"]},
                {**TOOL, "name": "c_progress", "command": ["progress.sh"]},
                {**TOOL, "name": "c_content", "command": ["content.sh"], "output": "content"},
                {**TOOL, "name": "c_big", "command": ["big.sh"]},
                {**TOOL, "name": "c_term", "command": ["term.sh"]},
            ],
        },
        **{
            "big.sh": SH + "i=0\nwhile [ $i -lt 3000 ]; do printf '%099d\\n' $i; i=$((i+1)); done\n",
            "fail.sh": SH + "echo broken >&2\nexit 7\n",
            "progress.sh": PROGRESS,
            "content.sh": SH + "echo not content JSON\n",
            "term.sh": SH + "echo stopping\nkill -TERM $$\n",
        },
    )
    write_set(
        home / "tools",
        "ct",
        {
            "runner": "exec",
            **TOOL,
            "command": ["t.sh"],
            "stdin": False,
            "approval": "always",
            "timeoutSeconds": 1,
        },
        **{"t.sh": SH + "sleep 30\n"},
    )
    workspace = base / "ws"
    write_set(
        workspace / ".crystal" / "tools",
        "proj",
        {
            "runner": "exec",
            **TOOL,
            "command": ["true"],
            "approval": "always",
        },
    )
    daemon = start_daemon(home, workspace, base, ["--no-watch", "--progress-interval", "0.1"])
    try:
        yield Ctl(daemon, base)
    finally:
        daemon.stop()
        shutil.rmtree(base, ignore_errors=True)


# -- 1. JSON on every path --------------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "exit_code", "code"),
    [
        (["invoke", "notes_add", "--args", '{"text": "x"}'], 3, -32004),
        (["invoke", "notes_add", "--args", '{"text": "x"}', "--headless"], 3, -32003),
        (["invoke", "notes_add", "--args", '{"text": 5}', "--approve"], 2, -32002),
        (["invoke", "no_such_tool"], 2, -32001),
        (["invoke", "hello", "--args", "{not json"], 2, -32090),
        (["invoke", "hello", "--headless", "--approve"], 2, -32090),
        (["classify", "hello", "--mode", "bogus"], 2, -32602),
        (["show", "nope"], 2, -32093),
        (["show", "9bad"], 2, -32093),
        (["list", "--catalog", "nope"], 2, -32090),
    ],
)
def test_cli_json_errors_are_one_document(
    ctl: Ctl, args: list[str], exit_code: int, code: int
) -> None:
    """In json mode a failure is one {"error": {code, message, data}} on stdout, same exit code."""
    text = ctl.run(*args)
    r = ctl.run(*args, "--format", "json")
    assert r.returncode == text.returncode == exit_code, (r.stdout, r.stderr, text.stderr)
    error = one_document(r)["error"]
    assert error["code"] == code
    assert error["message"] and error["message"].splitlines()[0] in text.stderr
    assert set(error) == {"code", "message", "data"}
    assert r.stderr == ""


def test_cli_json_error_data_carries_the_classification(ctl: Ctl) -> None:
    """A refusal keeps the daemon's data: the classification of a denial, the pointer errors."""
    r = ctl.run("invoke", "notes_add", "--args", '{"text": "x"}', "--headless", "--format", "json")
    data = one_document(r)["error"]["data"]
    assert (data["tool"], data["decision"]) == ("notes_add", "deny")
    r = ctl.run("invoke", "notes_add", "--args", '{"tags": [1]}', "--approve", "--format", "json")
    errors = one_document(r)["error"]["data"]["errors"]
    assert {e["path"] for e in errors} >= {"/tags/0"}


def test_cli_json_unreachable_daemon(ctl: Ctl, tmp_path: Path) -> None:
    """An unreachable daemon is a JSON error naming the socket, exit 5."""
    sock = str(tmp_path / "none.sock")
    r = subprocess.run(
        [sys.executable, "-m", "toolsetd.client", "--socket", sock, "status", "--format", "json"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert r.returncode == 5
    error = one_document(r)["error"]
    assert (
        error["code"] == -32091 and sock in error["message"] and error["data"] == {"socket": sock}
    )


def test_cli_json_offline_notice_stays_on_stderr(ctl: Ctl, tmp_path: Path) -> None:
    """Without a daemon, list --format json prints one document; the notice goes to stderr."""
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "toolsetd.client",
            "--socket",
            str(tmp_path / "x.sock"),
            "--home",
            str(ctl.daemon.home),
            "--workspace",
            str(ctl.workspace),
            "list",
            "--format",
            "json",
        ],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert r.returncode == 0, r.stderr
    assert "hello" in {s["directory"] for s in one_document(r)["sets"]}
    assert "not running" in r.stderr


def test_cli_json_results_and_failed_tool(ctl: Ctl) -> None:
    """A tool that fails is a result (not an error document); stdout is only that JSON."""
    r = ctl.run("invoke", "c_fail", "--format", "json")
    assert r.returncode == 1
    result = one_document(r)
    assert (result["status"], result["exitCode"], result["stderrBytes"]) == ("error", 7, 7)
    assert r.stderr == ""


# -- 2. invoke --format jsonl -----------------------------------------------------------


def test_cli_invoke_jsonl_streams_events_as_they_happen(ctl: Ctl) -> None:
    """jsonl prints started, progress and completed as they happen, then the result."""
    go = ctl.workspace / "go"
    go.unlink(missing_ok=True)
    proc = subprocess.Popen(
        ctl.argv("invoke", "c_progress", "--format", "jsonl"),
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env=ctl.env(),
    )
    try:
        assert proc.stdout is not None
        first = json.loads(proc.stdout.readline())
        assert first["method"] == "started" and first["params"]["tool"] == "c_progress"
        line = json.loads(proc.stdout.readline())
        assert line["method"] == "progress"  # while the tool still waits for its go file
        assert proc.poll() is None
        go.write_text("")
        rest = [json.loads(text) for text in proc.stdout]
        assert proc.wait(timeout=30) == 0
    finally:
        go.unlink(missing_ok=True)
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()
    methods = [m.get("method") for m in rest]
    assert methods[-2] == "completed" and set(methods[:-2]) <= {"progress"}
    assert list(rest[-1]) == ["result"] and rest[-1]["result"]["status"] == "ok"
    messages = [m["params"].get("message") for m in [line, *rest[:-2]]]
    assert "step 1 of 5" in messages


def test_cli_jsonl_error_is_one_line(ctl: Ctl) -> None:
    """A failure in jsonl is a single {"error": ...} line."""
    r = ctl.run("invoke", "notes_add", "--args", '{"text": "x"}', "--format", "jsonl")
    assert r.returncode == 3
    [line] = r.stdout.splitlines()
    assert json.loads(line)["error"]["code"] == -32004


@pytest.mark.parametrize("fmt", ["jsonl", "json"])
@pytest.mark.parametrize(("sig", "code"), [(signal.SIGTERM, -signal.SIGTERM), (signal.SIGINT, 130)])
def test_cli_jsonl_lines_stay_whole_when_a_signal_stops_a_blocked_write(
    ctl: Ctl, sig: int, code: int, fmt: str
) -> None:
    """A consumer that lags (its pipe full in the middle of the 100 KB ``result`` line) and
    a SIGTERM or Ctrl-C then: the signal raised from inside Python's write, the rest of
    the line was dropped, and the ``{"error": ...}`` line saying "Interrupted" followed
    the part written, on the same line: the consumer's JSON parser failed on it. Each
    line is whole now, the error one after it; ``json``'s one document is the result,
    whole, and the interruption goes to stderr, as a second document would break it."""
    read_end, write_end = os.pipe()
    try:
        proc = subprocess.Popen(
            ctl.argv("invoke", "c_big", "--format", fmt), stdout=write_end,
            stderr=subprocess.PIPE, env=ctl.env(), cwd=ctl.base,
        )
    finally:
        os.close(write_end)
    with os.fdopen(read_end, "rb") as reader:
        try:
            capacity = fcntl.fcntl(reader.fileno(), fcntl.F_GETPIPE_SZ)

            def full() -> bool:  # the reader has not read: the writer waits for it
                held = fcntl.ioctl(reader.fileno(), termios.FIONREAD, b"\0" * 4)
                return int(struct.unpack("i", held)[0]) >= capacity - 2 * 4096

            eventually(full, 30, "a full stdout pipe")
            proc.send_signal(sig)

            def taken() -> bool:  # the write it stopped has returned: nothing read meanwhile
                status = Path(f"/proc/{proc.pid}/status").read_text()
                pending = [line.split()[1] for line in status.splitlines()
                           if line.startswith(("SigPnd:", "ShdPnd:"))]
                return not any(int(mask, 16) & 1 << (sig - 1) for mask in pending)

            eventually(taken, 30, "the signal taken")
            data = reader.read()
            _, stderr = proc.communicate(timeout=30)
            assert proc.returncode == code
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    if fmt == "json":
        assert json.loads(data)["status"] == "ok"  # one document, whole
        assert stderr.decode().startswith("Interrupted")
        return
    *lines, last = data.split(b"\n")
    assert last == b""
    documents = [json.loads(line) for line in lines]  # each one whole
    assert [next(iter(document)) for document in documents][-2:] == ["result", "error"]
    assert documents[-2]["result"]["status"] == "ok"
    assert documents[-1]["error"]["code"] == -32095


# -- 3. exit codes, one meaning each ----------------------------------------------------


@pytest.mark.slow
def test_cli_exit_0_and_1_and_4(ctl: Ctl) -> None:
    """0 success, 1 the tool reported an error, 4 it timed out."""
    assert ctl.run("invoke", "hello", "--args", '{"name": "x"}').returncode == 0
    assert ctl.run("invoke", "c_fail").returncode == 1
    assert ctl.run("invoke", "ct").returncode == 4


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["--mode", "full"], 0),  # allow
        ([], 3),  # ask
        (["--headless"], 3),  # deny
        (["--mode", "review"], 3),  # review
    ],
)
def test_cli_classify_exits_like_invoke(ctl: Ctl, args: list[str], expected: int) -> None:
    """classify exits 0 for allow and 3 for deny, ask or review."""
    r = ctl.run("classify", "notes_add", "--args", '{"text": "x"}', *args, "--format", "json")
    assert r.returncode == expected, r.stderr
    decision = one_document(r)["decision"]
    assert (decision == "allow") == (expected == 0)


def _strict_json(text: str) -> Any:
    """Parse JSON as any JSON reader would: ``NaN`` and ``Infinity`` are not JSON."""

    def refuse(name: str) -> None:
        raise ValueError(f"{name} is not JSON")

    return json.loads(text, parse_constant=refuse, parse_float=Decimal)


@pytest.mark.parametrize("fmt", ["json", "jsonl"])
def test_cli_json_stays_json_for_a_number_past_the_double_range(ctl: Ctl, fmt: str) -> None:
    """``--args '{"n": 1e400}'`` is JSON, and the daemon sends it back as written (in the
    classification, and in a denial's ``data``). toolsetctl read it as a float, infinity,
    and printed ``"n": Infinity``: a document no JSON reader takes. It prints every
    number as the daemon wrote it: ``1e400``, and ``1.50`` (not ``1.5``)."""
    r = ctl.run("classify", "c_fail", "--args", '{"n": 1e400, "m": -2.5E+401, "k": 1.50}',
                "--format", fmt)
    assert r.returncode == 0, r.stderr
    document = _strict_json(r.stdout)
    arguments = (document["result"] if fmt == "jsonl" else document)["arguments"]
    assert arguments == {"n": Decimal("1e400"), "m": Decimal("-2.5E+401"), "k": Decimal("1.50")}
    assert '1.50' in r.stdout
    denied = ctl.run("invoke", "notes_add", "--args", '{"text": "x", "n": 1e400}',
                     "--headless", "--format", fmt)
    assert denied.returncode == 3, denied.stderr
    assert _strict_json(denied.stdout)["error"]["data"]["arguments"]["n"] == Decimal("1e400")


@pytest.mark.parametrize("fmt", ["table", "json"])
def test_cli_args_past_the_digit_limit_are_echoed_as_written(ctl: Ctl, fmt: str) -> None:
    """``PYTHONINTMAXSTRDIGITS=0`` and ``classify --args '{"n": 1e200000}'``: the daemon
    echoes the argument as written, as its messages echo a value bounded, but toolsetctl
    wrote it back as its exact integer, 200,001 digits (two million for 1e2000000, in
    50 s). It prints what the daemon sent, ``1e200000``; and with Python's limit in
    place, ``1e5000`` (more digits than Python writes) is sent and echoed the same, no
    longer refused as a number toolsetctl could not print."""
    r = ctl.run("classify", "c_fail", "--args", '{"n": 1e200000, "m": 1e4}', "--format", fmt,
                PYTHONINTMAXSTRDIGITS="0")
    assert r.returncode == 0, r.stderr[-2000:]
    assert len(r.stdout) < 2000, f"{len(r.stdout)} characters"
    shown = r.stdout.replace(" ", "")
    assert '"n":1e200000,' in shown and '"m":1e4' in shown
    limited = ctl.run("classify", "c_fail", "--args", '{"n": 1e5000}', "--format", "json")
    assert limited.returncode == 0, limited.stdout + limited.stderr
    assert _strict_json(limited.stdout)["arguments"]["n"] == Decimal("1e5000")


def test_cli_args_with_a_long_exponent_and_no_digit_limit_are_sent_at_once(ctl: Ctl) -> None:
    """``PYTHONINTMAXSTRDIGITS=0`` (an image that lifts Python's limit on integer digits)
    and ``--args '{"n": 1e2000000}'``: toolsetctl built the exact integer with
    ``int(Decimal)``, quadratic in its two million digits (minutes; 57 s for 1e1000000),
    then wrote it out again looking for half surrogate pairs, all before sending the
    call. It is sent at once now (the run's timeout of 60 s only guards against that
    wait; no time is asserted), and the tool runs: c_fail exits 7, exit 1."""
    r = ctl.run("invoke", "c_fail", "--args", '{"n": 1e2000000}', PYTHONINTMAXSTRDIGITS="0")
    assert r.returncode == 1, r.stderr
    assert r.stdout.startswith("exit 7\n")


@pytest.mark.slow
def test_cli_tool_exit_code(ctl: Ctl) -> None:
    """--tool-exit-code exits with the tool's own code once it ran; a timeout stays 4."""
    assert ctl.run("invoke", "c_fail", "--tool-exit-code").returncode == 7
    assert ctl.run("invoke", "hello", "--args", '{"name": "x"}', "--tool-exit-code").returncode == 0
    assert ctl.run("invoke", "ct", "--tool-exit-code").returncode == 4
    assert (
        ctl.run("invoke", "notes_add", "--args", '{"text": "x"}', "--tool-exit-code").returncode
        == 3
    )


def test_cli_a_tool_s_143_is_told_from_toolsetctl_s_own_sigterm(ctl: Ctl) -> None:
    """``--tool-exit-code`` with a tool that a SIGTERM of its own ended (exit code 143, as
    the daemon reports 128 + n): a shell's ``$?`` is 143, as when toolsetctl itself is
    ended by SIGTERM. What docs/cli.md tells a CI job to read tells them apart: the wait
    status is an exit with 143, not a death by the signal; stdout begins ``exit 143``,
    stderr has no ``Interrupted by SIGTERM``; in ``jsonl`` the result is the tool's, status
    ``error`` and exitCode 143, not ``cancelled``."""
    r = ctl.run("invoke", "c_term", "--tool-exit-code")
    assert r.returncode == 143, r.stderr  # subprocess: -15 for a death by SIGTERM
    assert r.stdout.startswith("exit 143\n")
    assert "Interrupted" not in r.stderr
    r = ctl.run("invoke", "c_term", "--tool-exit-code", "--format", "jsonl")
    assert r.returncode == 143, r.stderr
    result = json.loads(r.stdout.splitlines()[-1])["result"]
    assert (result["status"], result["exitCode"]) == ("error", 143)


@pytest.mark.parametrize("flags", [[], ["--tool-exit-code"]])
def test_cli_a_failed_result_of_a_tool_that_exited_0_is_exit_1(ctl: Ctl, flags: list[str]) -> None:
    """A content-mode tool that exits 0 but prints no content JSON: the result is an error
    (``isError``), and ``--tool-exit-code`` exited 0 with it, the tool's own code, so a CI
    step that gates on the code passed a failed call. The failure is exit 1 either way."""
    r = ctl.run("invoke", "c_content", *flags)
    assert r.returncode == 1, r.stdout + r.stderr
    assert "Tool output is not valid content JSON." in r.stdout


def test_cli_exit_5_lost_connection(ctl: Ctl, tmp_path: Path) -> None:
    """A daemon that closes mid-call is a lost connection: exit 5, naming the socket."""
    path = tmp_path / "s.sock"
    server = socket.socket(socket.AF_UNIX)
    server.bind(str(path))
    server.listen()

    def serve() -> None:
        conn, _ = server.accept()
        conn.recv(65536)
        conn.close()

    thread = threading.Thread(target=serve)
    thread.start()
    try:
        r = subprocess.run(
            [
                sys.executable,
                "-m",
                "toolsetd.client",
                "--socket",
                str(path),
                "status",
                "--format",
                "json",
            ],
            capture_output=True,
            text=True,
            timeout=30,
        )
    finally:
        thread.join(10)
        server.close()
    assert r.returncode == 5
    error = one_document(r)["error"]
    assert error["code"] == -32092 and str(path) in error["message"]


@pytest.mark.parametrize("fmt", ["json", "jsonl"])
def test_cli_json_interrupted_is_an_error_document(tmp_path: Path, fmt: str) -> None:
    """Ctrl-C (or a CI runner's SIGINT on cancel) while ``--format json status`` waits for
    the daemon: exit 130 and an empty stdout, where json promises one document for any
    failure. Now the ``{"error"}`` document of an interruption (-32095)."""
    path = tmp_path / "s.sock"
    server = socket.socket(socket.AF_UNIX)
    server.bind(str(path))
    server.listen()
    server.settimeout(30)
    proc = subprocess.Popen(
        [sys.executable, "-m", "toolsetd.client", "--socket", str(path), "--format", fmt,
         "status"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        conn, _ = server.accept()  # connected: it waits for the answer that never comes
        with conn:
            conn.recv(65536)  # the request is sent
            proc.send_signal(signal.SIGINT)
            out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
        server.close()
    assert proc.returncode == 130, err
    assert json.loads(out)["error"]["code"] == -32095


def test_cli_ctrl_c_while_the_options_are_read_is_an_error_document(tmp_path: Path) -> None:
    """A Ctrl-C (or SIGTERM) while the options were read, before ``run``'s handler, went up
    to the exit with nothing said: exit 130 and an empty stdout for ``--format json``. It
    is the interruption's document, as at any later moment. (Run in this process, with the
    options many enough that reading them takes a while, some 1.7 s of CPU: SIGVTALRM, after
    0.05 s of this process's CPU, stands for the Ctrl-C. A timer thread's signal, as this
    test sent before, came when the thread got the GIL back from the parser, which on a
    loaded machine was once after ``run`` had returned, and then broke the test's own
    teardown.)"""
    import io

    from toolsetd.client.cli import run

    armed = [True]

    def interrupt(signum: int, frame: object) -> None:
        if armed[0]:
            raise KeyboardInterrupt

    out, err = io.StringIO(), io.StringIO()
    before = signal.signal(signal.SIGVTALRM, interrupt)
    signal.setitimer(signal.ITIMER_VIRTUAL, 0.05)
    try:
        argv = ["--socket", str(tmp_path / "s.sock"), "--format", "json", "invoke", "t"]
        code = run([*argv, *["-w"] * 8000], stdout=out, stderr=err)
    except KeyboardInterrupt:  # not up to pytest, which would end the whole session
        code = None
    finally:
        armed[0] = False
        signal.setitimer(signal.ITIMER_VIRTUAL, 0)
        signal.signal(signal.SIGVTALRM, before)
    assert code == 130, (out.getvalue(), err.getvalue())
    assert json.loads(out.getvalue())["error"]["code"] == -32095


def test_cli_ctrl_c_while_its_modules_load_prints_no_traceback(tmp_path: Path) -> None:
    """A CI job cancelled (SIGINT) as ``toolsetctl`` starts: while its modules loaded, before
    any handler of its own, Python printed a traceback and the process died by SIGINT (13
    of 30 tries in a sweep). Swept over the start here: never a traceback; exit 130 (or
    the interpreter's own death by SIGINT, before Python takes the signal at all, or the
    command's outcome, 5, once it has run). A signal inside the interpreter's own start
    (``Fatal Python error: init_sys_streams``) is CPython's, before any code of ours, and
    is not counted, nor is a traceback before ``main`` runs (Python's own start)."""
    import toolsetd.client

    client = Path(toolsetd.client.__file__).parent
    seen = set()
    for step in range(24):
        proc = subprocess.Popen(
            [sys.executable, "-m", "toolsetd.client", "--socket", str(tmp_path / "none.sock"),
             "status"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )
        time.sleep(step * 0.015)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=30)
        if err.startswith("Fatal Python error"):
            continue
        assert "Exception ignored" not in err, (step, err)  # a Ctrl-C lost in a callback
        if "Traceback" in err:
            # The interpreter's own run of the module (runpy, the import of this package
            # and of ``__main__``'s first lines), before ``main`` runs: Python's, not ours.
            assert proc.returncode == -signal.SIGINT, (step, proc.returncode, err)
            ours = [line for line in err.splitlines() if f'"{client}' in line]
            assert all("__main__.py" in line and "<module>" in line for line in ours), err
        assert proc.returncode in (130, -signal.SIGINT, 5), (step, proc.returncode, err)
        seen.add(proc.returncode)
    assert 130 in seen, seen  # the sweep reached the start's Python code


def _write_slow_set(home: Path) -> None:
    """A home set ``slow`` whose one tool sleeps a minute (approval ``always``)."""
    write_set(
        home / "tools",
        "slow",
        {"runner": "exec", **TOOL, "command": ["slow.sh"], "stdin": False, "approval": "always"},
        **{"slow.sh": SH + "sleep 60\n"},
    )


@contextlib.contextmanager
def _slow_invoke(
    daemon_args: list[str], *ctl_args: str
) -> Iterator[tuple[Daemon, subprocess.Popen[str]]]:
    """A daemon (``daemon_args``) serving the ``slow`` set, and ``toolsetctl ctl_args``
    started against it (pipes, text); both stopped, and their folder removed, after."""
    base = Path(tempfile.mkdtemp(prefix="tsx-"))
    try:
        home, workspace = base / "home", base / "ws"
        workspace.mkdir()
        _write_slow_set(home)
        daemon = start_daemon(home, workspace, base, daemon_args)
        ctl = Ctl(daemon, base)
        (base / "user").mkdir()
        proc = subprocess.Popen(
            ctl.argv(*ctl_args),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=ctl.env(),
        )
        try:
            yield daemon, proc
        finally:
            if proc.poll() is None:
                proc.kill()
            for stream in (proc.stdout, proc.stderr):
                if stream is not None:
                    stream.close()
            daemon.stop()
    finally:
        shutil.rmtree(base, ignore_errors=True)


def test_cli_exit_6_cancelled_by_the_daemon(tmp_path: Path) -> None:
    """A call the daemon cancels while stopping exits 6, not 130 (that is Ctrl-C)."""
    with _slow_invoke(
        ["--no-watch", "--shutdown-grace", "0.5"], "invoke", "slow", "--format", "json"
    ) as (daemon, proc):
        eventually(lambda: daemon.call("status")["result"]["inFlight"] == 1, 15, "started")
        daemon.proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=30)
    assert proc.returncode == 6, (out, err)
    assert json.loads(out)["status"] == "cancelled"


def test_cli_exit_6_when_a_closed_event_stream_breaks_at_completed(tmp_path: Path) -> None:
    """``--format jsonl`` whose reader left while the call ran, and the call is then
    cancelled by the daemon (stopping): the stream breaks at ``completed``, so toolsetctl
    cancels nothing, and the code is the call's own, 6, as docs/cli.md says ("its own code
    stands"). It was 141, which says toolsetctl cancelled the call."""
    # A short grace, and no periodic progress for a minute: the next event after
    # `started` is `completed`, however loaded the machine.
    daemon_args = ["--no-watch", "--shutdown-grace", "0.1", "--progress-interval", "60"]
    with _slow_invoke(daemon_args, "--format", "jsonl", "invoke", "slow") as (daemon, proc):
        assert proc.stdout is not None and proc.stderr is not None
        assert json.loads(proc.stdout.readline())["method"] == "started"
        proc.stdout.close()
        eventually(lambda: daemon.call("status")["result"]["inFlight"] == 1, 15, "started")
        daemon.proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=30)
        err = proc.stderr.read()
    assert "the call had already ended" in err, err
    assert code == 6, err


def test_cli_exit_7_not_allowed_shows_the_daemon_sentence(ctl: Ctl) -> None:
    """A peer the daemon refuses sees the daemon's sentence and exits 7 (not allowed).

    The CLI runs as ``nobody``. That user cannot exec this interpreter (it lives under
    /root), so the child forks from this process, drops to nobody and calls the same
    ``run()`` the toolsetctl entry point calls.
    """
    if os.geteuid() != 0:
        pytest.skip("needs root to connect as another user")
    import pwd

    from toolsetd.client.cli import run

    nobody = pwd.getpwnam("nobody")
    os.chmod(ctl.daemon.socket.parent, 0o755)
    os.chmod(ctl.daemon.socket, 0o666)
    results = {}
    for fmt in ("text", "json"):
        read_fd, write_fd = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: become nobody, run the CLI, report what it printed
            os.close(read_fd)
            code = 99
            try:
                import io

                os.setgid(nobody.pw_gid)
                os.setuid(nobody.pw_uid)
                out, err = io.StringIO(), io.StringIO()
                code = run(
                    ["--socket", str(ctl.daemon.socket), "status", "--format", fmt],
                    stdout=out,
                    stderr=err,
                )
                os.write(write_fd, json.dumps([code, out.getvalue(), err.getvalue()]).encode())
            finally:
                os._exit(0)
        os.close(write_fd)
        os.waitpid(pid, 0)
        with os.fdopen(read_fd) as f:
            results[fmt] = json.loads(f.read())
    code, out, err = results["text"]
    assert code == 7, err
    assert "may not call toolsetd" in err and "broken" not in err
    code, out, err = results["json"]
    assert code == 7
    assert json.loads(out)["error"]["code"] == -32009


@contextlib.contextmanager
def _hold_the_only_connection(daemon: Daemon) -> Iterator[RawConn]:
    """Hold a daemon's one connection slot (retrying while the readiness probe's closes).

    The holder subscribes: an idle connection would be closed to make room for a newcomer
    (docs/protocol.md, Limits), a subscriber keeps its slot.
    """
    held: list[RawConn] = []

    def take() -> bool:
        conn = RawConn(daemon.socket)
        try:
            if "result" in conn.request("status") and "result" in conn.request(
                "list", {"subscribe": True}
            ):
                held.append(conn)
                return True
        except OSError:
            pass
        conn.close()
        return False

    eventually(take, 15, "the only connection")
    try:
        yield held[0]
    finally:
        held[0].close()


@contextlib.contextmanager
def _full_daemon() -> Iterator[tuple[Daemon, Path]]:
    """A daemon allowed one connection, with that connection held: every newcomer is refused."""
    base = Path(tempfile.mkdtemp(prefix="tsb-"))
    try:
        for folder in ("home/tools", "ws", "user"):
            (base / folder).mkdir(parents=True)
        daemon = start_daemon(
            base / "home", base / "ws", base, ["--no-watch", "--max-connections", "1"]
        )
        try:
            with _hold_the_only_connection(daemon):
                yield daemon, base
        finally:
            daemon.stop()
    finally:
        shutil.rmtree(base, ignore_errors=True)


def test_cli_exit_8_busy() -> None:
    """A daemon at its connection limit refuses with its sentence: exit 8 (try again)."""
    with _full_daemon() as (daemon, base):
        r = Ctl(daemon, base).run("status")
    assert r.returncode == 8, r.stderr
    assert "Too many connections" in r.stderr


@pytest.mark.anyio
async def test_client_raises_the_daemon_refusal_not_a_broken_pipe() -> None:
    """The async Client raises the error the daemon sent with a null id (here ServerBusy)."""
    with _full_daemon() as (daemon, _base), anyio.fail_after(20):
        async with await Client.connect(daemon.socket) as client:
            with pytest.raises(ServerBusy, match="Too many connections"):
                await client.status()
            with pytest.raises(ServerBusy):  # and every later call too
                await client.status()


def test_cli_exit_9_internal_error(tmp_path: Path) -> None:
    """A daemon internal error (-32603) exits 9 with its message.

    The real daemon answers -32603 only for its own bugs, so a socket stub answers here.
    """
    path = tmp_path / "s.sock"
    server = socket.socket(socket.AF_UNIX)
    server.bind(str(path))
    server.listen()

    def serve() -> None:
        conn, _ = server.accept()
        request = json.loads(conn.recv(65536).split(b"\n")[0])
        reply = {
            "jsonrpc": "2.0",
            "id": request["id"],
            "error": {"code": -32603, "message": "Internal error (incident 42)"},
        }
        conn.sendall(json.dumps(reply).encode() + b"\n")
        conn.close()

    thread = threading.Thread(target=serve)
    thread.start()
    try:
        r = subprocess.run(
            [sys.executable, "-m", "toolsetd.client", "--socket", str(path), "status"],
            capture_output=True,
            text=True,
            timeout=30,
        )
    finally:
        thread.join(10)
        server.close()
    assert r.returncode == 9
    assert "incident 42" in r.stderr


def test_cli_exit_2_usage(ctl: Ctl) -> None:
    """Usage errors exit 2: unknown option, --headless with --approve (explained)."""
    r = ctl.run("status", "--bogus")
    assert r.returncode == 2 and "--bogus" in r.stderr
    r = ctl.run("invoke", "notes_add", "--args", '{"text": "x"}', "--headless", "--approve")
    assert r.returncode == 2
    assert "--headless and --approve cannot be used together" in r.stderr
    assert not (ctl.workspace / ".crystal" / "data" / "tools" / "Acme.Notes").exists()


def test_cli_headless_review_takes_approve(ctl: Ctl) -> None:
    """Headless, a review stays a review (docs/policy.md), and --approve is the reviewer's
    allow: the CLI's own 'run the command again with --approve' works with --headless in
    the review and audit modes, and a credential path is still denied (the reviewer's
    allow does not count for it), where dropping --headless would have let --approve pass
    it."""
    args = ("--args", '{"text": "x"}', "--headless")
    r = ctl.run("invoke", "notes_add", *args, "--mode", "review")
    assert r.returncode == 3 and "again with --approve" in r.stderr, r.stderr
    for mode in ("review", "audit", "full-review"):
        r = ctl.run("invoke", "notes_add", *args, "--mode", mode, "--approve")
        assert r.returncode == 0, r.stderr
    key = ("--args", '{"path": "~/.ssh"}', "--headless", "--mode", "audit", "--approve")
    r = ctl.run("invoke", "notes_index", *key)
    assert r.returncode == 3 and "Denied: Headless run" in r.stderr, r.stderr
    r = ctl.run("invoke", "notes_add", *args, "--mode", "nosuch", "--approve")
    assert r.returncode == 2 and "must be one of" in r.stderr, r.stderr


# -- 4. the approval message names --approve --------------------------------------------


def test_cli_approval_message_names_the_flag(ctl: Ctl) -> None:
    """Approval required tells the operator about --approve, not the wire's approved: true."""
    r = ctl.run("invoke", "notes_add", "--args", '{"text": "x"}')
    assert r.returncode == 3
    assert "--approve" in r.stderr and "approved: true" not in r.stderr
    assert "default mode" in r.stderr  # the classification's reason is kept


# -- 5. the progress line ---------------------------------------------------------------


def _run_on_pty(
    ctl: Ctl,
    args: list[str],
    *,
    stdout_tty: bool,
    stderr_tty: bool,
    release: Callable[[str], bool] | None = None,
    **env: str,
) -> tuple[int, str, str]:
    """Run the CLI with stdout and/or stderr on a pty (80x24); return (code, stdout, stderr).

    A waiting tool is let go (its go file written) once ``release`` holds for what the
    pty showed so far, or after 1.5 s without one (20 s at the most).
    """
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 80, 0, 0))
    go = ctl.workspace / "go"
    go.unlink(missing_ok=True)
    proc = subprocess.Popen(
        ctl.argv(*args),
        env=ctl.env(**env),
        stdin=subprocess.DEVNULL,
        stdout=slave if stdout_tty else subprocess.PIPE,
        stderr=slave if stderr_tty else subprocess.PIPE,
    )
    os.close(slave)
    seen = bytearray()
    started = time.monotonic()
    try:
        reading = True  # until every writer of the pty is gone (EIO)
        while True:
            ready = select.select([master], [], [], 0.05)[0] if reading else []
            if not reading:
                time.sleep(0.05)
            if ready:
                try:
                    chunk = os.read(master, 65536)
                except OSError:
                    chunk = b""
                seen += chunk
                reading = bool(chunk)
            if not go.exists() and (
                time.monotonic() - started > 20
                or (release is not None and release(seen.decode(errors="replace")))
                or (release is None and time.monotonic() - started > 1.5)
            ):
                go.write_text("")  # let the tool finish
            if proc.poll() is not None and not ready:
                break
        out, err = proc.communicate(timeout=30)
    finally:
        go.unlink(missing_ok=True)
        os.close(master)
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    tty = seen.decode(errors="replace")
    text_out = tty if stdout_tty else (out or b"").decode()
    text_err = tty if stderr_tty else (err or b"").decode()
    return proc.returncode, text_out, text_err


def _frames(text: str) -> list[str]:
    """The progress lines drawn ("\\r\\x1b[2K" then the line), in order."""
    return [frame for frame in text.split("\r\x1b[2K") if frame.strip()]


def test_cli_progress_keeps_the_tool_message_between_ticks(ctl: Ctl) -> None:
    """With stdout redirected and stderr a terminal, progress goes to stderr and keeps the
    tool's last message and fraction while periodic ticks update the time."""

    def ticked(seen: str) -> bool:  # a periodic tick at least 0.6 s into the call
        return any(float(t) >= 0.6 for t in re.findall(r"  (\d+\.\d)s  ", seen))

    code, out, err = _run_on_pty(
        ctl, ["invoke", "c_progress"], stdout_tty=False, stderr_tty=True, release=ticked
    )
    assert code == 0, err
    assert out == "exit 0\nworking\ndone\n"
    frames = [f for f in _frames(err) if f.startswith("c_progress  ") and "bytes" in f]
    late = [f for f in frames if float(re.search(r"  (\d+\.\d)s  ", f).group(1)) >= 0.5]
    assert late, frames
    assert all("20%  step 1 of 5" in f for f in late), late
    assert err.endswith("\r\x1b[2K")  # the line is removed at the end
    assert all(len(f) < 80 for f in frames)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("stdout_tty", "stderr_tty", "env"),
    [
        (False, False, {}),  # neither is a terminal
        (True, True, {"CI": "true"}),  # CI is set
        (True, True, {"TERM": "dumb"}),  # Emacs' shell: erase-line would print as garbage
        (True, False, {}),  # only stdout is a terminal: progress never goes there
    ],
)
def test_cli_progress_off(
    ctl: Ctl, stdout_tty: bool, stderr_tty: bool, env: dict[str, str]
) -> None:
    """No progress line when stderr is not a terminal, or when CI is set, or TERM is dumb."""
    code, out, err = _run_on_pty(
        ctl, ["invoke", "c_progress"], stdout_tty=stdout_tty, stderr_tty=stderr_tty, **env
    )
    assert code == 0, err
    assert "\x1b[2K" not in out + err and "bytes" not in out + err
    assert out.replace("\r\n", "\n") == "exit 0\nworking\ndone\n"


# -- 6. a table readable at 80 columns --------------------------------------------------


def test_cli_list_fits_80_columns_on_a_terminal(ctl: Ctl) -> None:
    """On an 80-column terminal the table fits, paths shortened (~, workspace-relative)."""
    env_home = str(ctl.daemon.home.parent)  # ~ is the folder holding the daemon's home
    code, out, _ = _run_on_pty(ctl, ["list"], stdout_tty=True, stderr_tty=True, HOME=env_home)
    assert code == 0
    lines = [line for line in out.replace("\r\n", "\n").splitlines() if line.strip()]
    assert lines[0].split()[:2] == ["Directory", "Source"]
    assert all(len(line) <= 80 for line in lines), lines
    assert "~/home/tools/hello" in out
    assert ".crystal/tools/proj" in out and str(ctl.workspace) not in out


def test_cli_list_shortens_project_paths_of_a_workspace_given_through_a_link(ctl: Ctl) -> None:
    """A ``--workspace`` through a symlink (``~/src`` linking to a bigger disk): the daemon
    serves the folder it leads to and names the project sets there, so the table showed
    their whole resolved paths, where the same workspace given as itself shows them
    relative to it."""
    link = ctl.base / "ws-link"
    link.symlink_to(ctl.workspace)
    try:
        argv = ctl.argv("list")
        argv[argv.index(str(ctl.workspace))] = str(link)
        r = subprocess.run(argv, capture_output=True, text=True, timeout=60, env=ctl.env(),
                           cwd=ctl.base)
        assert r.returncode == 0, r.stderr
        assert ".crystal/tools/proj" in r.stdout
        assert str(ctl.workspace) not in r.stdout, r.stdout
    finally:
        link.unlink()


def test_cli_list_columns_fold_by_width_and_wide_shows_all(ctl: Ctl) -> None:
    """COLUMNS narrows the table; -w shows every reference column with full paths."""
    narrow = ctl.run("list", COLUMNS="80")
    assert all(len(line) <= 80 for line in narrow.stdout.splitlines()), narrow.stdout
    assert "State" in narrow.stdout.splitlines()[0]
    wide = ctl.run("list", "-w", COLUMNS="80")
    header = wide.stdout.splitlines()[0].split()
    assert header == [
        "Directory",
        "Source",
        "Enabled",
        "Effective",
        "Path",
        "Runner",
        "Catalogs",
        "Approval",
        "Tools",
    ]
    assert str(ctl.daemon.home / "tools" / "hello" / "tools.json") in wide.stdout
    text = ctl.run("list", "--format", "text", COLUMNS="80")
    assert str(ctl.daemon.home / "tools" / "hello" / "tools.json") in text.stdout
    assert max(len(line) for line in text.stdout.splitlines()) > 80  # text is never fitted


# -- 7. enable/disable use the running daemon's home ------------------------------------


def test_cli_disable_edits_the_daemons_home(ctl: Ctl) -> None:
    """Without --home, disable edits the daemon's home (not ~/.crystal) and says so."""
    manifest = ctl.daemon.home / "tools" / "hello" / "tools.json"
    before = manifest.read_bytes()
    try:
        r = ctl.run("disable", "hello")
        assert r.returncode == 0, r.stderr
        assert "Tool set hello disabled." in r.stdout
        assert str(ctl.daemon.home) in r.stderr and str(ctl.daemon.socket) in r.stderr
        assert json.loads(manifest.read_text())["enabled"] is False
        listed = one_document(ctl.run("list", "--format", "json"))
        hello = next(s for s in listed["sets"] if s["directory"] == "hello")
        assert hello["enabled"] is False  # the daemon reloaded
        r = ctl.run("enable", "hello", "--format", "json")
        done = one_document(r)
        assert (done["homeFrom"], done["home"], done["reloaded"]) == (
            "daemon",
            str(ctl.daemon.home),
            True,
        )
    finally:
        manifest.write_bytes(before)
        ctl.run("reload")


def test_cli_disable_edits_the_home_crystal_home_names(ctl: Ctl, tmp_path: Path) -> None:
    """Contract section 6: ``--home``, else ``$CRYSTAL_HOME``, else ``~/.crystal``. The
    daemon's home came before ``$CRYSTAL_HOME``: the home the operator named was left as
    it was, and another one edited. The named home is edited now, and stderr says that
    the daemon serves another one (whose set stays as it was)."""
    other = tmp_path / "other"
    shutil.copytree(ctl.daemon.home / "tools" / "hello", other / "tools" / "hello")
    served = ctl.daemon.home / "tools" / "hello" / "tools.json"
    before = served.read_bytes()
    r = ctl.run("disable", "hello", "--format", "json", CRYSTAL_HOME=str(other))
    assert r.returncode == 0, r.stderr
    done = one_document(r)
    assert (done["homeFrom"], done["home"]) == ("environment", str(other))
    assert json.loads((other / "tools" / "hello" / "tools.json").read_text())["enabled"] is False
    assert served.read_bytes() == before
    assert (
        f"The toolsetd at {ctl.daemon.socket} serves the home {ctl.daemon.home}, not this one"
    ) in r.stderr
    assert done["entry"]["enabled"] is False  # the files' entry, not the daemon's
    # A home named through a link to the daemon's is the daemon's: no such warning.
    link = tmp_path / "link"
    link.symlink_to(ctl.daemon.home)
    try:
        r = ctl.run("disable", "hello", CRYSTAL_HOME=str(link))
        assert r.returncode == 0, r.stderr
        assert "serves the home" not in r.stderr, r.stderr
        assert json.loads(served.read_text())["enabled"] is False
    finally:
        served.write_bytes(before)
        ctl.run("reload")


def test_cli_enable_with_a_file_at_the_socket_edits_the_default_home(tmp_path: Path) -> None:
    """Contract section 6: enable and disable work when no daemon runs. A regular file at
    ``--socket`` (a path given by mistake) is no daemon, but the command refused it
    ("Nothing was written"), exit 5; it now edits ``~/.crystal`` as with no socket."""
    user = tmp_path / "user"
    write_set(
        user / ".crystal" / "tools", "off",
        {"runner": "exec", **TOOL, "command": ["/bin/true"], "enabled": False},
    )
    stray = tmp_path / "stray.sock"
    stray.write_text("not a socket\n")
    env = {k: v for k, v in os.environ.items() if k not in ("TOOLSETD_SOCKET", "CRYSTAL_HOME")}
    r = subprocess.run(
        [sys.executable, "-m", "toolsetd.client", "--socket", str(stray), "--workspace",
         str(tmp_path), "enable", "off"],
        capture_output=True, text=True, timeout=60, env={**env, "HOME": str(user)},
    )
    assert r.returncode == 0, r.stderr
    assert "Tool set off enabled." in r.stdout
    manifest = user / ".crystal" / "tools" / "off" / "tools.json"
    assert json.loads(manifest.read_text())["enabled"] is True


@pytest.mark.parametrize(
    ("set_dir", "args"),
    [
        ("home/tools/hello", ("disable", "hello")),
        ("ws/.crystal/tools/proj", ("disable", "proj", "--source", "project")),
        ("home/tools/hello", ("enable", "hello", "--home", "home")),  # already enabled
    ],
)
def test_cli_enable_json_entry_is_the_set_as_show_prints_it(
    ctl: Ctl, set_dir: str, args: tuple[str, ...]
) -> None:
    """With a daemon, ``entry`` is the set as ``show --format json`` prints it after the
    edit: the daemon's ``sets[]`` entry, its state the reloaded one; it was the inventory
    row (``tools.json`` as ``path``, ``Plan+Work``, ``name (always)`` labels, no ``state``)."""
    manifest = ctl.base / set_dir / "tools.json"
    before = manifest.read_bytes()
    args = tuple(str(ctl.base / a) if a == "home" else a for a in args)
    try:
        done = one_document(ctl.run(*args, "--format", "json"))
        shown = ctl.run("show", done["directory"], "--source", done["source"], "--format", "json")
        assert shown.returncode == 0, shown.stderr
        assert done["entry"] == one_document(shown)
        assert done["entry"]["state"] == ("disabled" if args[0] == "disable" else "loaded")
        assert done["entry"]["path"] == os.path.realpath(ctl.base / set_dir)
    finally:
        manifest.write_bytes(before)
        ctl.run("reload")


def test_cli_enable_with_home_option_and_a_missing_home(ctl: Ctl, tmp_path: Path) -> None:
    """--home wins over the daemon's home; a home that does not exist is named."""
    r = ctl.run("disable", "hello", "--home", str(tmp_path / "nowhere"), "--format", "json")
    assert r.returncode == 2
    error = one_document(r)["error"]
    assert error["code"] == -32093 and error["data"]["home"] == str(tmp_path / "nowhere")
    r = ctl.run("disable", "hello", "--home", str(tmp_path / "nowhere"))
    assert f"The home {tmp_path / 'nowhere'} does not exist." in r.stderr


@pytest.mark.parametrize("command", ["disable", "validate"])
def test_cli_a_home_that_is_a_file_is_named_as_such(
    ctl: Ctl, tmp_path: Path, command: str
) -> None:
    """A ``--home`` naming a file (its ``config.json``, say) was said not to exist, which
    sent the operator looking for a missing folder; it is said to be no directory."""
    home = tmp_path / "config.json"
    home.write_text("{}")
    r = ctl.run(command, "hello", "--home", str(home))
    assert r.returncode == 2
    said = r.stderr + r.stdout
    assert f"The home {home} is not a directory." in said or (
        f"The home {home} (--home) is not a directory." in said
    ), said
    assert "does not exist" not in said.split("Tool set directory")[0]


@pytest.mark.slow
def test_make_run_prints_lines_that_make_the_readme_work(tmp_base: Path) -> None:
    """The export lines run-demo.sh prints make the README's commands work as printed.

    In a short folder (``tmp_base``): the demo's socket lies below ``$TMPDIR``, and under
    pytest's own temporary folders its path outgrew AF_UNIX's 107 bytes once the run counter
    reached four digits (the daemon then refuses to start, as it should).
    """
    readme = (REPO / "README.md").read_text()
    section = readme.split("## Trying it", 1)[1].split("\n## ", 1)[0]
    commands = [line for line in section.splitlines() if line.startswith("toolsetctl ")]
    assert {"toolsetctl list", "toolsetctl disable hello"} <= set(commands)
    env = {k: v for k, v in os.environ.items() if k not in ("TOOLSETD_SOCKET", "CRYSTAL_HOME")}
    env["TMPDIR"] = str(tmp_base)
    demo = subprocess.Popen(
        ["bash", str(REPO / "examples" / "run-demo.sh")],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env=env,
        start_new_session=True,
    )
    try:
        assert demo.stdout is not None
        printed = []
        for line in demo.stdout:
            printed.append(line)
            if line.startswith("Stop with"):
                break
        setup = [line.strip() for line in printed if line.strip().startswith(("export ", "cd "))]
        assert [s.split()[0] for s in setup] == ["export", "export", "export", "cd"], printed
        assert all(c.strip() in "".join(printed) for c in commands)
        sock = next(s for s in setup if "TOOLSETD_SOCKET" in s).split("=", 1)[1].strip('"')
        eventually(lambda: os.path.exists(sock), 30, "demo socket")
        script = (
            "set -e\n" + "\n".join(setup) + "\n" + "\n".join(f'{c}\necho "== $?"' for c in commands)
        )
        r = subprocess.run(
            ["bash", "-c", script],
            capture_output=True,
            text=True,
            timeout=120,
            env={**env, "HOME": str(tmp_base)},
        )
        assert r.returncode == 0, r.stdout + r.stderr
        assert "Hello, Ada!" in r.stdout
        assert "Tool set hello disabled." in r.stdout and "was not found" not in r.stderr
        assert r.stdout.count("== 0") == len(commands)
    finally:
        os.killpg(demo.pid, signal.SIGTERM)
        demo.wait(timeout=30)
        if demo.stdout is not None:
            demo.stdout.close()


# -- 8. --version and a description for every flag --------------------------------------


def _options_without_help(help_text: str) -> list[str]:
    """The option lines of an argparse --help that carry no description."""
    lines = help_text.splitlines()
    missing = []
    for index, line in enumerate(lines):
        if not line.startswith("  -"):
            continue
        described = re.search(r"\S\s{2,}\S", line.strip()) is not None
        nxt = lines[index + 1] if index + 1 < len(lines) else ""
        if not described and not (nxt.startswith(" " * 6) and not nxt.strip().startswith("-")):
            missing.append(line.strip())
    return missing


@pytest.mark.slow
def test_cli_version_and_every_flag_described(ctl: Ctl) -> None:
    """toolsetctl --version prints the version; every flag of every command has a description."""
    r = ctl.run("--version")
    assert (r.returncode, r.stdout.strip()) == (0, "toolsetctl 0.1.0")
    for command in ("", *COMMANDS):
        r = ctl.run(*command.split(), "--help")
        assert r.returncode == 0
        assert _options_without_help(r.stdout) == [], (command, r.stdout)


def test_toolsetd_help_describes_every_flag() -> None:
    """toolsetd --help leaves no flag without a description."""
    r = subprocess.run(
        [sys.executable, "-m", "toolsetd.daemon", "--help"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert r.returncode == 0
    assert _options_without_help(r.stdout) == [], r.stdout


# -- 9. start-up: the status path loads none of the heavy modules -----------------------


def test_cli_status_imports_nothing_heavy(ctl: Ctl) -> None:
    """toolsetctl status runs without importing pydantic, rich, anyio, asyncio, orjson,
    jsonschema, typing or dataclasses (their import is most of a slow start)."""
    code = (
        "import sys, io\n"
        "from toolsetd.client.cli import run\n"
        f"code = run(['--socket', {str(ctl.daemon.socket)!r}, 'status'], stdout=io.StringIO())\n"
        "heavy = {'pydantic', 'rich', 'anyio', 'asyncio', 'orjson', 'jsonschema', 'typing',\n"
        "         'dataclasses', 'toolsetd.daemon', 'toolsetd.protocol.models'}\n"
        "print(code, sorted(m for m in sys.modules if m in heavy or m.split('.')[0] in heavy))\n"
    )
    r = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=30, env=ctl.env()
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "0 []"


# -- 11. validate finds what invoke would trip on ---------------------------------------


def test_cli_validate_finds_a_command_file_invoke_cannot_start(ctl: Ctl, tmp_path: Path) -> None:
    """A non-executable command file: validate names it, and invoke's failure names it too."""
    tools = ctl.workspace / ".crystal" / "tools"
    set_dir = write_set(
        tools,
        "noexec",
        {
            "runner": "exec",
            **TOOL,
            "command": ["run.sh"],
            "approval": "always",
            "stdin": False,
        },
        **{"run.sh": SH + "echo hi\n"},
    )
    script = set_dir / "run.sh"
    script.chmod(0o644)
    try:
        r = ctl.run("validate", str(set_dir))
        assert r.returncode == 2
        assert f"Command file {script} is not executable: run chmod +x {script}." in r.stdout
        ctl.run("reload")
        r = ctl.run("invoke", "noexec", "--approve")
        assert r.returncode == 1
        assert r.stdout.strip() == (
            f"The external process failed to start: Permission denied: {script}. "
            f"Command file {script} is not executable: run chmod +x {script}."
        )
        script.chmod(0o755)
        r = ctl.run("validate", "noexec")  # by name: found in the workspace
        assert (r.returncode, r.stdout) == (0, "Tool set noexec is valid: 1 tool (noexec).\n")
    finally:
        shutil.rmtree(set_dir)
        ctl.run("reload")


def test_cli_validate_lists_every_schema_problem_and_a_missing_home(
    ctl: Ctl, tmp_path: Path
) -> None:
    """Every meta-schema problem of a tool is listed, and a --home that does not exist."""
    set_dir = write_set(
        tmp_path,
        "bad",
        {
            "runner": "exec",
            "command": ["true"],
            "description": "d",
            "schema": {"type": "objct", "properties": {"a": {"minimum": "x"}}, "required": "a"},
        },
    )
    r = ctl.run("validate", str(set_dir), "--home", str(tmp_path / "missing"), "--format", "json")
    assert r.returncode == 2
    problems = one_document(r)["problems"]
    assert problems[0] == f"The home {tmp_path / 'missing'} (--home) does not exist."
    schema_problems = [p for p in problems if "invalid JSON Schema" in p]
    assert len(schema_problems) == 3, problems
    assert any("(at /type)" in p for p in schema_problems)
    assert any("(at /properties/a/minimum)" in p for p in schema_problems)
    assert any("(at /required)" in p for p in schema_problems)


def _closed(ctl: Ctl, redirect: str, *args: str) -> subprocess.CompletedProcess[str]:
    """toolsetctl started with a standard descriptor closed (``>&-``, ``<&-``)."""
    return subprocess.run(
        ["/bin/sh", "-c", f'exec "$@" {redirect}', "sh", *ctl.argv(*args)],
        capture_output=redirect != "2>&-", text=True, timeout=30, env=ctl.env(), cwd=ctl.base,
    )


def test_cli_a_closed_stdout_keeps_the_outcome(ctl: Ctl) -> None:
    """``toolsetctl invoke build >&-`` in a CI step: sys.stdout was None, and every
    command ended in an internal error (exit 9) whatever the tool did. A closed stdout is
    one nobody reads: the outcome is the exit code (docs/cli.md)."""
    assert _closed(ctl, ">&-", "invoke", "c_fail").returncode == 1
    assert _closed(ctl, ">&-", "invoke", "c_fail", "--tool-exit-code").returncode == 7
    assert _closed(ctl, ">&-", "--format", "json", "status").returncode == 0
    assert _closed(ctl, "2>&-", "invoke", "c_fail", "--tool-exit-code").returncode == 7
    failed = _closed(ctl, ">&-", "invoke", "c_fail", "--args", "[")
    assert failed.returncode == 2, failed.stderr


def test_cli_mcp_with_stdin_closed_exits(ctl: Ctl) -> None:
    """``toolsetctl mcp <&-``: the socket took descriptor 0 and the pump copied the
    daemon's own answers back to it as the host's input, and never exited. A closed
    stdin is an ended one: the pump exits 0 (it exits when stdin closes)."""
    r = _closed(ctl, "<&-", "mcp", "--no-autostart")
    assert r.returncode == 0, r.stderr
    assert r.stdout == ""


def test_cli_mcp_waits_for_a_non_blocking_stdin(ctl: Ctl) -> None:
    """``toolsetctl mcp`` started by a host that hands it a non-blocking stdin with nothing
    in it yet: the first read failed with EAGAIN, which the pump took for the end of its
    input, and it exited 0 before the host's first request. It waits for input as on a
    blocking stdin, and answers."""
    read_end, write_end = os.pipe()
    os.set_blocking(read_end, False)
    proc = subprocess.Popen(
        ctl.argv("mcp", "--no-autostart"), stdin=read_end, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, env=ctl.env(), cwd=ctl.base,
    )
    os.close(read_end)
    try:
        proc.wait(timeout=3)  # the time it takes to start and find stdin empty
    except subprocess.TimeoutExpired:
        pass
    initialize = {
        "jsonrpc": "2.0", "id": 1, "method": "initialize",
        "params": {"protocolVersion": "2025-06-18", "capabilities": {},
                   "clientInfo": {"name": "t", "version": "1"}},
    }
    try:
        os.write(write_end, json.dumps(initialize).encode() + b"\n")
    except BrokenPipeError:  # it had already gone
        pass
    try:
        assert proc.stdout is not None
        ready, _, _ = select.select([proc.stdout], [], [], 30)
        line = proc.stdout.readline() if ready else b""
    finally:
        os.close(write_end)
        _out, err = proc.communicate(timeout=30)
    assert json.loads(line or b"null") is not None, err
    assert json.loads(line)["id"] == 1
    assert proc.returncode == 0, err


def test_cli_mcp_waits_for_a_non_blocking_stdout(ctl: Ctl) -> None:
    """``toolsetctl mcp`` whose stdout is non-blocking and full (the host reads later):
    the write failed with EAGAIN and the pump exited 9, "cannot write to stdout", with the
    answers after the first 64 KiB lost. It waits for the host to read. The reader here
    reads only once the pipe is full (or the pump has exited), so no timing decides it."""
    initialize = {
        "jsonrpc": "2.0", "id": 0, "method": "initialize",
        "params": {"protocolVersion": "2025-06-18", "capabilities": {},
                   "clientInfo": {"name": "t", "version": "1"}},
    }
    requests = [initialize, {"jsonrpc": "2.0", "method": "notifications/initialized"}]
    requests += [{"jsonrpc": "2.0", "id": n, "method": "tools/list"} for n in range(1, 61)]
    read_end, write_end = os.pipe()
    os.set_blocking(write_end, False)
    size = fcntl.fcntl(write_end, fcntl.F_GETPIPE_SZ)
    proc = subprocess.Popen(
        ctl.argv("mcp", "--no-autostart"), stdin=subprocess.PIPE, stdout=write_end,
        stderr=subprocess.DEVNULL, env=ctl.env(), cwd=ctl.base,
    )
    os.close(write_end)
    assert proc.stdin is not None
    proc.stdin.write(b"".join(json.dumps(r).encode() + b"\n" for r in requests))
    proc.stdin.flush()
    data = b""
    try:
        # Read only once the pipe is at least half full (the pump then has had to wait for
        # it) or the pump has exited; stdin stays open until every answer is in.
        while data.count(b"\n") < 61:
            waiting = struct.unpack("i", fcntl.ioctl(read_end, termios.FIONREAD, b"\0" * 4))[0]
            exited = proc.poll() is not None
            if waiting < size // 2 and not exited and not data:
                select.select([], [], [], 0.01)
                continue
            if exited and not waiting:
                break
            data += os.read(read_end, 1 << 20)
    finally:
        proc.stdin.close()
        os.close(read_end)
        proc.wait(timeout=60)
    assert len(data) > size
    answered = {json.loads(line)["id"] for line in data.splitlines()}
    assert answered == set(range(61))
    assert proc.returncode == 0


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
@pytest.mark.parametrize("fmt", ["json", "jsonl", "table"])
def test_cli_a_failing_stdout_is_said_without_a_traceback(ctl: Ctl, fmt: str) -> None:
    """``toolsetctl --format json status > /dev/full`` (a full disk): the error document
    went to the same failing stdout and toolsetctl printed a traceback (docs/cli.md: no
    command does). Now the failure is one line on stderr, exit 9."""
    with open("/dev/full", "w") as full:
        r = subprocess.run(
            ctl.argv("--format", fmt, "status"), stdout=full, stderr=subprocess.PIPE,
            text=True, timeout=30, env=ctl.env(), cwd=ctl.base,
        )
    assert "Traceback" not in r.stderr
    assert r.stderr.strip().splitlines() == [
        "toolsetctl: unexpected error: OSError: [Errno 28] No space left on device"
    ]
    assert r.returncode == 9


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
@pytest.mark.parametrize("args", [["--help"], ["invoke", "--help"], ["--version"]])
def test_cli_help_into_a_failing_stdout_is_said(ctl: Ctl, args: list[str]) -> None:
    """``toolsetctl --help > /dev/full``: argparse swallowed its own write's OSError, so
    nothing was printed and the exit was 0, where every other command's failing stdout is
    one line on stderr and exit 9 (``mcp --help`` included). A pipe whose reader left is
    no failure, and a failing stderr costs a usage error its line, not its code."""
    with open("/dev/full", "w") as full:
        r = subprocess.run(
            ctl.argv(*args), stdout=full, stderr=subprocess.PIPE,
            text=True, timeout=30, env=ctl.env(), cwd=ctl.base,
        )
    assert "Traceback" not in r.stderr
    assert r.stderr.strip().splitlines() == [
        "toolsetctl: unexpected error: OSError: [Errno 28] No space left on device"
    ]
    assert r.returncode == 9
    read_end, write_end = os.pipe()
    os.close(read_end)  # the reader left before a byte was written
    try:
        closed = subprocess.run(
            ctl.argv(*args), stdout=write_end, stderr=subprocess.PIPE,
            text=True, timeout=30, env=ctl.env(), cwd=ctl.base,
        )
    finally:
        os.close(write_end)
    assert closed.returncode == 0 and closed.stderr == "", closed.stderr
    with open("/dev/full", "w") as full:
        usage = subprocess.run(
            ctl.argv("--bogus"), stdout=full, stderr=full, timeout=30, env=ctl.env(), cwd=ctl.base,
        )
    assert usage.returncode == 2


@pytest.mark.parametrize(
    "locale_env",
    [
        {"PYTHONIOENCODING": "ascii"},
        {"PYTHONIOENCODING": "latin-1"},
        {"LC_ALL": "C", "PYTHONCOERCECLOCALE": "0", "PYTHONUTF8": "0"},
    ],
)
def test_cli_prints_utf8_output_in_any_locale(ctl: Ctl, locale_env: dict[str, str]) -> None:
    """A CI image with a legacy locale: printing the tool's ``Zoë ✓`` raised
    UnicodeEncodeError, the output was lost and toolsetctl exited 2 blaming "the current
    folder's path". Into a pipe the text goes as UTF-8, as the daemon sent it, exit 0."""
    env = {k: v for k, v in ctl.env().items() if k not in ("LANG", "LC_ALL", "LC_CTYPE")}
    env.pop("PYTHONUTF8", None)
    env.pop("PYTHONIOENCODING", None)
    args = ctl.base / "zoe.json"
    args.write_bytes('{"name": "Zoë ✓"}'.encode())  # argv would be decoded by the locale
    r = subprocess.run(
        ctl.argv("invoke", "hello", "--args", f"@{args}"),
        capture_output=True, timeout=60, env={**env, **locale_env}, cwd=ctl.base,
    )
    assert r.returncode == 0, r.stderr
    assert "Hello, Zoë ✓".encode() in r.stdout


def _c_locale(ctl: Ctl) -> tuple[dict[str, str], Path]:
    """A CI image's ``LC_ALL=C`` with Python's UTF-8 mode off, and a workspace ``ws-\u00eb``."""
    env = {k: v for k, v in ctl.env().items() if k not in ("LANG", "LC_ALL", "LC_CTYPE")}
    env.pop("PYTHONUTF8", None)
    env.pop("PYTHONIOENCODING", None)
    env.update(LC_ALL="C", PYTHONCOERCECLOCALE="0", PYTHONUTF8="0")
    workspace = ctl.base / "ws-\u00eb"
    workspace.mkdir(exist_ok=True)
    return env, workspace


def test_cli_takes_utf8_arguments_in_a_locale_that_is_not_utf8(ctl: Ctl) -> None:
    """A CI image with ``LC_ALL=C`` and Python's UTF-8 mode off: Python decodes the command
    line and the current folder's path as ASCII, keeping every other byte as a lone
    surrogate. ``--args '{"name": "Zoë"}'``, ``--session`` and a workspace named ``ws-ë``
    (all UTF-8) were refused as "not valid UTF-8" (exit 2). The daemon gets the bytes they
    were given as, read as UTF-8; bytes that are not UTF-8 are still refused."""
    env, workspace = _c_locale(ctl)

    def run(*args: str | bytes) -> subprocess.CompletedProcess[bytes]:
        argv = [a for a in ctl.argv() if a != str(ctl.workspace) and a != "--workspace"]
        return subprocess.run(
            [*argv, "--workspace", str(workspace), *args],
            capture_output=True, timeout=60, env=env, cwd=ctl.base,
        )

    r = run("invoke", "hello", "--args", '{"name": "Zo\u00eb \u2713"}', "--session", "s-\u00eb")
    assert r.returncode == 0, r.stderr
    assert "Hello, Zo\u00eb \u2713".encode() in r.stdout
    listed = run("--format", "json", "list")
    assert listed.returncode == 0, listed.stderr
    bad = run("invoke", "hello", "--args", b'{"name": "Zo\xeb"}')  # Latin-1, not UTF-8
    assert bad.returncode == 2
    assert b"not valid UTF-8" in bad.stderr


def test_cli_mcp_takes_a_utf8_workspace_in_a_locale_that_is_not_utf8(ctl: Ctl) -> None:
    """``toolsetctl mcp`` in the same CI image: a workspace named ``ws-ë`` (UTF-8) was
    refused as "b'.../ws-\\xc3\\xab' is not UTF-8" (exit 2), though invoke and list
    take it. The pump sends the bytes it was given as, read as UTF-8, as they do."""
    env, workspace = _c_locale(ctl)
    argv = [a for a in ctl.argv() if a != str(ctl.workspace) and a != "--workspace"]
    initialize = {
        "jsonrpc": "2.0", "id": 0, "method": "initialize",
        "params": {"protocolVersion": "2025-06-18", "capabilities": {},
                   "clientInfo": {"name": "t", "version": "1"}},
    }
    lines = [initialize, {"jsonrpc": "2.0", "method": "notifications/initialized"},
             {"jsonrpc": "2.0", "id": 1, "method": "tools/list"}]
    r = subprocess.run(
        [*argv, "--workspace", str(workspace), "mcp", "--no-autostart"],
        input=b"".join(json.dumps(line).encode() + b"\n" for line in lines),
        capture_output=True, timeout=60, env=env, cwd=ctl.base,
    )
    assert r.returncode == 0, r.stderr
    answers = [json.loads(line) for line in r.stdout.splitlines()]
    assert [a.get("id") for a in answers] == [0, 1], answers
    assert "hello" in [t["name"] for t in answers[1]["result"]["tools"]]


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (["status"], "the current folder cannot be used"),
        (["--format", "json", "list"], '"code": -32090'),
        (["mcp", "--no-autostart"], "toolsetctl mcp: error: the current folder cannot be used"),
    ],
)
def test_cli_in_a_removed_current_folder_is_a_usage_error(
    ctl: Ctl, args: list[str], said: str
) -> None:
    """A CI step that runs toolsetctl in a folder an earlier step removed: os.getcwd()
    raised FileNotFoundError and every command, status and mcp included, printed a traceback
    and exited 1 (which means "the tool failed"). Now it is one line, exit 2 (the current
    folder's path is usage, as for one that is not UTF-8)."""
    gone = ctl.base / "gone"
    gone.mkdir()
    argv = [a for a in ctl.argv(*args) if a != str(ctl.workspace)]
    argv.remove("--workspace")
    r = subprocess.run(
        ["/bin/sh", "-c", 'cd "$1" && rmdir "$1" && shift && exec "$@"', "sh", str(gone), *argv],
        capture_output=True, text=True, input="", timeout=30, env=ctl.env(), cwd=ctl.base,
    )
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr
    assert said in r.stdout + r.stderr


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
@pytest.mark.parametrize(
    ("args", "code"),
    [
        (["status"], 9),
        (["--format", "json", "status"], 9),
        (["invoke", "c_fail", "--args", "["], 2),
        (["--socket", "/nonexistent/toolsetd.sock", "status"], 5),
    ],
)
def test_cli_a_failing_stderr_keeps_the_exit_code(ctl: Ctl, args: list[str], code: int) -> None:
    """``toolsetctl ... >log 2>&1`` on a full disk: the message for the failure could not
    be written either, the OSError escaped and Python exited 1 ("the tool reported an
    error") with a traceback nobody could read. The line is lost; the code stands."""
    with open("/dev/full", "w") as full:
        r = subprocess.run(
            ctl.argv(*args), stdout=full, stderr=full, timeout=60, env=ctl.env(), cwd=ctl.base,
        )
    assert r.returncode == code


def test_cli_validate_a_relative_folder_in_a_removed_current_folder(ctl: Ctl) -> None:
    """``toolsetctl --workspace DIR validate ./set`` in a folder an earlier CI step removed:
    the absolute --workspace got past the check for the current folder, then the relative
    DIR needed it and validate ended in an internal error (exit 9). It is usage (exit 2),
    as for every other command; a set's name still finds the set."""
    gone = ctl.base / "gone"
    script = 'mkdir "$1" && cd "$1" && rmdir "$1" && shift && exec "$@"'
    for target, code, said in (
        ("./some-set-folder", 2, "the current folder cannot be used"),
        ("c", 0, "is valid"),
    ):
        r = subprocess.run(
            ["/bin/sh", "-c", script, "sh", str(gone), *ctl.argv("--home", str(ctl.daemon.home), "validate", target)],
            capture_output=True, text=True, timeout=30, env=ctl.env(), cwd=ctl.base,
        )
        assert r.returncode == code, r.stdout + r.stderr
        assert said in r.stdout + r.stderr


def test_cli_json_on_a_terminal_without_utf8_stays_json(ctl: Ctl) -> None:
    """``--format json`` on a terminal whose encoding lacks a character: it was written
    as Python's ``\\xe9`` (and ``\\U0001f600`` past U+FFFF), escapes JSON does not have,
    and the document did not parse. Now ``\\u00e9`` (a UTF-16 pair past U+FFFF): the
    same characters for any JSON reader."""
    args = ctl.base / "zoe-tty.json"
    args.write_bytes('{"name": "Zoë ✓ 😀"}'.encode())
    code, out, err = _run_on_pty(
        ctl, ["--format", "json", "invoke", "hello", "--args", f"@{args}"],
        stdout_tty=True, stderr_tty=False, PYTHONIOENCODING="ascii",
    )
    assert code == 0, err
    assert out.isascii()
    texts = [c["text"] for c in json.loads(out)["content"]]
    assert any("Hello, Zoë ✓ 😀" in text for text in texts), texts


def test_cli_text_names_every_argument_error_by_its_pointer(ctl: Ctl) -> None:
    """In text, every line of a schema refusal starts with its JSON Pointer, the arguments
    object's own error too, and the summary counts the rest as printed below: it said
    "(2 more in data.errors)", which only the JSON document carries. JSON keeps the
    daemon's words and data."""
    args = ("invoke", "hello", "--args", '{"name": 5, "shout": "x", "extra": 1}')
    text = ctl.run(*args)
    assert text.returncode == 2, text.stderr
    summary, *details = text.stderr.splitlines()
    assert summary.endswith(" (2 more below)"), text.stderr
    assert "data.errors" not in text.stderr
    error = one_document(ctl.run(*args, "--format", "json"))["error"]
    assert error["message"].endswith(" (2 more in data.errors)"), error
    firsts = [e for e in error["data"]["errors"] if e["message"] in summary]
    assert len(firsts) == 1, (summary, error)
    rest = [e for e in error["data"]["errors"] if e is not firsts[0]]
    assert details == [f"  {e['path'] or '(the arguments object)'}: "
                       f"{e['message'].removeprefix(e['path'] + ': ') if e['path'] else e['message']}"
                       for e in rest], text.stderr
    assert all(line.startswith(("  /", "  (the arguments object): ")) for line in details)
