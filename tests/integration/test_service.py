"""The daemon as a service: socket activation, sd_notify, graceful and forced stops, orphans, limits.

Every test runs a real daemon subprocess. Socket activation is reproduced exactly as
systemd does it (a listening socket at descriptor 3, ``LISTEN_PID`` naming the daemon's own
pid); notifications are read from a real ``AF_UNIX`` datagram socket. Waits poll against
deadlines; every process a test starts (daemon, tools, their grandchildren, the orphan
guard's sentinel) is checked dead or killed at the end.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import stat
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import anyio
import anyio.abc
import pytest
from toolsetd.daemon.peercred import PeerPolicy
from toolsetd.daemon.server import RequestContext, Server, ServerSettings, bind_unix_socket

from .conftest import Daemon, RawConn, eventually, pid_namespaces, start_daemon, write_set

_SH = "#!/bin/sh\n"

#: The set ``svc``: name -> script body. Grandchildren write their pid next to the call.
SVC_TOOLS = {
    "short": "sleep 0.3\necho done\n",
    "long": 'sleep 30 &\necho $! > "$CRYSTAL_PROJECT_DATA/$TOOLSETD_CALL_ID.pid"\nwait\n',
    "stubborn": "trap '' TERM\n"
                'sleep 30 &\necho $! > "$CRYSTAL_PROJECT_DATA/$TOOLSETD_CALL_ID.pid"\n'
                "while :; do wait; done\n",
    "env": 'env\nfor f in /proc/$$/fd/*; do echo "fd $(readlink "$f")"; done\n',
}


def write_svc_set(home: Path) -> None:
    """Write the ``svc`` set of small /bin/sh tools into the home."""
    tools = [
        {"name": name, "description": f"service test tool {name}",
         "schema": {"type": "object"}, "command": [f"{name}.sh"]}
        for name in SVC_TOOLS
    ]
    write_set(
        home / "tools", "svc",
        {"runner": "exec", "command": [], "stdin": False, "approval": "always",
         "timeoutSeconds": 120, "tools": tools},
        **{f"{name}.sh": _SH + body for name, body in SVC_TOOLS.items()},
    )


@pytest.fixture
def svc_home(home: Path) -> Path:
    """The example home plus the ``svc`` set."""
    write_svc_set(home)
    return home


# -- helpers ---------------------------------------------------------------------------


def pid_gone(pid: int) -> bool:
    """Whether a process no longer runs (gone, or a zombie nobody reaped yet)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except (FileNotFoundError, ProcessLookupError):
        return True


def kill_leftovers(*pids: int) -> None:
    """Last-resort cleanup: SIGKILL whatever of ``pids`` still runs."""
    for pid in pids:
        if not pid_gone(pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def params(workspace: Path, tool: str, call_id: str) -> dict[str, Any]:
    return {"tool": tool, "arguments": {}, "workspace": str(workspace), "approved": True,
            "callId": call_id}


def start_call(conn: RawConn, workspace: Path, tool: str, call_id: str) -> int:
    """Send an invoke (request id = call id) and read up to its started event; returns the pid."""
    conn.send({"jsonrpc": "2.0", "method": "invoke", "id": call_id,
               "params": params(workspace, tool, call_id)})
    while True:
        message = conn.receive()
        if message.get("method") == "started":
            return int(message["params"]["pid"])
        assert "id" not in message, message


def finish_call(conn: RawConn, call_id: str) -> tuple[dict[str, Any] | None, dict[str, Any]]:
    """Read to the call's response; returns (its completed params, the response)."""
    completed = None
    while True:
        message = conn.receive()
        if message.get("method") == "completed":
            completed = message["params"]
        elif message.get("id") == call_id:
            return completed, message


def grandchild_pid(workspace: Path, call_id: str) -> int:
    """The pid the ``long``/``stubborn`` tool wrote for its background ``sleep``."""
    path = workspace / ".crystal" / "data" / "tools" / "svc" / f"{call_id}.pid"
    eventually(lambda: path.exists() and path.read_text().strip() != "", 10, str(path))
    return int(path.read_text().strip())


def sentinel_pid(daemon: Daemon) -> int:
    """The orphan guard's sentinel pid, from the daemon's debug log."""
    def found() -> bool:
        return any(e.get("event") == "orphan_guard_started" for e in daemon.log_events())
    eventually(found, 10, "orphan_guard_started logged")
    return next(int(e["sentinel_pid"]) for e in daemon.log_events()
                if e.get("event") == "orphan_guard_started")


def logged(daemon: Daemon, event: str) -> Callable[[], bool]:
    return lambda: any(e.get("event") == event for e in daemon.log_events())


def spawn_daemon(
    argv: list[str], log_path: Path, env: dict[str, str], **popen: Any
) -> subprocess.Popen[bytes]:
    """Start a daemon command line with its output in ``log_path``."""
    full_env = {**os.environ, **env}
    full_env.pop("TOOLSETD_SOCKET", None)
    with open(log_path, "wb") as log_file:
        return subprocess.Popen(argv, stdout=log_file, stderr=log_file,
                                env=full_env, **popen)


def hold_stopped(proc: subprocess.Popen[bytes]) -> None:
    """Stop the daemon (SIGSTOP) and wait until it is: it then makes no socket again
    (``_keep_socket``) while a test changes what its path names. ``SIGCONT`` resumes it."""
    proc.send_signal(signal.SIGSTOP)
    _, status = os.waitpid(proc.pid, os.WUNTRACED)
    assert os.WIFSTOPPED(status), status


def wait_answering(path: Path, proc: subprocess.Popen[bytes], log_path: Path) -> None:
    """Wait until a status request on ``path`` is answered."""
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"daemon exited early ({proc.returncode}):\n{log_path.read_text()}")
        try:
            with RawConn(path, timeout=5) as probe:
                if "result" in probe.request("status"):
                    return
        except (OSError, EOFError):
            time.sleep(0.02)
    raise RuntimeError(f"daemon did not answer:\n{log_path.read_text()}")


