"""OpenTelemetry traces of ``invoke`` (the optional extra ``toolsetd[otel]``).

Theory of operation
-------------------
This module imports ``opentelemetry``; nothing else in the daemon does, and the composition
root imports this module only when tracing is on (``traces`` is not ``off``, or a test hands
in a tracer provider). Without the extra, nothing of OpenTelemetry is loaded.

``Tracing`` is an ``observe.Observer``. Each ``invoke`` that reached a policy decision gets
one span, following the GenAI semantic conventions for tool execution:

* name ``execute_tool {tool}``, kind INTERNAL, ``gen_ai.operation.name = execute_tool``,
  ``gen_ai.tool.name``, ``gen_ai.tool.call.id``, ``gen_ai.tool.type = function``;
* toolsetd's own attributes: ``toolsetd.set``, ``toolsetd.source``, ``toolsetd.decision``,
  ``toolsetd.status`` and, once the tool exited, ``toolsetd.exit_code``;
* ``error.type`` and an ERROR status when the call did not end ``ok``.

Its parent is the caller's W3C ``traceparent`` (the ``invoke`` param; MCP's ``_meta``
maps onto it), else it starts a trace. The child receives ``TRACEPARENT`` naming this
span, so the tool's own spans join the trace. When the call ends, two child spans are
recorded from the runner's timings: ``toolsetd.queue_wait`` (waiting for a
``--max-running`` slot) and ``toolsetd.process`` (spawn to reap).

Arguments, environments and output never go into a span (the GenAI
``gen_ai.tool.call.arguments`` and ``gen_ai.tool.call.result`` are deliberately not set).
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from opentelemetry import trace
from opentelemetry.trace import SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
from toolsetd.protocol import __version__

from .observe import CallInfo
from .settings import ConfigError

if TYPE_CHECKING:
    from .call import CallOutcome

__all__ = ["Tracing", "check_exporter", "tracer_provider"]

_PROPAGATOR = TraceContextTextMapPropagator()
_REFUSALS = {
    "deny": "policy_denied",
    "approval": "approval_required",
    "arguments": "invalid_arguments",
}


class _CallSpan:
    __slots__ = ("_began", "_info", "_span", "_tracer")

    def __init__(self, tracer: trace.Tracer, info: CallInfo) -> None:
        self._tracer = tracer
        self._info = info
        parent = (
            _PROPAGATOR.extract({"traceparent": info.traceparent}) if info.traceparent else None
        )
        self._began = time.time_ns()
        self._span = tracer.start_span(
            f"execute_tool {info.tool}",
            context=parent,
            kind=SpanKind.INTERNAL,
            start_time=self._began,
            attributes={
                "gen_ai.operation.name": "execute_tool",
                "gen_ai.tool.name": info.tool,
                "gen_ai.tool.call.id": info.call_id,
                "gen_ai.tool.type": "function",
                "toolsetd.set": info.set,
                "toolsetd.source": info.source,
                "toolsetd.decision": info.decision,
            },
        )

    def child_env(self) -> Mapping[str, str]:
        carrier: dict[str, str] = {}
        _PROPAGATOR.inject(carrier, context=trace.set_span_in_context(self._span))
        value = carrier.get("traceparent")
        return {"TRACEPARENT": value} if value else {}

    def refused(self, reason: str) -> None:
        error = _REFUSALS.get(reason, reason)
        self._span.set_attributes({"toolsetd.status": "refused", "error.type": error})
        self._span.set_status(Status(StatusCode.ERROR, error))
        self._span.end()

    def finished(self, outcome: CallOutcome | None) -> None:
        span = self._span
        now = time.time_ns()
        if outcome is None:
            span.set_attributes({"toolsetd.status": "error", "error.type": "internal"})
            span.set_status(Status(StatusCode.ERROR, "internal"))
            span.end(end_time=now)
            return
        attributes: dict[str, Any] = {"toolsetd.status": outcome.status}
        if outcome.exit_code is not None:
            attributes["toolsetd.exit_code"] = outcome.exit_code
        if outcome.status != "ok":
            attributes["error.type"] = outcome.status
        span.set_attributes(attributes)
        if outcome.status != "ok":
            span.set_status(Status(StatusCode.ERROR, outcome.status))
        context = trace.set_span_in_context(span)
        run_began = max(self._began, now - outcome.duration_ms * 1_000_000)
        slot = min(now, run_began + outcome.queue_ms * 1_000_000)
        queue = self._tracer.start_span(
            "toolsetd.queue_wait", context=context, start_time=run_began
        )
        queue.end(end_time=slot)
        if outcome.started or outcome.spawn_failed:
            process = self._tracer.start_span(
                "toolsetd.process",
                context=context,
                start_time=slot,
                attributes={"process.pid": outcome.pid} if outcome.pid else None,
            )
            if outcome.exit_code is not None:
                process.set_attribute("process.exit.code", outcome.exit_code)
            if outcome.spawn_failed:
                process.set_status(Status(StatusCode.ERROR, "spawn_failed"))
            process.end(end_time=now)
        span.end(end_time=now)


class Tracing:
    """Spans for ``invoke``; the other observer events are not traced.

    Args:
        provider: An OpenTelemetry ``TracerProvider`` (the SDK's, with its exporters).
    """

    def __init__(self, provider: Any) -> None:
        self._tracer = provider.get_tracer("toolsetd", __version__)

    def call(self, info: CallInfo) -> _CallSpan:
        """Start the call's span."""
        return _CallSpan(self._tracer, info)

    def connection_refused(self, reason: str) -> None:
        """Not traced."""

    def reload_finished(self, seconds: float, failed: bool) -> None:
        """Not traced."""


def check_exporter(kind: str) -> None:
    """Refuse ``traces = "otlp"`` when its exporter is not installed (a start, and a reload
    that changes ``traces``, say so).

    Raises:
        ConfigError: The OTLP exporter is not installed.
    """
    if kind != "otlp":
        return
    try:
        import opentelemetry.exporter.otlp.proto.http.trace_exporter  # noqa: F401
    except ImportError:
        raise ConfigError(
            "otlp needs opentelemetry-exporter-otlp-proto-http: install toolsetd[otel]",
            key="traces",
        ) from None


def tracer_provider(kind: str) -> Any:
    """An SDK tracer provider exporting to ``otlp`` (the standard ``OTEL_*`` variables
    configure the endpoint) or to ``console`` (stdout).

    Raises:
        ConfigError: The OTLP exporter is not installed.
    """
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter

    exporter: Any
    if kind == "console":
        exporter = ConsoleSpanExporter()
    else:
        check_exporter(kind)
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        exporter = OTLPSpanExporter()
    attributes = {"service.version": __version__}
    if not os.environ.get("OTEL_SERVICE_NAME"):
        attributes["service.name"] = "toolsetd"
    provider = TracerProvider(resource=Resource.create(attributes))
    provider.add_span_processor(BatchSpanProcessor(exporter))
    return provider
