"""Operating a real daemon: config reload, ExecReload, journald priorities, metrics, TRACEPARENT."""

from __future__ import annotations

import contextlib
import datetime
import email.utils
import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from .conftest import (
    EXAMPLES,
    REPO,
    Daemon,
    RawConn,
    descriptors_limited,
    eventually,
    pid_namespaces,
    start_daemon,
    write_set,
)

_SH = "#!/bin/sh\n"


def _set(root: Path, name: str, body: str, **manifest: Any) -> None:
    write_set(
        root,
        name,
        {
            "runner": "exec",
            "description": f"test set {name}",
            "schema": {"type": "object"},
            "command": [f"{name}.sh"],
            "stdin": False,
            "approval": "always",
            **manifest,
        },
        **{f"{name}.sh": _SH + body},
    )


@pytest.fixture
def ops_home(tmp_base: Path) -> Path:
    home = tmp_base / "home"
    tools = home / "tools"
    _set(tools, "quick", "echo ok\n")
    _set(tools, "slow", "sleep 30\n", timeoutSeconds=1)
    _set(tools, "guarded", "echo never\n", approval="inherit")
    _set(tools, "sleepy", "sleep 30\n")
    _set(tools, "big", "head -c 300 /dev/zero | tr '\\000' x\n")
    _set(tools, "trace", 'printf "%s" "$TRACEPARENT"\n')
    write_set(
        tools,
        "missing",
        {
            "runner": "exec",
            "description": "no such program",
            "schema": {"type": "object"},
            "command": ["toolsetd-no-such-program-xyz"],
            "stdin": False,
            "approval": "always",
        },
    )
    return home


def _config(tmp_base: Path, text: str) -> Path:
    path = tmp_base / "toolsetd.toml"
    path.write_text(text)
    return path


def _configured(base: Path, text: str, *flags: str) -> tuple[Daemon, Path]:
    """A daemon over base/home reading base/toolsetd.toml (written with ``text``)."""
    config = _config(base, text)
    return start_daemon(base / "home", base / "ws", base, ["--config", str(config), *flags]), config


def _invoke(d: Daemon, workspace: Path, tool: str, **extra: Any) -> dict[str, Any]:
    with d.raw(timeout=30) as conn:
        _, reply = conn.invoke(
            {"tool": tool, "arguments": {}, "workspace": str(workspace), **extra}
        )
    return reply


Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def _metrics(d: Daemon) -> Samples:
    return _samples(d.call("metrics", {})["result"])


def _samples(result: dict[str, Any]) -> Samples:
    assert result["contentType"].startswith("text/plain")
    samples = {}
    for family in text_string_to_metric_families(result["text"]):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return samples


def test_every_metric_is_in_the_docs_table_with_its_type_and_labels(
    ops_home: Path, workspace: Path, tmp_base: Path
) -> None:
    """Each toolsetd_* family of the exposition has its row in docs/operations.md's Metrics
    table, with the row's type and exactly the row's labels; no row names a family the
    daemon does not have."""
    text = (REPO / "docs" / "operations.md").read_text().split("\n## Metrics\n", 1)[1]
    text = text.split("\n## ", 1)[0]
    rows = {
        m.group(1): (m.group(2), set(re.findall(r"`(\w+)`", m.group(3))))
        for m in re.finditer(r"^\| `(toolsetd_\w+)` \| (\w+) \|([^|]*)\|", text, flags=re.M)
    }
    d = start_daemon(ops_home, workspace, tmp_base)
    try:
        assert _invoke(d, workspace, "quick")["result"]["status"] == "ok"
        exposition = d.call("metrics", {})["result"]["text"]
    finally:
        d.stop()
    families = {
        f.name: f
        for f in text_string_to_metric_families(exposition)
        if f.name.startswith("toolsetd_")
    }
    named = {name.removesuffix("_total") for name in rows}
    assert set(families) == named, (sorted(set(families) - named), sorted(named - set(families)))
    for name, family in families.items():
        kind, labels = rows.get(f"{name}_total") or rows[name]
        assert family.type == kind, name
        seen = {label for s in family.samples for label in s.labels} - {"le"}
        assert seen <= labels, (name, seen, labels)


@pytest.mark.slow
def test_metrics_after_a_known_sequence_of_calls(
    ops_home: Path, workspace: Path, tmp_base: Path
) -> None:
    """3 ok, 1 timeout, 1 denied, 1 cancelled, a refused connection and a reload, as counted."""
    d, _config = _configured(tmp_base, "max-connections = 2\nkill-grace = 1\n", "--no-watch")
    try:
        for _ in range(3):
            assert _invoke(d, workspace, "quick")["result"]["status"] == "ok"
        assert _invoke(d, workspace, "slow")["result"]["status"] == "timeout"
        denied = _invoke(d, workspace, "guarded", headless=True)
        assert denied["error"]["code"] == -32003
        assert "result" in d.call("reload", {})
        with d.raw(timeout=30) as a:
            # Earlier connections are closed, but counted until the daemon saw their EOF:
            # wait for a to be alone, so b is accepted and the third one is refused.
            eventually(lambda: a.request("status")["result"]["connections"] == 1, what="a alone")
            b = d.raw(timeout=30)
            a.send(
                {
                    "jsonrpc": "2.0",
                    "id": 1,
                    "method": "invoke",
                    "params": {
                        "tool": "sleepy",
                        "arguments": {},
                        "workspace": str(workspace),
                        "callId": "c-sleepy",
                    },
                }
            )
            assert a.receive()["method"] == "started"
            assert b.request("status")["result"]["connections"] == 2
            # An idle connection would make room for the third (docs/protocol.md, Limits):
            # a subscriber keeps its slot, so the table is full of busy connections.
            assert "result" in b.request("list", {"subscribe": True})
            with RawConn(d.socket) as third:  # over max-connections = 2
                assert third.receive()["error"]["code"] == -32008
            assert b.request("cancel", {"callId": "c-sleepy"})["result"] == {"cancelled": True}
            while "id" not in (reply := a.receive()):
                pass
            assert reply["result"]["status"] == "cancelled"
            m = _samples(b.request("metrics", {})["result"])
            b.close()
    finally:
        d.stop()

    def calls(set_: str, status: str, decision: str) -> float:
        labels = (("decision", decision), ("set", set_), ("status", status))
        return m.get(("toolsetd_calls_total", labels), 0)

    assert calls("quick", "ok", "allow") == 3
    assert calls("slow", "timeout", "allow") == 1
    assert calls("guarded", "refused", "deny") == 1
    assert calls("sleepy", "cancelled", "allow") == 1
    assert sum(v for (name, _), v in m.items() if name == "toolsetd_calls_total") == 6
    assert m[("toolsetd_call_duration_seconds_count", (("set", "quick"),))] == 3
    assert m[("toolsetd_call_duration_seconds_count", (("set", "slow"),))] == 1
    assert m[("toolsetd_call_duration_seconds_sum", (("set", "slow"),))] >= 1.0
    assert m[("toolsetd_call_queue_wait_seconds_count", ())] == 5
    assert m[("toolsetd_output_bytes_total", (("set", "quick"), ("stream", "stdout")))] == 9
    assert m[("toolsetd_connections_refused_total", (("reason", "limit"),))] == 1
    assert m[("toolsetd_reloads_total", (("result", "ok"),))] == 1
    assert m[("toolsetd_reload_duration_seconds_count", ())] == 1
    assert m[("toolsetd_calls_in_flight", ())] == 0
    assert m[("toolsetd_calls_queued", ())] == 0
    assert m[("toolsetd_catalog_sets", (("source", "home"), ("state", "loaded")))] == 7
    assert m[("toolsetd_catalog_tools", (("source", "home"),))] == 7
    assert m[("toolsetd_connections_total", ())] >= 10
    # Labels carry names, statuses and decisions only: never arguments or paths.
    for _, labels in m:
        for key, value in labels:
            assert str(workspace) not in value and key in {
                "set",
                "status",
                "decision",
                "stream",
                "reason",
                "result",
                "source",
                "state",
                "version",
                "le",
            }


def test_sigusr1_and_sigusr2_are_logged_and_end_no_daemon(
    ops_home: Path, workspace: Path, tmp_base: Path
) -> None:
    """SIGUSR1 and SIGUSR2 (a stray kill, an init passing them on) used to end the daemon
    by their default action, with no cleanup; they are logged, and it serves on. A tool
    still gets them at their default action: a handler, not an ignored disposition, which
    the tool would inherit."""
    _set(ops_home / "tools", "usr1", "kill -USR1 $$\necho survived\n")
    d = start_daemon(ops_home, workspace, tmp_base, ["--no-watch"])
    try:
        for signum in (signal.SIGUSR1, signal.SIGUSR2):
            d.proc.send_signal(signum)
            eventually(
                lambda signum=signum: any(
                    e.get("event") == "signal_ignored" and e.get("signal") == signum.name
                    for e in d.log_events()
                ),
                what=f"{signum.name} logged",
            )
        ignored = [e for e in d.log_events() if e.get("event") == "signal_ignored"]
        assert [e.get("stopping") for e in ignored] == [False, False], ignored
        assert d.proc.poll() is None
        assert _invoke(d, workspace, "quick")["result"]["status"] == "ok"
        killed = _invoke(d, workspace, "usr1")["result"]
        assert killed["exitCode"] == 128 + signal.SIGUSR1, killed
        assert "survived" not in json.dumps(killed), killed
    finally:
        d.stop()


def test_deep_arguments_get_the_same_answer_before_and_after_a_large_request(
    tmp_base: Path, workspace: Path
) -> None:
    """The argument check spends the interpreter's recursion limit, which the first text
    over 64 KiB raised (the large parser's) and nothing lowered: a tree of 63 levels
    through a schema with six ``allOf`` a level was refused "nested too deeply to
    validate" before any large request and ran after one. The daemon raises the limit at
    its start, so the answer is the same from the first call."""
    home = tmp_base / "home"
    node: Any = {"type": "object", "properties": {"c": {"$ref": "#"}}}
    for _ in range(6):
        node = {"allOf": [node]}
    _set(home / "tools", "nest", "echo ran\n", schema=node)
    _set(home / "tools", "pad", "echo padded\n")
    deep: Any = {}
    for _ in range(63):
        deep = {"c": deep}
    d = start_daemon(home, workspace, tmp_base, ["--no-watch"])
    try:
        before = _invoke(d, workspace, "nest", arguments={**deep, "d": 1})
        large = _invoke(d, workspace, "pad", arguments={"x": "x" * 100_000})
        assert large["result"]["status"] == "ok", large
        after = _invoke(d, workspace, "nest", arguments={**deep, "d": 1})
        assert before.get("error") == after.get("error"), (before, after)
        assert "result" in before and before["result"]["status"] == "ok", (before, after)
    finally:
        d.stop()


