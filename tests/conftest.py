"""Shared fixtures: the anyio backend for every async test, a private cache folder,
``as_nobody`` (the command prefix that runs a program as uid 65534) and ``unwritable`` (a
folder that refuses new files, root included).

Under ``make test-fast`` the property tests run the ``fast`` profile (``budget.py``).
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from hypothesis import settings

from .budget import FAST

settings.register_profile("fast", max_examples=20)
if FAST:
    settings.load_profile("fast")


@pytest.fixture(scope="session")
def anyio_backend() -> str:
    """Run async tests on asyncio, the backend the daemon runs on."""
    return "asyncio"


@pytest.fixture(scope="session", autouse=True)
def _private_cache_home(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Every daemon a test starts keeps its set cache here, never in the user's ~/.cache."""
    old = os.environ.get("XDG_CACHE_HOME")
    os.environ["XDG_CACHE_HOME"] = str(tmp_path_factory.mktemp("xdg-cache"))
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("XDG_CACHE_HOME", None)
        else:
            os.environ["XDG_CACHE_HOME"] = old


@pytest.fixture
def unwritable() -> Iterator[Callable[[Path], None]]:
    """Make a folder refuse new files, even to root (mode 0555, then ``chattr +i``), until
    the test ends; the test is skipped where neither holds (no ``chattr``, a file system
    without the flag)."""
    made: list[Path] = []

    def make(folder: Path) -> None:
        made.append(folder)
        folder.chmod(0o555)
        probe = folder / ".probe"
        try:
            probe.touch()
        except PermissionError:
            return
        probe.unlink()
        chattr = shutil.which("chattr")
        done = None if chattr is None else subprocess.run(
            [chattr, "+i", str(folder)], capture_output=True, check=False
        )
        if done is None or done.returncode != 0:
            pytest.skip("cannot make a folder unwritable here")

    yield make
    chattr = shutil.which("chattr")
    for folder in made:
        if chattr is not None:
            subprocess.run([chattr, "-i", str(folder)], capture_output=True, check=False)
        folder.chmod(0o755)


NOBODY = ("setpriv", "--reuid=65534", "--regid=65534", "--clear-groups")


@functools.cache
def _why_nobody_cannot_run() -> str | None:
    if os.geteuid() != 0 or shutil.which("setpriv") is None:
        return "needs root and setpriv"
    probe = subprocess.run(
        [*NOBODY, sys.executable, "-c", "import toolsetd.daemon.catalog"],
        capture_output=True, text=True, timeout=60, check=False,
    )
    if probe.returncode == 0:
        return None
    last = (probe.stderr.strip().splitlines() or ["no output"])[-1]
    return (
        "uid 65534 cannot run this checkout's interpreter and packages (a checkout under a "
        f"folder only its owner may search, such as one made by mktemp -d): {last}"
    )


@pytest.fixture
def as_nobody() -> tuple[str, ...]:
    """The prefix that runs a command as uid 65534; skips where that cannot run toolsetd."""
    reason = _why_nobody_cannot_run()
    if reason is not None:
        pytest.skip(reason)
    return NOBODY