class Notifications:
    """A datagram socket standing in for systemd's notification socket."""

    def __init__(self, address: str) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(address)
        self.messages: list[dict[str, str]] = []

    def close(self) -> None:
        self.sock.close()

    def _receive(self, timeout: float) -> dict[str, str] | None:
        self.sock.settimeout(max(timeout, 0.001))
        try:
            data = self.sock.recv(65536)
        except TimeoutError:
            return None
        fields = dict(line.split("=", 1) for line in data.decode().split("\n") if line)
        self.messages.append(fields)
        return fields

    def expect(self, check: Callable[[dict[str, str]], bool], timeout: float = 10.0,
               what: str = "notification") -> dict[str, str]:
        """Read datagrams until one satisfies ``check``; returns it."""
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(f"no {what} within {timeout} s; got {self.messages}")
            message = self._receive(left)
            if message is not None and check(message):
                return message

    def drain(self, seconds: float) -> list[dict[str, str]]:
        """Every datagram arriving within ``seconds``."""
        got = []
        deadline = time.monotonic() + seconds
        while (left := deadline - time.monotonic()) > 0:
            message = self._receive(left)
            if message is not None:
                got.append(message)
        return got


@pytest.fixture
def notify_path(tmp_base: Path) -> Iterator[tuple[str, Notifications]]:
    """A filesystem notification socket: (NOTIFY_SOCKET value, receiver)."""
    path = str(tmp_base / "notify.sock")
    receiver = Notifications(path)
    try:
        yield path, receiver
    finally:
        receiver.close()


def has(key: str, value: str | None = None) -> Callable[[dict[str, str]], bool]:
    return lambda m: key in m and (value is None or m[key] == value)


def monotonic_usec() -> int:
    return time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000


# -- socket activation -----------------------------------------------------------------

#: Runs as the service's main process the way systemd's exec step does: put the listening
#: socket at descriptor 3, name our own pid in LISTEN_PID, then exec the daemon (same pid).
ACTIVATE = r"""
import os, sys
fd = int(sys.argv[1])
if fd != 3:
    os.dup2(fd, 3)
    os.close(fd)
os.environ["LISTEN_PID"] = str(os.getpid())
os.environ["LISTEN_FDS"] = "1"
os.environ["LISTEN_FDNAMES"] = "toolsetd.socket"
os.execv(sys.executable, [sys.executable, "-m", "toolsetd.daemon", *sys.argv[2:]])
"""


def test_activation_serves_the_passed_socket_and_hides_it_from_tools(
    svc_home: Path, workspace: Path, tmp_base: Path
) -> None:
    """A socket passed at fd 3 with LISTEN_PID/LISTEN_FDS is served, hidden from tools, never unlinked."""
    path = tmp_base / "act.sock"
    listening = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listening.bind(str(path))
    listening.listen(16)
    inode = os.fstat(listening.fileno()).st_ino
    log_path = tmp_base / "daemon.log"
    proc = spawn_daemon(
        [sys.executable, "-c", ACTIVATE, str(listening.fileno()),
         "--home", str(svc_home), "--socket", str(path), "--log-level", "debug", "--no-watch"],
        log_path,
        {"NOTIFY_SOCKET": str(tmp_base / "nobody-listens"), "WATCHDOG_USEC": "60000000"},
        pass_fds=(listening.fileno(),),
    )
    try:
        wait_answering(path, proc, log_path)
        with RawConn(path) as conn:
            status = conn.request("status")["result"]
            _, reply = conn.invoke(params(workspace, "env", "env-1"))
        assert status["pid"] == proc.pid  # LISTEN_PID named the daemon itself
        assert status["socket"] == str(path)
        started = next(json.loads(line) for line in log_path.read_text().splitlines()
                       if '"daemon_started"' in line)
        assert started["activated"] is True
        output = reply["result"]["content"][0]["text"]
        names = {line.split("=", 1)[0] for line in output.splitlines() if "=" in line}
        assert names.isdisjoint({"LISTEN_FDS", "LISTEN_PID", "LISTEN_FDNAMES", "NOTIFY_SOCKET",
                                 "WATCHDOG_USEC", "WATCHDOG_PID"})
        assert "TOOLSETD_CALL_ID" in names
        assert f"fd socket:[{inode}]" not in output  # the tool does not hold the listener
        assert not (tmp_base / "act.sock.lock").exists()  # systemd owns the path: no lock
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20) == 0
        assert path.exists()  # not unlinked: systemd owns it
        with RawConn(path, timeout=2):  # and it still listens (queued for the next start)
            pass
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        listening.close()


