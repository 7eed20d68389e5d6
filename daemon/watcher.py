"""Watch the tool-set folders and tell the reload path which snapshots to rebuild.

Theory of operation
-------------------
A tool set is exactly ``<root>/<dir>/tools.json`` with ``<root>`` one of ``<home>/tools``
or ``<workspace>/.crystal/tools``, and operator settings are ``<home>/config.json``.
So the directories whose *direct* entries matter are few and known:

* ``<home>`` (``config.json``, the ``tools`` root appearing or vanishing),
* each tools root and each immediate set directory inside it,
* per workspace, ``<ws>/.crystal`` when it exists (the ``tools`` root appearing or
  vanishing), otherwise ``<ws>`` itself (``.crystal`` appearing).

Each only if this process may read it and its path is UTF-8 (``_watch_id``): one awatch
covers them all, and one directory it cannot watch fails the whole of it. At most
``max_watches`` of them (``_watched``): each is an inotify watch out of the user's
``fs.inotify.max_user_watches``, which the user's other programs share (one per directory,
however many paths reach it: they are counted so); the set folders
past the bound (the largest workspace's first) are followed by the poll alone, and
``status()`` says so (``watch_capped`` in the log).

The watcher runs **one** ``watchfiles.awatch(..., recursive=False)`` over exactly that
set of directories. Nothing is ever watched recursively: not a workspace (``.git``,
``node_modules``), not ``<home>/data`` or ``.crystal/data`` (tools write runtime data
there), not a set's own ``venv``. The cost is that the set of directories moves when a
root or a set directory appears or vanishes, or a watched directory is reported removed or
made (a folder made again under its name, a swap: a watch follows the directory, not the
path, and the next probe lists the same paths); each such move **restarts** the awatch
through its ``stop_event`` (the Rust thread sees it within one ``step``; cancelling
the awatch instead waits out ``rust_timeout``).

Four sibling tasks in one task group:

* **supervisor**: one awatch *generation* at a time over the current directories.
  Each batch is mapped to reload keys (``None`` = home, which affects every snapshot;
  a workspace path = that workspace) by :meth:`Watcher._changes_for`, a whitelist (in a
  worker thread for a batch of more than ``_MAP_INLINE_MAX`` changes), so data
  directories and unrelated files map to nothing; a path in a folder that is one directory
  with others (links) is mapped under each of its names, as inotify reports it under one
  (``_aliases``). A path inside a set folder also names
  that set, as a (tools root, folder name) pair: the reload stats only the sets named
  (``Registry.reload``'s ``reported``), so one edit among 10,000 sets costs in proportion
  to the edit, not a ``stat`` of every set. Anything else (``config.json``, ``.crystal``,
  a root) names no set: that key's reload scans everything.
* **timer**: the *poller* and the *settler*. The poller ``stat``s every root, set
  directory and manifest (a *probe*, off the event loop) every ``recheck_seconds``,
  right after a batch that may have added or removed a folder to watch (see below), and
  a quarter second after each restart, but never sooner than ``_POLL_COST_FACTOR`` times
  the last poll's cost after it (a root of 100,000 subdirectories is polled every ~40 s,
  not every 2 s: a core's worth of stats). When the probed directories differ from the
  watched ones it restarts the watch; when a key's stat signature changed since the
  previous probe it reloads that key. A workspace added while a probe is in its thread
  keeps its mark (not probed yet) through that poll. The poller is what makes the
  design robust: events lost while a generation restarts, a set
  directory created between a probe and the watch starting, a symlinked
  ``config.json`` edited elsewhere, or a filesystem with no working notifications all
  end up as a changed signature within one recheck. A batch's keys are probed just
  before they are sent, so the poll does not report the same change twice; a key sent
  with its sets named has only those sets probed again, so a change no event reported
  stays out of the baseline and the poll still sends it (with no sets named: a full scan).
  A key's first delivery after the watcher started names no sets either: a workspace's
  catalog is built before the watcher first probes it, and a change made between the two
  is in neither's events (the home catalog is built after the baseline, in ``run``'s
  ``prepare``, and treated alike). The keys of a failed delivery are marked not probed,
  so the next poll sends them again, and they name no sets until a poll has probed them
  anew. The poll runs right after a batch only
  when something other than an entry of a set folder changed (a set folder, a root, the
  config), as a set folder may have come or gone. The settler
  re-sends the keys of recent batches once no batch arrived for ``settle_seconds``, so
  a manifest caught half-written is replaced by its final version even if no later
  event reports it.
* **deliverer**: calls ``on_change`` one call at a time. Keys that arrive while a call
  is in flight are merged into the next call; keys of workspaces removed meanwhile are
  dropped (reloading them would rebuild an evicted snapshot). A call that fails with
  ``ServerBusy`` (the daemon out of descriptors or memory) is made again a second later
  with the same keys: the poller's baselines already hold that change. A call that fails
  otherwise is made again, whole, by the next poll (see the poller).
* **host** (``run`` itself): waits for cancellation and then sets the current stop event.

The awatch runs in a process of its own (``watchproc``, the default ``watch_factory``):
watchfiles' watcher aborts the process it is made in when its thread cannot start (at the
limit of processes and threads), and a look beforehand could always lose the last place to
a tool's fork. The supervisor waits until that process watches (``established``), then
probes at once: what changed before it watched was reported by no event.

Failure: if awatch raises (``OSError`` "OS file watch limit reached", an unsupported
filesystem), or its process cannot start
or dies (``the watch process ended (killed by SIGABRT)``: its watcher's thread could not
start), the watcher logs
``watch_unavailable`` once, probes at once (what changed while the watch started was seen
by no event), keeps serving from the poller alone, and retries the watch
when the directories change or after ``retry_seconds`` (``watch_retry``, debug; a retried
watch says ``watch_started`` once its process watches, or, made by a factory that cannot
tell, at its first change). Two failures are not the watch's: an event naming a path that
is not UTF-8 (a name made in a watched folder), which watchfiles cannot decode, ends its
awatch; and a folder the probe listed can be gone before the awatch watches it
(``FileNotFoundError``: a deploy's ``rm -rf`` and ``mv`` during a restart). That watch is
started again within a second over a fresh probe (``watch_restarted``, logged once a
minute, and no ``watch_started`` for it), and the probe after its start takes in the lost
batch; a folder gone at ``_GONE_RESTARTS`` starts in a row while the folders stand still
is no race, and the watch is unavailable then. Nothing but cancellation leaves ``run``.
Reload through the RPC path is unaffected either way.

Duplicate calls are expected (an event, then the settle call, sometimes a poll) and
cheap: the registry re-stats manifests, re-parses only changed ones, and reports
whether anything changed.
"""

