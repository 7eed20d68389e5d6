"""Catalog benchmark (goals 4 and 5): loading, listing and reloading many tool sets.

``python -m bench.bench_catalog [--quick]``

A temp home holds N small sets (``s00000`` ...), each a ``tools.json`` with one exec tool
and a small schema distinct from every other set's (so the schema-check cache cannot
share verdicts between sets).

* Floors: a plain loop that lists the tools folder and reads every ``tools.json``
  (``read``), and the same plus ``json.loads`` (``read+parse``).
* Cold start: spawn ``python -m toolsetd.daemon`` to its first ``status`` answer with
  1,000 sets vs an empty home, paired (the difference is the catalog's share); in process,
  ``build_catalog`` with a new ``ManifestCache`` vs the read+parse floor, and the same with
  a pre-warmed schema checker (what the cold load costs without schema checks).
* ``list`` of 1,000 tools through the daemon (sequential, median ms, client decode included).
* Reload of unchanged sets and of one changed set, through the ``reload`` RPC and in
  process with ``Registry.reload``, for 1,000 and 10,000 sets, vs the floors.
* Watch latency: with watching on, the time from writing a new set's ``tools.json`` to the
  ``catalogChanged`` notification on a subscribed connection.

The daemon runs with ``--log-level warning`` and ``--no-watch`` except for the watch test.
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    __package__ = "bench"  # noqa: A001

import argparse
import gc
import json
import os
import socket
import time
from typing import Any

import anyio

from bench._common import (
    BlockingConn,
    Goal,
    Section,
    make_home,
    median,
    now_ns,
    paired,
    print_goals,
    print_table,
    ratio_of_pairs,
    sequential_latency,
    set_name,
    small_manifest,
    start_daemon,
    temp_base,
    write_results,
)


# --- floors -------------------------------------------------------------------------------


def read_floor(home: Path) -> int:
    tools = os.path.join(home, "tools")
    t0 = now_ns()
    for name in sorted(os.listdir(tools)):
        with open(os.path.join(tools, name, "tools.json"), "rb") as f:
            f.read()
    return now_ns() - t0


def parse_floor(home: Path) -> int:
    tools = os.path.join(home, "tools")
    loads = json.loads
    t0 = now_ns()
    for name in sorted(os.listdir(tools)):
        with open(os.path.join(tools, name, "tools.json"), "rb") as f:
            loads(f.read())
    return now_ns() - t0


# --- in process ---------------------------------------------------------------------------


def build_cold(home: Path, warm_schemas: Any = None) -> int:
    from toolsetd.daemon.catalog import ManifestCache, build_catalog
    from toolsetd.daemon.model import DEFAULT_RESERVED_NAMES

    cache = ManifestCache(schemas=warm_schemas)
    gc.collect()
    t0 = now_ns()
    catalog = build_catalog(home, None, reserved=DEFAULT_RESERVED_NAMES, cache=cache)
    elapsed = now_ns() - t0
    assert catalog.tools, "no tools loaded"
    return elapsed


#: Seconds after which a written manifest is judged by its stat signature (catalog.RACY_NS).
RACY_SECONDS = 2.1


def warm_checker(home: Path) -> Any:
    from toolsetd.daemon.catalog import ManifestCache, build_catalog
    from toolsetd.daemon.model import DEFAULT_RESERVED_NAMES

    cache = ManifestCache()
    build_catalog(home, None, reserved=DEFAULT_RESERVED_NAMES, cache=cache)
    return cache.schemas


def registry_reloads(home: Path, n_sets: int, repeats: int) -> dict[str, Any]:
    """In process: Registry cold build, then reloads unchanged and with one set changed."""
    from toolsetd.daemon.logs import configure_logging
    from toolsetd.daemon.model import DEFAULT_RESERVED_NAMES
    from toolsetd.daemon.registry import Registry

    configure_logging("json", "warning")
    out: dict[str, Any] = {}
    target = home / "tools" / set_name(n_sets // 2) / "tools.json"

    async def go() -> None:
        registry = Registry(home, DEFAULT_RESERVED_NAMES)
        t0 = now_ns()
        await registry.catalog(None)
        out["cold_build_ms"] = (now_ns() - t0) / 1e6
        unchanged, changed = [], []
        # Operators' manifests are old; ones written within RACY_NS are rescanned on
        # purpose (a same-tick rewrite keeps its stat), so let the generated files age.
        await anyio.sleep(RACY_SECONDS)
        for _ in range(repeats):
            t0 = now_ns()
            outcome = await registry.reload(None)
            unchanged.append(now_ns() - t0)
            assert not outcome.all_changes(), outcome.all_changes()
        for r in range(repeats):
            target.write_bytes(small_manifest(n_sets // 2, variant=r + 1))
            t0 = now_ns()
            outcome = await registry.reload(None)
            changed.append(now_ns() - t0)
            assert len(outcome.all_changes()) == 1, outcome.all_changes()
        target.write_bytes(small_manifest(n_sets // 2))
        await registry.reload(None)
        out["unchanged_ms"] = median(unchanged) / 1e6
        out["one_changed_ms"] = median(changed) / 1e6

    anyio.run(go, backend="asyncio")
    return out


# --- through the daemon -------------------------------------------------------------------


def rpc_reloads(sock: Path, home: Path, n_sets: int, repeats: int) -> dict[str, float]:
    target = home / "tools" / set_name(n_sets // 2 + 1) / "tools.json"
    unchanged, changed = [], []
    with BlockingConn(sock, timeout=300) as conn:
        conn.request("reload")
        time.sleep(RACY_SECONDS)  # as in registry_reloads: judge aged files by their stat
        conn.request("reload")
        for _ in range(repeats):
            t0 = now_ns()
            reply = conn.request("reload")
            unchanged.append(now_ns() - t0)
            assert not reply["result"]["changed"], reply
        for r in range(repeats):
            target.write_bytes(small_manifest(n_sets // 2 + 1, variant=r + 1))
            t0 = now_ns()
            reply = conn.request("reload")
            changed.append(now_ns() - t0)
            assert len(reply["result"]["changed"]) == 1, reply
        target.write_bytes(small_manifest(n_sets // 2 + 1))
        conn.request("reload")
    return {"unchanged_ms": median(unchanged) / 1e6, "one_changed_ms": median(changed) / 1e6}


def watch_latency(home: Path, base: Path, writes: int) -> dict[str, Any]:
    """Write a new set's tools.json; time until catalogChanged names it."""
    daemon = start_daemon(home, base, watch=True, name="w")
    samples: list[int] = []
    try:
        with BlockingConn(daemon.socket, timeout=30) as conn:
            conn.request("list", {"subscribe": True})
            time.sleep(1.0)  # let the watcher start its first generation
            for k in range(writes):
                name = f"new{k:03d}"
                d = home / "tools" / name
                t0 = now_ns()
                d.mkdir()
                (d / "tools.json").write_bytes(small_manifest(900_000 + k))
                while True:
                    msg = conn.receive()
                    if msg.get("method") != "catalogChanged":
                        continue
                    if any(c["set"] == name for c in msg["params"]["changed"]):
                        samples.append(now_ns() - t0)
                        break
                # drain whatever else arrives (settle re-sends are no-ops; nothing expected)
                conn.sock.settimeout(0.7)
                try:
                    while True:
                        conn.receive()
                except (TimeoutError, socket.timeout):
                    pass
                conn.sock.settimeout(30)
    finally:
        daemon.stop()
        for k in range(writes):
            d = home / "tools" / f"new{k:03d}"
            (d / "tools.json").unlink(missing_ok=True)
            if d.exists():
                d.rmdir()
    return {"median_ms": median(samples) / 1e6, "min_ms": min(samples) / 1e6,
            "max_ms": max(samples) / 1e6, "writes": len(samples)}


