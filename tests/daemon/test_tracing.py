"""OpenTelemetry spans of invoke, with the SDK's in-memory exporter, on an in-process daemon.

The daemon runs in the test's event loop (``run_daemon`` with a tracer provider whose
exporter keeps the spans in memory); the tools are real child processes.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest

pytest.importorskip("opentelemetry.sdk")

from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import (
    InMemorySpanExporter,
)
from opentelemetry.trace import StatusCode
from toolsetd.client import Client
from toolsetd.daemon.app import DaemonOptions, run_daemon
from toolsetd.protocol.errors import PolicyDenied

PARENT_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT = f"00-{PARENT_TRACE}-00f067aa0ba902b7-01"


def _write_set(root: Path, name: str, script: str, **manifest: Any) -> None:
    folder = root / name
    folder.mkdir(parents=True)
    (folder / "tools.json").write_text(
        json.dumps(
            {
                "runner": "exec",
                "description": name,
                "schema": {"type": "object"},
                "command": [f"{name}.sh"],
                "stdin": True,
                "approval": "always",
                **manifest,
            }
        )
    )
    (folder / f"{name}.sh").write_text("#!/bin/sh\n" + script)
    (folder / f"{name}.sh").chmod(0o755)


@pytest.fixture
def base() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="tst-"))
    try:
        tools = path / "home" / "tools"
        _write_set(tools, "echoenv", 'cat > /dev/null\nprintf "%s" "$TRACEPARENT"\n')
        _write_set(tools, "fail", "cat > /dev/null\necho bad >&2\nexit 3\n")
        _write_set(tools, "guarded", "echo never\n", approval="inherit")
        (path / "ws").mkdir()
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
async def traced(base: Path) -> AsyncIterator[tuple[Client, InMemorySpanExporter, Path]]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    options = DaemonOptions(
        home=base / "home",
        socket=base / "s.sock",
        orphan_guard=False,
        watch=False,
        tracer_provider=provider,
    )
    async with anyio.create_task_group() as tg:
        path = await tg.start(run_daemon, options)
        async with await Client.connect(path) as client:
            yield client, exporter, base / "ws"
        # Client.aclose closes only the sending side of its notification stream; the
        # receiving side would warn when collected.
        client.notifications().close()
        tg.cancel_scope.cancel()
    provider.shutdown()


def _by_name(spans: tuple[ReadableSpan, ...]) -> dict[str, ReadableSpan]:
    return {span.name: span for span in spans}


@pytest.mark.anyio
async def test_tracing_invoke_span_children_and_traceparent(
    traced: tuple[Client, InMemorySpanExporter, Path],
) -> None:
    """One execute_tool span under the caller's trace, queue and process children, and the
    child's TRACEPARENT naming that span; no argument or output in any span."""
    client, exporter, ws = traced
    with anyio.fail_after(20):
        result = await client.invoke(
            "echoenv", {"secret": "s3cr3t-value"}, ws, call_id="c-1", traceparent=PARENT
        )
    spans = _by_name(exporter.get_finished_spans())
    assert set(spans) == {"execute_tool echoenv", "toolsetd.queue_wait", "toolsetd.process"}
    call = spans["execute_tool echoenv"]
    assert call.context is not None and call.parent is not None
    assert format(call.context.trace_id, "032x") == PARENT_TRACE
    assert format(call.parent.span_id, "016x") == "00f067aa0ba902b7"
    attributes = dict(call.attributes or {})
    assert attributes == {
        "gen_ai.operation.name": "execute_tool",
        "gen_ai.tool.name": "echoenv",
        "gen_ai.tool.call.id": "c-1",
        "gen_ai.tool.type": "function",
        "toolsetd.set": "echoenv",
        "toolsetd.source": "home",
        "toolsetd.decision": "allow",
        "toolsetd.status": "ok",
        "toolsetd.exit_code": 0,
    }
    for child in ("toolsetd.queue_wait", "toolsetd.process"):
        span = spans[child]
        assert span.parent is not None and span.parent.span_id == call.context.span_id
        assert call.start_time is not None and span.start_time is not None
        assert call.end_time is not None and span.end_time is not None
        assert call.start_time <= span.start_time <= span.end_time <= call.end_time
    assert dict(spans["toolsetd.process"].attributes or {})["process.exit.code"] == 0
    seen = result["content"][0]["text"].splitlines()[-1]
    assert seen == f"00-{PARENT_TRACE}-{call.context.span_id:016x}-01"
    for span in spans.values():
        assert "s3cr3t" not in repr(dict(span.attributes or {}))


@pytest.mark.anyio
async def test_tracing_error_and_denied_calls(
    traced: tuple[Client, InMemorySpanExporter, Path],
) -> None:
    """A failing tool and a denied call end their spans with ERROR and error.type; without a
    caller's traceparent each call starts its own trace."""
    client, exporter, ws = traced
    with anyio.fail_after(20):
        result = await client.invoke("fail", {}, ws, call_id="c-2")
        assert result["status"] == "error"
        with pytest.raises(PolicyDenied):
            await client.invoke("guarded", {}, ws, call_id="c-3", headless=True)
    spans = _by_name(exporter.get_finished_spans())
    failed = spans["execute_tool fail"]
    assert failed.parent is None
    assert failed.status.status_code == StatusCode.ERROR
    assert dict(failed.attributes or {})["error.type"] == "error"
    assert dict(failed.attributes or {})["toolsetd.exit_code"] == 3
    denied = spans["execute_tool guarded"]
    assert denied.status.status_code == StatusCode.ERROR
    attributes = dict(denied.attributes or {})
    assert attributes["toolsetd.decision"] == "deny"
    assert attributes["toolsetd.status"] == "refused"
    assert attributes["error.type"] == "policy_denied"
    # A refused call never reached the runner: no queue or process span under it.
    assert denied.context is not None
    assert not [
        s
        for s in exporter.get_finished_spans()
        if s.parent is not None and s.parent.span_id == denied.context.span_id
    ]
