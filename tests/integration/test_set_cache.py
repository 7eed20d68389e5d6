"""The persistent set cache seen from a real daemon: files in its folder it must not trust."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from .conftest import shut_down, start_daemon, write_set

#: The manifest every test serves: what the daemon must run, whatever the cache says.
HELLO = {
    "runner": "exec",
    "description": "Say where the command came from.",
    "schema": {"type": "object"},
    "command": ["echo", "from-manifest"],
    "approval": "always",
}


def _first_start(tmp_base: Path) -> tuple[Path, Path, Path]:
    """Start and stop a daemon once over one set, so the cache holds its record."""
    home, workspace = tmp_base / "home", tmp_base / "ws"
    workspace.mkdir()
    write_set(home / "tools", "hello", HELLO)
    old = time.time() - 10  # beyond the racy window: indexed by its stat signature
    os.utime(home / "tools" / "hello" / "tools.json", (old, old))
    d = start_daemon(home, workspace, tmp_base)
    try:
        assert [t["name"] for t in d.call("list")["result"]["tools"]] == ["hello"]
    finally:
        assert d.stop() == 0
    folder = tmp_base / "cache" / "toolsetd"
    (snapshot,) = folder.glob("sets-*.json")
    return home, workspace, snapshot


@pytest.mark.parametrize("which", [".json", ".journal"])
def test_a_fifo_as_a_cache_file_neither_hangs_the_start_nor_sigterm(
    tmp_base: Path, which: str
) -> None:
    """A FIFO as the snapshot or journal is ignored: the daemon answers and stops on SIGTERM."""
    home, workspace, snapshot = _first_start(tmp_base)
    fifo = snapshot.with_suffix(which)
    fifo.unlink(missing_ok=True)
    os.mkfifo(fifo)
    d = start_daemon(home, workspace, tmp_base)  # fails unless status is answered
    try:
        assert [t["name"] for t in d.call("list")["result"]["tools"]] == ["hello"]
        assert d.stop(timeout=10) == 0
    finally:
        shut_down(d)
    events = [e for e in d.log_events() if e.get("path") == str(fifo)]
    assert [(e["event"], e.get("reason")) for e in events] == [
        ("set_cache_ignored", "not a regular file")
    ]