@pytest.mark.skipif(not pid_namespaces(), reason="needs root and unshare --pid")
def test_activation_of_process_1_is_the_daemons(svc_home: Path, tmp_base: Path) -> None:
    """A socket passed to process 1 (a container runtime's socket activation: LISTEN_PID=1):
    as process 1 toolsetd forks a minimal init and runs as its child, whose pid LISTEN_PID
    no longer named; the daemon took the socket for someone else's and would bind its own
    at the path the passed one holds. The child takes LISTEN_PID over. Stopped as a
    container is (SIGTERM to process 1), it leaves no cgroup folder behind: killed, it left
    its ``toolsetd-<namespace>-2`` for good, one more at each run."""
    path = tmp_base / "act.sock"
    listening = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listening.bind(str(path))
    listening.listen(16)
    log_path = tmp_base / "daemon.log"
    proc = spawn_daemon(
        ["unshare", "--pid", "--fork", "--mount-proc", "--kill-child",
         sys.executable, "-c", ACTIVATE, str(listening.fileno()),
         "--home", str(svc_home), "--socket", str(path), "--log-level", "debug", "--no-watch"],
        log_path,
        {},
        pass_fds=(listening.fileno(),),
    )
    try:
        wait_answering(path, proc, log_path)
        with RawConn(path) as conn:
            status = conn.request("status")["result"]
        assert status["socket"] == str(path)
        started = next(json.loads(line) for line in log_path.read_text().splitlines()
                       if '"daemon_started"' in line)
        assert started["activated"] is True
        tree = status["confinement"]["cgroup"].get("tree")
        (init,) = Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()
        os.kill(int(init), signal.SIGTERM)  # what `docker stop` sends to process 1
        assert proc.wait(timeout=30) == 0
        assert tree is None or not Path(tree).exists(), f"{tree} was left behind"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        listening.close()


# -- sd_notify -------------------------------------------------------------------------


def test_notify_ready_reloading_status_and_stopping(
    svc_home: Path, workspace: Path, tmp_base: Path, notify_path: tuple[str, Notifications]
) -> None:
    """READY=1 with STATUS after start, RELOADING=1+MONOTONIC_USEC then READY=1 around reloads, STOPPING=1."""
    address, notes = notify_path
    d = start_daemon(svc_home, workspace, tmp_base, ["--no-watch", "--status-interval", "0.1"],
                     env={"NOTIFY_SOCKET": address})
    try:
        ready = notes.expect(has("READY", "1"), what="READY=1")
        assert notes.messages[0] is ready  # nothing before READY
        assert ready["STATUS"].startswith("Serving ")
        assert ready["STATUS"].endswith("0 calls in flight")
        for trigger in ("rpc", "sighup"):
            before = monotonic_usec()
            if trigger == "rpc":
                assert "result" in d.call("reload")
            else:
                d.proc.send_signal(signal.SIGHUP)
            reloading = notes.expect(has("RELOADING", "1"), what=f"RELOADING=1 ({trigger})")
            usec = int(reloading["MONOTONIC_USEC"])
            assert before <= usec <= monotonic_usec()
            notes.expect(has("READY", "1"), what=f"READY=1 after the {trigger} reload")
        with d.raw(timeout=30) as conn:
            start_call(conn, workspace, "short", "s-1")
            notes.expect(lambda m: m.get("STATUS", "").endswith("; 1 calls in flight"),
                         what="STATUS with one call in flight")
            finish_call(conn, "s-1")
        notes.expect(lambda m: m.get("STATUS", "").endswith("; 0 calls in flight"),
                     what="STATUS back to idle")
        assert d.stop() == 0
        notes.expect(has("STOPPING", "1"), timeout=2, what="STOPPING=1")
    finally:
        d.stop()


def test_notify_abstract_socket_gets_watchdog_pings(
    svc_home: Path, workspace: Path, tmp_base: Path
) -> None:
    """With NOTIFY_SOCKET=@name and WATCHDOG_USEC=200000, READY=1 then WATCHDOG=1 repeatedly.

    The period (half WATCHDOG_USEC) is ``watchdog_interval``'s, tested in
    tests/daemon/test_sdnotify.py; here the pings keep coming, each well within 20 periods
    (a hang guard, not a timing)."""
    name = f"toolsetd-test-{os.getpid()}-{time.monotonic_ns()}"
    notes = Notifications("\0" + name)
    d = start_daemon(svc_home, workspace, tmp_base, ["--no-watch"],
                     env={"NOTIFY_SOCKET": "@" + name, "WATCHDOG_USEC": "200000"})
    try:
        notes.expect(has("READY", "1"), what="READY=1")
        for _ in range(4):
            notes.expect(has("WATCHDOG", "1"), timeout=2, what="WATCHDOG=1")
        assert d.stop() == 0
        notes.expect(has("STOPPING", "1"), timeout=2, what="STOPPING=1")
    finally:
        d.stop()
        notes.close()


