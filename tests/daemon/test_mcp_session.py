"""Unit tests for ``toolsetd.daemon.mcp_session``'s pure helpers (the session itself is
driven through a real daemon in tests/integration/test_mcp.py), and one session over a real
service, where a test must hold a listing's build to order two reloads."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import anyio
import pytest
from toolsetd.daemon.mcp_session import _is_progress_token
from toolsetd.protocol.jsontext import loads

from .large_catalog import large_sets, real_service, write_set


@pytest.mark.parametrize(
    ("text", "taken"),
    [
        ('"abc"', True),
        ("7", True),
        ("-0", True),  # an integer in JSON's grammar, kept as a number with its text
        (str(2**80), True),
        # JSON Schema's integer is a number whose fraction is zero, however written
        # (fccc697); decided in decimal, never through a float.
        ("0.0", True),
        ("1e2", True),
        ("1.5", False),
        ("1e-2", False),
        ("1.0000000000000000001", False),  # a float's 1.0, but no integer
        ("1.5e99999999999999999999999", False),  # past decimal's exponent: refused (692d00a)
        ("true", False),
        ("{}", False),
        ("[]", False),
    ],
)
def test_a_progress_token_is_a_string_or_a_json_integer(text: str, taken: bool) -> None:
    assert _is_progress_token(loads(text.encode())) is taken


def test_a_bind_names_its_first_unknown_field_as_sent(tmp_path: Path) -> None:
    """mcp.bind (and the HTTP query, by the same check) names the first unknown field in
    the order sent, as every native params error does; it sorted all of them first, which
    for a 16 MiB bind of 1.6 million stray keys held the event loop 0.7 s longer."""
    from toolsetd.daemon.mcp_session import Binding
    from toolsetd.protocol.errors import InvalidParams

    with pytest.raises(InvalidParams) as caught:
        Binding.from_params({"workspace": str(tmp_path), "zeta": 1, "alpha": 2})
    assert caught.value.data == {"field": "zeta"}
    assert "unknown field 'zeta'" in caught.value.message


async def _session(server: Any, workspace: Path, told: list[dict[str, object]]) -> Any:
    """A session of ``server`` bound to ``workspace`` whose host knows its list
    (initialized), posting what it tells into ``told``."""
    from toolsetd.daemon.mcp_session import Binding, McpSession

    class Outbox:
        def post(self, message: dict[str, object], *, droppable: bool = False) -> None:
            told.append(message)

        async def drained(self) -> None:
            return None

    session = McpSession(server, Binding(workspace), Outbox(), {}, 1)
    initialize = {"protocolVersion": "2025-06-18", "capabilities": {},
                  "clientInfo": {"name": "test", "version": "1"}}
    answer = await session.receive(
        {"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": initialize}
    )
    assert answer["result"]["protocolVersion"] == "2025-06-18"
    return session


@pytest.mark.anyio
async def test_a_listing_built_late_does_not_take_the_place_of_a_newer_one(
    tmp_path: Path,
) -> None:
    """A reload's list_changed check of a large catalog waits for its listing's build (in a
    worker thread, one at a time, 82358e7). A reload landing meanwhile, whose catalog was
    small (no build to wait for), was told to the host first; the older check then resumed
    and noted the older snapshot's list as the one the host knew. When a later reload
    brought that list back, the host, which held the newer one, was told nothing."""
    from toolsetd.daemon.mcp_session import McpServer

    home, workspace, spare = tmp_path / "home", tmp_path / "ws", tmp_path / "spare"
    workspace.mkdir()
    spare.mkdir()
    sets = large_sets(home / "tools", "before")
    service = real_service(tmp_path, home)
    told: list[dict[str, object]] = []
    server = McpServer(service)
    session = await _session(server, workspace, told)
    with anyio.fail_after(60):
        async with anyio.create_task_group() as tg:
            # Another listing of the workspace is being built.
            building = server.pages.building(session.binding.workspace, None)
            async with building:
                write_set(home / "tools", 0, "after")  # S1, large: its check waits for the build
                tg.start_soon(service.reload_catalogs, None)
                while building.statistics().tasks_waiting == 0:
                    await anyio.sleep(0.01)
                for index in range(1, sets):  # S2, small: told at once
                    shutil.move(home / "tools" / f"s{index:03d}", spare)
                await service.reload_catalogs(None)
                assert len(told) == 1
            # S1's check ends once the build is left to it, and with it the task group.
        # S3: S1's list again, while the host holds S2's.
        for index in range(1, sets):
            shutil.move(spare / f"s{index:03d}", home / "tools")
        told.clear()
        await service.reload_catalogs(None)
    assert [m["method"] for m in told] == ["notifications/tools/list_changed"]


@pytest.mark.anyio
async def test_a_tools_list_built_late_leaves_a_newer_snapshots_listing_cached(
    tmp_path: Path,
) -> None:
    """A ``tools/list`` of a large snapshot builds its listing in a worker thread. A reload
    landing meanwhile whose snapshot is small is listed at once, and kept; the older
    build, done after it, took its place (and ``page`` looked the listing up again), so
    every later ``tools/list`` of the current snapshot built it again."""
    from toolsetd.daemon.mcp_session import McpServer

    home, workspace, spare = tmp_path / "home", tmp_path / "ws", tmp_path / "spare"
    workspace.mkdir()
    spare.mkdir()
    sets = large_sets(home / "tools")
    service = real_service(tmp_path, home)
    server = McpServer(service)
    # Two hosts: a session answers its requests one at a time.
    first, second = [await _session(server, workspace, []) for _ in range(2)]

    def tools_list(request_id: int) -> dict[str, Any]:
        return {"jsonrpc": "2.0", "id": request_id, "method": "tools/list", "params": {}}

    with anyio.fail_after(60):
        async with anyio.create_task_group() as tg:
            building = server.pages.building(workspace, None)
            async with building:  # builds of the workspace's listings wait
                write_set(home / "tools", 0, "after")  # S1, large: its checks wait
                tg.start_soon(service.reload_catalogs, None)
                while building.statistics().tasks_waiting < 1:  # the first host's check
                    await anyio.sleep(0.01)
                tg.start_soon(first.receive, tools_list(2))  # S1's list waits too
                while building.statistics().tasks_waiting < 2:
                    await anyio.sleep(0.01)
                for index in range(1, sets):  # S2, small: listed on the loop
                    shutil.move(home / "tools" / f"s{index:03d}", spare)
                await service.reload_catalogs(None)
                small = await second.receive(tools_list(3))
            # S1's builds end once the lock is left to them, and with them the task group.
        again = await second.receive(tools_list(4))
    assert again["result"]["tools"] is small["result"]["tools"], "listed again"
