"""The registry: snapshots built on first use, swapped whole, and cheap reloads."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import resource
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import anyio
import anyio.lowlevel
import pytest
from structlog.testing import capture_logs
from toolsetd.daemon import registry as registry_module
from toolsetd.daemon.catalog import RACY_NS, ManifestCache
from toolsetd.daemon.model import DEFAULT_RESERVED_NAMES, Source
from toolsetd.daemon.registry import Registry, SetChange, diff_catalogs

pytestmark = pytest.mark.anyio


def _write(root: Path, directory: str, description: str = "d", **extra: object) -> Path:
    set_dir = root / directory
    set_dir.mkdir(parents=True, exist_ok=True)
    manifest = {
        "runner": "exec", "description": description, "schema": {"type": "object"},
        "command": ["true"], **extra,
    }
    (set_dir / "tools.json").write_text(json.dumps(manifest))
    return set_dir


@pytest.fixture
def home(tmp_path: Path) -> Path:
    (tmp_path / "home" / "tools").mkdir(parents=True)
    return tmp_path / "home"


async def test_registry_unchanged_reload_parses_nothing(home: Path, tmp_path: Path) -> None:
    """A reload of unchanged sets re-parses no manifest and leaves the generation alone."""
    for i in range(5):
        _write(home / "tools", f"set{i}")
    ws = tmp_path / "ws"
    _write(ws / ".crystal" / "tools", "proj")
    registry = Registry(home, DEFAULT_RESERVED_NAMES)
    await registry.catalog(None)
    await registry.catalog(ws)
    parses, generation = registry.cache.parses, registry.generation
    assert parses == 6
    outcome = await registry.reload()
    assert registry.cache.parses == parses
    assert outcome.all_changes() == []
    assert registry.generation == generation


@pytest.mark.parametrize("scan", ["on the loop", "in a thread"])
async def test_registry_reload_reparses_only_the_changed_set(
    home: Path, scan: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Changing one manifest re-parses that one and reports it updated, bumping the generation.

    Both ways of scanning: a small catalog's reload scans on the event loop and hands a
    change on to a worker thread; a large one (here: any over 0 sets) scans in the thread.
    """
    if scan == "in a thread":
        monkeypatch.setattr(registry_module, "INLINE_SCAN_MAX", 0)
    for i in range(3):
        _write(home / "tools", f"set{i}")
    registry = Registry(home, DEFAULT_RESERVED_NAMES)
    await registry.catalog(None)
    parses, generation = registry.cache.parses, registry.generation
    _write(home / "tools", "set1", description="changed")
    outcome = await registry.reload()
    assert registry.cache.parses == parses + 1
    assert outcome.all_changes() == [SetChange("set1", Source.HOME, "updated")]
    assert registry.generation == generation + 1


async def test_registry_reload_reports_added_removed_and_broken(home: Path) -> None:
    """Adding, removing and breaking sets are reported as added, removed and updated."""
    _write(home / "tools", "keep")
    gone = _write(home / "tools", "gone")
    registry = Registry(home, DEFAULT_RESERVED_NAMES)
    await registry.catalog(None)
    for f in gone.iterdir():
        f.unlink()
    gone.rmdir()
    _write(home / "tools", "new")
    (home / "tools" / "keep" / "tools.json").write_text("{ half")
    outcome = await registry.reload()
    assert outcome.all_changes() == [
        SetChange("gone", Source.HOME, "removed"),
        SetChange("keep", Source.HOME, "updated"),
        SetChange("new", Source.HOME, "added"),
    ]
    catalog = await registry.catalog(None)
    assert list(catalog.tools) == ["new"]


async def test_registry_snapshot_held_by_a_caller_survives_reload(home: Path) -> None:
    """A snapshot fetched before a reload still holds the old definition afterwards."""
    _write(home / "tools", "tool", description="old")
    registry = Registry(home, DEFAULT_RESERVED_NAMES)
    before = await registry.catalog(None)
    _write(home / "tools", "tool", description="new")
    await registry.reload()
    after = await registry.catalog(None)
    assert before.tools["tool"].tool.description == "old"
    assert after.tools["tool"].tool.description == "new"


async def test_registry_concurrent_first_use_builds_once(home: Path, tmp_path: Path) -> None:
    """Many concurrent first uses of one workspace build its snapshot once."""
    _write(home / "tools", "tool")
    ws = tmp_path / "ws"
    ws.mkdir()
    registry = Registry(home, DEFAULT_RESERVED_NAMES)
    results = []

    async def use() -> None:
        results.append(await registry.catalog(ws))

    async with anyio.create_task_group() as tg:
        for _ in range(20):
            tg.start_soon(use)
    assert all(r is results[0] for r in results)
    assert registry.cache.parses == 1


