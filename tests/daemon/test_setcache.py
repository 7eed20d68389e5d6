"""Tests for ``toolsetd.daemon.setcache``: the persistent cache of parsed tool sets."""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import stat
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import orjson
import pytest
from structlog.testing import capture_logs
from toolsetd.daemon import setcache
from toolsetd.daemon.catalog import RACY_NS, ManifestCache, build_catalog, tool_hash
from toolsetd.daemon.config_file import read_descriptor
from toolsetd.daemon.manifest import ManifestError, parse_manifest
from toolsetd.daemon.model import (
    DEFAULT_RESERVED_NAMES,
    Approval,
    ApprovalSource,
    Catalog,
    CatalogName,
    OutputMode,
    RunnerKind,
    Source,
    ToolDef,
    ToolSet,
)
from toolsetd.daemon.registry import Registry
from toolsetd.daemon.setcache import (
    MAX_CACHE_BYTES,
    SetStore,
    decode_record,
    default_cache_dir,
    encode_record,
)


def _write(root: Path, directory: str, **fields: object) -> Path:
    set_dir = root / directory
    set_dir.mkdir(parents=True, exist_ok=True)
    manifest = {
        "runner": "exec",
        "description": f"Tool {directory}.",
        "schema": {"type": "object", "properties": {"q": {"type": "string"}}},
        "command": ["/bin/true"],
        **fields,
    }
    (set_dir / "tools.json").write_text(json.dumps(manifest))
    return set_dir


@pytest.fixture
def home(tmp_path: Path) -> Path:
    home = tmp_path / "home"
    for i in range(6):
        _write(home / "tools", f"set{i}")
    _write(home / "tools", "broken", runner="perl")
    _write(
        home / "tools",
        "multi",
        tools=[
            {
                "name": "m_one",
                "description": "One.",
                "schema": {"type": "object"},
                "argv": {"q": "--q"},
            },
            {
                "name": "m_two",
                "description": "Two.",
                "schema": {"type": "object"},
                "approval": "always",
                "catalogs": ["plan"],
                "pathArguments": ["p"],
                "output": "content",
            },
        ],
        description=None,
        schema=None,
    )
    return home


def _build(
    home: Path,
    folder: Path | None,
    *,
    clock: int | None = None,
    reserved: frozenset[str] = DEFAULT_RESERVED_NAMES,
    workspace: Path | None = None,
) -> tuple[Catalog, ManifestCache]:
    # By default every file a test wrote counts as old (beyond the racy window).
    now = clock if clock is not None else time.time_ns() + 10 * RACY_NS
    cache = ManifestCache(store=SetStore(folder) if folder else None, clock_ns=lambda: now)
    catalog = build_catalog(home, workspace, reserved=reserved, cache=cache)
    cache.flush()
    return catalog, cache


def test_setstore_cold_load_equals_a_parse_and_reads_nothing(home: Path, tmp_path: Path) -> None:
    """A second daemon's cold load takes every set from the store, unread, equal to a parse."""
    folder = tmp_path / "cache"
    first, cache = _build(home, folder)
    assert cache.parses == 8
    assert (folder / SetStore(folder).path.name).exists()
    second, cache = _build(home, folder)
    assert (cache.parses, cache.reads) == (0, 0)
    plain, _ = _build(home, None)
    assert second == first == plain
    assert [e.error for e in second.sets if e.error] == [e.error for e in plain.sets if e.error]


def test_setstore_changed_bytes_are_parsed_again(home: Path, tmp_path: Path) -> None:
    """A manifest whose bytes changed is read and parsed; the others still come from the store."""
    folder = tmp_path / "cache"
    _build(home, folder)
    _write(home / "tools", "set3", description="Now different.")
    catalog, cache = _build(home, folder)
    assert cache.parses == 1
    assert catalog.tools["set3"].tool.description == "Now different."
    assert catalog == _build(home, None)[0]


def test_setstore_fresh_files_are_read_not_trusted_by_stat(home: Path, tmp_path: Path) -> None:
    """A file younger than the racy window is read even when its stat matches the index."""
    folder = tmp_path / "cache"
    _build(home, folder)
    catalog, cache = _build(home, folder, clock=time.time_ns())
    assert (cache.reads, cache.parses) == (8, 0)
    assert catalog == _build(home, None)[0]


