"""Confinement benchmark (goal 8): invoke with a cgroup per call and with the sandbox.

``python -m bench.bench_confine [--quick]``

Four daemons in the same run serve the trivial ``noop`` home set (``/bin/true``), each with
its own ``[confinement]`` table: nothing (``cgroup = "off"``, ``sandbox = "off"``), the
cgroup alone, the sandbox alone (``[confinement.home] profile = "workspace-write"``), both.

* Latency: sequential ``invoke`` calls, cgroup vs nothing and sandbox vs nothing,
  interleaved rounds; the ratio is the median of the per-round ratios.
* Throughput: calls/s at 8 callers, both vs nothing, interleaved.
* The spawn alternatives, in process (``subprocess.Popen`` of ``/bin/true`` with three pipes,
  waited): bare; the joining shell the runner uses; a blocker shell that the parent moves
  into the cgroup and releases through a pipe; the same shell without the move (its exec
  alone); bubblewrap with and without a network namespace.

A machine without a writable cgroup v2 tree or without bubblewrap reports the rows it can
and says why the others are missing.
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    __package__ = "bench"

import errno
import os
import shutil
import subprocess
import time
from collections.abc import Callable
from typing import Any

from toolsetd.daemon.cgroup import JOIN_ARGV, CgroupTree, Limits

from bench._common import (
    MIN_ROUNDS,
    UNCONFINED,
    BlockingConn,
    Goal,
    Section,
    median,
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
from bench.bench_invoke import trivial_call

CONFIGS = {
    "none": UNCONFINED,
    "cgroup": '[confinement]\ncgroup = "auto"\nsandbox = "off"\n',
    "sandbox": '[confinement]\ncgroup = "off"\n[confinement.home]\nprofile = "workspace-write"\n',
    "both": '[confinement]\ncgroup = "auto"\n[confinement.home]\nprofile = "workspace-write"\n',
}
#: Waits for a line on the descriptor named by its first argument, closes it, then runs the
#: rest (the descriptor is whatever ``os.pipe`` gave: not always 3).
BLOCK = 'fd=$1; shift; eval "read _ <&$fd; exec $fd<&-"; exec "$@"'


def _status(sock: Path) -> dict[str, Any]:
    with BlockingConn(sock) as conn:
        reply: dict[str, Any] = conn.request("status", {})["result"]["confinement"]
        return reply


# --- spawn alternatives, in process --------------------------------------------------------


def _popen(argv: list[str], **kw: Any) -> subprocess.Popen[bytes]:
    p = subprocess.Popen(
        argv,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,
        **kw,
    )
    return p


def _rmdir(path: str) -> None:
    for _ in range(10_000):
        try:
            os.rmdir(path)
            return
        except OSError as exc:
            if exc.errno != errno.EBUSY:
                raise
            time.sleep(0.0001)


def spawn_alternatives(n: int, rounds: int) -> dict[str, Any]:
    """Median µs per spawn+wait of each way of starting a child (inside a cgroup or not)."""
    tree = None
    tree, why = CgroupTree.probe("auto")
    counter = iter(range(10**9))
    bwrap = shutil.which("bwrap")

    def base() -> None:
        _popen(["/bin/true"]).communicate()

    def shell() -> None:
        _popen(["/bin/sh", "-c", 'shift; exec "$@"', "sh", "x", "/bin/true"]).communicate()

    def join() -> None:
        assert tree is not None
        call = tree.create(Limits(), "bench")
        _popen([*JOIN_ARGV, call.procs, "/bin/true"]).communicate()
        call.files.close()  # the descriptors the tree kept for it
        _rmdir(call.path)

    def enter() -> None:
        assert tree is not None
        call = tree.create(Limits(), "bench")
        with tree.entered(call):
            p = _popen(["/bin/true"])
        p.communicate()
        call.files.close()  # the descriptors the tree kept for it
        _rmdir(call.path)

    def blocker() -> None:
        assert tree is not None
        path = os.path.join(tree.folder, f"b{next(counter)}")
        os.mkdir(path)
        r, w = os.pipe()
        p = _popen(["/bin/sh", "-c", BLOCK, "sh", str(r), "/bin/true"], pass_fds=(r,))
        os.close(r)
        with open(path + "/cgroup.procs", "w") as f:
            f.write(str(p.pid))
        os.write(w, b"\n")
        os.close(w)
        p.communicate()
        _rmdir(path)

    bw = [
        bwrap or "bwrap",
        "--die-with-parent",
        "--unshare-pid",
        "--ro-bind",
        "/",
        "/",
        "--dev",
        "/dev",
        "--proc",
        "/proc",
        "--tmpfs",
        "/tmp",  # noqa: S108 -- a mount point inside the sandbox
    ]

    def bwrap_net() -> None:
        _popen([*bw, "--", "/bin/true"]).communicate()

    def bwrap_nonet() -> None:
        _popen([*bw, "--unshare-net", "--", "/bin/true"]).communicate()

    measures: dict[str, Callable[[], None]] = {"popen /bin/true": base, "sh exec": shell}
    if tree is not None:
        measures["daemon steps in (default)"] = enter
        measures["join shell (sets with memory/pids limits)"] = join
        measures["blocker + move + release"] = blocker
    if bwrap:
        measures["bwrap, network kept"] = bwrap_net
        measures["bwrap, network denied"] = bwrap_nonet

    def timed(fn: Callable[[], None]) -> Callable[[], float]:
        def run() -> float:
            samples: list[float] = []
            for _ in range(n):
                t = time.perf_counter_ns()
                fn()
                samples.append(time.perf_counter_ns() - t)
            return median(samples) / 1000

        return run

    try:
        for fn in measures.values():
            fn()
        results = paired(rounds, *(timed(fn) for fn in measures.values()))
    finally:
        if tree is not None:
            tree.close()
    out: dict[str, Any] = {name: median(r) for name, r in zip(measures, results, strict=True)}
    out["ratios_vs_popen"] = {
        name: ratio_of_pairs(r, results[0]) for name, r in zip(measures, results, strict=True)
    }
    if tree is None:
        out["cgroup_missing"] = why
    if not bwrap:
        out["bwrap_missing"] = "bwrap not on PATH"
    return out


# --- through the daemon ---------------------------------------------------------------------


def run(quick: bool = False) -> Section:
    rounds = 5 if quick else 9
    n_calls = 100 if quick else 300
    seconds = 1.0 if quick else 2.0
    section = Section("confine")
    data = section.data
    with temp_base() as base:
        home, params = trivial_call(base)
        daemons = {}
        try:
            for name, config in CONFIGS.items():
                path = base / f"{name}.toml"
                path.write_text(config)
                daemons[name] = start_daemon(
                    home,
                    base,
                    name=name,
                    extra=["--progress-interval", "60", "--config", str(path)],
                )
            modes = {name: _status(d.socket) for name, d in daemons.items()}
            data["modes"] = modes
            for name, d in daemons.items():
                with BlockingConn(d.socket) as conn:
                    reply = conn.request("invoke", params)
                    if reply.get("result", {}).get("status") != "ok":
                        raise RuntimeError(f"trivial invoke under {name} failed: {reply}")

            def latency(name: str) -> float:
                samples = sequential_latency(daemons[name].socket, "invoke", params, n_calls, 10)
                return median([float(x) for x in samples])

            none, cg, sb = paired(
                rounds,
                lambda: latency("none"),
                lambda: latency("cgroup"),
                lambda: latency("sandbox"),
            )
            data["latency_us"] = {
                "none": median(none) / 1000,
                "cgroup": median(cg) / 1000,
                "sandbox": median(sb) / 1000,
                "cgroup_ratio": ratio_of_pairs(cg, none),
                "sandbox_ratio": ratio_of_pairs(sb, none),
                "cgroup_ratios": ratios(cg, none),
                "sandbox_ratios": ratios(sb, none),
            }
            t_none, t_both = paired(
                max(MIN_ROUNDS, rounds // 2),
                lambda: throughput(daemons["none"].socket, "invoke", params, 8, seconds),
                lambda: throughput(daemons["both"].socket, "invoke", params, 8, seconds),
            )
            data["calls_per_s_c8"] = {
                "none": median(t_none),
                "both": median(t_both),
                "ratio": ratio_of_pairs(t_both, t_none),
                "ratios": ratios(t_both, t_none),
            }
        finally:
            for d in daemons.values():
                d.stop()
    data["spawn_alternatives_us"] = spawn_alternatives(50 if quick else 200, 3 if quick else 5)
    lat = data["latency_us"]
    active = {name: (m["cgroup"]["mode"], m["sandbox"]["mechanism"]) for name, m in modes.items()}
    print_table(
        "confinement modes",
        ["daemon", "cgroup", "sandbox"],
        [[name, *mode] for name, mode in active.items()],
    )
    print_table(
        "invoke latency (µs, median)",
        ["none", "cgroup", "sandbox"],
        [[lat["none"], lat["cgroup"], lat["sandbox"]]],
    )
    alternatives = data["spawn_alternatives_us"]
    print_table(
        "spawn alternatives (µs per spawn+wait, median; ratio vs popen)",
        ["how", "µs", "ratio"],
        [
            [k, v, alternatives["ratios_vs_popen"][k]]
            for k, v in alternatives.items()
            if isinstance(v, float)
        ],
    )
    note = "" if active["both"] == ("cgroup", "bubblewrap") else f" (modes: {active['both']})"
    # What bubblewrap alone adds to a spawn (in process), over the unconfined call: no
    # daemon can make a sandboxed call cheaper than that.
    sandbox_floor = ""
    if "bwrap, network denied" in alternatives:
        extra = alternatives["bwrap, network denied"] - alternatives["popen /bin/true"]
        sandbox_floor = f" (floor {1 + extra / lat['none']:.2f}: bubblewrap's own start-up)"
    section.goals = [
        Goal.of(
            "8",
            "invoke latency, cgroup on / off",
            lat["cgroup_ratios"],
            1.3,
            "<=",
            f"{lat['cgroup']:.0f} vs {lat['none']:.0f} µs{note}",
        ),
        Goal.of(
            "8",
            "invoke latency, sandbox on / off",
            lat["sandbox_ratios"],
            1.5,
            "<=",
            f"{lat['sandbox']:.0f} vs {lat['none']:.0f} µs{sandbox_floor}",
        ),
        Goal.of(
            "8",
            "calls/s at 8 callers, both on / off",
            data["calls_per_s_c8"]["ratios"],
            0.7,
            ">=",
            f"{data['calls_per_s_c8']['both']:.0f} vs {data['calls_per_s_c8']['none']:.0f}/s",
        ),
    ]
    return section


def main() -> None:
    standalone("confine", run, __doc__)


if __name__ == "__main__":
    main()
