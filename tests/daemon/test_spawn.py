"""Starting a child (``spawn.Spawner``): the direct ``fork_exec`` path and ``Popen`` alike.

Every test runs both ways: the direct path must give the child exactly what ``Popen`` gives
it (argv, environment, working directory, descriptors, session, signal dispositions) and
fail exactly as ``Popen`` fails.
"""

from __future__ import annotations

import errno
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from toolsetd.daemon.spawn import Child, Spawner, env_path

from tests.daemon.conftest import open_fds

BASE = {"PATH": "/usr/bin:/bin", "TRACEPARENT": "old", "KEEP": "base", "CRYSTAL_SESSION": "stale"}
FIXED = ("CRYSTAL_SESSION", "TOOLSETD_CALL_ID")


@pytest.fixture(params=[True, False], ids=["direct", "popen"])
def spawner(request: pytest.FixtureRequest) -> Spawner:
    if request.param and not Spawner({}, ()).direct:
        pytest.skip(f"fork_exec's arguments are not known on Python {sys.version_info[:2]}")
    return Spawner(BASE, FIXED, direct=request.param)


@pytest.fixture(autouse=True)
def no_fd_leak() -> Iterator[None]:
    before = open_fds()
    yield
    assert open_fds() - before == set()


def run(
    spawner: Spawner, argv: list[str], env: list[bytes] | None = None, cwd: str = "/"
) -> tuple[bytes, int]:
    """Start ``argv`` with an empty stdin; its stdout and stderr, and its return code."""
    out_r, out_w = os.pipe2(os.O_CLOEXEC)
    in_r, in_w = os.pipe2(os.O_CLOEXEC)
    os.close(in_w)
    try:
        child = spawner.spawn(
            argv,
            env=env if env is not None else spawner.environment({}, ()),
            cwd=cwd,
            stdin=in_r,
            stdout=out_w,
            stderr=out_w,
            pass_fds=(),
        )
    except BaseException:
        os.close(out_r)
        raise
    finally:
        os.close(out_w)
        os.close(in_r)
    with os.fdopen(out_r, "rb") as f:
        output = f.read()
    return output, wait(child)


def wait(child: Child) -> int:
    end = time.monotonic() + 10
    while (code := child.poll()) is None:
        assert time.monotonic() < end, "the child did not exit"
        time.sleep(0.002)
    return code


def test_environment_is_the_base_with_the_call_over_it(spawner: Spawner) -> None:
    """``extra`` replaces a base value in place, the fixed names come last, and a fixed name
    in the base (a daemon started from a tool call) is dropped, never sent twice."""
    env = spawner.environment(
        {"TRACEPARENT": "new", "EXTRA": "é"},
        ((b"CRYSTAL_SESSION", b"s1"), (b"TOOLSETD_CALL_ID", b"c1")),
    )
    assert env == [
        b"PATH=/usr/bin:/bin",
        b"TRACEPARENT=new",
        b"KEEP=base",
        b"EXTRA=\xc3\xa9",
        b"CRYSTAL_SESSION=s1",
        b"TOOLSETD_CALL_ID=c1",
    ]
    output, code = run(spawner, ["/usr/bin/env"], env)
    assert (output.splitlines(), code) == (env, 0)
    assert env_path(env) == "/usr/bin:/bin"


@pytest.mark.parametrize(
    ("extra", "fragment"),
    [({"A=B": "x"}, "illegal environment variable name"), ({"A": "\ud800"}, "surrogate")],
    ids=["equals-in-name", "unencodable"],
)
def test_environment_refuses_what_execve_cannot_carry(extra: dict[str, str], fragment: str) -> None:
    """One check for both ways of starting: the environment is built before either."""
    with pytest.raises(ValueError, match=fragment):
        Spawner(BASE, FIXED).environment(extra, ())


def test_argv_cwd_and_the_bare_name_found_on_the_child_path(
    spawner: Spawner, tmp_path: Path
) -> None:
    """A bare name is looked up on the child's PATH, not the daemon's."""
    (tmp_path / "bin").mkdir()
    tool = tmp_path / "bin" / "only-here"
    tool.write_text('#!/bin/sh\npwd; for a in "$@"; do echo "[$a]"; done\n')
    tool.chmod(0o755)
    env = spawner.environment({"PATH": f"{tmp_path / 'bin'}:/bin"}, ())
    output, code = run(spawner, ["only-here", "a b", ""], env, cwd=str(tmp_path))
    assert (output.decode(), code) == (f"{tmp_path}\n[a b]\n[]\n", 0)