@pytest.mark.parametrize("damage", ["empty", "half", "one_byte_short", "flipped_byte", "garbage"])
def test_setstore_damaged_file_is_ignored_and_rewritten(
    home: Path, tmp_path: Path, damage: str
) -> None:
    """A truncated or altered cache file is ignored whole; the load parses, then rewrites it.
    It is logged once: the compaction that rewrites it reads it again, and said so a
    second time (in a folder it could not write, at every reload that parsed a set)."""
    folder = tmp_path / "cache"
    first, _ = _build(home, folder)
    path = SetStore(folder).path
    data = path.read_bytes()
    damaged = {
        "empty": b"",
        "half": data[: len(data) // 2],
        "one_byte_short": data[:-1],
        "flipped_byte": data[:-10] + bytes([data[-10] ^ 0x01]) + data[-9:],
        "garbage": b"not a cache at all",
    }[damage]
    path.write_bytes(damaged)
    with capture_logs() as logs:
        catalog, cache = _build(home, folder)
    ignored = [e for e in logs if e["event"] == "set_cache_ignored"]
    assert len(ignored) == (0 if damage == "empty" else 1), ignored
    assert cache.parses == 8
    assert catalog == first
    assert path.read_bytes() != damaged  # rewritten whole
    _, cache = _build(home, folder)
    assert cache.parses == 0


def test_setstore_journal_lines_are_checked_one_by_one(home: Path, tmp_path: Path) -> None:
    """Changes after the first start go to the journal; a torn line costs its sets one parse."""
    folder = tmp_path / "cache"
    _build(home, folder)
    journal = SetStore(folder).journal
    _write(home / "tools", "set1", description="First change.")
    _build(home, folder)
    _write(home / "tools", "set2", description="Second change.")
    _build(home, folder)
    lines = journal.read_bytes().splitlines(keepends=True)
    assert len(lines) == 2  # appended, not rewritten
    journal.write_bytes(b"garbage without a checksum\n" + lines[0] + lines[1][:-7])
    catalog, cache = _build(home, folder)
    assert cache.parses == 1  # set2: its line was torn; set1's line still counts
    assert catalog == _build(home, None)[0]


def test_setstore_journal_is_compacted_into_the_snapshot(home: Path, tmp_path: Path) -> None:
    """Once the journal outgrows its bound, the next flush rewrites the snapshot and empties it."""
    folder = tmp_path / "cache"
    _build(home, folder)
    store = SetStore(folder)
    big = "x" * 50_000
    for i in range(30):  # ~1.5 MB of new records: over the 1 MiB bound
        _write(home / "tools", "set0", description=f"{big} {i}")
        _build(home, folder)
    assert store.journal.stat().st_size < 1 << 20
    catalog, cache = _build(home, folder)
    assert cache.parses == 0
    assert catalog == _build(home, None)[0]


def test_setstore_past_its_byte_bound_keeps_what_fits(home: Path, tmp_path: Path) -> None:
    """A compaction whose snapshot would pass ``max_bytes`` drops the largest records and
    writes the rest. Refused whole (EFBIG), the store wrote nothing, and every later
    flush read all of it again only to refuse again."""
    folder = tmp_path / "cache"
    big = "x" * 20_000
    for i in range(3):
        _write(home / "tools", f"set{i}", description=f"{big} {i}")
    store = SetStore(folder, max_bytes=50_000)  # the three large sets make ~60 kB
    now = time.time_ns() + 10 * RACY_NS
    cache = ManifestCache(store=store, clock_ns=lambda: now)
    first = build_catalog(home, None, reserved=DEFAULT_RESERVED_NAMES, cache=cache)
    with capture_logs() as logs:
        cache.flush()
    assert [entry["event"] for entry in logs] == []
    assert 0 < store.path.stat().st_size <= 50_000
    second, cache = _build(home, folder)
    assert second == first
    assert (cache.parses, cache.reads) == (1, 1)  # one large set, then nothing else


def test_setstore_byte_bound_counts_the_whole_file(home: Path, tmp_path: Path) -> None:
    """``max_bytes`` bounds the whole snapshot file, its magic line and digest included: a
    snapshot of exactly ``max_bytes`` is written whole, one byte less drops a set. Counted
    on the body alone, a snapshot up to 48 bytes past the bound would be written, one
    that every start ignores at ``MAX_CACHE_BYTES``."""
    _write(home / "tools", "large", description="x" * 5_000)
    _build(home, tmp_path / "sized")
    size = SetStore(tmp_path / "sized").path.stat().st_size
    now = time.time_ns() + 10 * RACY_NS
    for max_bytes, parsed in ((size, 0), (size - 1, 1)):
        folder = tmp_path / f"cache-{max_bytes}"
        store = SetStore(folder, max_bytes=max_bytes)
        cache = ManifestCache(store=store, clock_ns=lambda: now)
        build_catalog(home, None, reserved=DEFAULT_RESERVED_NAMES, cache=cache)
        cache.flush()
        assert store.path.stat().st_size <= max_bytes
        assert _build(home, folder)[1].parses == parsed


def test_setstore_past_its_byte_bound_drops_the_sets_it_does_not_use_first(
    home: Path, tmp_path: Path
) -> None:
    """Past the byte bound, a compaction drops the records this daemon does not use (here
    another daemon's project) before its own, however large its own are."""
    folder = tmp_path / "cache"
    workspace = tmp_path / "ws"
    for i in range(3):
        _write(workspace / ".crystal" / "tools", f"w{i}", description=f"{'x' * 20_000} {i}")
    _build(home, folder)
    _build(home, folder, workspace=workspace)  # another daemon's project: a journal line
    store = SetStore(folder, max_bytes=660_000)
    now = time.time_ns() + 10 * RACY_NS
    cache = ManifestCache(store=store, clock_ns=lambda: now)
    for i in range(2):  # 0.6 MB of journal each: the second flush compacts
        _write(home / "tools", "set3", description=f"{'y' * 600_000} {i}")
        build_catalog(home, None, reserved=DEFAULT_RESERVED_NAMES, cache=cache)
        cache.flush()
    assert store.journal.stat().st_size == 0  # compacted
    assert store.path.stat().st_size <= 660_000
    catalog, cache = _build(home, folder)
    assert cache.parses == 0  # every set this daemon used was kept
    assert catalog == _build(home, None)[0]


def test_setstore_compaction_after_a_cold_load_keeps_what_it_handed_out(
    home: Path, tmp_path: Path
) -> None:
    """Records a cold load took from the store (and dropped from memory) survive a compaction."""
    folder = tmp_path / "cache"
    _build(home, folder)
    now = time.time_ns() + 10 * RACY_NS
    cache = ManifestCache(store=SetStore(folder), clock_ns=lambda: now)
    build_catalog(home, None, reserved=DEFAULT_RESERVED_NAMES, cache=cache)
    assert cache.parses == 0
    store = cache.store
    assert store is not None
    big = "x" * 50_000
    for i in range(30):  # the same process compacts: over the journal's 1 MiB bound
        _write(home / "tools", "set0", description=f"{big} {i}")
        build_catalog(home, None, reserved=DEFAULT_RESERVED_NAMES, cache=cache)
        cache.flush()
    assert store.journal.stat().st_size < 1 << 20
    catalog, fresh = _build(home, folder)
    assert fresh.parses == 0
    assert catalog == _build(home, None)[0]


def test_setstore_an_edited_sets_old_decisions_are_not_kept(home: Path, tmp_path: Path) -> None:
    """Each edit of a manifest is a new key; the old bytes' record and decision go.

    Kept, a storm of edits to one big set grew the daemon by a whole set per reload (in
    the store's file and its decoded records, and in the cache's decisions), and every
    start read them all back.
    """
    folder = tmp_path / "cache"
    now = time.time_ns() + 10 * RACY_NS
    cache = ManifestCache(store=SetStore(folder), clock_ns=lambda: now)
    store = cache.store
    assert store is not None
    big = "x" * 50_000
    first_key = None
    for i in range(40):  # ~2 MB of records: the journal is compacted on the way
        _write(home / "tools", "set0", description=f"{big} {i}")
        build_catalog(home, None, reserved=DEFAULT_RESERVED_NAMES, cache=cache)
        cache.flush()
        if first_key is None:
            digest = hashlib.sha256((home / "tools" / "set0" / "tools.json").read_bytes())
            first_key = next(k for k in cache._decided if k.startswith(digest.hexdigest()))
    assert len(cache._decided) == len(cache)  # one decision per manifest: the current one
    records, _ = SetStore(folder)._read()
    assert first_key not in records
    assert len(records) < 30, len(records)  # the live sets, and the edits since compaction
    catalog, fresh = _build(home, folder)
    assert fresh.parses == 0
    assert catalog == _build(home, None)[0]


def test_setstore_two_worktrees_with_the_same_sets_parse_nothing_on_restart(
    home: Path, tmp_path: Path
) -> None:
    """Two worktrees holding the same project set share its store key: a restart serves
    both from the store (the record is handed out once; the cache keeps the decision)."""
    folder = tmp_path / "cache"
    trees = [tmp_path / "wt1", tmp_path / "wt2"]
    for tree in trees:
        _write(tree / ".crystal" / "tools", "shared", description="The same bytes in both.")
        _write(tree / ".crystal" / "tools", "broken", runner="perl")  # an error, shared too
    now = time.time_ns() + 10 * RACY_NS
    for restart in range(3):
        cache = ManifestCache(store=SetStore(folder), clock_ns=lambda: now)
        catalogs = [
            build_catalog(home, tree, reserved=DEFAULT_RESERVED_NAMES, cache=cache)
            for tree in trees
        ]
        cache.flush()
        assert cache.parses == (10 if restart == 0 else 0), restart  # 8 home + 2 project
        for tree, catalog in zip(trees, catalogs, strict=True):
            assert catalog.tools["shared"].toolset.path == tree / ".crystal" / "tools" / "shared"
            assert catalog == _build(home, None, workspace=tree)[0]
    assert SetStore(folder).journal.stat().st_size == 0  # nothing new to write each time


def test_setstore_a_forgotten_set_comes_back_without_a_parse(home: Path, tmp_path: Path) -> None:
    """A workspace's entries dropped from the cache (forget) come back from its decisions."""
    folder = tmp_path / "cache"
    _build(home, folder)
    now = time.time_ns() + 10 * RACY_NS
    cache = ManifestCache(store=SetStore(folder), clock_ns=lambda: now)
    first = build_catalog(home, None, reserved=DEFAULT_RESERVED_NAMES, cache=cache)
    cache.forget()
    again = build_catalog(home, None, reserved=DEFAULT_RESERVED_NAMES, cache=cache)
    assert (cache.parses, cache.reads) == (0, 0)
    assert again == first



def _idle_registry(
    home: Path, store: SetStore, clock_ns: int, now: list[float]
) -> tuple[ManifestCache, Registry]:
    """A registry over ``store`` whose workspaces go idle after 10 s of ``now[0]``, every
    file judged old enough by ``clock_ns``."""
    cache = ManifestCache(store=store, clock_ns=lambda: clock_ns)
    registry = Registry(
        home,
        DEFAULT_RESERVED_NAMES,
        cache,
        idle_seconds=10,
        clock=lambda: now[0],
        clock_ns=lambda: clock_ns,
    )
    return cache, registry

@pytest.mark.anyio
async def test_setstore_a_released_workspaces_sets_are_not_kept_decoded(
    home: Path, tmp_path: Path
) -> None:
    """A released workspace's sets are held decoded nowhere: the store keeps where each
    record is in its file, the manifest cache no decision no cached manifest holds.

    Kept decoded (a big manifest costs ~9 times its size so), the records of three released
    workspaces of ten 0.7 MB manifests held ~140 MB: on the first start in the store's
    memory after its compaction, on the next ones in the cache's decisions.
    """
    folder = tmp_path / "cache"
    workspaces = [tmp_path / f"ws{k}" for k in range(3)]
    for k, ws in enumerate(workspaces):
        for s in range(3):
            _write(ws / ".crystal" / "tools", f"p{k}s{s}", description=f"Project set {k}/{s}.")
    project = f"/{Source.PROJECT.value}/"
    clock_ns = time.time_ns() + 10 * RACY_NS  # every file old enough to be indexed
    now = [0.0]
    for start in ("cold store", "warm store"):
        now[0] = 0.0
        cache, registry = _idle_registry(home, SetStore(folder), clock_ns, now)
        await registry.catalog(None)
        used = [await registry.catalog(ws) for ws in workspaces]
        cache.flush()
        now[0] = 100.0
        await registry.catalog(None)
        assert sorted(registry.evict_idle()) == workspaces, start
        store = cache.store
        assert store is not None
        assert [k for k in cache._decided if project in k] == [], start
        records = {**store._loaded(), **store._new}
        assert [k for k, v in records.items() if isinstance(v, bytes)] == [], start
        assert len([k for k in records if project in k]) == 9, start  # in the file, for a return
        parses = cache.parses
        again = [await registry.catalog(ws) for ws in workspaces]  # from the store's file
        assert again == used, start
        assert cache.parses == parses, start
        assert again == [_build(home, None, workspace=ws)[0] for ws in workspaces], start


@pytest.mark.anyio
@pytest.mark.parametrize("flushes", ["journal lines", "compactions"])
async def test_setstore_memory_does_not_grow_with_the_workspaces_it_released(
    home: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, flushes: str
) -> None:
    """Cycles of new workspaces opened then released leave the store holding no record's
    bytes and no more open files than the first: it keeps where each record is on disk.

    The store kept every record it read or wrote as bytes, so a daemon's memory grew by the
    records of every set it ever served: six new workspaces of ten 0.5 MB manifests per
    cycle took a daemon 106 -> 141 -> 182 ... 234 MB over ten cycles, never levelling off
    below the 128 MiB the file may hold.
    """
    if flushes == "compactions":  # every flush after the first rewrites the snapshot
        monkeypatch.setattr(setcache, "_JOURNAL_MIN_BYTES", 0)
    folder = tmp_path / "cache"
    clock_ns = time.time_ns() + 10 * RACY_NS  # every file old enough to be indexed
    now = [0.0]
    store = SetStore(folder)
    cache, registry = _idle_registry(home, store, clock_ns, now)
    home_tools = len((await registry.catalog(None)).tools)
    cache.flush()
    home_records = len(store._loaded())
    fds: list[int] = []
    for cycle in range(4):
        workspaces = [tmp_path / f"ws{cycle}-{k}" for k in range(2)]
        for ws in workspaces:
            for s in range(3):
                schema = {
                    "type": "object",
                    "properties": {f"{ws.name}_{s}_{i}": {} for i in range(300)},
                }
                _write(ws / ".crystal" / "tools", f"s{s}", schema=schema)
        opened = [await registry.catalog(ws) for ws in workspaces]
        assert [len(c.tools) for c in opened] == [home_tools + 3] * 2
        cache.flush()
        now[0] += 100.0
        await registry.catalog(None)
        assert sorted(registry.evict_idle()) == workspaces
        records = {**store._loaded(), **store._new}
        assert len(records) == home_records + 6 * (cycle + 1)  # every workspace's sets
        held = [k for k, v in records.items() if isinstance(v, bytes)]
        assert held == [], f"cycle {cycle}: {len(held)} records held as bytes"
        # Nor a file's bytes: a start keeps them only until its first flush.
        buffered = {id(v[0]) for v in records.values() if v[0].data is not None}
        assert not buffered, f"cycle {cycle}: {len(buffered)} files held as bytes"
        fds.append(len(os.listdir("/proc/self/fd")))
        parses = cache.parses
        assert [await registry.catalog(ws) for ws in workspaces] == opened  # read back
        assert cache.parses == parses
        now[0] += 100.0
        await registry.catalog(None)
        registry.evict_idle()
    assert max(fds) <= fds[0]


@pytest.mark.parametrize(
    "spoil",
    [
        lambda record: ["set", "exec", True],  # too short to decode
        lambda record: ["set", *record],  # the earlier form's kind marker: one too many
        lambda record: [99, *record[1:]],  # no such runner
        lambda record: [*record[:3], [1, 2], *record[4:]],  # a list for a catalog mask
        lambda record: [*record[:8], [[*record[8][0][:4], -1, *record[8][0][5:]]]],  # approval
    ],
    ids=["short", "earlier form", "unknown runner", "catalogs not a mask", "unknown approval"],
)
def test_setstore_malformed_record_is_parsed_instead(
    home: Path, tmp_path: Path, spoil: Any
) -> None:
    """A record of the wrong shape (in an intact file) costs one parse, never a wrong set."""
    folder = tmp_path / "cache"
    first, _ = _build(home, folder)
    store = SetStore(folder)
    records = dict(store._read()[0])
    key = next(k for k in records if k.endswith("/set2"))
    raw = setcache._held_bytes(records[key])
    assert raw is not None
    spoilt = orjson.dumps(spoil(orjson.loads(raw)))
    records[key] = spoilt
    bad = SetStore(folder)
    bad._records, bad._index = records, store._read()[1]
    bad._new = {key: spoilt}
    assert bad.flush()
    catalog, cache = _build(home, folder)
    assert catalog == first
    assert cache.parses == 1


def test_setstore_keeps_only_exact_round_trips(tmp_path: Path) -> None:
    """A schema JSON cannot carry exactly (an integer beyond 64 bits) is parsed every time."""
    home = tmp_path / "home"
    _write(home / "tools", "big", schema={"type": "integer", "maximum": 2**70})
    _write(home / "tools", "small")
    folder = tmp_path / "cache"
    first, cache = _build(home, folder)
    assert cache.parses == 2
    second, cache = _build(home, folder)
    assert cache.parses == 1
    assert second == first
    assert second.tools["big"].tool.schema["maximum"] == 2**70


def test_setstore_keeps_a_tools_mcp_listing_note(tmp_path: Path) -> None:
    """A tool's note on its MCP listing (here: an ``x-mcp-header`` mark on a number) is
    made when its manifest is parsed and comes back from the store's record, so that a
    restart, which parses nothing, notes it too and no catalog build walks a schema."""
    home = tmp_path / "home"
    marked = {"type": "object", "properties": {"n": {"type": "number", "x-mcp-header": "N"}}}
    _write(home / "tools", "marked", schema=marked)
    folder = tmp_path / "cache"
    first, cache = _build(home, folder)
    assert cache.parses == 1
    second, cache = _build(home, folder)
    assert cache.parses == 0
    assert second == first
    (entry,) = second.sets
    assert entry.notes == (
        "External tool 'marked' is listed to MCP hosts without its x-mcp-header marks: the one "
        "on 'n' is on a type other than string, integer or boolean, which MCP's rules refuse "
        "(its 2026-07-28 clients drop such a tool), so no argument of it is mirrored into a "
        "header, nor checked in one.",
    )


def test_setstore_a_path_that_is_not_utf8_is_read_not_indexed(tmp_path: Path) -> None:
    """Sets below a folder whose name is not UTF-8 load again and again; the store still writes."""
    home = Path(os.fsdecode(os.fsencode(tmp_path) + b"/caf\xe9")) / "home"
    _write(home / "tools", "set0")
    folder = tmp_path / "cache"
    first, cache = _build(home, folder)
    assert [e.state.value for e in first.sets] == ["loaded"]
    second, cache = _build(home, folder)
    assert second == first
    assert cache.reads == 1  # not indexed: read (the store still gives its decision)


def test_setstore_errors_are_cached_with_their_message(home: Path, tmp_path: Path) -> None:
    """An invalid manifest's error comes back from the store word for word."""
    folder = tmp_path / "cache"
    _build(home, folder)
    catalog, cache = _build(home, folder)
    assert cache.parses == 0
    (entry,) = [e for e in catalog.sets if e.directory == "broken"]
    assert entry.error == "tools.json must set runner to exec or dotnet."


def test_setstore_key_covers_reserved_names_and_source(home: Path, tmp_path: Path) -> None:
    """Other reserved names, or the same bytes as a project set, are decided afresh."""
    folder = tmp_path / "cache"
    _build(home, folder)
    reserved = DEFAULT_RESERVED_NAMES | {"set1"}
    catalog, cache = _build(home, folder, reserved=reserved)
    assert cache.parses == 8
    assert "set1" not in catalog.tools
    assert catalog == _build(home, None, reserved=reserved)[0]
    workspace = tmp_path / "ws"
    (workspace / ".crystal" / "tools").mkdir(parents=True)
    os.symlink(home / "tools" / "set4", workspace / ".crystal" / "tools" / "set4")
    catalog, cache = _build(home, folder, workspace=workspace)
    assert cache.parses == 1  # the project copy of set4
    assert catalog.tools["set4"].toolset.source is Source.PROJECT
    assert catalog == _build(home, None, workspace=workspace)[0]


def test_setstore_reserved_names_that_join_alike_are_other_keys(
    home: Path, tmp_path: Path
) -> None:
    """Reserved names are keyed one by one: ``"set1\\0set2"`` (a config file's string may
    hold a NUL) is not the two names ``set1`` and ``set2``, and a name that is not UTF-8
    (``--reserve $'\\xff'``) is keyed rather than stopping the daemon."""
    folder = tmp_path / "cache"
    two = DEFAULT_RESERVED_NAMES | {"set1", "set2"}
    one = DEFAULT_RESERVED_NAMES | {"set1\x00set2"}
    assert setcache.reserved_fingerprint(two) != setcache.reserved_fingerprint(one)
    first, _ = _build(home, folder, reserved=two)
    assert "set1" not in first.tools
    catalog, cache = _build(home, folder, reserved=one)
    assert cache.parses == 8  # none of the other names' decisions
    assert "set1" in catalog.tools
    assert catalog == _build(home, None, reserved=one)[0]
    stray = DEFAULT_RESERVED_NAMES | {"\udcff"}  # what Python makes of argv's byte 0xff
    catalog, _ = _build(home, folder, reserved=stray)
    assert catalog == _build(home, None, reserved=stray)[0]


def test_setstore_unwritable_folder_only_costs_speed(home: Path, tmp_path: Path) -> None:
    """A cache folder that cannot be created leaves the load correct and the daemon running."""
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    catalog, _ = _build(home, blocker / "cache")
    assert catalog == _build(home, None)[0]
    assert not SetStore(blocker / "cache").flush()


def _bytes_read() -> int:
    """What this process has read so far (``rchar``: every ``read``, cached or not)."""
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("rchar:"):
            return int(line.split()[1])
    raise AssertionError("no rchar in /proc/self/io")


def test_setstore_unwritable_folder_is_not_read_again_to_compact(
    home: Path, tmp_path: Path, unwritable: Callable[[Path], None]
) -> None:
    """A cache folder the daemon may not write (a read-only mount, another owner's): each
    compaction read and hashed the snapshot and the journal (up to 128 MiB) before its
    rename failed, at every reload that parsed a set. It now fails first, reading nothing,
    and says why once."""
    for i in range(200):
        _write(home / "tools", f"more{i}", description="Padding for the snapshot. " * 8)
    folder = tmp_path / "cache"
    _build(home, folder)
    snapshot = SetStore(folder).path
    size = snapshot.stat().st_size
    data = bytearray(snapshot.read_bytes())
    data[-2] ^= 1  # altered: the next flush compacts, where a journal line would do
    snapshot.write_bytes(bytes(data))
    unwritable(folder)
    clock = [0]
    cache = ManifestCache(store=SetStore(folder), clock_ns=lambda: clock[0])
    with capture_logs() as logs:
        for i in range(2):  # a reload that parsed a set again: not warned again
            _write(home / "tools", "set3", description=f"Changed {i}: a record to write.")
            clock[0] = time.time_ns() + 10 * RACY_NS
            catalog = build_catalog(home, None, reserved=DEFAULT_RESERVED_NAMES, cache=cache)
            assert cache.parses == [208, 209][i]  # all (the snapshot is altered), then one
            before = _bytes_read()
            assert not cache.flush()
            assert _bytes_read() - before < size // 4, size
    assert catalog == _build(home, None)[0]
    warned = [e for e in logs if e["event"] == "set_cache_unwritable"]
    assert len(warned) == 1, logs
    assert warned[0]["error"] in ("Permission denied", "Operation not permitted")
    assert sorted(p.name for p in folder.iterdir()) == sorted([snapshot.name, SetStore(folder).journal.name])


@pytest.mark.parametrize("where", ["folder", "above"])
def test_setstore_folder_that_is_a_file_is_said_so(home: Path, tmp_path: Path, where: str) -> None:
    """A file where the cache folder (or a folder above it) should be: the loads work
    uncached, and the warning names the path that is not a folder, not mkdir's bare
    "File exists"."""
    top = tmp_path / "cache"
    folder = top if where == "folder" else top / "toolsetd"
    top.write_text("not a folder\n")
    with capture_logs() as logs:
        catalog, _ = _build(home, folder)
    assert catalog == _build(home, None)[0]
    warned = [e for e in logs if e["event"] == "set_cache_unwritable"]
    assert len(warned) == 1, logs
    expected = (f"File exists: {folder} is not a folder" if where == "folder"
                else f"Not a directory: a folder above {folder} is not a folder")
    assert warned[0]["error"] == expected, warned


def _special(path: Path, kind: str) -> None:
    path.unlink(missing_ok=True)
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "dev_zero":
        os.symlink("/dev/zero", path)
    elif kind == "symlink":  # to a copy of a good file: still not one this store wrote
        copy = path.with_name("elsewhere")
        copy.write_bytes(b"")
        os.symlink(copy, path)
    else:
        path.mkdir()


@pytest.mark.parametrize("kind", ["fifo", "dev_zero", "symlink", "folder"])
@pytest.mark.parametrize("which", ["path", "journal"])
def test_setstore_special_files_are_ignored_unread(
    home: Path, tmp_path: Path, which: str, kind: str
) -> None:
    """A FIFO, device link, symlink or folder as a cache file is ignored without blocking."""
    folder = tmp_path / "cache"
    _build(home, folder)
    target = getattr(SetStore(folder), which)
    _special(target, kind)
    _write(home / "tools", "set3", description="Changed, so the load has a record to write.")
    with capture_logs() as logs:
        catalog, cache = _build(home, folder)
    assert catalog == _build(home, None)[0]
    assert cache.parses == (8 if which == "path" else 1)
    warned = [e["event"] for e in logs if e.get("path") == str(target)]
    assert warned[0] in ("set_cache_ignored", "set_cache_unreadable")
    if kind == "folder":  # a file cannot be renamed over a folder: the cache stays unwritten
        assert warned[1:] == (["set_cache_unwritable"] if which == "path" else [])
    else:
        assert len(warned) == 1
        assert not target.is_symlink()  # replaced by a compaction
        assert target.is_file()
        _, cache = _build(home, folder)
        assert cache.parses == 0


def test_setstore_file_beyond_the_cap_is_ignored_unread(home: Path, tmp_path: Path) -> None:
    """A snapshot larger than MAX_CACHE_BYTES is ignored (sparse here: cheap to make)."""
    folder = tmp_path / "cache"
    _build(home, folder)
    path = SetStore(folder).path
    with open(path, "r+b") as f:
        f.truncate(MAX_CACHE_BYTES + 1)
    with capture_logs() as logs:
        _, cache = _build(home, folder)
    assert cache.parses == 8
    assert {"event": "set_cache_ignored", "path": str(path), "reason": "larger than 128 MiB"} in [
        {k: e[k] for k in ("event", "path", "reason") if k in e} for e in logs
    ]
    assert path.stat().st_size < MAX_CACHE_BYTES  # rewritten


ME = os.geteuid()
OTHER = 65534  # nobody
needs_root = pytest.mark.skipif(ME != 0, reason="only root can give a file to another uid")

#: What a poisoned record would make every cached set run instead of its manifest's command.
POISON = ["/bin/sh", "-c", "echo POISONED"]


def _poisoned(snapshot: Path) -> bytes:
    """The snapshot's body with every set's command replaced (no key: anyone can re-sign)."""
    records: dict[str, Any] = {}  # bytes: no file given
    index: dict[str, Any] = {}
    setcache._merge(records, index, snapshot.read_bytes()[len(setcache._MAGIC) + 32 :])
    for key, raw in records.items():
        record = orjson.loads(raw)
        if record[0] != "error":
            record[4] = POISON
        records[key] = orjson.dumps(record)
    return setcache._pack(records, index)


def _commands(catalog: Catalog) -> set[tuple[str, ...]]:
    return {loaded.toolset.command for loaded in catalog.tools.values()}


@pytest.mark.parametrize(
    ("uid", "mode", "reason", "fix"),
    [
        pytest.param(
            OTHER,
            0o777,
            f"owned by uid {OTHER}, not this daemon's uid {ME}",
            "remove {}",
            marks=needs_root,
            id="other_uid_777",
        ),
        pytest.param(
            OTHER,
            0o700,
            f"owned by uid {OTHER}, not this daemon's uid {ME}",
            "remove {}",
            marks=needs_root,
            id="other_uid_700",
        ),
        pytest.param(ME, 0o777, "writable by group or others", "chmod 700 {}", id="mine_777"),
        pytest.param(ME, 0o720, "writable by group or others", "chmod 700 {}", id="mine_720"),
        # A shared folder such as /tmp (--cache-dir /tmp): "chmod 700 /tmp" or "remove
        # /tmp" would break every other user of it.
        pytest.param(
            ME, 0o1777, "writable by group or others", "give the daemon a folder of its own",
            id="mine_shared_1777",
        ),
        pytest.param(
            OTHER,
            0o1777,
            f"owned by uid {OTHER}, not this daemon's uid {ME}",
            "give the daemon a folder of its own",
            marks=needs_root,
            id="other_uid_shared_1777",
        ),
    ],
)
def test_setstore_folder_not_the_daemons_alone_is_not_used(
    home: Path, tmp_path: Path, uid: int, mode: int, reason: str, fix: str
) -> None:
    """A cache folder another uid owns, or others may write, is neither read nor written."""
    folder = tmp_path / "cache"
    _build(home, folder)
    path = SetStore(folder).path
    body = _poisoned(path)
    path.write_bytes(b"toolsetd-sets 1\n" + hashlib.sha256(body).digest() + body)
    os.chown(folder, uid, uid)
    os.chmod(folder, mode)
    before = path.read_bytes()
    with capture_logs() as logs:
        catalog, cache = _build(home, folder)
        _build(home, folder)  # a second store: the same line again, once
    assert cache.parses == 8
    assert catalog == _build(home, None)[0]
    assert tuple(POISON) not in _commands(catalog)
    untrusted = [e for e in logs if e["event"] == "set_cache_untrusted"]
    assert (
        untrusted == [{**untrusted[0], "path": str(folder), "reason": reason}] * 2
    )  # once per store
    assert untrusted[0]["fix"].startswith(fix.format(folder))
    assert path.read_bytes() == before  # not written either
    assert os.stat(folder).st_uid == uid


def test_setstore_a_link_to_a_shared_folder_is_not_told_to_chmod(
    home: Path, tmp_path: Path
) -> None:
    """A cache folder that is a link to a shared folder (``~/.cache/toolsetd -> /tmp``):
    the fix said ``chmod 700 <the link>``, which chmod follows, making the shared folder
    private to one user. It says to give the daemon a folder of its own."""
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o1777)
    link = tmp_path / "cache"
    link.symlink_to(shared)
    with capture_logs() as logs:
        _build(home, link)
    untrusted = [e for e in logs if e["event"] == "set_cache_untrusted"]
    assert [e["path"] for e in untrusted] == [str(link)]
    assert "chmod" not in untrusted[0]["fix"]
    assert untrusted[0]["fix"].startswith("give the daemon a folder of its own")
    assert stat.S_IMODE(os.stat(shared).st_mode) == 0o1777


