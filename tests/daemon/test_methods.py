"""The native handlers over a real service (``toolsetd.daemon.methods``), where a test must
hold a large ``list``'s build to order it against a reload or another list; the methods
are driven through a real daemon in tests/integration."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import anyio
import pytest
from toolsetd.protocol.jsontext import dumps as json_dumps

from .large_catalog import large_sets, real_service

pytestmark = pytest.mark.anyio


def _handlers(tmp_path: Path, home: Path) -> Any:
    """``Handlers`` over a real service of ``home``."""
    from toolsetd.daemon.methods import Handlers

    return Handlers(real_service(tmp_path, home), lambda: ())


async def test_a_large_list_built_late_leaves_a_newer_snapshots_body_cached(
    tmp_path: Path,
) -> None:
    """A ``list`` of a large snapshot builds its body in a worker thread. A reload landing
    meanwhile whose snapshot is small is listed at once, and cached; the older build, done
    after it, took that entry, and every later ``list`` of the current snapshot built its
    body again (and, large, in a thread, behind any other build)."""
    home, spare = tmp_path / "home", tmp_path / "spare"
    sets = large_sets(home / "tools")
    spare.mkdir()
    handlers = _handlers(tmp_path, home)
    with anyio.fail_after(60):
        async with anyio.create_task_group() as tg:
            building = handlers._list_cache.building(None, None)
            async with building:  # the large snapshot's build waits
                tg.start_soon(handlers.list, None, {})
                while building.statistics().tasks_waiting == 0:
                    await anyio.sleep(0.01)
                for index in range(1, sets):  # a small snapshot, listed on the loop
                    shutil.move(home / "tools" / f"s{index:03d}", spare)
                await handlers.service.reload_catalogs(None)
                small = await handlers.list(None, {})
            # The large build ends once the lock is left to it, and with it the task group.
        again = await handlers.list(None, {})
    assert again["tools"] is small["tools"], "the current snapshot's body was built again"


async def test_a_large_list_of_one_workspace_does_not_wait_for_anothers_build(
    tmp_path: Path,
) -> None:
    """Large ``list`` bodies were built one at a time, all workspaces together: a list of
    one project waited out the build of another's (20,000 tools: 0.3-0.6 s). Only lists
    of the same workspace and filter wait for each other (the second takes the first's)."""
    from toolsetd.daemon.model import LARGE_CATALOG

    home, first, second = tmp_path / "home", tmp_path / "a", tmp_path / "b"
    large_sets(home / "tools")
    for workspace in (first, second):
        workspace.mkdir()
    handlers = _handlers(tmp_path, home)
    with anyio.fail_after(60):
        async with anyio.create_task_group() as tg:
            building = handlers._list_cache.building(handlers.service.workspace(str(first)), None)
            async with building:  # a's build waits
                tg.start_soon(handlers.list, None, {"workspace": str(first)})
                while building.statistics().tasks_waiting == 0:
                    await anyio.sleep(0.01)
                listed: list[dict[str, Any]] = []

                async def list_second() -> None:
                    listed.append(await handlers.list(None, {"workspace": str(second)}))

                tg.start_soon(list_second)
                # Until b is listed, or its list waits behind a's build too.
                while not listed and building.statistics().tasks_waiting < 2:
                    await anyio.sleep(0.01)
                assert listed, "b's list waited for a's build"
                assert building.statistics().tasks_waiting == 1  # a's still waits
    assert len(json.loads(json_dumps(listed[0]["tools"]))) > LARGE_CATALOG
    assert not handlers._list_cache._building, "a lock outlived its builds"
