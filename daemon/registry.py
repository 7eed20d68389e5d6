"""The registry of loaded tool sets: one immutable catalog snapshot per workspace.

Theory of operation
-------------------
A snapshot (``Catalog``) is built by ``build_catalog`` for a key: ``None`` for the home
sets alone, or a canonical workspace path for home plus that project. It is built on
first use, off the event loop, and replaced whole on reload: a reader holds whichever
snapshot it fetched, so a call started before a reload keeps its definition to the end.
Home sets are shared between snapshots through the ``ManifestCache``: a manifest whose
file did not change is neither re-read nor re-parsed, so a reload of unchanged sets
costs a ``stat`` per set.

The generation is one counter for the daemon. It moves when a reload changes any
snapshot, so a front end that saw generation N and sees N again has the same catalog.

Workspaces not used for ``idle_seconds`` are dropped by ``evict_idle`` (and with them
their watches), so a daemon that served many projects does not keep them all.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass, field, replace
from pathlib import Path

import anyio
import structlog

from .catalog import ManifestCache, build_catalog, load_config, trusted_signature
from .model import Catalog, SetEntry, Source

__all__ = ["Registry", "ReloadOutcome", "SetChange", "diff_catalogs"]

log = structlog.get_logger("toolsetd.registry")

Key = Path | None


@dataclass(frozen=True, slots=True)
class SetChange:
    """One set that a reload added, removed or updated."""

    set: str
    source: Source
    change: str  # "added" | "removed" | "updated"

    def to_wire(self) -> dict[str, str]:
        """The contract's ``changed[]`` entry."""
        return {"set": self.set, "source": self.source.value, "change": self.change}


@dataclass(frozen=True, slots=True)
class ReloadOutcome:
    """What a reload did, per workspace key, and the generation after it."""

    generation: int
    changes: dict[Key, tuple[SetChange, ...]] = field(default_factory=dict)
    catalogs: dict[Key, Catalog] = field(default_factory=dict)

    def all_changes(self) -> list[SetChange]:
        """Every change, each (set, source, change) once, in a stable order."""
        seen: dict[tuple[str, str, str], SetChange] = {}
        for changes in self.changes.values():
            for change in changes:
                seen.setdefault((change.set, change.source.value, change.change), change)
        return sorted(seen.values(), key=lambda c: (c.set, c.source.value, c.change))


def _fingerprint(entry: SetEntry) -> tuple[object, ...]:
    digest = entry.toolset.digest if entry.toolset is not None else None
    return (entry.state, entry.enabled, entry.tools, entry.notes, entry.error, digest, str(entry.path))


def diff_catalogs(old: Catalog | None, new: Catalog) -> tuple[SetChange, ...]:
    """Compare two snapshots set by set.

    Args:
        old: The snapshot before, or None when there was none.
        new: The snapshot after.

    Returns:
        The added, removed and updated sets, sorted by directory then source.
    """
    before = {(e.directory, e.source): e for e in (old.sets if old else ())}
    after = {(e.directory, e.source): e for e in new.sets}
    changes: list[SetChange] = []
    for key in sorted(before.keys() | after.keys(), key=lambda k: (k[0], k[1].value)):
        was, now = before.get(key), after.get(key)
        if was is None:
            changes.append(SetChange(key[0], key[1], "added"))
        elif now is None:
            changes.append(SetChange(key[0], key[1], "removed"))
        elif _fingerprint(was) != _fingerprint(now):
            changes.append(SetChange(key[0], key[1], "updated"))
    return tuple(changes)


class _TooFresh(Exception):
    """A file changed too recently for its stat signature to be trusted."""


def _file_signature(path: str, now_ns: int) -> object:
    try:
        st = os.stat(path)
    except OSError:
        return None
    signature = trusted_signature(st, now_ns)
    if signature is None:
        raise _TooFresh
    return signature


