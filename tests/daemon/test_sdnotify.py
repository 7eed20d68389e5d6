"""Tests for toolsetd.daemon.sdnotify against a real AF_UNIX datagram socket."""

from __future__ import annotations

import os
import socket
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from toolsetd.daemon.sdnotify import SYSTEMD_ENV_VARS, Notifier, scrub_environment


def _receive(sock: socket.socket) -> bytes:
    """Read one datagram, failing fast if none was sent."""
    sock.settimeout(2.0)
    return sock.recv(4096)


@pytest.fixture
def path_listener() -> Iterator[tuple[socket.socket, str]]:
    """A datagram socket bound to a short filesystem path, and that path."""
    with tempfile.TemporaryDirectory() as folder:
        address = os.path.join(folder, "notify")
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
            sock.bind(address)
            yield sock, address


@pytest.fixture
def abstract_listener() -> Iterator[tuple[socket.socket, str]]:
    """A datagram socket bound in the abstract namespace, and its ``@name`` spelling."""
    name = f"toolsetd-test-{uuid.uuid4().hex}"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind("\0" + name)
        yield sock, "@" + name


@pytest.mark.parametrize(
    ("call", "expected"),
    [
        (lambda n: n.ready(), b"READY=1"),
        (lambda n: n.ready("serving 3 sets"), b"READY=1\nSTATUS=serving 3 sets"),
        (lambda n: n.stopping(), b"STOPPING=1"),
        (lambda n: n.status("loading"), b"STATUS=loading"),
        (lambda n: n.status("two\nlines"), b"STATUS=two lines"),
        (lambda n: n.watchdog(), b"WATCHDOG=1"),
        (lambda n: n.notify("EXTEND_TIMEOUT_USEC=5000000"), b"EXTEND_TIMEOUT_USEC=5000000"),
    ],
)
def test_notifier_sends_exact_datagram_to_path(path_listener, call, expected) -> None:
    """Each helper sends exactly one datagram with the exact sd_notify bytes to a path socket."""
    sock, address = path_listener
    notifier = Notifier.from_environ({"NOTIFY_SOCKET": address})
    assert call(notifier) is True
    assert _receive(sock) == expected


def test_notifier_sends_to_abstract_socket(abstract_listener) -> None:
    """A NOTIFY_SOCKET starting with '@' addresses the abstract namespace."""
    sock, spelled = abstract_listener
    notifier = Notifier.from_environ({"NOTIFY_SOCKET": spelled})
    assert notifier.address is not None
    assert notifier.address.startswith("\0")
    assert notifier.ready() is True
    assert _receive(sock) == b"READY=1"
    assert notifier.stopping() is True
    assert _receive(sock) == b"STOPPING=1"


def test_notifier_reloading_carries_monotonic_usec(path_listener) -> None:
    """reloading() sends RELOADING=1 and the CLOCK_MONOTONIC time in microseconds."""
    sock, address = path_listener
    notifier = Notifier.from_environ({"NOTIFY_SOCKET": address})
    before = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
    assert notifier.reloading() is True
    after = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
    first, second = _receive(sock).split(b"\n")
    assert first == b"RELOADING=1"
    key, _, value = second.partition(b"=")
    assert key == b"MONOTONIC_USEC"
    assert before <= int(value) <= after


def test_notifier_without_notify_socket_is_noop() -> None:
    """Without NOTIFY_SOCKET every call returns False and nothing is sent."""
    notifier = Notifier.from_environ({})
    assert not notifier.enabled
    assert notifier.ready() is False
    assert notifier.reloading() is False
    assert notifier.stopping() is False
    assert notifier.watchdog_interval() is None


def test_notifier_delivery_failure_returns_false(tmp_path: Path) -> None:
    """A notify socket nobody listens on makes notify return False instead of raising."""
    notifier = Notifier.from_environ({"NOTIFY_SOCKET": str(tmp_path / "gone")})
    assert notifier.enabled
    assert notifier.ready() is False
    abstract = Notifier.from_environ({"NOTIFY_SOCKET": f"@nobody-{uuid.uuid4().hex}"})
    assert abstract.stopping() is False