def _start_sleepy(d: Daemon, conn: Any, workspace: Path) -> None:
    """Send an ``invoke`` of ``sleepy`` (id 1) on ``conn`` and wait until it runs."""
    conn.send({"jsonrpc": "2.0", "method": "invoke", "id": 1,
               "params": {"tool": "sleepy", "arguments": {}, "workspace": str(workspace)}})
    eventually(
        lambda: any(e["event"] == "call_started" for e in d.log_events()),
        what="the call started",
    )


def _answer_to(conn: Any, request_id: int) -> dict[str, Any]:
    """The response to ``request_id`` on ``conn``, past the notifications before it."""
    reply = conn.receive()
    while reply.get("id") != request_id:
        reply = conn.receive()
    return reply


def test_sigquit_stops_the_daemon_as_sigterm_does(
    ops_home: Path, workspace: Path, tmp_base: Path
) -> None:
    """SIGQUIT (a terminal's Ctrl-\\, a supervisor whose stop signal it is) was left at its
    default action: the daemon died at once, its socket file left behind and its tools left
    to the orphan guard, a call's caller answered by nothing but a closed connection. It
    is a stop like SIGTERM now: the call in flight is cancelled and answered, the socket
    removed, exit 0."""
    d, _ = _configured(tmp_base, "shutdown-grace = 0.2\nkill-grace = 0.2\n", "--no-watch")
    try:
        with d.raw(timeout=30) as conn:
            _start_sleepy(d, conn, workspace)
            d.proc.send_signal(signal.SIGQUIT)
            reply = _answer_to(conn, 1)
        assert reply["result"]["status"] == "cancelled", reply
        assert d.proc.wait(timeout=20) == 0, d.log()[-2000:]
        stops = [e for e in d.log_events() if e["event"] == "stop_requested"]
        assert [e["signal"] for e in stops] == ["SIGQUIT"]
        assert not d.socket.exists()
    finally:
        if d.proc.poll() is None:
            d.proc.kill()
            d.proc.wait()


def test_a_sighup_in_a_graceful_stops_grace_is_logged_and_reloads_nothing(
    ops_home: Path, workspace: Path, tmp_base: Path
) -> None:
    """A SIGHUP (or a stray SIGUSR1) while a stop waited for a call was dropped without a
    word: an operator whose ``systemctl reload`` met a stopping daemon found nothing in the
    journal. Each is logged as ignored, no reload starts, and the stop ends as it would."""
    d, _ = _configured(tmp_base, "shutdown-grace = 3\nkill-grace = 0.2\n", "--no-watch")
    try:
        with d.raw(timeout=30) as conn:
            _start_sleepy(d, conn, workspace)
            d.proc.send_signal(signal.SIGTERM)
            eventually(
                lambda: any(e["event"] == "stop_requested" for e in d.log_events()),
                what="the stop began",
            )
            for signum in (signal.SIGHUP, signal.SIGUSR1):
                d.proc.send_signal(signum)
                eventually(
                    lambda signum=signum: any(
                        e["event"] == "signal_ignored" and e["signal"] == signum.name
                        and e.get("stopping") is True
                        for e in d.log_events()
                    ),
                    what=f"{signum.name} in the grace logged",
                )
            reply = _answer_to(conn, 1)
        assert reply["result"]["status"] == "cancelled", reply
        assert d.proc.wait(timeout=20) == 0, d.log()[-2000:]
        assert not any(e["event"] == "reload_requested" for e in d.log_events())
    finally:
        if d.proc.poll() is None:
            d.proc.kill()
            d.proc.wait()


@pytest.mark.parametrize("signum", [signal.SIGHUP, signal.SIGUSR1, signal.SIGINT, signal.SIGQUIT])
def test_a_signal_during_the_last_of_a_graceful_stop_changes_nothing(
    ops_home: Path, workspace: Path, tmp_base: Path, signum: signal.Signals
) -> None:
    """Once the stop was done, the daemon's handlers were gone (asyncio puts back the
    default actions) while it still wound down: a SIGHUP (a reload sent as it stopped),
    a stray SIGUSR1 or a Ctrl-C then ended it by that signal, not with the stop's exit 0
    (as process 1's child, the container's exit code was 128 + N). Sent without pause
    through the whole stop, it changes nothing."""
    d = start_daemon(ops_home, workspace, tmp_base, ["--no-watch"])
    try:
        d.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 60  # only against a hang
        while d.proc.poll() is None and time.monotonic() < deadline:
            with contextlib.suppress(ProcessLookupError):
                os.kill(d.proc.pid, signum)
            time.sleep(0.001)
        assert d.proc.wait(timeout=20) == 0, d.log()[-2000:]
    finally:
        if d.proc.poll() is None:
            d.proc.kill()
            d.proc.wait()


def test_metrics_listener_serves_only_get_metrics(
    ops_home: Path, workspace: Path, tmp_base: Path
) -> None:
    """metrics-listen serves GET /metrics on loopback (spawn failures and truncations counted);
    other paths 404, other methods 405."""
    d, _ = _configured(tmp_base, 'metrics-listen = "127.0.0.1:0"\noutput-limit = 100\n')
    try:
        address = next(e["address"] for e in d.log_events() if e["event"] == "metrics_listening")
        _invoke(d, workspace, "quick")
        _invoke(d, workspace, "big")
        assert _invoke(d, workspace, "missing")["result"]["exitCode"] is None
        with urllib.request.urlopen(f"http://{address}/metrics", timeout=10) as response:
            body = response.read().decode()
            assert response.headers["Content-Type"].startswith("text/plain")
            assert email.utils.parsedate_to_datetime(response.headers["Date"]).utcoffset() == (
                datetime.timedelta(0)
            )  # RFC 9110 6.6.1
        assert 'toolsetd_calls_total{decision="allow",set="quick",status="ok"} 1.0' in body
        assert 'toolsetd_spawn_failures_total{set="missing"} 1.0' in body
        assert 'toolsetd_calls_total{decision="allow",set="missing",status="error"} 1.0' in body
        assert 'toolsetd_output_truncations_total{set="big"} 1.0' in body
        for path, method, code in (("/", "GET", 404), ("/metrics", "POST", 405)):
            request = urllib.request.Request(f"http://{address}{path}", method=method)
            with pytest.raises(urllib.error.HTTPError) as caught:
                urllib.request.urlopen(request, timeout=10)  # noqa: S310 - loopback
            assert caught.value.code == code
            caught.value.close()
    finally:
        d.stop()


def test_config_reload_applies_limits_and_names_restart_keys(
    ops_home: Path, workspace: Path, tmp_base: Path
) -> None:
    """reload re-reads toolsetd.toml: limits apply at once, others need a restart, bad keeps."""
    d, config = _configured(tmp_base, "output-limit = 100\n", "--no-watch")
    try:
        assert _invoke(d, workspace, "big")["result"]["truncated"] is True
        config.write_text('output-limit = 100000\nallow-group = "root"\n')
        result = d.call("reload", {})["result"]
        assert result["config"] == {
            "applied": ["output-limit"],
            "restartNeeded": ["allow-group"],
            "error": None,
        }
        assert _invoke(d, workspace, "big")["result"]["truncated"] is False
        config.write_text("output-limit = 10\nmax-running = [\n")
        result = d.call("reload", {})["result"]
        assert result["config"]["error"].startswith(f"{config}:2: is not valid TOML")
        assert _invoke(d, workspace, "big")["result"]["truncated"] is False  # kept
        failed = [e for e in d.log_events() if e["event"] == "config_reload_failed"]
        assert failed and failed[0]["level"] == "error" and str(config) in failed[0]["error"]
        config.write_text("output-limit = 50\n")
        d.proc.send_signal(signal.SIGHUP)
        eventually(
            lambda: any(
                e["event"] == "config_reloaded" and e["applied"] == ["output-limit"]
                for e in d.log_events()
            ),
            what="SIGHUP config reload",
        )
        assert _invoke(d, workspace, "big")["result"]["truncated"] is True
    finally:
        d.stop()


@pytest.mark.parametrize(
    ("line", "said"),
    [
        ('allow-group = "no-such-group-here"', ':1: allow-group: no group is named'),
        ('mcp-token-file = "/nonexistent/token"', ":1: mcp-token-file: needs mcp-listen"),
        ('mcp-listen = "10.1.2.3:8765"', ":1: mcp-listen: "),
        ('traces = "otlp"', ":1: traces: otlp needs opentelemetry-exporter-otlp-proto-http"),
    ],
    ids=["allow-group", "token-without-listen", "listen-not-loopback", "otlp-not-installed"],
)
def test_config_reload_refuses_a_file_the_next_start_would_refuse(
    ops_home: Path, workspace: Path, tmp_base: Path, line: str, said: str
) -> None:
    """A restart-only key the next start would refuse the file for makes the reload fail
    as any unusable file does, with the start's message, and keeps every running setting.
    It was named as needing a restart while the file's other keys applied, and the reload
    (``systemctl reload`` too) succeeded; the next restart exited 2. Each message names
    the file and line: the token's named the flag, the exporter's nothing. And
    ``--print-config``, the upgrade's check of a file, refuses what the start refuses (it
    printed a file whose exporter is not installed)."""
    if line.startswith("traces") and _otlp_exporter_installed():
        pytest.skip("the OTLP exporter is installed here: traces = otlp starts")
    d, config = _configured(tmp_base, "output-limit = 100\n", "--no-watch")
    try:
        config.write_text(f"{line}\noutput-limit = 100000\n")
        result = d.call("reload", {})["result"]
        assert result["config"]["applied"] == [] and result["config"]["restartNeeded"] == []
        assert said in result["config"]["error"], result
        assert _invoke(d, workspace, "big")["result"]["truncated"] is True  # 100 kept
        start = subprocess.run(
            [sys.executable, "-m", "toolsetd.daemon", "--config", str(config),
             "--socket", str(tmp_base / "other.sock"), "--home", str(ops_home)],
            capture_output=True, text=True, timeout=30, check=False,
        )
        assert start.returncode == 2 and said in start.stderr, start.stderr
        check = subprocess.run(
            [sys.executable, "-m", "toolsetd.daemon", "--config", str(config), "--print-config"],
            capture_output=True, text=True, timeout=30, check=False,
        )
        assert check.returncode == 2 and said in check.stderr and not check.stdout, check
    finally:
        d.stop()


def _otlp_exporter_installed() -> bool:
    try:
        import opentelemetry.exporter.otlp.proto.http.trace_exporter  # noqa: F401
    except ImportError:
        return False
    return True


