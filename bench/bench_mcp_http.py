"""MCP over Streamable HTTP (goal 6): toolsetd's endpoint against native invoke and the SDK.

``python -m bench.bench_mcp_http [--quick]``

* ``tools/call`` of the ``/bin/true`` tool over ``toolsetd --mcp-listen`` (one session,
  keep-alive, JSON answers) against native ``invoke`` of the same tool on the same daemon:
  median latency, paired rounds (goal: <= 1.3x).
* Throughput with 8 sessions, each on its own connection with one call in flight: toolsetd's
  endpoint against the MCP Python SDK's own Streamable HTTP server (``MCPServer`` under
  uvicorn, sessions, JSON answers, its faster mode; ``bench/_mcp_http_server.py``), the same
  client driving both, in the same run (goal: >= 2x). Beside it, its floor: native
  ``invoke`` on the same daemon with 8 connections, against the same SDK rounds (an HTTP
  call costs more than a native one, so no HTTP face gets past this ratio).
* Cold start: spawn → first ``status`` answered, with the endpoint off and on (h11 and the
  HTTP modules are imported only when it is on).

Both HTTP sides are driven by the same minimal raw-socket HTTP/1.1 client, so neither pays
for a heavier client than the other.
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    __package__ = "bench"

import asyncio
import socket
import subprocess
import time
from typing import Any

import orjson

from bench._common import (
    MIN_ROUNDS,
    PYTHON,
    REPO,
    TRUE_SET,
    Goal,
    Section,
    make_home,
    median,
    open_kept_buffer,
    paired,
    print_table,
    ratio_of_pairs,
    ratios,
    sequential_latency,
    standalone,
    start_daemon,
    temp_base,
    throughput,
)
from bench.bench_invoke import DAEMON_ARGS, invoke_params

_INIT = {
    "protocolVersion": "2025-11-25",
    "capabilities": {},
    "clientInfo": {"name": "bench", "version": "1"},
}


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class HttpMcp:
    """A minimal asyncio HTTP/1.1 MCP client: one keep-alive connection, one session."""

    def __init__(self, port: int, path: str) -> None:
        self.port = port
        self.path = path
        self.session: str | None = None
        self._id = 0
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.Transport | None = None

    async def open(self) -> None:
        self._reader, self._writer = await open_kept_buffer(host="127.0.0.1", port=self.port)
        _, headers = await self.post(
            {"jsonrpc": "2.0", "id": 0, "method": "initialize", "params": _INIT}
        )
        self.session = headers.get("mcp-session-id")
        await self.post({"jsonrpc": "2.0", "method": "notifications/initialized"})

    async def close(self) -> None:
        if self._writer is not None:
            self._writer.close()

    async def post(self, message: dict[str, Any]) -> tuple[Any, dict[str, str]]:
        assert self._reader is not None
        assert self._writer is not None
        body = orjson.dumps(message)
        head = (
            f"POST {self.path} HTTP/1.1\r\nHost: 127.0.0.1:{self.port}\r\n"
            "Content-Type: application/json\r\nAccept: application/json, text/event-stream\r\n"
            f"Content-Length: {len(body)}\r\n"
        )
        if self.session:
            head += f"Mcp-Session-Id: {self.session}\r\nMcp-Protocol-Version: 2025-11-25\r\n"
        self._writer.write(head.encode() + b"\r\n" + body)
        raw = await self._reader.readuntil(b"\r\n\r\n")
        lines = raw.decode("latin-1").split("\r\n")
        status = int(lines[0].split(" ")[1])
        headers = {}
        for line in lines[1:]:
            if ":" in line:
                k, v = line.split(":", 1)
                headers[k.strip().lower()] = v.strip()
        if "content-length" in headers:
            data = await self._reader.readexactly(int(headers["content-length"]))
        elif headers.get("transfer-encoding") == "chunked":
            data = b""
            while True:
                size = int((await self._reader.readuntil(b"\r\n")).strip(), 16)
                chunk = await self._reader.readexactly(size + 2)
                if size == 0:
                    break
                data += chunk[:-2]
        else:
            data = b""
        if status >= 400:
            raise RuntimeError(f"HTTP {status}: {data[:300]!r}")
        if not data:
            return None, headers
        if headers.get("content-type", "").startswith("text/event-stream"):
            for block in data.decode().split("\n\n"):
                for line in block.splitlines():
                    if line.startswith("data:") and line[5:].strip():
                        found = orjson.loads(line[5:])
                        if "id" in found and "method" not in found:
                            return found, headers
            raise RuntimeError(f"no answer in the SSE body: {data[:300]!r}")
        return orjson.loads(data), headers

    async def call(self, name: str) -> Any:
        self._id += 1
        reply, _ = await self.post(
            {
                "jsonrpc": "2.0",
                "id": self._id,
                "method": "tools/call",
                "params": {"name": name, "arguments": {}},
            }
        )
        result = reply.get("result") if isinstance(reply, dict) else None
        if not isinstance(result, dict) or result.get("isError"):
            raise RuntimeError(f"tools/call {name} failed: {reply}")
        return result


async def http_latency(port: int, path: str, tool: str, n: int, warmup: int) -> list[float]:
    """``n`` sequential ``tools/call`` of ``tool`` in a new session on one keep-alive
    connection, after ``warmup`` calls; the round trip of each in ns."""
    client = HttpMcp(port, path)
    await client.open()
    try:
        for _ in range(warmup):
            await client.call(tool)
        out: list[float] = []
        for _ in range(n):
            t0 = time.perf_counter_ns()
            await client.call(tool)
            out.append(float(time.perf_counter_ns() - t0))
        return out
    finally:
        await client.close()


async def _throughput(port: int, path: str, tool: str, sessions: int, seconds: float) -> float:
    clients = [HttpMcp(port, path) for _ in range(sessions)]
    for client in clients:
        await client.open()
    counts = [0] * sessions
    loop = asyncio.get_running_loop()
    deadline = loop.time() + seconds

    async def worker(i: int) -> None:
        while loop.time() < deadline:
            await clients[i].call(tool)
            counts[i] += 1

    t0 = time.perf_counter_ns()
    try:
        await asyncio.gather(*(worker(i) for i in range(sessions)))
    finally:
        for client in clients:
            await client.close()
    return sum(counts) / ((time.perf_counter_ns() - t0) / 1e9)


def _wait_http(port: int, proc: subprocess.Popen[bytes], timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited early ({proc.returncode})")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                return
        except OSError:
            time.sleep(0.02)
    raise RuntimeError("the HTTP server did not start")


def _cold(home: Path, base: Path, extra: list[str]) -> float:
    daemon = start_daemon(home, base, extra=extra, name="cold")
    daemon.stop()
    return daemon.ready_ns


def run(quick: bool = False) -> Section:
    rounds = MIN_ROUNDS if quick else 7
    n_calls = 200 if quick else 500
    seconds = 1.0 if quick else 2.0
    section = Section("mcp_http")
    data = section.data
    with temp_base() as base:
        home = make_home(base, 0, trivial=True, name="home")
        ws = base / "ws"
        ws.mkdir()
        params = invoke_params(ws)
        port = free_port()
        path = f"/mcp?workspace={ws}"
        daemon = start_daemon(home, base, extra=[*DAEMON_ARGS, "--mcp-listen", f"127.0.0.1:{port}"])
        sdk_port = free_port()
        sdk = subprocess.Popen(
            [PYTHON, str(REPO / "bench" / "_mcp_http_server.py"), str(sdk_port)],
            stdout=subprocess.DEVNULL,
            stderr=(base / "sdk.log").open("wb"),
        )
        try:
            _wait_http(sdk_port, sdk)
            sequential_latency(daemon.socket, "invoke", params, 50, warmup=20)
            asyncio.run(http_latency(port, path, TRUE_SET, 50, 20))
            asyncio.run(http_latency(sdk_port, "/mcp", "noop", 20, 10))

            native, over_http = paired(
                rounds,
                lambda: median(
                    [
                        float(t)
                        for t in sequential_latency(daemon.socket, "invoke", params, n_calls, 10)
                    ]
                ),
                lambda: median(asyncio.run(http_latency(port, path, TRUE_SET, n_calls, 10))),
            )
            # The floor: native invoke on the same daemon, 8 connections with one call
            # each in flight. HTTP adds to each call, so its calls/s stay below this.
            ts_rps, sdk_rps, native_rps = paired(
                rounds,
                lambda: asyncio.run(_throughput(port, path, TRUE_SET, 8, seconds)),
                lambda: asyncio.run(_throughput(sdk_port, "/mcp", "noop", 8, seconds)),
                lambda: throughput(daemon.socket, "invoke", params, 8, seconds),
            )
            sdk_lat = median(asyncio.run(http_latency(sdk_port, "/mcp", "noop", n_calls // 2, 10)))
        finally:
            daemon.stop()
            sdk.terminate()
            try:
                sdk.wait(timeout=20)
            except subprocess.TimeoutExpired:
                sdk.kill()
                sdk.wait()
        off, on = paired(
            rounds,
            lambda: _cold(home, base, list(DAEMON_ARGS)),
            lambda: _cold(home, base, [*DAEMON_ARGS, "--mcp-listen", f"127.0.0.1:{free_port()}"]),
        )
    data["call"] = {
        "native_invoke_median_us": median(native) / 1000,
        "http_tools_call_median_us": median(over_http) / 1000,
        "sdk_http_tools_call_median_us": sdk_lat / 1000,
        "latency_ratio": ratio_of_pairs(over_http, native),
        "latency_ratios": ratios(over_http, native),
    }
    data["throughput_8"] = {
        "toolsetd_calls_per_s": median(ts_rps),
        "sdk_calls_per_s": median(sdk_rps),
        "ratio": ratio_of_pairs(ts_rps, sdk_rps),
        "ratios": ratios(ts_rps, sdk_rps),
        "native_calls_per_s": median(native_rps),
        "floor_ratio": ratio_of_pairs(native_rps, sdk_rps),
    }
    data["cold_start"] = {
        "off_ms": median(off) / 1e6,
        "on_ms": median(on) / 1e6,
        "ratio": ratio_of_pairs(on, off),
    }
    c, t, k = data["call"], data["throughput_8"], data["cold_start"]
    print_table(
        "MCP over Streamable HTTP",
        ["what", "toolsetd HTTP", "baseline", "ratio"],
        [
            [
                "tools/call vs native invoke, median µs",
                c["http_tools_call_median_us"],
                c["native_invoke_median_us"],
                c["latency_ratio"],
            ],
            [
                "  the SDK's HTTP server, tools/call median µs",
                "",
                c["sdk_http_tools_call_median_us"],
                "",
            ],
            [
                "calls/s, 8 sessions, vs the SDK's HTTP server",
                t["toolsetd_calls_per_s"],
                t["sdk_calls_per_s"],
                t["ratio"],
            ],
            [
                "  floor: native invoke, 8 connections, calls/s",
                t["native_calls_per_s"],
                "",
                t["floor_ratio"],
            ],
            ["cold start, endpoint on vs off, ms", k["on_ms"], k["off_ms"], k["ratio"]],
        ],
    )
    section.goals = [
        Goal.of(
            "6",
            "tools/call over HTTP / native invoke",
            c["latency_ratios"],
            1.3,
            "<=",
            f"{c['http_tools_call_median_us']:.0f} vs {c['native_invoke_median_us']:.0f} µs",
        ),
        Goal.of(
            "6",
            "HTTP calls/s (8 sessions) / SDK Streamable HTTP",
            t["ratios"],
            2.0,
            ">=",
            f"{t['toolsetd_calls_per_s']:.0f} vs {t['sdk_calls_per_s']:.0f}/s "
            f"(floor {t['floor_ratio']:.2f})",
        ),
    ]
    return section


def main() -> None:
    """``python -m bench.bench_mcp_http [--quick]``."""
    standalone("mcp_http", run, __doc__)


if __name__ == "__main__":
    main()
