"""Prometheus metrics: counted in plain Python, exposed through ``prometheus-client``.

Theory of operation
-------------------
``Metrics`` is an ``observe.Observer``. On the call path it only adds to dicts and
histogram arrays owned by the event loop (no locks, no label lookups in a library):
a call costs a few dict operations. Gauges (calls in flight and queued, open connections,
the catalog's sets, tools and notes) are not counted at all: ``MetricsSources`` reads
them from the daemon's own state when someone asks.

``prometheus_client`` renders the exposition format. It is imported the first time
metrics are asked for (``toolsetctl metrics`` or a scrape of ``/metrics``), so a daemon
nobody scrapes never loads it, and start-up does not pay for it. The collector builds
metric families from the counts at each scrape, on the event loop. Imported then, it
comes from the install as it is then: one that cannot be imported (toolsetd upgraded or
removed under the daemon, the venv half replaced) is said as such (``MetricsUnavailable``:
``toolsetctl metrics`` gets its message, a scrape a 503 with it), not as a bug.

Labels carry tool-set directory names, statuses, decisions and reasons only: never
argument values, paths or output.

``serve_metrics`` answers ``GET /metrics`` on a loopback TCP listener (``--metrics-listen``,
bound at start-up by ``bind_metrics``): one request per connection, a bounded request head,
one timeout for the whole exchange, ``Connection: close``, at most ``_MAX_SCRAPES``
connections at once, and an ``accept`` short of descriptors retried rather than fatal:
any local user can connect, and none may take the daemon's descriptors or end it.
"""

from __future__ import annotations

import bisect
import email.utils
import socket
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import anyio
import anyio.abc
import structlog
from toolsetd.protocol import __version__
from toolsetd.protocol.errors import InternalError

from .exhaustion import Acceptor
from .logs import Throttle
from .model import Catalog, Source
from .observe import CallInfo

if TYPE_CHECKING:
    from .call import CallOutcome

__all__ = [
    "MAX_SET_LABELS",
    "OTHER_SETS",
    "Metrics",
    "MetricsSources",
    "MetricsUnavailable",
    "bind_metrics",
    "serve_metrics",
]

log = structlog.get_logger("toolsetd.metrics")

#: Peak memory bucket bounds, in bytes (1 MiB to 16 GiB, by 4).
MEMORY_BUCKETS = tuple(float(1 << n) for n in range(20, 35, 2))
#: Histogram bucket bounds, in seconds.
CALL_BUCKETS = (
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
    120.0,
    300.0,
)
QUEUE_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 10.0, 30.0, 60.0)
RELOAD_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 10.0)

#: Distinct ``set`` label values kept; calls of further sets count under ``OTHER_SETS``.
MAX_SET_LABELS = 1000
#: No set is named so (a directory name starts with a letter).
OTHER_SETS = "_other"

_HEAD_LIMIT = 8192
#: Seconds a ``/metrics`` rendering is served again before it is rendered anew.
_SCRAPE_MAX_AGE = 1.0
#: Seconds one scrape may take in all: reading the request and writing the answer.
_REQUEST_TIMEOUT = 5.0
#: Scrapes served at once; a connection beyond them is closed unanswered.
_MAX_SCRAPES = 8
_BACKLOG = 64


@dataclass(frozen=True, slots=True)
class MetricsSources:
    """Where the gauges are read from at scrape time (the composition root wires them)."""

    in_flight: Callable[[], int]
    queued: Callable[[], int]
    connections_open: Callable[[], int]
    connections_accepted: Callable[[], int]
    catalogs: Callable[[], Sequence[Catalog]]
    generation: Callable[[], int]
    #: ``status``'s ``watch`` (``Watcher.status``), or None under ``--no-watch``.
    watch: Callable[[], Mapping[str, Any] | None] = lambda: None


class _Histogram:
    """Bucket counts and a sum; ``buckets()`` gives Prometheus' cumulative pairs."""

    __slots__ = ("bounds", "counts", "total")

    def __init__(self, bounds: Sequence[float]) -> None:
        self.bounds = tuple(bounds)
        self.counts = [0] * (len(self.bounds) + 1)
        self.total = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.total += value

    def buckets(self) -> list[tuple[str, int]]:
        pairs: list[tuple[str, int]] = []
        running = 0
        for bound, count in zip((*self.bounds, float("inf")), self.counts, strict=True):
            running += count
            pairs.append(("+Inf" if bound == float("inf") else repr(bound), running))
        return pairs


