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

A reload first takes a *scan* of a snapshot's inputs: the roots' listings and the stat
signature of every manifest and of ``config.json`` (a file too fresh to be judged by its
stat counts as suspect). Equal to the last scan: the snapshot is kept whole. When only a
few manifests are suspect, the same names are present and the config is unchanged, each
suspect is re-read through the cache and, if its set still loads every tool it loaded,
under the same names, the old snapshot is *patched*: that set's entry and its tools are
replaced, everything else is shared, and the change list is known without a diff. That
is exactly what a rebuild would produce, because a set's tool names are all that its
neighbours see of it (collisions, overlay and notes depend on names only). Anything else
(a set added, removed, renamed, broken, disabled, hidden or colliding) rebuilds the
snapshot from the cache. So a reload costs a ``stat`` per set plus work in proportion to
what changed.

The generation is one counter for the daemon. It moves when a reload changes any
snapshot, and when idle workspaces are released (their next use builds them afresh), so a
front end that saw generation N and sees N again has the same catalog.

Workspaces not used for ``idle_seconds`` are dropped by ``evict_idle`` (and with them
their watches), so a daemon that served many projects does not keep them all.
"""

from __future__ import annotations

import errno
import os
import time
from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import MappingProxyType

import anyio
import structlog

from . import threads
from .catalog import (
    MANIFEST_NAME,
    RACY_NS,
    ManifestCache,
    build_catalog,
    load_config,
    trusted_signature,
)
from .logs import Throttle
from .manifest import ManifestError
from .model import (
    Approval,
    ApprovalSource,
    Catalog,
    LoadedTool,
    RunnerKind,
    SetEntry,
    SetState,
    Source,
    ToolSet,
)
from .paths import unreachable_link

__all__ = ["Registry", "ReloadOutcome", "Reported", "SetChange", "diff_catalogs"]

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
    return (
        entry.state,
        entry.enabled,
        entry.tools,
        entry.notes,
        entry.error,
        digest,
        str(entry.path),
    )


def _policy(catalog: Catalog, entry: SetEntry) -> ApprovalSource:
    """The ``config.json`` source policy that applies to ``entry``'s tools in ``catalog``.

    A tool's hash and effective approval cover it, and a set's fingerprint does not: a
    policy change left every fingerprint alike, so it moved no generation and told no
    subscriber while every tool of that source changed.
    """
    config = catalog.config
    return config.home_policy if entry.source is Source.HOME else config.project_policy


def diff_catalogs(old: Catalog | None, new: Catalog) -> tuple[SetChange, ...]:
    """Compare two snapshots set by set: a set's fingerprint, and the policy on its tools.

    Args:
        old: The snapshot before, or None when there was none.
        new: The snapshot after.

    Returns:
        The added, removed and updated sets, sorted by directory then source.
    """
    before = {(e.directory, e.source): e for e in (old.sets if old else ())}
    policies = old is not None and (old.config.home_policy, old.config.project_policy) != (
        new.config.home_policy,
        new.config.project_policy,
    )
    after = {(e.directory, e.source): e for e in new.sets}
    changes: list[SetChange] = []
    for key in sorted(before.keys() | after.keys(), key=lambda k: (k[0], k[1].value)):
        was, now = before.get(key), after.get(key)
        if was is None:
            changes.append(SetChange(key[0], key[1], "added"))
        elif now is None:
            changes.append(SetChange(key[0], key[1], "removed"))
        elif _fingerprint(was) != _fingerprint(now) or (
            policies and old is not None and now.tools and _policy(old, was) != _policy(new, now)
        ):
            changes.append(SetChange(key[0], key[1], "updated"))
    return tuple(changes)


#: A scan value for a file too fresh to be judged by its stat signature.
_FRESH = "fresh"
#: The errors of a path that names nothing (``_signature_or_fresh``).
_MISSING = frozenset({errno.ENOENT, errno.ENOTDIR})
#: What the last scan holds for a name it did not see.
_GONE = "gone"
#: A scan value for a manifest that is a symlink leading nowhere (a candidate, unreadable).
_LINK = "link"
#: Up to this many manifests in all, a reload stats them on the event loop (``_refresh``).
INLINE_SCAN_MAX = 2_000
#: A scan on the loop whose suspects are manifests too fresh to judge at the last scan,
#: each of at most ``RECHECK_INLINE_BYTES``, reads them again there (``_racy_unchanged``):
#: bytes unchanged, no worker thread is needed. At most this many per reload, over every
#: snapshot it refreshes (a fresh home manifest is a suspect in every one).
RECHECK_INLINE_MAX = 8
RECHECK_INLINE_BYTES = 64 * 1024

_Changes = tuple[SetChange, ...]
#: The last scan's names under a root it did not list.
_NO_NAMES: Mapping[str, object] = MappingProxyType({})


#: Per reload key, the (tools root, set folder) pairs the watcher saw change under it;
#: None: something else changed there (a root, ``.crystal``, ``config.json``), scan it all.
#: The home sets' pairs are under the key None and hold for every snapshot.
Reported = Mapping[Path | None, Collection[tuple[str, str]] | None]


@dataclass(frozen=True, slots=True)
class _Scan:
    """What a snapshot was built from: config.json and, per root, each name's manifest.

    ``fresh`` holds, per root, the names whose manifest was too fresh to be judged by its
    stat: a scan told what changed (``_reported_scan``) looks at them again.
    """

    config: object
    roots: tuple[dict[str, object] | None, ...]
    fresh: tuple[frozenset[str], ...]

    @property
    def size(self) -> int:
        """How many manifests the scan looked at."""
        return sum(len(found) for found in self.roots if found is not None)


def _patchable(entry: SetEntry) -> bool:
    """Whether ``_patch`` may replace this set's entry in place (else: a rebuild)."""
    before = entry.toolset
    return not (
        before is None
        or entry.state is not SetState.LOADED
        or entry.notes
        or before.runner is not RunnerKind.EXEC
        or entry.tools != tuple(t.name for t in before.tools)
    )


