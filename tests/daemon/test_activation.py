"""Tests for toolsetd.daemon.activation.

Anything that puts a descriptor on fd 3 runs in a child process: a small wrapper
``dup2``s the descriptor onto fd 3, sets ``LISTEN_PID`` to its own pid and ``execve``s
the probe, which keeps the pid, exactly as systemd starts a socket-activated service.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import sys
import tempfile
from collections.abc import Iterator

import anyio
import pytest
from toolsetd.daemon.activation import ActivationError, listen_fds

# argv: fd-to-put-on-3 (or -1 for none), LISTEN_FDS, LISTEN_FDNAMES (or "-"), probe code.
_WRAPPER = """
import os, sys
fd, count, names, code = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
if fd >= 0 and fd != 3:
    os.dup2(fd, 3)
    os.close(fd)
env = dict(os.environ, LISTEN_PID=str(os.getpid()), LISTEN_FDS=count)
if names != "-":
    env["LISTEN_FDNAMES"] = names
os.execve(sys.executable, [sys.executable, "-c", code], env)
"""

# Adopts the sockets, reports what it saw as JSON, then serves one echo connection.
_PROBE = """
import json, os, socket
from toolsetd.daemon.activation import ActivationError, listen_fds_with_names
report = {}
try:
    entries = listen_fds_with_names()
except ActivationError as exc:
    report["error"] = str(exc)
    entries = []
report["names"] = [e.name for e in entries]
report["fds"] = [e.socket.fileno() for e in entries]
report["families"] = [e.socket.family.name for e in entries]
report["inheritable"] = [os.get_inheritable(e.socket.fileno()) for e in entries]
report["env"] = {k: os.environ.get(k) for k in ("LISTEN_PID", "LISTEN_FDS", "LISTEN_FDNAMES")}
if entries:
    entries[0].socket.settimeout(5)
    conn, _ = entries[0].socket.accept()
    with conn:
        conn.settimeout(5)
        conn.sendall(b"pong:" + conn.recv(16))
print(json.dumps(report), flush=True)
"""


async def _activate(fd: int, count: str = "1", names: str = "-") -> dict[str, object]:
    """Run the probe with ``fd`` on descriptor 3 under socket-activation variables."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("LISTEN_")}
    result = await anyio.run_process(
        [sys.executable, "-c", _WRAPPER, str(fd), count, names, _PROBE],
        pass_fds=() if fd < 0 else (fd,),
        env=env,
    )
    report: dict[str, object] = json.loads(result.stdout)
    return report


@contextlib.contextmanager
def _queued_client(path: str) -> Iterator[socket.socket]:
    """A non-blocking client connected to ``path`` that has sent b"ping".

    Connecting before the probe exists works: the kernel queues the connection on the
    listening socket the probe inherits. Non-blocking, so nothing blocks the event loop.
    """
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as client:
        client.setblocking(False)
        client.connect(path)
        client.sendall(b"ping")
        yield client


@pytest.fixture
def listener() -> Iterator[tuple[socket.socket, str]]:
    """A listening Unix stream socket on a short path, and that path."""
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "toolsetd.sock")
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.bind(path)
            sock.listen()
            yield sock, path


@pytest.mark.anyio
async def test_listen_fds_adopts_passed_socket_and_serves(listener) -> None:
    """A passed listening socket is adopted at fd 3, made CLOEXEC, accepts, and the variables go."""
    sock, path = listener
    with anyio.fail_after(15), _queued_client(path) as client:
        report = await _activate(sock.fileno(), names="toolsetd.socket")
        # The probe has exited, so its answer is already waiting.
        assert client.recv(64) == b"pong:ping"
    assert "error" not in report
    assert report["fds"] == [3]
    assert report["names"] == ["toolsetd.socket"]
    assert report["families"] == ["AF_UNIX"]
    assert report["inheritable"] == [False]
    assert report["env"] == {"LISTEN_PID": None, "LISTEN_FDS": None, "LISTEN_FDNAMES": None}


