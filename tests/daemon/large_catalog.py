"""A real service over a home of more tools than ``LARGE_CATALOG`` (listed from a worker
thread), for the tests that hold such a listing's build to order it against another."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import anyio


def write_set(folder: Path, index: int, description: str = "d") -> None:
    """A set of 20 tools, ``s<index>``, in ``folder``."""
    (folder / f"s{index:03d}").mkdir(parents=True, exist_ok=True)
    tools = [{"name": f"t{index}_{n}", "description": description,
              "schema": {"type": "object"}} for n in range(20)]
    manifest = {"runner": "exec", "command": ["true"], "tools": tools}
    (folder / f"s{index:03d}" / "tools.json").write_text(json.dumps(manifest))


def large_sets(folder: Path, description: str = "d") -> int:
    """Sets of more tools than ``LARGE_CATALOG`` in ``folder``; returns how many."""
    from toolsetd.daemon.model import LARGE_CATALOG

    sets = LARGE_CATALOG // 20 + 5
    for index in range(sets):
        write_set(folder, index, description)
    return sets


def real_service(tmp_path: Path, home: Path) -> Any:
    """A ``Service`` over ``home``, with a real registry and runner."""
    from toolsetd.daemon.model import DEFAULT_RESERVED_NAMES
    from toolsetd.daemon.registry import Registry
    from toolsetd.daemon.runner import Runner, RunnerSettings
    from toolsetd.daemon.sdnotify import Notifier
    from toolsetd.daemon.service import Service, ServiceSettings
    from toolsetd.daemon.validation import ArgumentValidators

    registry = Registry(home, DEFAULT_RESERVED_NAMES)
    runner = Runner(RunnerSettings(), anyio.CapacityLimiter(4), os.environ)
    return Service(
        ServiceSettings(socket=str(tmp_path / "s"), home=home, user_home=Path.home()),
        registry, runner, ArgumentValidators(), Notifier.from_environ({}),
    )
