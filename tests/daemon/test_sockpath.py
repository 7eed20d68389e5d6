"""Tests for toolsetd.daemon.sockpath on real folders, sockets and locks."""

from __future__ import annotations

import os
import socket
import stat
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import anyio
import pytest
from toolsetd.daemon.sockpath import (
    AlreadyRunning,
    InstanceLocked,
    NotASocket,
    SocketPathError,
    UnsafeSocketDir,
    acquire_instance_lock,
    check_stale,
    default_socket_path,
    lock_path_for,
    prepare_socket_dir,
)


@pytest.fixture
def short_dir() -> Iterator[Path]:
    """A fresh folder with a short path (AF_UNIX paths are limited to ~108 bytes)."""
    with tempfile.TemporaryDirectory() as folder:
        yield Path(folder)


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({"TOOLSETD_SOCKET": "/srv/t.sock", "XDG_RUNTIME_DIR": "/run/user/1"}, "/srv/t.sock"),
        ({"XDG_RUNTIME_DIR": "/run/user/1"}, "/run/user/1/toolsetd/toolsetd.sock"),
        (
            {"TOOLSETD_SOCKET": "", "XDG_RUNTIME_DIR": "/run/user/1"},
            "/run/user/1/toolsetd/toolsetd.sock",
        ),
        ({"XDG_RUNTIME_DIR": "relative/dir"}, "/tmp/toolsetd-<uid>/toolsetd.sock"),
        ({}, "/tmp/toolsetd-<uid>/toolsetd.sock"),
    ],
)
def test_default_socket_path_order(env: dict[str, str], expected: str) -> None:
    """TOOLSETD_SOCKET wins, then an absolute XDG_RUNTIME_DIR, then /tmp/toolsetd-<uid>."""
    assert default_socket_path(env) == Path(expected.replace("<uid>", str(os.geteuid())))


def test_prepare_socket_dir_creates_0700_despite_umask(short_dir: Path) -> None:
    """A missing socket folder is created with mode 0700 even under a restrictive umask."""
    socket_path = short_dir / "new" / "toolsetd.sock"
    old = os.umask(0o277)
    try:
        prepare_socket_dir(socket_path)
    finally:
        os.umask(old)
    info = socket_path.parent.stat()
    assert stat.S_IMODE(info.st_mode) == 0o700
    assert info.st_uid == os.geteuid()


def test_prepare_socket_dir_accepts_own_private_dir(short_dir: Path) -> None:
    """An existing folder of ours that nobody else can write is accepted as it is."""
    folder = short_dir / "mine"
    folder.mkdir(mode=0o750)
    os.chmod(folder, 0o750)
    prepare_socket_dir(folder / "toolsetd.sock")
    assert stat.S_IMODE(folder.stat().st_mode) == 0o750


@pytest.mark.parametrize("mode", [0o770, 0o777, 0o702])
def test_prepare_socket_dir_refuses_writable_by_others(short_dir: Path, mode: int) -> None:
    """A socket folder writable by group or others is refused, not repaired."""
    folder = short_dir / "open"
    folder.mkdir()
    os.chmod(folder, mode)
    with pytest.raises(UnsafeSocketDir, match="writable by group or others"):
        prepare_socket_dir(folder / "toolsetd.sock")
    assert stat.S_IMODE(folder.stat().st_mode) == mode


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to create a folder owned by another uid")
def test_prepare_socket_dir_refuses_foreign_owner(short_dir: Path) -> None:
    """A pre-created folder owned by another user (the /tmp attack) is refused."""
    folder = short_dir / "toolsetd-0"
    folder.mkdir(mode=0o700)
    os.chown(folder, 65534, 65534)
    with pytest.raises(UnsafeSocketDir, match="owned by uid 65534"):
        prepare_socket_dir(folder / "toolsetd.sock")


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to create a symlink owned by another uid")
def test_prepare_socket_dir_refuses_foreign_symlink(short_dir: Path) -> None:
    """A symlink planted by another user is refused even when it points at our own folder."""
    target = short_dir / "ours"
    target.mkdir(mode=0o700)
    link = short_dir / "toolsetd-0"
    link.symlink_to(target)
    os.lchown(link, 65534, 65534)
    with pytest.raises(UnsafeSocketDir, match="symlink owned by uid 65534"):
        prepare_socket_dir(link / "toolsetd.sock")