from __future__ import annotations

import math
import os
import stat
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import structlog
from anyio.abc import TaskStatus
from toolsetd.protocol.errors import ServerBusy
from toolsetd.protocol.jsontext import is_utf8
from watchfiles import Change

from . import threads
from .catalog import subdirectory_names
from .logs import Throttle
from .watchproc import watch_in_process

__all__ = ["ReloadKey", "Watcher"]

log = structlog.get_logger("toolsetd.watcher")

ReloadKey = Path | None
"""``None`` means the home sets (reload every snapshot); a path names one workspace."""

_TOOLS = "tools"
_CRYSTAL = ".crystal"
_CONFIG = "config.json"
_MANIFEST = "tools.json"
_STEP_MS = 50  # how often the Rust thread looks at the stop event and for quiet
_RESTART_PROBE_DELAY = 0.25  # seconds: long enough for a new awatch to be established
_RUST_TIMEOUT_MS = 5_000  # the thread returns to Python this often even with no events
_BUSY_RETRY_SECONDS = 1.0  # a reload the daemon was too short of descriptors for: again
_UNDECODABLE_PACE = 1.0  # seconds between restarts after names watchfiles cannot decode
_MAP_INLINE_MAX = 1_000  # changes in a batch mapped on the loop (~20 ms); more: in a thread
#: A watch that failed as a folder it was given went before it watched it (a deploy's
#: ``rm -rf`` then ``mv``, a checkout, during a restart) is started again over a fresh
#: probe, quietly, while the folders it was given keep moving, and otherwise up to this
#: many times in a row; past that it is no race, and the watch is unavailable as for any
#: other failure (rather than restarted every second).
_GONE_RESTARTS = 3
#: After a poll, the next waits at least this many times as long as that one took, so the
#: poller spends at most about 1/20 of a core: a tools root of 100,000 subdirectories
#: (a hostile checkout) costs ~2 s of stat calls a probe, which every 2 s was a core.
_POLL_COST_FACTOR = 20
#: The most directories one watch takes by default (``--max-watches``): inotify costs a
#: watch per directory from the user's ``fs.inotify.max_user_watches``, shared with every
#: other program of that user (an editor, a build's file watcher), and a tools root of
#: 190,000 folders took all of it. Set folders past it are followed by the poll alone.
DEFAULT_MAX_WATCHES = 8192
#: Nor more than this share of the user's ``fs.inotify.max_user_watches``.
_USER_WATCHES_SHARE = 4
_MAX_USER_WATCHES = "/proc/sys/fs/inotify/max_user_watches"

_StatSig = tuple[int, int, int, int] | None
#: Path -> stat signature of everything a key's snapshot is built from.
_Signature = dict[str, _StatSig]
#: A set named in a change: (tools root, set folder name).
SetPair = tuple[str, str]
#: Per key, the sets seen changing under it, or None: something else changed there.
_Changes = dict[ReloadKey, set[SetPair] | None]
WatchFactory = Callable[..., AsyncIterator[set[tuple[Change, str]]]]


def _merge(into: _Changes, key: ReloadKey, pairs: Iterable[SetPair] | None) -> None:
    """Add ``pairs`` under ``key``; None (scan it all) absorbs any pairs, before or after."""
    if pairs is None:
        into[key] = None
    elif key not in into:
        into[key] = set(pairs)
    else:
        known = into[key]
        if known is not None:
            known.update(pairs)


#: The directories to watch, each with its (device, inode): a watch follows a directory,
#: not its name, so a link pointed elsewhere (a ``.crystal`` switched to another folder)
#: calls for a new watch; and a folder linked under two names (a set shared by two
#: projects) has one watch, whose events name one of them (``Watcher._aliases``).
_Watched = dict[Path, tuple[int, int]]


@dataclass(frozen=True, slots=True)
class _Probe:
    """What one key looks like on disk: the directories to watch (its folders that may
    hold a tools root, and the root), a stat signature, and its set folders to watch."""

    dirs: _Watched
    signature: _Signature
    sets: _Watched = field(default_factory=dict)


