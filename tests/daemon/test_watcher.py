"""Watcher tests: mapping, settle, restarts and fallback on a fake awatch, then the real one."""

from __future__ import annotations

import ctypes
import json
import os
import shutil
import sys
import tempfile
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from functools import partial
from pathlib import Path, PosixPath, PurePath
from typing import Any

import anyio
import pytest
from anyio.streams.buffered import BufferedByteReceiveStream
from structlog.testing import capture_logs
from toolsetd.daemon.watcher import _GONE_RESTARTS, ReloadKey, Watcher
from toolsetd.daemon.watchproc import watch_in_process
from watchfiles import Change

pytestmark = pytest.mark.anyio

Batch = set[tuple[Change, str]]
Layout = tuple[Path, Path]


class FakeWatch:
    """A stand-in for ``watchfiles.awatch``: yields batches sent to it, stops on its stop event."""

    def __init__(self) -> None:
        self.send, self._receive = anyio.create_memory_object_stream[Batch](100)
        self.calls: list[tuple[tuple[Path, ...], dict[str, Any]]] = []
        self.stops: list[anyio.Event] = []
        self.started = anyio.Event()

    async def __call__(
        self, *paths: Path, stop_event: anyio.Event, **kwargs: Any
    ) -> AsyncIterator[Batch]:
        self.calls.append((paths, kwargs))
        self.stops.append(stop_event)
        self.started.set()
        while not stop_event.is_set():
            # Receive inside the timeout, yield outside it: an async generator that yields
            # inside a cancel scope hands that scope to its consumer's task.
            batch: Batch | None = None
            with anyio.move_on_after(0.01):
                batch = await self._receive.receive()
            if batch is not None:
                yield batch

    def close(self) -> None:
        """Close both ends of the batch stream."""
        self.send.close()
        self._receive.close()

    async def wait_calls(self, count: int) -> None:
        """Wait until the watcher has started ``count`` generations."""
        while len(self.calls) < count:
            await anyio.sleep(0.01)


class Recorder:
    """An ``on_change`` that records each call and lets a test wait for one."""

    def __init__(self) -> None:
        self.calls: list[set[ReloadKey]] = []
        #: Each call's argument: per key, the sets named, or None (scan it all).
        self.changes: list[dict[ReloadKey, frozenset[tuple[str, str]] | None]] = []
        self.times: list[float] = []
        self._event = anyio.Event()

    async def __call__(self, keys: dict[ReloadKey, frozenset[tuple[str, str]] | None]) -> None:
        self.calls.append(set(keys))
        self.changes.append(dict(keys))
        self.times.append(anyio.current_time())
        self._event.set()
        self._event = anyio.Event()

    async def wait_for(self, key: ReloadKey, since: int = 0) -> int:
        """Wait for a call at index ``since`` or later holding ``key``; return its index."""
        while True:
            for index in range(since, len(self.calls)):
                if key in self.calls[index]:
                    return index
            await self._event.wait()

    def seen(self, key: ReloadKey, since: int) -> bool:
        """Whether a call at index ``since`` or later held ``key``."""
        return any(key in keys for keys in self.calls[since:])


@pytest.fixture
def layout(tmp_path: Path) -> Layout:
    """A home with one set and a workspace without ``.crystal``."""
    home = tmp_path / "home"
    (home / "tools" / "a").mkdir(parents=True)
    (home / "tools" / "a" / "tools.json").write_text("{}")
    workspace = tmp_path / "ws"
    workspace.mkdir()
    return home, workspace


@pytest.fixture
def fake() -> Iterator[FakeWatch]:
    """A fake awatch whose stream is closed after the test."""
    watch = FakeWatch()
    yield watch
    watch.close()


def _fake_watcher(home: Path, recorder: Recorder, fake: FakeWatch, **kwargs: Any) -> Watcher:
    options: dict[str, Any] = {"settle_seconds": 30.0, "recheck_seconds": 30.0} | kwargs
    return Watcher(home, recorder, watch_factory=fake, **options)


async def test_watcher_maps_home_changes_to_reload_all(layout: Layout, fake: FakeWatch) -> None:
    """A change to a home manifest or to config.json reloads every snapshot (key None)."""
    home, workspace = layout
    recorder = Recorder()
    watcher = _fake_watcher(home, recorder, fake)
    watcher.add_workspace(workspace)
    with anyio.fail_after(5):
        async with anyio.create_task_group() as tg:
            await tg.start(watcher.run)
            await fake.started.wait()
            await fake.send.send({(Change.modified, str(home / "tools" / "a" / "tools.json"))})
            await recorder.wait_for(None)
            await fake.send.send({(Change.added, str(home / "config.json"))})
            await recorder.wait_for(None, since=1)
            tg.cancel_scope.cancel()
    assert recorder.calls == [{None}, {None}]


async def test_watcher_maps_workspace_changes_to_workspace_key(
    layout: Layout, fake: FakeWatch
) -> None:
    """Changes under <ws>/.crystal/tools, or .crystal itself, reload that workspace alone."""
    home, workspace = layout
    recorder = Recorder()
    watcher = _fake_watcher(home, recorder, fake)
    watcher.add_workspace(workspace)
    tools = workspace / ".crystal" / "tools"
    with anyio.fail_after(5):
        async with anyio.create_task_group() as tg:
            await tg.start(watcher.run)
            await fake.started.wait()
            await fake.send.send({(Change.added, str(tools / "p" / "tools.json"))})
            await recorder.wait_for(workspace)
            await fake.send.send({(Change.deleted, str(workspace / ".crystal"))})
            await recorder.wait_for(workspace, since=1)
            await fake.send.send(
                {(Change.deleted, str(tools / "p")), (Change.modified, str(home / "tools" / "a"))}
            )
            await recorder.wait_for(None, since=2)
            tg.cancel_scope.cancel()
    assert recorder.calls == [{workspace}, {workspace}, {workspace, None}]


async def test_watcher_ignores_data_dirs_and_unrelated_files(
    layout: Layout, fake: FakeWatch
) -> None:
    """Runtime data under <home>/data or .crystal/data and other project files trigger no reload."""
    home, workspace = layout
    recorder = Recorder()
    watcher = _fake_watcher(home, recorder, fake)
    watcher.add_workspace(workspace)
    ignored = {
        (Change.added, str(home / "data" / "tools" / "x" / "file")),
        (Change.modified, str(home / "data")),
        (Change.added, str(workspace / ".crystal" / "data" / "tools" / "p" / "tool-output" / "c1")),
        (Change.modified, str(workspace / "src" / "tools" / "main.py")),
        (Change.modified, str(workspace / "README.md")),
        (Change.modified, str(home / "notes.txt")),
    }
    with anyio.fail_after(5):
        async with anyio.create_task_group() as tg:
            await tg.start(watcher.run)
            await fake.started.wait()
            await fake.send.send(ignored)
            # A relevant batch afterwards proves the ignored one was consumed, not pending.
            await fake.send.send({(Change.modified, str(home / "config.json"))})
            await recorder.wait_for(None)
            tg.cancel_scope.cancel()
    assert recorder.calls == [{None}]


async def test_watcher_settles_with_one_more_call(layout: Layout, fake: FakeWatch) -> None:
    """A batch is followed, settle_seconds after the last batch, by one more call with its keys."""
    home, workspace = layout
    recorder = Recorder()
    watcher = _fake_watcher(home, recorder, fake, settle_seconds=0.2)
    watcher.add_workspace(workspace)
    with anyio.fail_after(5):
        async with anyio.create_task_group() as tg:
            await tg.start(watcher.run)
            await fake.started.wait()
            manifest = workspace / ".crystal" / "tools" / "p" / "tools.json"
            sent = anyio.current_time()
            await fake.send.send({(Change.modified, str(manifest))})
            await recorder.wait_for(workspace)
            await recorder.wait_for(workspace, since=1)
            tg.cancel_scope.cancel()
    assert recorder.calls[:2] == [{workspace}, {workspace}]
    # The settle call is timed from the batch, not from the first call: on a loaded machine
    # the first call itself may run late, so the gap between the two calls can be shorter.
    assert recorder.times[1] - sent >= 0.2


async def _first_watch(
    watcher: Watcher, fake: FakeWatch
) -> tuple[tuple[Path, ...], dict[str, Any]]:
    """Run the watcher until its first awatch starts; return that call's paths and options."""
    with anyio.fail_after(5):
        async with anyio.create_task_group() as tg:
            await tg.start(watcher.run)
            await fake.started.wait()
            tg.cancel_scope.cancel()
    return fake.calls[0]


async def test_watcher_watches_only_known_directories_flat(layout: Layout, fake: FakeWatch) -> None:
    """One flat awatch covers home, the tools root, its set dirs and the bare workspace."""
    home, workspace = layout
    recorder = Recorder()
    watcher = _fake_watcher(home, recorder, fake, debounce_ms=123)
    watcher.add_workspace(workspace)
    (home / "data" / "tools").mkdir(parents=True)
    paths, kwargs = await _first_watch(watcher, fake)
    assert set(paths) == {home, home / "tools", home / "tools" / "a", workspace}
    assert kwargs["recursive"] is False
    assert kwargs["debounce"] == 123


async def test_watcher_an_entry_it_cannot_examine_leaves_the_rest_watched(
    layout: Layout, fake: FakeWatch
) -> None:
    """A symlink loop in the tools root is not watched; the root and its set dirs still are."""
    home, _ = layout
    (home / "tools" / "loopy").symlink_to("loopy")
    paths, _ = await _first_watch(_fake_watcher(home, Recorder(), fake), fake)
    assert set(paths) == {home, home / "tools", home / "tools" / "a"}


async def test_watcher_restarts_on_workspace_add_and_remove(
    layout: Layout, fake: FakeWatch
) -> None:
    """Adding or removing a workspace stops the running awatch and starts one over the new paths."""
    home, workspace = layout
    (workspace / ".crystal" / "tools" / "p").mkdir(parents=True)
    recorder = Recorder()
    watcher = _fake_watcher(home, recorder, fake)
    with anyio.fail_after(5):
        async with anyio.create_task_group() as tg:
            await tg.start(watcher.run)
            await fake.wait_calls(1)
            watcher.add_workspace(workspace)
            await fake.wait_calls(2)
            assert fake.stops[0].is_set()
            assert workspace / ".crystal" / "tools" / "p" in fake.calls[1][0]
            watcher.remove_workspace(workspace)
            removed = len(recorder.calls)  # before it, its first probe reloaded it once
            await fake.wait_calls(3)
            assert fake.stops[1].is_set()
            manifest = workspace / ".crystal" / "tools" / "p" / "tools.json"
            await fake.send.send({(Change.modified, str(manifest))})
            await fake.send.send({(Change.modified, str(home / "config.json"))})
            await recorder.wait_for(None)
            tg.cancel_scope.cancel()
    assert watcher.workspaces == frozenset()
    assert not recorder.seen(workspace, removed)
    assert not any(p.is_relative_to(workspace) for p in fake.calls[2][0])


