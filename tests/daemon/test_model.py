"""The catalog's values: built through their slots, and exactly what dataclasses would make."""

from __future__ import annotations

import dataclasses
import gc
import inspect
import threading
import typing
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio
import pytest
from toolsetd.daemon import model
from toolsetd.daemon.model import (
    Approval,
    ApprovalSource,
    Catalog,
    CatalogName,
    LoadedTool,
    Note,
    OutputMode,
    RunnerKind,
    SetEntry,
    SetState,
    SnapshotCache,
    Source,
    ToolDef,
    ToolSet,
)

_TOOL = ToolDef("t", "d", {"type": "object"}, frozenset({CatalogName.PLAN}), Approval.ALWAYS)
_SET = ToolSet("s", Source.HOME, Path("/h/tools/s"), RunnerKind.EXEC, tools=(_TOOL,))

#: Each value built through ``_slot_init``, with the arguments of a full construction.
_ALL: dict[type, tuple[Any, ...]] = {
    ToolDef: (
        "t", "d", {"type": "object"}, frozenset({CatalogName.WORK}), Approval.INHERIT,
        ("run",), (("p", "--p"),), ("p",), OutputMode.CONTENT, ("a note",),
    ),
    ToolSet: (
        "s", Source.PROJECT, Path("/w/s"), RunnerKind.DOTNET, False, Approval.ALWAYS,
        frozenset({CatalogName.PLAN}), ("x",), False, None, (_TOOL,), "sha256:00",
    ),
    LoadedTool: (_TOOL, _SET, Approval.INHERIT, ApprovalSource.HOST, "sha256:11"),
    Note: ("s", None, "a note"),
    SetEntry: (
        "s", Source.HOME, Path("/h/tools/s"), True, SetState.LOADED, ("t",), ("n",), _SET, None,
    ),
}


def _twin(cls: type) -> type:
    """The same fields made into a frozen, slotted dataclass by dataclasses alone."""
    fields = [(f.name, f.type, f) for f in dataclasses.fields(cls)]
    return dataclasses.make_dataclass(cls.__name__, fields, frozen=True, slots=True)


def _values(value: object) -> list[object]:
    return [getattr(value, f.name) for f in dataclasses.fields(value)]  # type: ignore[arg-type]


@pytest.mark.parametrize("cls", list(_ALL), ids=lambda c: c.__name__)
def test_slot_init_builds_what_the_dataclass_init_builds(cls: type) -> None:
    """Positional, keyword and default arguments give the values the dataclass's own
    ``__init__`` gives, with the same signature and repr."""
    twin, args = _twin(cls), _ALL[cls]
    names = [f.name for f in dataclasses.fields(cls)]
    assert cls.__init__.__qualname__ == f"{cls.__name__}.__init__"
    assert inspect.signature(cls) == inspect.signature(twin)
    required = [f for f in dataclasses.fields(cls) if f.default is dataclasses.MISSING]
    for made, expected in [
        (cls(*args), twin(*args)),
        (cls(**dict(zip(names, args, strict=True))), twin(*args)),
        (cls(*args[: len(required)]), twin(*args[: len(required)])),
    ]:
        assert _values(made) == _values(expected)
        assert repr(made) == repr(expected)
        assert made == cls(*_values(made))


@pytest.mark.parametrize("cls", list(_ALL), ids=lambda c: c.__name__)
def test_slot_init_refuses_what_the_dataclass_init_refuses(cls: type) -> None:
    """Wrong arguments raise the TypeError the dataclass's own ``__init__`` raises, and
    the value stays frozen."""
    twin, args = _twin(cls), _ALL[cls]
    for bad_args, bad_kwargs in [
        ((), {}),
        ((*args, "extra"), {}),
        (args, {dataclasses.fields(cls)[0].name: "again"}),
        (args[:-1], {"no_such_field": 1}),
    ]:
        with pytest.raises(TypeError) as ours:
            cls(*bad_args, **bad_kwargs)
        with pytest.raises(TypeError) as theirs:
            twin(*bad_args, **bad_kwargs)
        assert str(ours.value) == str(theirs.value)
    value = cls(*args)
    with pytest.raises(dataclasses.FrozenInstanceError):
        setattr(value, dataclasses.fields(cls)[0].name, "changed")


