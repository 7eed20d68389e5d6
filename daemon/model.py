"""The daemon's catalog data model: frozen values shared by catalog, registry, policy and runner.

Theory of operation: a ``tools.json`` is parsed into one ``ToolSet`` holding its
``ToolDef`` values. Discovery and overlay turn the sets of a home and a workspace into
one ``Catalog`` snapshot: the tools that loaded (``LoadedTool``, in catalog order), one
``SetEntry`` per candidate directory (whatever became of it), and the operator notes.
Every value here is immutable, so a snapshot can be shared by any number of concurrent
calls and replaced whole by a reload without locks. A call keeps the ``LoadedTool`` it
started with, whatever later reloads do.
"""

from __future__ import annotations

import dataclasses
import enum
import inspect
import itertools
import sys
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Generic, TypeVar

__all__ = [
    "DEFAULT_RESERVED_NAMES",
    "DEFAULT_TIMEOUT_SECONDS",
    "Approval",
    "ApprovalSource",
    "Catalog",
    "CatalogName",
    "Config",
    "LoadedTool",
    "Note",
    "OutputMode",
    "RunnerKind",
    "SetEntry",
    "SetState",
    "SnapshotCache",
    "Source",
    "ToolDef",
    "ToolSet",
]

#: The front ends' built-in tool names (contract section 3), compared case-sensitively.
DEFAULT_RESERVED_NAMES: frozenset[str] = frozenset(
    {
        "read",
        "describe_image",
        "view_image",
        "list",
        "tree",
        "glob",
        "grep",
        "search",
        "todowrite",
        "todoread",
        "question",
        "edit",
        "write",
        "bash",
        "skill",
    }
)

#: The default per-call timeout of a set (the reference host's bash timeout).
DEFAULT_TIMEOUT_SECONDS = 120


class Source(enum.StrEnum):
    """Which tree a set came from. Values sort home before project, as the CLI rows do."""

    HOME = "home"
    PROJECT = "project"


_T = TypeVar("_T")


def _slot_init(cls: type[_T]) -> type[_T]:
    """Give a frozen, slotted dataclass an ``__init__`` that stores through its slots.

    A frozen dataclass's own ``__init__`` stores each field with
    ``object.__setattr__(self, name, value)``: a global and an attribute lookup, then a
    call that looks the name up again on the class. This one calls each slot's
    ``__set__`` (what that lookup ends in), bound once, with the same parameters and
    defaults: a ``ToolDef`` takes 0.5 µs instead of 0.9, and a catalog build makes four
    such values a set. It replaces the dataclass's ``__init__``, so it is still the one
    way to make a value; ``__setattr__`` still refuses every assignment.

    Raises:
        TypeError: ``cls`` is not a frozen, slotted dataclass whose fields are all plain
            positional ``__init__`` parameters with at most a plain default, or the new
            signature differs from the dataclass's.
    """
    params = getattr(cls, "__dataclass_params__", None)
    if params is None or not params.frozen or "__slots__" not in cls.__dict__:
        raise TypeError(f"{cls.__name__} is not a frozen, slotted dataclass")
    if hasattr(cls, "__post_init__"):
        raise TypeError(f"{cls.__name__} has a __post_init__")
    values: dict[str, Any] = {}  # the setters and defaults, passed in as closure cells
    parameters, body = [], []
    for i, f in enumerate(dataclasses.fields(cls)):  # type: ignore[arg-type]
        slot: Any = cls.__dict__.get(f.name)
        if (
            not f.init
            or f.kw_only
            or f.default_factory is not dataclasses.MISSING
            or f.name == "self"
            or f.name.startswith("_slot_init_")
            or not hasattr(slot, "__set__")  # a field of a base class: not this class's slot
        ):
            raise TypeError(f"{cls.__name__}.{f.name} is not a plain __init__ parameter")
        values[f"_slot_init_set{i}"] = slot.__set__
        if f.default is dataclasses.MISSING:
            parameters.append(f.name)
        else:
            values[f"_slot_init_default{i}"] = f.default
            parameters.append(f"{f.name}=_slot_init_default{i}")
        body.append(f"        _slot_init_set{i}(self, {f.name})")
    # As dataclasses does: a factory run in the class's module, so the function's globals
    # are the module's (typing.get_type_hints resolves its annotations there).
    source = (
        f"def _slot_init_factory({', '.join(values)}):\n"
        f"    def __init__(self, {', '.join(parameters)}):\n" + "\n".join(body) + "\n"
        "    return __init__\n"
    )
    factory: dict[str, Any] = {}
    exec(source, sys.modules[cls.__module__].__dict__, factory)  # noqa: S102 - checked names
    init = factory["_slot_init_factory"](**values)
    init.__qualname__ = f"{cls.__qualname__}.__init__"
    init.__annotations__ = dict(cls.__init__.__annotations__)
    if inspect.signature(init) != inspect.signature(cls.__init__):
        raise TypeError(f"{cls.__name__}: the slot __init__ would change the signature")
    cls.__init__ = init  # type: ignore[method-assign]
    return cls


