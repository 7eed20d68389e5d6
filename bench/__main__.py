"""Run every benchmark and print the goals table (``make bench`` / ``python -m bench``).

``python -m bench [--quick] [--only rpc,invoke,catalog,mcp,drain,cli] [--skip ...]``

Each benchmark measures toolsetd and its baseline in the same run, interleaved; the table
gives every goal of ``docs/benchmarks.md`` (section Goals) as a
measured ratio against its target. ``--quick`` shortens every run (a few minutes in all;
the numbers are noisier). Results go to ``bench/results/`` (gitignored).
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import time
from typing import Any

from bench import (
    bench_catalog,
    bench_cli,
    bench_confine,
    bench_invoke,
    bench_mcp,
    bench_mcp_face,
    bench_mcp_http,
    bench_rpc,
)
from bench._common import PYTHON, REPO, Goal, Section, machine, print_goals, write_results

ALL = ("rpc", "invoke", "drain", "catalog", "mcp", "mcp_face", "mcp_http", "cli", "confine")
_DRAIN_LINE = re.compile(
    r"(one stream|both streams)\s*: C\s+([\d.]+) GB/s\s+runner\s+([\d.]+) GB/s\s+ratio\s+([\d.]+)\s+"
    r"peak RSS growth\s+([\d.]+) MiB"
)


def run_drain(quick: bool) -> Section:
    """Goal 2 through ``bench/bench_drain.py`` (C reader vs Runner, same run)."""
    size, repeat = ("256", "3") if quick else ("1024", "3")
    out = subprocess.run(
        [PYTHON, str(REPO / "bench" / "bench_drain.py"), "--size-mib", size, "--repeat", repeat],
        capture_output=True, text=True, cwd=REPO, check=False,
    )
    print(out.stdout, end="")
    if out.returncode != 0:
        raise RuntimeError(f"bench_drain failed:\n{out.stderr[-4000:]}")
    rows = {m.group(1): m for m in _DRAIN_LINE.finditer(out.stdout)}
    one, both = rows["one stream"], rows["both streams"]
    growth = max(float(one.group(5)), float(both.group(5)))
    section = Section("drain", data={
        "size_mib": int(size), "one_stream": {"c_gbs": float(one.group(2)), "runner_gbs": float(one.group(3)),
                                              "ratio": float(one.group(4)), "rss_growth_mib": float(one.group(5))},
        "both_streams": {"c_gbs": float(both.group(2)), "runner_gbs": float(both.group(3)),
                         "ratio": float(both.group(4)), "rss_growth_mib": float(both.group(5))},
    })
    section.goals = [
        Goal("2", "drain one stream / C floor", float(one.group(4)), 0.5, ">=",
             f"{one.group(3)} vs {one.group(2)} GB/s, {size} MiB"),
        Goal("2", "drain both streams / C floor", float(both.group(4)), 0.85, ">=",
             f"{both.group(3)} vs {both.group(2)} GB/s"),
        Goal("2", "daemon memory growth in flood (MiB, absolute)", growth, 8, "<=", "peak RSS growth"),
    ]
    return section


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="short runs (a few minutes in all)")
    parser.add_argument("--only", default="", help=f"comma-separated subset of {','.join(ALL)}")
    parser.add_argument("--skip", default="", help="comma-separated benchmarks to skip")
    args = parser.parse_args()
    chosen = [b for b in (args.only.split(",") if args.only else ALL) if b and b not in args.skip.split(",")]
    unknown = set(chosen) - set(ALL)
    if unknown:
        parser.error(f"unknown benchmark(s): {', '.join(sorted(unknown))}")
    runners: dict[str, Any] = {
        "rpc": bench_rpc.run, "invoke": bench_invoke.run, "drain": run_drain,
        "catalog": bench_catalog.run, "mcp": bench_mcp.run, "mcp_face": bench_mcp_face.run,
        "cli": bench_cli.run,
    bench_confine,
    bench_invoke,
    bench_mcp,
    bench_mcp_face,
    bench_mcp_http,
    }
    info = machine()
    print(f"toolsetd benchmarks ({'quick' if args.quick else 'full'}): {info['date']}, "
          f"nproc {info['nproc']}, Python {info['python']}, load {info['loadavg']}")
    t_all = time.monotonic()
    goals: list[Goal] = []
    sections: dict[str, Any] = {}
    timings: dict[str, float] = {}
    for name in chosen:
        print(f"\n=== {name} ===")
        sys.stdout.flush()
        t0 = time.monotonic()
        try:
            section = runners[name](args.quick)
        except Exception as exc:  # noqa: BLE001 - one failing benchmark must not hide the rest
            print(f"{name}: FAILED: {type(exc).__name__}: {exc}")
            sections[name] = {"error": f"{type(exc).__name__}: {exc}"}
            continue
        finally:
            timings[name] = round(time.monotonic() - t0, 1)
        if section is None:
            sections[name] = {"skipped": True}
            continue
        goals.extend(section.goals)
        sections[name] = {"goals": section.goals, **section.data}
        write_results(name, {"quick": args.quick, **sections[name], "seconds": timings[name]})
    total = time.monotonic() - t_all
    print(f"\n=== summary ({'quick' if args.quick else 'full'} run, {total:.0f} s; "
          f"load at end {machine()['loadavg']}) ===")
    goals.sort(key=lambda g: g.goal)
    print_goals(goals)
    passed = sum(g.passed for g in goals)
    print(f"\n{passed}/{len(goals)} goals met. Seconds per benchmark: {timings}")
    path = write_results("all", {"quick": args.quick, "seconds": total, "timings": timings,
                                 "start_machine": info, "goals": goals, "sections": sections})
    print(f"results: {path}")


if __name__ == "__main__":
    main()
