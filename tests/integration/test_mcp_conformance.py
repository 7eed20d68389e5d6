"""The official MCP conformance suite (``@modelcontextprotocol/conformance``) against toolsetd.

The suite is installed from npm into a cache folder outside the repository
(``$XDG_CACHE_HOME/toolsetd-tests``, else ``~/.cache/toolsetd-tests``), once, under a lock
(the tests may run in parallel). Its entry point imports ``globSync`` from ``fs``, which
Node gained in 22; on an older Node the import is rewritten to take ``globSync`` from the
``glob`` package (installed beside it), which is what makes it run on Node 20. Without
``node`` and ``npm`` the test is skipped with the reason.

Every server scenario runs (``--suite all``) against a real daemon serving the tool set
under ``tests/conformance/tools`` over HTTP; ``tests/conformance/expected-failures.yml``
lists the scenarios that need features toolsetd does not offer, and the suite itself fails
the run for a scenario that fails unlisted, or passes listed.
"""

from __future__ import annotations

import fcntl
import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from .conftest import REPO, Daemon, shut_down
from .http_helpers import endpoint, start_http_daemon
from .npm_helpers import CACHE_BASE

SUITE_VERSION = "0.1.16"
GLOB_VERSION = "14.0.6"
CONFORMANCE = REPO / "tests" / "conformance"
#: Scenarios a tools-only server must pass (the issue's list); the run must show them.
MUST_PASS = (
    "server-initialize", "ping", "tools-list", "tools-call-simple-text", "tools-call-image",
    "tools-call-error", "tools-call-with-progress", "tools-call-elicitation",
    "json-schema-2020-12", "dns-rebinding-protection", "server-sse-polling",
    "server-sse-multiple-streams",
)


def _cache_dir() -> Path:
    return Path(CACHE_BASE) / "toolsetd-tests" / f"mcp-conformance-{SUITE_VERSION}"


def _node_major(node: str) -> int:
    out = subprocess.run([node, "--version"], capture_output=True, text=True, check=True)
    return int(out.stdout.strip().lstrip("v").split(".")[0])


def _patch_glob_import(entry: Path) -> None:
    """Take ``globSync`` from the ``glob`` package instead of ``fs`` (Node < 22)."""
    text = entry.read_text()
    if 'from"glob"' in text:
        return
    match = re.search(r'import\{([^}]*)\}from"fs";', text)
    if match is None:
        raise RuntimeError(f"{entry}: no import from 'fs' to patch; has the suite changed?")
    names = match.group(1).split(",")
    glob_names = [n for n in names if n.strip().startswith("globSync")]
    if not glob_names:
        return
    rest = [n for n in names if n not in glob_names]
    patched = (
        f'import{{{",".join(rest)}}}from"fs";import{{{",".join(glob_names)}}}from"glob";'
    )
    entry.write_text(text[: match.start()] + patched + text[match.end() :])


def install_suite() -> Path:
    """Install the suite (once) and return its entry point; skip without node or npm."""
    node, npm = shutil.which("node"), shutil.which("npm")
    if node is None or npm is None:
        pytest.skip("the MCP conformance suite needs node and npm, and this machine has none")
    folder = _cache_dir()
    folder.mkdir(parents=True, exist_ok=True)
    entry = folder / "node_modules" / "@modelcontextprotocol" / "conformance" / "dist" / "index.js"
    with open(folder / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not entry.exists():
            out = subprocess.run(
                [npm, "install", "--prefix", str(folder), "--no-audit", "--no-fund",
                 "--loglevel=error", f"@modelcontextprotocol/conformance@{SUITE_VERSION}",
                 f"glob@{GLOB_VERSION}"],
                capture_output=True, text=True, timeout=600, check=False,
            )
            if out.returncode != 0 or not entry.exists():
                pytest.fail(f"npm could not install the conformance suite:\n{out.stderr[-4000:]}")
        if _node_major(node) < 22:
            _patch_glob_import(entry)
    return entry


@pytest.fixture
def conformance_daemon(tmp_base: Path) -> Iterator[tuple[Daemon, str, Path]]:
    """A daemon whose home holds only the conformance tool set, serving MCP over HTTP."""
    home = tmp_base / "home"
    shutil.copytree(CONFORMANCE / "tools", home / "tools")
    workspace = tmp_base / "ws"
    workspace.mkdir()
    daemon, base = start_http_daemon(home, workspace, tmp_base)
    try:
        yield daemon, base, workspace
    finally:
        shut_down(daemon)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_official_conformance_suite_server_scenarios(conformance_daemon) -> None:
    """Every server scenario a tools-only server can meet passes the official suite."""
    entry = install_suite()
    node = shutil.which("node")
    assert node is not None
    daemon, base, workspace = conformance_daemon
    out = subprocess.run(
        [node, str(entry), "server", "--suite", "all", "--url", endpoint(base, workspace),
         "--expected-failures", str(CONFORMANCE / "expected-failures.yml")],
        capture_output=True, text=True, timeout=600, check=False,
    )
    report = out.stdout + out.stderr
    assert out.returncode == 0, f"conformance suite failed:\n{report[-12000:]}\n{daemon.log()[-4000:]}"
    passed = set(re.findall(r"^✓ ([\w-]+):", report, re.MULTILINE))
    missing = [name for name in MUST_PASS if name not in passed]
    assert not missing, f"scenarios not passed: {missing}\n{report[-8000:]}"
    assert daemon.proc.poll() is None


def test_patch_glob_import_rewrites_only_the_fs_import(tmp_path: Path) -> None:
    """The Node 20 patch moves globSync to the glob package and keeps the other fs names."""
    entry = tmp_path / "index.js"
    entry.write_text('import{a as b}from"x";import{existsSync as a,globSync as o,readFileSync as l}'
                     'from"fs";o(`**`);')
    _patch_glob_import(entry)
    text = entry.read_text()
    assert 'import{existsSync as a,readFileSync as l}from"fs";' in text
    assert 'import{globSync as o}from"glob";' in text
    _patch_glob_import(entry)
    assert entry.read_text() == text
