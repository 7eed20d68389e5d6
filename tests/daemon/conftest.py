"""Helpers for runner tests: a set directory in tmp_path, a LoadedTool for it, a recording sink."""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from toolsetd.daemon.model import (
    Approval,
    ApprovalSource,
    CatalogName,
    LoadedTool,
    OutputMode,
    RunnerKind,
    Source,
    ToolDef,
    ToolSet,
)


@pytest.fixture
def own_sigalrm() -> Iterator[None]:
    """pytest-timeout's signal method owns SIGALRM and the real timer in this process:
    set them aside for the test (``run_limited`` leaves a running timer alone, so a check
    that backtracks would run unlimited), then give them back."""
    handler = signal.getsignal(signal.SIGALRM)
    left, _ = signal.setitimer(signal.ITIMER_REAL, 0)
    yield
    signal.signal(signal.SIGALRM, handler)
    if left:
        signal.setitimer(signal.ITIMER_REAL, left)


#: A fast Python for child scripts (no site import).
PY = (sys.executable, "-S")


def make_tool(
    set_dir: Path,
    *,
    command: Sequence[str] = (),
    tool_command: Sequence[str] = (),
    argv: Sequence[tuple[str, str]] = (),
    stdin: bool = True,
    timeout: int | None = 30,
    output: OutputMode = OutputMode.TEXT,
    name: str = "t",
) -> LoadedTool:
    """A LoadedTool of an exec set living in ``set_dir``."""
    tool = ToolDef(
        name=name,
        description="test tool",
        schema={"type": "object"},
        catalogs=frozenset({CatalogName.PLAN, CatalogName.WORK}),
        approval=Approval.INHERIT,
        command=tuple(tool_command),
        argv=tuple(argv),
        output=output,
    )
    toolset = ToolSet(
        directory=set_dir.name,
        source=Source.PROJECT,
        path=set_dir,
        runner=RunnerKind.EXEC,
        command=tuple(command),
        stdin=stdin,
        timeout_seconds=timeout,
        tools=(tool,),
    )
    return LoadedTool(
        tool=tool,
        toolset=toolset,
        effective_approval=Approval.INHERIT,
        policy=ApprovalSource.HOST,
        hash="sha256:test",
    )


def python_tool(set_dir: Path, code: str, **kwargs: Any) -> LoadedTool:
    """A tool running ``code`` (written to ``<set_dir>/tool.py``) with ``python -S``."""
    script = set_dir / "tool.py"
    script.write_text(code)
    return make_tool(set_dir, command=(*PY, str(script)), **kwargs)


def sh_tool(set_dir: Path, script: str, **kwargs: Any) -> LoadedTool:
    """A tool running a /bin/sh script."""
    return make_tool(set_dir, command=("/bin/sh", "-c", script, "sh"), **kwargs)


@dataclass
class RecordingSink:
    """An EventSink that records every event with its arguments."""

    events: list[tuple[str, dict[str, Any]]] = field(default_factory=list)

    async def started(self, pid: int) -> None:
        self.events.append(("started", {"pid": pid}))

    async def progress(self, **kwargs: Any) -> None:
        self.events.append(("progress", kwargs))

    def of(self, kind: str) -> list[dict[str, Any]]:
        return [args for name, args in self.events if name == kind]


@dataclass
class Env:
    """The directories of one test: workspace, home and a set directory."""

    workspace: Path
    home: Path
    set_dir: Path


@pytest.fixture
def env(tmp_path: Path) -> Env:
    """A canonical workspace, a home, and an (empty) set directory ``acme``."""
    root = Path(os.path.realpath(tmp_path))
    workspace = root / "ws"
    home = root / "home"
    set_dir = home / "tools" / "acme"
    for folder in (workspace, set_dir):
        folder.mkdir(parents=True)
    return Env(workspace=workspace, home=home, set_dir=set_dir)


def open_fds() -> set[str]:
    """The test process's open file descriptors."""
    return set(os.listdir("/proc/self/fd"))