async def test_registry_evicts_idle_workspaces(home: Path, tmp_path: Path) -> None:
    """Workspaces unused for longer than the idle time are released; home stays."""
    now = [0.0]
    registry = Registry(home, DEFAULT_RESERVED_NAMES, idle_seconds=10, clock=lambda: now[0])
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    await registry.catalog(None)
    await registry.catalog(a)
    assert registry.workspace_names == (str(a),)  # status's copy, kept until keys change
    now[0] = 8.0
    await registry.catalog(b)
    assert registry.workspace_names == (str(a), str(b))
    await registry.reload([b])
    now[0] = 12.0
    assert registry.evict_idle() == [a]
    assert registry.workspaces == [b]
    assert registry.workspace_names == (str(b),)
    assert registry.cached(None) is not None


async def test_registry_releases_a_workspace_whose_first_build_outlasted_its_idle_time(
    home: Path, tmp_path: Path
) -> None:
    """A workspace released as idle while its first build ran is released again later.

    The build's snapshot went in after the release had dropped its last use, so no later
    release ever saw it: the daemon held that workspace (its sets, decoded) for good. A
    reproduction under tracemalloc, slow enough for a 1 s idle time, grew ~30 MB a cycle.
    """
    _write(tmp_path / "ws" / ".crystal" / "tools", "proj")
    ws = tmp_path / "ws"
    now = [0.0]
    registry = Registry(home, DEFAULT_RESERVED_NAMES, idle_seconds=10, clock=lambda: now[0])
    await registry.catalog(None)
    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            tg.start_soon(registry.catalog, ws)
            await anyio.lowlevel.checkpoint()  # the build is in its worker thread now
            await anyio.wait_all_tasks_blocked()
            now[0] = 100.0  # idle for longer than allowed, still building
            assert registry.evict_idle() == [ws]
    assert registry.workspaces == [ws]  # the build's snapshot went in after all
    now[0] = 200.0
    assert registry.evict_idle() == [ws]
    assert registry.workspaces == []
    assert len(registry.cache) == len((await registry.catalog(None)).sets)


async def test_registry_forgets_manifests_of_deleted_sets_and_released_workspaces(
    home: Path, tmp_path: Path
) -> None:
    """The manifest cache holds only sets some snapshot still refers to."""
    _write(home / "tools", "keep")
    gone = _write(home / "tools", "gone")
    ws = tmp_path / "ws"
    _write(ws / ".crystal" / "tools", "proj")
    now = [0.0]
    registry = Registry(home, DEFAULT_RESERVED_NAMES, idle_seconds=10, clock=lambda: now[0])
    await registry.catalog(None)
    await registry.catalog(ws)
    assert len(registry.cache) == 3
    (gone / "tools.json").unlink()
    gone.rmdir()
    await registry.reload()
    assert len(registry.cache) == 2
    now[0] = 100.0
    await registry.catalog(None)
    assert registry.evict_idle() == [ws]
    assert len(registry.cache) == 1


async def test_registry_unchanged_reload_keeps_the_snapshot_without_reading(home: Path) -> None:
    """When no file changed (and none is too fresh to judge), reload keeps the snapshot whole."""
    _write(home / "tools", "a")
    later = [time.time_ns() + 10 * RACY_NS]
    registry = Registry(home, DEFAULT_RESERVED_NAMES, clock_ns=lambda: later[0])
    before = await registry.catalog(None)
    reads = registry.cache.reads
    await registry.reload()
    assert await registry.catalog(None) is before
    assert registry.cache.reads == reads
    _write(home / "tools", "a", description="changed, and longer")
    later[0] = time.time_ns() + 10 * RACY_NS
    outcome = await registry.reload()
    assert outcome.all_changes() == [SetChange("a", Source.HOME, "updated")]
    assert await registry.catalog(None) is not before


async def test_registry_fresh_files_are_always_reread(home: Path) -> None:
    """Files modified within the racy window are re-read on every reload, so a same-size
    rewrite inside one timestamp tick is still seen; equal bytes keep the snapshot."""
    _write(home / "tools", "a", description="one")
    registry = Registry(home, DEFAULT_RESERVED_NAMES)
    before = await registry.catalog(None)
    reads = registry.cache.reads
    await registry.reload()
    assert registry.cache.reads == reads + 1
    assert await registry.catalog(None) is before
    _write(home / "tools", "a", description="two")  # same size, likely the same mtime tick
    outcome = await registry.reload()
    assert outcome.all_changes() == [SetChange("a", Source.HOME, "updated")]
    after = await registry.catalog(None)
    assert after.tools["a"].tool.description == "two"


def _fresh_build(home: Path, workspace: Path | None = None):  # type: ignore[no-untyped-def]
    from toolsetd.daemon.catalog import ManifestCache, build_catalog

    return build_catalog(home, workspace, reserved=DEFAULT_RESERVED_NAMES, cache=ManifestCache())


