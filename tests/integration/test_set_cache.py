"""The persistent set cache seen from a real daemon: files in its folder it must not trust."""

from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path
from typing import Any

import pytest
from toolsetd.daemon import setcache
from toolsetd.daemon.exhaustion import allocations_can_fail

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


#: A machine whose allocations can fail (an address-space limit on the test run, strict
#: overcommit) starts daemons that use no set cache (docs/operations.md).
_CACHE_USED = pytest.mark.skipif(
    allocations_can_fail() is not None,
    reason="allocations can fail here, so the daemon uses no set cache",
)


@_CACHE_USED
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


@_CACHE_USED
@pytest.mark.skipif(os.geteuid() != 0, reason="only root can give a folder to another uid")
def test_a_poisoned_cache_in_another_users_open_folder_does_not_choose_the_command(
    tmp_base: Path,
) -> None:
    """A re-signed record in a folder another uid owns (mode 777) is not run; it is logged."""
    home, workspace, snapshot = _first_start(tmp_base)
    magic = setcache._MAGIC
    records: dict[str, Any] = {}  # bytes: no file given
    index: dict[str, Any] = {}
    setcache._merge(records, index, snapshot.read_bytes()[len(magic) + 32 :])
    for key, raw in records.items():
        record = json.loads(raw)
        record[4] = ["/bin/sh", "-c", "echo POISONED"]  # the set's command
        records[key] = json.dumps(record).encode()
    poisoned = setcache._pack(records, index)
    snapshot.write_bytes(magic + hashlib.sha256(poisoned).digest() + poisoned)
    folder = snapshot.parent
    for path in (folder, snapshot):
        os.chown(path, 65534, 65534)
    folder.chmod(0o777)
    d = start_daemon(home, workspace, tmp_base)
    try:
        with d.raw(timeout=30) as conn:
            _, reply = conn.invoke({"tool": "hello", "arguments": {}, "workspace": str(workspace)})
        assert reply["result"]["content"] == [{"type": "text", "text": "exit 0\nfrom-manifest\n"}]
    finally:
        shut_down(d)
    untrusted = [e for e in d.log_events() if e["event"] == "set_cache_untrusted"]
    assert [(e["path"], e["reason"]) for e in untrusted] == [
        (str(folder), "owned by uid 65534, not this daemon's uid 0")
    ]
    assert untrusted[0]["fix"].startswith(f"remove {folder}")
