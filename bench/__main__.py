"""Run every benchmark and print the goals table (``make bench`` / ``python -m bench``).

``python -m bench [--quick] [--repeat N] [--only NAME,...] [--skip NAME,...]``, the names
being ``ALL``'s: rpc, invoke, drain, catalog, mcp, mcp_face, mcp_http, cli, confine.

Each benchmark measures toolsetd and its baseline in the same run, interleaved round by
round (the goals are in ``docs/benchmarks.md``, section Goals); every goal row is the
median of at least five paired rounds, printed with the spread (lowest and highest round)
and the number of rounds. ``--repeat N`` runs the whole
table N times and ends with each goal's **worst** run (the verdict is that run's), with
the load average at the start and end of every run. ``--quick`` shortens every run (the
numbers are noisier). Results go to ``bench/results/`` (gitignored).
"""

from __future__ import annotations

import argparse
import json
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
from bench._common import (
    MIN_ROUNDS,
    PYTHON,
    REPO,
    Goal,
    Section,
    load,
    machine,
    print_goals,
    print_table,
    stop_cleanly_on_sigterm,
    write_results,
)

ALL = ("rpc", "invoke", "drain", "catalog", "mcp", "mcp_face", "mcp_http", "cli", "confine")
_DRAIN_LINE = re.compile(
    r"(one stream|both streams)\s*: C\s+([\d.]+) GB/s\s+runner\s+([\d.]+) GB/s\s+"
    r"ratio\s+([\d.]+)\s+"
    r"peak RSS growth\s+([\d.]+) MiB"
)


def run_drain(quick: bool) -> Section:
    """Goal 2 through ``bench/bench_drain.py`` (C reader vs Runner, same run)."""
    size, repeat = ("256", str(MIN_ROUNDS)) if quick else ("1024", str(MIN_ROUNDS))
    out = subprocess.run(
        [PYTHON, str(REPO / "bench" / "bench_drain.py"), "--size-mib", size, "--repeat", repeat],
        capture_output=True,
        text=True,
        cwd=REPO,
        check=False,
    )
    print(out.stdout, end="")
    if out.returncode != 0:
        raise RuntimeError(f"bench_drain failed:\n{out.stderr[-4000:]}")
    rows = {m.group(1): m for m in _DRAIN_LINE.finditer(out.stdout)}
    per_round = json.loads(
        next(
            line[len("ROUNDS ") :] for line in out.stdout.splitlines() if line.startswith("ROUNDS ")
        )
    )
    one, both = rows["one stream"], rows["both streams"]
    growth = max(float(one.group(5)), float(both.group(5)))
    section = Section(
        "drain",
        data={
            "size_mib": int(size),
            "one_stream": {
                "c_gbs": float(one.group(2)),
                "runner_gbs": float(one.group(3)),
                "ratio": float(one.group(4)),
                "rss_growth_mib": float(one.group(5)),
            },
            "both_streams": {
                "c_gbs": float(both.group(2)),
                "runner_gbs": float(both.group(3)),
                "ratio": float(both.group(4)),
                "rss_growth_mib": float(both.group(5)),
            },
        },
    )
    section.data["rounds"] = per_round
    section.goals = [
        Goal.of(
            "2",
            "drain one stream / C floor",
            per_round["one"],
            0.5,
            ">=",
            f"{one.group(3)} vs {one.group(2)} GB/s, {size} MiB",
        ),
        Goal.of(
            "2",
            "drain both streams / C floor",
            per_round["both"],
            0.85,
            ">=",
            f"{both.group(3)} vs {both.group(2)} GB/s",
        ),
        Goal.of(
            "2",
            "daemon memory growth in flood (MiB, absolute)",
            [
                max(a, b)
                for a, b in zip(
                    per_round["one_growth_mib"], per_round["both_growth_mib"], strict=True
                )
            ],
            8,
            "<=",
            f"peak RSS growth, worst {growth:.1f} MiB",
        ),
    ]
    return section


RUNNERS: dict[str, Any] = {
    "rpc": bench_rpc.run,
    "invoke": bench_invoke.run,
    "drain": run_drain,
    "catalog": bench_catalog.run,
    "mcp": bench_mcp.run,
    "cli": bench_cli.run,
    "mcp_face": bench_mcp_face.run,
    "mcp_http": bench_mcp_http.run,
    "confine": bench_confine.run,
}


