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
  process with ``Registry.reload``, for 1,000 and 10,000 sets, vs the floors; and the
  floor of the one-set row: listing the tools folder and a ``stat`` of every manifest
  (what a reload that is not told what changed has to do) against the same full loads.
* Watch latency: with watching on, the time from writing a new set's ``tools.json`` to the
  ``catalogChanged`` notification on a subscribed connection.

The daemon runs with ``--log-level warning`` and ``--no-watch`` except for the watch test.
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    __package__ = "bench"

import gc
import json
import os
import time
from typing import Any

import anyio

from bench._common import (
    MIN_ROUNDS,
    BlockingConn,
    Goal,
    Section,
    make_home,
    median,
    now_ns,
    paired,
    print_table,
    ratio_of_pairs,
    ratios,
    sequential_latency,
    set_name,
    small_manifest,
    standalone,
    start_daemon,
    temp_base,
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


def stat_floor(home: Path) -> int:
    """List the tools folder and ``stat`` every ``tools.json`` relative to it: what any
    reload that finds changes without being told of them has to do."""
    fd = os.open(os.path.join(home, "tools"), os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        t0 = now_ns()
        for name in os.listdir(fd):
            os.stat(name + "/tools.json", dir_fd=fd)
        return now_ns() - t0
    finally:
        os.close(fd)


# --- in process ---------------------------------------------------------------------------


def build_cold(home: Path, warm_schemas: Any = None, store: Path | None = None) -> int:
    """One cold ``build_catalog``: a new ManifestCache (and a new SetStore over ``store``).

    With ``store`` the time includes opening the store (reading and checking its file):
    what a restarted daemon pays.
    """
    from toolsetd.daemon.catalog import ManifestCache, build_catalog
    from toolsetd.daemon.model import DEFAULT_RESERVED_NAMES
    from toolsetd.daemon.setcache import SetStore

    gc.collect()
    t0 = now_ns()
    cache = ManifestCache(schemas=warm_schemas, store=SetStore(store) if store else None)
    catalog = build_catalog(home, None, reserved=DEFAULT_RESERVED_NAMES, cache=cache)
    elapsed = now_ns() - t0
    assert catalog.tools, "no tools loaded"
    if store is not None:
        assert cache.parses == 0, f"{cache.parses} sets parsed with a warm store"
    return elapsed


#: Seconds after which a written manifest is judged by its stat signature (catalog.RACY_NS).
RACY_SECONDS = 2.1


def warm_store(home: Path, folder: Path) -> None:
    """Fill a set store for ``home``: what every start after the first one finds."""
    from toolsetd.daemon.catalog import ManifestCache, build_catalog
    from toolsetd.daemon.model import DEFAULT_RESERVED_NAMES
    from toolsetd.daemon.setcache import SetStore

    cache = ManifestCache(store=SetStore(folder))
    build_catalog(home, None, reserved=DEFAULT_RESERVED_NAMES, cache=cache)
    cache.flush()


def warm_checker(home: Path) -> Any:
    from toolsetd.daemon.catalog import ManifestCache, build_catalog
    from toolsetd.daemon.model import DEFAULT_RESERVED_NAMES

    cache = ManifestCache()
    build_catalog(home, None, reserved=DEFAULT_RESERVED_NAMES, cache=cache)
    return cache.schemas


def registry_reloads(home: Path, n_sets: int, rounds: int, folder: Path) -> dict[str, Any]:
    """In process, paired rounds: read floor, unchanged reload, one-set reload, full load.

    The registry uses a set store in ``folder`` as the daemon does; the full load is a
    cold ``build_catalog`` through a new cache and a new store over the same folder (a
    restart), and the read floor reads the same files. The one-set reload is measured
    twice: told nothing (the ``reload`` RPC, ``SIGHUP``: a ``stat`` of every set) and told
    which set changed, as the watcher tells it when it saw the manifest's folder change.
    """
    from toolsetd.daemon.catalog import ManifestCache
    from toolsetd.daemon.logs import configure_logging
    from toolsetd.daemon.model import DEFAULT_RESERVED_NAMES
    from toolsetd.daemon.registry import Registry
    from toolsetd.daemon.setcache import SetStore

    configure_logging("json", "warning")
    out: dict[str, Any] = {}
    target = home / "tools" / set_name(n_sets // 2) / "tools.json"

    async def go() -> None:
        registry = Registry(home, DEFAULT_RESERVED_NAMES, ManifestCache(store=SetStore(folder)))
        t0 = now_ns()
        await registry.catalog(None)
        out["cold_build_ms"] = (now_ns() - t0) / 1e6
        # Operators' manifests are old; ones written within RACY_NS are rescanned on
        # purpose (a same-tick rewrite keeps its stat), so let the generated files age.
        await anyio.sleep(RACY_SECONDS)
        await registry.reload(None)
        warm_store(home, folder)
        floor, stats, unchanged, changed, told, full = [], [], [], [], [], []
        # What the watcher sends for a write to the target's manifest (the home key).
        reported: dict[Path | None, frozenset[tuple[str, str]] | None] = {
            None: frozenset({(str(home / "tools"), set_name(n_sets // 2))})
        }
        for r in range(rounds):
            floor.append(read_floor(home))
            stats.append(stat_floor(home))
            t0 = now_ns()
            outcome = await registry.reload(None)
            unchanged.append(now_ns() - t0)
            assert not outcome.all_changes(), outcome.all_changes()
            target.write_bytes(small_manifest(n_sets // 2, variant=r + 1))
            t0 = now_ns()
            outcome = await registry.reload(None)
            changed.append(now_ns() - t0)
            assert len(outcome.all_changes()) == 1, outcome.all_changes()
            target.write_bytes(small_manifest(n_sets // 2, variant=rounds + r + 1))
            t0 = now_ns()
            outcome = await registry.reload(None, reported)
            told.append(now_ns() - t0)
            assert len(outcome.all_changes()) == 1, outcome.all_changes()
            full.append(build_cold(home, store=folder))
        target.write_bytes(small_manifest(n_sets // 2))
        await registry.reload(None)
        out.update(
            read_ms=median(floor) / 1e6,
            unchanged_ms=median(unchanged) / 1e6,
            one_changed_ms=median(changed) / 1e6,
            full_load_ms=median(full) / 1e6,
            unchanged_vs_read=ratios(unchanged, floor),
            changed_vs_read=ratios(changed, floor),
            changed_vs_full=ratios(changed, full),
            told_ms=median(told) / 1e6,
            told_vs_full=ratios(told, full),
            stat_ms=median(stats) / 1e6,
            stat_vs_full=ratios(stats, full),
        )

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
        for r in range(repeats):
            t0 = now_ns()
            reply = conn.request("reload")
            unchanged.append(now_ns() - t0)
            assert not reply["result"]["changed"], reply
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
                except TimeoutError:
                    pass
                conn.sock.settimeout(30)
    finally:
        daemon.stop()
        for k in range(writes):
            d = home / "tools" / f"new{k:03d}"
            (d / "tools.json").unlink(missing_ok=True)
            if d.exists():
                d.rmdir()
    return {
        "median_ms": median(samples) / 1e6,
        "min_ms": min(samples) / 1e6,
        "max_ms": max(samples) / 1e6,
        "writes": len(samples),
    }


# --- the run ------------------------------------------------------------------------------


def run(quick: bool = False) -> Section:
    rounds = MIN_ROUNDS if quick else 7
    section = Section("catalog")
    data = section.data
    with temp_base() as base:
        empty = base / "empty"
        (empty / "tools").mkdir(parents=True)
        home = make_home(base, 1000)
        store = base / "store1k"
        time.sleep(RACY_SECONDS)  # operators' manifests are old (see RACY_SECONDS)
        warm_store(home, store)
        warm_store(home, store)  # the second start indexes the now-old files by their stat
        # floors, 1,000 files (warm page cache)
        for _ in range(3):
            read_floor(home), parse_floor(home)
        rf, pf = paired(rounds * 3, lambda: read_floor(home), lambda: parse_floor(home))
        floors = {"read_ms": median(rf) / 1e6, "read_parse_ms": median(pf) / 1e6}
        data["floors_1000"] = floors

        # in-process cold build vs the floors: a restart (warm set store), a first start
        # (no store, every set parsed), and a first start with the schema checks cached
        checker = warm_checker(home)
        bs, pf2, rf2, bc, bw = paired(
            rounds,
            lambda: build_cold(home, store=store),
            lambda: parse_floor(home),
            lambda: read_floor(home),
            lambda: build_cold(home),
            lambda: build_cold(home, checker),
        )
        data["build_cold_1000"] = {
            "store_ms": median(bs) / 1e6,
            "read_parse_ms": median(pf2) / 1e6,
            "read_ms": median(rf2) / 1e6,
            "store_vs_read_parse": ratios(bs, pf2),
            "store_vs_read": ratios(bs, rf2),
            "build_ms": median(bc) / 1e6,
            "ratio_vs_read_parse": ratio_of_pairs(bc, pf2),
            "build_schemas_cached_ms": median(bw) / 1e6,
            "schemas_cached_ratio_vs_read_parse": ratio_of_pairs(bw, pf2),
        }

        # daemon cold start, 1,000 sets vs empty home (its set cache warm after the first)
        def cold(h: Path) -> float:
            d = start_daemon(h, base, name="c")
            d.stop()
            return d.ready_ns

        cold(empty), cold(home)
        c1000, c0 = paired(rounds, lambda: cold(home), lambda: cold(empty))
        data["cold_start"] = {
            "sets_1000_ms": median(c1000) / 1e6,
            "empty_ms": median(c0) / 1e6,
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
            data["list_1000"] = {
                "tools": n_tools,
                "median_ms": median(lat) / 1e6,
                "bytes": list_bytes,
            }
            data["rpc_reload_1000"] = rpc_reloads(daemon.socket, home, 1000, rounds)
        finally:
            daemon.stop()
        data["registry_reload_1000"] = registry_reloads(home, 1000, rounds, store)

        # watch latency (1,000 sets watched)
        data["watch"] = watch_latency(home, base, 5 if quick else 10)

        # 10,000 sets
        home10 = make_home(base, 10000, name="home10k")
        store10 = base / "store10k"
        time.sleep(RACY_SECONDS)
        warm_store(home10, store10)
        warm_store(home10, store10)
        for _ in range(2):
            read_floor(home10), parse_floor(home10)
        rf10, pf10 = paired(MIN_ROUNDS, lambda: read_floor(home10), lambda: parse_floor(home10))
        data["floors_10000"] = {"read_ms": median(rf10) / 1e6, "read_parse_ms": median(pf10) / 1e6}
        daemon = start_daemon(home10, base, name="d10")
        try:
            data["cold_start"]["sets_10000_ms"] = daemon.ready_ns / 1e6
            data["rpc_reload_10000"] = rpc_reloads(daemon.socket, home10, 10000, MIN_ROUNDS)
        finally:
            daemon.stop()
        data["registry_reload_10000"] = registry_reloads(home10, 10000, MIN_ROUNDS, store10)

    f1, f10 = data["floors_1000"], data["floors_10000"]
    bc = data["build_cold_1000"]
    cs = data["cold_start"]
    print_table(
        "floors (plain loop over the same files)",
        ["sets", "read ms", "read+json.loads ms"],
        [[1000, f1["read_ms"], f1["read_parse_ms"]], [10000, f10["read_ms"], f10["read_parse_ms"]]],
    )
    print_table(
        "cold load, 1,000 sets",
        ["what", "ms", "vs read+parse floor"],
        [
            [
                "build_catalog, restart (warm set store, in process)",
                bc["store_ms"],
                median(bc["store_vs_read_parse"]),
            ],
            [
                "build_catalog, first start (no store: every set parsed)",
                bc["build_ms"],
                bc["ratio_vs_read_parse"],
            ],
            [
                "build_catalog, no store, schema checks cached",
                bc["build_schemas_cached_ms"],
                bc["schemas_cached_ratio_vs_read_parse"],
            ],
            ["daemon spawn -> first status, 1,000 sets", cs["sets_1000_ms"], ""],
            ["daemon spawn -> first status, empty home", cs["empty_ms"], ""],
            [
                "  catalog's share",
                cs["catalog_share_ms"],
                cs["catalog_share_ms"] / f1["read_parse_ms"],
            ],
            ["daemon spawn -> first status, 10,000 sets (1 sample)", cs["sets_10000_ms"], ""],
        ],
    )
    rows = []
    for n in (1000, 10000):
        r, rpc = data[f"registry_reload_{n}"], data[f"rpc_reload_{n}"]
        rows.append(
            [
                n,
                "Registry.reload",
                r["unchanged_ms"],
                median(r["unchanged_vs_read"]),
                r["one_changed_ms"],
                median(r["changed_vs_read"]),
                median(r["changed_vs_full"]),
            ]
        )
        rows.append(
            [
                n,
                "Registry.reload, told the set (watcher)",
                "",
                "",
                r["told_ms"],
                "",
                median(r["told_vs_full"]),
            ]
        )
        rows.append([n, "reload RPC", rpc["unchanged_ms"], "", rpc["one_changed_ms"], "", ""])
        rows.append([n, "full load (restart, warm store)", r["full_load_ms"], "", "", "", ""])
        rows.append(
            [n, "  floor: stat every set", r["stat_ms"], "", "", "", median(r["stat_vs_full"])]
        )
    print_table(
        "reload",
        [
            "sets",
            "path",
            "unchanged ms",
            "/read floor",
            "one changed ms",
            "/read floor",
            "/full load",
        ],
        rows,
    )
    print_table(
        "list and watch",
        ["what", "ms"],
        [
            [
                f"list of {data['list_1000']['tools']} tools "
                f"({data['list_1000']['bytes']:,} bytes), median",
                data["list_1000"]["median_ms"],
            ],
            ["file write -> catalogChanged, median", data["watch"]["median_ms"]],
            ["file write -> catalogChanged, max", data["watch"]["max_ms"]],
        ],
    )

    r1, r10 = data["registry_reload_1000"], data["registry_reload_10000"]
    section.goals = [
        Goal.of(
            "5",
            "cold load 1,000 sets / read+parse floor",
            bc["store_vs_read_parse"],
            1.5,
            "<=",
            f"{bc['store_ms']:.0f} vs {bc['read_parse_ms']:.1f} ms (restart; first start "
            f"{bc['build_ms']:.0f} ms)",
        ),
        Goal.of(
            "5",
            "cold load 1,000 sets / read floor",
            bc["store_vs_read"],
            1.5,
            "<=",
            f"{bc['store_ms']:.0f} vs {bc['read_ms']:.1f} ms",
        ),
        Goal.of(
            "5",
            "unchanged reload 1,000 / read floor",
            r1["unchanged_vs_read"],
            0.5,
            "<=",
            f"{r1['unchanged_ms']:.1f} vs {r1['read_ms']:.1f} ms (Registry.reload)",
        ),
        Goal.of(
            "5",
            "unchanged reload 10,000 / read floor",
            r10["unchanged_vs_read"],
            0.5,
            "<=",
            f"{r10['unchanged_ms']:.0f} vs {r10['read_ms']:.0f} ms (Registry.reload)",
        ),
        Goal.of(
            "5",
            "one-set reload 10,000 / read floor",
            r10["changed_vs_read"],
            0.5,
            "<=",
            f"{r10['one_changed_ms']:.0f} vs {r10['read_ms']:.0f} ms (Registry.reload)",
        ),
        Goal.of(
            "5",
            "one-set reload 10,000 / full load",
            r10["changed_vs_full"],
            0.05,
            "<=",
            f"{r10['one_changed_ms']:.0f} vs {r10['full_load_ms']:.0f} ms (restart, warm store; "
            f"floor {median(r10['stat_vs_full']):.3f}: a stat of every set, "
            f"{r10['stat_ms']:.0f} ms)",
        ),
        Goal.of(
            "5",
            "one-set reload 10,000, told the set / full load",
            r10["told_vs_full"],
            0.05,
            "<=",
            f"{r10['told_ms']:.1f} vs {r10['full_load_ms']:.0f} ms (the watcher's reload)",
        ),
    ]
    return section


def main() -> None:
    """``python -m bench.bench_catalog [--quick]``."""
    standalone("catalog", run, __doc__)


if __name__ == "__main__":
    main()
