"""Call latency of this tree against another checkout's daemon, paired: native, MCP over
HTTP or MCP over stdio.

``python -m bench.ab_invoke --against DIR [--face native|http|stdio] [--rounds 15] [--calls 300]``

``DIR`` is another checkout of toolsetd with its own venv (``DIR/.venv/bin/python``), for
example the code before a change::

    git worktree add /tmp/before HEAD~1 && make -C /tmp/before .venv/.installed

Two daemons run side by side on one home with the trivial set (``noop``: ``/bin/true``):
this tree's and ``DIR``'s (both unconfined, ``--log-level warning``, as the invoke
benchmark runs them). Each round measures the median latency of ``--calls`` sequential
calls on each series, in an order that alternates every round. Printed: each series'
median over the rounds and the median CPU time its server's main thread spent per call
(``/proc/<pid>/schedstat``, in ns, each round's 10 warm-up calls included: a busy
machine's scheduling moves it less than a latency; a call alone runs on the daemon's loop,
spawn included), and the per-round ratios of both (median; range of the latency's).

``--face native`` (the default): native ``invoke`` on each daemon, beside the minimal spawn
server (the floor); ratios this / other, this / floor and other / floor. The issue-16 pass
that added it used it to tell a change of a few per cent from the noise that moves whole
runs by more.

``--face http``: both daemons also listen for MCP over HTTP (``--mcp-listen``), and the
series are ``tools/call`` over HTTP with ``bench_mcp_http``'s client (one session, one
keep-alive connection, a new session each round) and native ``invoke`` on each daemon;
ratios this / other over HTTP, each daemon's HTTP / native (goal 6's row, per side) and
this / other native. A change that moves the HTTP face alone moves the first two; one in
the shared invoke path moves the native ratio too.

``--face stdio``: the same four series and ratios with ``tools/call`` through each tree's
own ``toolsetctl mcp`` (its pump, started with that tree's interpreter, on its own daemon;
``bench_mcp_face``'s raw client), in place of HTTP: goal 6's stdio row, per side. The CPU
column of a stdio series is the pump's main thread, where a pump change shows; the
daemon's is in the native series.
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    __package__ = "bench"

import argparse
import asyncio
from collections.abc import Callable
from typing import Any

from bench._common import (
    PYTHON,
    TRUE_SET,
    Proc,
    against_python,
    daemon_argv,
    load,
    median,
    paired,
    print_table,
    ratios,
    sequential_latency,
    spawn_server,
    start_baseline,
    temp_base,
)
from bench.bench_invoke import DAEMON_ARGS, trivial_call
from bench.bench_mcp_face import Stdio
from bench.bench_mcp_http import free_port, http_latency


def _native(server: Proc, params: Any, calls: int) -> Callable[[], float]:
    """A measure: the median µs of ``calls`` sequential native invokes on ``server``."""
    return lambda: median(sequential_latency(server.socket, "invoke", params, calls, 10)) / 1000


def _http(port: int, path: str, calls: int) -> Callable[[], float]:
    """A measure: the median µs of ``calls`` sequential ``tools/call`` over MCP HTTP."""
    return lambda: median(asyncio.run(http_latency(port, path, TRUE_SET, calls, 10))) / 1000


def _stdio(pump: Stdio, calls: int) -> Callable[[], float]:
    """A measure: the median µs of ``calls`` sequential ``tools/call`` through ``pump``."""
    call = {"name": TRUE_SET, "arguments": {}}
    return lambda: median(pump.latency("tools/call", call, calls, 10)) / 1000


def _pump(python: str, sock: Path, workspace: str) -> Stdio:
    """``toolsetctl mcp`` of the tree whose interpreter is ``python``, initialized."""
    pump = Stdio(
        [
            python,
            "-m",
            "toolsetd.client",
            "--socket",
            str(sock),
            "--workspace",
            workspace,
            "mcp",
            "--no-autostart",
        ]
    )
    pump.start()
    return pump


def _cpu_ns(pid: int) -> int:
    """The CPU time of process ``pid``'s main thread so far, in ns."""
    with open(f"/proc/{pid}/schedstat") as f:
        return int(f.read().split()[0])