def test_config_sighup_with_seconds_past_a_doubles_range_keeps_the_daemon(
    ops_home: Path, workspace: Path, tmp_base: Path
) -> None:
    """A SIGHUP that read ``kill-grace = 1`` and 400 zeros ended the daemon (float()'s
    OverflowError went past every handler): the file is refused as any bad one is, and
    the daemon serves on with the settings it had."""
    d, config = _configured(tmp_base, "output-limit = 100\n", "--no-watch")
    try:
        config.write_text(f"output-limit = 100000\nkill-grace = 1{'0' * 400}\n")
        d.proc.send_signal(signal.SIGHUP)
        eventually(
            lambda: d.proc.poll() is not None
            or any(e["event"] == "config_reload_failed" for e in d.log_events()),
            what="the SIGHUP's reload judged",
        )
        assert d.proc.poll() is None, d.log()[-3000:]
        failed = [e for e in d.log_events() if e["event"] == "config_reload_failed"]
        assert "kill-grace: must be a finite number of seconds" in failed[0]["error"]
        assert _invoke(d, workspace, "big")["result"]["truncated"] is True  # 100 kept
    finally:
        d.stop()


def test_config_reload_lowering_workspace_idle_releases_within_the_new_period(
    ops_home: Path, workspace: Path, tmp_base: Path
) -> None:
    """The idle check runs every quarter of workspace-idle, at most every 300 s. Started
    at an hour, it slept 300 s whatever a reload said: lowered to 1 s, a workspace stayed
    loaded for minutes. It follows the value in force within a second now."""
    d, config = _configured(tmp_base, "workspace-idle = 3600\n", "--no-watch")
    try:
        d.call("list", {"workspace": str(workspace)})
        assert d.call("status")["result"]["workspaces"] == [str(workspace.resolve())]
        config.write_text("workspace-idle = 1\n")
        assert d.call("reload", {})["result"]["config"]["applied"] == ["workspace-idle"]
        eventually(
            lambda: d.call("status")["result"]["workspaces"] == [],
            timeout=15,
            what="the workspace released after the reload",
        )
    finally:
        d.stop()


def _exec_reload(unit: Path, socket: Path) -> list[str]:
    """The unit's ExecReload= command, pointed at this checkout and this daemon's socket."""
    line = next(raw for raw in unit.read_text().splitlines() if raw.startswith("ExecReload="))
    argv = shlex.split(line.removeprefix("ExecReload="))
    assert argv[0].endswith("/toolsetctl")
    argv = [sys.executable, "-m", "toolsetd.client", *argv[1:]]
    index = argv.index("--socket")
    argv[index + 1] = str(socket)
    return argv


def _run_cli(command: list[str]) -> subprocess.CompletedProcess[str]:
    """Run it as systemd would: from /, waiting for it to exit."""
    return subprocess.run(
        command, capture_output=True, text=True, timeout=30, cwd="/", check=False
    )


@pytest.mark.parametrize("unit", ["toolsetd.service", "system/toolsetd.service"])
def test_exec_reload_returns_after_the_new_generation(
    ops_home: Path, workspace: Path, tmp_base: Path, unit: str
) -> None:
    """The units' ExecReload returns once the reload is done, and fails on a bad config file."""
    d, config = _configured(tmp_base, "", "--no-watch")
    try:
        before = d.call("status")["result"]["generation"]
        _set(ops_home / "tools", "fresh", "echo new\n")
        command = _exec_reload(REPO / "systemd" / unit, d.socket)
        done = _run_cli(command)
        assert done.returncode == 0, done.stderr
        # No waiting: when the command has returned, the new catalog is in place.
        assert d.call("status")["result"]["generation"] == before + 1
        assert "fresh" in {t["name"] for t in d.call("list", {})["result"]["tools"]}
        assert "/" not in d.call("status")["result"]["workspaces"]
        config.write_text("max-running = 0\n")
        failed = _run_cli(command)
        assert failed.returncode == 2  # docs/cli.md: a file the command names is unusable
        assert f"{config}:1: max-running: must be at least 1, got 0" in failed.stderr
    finally:
        d.stop()


def test_journald_priority_prefixes_when_stderr_is_the_journal(
    ops_home: Path, workspace: Path, tmp_base: Path
) -> None:
    """With JOURNAL_STREAM naming stderr, each line starts <N> and keeps its JSON fields."""
    log_path = tmp_base / "daemon.log"
    log_path.touch()
    st = os.stat(log_path)
    config = _config(tmp_base, "")
    d = start_daemon(
        ops_home,
        workspace,
        tmp_base,
        ["--config", str(config), "--max-message-bytes", "1024"],
        env={"JOURNAL_STREAM": f"{st.st_dev}:{st.st_ino}"},
    )
    try:
        _invoke(d, workspace, "quick")
        with d.raw() as conn:
            conn.send_bytes(b"x" * 2048 + b"\n")  # over the limit: a warning
            assert conn.closed_by_peer()
        config.write_text("max-running = 0\n")
        d.call("reload", {})  # a bad file at reload: an error
        eventually(lambda: "config_reload_failed" in d.log(), what="error logged")
    finally:
        d.stop()
    lines = [line for line in d.log().splitlines() if line.startswith("<")]
    assert lines and len(lines) == len([x for x in d.log().splitlines() if x.strip()])
    by_event = {}
    for line in lines:
        prefix, record = line[:3], json.loads(line[3:])
        by_event.setdefault(record["event"], (prefix, record))
    assert by_event["daemon_started"][0] == "<6>"
    assert by_event["request_served"][0] == "<7>"
    assert by_event["connection_frame_too_large"][0] == "<4>"
    assert by_event["config_reload_failed"][0] == "<3>"
    prefix, finished = by_event["call_finished"]
    assert prefix == "<6>" and finished["tool"] == "quick" and finished["status"] == "ok"


def test_journald_a_failed_start_says_why_at_error_priority(tmp_base: Path) -> None:
    """The message of a failed start (a bad config file: exit 2; a port taken: exit 1) went
    to the journal with no priority prefix, so journald filed it at the stream's default,
    info: ``journalctl -u toolsetd -p warning``, which operations.md suggests, left out why
    the daemon was not running. Each such line starts <3> now."""
    (tmp_base / "home").mkdir(exist_ok=True)
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    log_path = tmp_base / "daemon.log"
    try:
        for text, flags, code in (
            ("max-running = 0\n", [], 2),
            ("", ["--metrics-listen", f"127.0.0.1:{taken.getsockname()[1]}"], 1),
            ("", ["--max-runing", "3"], 2),  # a usage error (an ExecStart= typo): argparse's
        ):
            with open(log_path, "wb") as log_file:
                st = os.fstat(log_file.fileno())
                args = [sys.executable, "-m", "toolsetd.daemon", "--home", str(tmp_base / "home")]
                args += ["--socket", str(tmp_base / "s.sock"), "--no-watch"]
                args += ["--config", str(_config(tmp_base, text)), *flags]
                env = {**os.environ, "XDG_CACHE_HOME": str(tmp_base / "cache")}
                env["JOURNAL_STREAM"] = f"{st.st_dev}:{st.st_ino}"
                env.pop("TOOLSETD_SOCKET", None)
                done = subprocess.run(
                    args, stdout=subprocess.DEVNULL, stderr=log_file, env=env, timeout=60
                )
            assert done.returncode == code
            said = [x for x in log_path.read_text().splitlines() if '"event": ' not in x]
            assert said and all(line.startswith("<3>") for line in said), said
            assert any(line.startswith("<3>toolsetd: ") for line in said), said
    finally:
        taken.close()


def test_journald_no_prefix_when_journal_stream_is_another_file(
    ops_home: Path, workspace: Path, tmp_base: Path
) -> None:
    """A JOURNAL_STREAM that names another file leaves plain JSON lines."""
    other = os.stat(tmp_base)
    d = start_daemon(
        ops_home, workspace, tmp_base, env={"JOURNAL_STREAM": f"{other.st_dev}:{other.st_ino}"}
    )
    d.stop()
    events = d.log_events()
    assert events and all(line.startswith("{") for line in d.log().splitlines() if line)


def test_events_inside_a_request_name_it_and_events_after_it_do_not(
    ops_home: Path, workspace: Path, tmp_base: Path
) -> None:
    """``method`` and ``request_id`` mark every event of a request's run, and only those.

    The refusal is logged by the boundary, ``call_started`` deep in the service, in a
    task of the call; the frame error is logged by the same connection's reader right
    after an inline ``status`` ran in it, so a request context left set would show there.
    """
    d = start_daemon(ops_home, workspace, tmp_base, ["--max-message-bytes", "1024"])
    try:
        with d.raw() as conn:
            conn.send({"jsonrpc": "2.0", "method": "invoke", "id": "run-1",
                       "params": {"tool": "quick", "arguments": {}, "workspace": str(workspace)}})
            while conn.receive().get("id") != "run-1":
                pass
            conn.send({"jsonrpc": "2.0", "method": "invoke", "id": 42,
                       "params": {"tool": "no-such-tool", "arguments": {}}})
            assert "error" in conn.receive()
            # An inline method between requests is answered in the transport's callback.
            conn.send({"jsonrpc": "2.0", "method": "cancel", "id": "c-9", "params": {}})
            assert conn.receive()["error"]["code"] == -32602
            assert "result" in conn.request("status")
            conn.send_bytes(b"x" * 2048 + b"\n")  # over the limit: logged by the reader
            assert conn.closed_by_peer()
    finally:
        d.stop()
    events = d.log_events()
    by_event = {e["event"]: e for e in events}
    started = by_event["call_started"]
    refused, cancel = [e for e in events if e["event"] == "request_refused"]
    assert (started["method"], started["request_id"]) == ("invoke", "run-1")
    # docs/operations.md shows a call_started line: the same members as the real one.
    logs = (REPO / "docs" / "operations.md").read_text()
    sample = json.loads(next(line for line in logs.splitlines() if '"call_started"' in line))
    assert list(sample) == list(started)
    assert (refused["method"], refused["request_id"]) == ("invoke", 42)
    assert (cancel["method"], cancel["request_id"]) == ("cancel", "c-9")
    too_large = by_event["connection_frame_too_large"]
    assert too_large["conn_id"] == started["conn_id"] == refused["conn_id"] == cancel["conn_id"]
    assert "method" not in too_large and "request_id" not in too_large
    assert "method" not in by_event["daemon_stopped"]


def test_every_logged_event_is_in_the_docs_table_with_its_level_and_fields(
    ops_home: Path, workspace: Path, tmp_base: Path
) -> None:
    """Each event a daemon logs through a start, calls (run, timed out, refused, unknown),
    a bad frame, a reload and a stop has its row in docs/operations.md's Logs table, at the
    level the row gives, with no member the row does not name (beyond the context members
    every event may carry)."""
    d = start_daemon(ops_home, workspace, tmp_base, ["--max-message-bytes", "1024"])
    try:
        base = {"workspace": str(workspace), "arguments": {}}
        with d.raw() as conn:
            for tool, extra in (("quick", {}), ("slow", {}), ("guarded", {}), ("nope", {})):
                conn.invoke({"tool": tool, **base, **extra})
            assert "result" in conn.request("reload")
            conn.send_bytes(b"x" * 2048 + b"\n")
            assert conn.closed_by_peer()
    finally:
        d.stop()
    events = d.log_events()
    assert {"call_started", "call_finished", "call_refused", "daemon_stopped"} <= {
        e["event"] for e in events
    }
    _assert_documented(events)


