"""Tests for ``toolsetd.daemon.gcpause``: nested, bounded pauses of the cyclic collector."""

from __future__ import annotations

import gc
import json
import sys
import threading
import weakref
from collections.abc import Iterator
from pathlib import Path

import pytest
from toolsetd.daemon import gcpause
from toolsetd.daemon.catalog import ManifestCache, build_catalog
from toolsetd.daemon.gcpause import GcPause
from toolsetd.daemon.model import DEFAULT_RESERVED_NAMES, Config

promoting = pytest.mark.skipif(
    not gcpause.CAN_PROMOTE, reason="this interpreter's generations are not CPython 3.11-3.13's"
)


@pytest.fixture(autouse=True)
def _collector_on() -> Iterator[None]:
    """Each test starts with the collector on, and leaves it, and the pauses, as it found them."""
    was = gc.isenabled()
    gc.enable()
    yield
    assert gcpause._holders == 0  # every pause a test took was given back
    if was:
        gc.enable()
    else:
        gc.disable()


class Clock:
    """A monotonic clock moved by hand."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class Node:
    """An object that can sit in a reference cycle and be watched through a weakref."""

    me: Node | None = None


def _generation_of(obj: object) -> int | None:
    for generation in range(3):
        if any(o is obj for o in gc.get_objects(generation)):
            return generation
    return None


def test_a_pause_holds_the_collector_off_and_gives_it_back() -> None:
    with GcPause():
        assert not gc.isenabled()
    assert gc.isenabled()


def test_nested_pauses_give_it_back_when_the_last_one_leaves() -> None:
    outer, inner = GcPause(), GcPause()
    outer.__enter__()
    inner.__enter__()
    outer.__exit__(None, None, None)
    assert not gc.isenabled()  # inner still holds it
    inner.__exit__(None, None, None)
    assert gc.isenabled()


def test_a_pause_is_not_reentrant() -> None:
    pause = GcPause()
    with pause:
        with pytest.raises(RuntimeError, match="held already"), pause:
            pass
        assert not gc.isenabled()
    assert gc.isenabled()


def test_a_pause_leaves_a_collector_someone_else_turned_off_alone() -> None:
    gc.disable()
    with GcPause(promote=True):
        assert not gc.isenabled()
    assert not gc.isenabled()


def test_an_error_inside_a_pause_gives_the_collector_back() -> None:
    with pytest.raises(ValueError, match="boom"), GcPause():
        raise ValueError("boom")
    assert gc.isenabled()


def test_a_pause_expires_at_its_deadline_only() -> None:
    clock = Clock()
    with GcPause(0.5, clock=clock) as pause:
        clock.now += 0.49
        pause.expire_if_due()
        assert not gc.isenabled()
        clock.now += 0.01
        pause.expire_if_due()
        assert gc.isenabled()
        pause.expire_if_due()
        assert gc.isenabled()
    assert gc.isenabled()


def test_overlapping_holders_cannot_keep_the_collector_off_past_the_first_deadline() -> None:
    """A chain of holders (builds in worker threads) never lets the period end on its own:
    the period's deadline is its first holder's, whatever the later ones ask."""
    clock = Clock()
    first = GcPause(0.5, clock=clock).__enter__()
    clock.now += 0.4
    second = GcPause(60, clock=clock).__enter__()
    first.__exit__(None, None, None)
    clock.now += 0.4
    third = GcPause(60, clock=clock).__enter__()
    second.__exit__(None, None, None)
    third.expire_if_due()
    assert gc.isenabled()
    third.__exit__(None, None, None)
    assert gc.isenabled()


@promoting
def test_a_promoting_pause_moves_what_it_made_to_the_oldest_generation() -> None:
    gc.collect()
    with GcPause(promote=True):
        made = [[]]
    assert _generation_of(made) == 2
    assert gc.get_freeze_count() == 0  # nothing is left frozen
    with GcPause():
        plain = [[]]
    assert _generation_of(plain) == 0


@promoting
def test_a_promoting_pause_first_collects_the_young_garbage_made_before_it() -> None:
    """Garbage from before the pause is freed by a young collection, not promoted."""
    gc.collect()
    node = Node()
    node.me = node
    watch = weakref.ref(node)
    del node
    with GcPause(promote=True):
        pass
    assert watch() is None


@promoting
def test_a_pause_left_by_an_error_or_expired_promotes_nothing() -> None:
    gc.collect()
    with pytest.raises(ValueError, match="boom"), GcPause(promote=True):  # noqa: PT012 - made in the pause the error ends
        failed = [[]]
        raise ValueError("boom")
    assert _generation_of(failed) == 0
    clock = Clock()
    with GcPause(0.5, promote=True, clock=clock) as pause:
        clock.now += 1
        pause.expire_if_due()
        late = [[]]
    assert _generation_of(late) == 0


@promoting
def test_the_last_holder_promotes_for_an_earlier_one_that_asked() -> None:
    gc.collect()
    first, second = GcPause(promote=True), GcPause()
    first.__enter__()
    second.__enter__()
    made = [[]]
    first.__exit__(None, None, None)
    assert _generation_of(made) == 0
    second.__exit__(None, None, None)
    assert _generation_of(made) == 2


@promoting
def test_a_promoting_holder_that_joins_a_plain_period_promotes_nothing() -> None:
    """Only a period that began with its young collection may promote."""
    gc.collect()
    plain = GcPause().__enter__()
    with GcPause(promote=True):
        made = [[]]
    plain.__exit__(None, None, None)
    assert _generation_of(made) == 0


@promoting
def test_a_holder_that_joins_an_expired_period_leaves_the_collector_on() -> None:
    gc.collect()
    clock = Clock()
    first = GcPause(0.5, promote=True, clock=clock).__enter__()
    clock.now += 1
    first.expire_if_due()
    with GcPause(promote=True, clock=clock):
        assert gc.isenabled()
        made = [[]]
    assert gc.isenabled()
    first.__exit__(None, None, None)
    assert gc.isenabled()
    assert _generation_of(made) == 0


@promoting
def test_holders_in_two_threads_compose() -> None:
    """A build in one worker thread and one in another: the collector stays off until the
    second leaves, and the promotion the first asked for happens then."""
    gc.collect()
    entered, leave = threading.Event(), threading.Event()
    made: list[object] = []

    def other() -> None:
        with GcPause():
            entered.set()
            leave.wait(10)

    with GcPause(promote=True):
        worker = threading.Thread(target=other)
        worker.start()
        assert entered.wait(10)
        made.append([[]])
    assert not gc.isenabled()  # the other thread still holds the pause
    leave.set()
    worker.join(10)
    assert gc.isenabled()
    assert _generation_of(made[0]) == 2


@promoting
def test_promotions_stop_until_a_full_collection_has_run() -> None:
    """Past PROMOTIONS_PER_FULL promotions with no full collection between, a pause only
    defers: its objects reach the oldest generation counted, and bring the full collection
    that frees what earlier promotions carried along."""
    gc.collect()
    threshold = gc.get_threshold()
    gc.set_threshold(threshold[0], 10**6, 10**6)  # no middle or full collection on its own
    try:
        for _ in range(gcpause.PROMOTIONS_PER_FULL):
            with GcPause(promote=True):
                made = [[]]
            assert _generation_of(made) == 2
        with GcPause(promote=True):
            deferred = [[]]
        assert _generation_of(deferred) == 0
        gc.collect()
        with GcPause(promote=True):
            again = [[]]
        assert _generation_of(again) == 2
    finally:
        gc.set_threshold(*threshold)


def _write_sets(tools: Path, count: int) -> None:
    for i in range(count):
        (tools / f"s{i:03d}").mkdir(parents=True)
        body = {
            "runner": "exec",
            "command": ["/bin/true"],
            "description": f"tool {i}",
            "schema": {"type": "object"},
        }
        (tools / f"s{i:03d}" / "tools.json").write_text(json.dumps(body))


def _collections_during_build(home: Path) -> tuple[int, Config, ManifestCache]:
    """Build with a young collection due every 50 allocations; count the ones started."""
    starts: list[int] = []

    def count(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            starts.append(info["generation"])

    cache, config = ManifestCache(), Config()
    threshold = gc.get_threshold()
    gc.callbacks.append(count)
    gc.set_threshold(50, 1000, 1000)
    try:
        catalog = build_catalog(home, None, reserved=DEFAULT_RESERVED_NAMES, cache=cache, config=config)
    finally:
        gc.set_threshold(*threshold)
        gc.callbacks.remove(count)
    assert len(catalog.tools) == len(catalog.sets)
    return len(starts), config, cache


def test_build_catalog_starts_no_collection_while_it_builds(tmp_path: Path) -> None:
    """Without the pause this build of 40 sets starts dozens of collections; with it, at
    most the promoting pause's own young collection and one after."""
    _write_sets(tmp_path / "home" / "tools", 40)
    build_catalog(tmp_path / "home", None, reserved=DEFAULT_RESERVED_NAMES, cache=ManifestCache())
    gc.collect()
    starts, _, _ = _collections_during_build(tmp_path / "home")
    assert starts <= 2, starts
    assert gc.isenabled()