def test_prepare_socket_dir_refuses_non_directory(short_dir: Path) -> None:
    """A regular file where the socket folder should be is refused."""
    (short_dir / "file").write_text("x")
    with pytest.raises(UnsafeSocketDir, match="not a directory"):
        prepare_socket_dir(short_dir / "file" / "toolsetd.sock")


def test_prepare_socket_dir_refuses_too_long_path(short_dir: Path) -> None:
    """A path longer than sun_path allows is refused with the limit in the message."""
    with pytest.raises(SocketPathError, match="AF_UNIX allows at most 107"):
        prepare_socket_dir(short_dir / ("x" * 120) / "toolsetd.sock")


def _listening(path: Path) -> socket.socket:
    """Bind and listen on ``path``."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind(os.fspath(path))
    sock.listen()
    return sock


def test_check_stale_missing_path_is_fine(short_dir: Path) -> None:
    """Nothing at the path: nothing to do."""
    check_stale(short_dir / "toolsetd.sock")


def test_check_stale_removes_dead_socket(short_dir: Path) -> None:
    """A socket file nobody listens on is a leftover and is removed."""
    path = short_dir / "toolsetd.sock"
    _listening(path).close()  # closing does not unlink: a crashed daemon's leftover
    assert stat.S_ISSOCK(path.lstat().st_mode)
    check_stale(path)
    assert not path.exists()


def test_check_stale_refuses_live_socket(short_dir: Path) -> None:
    """A socket that accepts connections means a daemon is running: refuse, keep it."""
    path = short_dir / "toolsetd.sock"
    with _listening(path), pytest.raises(AlreadyRunning, match=f"already running on {path}"):
        check_stale(path)
    assert stat.S_ISSOCK(path.lstat().st_mode)


def test_check_stale_refuses_regular_file(short_dir: Path) -> None:
    """A regular file at the socket path is the operator's: refused and left alone."""
    path = short_dir / "toolsetd.sock"
    path.write_text("notes")
    with pytest.raises(NotASocket, match="is not a socket"):
        check_stale(path)
    assert path.read_text() == "notes"


def test_instance_lock_writes_pid_and_releases(short_dir: Path) -> None:
    """The lock file is 0600 with our pid, and release removes it and frees the lock."""
    socket_path = short_dir / "toolsetd.sock"
    with acquire_instance_lock(socket_path) as handle:
        lock = lock_path_for(socket_path)
        assert handle.path == lock
        assert lock == short_dir / "toolsetd.sock.lock"
        assert stat.S_IMODE(lock.stat().st_mode) == 0o600
        assert lock.read_text() == f"{os.getpid()}\n"
    assert not handle.held
    assert not lock.exists()
    acquire_instance_lock(socket_path).release()


def test_instance_lock_that_is_a_fifo_is_refused_plainly(short_dir: Path) -> None:
    """A FIFO at ``<socket>.lock``: truncating it failed with EINVAL and the start ended in
    a traceback. It is refused with the reason (``toolsetd: ...``, exit 1) and left alone."""
    socket_path = short_dir / "toolsetd.sock"
    lock = lock_path_for(socket_path)
    os.mkfifo(lock)
    with pytest.raises(SocketPathError, match="is not a regular file"):
        acquire_instance_lock(socket_path)
    assert stat.S_ISFIFO(lock.lstat().st_mode)