def test_notify_watchdog_for_another_pid_sends_no_pings(
    svc_home: Path, workspace: Path, tmp_base: Path, notify_path: tuple[str, Notifications]
) -> None:
    """WATCHDOG_PID naming another process leaves the watchdog off: READY=1 but no WATCHDOG=1."""
    address, notes = notify_path
    d = start_daemon(svc_home, workspace, tmp_base, ["--no-watch"],
                     env={"NOTIFY_SOCKET": address, "WATCHDOG_USEC": "200000",
                          "WATCHDOG_PID": str(os.getpid())})
    try:
        notes.expect(has("READY", "1"), what="READY=1")
        # Five ping periods of silence: a pinging daemon would have sent at least four.
        assert not [m for m in notes.drain(0.5) if "WATCHDOG" in m]
    finally:
        assert d.stop() == 0


# -- stopping --------------------------------------------------------------------------


@pytest.mark.slow
def test_stop_graceful_finishes_short_calls_and_cancels_long_ones(
    svc_home: Path, workspace: Path, tmp_base: Path
) -> None:
    """SIGTERM: a short call completes ok, a long one is cancelled after the grace; all answered, nothing left."""
    d = start_daemon(svc_home, workspace, tmp_base,
                     ["--no-watch", "--shutdown-grace", "1", "--kill-grace", "2"])
    pids: list[int] = []
    try:
        sentinel = sentinel_pid(d)
        pids.append(sentinel)
        with d.raw(timeout=15) as long_conn, d.raw(timeout=15) as short_conn:
            long_pid = start_call(long_conn, workspace, "long", "long-1")
            pids.append(long_pid)
            grandchild = grandchild_pid(workspace, "long-1")
            pids.append(grandchild)
            pids.append(start_call(short_conn, workspace, "short", "short-1"))
            d.proc.send_signal(signal.SIGTERM)
            eventually(logged(d, "stop_requested"), 5, "stop_requested logged")
            # A newcomer is refused: the listener is closed (or, in a race, ShuttingDown).
            try:
                with RawConn(d.socket, timeout=5) as late:
                    late.send({"jsonrpc": "2.0", "method": "invoke", "id": 1,
                               "params": params(workspace, "short", "late-1")})
                    reply = late.receive()
                    assert reply["error"]["code"] == -32010, reply
            except (ConnectionRefusedError, FileNotFoundError, EOFError, ConnectionResetError):
                pass
            # An open connection still talks, but takes no new call.
            refused = long_conn.request("invoke", params(workspace, "short", "late-2"))
            assert refused["error"]["code"] == -32010, refused
            completed, reply = finish_call(short_conn, "short-1")
            assert completed is not None
            assert completed["status"] == "ok"
            assert reply["result"]["status"] == "ok"
            completed, reply = finish_call(long_conn, "long-1")
            assert completed is not None
            assert completed["status"] == "cancelled"
            assert reply["result"]["status"] == "cancelled"
            assert reply["result"]["exitCode"] is None
            assert short_conn.closed_by_peer(timeout=10)
            assert long_conn.closed_by_peer(timeout=10)
        assert d.proc.wait(timeout=15) == 0
        assert not d.socket.exists()
        assert not Path(f"{d.socket}.lock").exists()
        for pid in pids:
            eventually(lambda pid=pid: pid_gone(pid), 5, f"pid {pid} gone")
        assert any(e.get("event") == "calls_cancelled_at_stop" and e.get("count") == 1
                   for e in d.log_events())
    finally:
        d.stop()
        kill_leftovers(*pids)


def test_stop_second_signal_exits_at_once_killing_stubborn_children(
    svc_home: Path, workspace: Path, tmp_base: Path
) -> None:
    """A second SIGTERM during the grace ends the daemon at once; a SIGTERM-ignoring tool still dies."""
    d = start_daemon(svc_home, workspace, tmp_base,
                     ["--no-watch", "--shutdown-grace", "30", "--kill-grace", "30"])
    pids: list[int] = []
    try:
        pids.append(sentinel_pid(d))
        with d.raw(timeout=15) as conn:
            pids.append(start_call(conn, workspace, "stubborn", "st-1"))
            pids.append(grandchild_pid(workspace, "st-1"))
            d.proc.send_signal(signal.SIGTERM)
            eventually(logged(d, "stop_requested"), 5, "stop_requested logged")
            t0 = time.monotonic()
            d.proc.send_signal(signal.SIGTERM)
            assert d.proc.wait(timeout=10) == 0
            assert time.monotonic() - t0 < 5
            assert conn.closed_by_peer(timeout=5)
        for pid in pids:
            eventually(lambda pid=pid: pid_gone(pid), 5, f"pid {pid} gone")
        assert not d.socket.exists()
    finally:
        d.stop()
        kill_leftovers(*pids)