@pytest.mark.parametrize(
    ("change", "patched"),
    [
        ({"description": "a new description"}, True),
        ({"schema": {"type": "object", "properties": {"x": {"type": "integer"}}}}, True),
        ({"approval": "always", "timeoutSeconds": 7, "stdin": False}, True),
        ({"enabled": False}, False),
        ({"runner": "perl"}, False),
        ({"tools": [{"name": "set0", "description": "d", "schema": {"type": "object"}}],
          "description": None, "schema": None}, False),  # collides with set0's tool
        ({"tools": [{"name": "fresh", "description": "d", "schema": {"type": "object"}}],
          "description": None, "schema": None}, False),  # a new tool name
    ],
)
async def test_registry_one_changed_set_equals_a_rebuild(
    home: Path, tmp_path: Path, change: dict[str, object], patched: bool
) -> None:
    """A reload after one set changed gives exactly what a fresh build gives; a change that
    keeps the set's tool names is patched into the old snapshot, sharing the other entries."""
    for i in range(8):
        _write(home / "tools", f"set{i}")
    ws = tmp_path / "ws"
    _write(ws / ".crystal" / "tools", "proj")
    later = [time.time_ns() + 10 * RACY_NS]
    registry = Registry(home, DEFAULT_RESERVED_NAMES, clock_ns=lambda: later[0])
    before = await registry.catalog(None)
    before_ws = await registry.catalog(ws)
    fields = {k: v for k, v in change.items() if v is not None}
    set_dir = _write(home / "tools", "set5", **fields)
    manifest = json.loads((set_dir / "tools.json").read_text())
    for key, value in change.items():
        if value is None:
            manifest.pop(key, None)
    (set_dir / "tools.json").write_text(json.dumps(manifest))
    later[0] = time.time_ns() + 10 * RACY_NS
    outcome = await registry.reload()
    after, after_ws = await registry.catalog(None), await registry.catalog(ws)
    assert after == _fresh_build(home)
    assert after_ws == _fresh_build(home, ws)
    assert SetChange("set5", Source.HOME, "updated") in outcome.all_changes()
    assert outcome.changes[None] == diff_catalogs(before, after)
    assert outcome.changes[ws] == diff_catalogs(before_ws, after_ws)
    assert (after.sets[0] is before.sets[0]) is patched


async def test_registry_patch_reads_only_the_changed_set(home: Path) -> None:
    """A reload with one of many sets changed reads that one manifest and no other."""
    for i in range(30):
        _write(home / "tools", f"set{i:02d}")
    later = [time.time_ns() + 10 * RACY_NS]
    registry = Registry(home, DEFAULT_RESERVED_NAMES, clock_ns=lambda: later[0])
    await registry.catalog(None)
    reads, parses = registry.cache.reads, registry.cache.parses
    _write(home / "tools", "set17", description="changed")
    later[0] = time.time_ns() + 10 * RACY_NS
    outcome = await registry.reload()
    assert outcome.all_changes() == [SetChange("set17", Source.HOME, "updated")]
    assert (registry.cache.reads, registry.cache.parses) == (reads + 1, parses + 1)


def _remove_set(root: Path, directory: str) -> None:
    for f in (root / directory).iterdir():
        f.unlink()
    (root / directory).rmdir()


#: What the watcher reports for a change (``Registry.reload``'s ``reported``).
_Told = dict[Path | None, frozenset[tuple[str, str]] | None]


def _sets(tools: Path, *names: str) -> _Told:
    """The watcher's report of writes inside these home set folders."""
    return {None: frozenset((str(tools), name) for name in names)}


def _added(tools: Path, ws: Path) -> _Told:
    _write(tools, "added")
    return _sets(tools, "added")


def _removed(tools: Path, ws: Path) -> _Told:
    _remove_set(tools, "set3")
    return _sets(tools, "set3")


def _change_many(tools: Path, ws: Path) -> _Told:
    for i in range(66):  # more than a patch takes (64)
        _write(tools, f"many{i:02d}", description="changed")
    return _sets(tools, *(f"many{i:02d}" for i in range(66)))


def _rename(tools: Path, ws: Path) -> _Told:
    (tools / "set3").rename(tools / "set3b")
    return _sets(tools, "set3", "set3b")


def _manifest_gone(tools: Path, ws: Path) -> _Told:
    (tools / "set3" / "tools.json").unlink()
    return _sets(tools, "set3")


def _manifest_back(tools: Path, ws: Path) -> _Told:
    _write(tools, "bare")
    return _sets(tools, "bare")


def _link_nowhere_came(tools: Path, ws: Path) -> _Told:
    (tools / "bare" / "tools.json").symlink_to("gone.json")  # a candidate that cannot be read
    return _sets(tools, "bare")


def _manifest_now_a_link_nowhere(tools: Path, ws: Path) -> _Told:
    (tools / "set3" / "tools.json").unlink()
    (tools / "set3" / "tools.json").symlink_to("tools.json")  # a loop
    return _sets(tools, "set3")