class _CallObservation:
    __slots__ = ("_info", "_metrics")

    def __init__(self, metrics: Metrics, info: CallInfo) -> None:
        self._metrics = metrics
        label = metrics.set_label(info.set, info.source)
        self._info = info if label == info.set else replace(info, set=label)

    def child_env(self) -> Mapping[str, str]:
        return {}

    def refused(self, reason: str) -> None:
        info = self._info
        key = (info.set, "refused", info.decision)
        calls = self._metrics.calls
        calls[key] = calls.get(key, 0) + 1

    def finished(self, outcome: CallOutcome | None) -> None:
        info, m = self._info, self._metrics
        status = outcome.status if outcome is not None else "error"
        key = (info.set, status, info.decision)
        m.calls[key] = m.calls.get(key, 0) + 1
        if outcome is None:
            return
        duration = m.durations.get(info.set)
        if duration is None:
            duration = m.durations[info.set] = _Histogram(CALL_BUCKETS)
        duration.observe(outcome.duration_ms / 1000)
        m.queue_wait.observe(outcome.queue_ms / 1000)
        if outcome.spawn_failed:
            m.spawn_failures[info.set] = m.spawn_failures.get(info.set, 0) + 1
        out = m.output_bytes
        if outcome.stdout_bytes:
            out[(info.set, "stdout")] = out.get((info.set, "stdout"), 0) + outcome.stdout_bytes
        if outcome.stderr_bytes:
            out[(info.set, "stderr")] = out.get((info.set, "stderr"), 0) + outcome.stderr_bytes
        if outcome.truncated:
            m.truncations[info.set] = m.truncations.get(info.set, 0) + 1
        if outcome.cpu_ms is not None:  # the call had a cgroup of its own
            m.cpu_seconds[info.set] = m.cpu_seconds.get(info.set, 0) + outcome.cpu_ms / 1000
        if outcome.peak_memory_bytes is not None:
            peak = m.peak_memory.get(info.set)
            if peak is None:
                peak = m.peak_memory[info.set] = _Histogram(MEMORY_BUCKETS)
            peak.observe(outcome.peak_memory_bytes)
        if outcome.oom_killed:
            m.oom_kills[info.set] = m.oom_kills.get(info.set, 0) + 1


class MetricsUnavailable(InternalError):
    """``prometheus_client`` could not be imported at the first exposition (see the module
    docstring); ``toolsetctl metrics`` gets this message, a scrape a 503 with it."""


