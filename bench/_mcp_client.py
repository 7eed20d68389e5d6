"""The MCP side of ``bench_mcp``: runs under the interpreter that has ``mcp``.

``python bench/_mcp_client.py --mode calls|list|cold|raw-calls ...`` prints one JSON line.

* ``calls``: the SDK's ``stdio_client`` + ``ClientSession`` against ``_mcp_server.py``:
  ``initialize``, warm up, then ``--n`` sequential ``tools/call noop`` (latency samples),
  then calls/s for ``--seconds`` with 1 and ``--conc`` calls in flight on the session.
* ``list``: the same client, server with ``--tools`` tools; ``--n`` sequential ``tools/list``.
* ``cold``: spawn the server with ``--tools`` tools and send ``initialize`` at once on raw
  pipes; the time to its answer (what ``status`` is for toolsetd's cold start).
* ``raw-calls``: no SDK client: NDJSON on the server's pipes (initialize, initialized,
  then ``--n`` sequential ``tools/call``), to split server cost from SDK-client cost.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

SERVER = str(Path(__file__).resolve().parent / "_mcp_server.py")
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


def _server_params(tools: int):
    from mcp import StdioServerParameters

    return StdioServerParameters(command=sys.executable, args=[SERVER, "--tools", str(tools)])


async def _calls(n: int, conc: int, seconds: float) -> dict:
    import anyio
    from mcp import ClientSession, stdio_client

    out: dict = {}
    async with stdio_client(_server_params(1)) as (read, write), ClientSession(read, write) as s:
        await s.initialize()
        for _ in range(30):
            r = await s.call_tool("noop", {})
            assert not r.is_error, r
        samples = []
        for _ in range(n):
            t0 = now_ns()
            await s.call_tool("noop", {})
            samples.append(now_ns() - t0)
        out["latency_ns"] = samples

        for c in (1, conc):
            count = 0
            stop_at = time.monotonic() + seconds

            async def worker(stop_at: float = stop_at) -> None:
                nonlocal count
                while time.monotonic() < stop_at:
                    await s.call_tool("noop", {})
                    count += 1

            t0 = now_ns()
            async with anyio.create_task_group() as tg:
                for _ in range(c):
                    tg.start_soon(worker)
            out[f"calls_per_s_c{c}"] = count / ((now_ns() - t0) / 1e9)
    return out


async def _list(tools: int, n: int) -> dict:
    from mcp import ClientSession, stdio_client

    async with (
        stdio_client(_server_params(tools)) as (read, write),
        ClientSession(read, write) as s,
    ):
        await s.initialize()
        for _ in range(2):
            r = await s.list_tools()
        assert len(r.tools) == tools, len(r.tools)
        samples = []
        for _ in range(n):
            t0 = now_ns()
            await s.list_tools()
            samples.append(now_ns() - t0)
    return {"latency_ns": samples, "tools": tools}


def _raw_request(proc: subprocess.Popen, message: dict) -> dict:
    proc.stdin.write(json.dumps(message).encode() + b"\n")
    proc.stdin.flush()
    while True:
        line = proc.stdout.readline()
        if not line:
            raise EOFError("server closed stdout")
        reply = json.loads(line)
        if reply.get("id") == message.get("id") and "method" not in reply:
            return reply


def _spawn(tools: int) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, SERVER, "--tools", str(tools)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
    )


def _stop(proc: subprocess.Popen) -> None:
    try:
        proc.stdin.close()
        proc.wait(timeout=5)
    except Exception:
        proc.kill()
        proc.wait()


def _cold(tools: int) -> dict:
    t0 = now_ns()
    proc = _spawn(tools)
    try:
        reply = _raw_request(proc, INIT)
        elapsed = now_ns() - t0
        assert "result" in reply, reply
    finally:
        _stop(proc)
    return {"ready_ns": elapsed, "tools": tools}


def _raw_calls(n: int) -> dict:
    proc = _spawn(1)
    try:
        _raw_request(proc, INIT)
        proc.stdin.write(b'{"jsonrpc": "2.0", "method": "notifications/initialized"}\n')
        proc.stdin.flush()
        samples = []
        for i in range(1, n + 31):
            message = {
                "jsonrpc": "2.0",
                "id": i,
                "method": "tools/call",
                "params": {"name": "noop", "arguments": {}},
            }
            t0 = now_ns()
            reply = _raw_request(proc, message)
            if i > 30:
                samples.append(now_ns() - t0)
            assert "result" in reply, reply
            assert not reply["result"].get("isError"), reply
    finally:
        _stop(proc)
    return {"latency_ns": samples}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument(
        "--mode", choices=["calls", "list", "cold", "raw-calls", "check"], required=True
    )
    parser.add_argument("--n", type=int, default=200)
    parser.add_argument("--tools", type=int, default=1000)
    parser.add_argument("--conc", type=int, default=8)
    parser.add_argument("--seconds", type=float, default=1.0)
    args = parser.parse_args()
    if args.mode == "check":
        from importlib.metadata import version

        import mcp  # noqa: F401

        print(json.dumps({"mcp": version("mcp"), "python": sys.version.split()[0]}))
        return
    import anyio

    if args.mode == "calls":
        out = anyio.run(_calls, args.n, args.conc, args.seconds)
    elif args.mode == "list":
        out = anyio.run(_list, args.tools, args.n)
    elif args.mode == "cold":
        out = _cold(args.tools)
    else:
        out = _raw_calls(args.n)
    print(json.dumps(out))
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
