"""One side of ``bench.ab_reload``: a ``Registry`` over a home, timing reloads on request.

``PYTHON bench/_reload_worker.py HOME STORE``, where ``PYTHON`` is the interpreter of the
checkout under test (its ``toolsetd`` is the one imported). It builds the home catalog,
prints ``ready``, then answers each line on stdin with the nanoseconds one reload took and
how many sets it reported changed: ``u`` (a reload told nothing) or ``t NAME`` (told that
set changed, as the watcher tells it). Only the reload is timed, in this process.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path


def main() -> None:
    import anyio
    from toolsetd.daemon.catalog import ManifestCache
    from toolsetd.daemon.logs import configure_logging
    from toolsetd.daemon.model import DEFAULT_RESERVED_NAMES
    from toolsetd.daemon.registry import Registry, Reported
    from toolsetd.daemon.setcache import SetStore

    home, store = Path(sys.argv[1]), Path(sys.argv[2])
    configure_logging("json", "warning")

    async def serve() -> None:
        registry = Registry(home, DEFAULT_RESERVED_NAMES, ManifestCache(store=SetStore(store)))
        await registry.catalog(None)
        await registry.reload(None)
        print("ready", flush=True)
        tools = str(home / "tools")
        for line in sys.stdin:
            words = line.split()
            reported: Reported | None = None
            if words[0] == "t":
                reported = {None: frozenset({(tools, words[1])})}
            t0 = time.perf_counter_ns()
            outcome = await registry.reload(None, reported)
            elapsed = time.perf_counter_ns() - t0
            print(elapsed, len(outcome.all_changes()), flush=True)

    anyio.run(serve, backend="asyncio")


if __name__ == "__main__":
    main()