class CatalogName(enum.StrEnum):
    """The product's two tool catalogs. Approval modes are not catalogs."""

    PLAN = "plan"
    WORK = "work"


class Approval(enum.StrEnum):
    """An author's approval declaration (set default, tool override)."""

    INHERIT = "inherit"
    ALWAYS = "always"


class ApprovalSource(enum.StrEnum):
    """Operator policy per source in ``config.json``: follow the author, or the host."""

    AUTHOR = "author"
    HOST = "host"


class OutputMode(enum.StrEnum):
    """How an exec tool's stdout is read."""

    TEXT = "text"
    CONTENT = "content"


class RunnerKind(enum.StrEnum):
    """The runner a set declares."""

    EXEC = "exec"
    DOTNET = "dotnet"


class SetState(enum.StrEnum):
    """What became of one candidate set directory (``sets[].state`` on the wire)."""

    LOADED = "loaded"  # at least one tool registered
    DISABLED = "disabled"  # "enabled": false
    REFUSED = "refused"  # unreadable/invalid manifest, skipped runner, or every tool omitted
    HIDDEN = "hidden"  # a home set replaced by a project set of the same directory name


@_slot_init
@dataclass(frozen=True, slots=True)
class ToolDef:
    """One model-facing tool as its manifest declares it.

    Attributes:
        name: The model-facing name.
        description: The model-facing description (trimmed).
        schema: The tool's input JSON Schema, as written.
        catalogs: Plan and/or Work, never empty.
        approval: The declared approval (tool override, else the set default).
        command: The tool's argv suffix (after the set prefix).
        argv: ``(property, flag)`` pairs in manifest order.
        path_arguments: Property names treated as filesystem paths, in manifest order.
        output: ``text`` or ``content``.
        listing_notes: The operator notes on how MCP hosts are shown the tool
            (``mcpschema.listing_notes``: left out of ``tools/list``, or listed without its
            ``x-mcp-header`` marks), made when the manifest is parsed and kept in the set
            store's record: a catalog build, a restart's too, only reads them.
    """

    name: str
    description: str
    schema: Mapping[str, Any]
    catalogs: frozenset[CatalogName]
    approval: Approval
    command: tuple[str, ...] = ()
    argv: tuple[tuple[str, str], ...] = ()
    path_arguments: tuple[str, ...] = ()
    output: OutputMode = OutputMode.TEXT
    listing_notes: tuple[str, ...] = ()


@_slot_init
@dataclass(frozen=True, slots=True)
class ToolSet:
    """One parsed ``tools.json`` and the directory it lives in.

    Attributes:
        directory: The set's identity: its directory name.
        source: Home or project.
        path: The absolute set directory.
        runner: exec or dotnet.
        enabled: The manifest's ``enabled`` (default true).
        approval: The set-level declared approval.
        catalogs: The set-level default catalogs.
        command: The set argv prefix.
        stdin: Whether the argument object is written to the child's stdin.
        timeout_seconds: The per-call timeout, or None for ``"unlimited"``.
        tools: The exec tools in manifest order; for dotnet, its overlays (never loaded).
        digest: ``sha256:`` of the manifest bytes, for change detection on reload.
    """

    directory: str
    source: Source
    path: Path
    runner: RunnerKind
    enabled: bool = True
    approval: Approval = Approval.INHERIT
    catalogs: frozenset[CatalogName] = frozenset({CatalogName.PLAN, CatalogName.WORK})
    command: tuple[str, ...] = ()
    stdin: bool = True
    timeout_seconds: int | None = DEFAULT_TIMEOUT_SECONDS
    tools: tuple[ToolDef, ...] = ()
    digest: str = ""


