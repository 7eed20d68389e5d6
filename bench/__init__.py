"""toolsetd benchmarks: each module measures the daemon against a baseline in the same run.

Run everything with ``make bench`` (``python -m bench``) or ``python -m bench --quick``;
run one module with ``python -m bench.bench_rpc`` (or ``python bench/bench_rpc.py``).
Not part of the test suite: ``tests/`` is the suite root and nothing here is collected.
See ``docs/benchmarks.md``.
"""