async def test_watcher_falls_back_to_polling_when_watch_unavailable(layout: Layout) -> None:
    """An awatch that raises is logged as watch_unavailable and polling still reports changes."""
    home, _workspace = layout
    attempts: list[int] = []

    async def broken(*paths: Path, **kwargs: Any) -> AsyncIterator[Batch]:
        attempts.append(len(paths))
        raise OSError("OS file watch limit reached")
        yield set()  # pragma: no cover - makes this an async generator

    recorder = Recorder()
    watcher = Watcher(
        home, recorder, settle_seconds=30.0, recheck_seconds=0.05, watch_factory=broken
    )
    with capture_logs() as logs, anyio.fail_after(5):
        async with anyio.create_task_group() as tg:
            await tg.start(watcher.run)
            while not attempts:
                await anyio.sleep(0.01)
            (home / "tools" / "a" / "tools.json").write_text('{"runner": "exec"}')
            await recorder.wait_for(None)
            tg.cancel_scope.cancel()
    warnings = [entry for entry in logs if entry["event"] == "watch_unavailable"]
    assert len(warnings) == 1
    assert warnings[0]["error"] == "OSError"
    assert warnings[0]["log_level"] == "warning"


async def test_a_change_made_while_a_watch_failed_to_start_is_probed_at_once(
    layout: Layout,
) -> None:
    """A watch that fails as it starts (a folder it was to watch vanished meanwhile: a
    project's ``.crystal/tools`` removed while its watch process started) took in what
    changed during its start only at the next poll, ``recheck_seconds`` later: a watch
    process's start takes a while, and under load the removal's reload waited for the
    poll. The failure is now followed by a probe at once."""
    home, _ = layout
    manifest = home / "tools" / "a" / "tools.json"

    async def vanished(*paths: Path, **kwargs: Any) -> AsyncIterator[Batch]:
        # Past the probe a restart schedules (0.25 s), as a slow start is: what changes
        # now is seen by no event and no probe yet.
        await anyio.sleep(0.5)
        manifest.write_text('{"runner": "exec"}')
        raise FileNotFoundError("No such file or directory (os error 2)")
        yield set()  # pragma: no cover - makes this an async generator

    recorder = Recorder()
    watcher = Watcher(
        home, recorder, settle_seconds=60.0, recheck_seconds=60.0, retry_seconds=60.0,
        watch_factory=vanished,
    )
    with anyio.fail_after(20):
        async with anyio.create_task_group() as tg:
            await tg.start(watcher.run)
            await recorder.wait_for(None)
            tg.cancel_scope.cancel()


async def _watch_until(
    home: Path,
    factory: Any,
    until: anyio.Event,
    recheck_seconds: float = 60.0,
    linger: float = 0,
    retry_seconds: float = 60.0,
) -> list[dict[str, Any]]:
    """Run a watcher over ``factory`` (its settle and, unless told, its retry a minute
    long) until ``until`` is set, and ``linger`` seconds more; returns what it logged."""
    watcher = Watcher(
        home, Recorder(), settle_seconds=60.0, recheck_seconds=recheck_seconds,
        retry_seconds=retry_seconds, watch_factory=factory,
    )
    with capture_logs() as logs, anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            await tg.start(watcher.run)
            await until.wait()
            await anyio.sleep(linger)
            tg.cancel_scope.cancel()
    return [dict(entry) for entry in logs]


@pytest.mark.parametrize("how", ["removed", "made again"])
async def test_a_folder_gone_as_its_watch_starts_restarts_the_watch_quietly(
    layout: Layout, how: str
) -> None:
    """A folder the probe listed and that went before the watch process watched it (a
    deploy's ``rm -rf`` then ``mv``, a checkout, while a restart was under way) failed
    the watch with FileNotFoundError: ``watch_unavailable`` warned of a watch that a
    fresh probe starts at once, and the daemon sat on the poll until a poll saw the
    folders move, or for 30 s where the folder came back under its inode number. The
    watch is started again over a fresh probe within a second (``watch_restarted``)."""
    home, _ = layout
    set_dir = home / "tools" / "a"
    calls: list[tuple[Path, ...]] = []
    again = anyio.Event()

    async def racing(*paths: Path, stop_event: anyio.Event, **kwargs: Any) -> AsyncIterator[Batch]:
        calls.append(paths)
        if len(calls) == 2:
            again.set()
        if len(calls) == 1:
            shutil.rmtree(set_dir)
            if how == "made again":
                set_dir.mkdir()
            raise FileNotFoundError(f"No such file or directory (os error 2) about [{set_dir}]")
        await stop_event.wait()
        yield set()  # pragma: no cover - makes this an async generator

    logs = await _watch_until(home, racing, again)
    events = [e["event"] for e in logs if e["event"].startswith("watch_")]
    assert "watch_unavailable" not in events
    assert "watch_restarted" in events
    assert (set_dir in calls[1]) == (how == "made again")


async def _racing_a_long_rm(home: Path, still: int) -> tuple[list[str], int]:
    """Start after start racing a ``rm -rf`` that removes one more folder each time (2 x
    ``_GONE_RESTARTS`` of them), then ``still`` failures with nothing moved (a folder gone
    and made again under its inode number), then a watch that works (an unavailable one
    is retried at once). Returns the events logged and how many starts there were."""
    doomed = [home / "tools" / f"s{n}" for n in range(2 * _GONE_RESTARTS)]
    for folder in doomed:
        folder.mkdir()
    calls: list[tuple[Path, ...]] = []
    watching = anyio.Event()

    async def removing(
        *paths: Path, stop_event: anyio.Event, **kwargs: Any
    ) -> AsyncIterator[Batch]:
        calls.append(paths)
        if doomed:
            shutil.rmtree(doomed.pop())  # the rm -rf got one folder further
            raise FileNotFoundError("No such file or directory (os error 2)")
        if len(calls) <= 2 * _GONE_RESTARTS + still:  # nothing moved
            raise FileNotFoundError("No such file or directory (os error 2)")
        watching.set()
        await stop_event.wait()
        yield set()  # pragma: no cover - makes this an async generator

    logs = await _watch_until(home, removing, watching, recheck_seconds=0.05, retry_seconds=0.1)
    return [e["event"] for e in logs], len(calls)


async def test_folders_gone_at_start_after_start_while_they_move_restart_quietly(
    layout: Layout,
) -> None:
    """A long ``rm -rf`` of a big root races every start of the watch: each probe lists
    folders that are gone by the time the watch process watches them. While the folders
    keep moving, each such failure restarts the watch quietly; counted as a folder that
    stands still, the fourth in a row warned ``watch_unavailable`` in the middle of it."""
    home, _ = layout
    events, starts = await _racing_a_long_rm(home, still=0)
    assert "watch_unavailable" not in events
    assert starts == 2 * _GONE_RESTARTS + 1


async def test_starts_that_raced_moving_folders_leave_the_bound_for_still_ones_whole(
    layout: Layout,
) -> None:
    """The bound of ``_GONE_RESTARTS`` quiet restarts holds for failures while the folders
    stand still (docs/operations.md). The starts that raced a long ``rm -rf`` counted
    towards it too: once the removal was over, the next failure whose folder stands
    still (made again under its inode number) warned ``watch_unavailable`` at once, and
    the daemon sat on its poll for ``retry_seconds``."""
    home, _ = layout
    events, starts = await _racing_a_long_rm(home, still=_GONE_RESTARTS - 1)
    assert "watch_unavailable" not in events
    assert starts == 3 * _GONE_RESTARTS


async def test_a_folder_gone_at_every_start_makes_the_watch_unavailable(layout: Layout) -> None:
    """A watch that fails with FileNotFoundError start after start is no race with a
    folder that went: after a few quiet restarts it is unavailable (``watch_unavailable``,
    the poll serving, a retry every ``retry_seconds``), not restarted every second."""
    home, _ = layout
    attempts: list[int] = []
    warned = anyio.Event()  # the start after the quiet restarts: it warns

    async def gone(*paths: Path, **kwargs: Any) -> AsyncIterator[Batch]:
        attempts.append(len(paths))
        if len(attempts) == _GONE_RESTARTS + 1:
            warned.set()
        raise FileNotFoundError("No such file or directory (os error 2)")
        yield set()  # pragma: no cover - makes this an async generator

    # Polls every 0.05 s for 0.3 s after it: none restarts the watch.
    logs = await _watch_until(home, gone, warned, recheck_seconds=0.05, linger=0.3)
    assert len(attempts) == _GONE_RESTARTS + 1
    events = [e["event"] for e in logs if e["event"] in {"watch_restarted", "watch_unavailable"}]
    assert events == ["watch_restarted", "watch_unavailable"]  # restarts said once a minute


async def test_a_retry_of_an_unavailable_watch_does_not_say_it_started(layout: Layout) -> None:
    """With the watch limit reached, every retry (every 30 s) logged ``watch_started`` at
    info before failing again at debug: the last line an operator read said the watch had
    started while the daemon ran on the stat poll alone. A retry is logged at debug; the
    watch is said to have started again once it reports a change."""
    home, _ = layout
    attempts: list[int] = []
    works = anyio.Event()

    async def limited(*paths: Path, stop_event: anyio.Event, **kwargs: Any) -> AsyncIterator[Batch]:
        attempts.append(len(paths))
        if not works.is_set():
            raise OSError("OS file watch limit reached")
        yield {(Change.modified, str(home / "tools" / "a" / "tools.json"))}
        await stop_event.wait()

    recorder = Recorder()
    watcher = Watcher(
        home, recorder, settle_seconds=30.0, recheck_seconds=30.0, retry_seconds=0.01,
        watch_factory=limited,
    )
    with capture_logs() as logs, anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            await tg.start(watcher.run)
            while len(attempts) < 5:
                await anyio.sleep(0.01)
            watch = {"watch_started", "watch_unavailable", "watch_retry", "watch_retry_failed"}
            failing = [e["event"] for e in logs if e["event"] in watch]
            works.set()
            await recorder.wait_for(None)
            tg.cancel_scope.cancel()
    assert failing[:2] == ["watch_started", "watch_unavailable"]
    assert "watch_started" not in failing[2:]
    assert {"watch_retry", "watch_retry_failed"} >= set(failing[2:])
    after = [e for e in logs if e["event"] == "watch_started"][1:]
    assert [e["log_level"] for e in after] == ["info"]