def test_a_call_ended_from_outside_still_logs_call_finished(
    svc_home: Path, workspace: Path, tmp_base: Path
) -> None:
    """A call whose run is cancelled from outside (here a forced stop; a connection aborted
    for a client that reads nothing is the other way) ended: the audit trail that has its
    ``call_started`` has its ``call_finished`` too, ``cancelled`` (operations.md's Logs),
    not nothing."""
    d = start_daemon(svc_home, workspace, tmp_base,
                     ["--no-watch", "--shutdown-grace", "30", "--kill-grace", "30"])
    pids: list[int] = []
    try:
        with d.raw(timeout=15) as conn:
            pids.append(start_call(conn, workspace, "stubborn", "st-3"))
            pids.append(grandchild_pid(workspace, "st-3"))
            d.proc.send_signal(signal.SIGTERM)
            eventually(logged(d, "stop_requested"), 5, "stop_requested logged")
            d.proc.send_signal(signal.SIGTERM)
            assert d.proc.wait(timeout=20) == 0
        finished = [e for e in d.log_events()
                    if e.get("event") == "call_finished" and e.get("call_id") == "st-3"]
        assert len(finished) == 1, finished
        assert finished[0]["status"] == "cancelled"
        assert finished[0]["exit_code"] is None
    finally:
        d.stop()
        kill_leftovers(*pids)


@pytest.mark.parametrize("guard", [True, False], ids=["orphan-guard", "no-orphan-guard"])
def test_stop_second_signal_during_kill_grace_exits_at_once(
    svc_home: Path, workspace: Path, tmp_base: Path, guard: bool
) -> None:
    """A second SIGTERM while a cancelled call waits out its kill grace does not wait for it,
    with or without the orphan guard's sentinel (the groups are tracked either way)."""
    d = start_daemon(svc_home, workspace, tmp_base,
                     ["--no-watch", "--shutdown-grace", "0.2", "--kill-grace", "30",
                      *([] if guard else ["--no-orphan-guard"])])
    pids: list[int] = []
    try:
        if guard:
            pids.append(sentinel_pid(d))
        with d.raw(timeout=15) as conn:
            pids.append(start_call(conn, workspace, "stubborn", "st-2"))
            pids.append(grandchild_pid(workspace, "st-2"))
            d.proc.send_signal(signal.SIGTERM)
            # The grace ran out: the call got SIGTERM (ignored) and waits for the kill grace.
            eventually(logged(d, "calls_cancelled_at_stop"), 5, "calls_cancelled_at_stop")
            t0 = time.monotonic()
            d.proc.send_signal(signal.SIGTERM)
            assert d.proc.wait(timeout=10) == 0
            assert time.monotonic() - t0 < 5
        for pid in pids:
            eventually(lambda pid=pid: pid_gone(pid), 5, f"pid {pid} gone")
    finally:
        d.stop()
        kill_leftovers(*pids)


# -- orphans ---------------------------------------------------------------------------


def test_orphans_die_when_the_daemon_is_sigkilled(
    svc_home: Path, workspace: Path, tmp_base: Path
) -> None:
    """A SIGKILLed daemon's tool and the tool's grandchild are killed by the orphan guard."""
    d = start_daemon(svc_home, workspace, tmp_base, ["--no-watch"])
    pids: list[int] = []
    try:
        sentinel = sentinel_pid(d)
        pids.append(sentinel)
        with d.raw(timeout=15) as conn:
            child = start_call(conn, workspace, "long", "orphan-1")
            pids.append(child)
            pids.append(grandchild_pid(workspace, "orphan-1"))
            d.proc.send_signal(signal.SIGKILL)
            assert d.proc.wait(timeout=10) == -signal.SIGKILL
            for pid in pids:
                eventually(lambda pid=pid: pid_gone(pid), 5, f"pid {pid} gone")
    finally:
        d.stop()
        kill_leftovers(*pids)


def test_orphans_die_when_the_daemon_process_group_is_sigkilled(
    svc_home: Path, workspace: Path, tmp_base: Path
) -> None:
    """``kill -9 -<daemon pgid>`` misses the sentinel (own session), which then kills the tools."""
    path = tmp_base / "s.sock"
    log_path = tmp_base / "daemon.log"
    proc = spawn_daemon(
        [sys.executable, "-m", "toolsetd.daemon", "--home", str(svc_home), "--socket", str(path),
         "--log-level", "debug", "--no-watch"],
        log_path, {}, start_new_session=True,
    )
    d = Daemon(proc, path, svc_home, workspace, log_path)
    pids: list[int] = []
    try:
        wait_answering(path, proc, log_path)
        sentinel = sentinel_pid(d)
        assert os.getpgid(sentinel) != proc.pid
        with d.raw(timeout=15) as conn:
            pids.append(start_call(conn, workspace, "long", "orphan-2"))
            pids.append(grandchild_pid(workspace, "orphan-2"))
            os.killpg(proc.pid, signal.SIGKILL)
            assert proc.wait(timeout=10) == -signal.SIGKILL
            for pid in pids:
                eventually(lambda pid=pid: pid_gone(pid), 5, f"pid {pid} gone")
            eventually(lambda: pid_gone(sentinel), 5, "sentinel gone")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        kill_leftovers(*pids)


