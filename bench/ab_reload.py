"""Unchanged ``Registry.reload``, this tree against another checkout, paired, beside the read floor.

``python -m bench.ab_reload --against DIR [--sets 1000] [--rounds 41] [--pure]``

``DIR`` is another checkout of toolsetd with its own venv (``DIR/.venv/bin/python``), for
example the code before a change::

    git worktree add /tmp/before HEAD~1 && make -C /tmp/before .venv/.installed

A temp home holds ``--sets`` small sets, aged past the racy window, as ``bench_catalog``
makes them. Two worker processes (``bench/_reload_worker.py``), one under each tree's
interpreter, each hold a ``Registry`` over that home with a set store of its own and time
their own reloads. Each round, as ``bench_catalog``'s ``registry_reloads``: the read floor,
then an unchanged reload on each side (the order alternates every round); unless
``--pure``, one set's manifest is then rewritten and reloaded, rewritten again and
reloaded told which set changed, and a full load runs, so the next round's unchanged
reload finds that manifest still too fresh to judge by its stat (as the benchmark's
rounds after the first do). Printed: each side's unchanged reload against the read floor
and this / other (median and range over the rounds).
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    __package__ = "bench"

import argparse
import subprocess
import time
from typing import IO

from bench._common import (
    PYTHON,
    REPO,
    against_python,
    load,
    make_home,
    median,
    print_table,
    ratios,
    set_name,
    small_manifest,
    temp_base,
)
from bench.bench_catalog import RACY_SECONDS, build_cold, read_floor, warm_store

WORKER = REPO / "bench" / "_reload_worker.py"


class _Side:
    """A worker process under one tree's interpreter."""

    def __init__(self, python: Path | str, home: Path, store: Path) -> None:
        self.proc = subprocess.Popen(
            [str(python), str(WORKER), str(home), str(store)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            cwd="/",
        )
        assert self._line() == "ready"

    def _line(self) -> str:
        out: IO[str] | None = self.proc.stdout
        assert out is not None
        line = out.readline()
        if not line:
            raise RuntimeError(f"worker exited: {self.proc.wait()}")
        return line.strip()

    def reload(self, request: str, changes: int) -> int:
        stdin = self.proc.stdin
        assert stdin is not None
        stdin.write(request + "\n")
        stdin.flush()
        elapsed, changed = self._line().split()
        assert int(changed) == changes, (request, changed)
        return int(elapsed)

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        self.proc.wait(timeout=30)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--against", required=True, type=Path, help="a checkout with .venv")
    parser.add_argument("--sets", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=41)
    parser.add_argument("--pure", action="store_true", help="no writes: every manifest aged")
    args = parser.parse_args()
    other_python = against_python(parser, args.against)
    print(f"load at start: {load()}")
    n = args.sets
    with temp_base() as base:
        home = make_home(base, n)
        stores = {side: base / f"store-{side}" for side in ("this", "other")}
        time.sleep(RACY_SECONDS)  # operators' manifests are old (see bench_catalog)
        for store in stores.values():
            warm_store(home, store)
            warm_store(home, store)
        sides = {
            "this": _Side(PYTHON, home, stores["this"]),
            "other": _Side(other_python, home, stores["other"]),
        }
        target = home / "tools" / set_name(n // 2) / "tools.json"
        floor: list[float] = []
        times: dict[str, list[float]] = {"this": [], "other": []}
        try:
            for r in range(args.rounds):
                order = ["this", "other"] if r % 2 == 0 else ["other", "this"]
                floor.append(read_floor(home))
                for side in order:
                    times[side].append(sides[side].reload("u", 0))
                if args.pure:
                    continue
                target.write_bytes(small_manifest(n // 2, variant=r + 1))
                for side in order:
                    sides[side].reload("u", 1)
                target.write_bytes(small_manifest(n // 2, variant=args.rounds + r + 1))
                for side in order:
                    sides[side].reload(f"t {set_name(n // 2)}", 1)
                build_cold(home, store=stores["this"])  # a restart (reads the store only)
        finally:
            for worker in sides.values():
                worker.close()
    rows = []
    for side in ("this", "other"):
        vs = ratios(times[side], floor)
        rows.append(
            [f"{side}: unchanged reload", median(times[side]) / 1e6, median(vs), min(vs), max(vs)]
        )
    pairs = ratios(times["this"], times["other"])
    rows.append(["this / other", "", median(pairs), min(pairs), max(pairs)])
    kind = "every manifest aged" if args.pure else "one manifest too fresh, as in the benchmark"
    print_table(
        f"unchanged reload of {n:,} sets, {args.rounds} rounds ({kind});"
        f" read floor {median(floor) / 1e6:.2f} ms",
        ["what", "ms", "ratio (median)", "lowest", "highest"],
        rows,
    )
    print(f"load at end: {load()}")


if __name__ == "__main__":
    main()
