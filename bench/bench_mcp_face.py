"""The MCP face (goal 6 and issue 10's table): ``toolsetctl mcp`` measured in one run.

``python -m bench.bench_mcp_face [--quick]``

Every MCP number here is taken with one raw NDJSON client over the server's stdio (the
same code for both servers, decoding with orjson like the native client), so the servers
are compared, not their clients:

* ``tools/call`` of ``noop`` (``/bin/true``) through ``toolsetctl mcp`` vs native
  ``invoke`` of it on the same daemon (the benchmarks' blocking NDJSON client): median
  latency, paired rounds;
* the same ``tools/call`` through ``toolsetctl mcp`` vs the MCP SDK server of
  ``bench_mcp`` (``bench/_mcp_server.py``, under ``BENCH_MCP_PYTHON``): median latency and
  calls/s with 1 and 8 requests in flight on the one stdio session;
* time to the first answer: spawn ``toolsetctl mcp`` -> ``initialize`` answered (daemon
  already running) vs spawn ``python -c pass`` -> exit (same interpreter), and vs spawn
  the SDK server -> ``initialize`` answered;
* ``tools/list`` of 1,000 tools through ``toolsetctl mcp`` vs the SDK server's, with its
  floor beside it: a server that answers each request with the same result bytes,
  encoded beforehand (``CANNED_SERVER``), read and decoded by the same client.
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    __package__ = "bench"

import subprocess
import time
from collections.abc import Callable
from typing import Any

import orjson

from bench._common import (
    MIN_ROUNDS,
    PYTHON,
    REPO,
    Goal,
    Section,
    make_home,
    median,
    paired,
    print_table,
    ratio_of_pairs,
    ratios,
    sequential_latency,
    standalone,
    start_daemon,
    temp_base,
)
from bench.bench_invoke import DAEMON_ARGS, invoke_params
from bench.bench_mcp import mcp_python

SDK_SERVER = str(REPO / "bench" / "_mcp_server.py")
#: The tools/call rows' floor: a minimal orjson + asyncio MCP stdio server that spawns
#: ``/bin/true`` with pipes per call (``bench/_baseline.py``).
FLOOR_ARGV = [PYTHON, str(REPO / "bench" / "_baseline.py"), "--mode", "mcp-stdio"]
now_ns = time.perf_counter_ns
INIT = {
    "jsonrpc": "2.0",
    "id": 0,
    "method": "initialize",
    "params": {
        "protocolVersion": "2025-11-25",
        "capabilities": {},
        "clientInfo": {"name": "bench", "version": "0"},
    },
}
INITIALIZED = b'{"jsonrpc": "2.0", "method": "notifications/initialized"}\n'
#: The list row's floor: answers every request with the result in the file ``argv[1]``,
#: under the request's id, and does nothing else (no catalog, no encoding).
CANNED_SERVER = """
import sys, orjson
result = open(sys.argv[1], "rb").read()
out = sys.stdout.buffer
for line in sys.stdin.buffer:
    message = orjson.loads(line)
    if "id" in message:
        out.write(b'{"jsonrpc":"2.0","id":' + orjson.dumps(message["id"]) + b',"result":'
                  + result + b"}\\n")
        out.flush()
