"""Reproduce: a released idle workspace's set-store records stay decoded in memory.

Starts a real daemon (temp home, temp cache folder, ``--workspace-idle 1``) and, in
``CYCLES`` cycles, opens ``PER_CYCLE`` new workspaces of ``SETS`` project sets each (every
manifest ~0.5 MB: one tool with a big schema) with ``list``, then leaves them idle until
the daemon releases them. RSS is read from /proc/<pid>/status after the start and after
each cycle's release: once on a cold set store (the first start parses and writes it),
once on a second daemon with the warm store, and once with ``--no-cache``. Memory a
release frees is reused by the next cycle, so RSS that climbs cycle after cycle is
memory the daemon kept for workspaces it released.

``python attack/setcache_rss.py``
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._common import BlockingConn, start_daemon

CYCLES = int(os.environ.get("CYCLES", "3"))
PER_CYCLE = 2  # workspaces opened per cycle, then left to be released
WORKSPACES = CYCLES * PER_CYCLE
SETS = 10
PROPS = 5200  # ~0.7 MB of manifest


def big_manifest(w: int, s: int) -> bytes:
    props = {
        f"p{w}_{s}_{i:05d}": {
            "type": "string",
            "description": f"Property {i} of set {s} in workspace {w}, long enough.",
        }
        for i in range(PROPS)
    }
    return json.dumps(
        {
            "runner": "exec",
            "description": f"Big tool {w}/{s}.",
            "schema": {"type": "object", "properties": props},
            "command": ["/bin/true"],
        }
    ).encode()


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def run(base: Path, name: str, extra: list[str]) -> list[float]:
    """RSS (MB) after the start, then after each cycle's workspaces were used and released."""
    home = base / "home"
    daemon = start_daemon(
        home, base, extra=[*extra, "--workspace-idle", "1"], name=name, log_level="info"
    )
    pid = daemon.popen.pid
    out = [rss_mb(pid)]
    try:
        for c in range(CYCLES):
            with BlockingConn(daemon.socket, timeout=120) as conn:
                for w in range(c * PER_CYCLE, (c + 1) * PER_CYCLE):
                    reply = conn.request("list", {"workspace": str(base / f"ws{w}")})
                    assert len(reply["result"]["tools"]) == SETS, reply
            time.sleep(3)  # idle 1 s, checked every 0.5 s: released
            out.append(rss_mb(pid))
    finally:
        daemon.stop()
    released = (base / f"{name}.log").read_text().count("workspaces_released")
    assert released >= CYCLES, f"only {released} releases logged"
    return out


def main() -> None:
    with tempfile.TemporaryDirectory(prefix="tsrss-", dir="/tmp") as tmp:
        base = Path(tmp)
        (base / "home" / "tools").mkdir(parents=True)
        for w in range(WORKSPACES):
            for s in range(SETS):
                d = base / f"ws{w}" / ".crystal" / "tools" / f"big{s}"
                d.mkdir(parents=True)
                (d / "tools.json").write_bytes(big_manifest(w, s))
        size = len(big_manifest(0, 0))
        print(f"{WORKSPACES} workspaces x {SETS} sets of {size / 1e6:.2f} MB manifests")  # noqa: T201
        time.sleep(2.2)  # older than RACY_NS: indexed by their stat signature
        cache = ["--cache-dir", str(base / "cache")]
        runs = [("cold store", cache), ("warm store", cache), ("no cache", ["--no-cache"])]
        only = os.environ.get("ONLY")
        for label, extra in runs:
            if only and only != label:
                continue
            r = run(base, label.replace(" ", ""), extra)
            cycles = "  ".join(f"{mb:6.1f}" for mb in r[1:])
            print(f"{label:10}  RSS start {r[0]:6.1f} MB  after each release: {cycles} MB")  # noqa: T201


if __name__ == "__main__":
    main()
