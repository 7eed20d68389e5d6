"""MCP comparison (goal 4): toolsetd against the MCP Python SDK over stdio, same run.

``python -m bench.bench_mcp [--quick]``

The MCP side runs under an interpreter that has ``mcp`` installed: ``BENCH_MCP_PYTHON`` if
set, else ``/tmp/mcp-venv/bin/python`` if it exists (for another SDK release:
``python3 -m venv /tmp/mcp-venv && /tmp/mcp-venv/bin/pip install mcp==X``), else the
project venv's own interpreter, which has the SDK the tests pin (the test extra's
``mcp==2.3.0``). Without any of them, this benchmark is skipped with a message.

Paired rounds, alternating the two sides:

* ``tools/call`` of a tool running ``/bin/true`` (``bench/_mcp_server.py``, ``MCPServer``,
  ``asyncio.create_subprocess_exec`` + ``communicate()``) through the SDK's ``stdio_client``
  and ``ClientSession`` vs toolsetd ``invoke`` of the ``noop`` set through the benchmarks'
  blocking NDJSON client: median latency, and calls/s with 1 and 8 calls in flight (MCP: 8
  concurrent calls on its one stdio session; toolsetd: 8 connections). A raw-NDJSON MCP
  client row shows how much of MCP's time is its client.
* Floors, in the same rounds: the minimal spawn server (``bench._baseline --mode spawn``,
  one ``create_subprocess_exec`` per request and one response frame, through the same
  client) against the SDK, the best any daemon that spawns a child per call can do on these
  rows; and for ``list``, the client's own ``orjson.loads`` of toolsetd's answer against
  the SDK's ``tools/list``. They are printed beside the goals, not goals themselves.
* ``tools/list`` with 1,000 tools vs toolsetd ``list`` with 1,000 tools (999 small sets +
  ``noop``).
* Cold start with 1,000 tools: MCP spawn -> ``initialize`` answered vs toolsetd spawn ->
  first ``status`` answered (same 1,000-tool home).
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    __package__ = "bench"

import json
import os
import subprocess
import time
from typing import Any

import orjson

from bench._common import (
    MIN_ROUNDS,
    REPO,
    BlockingConn,
    Goal,
    Section,
    make_home,
    median,
    paired,
    percentile,
    print_table,
    ratio_of_pairs,
    ratios,
    sequential_latency,
    standalone,
    start_baseline,
    start_daemon,
    temp_base,
    throughput,
)
from bench.bench_invoke import DAEMON_ARGS, invoke_params

CLIENT = str(REPO / "bench" / "_mcp_client.py")


def mcp_python() -> str | None:
    """The interpreter with ``mcp``, or None (with the reason printed)."""
    # The path the docs tell people to create; only ever executed, never written.
    python = os.environ.get("BENCH_MCP_PYTHON", "/tmp/mcp-venv/bin/python")  # noqa: S108
    if "BENCH_MCP_PYTHON" not in os.environ and not os.path.exists(python):
        python = sys.executable  # the project venv: the test extra pins the SDK
    if not os.path.exists(python):
        print(
            f"bench_mcp: skipped: no interpreter at {python} (set BENCH_MCP_PYTHON, or create it: "
            "python3 -m venv /tmp/mcp-venv && /tmp/mcp-venv/bin/pip install mcp)"
        )
        return None
    out = subprocess.run(
        [python, CLIENT, "--mode", "check"], capture_output=True, text=True, check=False
    )
    if out.returncode != 0:
        print(
            f"bench_mcp: skipped: {python} cannot import mcp "
            f"({out.stderr.strip().splitlines()[-1] if out.stderr.strip() else out.returncode})"
        )
        return None
    return python


def _mcp(python: str, *args: str) -> dict[str, Any]:
    out = subprocess.run(
        [python, CLIENT, *args], capture_output=True, text=True, check=False, timeout=600
    )
    if out.returncode != 0:
        raise RuntimeError(f"MCP client failed ({args}):\n{out.stderr[-4000:]}")
    result: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def run(quick: bool = False) -> Section | None:
    python = mcp_python()
    if python is None:
        return None
    info = _mcp(python, "--mode", "check")
    rounds = MIN_ROUNDS if quick else 7
    n_calls = 200 if quick else 500
    seconds = 1.0 if quick else 2.0
    section = Section("mcp")
    data = section.data
    data["mcp"] = info
    with temp_base() as base:
        home1 = make_home(base, 0, trivial=True, name="home1")
        home1k = make_home(base, 999, trivial=True, name="home1k")
        ws = base / "ws"
        ws.mkdir()
        params = invoke_params(ws)

        # -- tools/call vs invoke ---------------------------------------------------------
        daemon = start_daemon(home1, base, extra=DAEMON_ARGS)
        spawn_srv = None
        try:
            spawn_srv = start_baseline("spawn", base, name="spawn")
            floor_srv = spawn_srv.socket
            sequential_latency(daemon.socket, "invoke", params, 50, warmup=20)
            mcp_lat: list[float] = []
            ts_lat: list[float] = []
            mcp_rps: dict[int, list[float]] = {1: [], 8: []}
            ts_rps: dict[int, list[float]] = {1: [], 8: []}
            floor_rps: dict[int, list[float]] = {1: [], 8: []}

            def mcp_round() -> float:
                d = _mcp(
                    python,
                    "--mode",
                    "calls",
                    "--n",
                    str(n_calls),
                    "--conc",
                    "8",
                    "--seconds",
                    str(seconds),
                )
                mcp_lat.extend(d["latency_ns"])
                for c in (1, 8):
                    mcp_rps[c].append(d[f"calls_per_s_c{c}"])
                return median(d["latency_ns"])

            def ts_round() -> float:
                samples = sequential_latency(daemon.socket, "invoke", params, n_calls, warmup=10)
                ts_lat.extend(samples)
                for c in (1, 8):
                    ts_rps[c].append(throughput(daemon.socket, "invoke", params, c, seconds))
                return median(samples)

            def floor_round() -> float:
                samples = sequential_latency(floor_srv, "invoke", params, n_calls, warmup=10)
                for c in (1, 8):
                    floor_rps[c].append(throughput(floor_srv, "invoke", params, c, seconds))
                return median(samples)

            t_med, m_med, f_med = paired(rounds, ts_round, mcp_round, floor_round)
        finally:
            daemon.stop()
            if spawn_srv is not None:
                spawn_srv.stop()
        raw = [
            median(_mcp(python, "--mode", "raw-calls", "--n", str(n_calls))["latency_ns"])
            for _ in range(max(1, rounds // 2))
        ]
        data["call"] = {
            "toolsetd_median_us": median(t_med) / 1000,
            "toolsetd_p99_us": percentile(ts_lat, 99) / 1000,
            "mcp_median_us": median(m_med) / 1000,
            "mcp_p99_us": percentile(mcp_lat, 99) / 1000,
            "mcp_raw_client_median_us": median(raw) / 1000,
            "latency_ratio": ratio_of_pairs(t_med, m_med),
            "latency_ratios": ratios(t_med, m_med),
        }
        for c in (1, 8):
            data["call"][f"toolsetd_calls_per_s_c{c}"] = median(ts_rps[c])
            data["call"][f"mcp_calls_per_s_c{c}"] = median(mcp_rps[c])
            data["call"][f"calls_per_s_ratio_c{c}"] = ratio_of_pairs(ts_rps[c], mcp_rps[c])
            data["call"][f"calls_per_s_ratios_c{c}"] = ratios(ts_rps[c], mcp_rps[c])
        data["floor"] = {
            "spawn_server_median_us": median(f_med) / 1000,
            "latency_ratio": ratio_of_pairs(f_med, m_med),
            **{f"calls_per_s_ratio_c{c}": ratio_of_pairs(floor_rps[c], mcp_rps[c]) for c in (1, 8)},
        }

        # -- list of 1,000 tools ----------------------------------------------------------
        n_list = 10 if quick else 30
        daemon = start_daemon(home1k, base, name="l")
        try:
            with BlockingConn(daemon.socket) as conn:  # the answer's size, as the client gets it
                answer = orjson.dumps(conn.request("list"))

            def decode() -> float:
                times = []
                for _ in range(n_list):
                    t0 = time.perf_counter_ns()
                    orjson.loads(answer)
                    times.append(time.perf_counter_ns() - t0)
                return median(times)

            t_list, m_list, d_list = paired(
                rounds,
                lambda: median(sequential_latency(daemon.socket, "list", None, n_list, warmup=3)),
                lambda: median(
                    _mcp(python, "--mode", "list", "--tools", "1000", "--n", str(n_list))[
                        "latency_ns"
                    ]
                ),
                decode,
            )
        finally:
            daemon.stop()
        data["list_1000"] = {
            "toolsetd_ms": median(t_list) / 1e6,
            "mcp_ms": median(m_list) / 1e6,
            "answer_bytes": len(answer),
            "client_decode_ms": median(d_list) / 1e6,
            "floor_ratio": ratio_of_pairs(d_list, m_list),
            "ratio": ratio_of_pairs(t_list, m_list),
            "ratios": ratios(t_list, m_list),
        }

        # -- cold start with 1,000 tools --------------------------------------------------
        def ts_cold() -> float:
            d = start_daemon(home1k, base, name="c")
            d.stop()
            return d.ready_ns

        t_cold, m_cold = paired(
            rounds, ts_cold, lambda: _mcp(python, "--mode", "cold", "--tools", "1000")["ready_ns"]
        )
        data["cold_1000"] = {
            "toolsetd_ms": median(t_cold) / 1e6,
            "mcp_ms": median(m_cold) / 1e6,
            "ratio": ratio_of_pairs(t_cold, m_cold),
            "ratios": ratios(t_cold, m_cold),
        }

    c, li, co, fl = data["call"], data["list_1000"], data["cold_1000"], data["floor"]
    print_table(
        f"toolsetd vs MCP Python SDK {info['mcp']} (stdio)",
        ["what", "toolsetd", "MCP SDK", "ratio"],
        [
            [
                "trivial call, median µs",
                c["toolsetd_median_us"],
                c["mcp_median_us"],
                c["latency_ratio"],
            ],
            [
                "  floor: minimal spawn server, median µs",
                fl["spawn_server_median_us"],
                "",
                fl["latency_ratio"],
            ],
            ["trivial call, p99 µs", c["toolsetd_p99_us"], c["mcp_p99_us"], ""],
            [
                "  MCP server with a raw NDJSON client, median µs",
                "",
                c["mcp_raw_client_median_us"],
                "",
            ],
            [
                "calls/s, 1 in flight",
                c["toolsetd_calls_per_s_c1"],
                c["mcp_calls_per_s_c1"],
                c["calls_per_s_ratio_c1"],
            ],
            ["  floor: minimal spawn server", "", "", fl["calls_per_s_ratio_c1"]],
            [
                "calls/s, 8 in flight",
                c["toolsetd_calls_per_s_c8"],
                c["mcp_calls_per_s_c8"],
                c["calls_per_s_ratio_c8"],
            ],
            ["  floor: minimal spawn server", "", "", fl["calls_per_s_ratio_c8"]],
            ["list 1,000 tools, ms", li["toolsetd_ms"], li["mcp_ms"], li["ratio"]],
            [
                f"  floor: the client's orjson.loads of the {li['answer_bytes']:,} bytes, ms",
                li["client_decode_ms"],
                "",
                li["floor_ratio"],
            ],
            ["cold start, 1,000 tools, ms", co["toolsetd_ms"], co["mcp_ms"], co["ratio"]],
        ],
    )
    # Targets as raised by issue 16 (latency <= 0.35x, calls/s >= 3x the SDK's).
    section.goals = [
        Goal.of(
            "4",
            "invoke latency / MCP tools/call",
            c["latency_ratios"],
            0.35,
            "<=",
            f"{c['toolsetd_median_us']:.0f} vs {c['mcp_median_us']:.0f} µs "
            f"(floor {fl['latency_ratio']:.2f})",
        ),
        Goal.of(
            "4",
            "calls/s (1 in flight) / MCP",
            c["calls_per_s_ratios_c1"],
            3.0,
            ">=",
            f"{c['toolsetd_calls_per_s_c1']:.0f} vs {c['mcp_calls_per_s_c1']:.0f}/s "
            f"(floor {fl['calls_per_s_ratio_c1']:.2f})",
        ),
        Goal.of(
            "4",
            "calls/s (8 in flight) / MCP",
            c["calls_per_s_ratios_c8"],
            3.0,
            ">=",
            f"{c['toolsetd_calls_per_s_c8']:.0f} vs {c['mcp_calls_per_s_c8']:.0f}/s "
            f"(floor {fl['calls_per_s_ratio_c8']:.2f})",
        ),
        Goal.of(
            "4",
            "list 1,000 tools / MCP tools/list",
            li["ratios"],
            0.05,
            "<=",
            f"{li['toolsetd_ms']:.1f} vs {li['mcp_ms']:.0f} ms (floor {li['floor_ratio']:.3f})",
        ),
        Goal.of(
            "4",
            "cold start 1,000 / MCP cold start",
            co["ratios"],
            0.15,
            "<=",
            f"{co['toolsetd_ms']:.0f} vs {co['mcp_ms']:.0f} ms",
        ),
    ]
    return section


def main() -> None:
    """``python -m bench.bench_mcp [--quick]``."""
    standalone("mcp", run, __doc__)


if __name__ == "__main__":
    main()
