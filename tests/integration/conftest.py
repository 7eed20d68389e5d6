"""A real daemon on a temporary socket, with a temporary home and workspace.

The daemon runs as a subprocess (``python -m toolsetd.daemon``) so signals, process
groups and the socket behave exactly as in production. ``RawConn`` speaks NDJSON on a
plain socket for conformance and bad-input tests; the async ``Client`` is the library
front ends use.
"""

from __future__ import annotations

import contextlib
import json
import os
import resource
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import pytest

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = REPO / "examples" / "tools"

T = TypeVar("T")


@dataclass
class Daemon:
    """A running toolsetd subprocess and the files it serves."""

    proc: subprocess.Popen[bytes]
    socket: Path
    home: Path
    workspace: Path
    log_path: Path
    args: list[str] = field(default_factory=list)
    #: The MCP endpoint a host test reaches this daemon at (``--mcp-listen``); ``None``
    #: means over stdio, through ``toolsetctl mcp`` on the socket.
    mcp_url: str | None = None

    def log(self) -> str:
        """The daemon's stderr so far."""
        return self.log_path.read_text(errors="replace")

    def log_events(self) -> list[dict[str, Any]]:
        """The daemon's JSON log lines, parsed."""
        events = []
        for line in self.log().splitlines():
            try:
                events.append(json.loads(line))
            except json.JSONDecodeError:
                continue
        return events

    def raw(self, timeout: float = 10.0) -> RawConn:
        """A new raw NDJSON connection."""
        return RawConn(self.socket, timeout)

    def call(self, method: str, params: dict[str, Any] | None = None) -> dict[str, Any]:
        """One request on a fresh connection; returns the whole response message."""
        with self.raw() as conn:
            return conn.request(method, params)

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 20.0) -> int:
        """Signal the daemon and wait for it to exit."""
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        return self.proc.wait(timeout=timeout)


@dataclass
class CtlTarget:
    """A daemon, the workspace and folder a ``toolsetctl`` under test runs against."""

    daemon: Daemon
    workspace: Path
    base: Path

    def argv(self, *args: str) -> list[str]:
        """The ``toolsetctl`` command line aimed at this daemon and workspace."""
        return [sys.executable, "-m", "toolsetd.client", "--socket", str(self.daemon.socket),
                "--workspace", str(self.workspace), *args]