def _assert_documented(events: list[dict[str, Any]]) -> None:
    """Each event has its row in docs/operations.md's Logs table, at the row's level, with
    no member the row does not name (beyond the context members every event may carry, and
    ``exception`` where the row says "+ traceback")."""
    logs = (REPO / "docs" / "operations.md").read_text().split("\n## Logs\n", 1)[1]
    logs = logs.split("\n## ", 1)[0]
    rows = {
        # "+ traceback": the event's exception, as log.exception adds it.
        m.group(1): (
            m.group(2),
            set(re.findall(r"`(\w+)`", m.group(3)))
            | ({"exception"} if "+ traceback" in m.group(3) else set()),
        )
        for m in re.finditer(r"^\| `(\w+)` \| (\w+) \|([^|]*)\|", logs, flags=re.M)
    }
    context = {"event", "level", "timestamp", "conn_id", "http_conn_id", "method", "request_id"}
    for event in events:
        assert event["event"] in rows, event
        level, fields = rows[event["event"]]
        assert event["level"] == level, event
        assert set(event) - context <= fields, (event, fields)


def _json_lines(log: str) -> list[dict[str, Any]]:
    """Every line of a JSON log, parsed: one that is not a JSON object fails the test."""
    events = []
    for line in log.splitlines():
        try:
            events.append(json.loads(line))
        except json.JSONDecodeError:
            raise AssertionError(f"not a JSON log line: {line!r}\n{log}") from None
    return events


def _shown_not_obeyed(log: str) -> None:
    """No line of ``log`` is a CI runner's command (``::name::`` opening it, ``##vso[``)."""
    assert "##vso[" not in log, log
    assert not [line for line in log.splitlines() if line.lstrip().startswith("::")], log


def test_a_warning_a_sets_schema_leads_to_is_one_log_event(
    tmp_base: Path, workspace: Path
) -> None:
    """A set whose schema has the pattern "[[a]" makes jsonschema's regex format check
    issue re's FutureWarning ("Possible nested set") while the set is parsed. The
    interpreter printed it on stderr as two bare lines (the file and line, then the source
    line): no JSON object in a JSON log. It is one warning_issued event, as documented."""
    home = tmp_base / "home"
    _set(home / "tools", "nested", "echo ok\n",
         schema={"type": "object", "properties": {"x": {"type": "string", "pattern": "[[a]"}}})
    d = start_daemon(home, workspace, tmp_base)
    try:
        listed = d.call("list", {"workspace": str(workspace)})["result"]
        assert [t["name"] for t in listed["tools"]] == ["nested"]
    finally:
        assert d.stop() == 0
    events = _json_lines(d.log())
    warned = [e for e in events if e["event"] == "warning_issued"]
    assert [(e["category"], e["message"]) for e in warned] == [
        ("FutureWarning", "Possible nested set at position 1")
    ]
    assert re.fullmatch(r".*jsonschema.*\.py:\d+", warned[0]["where"]), warned
    _assert_documented(warned)


#: The daemon, with a SIGALRM handler standing in for a library: its thread crashes, and
#: an object it drops raises in ``__del__`` (the daemon itself has no such path: its
#: worker threads hand every exception to their caller, and no ``__del__`` of its raises).
#: Each message holds a CI runner's commands, as a path from a hostile set folder would.
_REPORTS_ON_ALARM = (
    "import signal, sys, threading\n"
    "from toolsetd.daemon.app import main\n"
    "HOSTILE = 'quoted\\n::add-mask::secret\\n##vso[task.setvariable variable=x]y'\n"
    "class Finalized:\n"
    "    def __del__(self):\n"
    "        raise RuntimeError('__del__ ' + HOSTILE)\n"
    "def crash():\n"
    "    raise RuntimeError('thread ' + HOSTILE)\n"
    "def on_alarm(signum, frame):\n"
    "    threading.Thread(target=crash, name='test-crash').start()\n"
    "    Finalized()\n"
    "signal.signal(signal.SIGALRM, on_alarm)\n"
    "sys.exit(main(sys.argv[1:]))\n"
)


@pytest.mark.parametrize("log_format", ["json", "console"])
def test_a_threads_crash_and_an_exception_ignored_are_log_events_shown_not_obeyed(
    ops_home: Path, workspace: Path, tmp_base: Path, log_format: str
) -> None:
    """An exception that ends a thread and one raised in a ``__del__`` were printed by the
    interpreter itself: tracebacks of bare lines on stderr, outside the JSON log, and
    their text raw, so "::add-mask::" at a line's start and "##vso[" reached a CI job's
    log as commands. Each is one event with an incident id (thread_crashed,
    exception_ignored), made inert as every line is, and the daemon serves on."""
    d = start_daemon(ops_home, workspace, tmp_base, ["--log-format", log_format],
                     launcher=[sys.executable, "-c", _REPORTS_ON_ALARM])
    try:
        d.proc.send_signal(signal.SIGALRM)
        # Their messages, however they are written (logged, or printed raw).
        eventually(lambda: "thread quoted" in d.log() and "__del__ quoted" in d.log(),
                   what="both reports on stderr")
        assert "result" in d.call("status")
    finally:
        assert d.stop() == 0
    log = d.log()
    _shown_not_obeyed(log)
    if log_format == "console":
        assert "\\x3a:add-mask::secret" in log  # the traceback's line, kept and shown
        return
    events = {e["event"]: e for e in _json_lines(log)}
    crashed, ignored = events["thread_crashed"], events["exception_ignored"]
    assert crashed["thread"] == "test-crash"
    assert "RuntimeError: thread quoted\n::add-mask::secret" in crashed["exception"]
    assert ignored["message"] == "Exception ignored in"
    assert ignored["object"].startswith("<function Finalized.__del__ at 0x")
    assert "RuntimeError: __del__ quoted\n::add-mask::secret" in ignored["exception"]
    assert re.fullmatch(r"[0-9a-f]{12}", crashed["incident"])
    assert re.fullmatch(r"[0-9a-f]{12}", ignored["incident"])
    assert crashed["incident"] != ignored["incident"]
    _assert_documented([crashed, ignored])


def _exit_on_alarm(code: str) -> str:
    """The daemon, with a SIGALRM handler that has a task on the daemon's loop raise
    ``SystemExit(code)``, as a library's ``sys.exit`` would in a task (no such library
    path is known).

    Not raised by the handler itself: that lands at whatever bytecode the loop's thread
    is at, and can land inside asyncio's own bookkeeping. It did, once in about 150 runs
    on a loaded machine: inside ``Future.set_result``, after the future was marked done
    and before its waiter's wakeup was scheduled; that task then waited for good, and
    ``asyncio.run``'s cancellation of the remaining tasks never ended. No library's
    ``sys.exit`` lands there, and no daemon code can guard against it.
    """
    return (
        "import asyncio, signal, sys\n"
        "from toolsetd.daemon.app import main\n"
        "async def library():\n"
        f"    raise SystemExit({code})\n"
        "def on_alarm(signum, frame):\n"
        "    loop = asyncio.get_running_loop()\n"
        "    loop.call_soon_threadsafe(lambda: loop.create_task(library()))\n"
        "signal.signal(signal.SIGALRM, on_alarm)\n"
        "sys.exit(main(sys.argv[1:]))\n"
    )


@pytest.mark.parametrize(
    ("code", "asked", "message"),
    [("2", 2, None), ("None", 0, None), ("'bye ##vso[x]y'", 1, "bye ##vso[x]y")],
)
def test_a_system_exit_inside_the_run_stops_the_daemon_as_a_failure_with_a_log_line(
    ops_home: Path, workspace: Path, tmp_base: Path, code: str, asked: int, message: str | None
) -> None:
    """A SystemExit raised while the daemon serves was a crash: a traceback said on
    stderr and bare lines in the JSON log. The daemon stops as a stop does
    (daemon_stopped, its socket removed) and says so in one documented line with the
    code asked for, but exits 1: no one asked it to stop, and 0 would pass for an ordered
    stop, 2 for a configuration error that the units never restart."""
    d = start_daemon(ops_home, workspace, tmp_base,
                     launcher=[sys.executable, "-c", _exit_on_alarm(code)])
    d.proc.send_signal(signal.SIGALRM)
    assert d.proc.wait(timeout=30) == 1, d.log()
    events = _json_lines(d.log())
    _shown_not_obeyed(d.log())
    exited = [e for e in events if e["event"] == "system_exit_raised"]
    assert [(e["code"], e.get("message")) for e in exited] == [(asked, message)]
    assert "SystemExit" in exited[0]["exception"]
    assert "daemon_stopped" in {e["event"] for e in events}
    assert not d.socket.exists()
    _assert_documented(exited)


def test_traceparent_reaches_the_child_and_nothing_optional_is_imported(
    ops_home: Path, workspace: Path, tmp_base: Path
) -> None:
    """Without tracing the caller's traceparent reaches the child as TRACEPARENT; OpenTelemetry
    is never imported and prometheus_client only once metrics are asked for."""
    d = start_daemon(ops_home, workspace, tmp_base, env={"PYTHONPROFILEIMPORTTIME": "1"})
    try:
        parent = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
        reply = _invoke(d, workspace, "trace", traceparent=parent)
        assert reply["result"]["content"][0]["text"] == f"exit 0\n{parent}"
        assert _invoke(d, workspace, "trace")["result"]["content"][0]["text"] == "exit 0\n"
        bad = _invoke(d, workspace, "trace", traceparent="00-xyz")
        assert bad["error"]["code"] == -32602 and "traceparent" in bad["error"]["message"]
        assert "prometheus_client" not in d.log()
        _metrics(d)
        eventually(lambda: "prometheus_client" in d.log(), what="lazy import")
    finally:
        d.stop()
    assert "opentelemetry" not in d.log()


def test_the_daemons_own_trace_context_never_reaches_a_child(
    ops_home: Path, workspace: Path, tmp_base: Path
) -> None:
    """A daemon started inside a traced job has TRACEPARENT and TRACESTATE of its own: they
    name its parent span, so no call's child gets them, with or without a trace."""
    (ops_home / "tools" / "trace" / "trace.sh").write_text(
        _SH + 'printf "%s|%s" "${TRACEPARENT-unset}" "${TRACESTATE-unset}"\n'
    )
    own = {"TRACEPARENT": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
           "TRACESTATE": "vendor=daemon"}
    d = start_daemon(ops_home, workspace, tmp_base, env=own)
    try:
        plain = _invoke(d, workspace, "trace")["result"]["content"][0]["text"]
        assert plain == "exit 0\nunset|unset"
        parent = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
        traced = _invoke(d, workspace, "trace", traceparent=parent)["result"]["content"][0]["text"]
        assert traced == f"exit 0\n{parent}|unset"
    finally:
        d.stop()


