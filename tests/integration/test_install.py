"""The install of docs/operations.md: a wheel from this checkout, a fresh venv, a daemon from it.

This is what `pipx install .`, `uv tool install .` and the `/opt/toolsetd` venv do, minus
the tool that makes the venv: build a wheel, install it (with its dependencies, from the
package index) into a new venv outside the checkout, and run the venv's own `toolsetd` and
`toolsetctl` from a folder where the checkout cannot be imported. Slow: it installs the
dependencies (pip's cache makes a second run quicker).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from .conftest import REPO, RawConn

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


def _run(*argv: str | Path, cwd: Path, timeout: float = 600) -> str:
    result = subprocess.run(
        [str(a) for a in argv],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
        env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"},
    )
    assert result.returncode == 0, f"{argv}:\n{result.stdout}\n{result.stderr}"
    return result.stdout


def test_install_wheel_into_a_fresh_venv_and_serve(tmp_base: Path) -> None:
    """The wheel installs into a new venv whose toolsetd serves and whose toolsetctl reaches it."""
    # Build from a copy: an in-tree build would leave build/ and *.egg-info in the checkout.
    source = tmp_base / "src"
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(REPO / name, source / name)
    for folder in ("protocol", "daemon", "client"):
        shutil.copytree(
            REPO / folder, source / folder, ignore=shutil.ignore_patterns("__pycache__")
        )
    wheels = tmp_base / "wheels"
    _run(
        sys.executable,
        "-m",
        "pip",
        "wheel",
        "--no-deps",
        "--quiet",
        "-w",
        wheels,
        source,
        cwd=tmp_base,
    )
    (wheel,) = wheels.glob("toolsetd-*.whl")
    venv = tmp_base / "opt-toolsetd"
    _run(sys.executable, "-m", "venv", venv, cwd=tmp_base)
    _run(venv / "bin" / "pip", "install", "--quiet", wheel, cwd=tmp_base)
    toolsetd, toolsetctl = venv / "bin" / "toolsetd", venv / "bin" / "toolsetctl"
    assert os.access(toolsetd, os.X_OK) and os.access(toolsetctl, os.X_OK)
    where = _run(
        venv / "bin" / "python",
        "-c",
        "import toolsetd.daemon; print(toolsetd.daemon.__file__)",
        cwd=tmp_base,
    )
    assert where.startswith(str(venv)), where

    home = tmp_base / "home"
    (home / "tools" / "hello").mkdir(parents=True)
    for name in ("tools.json", "hello.sh"):
        source = REPO / "examples" / "tools" / "hello" / name
        target = home / "tools" / "hello" / name
        target.write_bytes(source.read_bytes())
        target.chmod(source.stat().st_mode)
    config = tmp_base / "toolsetd.toml"
    config.write_text(f'home = "{home}"\nmax-running = 4\n')
    sock = tmp_base / "s.sock"
    printed = _run(toolsetd, "--config", config, "--print-config", cwd=tmp_base)
    assert "max-running = 4" in printed and f"{config}:2" in printed

    log = (tmp_base / "daemon.log").open("wb")
    proc = subprocess.Popen(  # the installed daemon under test
        [toolsetd, "--config", config, "--socket", sock],
        cwd=tmp_base,
        stderr=log,
        stdout=log,
    )
    try:
        deadline = time.monotonic() + 30
        while not sock.exists():
            assert proc.poll() is None, (tmp_base / "daemon.log").read_text()
            assert time.monotonic() < deadline, "the installed daemon did not start"
            time.sleep(0.05)
        with RawConn(sock) as conn:
            assert conn.request("status")["result"]["home"] == str(home)
        status = _run(toolsetctl, "--socket", sock, "--format", "json", "status", cwd=tmp_base)
        assert '"home"' in status
        ran = _run(
            toolsetctl,
            "--socket",
            sock,
            "--workspace",
            tmp_base,
            "invoke",
            "hello",
            "--args",
            '{"name": "installed"}',
            cwd=tmp_base,
        )
        assert "Hello, installed!" in ran
        metrics = _run(toolsetctl, "--socket", sock, "metrics", cwd=tmp_base)
        assert 'toolsetd_calls_total{decision="allow",set="hello",status="ok"} 1.0' in metrics
        _run(toolsetctl, "--socket", sock, "reload", "--all", cwd=tmp_base)
    finally:
        proc.terminate()
        assert proc.wait(timeout=30) == 0
        log.close()
