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
    text, _ = metrics.exposition()
    calls = {
        sample.labels["set"]: sample.value
        for family in text_string_to_metric_families(text)
        if family.name == "toolsetd_calls"
        for sample in family.samples
        if sample.name == "toolsetd_calls_total"
    }
    assert len(calls) == MAX_SET_LABELS + 1
    assert calls[OTHER_SETS] == extra
    assert calls["set0"] == 2
