"""Metrics: the counts behind the exposition."""

from __future__ import annotations

import contextlib

import anyio
import pytest
from prometheus_client.parser import text_string_to_metric_families
from toolsetd.daemon.metrics import (
    MAX_SET_LABELS,
    OTHER_SETS,
    Metrics,
    MetricsSources,
    bind_metrics,
    serve_metrics,
)
from toolsetd.daemon.observe import CallInfo


def _metrics() -> Metrics:
    return Metrics(
        MetricsSources(
            in_flight=lambda: 0,
            queued=lambda: 0,
            connections_open=lambda: 0,
            connections_accepted=lambda: 0,
            catalogs=list,
            generation=lambda: 1,
        )
    )


def test_metrics_set_labels_are_bounded() -> None:
    """Any workspace a client names brings project sets of its own: past MAX_SET_LABELS
    distinct names, calls count under set="_other", so neither the counts nor each scrape
    (rendered on the event loop) grow without bound. A set seen before keeps its label."""
    metrics = _metrics()
    extra = 50
    for n in range(MAX_SET_LABELS + extra):
        metrics.call(CallInfo(f"c{n}", "t", f"set{n}", "project", "deny")).refused("deny")
    metrics.call(CallInfo("again", "t", "set0", "project", "deny")).refused("deny")
    # The operator's home sets keep their names past the cap: project sets named first
    # by any client cannot push them into _other.
    metrics.call(CallInfo("home", "t", "deploy", "home", "deny")).refused("deny")
    text, _ = metrics.exposition()
    calls = {
        sample.labels["set"]: sample.value
        for family in text_string_to_metric_families(text)
        if family.name == "toolsetd_calls"
        for sample in family.samples
        if sample.name == "toolsetd_calls_total"
    }
    assert len(calls) == MAX_SET_LABELS + 2
    assert calls[OTHER_SETS] == extra
    assert calls["set0"] == 2
    assert calls["deploy"] == 1


def test_metrics_listener_renders_at_most_once_a_second() -> None:
    """What /metrics serves (anyone on the machine may scrape it, in a loop) is rendered
    again only once the last rendering is a second old; the metrics method is always fresh."""
    metrics = _metrics()
    now = [100.0]

    def clock() -> float:
        return now[0]

    def refused(n: int) -> None:
        metrics.call(CallInfo(f"c{n}", "t", "lint", "project", "deny")).refused("deny")

    refused(1)
    first, _ = metrics.recent_exposition(clock=clock)
    assert 'set="lint",status="refused"} 1.0' in first
    refused(2)
    now[0] += 0.5
    assert metrics.recent_exposition(clock=clock)[0] is first  # not rendered again
    assert 'set="lint",status="refused"} 2.0' in metrics.exposition()[0]
    now[0] += 0.5
    again, _ = metrics.recent_exposition(clock=clock)
    assert 'set="lint",status="refused"} 2.0' in again


async def _scrape_raw(request: bytes, address: str = "127.0.0.1") -> bytes:
    """Send ``request`` to a fresh /metrics listener on ``address`` (``PORT`` in it becomes
    the port it listens on); the answer, read to its close."""
    metrics = _metrics()
    async with anyio.create_task_group() as tg:
        host, port = await tg.start(serve_metrics, metrics, bind_metrics((address, 0)))
        with anyio.fail_after(15):
            async with await anyio.connect_tcp(host, port) as stream:
                await stream.send(request.replace(b"PORT", str(port).encode()))
                answer = b""
                with contextlib.suppress(anyio.EndOfStream, anyio.BrokenResourceError):
                    while True:
                        answer += await stream.receive()
        tg.cancel_scope.cancel()
    return answer


@pytest.mark.anyio
@pytest.mark.parametrize("address", ["127.0.0.1", "::1"])
async def test_metrics_listener_takes_an_http10_request_with_a_loopback_origin_and_no_host(
    address: str,
) -> None:
    """An HTTP/1.0 request may leave Host out; its Origin, a loopback page of this port, is
    then checked against the listener's own address. On an IPv6 listener that address
    was written unbracketed (``::1:PORT``), read as no loopback host, and the request got
    421 where the same one to 127.0.0.1 got the exposition."""
    shown = f"[{address}]" if ":" in address else address
    try:  # an address this machine has (no IPv6 loopback in some containers)
        bind_metrics((address, 0)).close()
    except OSError as exc:
        pytest.skip(f"cannot listen on {address}: {exc.strerror}")
    answer = await _scrape_raw(
        f"GET /metrics HTTP/1.0\r\nOrigin: http://{shown}:PORT\r\n\r\n".encode(), address
    )
    assert answer.startswith(b"HTTP/1.1 200 "), answer[:200]