async def test_watch_unavailable_names_the_failure_a_task_group_wrapped(layout: Layout) -> None:
    """watchfiles raises what its watch thread raised from inside a task group, so a watch
    that fails once running arrives as an ExceptionGroup: ``watch_unavailable`` said
    ``ExceptionGroup`` / ``unhandled errors in a TaskGroup (1 sub-exception)``, which tells
    the operator nothing. It names the exception inside."""
    home, _ = layout
    attempts: list[int] = []

    async def failing(*paths: Path, **kwargs: Any) -> AsyncIterator[Batch]:
        attempts.append(len(paths))
        cause = RuntimeError("error in underlying watcher: inotify queue broke")
        raise ExceptionGroup("unhandled errors in a TaskGroup (1 sub-exception)", [cause])
        yield set()  # pragma: no cover - makes this an async generator

    watcher = Watcher(
        home, Recorder(), settle_seconds=30.0, recheck_seconds=30.0, watch_factory=failing
    )
    with capture_logs() as logs, anyio.fail_after(5):
        async with anyio.create_task_group() as tg:
            await tg.start(watcher.run)
            while not attempts:
                await anyio.sleep(0.01)
            tg.cancel_scope.cancel()
    warnings = [entry for entry in logs if entry["event"] == "watch_unavailable"]
    assert [(w["error"], w["message"]) for w in warnings] == [
        ("RuntimeError", "error in underlying watcher: inotify queue broke")
    ]


async def test_watcher_survives_on_change_failure(layout: Layout, fake: FakeWatch) -> None:
    """An exception from on_change is logged and later batches are still delivered."""
    home, _workspace = layout
    calls: list[dict[ReloadKey, Any]] = []
    delivered = anyio.Event()

    async def flaky(keys: dict[ReloadKey, Any]) -> None:
        calls.append(keys)
        if len(calls) == 1:
            raise RuntimeError("reload broke")
        delivered.set()

    watcher = Watcher(home, flaky, settle_seconds=30.0, recheck_seconds=30.0, watch_factory=fake)
    with capture_logs() as logs, anyio.fail_after(5):
        async with anyio.create_task_group() as tg:
            await tg.start(watcher.run)
            await fake.started.wait()
            await fake.send.send({(Change.modified, str(home / "config.json"))})
            while not calls:
                await anyio.sleep(0.01)
            await fake.send.send({(Change.modified, str(home / "config.json"))})
            await delivered.wait()
            tg.cancel_scope.cancel()
    assert [entry["event"] for entry in logs].count("watch_reload_failed") == 1


async def _poke_until(recorder: Recorder, key: ReloadKey, manifest: Path) -> None:
    """Rewrite ``manifest`` until a call holding ``key`` follows (covers a watch still starting)."""
    for attempt in range(40):
        since = len(recorder.calls)
        manifest.write_text(f'{{"attempt": {attempt}}}')
        with anyio.move_on_after(0.5):
            await recorder.wait_for(key, since)
            return
    pytest.fail(f"no reload of {key} after rewriting {manifest}")


@pytest.mark.slow
async def test_watcher_follows_real_filesystem_changes(layout: Layout) -> None:
    """Real watchfiles: home and late project sets are seen; data and removed workspaces not."""
    home, workspace = layout
    recorder = Recorder()
    # Long settle and recheck: every call below comes from a file event, not from a timer.
    watcher = Watcher(home, recorder, debounce_ms=50, settle_seconds=60.0, recheck_seconds=60.0)
    watcher.add_workspace(workspace)
    project = workspace / ".crystal" / "tools"
    with anyio.fail_after(15):
        async with anyio.create_task_group() as tg:
            await tg.start(watcher.run)
            await _poke_until(recorder, None, home / "tools" / "a" / "tools.json")

            since = len(recorder.calls)
            (project / "p").mkdir(parents=True)  # the project root did not exist at start
            (project / "p" / "tools.json").write_text("{}")
            await recorder.wait_for(workspace, since)
            assert not recorder.seen(None, since)
            # Modifying the manifest is only visible to a watch that now covers the new set dir.
            await _poke_until(recorder, workspace, project / "p" / "tools.json")

            since = len(recorder.calls)
            shutil.rmtree(project)
            await recorder.wait_for(workspace, since)

            since = len(recorder.calls)
            watcher.remove_workspace(workspace)
            (project / "q").mkdir(parents=True)
            (project / "q" / "tools.json").write_text("{}")
            (home / "data" / "tools" / "x").mkdir(parents=True)
            (home / "data" / "tools" / "x" / "file").write_text("runtime data")
            await anyio.sleep(1.0)  # a bounded wait for calls that must not come
            assert recorder.calls[since:] == []

            await _poke_until(recorder, None, home / "tools" / "a" / "tools.json")  # still alive
            tg.cancel_scope.cancel()
            cancelled_at = anyio.current_time()
    assert anyio.current_time() - cancelled_at < 2.0


async def _polls_after_the_first_timed_one(
    watcher: Watcher, fake: FakeWatch, seconds: float
) -> int:
    """Run ``watcher`` until its first timed poll (the one after the baseline), then
    ``seconds`` more; how many polls ran."""
    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            await tg.start(watcher.run)
            await fake.wait_calls(1)
            while watcher.polls < 2:
                await anyio.sleep(0.01)
            await anyio.sleep(seconds)
            tg.cancel_scope.cancel()
    return watcher.polls


async def test_watcher_polls_no_more_often_than_its_cost_allows(
    layout: Layout, fake: FakeWatch
) -> None:
    """A poll that cost a lot defers the next one (a tools root of 100,000 folders).

    The clock says each poll took a second, so the next may not start for twenty: with
    a recheck period of 10 ms, only the baseline and the first timed poll run.
    """
    home, _ = layout
    ticks = iter(range(1_000_000))
    watcher = _fake_watcher(
        home, Recorder(), fake, recheck_seconds=0.01, clock=lambda: float(next(ticks))
    )
    assert await _polls_after_the_first_timed_one(watcher, fake, 0.5) == 2  # 50 periods