class RawConn:
    """A blocking NDJSON connection for tests."""

    def __init__(self, path: Path, timeout: float = 10.0) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(timeout)
        try:
            self.sock.connect(str(path))
        except OSError:
            self.sock.close()
            raise
        self._buffer = b""
        self._next_id = 1

    def __enter__(self) -> RawConn:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Close the connection."""
        self.sock.close()

    def send_bytes(self, data: bytes) -> None:
        """Send raw bytes."""
        self.sock.sendall(data)

    def send(self, message: Any) -> None:
        """Send one message as a line."""
        self.send_bytes(json.dumps(message).encode() + b"\n")

    def receive(self) -> Any:
        """Read one message; raises EOFError when the daemon closed the connection."""
        while b"\n" not in self._buffer:
            chunk = self.sock.recv(1 << 20)
            if not chunk:
                raise EOFError("connection closed")
            self._buffer += chunk
        line, self._buffer = self._buffer.split(b"\n", 1)
        return json.loads(line)

    def request(self, method: str, params: dict[str, Any] | None = None) -> dict[str, Any]:
        """Send a request and return its response, collecting nothing else."""
        request_id = self._next_id
        self._next_id += 1
        message: dict[str, Any] = {"jsonrpc": "2.0", "method": method, "id": request_id}
        if params is not None:
            message["params"] = params
        self.send(message)
        while True:
            reply = self.receive()
            if isinstance(reply, dict) and reply.get("id") == request_id:
                return reply

    def invoke(self, params: dict[str, Any]) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        """Send an invoke; return (notifications in order, the response)."""
        request_id = self._next_id
        self._next_id += 1
        self.send({"jsonrpc": "2.0", "method": "invoke", "id": request_id, "params": params})
        events: list[dict[str, Any]] = []
        while True:
            reply = self.receive()
            if "method" in reply:
                events.append(reply)
            elif reply.get("id") == request_id:
                return events, reply

    def closed_by_peer(self, timeout: float = 5.0) -> bool:
        """Whether the daemon closes this connection within ``timeout``."""
        self.sock.settimeout(timeout)
        try:
            while True:
                if not self.sock.recv(65536):
                    return True
        except TimeoutError:
            return False
        except OSError:
            return True


def eventually(check: Callable[[], bool], timeout: float = 10.0, what: str = "condition") -> None:
    """Poll until check() holds, failing after the deadline (tests never sleep a fixed time)."""
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} not reached within {timeout} s")
        time.sleep(0.02)


def _cpu_ticks(stat: Path) -> int:
    """The user and system CPU time (clock ticks) in a ``/proc`` ``stat`` file."""
    fields = stat.read_text().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])


class CpuByThread:
    """The CPU time a daemon spends from now on, on its event loop's thread (the main one,
    ``anyio.run``'s) and on its other threads (the worker threads, ended ones included).

    For a test that some work runs off the event loop. The order of two clients' answers
    tells it only while the test outruns the work, which a loaded machine can turn around
    however right the daemon is; which thread does the work, and how much CPU it takes,
    does not depend on the load. The window must hold the work: start it where the work
    cannot have begun, end it where it must be done.
    """

    def __init__(self, pid: int) -> None:
        self._loop = Path(f"/proc/{pid}/task/{pid}/stat")
        self._process = Path(f"/proc/{pid}/stat")  # every thread's, ended ones too
        self._start = self._now()
        self._end: tuple[int, int] | None = None

    def _now(self) -> tuple[int, int]:
        loop = _cpu_ticks(self._loop)
        return loop, _cpu_ticks(self._process) - loop

    def stop(self) -> None:
        """End the window now (what follows, the test's reading of an answer, say, is not
        counted)."""
        self._end = self._now()

    def spent(self) -> tuple[int, int]:
        """The ticks spent in the window (since, until ``stop``), on the loop's thread and on
        the others."""
        loop, others = self._end if self._end is not None else self._now()
        return loop - self._start[0], others - self._start[1]

    def assert_off_the_loop(self, what: str) -> None:
        """Fail unless the loop's thread spent less than a quarter of the others' time.

        Work done on the loop shows as its thread's; the loop's own share of a window that
        holds large work (a read, an answer posted) is a tick or two.
        """
        on_loop, off_loop = self.spent()
        assert on_loop * 4 < off_loop, (
            f"{what} on the event loop: its thread spent {on_loop} ticks of CPU meanwhile, "
            f"the others {off_loop}"
        )


def pid_namespaces() -> bool:
    """Whether a test may start a process as 1 of a new PID namespace (root, unshare)."""
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        return False
    done = subprocess.run(
        ["unshare", "--pid", "--fork", "--mount-proc", "/bin/true"],
        capture_output=True, timeout=30,
    )
    return done.returncode == 0


def alive(pid: int) -> bool:
    """Whether a process with this pid exists."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def write_set(root: Path, directory: str, manifest: dict[str, Any] | str, **files: str) -> Path:
    """Write a tool set: its tools.json and any executable files beside it."""
    set_dir = root / directory
    set_dir.mkdir(parents=True, exist_ok=True)
    text = manifest if isinstance(manifest, str) else json.dumps(manifest, indent=2)
    (set_dir / "tools.json").write_text(text)
    for name, body in files.items():
        path = set_dir / name
        path.write_text(body)
        path.chmod(0o755)
    return set_dir