@pytest.mark.parametrize("which", ["path", "journal"])
@pytest.mark.parametrize(
    ("uid", "mode"),
    [
        pytest.param(OTHER, 0o600, marks=needs_root, id="other_uid_600"),
        pytest.param(ME, 0o666, id="mine_666"),
        pytest.param(ME, 0o620, id="mine_620"),
    ],
)
def test_setstore_file_not_the_daemons_alone_is_ignored_and_replaced(
    home: Path, tmp_path: Path, which: str, uid: int, mode: int
) -> None:
    """A poisoned snapshot or journal another uid owns, or others may write, is not read."""
    folder = tmp_path / "cache"
    _build(home, folder)
    store = SetStore(folder)
    body = _poisoned(store.path)
    if which == "path":
        store.path.write_bytes(b"toolsetd-sets 1\n" + hashlib.sha256(body).digest() + body)
    else:
        store.journal.write_bytes(hashlib.sha256(body).hexdigest().encode() + b" " + body + b"\n")
    target = getattr(store, which)
    os.chown(target, uid, uid)
    os.chmod(target, mode)
    _write(home / "tools", "set3", description="Changed, so the load has a record to write.")
    with capture_logs() as logs:
        catalog, cache = _build(home, folder)
    assert cache.parses == (8 if which == "path" else 1)
    assert catalog == _build(home, None)[0]
    assert tuple(POISON) not in _commands(catalog)
    untrusted = [e for e in logs if e["event"] == "set_cache_untrusted"]
    assert [e["path"] for e in untrusted] == [str(target)]
    fix = f"remove {target}" if uid != ME else f"chmod 600 {target}"
    assert untrusted[0]["fix"].startswith(fix)
    st = os.stat(target)  # replaced by the compaction: the daemon's own, private
    assert (st.st_uid, st.st_mode & 0o077) == (ME, 0)
    catalog, cache = _build(home, folder)
    assert cache.parses == 0
    assert tuple(POISON) not in _commands(catalog)