"""


class Stdio:
    """A raw NDJSON MCP client on a server subprocess's stdin/stdout."""

    def __init__(self, argv: list[str]) -> None:
        self.proc = subprocess.Popen(
            argv,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
        )
        self._id = 1

    def request(self, message: dict[str, Any]) -> dict[str, Any]:
        assert self.proc.stdin is not None
        assert self.proc.stdout is not None
        self.proc.stdin.write(orjson.dumps(message) + b"\n")
        self.proc.stdin.flush()
        while True:
            line = self.proc.stdout.readline()
            if not line:
                raise EOFError("server closed stdout")
            reply: dict[str, Any] = orjson.loads(line)
            if reply.get("id") == message.get("id") and "method" not in reply:
                return reply

    def start(self) -> None:
        assert self.proc.stdin is not None
        assert "result" in self.request(INIT)
        self.proc.stdin.write(INITIALIZED)
        self.proc.stdin.flush()

    def _message(self, method: str, params: dict[str, Any]) -> dict[str, Any]:
        self._id += 1
        return {"jsonrpc": "2.0", "id": self._id, "method": method, "params": params}

    def latency(self, method: str, params: dict[str, Any], n: int, warmup: int = 20) -> list[float]:
        samples: list[float] = []
        for i in range(n + warmup):
            # Checked and dropped inside its own round trip (as bench._common's
            # sequential_latency does): a reply kept alive into the next one makes this
            # process's collector traverse it during the next decode, which is neither
            # server's cost (~3 ms for a tools/list of 1,000 tools).
            t0 = now_ns()
            failed = _failure(self.request(self._message(method, params)))
            if i >= warmup:
                samples.append(now_ns() - t0)
            assert failed is None, failed
        return samples

    def pipelined(self, method: str, params: dict[str, Any], depth: int, seconds: float) -> float:
        """Calls per second with ``depth`` requests always in flight."""
        assert self.proc.stdin is not None
        assert self.proc.stdout is not None
        stdin, stdout = self.proc.stdin, self.proc.stdout
        for _ in range(depth):
            stdin.write(orjson.dumps(self._message(method, params)) + b"\n")
        stdin.flush()
        done = 0
        t0 = time.monotonic()
        end = t0 + seconds
        sending = True
        outstanding = depth
        while outstanding:
            reply = orjson.loads(stdout.readline())
            if "method" in reply:
                continue
            outstanding -= 1
            done += 1
            if sending and time.monotonic() < end:
                stdin.write(orjson.dumps(self._message(method, params)) + b"\n")
                stdin.flush()
                outstanding += 1
            else:
                sending = False
        return done / (time.monotonic() - t0)

    def close(self) -> None:
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.close()
            self.proc.wait(timeout=15)
        except Exception:
            self.proc.kill()
            self.proc.wait()
        for stream in (self.proc.stdout,):
            if stream is not None:
                stream.close()


def _failure(reply: dict[str, Any]) -> dict[str, Any] | None:
    """The reply when it is not a successful result, else None (and the reply is dropped)."""
    ok = "result" in reply and not reply["result"].get("isError")
    return None if ok else reply


def _rate(client: Stdio, call: dict[str, Any], depth: int, seconds: float) -> Callable[[], float]:
    """One paired measure: ``client``'s tools/call per second with ``depth`` in flight."""
    return lambda: client.pipelined("tools/call", call, depth, seconds)


def pump_argv(sock: Path, workspace: Path) -> list[str]:
    return [
        PYTHON,
        "-m",
        "toolsetd.client",
        "--socket",
        str(sock),
        "--workspace",
        str(workspace),
        "mcp",
        "--no-autostart",
    ]


def first_answer(argv: list[str]) -> float:
    """Spawn -> ``initialize`` answered, in ns."""
    t0 = now_ns()
    client = Stdio(argv)
    try:
        assert "result" in client.request(INIT)
        return now_ns() - t0
    finally:
        client.close()


def bare_start() -> float:
    t0 = now_ns()
    subprocess.run([PYTHON, "-c", "pass"], check=True)
    return now_ns() - t0