# -- limits ----------------------------------------------------------------------------


@pytest.mark.parametrize("delivery", ["one chunk", "a line at a time"])
def test_limits_in_flight_calls_per_connection(
    svc_home: Path, workspace: Path, tmp_base: Path, delivery: str
) -> None:
    """With --max-calls-per-connection 2, a third pipelined invoke gets -32008 naming the limit.

    In one chunk the reader takes the three; a line at a time, after a first request, each
    arrives while the reader waits between requests and is taken in the transport's
    callback (``Connection._answer_at_once``): the limit holds there too.
    """
    d = start_daemon(svc_home, workspace, tmp_base,
                     ["--no-watch", "--max-calls-per-connection", "2"])
    try:
        with d.raw(timeout=15) as conn:
            lines = [
                json.dumps({"jsonrpc": "2.0", "method": "invoke", "id": f"c{i}",
                            "params": params(workspace, "short", f"c{i}")}).encode() + b"\n"
                for i in range(3)
            ]
            if delivery == "one chunk":
                conn.send_bytes(b"".join(lines))
            else:
                assert "result" in conn.request("status")
                for line in lines:
                    conn.send_bytes(line)
                    time.sleep(0.05)  # each its own chunk, well within the 0.3 s calls
            responses: dict[str, dict[str, Any]] = {}
            while len(responses) < 3:
                message = conn.receive()
                if "id" in message and "method" not in message:
                    responses[message["id"]] = message
        busy = responses["c2"]["error"]
        assert busy["code"] == -32008
        assert "at most 2" in busy["message"]
        assert busy["data"] == {"limit": 2}
        assert responses["c0"]["result"]["status"] == "ok"
        assert responses["c1"]["result"]["status"] == "ok"
    finally:
        assert d.stop() == 0


# -- shielded cleanup under cancellation ----------------------------------------------


@pytest.mark.anyio
async def test_stop_forced_cancel_lets_shielded_handler_cleanup_finish(tmp_base: Path) -> None:
    """Cancelling the server mid-request still lets the handler's shielded cleanup run to its end."""
    cleanup = {"started": False, "finished": False}
    entered = anyio.Event()

    async def slow(ctx: RequestContext, params: Any) -> dict[str, Any]:
        try:
            entered.set()
            await anyio.sleep_forever()
        finally:
            with anyio.CancelScope(shield=True):
                cleanup["started"] = True
                await anyio.sleep(0.1)
                cleanup["finished"] = True
        return {}

    path = tmp_base / "shield.sock"
    server = Server(ServerSettings(), {"slow": slow}, PeerPolicy.default())
    listener = await anyio.abc.SocketListener.from_socket(bind_unix_socket(path))
    stream = None
    try:
        with anyio.fail_after(10):
            async with anyio.create_task_group() as tg:
                await tg.start(server.serve, listener)
                stream = await anyio.connect_unix(str(path))
                await stream.send(b'{"jsonrpc": "2.0", "method": "slow", "id": 1}\n')
                await entered.wait()
                tg.cancel_scope.cancel()  # what the forced stop does to the daemon's tasks
    finally:
        if stream is not None:
            await stream.aclose()
    assert cleanup["started"]
    assert cleanup["finished"]


def test_a_reload_lowering_status_interval_takes_effect_within_the_new_interval(
    svc_home: Path, workspace: Path, tmp_base: Path, notify_path: tuple[str, Notifications]
) -> None:
    """status-interval is applied at reload (docs/operations.md), but the status task slept
    the old interval out first: started at an hour and lowered to 0.1 s, systemctl status
    showed the start's line for up to that hour. The new interval counts within a second."""
    address, notes = notify_path
    config = tmp_base / "status.toml"
    config.write_text("status-interval = 3600\n")
    d = start_daemon(svc_home, workspace, tmp_base, ["--no-watch", "--config", str(config)],
                     env={"NOTIFY_SOCKET": address})
    try:
        assert notes.expect(has("READY", "1"), what="READY=1")["STATUS"].endswith(
            "(0 workspaces); 0 calls in flight")
        config.write_text("status-interval = 0.1\n")
        assert d.call("reload", {})["result"]["config"]["applied"] == ["status-interval"]
        assert "result" in d.call("list", {"workspace": str(workspace)})
        notes.expect(lambda m: "(1 workspaces)" in m.get("STATUS", ""), timeout=15,
                     what="STATUS with the workspace, after the reload")
    finally:
        d.stop()