def test_instance_lock_refuses_second_holder_in_process(short_dir: Path) -> None:
    """A second acquisition fails while the first is held (flock is per open file)."""
    socket_path = short_dir / "toolsetd.sock"
    with acquire_instance_lock(socket_path):
        with pytest.raises(InstanceLocked, match=f"pid {os.getpid()}"):
            acquire_instance_lock(socket_path)
        assert lock_path_for(socket_path).exists()


_HOLD = """
import fcntl, os, sys
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o600)
fcntl.flock(fd, fcntl.LOCK_EX)
os.write(fd, b"%d\\n" % os.getpid())
print("locked", flush=True)
sys.stdin.read()
"""


@pytest.mark.anyio
async def test_instance_lock_held_by_other_process_is_refused(short_dir: Path) -> None:
    """A lock held by another process is refused with that process's pid in the message."""
    socket_path = short_dir / "toolsetd.sock"
    lock = lock_path_for(socket_path)
    with anyio.fail_after(15):
        async with await anyio.open_process(
            [sys.executable, "-c", _HOLD, os.fspath(lock)]
        ) as holder:
            assert holder.stdout is not None
            assert holder.stdin is not None
            assert (await holder.stdout.receive()).startswith(b"locked")
            with pytest.raises(
                InstanceLocked,
                match=f"another toolsetd is already serving {socket_path} \\(pid {holder.pid}\\)",
            ):
                acquire_instance_lock(socket_path)
            await holder.stdin.aclose()
            assert await holder.wait() == 0
    # The holder died; the kernel released its lock, and its stale file is reused.
    with acquire_instance_lock(socket_path) as handle:
        assert lock.read_text() == f"{os.getpid()}\n"
        assert handle.held


@pytest.mark.parametrize(
    "env",
    [
        {"TOOLSETD_SOCKET": "~/t.sock"},
        {"TOOLSETD_SOCKET": "/srv/t.sock", "XDG_RUNTIME_DIR": "/run/user/1"},
        {"XDG_RUNTIME_DIR": "/run/user/1/"},
        {"XDG_RUNTIME_DIR": "relative/dir"},
        {},
    ],
)
def test_the_clients_default_socket_path_is_the_daemons(env: dict[str, str]) -> None:
    """toolsetctl and the MCP pump look where the daemon serves: a ``~`` in
    TOOLSETD_SOCKET was expanded by the daemon only, so the client looked elsewhere."""
    from toolsetd.client.mcp import default_socket_path as client_default

    assert client_default(env) == str(default_socket_path(env))


def test_the_socket_path_appears_only_once_it_listens(short_dir: Path) -> None:
    """A client that waits for the file and connects at once is never refused: bound at
    the path directly, 83 to 177 connects in 1,000 were in the moment between bind and listen
    (``bind`` and ``chmod`` let another thread run)."""
    from toolsetd.daemon.server import bind_unix_socket

    refused = 0
    for i in range(1000):
        path = short_dir / f"s{i}.sock"
        outcome: list[str] = []

        def wait_and_connect(path: Path = path, outcome: list[str] = outcome) -> None:
            deadline = time.monotonic() + 10
            while not path.exists():
                if time.monotonic() > deadline:
                    return
            with socket.socket(socket.AF_UNIX) as client:
                try:
                    client.connect(str(path))
                    outcome.append("accepted")
                except ConnectionRefusedError:
                    outcome.append("refused")

        waiter = threading.Thread(target=wait_and_connect)
        waiter.start()
        listener = bind_unix_socket(path)
        waiter.join(10)
        listener.close()
        assert outcome, "the waiter never saw the socket"
        refused += outcome == ["refused"]
        assert stat.S_IMODE(path.lstat().st_mode) == 0o600
        path.unlink()
    assert refused == 0
    assert os.listdir(short_dir) == []  # no temporary name left behind


def test_binding_replaces_nothing_that_took_the_path(short_dir: Path) -> None:
    """What appeared at the path after ``check_stale`` looked (an operator's file) is kept:
    the bind fails with EEXIST, and its temporary name goes."""
    from toolsetd.daemon.server import bind_unix_socket

    path = short_dir / "t.sock"
    path.write_text("the operator's\n")
    with pytest.raises(FileExistsError) as raised:
        bind_unix_socket(path)
    assert raised.value.filename == str(path)  # the path asked for, not the temporary one
    assert path.read_text() == "the operator's\n"
    assert os.listdir(short_dir) == ["t.sock"]