class Registry:
    """Holds the catalog snapshots and rebuilds them.

    Args:
        home: The Crystal home.
        reserved: Tool names no external tool may take.
        cache: The manifest cache shared by every snapshot.
        idle_seconds: How long an unused workspace is kept.
        clock: A monotonic clock (injectable for tests).
        clock_ns: Wall-clock nanoseconds, to tell files too fresh to judge by their stat.
    """

    def __init__(
        self,
        home: Path,
        reserved: frozenset[str],
        cache: ManifestCache | None = None,
        *,
        idle_seconds: float = 3600.0,
        clock: Callable[[], float] = time.monotonic,
        clock_ns: Callable[[], int] = time.time_ns,
    ) -> None:
        self.home = home
        self.reserved = reserved
        self.cache = cache if cache is not None else ManifestCache()
        self.idle_seconds = idle_seconds
        self._clock = clock
        self._clock_ns = clock_ns
        self._snapshots: dict[Key, Catalog] = {}
        self._last_used: dict[Key, float] = {}
        self._building: dict[Key, anyio.Event] = {}
        #: What the files looked like when each snapshot was built (None: not trusted).
        self._scans: dict[Key, tuple[object, ...] | None] = {}
        self._reload_lock = anyio.Lock()
        self.generation = 1

    @property
    def workspaces(self) -> list[Path]:
        """The workspaces with a snapshot, sorted."""
        return sorted(k for k in self._snapshots if k is not None)

    def cached(self, workspace: Key) -> Catalog | None:
        """The snapshot for a key if it was built, without building it."""
        return self._snapshots.get(workspace)

    async def catalog(self, workspace: Key) -> Catalog:
        """The snapshot for a workspace (or home alone), built on first use.

        Concurrent first uses of one workspace build it once.
        """
        self._last_used[workspace] = self._clock()
        while True:
            snapshot = self._snapshots.get(workspace)
            if snapshot is not None:
                return snapshot
            pending = self._building.get(workspace)
            if pending is None:
                break
            await pending.wait()
        event = self._building[workspace] = anyio.Event()
        try:
            snapshot = await self._build(workspace)
            self._snapshots[workspace] = snapshot
            log.info(
                "catalog_built",
                workspace=str(workspace) if workspace else None,
                tools=len(snapshot.tools),
                sets=len(snapshot.sets),
                notes=len(snapshot.notes),
            )
            return snapshot
        finally:
            del self._building[workspace]
            event.set()

    async def _build(self, workspace: Key) -> Catalog:
        catalog = await anyio.to_thread.run_sync(self._refresh_sync, workspace, True)
        assert catalog is not None
        return catalog

    def _refresh_sync(self, workspace: Key, force: bool) -> Catalog | None:
        """Rebuild a snapshot, or return None when its files provably did not change.

        The scan (the roots' listings and a stat of every manifest and of config.json) is
        taken before the build, so a change made during the build shows in the next one.
        """
        scan = self._scan(workspace)
        if not force and scan is not None and scan == self._scans.get(workspace):
            return None
        catalog = self._build_sync(workspace)
        self._scans[workspace] = scan
        return catalog

    def _scan(self, workspace: Key) -> tuple[object, ...] | None:
        """A cheap fingerprint of everything a snapshot is built from; None if too fresh."""
        now = self._clock_ns()
        roots = [os.path.join(self.home, "tools")]
        if workspace is not None:
            roots.append(os.path.join(workspace, ".crystal", "tools"))
        try:
            parts: list[object] = [_file_signature(os.path.join(self.home, "config.json"), now)]
            for root in roots:
                try:
                    names = sorted(os.listdir(root))
                except OSError:
                    parts.append(None)
                    continue
                parts.append(
                    tuple((n, _file_signature(os.path.join(root, n, "tools.json"), now)) for n in names)
                )
        except _TooFresh:
            return None
        return tuple(parts)

    def _build_sync(self, workspace: Key) -> Catalog:
        config, config_notes = load_config(self.home)
        catalog = build_catalog(
            self.home, workspace, reserved=self.reserved, cache=self.cache, config=config
        )
        if config_notes:
            catalog = replace(catalog, notes=(*config_notes, *catalog.notes))
        return catalog

    async def reload(self, workspaces: Iterable[Key] | None = None) -> ReloadOutcome:
        """Rebuild snapshots and swap each one whole.

        Args:
            workspaces: The keys to rebuild; None rebuilds every snapshot held (the home
                snapshot always included).

        Returns:
            The changes per key, the new snapshots, and the generation after the reload.
        """
        async with self._reload_lock:
            keys = list(self._snapshots) if workspaces is None else list(workspaces)
            if None not in keys and workspaces is None:
                keys.insert(0, None)
            changes: dict[Key, tuple[SetChange, ...]] = {}
            catalogs: dict[Key, Catalog] = {}
            for key in keys:
                old = self._snapshots.get(key)
                refreshed = await anyio.to_thread.run_sync(
                    self._refresh_sync, key, old is None
                )
                if refreshed is None:  # nothing on disk changed: keep the snapshot
                    assert old is not None
                    catalogs[key] = old
                    continue
                new = refreshed
                diff = diff_catalogs(old, new)
                notes_changed = old is None or old.notes != new.notes
                self._snapshots[key] = new
                self._last_used.setdefault(key, self._clock())
                catalogs[key] = new
                if diff or notes_changed:
                    changes[key] = diff
            if changes:
                self.generation += 1
            self._prune_cache()
            outcome = ReloadOutcome(self.generation, changes, catalogs)
            log.info(
                "catalog_reloaded",
                generation=self.generation,
                workspaces=len(keys),
                changed=len(outcome.all_changes()),
                parses=self.cache.parses,
            )
            return outcome

    def _prune_cache(self) -> None:
        """Forget cached manifests no snapshot refers to (deleted sets, released workspaces)."""
        keep = {
            os.path.join(entry.path, "tools.json")
            for snapshot in self._snapshots.values()
            for entry in snapshot.sets
        }
        self.cache.forget(keep)

    def evict_idle(self, in_use: Collection[Path] = ()) -> list[Path]:
        """Drop the workspaces unused for longer than ``idle_seconds``.

        Args:
            in_use: Workspaces to count as used now (for example, subscribed to).

        Returns:
            The workspaces dropped.
        """
        now = self._clock()
        for key in in_use:
            if key in self._last_used:
                self._last_used[key] = now
        dropped = [
            key
            for key, used in self._last_used.items()
            if key is not None and now - used > self.idle_seconds
        ]
        for key in dropped:
            self._snapshots.pop(key, None)
            self._last_used.pop(key, None)
            self._scans.pop(key, None)
        if dropped:
            self._prune_cache()
            log.info("workspaces_released", count=len(dropped))
        return [k for k in dropped if k is not None]