def test_a_ready_systemd_cannot_receive_is_said_in_the_log(
    svc_home: Path, workspace: Path, tmp_base: Path
) -> None:
    """Under Type=notify systemd waits for READY=1, and ends the start at TimeoutStartSec=
    when it does not come. A READY=1 the daemon could not send (NOTIFY_SOCKET naming
    nothing the daemon can reach: a sandboxing setting, a socket gone) was dropped without a
    word (sdnotify leaves the logging to its caller, and the start did not log), so the
    journal showed a daemon that started and was killed 30 s later for no reason given."""
    nowhere = tmp_base / "nobody-listens"
    d = start_daemon(svc_home, workspace, tmp_base, ["--no-watch"],
                     env={"NOTIFY_SOCKET": str(nowhere)})
    try:
        failed = [e for e in d.log_events() if e["event"] == "ready_not_delivered"]
        assert [(e["level"], e["notify_socket"]) for e in failed] == [("error", str(nowhere))]
    finally:
        d.stop()
    path = tmp_base / "notify.sock"
    notes = Notifications(str(path))
    try:
        d = start_daemon(svc_home, workspace, tmp_base, ["--no-watch"],
                         env={"NOTIFY_SOCKET": str(path)})
        try:
            notes.expect(has("READY", "1"), what="READY=1")
            assert "ready_not_delivered" not in d.log()
        finally:
            d.stop()
    finally:
        notes.close()


#: ACTIVATE for two sockets: the first at descriptor 3, the second at 4 (LISTEN_FDS=2).
ACTIVATE_TWO = r"""
import os, sys
first, second = int(sys.argv[1]), int(sys.argv[2])
os.dup2(first, 3)
os.dup2(second, 4)
for fd in {first, second} - {3, 4}:
    os.close(fd)
os.environ["LISTEN_PID"] = str(os.getpid())
os.environ["LISTEN_FDS"] = "2"
os.environ["LISTEN_FDNAMES"] = "toolsetd.socket:toolsetd.socket"
os.execv(sys.executable, [sys.executable, "-m", "toolsetd.daemon", *sys.argv[3:]])
"""


def test_a_second_activated_socket_is_not_served_and_the_log_says_so(
    svc_home: Path, tmp_base: Path
) -> None:
    """A drop-in adding a second ListenStream= passes two sockets. The daemon serves the
    first and closed the others without a word: a client of the second path connected
    (systemd still listens there) and waited for ever, and nothing in the journal said why.
    The daemon now names the sockets it does not serve."""
    paths = [tmp_base / "one.sock", tmp_base / "two.sock"]
    listening = []
    for path in paths:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.bind(str(path))
        sock.listen(16)
        listening.append(sock)
    log_path = tmp_base / "daemon.log"
    fds = [s.fileno() for s in listening]
    (tmp_base / "none.toml").touch()
    proc = spawn_daemon(
        [sys.executable, "-c", ACTIVATE_TWO, *map(str, fds), "--home", str(svc_home),
         "--no-watch", "--config", str(tmp_base / "none.toml")],
        log_path, {}, pass_fds=tuple(fds),
    )
    try:
        wait_answering(paths[0], proc, log_path)
        events = [json.loads(line) for line in log_path.read_text().splitlines()
                  if line.startswith("{")]
        ignored = [e for e in events if e["event"] == "activation_sockets_ignored"]
        assert [(e["level"], e["served"], e["ignored"]) for e in ignored] == [
            ("warning", str(paths[0]), [str(paths[1])])
        ]
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for sock in listening:
            sock.close()



def test_a_stopping_daemon_leaves_another_daemons_socket_and_lock_alone(
    svc_home: Path, workspace: Path, tmp_base: Path
) -> None:
    """A cleanup removed the socket and its lock (systemd-tmpfiles ages /tmp, an operator's
    rm), and a new daemon now serves the path with a lock of its own. The old daemon, once
    stopped, unlinked whatever the path named: the new daemon's socket and its lock, so
    that daemon ran on, unreachable, and a third one could start beside it.

    The old daemon is held stopped (SIGSTOP) until the new one serves: left running, it
    makes its own socket and lock again within ``_SOCKET_CHECK_SECONDS``, and a new daemon
    slower to start than that found the path served and exited."""
    first = start_daemon(svc_home, workspace, tmp_base, ["--no-watch"])
    lock = Path(f"{first.socket}.lock")
    log_path = tmp_base / "second.log"
    second: subprocess.Popen[bytes] | None = None
    try:
        hold_stopped(first.proc)
        first.socket.unlink()
        lock.unlink()
        second = spawn_daemon(
            [*first.args, "--socket", str(first.socket)], log_path, {}
        )
        wait_answering(first.socket, second, log_path)
        theirs = (first.socket.stat().st_ino, lock.stat().st_ino)
        first.proc.send_signal(signal.SIGCONT)
        assert first.stop() == 0
        assert (first.socket.stat().st_ino, lock.stat().st_ino) == theirs
        with RawConn(first.socket) as conn:
            assert "result" in conn.request("status")
    finally:
        if first.proc.poll() is None:
            first.proc.send_signal(signal.SIGCONT)
        first.stop()
        if second is not None:
            second.send_signal(signal.SIGTERM)
            second.wait(timeout=20)