async def test_watcher_counts_a_poll_blocked_on_a_slow_file_system_as_its_cost(
    layout: Layout, fake: FakeWatch, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A probe that waits on its file system (a network or FUSE mount's ``stat``, here a
    sleep) costs that wait: paced by its thread's CPU time alone, which such a wait does
    not use, the polls ran back to back against the server. With a recheck period of
    10 ms and a probe of 0.2 s, only the baseline and the first timed poll run."""
    import time

    from toolsetd.daemon import watcher as watcher_module

    real = watcher_module._probe_all

    def slow(*args: Any) -> Any:
        time.sleep(0.2)
        return real(*args)

    monkeypatch.setattr(watcher_module, "_probe_all", slow)
    home, _ = layout
    watcher = _fake_watcher(home, Recorder(), fake, recheck_seconds=0.01)
    # A hundred recheck periods, five probes' time.
    assert await _polls_after_the_first_timed_one(watcher, fake, 1.0) == 2


class _StartingWatch:
    """A watch process's iterator: ``on_start`` runs as it starts watching (``established``),
    then ``on_watch`` runs as its batches are waited for; it reports none."""

    def __init__(
        self, stop: anyio.Event, on_start: Callable[[], None], on_watch: Callable[[], Awaitable[None]]
    ) -> None:
        self._stop = stop
        self._on_start = on_start
        self._on_watch = on_watch

    def __aiter__(self) -> _StartingWatch:
        return self

    async def established(self) -> None:
        self._on_start()

    async def __anext__(self) -> Batch:
        await self._on_watch()
        await self._stop.wait()
        raise StopAsyncIteration

    async def aclose(self) -> None:
        pass


async def test_an_edit_made_while_a_watch_restarts_is_sent_once_it_watches(
    layout: Layout,
) -> None:
    """What changed while a watch restarted is seen by no event: the probe made once the
    new watch watches takes it in. That probe waited out the poll's pace (twenty times
    what the last poll took), so over a big root (20,000 sets: 0.5 s a poll, 10 s of pace)
    whatever changed during a restart, or during a run of starts racing a ``rm -rf``,
    stayed out of the catalog that long. It runs at once: a restart costs a probe anyway."""
    home, _ = layout
    manifest = home / "tools" / "a" / "tools.json"
    ticks = iter(range(0, 10**9, 1000))  # every poll seems to take 1,000 s: a long pace
    watcher: Watcher
    starts: list[int] = []

    async def then_fail() -> None:
        if len(starts) == 1:  # the first watch: ended (as by a name it cannot decode)
            while watcher.polls_ended < 2:  # once a poll set the pace
                await anyio.sleep(0.01)
            raise RuntimeError("Unable to decode path b'caf\\xe9'")

    def factory(*paths: Path, stop_event: anyio.Event, **kwargs: Any) -> _StartingWatch:
        def start() -> None:
            starts.append(1)
            if len(starts) == 2:  # an edit while the second watch started
                manifest.write_text('{"runner": "exec"}')

        return _StartingWatch(stop_event, start, then_fail)

    recorder = Recorder()
    watcher = Watcher(
        home, recorder, settle_seconds=60.0, recheck_seconds=60.0, retry_seconds=60.0,
        watch_factory=factory, clock=lambda: next(ticks),
    )
    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            await tg.start(watcher.run)
            await recorder.wait_for(None)
            tg.cancel_scope.cancel()
    assert len(starts) == 2


async def test_watcher_reloads_a_workspace_changed_before_its_first_probe(
    layout: Layout, fake: FakeWatch
) -> None:
    """An edit between a workspace's build and its first probe is reloaded, not absorbed.

    The daemon builds a workspace's catalog, then adds it; its first probe comes a poll
    later (with a costly root, twenty times the last poll's cost later). Taken as the
    baseline, that probe held the edit, and no poll ever reported it: the catalog kept
    the old manifest until some other change.
    """
    home, workspace = layout
    recorder = Recorder()
    watcher = _fake_watcher(home, recorder, fake, recheck_seconds=0.05)
    with anyio.fail_after(5):
        async with anyio.create_task_group() as tg:
            await tg.start(watcher.run)
            await fake.wait_calls(1)
            watcher.add_workspace(workspace)  # its catalog was built just now
            manifest = workspace / ".crystal" / "tools" / "p" / "tools.json"
            manifest.parent.mkdir(parents=True)
            manifest.write_text("{}")  # edited before the watcher probed it
            await recorder.wait_for(workspace)
            tg.cancel_scope.cancel()


async def test_an_edit_made_after_the_daemon_built_its_catalog_is_sent(
    layout: Layout, fake: FakeWatch
) -> None:
    """The daemon builds the home catalog in ``run``'s ``prepare``, after the baseline
    probe, so an edit made between that build and the watch starting is sent, whole.

    Built before the watcher's first probe (as it was), the catalog held the old manifest
    while that probe took the edit in as the baseline: unsent until some later home event,
    and never if none came.
    """
    home, _ = layout
    manifest = home / "tools" / "a" / "tools.json"
    recorder = Recorder()
    watcher = _fake_watcher(home, recorder, fake, recheck_seconds=0.05)
    order: list[int] = []

    async def build() -> None:
        order.append(watcher.polls)  # the baseline was taken before the build
        manifest.write_text('{"edited": true}')  # ... and this edit comes after it

    with anyio.fail_after(5):
        async with anyio.create_task_group() as tg:
            await tg.start(partial(watcher.run, prepare=build))
            await recorder.wait_for(None)
            tg.cancel_scope.cancel()
    assert order == [1]
    assert recorder.changes[0] == {None: None}


#: The bound of a test that waits for several polls: each waits out twenty times the last
#: one's cost, and on a loaded machine a probe's thread hop alone takes tens of ms.
_POLLS_SECONDS = 30


async def _until_polled(watcher: Watcher, count: int) -> None:
    while watcher.polls < count:
        await anyio.sleep(0.01)


def _held_probes(
    monkeypatch: pytest.MonkeyPatch, seconds: float
) -> tuple[list[bool], threading.Event]:
    """Make every probe, once ``slow[0]`` is set, set ``held`` and take ``seconds`` more
    in its thread (a slow file system); returns ``(slow, held)``."""
    import time

    from toolsetd.daemon import watcher as watcher_module

    real = watcher_module._probe_all
    slow = [False]
    held = threading.Event()

    def probe(*args: Any) -> Any:
        if slow[0]:
            held.set()
            time.sleep(seconds)
        return real(*args)

    monkeypatch.setattr(watcher_module, "_probe_all", probe)
    return slow, held


async def _started(tg: Any, watcher: Watcher, fake: FakeWatch) -> None:
    """Start ``watcher`` in ``tg`` and wait for its watch and the end of the poll a quarter
    second after. Its start is not enough: its probe, late in its thread on a loaded
    machine, took in the test's next writes and sent them as a poll's whole scan."""
    await tg.start(watcher.run)
    await fake.started.wait()
    while watcher.polls_ended < 2:
        await anyio.sleep(0.01)


async def _reported(watcher: Watcher, fake: FakeWatch) -> None:
    """Have the fake awatch report a change that maps to nothing, and wait until status
    says it watches: a factory that cannot tell when it watches is taken to from its first
    change on."""
    await fake.send.send({(Change.modified, str(watcher._home / "unrelated"))})
    while watcher.status()["state"] != "watching":
        await anyio.sleep(0.01)


async def test_watcher_names_the_set_a_change_lies_in(layout: Layout, fake: FakeWatch) -> None:
    """A write inside a set folder is sent with that set named, so the reload stats it
    alone; but not on the key's first delivery (a workspace's scan predates the watcher's
    first probe of it, and home is treated alike), and not for the set folder itself, a root or ``config.json``. Only a change
    that may add or remove a folder to watch probes everything at once."""
    home, _ = layout
    tools = home / "tools"
    manifest = str(tools / "a" / "tools.json")
    recorder = Recorder()
    watcher = _fake_watcher(home, recorder, fake)
    with anyio.fail_after(5):
        async with anyio.create_task_group() as tg:
            await _started(tg, watcher, fake)
            for batch in (
                {(Change.modified, manifest)},
                {(Change.modified, manifest), (Change.added, str(tools / "a" / "x.tmp"))},
            ):
                await fake.send.send(batch)
                await recorder.wait_for(None, since=len(recorder.calls))
            await anyio.sleep(0.2)
            assert watcher.polls == 2  # entries of a set folder: no folder came or went
            for raw in (str(tools / "a"), str(home / "config.json"), str(tools)):
                await fake.send.send({(Change.modified, raw)})
                await recorder.wait_for(None, since=len(recorder.calls))
            await _until_polled(watcher, 3)
            tg.cancel_scope.cancel()
    assert recorder.changes == [
        {None: None},
        {None: frozenset({(str(tools), "a")})},
        {None: None},
        {None: None},
        {None: None},
    ]


async def test_a_big_batch_is_mapped_off_the_event_loop(layout: Layout, fake: FakeWatch) -> None:
    """A batch of thousands of changes (a ``rm -rf`` or a checkout of a big tools root) is
    mapped to its reload keys in a worker thread: on the loop, 40,000 changes held every
    client for 0.8 s. A small batch is still mapped where it came.

    Seen from the home given to the watcher, a ``Path`` all the same: the walk compares
    each changed path with the home's ``tools`` and ``config.json``, and a subclass's
    ``__eq__`` is Python's first choice for that comparison, so the home sees where each
    of a batch's paths is compared. The big batch's first comparison then waits for the
    test's event loop to answer it: a walk on the loop would wait in vain."""
    home, _ = layout
    seen: dict[str, set[bool]] = {}
    walking, answered = threading.Event(), threading.Event()
    waited: list[bool] = []

    class Home(PosixPath):
        __hash__ = PosixPath.__hash__

        def __eq__(self, other: object) -> bool:
            if isinstance(other, PurePath) and other.name == "tools.json":
                batch = other.parent.name.rstrip("0123456789")  # "small" or "big"
                on_loop = threading.current_thread() is threading.main_thread()
                seen.setdefault(batch, set()).add(on_loop)
                if batch == "big" and not walking.is_set():
                    walking.set()
                    waited.append(answered.wait(10))
            return super().__eq__(other)

    async def answer_the_walk() -> None:
        while not walking.is_set():
            await anyio.sleep(0.005)
        answered.set()

    recorder = Recorder()
    watcher = _fake_watcher(Home(home), recorder, fake)
    tools = home / "tools"
    with anyio.fail_after(30):
        async with anyio.create_task_group() as tg:
            await _started(tg, watcher, fake)
            tg.start_soon(answer_the_walk)
            for name, size in (("small", 3), ("big", 5000)):
                batch = {(Change.deleted, str(tools / f"{name}{n}" / "tools.json"))
                         for n in range(size)}
                await fake.send.send(batch)
                await recorder.wait_for(None, since=len(recorder.calls))
            tg.cancel_scope.cancel()
    assert seen == {"small": {True}, "big": {False}}
    assert waited == [True], "the event loop did not run while the big batch was mapped"