def _still_bare(tools: Path, ws: Path) -> _Told:
    _write(tools, "set2", description="changed")
    return _sets(tools, "set2")


def _project_gone(tools: Path, ws: Path) -> _Told:
    _remove_set(ws / ".crystal" / "tools", "proj")
    (ws / ".crystal" / "tools").rmdir()
    return {ws: None}


def _project_came(tools: Path, ws: Path) -> _Told:
    _write(ws / ".crystal" / "tools", "proj")
    return {ws: None}


def _config(tools: Path, ws: Path) -> _Told:
    (tools.parent / "config.json").write_text('{"externalTools": false}')
    return {None: None}


def _config_link_nowhere(tools: Path, ws: Path) -> _Told:
    # Where there was no config.json: a link whose target is gone is a file that cannot be
    # read (discovery off), not a missing one; its stat, like a missing file's, failed, so
    # the reload saw no change and kept discovery on.
    (tools.parent / "config.json").symlink_to(tools.parent / "nowhere" / "config.json")
    return {None: None}


@pytest.mark.parametrize("scan", ["on the loop", "in a thread", "told what changed"])
@pytest.mark.parametrize(
    "change",
    [
        _added,
        _removed,
        _rename,
        _manifest_gone,
        _manifest_back,
        _link_nowhere_came,
        _manifest_now_a_link_nowhere,
        _still_bare,
        _change_many,
        _project_gone,
        _project_came,
        _config,
        _config_link_nowhere,
    ],
    ids=[
        "set added", "set removed", "set renamed", "manifest removed", "manifest added",
        "a manifest link to nowhere added", "manifest replaced by a link to nowhere",
        "a set beside a bare folder changed", "more sets changed than a patch takes",
        "project folder removed", "project folder created", "config.json changed",
        "config.json a link to nowhere",
    ],
)
async def test_registry_reload_after_any_change_equals_a_rebuild(
    home: Path, tmp_path: Path, change, scan: str, monkeypatch: pytest.MonkeyPatch  # type: ignore[no-untyped-def]
) -> None:
    """Whatever changed on disk, a reload gives what a fresh build gives: the scan compares
    each manifest with the last scan as it goes, and names that came or went, a root that
    came or went, a changed config and too many suspects all mean a rebuild. The same
    holds for a reload told what changed, as the watcher tells it: the sets it names are
    looked at, and anything a report cannot settle is scanned whole."""
    if scan == "in a thread":
        monkeypatch.setattr(registry_module, "INLINE_SCAN_MAX", 0)
    tools = home / "tools"
    for i in range(6):
        _write(tools, f"set{i}")
    for i in range(66):
        _write(tools, f"many{i:02d}")
    (tools / "bare").mkdir()  # a folder without a manifest: a note, the same on each scan
    ws = tmp_path / "ws"
    if change is not _project_came:
        _write(ws / ".crystal" / "tools", "proj")
    else:
        ws.mkdir()
    later = [time.time_ns() + 10 * RACY_NS]
    registry = Registry(home, DEFAULT_RESERVED_NAMES, clock_ns=lambda: later[0])
    await registry.catalog(None)
    await registry.catalog(ws)
    assert (await registry.reload()).all_changes() == []  # the scans are taken and alike
    before = await registry.catalog(None)
    told = change(tools, ws)
    later[0] = time.time_ns() + 10 * RACY_NS
    if scan == "told what changed":
        outcome = await registry.reload(None if None in told else list(told), told)
    else:
        outcome = await registry.reload()
    assert outcome.all_changes()
    after = await registry.catalog(None)
    assert after == _fresh_build(home)
    assert await registry.catalog(ws) == _fresh_build(home, ws)
    if change is _change_many:  # past the limit a reload rebuilds: no entry is shared
        assert not any(a is b for a, b in zip(after.sets, before.sets, strict=True))