def test_a_bare_name_is_never_taken_from_the_daemon_folder_or_the_workspace(
    spawner: Spawner, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """.NET's Process.Start on Unix tries the host's own folder and current directory
    before PATH; here a bare name (not in the set folder) is looked up on PATH alone, so a
    file of that name in the daemon's folder or the workspace never runs (docs/manifest.md,
    Differences)."""
    daemon_cwd, workspace = tmp_path / "daemon", tmp_path / "ws"
    for folder in (daemon_cwd, workspace):
        folder.mkdir()
        tool = folder / "fid-only-here"
        tool.write_text("#!/bin/sh\necho ran\n")
        tool.chmod(0o755)
    monkeypatch.chdir(daemon_cwd)
    env = spawner.environment({"PATH": "/usr/bin:/bin"}, ())
    with pytest.raises(FileNotFoundError):
        run(spawner, ["fid-only-here"], env, cwd=str(workspace))


def test_the_child_gets_only_its_streams_and_pass_fds(spawner: Spawner) -> None:
    """close_fds: a descriptor of the daemon, even an inheritable one, never reaches the
    child; ``pass_fds`` does, at its number."""
    stray = os.open("/dev/null", os.O_RDONLY)
    os.set_inheritable(stray, True)
    keep_r, keep_w = os.pipe2(os.O_CLOEXEC)
    out_r, out_w = os.pipe2(os.O_CLOEXEC)
    try:
        child = spawner.spawn(
            ["/bin/sh", "-c", "ls /proc/$$/fd"],
            env=spawner.environment({}, ()),
            cwd="/",
            stdin=keep_r,
            stdout=out_w,
            stderr=out_w,
            pass_fds=(keep_w,),
        )
    finally:
        os.close(out_w)
    with os.fdopen(out_r, "rb") as f:
        fds = {int(n) for n in f.read().split()}
    os.close(stray)
    os.close(keep_r)
    os.close(keep_w)
    assert wait(child) == 0
    assert stray not in fds
    assert fds == {0, 1, 2, keep_w}


def test_the_child_leads_a_new_session_with_default_signals(spawner: Spawner) -> None:
    """It leads its own session (so its group's id is its pid), and SIGPIPE, which Python
    ignores in the daemon, is back at its default (restore_signals)."""
    script = "import os; print(os.getsid(0) == os.getpid() == os.getpgid(0))"
    assert run(spawner, [sys.executable, "-S", "-c", script]) == (b"True\n", 0)
    # Python's own start-up ignores SIGPIPE again, so read the shell's mask instead.
    output, _ = run(spawner, ["/bin/sh", "-c", "grep SigIgn /proc/$$/status"])
    mask = int(output.split()[1], 16)
    assert not mask & (1 << (13 - 1)), "SIGPIPE is still ignored in the child"


def test_poll_reports_exit_codes_and_signals(spawner: Spawner) -> None:
    assert run(spawner, ["/bin/sh", "-c", "exit 7"])[1] == 7
    assert run(spawner, ["/bin/sh", "-c", "kill -TERM $$"])[1] == -15


def test_poll_of_a_child_reaped_elsewhere_is_zero(spawner: Spawner) -> None:
    """As ``Popen.poll``: a child someone else reaped (ECHILD) ends with code 0, not an
    exception out of the runner's reap."""
    child = spawner.spawn(
        ["/bin/sh", "-c", "exit 3"], env=[], cwd="/", stdin=0, stdout=1, stderr=2, pass_fds=()
    )
    os.waitpid(child.pid, 0)
    assert child.poll() == 0
    assert child.returncode == 0


@pytest.mark.parametrize(
    ("argv", "cwd", "kind", "named"),
    [
        (["/nonexistent/tool"], "/", FileNotFoundError, "/nonexistent/tool"),
        (["no-such-tool-anywhere"], "/", FileNotFoundError, "no-such-tool-anywhere"),
        (["{tmp}/data.txt"], "/", PermissionError, "{tmp}/data.txt"),
        (["/bin/true"], "/nonexistent-folder", FileNotFoundError, "/nonexistent-folder"),
    ],
    ids=["missing", "not-on-path", "not-executable", "missing-cwd"],
)
def test_a_failed_exec_names_the_file_and_leaves_no_child(
    spawner: Spawner,
    tmp_path: Path,
    argv: list[str],
    cwd: str,
    kind: type[OSError],
    named: str,
) -> None:
    """As Popen: the errno, its text and the file (the working directory when the chdir
    before the exec failed); the failed child is reaped before the error is raised."""
    (tmp_path / "data.txt").write_text("not a program\n")  # mode 644: no exec bit for anyone
    argv = [a.format(tmp=tmp_path) for a in argv]
    named = named.format(tmp=tmp_path)
    children = _children()
    with pytest.raises(kind) as caught:
        run(spawner, argv, cwd=cwd)
    assert caught.value.filename == named
    assert caught.value.strerror == os.strerror(caught.value.errno)
    assert _children() == children


def test_a_failure_before_the_exec_is_reported_as_popen_reports_it(tmp_path: Path) -> None:
    """A step between the fork and the exec that fails (here the dup2 of a closed stdin)
    raises what this Python's ``Popen`` raises for it: Python 3.13 names no file where
    3.11 and 3.12 name the working directory; a failed chdir names it in every version."""
    if not Spawner({}, ()).direct:
        pytest.skip(f"fork_exec's arguments are not known on Python {sys.version_info[:2]}")
    closed = 900
    with pytest.raises(OSError, match=os.strerror(errno.EBADF)):
        os.fstat(closed)

    def failure(direct: bool, stdin: int, cwd: str) -> tuple[type, int | None, str | None]:
        spawner = Spawner(BASE, FIXED, direct=direct)
        with pytest.raises(OSError) as caught:  # noqa: PT011 - any: the two spawners' are compared
            spawner.spawn(
                ["/bin/true"], env=[], cwd=cwd, stdin=stdin, stdout=1, stderr=2, pass_fds=()
            )
        return type(caught.value), caught.value.errno, caught.value.filename

    for stdin, cwd in ((closed, str(tmp_path)), (0, str(tmp_path / "gone"))):
        assert failure(True, stdin, cwd) == failure(False, stdin, cwd)
    assert failure(True, closed, str(tmp_path))[1] == errno.EBADF


def test_a_child_kept_unreaped_is_reaped_by_a_later_spawn(spawner: Spawner) -> None:
    """The runner hands back a leader it could not reap within its bound; it must not stay
    a zombie (a dropped ``Popen`` is reaped by the next ``Popen``; ``fork_exec``'s child
    has nobody else)."""
    r, w = os.pipe2(os.O_CLOEXEC)
    try:
        child = spawner.spawn(
            ["/bin/sh", "-c", "read line"],
            env=[],
            cwd="/",
            stdin=r,
            stdout=1,
            stderr=2,
            pass_fds=(),
        )
    finally:
        os.close(r)
    assert child.poll() is None
    spawner.keep_unreaped(child)
    os.close(w)  # it reads EOF and exits
    end = time.monotonic() + 10
    while _state(child.pid) != "Z":
        assert time.monotonic() < end, "the child did not exit"
        time.sleep(0.002)
    run(spawner, ["/bin/true"])
    assert _state(child.pid) is None
    assert child.returncode is not None


def _state(pid: int) -> str | None:
    """A process's state letter, None once it is gone (reaped)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return None


def test_a_nul_byte_is_refused_before_any_child(spawner: Spawner) -> None:
    children = _children()
    with pytest.raises(ValueError, match="null"):
        run(spawner, ["/bin/echo", "a\0b"])
    assert _children() == children


def _children() -> set[str]:
    """This process's children, zombies included."""
    me = str(os.getpid())
    found = set()
    for task in os.listdir(f"/proc/{me}/task"):
        try:
            found.update(Path(f"/proc/{me}/task/{task}/children").read_text().split())
        except FileNotFoundError:
            pass
    return found