class Watcher:
    """Follow the home tool sets, ``config.json`` and each workspace's project sets.

    Args:
        home: The toolsetd home (absolute); ``<home>/tools`` and ``<home>/config.json``.
        on_change: Awaited with what to reload: per key (``None`` in it means "all"), the
            frozenset of (tools root, set folder) pairs seen changing, or None when only a
            scan of everything will do.
        debounce_ms: awatch's grouping window for one batch.
        settle_seconds: Quiet time after a batch before its keys are sent once more.
        recheck_seconds: Period of the stat poll (the safety net and the fallback).
        retry_seconds: Period of retries of a watch that could not be started.
        watch_factory: ``watchproc.watch_in_process`` (the default), ``watchfiles.awatch``
            or a fake with its signature.
        clock: Measures what a poll cost, in the probing thread: the time it took there,
            waiting on a slow file system included (``time.monotonic``; injectable for
            tests).
        max_watches: The most directories watched (``--max-watches``), and never more
            than a quarter of ``fs.inotify.max_user_watches``; set folders past it are
            followed by the poll alone. None: that quarter alone (no bound where the limit
            cannot be read).

    Attributes:
        polls: How many polls ran (the baseline included).
    """

    def __init__(
        self,
        home: Path,
        on_change: Callable[[dict[ReloadKey, frozenset[SetPair] | None]], Awaitable[None]],
        *,
        debounce_ms: int = 300,
        settle_seconds: float = 0.5,
        recheck_seconds: float = 2.0,
        retry_seconds: float = 30.0,
        watch_factory: WatchFactory = watch_in_process,
        clock: Callable[[], float] = time.monotonic,
        max_watches: int | None = DEFAULT_MAX_WATCHES,
    ) -> None:
        self._home = home
        self._clock = clock
        self._max_watches = max_watches
        #: The bound of the current generation (``_watch_cap``), and how many set folders
        #: it left to the poll alone.
        self._cap: int | None = max_watches
        self._past_cap = 0
        #: A watch process watched once (``established``, or a first change reported): a
        #: restart's few moments without one still say ``watching``, not ``starting``.
        self._established = False
        #: Why the watch is unavailable, while it is (``watch_unavailable``'s words).
        self._unavailable = ""
        #: The inotify watches of the last watch that said it watches (``status``'s
        #: ``watched``): none while the first one starts; through a restart, the replaced
        #: watch's until the new one watches.
        self._held = 0
        #: Seconds between polls now (``status``): the recheck, or twenty times what the
        #: last poll took in its thread if longer; worked out per poll, not per status.
        self._poll_seconds = recheck_seconds
        #: ``status()``: made again by ``_restate`` when what it says changed, and the
        #: same dict until then, so a reader may keep what it made of it beside it.
        self._status: dict[str, Any] = {}
        #: Polls begun, and polls ended: a poll counts as begun while its probe is still
        #: in its thread, and as ended once what it found is taken in.
        self.polls = 0
        self.polls_ended = 0
        self._home_tools = home / _TOOLS
        self._config = home / _CONFIG
        self._on_change = on_change
        self._debounce_ms = debounce_ms
        self._settle = settle_seconds
        self._recheck = recheck_seconds
        self._retry = retry_seconds
        self._factory = watch_factory
        self._workspaces: set[Path] = set()
        self._running = False
        # Watch generation state (supervisor).
        self._stop: anyio.Event | None = None
        self._watching: _Watched | None = None
        #: Per watched folder that has other names (links to one directory), those names:
        #: inotify has one watch per directory, and reports its events under one name.
        self._aliases: dict[Path, tuple[Path, ...]] = {}
        #: A watched directory was reported removed or made (again) since the generation
        #: started: the next poll restarts it, as its path may well be in the new probe.
        self._rewatch = False
        self._degraded = False
        # Poll and settle timers (timer task).
        #: Per key, its last probe; None for a workspace added while watching and not
        #: probed yet, or a key whose reload failed, so its next probe reloads it.
        self._signatures: dict[ReloadKey, _Signature | None] = {}
        self._poll_due = math.inf
        #: No poll starts before this (``_POLL_COST_FACTOR`` times the last one's cost).
        self._poll_floor = -math.inf
        #: The poll due is the one a new watch asks for once it watches: not held back.
        self._poll_now = False
        self._settle_due = math.inf
        self._settle_changes: _Changes = {}
        self._timer_wake = anyio.Event()
        # Delivery (deliverer task).
        self._pending: _Changes = {}
        #: Keys delivered with a full scan since the watcher started (or since their last
        #: failed delivery): only their later deliveries may name sets.
        self._confirmed: set[ReloadKey] = set()
        self._deliver_wake = anyio.Event()
        #: A reload failing at every poll logs once a minute, with how many failed.
        self._failures = Throttle()
        #: Restarts after a name watchfiles could not decode: logged once a minute.
        self._restarts = Throttle()
        #: The next awatch is such a restart: ``watch_restarted`` says it, not ``watch_started``.
        #: Restarts in a row after a folder went as its watch started (``_GONE_RESTARTS``).
        self._gone_restarts = 0
        self._restarting = False
        #: Keys whose last delivery failed: while any is, their failures are throttled;
        #: once each was reloaded, the throttle starts afresh (the next failure is news).
        self._failing: set[ReloadKey] = set()
        self._restate()

    @property
    def workspaces(self) -> frozenset[Path]:
        """The workspaces currently followed."""
        return frozenset(self._workspaces)

    def status(self) -> dict[str, Any]:
        """What ``status`` says of watching (``docs/protocol.md``): ``state`` (``starting``,
        ``watching`` or ``polling``), ``reason`` (why it polls), ``watched`` (the
        directories of the watch that last said it watches: none while it starts or while
        polling), ``pastCap`` (set folders past ``maxWatches``, left to the poll),
        ``maxWatches`` and ``pollSeconds`` (between polls now: at least ``recheck_seconds``,
        and twenty times what the last poll took).

        The same dict until one of them changes (``status`` encodes it once per change, as
        ``Handlers._fixed_status`` does the rest): read it, do not change it.
        """
        return self._status

    def _restate(self) -> None:
        """Make ``status()`` anew if what it says changed (call after changing any of it)."""
        if self._degraded:
            state = "polling"
        elif self._established:
            state = "watching"
        else:
            state = "starting"
        status = {
            "state": state,
            "reason": self._unavailable if self._degraded else None,
            "watched": 0 if self._degraded else self._held,
            "pastCap": self._past_cap,
            "maxWatches": self._cap,
            "pollSeconds": self._poll_seconds,
        }
        if status != self._status:
            self._status = status

    def add_workspace(self, workspace: Path) -> None:
        """Start following ``<workspace>/.crystal/tools`` (created later or deleted included).

        Args:
            workspace: The canonical workspace path, as the registry keys it.
        """
        if workspace in self._workspaces:
            return
        self._workspaces.add(workspace)
        if self._running:
            # Its catalog was just built, but its first probe may be a while off (a poll
            # waits out the last one's cost): with no signature, that probe would become
            # the baseline, and an edit made meanwhile would never be reloaded. Unseen, the
            # first probe reloads it (a stat scan when nothing changed).
            self._signatures[workspace] = None
        self._schedule_poll(0.0)  # the poll sees new directories and restarts the watch

    def remove_workspace(self, workspace: Path) -> None:
        """Stop following a workspace and forget anything pending for it.

        Args:
            workspace: A path given to :meth:`add_workspace`; unknown paths are ignored.
        """
        if workspace not in self._workspaces:
            return
        self._workspaces.discard(workspace)
        self._pending.pop(workspace, None)
        self._settle_changes.pop(workspace, None)
        self._signatures.pop(workspace, None)
        self._confirmed.discard(workspace)
        self._reloaded({workspace})
        self._schedule_poll(0.0)

    async def run(
        self,
        *,
        prepare: Callable[[], Awaitable[object]] | None = None,
        task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED,
    ) -> None:
        """Watch until cancelled; readiness is signalled once the baseline probe is taken.

        Args:
            prepare: Awaited after the baseline probe and before watching starts: the
                daemon builds its catalog there. Whatever it read is then no older than
                the baseline, so an edit made during or after the build differs from the
                baseline and is sent. A catalog built before the first probe could hold
                the old manifest while that probe took the edit in, unsent.
            task_status: Set started after ``prepare``, so any later change is seen.
        """
        self._running = True
        try:
            await self._poll_once()  # the baseline: later signatures are compared to it
            log.debug("watch_baseline", keys=len(self._signatures))
            if prepare is not None:
                await prepare()
            async with anyio.create_task_group() as tg:
                tg.start_soon(self._supervise)
                tg.start_soon(self._run_timers)
                tg.start_soon(self._deliver)
                task_status.started()
                try:
                    await anyio.sleep_forever()
                finally:
                    # Event.set() is synchronous, so cancellation cannot interrupt it;
                    # it makes the Rust thread return within one step instead of waiting
                    # out rust_timeout inside a non-cancellable to_thread call.
                    self._stop_generation()
        finally:
            self._running = False

    # -- mapping ---------------------------------------------------------------------

    def _changes_for(self, raw: str) -> _Changes:
        """Map one changed path to reload keys; unrelated and data paths map to nothing.

        Returns:
            Per key, the set the path lies in (as a one-pair set: the path is an entry of
            that set folder), or None when it lies in no set folder (``config.json``,
            ``.crystal``, a root, a set folder itself).
        """
        path = Path(raw)
        found: _Changes = {}
        if path == self._config:
            found[None] = None
        if path.name == _CRYSTAL and path.parent in self._workspaces:
            found[path.parent] = None  # .crystal came or went, and its tools root with it
        for depth, candidate in enumerate((path, *path.parents)):
            key: ReloadKey
            if candidate == self._home_tools:
                key = None
            elif (
                candidate.name == _TOOLS
                and candidate.parent.name == _CRYSTAL
                and candidate.parent.parent in self._workspaces
            ):
                key = candidate.parent.parent
            else:
                continue
            if depth >= 2:  # <root>/<set>/<entry>: that set alone
                _merge(found, key, {(str(candidate), path.parts[len(candidate.parts)])})
            else:  # the root, or a set folder itself (it may have come or gone)
                _merge(found, key, None)
        return found

    async def _handle_batch(self, batch: set[tuple[Change, str]]) -> None:
        watching, aliases = self._watching, self._aliases
        if len(batch) > _MAP_INLINE_MAX:
            # 20 µs a change: 40,000 (a rm -rf of a big root) held every client 0.8 s.
            rewatch, changes = await threads.run_sync(self._map_batch, batch, watching, aliases)
        else:
            rewatch, changes = self._map_batch(batch, watching, aliases)
        if rewatch:
            # A watch follows a directory, not its name: a folder removed and made again
            # (its inode number often reused) is the same path in the next probe, and its
            # new directory had no watch until a poll found some other folder come or go.
            self._rewatch = True
            self._schedule_poll(0.0)
        if not changes:
            return
        log.info("watch_changed", keys=len(changes))
        # Record what the reload is about to see, so the next poll does not report this
        # change a second time. Probing *before* sending keeps the invariant the poller
        # relies on: every state absorbed into a baseline was, or is about to be, sent.
        # A key sent with its sets named has only those sets probed again.
        baselines = {
            key: (pairs, self._signatures.get(key))
            for key, pairs in changes.items()
            if key in self._signatures
        }
        try:
            probes = await threads.run_sync(_reprobe, self._home, baselines)
        except Exception:  # only costs a duplicate call from the next poll
            probes = {}
        for key, (signature, was) in probes.items():
            if self._signatures.get(key) is was:  # not replaced by a poll meanwhile
                self._signatures[key] = signature
        self._enqueue(changes)
        for key, pairs in changes.items():
            _merge(self._settle_changes, key, pairs)
        self._settle_due = anyio.current_time() + self._settle
        self._timer_wake.set()
        if any(pairs is None for pairs in changes.values()):
            # Not only entries of set folders changed: a root or a set folder may have
            # come or gone (an entry of one cannot add or remove a folder to watch).
            self._schedule_poll(0.0)

    def _map_batch(
        self,
        batch: set[tuple[Change, str]],
        watching: _Watched | None,
        aliases: dict[Path, tuple[Path, ...]],
    ) -> tuple[bool, _Changes]:
        """Whether ``batch`` reports a watched directory removed or made, and its changes
        per reload key (``_changes_for``). Pure but for reading the workspaces followed: a
        big batch is mapped in a worker thread."""
        rewatch = watching is not None and any(
            change is not Change.modified and Path(raw) in watching for change, raw in batch
        )
        changes: _Changes = {}
        for _change, raw in batch:
            raws = [raw]
            if aliases:
                path = Path(raw)
                # One directory under several names has one watch, which reports under
                # the last name watched alone: the others' keys are told too.
                raws += [str(alias / path.name) for alias in aliases.get(path.parent, ())]
            for each in raws:
                for key, pairs in self._changes_for(each).items():
                    _merge(changes, key, pairs)
        return rewatch, changes

    # -- supervisor: awatch generations -----------------------------------------------

    def _stop_generation(self) -> None:
        if self._stop is not None:
            self._stop.set()

    async def _supervise(self) -> None:
        while True:
            self._rewatch = False  # this probe is taken after any removal reported so far
            cap, dirs, past = await threads.run_sync(self._probe_capped, tuple(self._workspaces))
            watches = _watches(dirs)
            self._note_cap(cap, past, watches)
            stop = anyio.Event()
            self._stop, self._watching = stop, dirs
            self._aliases = _aliases(dirs)
            if not dirs:
                # Nothing exists yet (no home): nothing to watch or miss, so not "starting"
                # for good in status; the poller restarts us when something appears.
                self._established = True
                self._held = 0
                self._restate()
                await stop.wait()
                continue
            # Events between the previous generation's end and this one's start are lost;
            # a probe shortly after the start turns them into signature changes.
            self._schedule_poll(min(_RESTART_PROBE_DELAY, self._recheck))
            if self._degraded:
                # Not "started": a retry of a watch that could not start (the watch limit)
                # usually fails at once again; said at info, the last line an operator read
                # claimed a watch while the daemon ran on the poll. ``_watch`` says
                # ``watch_started`` once it reports a change.
                log.debug("watch_retry", paths=len(dirs))
            elif not self._restarting:
                log.info("watch_started", paths=len(dirs))
            self._restarting = False
            try:
                await self._watch(dirs, stop, watches)
            except Exception as exc:  # any failure of the watch degrades to polling
                cause = _cause(exc)
                moved = _folder_gone(cause) and await threads.run_sync(_moved, dirs)
                gone = moved or (_folder_gone(cause) and self._gone_restarts < _GONE_RESTARTS)
                if gone:
                    # A folder the probe listed went before the watch watched it: the
                    # watch works, over the folders a fresh probe lists. Degraded, it
                    # warned of a watch that was not lost, and sat on the poll until a
                    # poll saw the folders move, or for ``retry_seconds`` where the folder
                    # came back under its inode number. Quiet as long as folders keep
                    # moving (a long ``rm -rf``: each start races it), else a few times in
                    # a row (one made again under its inode number looks unmoved). What
                    # changed meanwhile was seen by no event: probed now. Only a failure
                    # whose folders stand still counts: counted too, the starts that raced
                    # a long rm -rf used up the bound, and the first still one at its end
                    # (a folder made again under its inode number) warned at once.
                    if not moved:
                        self._gone_restarts += 1
                    self._schedule_poll(0.0)
                if gone or _undecodable_name(cause):
                    # A name in a watched folder that is not UTF-8 (a Latin-1 folder a
                    # checkout brought, a file written in a set folder) ended the awatch:
                    # the watch itself works. Started again within a second, and the probe
                    # after its start takes in what the lost batch held; degraded, every
                    # edit waited for the poll until the retry. Paced and logged once a
                    # minute: a tool rewriting such a file would otherwise restart the
                    # watch (a probe of every set) and log a line at each of its events.
                    said = self._restarts.count(None)
                    if said is not None:
                        log.info(
                            "watch_restarted",
                            error=type(cause).__name__,
                            message=str(cause),
                            restarts=said,
                        )
                    self._restarting = True  # said by watch_restarted, once a minute
                    with anyio.move_on_after(min(_UNDECODABLE_PACE, self._recheck)):
                        await stop.wait()
                    continue
                if self._degraded:
                    log.debug("watch_retry_failed", error=type(cause).__name__)
                else:
                    self._degraded = True
                    log.warning("watch_unavailable", error=type(cause).__name__, message=str(cause))
                self._unavailable = f"{type(cause).__name__}: {cause}"
                self._restate()
                # What changed while it started was seen by no event, and the restart's
                # probe may have come first (a watch process's start takes a while): a
                # probe now takes it in, and restarts the watch if the folders moved (a
                # folder it was to watch vanished). Else it waited for the next poll.
                self._schedule_poll(0.0)
                with anyio.move_on_after(self._retry):
                    await stop.wait()
                continue
            self._degraded = False
            self._restate()
            if not stop.is_set():  # the iterator ended by itself: do not spin
                with anyio.move_on_after(self._recheck):
                    await stop.wait()

    async def _watch(self, dirs: _Watched, stop: anyio.Event, watches: int) -> None:
        changes = self._factory(
            *sorted(dirs),
            stop_event=stop,
            debounce=self._debounce_ms,
            step=_STEP_MS,
            recursive=False,
            watch_filter=None,  # _changes_for is the filter (a whitelist)
            yield_on_timeout=False,
            rust_timeout=_RUST_TIMEOUT_MS,
        )
        try:
            established = getattr(changes, "established", None)
            if established is not None:  # a watch process: its start takes a while
                await established()
                # What changed before it watched was reported by no event: probed now, not
                # after the poll's pace (twenty times the last poll: 10 s over 20,000 sets,
                # for changes made during the restart or a run of starts racing a rm -rf).
                # A restart costs a probe of its own already: this one at most doubles it.
                self._schedule_poll(0.0, now=True)
                self._gone_restarts = 0  # it watches: a folder gone later is a new race
                self._established, self._held = True, watches
                if self._degraded and not stop.is_set():  # it watches: the retry worked
                    self._degraded = False
                    log.info("watch_started", paths=len(dirs))
                self._restate()
            async for batch in changes:
                self._gone_restarts = 0
                self._established, self._held = True, watches
                if self._degraded:
                    self._degraded = False
                    log.info("watch_started", paths=len(dirs))
                self._restate()
                await self._handle_batch(batch)
        finally:
            aclose = getattr(changes, "aclose", None)
            if aclose is not None:
                with anyio.move_on_after(1, shield=True):
                    await aclose()

    # -- timers: poll and settle ------------------------------------------------------

    def _schedule_poll(self, delay: float, *, now: bool = False) -> None:
        """Poll after ``delay`` seconds, or later: never sooner than the pace allows
        (``_poll_floor``) unless ``now``."""
        if not self._running:
            return  # run() takes a fresh probe when it starts
        due = anyio.current_time() + delay
        if now:
            self._poll_now = True
        if due < self._poll_due or now:
            self._poll_due = min(due, self._poll_due)
            self._timer_wake.set()

    async def _run_timers(self) -> None:
        self._poll_due = min(self._poll_due, anyio.current_time() + self._recheck)
        while True:
            now = anyio.current_time()
            if self._settle_due <= now:
                settled, self._settle_changes = self._settle_changes, {}
                self._settle_due = math.inf
                self._enqueue(settled)
            poll_due = self._poll_due if self._poll_now else max(self._poll_due, self._poll_floor)
            if poll_due <= now:
                self._poll_due = now + self._recheck
                self._poll_now = False
                cost = await self._poll_once()
                self._poll_floor = anyio.current_time() + _POLL_COST_FACTOR * cost
                continue
            with anyio.move_on_after(min(poll_due, self._settle_due) - now):
                await self._timer_wake.wait()
            if self._timer_wake.is_set():
                self._timer_wake = anyio.Event()

    async def _poll_once(self) -> float:
        """Probe everything and reload what changed; returns the probe's seconds."""
        self.polls += 1
        try:
            return await self._poll()
        finally:
            self.polls_ended += 1

    async def _poll(self) -> float:
        """``_poll_once`` but for the count."""
        cap = self._cap
        try:
            probes, cost, (watched, past) = await threads.run_sync(
                self._timed_probe, tuple(self._workspaces), cap
            )
        except Exception as exc:  # a probe must never stop the watcher
            log.warning("watch_poll_failed", error=type(exc).__name__, message=str(exc))
            return 0.0
        kept = {k: p for k, p in probes.items() if k is None or k in self._workspaces}
        if len(kept) != len(probes) or cap != self._cap:
            # A workspace released, or a new bound taken, while it probed (rare): the
            # folders to watch are worked out again, here.
            watched, past = _watched(kept, self._cap)
        probes = kept
        changed = {
            key
            for key, probe in probes.items()
            if key in self._signatures and self._signatures[key] != probe.signature
        }
        signatures: dict[ReloadKey, _Signature | None] = {
            key: probe.signature for key, probe in probes.items()
        }
        for key in self._workspaces - probes.keys():
            # Added while this probe was in its thread: keep its mark (not probed yet), or
            # its first probe became the baseline unsent, an edit since its build with it.
            if key in self._signatures:
                signatures[key] = self._signatures[key]
        self._signatures = signatures
        if changed:
            log.info("watch_changed", keys=len(changed))
            self._enqueue(dict.fromkeys(changed))
        # Another directory, or another one under a name watched (a link pointed elsewhere).
        if self._watching is not None and (self._rewatch or watched != self._watching):
            self._stop_generation()
        elif self._watching is not None:
            # The same folders watched, but set folders past the bound came or went (one
            # that sorts after those watched, rm -rf of those polled): status, the metrics
            # and STATUS= said the old count, 'N past --max-watches' with none left.
            self._note_cap(self._cap, past, _watches(watched))
        self._poll_seconds = round(max(self._recheck, _POLL_COST_FACTOR * cost), 3)
        self._restate()
        return cost

    def _probe_capped(self, workspaces: tuple[Path, ...]) -> tuple[int | None, _Watched, int]:
        """In a worker thread: the bound on the directories to watch, those directories
        and how many set folders are past it (``_watched``: a walk of every set folder,
        ~0.1 s over 190,000, which every client waited out on the loop)."""
        cap = _watch_cap(self._max_watches)
        return cap, *_watched(_probe_all(self._home, workspaces), cap)

    def _note_cap(self, cap: int | None, past: int, watched: int) -> None:
        """Take a generation's bound; log when set folders start or stop being left to the
        poll by it (not at each restart that leaves the same folders out)."""
        if past and (not self._past_cap or cap != self._cap):
            log.warning(
                "watch_capped",
                watched=watched,
                past_cap=past,
                max_watches=cap,
                message=f"{past} set folders are past the watch's bound of {cap} directories "
                "(--max-watches, at most a quarter of fs.inotify.max_user_watches): edits in "
                "them are seen by the stat poll alone",
            )
        elif not past and self._past_cap:
            log.info("watch_cap_cleared", watched=watched, max_watches=cap)
        self._cap, self._past_cap = cap, past
        self._restate()

    def _timed_probe(
        self, workspaces: tuple[Path, ...], cap: int | None
    ) -> tuple[dict[ReloadKey, _Probe], float, tuple[_Watched, int]]:
        """``_probe_all`` in a worker thread, with the time it took there: the time a poll
        waited for a thread or the loop is not its cost. Not the thread's CPU time: a
        ``stat`` on a network or FUSE mount (what the poll is for) waits on a server or a
        FUSE daemon, whose work that is, and a poll paced by its CPU time alone ran there
        back to back. And the directories to watch under ``cap`` (``_probe_capped``)."""
        began = self._clock()
        probes = _probe_all(self._home, workspaces)
        cost = self._clock() - began
        return probes, cost, _watched(probes, cap)

    # -- delivery ---------------------------------------------------------------------

    def _enqueue(self, changes: _Changes) -> None:
        for key, pairs in changes.items():
            _merge(self._pending, key, pairs)
        if self._pending:
            self._deliver_wake.set()

    async def _deliver(self) -> None:
        while True:
            await self._deliver_wake.wait()
            self._deliver_wake = anyio.Event()
            changes = {
                key: pairs
                for key, pairs in self._pending.items()
                if key is None or key in self._workspaces
            }
            self._pending = {}
            if not changes:
                continue
            told = {
                key: frozenset(pairs) if pairs is not None and key in self._confirmed else None
                for key, pairs in changes.items()
            }
            if told.get(None) is not None and not self._workspaces <= self._confirmed:
                # A home change reloads every snapshot, and a workspace's own sets are
                # not named under the home key: while one was never scanned whole since
                # the watcher started, every snapshot is.
                told[None] = None
            # A scan whole confirms only a key probed before it began: a key not probed
            # yet is sent whole by its first probe, which alone catches an edit made
            # between its build and that probe; confirmed sooner, its sets were named.
            probed = {
                key
                for key, signature in self._signatures.items()
                if signature is not None and (key is None or key in self._workspaces)
            }
            try:
                await self._on_change(told)
            except ServerBusy as exc:
                # Out of descriptors or memory: the signatures already took this change
                # in, so no poll would send it again. Send it again later ourselves.
                log.warning("watch_reload_deferred", error=exc.message)
                await anyio.sleep(_BUSY_RETRY_SECONDS)
                self._enqueue(changes)
            except Exception as exc:  # the reload path's failure must not stop watching
                said = self._failures.count(type(exc).__name__)
                if said is not None:
                    log.warning(
                        "watch_reload_failed",
                        error=type(exc).__name__,
                        failures=said,
                        exc_info=True,
                    )
                # The baselines took this change in, so no poll would report it again, and
                # a change that no later event names stayed unseen: these keys are marked
                # not probed, so the next poll sends them again, to be scanned whole.
                self._confirmed -= changes.keys()
                for key in changes.keys() & self._signatures.keys():
                    self._signatures[key] = None
                self._failing |= changes.keys()
            else:
                self._reloaded(changes.keys())
                scanned = probed & changes.keys()
                if None in told and told[None] is None:  # every snapshot was scanned whole
                    scanned = probed
                # Not a workspace removed meanwhile: it is probed anew if it comes back.
                self._confirmed |= {k for k in scanned if k is None or k in self._workspaces}

    def _reloaded(self, keys: Iterable[ReloadKey]) -> None:
        """Note that ``keys`` no longer fail (reloaded, or no longer followed).

        Once no key's last delivery failed, the throttle of ``watch_reload_failed`` starts
        afresh: it stands for the retries of one run of failures, and kept, it hid a
        failure that came within a minute of the last line after the reloads worked again
        (logged at no later line unless another came a minute on, its traceback never).
        """
        if self._failing:
            self._failing.difference_update(keys)
            if not self._failing:
                self._failures.reset()