@pytest.mark.parametrize(
    "make",
    [
        lambda: dataclasses.dataclass(slots=True)(type("Plain", (), {"__annotations__": {"a": "int"}})),
        lambda: dataclasses.dataclass(frozen=True)(type("NoSlots", (), {"__annotations__": {"a": "int"}})),
        lambda: dataclasses.dataclass(frozen=True, slots=True)(
            type("Factory", (), {"__annotations__": {"a": "list"}, "a": dataclasses.field(default_factory=list)})
        ),
        lambda: dataclasses.dataclass(frozen=True, slots=True)(
            type("KwOnly", (), {"__annotations__": {"a": "int"}, "a": dataclasses.field(kw_only=True)})
        ),
        lambda: dataclasses.dataclass(frozen=True, slots=True)(
            type("NoInit", (), {"__annotations__": {"a": "int"}, "a": dataclasses.field(init=False, default=1)})
        ),
        lambda: dataclasses.dataclass(frozen=True, slots=True)(
            type("PostInit", (), {"__annotations__": {"a": "int"}, "__post_init__": lambda self: None})
        ),
        lambda: dataclasses.dataclass(frozen=True, slots=True)(
            type("Clash", (), {"__annotations__": {"_slot_init_set1": "int", "b": "int"}})
        ),
        lambda: dataclasses.dataclass(frozen=True, slots=True)(
            type("SelfField", (), {"__annotations__": {"self": "int"}})
        ),
        lambda: dataclasses.dataclass(frozen=True, slots=True)(
            type(
                "Inherited",
                (dataclasses.dataclass(frozen=True, slots=True)(type("Base", (), {"__annotations__": {"a": "int"}})),),
                {"__annotations__": {"b": "int"}},
            )
        ),
    ],
    ids=[
        "not frozen", "not slotted", "a default factory", "keyword-only", "init=False",
        "__post_init__", "a field named like the generated names", "a field named self",
        "a field of a base class",
    ],
)
def test_slot_init_refuses_a_class_it_cannot_build_exactly(make: Any) -> None:
    """Only a class whose every field is a plain positional parameter gets a slot init."""
    cls = make()
    before = cls.__init__
    with pytest.raises(TypeError):
        model._slot_init(cls)
    assert cls.__init__ is before


@pytest.mark.parametrize("cls", list(_ALL), ids=lambda c: c.__name__)
def test_slot_init_annotations_resolve_in_the_models_module(cls: type) -> None:
    """``get_type_hints`` resolves the new ``__init__``'s annotations as it does the
    dataclass's (its globals are the module's)."""
    assert typing.get_type_hints(cls.__init__) == typing.get_type_hints(_twin_in_model(cls).__init__)
    assert inspect.signature(cls, eval_str=True) == inspect.signature(
        _twin_in_model(cls), eval_str=True
    )


def _twin_in_model(cls: type) -> type:
    """``_twin``, made in the models' module (where its annotations resolve)."""
    return dataclasses.make_dataclass(
        cls.__name__,
        [(f.name, f.type, f) for f in dataclasses.fields(cls)],
        frozen=True,
        slots=True,
        namespace={"__module__": model.__name__},
    )