def test_setstore_concurrent_writers_leave_a_valid_file(tmp_path: Path) -> None:
    """Daemons flushing into one folder at once never leave a torn file or a stray temp file."""
    folder = tmp_path / "cache"
    script = textwrap.dedent(
        """
        import json, sys, time
        from pathlib import Path
        from toolsetd.daemon.catalog import ManifestCache, build_catalog
        from toolsetd.daemon.model import DEFAULT_RESERVED_NAMES
        from toolsetd.daemon.setcache import SetStore
        home, folder, tag = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]
        for round in range(15):
            d = home / "tools" / f"{tag}{round}"
            d.mkdir(parents=True, exist_ok=True)
            (d / "tools.json").write_text(json.dumps({
                "runner": "exec", "description": f"{tag} {round}", "schema": {"type": "object"},
                "command": ["/bin/true"]}))
            cache = ManifestCache(store=SetStore(folder))
            catalog = build_catalog(home, None, reserved=DEFAULT_RESERVED_NAMES, cache=cache)
            cache.flush()
            assert all(t.tool.description for t in catalog.tools.values())
        """
    )
    procs = [
        subprocess.Popen(  # the test starts separate processes, as daemons would be
            [sys.executable, "-c", script, str(tmp_path / f"home{k}"), str(folder), f"w{k}x"]
        )
        for k in range(4)
    ]
    assert [p.wait(timeout=60) for p in procs] == [0, 0, 0, 0]
    records, _ = SetStore(folder)._read()
    assert records  # (no index: every file was too fresh to be judged by its stat)
    assert not [p for p in folder.iterdir() if p.name.endswith(".tmp")]
    for k in range(4):  # whatever survived the races decodes to what a parse gives
        home = tmp_path / f"home{k}"
        catalog, _ = _build(home, folder)
        assert catalog == _build(home, None)[0]


