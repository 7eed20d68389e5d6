"""The shipped systemd units pass ``systemd-analyze verify`` and say what the contract needs.

``verify`` needs no running systemd (it loads the units into an offline manager), but it
checks that ``ExecStart=`` and ``ExecReload=`` name existing executables, so each unit pair
is copied into a temporary folder with those paths replaced by real ones (the venv's
``toolsetd`` and ``toolsetctl`` when installed, else ``/bin/true``). ``--man=no`` keeps it from looking up man pages.
The user pair is verified with ``--user``, which needs ``XDG_RUNTIME_DIR`` (a temporary
one is given). ``verify`` only warns, exit status 0, about unknown keys and bad values, so
the tests also require its output to be empty.
"""

from __future__ import annotations

import os
import re
import shutil
import sys
from pathlib import Path

import anyio
import pytest

UNITS = Path(__file__).resolve().parents[2] / "systemd"
PAIRS = {"user": UNITS, "system": UNITS / "system"}
SYSTEMD_ANALYZE = shutil.which("systemd-analyze")


def _real_executable(name: str = "toolsetd") -> str:
    """An executable that exists here, to stand in for the installed command."""
    candidate = Path(sys.executable).with_name(name)
    return os.fspath(candidate) if os.access(candidate, os.X_OK) else "/bin/true"


def _read(kind: str, name: str) -> str:
    return (PAIRS[kind] / name).read_text()


def _directives(text: str) -> dict[str, list[str]]:
    """Map each ``Key=`` to its values, ignoring comments."""
    found: dict[str, list[str]] = {}
    for line in text.splitlines():
        if line.startswith(("#", ";", "[")) or "=" not in line:
            continue
        key, _, value = line.partition("=")
        found.setdefault(key.strip(), []).append(value.strip())
    return found


@pytest.mark.anyio
@pytest.mark.skipif(SYSTEMD_ANALYZE is None, reason="systemd-analyze is not installed")
@pytest.mark.parametrize("kind", ["user", "system"])
async def test_units_pass_systemd_analyze_verify(kind: str, tmp_path: Path) -> None:
    """Each unit pair verifies cleanly: exit status 0 and no warning at all."""
    assert SYSTEMD_ANALYZE is not None
    exe, ctl = _real_executable(), _real_executable("toolsetctl")
    for name in ("toolsetd.socket", "toolsetd.service"):
        text = _read(kind, name)
        text = re.sub(r"^ExecStart=\S+", f"ExecStart={exe}", text, flags=re.MULTILINE)
        text = re.sub(r"^ExecReload=\S+", f"ExecReload={ctl}", text, flags=re.MULTILINE)
        (tmp_path / name).write_text(text)
    runtime = tmp_path / "runtime"
    runtime.mkdir(mode=0o700)
    env = dict(os.environ, XDG_RUNTIME_DIR=os.fspath(runtime), SYSTEMD_LOG_LEVEL="notice")
    command = [SYSTEMD_ANALYZE, *(["--user"] if kind == "user" else []), "verify", "--man=no"]
    command += [os.fspath(tmp_path / "toolsetd.socket"), os.fspath(tmp_path / "toolsetd.service")]
    with anyio.fail_after(30):
        result = await anyio.run_process(command, env=env, check=False, cwd=tmp_path)
    output = (result.stdout + result.stderr).decode(errors="replace")
    if result.returncode != 0 and "Failed to initialize manager" in output:
        pytest.skip(f"systemd-analyze verify cannot run here: {output.strip()}")
    assert result.returncode == 0, output
    assert output.strip() == ""


@pytest.mark.parametrize("kind", ["user", "system"])
def test_units_socket_and_kill_settings(kind: str) -> None:
    """The sockets are private (0600 user, 0660 group system) and stop kills the whole cgroup."""
    socket_unit = _directives(_read(kind, "toolsetd.socket"))
    service = _directives(_read(kind, "toolsetd.service"))
    if kind == "user":
        assert socket_unit["ListenStream"] == ["%t/toolsetd/toolsetd.sock"]
        assert socket_unit["SocketMode"] == ["0600"]
        # pipx and `uv tool install` put the console scripts in ~/.local/bin.
        assert service["ExecStart"][0].startswith("%h/.local/bin/toolsetd ")
        assert service["ExecReload"][0].startswith("%h/.local/bin/toolsetctl ")
    else:
        assert socket_unit["ListenStream"] == ["/run/toolsetd/toolsetd.sock"]
        assert socket_unit["SocketMode"] == ["0660"]
        assert socket_unit["SocketGroup"] == ["toolsetd"]
        assert service["User"] == ["toolsetd"]
        assert service["RuntimeDirectory"] == ["toolsetd"]
        # The venv of the system install (docs/operations.md).
        assert service["ExecStart"][0].startswith("/opt/toolsetd/bin/toolsetd ")
        assert service["ExecReload"][0].startswith("/opt/toolsetd/bin/toolsetctl ")
        assert "--allow-group toolsetd" in service["ExecStart"][0]
    assert service["KillMode"][0] in {"mixed", "control-group"}
    assert service["Type"][0] in {"notify", "notify-reload"}
    if service["Type"][0] == "notify":
        # A reload over the socket: it returns once the catalogs are rebuilt, and fails
        # the unit's reload when they could not be (a SIGHUP would return at once).
        assert service["ExecReload"][0].endswith(" reload --all")
        assert f"--socket {socket_unit['ListenStream'][0]}" in service["ExecReload"][0]
    assert service["ConfigurationDirectory"] == ["toolsetd"]
    assert service["NotifyAccess"] == ["main"]
    # A config or usage error (exit 2) is not restarted until the start limit.
    assert service["RestartPreventExitStatus"] == ["2"]
    listen = socket_unit["ListenStream"][0]
    assert f"--socket {listen}" in service["ExecStart"][0]


@pytest.mark.parametrize("kind", ["user", "system"])
def test_units_delegate_the_cgroup(kind: str) -> None:
    """Both units delegate their cgroup (one per call) and leave it and bwrap's namespaces usable."""
    service = _directives(_read(kind, "toolsetd.service"))
    assert service["Delegate"] == ["yes"]
    assert service.get("ProtectControlGroups", ["no"]) == ["no"]
    allowed = service.get("RestrictNamespaces", ["no"])[0].split()
    assert allowed == ["no"] or {"mnt", "pid", "net", "ipc"} <= set(allowed)


@pytest.mark.parametrize(
    "path",
    sorted(p.relative_to(UNITS) for p in UNITS.rglob("toolsetd.*")),
    ids=str,
)
def test_units_are_commented(path: Path) -> None:
    """Every unit file opens with a comment saying what it is and how to install it."""
    text = (UNITS / path).read_text()
    assert text.startswith(f"# {path.name} - ")
    assert "systemctl" in text.split("[Unit]")[0]
