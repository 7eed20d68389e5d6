"""Shared helpers of the benchmarks: processes, clients, statistics, tool sets, results.

Everything here is plain stdlib + orjson so that the client side costs the same whether it
talks to toolsetd or to a baseline server: a benchmark always measures both with the same
client code, in the same run, interleaved round by round.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime as _dt
import json
import os
import platform
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import orjson

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results"
EXAMPLES = REPO / "examples" / "tools"
PYTHON = sys.executable
now_ns = time.perf_counter_ns


# --- statistics -------------------------------------------------------------------------


def median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else float("nan")


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100)."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    rank = max(0, min(len(ordered) - 1, round(q / 100 * len(ordered) + 0.5) - 1))
    return ordered[rank]


def us(ns: float) -> float:
    return ns / 1000.0


def ms(ns: float) -> float:
    return ns / 1e6


#: Every goal row is the median of at least this many paired rounds.
MIN_ROUNDS = 5


@dataclass
class Goal:
    """One goal row: the median of per-round measurements against its target.

    ``samples`` holds one value per paired round (a ratio, or an absolute figure where
    the target is absolute); ``ratio`` is their median and the spread is their range.
    """

    goal: str  # "1", "2", ...
    name: str
    ratio: float
    target: float
    op: str  # "<=" or ">="
    detail: str = ""
    samples: list[float] = field(default_factory=list)

    @classmethod
    def of(
        cls, goal: str, name: str, samples: list[float], target: float, op: str, detail: str = ""
    ) -> Goal:
        """A goal row from its per-round samples (the ratio is their median)."""
        clean = [s for s in samples if s == s]
        return cls(goal, name, median(clean), target, op, detail, clean)

    @property
    def passed(self) -> bool:
        if self.ratio != self.ratio:  # NaN
            return False
        return self.ratio <= self.target if self.op == "<=" else self.ratio >= self.target

    @property
    def spread(self) -> tuple[float, float]:
        """The lowest and highest per-round value (the median's own value without samples)."""
        if not self.samples:
            return (self.ratio, self.ratio)
        return (min(self.samples), max(self.samples))

    @property
    def rounds(self) -> int:
        return len(self.samples)

    def worse(self, other: Goal) -> bool:
        """Whether this row is further on the wrong side of the target than ``other``."""
        if self.ratio != self.ratio:
            return True
        if other.ratio != other.ratio:
            return False
        return self.ratio > other.ratio if self.op == "<=" else self.ratio < other.ratio

    def row(self) -> dict[str, Any]:
        d = asdict(self)
        d["passed"] = self.passed
        d["spread"] = list(self.spread)
        d["rounds"] = self.rounds
        return d


def print_table(title: str, header: list[str], rows: list[list[Any]]) -> None:
    """Print a small aligned table."""
    cells = [[_fmt(c) for c in row] for row in rows]
    widths = [
        max(len(h), *(len(r[i]) for r in cells)) if cells else len(h) for i, h in enumerate(header)
    ]
    print(f"\n{title}")
    print("  " + "  ".join(h.ljust(w) for h, w in zip(header, widths, strict=True)))
    print("  " + "  ".join("-" * w for w in widths))
    for row in cells:
        print(
            "  "
            + "  ".join(
                c.rjust(w) if _numeric(c) else c.ljust(w) for c, w in zip(row, widths, strict=True)
            )
        )
    sys.stdout.flush()


def _ratio_text(value: float) -> str:
    return "n/a" if value != value else f"{value:.3f}"


def print_goals(goals: list[Goal], title: str = "goals") -> None:
    """The goals table: median of the paired rounds, their spread (min-max) and count."""
    print_table(
        title,
        ["goal", "what", "median", "spread (min-max)", "rounds", "target", "verdict"],
        [
            [
                g.goal,
                g.name,
                _ratio_text(g.ratio),
                f"{_ratio_text(g.spread[0])}-{_ratio_text(g.spread[1])}",
                str(g.rounds),
                f"{g.op} {g.target:g}",
                "PASS" if g.passed else "MISS",
            ]
            for g in goals
        ],
    )


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        if value != value:
            return "n/a"
        if abs(value) >= 100:
            return f"{value:,.0f}"
        if abs(value) >= 10:
            return f"{value:.1f}"
        return f"{value:.3g}" if abs(value) < 1 else f"{value:.2f}"
    if isinstance(value, int):
        return f"{value:,}"
    return str(value)


def _numeric(text: str) -> bool:
    return bool(text) and (text[0].isdigit() or (text[0] == "-" and text[1:2].isdigit()))


# --- machine and results ----------------------------------------------------------------


def machine() -> dict[str, Any]:
    return {
        "date": _dt.datetime.now().astimezone().isoformat(timespec="seconds"),
        "nproc": os.cpu_count(),
        "python": platform.python_version(),
        "implementation": platform.python_implementation(),
        "platform": platform.platform(),
        "loadavg": [round(x, 2) for x in os.getloadavg()],
    }


def write_results(name: str, data: dict[str, Any]) -> Path:
    """Write ``bench/results/<name>-<timestamp>.json`` and ``<name>-latest.json``."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    body = {"benchmark": name, "machine": machine(), **data}
    text = json.dumps(body, indent=2, default=_json_default)
    path = RESULTS / f"{name}-{stamp}.json"
    path.write_text(text)
    (RESULTS / f"{name}-latest.json").write_text(text)
    return path


def _json_default(value: Any) -> Any:
    if isinstance(value, Goal):
        return value.row()
    if isinstance(value, Path):
        return str(value)
    raise TypeError(type(value).__name__)


# --- temp dirs and processes ------------------------------------------------------------


@contextlib.contextmanager
def temp_base() -> Iterator[Path]:
    """A short temp dir under /tmp (AF_UNIX paths are limited to ~108 bytes)."""
    base = Path(tempfile.mkdtemp(prefix="tsb-", dir="/tmp"))
    try:
        yield base
    finally:
        shutil.rmtree(base, ignore_errors=True)


@dataclass
class Proc:
    """A server process this benchmark started; ``stop`` always reaps it."""

    popen: subprocess.Popen[bytes]
    socket: Path
    log: Path
    ready_ns: int = 0  # spawn -> first answer

    def stop(self) -> None:
        p = self.popen
        if p.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                p.send_signal(signal.SIGTERM)
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()

    def log_text(self) -> str:
        try:
            return self.log.read_text(errors="replace")
        except OSError:
            return ""

    def __enter__(self) -> Proc:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def spawn_server(
    argv: list[str],
    sock: Path,
    log: Path,
    *,
    timeout: float = 120.0,
    env: dict[str, str] | None = None,
) -> Proc:
    """Spawn a server and wait until it answers ``status`` on ``sock``.

    ``ready_ns`` is the time from just before the spawn to the first answer. The probe
    retries every 1 ms, so that is the resolution of cold-start numbers.
    """
    with contextlib.suppress(FileNotFoundError):
        sock.unlink()
    # The daemon's set cache lives beside the socket, in the benchmark's temp folder.
    full_env = {**os.environ, "XDG_CACHE_HOME": str(sock.parent / "cache"), **(env or {})}
    full_env.pop("TOOLSETD_SOCKET", None)
    with open(log, "wb") as log_file:
        t0 = now_ns()
        popen = subprocess.Popen(argv, stdout=log_file, stderr=log_file, env=full_env, cwd=REPO)
    proc = Proc(popen, sock, log)
    deadline = time.monotonic() + timeout
    try:
        while True:
            if popen.poll() is not None:
                raise RuntimeError(
                    f"{argv[:3]} exited early ({popen.returncode}):\n{proc.log_text()[-4000:]}"
                )
            try:
                with BlockingConn(sock, timeout=timeout) as conn:
                    reply = conn.request("status")
                if "result" in reply:
                    proc.ready_ns = now_ns() - t0
                    return proc
            except (OSError, EOFError):
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"{argv[:3]} did not start:\n{proc.log_text()[-4000:]}")
            time.sleep(0.001)
    except BaseException:
        proc.stop()
        raise


#: The daemon's config in every benchmark that names none: unconfined, as the minimal
#: servers and the MCP SDK's server run, and the same on every host (with
#: ``cgroup = "auto"`` a host with a writable cgroup v2 tree would give every call a cgroup,
#: and one without would not). Goal 8 (``bench_confine``) measures the cgroup and the
#: sandbox against this.
UNCONFINED = '[confinement]\ncgroup = "off"\nsandbox = "off"\n'


def daemon_argv(
    home: Path,
    sock: Path,
    *,
    watch: bool = False,
    log_level: str = "warning",
    extra: list[str] | None = None,
) -> list[str]:
    """The daemon's command line; with ``UNCONFINED`` as its config unless ``extra`` names one."""
    extra = list(extra or [])
    if "--config" not in extra:
        config = sock.parent / "unconfined.toml"
        config.write_text(UNCONFINED)
        extra += ["--config", str(config)]
    argv = [
        PYTHON,
        "-m",
        "toolsetd.daemon",
        "--home",
        str(home),
        "--socket",
        str(sock),
        "--log-level",
        log_level,
    ]
    if not watch:
        argv.append("--no-watch")
    return argv + extra


def start_daemon(
    home: Path,
    base: Path,
    *,
    watch: bool = False,
    log_level: str = "warning",
    extra: list[str] | None = None,
    name: str = "d",
) -> Proc:
    sock = base / f"{name}.sock"
    return spawn_server(
        daemon_argv(home, sock, watch=watch, log_level=log_level, extra=extra),
        sock,
        base / f"{name}.log",
    )


def _pin(pid: int, cpus: set[int]) -> None:
    """Set the CPU affinity of every thread of ``pid`` (threads started later inherit it)."""
    for tid in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(ProcessLookupError):
            os.sched_setaffinity(int(tid), cpus)


@contextlib.contextmanager
def placed(servers: Sequence[Proc], how: str) -> Iterator[str]:
    """Place the servers and this process (the client) on CPUs for the block, then undo it.

    ``how`` is ``"split"`` (servers on the last CPU, the client on the first: every
    request crosses cores, as between an agent front end and the daemon) or ``"shared"``
    (all on the first CPU). Left to itself, the scheduler sometimes settles a
    single-threaded server on its client's core, where a round trip costs a third as much,
    and keeps it there for a whole round: the placement, not the server, then decides a
    ratio. Yields what was done (``"unpinned"`` with fewer than two CPUs).
    """
    assert how in ("split", "shared"), how
    mine = os.sched_getaffinity(0)
    if len(mine) < 2:
        yield "unpinned"
        return
    first, last = min(mine), max(mine)
    server_cpus = {last} if how == "split" else {first}
    try:
        for server in servers:
            _pin(server.popen.pid, server_cpus)
        os.sched_setaffinity(0, {first})
        yield how
    finally:
        os.sched_setaffinity(0, mine)
        for server in servers:
            with contextlib.suppress(OSError):
                _pin(server.popen.pid, mine)


def start_baseline(mode: str, base: Path, name: str = "echo") -> Proc:
    """The orjson + asyncio baseline server (``bench/_baseline.py``) in its own process."""
    sock = base / f"{name}.sock"
    argv = [PYTHON, "-m", "bench._baseline", "--socket", str(sock), "--mode", mode]
    return spawn_server(argv, sock, base / f"{name}.log")


# --- the clients ------------------------------------------------------------------------


class BlockingConn:
    """A blocking NDJSON client (orjson), the same for toolsetd and every baseline."""

    def __init__(self, path: Path | str, timeout: float = 30.0) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(timeout)
        try:
            self.sock.connect(str(path))
        except OSError:
            self.sock.close()
            raise
        self._buf = b""
        self._id = 0
        # Read into a buffer kept for the connection: ``recv(1 MiB)`` allocated 1 MiB for
        # each read, which glibc maps and unmaps afresh each time (16-18 µs a read against
        # 2.5: ``_Feed`` below says more), paid by this client in every round trip.
        self._chunk = memoryview(bytearray(1 << 20))

    def __enter__(self) -> BlockingConn:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self.sock.close()

    def send(self, message: Any) -> None:
        self.sock.sendall(orjson.dumps(message) + b"\n")

    def receive(self) -> Any:
        buf = self._buf
        while True:
            i = buf.find(b"\n")
            if i >= 0:
                self._buf = buf[i + 1 :]
                return orjson.loads(buf[:i])
            size = self.sock.recv_into(self._chunk)
            if not size:
                raise EOFError("connection closed")
            buf += self._chunk[:size]

    def request(self, method: str, params: Any = None, *, notes: list[Any] | None = None) -> Any:
        """Send one request; return its response (notifications go to ``notes``)."""
        self._id += 1
        rid = self._id
        message: dict[str, Any] = {"jsonrpc": "2.0", "id": rid, "method": method}
        if params is not None:
            message["params"] = params
        self.send(message)
        while True:
            reply = self.receive()
            if "id" in reply and "method" not in reply and reply["id"] == rid:
                return reply
            if notes is not None:
                notes.append(reply)


def sequential_latency(sock: Path, method: str, params: Any, n: int, warmup: int = 50) -> list[int]:
    """``n`` sequential requests on one connection; per-request round trip in ns."""
    out: list[int] = []
    with BlockingConn(sock) as conn:
        for _ in range(warmup):
            conn.request(method, params)
        for _ in range(n):
            # The reply is checked and dropped inside its own round trip, as the SDK's
            # client in bench/_mcp_client.py drops its tools/list result. Kept alive into
            # the next one, a large answer (a list of 1,000 tools is ~60,000 objects) made
            # this process's collector traverse it during the next decode: paired, 9.1-10
            # against 5.0-5.4 ms a list of 1,000 tools, paired in one process.
            t0 = now_ns()
            failed = _failure(conn.request(method, params))
            out.append(now_ns() - t0)
            if failed is not None:
                raise RuntimeError(f"{method} failed: {failed}")
    return out


def _failure(reply: Any) -> Any:
    """The reply when it carries no result, else None (and the reply is dropped)."""
    return None if "result" in reply else reply


class _Feed(asyncio.BufferedProtocol):
    """A client connection that reads into a buffer it keeps and feeds a ``StreamReader``
    (``open_kept_buffer``).

    Not asyncio's own streams: their transport reads each chunk with ``recv(256 KiB)``, a
    fresh 256 KiB allocation cut down to the chunk, and whether glibc's ``malloc`` then maps
    and unmaps pages for it (a page fault, an ``munmap`` and a TLB flush, ~15 µs) depends on
    the state of the client's heap. A client in that state spent 15-20 µs of system time a
    request against ~3, could not keep either server busy, and served every server alike at
    ~40,000 requests/s; in the other it drove both to ~90,000. Which state a round found
    decided the 32-connection ``status`` ratio (2.4 or 1.1 from one round to the next), not
    the servers. ``recv_into`` this buffer allocates nothing per read.
    """

    def __init__(self, reader: asyncio.StreamReader) -> None:
        self._reader = reader
        self._buffer = memoryview(bytearray(1 << 16))

    def get_buffer(self, sizehint: int) -> memoryview:
        return self._buffer

    def buffer_updated(self, nbytes: int) -> None:
        self._reader.feed_data(bytes(self._buffer[:nbytes]))

    def eof_received(self) -> bool:
        self._reader.feed_eof()
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        if exc is None:
            self._reader.feed_eof()
        else:
            self._reader.set_exception(exc)


async def open_kept_buffer(
    *, path: Path | None = None, host: str = "", port: int = 0, limit: int = 1 << 24
) -> tuple[asyncio.StreamReader, asyncio.Transport]:
    """A connection to the Unix socket ``path`` (or to ``host``:``port`` over TCP), read as
    asyncio's streams are (``readline``, ``readuntil``, ``readexactly``) but into a buffer
    it keeps (``_Feed``); written through the transport."""
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader(limit=limit)
    if path is not None:
        transport, _ = await loop.create_unix_connection(lambda: _Feed(reader), str(path))
    else:
        transport, _ = await loop.create_connection(lambda: _Feed(reader), host, port)
    return reader, transport


async def _worker(
    sock: Path,
    method: str,
    params: Any,
    deadline: list[float],
    counts: list[int],
    idx: int,
    start: asyncio.Event,
) -> None:
    reader, transport = await open_kept_buffer(path=sock)
    try:
        rid = 0
        loads = orjson.loads
        await start.wait()
        loop = asyncio.get_running_loop()
        while loop.time() < deadline[0]:
            rid += 1
            transport.write(
                orjson.dumps({"jsonrpc": "2.0", "id": rid, "method": method, "params": params})
                + b"\n"
            )
            while True:
                line = await reader.readline()
                if not line:
                    raise EOFError("server closed the connection")
                msg = loads(line)
                if "method" not in msg and msg.get("id") == rid:
                    break
            if "result" not in msg:
                raise RuntimeError(f"{method} failed: {msg}")
            counts[idx] += 1
    finally:
        transport.close()


async def _throughput(
    sock: Path, method: str, params: Any, concurrency: int, seconds: float
) -> float:
    counts = [0] * concurrency
    loop = asyncio.get_running_loop()
    start = asyncio.Event()
    deadline = [0.0]
    tasks = [
        asyncio.ensure_future(_worker(sock, method, params, deadline, counts, i, start))
        for i in range(concurrency)
    ]
    await asyncio.sleep(0.05)  # let every connection open
    deadline[0] = loop.time() + seconds
    t0 = now_ns()
    start.set()
    results = await asyncio.gather(*tasks, return_exceptions=True)
    elapsed = now_ns() - t0
    errors = [r for r in results if isinstance(r, BaseException)]
    if errors:
        raise errors[0]
    return sum(counts) / (elapsed / 1e9)


def throughput(sock: Path, method: str, params: Any, concurrency: int, seconds: float) -> float:
    """Requests/s with ``concurrency`` connections, each sending one request at a time.

    The deadline is checked before each request and the window ends when the last
    in-flight request has been answered.
    """
    return asyncio.run(_throughput(sock, method, params, concurrency, seconds))


def paired(rounds: int, *measures: Callable[[], float]) -> list[list[float]]:
    """Run the measures interleaved ``rounds`` times (the order alternates every round)."""
    out: list[list[float]] = [[] for _ in measures]
    order = list(range(len(measures)))
    for r in range(rounds):
        seq = order if r % 2 == 0 else order[::-1]
        for i in seq:
            out[i].append(measures[i]())
    return out


def ratios(a: Sequence[float], b: Sequence[float]) -> list[float]:
    """The per-round ratios a/b of two paired series."""
    return [x / y if y else float("nan") for x, y in zip(a, b, strict=True)]


def ratio_of_pairs(a: Sequence[float], b: Sequence[float]) -> float:
    """Median of the per-round ratios a/b (robust to drift between rounds)."""
    return median([r for r in ratios(a, b) if r == r])


def against_python(parser: argparse.ArgumentParser, against: Path) -> Path:
    """The interpreter of ``--against DIR``, another checkout with its own venv (the A/B
    tools' other side); a parser error when it has none."""
    python = against / ".venv" / "bin" / "python"
    if not python.exists():
        parser.error(f"{python} does not exist: run make .venv/.installed in {against}")
    return python


def load() -> str:
    """The load averages (1, 5, 15 min) as ``uptime`` prints them."""
    return ", ".join(f"{x:.2f}" for x in os.getloadavg())


# --- tool sets --------------------------------------------------------------------------

TRUE_SET = "noop"


def trivial_manifest(command: list[str] | None = None) -> bytes:
    """The trivial exec tool: ``/bin/true``, no stdin, approval always."""
    return orjson.dumps(
        {
            "runner": "exec",
            "description": "Runs /bin/true.",
            "schema": {"type": "object", "properties": {}, "additionalProperties": False},
            "command": command or ["/bin/true"],
            "stdin": False,
            "approval": "always",
        },
        option=orjson.OPT_INDENT_2,
    )


def small_manifest(i: int, variant: int = 0) -> bytes:
    """Set ``i``: one exec tool with a small schema distinct from every other set's."""
    return orjson.dumps(
        {
            "runner": "exec",
            "description": f"Tool number {i} (variant {variant}).",
            "schema": {
                "type": "object",
                "properties": {
                    f"p{i}": {"type": "string", "description": f"Parameter of tool {i}."},
                    "count": {"type": "integer", "minimum": 0, "maximum": 1000 + i},
                },
                "required": [f"p{i}"],
                "additionalProperties": False,
            },
            "command": ["/bin/true"],
            "stdin": False,
            "approval": "always",
        },
        option=orjson.OPT_INDENT_2,
    )


def set_name(i: int) -> str:
    return f"s{i:05d}"


def make_home(base: Path, n_sets: int, *, trivial: bool = False, name: str = "home") -> Path:
    """A home with ``n_sets`` small sets (and the trivial ``noop`` set when asked)."""
    home = base / name
    tools = home / "tools"
    tools.mkdir(parents=True, exist_ok=True)
    for i in range(n_sets):
        d = tools / set_name(i)
        d.mkdir(exist_ok=True)
        (d / "tools.json").write_bytes(small_manifest(i))
    if trivial:
        d = tools / TRUE_SET
        d.mkdir(exist_ok=True)
        (d / "tools.json").write_bytes(trivial_manifest())
    return home


@dataclass
class Section:
    """What one benchmark module returns to ``bench.__main__``."""

    name: str
    goals: list[Goal] = field(default_factory=list)
    data: dict[str, Any] = field(default_factory=dict)


def stop_cleanly_on_sigterm() -> None:
    """Make SIGTERM (``kill``, ``timeout``) unwind like Ctrl-C: every ``finally`` runs.

    Without it the benchmark dies at once and the servers it started (``bench._baseline``,
    daemons, MCP servers) keep running, bound to sockets in a temp folder nobody removes.
    """

    def unwind(signum: int, frame: object) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, unwind)


def standalone(name: str, run: Callable[[bool], Section | None], doc: str | None) -> None:
    """``python -m bench.bench_<name> [--quick]``: run one benchmark, print its goals, save it.

    A ``run`` that returns None skipped itself (it printed why): nothing is saved.
    """
    parser = argparse.ArgumentParser(description=(doc or name).splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    stop_cleanly_on_sigterm()
    t0 = time.monotonic()
    section = run(args.quick)
    if section is None:
        return
    print_goals(section.goals)
    body = {
        "quick": args.quick,
        "goals": section.goals,
        **section.data,
        "seconds": time.monotonic() - t0,
    }
    print(f"\nresults: {write_results(name, body)}")