def _signature_or_fresh(path: str, now_ns: int) -> object:
    """A file's stat signature (``config.json``'s); None when there is none, ``_FRESH``
    while too fresh to judge by it.

    A file that is there but cannot be read (a link whose target is gone, a link loop, a
    folder that may not be searched) is no missing one: ``config.json`` then turns
    discovery off. Its stat failed as a missing file's does, so it read as None, no
    change, and the catalogs already loaded kept discovery on; it is the link's own
    signature (and why) now.
    """
    try:
        st = os.stat(path)
    except OSError as exc:
        try:
            st = os.lstat(path)
        except OSError:
            return None if exc.errno in _MISSING else ("unreadable", exc.errno)
        link = trusted_signature(st, now_ns)
        return _FRESH if link is None else ("unreadable", exc.errno, link)
    signature = trusted_signature(st, now_ns)
    return _FRESH if signature is None else signature


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
        #: ``workspace_names``, until a key is added to or removed from ``_snapshots``.
        self._workspace_names: tuple[str, ...] | None = None
        self._last_used: dict[Key, float] = {}
        self._building: dict[Key, anyio.Event] = {}
        #: What the files looked like when each snapshot was built.
        self._scans: dict[Key, _Scan] = {}
        #: Each snapshot's set positions by (directory, source), built on first patch.
        self._positions: dict[Key, tuple[Catalog, dict[tuple[str, Source], int]]] = {}
        self._reload_lock = anyio.Lock()
        #: A reload failing again and again (the watcher's retries: every poll, or every
        #: second while short of descriptors) logs once a minute per error, with a count.
        #: A reload that works starts it afresh.
        self._reload_failures = Throttle()
        #: How many manifests the reload under way may still read on the loop.
        self._rechecks_left = 0
        #: Per snapshot held, its notes per set folder (``""``: config.json's), and per
        #: (folder, note) how many snapshots hold it: a note is logged when a first snapshot
        #: comes to hold it, not again with every other that has it (``_say_notes``).
        self._noted: dict[Key, dict[str, tuple[str, ...]]] = {}
        self._holders: dict[tuple[str, str], int] = {}
        self.generation = 1

    @property
    def workspaces(self) -> list[Path]:
        """The workspaces with a snapshot, sorted."""
        return sorted(k for k in self._snapshots if k is not None)

    @property
    def workspace_names(self) -> tuple[str, ...]:
        """``workspaces`` as strings, worked out again only when a snapshot comes or goes.

        ``status`` reports it on every call.
        """
        names = self._workspace_names
        if names is None:
            names = self._workspace_names = tuple(str(w) for w in self.workspaces)
        return names

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
            # Used now, by the caller. Also: a release while the build ran (one that took
            # longer than the idle time) dropped the use set above, and ``evict_idle``
            # sees only workspaces with one: without it this snapshot was never released.
            self._last_used[workspace] = self._clock()
            self._workspace_names = None
            log.info(
                "catalog_built",
                workspace=str(workspace) if workspace else None,
                tools=len(snapshot.tools),
                sets=len(snapshot.sets),
                notes=len(snapshot.notes),
            )
            self._say_notes(workspace, snapshot)
            return snapshot
        finally:
            del self._building[workspace]
            event.set()

    def _say_notes(self, workspace: Key, snapshot: Catalog) -> None:
        """Log each note of ``snapshot``, now held for ``workspace``, that no snapshot held
        for its folder until now.

        ``catalog_built`` counted the notes and named none: an operator reading a
        service's journal learnt that some set did not load, not which, why, or where its
        ``tools.json`` is. Each note is logged once when it appears (again once no snapshot
        holds it and it comes back: its set was fixed, or removed, and broke anew); another
        snapshot that has it too says nothing more. Counted per snapshot: kept per folder
        alone, a note one catalog has and another lacks (a home tool's name taken by a
        project set, in that workspace's catalog only) was forgotten by the one and logged
        anew by the other at every reload; and a set removed kept its note as said, so its
        return, as broken as before, went unlogged.
        """
        noted: dict[str, tuple[str, ...]] = {}
        config = tuple(sorted({n.message for n in snapshot.notes if n.source is None}))
        if config:
            noted[""] = config
        holding: list[SetEntry] = []
        for entry in snapshot.sets:
            if entry.notes:  # the usual set has none: nothing to say or to count
                holding.append(entry)
                folder = str(entry.path)
                held = noted.get(folder)
                # Two entries of one folder: where ``<workspace>/.crystal`` is the home.
                noted[folder] = entry.notes if held is None else (*held, *entry.notes)
        before = self._noted.get(workspace, {})
        if noted == before:
            return
        counted: set[tuple[str, str]] = set()  # a folder's note counts once a snapshot
        for message in config:
            if self._held(before, "", message, counted):
                path = os.path.join(self.home, "config.json")
                log.warning("catalog_note", set=None, source=None, path=path, message=message)
        for entry in holding:
            folder = str(entry.path)
            if noted[folder] == before.get(folder):
                continue  # as its predecessor had them: nothing new (nor to count again)
            for message in entry.notes:
                if self._held(before, folder, message, counted):
                    log.warning(
                        "catalog_note",
                        set=entry.directory,
                        source=entry.source.value,
                        path=os.path.join(folder, MANIFEST_NAME),
                        message=message,
                    )
        self._release_notes(before, noted)
        if noted:
            self._noted[workspace] = noted
        else:
            self._noted.pop(workspace, None)

    def _held(
        self,
        before: Mapping[str, tuple[str, ...]],
        folder: str,
        message: str,
        counted: set[tuple[str, str]],
    ) -> bool:
        """Count a snapshot's note; True when it is news (no snapshot held it until now).

        ``before`` is what that snapshot's predecessor held: a note it held already counts.
        ``counted`` holds the notes of this snapshot counted so far (two entries of one
        folder, as when ``<workspace>/.crystal`` is the home: one count for both).
        """
        key = (folder, message)
        if message in before.get(folder, ()) or key in counted:
            return False
        counted.add(key)
        count = self._holders.get(key, 0)
        self._holders[key] = count + 1
        return count == 0

    def _release_notes(
        self, before: Mapping[str, tuple[str, ...]], after: Mapping[str, tuple[str, ...]]
    ) -> None:
        """Uncount the notes a snapshot held (``before``) and its successor does not."""
        for folder, messages in before.items():
            kept = after.get(folder, ())
            if messages == kept:
                continue
            for message in dict.fromkeys(messages):  # counted once a snapshot (``_held``)
                if message in kept:
                    continue
                key = (folder, message)
                count = self._holders.get(key, 0) - 1
                if count > 0:
                    self._holders[key] = count
                else:
                    self._holders.pop(key, None)

    async def manifest_problem(self, toolset: ToolSet) -> str | None:
        """Why a call of ``toolset`` must not start now, as its result text: the manifest
        in its folder no longer loads (broken, gone, or another folder put at its path
        whose ``tools.json`` is refused); None while it still loads.

        A call is judged against its catalog, and its process started later (after a
        wait for a runner slot, or before a reload caught up with an edit); the files it
        runs are the ones in the set's folder at that moment. The common case costs a
        ``stat`` on the loop (the manifest still holds the bytes the call's set came from);
        any other is loaded in a worker thread, as a reload would load it.
        """
        manifest = os.path.join(toolset.path, MANIFEST_NAME)
        if self.cache.unchanged(
            manifest, toolset.source, self.reserved, toolset, RECHECK_INLINE_BYTES
        ):
            return None
        return await threads.run_sync(self._manifest_problem_sync, toolset)

    def _manifest_problem_sync(self, toolset: ToolSet) -> str | None:
        try:
            self.cache.get(toolset.path, toolset.source, self.reserved)
        except ManifestError as exc:
            manifest = os.path.join(toolset.path, MANIFEST_NAME)
            return (
                f"The call did not run: the manifest of tool set '{toolset.directory}' "
                f"({manifest}) no longer loads: {exc.message} A call starts only while its "
                "set's manifest loads: fix the set, then call again."
            )
        except OSError:
            return None  # the set cache's own files failed: the spawn tells what it finds
        return None

    async def _build(self, workspace: Key) -> Catalog:
        refreshed = await threads.run_sync(self._refresh_sync, workspace, True)
        assert refreshed is not None
        catalog, _, scan = refreshed
        self._scans[workspace] = scan
        return catalog

    async def _refresh(
        self, workspace: Key, force: bool, inline: bool, told: list[set[str]] | None = None
    ) -> tuple[Catalog, _Changes | None, _Scan] | None:
        """``_refresh_sync`` in a worker thread, or its scan on the loop (``inline``).

        A reload that finds nothing changed is one ``stat`` per set (~2 ms for 1,000): for
        a small catalog the hand-off to a worker thread and back would add a fifth to
        that. ``reload`` allows at most ``INLINE_SCAN_MAX`` manifests on the loop in all,
        over every snapshot it refreshes. A scan told what changed (``told``, from
        ``_told``) stats only the names told, and counts only those against that budget:
        one edit among 10,000 sets is one ``stat`` on the loop; a batch that names every
        set is stat'ed in the thread, as a scan told nothing. A told scan that cannot
        settle the snapshot (a name came or went, the config changed) leaves it to a full
        scan in the thread, which rebuilds it there anyway. A scan that finds a change
        hands it on to the thread, with its suspects.
        """
        previous = self._scans.get(workspace)
        scanned: tuple[_Scan, list[tuple[int, str]] | None] | None = None
        if not force and previous is not None:
            if told is None:
                scanned = self._scan(workspace, previous) if inline else None
            elif inline:
                scanned = self._reported_scan(workspace, previous, told)
            else:
                scanned = await threads.run_sync(self._reported_scan, workspace, previous, told)
        if scanned is None:  # a build, a scan of everything off the loop, or a told scan
            # that cannot settle the snapshot: all of it in the thread
            return await threads.run_sync(self._refresh_sync, workspace, force)
        if scanned[1] == []:
            return None
        suspects = scanned[1]
        if inline and previous is not None and suspects is not None:
            old = self._snapshots.get(workspace)
            if old is not None and self._racy_unchanged(workspace, old, previous, suspects):
                return old, (), scanned[0]
        return await threads.run_sync(self._refresh_sync, workspace, force, scanned)

    def _racy_unchanged(
        self, workspace: Key, old: Catalog, previous: _Scan, suspects: list[tuple[int, str]]
    ) -> bool:
        """Whether the suspects of a scan on the loop are manifests re-read to the same bytes.

        A manifest written less than ``RACY_NS`` ago is a suspect at every scan, its bytes
        unchanged or not: a reload within seconds of an edit read it again in a worker
        thread, whose hand-off cost more than the read (and, on a busy machine, a wait for
        a CPU). Only suspects the last scan found too fresh as well are read here, at most
        ``RECHECK_INLINE_MAX`` in a reload over every snapshot and ``RECHECK_INLINE_BYTES``
        each (by its stat and by the read, which stops one byte past it: a file that grew
        since the stat, or another renamed over it, goes to the thread), and only where
        ``_patch`` would take them (a set it would rebuild goes to the thread as before):
        their bytes unchanged, ``_patch`` would return ``old`` itself. A manifest that
        changed (a newer signature) goes to the thread unread, where it is parsed.
        """
        if len(suspects) > self._rechecks_left:
            return False
        roots = self._roots(workspace)
        index = self._index(workspace, old)
        for root_index, name in suspects:
            before = previous.roots[root_index]
            if before is None or before.get(name) is not _FRESH:
                return False
            root, source = roots[root_index]
            position = index.get((name, source))
            if position is None:
                return False
            entry = old.sets[position]
            if not _patchable(entry):
                return False
            assert entry.toolset is not None
            manifest = root + os.sep + name + os.sep + MANIFEST_NAME
            self._rechecks_left -= 1
            if not self.cache.unchanged(
                manifest, source, self.reserved, entry.toolset, RECHECK_INLINE_BYTES
            ):
                return False
        return True

    def _refresh_sync(
        self,
        workspace: Key,
        force: bool,
        scanned: tuple[_Scan, list[tuple[int, str]] | None] | None = None,
    ) -> tuple[Catalog, _Changes | None, _Scan] | None:
        """Rebuild or patch a snapshot; None when its files provably did not change.

        The scan is taken before the build, so a change made during the build shows in
        the next one. It is returned, not kept: it goes with the snapshot, which the
        caller swaps in (or, when the reload fails, does not).

        Args:
            workspace: The snapshot's key.
            force: Rebuild even when the scan finds nothing changed.
            scanned: A scan already taken against the last one, and its suspects
                (``_refresh``); else one is taken here.

        Returns:
            The new snapshot, its changes (None: unknown, diff it) and the scan it was
            built from, or None.
        """
        if scanned is None:  # forced: nothing to compare with
            scanned = self._scan(workspace, None if force else self._scans.get(workspace))
        scan, suspects = scanned  # suspects: None without a last scan to compare with
        old = self._snapshots.get(workspace)
        result: tuple[Catalog, _Changes | None] | None = None
        if not force and old is not None and suspects is not None:
            if not suspects:
                return None
            result = self._patch(workspace, old, suspects)
        if result is None:
            result = (self._build_sync(workspace), None)
            self._positions.pop(workspace, None)  # for a snapshot no longer served
        self.cache.flush()
        return (*result, scan)

    def _roots(self, workspace: Key) -> list[tuple[str, Source]]:
        roots = [(os.path.join(self.home, "tools"), Source.HOME)]
        if workspace is not None:
            roots.append((os.path.join(workspace, ".crystal", "tools"), Source.PROJECT))
        return roots

    def _scan(
        self, workspace: Key, previous: _Scan | None, limit: int = 64
    ) -> tuple[_Scan, list[tuple[int, str]] | None]:
        """A cheap fingerprint of everything a snapshot is built from, compared as it is taken.

        Args:
            workspace: The snapshot's key.
            previous: The scan the snapshot was built from, if any.
            limit: More suspects than this and only a rebuild will do.

        Returns:
            The scan, and the (root, name) pairs that may have changed since ``previous``:
            None when only a rebuild will do (no previous scan, ``config.json`` changed or
            too fresh, a root or a name came or went, more than ``limit`` suspects).
        """
        now = self._clock_ns()
        config = _signature_or_fresh(os.path.join(self.home, "config.json"), now)
        suspects: list[tuple[int, str]] | None = None
        if previous is not None and config is not _FRESH and config == previous.config:
            suspects = []
        roots: list[dict[str, object] | None] = []
        fresh: list[frozenset[str]] = []
        stat_ = os.stat
        for i, (root, _) in enumerate(self._roots(workspace)):
            before = previous.roots[i] if previous is not None else None
            too_fresh: list[str] = []
            fresh.append(frozenset())
            # Each manifest is stat'ed relative to the open tools folder: the kernel then
            # walks two path components per set instead of the whole path.
            try:
                root_fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
            except OSError:
                roots.append(None)
                if before is not None:
                    suspects = None
                continue
            try:
                names = os.listdir(root_fd)
                if before is None:  # a root that came (or could not be listed before)
                    suspects = None
                suffix = os.sep + MANIFEST_NAME
                fresh_after = now - RACY_NS  # trusted_signature, inlined: this loop is the reload
                get = (before if before is not None else _NO_NAMES).get
                # Each signature is compared with the last scan's here, as it is taken: the
                # suspects come with the scan, and nothing walks the entries again (on the
                # loop or in the thread). Only the names whose signature is not the last
                # scan's trusted one go into ``changed``; the others keep ``before``'s.
                changed: dict[str, object] = {}
                came = 0  # names in changed and not in before
                for name in names:
                    try:
                        st = stat_(name + suffix, dir_fd=root_fd)
                    except OSError:
                        # A manifest link that leads nowhere is a candidate (it cannot be
                        # read): it must not look like no manifest, or its coming or going
                        # would not be noticed.
                        link = unreachable_link(name + suffix, root_fd)
                        signature: object = _LINK if link else None
                    else:
                        mtime, ctime = st.st_mtime_ns, st.st_ctime_ns
                        if mtime > fresh_after or ctime > fresh_after:
                            signature = _FRESH
                            too_fresh.append(name)
                        else:
                            signature = (mtime, st.st_size, st.st_ino, ctime)
                            if signature == get(name):
                                continue  # as the last scan found it: no suspect
                    changed[name] = signature
                    last = get(name, _GONE)
                    if last is _GONE:
                        came += 1
                    if suspects is None:
                        continue
                    if signature is _FRESH or signature != last:
                        if last is _GONE or len(suspects) == limit:
                            suspects = None  # a new name, or too many to patch
                        else:
                            suspects.append((i, name))
                found: dict[str, object]
                if before is None:
                    found = changed
                elif not changed and len(names) == len(before):
                    found = before  # scans are never changed in place (``_reported_scan``)
                elif len(names) == len(before) + came:  # no name of before went away
                    found = before | changed
                else:
                    found = {n: changed[n] if n in changed else before[n] for n in names}
            except OSError:
                roots.append(None)  # unlisted now: unchanged if it was unlisted before too
                if before is not None:
                    suspects = None
                continue
            finally:
                os.close(root_fd)
            if suspects is not None:
                assert before is not None
                if len(found) != len(before):  # every name was in before: one went away
                    suspects = None
            roots.append(found)
            fresh[i] = frozenset(too_fresh)
        return _Scan(config, tuple(roots), tuple(fresh)), suspects

    def _told(self, workspace: Key, previous: _Scan, reported: Reported) -> list[set[str]] | None:
        """Per root of a snapshot, the names a report tells ``_reported_scan`` to look at.

        Those are the names reported under the root's key and the names ``previous`` found
        too fresh to judge. None when the report cannot be trusted for this snapshot: a
        root reported whole, or a pair under a root it does not have (another spelling).
        """
        told: list[set[str]] = []
        for i, (root, source) in enumerate(self._roots(workspace)):
            owner = None if source is Source.HOME else workspace
            pairs = reported.get(owner, ())
            if pairs is None:
                return None
            names = set(previous.fresh[i])
            for pair_root, name in pairs:
                if pair_root != root:
                    return None  # reported under another spelling of the root: scan it all
                names.add(name)
            told.append(names)
        return told

    def _reported_scan(
        self,
        workspace: Key,
        previous: _Scan,
        told: list[set[str]],
        limit: int = 64,
    ) -> tuple[_Scan, list[tuple[int, str]]] | None:
        """``_scan`` told by the watcher what changed: a ``stat`` per reported set, not per set.

        The watcher watches each set folder, so a write to a manifest is reported as its
        set's (root, name) pair. Only those manifests, ``config.json`` and the manifests
        the last scan found too fresh are looked at; every other name keeps its signature
        from ``previous``. A change the watcher did not see (a notification lost, a
        symlinked manifest edited elsewhere) is not missed: the watcher's stat poll, whose
        baseline took in only what was reported, finds it and sends its key with no pairs,
        which scans everything.

        Args:
            workspace: The snapshot's key.
            previous: The scan the snapshot was built from.
            told: Per root, the names to look at (``_told``, from what the watcher saw
                change: ``Reported``).
            limit: More suspects than this and only a rebuild will do.

        Returns:
            The scan and its suspects, as ``_scan`` returns them; None when a rebuild is
            due (a name came or went, the config changed): the caller takes a full scan
            then.
        """
        roots = self._roots(workspace)
        now = self._clock_ns()
        config = _signature_or_fresh(os.path.join(self.home, "config.json"), now)
        if config is _FRESH or config != previous.config:
            return None
        found_roots = list(previous.roots)
        fresh = list(previous.fresh)
        suspects: list[tuple[int, str]] = []
        for i, names in enumerate(told):
            before = previous.roots[i]
            if not names:
                continue
            if before is None:
                return None
            found: dict[str, object] | None = None  # copied once a signature differs
            now_fresh: set[str] = set()  # every name fresh before is in names
            for name in names:
                last = before.get(name, _GONE)
                if last is _GONE:
                    return None  # a new name: a rebuild, from a full scan
                try:
                    st = os.stat(roots[i][0] + os.sep + name + os.sep + MANIFEST_NAME)
                except OSError:
                    return None  # a set or its manifest went: the full scan tells which
                trusted = trusted_signature(st, now)
                signature: object = _FRESH if trusted is None else trusted
                if trusted is None:
                    now_fresh.add(name)
                if signature is _FRESH or signature != last:
                    if len(suspects) == limit:
                        return None
                    suspects.append((i, name))
                    if found is None:
                        found = dict(before)
                    found[name] = signature
            if found is not None:
                found_roots[i] = found
            fresh[i] = frozenset(now_fresh)
        return _Scan(config, tuple(found_roots), tuple(fresh)), suspects

    def _patch(
        self, workspace: Key, old: Catalog, suspects: list[tuple[int, str]]
    ) -> tuple[Catalog, _Changes] | None:
        """Replace the suspect sets' entries and tools in ``old``; None if unsafe (rebuild)."""
        roots = self._roots(workspace)
        index = self._index(workspace, old)
        tools: dict[str, LoadedTool] | None = None
        sets: list[SetEntry] | None = None
        changes: list[SetChange] = []
        config = old.config
        for root_index, name in suspects:
            root, source = roots[root_index]
            position = index.get((name, source))
            if position is None:
                return None
            entry = old.sets[position]
            before = entry.toolset
            if before is None or not _patchable(entry):
                return None
            set_dir = root + os.sep + name
            manifest = set_dir + os.sep + MANIFEST_NAME
            try:
                cached = self.cache.entry(
                    set_dir, manifest, source, self.reserved, os.stat(manifest), None
                )
            except (OSError, ManifestError):
                return None
            after = cached.result
            if after is before:
                continue
            if (
                not isinstance(after, type(before))
                or after.runner is not RunnerKind.EXEC
                or not after.enabled
                or tuple(t.name for t in after.tools) != entry.tools
            ):
                return None
            if tools is None or sets is None:
                # A snapshot's tools are a MappingProxyType, which dict() copies item by
                # item (4 ms for 10,000); its copy() copies the dict underneath at once.
                tools = (
                    old.tools.copy() if isinstance(old.tools, MappingProxyType) else dict(old.tools)
                )
                sets = list(old.sets)
            policy = config.home_policy if source is Source.HOME else config.project_policy
            for tool in after.tools:
                tools[tool.name] = LoadedTool(
                    tool,
                    after,
                    tool.approval if policy is ApprovalSource.AUTHOR else Approval.INHERIT,
                    policy,
                    self.cache.tool_hash(tool, after, policy),
                )
            sets[position] = replace(entry, path=after.path, toolset=after)
            if before.digest != after.digest or entry.path != after.path:
                changes.append(SetChange(name, source, "updated"))
        if tools is None or sets is None:
            return old, ()
        new = replace(old, tools=MappingProxyType(tools), sets=tuple(sets))
        self._positions[workspace] = (new, index)
        return new, tuple(sorted(changes, key=lambda c: (c.set, c.source.value)))

    def _index(self, workspace: Key, old: Catalog) -> dict[tuple[str, Source], int]:
        """``old``'s set positions by (directory, source), worked out once per snapshot."""
        positions = self._positions.get(workspace)
        if positions is not None and positions[0] is old:
            return positions[1]
        index = {(e.directory, e.source): i for i, e in enumerate(old.sets)}
        self._positions[workspace] = (old, index)
        return index

    def _build_sync(self, workspace: Key) -> Catalog:
        config, config_notes = load_config(self.home)
        catalog = build_catalog(
            self.home, workspace, reserved=self.reserved, cache=self.cache, config=config
        )
        if config_notes:
            catalog = replace(catalog, notes=(*config_notes, *catalog.notes))
        return catalog

    async def reload(
        self, workspaces: Iterable[Key] | None = None, reported: Reported | None = None
    ) -> ReloadOutcome:
        """Rebuild snapshots and swap each one whole.

        Args:
            workspaces: The keys to rebuild; None rebuilds every snapshot held (the home
                snapshot always included). When the keys name the home snapshot and it
                changed, every other snapshot held is refreshed too. A workspace with no
                snapshot (never built, or released as idle meanwhile) is left out: only
                ``catalog`` builds one.
            reported: What the watcher saw change (``Reported``): a snapshot it covers
                stats only the reported sets. None: nothing was said, every manifest of
                every snapshot refreshed is stat'ed (the ``reload`` RPC, ``SIGHUP``).

        Returns:
            The changes per key, the new snapshots, and the generation after the reload.

        Raises:
            OSError, MemoryError: A snapshot could not be refreshed (the daemon is short
                of descriptors or memory): none is swapped, so every one stays on the
                files it was built from, under the generation that goes with it, and the
                next reload sees every change again.
        """
        async with self._reload_lock:
            keys = list(self._snapshots) if workspaces is None else list(workspaces)
            if None not in keys and workspaces is None:
                keys.insert(0, None)
            changes: dict[Key, tuple[SetChange, ...]] = {}
            catalogs: dict[Key, Catalog] = {}
            rebuilt = False
            inline_budget = INLINE_SCAN_MAX  # manifests this reload may stat on the loop
            self._rechecks_left = RECHECK_INLINE_MAX  # and read again there (_racy_unchanged)
            #: Refreshed, swapped in only once every key is: key -> (old, new, its scan).
            staged: dict[Key, tuple[Catalog | None, Catalog, _Scan]] = {}
            for key in keys:
                old = self._snapshots.get(key)
                if old is None and key is not None:
                    # Released as idle (and its watch with it) since the reload was asked
                    # for, or before its turn: not brought back. Built here, it was held
                    # again with no watch on its files (the service has a workspace
                    # followed only when its ``catalog`` call builds it), and no reload
                    # told what changed looked at its project sets again.
                    continue
                previous = self._scans.get(key)
                told: list[set[str]] | None = None
                if reported is not None and previous is not None and old is not None:
                    told = self._told(key, previous, reported)
                # What this snapshot's scan stats: the names told, or every manifest.
                cost = sum(map(len, told)) if told is not None else None
                if cost is None and previous is not None:
                    cost = previous.size
                inline = cost is not None and cost <= inline_budget
                if inline:
                    assert cost is not None
                    inline_budget -= cost
                try:
                    refreshed = await self._refresh(key, old is None, inline, told)
                except Exception as exc:  # short of descriptors or memory, above all
                    # Swapping what was refreshed so far would serve some snapshots on the
                    # new files and others on the old under one generation, announced to
                    # no one, and the next reload would find the swapped ones unchanged.
                    said = self._reload_failures.count(type(exc).__name__)
                    if said is not None:
                        log.error(
                            "catalog_reload_failed",
                            workspace=str(key) if key else None,
                            error=getattr(exc, "strerror", None) or repr(exc),
                            workspaces=len(keys),
                            swapped=0,
                            failures=said,
                        )
                    raise
                if refreshed is None or refreshed[0] is old:  # nothing changed: keep it
                    assert old is not None
                    catalogs[key] = old
                    if refreshed is not None:
                        # Patched to itself (a manifest touched, its bytes the same): its
                        # scan is still swapped in. Dropped, every later reload found the
                        # same suspects and patched them again in a worker thread.
                        staged[key] = (old, old, refreshed[2])
                    continue
                new, known, scan = refreshed
                if known is None:
                    rebuilt = True
                    diff = diff_catalogs(old, new)
                    notes_changed = old is None or old.notes != new.notes
                else:  # patched: same sets and notes, these entries replaced
                    diff, notes_changed = known, False
                staged[key] = (old, new, scan)
                catalogs[key] = new
                if diff or notes_changed:
                    changes[key] = diff
                if key is None and workspaces is not None:
                    # The home sets and config.json are part of every catalog: a reload
                    # that names some workspaces and finds the home changed refreshes the
                    # other loaded ones too (a scan each when nothing else changed).
                    # Otherwise they kept the old home sets, under the new generation,
                    # with no catalogChanged, until a full reload.
                    keys += [k for k in self._snapshots if k not in keys]
            for key, (old, new, scan) in staged.items():
                if old is not None and self._snapshots.get(key) is not old:
                    continue  # released as idle meanwhile: not brought back
                if new is not old:
                    self._say_notes(key, new)
                self._snapshots[key] = new
                self._scans[key] = scan
                self._workspace_names = None
                self._last_used.setdefault(key, self._clock())
            if changes:
                self.generation += 1
            if rebuilt:  # a patch removes no set, so only a rebuild can leave manifests unused
                self._prune_cache()
            outcome = ReloadOutcome(self.generation, changes, catalogs)
            # The failures' run is over: kept, the throttle hid a new failure within a
            # minute of its last line (in the count of a line a minute later, if any).
            self._reload_failures.reset()
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
            The workspaces dropped. Dropping any moves the generation: a workspace's next
            use builds its catalog afresh, and what it holds then may differ.
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
            self._workspace_names = None
            self._last_used.pop(key, None)
            self._scans.pop(key, None)
            self._positions.pop(key, None)
            self._release_notes(self._noted.pop(key, {}), {})
        if dropped:
            # Their next use builds them afresh, from files no watch followed meanwhile:
            # under the same generation, a front end that kept a released workspace's tools
            # was told nothing had changed when they had.
            self.generation += 1
            self._prune_cache()
            log.info("workspaces_released", count=len(dropped))
        return [k for k in dropped if k is not None]