@_slot_init
@dataclass(frozen=True, slots=True)
class LoadedTool:
    """A tool that made it into a catalog, with everything a call needs.

    Attributes:
        tool: The definition.
        toolset: The set it belongs to.
        effective_approval: The declared approval after the source policy
            (``host`` turns every declaration into ``inherit``).
        policy: The source policy that applied (``author`` or ``host``).
        hash: ``sha256:`` of the canonical JSON of the definition (contract section 4).
    """

    tool: ToolDef
    toolset: ToolSet
    effective_approval: Approval
    policy: ApprovalSource
    hash: str


@_slot_init
@dataclass(frozen=True, slots=True)
class Note:
    """One English operator note."""

    set: str
    source: Source | None
    message: str


@_slot_init
@dataclass(frozen=True, slots=True)
class SetEntry:
    """One candidate set directory and what became of it.

    Attributes:
        directory: The directory name.
        source: Home or project.
        path: The absolute set directory.
        enabled: The manifest's ``enabled``, or None when the manifest did not parse.
        state: loaded, disabled, refused or hidden.
        tools: The names that registered from this set.
        notes: The messages of the notes about this set.
        toolset: The parsed set, when it parsed.
        error: The manifest error when it did not parse, else None.
    """

    directory: str
    source: Source
    path: Path
    enabled: bool | None
    state: SetState
    tools: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()
    toolset: ToolSet | None = None
    error: str | None = None


@dataclass(frozen=True, slots=True)
class Config:
    """Operator settings from ``<home>/config.json``.

    Attributes:
        external_tools: Whether manifests are scanned at all (default true).
        home_policy: The approval source policy for home sets (default author).
        project_policy: The approval source policy for project sets (default host).
    """

    external_tools: bool = True
    home_policy: ApprovalSource = ApprovalSource.AUTHOR
    project_policy: ApprovalSource = ApprovalSource.HOST


#: ``Catalog.serial``: snapshots in the order they were made.
_SERIALS = itertools.count()


@dataclass(frozen=True, slots=True, weakref_slot=True)  # weakref: SnapshotCache
class Catalog:
    """One immutable catalog snapshot for a home, or a home and a workspace.

    Attributes:
        workspace: The workspace this snapshot covers, or None for home sets only.
        tools: Loaded tools by name, in catalog order (sets in order, tools in manifest order).
        sets: Every candidate set entry, sorted by directory then source.
        notes: Operator notes: discovery notes (home, then project), then load notes.
        config: The settings the snapshot was built with.
        serial: The order the snapshot was made in: a later snapshot has a larger one (a
            reload's, made from its files later, or a patch's, ``dataclasses.replace``).
            Not compared: two snapshots of the same content are equal.
    """

    workspace: Path | None
    tools: Mapping[str, LoadedTool] = field(default_factory=dict)
    sets: tuple[SetEntry, ...] = ()
    notes: tuple[Note, ...] = ()
    config: Config = field(default_factory=Config)
    serial: int = field(default_factory=_SERIALS.__next__, init=False, compare=False, repr=False)


_V = TypeVar("_V")
#: A ``SnapshotCache`` entry: (workspace, filter).
_EntryKey = tuple[Path | None, str | None]


#: A catalog of more tools and sets than this has its native ``list`` body built in a
#: worker thread, and one of more tools than this its MCP ``tools/list`` entries (which
#: list no set), not on the event loop: 20,000 tools took 0.15-0.6 s, which every other
#: client waited out. Smaller ones skip the thread hand-off, which costs more than they do.
LARGE_CATALOG = 2_000