@pytest.mark.anyio
async def test_listen_fds_names_default_to_unknown(listener) -> None:
    """Without LISTEN_FDNAMES each socket is named 'unknown', as libsystemd does."""
    sock, path = listener
    with anyio.fail_after(15), _queued_client(path):
        report = await _activate(sock.fileno())
    assert report["names"] == ["unknown"]


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("kind", "message"),
    [
        ("pipe", "descriptor 3 is not a socket"),
        ("connected", "is not listening"),
        ("datagram", "expected SOCK_STREAM"),
        ("inet", "expected AF_UNIX"),
        ("closed", "is not open"),
        ("abstract", "ListenStream= must name a filesystem path"),
        ("unnamed", "ListenStream= must name a filesystem path"),
    ],
)
async def test_listen_fds_rejects_unusable_descriptor(kind: str, message: str) -> None:
    """A passed descriptor that is not a listening AF_UNIX stream socket raises ActivationError."""
    keep: list[socket.socket] = []
    fds: list[int] = []
    try:
        if kind == "pipe":
            read_end, write_end = os.pipe()
            fds += [read_end, write_end]
            fd = read_end
        elif kind == "connected":
            keep += socket.socketpair()
            fd = keep[0].fileno()
        elif kind == "datagram":
            keep.append(socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM))
            fd = keep[0].fileno()
        elif kind == "inet":
            keep.append(socket.socket(socket.AF_INET, socket.SOCK_STREAM))
            keep[0].bind(("127.0.0.1", 0))
            keep[0].listen()
            fd = keep[0].fileno()
        elif kind in ("abstract", "unnamed"):
            # ListenStream=@name passes a socket in the abstract namespace; bind("") an
            # autobound one: neither has a path.
            keep.append(socket.socket(socket.AF_UNIX, socket.SOCK_STREAM))
            keep[0].bind(f"\0toolsetd-test-{os.getpid()}" if kind == "abstract" else "")
            keep[0].listen()
            fd = keep[0].fileno()
        else:
            fd = -1
        with anyio.fail_after(15):
            report = await _activate(fd)
    finally:
        for sock in keep:
            sock.close()
        for raw in fds:
            os.close(raw)
    assert message in str(report["error"])
    assert report["env"] == {"LISTEN_PID": None, "LISTEN_FDS": None, "LISTEN_FDNAMES": None}


def test_listen_fds_without_variables_returns_nothing() -> None:
    """Without LISTEN_PID the process was not socket-activated: no sockets."""
    env = {"PATH": "/bin"}
    assert listen_fds(env) == []
    assert env == {"PATH": "/bin"}


def test_listen_fds_for_another_pid_is_ignored_and_unset() -> None:
    """Variables meant for another pid are ignored (fd 3 untouched) and still removed."""
    env = {"LISTEN_PID": str(os.getpid() + 1), "LISTEN_FDS": "1", "LISTEN_FDNAMES": "x"}
    assert listen_fds(env) == []
    assert env == {}


def test_listen_fds_unset_false_keeps_variables() -> None:
    """With unset=False the variables stay in the environment."""
    env = {"LISTEN_PID": str(os.getpid() + 1), "LISTEN_FDS": "1"}
    assert listen_fds(env, unset=False) == []
    assert env == {"LISTEN_PID": str(os.getpid() + 1), "LISTEN_FDS": "1"}


def test_listen_fds_zero_count_returns_nothing() -> None:
    """LISTEN_FDS=0 for our pid means no sockets, not an error."""
    env = {"LISTEN_PID": str(os.getpid()), "LISTEN_FDS": "0"}
    assert listen_fds(env) == []
    assert env == {}


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"LISTEN_PID": "abc", "LISTEN_FDS": "1"}, "LISTEN_PID must be a decimal integer"),
        ({"LISTEN_PID": "<self>", "LISTEN_FDS": "one"}, "LISTEN_FDS must be a decimal integer"),
        ({"LISTEN_PID": "<self>", "LISTEN_FDS": "-1"}, "must not be negative"),
        ({"LISTEN_PID": "<self>"}, "LISTEN_FDS is missing"),
        (
            {"LISTEN_PID": "<self>", "LISTEN_FDS": "2", "LISTEN_FDNAMES": "a"},
            "LISTEN_FDNAMES has 1 names but LISTEN_FDS is 2",
        ),
    ],
)
def test_listen_fds_malformed_variables_raise(env: dict[str, str], message: str) -> None:
    """Malformed activation variables raise ActivationError naming the variable, and are unset."""
    env = {k: (str(os.getpid()) if v == "<self>" else v) for k, v in env.items()}
    with pytest.raises(ActivationError, match=message):
        listen_fds(env)
    assert env == {}


def test_listen_fds_beyond_the_descriptor_limit_is_refused_before_any_list() -> None:
    """LISTEN_FDS=2000000000 (a typo, a stray variable) built a list of that many names
    first: 16 GB before the first descriptor was looked at. A count no process could hold
    is refused at once. (Run under a 1 GiB address-space limit, so a regression fails with
    MemoryError instead of taking the machine's memory.)"""
    import subprocess

    code = (
        "import os, resource\n"
        "resource.setrlimit(resource.RLIMIT_AS, (1 << 30, 1 << 30))\n"
        "from toolsetd.daemon.activation import ActivationError, listen_fds\n"
        "env = {'LISTEN_PID': str(os.getpid()), 'LISTEN_FDS': '2000000000'}\n"
        "try:\n"
        "    listen_fds(env)\n"
        "except ActivationError as exc:\n"
        "    print(exc)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 0, done.stderr[-500:]
    assert "LISTEN_FDS is 2000000000, more descriptors than this process may hold" in done.stdout