def test_setstore_threads_flushing_at_once(home: Path, tmp_path: Path) -> None:
    """Two stores in one process flushing concurrently both succeed and the file stays valid."""
    folder = tmp_path / "cache"
    errors: list[BaseException] = []

    def work() -> None:
        try:
            for _ in range(10):
                _build(home, folder, clock=time.time_ns())
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=work) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors
    _, cache = _build(home, folder)
    assert cache.parses == 0


@pytest.mark.parametrize(
    ("environ", "expected"),
    [
        ({"XDG_CACHE_HOME": "/var/c", "HOME": "/home/u"}, "/var/c/toolsetd"),
        ({"XDG_CACHE_HOME": "relative", "HOME": "/home/u"}, "/home/u/.cache/toolsetd"),
        ({"HOME": "/home/u"}, "/home/u/.cache/toolsetd"),
    ],
)
def test_setstore_default_folder_follows_xdg(environ: dict[str, str], expected: str) -> None:
    """An absolute XDG_CACHE_HOME wins; a relative one is ignored, as the XDG spec says."""
    assert str(default_cache_dir(environ)) == expected


@pytest.mark.parametrize("runner", list(RunnerKind))
@pytest.mark.parametrize("approval", list(Approval))
@pytest.mark.parametrize("output", list(OutputMode))
@pytest.mark.parametrize(
    "catalogs",
    [frozenset(), *({c} for c in CatalogName), frozenset(CatalogName)],
    ids=lambda c: "+".join(sorted(c)) or "none",  # a frozenset's order varies by process
)
def test_setstore_record_round_trips_every_enum_value(
    runner: RunnerKind, approval: Approval, output: OutputMode, catalogs: set[CatalogName]
) -> None:
    """A record stores enum members as codes and catalogs as a mask: each value, read back
    through JSON, decodes to the set it was made from."""
    path = Path("/h/tools/s")
    tool = ToolDef(
        "t",
        "d",
        {"type": "object"},
        frozenset(catalogs),
        approval,
        ("a",),
        (("q", "--q"),),
        ("p",),
        output,
        ("a note on the tool's MCP listing",),
    )
    other = next(a for a in Approval if a is not approval)  # the set's differ from the tool's
    toolset = ToolSet(
        "s",
        Source.HOME,
        path,
        runner,
        False,
        other,
        frozenset(CatalogName) - catalogs,
        ("run",),
        False,
        None,
        (tool,),
        "sha256:00",
    )
    hashes = {("t", ApprovalSource.AUTHOR): "sha256:aa", ("t", ApprovalSource.HOST): "sha256:bb"}
    record = orjson.loads(orjson.dumps(encode_record(toolset, hashes)))
    assert decode_record(record, directory="s", source=Source.HOME, path=path) == (
        toolset,
        hashes,
    )


