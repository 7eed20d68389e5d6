"""Where an invoke's time goes beyond the minimal spawn server (issue 16, item 1).

``python -m bench.profile_invoke [--quick] [--cprofile DIR]``

Two views of one trivial ``invoke`` (set ``noop``: ``/bin/true``, no path arguments,
``approval: always``):

* **Stages, in process.** Each step the daemon takes for an invoke, run through the
  daemon's own objects (a real ``Registry``, ``Handlers``, ``Runner``, codec and
  loggers) in a tight loop, µs per call (median of rounds): the params check, the call
  id, the workspace check, the catalog lookup, schema validation, classification (and a
  tool with one path argument, for the path work), the classification's wire form, the
  call bookkeeping, the two log lines (filtered at ``warning``, rendered at ``info``),
  the event params, encoding the three frames, writing them (three ``send`` calls against
  one), and the spawn: ``Runner.run`` against bare ``asyncio.create_subprocess_exec`` +
  ``communicate()`` (their difference is the runner's drain set-up and bookkeeping).
  The call's cgroup (the default where the daemon owns a cgroup v2 tree) is measured end
  to end: a second daemon with ``cgroup = "off"`` in the same paired rounds.
* **End to end, under cProfile.** A daemon started under ``cProfile`` serves sequential
  invokes (1 caller) and 8 concurrent callers; the top functions by own time are printed
  per run, and with ``--cprofile DIR`` the ``.prof`` files are kept.

In the same run the daemon's invoke latency and the minimal server's are measured, so
the table ends with how much of the measured gap the stages account for.
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    __package__ = "bench"

import argparse
import asyncio
import io
import json
import os
import pstats
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Callable
from typing import Any

from bench._common import (
    MIN_ROUNDS,
    PYTHON,
    REPO,
    TRUE_SET,
    BlockingConn,
    daemon_argv,
    load,
    make_home,
    median,
    now_ns,
    paired,
    print_table,
    sequential_latency,
    start_baseline,
    start_daemon,
    stop_cleanly_on_sigterm,
    temp_base,
    throughput,
    write_results,
)
from bench.bench_confine import CONFIGS
from bench.bench_invoke import DAEMON_ARGS, invoke_params, trivial_call


def _per_call_us(fn: Callable[[], object], n: int, rounds: int) -> tuple[float, float, float]:
    """Median, min and max over ``rounds`` of the µs per call of ``fn`` run ``n`` times."""
    samples = []
    for _ in range(rounds):
        t0 = now_ns()
        for _ in range(n):
            fn()
        samples.append((now_ns() - t0) / n / 1000)
    return median(samples), min(samples), max(samples)


def _per_call_us_async(fn: Callable[[], Any], n: int, rounds: int) -> Callable[[], Any]:
    async def go() -> tuple[float, float, float]:
        samples = []
        for _ in range(rounds):
            t0 = now_ns()
            for _ in range(n):
                await fn()
            samples.append((now_ns() - t0) / n / 1000)
        return median(samples), min(samples), max(samples)

    return go


def stages(base: Path, quick: bool) -> list[tuple[str, float, float, float]]:
    """µs per call of each step of an invoke, through the daemon's own objects."""
    import anyio
    import structlog
    from toolsetd.daemon.logs import configure_logging
    from toolsetd.daemon.model import DEFAULT_RESERVED_NAMES
    from toolsetd.daemon.policy import classify
    from toolsetd.daemon.registry import Registry
    from toolsetd.daemon.runner import CallRequest, Runner, RunnerSettings
    from toolsetd.daemon.sdnotify import Notifier
    from toolsetd.daemon.service import Service, ServiceSettings, _Bookkeeping, _Call
    from toolsetd.daemon.validation import ArgumentValidators
    from toolsetd.protocol import modes as m
    from toolsetd.protocol import params as params_check
    from toolsetd.protocol.codec import encode
    from toolsetd.protocol.jsonrpc import notification_message

    n = 2000 if quick else 10000
    rounds = MIN_ROUNDS
    home = make_home(base, 0, trivial=True, name="stages-home")
    path_set = home / "tools" / "pathy"
    path_set.mkdir()
    (path_set / "tools.json").write_text(
        json.dumps(
            {
                "runner": "exec",
                "description": "Takes a path.",
                "command": ["/bin/true"],
                "schema": {"type": "object", "properties": {"file": {"type": "string"}}},
                "pathArguments": ["file"],
                "approval": "always",
                "stdin": False,
            }
        )
    )
    ws = base / "stages-ws"
    (ws / "src").mkdir(parents=True)
    (ws / "src" / "a.txt").write_text("x")
    params = invoke_params(ws)
    configure_logging("json", "warning")
    registry = Registry(home, DEFAULT_RESERVED_NAMES)
    runner = Runner(
        RunnerSettings(progress_interval_seconds=60), anyio.CapacityLimiter(64), os.environ
    )
    validators = ArgumentValidators()
    service = Service(
        ServiceSettings(socket="/x", home=home, user_home=Path.home()),
        registry,
        runner,
        validators,
        Notifier.from_environ({}),
    )
    out: list[tuple[str, float, float, float]] = []
    wsp = Path(os.path.realpath(ws))
    user_home = Path.home()

    async def go() -> None:
        catalog = await service.catalog(wsp)
        loaded = Service.lookup(catalog, TRUE_SET, None)
        pathy = Service.lookup(catalog, "pathy", None)
        mode = m.parse_mode("default")
        out.append(
            (
                "params check (protocol/params.invoke_args)",
                *_per_call_us(lambda: params_check.invoke_args(params), n, rounds),
            )
        )
        out.append(
            (
                "call id (16 random bytes + in-flight check)",
                *_per_call_us(lambda: service._check_call_id_free(os.urandom(16).hex()), n, rounds),
            )
        )
        out.append(
            (
                "workspace check (O_PATH open + /proc/self/fd)",
                *_per_call_us(lambda: Service.workspace(str(ws)), n, rounds),
            )
        )
        out.append(
            (
                "catalog lookup (registry snapshot + tool)",
                *await _per_call_us_async(lambda: service.catalog(wsp), n, rounds)(),
            )
        )
        out.append(
            (
                "  of which the tool lookup",
                *_per_call_us(lambda: Service.lookup(catalog, TRUE_SET, None), n, rounds),
            )
        )
        out.append(
            (
                "schema validation (compiled validator)",
                *_per_call_us(lambda: validators.errors(loaded, {}), n, rounds),
            )
        )
        out.append(
            (
                "classification, no path arguments",
                *_per_call_us(lambda: classify(loaded, {}, wsp, mode, False, user_home), n, rounds),
            )
        )
        args = {"file": "src/a.txt"}
        out.append(
            (
                "classification, one path argument (path work)",
                *_per_call_us(
                    lambda: classify(pathy, args, wsp, mode, False, user_home), n, rounds
                ),
            )
        )
        c = classify(loaded, {}, wsp, mode, False, user_home)
        out.append(
            ("classification.to_wire() (built for every call)", *_per_call_us(c.to_wire, n, rounds))
        )

        def bookkeeping() -> None:
            cancel = anyio.Event()
            service.calls["x"] = _Call(cancel)
            CallRequest("x", loaded, {}, wsp, home, "", "default", True)
            _Bookkeeping(None, "x", loaded)  # type: ignore[arg-type]  # no sink: never called
            service.calls.pop("x", None)

        out.append(
            (
                "call bookkeeping (cancel event, request, events)",
                *_per_call_us(bookkeeping, n, rounds),
            )
        )
        log = structlog.get_logger("toolsetd.methods")

        def two_lines() -> None:
            log.info("call_started", call_id="x", tool="noop", set="noop")
            log.info(
                "call_finished",
                call_id="x",
                tool="noop",
                status="ok",
                exit_code=0,
                duration_ms=1,
                stdout_bytes=0,
                stderr_bytes=0,
                truncated=False,
            )

        out.append(("two log lines, level warning (filtered)", *_per_call_us(two_lines, n, rounds)))
        sink = io.StringIO()
        structlog.configure(
            logger_factory=structlog.PrintLoggerFactory(sink), cache_logger_on_first_use=False
        )
        configure_logging("json", "info")
        structlog.configure(logger_factory=structlog.PrintLoggerFactory(sink))
        log = structlog.get_logger("toolsetd.methods")
        out.append(
            ("two log lines, level info (rendered JSON)", *_per_call_us(two_lines, n, rounds))
        )
        configure_logging("json", "warning")

        def frames() -> None:
            encode(
                notification_message(
                    "started", {"callId": "x", "tool": "noop", "set": "noop", "pid": 1234}
                )
            )
            encode(
                notification_message(
                    "completed",
                    {
                        "callId": "x",
                        "status": "ok",
                        "exitCode": 0,
                        "durationMs": 1,
                        "truncated": False,
                    },
                )
            )
            encode(
                {
                    "jsonrpc": "2.0",
                    "id": 1,
                    "result": {
                        "callId": "x",
                        "status": "ok",
                        "exitCode": 0,
                        "content": [{"type": "text", "text": ""}],
                        "isError": False,
                        "truncated": False,
                        "outputPath": None,
                        "durationMs": 1,
                        "stdoutBytes": 0,
                        "stderrBytes": 0,
                    },
                }
            )

        out.append(("three frames, built and encoded", *_per_call_us(frames, n, rounds)))
        a, b = socket.socketpair()
        a.setblocking(False)
        frame = b'{"jsonrpc":"2.0","method":"started","params":{"callId":"x","pid":1}}\n'

        def three_sends() -> None:
            a.send(frame)
            a.send(frame)
            a.send(frame)
            b.recv(65536)

        def one_send() -> None:
            a.send(frame * 3)
            b.recv(65536)

        out.append(("three socket sends (one per frame)", *_per_call_us(three_sends, n, rounds)))
        out.append(("one socket send (the frames joined)", *_per_call_us(one_send, n, rounds)))
        a.close()
        b.close()

        class Sink:
            started_sent = False

            async def started(self, pid: int) -> None:
                pass

            async def progress(self, **kwargs: object) -> None:
                pass

        request = CallRequest("x", loaded, {}, wsp, home, "", "default", True)
        k = 100 if quick else 300

        async def runner_once() -> None:
            await runner.run(request, Sink(), anyio.Event())

        async def bare_once() -> None:
            proc = await asyncio.create_subprocess_exec(
                "/bin/true",
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
            )
            await proc.communicate()

        for _ in range(20):
            await runner_once()
            await bare_once()
        spawn_r: list[float] = []
        spawn_b: list[float] = []
        for _ in range(rounds):
            spawn_r.append((await _per_call_us_async(runner_once, k, 1)())[0])
            spawn_b.append((await _per_call_us_async(bare_once, k, 1)())[0])
        out.append(
            (
                "Runner.run (spawn, drain, reap, outcome)",
                median(spawn_r),
                min(spawn_r),
                max(spawn_r),
            )
        )
        out.append(
            ("bare asyncio spawn + communicate()", median(spawn_b), min(spawn_b), max(spawn_b))
        )
        diffs = [r - b for r, b in zip(spawn_r, spawn_b, strict=True)]
        out.append(
            (
                "  runner beyond bare spawn (drain set-up etc.)",
                median(diffs),
                min(diffs),
                max(diffs),
            )
        )

    anyio.run(go, backend="asyncio")
    return out