def _start_fails(tmp_base: Path, *flags: str) -> subprocess.CompletedProcess[str]:
    """Run ``toolsetd`` over base/home and base/s.sock; it must exit on its own."""
    (tmp_base / "home").mkdir(exist_ok=True)
    args = [sys.executable, "-m", "toolsetd.daemon", "--home", str(tmp_base / "home")]
    args += ["--socket", str(tmp_base / "s.sock"), "--no-watch", *flags]
    if "--config" not in flags:
        args += ["--config", str(_config(tmp_base, ""))]
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_base / "cache")}
    env.pop("TOOLSETD_SOCKET", None)
    return subprocess.run(args, capture_output=True, text=True, timeout=60, env=env, check=False)


def test_an_unknown_allow_group_stops_the_start_plainly(tmp_base: Path) -> None:
    """An allow-group no group has is a settings error (exit 2, the flag or the file's line
    and key, what to do), found before the socket is bound: no traceback, no socket left."""
    done = _start_fails(tmp_base, "--allow-group", "toolsetd-no-such-group")
    assert done.returncode == 2, done.stderr
    assert done.stderr.startswith(
        'toolsetd: --allow-group: no group is named "toolsetd-no-such-group"'
    )
    assert "groupadd" in done.stderr and "Traceback" not in done.stderr
    config = _config(tmp_base, 'max-running = 4\nallow-group = "toolsetd-no-such-group"\n')
    done = _start_fails(tmp_base, "--config", str(config))
    assert done.returncode == 2, done.stderr
    assert done.stderr.startswith(f"toolsetd: {config}:2: allow-group: no group is named")
    assert not (tmp_base / "s.sock").exists()


def test_a_start_without_a_home_directory_says_so(
    tmp_base: Path, as_nobody: tuple[str, ...]
) -> None:
    """No ``~`` (HOME unset and a uid without a passwd entry, as a container's arbitrary
    uid has; or HOME relative) is a settings error (exit 2) that says what to set, with
    CRYSTAL_HOME given or not: Path.home() raised a traceback (exit 1), and a relative HOME
    made ``~`` in path arguments, and the credential paths under it, relative."""
    sock, config = tmp_base / "s.sock", _config(tmp_base, "")
    daemon = [sys.executable, "-m", "toolsetd.daemon", "--socket", str(sock),
              "--config", str(config)]
    no_entry = [p.replace("65534", "54321") for p in as_nobody]
    cases = [
        ({"HOME": "relative"}, [], "HOME is not an absolute path (got 'relative')"),
        ({}, no_entry, "HOME is unset and uid 54321 has no passwd entry"),
        ({"CRYSTAL_HOME": str(tmp_base)}, no_entry, "uid 54321 has no passwd entry"),
    ]
    tmp_base.chmod(0o755)  # uid 54321 reads the config file
    for env, prefix, why in cases:
        done = subprocess.run(
            [*prefix, *daemon], capture_output=True, text=True, timeout=20, check=False,
            env={"PATH": os.environ["PATH"], "XDG_CACHE_HOME": str(tmp_base / "cache"), **env},
        )
        assert done.returncode == 2, done.stderr
        assert done.stderr.startswith("toolsetd: no home directory: "), done.stderr
        assert why in done.stderr and "set HOME" in done.stderr, done.stderr
        assert "Traceback" not in done.stderr
        assert not sock.exists()


@pytest.mark.parametrize("stderr_kind", ["pipe", "file"])
def test_a_start_error_quoting_hostile_text_is_shown_not_obeyed(
    tmp_base: Path, stderr_kind: str
) -> None:
    """A start-up error quotes what it was given: a config key, a socket folder's path.
    ConfigError escaped its control characters, but a CI runner's commands (``##vso[``,
    ``##[``) reached the job's log as commands, and a SocketPathError printed a path's ESC
    sequences raw to the terminal. Each line on the daemon's stderr is shown, not obeyed,
    whether stderr is a pipe (the log writer) or a file."""
    hostile = "a\x1b]0;pwned\x07##vso[task.setvariable variable=X]1"
    in_toml = hostile.replace("\x1b", "\\u001b").replace("\x07", "\\u0007")
    key = tmp_base / "hostile.toml"
    key.write_text(f'"{in_toml}" = 1\n')
    folder = tmp_base / hostile
    folder.write_text("")  # a file where the socket's folder must be
    cases = [
        (["--config", str(key), "--socket", str(tmp_base / "s.sock")], 2, "unknown key"),
        (["--config", str(_config(tmp_base, "")), "--socket", str(folder / "s.sock")], 1,
         "is not a directory"),
    ]
    for flags, code, said in cases:
        argv = [sys.executable, "-m", "toolsetd.daemon", "--home", str(tmp_base / "home"), *flags]
        env = {**os.environ, "XDG_CACHE_HOME": str(tmp_base / "cache")}
        err_path = tmp_base / "err.log"
        with open(err_path, "wb") as err_file:
            done = subprocess.run(
                argv, stdout=subprocess.DEVNULL, timeout=20, check=False, env=env,
                stderr=subprocess.PIPE if stderr_kind == "pipe" else err_file,
            )
        err = (done.stderr or err_path.read_bytes()).decode()
        assert done.returncode == code, err
        assert said in err, err
        assert "\x1b" not in err and "\x07" not in err, err
        assert "##vso[" not in err and "\\x23#vso[" in err, err


def _status_as(path: Path, uid: int, gid: int, groups: list[int]) -> int:
    """A status request from a forked child running as ``uid``/``gid`` with ``groups``:
    0 when answered, 3 when refused as PeerNotAllowed, 1 otherwise."""
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child, measured by its exit status
        status = 1
        try:
            os.setgroups(groups)
            os.setgid(gid)
            os.setuid(uid)
            with RawConn(path) as conn:
                conn.send({"jsonrpc": "2.0", "id": 1, "method": "status"})
                reply = conn.receive()  # a refusal comes with id null, then the close
            if "result" in reply:
                status = 0
            elif reply.get("error", {}).get("code") == -32009:
                status = 3
        except BaseException:  # the child reports by its exit status
            status = 1
        finally:
            os._exit(status)
    _, wait_status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(wait_status)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to call as another user")
def test_a_known_allow_group_is_served_and_others_are_not(
    home: Path, workspace: Path, tmp_base: Path
) -> None:
    """The gid the start looked allow-group up to is what the socket admits: a member
    (by a supplementary group) is served, the same user without it is refused."""
    import grp
    import pwd

    try:
        nobody = pwd.getpwnam("nobody")
        group = grp.getgrnam("daemon")
    except KeyError:
        pytest.skip("no 'nobody' user or 'daemon' group on this machine")
    d = start_daemon(home, workspace, tmp_base, ["--allow-group", "daemon"])
    try:
        # The socket's mode is the first gate (0600; the service makes it 0660 with a
        # group): open it, so that the peer policy is what decides.
        os.chmod(tmp_base, 0o711)
        os.chmod(d.socket, 0o666)
        assert _status_as(d.socket, nobody.pw_uid, nobody.pw_gid, [group.gr_gid]) == 0
        assert _status_as(d.socket, nobody.pw_uid, nobody.pw_gid, []) == 3
    finally:
        d.stop()


def test_metrics_listen_on_a_taken_port_stops_the_start_plainly(tmp_base: Path) -> None:
    """A metrics-listen address that cannot be bound is a start-up failure like a taken
    --mcp-listen: exit 1 with the address and the reason, no traceback, no socket left."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = _start_fails(tmp_base, "--metrics-listen", f"127.0.0.1:{port}")
    assert done.returncode == 1, done.stderr
    assert done.stderr.endswith(
        f"toolsetd: --metrics-listen 127.0.0.1:{port}: cannot listen there "
        "(Address already in use).\n"
    ), done.stderr
    assert "Traceback" not in done.stderr
    assert not (tmp_base / "s.sock").exists()


def _descriptors(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def _scrape(address: str) -> str:
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=10) as response:
        return str(response.read().decode())


def test_metrics_listener_holds_few_connections_and_outlives_running_out(
    ops_home: Path, workspace: Path, tmp_base: Path
) -> None:
    """Any local user may connect to /metrics. Connections that send nothing are served a
    few at a time and the rest closed at once, so the daemon's descriptors stay bounded; an
    accept short of descriptors is retried (metrics_accept_retry), not the daemon's end."""
    d, _ = _configured(tmp_base, 'metrics-listen = "127.0.0.1:0"\n')
    try:
        address = next(e["address"] for e in d.log_events() if e["event"] == "metrics_listening")
        host, port = address.rsplit(":", 1)
        pid = d.proc.pid
        before = _descriptors(pid)
        idle = [socket.create_connection((host, int(port)), timeout=10) for _ in range(200)]
        try:
            eventually(
                lambda: any(e["event"] == "metrics_connection_limit" for e in d.log_events()),
                what="connections beyond the limit closed",
            )
            assert _descriptors(pid) < before + 20
            assert "result" in d.call("status")
        finally:
            for conn in idle:
                conn.close()
        with descriptors_limited(pid), socket.create_connection((host, int(port)), timeout=10):
            eventually(
                lambda: any(e["event"] == "metrics_accept_retry" for e in d.log_events()),
                what="the accept retried",
            )
        body = _scrape(address)  # the connection that waited in the backlog was served
        assert "toolsetd_build_info" in body
        assert d.proc.poll() is None
    finally:
        d.stop()


def test_daemon_started_says_null_when_no_config_file_was_read(tmp_base: Path) -> None:
    """daemon_started's config is the file read, or null (operations.md): a start without
    one logged the string "None", which a jq filter on null never matches."""
    (tmp_base / "home").mkdir()
    args = [sys.executable, "-m", "toolsetd.daemon", "--home", str(tmp_base / "home")]
    args += ["--socket", str(tmp_base / "s.sock"), "--no-watch"]
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_base / "cache")}
    # Where the default file is looked for first, and empty: no /etc or ~/.config file.
    env["CONFIGURATION_DIRECTORY"] = str(tmp_base / "no-config")
    env.pop("TOOLSETD_SOCKET", None)
    log_path = tmp_base / "daemon.log"
    with open(log_path, "wb") as log_file:
        proc = subprocess.Popen(args, stderr=log_file, env=env)
    d = Daemon(proc, tmp_base / "s.sock", tmp_base / "home", tmp_base, log_path, args)
    try:
        eventually(lambda: "daemon_started" in d.log(), timeout=20, what="the start")
        started = next(e for e in d.log_events() if e["event"] == "daemon_started")
        assert started["config"] is None
    finally:
        d.stop()