#: Manifests whose records between them run every path a record's values come from: a
#: set and its hashes, the reference host's messages, Python's JSON parser's, the
#: protocol's for NaN, and jsonschema's for a bad schema (of two dialects).
DECIDING_MANIFESTS = [
    {
        "runner": "exec",
        "command": ["x"],
        "tools": [
            {"name": "a", "description": "d", "schema": {"type": "object"}, "argv": {"q": "-q"}},
            {"name": "b", "description": "d", "schema": {"type": "object"}, "output": "content"},
        ],
    },
    {"runner": "dotnet", "assembly": "a.dll", "tools": {"a": {"approval": "always"}}},
    {"runner": "perl"},
    "{not json",
    '{"runner": NaN}',
    {
        "runner": "exec",
        "description": "d",
        "schema": {"properties": {"q": {"type": 12}}},
        "command": ["x"],
    },
    {
        "runner": "exec",
        "description": "d",
        "schema": {"$schema": "http://json-schema.org/draft-07/schema#", "minimum": "a"},
        "command": ["x"],
    },
]


def test_setstore_fingerprint_covers_every_module_a_record_comes_from(tmp_path: Path) -> None:
    """Every toolsetd module that runs while a record's values are made is fingerprinted."""
    ran: set[str] = set()

    def profile(frame: Any, event: str, arg: Any) -> None:
        if event == "call":
            ran.add(frame.f_code.co_filename)

    for i, manifest in enumerate(DECIDING_MANIFESTS):
        set_dir = tmp_path / f"s{i}"
        text = (manifest if isinstance(manifest, str) else json.dumps(manifest)).encode()
        sys.setprofile(profile)
        try:
            try:
                result = parse_manifest(
                    text, set_dir=set_dir, source=Source.HOME, reserved=DEFAULT_RESERVED_NAMES
                )
            except ManifestError as exc:
                record = encode_record(exc.message, {})
            else:
                hashes = {
                    (t.name, policy): tool_hash(t, result, policy)
                    for t in result.tools
                    for policy in ApprovalSource
                }
                record = encode_record(result, hashes)
            decode_record(record, directory=set_dir.name, source=Source.HOME, path=set_dir)
        finally:
            sys.setprofile(None)
    ours = {
        os.path.realpath(module.__file__ or "")
        for name, module in sys.modules.items()
        if name.startswith("toolsetd.") and hasattr(module, "__file__")
    }
    fingerprinted = {
        os.path.realpath(sys.modules[name].__file__ or "") for name in setcache._DECIDING_MODULES
    }
    ran_ours = {os.path.realpath(f) for f in ran} & ours
    assert ran_ours - fingerprinted == set()
    assert len(ran_ours) >= 5  # the trace saw the parser, the hash and this module
    third_party = [Path(f).parts for f in ran if "site-packages" in Path(f).parts]
    packages = {parts[parts.index("site-packages") + 1] for parts in third_party}
    assert "jsonschema" in packages
    assert "jsonschema" in setcache._DECIDING_DISTRIBUTIONS