def _profiled_daemon(
    base: Path, home: Path, name: str
) -> tuple[subprocess.Popen[bytes], Path, Path]:
    sock = base / f"{name}.sock"
    prof = base / f"{name}.prof"
    argv = daemon_argv(home, sock, extra=DAEMON_ARGS)
    argv = [PYTHON, "-m", "cProfile", "-o", str(prof), *argv[1:]]
    env = {**os.environ, "XDG_CACHE_HOME": str(base / "cache")}
    env.pop("TOOLSETD_SOCKET", None)
    popen = subprocess.Popen(
        argv,
        cwd=REPO,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            with BlockingConn(sock, timeout=5) as conn:
                if "result" in conn.request("status"):
                    return popen, sock, prof
        except (OSError, EOFError):
            time.sleep(0.02)
    popen.kill()
    raise RuntimeError("profiled daemon did not start")


def cprofile_runs(base: Path, quick: bool, keep: Path | None) -> dict[str, list[list[Any]]]:
    """Top own-time functions of a daemon under cProfile, 1 and 8 callers."""
    home = make_home(base, 0, trivial=True, name="prof-home")
    ws = base / "prof-ws"
    ws.mkdir()
    params = invoke_params(ws)
    tables: dict[str, list[list[Any]]] = {}
    for callers in (1, 8):
        popen, sock, prof = _profiled_daemon(base, home, f"p{callers}")
        try:
            sequential_latency(sock, "invoke", params, 20, warmup=20)
            if callers == 1:
                sequential_latency(sock, "invoke", params, 500 if quick else 2000, warmup=0)
            else:
                throughput(sock, "invoke", params, callers, 2.0 if quick else 6.0)
        finally:
            popen.send_signal(signal.SIGTERM)
            popen.wait(timeout=30)
        stats = pstats.Stats(str(prof))
        raw = stats.stats  # type: ignore[attr-defined]  # pstats keeps its table here
        total = sum(v[2] for v in raw.values())
        rows = sorted(raw.items(), key=lambda kv: kv[1][2], reverse=True)[:25]
        tables[f"c{callers}"] = [
            [f"{Path(f).name}:{line}({fn})", v[1], v[2] * 1000, 100 * v[2] / total, v[3] * 1000]
            for (f, line, fn), v in rows
        ]
        if keep is not None:
            keep.mkdir(parents=True, exist_ok=True)
            shutil.copy(prof, keep / f"invoke-c{callers}.prof")
    return tables


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument(
        "--cprofile",
        type=Path,
        default=None,
        metavar="DIR",
        help="keep the daemon's .prof files here",
    )
    args = parser.parse_args()
    stop_cleanly_on_sigterm()
    print(f"profile_invoke: load at start {load()}")
    with temp_base() as base:
        home, params = trivial_call(base)
        # bench_confine's configs that differ in the cgroup alone (no operator config is read).
        on, off = base / "cgroup-auto.toml", base / "cgroup-off.toml"
        on.write_text(CONFIGS["cgroup"])
        off.write_text(CONFIGS["none"])
        daemon = start_daemon(home, base, extra=[*DAEMON_ARGS, "--config", str(on)])
        daemon_off = start_daemon(home, base, extra=[*DAEMON_ARGS, "--config", str(off)], name="o")
        srv = start_baseline("spawn", base, name="spawn")
        try:
            with BlockingConn(daemon.socket) as conn:
                status = conn.request("status")["result"]
            cgroup_mode = ((status.get("confinement") or {}).get("cgroup") or {}).get("mode")
            n = 200 if args.quick else 500

            def lat(sock: Path) -> float:
                return median(sequential_latency(sock, "invoke", params, n, warmup=20))

            d, o, b = paired(
                MIN_ROUNDS,
                lambda: lat(daemon.socket),
                lambda: lat(daemon_off.socket),
                lambda: lat(srv.socket),
            )
        finally:
            daemon.stop()
            daemon_off.stop()
            srv.stop()
        gap = [(x - y) / 1000 for x, y in zip(d, b, strict=True)]
        cgroup_us = [(x - y) / 1000 for x, y in zip(d, o, strict=True)]
        rows = stages(base, args.quick)
        rows.append(
            (
                "the call's cgroup, end to end (cgroup auto - cgroup off)"
                if cgroup_mode == "cgroup"
                else f"(no cgroup here: mode {cgroup_mode}) cgroup auto - cgroup off",
                median(cgroup_us),
                min(cgroup_us),
                max(cgroup_us),
            )
        )
        tables = cprofile_runs(base, args.quick, args.cprofile)
    print_table(
        f"invoke latency: toolsetd {median(d) / 1000:.0f} µs, minimal server "
        f"{median(b) / 1000:.0f} µs, gap {median(gap):.0f} µs (min {min(gap):.0f}, "
        f"max {max(gap):.0f})",
        ["stage", "µs median", "min", "max"],
        [list(r) for r in rows],
    )
    for key, table in tables.items():
        print_table(
            f"cProfile, {key[1:]} caller(s): top own time",
            ["function", "calls", "own ms", "own %", "cumulative ms"],
            table,
        )
    print(f"\nload at end {load()}")
    write_results(
        "profile_invoke",
        {
            "gap_us": gap,
            "cgroup_us": cgroup_us,
            "daemon_us": median(d) / 1000,
            "baseline_us": median(b) / 1000,
            "stages": rows,
            "cprofile": tables,
        },
    )


if __name__ == "__main__":
    main()
