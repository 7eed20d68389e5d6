"""What a daemon whose memory is bounded pays for JSON (``jsontext.check_allocations``).

``python -m bench.bench_checked_json [--rounds 9] [--number N] [--memory]``

Not a goal row. A daemon whose allocations can fail (``LimitAS=``, ``LimitDATA=``, strict
overcommit) parses every text with the standard library's parser and writes every answer
with its own writer on the standard library's string escaper, since orjson died of SIGSEGV
short of memory. This times both against orjson's path (``check_allocations`` off) on the
messages the daemon reads and writes most, interleaved: each round times ``--number``
parses or writes of each shape both ways, and the ratio printed is the median of the
per-round ratios (checked / orjson), with their range, and each way's median time per
message in microseconds. The bytes and values are the same both ways
(``tests/protocol/test_jsontext.py``), so only the time differs, and the memory:
``--memory`` also prints, for each message written, the most memory the write held at
once (``tracemalloc``'s peak, the output included) as a multiple of the output's size,
each way: what a bounded daemon must have free to write it.
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    __package__ = "bench"

import argparse
import gc
import statistics
import time
import tracemalloc
from collections.abc import Callable
from functools import partial
from typing import Any

import orjson
from toolsetd.protocol.jsontext import RawJson, check_allocations, dumps, loads

from bench._common import load

NEWLINE = orjson.OPT_APPEND_NEWLINE


def _answer(text: str) -> dict[str, Any]:
    """An ``invoke`` answer whose tool printed ``text``."""
    return {
        "jsonrpc": "2.0",
        "id": 7,
        "result": {
            "callId": "c-0a1b2c3d",
            "status": "ok",
            "exitCode": 0,
            "elapsedMs": 12.5,
            "content": [{"type": "text", "text": text}],
            "truncated": False,
        },
    }


def _shapes() -> tuple[dict[str, Any], dict[str, bytes]]:
    """The values written and the texts read, by name."""
    tools = [
        {
            "name": f"tool{i}",
            "description": "does a thing " * 4,
            "set": f"set{i // 10}",
            "inputSchema": {"type": "object", "properties": {"path": {"type": "string"}}},
        }
        for i in range(1_000)
    ]
    written = {
        "started event": {
            "jsonrpc": "2.0",
            "method": "started",
            "params": {"callId": "c-0a1b2c3d", "tool": "noop", "pid": 4242},
        },
        "invoke answer, 1 KB output": _answer("line of output\n" * 70),
        "invoke answer, 100 KB output": _answer("x" * 100_000),
        "status answer": {
            "jsonrpc": "2.0",
            "id": 3,
            "result": {
                "version": "1.0",
                "pid": 4242,
                "uptimeSeconds": 3600.25,
                "connections": 3,
                "calls": {"running": 1, "total": 1234},
                "sets": 12,
                "tools": 57,
                "watching": {"paths": 14, "mode": "inotify"},
                "cgroups": True,
                "sandbox": False,
            },
        },
        "list answer, 1,000 tools": {
            "jsonrpc": "2.0",
            "id": 4,
            "result": {
                "tools": RawJson(dumps(tools)),
                "sets": RawJson(b"[]"),
                "notes": RawJson(b"[]"),
            },
        },
    }
    read = {
        "invoke request": dumps(
            {
                "jsonrpc": "2.0",
                "id": 7,
                "method": "invoke",
                "params": {
                    "tool": "noop",
                    "arguments": {"path": "src/main.py", "n": 3, "ratio": 0.25},
                    "workspace": "/home/ada/project",
                },
            }
        ),
        "status request": b'{"jsonrpc":"2.0","id":3,"method":"status"}',
        "request with 60 KB of text": dumps(
            {
                "jsonrpc": "2.0",
                "id": 8,
                "method": "invoke",
                "params": {"tool": "t", "arguments": {"s": "a" * 60_000}},
            }
        ),
    }
    return written, read


def _time(run: Callable[[], Any], number: int) -> float:
    started = time.perf_counter()
    for _ in range(number):
        run()
    return (time.perf_counter() - started) / number


def _row(name: str, run: Callable[[], Any], rounds: int, number: int) -> str:
    plain: list[float] = []
    checked: list[float] = []
    for index in range(rounds):
        for on in (False, True) if index % 2 == 0 else (True, False):
            check_allocations(on)
            try:
                (checked if on else plain).append(_time(run, number))
            finally:
                check_allocations(False)
    ratios = [c / p for c, p in zip(checked, plain, strict=True)]
    return (
        f"{name:34} {statistics.median(ratios):6.2f}  ({min(ratios):.2f}-{max(ratios):.2f})"
        f"  {statistics.median(plain) * 1e6:9.2f} {statistics.median(checked) * 1e6:9.2f}"
    )


def _peak(value: Any) -> float:
    """The most memory ``dumps(value)`` held at once, over its output's size."""
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        size = len(dumps(value, NEWLINE))
        return tracemalloc.get_traced_memory()[1] / size
    finally:
        tracemalloc.stop()


def _peaks(written: dict[str, Any]) -> None:
    print(f"{'message written':34} {'orjson peak':>11} {'checked peak':>12}  (times its output)")
    for name, value in written.items():
        plain = _peak(value)
        check_allocations(True)
        try:
            checked = _peak(value)
        finally:
            check_allocations(False)
        print(f"{name:34} {plain:11.2f} {checked:12.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--number", type=int, default=2_000)
    parser.add_argument("--memory", action="store_true", help="also each write's peak memory")
    args = parser.parse_args()
    written, read = _shapes()
    print(f"load at start: {load()}")
    print(f"{'message':34} {'checked / orjson':>16}  {'orjson µs':>9} {'checked µs':>9}")
    gc.disable()  # as the daemon's hot path meets it: no collection inside a round
    try:
        for name, value in written.items():
            number = max(20, args.number // (50 if "100 KB" in name or "1,000" in name else 1))
            print(_row(f"write {name}", partial(dumps, value, NEWLINE), args.rounds, number))
        for name, text in read.items():
            number = max(20, args.number // (20 if "60 KB" in name else 1))
            print(_row(f"read {name}", partial(loads, text), args.rounds, number))
    finally:
        gc.enable()
    if args.memory:
        _peaks(written)
    print(f"load at end: {load()}")


if __name__ == "__main__":
    main()