def _counting(measure: Callable[[], float], pid: int, spent: list[int]) -> Callable[[], float]:
    """``measure``, adding the CPU ns the main thread of ``pid`` spends in each run to
    ``spent``."""

    def run() -> float:
        before = _cpu_ns(pid)
        value = measure()
        spent.append(_cpu_ns(pid) - before)
        return value

    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--against", required=True, type=Path, help="a checkout with .venv")
    parser.add_argument("--face", choices=("native", "http", "stdio"), default="native")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--calls", type=int, default=300)
    args = parser.parse_args()
    other_python = against_python(parser, args.against)
    http = args.face == "http"
    stdio = args.face == "stdio"
    print(f"load at start: {load()}")
    with temp_base() as base:
        home, params = trivial_call(base)
        path = f"/mcp?workspace={params['workspace']}"
        servers: list[Proc] = []
        ports: list[int] = []  # the daemons' MCP HTTP ports (--face http)
        pumps: list[Stdio] = []  # each tree's toolsetctl mcp (--face stdio)
        measures: dict[str, Callable[[], float]] = {}
        spent: dict[str, list[int]] = {}  # CPU ns of the measured server, per round

        def add(name: str, measure: Callable[[], float], server: Proc) -> None:
            spent[name] = []
            measures[name] = _counting(measure, server.popen.pid, spent[name])

        try:
            for side, python in (("this", PYTHON), ("other", str(other_python))):
                sock = base / f"{side}.sock"
                port = free_port()
                extra = [*DAEMON_ARGS, "--mcp-listen", f"127.0.0.1:{port}"] if http else DAEMON_ARGS
                argv = daemon_argv(home, sock, extra=extra)
                argv[0] = python
                server = spawn_server(argv, sock, base / f"{side}.log")
                servers.append(server)
                if http:
                    ports.append(port)
                    add(f"{side} http", _http(port, path, args.calls), server)
                    add(f"{side} native", _native(server, params, args.calls), server)
                elif stdio:
                    pumps.append(_pump(python, sock, params["workspace"]))
                    spent[f"{side} stdio"] = []
                    measures[f"{side} stdio"] = _counting(
                        _stdio(pumps[-1], args.calls), pumps[-1].proc.pid, spent[f"{side} stdio"]
                    )
                    add(f"{side} native", _native(server, params, args.calls), server)
                else:
                    add(side, _native(server, params, args.calls), server)
            if not (http or stdio):
                servers.append(start_baseline("spawn", base, name="floor"))
                add("floor", _native(servers[-1], params, args.calls), servers[-1])
            for server in servers:  # warm up: the set's catalog, the code paths, the caches
                sequential_latency(server.socket, "invoke", params, 100, warmup=20)
            for port in ports:  # and the HTTP face's
                asyncio.run(http_latency(port, path, TRUE_SET, 50, 20))
            for pump in pumps:  # or the stdio face's
                pump.latency("tools/call", {"name": TRUE_SET, "arguments": {}}, 50, 20)
            series = dict(zip(measures, paired(args.rounds, *measures.values()), strict=True))
        finally:
            for pump in pumps:
                pump.close()
            for server in servers:
                server.stop()
    named = {"this": "this tree", "other": str(args.against), "floor": "floor"}

    def shown(name: str) -> str:
        side, _, face = name.partition(" ")
        return f"{named[side]} {face}".strip()

    cpu = {  # µs of CPU per call, per round
        name: [ns / 1000 / (args.calls + 10) for ns in per_round]
        for name, per_round in spent.items()
    }
    print_table(
        f"{args.face} latency, {args.rounds} rounds of {args.calls} calls (µs, medians)",
        ["series", "median", "CPU per call", "rounds"],
        [
            [shown(name), median(values), median(cpu[name]), " ".join(f"{x:.0f}" for x in values)]
            for name, values in series.items()
        ],
    )
    face = args.face
    pairs = (
        [
            (f"this / other, {face}", f"this {face}", f"other {face}"),
            (f"this {face} / native", f"this {face}", "this native"),
            (f"other {face} / native", f"other {face}", "other native"),
            ("this / other, native", "this native", "other native"),
        ]
        if http or stdio
        else [
            ("this / other", "this", "other"),
            ("this / floor", "this", "floor"),
            ("other / floor", "other", "floor"),
        ]
    )
    rows = []
    for what, a, b in pairs:
        per_round = ratios(series[a], series[b])
        rows.append(
            [
                what,
                median(per_round),
                f"{min(per_round):.3f}-{max(per_round):.3f}",
                median(ratios(cpu[a], cpu[b])),
                " ".join(f"{x:.3f}" for x in per_round),
            ]
        )
    print_table(
        "paired ratios (per round) of the latency, and of the CPU per call",
        ["ratio", "median", "range", "CPU", "rounds"],
        rows,
    )
    print(f"load at end: {load()}")


if __name__ == "__main__":
    main()