def test_a_tilde_in_toolsetd_socket_names_one_socket_for_daemon_and_clients(
    tmp_base: Path,
) -> None:
    """With ``TOOLSETD_SOCKET=~/t.sock`` the daemon served ``$HOME/t.sock`` while
    toolsetctl and the MCP pump looked for a relative ``~/t.sock``: now all three agree."""
    (tmp_base / "home").mkdir()
    shutil.copytree(EXAMPLES, tmp_base / "home" / "tools")
    workspace = tmp_base / "ws"
    workspace.mkdir()
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_base / "cache"), "HOME": str(tmp_base)}
    env["TOOLSETD_SOCKET"] = "~/t.sock"
    env.pop("CRYSTAL_HOME", None)
    args = [sys.executable, "-m", "toolsetd.daemon", "--home", str(tmp_base / "home")]
    args += ["--no-watch", "--config", str(_config(tmp_base, ""))]
    log_path = tmp_base / "daemon.log"
    with open(log_path, "wb") as log_file:
        proc = subprocess.Popen(args, stderr=log_file, env=env)
    d = Daemon(proc, tmp_base / "t.sock", tmp_base / "home", workspace, log_path, args)
    try:
        eventually(lambda: "daemon_started" in d.log(), timeout=20, what="the start")
        assert "result" in d.call("status")
        ctl = [sys.executable, "-m", "toolsetd.client", "--workspace", str(workspace)]
        # cwd: where a relative "~/t.sock" would have been looked for.
        status = subprocess.run([*ctl, "status"], capture_output=True, text=True, timeout=60,
                                env=env, cwd=workspace, check=False)
        assert status.returncode == 0, status.stderr
        init = {"jsonrpc": "2.0", "id": 1, "method": "initialize",
                "params": {"protocolVersion": "2025-11-25", "capabilities": {}, "clientInfo": {"name": "t", "version": "1"}}}
        with subprocess.Popen([*ctl, "mcp", "--no-autostart"], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env,
                              cwd=workspace) as pump:
            assert pump.stdin is not None and pump.stdout is not None
            pump.stdin.write(json.dumps(init).encode() + b"\n")
            pump.stdin.flush()
            line = pump.stdout.readline()
            _, err = pump.communicate(timeout=60)
        assert pump.returncode == 0, err
        assert json.loads(line)["result"]["serverInfo"]["name"] == "toolsetd"
        assert not (workspace / "~").exists()
    finally:
        d.stop()


def test_a_flood_of_refused_requests_is_logged_once_a_second_per_method_and_code(
    ops_home: Path, workspace: Path, tmp_base: Path
) -> None:
    """A client can have every request refused as fast as it writes (a single connection
    forced ~20,000 request_refused lines a second). Each method and code is said once a second
    at most,
    its refused field counting the refusals since the last such line."""
    d = start_daemon(ops_home, workspace, tmp_base)
    count = 2000
    try:
        with d.raw(timeout=30) as conn:
            line = {"jsonrpc": "2.0", "method": "cancel", "params": {"callId": "none"}}
            conn.send_bytes(b"".join(
                json.dumps({**line, "id": n}).encode() + b"\n" for n in range(count)
            ))
            answers = [conn.receive() for _ in range(count)]
            assert all(a["error"]["code"] == -32005 for a in answers)
            conn.send({"jsonrpc": "2.0", "method": "cancel", "id": "last", "params": {}})
            assert conn.receive()["error"]["code"] == -32602  # another code: said at once
    finally:
        d.stop()
    refused = [e for e in d.log_events() if e["event"] == "request_refused"]
    unknown = [e for e in refused if e["code"] == -32005]
    assert unknown[0]["refused"] == 1 and unknown[0]["request_id"] == 0
    assert len(unknown) < count / 10
    assert sum(e["refused"] for e in unknown) <= count
    assert [e["request_id"] for e in refused if e["code"] == -32602] == ["last"]


def test_every_refused_or_approved_call_leaves_its_own_audit_line(
    ops_home: Path, workspace: Path, tmp_base: Path
) -> None:
    """request_refused is throttled; what the policy decided about each invoke is not: a
    call_refused line per refused call (tool, set, decision, why), and call_started says
    the decision a call ran under (ask: it ran approved)."""
    d = start_daemon(ops_home, workspace, tmp_base)
    try:
        for _ in range(3):  # within a second: request_refused says one of them
            assert _invoke(d, workspace, "guarded")["error"]["code"] == -32004
        assert _invoke(d, workspace, "guarded", headless=True)["error"]["code"] == -32003
        assert "result" in _invoke(d, workspace, "guarded", approved=True)
    finally:
        d.stop()
    refused = [e for e in d.log_events() if e["event"] == "call_refused"]
    assert [(e["tool"], e["set"], e["source"], e["decision"], e["refused"]) for e in refused] == [
        ("guarded", "guarded", "home", "ask", "approval")
    ] * 3 + [("guarded", "guarded", "home", "deny", "deny")]
    assert all("request_id" in e and "conn_id" in e for e in refused)
    started = [e for e in d.log_events() if e["event"] == "call_started"]
    assert [(e["tool"], e["decision"]) for e in started] == [("guarded", "ask")]


def test_a_long_request_id_is_cut_in_the_log(
    ops_home: Path, workspace: Path, tmp_base: Path
) -> None:
    """A client picks its request ids, up to the line limit: a string id over 128 characters
    is logged cut, with its length, in every event of its request (the answer echoes it
    whole)."""
    d = start_daemon(ops_home, workspace, tmp_base)
    long_id = "i" * 200_000
    try:
        with d.raw(timeout=30) as conn:
            params = {"tool": "quick", "arguments": {}, "workspace": str(workspace)}
            conn.send({"jsonrpc": "2.0", "method": "invoke", "id": long_id, "params": params})
            while "result" not in (answer := conn.receive()):
                pass
            assert answer["id"] == long_id
    finally:
        d.stop()
    shown = "i" * 128 + "... (200000 characters)"
    events = [e for e in d.log_events() if e.get("method") == "invoke"]
    assert {e["event"] for e in events} >= {"call_started", "call_finished"}
    assert all(e["request_id"] == shown for e in events)
    assert max(len(line) for line in d.log().splitlines()) < 2000


@pytest.mark.parametrize("stream", ["pipe", "socket"])
def test_a_stalled_log_reader_stalls_no_client(
    stream: str, ops_home: Path, workspace: Path, tmp_base: Path
) -> None:
    """stderr a pipe (a supervisor, `| less`) or a socket (journald's stream) whose reader
    stopped reading: clients are still served at full speed, the lines past what can be
    held are dropped, and once the reader reads again a `log_lines_dropped` line says how
    many, in their place; every line that comes out is whole."""
    if stream == "pipe":
        read_end, write_end = os.pipe()
    else:
        ours, theirs = socket.socketpair()
        read_end, write_end = ours.detach(), theirs.detach()
    reader = os.fdopen(read_end, "rb", buffering=0)
    sock = tmp_base / "stall.sock"
    config = _config(tmp_base, "")
    proc = subprocess.Popen(
        [sys.executable, "-m", "toolsetd.daemon", "--home", str(ops_home), "--socket",
         str(sock), "--log-level", "debug", "--config", str(config)],
        stdout=subprocess.DEVNULL, stderr=write_end,
        env={**os.environ, "XDG_CACHE_HOME": str(tmp_base / "cache")},
    )
    os.close(write_end)
    try:
        eventually(sock.exists, what="the socket")
        # Each status is a request_served line (~170 bytes): 5,000 are ~850 KB, far more
        # than the pipe (64 KiB) and what is held (256 KiB) together.
        with RawConn(sock, timeout=10) as conn:
            for _ in range(5000):
                assert "result" in conn.request("status")
        # The reader wakes up: it reads what is there, then what the next requests let out.
        os.set_blocking(reader.fileno(), False)
        text = b""
        with RawConn(sock, timeout=10) as conn:
            for _ in range(50):
                conn.request("status")
                text += reader.read() or b""
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        reader.close()
    lines = text.decode().splitlines()
    records = [json.loads(line) for line in lines[:-1]]  # the last may still be on its way
    dropped = [r for r in records if r["event"] == "log_lines_dropped"]
    # They say the gap of the stall: in one line, or in more, for a shorter line that still
    # fits in what is held is kept, with the count so far before it (a fresh clone's run
    # saw 79, then 2,979); a reader slower than the daemon may see more.
    assert dropped and all(r["dropped"] > 0 for r in dropped), dropped
    assert sum(r["dropped"] for r in dropped) > 1000, dropped
    assert dropped[0]["level"] == "warning" and dropped[0]["timestamp"].endswith("Z")
    served = [r for r in records if r["event"] == "request_served"]
    assert len(served) + sum(r["dropped"] for r in dropped) >= 5000


def _daemon_on_a_pipe(ops_home: Path, tmp_base: Path) -> tuple[subprocess.Popen[bytes], Path]:
    """A daemon (debug logs: a line per request) whose stderr is a pipe we read, or not."""
    sock = tmp_base / "piped.sock"
    proc = subprocess.Popen(
        [sys.executable, "-m", "toolsetd.daemon", "--home", str(ops_home), "--socket",
         str(sock), "--log-level", "debug", "--config", str(_config(tmp_base, ""))],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
        env={**os.environ, "XDG_CACHE_HOME": str(tmp_base / "cache")},
    )
    eventually(sock.exists, what="the socket")
    return proc, sock


def test_a_quiet_daemon_lets_out_what_a_stalled_reader_missed(
    ops_home: Path, tmp_base: Path
) -> None:
    """Lines held while the reader was stalled come out once it reads again, even if the
    daemon logs nothing more: the last request's line is not left waiting for a next."""
    proc, sock = _daemon_on_a_pipe(ops_home, tmp_base)
    assert proc.stderr is not None
    try:
        # ~1,000 lines: more than the pipe holds, less than what is held beyond it.
        with RawConn(sock, timeout=10) as conn:
            for _ in range(1000):
                last = conn.request("status")
            assert "result" in last
        os.set_blocking(proc.stderr.fileno(), False)
        text = b""

        def last_line_out() -> bool:
            nonlocal text
            text += proc.stderr.read() or b""  # type: ignore[union-attr]
            return b'"request_id": %d,' % last["id"] in text

        eventually(last_line_out, what="the last request's line")
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        proc.stderr.close()


def test_a_slow_reader_gets_the_last_lines_at_exit(ops_home: Path, tmp_base: Path) -> None:
    """A stderr reader that is slow but reading gets every line up to daemon_stopped, each
    whole: the lines still held when the daemon stops go out before it exits."""
    import threading
    import time

    proc, sock = _daemon_on_a_pipe(ops_home, tmp_base)
    assert proc.stderr is not None
    chunks: list[bytes] = []

    def slow() -> None:
        while chunk := os.read(proc.stderr.fileno(), 4096):  # type: ignore[union-attr]
            chunks.append(chunk)
            time.sleep(0.02)  # ~200 KB/s: behind the daemon, but reading

    reader = threading.Thread(target=slow)
    reader.start()
    try:
        with RawConn(sock, timeout=10) as conn:
            for _ in range(1500):
                assert "result" in conn.request("status")
        proc.terminate()
        assert proc.wait(timeout=30) == 0
    finally:
        reader.join(timeout=60)
        proc.stderr.close()
    text = b"".join(chunks).decode()
    assert text.endswith("\n")
    records = [json.loads(line) for line in text.splitlines()]  # every line whole
    assert records[-1]["event"] == "daemon_stopped"
    served = sum(r["event"] == "request_served" for r in records)
    dropped = sum(r.get("dropped", 0) for r in records if r["event"] == "log_lines_dropped")
    assert served + dropped >= 1500