def test_a_socket_path_too_long_for_a_temporary_name_is_bound_directly(short_dir: Path) -> None:
    """A path of 107 bytes whose name is shorter than the temporary one leaves no room for
    it in its folder: the socket is bound where it is asked to be, and works."""
    from toolsetd.daemon.server import bind_unix_socket

    folder = short_dir / ("d" * (105 - len(os.fsencode(str(short_dir))) - 1))  # + "/s": 107
    folder.mkdir()
    path = folder / "s"
    assert len(os.fsencode(str(path))) == 107
    listener = bind_unix_socket(path)
    try:
        with socket.socket(socket.AF_UNIX) as client:
            client.connect(str(path))
    finally:
        listener.close()
    assert os.listdir(folder) == ["s"]


_UMASK_AT_BIND = """
import os, stat, sys
from toolsetd.daemon.server import bind_unix_socket

os.umask(0o022)
seen = []

def hook(event, args):
    # At the bind itself (the audit event comes just before the system call), the umask
    # the socket file is made under, read without setting it.
    if event == "socket.bind":
        with open("/proc/self/status") as f:
            seen.append(next(line for line in f if line.startswith("Umask:")).split()[1])

sys.addaudithook(hook)
path = os.path.join(sys.argv[1], "u.sock")
bind_unix_socket(path).close()
print(" ".join(seen), oct(stat.S_IMODE(os.lstat(path).st_mode)))
"""


def test_binding_leaves_the_process_umask_alone(short_dir: Path) -> None:
    """The umask is the process's, and a tool spawned in a worker thread inherits it. Since
    the daemon makes its socket again while it serves (``_keep_socket``), a bind that
    tightened the umask to 0177 around ``bind`` could hand a tool spawned at that moment
    0177 (its folders made 0600, not searchable). The umask at each ``bind`` is read in an
    audit hook (in a child: a hook cannot be removed), so the test does not depend on a
    thread catching the moment; the socket is still 0600."""
    import subprocess

    done = subprocess.run(
        [sys.executable, "-c", _UMASK_AT_BIND, str(short_dir)],
        capture_output=True, text=True, timeout=60,
    )
    assert done.returncode == 0, done.stderr
    *umasks, mode = done.stdout.split()
    assert umasks and set(umasks) == {"0022"}, done.stdout
    assert mode == "0o600", done.stdout


_MODE_AT_BIND = """
import os, stat, sys
from toolsetd.daemon.server import bind_unix_socket

os.umask(0)
seen = []

def hook(event, args):
    # Just before the chmod that follows the bind (by path; the fchmod before it has
    # the socket's descriptor): the mode the socket file was made with.
    if event == "os.chmod" and isinstance(args[0], str):
        seen.append(oct(stat.S_IMODE(os.lstat(args[0]).st_mode)))

sys.addaudithook(hook)
bind_unix_socket(os.path.join(sys.argv[1], "m.sock")).close()
print(" ".join(seen))
"""


def test_a_socket_is_0600_from_its_bind_on_whatever_the_umask(short_dir: Path) -> None:
    """The kernel checks a connect's permission before it looks whether the socket listens,
    so a socket file made 0777 (umask 000) and chmod'ed only afterwards leaves a moment in
    which another user's connect can pass that check. The socket's own mode is set to 0600
    before ``bind`` (Linux makes the file with it, less the umask), so the file is 0600
    from the first instant, with the process's umask untouched."""
    import subprocess

    done = subprocess.run(
        [sys.executable, "-c", _MODE_AT_BIND, str(short_dir)],
        capture_output=True, text=True, timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() and set(done.stdout.split()) == {"0o600"}, done.stdout