class Metrics:
    """The daemon's counters, and their exposition.

    Args:
        sources: Where the gauges are read from.
    """

    def __init__(self, sources: MetricsSources) -> None:
        self._sources = sources
        self.calls: dict[tuple[str, str, str], int] = {}
        self.durations: dict[str, _Histogram] = {}
        self.queue_wait = _Histogram(QUEUE_BUCKETS)
        self.spawn_failures: dict[str, int] = {}
        self.output_bytes: dict[tuple[str, str], int] = {}
        self.truncations: dict[str, int] = {}
        self.cpu_seconds: dict[str, float] = {}
        self.peak_memory: dict[str, _Histogram] = {}
        self.oom_kills: dict[str, int] = {}
        self.refusals: dict[str, int] = {}
        self.reloads: dict[str, int] = {}
        self.reload_durations = _Histogram(RELOAD_BUCKETS)
        self._registry: Any = None
        self._started = time.time()
        self._set_labels: set[str] = set()
        self._rendered: tuple[float, tuple[str, str]] | None = None

    def set_label(self, name: str, source: str = "project") -> str:
        """The ``set`` label for a set: its name, or ``OTHER_SETS`` past ``MAX_SET_LABELS``.

        Any workspace a client names brings its own project sets, so their names are not
        bounded; each one costs every scrape some 20 lines, rendered on the event loop. A
        home set always keeps its name (the operator's folder bounds them), so project sets
        named early cannot push the operator's own into ``OTHER_SETS``.
        """
        labels = self._set_labels
        if name in labels:
            return name
        if source == "home" or len(labels) < MAX_SET_LABELS:
            labels.add(name)
            return name
        return OTHER_SETS

    # -- Observer ---------------------------------------------------------------------

    def call(self, info: CallInfo) -> _CallObservation:
        """Begin counting one call."""
        return _CallObservation(self, info)

    def connection_refused(self, reason: str) -> None:
        """Count a refused connection by reason."""
        self.refusals[reason] = self.refusals.get(reason, 0) + 1

    def reload_finished(self, seconds: float, failed: bool) -> None:
        """Count a reload and its duration."""
        result = "failed" if failed else "ok"
        self.reloads[result] = self.reloads.get(result, 0) + 1
        self.reload_durations.observe(seconds)

    # -- exposition -------------------------------------------------------------------

    def exposition(self) -> tuple[str, str]:
        """The Prometheus text exposition and its content type (loads prometheus_client).

        Raises:
            MetricsUnavailable: prometheus_client could not be imported.
        """
        try:
            from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

            registry = self._collector_registry()
        except ImportError as exc:
            raise MetricsUnavailable(
                "toolsetd was upgraded (or removed) under this daemon, which loads its metrics "
                f"renderer at the first scrape, and it cannot be loaded now ({exc}): restart it"
            ) from None
        return generate_latest(registry).decode(), CONTENT_TYPE_LATEST

    def recent_exposition(
        self, max_age: float = _SCRAPE_MAX_AGE, clock: Callable[[], float] = time.monotonic
    ) -> tuple[str, str]:
        """``exposition``, rendered again only once the last rendering is ``max_age`` old.

        For the ``/metrics`` listener, which anyone on the machine may call: with a
        thousand sets labelled a rendering is ~35,000 lines and takes a quarter of a second
        on the event loop, so scrapes in a loop would hold every call. Prometheus scrapes
        every 15 s or so and loses nothing to a second's staleness.
        """
        now = clock()
        cached = self._rendered
        if cached is None or now - cached[0] >= max_age:
            cached = self._rendered = (now, self.exposition())
        return cached[1]

    def _collector_registry(self) -> Any:
        if self._registry is None:
            from prometheus_client import CollectorRegistry, ProcessCollector

            registry = CollectorRegistry(auto_describe=False)
            registry.register(_Collector(self))
            ProcessCollector(registry=registry)
            self._registry = registry
        return self._registry

    def families(self) -> Iterator[Any]:
        """The metric families, built from the counts now (used by the collector)."""
        from prometheus_client.core import (
            CounterMetricFamily,
            GaugeMetricFamily,
            HistogramMetricFamily,
        )

        def labelled(
            kind: Any, name: str, text: str, labels: Sequence[str], counts: Mapping[Any, float]
        ) -> Any:
            family = kind(name, text, labels=list(labels))
            for key, count in sorted(counts.items()):
                family.add_metric(list(key) if isinstance(key, tuple) else [key], count)
            return family

        def histograms(
            name: str, text: str, labels: Sequence[str], by: Mapping[tuple[str, ...], _Histogram]
        ) -> Any:
            family = HistogramMetricFamily(name, text, labels=list(labels))
            for key, hist in sorted(by.items()):
                family.add_metric(list(key), hist.buckets(), hist.total)
            return family

        s = self._sources
        counter, gauge = CounterMetricFamily, GaugeMetricFamily
        yield labelled(
            gauge,
            "toolsetd_build_info",
            "The running toolsetd version.",
            ["version"],
            {__version__: 1},
        )
        yield gauge(
            "toolsetd_start_time_seconds",
            "When the daemon started (Unix time).",
            value=self._started,
        )
        yield labelled(
            counter,
            "toolsetd_calls",
            "invoke calls by tool set, result status "
            "(ok, error, timeout, cancelled; refused when the policy or the path "
            "fence stopped the call) and policy decision.",
            ["set", "status", "decision"],
            self.calls,
        )
        yield histograms(
            "toolsetd_call_duration_seconds",
            "invoke calls from the runner's "
            "start to the outcome (queue wait included), by tool set.",
            ["set"],
            {(name,): hist for name, hist in self.durations.items()},
        )
        yield histograms(
            "toolsetd_call_queue_wait_seconds",
            "Time calls waited for a --max-running slot.",
            [],
            {(): self.queue_wait},
        )
        yield gauge(
            "toolsetd_calls_in_flight",
            "invoke calls accepted and not yet answered (queued ones included).",
            value=s.in_flight(),
        )
        yield gauge(
            "toolsetd_calls_queued", "Calls waiting for a --max-running slot.", value=s.queued()
        )
        yield labelled(
            counter,
            "toolsetd_spawn_failures",
            "Tool processes that could not be started, by tool set.",
            ["set"],
            self.spawn_failures,
        )
        yield labelled(
            counter,
            "toolsetd_output_bytes",
            "Bytes tools wrote, by tool set and stream.",
            ["set", "stream"],
            self.output_bytes,
        )
        yield labelled(
            counter,
            "toolsetd_output_truncations",
            "Call results cut at --output-limit, by tool set.",
            ["set"],
            self.truncations,
        )
        yield labelled(
            counter,
            "toolsetd_call_cpu_seconds",
            "CPU time (user + system) of calls that ran in a cgroup of their own, by tool set.",
            ["set"],
            self.cpu_seconds,
        )
        yield histograms(
            "toolsetd_call_peak_memory_bytes",
            "Peak memory of calls that ran in a cgroup with the memory controller, by tool set.",
            ["set"],
            {(name,): hist for name, hist in self.peak_memory.items()},
        )
        yield labelled(
            counter,
            "toolsetd_call_oom_kills",
            "Calls the out-of-memory killer struck in their cgroup (memory-max), by tool set.",
            ["set"],
            self.oom_kills,
        )
        yield counter(
            "toolsetd_connections",
            "Connections accepted (refused ones included).",
            value=s.connections_accepted(),
        )
        yield gauge(
            "toolsetd_connections_open", "Connections being served.", value=s.connections_open()
        )
        yield labelled(
            counter,
            "toolsetd_connections_refused",
            "Connections turned away: peer (SO_PEERCRED), limit (--max-connections), stopping, "
            "memory (none to open it).",
            ["reason"],
            self.refusals,
        )
        yield labelled(
            counter,
            "toolsetd_reloads",
            "Catalog reloads by result (ok, failed).",
            ["result"],
            self.reloads,
        )
        yield histograms(
            "toolsetd_reload_duration_seconds",
            "Catalog reload durations.",
            [],
            {(): self.reload_durations},
        )
        sets, tools, notes, workspaces = _catalog_counts(s.catalogs())
        yield labelled(
            gauge,
            "toolsetd_catalog_sets",
            "Tool sets by source and state (loaded, disabled, refused, hidden).",
            ["source", "state"],
            sets,
        )
        yield labelled(
            gauge, "toolsetd_catalog_tools", "Tools in the catalogs, by source.", ["source"], tools
        )
        yield labelled(
            gauge, "toolsetd_catalog_notes", "Operator notes, by source.", ["source"], notes
        )
        yield gauge("toolsetd_catalog_workspaces", "Workspaces loaded.", value=workspaces)
        yield gauge("toolsetd_catalog_generation", "The catalog generation.", value=s.generation())
        watch = s.watch()
        if watch is not None:  # --no-watch: no watch to tell of
            yield gauge(
                "toolsetd_watch_available",
                "1 while the watch works (or starts), 0 while edits are found by the poll alone.",
                value=0 if watch["state"] == "polling" else 1,
            )
            yield labelled(
                gauge,
                "toolsetd_watch_folders",
                "Folders followed: watched (inotify watches), or past --max-watches (polled).",
                ["state"],
                {"watched": watch["watched"], "polled": watch["pastCap"]},
            )