def test_a_stalled_log_reader_does_not_hold_a_failed_start(tmp_base: Path) -> None:
    """A start-up error with stderr a pipe nobody reads (and full): the daemon still exits,
    with its exit code; its message waits for the reader a bounded time, never for ever."""
    import fcntl

    (tmp_base / "home").mkdir(exist_ok=True)
    read_end, write_end = os.pipe()
    fcntl.fcntl(write_end, fcntl.F_SETFL, os.O_NONBLOCK)
    try:
        while True:
            os.write(write_end, b"x" * 4096)  # the reader has stopped: the pipe is full
    except BlockingIOError:
        pass
    fcntl.fcntl(write_end, fcntl.F_SETFL, 0)
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = taken.getsockname()[1]
    args = [sys.executable, "-m", "toolsetd.daemon", "--home", str(tmp_base / "home")]
    args += ["--socket", str(tmp_base / "s.sock"), "--no-watch"]
    args += ["--config", str(_config(tmp_base, "")), "--metrics-listen", f"127.0.0.1:{port}"]
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_base / "cache")}
    env.pop("TOOLSETD_SOCKET", None)
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=write_end, env=env)
    os.close(write_end)
    try:
        assert proc.wait(timeout=60) == 1
    finally:
        proc.kill()
        proc.wait()
        os.close(read_end)
        taken.close()


def test_the_daemon_raises_its_open_files_limit_to_the_hard_one(
    ops_home: Path, tmp_base: Path
) -> None:
    """Started with 1,024 soft (systemd's and most logins' default) under a higher hard
    limit, the daemon takes the hard one: a hundred idle clients must not hold every
    descriptor. It says so once."""
    import resource

    sock = tmp_base / "nofile.sock"

    def low() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (256, 4096))

    proc = subprocess.Popen(
        [sys.executable, "-m", "toolsetd.daemon", "--home", str(ops_home), "--socket",
         str(sock), "--config", str(_config(tmp_base, ""))],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, preexec_fn=low,
        env={**os.environ, "XDG_CACHE_HOME": str(tmp_base / "cache")},
    )
    try:
        eventually(sock.exists, what="the socket")
        assert resource.prlimit(proc.pid, resource.RLIMIT_NOFILE) == (4096, 4096)
    finally:
        proc.terminate()
        _, err = proc.communicate(timeout=30)
    raised = [json.loads(line) for line in err.splitlines() if b"open_files_limit_raised" in line]
    assert [(e["soft"], e["limit"]) for e in raised] == [(256, 4096)]


def test_a_daemon_started_with_signals_blocked_stops_on_sigterm_and_blocks_none_for_tools(
    tmp_base: Path,
) -> None:
    """A parent that blocks signals hands its mask to what it starts (a host's worker
    thread, a supervisor): a daemon started with SIGTERM, SIGINT and SIGHUP blocked never
    received them (SIGTERM left it running, and the test had to SIGKILL it), and every
    tool inherited the mask, so a timed-out or cancelled tool never got its grace SIGTERM.
    The daemon clears its mask at start, as systemd does for a service."""
    home = tmp_base / "home"
    write_set(home / "tools", "mask", {  # no shell: dash clears its mask as it starts
        "runner": "exec", "description": "its signal mask", "schema": {"type": "object"},
        "command": [shutil.which("grep"), "-E", "^Sig(Blk|Ign):", "/proc/self/status"],
        "stdin": False, "approval": "always",
    })
    workspace = tmp_base / "ws"
    workspace.mkdir()
    blocked = {signal.SIGTERM, signal.SIGINT, signal.SIGHUP}
    old = signal.pthread_sigmask(signal.SIG_BLOCK, blocked)  # Popen's child takes it
    try:
        d = start_daemon(home, workspace, tmp_base)
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)
    try:
        reply = _invoke(d, workspace, "mask")
        lines = reply["result"]["content"][0]["text"].splitlines()
        assert "SigBlk:\t0000000000000000" in lines, lines
        unblocked = [e for e in d.log_events() if e.get("event") == "signals_unblocked"]
        assert [sorted(e["signals"]) for e in unblocked] == [["SIGHUP", "SIGINT", "SIGTERM"]]
        assert d.stop(signal.SIGTERM, timeout=20) == 0
    finally:
        if d.proc.poll() is None:
            d.proc.kill()
            d.proc.wait()


#: Starts the daemon with these signals ignored, as a parent that ignores them hands on
#: (SIG_IGN survives exec): a supervisor or a host that set SIGCHLD to SIG_IGN to avoid
#: zombies, a non-interactive shell's ``toolsetd &`` (SIGQUIT).
_IGNORED_BY_LAUNCHER = ("SIGCHLD", "SIGQUIT", "SIGALRM", "SIGTTOU")


def _launcher_ignoring(names: tuple[str, ...]) -> str:
    """A ``python -c`` launcher that execs the daemon with the signals ``names`` ignored.

    Every other signal is set back to its default first: one the test's own environment
    ignores (a CI runner's SIGURG, say) would be restored too, and named in the log."""
    return (
        "import contextlib, os, signal, sys\n"
        "for signum in signal.valid_signals():\n"
        "    with contextlib.suppress(OSError, ValueError):\n"
        "        signal.signal(signum, signal.SIG_DFL)\n"
        f"for name in {names!r}:\n"
        "    signal.signal(getattr(signal, name), signal.SIG_IGN)\n"
        "os.execv(sys.executable, [sys.executable, '-m', 'toolsetd.daemon', *sys.argv[1:]])\n"
    )


_IGNORING = _launcher_ignoring(_IGNORED_BY_LAUNCHER)


def test_a_daemon_started_with_signals_ignored_reports_exit_codes_and_ignores_none_for_tools(
    tmp_base: Path,
) -> None:
    """An ignored signal stays ignored across exec. Started with SIGCHLD ignored, the
    kernel reaped every tool at once, so the daemon never learnt how one ended: a tool
    that exited 5 was a call with status "ok" and exit code 0 (and bubblewrap's probe,
    waiting for its child, timed out, so the sandbox was off). Every tool inherited the
    ignored signals too (a Python tool's subprocess.run returned 0 for every child). The
    daemon now sets them back to their default at start, as systemd does for a service."""
    home = tmp_base / "home"
    write_set(home / "tools", "sig", {
        "runner": "exec", "stdin": False, "approval": "always", "tools": [
            {"name": "fail", "description": "exits 5", "schema": {"type": "object"},
             "command": ["/bin/sh", "-c", "exit 5"]},
            {"name": "ign", "description": "its ignored signals", "schema": {"type": "object"},
             "command": [shutil.which("grep"), "^SigIgn:", "/proc/self/status"]},
        ],
    })
    workspace = tmp_base / "ws"
    workspace.mkdir()
    d = start_daemon(home, workspace, tmp_base, launcher=[sys.executable, "-c", _IGNORING])
    try:
        result = _invoke(d, workspace, "fail")["result"]
        assert (result["status"], result["exitCode"]) == ("error", 5), result
        text = _invoke(d, workspace, "ign")["result"]["content"][0]["text"]
        # SIGTTOU stays ignored: a daemon writing to a terminal from the background is not
        # stopped. Only the launcher's four are looked at: a signal the C library keeps for
        # itself (32, 33) may be ignored by an ancestor, and no process can change it.
        mask = int(text.split("SigIgn:")[1].split()[0], 16)
        ignored = {name for name in _IGNORED_BY_LAUNCHER if mask >> (signal.Signals[name] - 1) & 1}
        assert ignored == {"SIGTTOU"}, text
        restored = [e for e in d.log_events() if e.get("event") == "signals_restored"]
        # SIGQUIT is no longer ignored either: the daemon handles it (a stop, as SIGTERM).
        assert [sorted(e["signals"]) for e in restored] == [["SIGALRM", "SIGCHLD"]]
        assert d.stop(signal.SIGTERM, timeout=20) == 0
    finally:
        if d.proc.poll() is None:
            d.proc.kill()
            d.proc.wait()


def test_a_daemon_started_as_a_scripts_background_job_still_stops_on_sigint(
    tmp_base: Path,
) -> None:
    """``toolsetd &`` in a script starts it with SIGINT and SIGQUIT ignored (POSIX: a
    background job of a shell without job control). The daemon still stops gracefully on
    SIGINT (docs/operations.md, "Started with & from a script"): a Ctrl-C on the script
    ends it with the script instead of leaving it serving with the job's environment."""
    workspace = tmp_base / "ws"
    workspace.mkdir()
    launcher = [sys.executable, "-c", _launcher_ignoring(("SIGINT", "SIGQUIT"))]
    d = start_daemon(tmp_base / "home", workspace, tmp_base, launcher=launcher)
    try:
        assert d.stop(signal.SIGINT, timeout=20) == 0
        stops = [e for e in d.log_events() if e.get("event") == "stop_requested"]
        assert [e["signal"] for e in stops] == ["SIGINT"], stops
    finally:
        if d.proc.poll() is None:
            d.proc.kill()
            d.proc.wait()


def _private_mounts() -> bool:
    """Whether a test may run a command in a mount namespace of its own (root, unshare)."""
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        return False
    done = subprocess.run(
        ["unshare", "-m", "--propagation", "private", "/bin/true"],
        capture_output=True, timeout=30, check=False,
    )
    return done.returncode == 0


def test_a_mount_point_named_in_utf8_stops_no_start(tmp_base: Path) -> None:
    """A USB stick labelled "Clé USB" is mounted at /media/ada/Clé USB: the cgroup probe
    read /proc/self/mountinfo as ASCII, and the daemon died at start with a traceback
    (UnicodeDecodeError) on any machine with a mount point not in ASCII. The mount is made
    in a mount namespace of the daemon's own, so nothing else on the machine sees it."""
    if not _private_mounts():
        pytest.skip("needs root and unshare -m")
    home = tmp_base / "home"
    write_set(home / "tools", "hi", {
        "runner": "exec", "stdin": False, "approval": "always", "tools": [
            {"name": "hi", "description": "says hi", "schema": {"type": "object"},
             "command": ["/bin/echo", "hi"]},
        ],
    })
    workspace = tmp_base / "ws"
    workspace.mkdir()
    stick = tmp_base / "Clé USB"
    stick.mkdir()
    launcher = [
        "unshare", "-m", "--propagation", "private", "sh", "-c",
        'mount -t tmpfs stick "$0" && exec "$@"', str(stick),
        sys.executable, "-m", "toolsetd.daemon",
    ]
    d = start_daemon(home, workspace, tmp_base, launcher=launcher)
    try:
        result = _invoke(d, workspace, "hi")["result"]
        assert (result["status"], result["content"][0]["text"]) == ("ok", "exit 0\nhi\n")
        assert d.stop(signal.SIGTERM, timeout=20) == 0
    finally:
        if d.proc.poll() is None:
            d.proc.kill()
            d.proc.wait()