async def test_the_folders_to_watch_are_worked_out_off_the_event_loop(
    layout: Layout, fake: FakeWatch, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Which folders to watch under the bound (``_watched``) is a walk of every set folder,
    taken at each watch start and each poll: on the loop, 190,000 folders past the bound
    held every client ~0.1 s a poll. It is worked out in the probe's worker thread."""
    from toolsetd.daemon import watcher as watcher_module

    home, workspace = layout
    on_loop: list[bool] = []
    real = watcher_module._watched

    def spied(*args: Any) -> Any:
        on_loop.append(threading.current_thread() is threading.main_thread())
        return real(*args)

    monkeypatch.setattr(watcher_module, "_watched", spied)
    recorder = Recorder()
    watcher = _fake_watcher(home, recorder, fake, max_watches=2)
    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            await _started(tg, watcher, fake)
            watcher.add_workspace(workspace)  # polls at once, and restarts the watch
            await recorder.wait_for(workspace)
            while watcher.polls_ended < 3:
                await anyio.sleep(0.01)
            tg.cancel_scope.cancel()
    assert len(on_loop) >= 3  # two watch starts and the polls
    assert not any(on_loop), on_loop


async def test_status_counts_the_set_folders_past_the_bound_as_they_come_and_go(
    layout: Layout, fake: FakeWatch
) -> None:
    """Set folders past the bound that come or go leave the folders watched as they are
    (those watched sort first), so no new watch starts: status (and with it the metrics
    and systemd's STATUS= line) kept the count of the watch's start, 'past the bound' with
    none left. The poll that finds them counts them again."""
    home, _workspace = layout
    tools = home / "tools"
    for name in ("b", "c"):
        (tools / name).mkdir()
    recorder = Recorder()
    # The home, its tools root and "a"; a poll every 50 ms.
    watcher = _fake_watcher(home, recorder, fake, max_watches=3, recheck_seconds=0.05)

    async def polled() -> None:  # a poll begun after the folders changed has ended
        ended = watcher.polls_ended
        while watcher.polls_ended < ended + 2:
            await anyio.sleep(0.01)

    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            await _started(tg, watcher, fake)
            await _reported(watcher, fake)
            assert (watcher.status()["watched"], watcher.status()["pastCap"]) == (3, 2)
            (tools / "d").mkdir()
            await polled()
            assert watcher.status()["pastCap"] == 3
            for name in ("b", "c", "d"):
                (tools / name).rmdir()
            await polled()
            assert (watcher.status()["watched"], watcher.status()["pastCap"]) == (3, 0)
            assert len(fake.calls) == 1  # the same watch all along
            tg.cancel_scope.cancel()


async def test_the_bound_counts_a_folder_reached_by_two_names_as_one_watch(
    tmp_path: Path, fake: FakeWatch
) -> None:
    """inotify holds one watch per directory, however many paths reach it. A workspace
    whose ``.crystal`` is a link to the home (the user's home as a project, its
    ``~/.crystal`` linked to the daemon's home) names the home, its root and every set
    folder twice: counted by path, the bound left half of them "past --max-watches" and
    status said so, though each was watched under its other name."""
    home, user = tmp_path / "home", tmp_path / "user"
    for index in range(3):
        (home / "tools" / f"s{index}").mkdir(parents=True)
    user.mkdir()
    (user / ".crystal").symlink_to(home)
    recorder = Recorder()
    # The home, its root and three set folders: five watches, under two names each.
    watcher = _fake_watcher(home, recorder, fake, max_watches=5)
    watcher.add_workspace(user)
    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            await _started(tg, watcher, fake)
            await _reported(watcher, fake)
            status = watcher.status()
            tg.cancel_scope.cancel()
    assert (status["watched"], status["pastCap"]) == (5, 0)
    shared = user / ".crystal" / "tools"
    assert set(fake.calls[0][0]) >= {shared / f"s{index}" for index in range(3)}


class _HeldWatch(_StartingWatch):
    """A watch process's iterator that says it watches only once ``go`` is set."""

    def __init__(self, stop: anyio.Event, go: anyio.Event) -> None:
        super().__init__(stop, lambda: None, _nothing)
        self._go = go

    async def established(self) -> None:
        await self._go.wait()


async def _nothing() -> None:
    return None


async def test_status_counts_no_folder_watched_while_the_watch_starts(layout: Layout) -> None:
    """Until the watch process says it watches, no folder is watched: status said
    ``starting`` with the folders it was about to watch as ``watched``, and the metrics'
    ``toolsetd_watch_folders{state="watched"}`` counted inotify watches nobody held."""
    home, _ = layout
    go = anyio.Event()
    recorder = Recorder()
    watcher = Watcher(
        home, recorder, settle_seconds=60.0, recheck_seconds=60.0,
        watch_factory=lambda *paths, stop_event, **kwargs: _HeldWatch(stop_event, go),
    )
    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            await tg.start(watcher.run)
            while watcher.polls_ended < 2:  # the baseline, and the probe after the start
                await anyio.sleep(0.01)
            starting = watcher.status()
            # One dict until what it says changes (status encodes it once per change).
            assert watcher.status() is starting
            go.set()
            while watcher.status()["state"] != "watching":
                await anyio.sleep(0.01)
            watching = watcher.status()
            tg.cancel_scope.cancel()
    assert (starting["state"], starting["watched"]) == ("starting", 0)  # not changed in place
    assert watching["watched"] == 3  # the home, its root and its one set folder


async def test_a_change_no_event_reported_is_still_sent_by_the_poll(
    layout: Layout, fake: FakeWatch
) -> None:
    """Before a key is sent with its sets named, only those sets are probed again: a
    change elsewhere that no event reported (a lost notification, a symlinked manifest
    edited elsewhere) stays out of the baseline, and the next poll sends the key with no
    set named, which scans everything. Probed whole, the baseline took that change in
    while the reload looked at the named set alone, and nothing ever sent it."""
    home, workspace = layout
    tools = home / "tools"
    (tools / "b").mkdir()
    (tools / "b" / "tools.json").write_text("{}")
    recorder = Recorder()
    watcher = _fake_watcher(home, recorder, fake)
    with anyio.fail_after(5):
        async with anyio.create_task_group() as tg:
            await _started(tg, watcher, fake)
            await fake.send.send({(Change.modified, str(tools / "a" / "tools.json"))})
            await recorder.wait_for(None)
            (tools / "b" / "tools.json").write_text('{"unreported": true}')
            (tools / "a" / "tools.json").write_text('{"reported": true}')
            await fake.send.send({(Change.modified, str(tools / "a" / "tools.json"))})
            await recorder.wait_for(None, since=1)
            watcher.add_workspace(workspace)  # polls at once
            await recorder.wait_for(workspace, since=2)
            tg.cancel_scope.cancel()
    assert recorder.changes[1] == {None: frozenset({(str(tools), "a")})}
    assert recorder.changes[2] == {None: None, workspace: None}


def _reload_failing_at(
    *numbers: int,
) -> tuple[list[dict[ReloadKey, Any]], Callable[[dict[ReloadKey, Any]], Awaitable[None]]]:
    """An ``on_change`` that records each call and raises on the calls numbered
    ``numbers`` (the first is 1); returns the calls and it."""
    calls: list[dict[ReloadKey, Any]] = []

    async def on_change(keys: dict[ReloadKey, Any]) -> None:
        calls.append(keys)
        if len(calls) in numbers:
            raise RuntimeError(f"reload broke ({len(calls)})")

    return calls, on_change


async def test_a_key_whose_reload_failed_is_scanned_whole_next_time(
    layout: Layout, fake: FakeWatch
) -> None:
    """A failed reload loses what its report named (the baseline already took it in), so
    the key's deliveries name no set, and everything is looked at again, until a poll has
    probed it anew (and sent it again: the next test)."""
    home, _ = layout
    manifest = str(home / "tools" / "a" / "tools.json")
    calls, flaky = _reload_failing_at(2)
    watcher = Watcher(home, flaky, settle_seconds=30.0, recheck_seconds=30.0, watch_factory=fake)
    with anyio.fail_after(5):
        async with anyio.create_task_group() as tg:
            # Past the poll a quarter second after the watch started: taken after the
            # failure, it sent the key whole and confirmed it, and the events after it
            # named the set (a slow run failed the test).
            await _started(tg, watcher, fake)
            for count in (1, 2, 3, 4):
                await fake.send.send({(Change.modified, manifest)})
                while len(calls) < count:
                    await anyio.sleep(0.01)
            tg.cancel_scope.cancel()
    named = {None: frozenset({(str(home / "tools"), "a")})}
    assert calls == [{None: None}, named, {None: None}, {None: None}]


async def test_a_failed_reload_is_sent_again_by_the_next_poll(
    layout: Layout, fake: FakeWatch
) -> None:
    """A failed reload lost its change (the baselines took it in), and no event may ever
    name it again: the next poll sends the key again, whole. Once that succeeds, the
    polls after it send nothing, and an event names its set again."""
    home, _ = layout
    manifest = str(home / "tools" / "a" / "tools.json")
    calls, flaky = _reload_failing_at(1)
    watcher = Watcher(home, flaky, settle_seconds=30.0, recheck_seconds=0.05, watch_factory=fake)
    with anyio.fail_after(_POLLS_SECONDS):
        async with anyio.create_task_group() as tg:
            await tg.start(watcher.run)
            await fake.started.wait()
            await fake.send.send({(Change.modified, manifest)})
            while len(calls) < 2:
                await anyio.sleep(0.01)
            polls = watcher.polls
            await _until_polled(watcher, polls + 3)
            await fake.send.send({(Change.modified, manifest)})
            while len(calls) < 3:
                await anyio.sleep(0.01)
            tg.cancel_scope.cancel()
    named = {None: frozenset({(str(home / "tools"), "a")})}
    assert calls == [{None: None}, {None: None}, named]


async def test_a_reload_failing_at_every_poll_is_logged_once_a_minute(
    layout: Layout, fake: FakeWatch
) -> None:
    """A reload that keeps failing is tried at every poll, but logged once a minute."""
    home, _ = layout
    calls: list[dict[ReloadKey, Any]] = []

    async def broken(keys: dict[ReloadKey, Any]) -> None:
        calls.append(keys)
        raise RuntimeError("reload broke")

    watcher = Watcher(home, broken, settle_seconds=30.0, recheck_seconds=0.05, watch_factory=fake)
    with capture_logs() as logs, anyio.fail_after(_POLLS_SECONDS):
        async with anyio.create_task_group() as tg:
            await tg.start(watcher.run)
            await fake.started.wait()
            await fake.send.send({(Change.modified, str(home / "config.json"))})
            while len(calls) < 4:
                await anyio.sleep(0.01)
            tg.cancel_scope.cancel()
    failed = [entry for entry in logs if entry["event"] == "watch_reload_failed"]
    assert [(entry["error"], entry["failures"]) for entry in failed] == [("RuntimeError", 1)]


async def test_a_home_change_names_no_set_while_a_workspace_was_never_scanned_whole(
    layout: Layout, fake: FakeWatch, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A home change reloads every snapshot, and a workspace's own sets are only ever named
    under its own key: while a followed workspace has had no full scan since it was added
    (its first poll is still running, here held on a slow file system), a home change
    names no set, so every snapshot is scanned whole."""
    import time

    from toolsetd.daemon import watcher as watcher_module

    real = watcher_module._probe_all
    slow = anyio.Event()

    def probe(*args: Any) -> Any:
        if slow.is_set():
            time.sleep(0.5)
        return real(*args)

    monkeypatch.setattr(watcher_module, "_probe_all", probe)
    home, workspace = layout
    manifest = str(home / "tools" / "a" / "tools.json")
    recorder = Recorder()
    watcher = _fake_watcher(home, recorder, fake)
    with anyio.fail_after(5):
        async with anyio.create_task_group() as tg:
            await _started(tg, watcher, fake)
            await fake.send.send({(Change.modified, manifest)})
            await recorder.wait_for(None)
            slow.set()
            watcher.add_workspace(workspace)  # its first poll is held for half a second
            await fake.send.send({(Change.modified, manifest)})
            await recorder.wait_for(None, since=1)
            await recorder.wait_for(workspace, since=2)
            await fake.send.send({(Change.modified, manifest)})
            await recorder.wait_for(None, since=3)
            tg.cancel_scope.cancel()
    named = {None: frozenset({(str(home / "tools"), "a")})}
    assert recorder.changes == [{None: None}, {None: None}, {workspace: None}, named]


async def test_a_workspace_added_during_a_poll_is_reloaded_whole_before_its_sets_are_named(
    layout: Layout, fake: FakeWatch, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A workspace added while a poll is in its thread keeps its "not probed yet" mark: its
    first probe sends it whole, so an edit between its build and that probe is reloaded.

    That poll probed the workspaces it started with: replacing every signature with its
    own dropped the mark, and the next poll took the edit into the baseline unsent. A home
    reload scanned whole before the edit counted the workspace as scanned whole since the
    watcher started, so its next event named one set, the registry looked at that set
    alone, and the catalog kept the old manifest for good.
    """
    import time

    from toolsetd.daemon.catalog import RACY_NS
    from toolsetd.daemon.model import DEFAULT_RESERVED_NAMES
    from toolsetd.daemon.registry import Registry

    # long enough for a home reload and an edit meanwhile
    slow, held = _held_probes(monkeypatch, 1.0)

    def write(manifest: Path, description: str) -> None:
        manifest.parent.mkdir(parents=True, exist_ok=True)
        document = {"runner": "exec", "description": description, "command": ["true"]}
        manifest.write_text(json.dumps(document | {"schema": {"type": "object"}}))

    home, workspace = layout
    project = workspace / ".crystal" / "tools"
    write(project / "p" / "tools.json", "as built")
    write(project / "q" / "tools.json", "as built")
    config = str(home / "config.json")
    # Every manifest old enough to be judged by its stat, as a minute later.
    registry = Registry(
        home, DEFAULT_RESERVED_NAMES, clock_ns=lambda: time.time_ns() + 10 * RACY_NS
    )
    await registry.catalog(None)
    recorder = Recorder()

    async def reload(changes: dict[ReloadKey, Any]) -> None:
        await registry.reload(None if None in changes else list(changes), changes)
        await recorder(changes)

    watcher = Watcher(
        home,
        reload,
        settle_seconds=30.0,
        recheck_seconds=30.0,
        watch_factory=fake,
        clock=lambda: 0.0,  # the held poll costs nothing: the next is not deferred
    )
    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            await _started(tg, watcher, fake)
            slow[0] = True
            await fake.send.send({(Change.modified, config)})  # polls at once: held
            await _until_polled(watcher, 3)
            while not held.is_set():  # the poll is in its thread
                await anyio.sleep(0.01)
            await registry.catalog(workspace)
            watcher.add_workspace(workspace)  # its catalog was built just now
            since = len(recorder.calls)
            await fake.send.send({(Change.modified, config)})  # a home reload, scanned whole
            await recorder.wait_for(None, since=since)
            write(project / "q" / "tools.json", "edited before its first probe")
            slow[0] = False
            await fake.wait_calls(2)  # the poll add_workspace asked for saw its folders
            await fake.send.send({(Change.modified, str(project / "p" / "notes.txt"))})
            first = await recorder.wait_for(workspace)
            tg.cancel_scope.cancel()
    assert recorder.changes[first][workspace] is None
    catalog = await registry.catalog(workspace)
    assert catalog.tools["q"].tool.description == "edited before its first probe"


async def test_a_workspace_added_during_a_poll_is_sent_by_its_first_probe(
    layout: Layout, fake: FakeWatch, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The poll in its thread when a workspace is added did not probe it: its signatures
    replace the others but keep that workspace's mark, so the next poll, its first probe,
    sends it (whole) instead of taking an edit made since its build into the baseline."""
    slow, held = _held_probes(monkeypatch, 0.5)
    home, workspace = layout
    recorder = Recorder()
    watcher = _fake_watcher(home, recorder, fake, clock=lambda: 0.0)
    with anyio.fail_after(5):
        async with anyio.create_task_group() as tg:
            await _started(tg, watcher, fake)
            slow[0] = True
            await fake.send.send({(Change.modified, str(home / "tools"))})  # polls at once
            await _until_polled(watcher, 3)
            while not held.is_set():  # the poll is in its thread
                await anyio.sleep(0.01)
            watcher.add_workspace(workspace)
            slow[0] = False
            manifest = workspace / ".crystal" / "tools" / "p" / "tools.json"
            manifest.parent.mkdir(parents=True)
            manifest.write_text("{}")  # edited before its first probe
            first = await recorder.wait_for(workspace)
            tg.cancel_scope.cancel()
    assert recorder.changes[first][workspace] is None


async def test_a_failed_reload_is_logged_when_the_last_one_was_retried_well(
    layout: Layout, fake: FakeWatch
) -> None:
    """Reload failures are throttled while they go on (each poll retries them); a failure
    after the reloads succeeded again is news, and logged, however soon it comes."""
    home, _ = layout
    manifest = str(home / "tools" / "a" / "tools.json")
    calls, twice_broken = _reload_failing_at(1, 3)
    watcher = Watcher(
        home, twice_broken, settle_seconds=30.0, recheck_seconds=0.05, watch_factory=fake
    )
    with capture_logs() as logs, anyio.fail_after(_POLLS_SECONDS):
        async with anyio.create_task_group() as tg:
            await tg.start(watcher.run)
            await fake.started.wait()
            await fake.send.send({(Change.modified, manifest)})
            while len(calls) < 2:  # failed, then sent again by a poll: it worked
                await anyio.sleep(0.01)
            await fake.send.send({(Change.modified, str(home / "config.json"))})
            while len(calls) < 4:  # failed, then sent again by a poll: it worked
                await anyio.sleep(0.01)
            tg.cancel_scope.cancel()
    failed = [entry for entry in logs if entry["event"] == "watch_reload_failed"]
    assert [(entry["error"], entry["failures"]) for entry in failed] == [
        ("RuntimeError", 1),
        ("RuntimeError", 1),
    ]


async def test_a_reload_failing_again_stays_throttled_while_others_work(
    layout: Layout, fake: FakeWatch
) -> None:
    """A workspace whose reload keeps failing logs once a minute, even while the reloads
    of another workspace succeed in between: only its own success ends its failures.

    Each delivery is one event's (no poll: they run every 30 s here), so the two
    workspaces are never reloaded together.
    """
    home, broken = layout
    working = broken.parent / "ws2"
    manifests = {}
    for workspace in (broken, working):
        manifest = workspace / ".crystal" / "tools" / "p" / "tools.json"
        manifest.parent.mkdir(parents=True)
        manifest.write_text("{}")
        manifests[workspace] = str(manifest)
    calls: list[dict[ReloadKey, Any]] = []

    async def on_change(keys: dict[ReloadKey, Any]) -> None:
        calls.append(keys)
        if broken in keys:
            raise RuntimeError("reload broke")

    watcher = Watcher(
        home, on_change, settle_seconds=30.0, recheck_seconds=30.0, watch_factory=fake
    )
    watcher.add_workspace(broken)
    watcher.add_workspace(working)
    with capture_logs() as logs, anyio.fail_after(5):
        async with anyio.create_task_group() as tg:
            await _started(tg, watcher, fake)
            for workspace in (broken, working, broken, working, broken):
                count = len(calls)
                await fake.send.send({(Change.modified, manifests[workspace])})
                while len(calls) == count:
                    await anyio.sleep(0.01)
            tg.cancel_scope.cancel()
    assert [set(keys) for keys in calls] == [{broken}, {working}, {broken}, {working}, {broken}]
    failed = [entry for entry in logs if entry["event"] == "watch_reload_failed"]
    assert [(entry["error"], entry["failures"]) for entry in failed] == [("RuntimeError", 1)]


async def test_watcher_a_folder_name_that_is_not_utf8_leaves_the_rest_watched(
    layout: Layout,
) -> None:
    """A set folder whose name is not UTF-8 (a cloned repository's ``.crystal/tools`` can
    hold one) cannot be handed to watchfiles, which raised UnicodeEncodeError for the whole
    watch: every catalog, the home's too, fell back to the stat poll, and each retry failed
    again. Such a folder is left to the poll; the rest is watched."""
    home, workspace = layout
    project = workspace / ".crystal" / "tools"
    project.mkdir(parents=True)
    os.mkdir(os.fsencode(project) + b"/bad\xff")
    elsewhere = Path(os.fsdecode(os.fsencode(workspace.parent) + b"/w\xe9"))  # a workspace too
    (elsewhere / ".crystal" / "tools" / "p").mkdir(parents=True)
    recorder = Recorder()
    # Long settle and recheck: the call below comes from a file event, not from a timer.
    watcher = Watcher(home, recorder, debounce_ms=50, settle_seconds=60.0, recheck_seconds=60.0)
    watcher.add_workspace(workspace)
    watcher.add_workspace(elsewhere)
    with capture_logs() as logs, anyio.fail_after(30):
        async with anyio.create_task_group() as tg:
            await tg.start(watcher.run)
            await anyio.sleep(1.0)  # past the probes that follow the watch's start
            await _poke_until(recorder, None, home / "tools" / "a" / "tools.json")
            tg.cancel_scope.cancel()
    assert [e for e in logs if e["event"] == "watch_unavailable"] == []
    # Nor does the poll, which sees that folder, take it for a new one each time and
    # restart the watch.
    watcher = Watcher(home, Recorder(), settle_seconds=60.0, recheck_seconds=0.05)
    watcher.add_workspace(workspace)
    with capture_logs() as logs, anyio.fail_after(30):
        async with anyio.create_task_group() as tg:
            await tg.start(watcher.run)
            while watcher.polls < 10:
                await anyio.sleep(0.05)
            tg.cancel_scope.cancel()
    assert len([e for e in logs if e["event"] == "watch_started"]) == 1
async def test_a_name_that_is_not_utf8_made_while_watching_keeps_the_watch(
    layout: Layout,
) -> None:
    """Real watchfiles: a folder named in Latin-1 made in a watched tools root (a checkout
    or a pull that brings one), or such a file written in a set folder, is an event whose
    path watchfiles cannot decode: its watch thread raises, and the awatch ends. The
    watcher took that for a watch that cannot start: ``watch_unavailable``, and only the
    stat poll (every 2 s) until the retry 30 s later, so every edit in that time waited
    for the poll. The watch itself works: it is started again at once, and the probe after
    its start takes in what the lost batch held."""
    home, _ = layout
    tools = home / "tools"
    recorder = Recorder()
    # Long settle, recheck and retry: the calls below come from file events alone.
    watcher = Watcher(
        home, recorder, debounce_ms=50, settle_seconds=60.0, recheck_seconds=60.0,
        retry_seconds=60.0,
    )
    manifest = tools / "a" / "tools.json"
    with capture_logs() as logs, anyio.fail_after(60):
        async with anyio.create_task_group() as tg:
            await tg.start(watcher.run)
            await anyio.sleep(1.0)  # past the probes that follow the watch's start
            await _poke_until(recorder, None, manifest)
            for bad in (os.fsencode(tools) + b"/caf\xe9", os.fsencode(tools / "a") + b"/n\xff"):
                if bad.endswith(b"\xe9"):
                    os.mkdir(bad)
                else:
                    with open(bad, "wb"):
                        pass
                await anyio.sleep(1.0)  # the batch that held it, and the probe after it
                await _poke_until(recorder, None, manifest)
            tg.cancel_scope.cancel()
    assert [e for e in logs if e["event"] == "watch_unavailable"] == []
    restarts = [e for e in logs if e["event"] == "watch_restarted"]
    assert [e["restarts"] for e in restarts] == [1]  # the second within the minute: counted
    assert restarts[0]["message"].startswith("Unable to decode path")
    # A restart is said by watch_restarted alone, at most once a minute: watch_started at
    # each one was a line a second for a tool rewriting such a file.
    assert len([e for e in logs if e["event"] == "watch_started"]) == 1


def _exchange(a: Path, b: Path) -> None:
    """Swap two directories in one step (``renameat2(RENAME_EXCHANGE)``): neither path is
    ever missing, so no probe can see a folder go."""
    libc = ctypes.CDLL(None, use_errno=True)
    at_fdcwd, rename_exchange = -100, 2
    if libc.renameat2(at_fdcwd, bytes(a), at_fdcwd, bytes(b), rename_exchange) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, os.strerror(errno))


@pytest.mark.slow
@pytest.mark.parametrize("replaced", ["set folder", "tools root", "workspace .crystal"])
async def test_a_folder_replaced_under_its_name_is_watched_again(
    layout: Layout, tmp_path: Path, replaced: str
) -> None:
    """Real watchfiles: a set folder, a tools root or a ``.crystal`` replaced by another
    folder under the same name (a checkout, a swap) is watched anew.

    A watch follows a directory, not its name: the one on the folder that went was gone,
    and the new folder had the same path, so the poll saw the same directories and kept
    the generation. Edits in it reached the catalog only through the stat poll (every
    recheck period, far longer on a big root), never through an event.
    """
    home, workspace = layout
    recorder = Recorder()
    # Long settle and recheck: every call below comes from a file event, not from a timer.
    watcher = Watcher(home, recorder, debounce_ms=50, settle_seconds=60.0, recheck_seconds=60.0)
    watcher.add_workspace(workspace)
    tools = home / "tools"
    project = workspace / ".crystal" / "tools"
    (project / "p").mkdir(parents=True)
    (project / "p" / "tools.json").write_text("{}")
    key, gone, set_dir = {
        "set folder": (None, tools / "a", tools / "a"),
        "tools root": (None, tools, tools / "a"),
        "workspace .crystal": (workspace, workspace / ".crystal", project / "p"),
    }[replaced]
    with anyio.fail_after(60):
        async with anyio.create_task_group() as tg:
            await tg.start(watcher.run)
            while watcher.polls_ended < 2:  # the baseline, and the probe after the start
                await anyio.sleep(0.01)
            await _poke_until(recorder, key, set_dir / "tools.json")  # the watch is live

            # The same folders under the same names, in a copy swapped in at once.
            staged = tmp_path / "staged"
            shutil.copytree(gone, staged)
            since, polls = len(recorder.calls), watcher.polls_ended
            _exchange(staged, gone)
            await recorder.wait_for(key, since)
            # The poll after that batch (a folder may have come or gone), and the probe
            # after the restart it makes: neither may be the one to see the edits below.
            while watcher.polls_ended < polls + 2:
                await anyio.sleep(0.01)
            # Edits in the new folder are events again, once the watch restarted.
            await _poke_until(recorder, key, set_dir / "tools.json")
            tg.cancel_scope.cancel()


@pytest.mark.slow
async def test_a_folder_linked_under_two_names_tells_both(layout: Layout, tmp_path: Path) -> None:
    """Real watchfiles: one set folder linked from the home and from a project reloads both.

    inotify has one watch per directory and reports its events under the last name it was
    watched by: an edit of a shared set reached one catalog at once and the other only
    by the stat poll (every 2 s, every ~40 s on a big root).
    """
    home, workspace = layout
    shared = tmp_path / "shared"
    shared.mkdir()
    (shared / "tools.json").write_text("{}")
    (home / "tools" / "s").symlink_to(shared)
    (workspace / ".crystal" / "tools").mkdir(parents=True)
    (workspace / ".crystal" / "tools" / "s").symlink_to(shared)
    recorder = Recorder()
    # Long settle and recheck: every call below comes from a file event, not from a timer.
    watcher = Watcher(home, recorder, debounce_ms=50, settle_seconds=60.0, recheck_seconds=60.0)
    watcher.add_workspace(workspace)
    with anyio.fail_after(60):
        async with anyio.create_task_group() as tg:
            await tg.start(watcher.run)
            while watcher.polls_ended < 2:  # the baseline, and the probe after the start
                await anyio.sleep(0.01)
            await _poke_until(recorder, None, shared / "tools.json")
            await _poke_until(recorder, workspace, shared / "tools.json")
            tg.cancel_scope.cancel()


@pytest.mark.slow
async def test_a_link_to_a_watched_folder_pointed_elsewhere_is_watched_again(
    layout: Layout, tmp_path: Path
) -> None:
    """Real watchfiles: a workspace's ``.crystal`` linked to a shared folder, then pointed
    at another (dotfiles switched), is watched at its new target.

    The link's own folder (the workspace) is not watched while ``.crystal`` exists, so no
    event tells of the switch, and the probe lists the same paths: the watch stayed on the
    old target, and edits in the new one reached the catalog only through the stat poll.
    """
    home, workspace = layout
    first, second = tmp_path / "first", tmp_path / "second"
    for target in (first, second):
        (target / "tools" / "p").mkdir(parents=True)
        (target / "tools" / "p" / "tools.json").write_text("{}")
    (workspace / ".crystal").symlink_to(first)
    recorder = Recorder()
    # Long settle and recheck: every call below comes from a file event, not from a timer.
    watcher = Watcher(home, recorder, debounce_ms=50, settle_seconds=60.0, recheck_seconds=60.0)
    watcher.add_workspace(workspace)
    manifest = workspace / ".crystal" / "tools" / "p" / "tools.json"
    with anyio.fail_after(45):
        async with anyio.create_task_group() as tg:
            await tg.start(watcher.run)
            while watcher.polls_ended < 2:  # the baseline, and the probe after the start
                await anyio.sleep(0.01)
            await _poke_until(recorder, workspace, manifest)

            (tmp_path / "link").symlink_to(second)
            os.replace(tmp_path / "link", workspace / ".crystal")  # no event: not watched
            polls = watcher.polls_ended
            (home / "config.json").write_text("{}")  # an event whose poll sees the switch
            # That poll, and the probe after the restart it makes.
            while watcher.polls_ended < polls + 2:
                await anyio.sleep(0.01)
            await _poke_until(recorder, workspace, manifest)
            tg.cancel_scope.cancel()


async def test_a_watch_process_started_through_proc_self_exe_imports_the_daemons_packages(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A daemon whose user may not run its interpreter by its path starts the watch
    process as ``/proc/self/exe``: the bare interpreter behind the daemon's venv, whose own
    search path (its site-packages, the user's) came first and the daemon's site folders
    after. Another watchfiles installed there (a user's older one; here one that exits at
    import) was the one imported, and the watch process ended at its start, every time.
    It imports what the daemon does."""
    user_base = tmp_path / "user"
    decoy = user_base / "lib" / f"python{sys.version_info[0]}.{sys.version_info[1]}"
    decoy = decoy / "site-packages" / "watchfiles"
    decoy.mkdir(parents=True)
    (decoy / "__init__.py").write_text("raise SystemExit(3)\n")
    monkeypatch.setenv("PYTHONUSERBASE", str(user_base))
    monkeypatch.delenv("PYTHONNOUSERSITE", raising=False)
    interpreter = tmp_path / "python"  # not executable: the start by path is refused
    interpreter.write_text("")
    await _a_file_made_is_seen(tmp_path, python=str(interpreter))


async def _a_file_made_is_seen(tmp_path: Path, python: str = sys.executable) -> None:
    """A watch process started with ``python`` watches: a file made is in its batch."""
    watched = tmp_path / "watched"
    watched.mkdir()
    watch = watch_in_process(
        watched, stop_event=anyio.Event(), debounce=50, step=50, recursive=False,
        rust_timeout=5000, python=python,
    )
    try:
        with anyio.fail_after(30):
            await watch.established()
            (watched / "made").touch()
            batch = await watch.__anext__()
    finally:
        await watch.aclose()
    assert (Change.added, str(watched / "made")) in batch


async def test_a_watch_process_that_ends_says_what_it_wrote_on_stderr(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A watch process that ends before it watches (here: the watchfiles it imports raises)
    is reported with how it ended and the last thing it said: its stderr went to
    /dev/null, and ``exit status 1`` alone left the operator nothing to go on."""
    decoy = tmp_path / "decoy" / "watchfiles"
    decoy.mkdir(parents=True)
    (decoy / "__init__.py").write_text("raise ImportError('a decoy watchfiles, refused')\n")
    monkeypatch.setenv("PYTHONPATH", str(decoy.parent))
    watched = tmp_path / "watched"
    watched.mkdir()
    watch = watch_in_process(
        watched, stop_event=anyio.Event(), debounce=50, step=50, recursive=False,
        rust_timeout=5000,
    )
    try:
        with anyio.fail_after(30), pytest.raises(RuntimeError) as ended:
            await watch.established()
    finally:
        await watch.aclose()
    assert str(ended.value) == (
        "the watch process ended (exit status 1; it said: "
        "ImportError: a decoy watchfiles, refused)"
    )


async def test_a_watch_process_runs_where_no_temporary_file_can_be_made(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The watch process's stderr goes to a temporary file, kept only to explain its end;
    where the daemon may write no temporary folder (a unit whose /tmp is read-only) that
    file could not be made, and the watch never started: "the watch process could not
    start: No such file or directory", and only the poll served, for the daemon's life.
    ``tempfile.tempdir`` (the stdlib's documented default folder) names a folder that is
    not there, as ``gettempdir`` would find none."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "no-such-folder"))
    await _a_file_made_is_seen(tmp_path)


async def test_a_watch_process_that_never_says_it_watches_fails_as_a_watch(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A watch process stopped or stuck before it watches (SIGSTOPped, a start that
    hangs) left ``established()`` waiting for ever: the daemon served from the poll with
    nothing logged, and never retried. It now fails as any watch does, after a deadline."""
    import toolsetd.daemon.watchproc as watchproc

    monkeypatch.setattr(watchproc, "_READY_TIMEOUT", 1.0, raising=False)
    stuck = tmp_path / "python"  # an interpreter that starts and never says a word
    stuck.write_text("#!/bin/sh\nexec sleep 600\n")
    stuck.chmod(0o755)
    watched = tmp_path / "watched"
    watched.mkdir()
    watch = watch_in_process(
        watched, stop_event=anyio.Event(), debounce=50, step=50, recursive=False,
        rust_timeout=5000, python=str(stuck),
    )
    try:
        with anyio.fail_after(15), pytest.raises(RuntimeError) as failed:
            await watch.established()
    finally:
        await watch.aclose()
    assert str(failed.value) == "the watch process did not start watching within 1 s"


async def test_a_batch_the_watch_process_writes_in_chunks_is_one_batch(tmp_path: Path) -> None:
    """The watch process writes a batch of more than 1000 changes as several lines, and
    each line came out as a batch of its own: a checkout that brought 2,500 entries at
    once was 3 batches, each a probe and a reload of its own, where watchfiles made one."""
    watched = tmp_path / "watched"
    watched.mkdir()
    stop = anyio.Event()
    # A step long enough that the entries below, made in a tight loop, are one batch.
    watch = watch_in_process(
        watched, stop_event=stop, debounce=10_000, step=1000, recursive=False,
        rust_timeout=5000,
    )
    try:
        with anyio.fail_after(30):
            await watch.established()
            for n in range(2500):
                (watched / f"e{n}").touch()
            batch = await watch.__anext__()
    finally:
        await watch.aclose()
    assert len(batch) == 2500


#: A ``sitecustomize`` that writes the name of each module the process imports from then
#: on, a line each as it comes, to the file ``TOOLSETD_TEST_IMPORTS`` names.
_IMPORTS_SEEN = """\
import os, sys

_seen = open(os.environ["TOOLSETD_TEST_IMPORTS"], "a", buffering=1)


def _hook(event, args):
    if event == "import":
        _seen.write(f"{args[0]}\\n")


sys.addaudithook(_hook)
"""


async def test_a_watch_process_imports_the_standard_library_and_watchfiles_only(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The watch process ran ``python -m toolsetd.daemon.watchproc``: the package's
    ``__init__`` (structlog) and the daemon side's imports (anyio's streams, tempfile...),
    about 25 MB and 0.08 s of CPU a start, for a process that only needs watchfiles. What
    it imports beyond what ``import watchfiles`` does is the standard library's; the
    imports are seen as they come, by an audit hook a ``sitecustomize`` installs."""
    customize = tmp_path / "customize"
    customize.mkdir()
    (customize / "sitecustomize.py").write_text(_IMPORTS_SEEN)
    seen = tmp_path / "imports"
    monkeypatch.setenv("PYTHONPATH", str(customize))
    monkeypatch.setenv("TOOLSETD_TEST_IMPORTS", str(seen))
    await anyio.run_process([sys.executable, "-P", "-c", "import watchfiles"], cwd="/")
    by_watchfiles = set(seen.read_text().split())
    seen.unlink()
    await _a_file_made_is_seen(tmp_path)
    imported = set(seen.read_text().split())
    assert "watchfiles" in imported
    assert {name for name in imported if name.split(".")[0] in {"toolsetd", "structlog"}} == set()
    others = {name.split(".")[0] for name in imported - by_watchfiles}
    assert others - set(sys.stdlib_module_names) == set()


#: A daemon's side of a watch process, toolsetd imported from PYTHONPATH: it says where
#: ``watchproc`` came from, waits for a line on stdin (an upgrade meanwhile), then watches
#: argv[1] and says what the batch of a file made there held, or why the watch failed.
_DAEMON_UPGRADED_UNDER = """
import json, sys
import anyio
from toolsetd.daemon import watchproc

print(json.dumps(watchproc.__file__), flush=True)
sys.stdin.readline()


async def main():
    watched = sys.argv[1]
    watch = watchproc.watch_in_process(
        watched, stop_event=anyio.Event(), debounce=50, step=50, recursive=False,
        rust_timeout=5000,
    )
    try:
        with anyio.fail_after(30):
            await watch.established()
            open(f"{watched}/made", "w").close()
            said = sorted(path for _, path in await watch.__anext__())
    except Exception as exc:
        said = f"{type(exc).__name__}: {exc}"
    finally:
        await watch.aclose()
    print(json.dumps(said), flush=True)


anyio.run(main)
"""


async def test_a_watch_process_finds_watchfiles_where_a_daemon_run_without_the_environment_does(
    tmp_path: Path,
) -> None:
    """A daemon run by ``python -E`` or ``-I`` (a unit's hardening), or ``-s`` (a distro's
    script line), started its watch processes without that flag: they imported a
    watchfiles the daemon does not see (here one on the ``PYTHONPATH`` it ignores, which
    refuses to load; another tool's, an older one), each watch ended at its start, and the
    daemon served from its poll. The watch process gets the daemon's flags, as the check
    process does."""
    decoy = tmp_path / "decoy" / "watchfiles"
    decoy.mkdir(parents=True)
    (decoy / "__init__.py").write_text("raise ImportError('a watchfiles the daemon ignores')\n")
    watched = tmp_path / "watched"
    watched.mkdir()
    environment = {**os.environ, "PYTHONPATH": str(decoy.parent)}
    daemon = await anyio.run_process(
        [sys.executable, "-E", "-P", "-c", _DAEMON_UPGRADED_UNDER, str(watched)],
        input=b"go\n", env=environment, cwd="/",
    )
    said = json.loads(daemon.stdout.splitlines()[-1])
    assert said == [str(watched / "made")]


def _package_copy(tmp_path: Path) -> Path:
    """A copy of the ``toolsetd.daemon`` package, the install a daemon of
    ``_DAEMON_UPGRADED_UNDER`` imports (``install/toolsetd/daemon``)."""
    import toolsetd.daemon

    package = tmp_path / "install" / "toolsetd" / "daemon"
    shutil.copytree(
        Path(toolsetd.daemon.__file__).parent, package, ignore=shutil.ignore_patterns("__pycache__")
    )
    return package


async def _watch_of_a_daemon_from(
    tmp_path: Path, package: Path, meanwhile: Callable[[], None] = lambda: None
) -> Any:
    """What the watch of a daemon run from the copy ``package`` saw (the paths of its first
    batch, or the error it raised), ``meanwhile`` run between the daemon's import of
    ``watchproc`` and its start of the watch."""
    watched = tmp_path / "watched"
    watched.mkdir()
    install = package.parent.parent
    environment = {**os.environ, "PYTHONPATH": str(install), "PYTHONDONTWRITEBYTECODE": "1"}
    async with await anyio.open_process(
        [sys.executable, "-P", "-c", _DAEMON_UPGRADED_UNDER, str(watched)], env=environment, cwd="/"
    ) as daemon:
        assert daemon.stdin is not None
        assert daemon.stdout is not None
        said = BufferedByteReceiveStream(daemon.stdout)
        with anyio.fail_after(60):
            loaded = json.loads(await said.receive_until(b"\n", 65536))
            assert loaded == str(package / "watchproc.py")  # the copy, not the checkout
            meanwhile()
            await daemon.stdin.send(b"go\n")
            return json.loads(await said.receive_until(b"\n", 65536))


async def test_a_watch_process_runs_the_code_the_daemon_loaded(tmp_path: Path) -> None:
    """The watch process imported toolsetd from disk when it started: after an upgrade in
    place under a running daemon (``pip install -U``, a ``git pull`` in an editable
    install), the old daemon's next watch ran the new code, whatever its wire. Here the
    install is a copy of the package, each of whose modules is replaced, once the daemon
    imported it, by one that refuses to load: the watch the daemon starts then still
    watches, with the code the daemon loaded."""
    package = _package_copy(tmp_path)

    def upgrade() -> None:
        for module in package.glob("*.py"):
            module.write_text("raise ImportError('toolsetd 0.2 is on disk now')\n")

    outcome = await _watch_of_a_daemon_from(tmp_path, package, upgrade)
    assert outcome == [str(tmp_path / "watched" / "made")]


async def test_a_daemon_installed_without_its_watch_code_starts_and_its_watch_says_why(
    tmp_path: Path,
) -> None:
    """The watch process's code is read from its source files when the daemon imports
    ``watchproc``. An install of compiled files only (``.pyc``, no ``.py``) made that
    import raise, so a daemon with the watch on did not start at all. It starts, and its
    watch fails at its start, saying why and what to do (the poll serves meanwhile)."""
    import py_compile

    package = _package_copy(tmp_path)
    compiled = package / "watchchild.pyc"
    py_compile.compile(str(package / "watchchild.py"), cfile=str(compiled), doraise=True)
    (package / "watchchild.py").unlink()
    outcome = await _watch_of_a_daemon_from(tmp_path, package)
    assert outcome == (
        "RuntimeError: the watch process's code could not be read when the daemon started "
        f"(toolsetd.daemon.watchchild has no source file ({compiled})); reinstall toolsetd "
        "with its source files and restart it"
    )


def test_the_bound_on_watches_leaves_the_largest_workspace_to_the_poll(tmp_path: Path) -> None:
    """Past the bound, the home and every root stay watched, and the workspace with the
    most set folders gives up its watches first: one project of 190,000 folders does not
    leave a small project (or the home) without one."""
    from toolsetd.daemon import watcher as watcher_module

    home, big, small = tmp_path / "home", tmp_path / "big", tmp_path / "small"
    for root, count in ((home / "tools", 2), (big / ".crystal" / "tools", 6),
                        (small / ".crystal" / "tools", 1)):
        for index in range(count):
            (root / f"s{index}").mkdir(parents=True)
    probes = watcher_module._probe_all(home, (big, small))
    everything, none_past = watcher_module._watched(probes, None)
    assert none_past == 0
    assert len(everything) == 2 + 2 + 2 + 2 + 6 + 1  # home, 2 .crystal, 3 roots, sets
    dirs, past = watcher_module._watched(probes, 10)
    assert past == 5
    assert set(dirs) == {
        home, home / "tools", big / ".crystal", big / ".crystal" / "tools", small / ".crystal",
        small / ".crystal" / "tools", home / "tools" / "s0", home / "tools" / "s1",
        small / ".crystal" / "tools" / "s0", big / ".crystal" / "tools" / "s0",
    }