def _catalog_counts(
    catalogs: Sequence[Catalog],
) -> tuple[dict[tuple[str, str], int], dict[str, int], dict[str, int], int]:
    """Sets by (source, state), tools and notes by source, and workspaces, over every catalog.

    The home catalog counts its home sets; a workspace catalog adds its project sets
    (its home sets are the same ones, counted once).
    """
    sets: dict[tuple[str, str], int] = {}
    tools: dict[str, int] = {}
    notes: dict[str, int] = {}
    workspaces = 0
    for catalog in catalogs:
        if catalog.workspace is not None:
            workspaces += 1
        keep = Source.HOME if catalog.workspace is None else Source.PROJECT
        for entry in catalog.sets:
            if entry.source == keep:
                key = (entry.source.value, entry.state.value)
                sets[key] = sets.get(key, 0) + 1
        for loaded in catalog.tools.values():
            if loaded.toolset.source == keep:
                tools[keep.value] = tools.get(keep.value, 0) + 1
        for note in catalog.notes:
            source = note.source.value if note.source is not None else "config"
            if (catalog.workspace is None) != (note.source == Source.PROJECT):
                notes[source] = notes.get(source, 0) + 1
    return sets, tools, notes, workspaces


class _Collector:
    """A prometheus_client collector over ``Metrics``."""

    def __init__(self, metrics: Metrics) -> None:
        self._metrics = metrics

    def collect(self) -> Iterator[Any]:
        return self._metrics.families()


# -- the loopback /metrics listener -------------------------------------------------------