def _cause(exc: BaseException) -> BaseException:
    """The failure an awatch error stands for.

    watchfiles runs its watch thread inside a task group, so what that thread raised once
    the watch was running (a name it cannot decode, an error of the notify backend)
    arrives wrapped in a group of one, whose own message says nothing of it.
    """
    while isinstance(exc, BaseExceptionGroup) and len(exc.exceptions) == 1:
        exc = exc.exceptions[0]
    return exc


def _moved(dirs: _Watched) -> bool:
    """Whether a directory of ``dirs`` is gone, or another directory, or not one to watch."""
    return any(_watch_id(path) != identity for path, identity in dirs.items())


def _folder_gone(exc: BaseException) -> bool:
    """Whether an awatch failed as a folder it was given was gone, or no longer a folder,
    when it came to watch it (``No such file or directory (os error 2) about [...]``)."""
    return isinstance(exc, FileNotFoundError | NotADirectoryError)


def _undecodable_name(exc: BaseException) -> bool:
    """Whether an awatch ended on an event whose path watchfiles could not decode (a name
    that is not UTF-8 reported in a watched folder), which says nothing of the watch."""
    return isinstance(exc, RuntimeError) and str(exc).startswith("Unable to decode path")


# -- probes (blocking; run in a worker thread) ----------------------------------------