def run_once(chosen: list[str], quick: bool, label: str) -> tuple[list[Goal], dict[str, Any]]:
    """One whole run of the chosen benchmarks; its goals table and what it measured."""
    start_load = load()
    print(f"\n##### {label}: load at start {start_load} #####")
    t_all = time.monotonic()
    goals: list[Goal] = []
    sections: dict[str, Any] = {}
    timings: dict[str, float] = {}
    for name in chosen:
        print(f"\n=== {name} (load {load()}) ===")
        sys.stdout.flush()
        t0 = time.monotonic()
        try:
            section = RUNNERS[name](quick)
        except Exception as exc:
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
        write_results(name, {"quick": quick, **sections[name], "seconds": timings[name]})
    total = time.monotonic() - t_all
    end_load = load()
    goals.sort(key=lambda g: g.goal)
    print_goals(
        goals,
        f"goals, {label} ({'quick' if quick else 'full'}, {total:.0f} s; "
        f"load {start_load} at start, {end_load} at end)",
    )
    passed = sum(g.passed for g in goals)
    print(f"\n{passed}/{len(goals)} goals met. Seconds per benchmark: {timings}")
    return goals, {
        "seconds": total,
        "timings": timings,
        "load_start": start_load,
        "load_end": end_load,
        "goals": goals,
        "sections": sections,
    }


def worst_of(runs: list[list[Goal]]) -> list[tuple[Goal, list[Goal]]]:
    """For each goal row (by goal and name), its worst run and every run's row."""
    by_key: dict[tuple[str, str], list[Goal]] = {}
    for goals in runs:
        for g in goals:
            by_key.setdefault((g.goal, g.name), []).append(g)
    out = []
    for rows in by_key.values():
        worst = rows[0]
        for g in rows[1:]:
            if g.worse(worst):
                worst = g
        out.append((worst, rows))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="short runs (noisier)")
    parser.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="run the whole table N times and report each goal's worst run",
    )
    parser.add_argument("--only", default="", help=f"comma-separated subset of {','.join(ALL)}")
    parser.add_argument("--skip", default="", help="comma-separated benchmarks to skip")
    args = parser.parse_args()
    chosen = [
        b
        for b in (args.only.split(",") if args.only else ALL)
        if b and b not in args.skip.split(",")
    ]
    unknown = set(chosen) - set(ALL)
    if unknown:
        parser.error(f"unknown benchmark(s): {', '.join(sorted(unknown))}")
    if args.repeat < 1:
        parser.error("--repeat must be at least 1")
    stop_cleanly_on_sigterm()
    info = machine()
    print(
        f"toolsetd benchmarks ({'quick' if args.quick else 'full'}, {args.repeat} run(s), "
        f"at least {MIN_ROUNDS} paired rounds per goal): {info['date']}, nproc {info['nproc']}, "
        f"Python {info['python']}, load {load()}"
    )
    t_all = time.monotonic()
    runs: list[list[Goal]] = []
    details: list[dict[str, Any]] = []
    for k in range(args.repeat):
        goals, detail = run_once(chosen, args.quick, f"run {k + 1} of {args.repeat}")
        runs.append(goals)
        details.append(detail)
    total = time.monotonic() - t_all
    loads = "; ".join(
        f"run {i + 1}: {d['load_start']} -> {d['load_end']}" for i, d in enumerate(details)
    )
    final: list[Goal] = []
    if args.repeat > 1:
        rows = []
        for worst, all_rows in sorted(worst_of(runs), key=lambda item: item[0].goal):
            final.append(worst)
            lo, hi = worst.spread
            rows.append(
                [
                    worst.goal,
                    worst.name,
                    f"{worst.ratio:.3f}",
                    " / ".join(f"{g.ratio:.3f}" for g in all_rows),
                    f"{lo:.3f}-{hi:.3f}",
                    str(worst.rounds),
                    f"{worst.op} {worst.target:g}",
                    "PASS" if worst.passed else "MISS",
                ]
            )
        print_table(
            f"worst of {args.repeat} runs ({total:.0f} s; load {loads})",
            [
                "goal",
                "what",
                "worst",
                "every run",
                "worst run's spread",
                "rounds",
                "target",
                "verdict",
            ],
            rows,
        )
        passed = sum(g.passed for g in final)
        print(f"\n{passed}/{len(final)} goals met in their worst run.")
    else:
        final = runs[0]
    path = write_results(
        "all",
        {
            "quick": args.quick,
            "repeat": args.repeat,
            "seconds": total,
            "start_machine": info,
            "worst": final,
            "runs": details,
        },
    )
    print(f"results: {path}")


if __name__ == "__main__":
    main()