def run(quick: bool = False) -> Section | None:
    python = mcp_python()
    rounds = MIN_ROUNDS if quick else 7
    n_calls = 200 if quick else 500
    seconds = 1.0 if quick else 2.0
    section = Section("mcp_face")
    data = section.data
    call = {"name": "noop", "arguments": {}}
    with temp_base() as base:
        home1 = make_home(base, 0, trivial=True, name="home1")
        home1k = make_home(base, 999, trivial=True, name="home1k")
        ws = base / "ws"
        ws.mkdir()
        daemon = start_daemon(home1, base, extra=DAEMON_ARGS)
        try:
            pump = Stdio(pump_argv(daemon.socket, ws))
            pump.start()
            sdk = Stdio([python, SDK_SERVER, "--tools", "1"]) if python else None
            if sdk is not None:
                sdk.start()
            try:

                def native() -> float:
                    samples = sequential_latency(
                        daemon.socket, "invoke", invoke_params(ws), n_calls, warmup=20
                    )
                    return median([float(x) for x in samples])

                def through() -> float:
                    return median(pump.latency("tools/call", call, n_calls))

                t_native, t_pump = paired(rounds, native, through)
                data["call_vs_native"] = {
                    "native_us": median(t_native) / 1000,
                    "mcp_us": median(t_pump) / 1000,
                    "ratio": ratio_of_pairs(t_pump, t_native),
                    "ratios": ratios(t_pump, t_native),
                }
                if sdk is not None:
                    other: Stdio = sdk
                    spawner = Stdio(FLOOR_ARGV)
                    spawner.start()
                    try:
                        t_ours, t_sdk, t_floor = paired(
                            rounds,
                            through,
                            lambda: median(other.latency("tools/call", call, n_calls)),
                            lambda: median(spawner.latency("tools/call", call, n_calls)),
                        )
                        rates = {
                            depth: paired(
                                rounds,
                                *(
                                    _rate(client, call, depth, seconds)
                                    for client in (pump, other, spawner)
                                ),
                            )
                            for depth in (1, 8)
                        }
                    finally:
                        spawner.close()
                    (r_ours, r_sdk, r_floor), (r8_ours, r8_sdk, r8_floor) = rates[1], rates[8]
                    data["call_vs_sdk"] = {
                        "mcp_us": median(t_ours) / 1000,
                        "sdk_us": median(t_sdk) / 1000,
                        "ratio": ratio_of_pairs(t_ours, t_sdk),
                        "ratios": ratios(t_ours, t_sdk),
                        "calls_per_s_c1": median(r_ours),
                        "sdk_calls_per_s_c1": median(r_sdk),
                        "calls_per_s_ratio_c1": ratio_of_pairs(r_ours, r_sdk),
                        "calls_per_s_ratios_c1": ratios(r_ours, r_sdk),
                        "calls_per_s_c8": median(r8_ours),
                        "sdk_calls_per_s_c8": median(r8_sdk),
                        "calls_per_s_ratio_c8": ratio_of_pairs(r8_ours, r8_sdk),
                        "calls_per_s_ratios_c8": ratios(r8_ours, r8_sdk),
                    }
                    data["call_floor"] = {
                        "floor_us": median(t_floor) / 1000,
                        "ratio": ratio_of_pairs(t_floor, t_sdk),
                        "calls_per_s_c1": median(r_floor),
                        "calls_per_s_ratio_c1": ratio_of_pairs(r_floor, r_sdk),
                        "calls_per_s_c8": median(r8_floor),
                        "calls_per_s_ratio_c8": ratio_of_pairs(r8_floor, r8_sdk),
                    }
            finally:
                pump.close()
                if sdk is not None:
                    sdk.close()
            n_start = rounds * 2
            measures: list[Callable[[], float]] = [
                lambda: first_answer(pump_argv(daemon.socket, ws)),
                bare_start,
            ]
            if python:
                measures.append(lambda: first_answer([python, SDK_SERVER, "--tools", "1"]))
            starts = paired(n_start, *measures)
            data["first_answer"] = {
                "pump_ms": median(starts[0]) / 1e6,
                "python_pass_ms": median(starts[1]) / 1e6,
                "ratio_python": ratio_of_pairs(starts[0], starts[1]),
                "ratios_python": ratios(starts[0], starts[1]),
            }
            if python:
                data["first_answer"].update(
                    sdk_ms=median(starts[2]) / 1e6,
                    ratio_sdk=ratio_of_pairs(starts[0], starts[2]),
                    ratios_sdk=ratios(starts[0], starts[2]),
                )
        finally:
            daemon.stop()

        daemon = start_daemon(home1k, base, name="l")
        try:
            pump = Stdio(pump_argv(daemon.socket, ws))
            pump.start()
            sdk = Stdio([python, SDK_SERVER, "--tools", "1000"]) if python else None
            if sdk is not None:
                sdk.start()
            n_list = 10 if quick else 30
            try:

                def ours() -> float:
                    return median(pump.latency("tools/list", {}, n_list, warmup=3))

                if sdk is not None:
                    lister: Stdio = sdk
                    answer = orjson.dumps(pump.request(pump._message("tools/list", {}))["result"])
                    result_file = base / "list-result.json"
                    result_file.write_bytes(answer)
                    canned = Stdio([PYTHON, "-c", CANNED_SERVER, str(result_file)])
                    try:
                        t_ours, t_sdk, t_floor = paired(
                            rounds,
                            ours,
                            lambda: median(lister.latency("tools/list", {}, n_list, warmup=3)),
                            lambda: median(canned.latency("tools/list", {}, n_list, warmup=3)),
                        )
                    finally:
                        canned.close()
                    data["list_1000"] = {
                        "mcp_ms": median(t_ours) / 1e6,
                        "sdk_ms": median(t_sdk) / 1e6,
                        "ratio": ratio_of_pairs(t_ours, t_sdk),
                        "ratios": ratios(t_ours, t_sdk),
                        "answer_bytes": len(answer),
                        "floor_ms": median(t_floor) / 1e6,
                        "floor_ratio": ratio_of_pairs(t_floor, t_sdk),
                    }
                else:
                    data["list_1000"] = {"mcp_ms": ours() / 1e6}
            finally:
                pump.close()
                if sdk is not None:
                    sdk.close()
        finally:
            daemon.stop()

    rows: list[list[Any]] = []
    cn, fa = data["call_vs_native"], data["first_answer"]
    rows.append(
        [
            "tools/call via toolsetctl mcp / native invoke, µs",
            cn["mcp_us"],
            cn["native_us"],
            cn["ratio"],
        ]
    )
    rows.append(
        [
            "first answer / python -c pass, ms",
            fa["pump_ms"],
            fa["python_pass_ms"],
            fa["ratio_python"],
        ]
    )
    section.goals = [
        Goal.of(
            "6",
            "MCP tools/call (stdio) / native invoke",
            cn["ratios"],
            1.15,
            "<=",
            f"{cn['mcp_us']:.0f} vs {cn['native_us']:.0f} µs",
        ),
        Goal.of(
            "6",
            "first answer / python -c pass",
            fa["ratios_python"],
            2.5,
            "<=",
            f"{fa['pump_ms']:.1f} vs {fa['python_pass_ms']:.1f} ms",
        ),
    ]
    if "call_vs_sdk" in data:
        cs, cf, li = data["call_vs_sdk"], data["call_floor"], data["list_1000"]
        rows += [
            ["tools/call / SDK server, µs", cs["mcp_us"], cs["sdk_us"], cs["ratio"]],
            ["  floor: minimal MCP spawn server, µs", cf["floor_us"], cs["sdk_us"], cf["ratio"]],
            [
                "calls/s 1 in flight / SDK",
                cs["calls_per_s_c1"],
                cs["sdk_calls_per_s_c1"],
                cs["calls_per_s_ratio_c1"],
            ],
            [
                "  floor: minimal MCP spawn server",
                cf["calls_per_s_c1"],
                cs["sdk_calls_per_s_c1"],
                cf["calls_per_s_ratio_c1"],
            ],
            [
                "calls/s 8 in flight / SDK",
                cs["calls_per_s_c8"],
                cs["sdk_calls_per_s_c8"],
                cs["calls_per_s_ratio_c8"],
            ],
            [
                "  floor: minimal MCP spawn server",
                cf["calls_per_s_c8"],
                cs["sdk_calls_per_s_c8"],
                cf["calls_per_s_ratio_c8"],
            ],
            ["first answer / SDK server, ms", fa["pump_ms"], fa["sdk_ms"], fa["ratio_sdk"]],
            ["tools/list 1,000 tools / SDK, ms", li["mcp_ms"], li["sdk_ms"], li["ratio"]],
            [
                f"  floor: canned answer of {li['answer_bytes']:,} bytes, ms",
                li["floor_ms"],
                li["sdk_ms"],
                li["floor_ratio"],
            ],
        ]
        section.goals += [
            Goal.of(
                "10",
                "MCP tools/call / SDK server",
                cs["ratios"],
                0.5,
                "<=",
                f"{cs['mcp_us']:.0f} vs {cs['sdk_us']:.0f} µs (floor {cf['ratio']:.3f})",
            ),
            Goal.of(
                "10",
                "MCP calls/s (1 in flight) / SDK",
                cs["calls_per_s_ratios_c1"],
                2.0,
                ">=",
                f"{cs['calls_per_s_c1']:.0f} vs {cs['sdk_calls_per_s_c1']:.0f}/s "
                f"(floor {cf['calls_per_s_ratio_c1']:.2f})",
            ),
            Goal.of(
                "10",
                "MCP calls/s (8 in flight) / SDK",
                cs["calls_per_s_ratios_c8"],
                2.0,
                ">=",
                f"{cs['calls_per_s_c8']:.0f} vs {cs['sdk_calls_per_s_c8']:.0f}/s "
                f"(floor {cf['calls_per_s_ratio_c8']:.2f})",
            ),
            Goal.of(
                "10",
                "first answer / SDK server",
                fa["ratios_sdk"],
                0.05,
                "<=",
                f"{fa['pump_ms']:.1f} vs {fa['sdk_ms']:.0f} ms",
            ),
            Goal.of(
                "10",
                "tools/list 1,000 / SDK",
                li["ratios"],
                0.05,
                "<=",
                f"{li['mcp_ms']:.1f} vs {li['sdk_ms']:.0f} ms (floor {li['floor_ratio']:.3f})",
            ),
        ]
    print_table(
        "toolsetd's MCP face (toolsetctl mcp, raw stdio client)",
        ["what", "toolsetd MCP", "baseline", "ratio"],
        rows,
    )
    return section


def main() -> None:
    """``python -m bench.bench_mcp_face [--quick]``."""
    standalone("mcp_face", run, __doc__)


if __name__ == "__main__":
    main()