def bind_metrics(address: tuple[str, int]) -> socket.socket:
    """Bind and listen on the loopback ``/metrics`` address, before anything is served.

    Bound by the composition root at start-up, so an address that cannot be used (taken,
    not ours) stops the start with a one-line reason instead of a traceback later.

    Raises:
        OSError: The address cannot be bound.
    """
    host, port = address
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.set_inheritable(False)
        sock.bind((host, port))
        sock.listen(_BACKLOG)
    except BaseException:
        sock.close()
        raise
    return sock


async def serve_metrics(
    metrics: Metrics,
    sock: socket.socket,
    *,
    task_status: anyio.abc.TaskStatus[tuple[str, int]] = anyio.TASK_STATUS_IGNORED,
) -> None:
    """Answer ``GET /metrics`` on a bound loopback socket (``bind_metrics``) until cancelled.

    Anyone on the machine may connect (no authentication, no peer check), so nothing a
    scraper does may cost the daemon more than a bounded share: at most ``_MAX_SCRAPES``
    connections are served at once (the next ones are closed at once), each exchange has
    ``_REQUEST_TIMEOUT`` seconds in all (reading the request and writing the answer), and
    an ``accept`` that fails for want of descriptors or memory is retried after a pause
    (``metrics_accept_retry``, once per episode) instead of ending the daemon.

    Args:
        metrics: What to expose.
        sock: The listening socket; owned (and closed) from here on.
        task_status: Receives the bound (host, port).
    """
    listener = await anyio.abc.SocketListener.from_socket(sock)
    async with listener, anyio.create_task_group() as tg:
        bound = listener.extra(anyio.abc.SocketAttribute.local_address)
        host_bound, port_bound = str(bound[0]), int(bound[1])
        shown = f"[{host_bound}]" if ":" in host_bound else host_bound
        log.info("metrics_listening", address=f"{shown}:{port_bound}")
        task_status.started((host_bound, port_bound))
        active = 0
        refused = Throttle()
        acceptor = Acceptor(listener, log, "metrics_accept")

        async def answer(stream: anyio.abc.SocketStream) -> None:
            nonlocal active
            try:
                await _answer(metrics, stream, host_bound, port_bound)
            finally:
                active -= 1

        while True:
            try:
                stream = await acceptor.next()
            except (anyio.BrokenResourceError, OSError):
                return  # logged: the metrics listener stops, the daemon serves on
            if stream is None:
                return
            if active >= _MAX_SCRAPES:
                await stream.aclose()  # frees the descriptor at once; Prometheus retries
                said = refused.count("busy")
                if said is not None:
                    log.warning("metrics_connection_limit", limit=_MAX_SCRAPES, refused=said)
                continue
            active += 1
            tg.start_soon(answer, stream)


async def _answer(metrics: Metrics, stream: anyio.abc.SocketStream, host: str, port: int) -> None:
    """One HTTP/1.x exchange; anything but ``GET``/``HEAD /metrics`` gets 404 or 405, and
    a request that does not name this loopback listener as its ``Host`` 400, 421 or 403.

    The whole exchange, the answer's writing included, has ``_REQUEST_TIMEOUT`` seconds:
    a client that never reads cannot hold the connection (and its descriptor).
    """
    try:
        async with stream:
            with anyio.move_on_after(_REQUEST_TIMEOUT):
                await _exchange(metrics, stream, host, port)
    except (anyio.EndOfStream, anyio.BrokenResourceError, anyio.ClosedResourceError, OSError):
        pass
    except Exception:  # one scrape's bug must not end the listener
        log.exception("metrics_request_failed")


async def _exchange(metrics: Metrics, stream: anyio.abc.SocketStream, host: str, port: int) -> None:
    head = b""
    while b"\r\n\r\n" not in head and b"\n\n" not in head:
        head += await stream.receive(4096)
        if len(head) > _HEAD_LIMIT:
            await stream.send(_response(431, "text/plain", b"request head too large\n"))
            return
    # The request line ends at LF, as the head's end is found by LFs alone too (RFC 9112
    # 2.2); split() drops a CR before it.
    parts = head.split(b"\n", 1)[0].split()
    if len(parts) != 3 or not parts[2].startswith(b"HTTP/1."):
        await stream.send(_response(400, "text/plain", b"bad request\n"))
        return
    method, (target, authority) = parts[0], _target_parts(parts[1])
    if target != b"/metrics":
        await stream.send(_response(404, "text/plain", b"only /metrics is served here\n"))
        return
    if method not in (b"GET", b"HEAD"):
        await stream.send(_response(405, "text/plain", b"use GET\n", allow=True))
        return
    refusal = _misdirected(head, parts[2], host, port, authority)
    if refusal is not None:
        status, message = refusal
        await stream.send(_response(status, "text/plain", message.encode() + b"\n"))
        return
    try:
        text, content_type = metrics.recent_exposition()
    except MetricsUnavailable as exc:
        await stream.send(_response(503, "text/plain", exc.message.encode() + b"\n"))
        return
    body = text.encode()
    await stream.send(
        _response(200, content_type, b"" if method == b"HEAD" else body, length=len(body))
    )