def test_setstore_a_decision_made_under_another_digit_limit_is_not_used(tmp_path: Path) -> None:
    """Whether an integer of 4,400 digits refuses a set depends on the interpreter's limit
    (``PYTHONINTMAXSTRDIGITS``): a daemon started with another limit parses it afresh
    instead of taking the refusal a daemon with the default limit stored."""
    home = tmp_path / "home"
    _write(home / "tools", "wide", note=0)
    manifest = home / "tools" / "wide" / "tools.json"
    manifest.write_text(manifest.read_text().replace('"note": 0', '"note": ' + "9" * 4400))
    folder = tmp_path / "cache"
    limit = sys.get_int_max_str_digits()
    try:
        sys.set_int_max_str_digits(4300)
        refused, _ = _build(home, folder)
        assert list(refused.tools) == [] and "4,300 digits" in refused.notes[0].message
        sys.set_int_max_str_digits(0)  # no limit: the manifest parses
        catalog, cache = _build(home, folder)
        fresh, _ = _build(home, None)
    finally:
        sys.set_int_max_str_digits(limit)
    assert list(fresh.tools) == ["wide"]
    assert catalog == fresh
    assert cache.parses == 1


_BUILD_WITH_STORE = """
import json, sys, time
from pathlib import Path
from toolsetd.daemon.catalog import RACY_NS, ManifestCache, build_catalog
from toolsetd.daemon.model import DEFAULT_RESERVED_NAMES
from toolsetd.daemon.setcache import SetStore
later = time.time_ns() + 10 * RACY_NS
store = SetStore(Path(sys.argv[2])) if sys.argv[2] else None
cache = ManifestCache(store=store, clock_ns=lambda: later)
catalog = build_catalog(Path(sys.argv[1]), None, reserved=DEFAULT_RESERVED_NAMES, cache=cache)
cache.flush()
print(json.dumps([list(catalog.tools), [n.message for n in catalog.notes]]))
"""