async def test_registry_a_root_it_cannot_list_twice_is_unchanged(
    home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A tools folder that opens but cannot be listed, on this scan and the last, is no
    change: the reload keeps the snapshot instead of rebuilding it every time."""
    _write(home / "tools", "a")
    later = [time.time_ns() + 10 * RACY_NS]
    registry = Registry(home, DEFAULT_RESERVED_NAMES, clock_ns=lambda: later[0])
    listdir = os.listdir

    def failing(path: object = ".") -> list[str]:
        if isinstance(path, int):  # the registry lists the folder it opened
            raise OSError(5, "Input/output error")
        return listdir(path)  # type: ignore[arg-type]

    await registry.catalog(None)
    monkeypatch.setattr(os, "listdir", failing)
    await registry.reload()  # unlisted now, listed before: rebuilt
    snapshot = await registry.catalog(None)
    await registry.reload()
    assert await registry.catalog(None) is snapshot


@contextlib.contextmanager
def _descriptors_to_take() -> Iterator[Callable[[], None]]:
    """Inside, calling the function yielded takes every descriptor this process has left
    (EMFILE after that); all are given back, and the limit restored, on the way out."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (len(os.listdir("/proc/self/fd")) + 16, hard))
    held: list[int] = []

    def take() -> None:
        with contextlib.suppress(OSError):
            while True:
                held.append(os.open("/", os.O_RDONLY | os.O_CLOEXEC))

    try:
        yield take
    finally:
        for fd in held:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


async def test_a_reload_short_of_descriptors_part_way_swaps_no_snapshot(
    home: Path, tmp_path: Path
) -> None:
    """A reload that runs out of descriptors after it refreshed some snapshots (here:
    another task takes the last ones once the home's changed set was read) swaps none of
    them. Swapped, the home and the first workspace served the new home sets under the
    old generation, no listener was told (the reload failed) and the next reload found
    them unchanged, while the other workspace kept the old home sets. Now the reload
    fails whole, and the next one moves every snapshot and the generation together."""
    later = [time.time_ns() + 10 * RACY_NS]
    _write(home / "tools", "shared")
    one, two = tmp_path / "one", tmp_path / "two"
    _write(one / ".crystal" / "tools", "p1")
    _write(two / ".crystal" / "tools", "p2")
    registry = Registry(home, DEFAULT_RESERVED_NAMES, clock_ns=lambda: later[0])
    before = {key: await registry.catalog(key) for key in (None, one, two)}
    generation, reads = registry.generation, registry.cache.reads
    _write(home / "tools", "shared", description="changed, and longer")
    later[0] = time.time_ns() + 10 * RACY_NS
    failed: list[BaseException] = []
    with _descriptors_to_take() as take:

        async def take_once_the_home_was_read() -> None:
            while registry.cache.reads == reads:
                await anyio.lowlevel.checkpoint()
            take()

        async def reload() -> None:
            try:
                await registry.reload()
            except OSError as exc:
                failed.append(exc)
            tg.cancel_scope.cancel()

        async with anyio.create_task_group() as tg:
            tg.start_soon(take_once_the_home_was_read)
            tg.start_soon(reload)
    assert [getattr(exc, "errno", None) for exc in failed] == [errno.EMFILE]
    assert all(registry.cached(key) is catalog for key, catalog in before.items())
    assert registry.generation == generation
    outcome = await registry.reload()
    assert registry.generation == generation + 1
    assert set(outcome.changes) == {None, one, two}
    for key in before:
        catalog = registry.cached(key)
        assert catalog is not None
        assert catalog.tools["shared"].tool.description == "changed, and longer"


async def test_a_reload_failing_again_and_again_is_logged_once_a_minute(home: Path) -> None:
    """A reload that keeps failing (the watcher retries it at every poll, and every second
    while the daemon is short of descriptors) logs ``catalog_reload_failed`` once a minute
    per kind of error, counting the failures. Logged at every failure, a failure the
    watcher retried at every poll wrote an error line every 2 s, however throttled the
    watcher's own ``watch_reload_failed`` was."""
    _write(home / "tools", "a")
    registry = Registry(home, DEFAULT_RESERVED_NAMES)
    await registry.catalog(None)
    failed: list[int | None] = []
    with anyio.fail_after(5), capture_logs() as logs, _descriptors_to_take() as take:
        take()
        for _ in range(3):
            try:
                await registry.reload()
            except OSError as exc:
                failed.append(exc.errno)
    assert failed == [errno.EMFILE] * 3
    lines = [entry for entry in logs if entry["event"] == "catalog_reload_failed"]
    assert [line["workspace"] for line in lines] == [None]
    assert lines[0]["failures"] == 1


async def test_a_reload_failing_after_one_that_worked_is_logged_at_once(home: Path) -> None:
    """A reload that works ends a run of failures: the next failure, however soon, is
    logged at once, as the first of a new run. Throttled with the run before, it showed
    only in the count of a line a minute on, if another failure came to write one."""
    _write(home / "tools", "a")
    registry = Registry(home, DEFAULT_RESERVED_NAMES)
    await registry.catalog(None)
    with anyio.fail_after(5), capture_logs() as logs:
        for _ in range(2):
            with _descriptors_to_take() as take:
                take()
                for _ in range(2):
                    with pytest.raises(OSError, match=os.strerror(errno.EMFILE)):
                        await registry.reload()
            await registry.reload()  # descriptors again: it works
    lines = [entry for entry in logs if entry["event"] == "catalog_reload_failed"]
    assert [line["failures"] for line in lines] == [1, 1]


def _refreshes_counted(registry: Registry, monkeypatch: pytest.MonkeyPatch) -> list[object]:
    """The workspaces of every ``_refresh_sync`` (the worker thread's refresh) from now on,
    each call still made."""
    refreshed: list[object] = []
    real = registry._refresh_sync

    def counted(*args: object) -> object:
        refreshed.append(args[0])
        return real(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(registry, "_refresh_sync", counted)
    return refreshed


async def test_a_touched_manifest_is_looked_at_once(
    home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A manifest touched with its bytes unchanged is patched to the same snapshot once;
    its new scan is kept with it, so later reloads find nothing to look at again. Lost
    (the reload staged only changed snapshots), every reload patched it again in a worker
    thread."""
    set_dir = _write(home / "tools", "a")
    later = [time.time_ns() + 10 * RACY_NS]
    registry = Registry(home, DEFAULT_RESERVED_NAMES, clock_ns=lambda: later[0])
    before = await registry.catalog(None)
    refreshed = _refreshes_counted(registry, monkeypatch)
    touched = time.time_ns() - 5 * 10**9
    os.utime(set_dir / "tools.json", ns=(touched, touched))
    for _ in range(3):
        outcome = await registry.reload()
        assert outcome.all_changes() == []
        assert await registry.catalog(None) is before
    assert refreshed == [None]


async def test_a_manifest_too_fresh_to_judge_is_read_again_on_the_loop(
    home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A manifest written within the racy window is read again at every reload (a rewrite
    inside one timestamp tick leaves its stat alike). While its bytes stay the same, that
    read happens on the event loop and the snapshot is kept: each such reload went to a
    worker thread for it, and the hand-off cost more than the read. Changed bytes still
    go to the thread, which parses them."""
    tools = home / "tools"
    _write(tools, "a", description="one")
    _write(tools, "b")
    now = [time.time_ns()]  # every manifest stays too fresh to judge by its stat
    registry = Registry(
        home,
        DEFAULT_RESERVED_NAMES,
        ManifestCache(clock_ns=lambda: now[0]),
        clock_ns=lambda: now[0],
    )
    before = await registry.catalog(None)
    refreshed = _refreshes_counted(registry, monkeypatch)
    reads = registry.cache.reads
    for _ in range(3):
        outcome = await registry.reload()
        assert outcome.all_changes() == []
        assert await registry.catalog(None) is before
    assert registry.cache.reads == reads + 3 * 2
    assert refreshed == []
    _write(tools, "a", description="two")  # same size, likely the same tick
    outcome = await registry.reload()
    assert outcome.all_changes() == [SetChange("a", Source.HOME, "updated")]
    assert refreshed == [None]
    assert (await registry.catalog(None)).tools["a"].tool.description == "two"


async def test_the_loop_reads_at_most_recheck_inline_max_manifests_per_reload(
    home: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The manifests a reload reads again on the event loop are bounded per reload, over
    every snapshot it refreshes, not per snapshot: a home manifest too fresh to judge is a
    suspect in every workspace's snapshot, and a daemon serving many workspaces read it
    once per snapshot, on the loop. Past the bound the thread reads them, as before."""
    import threading

    monkeypatch.setattr(registry_module, "RECHECK_INLINE_MAX", 1)
    _write(home / "tools", "a")
    now = [time.time_ns()]  # "a" stays too fresh to judge by its stat
    registry = Registry(
        home,
        DEFAULT_RESERVED_NAMES,
        ManifestCache(clock_ns=lambda: now[0]),
        clock_ns=lambda: now[0],
    )
    workspaces = [tmp_path / f"ws{i}" for i in range(3)]
    for ws in workspaces:
        ws.mkdir()
    before = {key: await registry.catalog(key) for key in [None, *workspaces]}
    loop = threading.current_thread()
    on_loop: list[str] = []
    real = registry.cache.unchanged

    def unchanged(manifest: str, *args: Any) -> bool:
        if threading.current_thread() is loop:
            on_loop.append(manifest)
        return real(manifest, *args)

    monkeypatch.setattr(registry.cache, "unchanged", unchanged)
    for _ in range(2):
        outcome = await registry.reload()
        assert outcome.all_changes() == []
        for key, catalog in before.items():
            assert await registry.catalog(key) is catalog
    assert on_loop == [os.path.join(home, "tools", "a", "tools.json")] * 2


async def test_a_reload_told_what_changed_looks_at_those_sets_alone(home: Path) -> None:
    """Told by the watcher which set changed, a reload stats that set's manifest and no
    other: a change it was not told of waits for a reload that is told of it or told
    nothing (the watcher's poll sends one). That is what makes one edit among 10,000 sets
    cost the edit, not a ``stat`` of every set."""
    tools = home / "tools"
    for i in range(30):
        _write(tools, f"set{i:02d}")
    later = [time.time_ns() + 10 * RACY_NS]
    registry = Registry(home, DEFAULT_RESERVED_NAMES, clock_ns=lambda: later[0])
    await registry.catalog(None)
    reads = registry.cache.reads
    _write(tools, "set17", description="seventeen, changed")
    _write(tools, "set03", description="three, changed")
    later[0] = time.time_ns() + 10 * RACY_NS
    outcome = await registry.reload(None, _sets(tools, "set17"))
    assert outcome.all_changes() == [SetChange("set17", Source.HOME, "updated")]
    assert registry.cache.reads == reads + 1
    catalog = await registry.catalog(None)
    assert catalog.tools["set03"].tool.description == "d"
    outcome = await registry.reload()  # told nothing: every manifest looked at
    assert outcome.all_changes() == [SetChange("set03", Source.HOME, "updated")]
    assert await registry.catalog(None) == _fresh_build(home)


async def test_a_report_under_another_spelling_of_the_root_scans_everything(
    home: Path,
) -> None:
    """A reported pair whose root is not the snapshot's root, character for character, is
    not trusted to say what else did not change: the reload scans every manifest."""
    tools = home / "tools"
    for name in ("a", "b"):
        _write(tools, name)
    later = [time.time_ns() + 10 * RACY_NS]
    registry = Registry(home, DEFAULT_RESERVED_NAMES, clock_ns=lambda: later[0])
    await registry.catalog(None)
    _write(tools, "a", description="a, changed")
    _write(tools, "b", description="b, changed")
    later[0] = time.time_ns() + 10 * RACY_NS
    outcome = await registry.reload(None, {None: frozenset({(str(tools) + "/.", "a")})})
    assert outcome.all_changes() == [
        SetChange("a", Source.HOME, "updated"),
        SetChange("b", Source.HOME, "updated"),
    ]


async def test_a_reload_told_what_changed_looks_again_at_manifests_too_fresh_to_judge(
    home: Path,
) -> None:
    """A manifest the last scan found too fresh to judge by its stat is looked at again by
    the next reload even when the report does not name it: a same-size rewrite inside one
    timestamp tick leaves its stat alike, so only its bytes tell."""
    tools = home / "tools"
    _write(tools, "old")
    _write(tools, "new", description="one")
    registry = Registry(home, DEFAULT_RESERVED_NAMES)  # the real clock: "new" is fresh
    await registry.catalog(None)
    _write(tools, "new", description="two")  # same size, likely the same tick
    outcome = await registry.reload(None, _sets(tools, "old"))
    assert outcome.all_changes() == [SetChange("new", Source.HOME, "updated")]
    assert (await registry.catalog(None)).tools["new"].tool.description == "two"


async def test_a_workspace_reload_told_only_of_home_sets_scans_no_project_manifest(
    home: Path, tmp_path: Path
) -> None:
    """A home set reported changed is looked at in every snapshot; a workspace the report
    does not name keeps its project scan (its own changes come under its own key)."""
    tools = home / "tools"
    _write(tools, "shared")
    ws = tmp_path / "ws"
    _write(ws / ".crystal" / "tools", "proj")
    later = [time.time_ns() + 10 * RACY_NS]
    registry = Registry(home, DEFAULT_RESERVED_NAMES, clock_ns=lambda: later[0])
    await registry.catalog(None)
    await registry.catalog(ws)
    _write(tools, "shared", description="shared, changed")
    _write(ws / ".crystal" / "tools", "proj", description="proj, changed")
    later[0] = time.time_ns() + 10 * RACY_NS
    outcome = await registry.reload(None, _sets(tools, "shared"))
    assert outcome.changes == {
        None: (SetChange("shared", Source.HOME, "updated"),),
        ws: (SetChange("shared", Source.HOME, "updated"),),
    }
    project = {(str(ws / ".crystal" / "tools"), "proj")}
    outcome = await registry.reload([ws], {ws: frozenset(project)})
    assert outcome.all_changes() == [SetChange("proj", Source.PROJECT, "updated")]
    assert await registry.catalog(ws) == _fresh_build(home, ws)


async def test_a_report_naming_more_sets_than_the_loop_may_stat_is_scanned_in_a_thread(
    home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A reload stats at most ``INLINE_SCAN_MAX`` manifests on the event loop, told what
    changed or not. A batch that names every set (a checkout or a ``touch`` of a file in
    each folder, the manifests alike) stat'ed each named manifest on the loop, per
    snapshot: 10,000 sets held it ~60 ms a snapshot, where a reload told nothing stats
    them in a worker thread. One set named, the watcher's one edit, stays on the loop."""
    import threading

    tools = home / "tools"
    names = [f"set{i}" for i in range(6)]
    for name in names:
        _write(tools, name)
    monkeypatch.setattr(registry_module, "INLINE_SCAN_MAX", 4)
    later = [time.time_ns() + 10 * RACY_NS]
    registry = Registry(home, DEFAULT_RESERVED_NAMES, clock_ns=lambda: later[0])
    await registry.catalog(None)
    loop = threading.current_thread()
    on_loop: list[str] = []
    real = os.stat

    def stat(path: object, *args: object, **kwargs: object) -> os.stat_result:
        if threading.current_thread() is loop and str(path).endswith("tools.json"):
            on_loop.append(str(path))
        return real(path, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(os, "stat", stat)
    outcome = await registry.reload(None, _sets(tools, *names))
    assert outcome.all_changes() == []
    assert on_loop == []
    _write(tools, "set3", description="three, changed")
    later[0] = time.time_ns() + 10 * RACY_NS
    outcome = await registry.reload(None, _sets(tools, "set3"))
    assert outcome.all_changes() == [SetChange("set3", Source.HOME, "updated")]
    assert on_loop == [os.path.join(tools, "set3", "tools.json")]


async def test_a_workspace_released_during_a_reload_is_not_brought_back(
    home: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A workspace released as idle while a reload is under way is not rebuilt by it.

    Released before its turn, it was rebuilt and held again, but the daemon stops
    following a released workspace's files and follows one again only when ``catalog``
    builds it: held with no watch, its project sets were never looked at by a reload told
    what changed, whatever was edited there, for as long as it was in use."""
    tools = home / "tools"
    _write(tools, "a")
    ws = tmp_path / "ws"
    _write(ws / ".crystal" / "tools", "proj")
    now = [0.0]
    later = [time.time_ns() + 10 * RACY_NS]
    registry = Registry(
        home,
        DEFAULT_RESERVED_NAMES,
        idle_seconds=10,
        clock=lambda: now[0],
        clock_ns=lambda: later[0],
    )
    await registry.catalog(None)
    await registry.catalog(ws)
    _write(tools, "a", description="changed")
    later[0] = time.time_ns() + 10 * RACY_NS
    entered, release = anyio.Event(), anyio.Event()
    real = registry_module.threads.run_sync

    async def held(*args: Any, **kwargs: Any) -> Any:
        if not entered.is_set():  # the home snapshot's patch, before the workspace's turn
            entered.set()
            await release.wait()
        return await real(*args, **kwargs)

    monkeypatch.setattr(registry_module.threads, "run_sync", held)
    async with anyio.create_task_group() as tg:
        tg.start_soon(registry.reload, None, _sets(tools, "a"))
        await entered.wait()
        now[0] = 100.0
        assert registry.evict_idle() == [ws]
        release.set()
    assert registry.workspaces == []
    assert (await registry.catalog(None)).tools["a"].tool.description == "changed"


def _write_tools(root: Path, directory: str, *names: str) -> None:
    """A set named ``directory`` whose tools are ``names``."""
    set_dir = root / directory
    set_dir.mkdir(parents=True, exist_ok=True)
    tools = [{"name": n, "description": "d", "schema": {"type": "object"}} for n in names]
    manifest = {"runner": "exec", "command": ["true"], "tools": tools}
    (set_dir / "tools.json").write_text(json.dumps(manifest))


def _noted(logs: Sequence[Mapping[str, Any]]) -> list[tuple[str | None, str]]:
    return [(e["set"], e["message"]) for e in logs if e["event"] == "catalog_note"]


async def test_a_note_one_catalog_has_and_another_lacks_is_logged_once(
    home: Path, tmp_path: Path
) -> None:
    """A note that only a workspace's catalog has (its project set takes the name of a home
    set's tool) is logged once, not again at every reload of an unrelated edit. Kept per
    folder alone, the home catalog, which lacks the note, forgot it at each reload, and the
    workspace's catalog logged it anew: a warning a reload in a service's journal."""
    _write_tools(home / "tools", "b", "t")
    _write(home / "tools", "c")
    ws = tmp_path / "ws"
    _write_tools(ws / ".crystal" / "tools", "a", "t")
    registry = Registry(home, DEFAULT_RESERVED_NAMES)
    omitted = ("b", "External tool 't' was omitted because the name is already registered.")
    with capture_logs() as logs:
        await registry.catalog(None)
        await registry.catalog(ws)
        for n in range(3):
            _write(home / "tools", "c", description=f"edit {n}")
            outcome = await registry.reload()
            assert [c.set for c in outcome.all_changes()] == ["c"]
    assert _noted(logs) == [omitted]


async def test_a_note_of_a_set_removed_and_brought_back_is_logged_again(home: Path) -> None:
    """A broken set removed, then brought back as broken (a checkout of an old branch), is
    logged again: its note appears anew. The folder's last note was kept after the set went,
    so its return was silent."""
    (home / "tools" / "x").mkdir()
    (home / "tools" / "x" / "tools.json").write_text("{broken")
    registry = Registry(home, DEFAULT_RESERVED_NAMES)
    with capture_logs() as logs:
        await registry.catalog(None)
        (home / "tools" / "x" / "tools.json").rename(home / "x.json")
        await registry.reload()
        (home / "x.json").rename(home / "tools" / "x" / "tools.json")
        await registry.reload()
    assert [s for s, _ in _noted(logs)] == ["x", "x"]