def _misdirected(
    head: bytes, version: bytes, host: str, port: int, authority: str | None = None
) -> tuple[int, str] | None:
    """Why a request may not have the exposition (status, message), else None.

    Loopback is not only the machine's users: a web page whose name the attacker points
    at 127.0.0.1 (DNS rebinding) has the browser send its own name as ``Host``, and its
    script would read the answer. So ``Host`` must name this listener, as on the MCP
    endpoint (``httpguard.check_host_origin``): 421 otherwise, 403 for a foreign
    ``Origin``. HTTP/1.1 requires one ``Host`` (400 without, or with two: RFC 9112 3.2);
    an HTTP/1.0 request may have none. An absolute-form target's ``authority`` is the
    host judged, and ``Host`` is ignored (RFC 9112 3.2.2), as on the MCP endpoint: else
    a loopback ``Host`` let a target naming another host have the exposition.
    """
    from .httpguard import ListenAddress, check_host_origin  # rules of the MCP endpoint

    fields: dict[bytes, list[str]] = {b"host": [], b"origin": []}
    for line in head.split(b"\n")[1:]:
        if not line.strip(b"\r"):
            break  # the head's end: what follows is a body
        name, sep, value = line.partition(b":")
        found = fields.get(name.strip().lower()) if sep else None
        if found is not None:
            found.append(value.strip().decode("latin-1"))
    hosts, origins = fields[b"host"], fields[b"origin"]
    if len(hosts) > 1 or (not hosts and version != b"HTTP/1.0"):
        return 400, "Bad request: one Host header is required."
    if authority is not None:
        hosts = [authority]
    if not hosts and not origins:
        return None
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # Without a Host (HTTP/1.0), the listener's own address stands for it, bracketed as
    # a Host is for IPv6 ("::1:PORT" would be read as the host "").
    bound = f"[{host}]" if family == socket.AF_INET6 else host
    return check_host_origin(
        hosts[0] if hosts else f"{bound}:{port}",
        origins[0] if origins else None,
        ListenAddress(family, host, port),
        port,
    )


def _target_parts(target: bytes) -> tuple[bytes, str | None]:
    """The path a request target names, its query dropped, and its authority (None for
    the origin-form).

    The origin-form (``/metrics?x``) is its own path; the absolute-form
    (``http://127.0.0.1:9464/metrics``), which RFC 9112 3.2.2 says a server MUST accept,
    names the path after its authority, and that authority is the request's host.
    """
    scheme, sep, _ = target.partition(b"://")
    if sep and scheme.lower() in (b"http", b"https"):
        from urllib.parse import urlsplit  # only for this rare form

        try:
            parts = urlsplit(target.decode("latin-1"))
        except ValueError:  # an authority it cannot read (``http://[::1/metrics``)
            return target, None  # no /metrics: 404, as a target of another scheme
        return parts.path.encode("latin-1"), parts.netloc
    return target.split(b"?", 1)[0], None


_REASONS = {
    200: "OK",
    400: "Bad Request",
    403: "Forbidden",
    404: "Not Found",
    405: "Method Not Allowed",
    421: "Misdirected Request",
    431: "Request Header Fields Too Large",
    503: "Service Unavailable",
}


def _response(
    status: int, content_type: str, body: bytes, *, length: int | None = None, allow: bool = False
) -> bytes:
    headers = [
        f"HTTP/1.1 {status} {_REASONS[status]}",
        f"Date: {email.utils.formatdate(usegmt=True)}",  # RFC 9110 6.6.1
        f"Content-Type: {content_type}",
        f"Content-Length: {len(body) if length is None else length}",
        "Connection: close",
    ]
    if allow:
        headers.append("Allow: GET, HEAD")
    return ("\r\n".join(headers) + "\r\n\r\n").encode() + body