def test_setstore_a_verdict_made_without_a_format_package_is_not_used_with_it(
    tmp_path: Path,
) -> None:
    """jsonschema checks the meta-schema's ``uri-reference`` format only when a package
    for it is installed: ``{"$ref": "a b"}`` passes without one and is refused with one. A
    daemon that has it parses afresh instead of taking the store's verdict made without."""
    home = tmp_path / "home"
    _write(home / "tools", "refset", schema={"$ref": "a b"})
    extra = tmp_path / "extra"  # a stand-in for rfc3986-validator
    (extra / "rfc3986_validator-0.1.1.dist-info").mkdir(parents=True)
    (extra / "rfc3986_validator.py").write_text(
        "def validate_rfc3986(value, rule='URI'):\n    return ' ' not in value\n"
    )
    folder = tmp_path / "cache"

    def build(store: Path | None, with_format: bool) -> list[Any]:
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        if with_format:
            env["PYTHONPATH"] = str(extra)
        done = subprocess.run(
            [sys.executable, "-c", _BUILD_WITH_STORE, str(home), str(store or "")],
            capture_output=True, text=True, env=env, timeout=60, check=True,
        )
        result: list[Any] = json.loads(done.stdout)
        return result

    assert build(folder, with_format=False) == [["refset"], []]
    fresh = build(None, with_format=True)
    assert fresh[0] == [] and "is not a 'uri-reference'" in fresh[1][0]
    assert build(folder, with_format=True) == fresh


@pytest.mark.parametrize("package", setcache._DECIDING_DISTRIBUTIONS)
def test_setstore_fingerprint_reads_the_installed_version(package: str) -> None:
    """The fingerprint's cheap version lookup finds what importlib.metadata reports."""
    version = importlib.metadata.version(package)
    assert f"{package}-{version}.dist-info" in setcache._installed_version(package, {}).split()


def test_setstore_compaction_keeps_the_index_a_journal_line_updated(tmp_path: Path) -> None:
    """A manifest edited since the last compaction stays indexed to its new bytes.

    The edit went to the journal; a later compaction (another set's flush) merged the
    file, then laid the process's index as of the last compaction over it: the path
    went back to its old bytes' key and signature, which kept the old record alive and
    left the new one unindexed (read again at every start, and dropped by a
    compaction in a process that does not use it).
    """
    folder = tmp_path / "cache"
    store = SetStore(folder)
    manifest, other = "/w/p/tools.json", "/w/q/tools.json"
    store.put("old", ["p, before the edit"])
    store.index(manifest, (1, 1, 1, 1), "old")
    store.flush()  # the first snapshot
    store.put("new", ["p, after the edit"])
    store.index(manifest, (2, 2, 2, 2), "new")
    store.release("old")
    store.flush()  # a journal line
    store.put("big", ["q" * (2 << 20)])  # too big for the journal: a compaction
    store.index(other, (3, 3, 3, 3), "big")
    store.flush()
    records, index = SetStore(folder)._read()
    assert index[manifest] == [2, 2, 2, 2, "new"]
    assert "old" not in records


@pytest.mark.parametrize("expected", [None, 0, 10, 100_000, 300_000])
def test_read_descriptor_reads_to_the_end_whatever_size_was_expected(
    tmp_path: Path, expected: int | None
) -> None:
    """The size hint only sizes the reads: a file that grew or shrank since its ``fstat``
    is read whole, and one past the limit still gives None."""
    data = os.urandom(200_000)
    path = tmp_path / "f"
    path.write_bytes(data)
    for limit, want in [(len(data), data), (len(data) - 1, None)]:
        fd = os.open(path, os.O_RDONLY)
        try:
            assert read_descriptor(fd, limit, expected) == want
        finally:
            os.close(fd)
