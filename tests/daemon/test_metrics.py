"""Metrics: the counts behind the exposition."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from toolsetd.daemon.metrics import MAX_SET_LABELS, OTHER_SETS, Metrics, MetricsSources
from toolsetd.daemon.observe import CallInfo


def _metrics() -> Metrics:
    return Metrics(
        MetricsSources(
            in_flight=lambda: 0,
            queued=lambda: 0,
            connections_open=lambda: 0,
            connections_accepted=lambda: 0,
            catalogs=lambda: [],
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