def test_a_socket_removed_from_outside_is_made_again(
    svc_home: Path, workspace: Path, tmp_base: Path
) -> None:
    """A cleanup removed the socket, or its whole folder with the lock (systemd-tmpfiles
    ages /tmp/toolsetd-<uid>; an operator's rm). The daemon served on, unreachable for good,
    and, while its lock stayed, no other daemon could start there either. It now makes the
    socket again (and the folder and the lock with it), and says so."""
    first = start_daemon(svc_home, workspace, tmp_base, ["--no-watch"])
    folder = tmp_base / "run"
    path = folder / "s.sock"
    log_path = tmp_base / "run.log"
    proc = spawn_daemon([*first.args, "--socket", str(path)], log_path, {})
    try:
        first.stop()
        wait_answering(path, proc, log_path)
        for remove in (path.unlink, lambda: shutil.rmtree(folder)):
            hold_stopped(proc)  # not remade halfway through the removal
            remove()
            proc.send_signal(signal.SIGCONT)
            wait_answering(path, proc, log_path)
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
        assert stat.S_IMODE(folder.stat().st_mode) == 0o700
        events = [json.loads(line) for line in log_path.read_text().splitlines()
                  if line.startswith("{")]
        made = [e for e in events if e["event"] == "socket_recreated"]
        assert [(e["level"], e["socket"]) for e in made] == [("warning", str(path))] * 2
        again = subprocess.run(  # the lock was taken again: no second daemon starts
            [*first.args, "--socket", str(path)], capture_output=True, text=True, timeout=30,
        )
        assert again.returncode == 1, again.stderr
        assert "another toolsetd is already serving" in again.stderr
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20) == 0
        assert not path.exists()
        assert not Path(f"{path}.lock").exists()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_a_daemon_whose_socket_folder_became_a_file_still_stops_cleanly(
    svc_home: Path, workspace: Path, tmp_base: Path
) -> None:
    """The socket's folder removed and a file put in its place (an operator's mistake, a
    cleanup and a program writing there): the daemon cannot make its socket again, and
    says so. Its stop then asked whether the lock's path still named its lock, and the
    question itself failed (ENOTDIR): the stop ended in a traceback, exit 1, without
    ``daemon_stopped``. A path that cannot be looked at names no lock of the daemon's."""
    first = start_daemon(svc_home, workspace, tmp_base, ["--no-watch"])
    folder = tmp_base / "run"
    path = folder / "s.sock"
    log_path = tmp_base / "run.log"
    proc = spawn_daemon([*first.args, "--socket", str(path)], log_path, {})
    try:
        first.stop()
        wait_answering(path, proc, log_path)
        hold_stopped(proc)  # the folder not made again between the two
        shutil.rmtree(folder)
        folder.write_text("not a folder\n")
        proc.send_signal(signal.SIGCONT)

        def said() -> bool:
            return "socket_recreate_failed" in log_path.read_text()

        deadline = time.monotonic() + 20
        while not said() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert said(), log_path.read_text()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20) == 0, log_path.read_text()
        assert "Traceback" not in log_path.read_text()
        assert '"daemon_stopped"' in log_path.read_text()
        assert folder.read_text() == "not a folder\n"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_a_daemon_that_finds_the_path_served_leaves_no_lock_behind(
    svc_home: Path, workspace: Path, tmp_base: Path
) -> None:
    """A cleanup removed the lock file alone (systemd-tmpfiles ages the regular files of
    /tmp/toolsetd-<uid>, not the socket), so a second start took a lock of its own, found
    the first daemon answering and exited, leaving its lock file behind: the first daemon,
    stopping, leaves alone a lock file that is not its own, so the file stayed for good,
    naming a pid that is gone. The second start removes it as it fails."""
    first = start_daemon(svc_home, workspace, tmp_base, ["--no-watch"])
    lock = Path(f"{first.socket}.lock")
    try:
        lock.unlink()
        second = subprocess.run(
            [*first.args, "--socket", str(first.socket)],
            capture_output=True, text=True, timeout=60, check=False,
        )
        assert second.returncode != 0
        assert "already running" in second.stderr, second.stderr
        assert not lock.exists()
        with RawConn(first.socket) as conn:
            assert "result" in conn.request("status")
        assert first.stop() == 0
        assert not lock.exists()
        assert not first.socket.exists()
    finally:
        first.stop()


def test_notify_status_says_set_folders_past_the_watch_bound_are_polled(
    svc_home: Path, workspace: Path, tmp_base: Path, notify_path: tuple[str, Notifications]
) -> None:
    """systemctl status shows when edits reach the catalog by the poll alone: set folders
    past --max-watches are counted in the STATUS= line."""
    address, notes = notify_path
    folders = sum(1 for p in (svc_home / "tools").iterdir() if p.is_dir())
    d = start_daemon(svc_home, workspace, tmp_base, ["--max-watches", "3", "--status-interval",
                     "0.1"], env={"NOTIFY_SOCKET": address})
    try:
        status = notes.expect(lambda m: "polled" in m.get("STATUS", ""), what="a STATUS= line that says what is polled")
        assert status["STATUS"].endswith(
            f"0 calls in flight; {folders - 1} set folders past --max-watches are polled"
        ), status
    finally:
        d.stop()