def start_daemon(
    home: Path, workspace: Path, base: Path, extra_args: list[str] | None = None,
    env: dict[str, str] | None = None, launcher: list[str] | None = None,
) -> Daemon:
    """Start toolsetd and wait until it accepts connections.

    ``launcher`` replaces ``python -m toolsetd.daemon`` (a test that must shorten a limit
    no option sets runs the daemon's ``main`` through ``python -c``).
    """
    sock = base / "s.sock"
    log_path = base / "daemon.log"
    extra_args = list(extra_args or [])
    if "--config" not in extra_args:
        # Hermetic: never the machine's /etc/toolsetd/toolsetd.toml or ~/.config one.
        config = base / "toolsetd.toml"
        config.touch()
        extra_args += ["--config", str(config)]
    args = [
        *(launcher or [sys.executable, "-m", "toolsetd.daemon"]),
        "--home", str(home), "--socket", str(sock), "--log-level", "debug",
        *extra_args,
    ]
    # The set cache goes under the test's own folder, never the user's ~/.cache.
    full_env = {**os.environ, "XDG_CACHE_HOME": str(base / "cache"), **(env or {})}
    full_env.pop("TOOLSETD_SOCKET", None)
    with open(log_path, "wb") as log_file:
        proc = subprocess.Popen(args, stderr=log_file, stdout=log_file, env=full_env)
    daemon = Daemon(proc, sock, home, workspace, log_path, args)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"toolsetd exited early ({proc.returncode}):\n{daemon.log()}")
        try:
            # Ready means answering, not merely listening: status proves the handlers run.
            with RawConn(sock, timeout=5) as probe:
                if "result" in probe.request("status"):
                    return daemon
        except (OSError, EOFError):
            time.sleep(0.02)
    proc.kill()
    raise RuntimeError(f"toolsetd did not start:\n{daemon.log()}")


@contextlib.contextmanager
def daemon_in(
    prefix: str,
    fill: Callable[[Path, Path], None] | None = None,
    args: list[str] | None = None,
    env: dict[str, str] | None = None,
    launcher: list[str] | None = None,
) -> Iterator[Daemon]:
    """A daemon over a fresh temporary home and workspace, removed afterwards.

    ``fill(home, workspace)`` writes the sets first (``home/tools`` exists already);
    ``launcher`` is ``start_daemon``'s.
    """
    base = Path(tempfile.mkdtemp(prefix=prefix))
    home, workspace = base / "home", base / "ws"
    (home / "tools").mkdir(parents=True)
    workspace.mkdir()
    try:
        if fill is not None:
            fill(home, workspace)
        d = start_daemon(home, workspace, base, args, env=env, launcher=launcher)
        try:
            yield d
        finally:
            try:
                d.stop()
            finally:  # a stop cut short (pytest-timeout) left it running, and unwaited
                if d.proc.poll() is None:
                    d.proc.kill()
                    d.proc.wait()
    finally:
        shutil.rmtree(base, ignore_errors=True)


@pytest.fixture
def tmp_base() -> Iterator[Path]:
    """A short temporary directory (AF_UNIX paths are limited to ~108 bytes)."""
    base = Path(tempfile.mkdtemp(prefix="tsd-"))
    try:
        yield base
    finally:
        shutil.rmtree(base, ignore_errors=True)


@pytest.fixture
def home(tmp_base: Path) -> Path:
    """A Crystal home holding the bundled example sets."""
    path = tmp_base / "home"
    (path / "tools").mkdir(parents=True)
    shutil.copytree(EXAMPLES, path / "tools", dirs_exist_ok=True)
    return path


@pytest.fixture
def workspace(tmp_base: Path) -> Path:
    """An empty workspace directory."""
    path = tmp_base / "ws"
    path.mkdir()
    return path


@pytest.fixture
def daemon(home: Path, workspace: Path, tmp_base: Path) -> Iterator[Daemon]:
    """A running daemon over the example sets; stopped (and checked) at teardown."""
    d = start_daemon(home, workspace, tmp_base)
    try:
        yield d
    finally:
        shut_down(d)


def shut_down(d: Daemon) -> None:
    """Stop a daemon with SIGTERM; kill it if it has not exited within 20 s."""
    if d.proc.poll() is None:
        d.proc.send_signal(signal.SIGTERM)
        try:
            d.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            d.proc.kill()
            d.proc.wait()


