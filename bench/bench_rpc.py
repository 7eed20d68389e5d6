"""RPC benchmark (goal 3): ``status`` through the real daemon vs an orjson NDJSON echo.

``python -m bench.bench_rpc [--quick]``

* Round trip: one blocking client sends ``status`` sequentially on one connection, to the
  daemon and to ``bench._baseline --mode status`` (asyncio streams + orjson, answering a
  canned status-like result), interleaved round by round. Median and p99 in µs; the goal
  ratio is the median of per-round ratios of the medians (daemon / echo).
* Throughput: requests/s with 1 and 32 connections (an asyncio client in this process,
  each connection one request at a time), same pairing.
* Placement: for the round trip and throughput, the client (this process) runs on the
  first CPU and both servers on the last (``_common.placed``, ``"split"``), so every
  request crosses cores the same way for both. Unpinned, the scheduler sometimes keeps the
  one-threaded echo on its client's core for a whole round, where its round trip is a
  third as long, and the ratio then measures the placement. The round trip with all of
  them on one core is printed beside it, for the record (not a goal).
* Dispatch CPU, in process: ``Server.dispatch_one`` on an already parsed request dict for a
  trivial method, µs per call; and for reference jsonrpcserver's default
  ``dispatch(str)`` (json + per-request jsonschema envelope check) of the same request, and
  the full line path (orjson decode + dispatch_one + encode).

The daemon runs with ``--no-watch --log-level warning``.
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    __package__ = "bench"

import functools
import gc
from typing import Any

import anyio
import orjson

from bench._common import (
    MIN_ROUNDS,
    Goal,
    Section,
    median,
    now_ns,
    paired,
    percentile,
    placed,
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


def _dispatch_cpu(n: int) -> dict[str, Any]:
    """µs per call of the daemon's dispatch and of jsonrpcserver's default dispatch."""
    from jsonrpcserver import Success
    from jsonrpcserver import dispatch as jrs_dispatch
    from toolsetd.daemon.logs import configure_logging
    from toolsetd.daemon.peercred import PeerPolicy
    from toolsetd.daemon.server import Server, ServerSettings
    from toolsetd.protocol.codec import Codec

    configure_logging("json", "warning")
    result = {"ok": True}

    async def trivial(ctx: Any, params: Any) -> dict[str, bool]:
        return result

    server = Server(ServerSettings(), {"status": trivial}, PeerPolicy.default())
    line = b'{"jsonrpc": "2.0", "id": 7, "method": "status"}'
    request = orjson.loads(line)
    codec = Codec()

    out: dict[str, Any] = {}

    async def ours() -> None:
        for _ in range(2000):  # warm up
            await server.dispatch_one(None, request)  # type: ignore[arg-type]
        samples = []
        for _ in range(7):
            gc.collect()
            t0 = now_ns()
            for _ in range(n):
                await server.dispatch_one(None, request)  # type: ignore[arg-type]
            samples.append((now_ns() - t0) / n / 1000)
        out["dispatch_one_us"] = median(samples)
        out["dispatch_one_samples"] = samples
        samples = []
        for _ in range(7):
            t0 = now_ns()
            for _ in range(n):
                codec.receive_data(line + b"\n")
                value = codec.next_event().value  # type: ignore[union-attr]
                codec.encode(await server.dispatch_one(None, value))  # type: ignore[arg-type]
            samples.append((now_ns() - t0) / n / 1000)
        out["line_path_us"] = median(samples)

    anyio.run(ours, backend="asyncio")

    methods = {"status": lambda: Success(result)}
    text = line.decode()
    for _ in range(500):
        jrs_dispatch(text, methods=methods)
    samples = []
    for _ in range(7):
        gc.collect()
        t0 = now_ns()
        for _ in range(n // 4):
            jrs_dispatch(text, methods=methods)
        samples.append((now_ns() - t0) / (n // 4) / 1000)
    out["jsonrpcserver_default_us"] = median(samples)
    return out


def run(quick: bool = False) -> Section:
    rounds = MIN_ROUNDS if quick else 9
    n_req = 1000 if quick else 3000
    seconds = 1.0 if quick else 2.0
    section = Section("rpc")
    data = section.data
    with temp_base() as base:
        home = base / "home"
        (home / "tools").mkdir(parents=True)
        daemon = start_daemon(home, base)
        echo = None
        try:
            echo = start_baseline("status", base)
            lat: dict[str, list[int]] = {"daemon": [], "echo": []}
            servers = (daemon, echo)

            def measure(which: str, sock: Path) -> float:
                samples = sequential_latency(sock, "status", None, n_req)
                lat[which].extend(samples)
                return median(samples)

            with placed(servers, "split") as placement:
                d_med, e_med = paired(
                    rounds,
                    lambda: measure("daemon", daemon.socket),
                    lambda: measure("echo", echo.socket),
                )
            data["status_round_trip"] = {
                "daemon_median_us": median(d_med) / 1000,
                "daemon_p99_us": percentile(lat["daemon"], 99) / 1000,
                "echo_median_us": median(e_med) / 1000,
                "echo_p99_us": percentile(lat["echo"], 99) / 1000,
                "ratio": ratio_of_pairs(d_med, e_med),
                "ratios": ratios(d_med, e_med),
                "rounds": rounds,
                "requests_per_round": n_req,
                "placement": placement,
            }
            # For the record, not a goal: the same round trip with client and servers on
            # one core, where each request's CPU time is the whole of its latency.
            with placed(servers, "shared") as shared:
                s_d, s_e = paired(
                    MIN_ROUNDS,
                    lambda: median(sequential_latency(daemon.socket, "status", None, n_req)),
                    lambda: median(sequential_latency(echo.socket, "status", None, n_req)),
                )
            data["status_round_trip_one_core"] = {
                "daemon_median_us": median(s_d) / 1000,
                "echo_median_us": median(s_e) / 1000,
                "ratio": ratio_of_pairs(s_d, s_e),
                "placement": shared,
            }
            for conc in (1, 32):
                with placed(servers, "split"):
                    d_rps, e_rps = paired(
                        rounds,
                        functools.partial(throughput, daemon.socket, "status", {}, conc, seconds),
                        functools.partial(throughput, echo.socket, "status", {}, conc, seconds),
                    )
                data[f"status_rps_c{conc}"] = {
                    "daemon": median(d_rps),
                    "echo": median(e_rps),
                    "ratio": ratio_of_pairs(d_rps, e_rps),
                    "echo_over_daemon": ratios(e_rps, d_rps),
                }
        finally:
            daemon.stop()
            if echo is not None:
                echo.stop()
    data["dispatch_cpu"] = _dispatch_cpu(5000 if quick else 20000)

    rt = data["status_round_trip"]
    dc = data["dispatch_cpu"]
    print_table(
        "status round trip (sequential, one connection)",
        ["server", "median µs", "p99 µs"],
        [
            ["toolsetd", rt["daemon_median_us"], rt["daemon_p99_us"]],
            ["orjson echo", rt["echo_median_us"], rt["echo_p99_us"]],
            ["ratio", rt["ratio"], ""],
            [
                "toolsetd, all on one core (not a goal)",
                data["status_round_trip_one_core"]["daemon_median_us"],
                "",
            ],
            [
                "orjson echo, all on one core",
                data["status_round_trip_one_core"]["echo_median_us"],
                "",
            ],
        ],
    )
    print_table(
        "status requests/s",
        ["connections", "toolsetd", "orjson echo", "ratio (echo/toolsetd)"],
        [
            [
                c,
                data[f"status_rps_c{c}"]["daemon"],
                data[f"status_rps_c{c}"]["echo"],
                1 / data[f"status_rps_c{c}"]["ratio"],
            ]
            for c in (1, 32)
        ],
    )
    print_table(
        "dispatch CPU per request (in process)",
        ["path", "µs"],
        [
            ["Server.dispatch_one (parsed dict)", dc["dispatch_one_us"]],
            ["codec decode + dispatch_one + encode", dc["line_path_us"]],
            ["jsonrpcserver default dispatch(str)", dc["jsonrpcserver_default_us"]],
        ],
    )
    section.goals = [
        Goal.of(
            "3",
            "status round trip / orjson echo (split CPUs)",
            rt["ratios"],
            1.2,
            "<=",
            f"{rt['daemon_median_us']:.0f} vs {rt['echo_median_us']:.0f} µs",
        ),
        Goal.of(
            "3",
            "status req/s, 1 conn, split CPUs: echo / toolsetd",
            data["status_rps_c1"]["echo_over_daemon"],
            1.2,
            "<=",
            f"{data['status_rps_c1']['daemon']:.0f} vs {data['status_rps_c1']['echo']:.0f} req/s",
        ),
        Goal.of(
            "3",
            "status req/s, 32 conns, split CPUs: echo / toolsetd",
            data["status_rps_c32"]["echo_over_daemon"],
            1.2,
            "<=",
            f"{data['status_rps_c32']['daemon']:.0f} vs {data['status_rps_c32']['echo']:.0f} req/s",
        ),
        Goal.of(
            "3",
            "dispatch CPU µs/request (absolute, µs)",
            dc["dispatch_one_samples"],
            10,
            "<=",
            f"jsonrpcserver default {dc['jsonrpcserver_default_us']:.0f} µs",
        ),
    ]
    return section


def main() -> None:
    """``python -m bench.bench_rpc [--quick]``."""
    standalone("rpc", run, __doc__)


if __name__ == "__main__":
    main()