def _stat(path: str | Path) -> _StatSig:
    try:
        return _signature(os.stat(path))
    except OSError:
        return None


def _signature(st: os.stat_result | None) -> _StatSig:
    if st is None:
        return None
    return (st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def _is_dir(path: str | Path) -> bool:
    try:
        return stat.S_ISDIR(os.stat(path).st_mode)
    except OSError:  # missing, unreadable, a loop: not something to watch
        return False


def _watch_id(path: str | Path, st: os.stat_result | None = None) -> tuple[int, int] | None:
    """Whether ``path`` is a directory this process may put a watch on (it may read it,
    and its path can be handed to watchfiles: ``jsontext.is_utf8``).

    One awatch covers every directory, and one it may not watch (root's, mode 0700, in a
    shared project) fails all of it: the daemon went on its stat poll alone for every set.
    Such a folder is left to the poll; made readable, its ctime moves, and the poll that
    sees it finds it in the directories to watch. A directory anyone may read costs no
    ``access`` call (a poll of 100,000 sets would make 100,000 more).

    Returns:
        The directory's (device, inode), or None when it is not one to watch.
    """
    if not is_utf8(str(path)):  # watchfiles takes UTF-8: one it cannot encode fails it all
        return None
    if st is None:
        try:
            st = os.stat(path)
        except OSError:  # missing, a loop: not something to watch
            return None
    if not stat.S_ISDIR(st.st_mode):
        return None
    if st.st_mode & stat.S_IROTH or os.access(path, os.R_OK):
        return (st.st_dev, st.st_ino)
    return None


def _probe_set(set_dir: Path, signature: _Signature) -> None:
    """Put a set folder and its manifest in a probe's signature."""
    signature[str(set_dir)] = _stat(set_dir)
    signature[str(set_dir / _MANIFEST)] = _stat(set_dir / _MANIFEST)


def _probe_root(root: Path, dirs: _Watched, signature: _Signature, sets: _Watched) -> None:
    """Add a tools root (to ``dirs``), its set directories (to ``sets``) and their
    manifests to a probe."""
    try:
        st: os.stat_result | None = os.stat(root)
    except OSError:
        st = None
    signature[str(root)] = _signature(st)
    try:
        names = subdirectory_names(root)
    except OSError:
        return
    if st is not None and is_utf8(str(root)):
        dirs[root] = (st.st_dev, st.st_ino)  # it was listed: it may be read
    for name in names:
        set_dir = root / name
        try:
            found: os.stat_result | None = os.stat(set_dir)
        except OSError:
            found = None
        signature[str(set_dir)] = _signature(found)
        signature[str(set_dir / _MANIFEST)] = _stat(set_dir / _MANIFEST)
        if found is not None and (identity := _watch_id(set_dir, found)) is not None:
            sets[set_dir] = identity


def _probe_home(home: Path) -> _Probe:
    dirs: _Watched = {}
    signature: _Signature = {str(home / _CONFIG): _stat(home / _CONFIG)}
    if (identity := _watch_id(home)) is not None:
        dirs[home] = identity
    sets: _Watched = {}
    _probe_root(home / _TOOLS, dirs, signature, sets)
    return _Probe(dirs, signature, sets)


def _probe_workspace(workspace: Path) -> _Probe:
    dirs: _Watched = {}
    signature: _Signature = {}
    crystal = workspace / _CRYSTAL
    if (identity := _watch_id(crystal)) is not None:
        dirs[crystal] = identity
    elif (identity := _watch_id(workspace)) is not None:
        # Flat: only to see .crystal appear (or, unreadable, become readable); never
        # recursive.
        dirs[workspace] = identity
    sets: _Watched = {}
    _probe_root(crystal / _TOOLS, dirs, signature, sets)
    return _Probe(dirs, signature, sets)


def _watched(probes: Mapping[ReloadKey, _Probe], cap: int | None) -> tuple[_Watched, int]:
    """The directories the probes list to watch, with their (device, inode), at most
    ``cap`` watches of them, and how many set folders that bound leaves out.

    First every folder that may hold a tools root and every root (few: a key's own
    structure), then set folders: the home's, then each workspace's, the workspace with
    the fewest first, so one project of 190,000 folders gives up its watches before a
    small one does. A set folder left out is followed by the poll alone.

    The bound counts directories, not paths: inotify holds one watch per directory however
    many paths reach it (a project whose ``.crystal`` links to the home names the home's
    root and sets again), so a path to a directory already watched is listed at no cost
    (its events are told under each name, ``_aliases``), and one past the bound is counted
    once.
    """
    dirs: _Watched = {}
    for probe in probes.values():
        dirs.update(probe.dirs)
    held = set(dirs.values())
    order = sorted(probes.items(), key=lambda item: (item[0] is not None, len(item[1].sets)))
    past: set[tuple[int, int]] = set()
    for _key, probe in order:
        for path, identity in probe.sets.items():
            if identity in held:
                dirs[path] = identity
            elif cap is None or len(held) < cap:
                dirs[path] = identity
                held.add(identity)
            else:
                past.add(identity)
    return dirs, len(past)


def _watches(dirs: _Watched) -> int:
    """The inotify watches ``dirs`` take: one per directory, however many paths reach it."""
    return len(set(dirs.values()))


def _watch_cap(max_watches: int | None) -> int | None:
    """The bound on the directories one watch takes: ``max_watches``, and never more than
    a quarter of the user's ``fs.inotify.max_user_watches`` (read each time: an operator
    may raise it)."""
    try:
        with open(_MAX_USER_WATCHES, "rb") as file:
            share = int(file.read(32)) // _USER_WATCHES_SHARE
    except (OSError, ValueError):
        return max_watches
    return share if max_watches is None else min(max_watches, share)


def _aliases(dirs: _Watched) -> dict[Path, tuple[Path, ...]]:
    """Per watched directory that is one directory with others (links), the others."""
    names: dict[tuple[int, int], set[Path]] = {}
    for path, identity in dirs.items():
        names.setdefault(identity, set()).add(path)
    return {
        path: tuple(sorted(group - {path}))
        for group in names.values()
        if len(group) > 1
        for path in group
    }


def _reprobe(
    home: Path, baselines: dict[ReloadKey, tuple[set[SetPair] | None, _Signature | None]]
) -> dict[ReloadKey, tuple[_Signature, _Signature | None]]:
    """The signatures a batch's keys are about to be reloaded at, each with its baseline.

    A key whose sets are named has only those sets probed again, over a copy of its
    baseline (a set folder that is no longer one leaves it, as ``_probe_root`` would leave
    it out); any other key is probed whole. A key not probed yet (baseline None) is left
    to its first poll.
    """
    probes: dict[ReloadKey, tuple[_Signature, _Signature | None]] = {}
    for key, (pairs, baseline) in baselines.items():
        if baseline is None:
            continue
        if pairs is None:
            whole = _probe_home(home) if key is None else _probe_workspace(key)
            probes[key] = (whole.signature, baseline)
            continue
        signature = dict(baseline)
        for root, name in pairs:
            set_dir = Path(root) / name
            if _is_dir(set_dir):
                _probe_set(set_dir, signature)
            else:
                signature.pop(str(set_dir), None)
                signature.pop(str(set_dir / _MANIFEST), None)
        probes[key] = (signature, baseline)
    return probes


def _probe_all(home: Path, workspaces: tuple[Path, ...]) -> dict[ReloadKey, _Probe]:
    probes: dict[ReloadKey, _Probe] = {None: _probe_home(home)}
    for workspace in workspaces:
        probes[workspace] = _probe_workspace(workspace)
    return probes