def ensure_bubblewrap() -> str | None:
    """Make sure ``bwrap`` is on PATH; return why not when it cannot be.

    CI machines start empty: as root with apt-get, the Debian ``bubblewrap`` package is
    installed here (once per machine); elsewhere the sandbox tests skip with the reason.
    """
    if shutil.which("bwrap"):
        return None
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        return "bubblewrap is not installed and cannot be (needs root and apt-get): install the 'bubblewrap' package"
    lock = Path(tempfile.gettempdir()) / "toolsetd-tests-bubblewrap.lock"
    with open(lock, "w") as f:
        import fcntl  # only where an install may run

        fcntl.flock(f, fcntl.LOCK_EX)  # parallel workers: one apt-get at a time
        if shutil.which("bwrap"):
            return None
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        install = ["apt-get", "install", "-y", "-q", "bubblewrap"]
        done = subprocess.run(install, capture_output=True, env=env, check=False)
        if done.returncode != 0:
            subprocess.run(["apt-get", "update", "-q"], capture_output=True, env=env, check=False)
            done = subprocess.run(install, capture_output=True, env=env, check=False)
    if shutil.which("bwrap") is None:
        tail = done.stderr.decode(errors="replace").strip().splitlines()[-1:] or ["no output"]
        return f"bubblewrap could not be installed with apt-get: {tail[0]}"
    return None


@contextlib.contextmanager
def descriptors_limited(pid: int, free: int = 0) -> Iterator[None]:
    """Inside, ``pid`` can open ``free`` more descriptors (EMFILE after): the soft limit is
    set just above its lowest free descriptor numbers."""
    before = resource.prlimit(pid, resource.RLIMIT_NOFILE)
    used = {int(name) for name in os.listdir(f"/proc/{pid}/fd")}
    lowest = [n for n in range(len(used) + free + 1) if n not in used][:free]
    limit = (lowest[-1] + 1) if lowest else 3  # 0-2 are always taken
    resource.prlimit(pid, resource.RLIMIT_NOFILE, (limit, before[1]))
    try:
        yield
    finally:
        resource.prlimit(pid, resource.RLIMIT_NOFILE, before)


@contextlib.contextmanager
def memory_limited(pid: int, headroom: int) -> Iterator[None]:
    """Inside, ``pid`` can map ``headroom`` bytes more than it has mapped now (its
    ``RLIMIT_AS``): past them an allocation fails, and Python raises ``MemoryError``."""
    before = resource.prlimit(pid, resource.RLIMIT_AS)
    mapped = int(Path(f"/proc/{pid}/status").read_text().split("VmSize:")[1].split()[0]) * 1024
    resource.prlimit(pid, resource.RLIMIT_AS, (mapped + headroom, before[1]))
    try:
        yield
    finally:
        resource.prlimit(pid, resource.RLIMIT_AS, before)


def _pids_hierarchy() -> tuple[Path, str] | None:
    """A cgroup hierarchy with the ``pids`` controller a test may make a cgroup in: its
    mount point and the name ``/proc/<pid>/cgroup`` gives it (``""`` for v2)."""
    if os.geteuid() != 0:
        return None
    with open("/proc/self/mounts") as mounts:
        entries = [line.split() for line in mounts]
    for _, point, kind, options, *_ in entries:
        if kind == "cgroup" and "pids" in options.split(","):
            return Path(point), "pids"
    for _, point, kind, *_ in entries:
        control = Path(point) / "cgroup.subtree_control"
        if kind == "cgroup2" and control.exists() and "pids" in control.read_text().split():
            return Path(point), ""
    return None