# --- the run ------------------------------------------------------------------------------


def run(quick: bool = False) -> Section:
    rounds = 3 if quick else 7
    reload_repeats = 5 if quick else 9
    section = Section("catalog")
    data = section.data
    with temp_base() as base:
        empty = base / "empty"
        (empty / "tools").mkdir(parents=True)
        home = make_home(base, 1000)
        # floors, 1,000 files (warm page cache)
        for _ in range(3):
            read_floor(home), parse_floor(home)
        rf, pf = paired(rounds * 3, lambda: read_floor(home), lambda: parse_floor(home))
        floors = {"read_ms": median(rf) / 1e6, "read_parse_ms": median(pf) / 1e6}
        data["floors_1000"] = floors

        # in-process cold build vs the read+parse floor; and without schema checks
        checker = warm_checker(home)
        bc, pf2, bw = paired(rounds, lambda: build_cold(home), lambda: parse_floor(home),
                             lambda: build_cold(home, checker))
        data["build_cold_1000"] = {
            "build_ms": median(bc) / 1e6, "read_parse_ms": median(pf2) / 1e6,
            "ratio_vs_read_parse": ratio_of_pairs(bc, pf2),
            "ratio_vs_read": median(bc) / 1e6 / floors["read_ms"],
            "build_schemas_cached_ms": median(bw) / 1e6,
            "schemas_cached_ratio_vs_read_parse": ratio_of_pairs(bw, pf2),
        }

        # daemon cold start, 1,000 sets vs empty home
        def cold(h: Path) -> float:
            d = start_daemon(h, base, name="c")
            d.stop()
            return d.ready_ns

        cold(empty)
        c1000, c0 = paired(rounds, lambda: cold(home), lambda: cold(empty))
        data["cold_start"] = {
            "sets_1000_ms": median(c1000) / 1e6, "empty_ms": median(c0) / 1e6,
            "catalog_share_ms": (median(c1000) - median(c0)) / 1e6,
        }

        # list of 1,000 tools and reloads through the daemon
        daemon = start_daemon(home, base)
        try:
            with BlockingConn(daemon.socket) as conn:
                reply = conn.request("list")
                n_tools = len(reply["result"]["tools"])
                list_bytes = len(json.dumps(reply))
            lat = sequential_latency(daemon.socket, "list", None, 30 if quick else 100, warmup=5)
            data["list_1000"] = {"tools": n_tools, "median_ms": median(lat) / 1e6, "bytes": list_bytes}
            data["rpc_reload_1000"] = rpc_reloads(daemon.socket, home, 1000, reload_repeats)
        finally:
            daemon.stop()
        data["registry_reload_1000"] = registry_reloads(home, 1000, reload_repeats)

        # watch latency (1,000 sets watched)
        data["watch"] = watch_latency(home, base, 5 if quick else 10)

        # 10,000 sets
        home10 = make_home(base, 10000, name="home10k")
        for _ in range(2):
            read_floor(home10), parse_floor(home10)
        rf10, pf10 = paired(3, lambda: read_floor(home10), lambda: parse_floor(home10))
        data["floors_10000"] = {"read_ms": median(rf10) / 1e6, "read_parse_ms": median(pf10) / 1e6}
        daemon = start_daemon(home10, base, name="d10")
        try:
            data["cold_start"]["sets_10000_ms"] = daemon.ready_ns / 1e6
            data["rpc_reload_10000"] = rpc_reloads(daemon.socket, home10, 10000, 3 if quick else 5)
        finally:
            daemon.stop()
        data["registry_reload_10000"] = registry_reloads(home10, 10000, 3 if quick else 5)

    f1, f10 = data["floors_1000"], data["floors_10000"]
    bc = data["build_cold_1000"]
    cs = data["cold_start"]
    print_table("floors (plain loop over the same files)", ["sets", "read ms", "read+json.loads ms"],
                [[1000, f1["read_ms"], f1["read_parse_ms"]], [10000, f10["read_ms"], f10["read_parse_ms"]]])
    print_table(
        "cold load, 1,000 sets",
        ["what", "ms", "vs read+parse floor"],
        [["build_catalog, new ManifestCache (in process)", bc["build_ms"], bc["ratio_vs_read_parse"]],
         ["build_catalog, schema checks cached", bc["build_schemas_cached_ms"], bc["schemas_cached_ratio_vs_read_parse"]],
         ["daemon spawn -> first status, 1,000 sets", cs["sets_1000_ms"], ""],
         ["daemon spawn -> first status, empty home", cs["empty_ms"], ""],
         ["  catalog's share", cs["catalog_share_ms"], cs["catalog_share_ms"] / f1["read_parse_ms"]],
         ["daemon spawn -> first status, 10,000 sets (1 sample)", cs["sets_10000_ms"], ""]],
    )
    rows = []
    for n, f in ((1000, f1), (10000, f10)):
        for how in ("rpc", "registry"):
            r = data[f"{how}_reload_{n}"]
            rows.append([n, "reload RPC" if how == "rpc" else "Registry.reload", r["unchanged_ms"],
                         r["unchanged_ms"] / f["read_ms"], r["one_changed_ms"], r["one_changed_ms"] / f["read_ms"]])
        rows.append([n, "Registry cold build", data[f"registry_reload_{n}"]["cold_build_ms"],
                     data[f"registry_reload_{n}"]["cold_build_ms"] / f["read_ms"], "", ""])
    print_table("reload", ["sets", "path", "unchanged ms", "/read floor", "one changed ms", "/read floor"], rows)
    print_table("list and watch", ["what", "ms"],
                [[f"list of {data['list_1000']['tools']} tools ({data['list_1000']['bytes']:,} bytes), median",
                  data["list_1000"]["median_ms"]],
                 ["file write -> catalogChanged, median", data["watch"]["median_ms"]],
                 ["file write -> catalogChanged, max", data["watch"]["max_ms"]]])

    r1, r10 = data["registry_reload_1000"], data["registry_reload_10000"]
    section.goals = [
        Goal("5", "cold load 1,000 sets / read+parse floor", bc["ratio_vs_read_parse"], 1.5, "<=",
             f"{bc['build_ms']:.0f} vs {bc['read_parse_ms']:.1f} ms"),
        Goal("5", "cold load 1,000 sets / read floor", bc["ratio_vs_read"], 1.5, "<=",
             f"{bc['build_ms']:.0f} vs {f1['read_ms']:.1f} ms"),
        Goal("5", "unchanged reload 1,000 / read floor", r1["unchanged_ms"] / f1["read_ms"], 0.5, "<=",
             f"{r1['unchanged_ms']:.1f} vs {f1['read_ms']:.1f} ms (Registry.reload)"),
        Goal("5", "unchanged reload 10,000 / read floor", r10["unchanged_ms"] / f10["read_ms"], 0.5, "<=",
             f"{r10['unchanged_ms']:.0f} vs {f10['read_ms']:.0f} ms (Registry.reload)"),
        Goal("5", "one-set reload 10,000 / read floor", r10["one_changed_ms"] / f10["read_ms"], 0.5, "<=",
             f"{r10['one_changed_ms']:.0f} vs {f10['read_ms']:.0f} ms (Registry.reload)"),
    ]
    return section


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    t0 = time.monotonic()
    section = run(args.quick)
    print_goals(section.goals)
    path = write_results("catalog", {"quick": args.quick, "goals": section.goals, **section.data,
                                     "seconds": time.monotonic() - t0})
    print(f"\nresults: {path}")


if __name__ == "__main__":
    main()