def test_build_catalog_gives_the_collector_back_when_its_period_is_over(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A build checks the period's deadline as it goes: with no time allowed, the collector
    is back within 64 sets and collects during the scan itself (not only after it)."""
    _write_sets(tmp_path / "home" / "tools", 200)
    build_catalog(tmp_path / "home", None, reserved=DEFAULT_RESERVED_NAMES, cache=ManifestCache())
    monkeypatch.setattr(gcpause, "MAX_PAUSE_SECONDS", 0.0)
    in_scan: list[bool] = []

    def where(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            frame = sys._getframe(1)
            while frame is not None and frame.f_code.co_name != "_scan":
                frame = frame.f_back
            in_scan.append(frame is not None)

    gc.callbacks.append(where)
    try:
        starts, _, _ = _collections_during_build(tmp_path / "home")
    finally:
        gc.callbacks.remove(where)
    assert starts > 10, starts
    assert any(in_scan), in_scan


@promoting
def test_build_catalog_promotes_what_it_built(tmp_path: Path) -> None:
    _write_sets(tmp_path / "home" / "tools", 5)
    gc.collect()
    catalog = build_catalog(
        tmp_path / "home", None, reserved=DEFAULT_RESERVED_NAMES, cache=ManifestCache()
    )
    assert _generation_of(catalog.tools["s000"]) == 2  # promoted, untraversed


def test_tick_looks_at_the_clock_once_in_ticks_per_check_calls() -> None:
    clock = Clock()
    with GcPause(0.5, clock=clock) as pause:
        clock.now += 1
        for _ in range(gcpause.TICKS_PER_CHECK - 1):
            pause.tick()
        assert not gc.isenabled()  # past the deadline, but not yet looked
        pause.tick()
        assert gc.isenabled()
