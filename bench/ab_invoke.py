"""Invoke latency of this tree against another checkout's daemon, paired, beside the floor.

``python -m bench.ab_invoke --against DIR [--rounds 15] [--calls 300]``

``DIR`` is another checkout of toolsetd with its own venv (``DIR/.venv/bin/python``), for
example the code before a change::

    git worktree add /tmp/before HEAD~1 && make -C /tmp/before .venv/.installed

Three servers run side by side on one home with the trivial set (``noop``: ``/bin/true``):
this tree's daemon, ``DIR``'s daemon (both unconfined, ``--log-level warning``, as the
invoke benchmark runs them) and the minimal spawn server. Each round measures the median
latency of ``--calls`` sequential invokes on each, in an order that alternates every round.
Printed: each server's median over the rounds, and the per-round ratios this / other,
this / floor and other / floor (median and range). The issue-16 pass that added it used it
to tell a change of a few per cent from the noise that moves whole runs by more.
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    __package__ = "bench"

import argparse

from bench._common import (
    PYTHON,
    Proc,
    daemon_argv,
    load,
    median,
    paired,
    print_table,
    ratios,
    sequential_latency,
    spawn_server,
    start_baseline,
    temp_base,
)
from bench.bench_invoke import DAEMON_ARGS, trivial_call


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--against", required=True, type=Path, help="a checkout with .venv")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--calls", type=int, default=300)
    args = parser.parse_args()
    other_python = args.against / ".venv" / "bin" / "python"
    if not other_python.exists():
        parser.error(f"{other_python} does not exist: run make .venv/.installed in {args.against}")
    print(f"load at start: {load()}")
    with temp_base() as base:
        home, params = trivial_call(base)
        servers: list[Proc] = []
        try:
            for name, python in (("this", PYTHON), ("other", str(other_python))):
                sock = base / f"{name}.sock"
                argv = daemon_argv(home, sock, extra=DAEMON_ARGS)
                argv[0] = python
                servers.append(spawn_server(argv, sock, base / f"{name}.log"))
            servers.append(start_baseline("spawn", base, name="floor"))
            for server in servers:  # warm up: the set's catalog, the code paths, the caches
                sequential_latency(server.socket, "invoke", params, 100, warmup=20)

            def measure(server: Proc) -> float:
                samples = sequential_latency(server.socket, "invoke", params, args.calls, 10)
                return median(samples) / 1000

            this, other, floor = paired(args.rounds, *(lambda s=s: measure(s) for s in servers))
        finally:
            for server in servers:
                server.stop()
    print_table(
        f"invoke latency, {args.rounds} rounds of {args.calls} calls (µs, medians)",
        ["server", "median", "rounds"],
        [
            [name, median(series), " ".join(f"{x:.0f}" for x in series)]
            for name, series in (("this tree", this), (str(args.against), other), ("floor", floor))
        ],
    )
    rows = []
    for what, a, b in (
        ("this / other", this, other),
        ("this / floor", this, floor),
        ("other / floor", other, floor),
    ):
        per_round = ratios(a, b)
        rows.append([what, median(per_round), f"{min(per_round):.3f}-{max(per_round):.3f}"])
    print_table("paired ratios (per round)", ["ratio", "median", "range"], rows)
    print(f"load at end: {load()}")


if __name__ == "__main__":
    main()
