"""Tests for ``toolsetd.daemon.gcpause``: nested, bounded pauses of the cyclic collector."""

from __future__ import annotations

import gc
import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from toolsetd.daemon.catalog import ManifestCache, build_catalog
from toolsetd.daemon.gcpause import GcPause
from toolsetd.daemon.model import DEFAULT_RESERVED_NAMES, Config


@pytest.fixture(autouse=True)
def _collector_on() -> Iterator[None]:
    """Each test starts with the collector on and leaves it as it found it."""
    was = gc.isenabled()
    gc.enable()
    yield
    if not was:
        gc.disable()


class Clock:
    """A monotonic clock moved by hand."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


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


def test_a_pause_leaves_a_collector_someone_else_turned_off_alone() -> None:
    gc.disable()
    with GcPause():
        assert not gc.isenabled()
    assert not gc.isenabled()


def test_an_error_inside_a_pause_gives_the_collector_back() -> None:
    with pytest.raises(ValueError), GcPause():
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
        pause.expire_if_due()  # once expired, it holds nothing more to give back
        assert gc.isenabled()
    assert gc.isenabled()


def test_an_expired_pause_does_not_end_another_holders_pause() -> None:
    clock = Clock()
    with GcPause(0.5, clock=clock) as short, GcPause(60, clock=clock) as long:
        clock.now += 1
        short.expire_if_due()
        long.expire_if_due()
        assert not gc.isenabled()
    assert gc.isenabled()


def _generation_of(obj: object) -> int | None:
    for generation in range(3):
        if any(o is obj for o in gc.get_objects(generation)):
            return generation
    return None


def test_a_promoting_pause_moves_what_it_made_to_the_oldest_generation() -> None:
    with GcPause(promote=True):
        made = [[]]
    assert _generation_of(made) == 2
    assert gc.get_freeze_count() == 0  # nothing is left frozen
    with GcPause():
        plain = [[]]
    assert _generation_of(plain) == 0


def test_a_pause_left_by_an_error_or_expired_promotes_nothing() -> None:
    with pytest.raises(ValueError), GcPause(promote=True):
        failed = [[]]
        raise ValueError("boom")
    assert _generation_of(failed) == 0
    clock = Clock()
    with GcPause(0.5, promote=True, clock=clock) as pause:
        clock.now += 1
        pause.expire_if_due()
        late = [[]]
    assert _generation_of(late) == 0


def test_the_last_holder_promotes_for_an_earlier_one_that_asked() -> None:
    outer, inner = GcPause(), GcPause(promote=True)
    outer.__enter__()
    inner.__enter__()
    made = [[]]
    inner.__exit__(None, None, None)
    assert _generation_of(made) == 0
    outer.__exit__(None, None, None)
    assert _generation_of(made) == 2


def test_build_catalog_starts_no_collection_while_it_builds(tmp_path: Path) -> None:
    """With a young collection every 50 allocations, a build starts at most one.

    Without the pause this build of 40 sets starts dozens; with it, only the allocations
    after the promotion count.
    """
    tools = tmp_path / "home" / "tools"
    for i in range(40):
        (tools / f"s{i:02d}").mkdir(parents=True)
        body = {
            "runner": "exec",
            "command": ["/bin/true"],
            "description": f"tool {i}",
            "schema": {"type": "object"},
        }
        (tools / f"s{i:02d}" / "tools.json").write_text(json.dumps(body))
    cache = ManifestCache()
    build_catalog(tmp_path / "home", None, reserved=DEFAULT_RESERVED_NAMES, cache=cache)
    starts: list[int] = []

    def count(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            starts.append(info["generation"])

    home, fresh, config = tmp_path / "home", ManifestCache(), Config()
    threshold = gc.get_threshold()
    gc.callbacks.append(count)
    gc.set_threshold(50, 1000, 1000)
    try:
        catalog = build_catalog(
            home, None, reserved=DEFAULT_RESERVED_NAMES, cache=fresh, config=config
        )
    finally:
        gc.set_threshold(*threshold)
        gc.callbacks.remove(count)
    assert len(catalog.tools) == 40
    assert len(starts) <= 1, starts
    assert gc.isenabled()
    assert _generation_of(catalog.tools["s00"]) == 2  # promoted, untraversed
