"""Drain benchmark: the runner against a C reader, one stream and both at once.

Usage: ``.venv/bin/python bench/bench_drain.py [--size-mib 1024] [--repeat 5]``

For each case the same writer (``head -c N /dev/zero``, on stdout, or on stdout and stderr
at once) is drained twice per round: by a tiny C program compiled with ``cc`` into a temp
directory (pipes enlarged to 1 MiB like the runner's, ``poll`` + 1 MiB ``read``), and by
``Runner.run`` with its default settings (output limit, 64 MiB spill cap included). It prints
the median throughput of each, their ratio (goal: >= 0.5 for one stream, >= 0.85 for both),
and the runner's peak RSS growth during the flood (goal: <= 8 MiB). Not part of the test suite.
Set ``CAP=<bytes>`` to change the spill cap (``CAP=0`` measures draining without the spill
file's disk writes).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

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

C_READER = r"""
#define _GNU_SOURCE
#include <fcntl.h>
#include <poll.h>
#include <spawn.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>
extern char **environ;
static char buf[1 << 20];
int main(int argc, char **argv) {
    int out[2], err[2];
    if (pipe2(out, O_CLOEXEC) || pipe2(err, O_CLOEXEC)) return 2;
    fcntl(out[1], F_SETPIPE_SZ, 1 << 20);
    fcntl(err[1], F_SETPIPE_SZ, 1 << 20);
    struct timespec t0, t1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    posix_spawn_file_actions_t fa;
    posix_spawn_file_actions_init(&fa);
    posix_spawn_file_actions_adddup2(&fa, out[1], 1);
    posix_spawn_file_actions_adddup2(&fa, err[1], 2);
    char *args[] = {"/bin/sh", "-c", argv[1], NULL};
    pid_t pid;
    if (posix_spawn(&pid, "/bin/sh", &fa, NULL, args, environ)) return 3;
    close(out[1]); close(err[1]);
    struct pollfd p[2] = {{out[0], POLLIN, 0}, {err[0], POLLIN, 0}};
    int open_ = 2; long long total = 0;
    while (open_) {
        if (poll(p, 2, -1) < 0) return 4;
        for (int i = 0; i < 2; i++) {
            if (p[i].fd < 0 || !p[i].revents) continue;
            ssize_t n = read(p[i].fd, buf, sizeof buf);
            if (n <= 0) { close(p[i].fd); p[i].fd = -1; open_--; } else total += n;
        }
    }
    int status; waitpid(pid, &status, 0);
    clock_gettime(CLOCK_MONOTONIC, &t1);
    printf("%lld %.6f\n", total, (t1.tv_sec - t0.tv_sec) + (t1.tv_nsec - t0.tv_nsec) / 1e9);
    return 0;
}
"""


def _writer(size: int, both: bool) -> str:
    one = f"head -c {size} /dev/zero"
    return f"{one} & {one} >&2; wait" if both else one


def _c_run(binary: Path, command: str) -> tuple[int, float]:
    out = subprocess.run([str(binary), command], capture_output=True, check=True, text=True)
    total, seconds = out.stdout.split()
    return int(total), float(seconds)


def _rss() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


class _Sink:
    async def started(self, pid: int) -> None:
        pass

    async def progress(self, **kwargs: object) -> None:
        pass


def _loaded(set_dir: Path, command: str) -> LoadedTool:
    tool = ToolDef(
        name="flood",
        description="flood",
        schema={"type": "object"},
        catalogs=frozenset({CatalogName.WORK}),
        approval=Approval.INHERIT,
    )
    toolset = ToolSet(
        directory=set_dir.name,
        source=Source.HOME,
        path=set_dir,
        runner=RunnerKind.EXEC,
        command=("/bin/sh", "-c", command),
        stdin=False,
        timeout_seconds=None,
        tools=(tool,),
    )
    return LoadedTool(tool, toolset, Approval.INHERIT, ApprovalSource.AUTHOR, "sha256:bench")


async def _runner_run(runner: Runner, root: Path, command: str) -> tuple[int, float, int]:
    set_dir = root / "home" / "tools" / "bench"
    set_dir.mkdir(parents=True, exist_ok=True)
    (root / "ws").mkdir(exist_ok=True)
    request = CallRequest("bench", _loaded(set_dir, command), {}, root / "ws", root / "home")
    base = _rss()
    peak = base
    done = False

    async def sample() -> None:
        nonlocal peak
        while not done:
            peak = max(peak, _rss())
            await anyio.sleep(0.005)

    async with anyio.create_task_group() as tg:
        tg.start_soon(sample)
        t0 = time.perf_counter()
        outcome = await runner.run(request, _Sink(), anyio.Event())
        seconds = time.perf_counter() - t0
        done = True
    peak = max(peak, _rss())
    return outcome.stdout_bytes + outcome.stderr_bytes, seconds, peak - base


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-mib", type=int, default=1024)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(os.path.realpath(tmp))
        binary = root / "reader"
        (root / "reader.c").write_text(C_READER)
        cc = shutil.which("cc") or "cc"
        subprocess.run([cc, "-O2", "-o", str(binary), str(root / "reader.c")], check=True)
        anyio.run(_measure, args, root, binary)


async def _measure(args: argparse.Namespace, root: Path, binary: Path) -> None:
    size = args.size_mib * 1024 * 1024
    runner = Runner(
        RunnerSettings(spill_cap_bytes=int(os.environ.get("CAP", 64 << 20))),
        anyio.CapacityLimiter(4),
        os.environ,
    )
    await _runner_run(runner, root, _writer(16 << 20, True))  # warm up buffers and imports
    print(
        f"python {sys.version.split()[0]}, {args.size_mib} MiB per stream, median of {args.repeat}"
    )
    per_round: dict[str, list[float]] = {}
    for both in (False, True):
        command = _writer(size, both)
        c_rates, r_rates, growth = [], [], []
        for k in range(args.repeat):  # paired rounds, the order alternating
            if k % 2:
                total, seconds, grew = await _runner_run(runner, root, command)
                r_rates.append(total / seconds)
                total, seconds = _c_run(binary, command)
                c_rates.append(total / seconds)
            else:
                total, seconds = _c_run(binary, command)
                c_rates.append(total / seconds)
                total, seconds, grew = await _runner_run(runner, root, command)
                r_rates.append(total / seconds)
            growth.append(grew)
        c, r = statistics.median(c_rates), statistics.median(r_rates)
        ratios = [rr / cc for rr, cc in zip(r_rates, c_rates, strict=True)]
        per_round["both" if both else "one"] = ratios
        per_round[("both" if both else "one") + "_growth_mib"] = [g / 2**20 for g in growth]
        label = "both streams" if both else "one stream  "
        print(
            f"{label}: C {c / 1e9:5.2f} GB/s  runner {r / 1e9:5.2f} GB/s  "
            f"ratio {statistics.median(ratios):4.2f}  "
            f"peak RSS growth {max(growth) / 2**20:5.2f} MiB"
        )
    print("ROUNDS " + json.dumps(per_round))


if __name__ == "__main__":
    main()