def test_snapshot_cache_builds_once_per_snapshot_and_keeps_one_per_workspace() -> None:
    """Built once per snapshot and filter; a new snapshot of a workspace replaces the old
    one's entry, and an old one's build never replaces a newer one's; past the limit every
    entry is dropped, and built again on use."""
    built: list[tuple[Path | None, str | None]] = []
    cache: SnapshotCache[int] = SnapshotCache(limit=2)

    def get(catalog: Catalog, wanted: str | None = None) -> int:
        def build() -> int:
            built.append((catalog.workspace, wanted))
            return len(built)

        return cache.get(catalog, wanted, build)

    old, new = Catalog(workspace=Path("/w")), Catalog(workspace=Path("/w"))
    assert get(old) == get(old) == 1
    assert get(old, "plan") == 2  # another filter, another value
    assert get(new) == 3  # a new snapshot of the same workspace
    assert get(old) == 4, "the old snapshot's entry was replaced, not kept beside it"
    assert get(new) == 3, "the old snapshot's value took the newer one's place"
    others = [Catalog(workspace=Path(f"/o{i}")) for i in range(2)]
    for catalog in others:  # /o0 is a third key; /o1 comes past the limit of 2
        get(catalog)
    assert len(built) == 6
    assert get(others[1]) == 6, "the newcomer is kept"
    assert get(others[0]) == 7, "dropped when /o1 came past the limit, built again"
    assert get(old, "plan") == 8


@pytest.mark.anyio
async def test_snapshot_cache_a_build_lock_handed_on_stays_its_entrys_lock() -> None:
    """A build's lock handed on to a waiter stays locked, so it stays the entry's until
    that waiter's build is done: dropped there, a third caller of the waiter's snapshot made
    a second lock for the entry and built the same value beside the waiter's build, which it
    is to wait for and take. Once nobody holds or waits for it, the lock is dropped."""
    cache: SnapshotCache[str] = SnapshotCache()
    old, new = Catalog(workspace=Path("/w")), Catalog(workspace=Path("/w"))
    gates = {"old": threading.Event(), "new": threading.Event()}
    started: list[str] = []
    got: dict[str, str] = {}

    async def get(caller: str, catalog: Catalog, name: str) -> None:
        def build() -> str:
            started.append(name)
            gates[name].wait(30)
            return name

        got[caller] = await cache.get_apart(catalog, None, build)

    async def until(done: Callable[[], bool]) -> None:
        while not done():
            await anyio.sleep(0.01)

    with anyio.fail_after(30):
        async with anyio.create_task_group() as tg:
            tg.start_soon(get, "a", old, "old")
            await until(lambda: started == ["old"])
            lock = cache.building(Path("/w"), None)
            tg.start_soon(get, "b", new, "new")  # a newer snapshot: a's value is not its
            await until(lambda: lock.statistics().tasks_waiting == 1)
            gates["old"].set()  # a's build ends, and the lock goes to b, which builds
            await until(lambda: started == ["old", "new"])
            tg.start_soon(get, "c", new, "new")  # b's snapshot: waits for b's build
            await until(lambda: lock.statistics().tasks_waiting == 1 or len(started) > 2)
            gates["new"].set()
    assert got == {"a": "old", "b": "new", "c": "new"}
    assert started == ["old", "new"], "a second lock of the entry let c build beside b"
    assert not cache._building, "a lock nobody holds or waits for was kept"


def test_snapshot_cache_does_not_keep_a_dropped_snapshot_alive() -> None:
    """A snapshot nothing else holds (its workspace released) goes, and its value with it.

    Held by the cache, the last snapshot of each released workspace stayed alive (up to
    64 of them) with every set it loaded, decoded, and its ``list`` bytes.
    """

    class Value:
        pass

    cache: SnapshotCache[Value] = SnapshotCache()
    kept, released = Catalog(workspace=Path("/kept")), Catalog(workspace=Path("/released"))
    values = [cache.get(catalog, None, Value) for catalog in (kept, released)]
    gone = weakref.ref(values[1])
    del released, values
    gc.collect()
    assert gone() is None, "the cache kept the entry of a snapshot nothing else holds"
    first = cache.get(kept, None, Value)
    assert cache.get(kept, None, Value) is first  # a live snapshot's value is still kept
