"""CLI start-up benchmark (goal 7): ``toolsetctl status`` against a running daemon.

``python -m bench.bench_cli [--quick]``

Each round runs ``python -c pass`` and ``toolsetctl status`` (the installed entry point
of the same interpreter, default table format, against a daemon started for the run) a
number of times each, interleaved; the goal ratio is the median of per-round ratios of
the medians. ``toolsetctl list`` and ``toolsetctl --version`` are measured the same way
for reference (no goal). Wall time of the whole process, spawn to exit.
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    __package__ = "bench"

import shutil
import subprocess

from bench._common import (
    EXAMPLES,
    PYTHON,
    Goal,
    Section,
    median,
    now_ns,
    paired,
    print_table,
    ratio_of_pairs,
    ratios,
    standalone,
    start_daemon,
    temp_base,
)

_CTL = str(Path(PYTHON).with_name("toolsetctl"))


def _wall_ms(argv: list[str], n: int) -> float:
    """Median wall time of ``n`` runs of ``argv``, in ms (a failing run is an error)."""
    samples = []
    for _ in range(n):
        t0 = now_ns()
        done = subprocess.run(argv, capture_output=True, check=False)
        samples.append((now_ns() - t0) / 1e6)
        if done.returncode != 0:
            raise RuntimeError(f"{argv} exited {done.returncode}: {done.stderr.decode()[-2000:]}")
    return median(samples)


def run(quick: bool = False) -> Section:
    """Measure goal 7 and return its section (``python -m bench`` calls it)."""
    rounds = 5 if quick else 9
    per_round = 5 if quick else 15
    section = Section("cli")
    data = section.data
    with temp_base() as base:
        home = base / "home"
        shutil.copytree(EXAMPLES, home / "tools")
        workspace = base / "ws"
        workspace.mkdir()
        daemon = start_daemon(home, base)
        try:
            ctl = [_CTL, "--socket", str(daemon.socket), "--workspace", str(workspace)]
            bare, status, listing, version = paired(
                rounds,
                lambda: _wall_ms([PYTHON, "-c", "pass"], per_round),
                lambda: _wall_ms([*ctl, "status"], per_round),
                lambda: _wall_ms([*ctl, "list"], per_round),
                lambda: _wall_ms([_CTL, "--version"], per_round),
            )
        finally:
            daemon.stop()
    data.update(
        {
            "python_pass_ms": median(bare),
            "status_ms": median(status),
            "list_ms": median(listing),
            "version_ms": median(version),
            "status_ratio": ratio_of_pairs(status, bare),
            "status_ratios": ratios(status, bare),
            "list_ratio": ratio_of_pairs(listing, bare),
            "rounds": rounds,
            "runs_per_round": per_round,
        }
    )
    print_table(
        "toolsetctl start-up (wall time, spawn to exit)",
        ["command", "median ms", "/ python -c pass"],
        [
            ["python -c pass", data["python_pass_ms"], 1.0],
            ["toolsetctl status", data["status_ms"], data["status_ratio"]],
            ["toolsetctl list", data["list_ms"], data["list_ratio"]],
            ["toolsetctl --version", data["version_ms"], ratio_of_pairs(version, bare)],
        ],
    )
    section.goals = [
        Goal.of(
            "7",
            "toolsetctl status / python -c pass (wall)",
            data["status_ratios"],
            3.0,
            "<=",
            f"{data['status_ms']:.0f} vs {data['python_pass_ms']:.0f} ms",
        ),
    ]
    return section


def main() -> None:
    """``python -m bench.bench_cli [--quick]``."""
    standalone("cli", run, __doc__)


if __name__ == "__main__":
    main()
