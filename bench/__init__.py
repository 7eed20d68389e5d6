"""toolsetd benchmarks: each module measures the daemon against a baseline in the same run.

Run everything with ``make bench`` (``python -m bench``) or ``python -m bench --quick``;
run one module with ``python -m bench.bench_rpc`` (or ``python bench/bench_rpc.py``).
Not part of the test suite: ``tests/`` is the suite root and nothing here is collected.
See ``docs/benchmarks.md``.
"""

import compileall
import os
from pathlib import Path

# Every benchmark spawns daemons, pumps and toolsetctl, and times their start. With
# PYTHONDONTWRITEBYTECODE set (as in many shells; `make bench` unexports it, a bare
# `python -m bench` did not), a module changed since its bytecode was last written is
# compiled again at every spawn: the sixteenth pass's full run measured ~78 ms of that in
# each cold start (246 ms, 168 ms with the bytecode written). So the children may write
# their bytecode, and it is written once here before anything is timed.
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
_ROOT = Path(__file__).resolve().parents[1]
for _package in ("protocol", "daemon", "client", "bench"):
    compileall.compile_dir(_ROOT / _package, quiet=1)