def processes() -> Iterator[tuple[int, list[bytes], bytes]]:
    """Each process: its pid, the fields of its ``/proc/<pid>/stat`` after the command
    (state, ppid, pgrp, ...) and its command line (NUL-separated); one that goes meanwhile
    is left out."""
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read()
            with open(f"/proc/{entry}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
        except OSError:
            continue
        yield int(entry), fields, cmdline


def marked_processes(marker: str) -> list[int]:
    """The pids of the live processes whose command line carries ``marker`` (zombies
    excluded): a test's tools, found by a word in their argv."""
    return [
        pid
        for pid, fields, cmdline in processes()
        if marker.encode() in cmdline and fields[0] != b"Z"
    ]


@contextlib.contextmanager
def launched_at_the_limit(
    base: Path, make: Callable[[list[str]], T], made: list[T], free: int = 0
) -> Iterator[T]:
    """What ``make(launcher)`` starts (a daemon, through that launcher), started inside
    ``tasks_limited(free=free)``: the launcher's process says its pid and waits (shell
    builtins: no fork) until it is in the limited cgroup, then becomes the daemon. Yields
    it inside the limit, lifted when the block ends. ``made`` gets what ``make`` returned,
    even late: the caller stops it."""
    pid_file, gate = base / "launcher.pid", base / "launcher.gate"
    os.mkfifo(gate)
    launcher = ["/bin/sh", "-c", 'echo $$ > "$0"; read _ < "$1"; shift; exec "$@"',
                str(pid_file), str(gate), sys.executable, "-m", "toolsetd.daemon"]
    starting = threading.Thread(target=lambda: made.append(make(launcher)))
    starting.start()
    try:
        eventually(lambda: bool(pid_file.exists() and pid_file.read_text().strip()),
                   what="the launcher's pid")
        with tasks_limited(int(pid_file.read_text()), free=free):
            gate.write_text("go\n")
            starting.join(60)
            assert made, "the daemon did not start"
            yield made[0]
    finally:
        if not made:  # let a launcher still waiting go (it then fails to start or is killed)
            with contextlib.suppress(OSError):
                fd = os.open(gate, os.O_WRONLY | os.O_NONBLOCK)
                os.write(fd, b"go\n")
                os.close(fd)
        starting.join(60)


@contextlib.contextmanager
def started_at_the_limit(
    home: Path, workspace: Path, base: Path, args: list[str], free: int = 0,
    env: dict[str, str] | None = None,
) -> Iterator[Daemon]:
    """A daemon (``start_daemon``'s) that starts inside ``tasks_limited(free=free)``
    (``launched_at_the_limit``). The caller stops it (it is stopped here only when the
    block raised)."""
    made: list[Daemon] = []
    try:
        with launched_at_the_limit(
            base, lambda launcher: start_daemon(home, workspace, base, args, env=env,
                                                launcher=launcher), made, free) as daemon:
            yield daemon
    except BaseException:
        for daemon in made:
            with contextlib.suppress(subprocess.TimeoutExpired):
                daemon.stop()
        raise


@contextlib.contextmanager
def tasks_limited(pid: int, free: int = 0) -> Iterator[None]:
    """Inside, ``pid`` can start ``free`` more threads and processes, then none (EAGAIN):
    it is moved into a cgroup of its own whose ``pids.max`` is the tasks it has and
    ``free`` more (what ``RLIMIT_NPROC`` does to a user other than root at its limit);
    with ``free`` 0 it is 0, so a task that ends frees no room either. Skips where no
    cgroup with the ``pids`` controller can be made (root, and a v1 ``pids`` hierarchy or
    a v2 one that enables ``pids``)."""
    found = _pids_hierarchy()
    if found is None:
        pytest.skip("needs root and a cgroup hierarchy with the pids controller")
    point, name = found
    with open(f"/proc/{pid}/cgroup") as own:
        path = next(line.split(":", 2)[2].strip() for line in own
                    if line.split(":", 2)[1] == name)
    home = point / path.lstrip("/")
    folder = point / f"toolsetd-test-tasks-{pid}"
    try:
        folder.mkdir()
        (folder / "cgroup.procs").write_text(str(pid))
    except OSError as exc:
        with contextlib.suppress(OSError):
            folder.rmdir()
        pytest.skip(f"a pids cgroup cannot be made or entered here: {exc}")
    try:
        tasks = int((folder / "pids.current").read_text())
        (folder / "pids.max").write_text(str(tasks + free if free else 0))
        yield
    finally:
        (folder / "pids.max").write_text("max")

        def emptied() -> bool:  # the daemon, and what it started meanwhile, go back
            for task in (folder / "cgroup.procs").read_text().split():
                with contextlib.suppress(ProcessLookupError):
                    (home / "cgroup.procs").write_text(task)
            return not (folder / "cgroup.procs").read_text().strip()

        eventually(emptied, what="the test cgroup emptied")
        folder.rmdir()