class SnapshotCache(Generic[_V]):
    """A value worked out once per catalog snapshot and filter (``list``'s bytes, MCP pages).

    One entry per workspace and filter: a new snapshot of a workspace replaces its entry
    instead of keeping the old snapshot alive beside it, and an older one never replaces
    a newer one's (``Catalog.serial``): a large build of an older snapshot, finishing
    after a reload's newer one was listed, took its place, and the next list of the
    current snapshot built it again. Past ``limit`` workspaces the entries are dropped and
    built again on use.

    The snapshot is held weakly: once nothing else holds it (the registry released its
    workspace, a reload replaced it) its entry goes with it. Held strongly, the last
    snapshot of each of up to ``limit`` released workspaces stayed alive here, with every
    set it loaded decoded and its ``list`` bytes beside them.
    """

    __slots__ = ("_building", "_entries", "_limit")

    def __init__(self, limit: int = 64) -> None:
        self._entries: dict[_EntryKey, tuple[weakref.ref[Catalog], _V]] = {}
        self._limit = limit
        #: Per entry, the lock its builds in a worker thread take (``get_apart``), while
        #: one holds it or waits for it.
        self._building: dict[_EntryKey, Any] = {}

    def cached(self, catalog: Catalog, wanted: str | None) -> _V | None:
        """The value for ``catalog`` under filter ``wanted`` if it was built, else None."""
        cached = self._entries.get((catalog.workspace, wanted))
        if cached is not None and cached[0]() is catalog:
            return cached[1]
        return None

    def get(self, catalog: Catalog, wanted: str | None, build: Callable[[], _V]) -> _V:
        """The value for ``catalog`` under filter ``wanted``, built by ``build`` the first
        time; kept unless a newer snapshot's value is."""
        key = (catalog.workspace, wanted)
        cached = self._entries.get(key)
        held = cached[0]() if cached is not None else None
        if held is catalog:
            assert cached is not None
            return cached[1]
        value = build()
        if held is not None and held.serial > catalog.serial:
            return value  # built for a caller of an older snapshot: the newer one's stays
        if key not in self._entries and len(self._entries) > self._limit:
            self._entries.clear()
        entries = self._entries

        def dropped(ref: weakref.ref[Catalog]) -> None:
            # Run where the snapshot's last reference went; a newer entry stays.
            if (entry := entries.get(key)) is not None and entry[0] is ref:
                entries.pop(key, None)

        entries[key] = (weakref.ref(catalog, dropped), value)
        return value

    def building(self, workspace: Path | None, wanted: str | None) -> Any:
        """The lock (an ``anyio.Lock``) the builds of the entry of ``workspace`` under
        ``wanted`` take in ``get_apart``."""
        key = (workspace, wanted)
        lock = self._building.get(key)
        if lock is None:
            import anyio  # the daemon's only: the offline CLI imports this module

            lock = self._building[key] = anyio.Lock()
        return lock

    async def get_apart(self, catalog: Catalog, wanted: str | None, build: Callable[[], _V]) -> _V:
        """``get``, with ``build`` run in a worker thread: for a large catalog
        (``LARGE_CATALOG``), whose value held the event loop, and every client, for a
        large part of a second.

        One build at a time per entry (``building``): a second caller of the same snapshot
        waits for the first's and takes it. Builds of other entries (another workspace,
        another filter) do not wait: with one lock for all, a ``list`` of a small project
        waited out a build of another's 20,000 tools. A value already built is taken at
        once.
        """
        value = self.cached(catalog, wanted)
        if value is not None:
            return value
        from . import threads  # the daemon's only: the offline CLI imports this module

        key = (catalog.workspace, wanted)
        lock = self.building(*key)
        try:
            async with lock:
                value = self.cached(catalog, wanted)
                if value is None:
                    built = await threads.run_sync(build)
                    value = self.get(catalog, wanted, lambda: built)
        finally:
            # Handed on to a waiter, the lock stays locked: dropped once nobody wants it.
            if not lock.locked() and self._building.get(key) is lock:
                del self._building[key]
        return value