@pytest.mark.anyio
@pytest.mark.parametrize(
    "request_head",
    [
        b"GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n",
        # RFC 9112 2.2: a recipient may take a bare LF as a line's end, and the head's end
        # was already found by one (b"\n\n"); the request line was cut at CRLF alone, so
        # the whole head was its "request line" and the answer 400.
        b"GET /metrics HTTP/1.1\nHost: 127.0.0.1\n\n",
        # RFC 9112 3.2.2: a server MUST accept the absolute-form; it was 404.
        b"GET http://127.0.0.1/metrics HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n",
        b"GET HTTP://127.0.0.1:PORT/metrics?x=1 HTTP/1.0\r\n\r\n",
    ],
)
async def test_metrics_listener_reads_every_request_form_http_allows(request_head: bytes) -> None:
    """/metrics answers 200 to a bare-LF head and to an absolute-form target."""
    answer = await _scrape_raw(request_head)
    assert answer.startswith(b"HTTP/1.1 200 OK\r\n"), answer[:200]
    assert b"toolsetd_build_info" in answer


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("request_head", "status"),
    [
        # DNS rebinding: a page of evil.example, its name pointed at 127.0.0.1, had the
        # user's browser read the exposition (set names and counts), though only local
        # users were to read it; the MCP endpoint refuses such a Host with 421 already.
        (b"GET /metrics HTTP/1.1\r\nHost: evil.example:PORT\r\n\r\n", b"421"),
        (b"GET /metrics HTTP/1.1\r\nHost: evil.example\r\n\r\n", b"421"),
        (b"GET /metrics HTTP/1.1\r\nHost: 127.0.0.1:1\r\n\r\n", b"421"),
        (b"GET /metrics HTTP/1.0\r\nhost: evil.example\r\n\r\n", b"421"),
        (
            b"GET /metrics HTTP/1.1\r\nHost: 127.0.0.1:PORT\r\n"
            b"Origin: http://evil.example\r\n\r\n",
            b"403",
        ),
        (  # an Origin urlsplit cannot read: a traceback and no answer
            b"GET /metrics HTTP/1.1\r\nHost: 127.0.0.1:PORT\r\n"
            b"Origin: http://[::1\r\n\r\n",
            b"403",
        ),
        # RFC 9112 3.2: an HTTP/1.1 request without a Host, or with two, is 400.
        (b"GET /metrics HTTP/1.1\r\n\r\n", b"400"),
        (b"GET /metrics HTTP/1.1\r\nHost: localhost\r\nHost: evil.example\r\n\r\n", b"400"),
        # What Prometheus, curl and an HTTP/1.0 client send.
        (b"GET /metrics HTTP/1.1\r\nHost: 127.0.0.1:PORT\r\n\r\n", b"200"),
        (b"GET /metrics HTTP/1.1\r\nHost: localhost:PORT\r\n\r\n", b"200"),
        (b"GET /metrics HTTP/1.0\r\n\r\n", b"200"),
        # RFC 9112 3.2.2: an absolute-form target's authority is the host, and Host is
        # ignored (as on the MCP endpoint): a loopback Host let a target naming another
        # host (or port) have the exposition, and a foreign Host refused one naming this.
        (b"GET http://evil.example/metrics HTTP/1.1\r\nHost: 127.0.0.1:PORT\r\n\r\n", b"421"),
        (b"GET http://127.0.0.1:1/metrics HTTP/1.1\r\nHost: 127.0.0.1:PORT\r\n\r\n", b"421"),
        (b"GET http://evil.example/metrics HTTP/1.0\r\n\r\n", b"421"),
        (b"GET http://127.0.0.1:PORT/metrics HTTP/1.1\r\nHost: evil.example\r\n\r\n", b"200"),
    ],
)
async def test_metrics_listener_answers_only_a_loopback_host(
    request_head: bytes, status: bytes
) -> None:
    """Host must name this loopback listener, as on the MCP endpoint."""
    answer = await _scrape_raw(request_head)
    assert answer.startswith(b"HTTP/1.1 " + status + b" "), answer[:200]
    assert (b"toolsetd_build_info" in answer) == (status == b"200")


@pytest.mark.anyio
@pytest.mark.parametrize(
    "request_head",
    [
        b"GET http://127.0.0.1/other HTTP/1.1\r\n\r\n",
        b"GET http://127.0.0.1 HTTP/1.1\r\n\r\n",
        b"GET //127.0.0.1/metrics HTTP/1.1\r\n\r\n",  # origin-form: the path is //127.0.0.1/...
        b"GET ftp://127.0.0.1/metrics HTTP/1.1\r\n\r\n",
        # An authority that cannot be read (an IPv6 literal never closed): urlsplit
        # raised, and each such request was a traceback in the log
        # (``metrics_request_failed``, at error level) and a connection closed unanswered.
        b"GET http://[::1/metrics HTTP/1.1\r\nHost: 127.0.0.1:PORT\r\n\r\n",
    ],
)
async def test_metrics_listener_serves_no_other_target(request_head: bytes) -> None:
    """Only the path /metrics is served, whatever form names it: an absolute-form target
    whose authority cannot be read names no resource here."""
    answer = await _scrape_raw(request_head)
    assert answer.startswith(b"HTTP/1.1 404 Not Found\r\n"), answer[:200]