def test_notifier_full_queue_returns_false_without_blocking(path_listener) -> None:
    """When the receiver's queue is full, notify returns False at once rather than blocking."""
    sock, address = path_listener
    notifier = Notifier.from_environ({"NOTIFY_SOCKET": address})
    deadline = time.monotonic() + 5.0
    results = set()
    while time.monotonic() < deadline:
        ok = notifier.status("x" * 1000)
        results.add(ok)
        if not ok:
            break
    assert False in results
    sock.setblocking(False)
    assert sock.recv(4096).startswith(b"STATUS=")


def test_notifier_rejects_line_with_newline(path_listener) -> None:
    """A raw line smuggling a second assignment is a programming error."""
    _, address = path_listener
    notifier = Notifier.from_environ({"NOTIFY_SOCKET": address})
    with pytest.raises(ValueError, match="KEY=VALUE"):
        notifier.notify("STATUS=a\nREADY=1")
    with pytest.raises(ValueError, match="KEY=VALUE"):
        notifier.notify("READY")


def test_notifier_from_environ_unsets_variables() -> None:
    """from_environ removes NOTIFY_SOCKET and the watchdog variables unless told not to."""
    env = {
        "NOTIFY_SOCKET": "@x",
        "WATCHDOG_USEC": "1000",
        "WATCHDOG_PID": str(os.getpid()),
        "PATH": "/bin",
    }
    kept = dict(env)
    Notifier.from_environ(kept, unset=False)
    assert kept == env
    notifier = Notifier.from_environ(env)
    assert env == {"PATH": "/bin"}
    assert notifier.address == "\0x"
    assert notifier.watchdog_usec == 1000


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({"WATCHDOG_USEC": "2000000"}, 1.0),
        ({"WATCHDOG_USEC": "30000000", "WATCHDOG_PID": "<self>"}, 15.0),
        ({"WATCHDOG_USEC": "2000000", "WATCHDOG_PID": "1"}, None),
        ({"WATCHDOG_USEC": "0"}, None),
        ({"WATCHDOG_USEC": "soon"}, None),
        ({"WATCHDOG_USEC": "2000000", "WATCHDOG_PID": "me"}, None),
        ({}, None),
        # WatchdogSec=1us: a ping every 0.5 us spun the loop; never more often than 10 ms.
        ({"WATCHDOG_USEC": "1"}, 0.01),
        ({"WATCHDOG_USEC": "20000"}, 0.01),
        # sd_watchdog_enabled's range: a u64 below USEC_INFINITY. 400 digits overflowed
        # the float of the interval and ended the start with a traceback.
        ({"WATCHDOG_USEC": "1" + "0" * 400}, None),
        ({"WATCHDOG_USEC": str((1 << 64) - 1)}, None),
        ({"WATCHDOG_USEC": str((1 << 64) - 2)}, ((1 << 64) - 2) / 2 / 1_000_000),
    ],
)
def test_notifier_watchdog_interval(env, expected) -> None:
    """watchdog_interval is half of WATCHDOG_USEC in seconds (10 ms at least), only when
    meant for this pid."""
    env = {k: (str(os.getpid()) if v == "<self>" else v) for k, v in env.items()}
    env["NOTIFY_SOCKET"] = "@unused"
    assert Notifier.from_environ(env).watchdog_interval() == expected


def test_scrub_environment_drops_systemd_variables() -> None:
    """scrub_environment drops the six systemd variables, keeps the rest, mutates nothing."""
    env = dict.fromkeys(SYSTEMD_ENV_VARS, "1") | {"HOME": "/root", "LISTEN": "keep"}
    original = dict(env)
    assert scrub_environment(env) == {"HOME": "/root", "LISTEN": "keep"}
    assert env == original
    assert {
        "LISTEN_FDS",
        "LISTEN_PID",
        "LISTEN_FDNAMES",
        "NOTIFY_SOCKET",
        "WATCHDOG_USEC",
        "WATCHDOG_PID",
    } == SYSTEMD_ENV_VARS


def test_mcp_pump_scrubs_the_same_variables() -> None:
    """``toolsetctl mcp`` starts a daemon without these variables and imports nothing of
    the daemon's to do it (its own copy of the names): the two lists must not drift."""
    from toolsetd.client.mcp import SYSTEMD_ENV_VARS as PUMP_VARS

    assert PUMP_VARS == SYSTEMD_ENV_VARS