def test_a_daemon_started_without_its_standard_descriptors_serves(
    ops_home: Path, tmp_base: Path
) -> None:
    """``toolsetd 2>&- >&- <&-`` (a supervisor that closes them): the log writer met a
    ``None`` stderr and the daemon exited 1 before serving, with nothing said anywhere.
    Now the three are /dev/null and the daemon serves."""
    sock = tmp_base / "closed.sock"
    argv = [sys.executable, "-m", "toolsetd.daemon", "--home", str(ops_home), "--socket",
            str(sock), "--no-watch", "--config", str(_config(tmp_base, ""))]
    proc = subprocess.Popen(
        ["/bin/sh", "-c", 'exec "$@" <&- >&- 2>&-', "sh", *argv],
        env={**os.environ, "XDG_CACHE_HOME": str(tmp_base / "cache")},
    )
    try:
        def answers() -> bool:
            assert proc.poll() is None, f"toolsetd exited {proc.returncode}"
            try:
                with RawConn(sock, timeout=5) as conn:
                    return "result" in conn.request("status")
            except (OSError, EOFError):
                return False

        eventually(answers, timeout=20, what="an answer")
        fds = {fd: os.readlink(f"/proc/{proc.pid}/fd/{fd}") for fd in (0, 1, 2)}
        assert fds == {0: os.devnull, 1: os.devnull, 2: os.devnull}
    finally:
        proc.terminate()
        assert proc.wait(timeout=30) == 0


def test_reload_into_a_closed_pipe_still_fails_on_an_unusable_config(
    ops_home: Path, tmp_base: Path
) -> None:
    """``toolsetctl reload | head -n0`` with a broken toolsetd.toml exited 0: the printing
    of what changed met the closed pipe first, and a broken pipe meant "success" (docs/cli.md:
    a failure's code is the exit code, read or not). Now it exits 2; a good file exits 0."""
    d, config = _configured(tmp_base, "", "--no-watch")
    try:
        argv = [sys.executable, "-m", "toolsetd.client", "--socket", str(d.socket), "reload"]
        for text, expected in (('max-running = "x"\n', 2), ("max-running = 3\n", 0)):
            config.write_text(text)
            proc = subprocess.Popen(
                argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=tmp_base
            )
            assert proc.stdout is not None and proc.stderr is not None
            proc.stdout.close()  # the reader is gone before anything is printed
            with proc.stderr:
                proc.stderr.read()
            assert proc.wait(timeout=30) == expected, text
    finally:
        d.stop()


def test_console_log_shows_a_clients_control_characters_escaped(
    ops_home: Path, tmp_base: Path
) -> None:
    """``--log-format console`` (for people at a terminal) printed a client's request id as
    it came: ESC sequences (OSC 52 writes the clipboard, OSC 0 the title), C1 CSI and bidi
    overrides reached the operator's terminal. Now each is its escape, as toolsetctl shows
    names; the JSON form escaped them already."""
    d = start_daemon(ops_home, tmp_base / "ws", tmp_base, ["--log-format", "console"])
    try:
        with d.raw() as conn:
            for request_id in ("\x1b]52;c;cHduZWQ=\x07", "\x9b2J\u202eevil"):
                conn.send({"jsonrpc": "2.0", "id": request_id, "method": "status"})
                assert conn.receive()["id"] == request_id
        eventually(lambda: d.log().count("request_served") >= 2, what="the log lines")
    finally:
        d.stop()
    log = d.log()
    assert not {"\x1b", "\x07", "\x9b", "\u202e"} & set(log)
    assert "\\x1b]52;c;cHduZWQ=" in log  # (quoted by the renderer: it holds a "=")
    assert "request_id=\\x9b2J\\u202eevil" in log


def test_a_stalled_span_reader_holds_the_exit_a_bounded_time(
    ops_home: Path, workspace: Path, tmp_base: Path
) -> None:
    """traces = "console" with stdout a FIFO nobody reads: the batched spans cannot go out,
    and the exporter's flush at exit waited for them 30 s (the SDK's shutdown join) after
    daemon_stopped; a hanging OTLP collector held it the same way, past systemd's
    TimeoutStopSec= with the graces. The flush now waits 2 s at most, as the log does."""
    import time

    fifo = tmp_base / "spans"
    os.mkfifo(fifo)
    reader = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)  # open, never read
    try:
        launcher = ["sh", "-c", f'exec "$@" > {shlex.quote(str(fifo))}', "sh"]
        launcher += [sys.executable, "-m", "toolsetd.daemon"]
        d = start_daemon(
            ops_home, workspace, tmp_base, ["--traces", "console", "--no-watch"],
            env={"OTEL_BSP_SCHEDULE_DELAY": "50"}, launcher=launcher,
        )  # fmt: skip
        try:
            with d.raw(timeout=60) as conn:
                for _ in range(60):  # ~3 spans of ~1 KB each: far past the FIFO's 64 KiB
                    conn.invoke({"tool": "quick", "arguments": {}, "workspace": str(workspace)})
            time.sleep(0.5)  # the exporter's thread has its batches, and is stuck writing
            assert d.stop(timeout=20) == 0
        finally:
            d.proc.kill()
            d.proc.wait()
    finally:
        os.close(reader)
    assert any(e["event"] == "daemon_stopped" for e in d.log_events())


def _zombies_under(pid: int) -> list[str]:
    """The zombies among ``pid``'s descendants (the host's /proc), as ``pid comm``."""
    children: dict[int, list[int]] = {}
    states: dict[int, str] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        name_end = stat.rindex(")")
        fields = stat[name_end + 2 :].split()
        children.setdefault(int(fields[1]), []).append(int(entry))
        states[int(entry)] = fields[0] + " " + stat[stat.index("(") + 1 : name_end]
    found, stack = [], [pid]
    while stack:
        for child in children.get(stack.pop(), []):
            stack.append(child)
            if states[child].startswith("Z"):
                found.append(f"{child} {states[child][2:]}")
    return found


@pytest.mark.skipif(not pid_namespaces(), reason="needs root and unshare --pid")
def test_as_process_1_the_orphans_of_calls_are_reaped(
    ops_home: Path, workspace: Path, tmp_base: Path
) -> None:
    """toolsetd as process 1 of its PID namespace (a container's entry point): every orphan
    of the namespace became its child, and the daemon waits for its own children only, so
    a tool's background child killed at the call's end stayed a zombie, one per call,
    until the namespace ran out of processes. Process 1 is now a minimal init that reaps
    every child and passes signals on to the daemon, its child: SIGTERM stops it
    gracefully, with the daemon's exit code."""
    _set(ops_home / "tools", "leaver", "sleep 0.2 &\necho left\n")
    launcher = ["unshare", "--pid", "--fork", "--mount-proc", "--kill-child",
                sys.executable, "-m", "toolsetd.daemon"]
    d = start_daemon(ops_home, workspace, tmp_base, launcher=launcher)
    try:
        for _ in range(4):
            reply = _invoke(d, workspace, "leaver")
            assert reply.get("result", {}).get("status") == "ok", reply
        (init,) = [int(p) for p in _children(d.proc.pid)]  # process 1, seen from here
        eventually(lambda: _zombies_under(init) == [], what="no zombie in the namespace")
        os.kill(init, signal.SIGTERM)  # what `docker stop` sends to process 1
        assert d.proc.wait(timeout=30) == 0
    finally:
        if d.proc.poll() is None:
            d.proc.kill()
    assert any(e.get("event") == "daemon_stopped" for e in d.log_events())


def _children(pid: int) -> list[str]:
    return Path(f"/proc/{pid}/task/{pid}/children").read_text().split()


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
@pytest.mark.parametrize("log_format", ["json", "console"])
def test_a_log_that_cannot_be_written_ends_no_daemon(
    ops_home: Path, tmp_base: Path, log_format: str
) -> None:
    """``toolsetd 2>>toolsetd.log`` on a full disk, or started from a terminal that was
    closed since (every write to it fails with EIO): the first log line that could not be
    written raised its OSError out of the code that logged it, and the daemon exited 1
    (here before it served; when it happened later, at the next call, reload or stop).
    Now a line that cannot be written is lost, and the daemon serves, reloads and stops."""
    sock = tmp_base / "full.sock"
    argv = [sys.executable, "-m", "toolsetd.daemon", "--home", str(ops_home), "--socket",
            str(sock), "--no-watch", "--log-level", "debug", "--log-format", log_format,
            "--config", str(_config(tmp_base, ""))]
    # stderr buffered, as a service's is: what the buffer kept failed again at exit (120).
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_base / "cache")}
    env.pop("PYTHONUNBUFFERED", None)
    with open("/dev/full", "w") as full:
        proc = subprocess.Popen(argv, stderr=full, stdout=full, env=env)
    try:
        def answers() -> bool:
            assert proc.poll() is None, f"toolsetd exited {proc.returncode}"
            try:
                with RawConn(sock, timeout=5) as conn:
                    return "result" in conn.request("status")
            except (OSError, EOFError):
                return False

        eventually(answers, timeout=20, what="an answer")
        proc.send_signal(signal.SIGHUP)
        with RawConn(sock, timeout=30) as conn:
            _, reply = conn.invoke(
                {"tool": "quick", "arguments": {}, "workspace": str(tmp_base)}
            )
            assert reply["result"]["status"] == "ok", reply
            assert "result" in conn.request("reload", {})
        assert proc.poll() is None
    finally:
        proc.terminate()
        assert proc.wait(timeout=30) == 0


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
def test_spans_a_full_stdout_cannot_take_cost_the_stop_its_exit_code(
    ops_home: Path, workspace: Path, tmp_base: Path
) -> None:
    """traces = "console" with stdout a file on a full disk (or a terminal closed since, or
    a pipe whose reader left): the exporter's failed write was logged, but what stdout's
    buffer kept failed again at the interpreter's exit, and a clean stop exited 120 ("a
    failure" to a supervisor). The stop exits 0; the spans are lost, as lines are."""
    launcher = ["sh", "-c", 'exec "$@" > /dev/full', "sh", sys.executable, "-m", "toolsetd.daemon"]
    env = {"OTEL_BSP_SCHEDULE_DELAY": "50", "PYTHONUNBUFFERED": ""}
    d = start_daemon(ops_home, workspace, tmp_base, ["--traces", "console", "--no-watch"],
                     env=env, launcher=launcher)
    try:
        reply = _invoke(d, workspace, "quick")
        assert reply["result"]["status"] == "ok", reply
        eventually(lambda: "Exception while exporting" in d.log(), timeout=20,
                   what="the exporter's failed write")
        assert d.stop(timeout=20) == 0
    finally:
        if d.proc.poll() is None:
            d.proc.kill()
            d.proc.wait()
