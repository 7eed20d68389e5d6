"""Node programs from npm for the tests that drive toolsetd with real MCP hosts.

Each is installed once into a cache folder outside the repository
(``$XDG_CACHE_HOME/toolsetd-tests/<name>``, else ``~/.cache/toolsetd-tests/<name>``), under
a lock (the tests may run in parallel). CI machines start empty: the install is the test's
own step. Without ``node`` and ``npm``, or when npm cannot install (no registry), the test
is skipped with the reason.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
from pathlib import Path

import pytest

#: Where the installs are kept: the cache folder of the user who runs the tests, read when
#: this module is imported (at collection). The session fixture in tests/conftest.py then
#: points ``XDG_CACHE_HOME`` at a fresh folder per session, for the daemons' set caches;
#: read at install time, that made every session install every package again (8-30 s each,
#: from npm's own cache).
CACHE_BASE = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")


def node() -> str:
    """The ``node`` to run an installed program with; skips when there is none."""
    found = shutil.which("node")
    if found is None:
        pytest.skip("node is needed to run the npm clients, and this machine has none")
    return found


def npm_installed(name: str, packages: list[str], marker: str) -> Path:
    """The cache folder ``name`` holding ``packages`` (npm specs, pinned), installed once;
    ``marker`` is a file under it that exists once the install is done."""
    node()
    npm = shutil.which("npm")
    if npm is None:
        pytest.skip(f"npm is needed to install {' '.join(packages)}, and this machine has none")
    folder = Path(CACHE_BASE) / "toolsetd-tests" / name
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (folder / marker).exists():
            try:
                done = subprocess.run(
                    [npm, "install", "--prefix", str(folder), "--no-audit", "--no-fund",
                     "--loglevel=error", *packages],
                    capture_output=True, text=True, timeout=600, check=False,
                )
            except subprocess.TimeoutExpired:
                pytest.skip(f"npm did not install {' '.join(packages)} within 600 s")
            if done.returncode != 0 or not (folder / marker).exists():
                why = " ".join(done.stderr.split())[:400] or f"exit {done.returncode}"
                pytest.skip(f"npm could not install {' '.join(packages)} (no registry?): {why}")
    return folder


def npm_program(name: str, spec: str, program: str) -> Path:
    """The program ``program`` of the npm package ``spec`` (pinned), installed once into
    the cache folder ``name``."""
    folder = npm_installed(name, [spec], f"node_modules/.bin/{program}")
    return folder / "node_modules" / ".bin" / program
