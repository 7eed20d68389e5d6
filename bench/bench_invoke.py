"""Invoke benchmark (goal 1): a trivial exec tool through the daemon vs minimal spawn loops.

``python -m bench.bench_invoke [--quick]``

The tool set ``noop`` runs ``/bin/true`` (``"stdin": false``, ``"approval": "always"``);
the daemon runs with ``--progress-interval 60 --log-level warning --no-watch`` and
``bench._common.UNCONFINED`` (no cgroup, no sandbox, as the servers it is compared with;
goal 8, ``bench_confine``, measures those).

* Latency: sequential ``invoke`` calls on one connection (the client reads ``started`` and
  ``completed`` and stops at the response) vs ``bench._baseline --mode spawn`` (asyncio
  streams + orjson; per request ``asyncio.create_subprocess_exec('/bin/true')`` with three
  pipes, ``communicate()``, answer), same client, interleaved rounds.
* Throughput: calls/s with 1, 8 and 32 callers, each on its own connection, vs the same
  baseline server and vs a bare in-process spawn loop (``asyncio.create_subprocess_exec``
  with three pipes and ``communicate()``, N concurrent tasks).
* Bare spawn latency in process: ``asyncio.create_subprocess_exec`` (three pipes) and
  ``subprocess.run``.
* Heap: in a child process, ``Runner.run`` of the trivial call without and with a 500 MB
  touched ``bytearray`` plus ~3 M small objects (before, with, after freed); the goal is a
  ratio near 1. A control row does the same with a forced ``fork()`` spawn
  (``subprocess.run`` with a ``preexec_fn``) to show the test can see heap-dependent spawns.
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    __package__ = "bench"

import argparse
import asyncio
import functools
import gc
import json
import os
import subprocess
import time
from typing import Any

from bench._common import (
    MIN_ROUNDS,
    PYTHON,
    REPO,
    TRUE_SET,
    BlockingConn,
    Goal,
    Section,
    make_home,
    median,
    now_ns,
    paired,
    percentile,
    print_goals,
    print_table,
    ratio_of_pairs,
    ratios,
    sequential_latency,
    start_baseline,
    start_daemon,
    stop_cleanly_on_sigterm,
    temp_base,
    throughput,
    write_results,
)

DAEMON_ARGS = ["--progress-interval", "60"]


def invoke_params(workspace: Path) -> dict[str, Any]:
    return {"tool": TRUE_SET, "arguments": {}, "workspace": str(workspace)}


def trivial_call(base: Path) -> tuple[Path, dict[str, Any]]:
    """A home holding the trivial set, and the params of an invoke of it in a new workspace
    (``base/ws``)."""
    home = make_home(base, 0, trivial=True)
    workspace = base / "ws"
    workspace.mkdir()
    return home, invoke_params(workspace)


# --- bare spawn loops (in process) --------------------------------------------------------


async def _spawn_once() -> None:
    proc = await asyncio.create_subprocess_exec(
        "/bin/true",
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    await proc.communicate()


def asyncio_spawn_latency(n: int) -> list[int]:
    async def go() -> list[int]:
        for _ in range(20):
            await _spawn_once()
        out = []
        for _ in range(n):
            t0 = now_ns()
            await _spawn_once()
            out.append(now_ns() - t0)
        return out

    return asyncio.run(go())


def subprocess_run_latency(n: int) -> list[int]:
    for _ in range(20):
        subprocess.run(["/bin/true"], check=True)
    out = []
    for _ in range(n):
        t0 = now_ns()
        subprocess.run(["/bin/true"], check=True)
        out.append(now_ns() - t0)
    return out


def asyncio_spawn_throughput(concurrency: int, seconds: float) -> float:
    async def go() -> float:
        loop = asyncio.get_running_loop()
        counts = [0] * concurrency
        stop_at = loop.time() + seconds

        async def worker(i: int) -> None:
            while loop.time() < stop_at:
                await _spawn_once()
                counts[i] += 1

        t0 = now_ns()
        await asyncio.gather(*(worker(i) for i in range(concurrency)))
        return sum(counts) / ((now_ns() - t0) / 1e9)

    return asyncio.run(go())


# --- the heap child -----------------------------------------------------------------------


def _heap_child(n: int, heap_mb: int, rounds: int = MIN_ROUNDS) -> dict[str, Any]:
    """Runs in its own process: Runner.run latency without and with a large heap."""
    import anyio
    from toolsetd.daemon.model import (
        Approval,
        ApprovalSource,
        CatalogName,
        LoadedTool,
        RunnerKind,
        Source,
        ToolDef,
        ToolSet,
    )
    from toolsetd.daemon.runner import CallRequest, Runner, RunnerSettings

    from bench._common import temp_base as _tb

    class Sink:
        async def started(self, pid: int) -> None:
            pass

        async def progress(self, **kwargs: object) -> None:
            pass

    out: dict[str, Any] = {}
    with _tb() as base:
        home, ws = base / "home", base / "ws"
        set_dir = home / "tools" / TRUE_SET
        set_dir.mkdir(parents=True)
        ws.mkdir()
        tool = ToolDef(
            name=TRUE_SET,
            description="true",
            schema={"type": "object"},
            catalogs=frozenset({CatalogName.WORK}),
            approval=Approval.ALWAYS,
        )
        toolset = ToolSet(
            directory=TRUE_SET,
            source=Source.HOME,
            path=set_dir,
            runner=RunnerKind.EXEC,
            command=("/bin/true",),
            stdin=False,
            timeout_seconds=None,
            tools=(tool,),
        )
        loaded = LoadedTool(tool, toolset, Approval.ALWAYS, ApprovalSource.AUTHOR, "sha256:bench")
        runner = Runner(
            RunnerSettings(progress_interval_seconds=60), anyio.CapacityLimiter(64), os.environ
        )

        async def runner_lat(k: int) -> float:
            samples = []
            for i in range(k):
                req = CallRequest(f"c{i}", loaded, {}, ws, home)
                t0 = now_ns()
                outcome = await runner.run(req, Sink(), anyio.Event())
                samples.append(now_ns() - t0)
                assert outcome.status == "ok", outcome
            return median(samples) / 1000

        def fork_lat(k: int) -> float:
            samples = []
            for _ in range(k):
                t0 = now_ns()
                subprocess.run(["/bin/true"], check=True, preexec_fn=lambda: None)
                samples.append(now_ns() - t0)
            return median(samples) / 1000

        def vfork_lat(k: int) -> float:
            samples = []
            for _ in range(k):
                t0 = now_ns()
                subprocess.run(["/bin/true"], check=True)
                samples.append(now_ns() - t0)
            return median(samples) / 1000

        def measure(tag: str) -> None:
            out[f"runner_{tag}_us"] = anyio.run(runner_lat, n, backend="asyncio")
            out[f"asyncio_{tag}_us"] = median(asyncio_spawn_latency(n)) / 1000
            out[f"subprocess_{tag}_us"] = vfork_lat(n)
            out[f"fork_{tag}_us"] = fork_lat(max(20, n // 4))

        anyio.run(runner_lat, 30, backend="asyncio")  # warm up
        measure("before")
        # Paired rounds: the runner with the heap held, then again after it is freed.
        heap_us: list[float] = []
        free_us: list[float] = []
        for r in range(rounds):
            blob = bytearray(b"\x01") * (heap_mb << 20)  # touched pages, not lazily zeroed ones
            small = [(i, str(i)) for i in range(3_000_000)]
            out["rss_with_heap_mb"] = _rss_mb()
            if r == 0:
                measure("heap")
                heap_us.append(out["runner_heap_us"])
            else:
                heap_us.append(anyio.run(runner_lat, n, backend="asyncio"))
            del blob, small
            gc.collect()
            free_us.append(anyio.run(runner_lat, n, backend="asyncio"))
        out["rss_after_mb"] = _rss_mb()
        measure("after")
        out["runner_heap_ratios"] = [h / f for h, f in zip(heap_us, free_us, strict=True)]
    for kind in ("runner", "asyncio", "subprocess", "fork"):
        base_us = (out[f"{kind}_before_us"] + out[f"{kind}_after_us"]) / 2
        out[f"{kind}_heap_ratio"] = out[f"{kind}_heap_us"] / base_us
    out["runner_heap_ratio"] = median(out["runner_heap_ratios"])
    return out


def _rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def heap_test(n: int, heap_mb: int = 500) -> dict[str, Any]:
    out = subprocess.run(
        [PYTHON, "-m", "bench.bench_invoke", "--heap-child", str(n), "--heap-mb", str(heap_mb)],
        capture_output=True,
        text=True,
        cwd=REPO,
        check=False,
    )
    if out.returncode != 0:
        raise RuntimeError(f"heap child failed:\n{out.stderr[-4000:]}")
    result: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


# --- the run ------------------------------------------------------------------------------


def run(quick: bool = False) -> Section:
    rounds = MIN_ROUNDS if quick else 9
    n_calls = 200 if quick else 500
    seconds = 1.0 if quick else 2.0
    section = Section("invoke")
    data = section.data
    with temp_base() as base:
        home, params = trivial_call(base)
        daemon = start_daemon(home, base, extra=DAEMON_ARGS)
        spawn_srv = None
        try:
            spawn_srv = start_baseline("spawn", base, name="spawn")
            with BlockingConn(daemon.socket) as conn:  # the set is there and the call allowed
                notes: list[Any] = []
                reply = conn.request("invoke", params, notes=notes)
                if reply.get("result", {}).get("status") != "ok":
                    raise RuntimeError(f"trivial invoke failed: {reply}")
                data["notifications_per_call"] = [n.get("method") for n in notes]
                # Unconfined (bench._common.UNCONFINED), as the servers it is compared with.
                data["confinement"] = conn.request("status", {})["result"]["confinement"]
            lat: dict[str, list[int]] = {"daemon": [], "baseline": []}

            def measure(which: str, sock: Path, method: str) -> float:
                samples = sequential_latency(sock, method, params, n_calls, warmup=20)
                lat[which].extend(samples)
                return median(samples)

            d_med, b_med = paired(
                rounds,
                lambda: measure("daemon", daemon.socket, "invoke"),
                lambda: measure("baseline", spawn_srv.socket, "invoke"),
            )
            data["latency"] = {
                "daemon_median_us": median(d_med) / 1000,
                "daemon_p99_us": percentile(lat["daemon"], 99) / 1000,
                "baseline_median_us": median(b_med) / 1000,
                "baseline_p99_us": percentile(lat["baseline"], 99) / 1000,
                "ratio": ratio_of_pairs(d_med, b_med),
                "ratios": ratios(d_med, b_med),
            }
            srv = spawn_srv.socket
            for conc in (1, 8, 32):
                d, b, a = paired(
                    rounds,
                    functools.partial(throughput, daemon.socket, "invoke", params, conc, seconds),
                    functools.partial(throughput, srv, "invoke", params, conc, seconds),
                    functools.partial(asyncio_spawn_throughput, conc, seconds),
                )
                data[f"calls_per_s_c{conc}"] = {
                    "daemon": median(d),
                    "baseline_server": median(b),
                    "bare_asyncio": median(a),
                    "ratio_vs_bare": ratio_of_pairs(d, a),
                    "ratio_vs_server": ratio_of_pairs(d, b),
                    "ratios_vs_bare": ratios(d, a),
                    # The floor with a client and a socket: the minimal server pays both.
                    "server_vs_bare": ratio_of_pairs(b, a),
                }
        finally:
            daemon.stop()
            if spawn_srv is not None:
                spawn_srv.stop()
        a_lat, s_lat = paired(
            3,
            lambda: median(asyncio_spawn_latency(n_calls)),
            lambda: median(subprocess_run_latency(n_calls)),
        )
        data["bare_spawn_latency"] = {
            "asyncio_us": median(a_lat) / 1000,
            "subprocess_run_us": median(s_lat) / 1000,
        }
    data["heap"] = heap_test(100 if quick else 300)

    lt, bs, hp = data["latency"], data["bare_spawn_latency"], data["heap"]
    print_table(
        "trivial exec call, sequential on one connection",
        ["path", "median µs", "p99 µs"],
        [
            ["toolsetd invoke", lt["daemon_median_us"], lt["daemon_p99_us"]],
            ["minimal asyncio spawn server", lt["baseline_median_us"], lt["baseline_p99_us"]],
            ["bare asyncio.create_subprocess_exec (in process)", bs["asyncio_us"], ""],
            ["bare subprocess.run (in process)", bs["subprocess_run_us"], ""],
            ["Runner.run in process (heap child, no heap)", hp["runner_before_us"], ""],
        ],
    )
    print_table(
        "calls/s",
        ["callers", "toolsetd", "minimal server", "bare asyncio", "toolsetd/bare"],
        [
            [
                c,
                data[f"calls_per_s_c{c}"]["daemon"],
                data[f"calls_per_s_c{c}"]["baseline_server"],
                data[f"calls_per_s_c{c}"]["bare_asyncio"],
                data[f"calls_per_s_c{c}"]["ratio_vs_bare"],
            ]
            for c in (1, 8, 32)
        ],
    )
    print_table(
        f"spawn cost vs heap (child process, RSS with heap {hp['rss_with_heap_mb']:.0f} MB)",
        ["spawn path", "before µs", "with heap µs", "after µs", "heap ratio"],
        [
            [
                k,
                hp[f"{k}_before_us"],
                hp[f"{k}_heap_us"],
                hp[f"{k}_after_us"],
                hp[f"{k}_heap_ratio"],
            ]
            for k in ("runner", "asyncio", "subprocess", "fork")
        ],
    )
    section.goals = [
        Goal.of(
            "1",
            "invoke latency / minimal spawn server",
            lt["ratios"],
            1.15,
            "<=",
            f"{lt['daemon_median_us']:.0f} vs {lt['baseline_median_us']:.0f} µs",
        ),
        Goal.of(
            "1",
            "invoke calls/s, 8 callers / bare asyncio spawn",
            data["calls_per_s_c8"]["ratios_vs_bare"],
            0.9,
            ">=",
            f"{data['calls_per_s_c8']['daemon']:.0f} vs "
            f"{data['calls_per_s_c8']['bare_asyncio']:.0f}/s (minimal spawn server "
            f"{data['calls_per_s_c8']['server_vs_bare']:.2f})",
        ),
        Goal.of(
            "1",
            "invoke calls/s, 32 callers / bare asyncio spawn",
            data["calls_per_s_c32"]["ratios_vs_bare"],
            0.9,
            ">=",
            f"{data['calls_per_s_c32']['daemon']:.0f} vs "
            f"{data['calls_per_s_c32']['bare_asyncio']:.0f}/s (minimal spawn server "
            f"{data['calls_per_s_c32']['server_vs_bare']:.2f})",
        ),
        Goal.of(
            "1",
            "Runner spawn with 500 MB heap / without",
            hp["runner_heap_ratios"],
            1.1,
            "<=",
            f"{hp['runner_heap_us']:.0f} vs {hp['runner_before_us']:.0f} µs (fork control "
            f"{hp['fork_heap_ratio']:.1f}x)",
        ),
    ]
    return section


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--heap-child", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--heap-mb", type=int, default=500, help=argparse.SUPPRESS)
    args = parser.parse_args()
    stop_cleanly_on_sigterm()
    if args.heap_child:
        print(json.dumps(_heap_child(args.heap_child, args.heap_mb)))
        return
    t0 = time.monotonic()
    section = run(args.quick)
    print_goals(section.goals)
    path = write_results(
        "invoke",
        {
            "quick": args.quick,
            "goals": section.goals,
            **section.data,
            "seconds": time.monotonic() - t0,
        },
    )
    print(f"\nresults: {path}")


if __name__ == "__main__":
    main()
