"""The CLI's offline commands: reading tool sets from disk without a daemon.

This is the one module of ``toolsetd.client`` that imports ``toolsetd.daemon`` (the
exception named in ``docs/architecture.md``): the pure, file-reading parts only, namely
``daemon.manifest`` (the parser), ``daemon.catalog`` (config, discovery, the wire
helpers), ``daemon.validation`` (the schema checker), ``daemon.mcpschema`` (a schema as
2020-12), ``daemon.schemarefs`` (its ``$ref``s that lead nowhere) and ``daemon.model``
(their values), and ``daemon.exhaustion``'s start-up switch (below).
Nothing here opens a socket, starts a process or logs.

Before it reads a set, the CLI turns on ``check_allocations_if_they_can_fail`` as the
daemon does at start: under a memory limit (``ulimit -v``, a CI job's unit) orjson, which
reads a manifest's keys for ``validate`` and writes an edited one, died of SIGSEGV short
of memory where the standard library's parser raises ``MemoryError`` (said as what it
is: ``cli.OUT_OF_MEMORY``).

* ``inventory`` is the reference host's ``ToolSetInventory.List``: every immediate
  subdirectory of ``<home>/tools`` and ``<workspace>/.crystal/tools`` that holds a
  ``tools.json``, parsed on its own, whatever ``externalTools`` says. A copy is
  *effective* when its name is valid and no project copy of the same name hides it.
* ``offline_list`` is what the daemon's ``list`` would say, built by ``build_catalog``.
* ``validate_set`` checks one directory and collects every problem it can: the
  directory name, every structural failure (the parser stops at its first: the member
  that failed is left out and the file parsed again, ``_parse_problems``), every
  schema problem of every tool, and the command files ``invoke`` would fail to start
  (missing, not a file, not executable, a bare name found neither in the set folder nor
  on ``PATH``).
"""

from __future__ import annotations

import difflib
import json
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from toolsetd.daemon.argv import ArgvError, executable_problem, resolve_executable
from toolsetd.daemon.catalog import (
    INVALID_DIRECTORY_NAME,
    ManifestCache,
    build_catalog,
    load_config,
    note_info,
    set_info,
    subdirectory_names,
    tool_info,
)
from toolsetd.daemon.config_file import MAX_MANIFEST_BYTES, read_regular_file
from toolsetd.daemon.exhaustion import check_allocations_if_they_can_fail
from toolsetd.daemon.manifest import ManifestError, is_directory_name, parse_manifest
from toolsetd.daemon.mcpschema import as_2020_12
from toolsetd.daemon.model import (
    DEFAULT_RESERVED_NAMES,
    Approval,
    RunnerKind,
    Source,
    ToolDef,
    ToolSet,
)
from toolsetd.daemon.paths import file_exists, os_user_home
from toolsetd.daemon.schemarefs import ref_problems
from toolsetd.daemon.validation import SchemaChecker
from toolsetd.protocol.jsontext import decode_file_text, dumps, is_utf8, loads
from toolsetd.protocol.ordinal import sort_by_directory

from .render import SetRow, catalogs_label

__all__ = [
    "MAX_MANIFEST_BYTES",
    "ValidationReport",
    "check_allocations_if_they_can_fail",
    "discovery_enabled",
    "file_exists",
    "inventory",
    "manifest_problem",
    "offline_list",
    "os_user_home",
    "read_for_edit",
    "read_manifest",
    "validate_set",
]

_MANIFEST = "tools.json"
_PLACEHOLDER = "toolsetctl-validate"


def discovery_enabled(home: Path) -> bool:
    """Return ``externalTools`` from ``<home>/config.json`` (true when absent)."""
    config, _notes = load_config(home)
    return bool(config.external_tools)


def manifest_problem(
    data: bytes, set_dir: Path, source: str, reserved: frozenset[str] = DEFAULT_RESERVED_NAMES
) -> str | None:
    """Return the parser's message for a manifest, or None when it parses.

    Args:
        data: The manifest bytes.
        set_dir: The set directory.
        source: ``home`` or ``project``.
        reserved: The reserved tool names.
    """
    try:
        parse_manifest(data, set_dir=set_dir, source=Source(source), reserved=reserved)
    except ManifestError as exc:
        return exc.message
    return None


def _tool_label(name: str, approval: Approval) -> str:
    return name if approval is Approval.INHERIT else f"{name} ({approval.value})"


def read_manifest(path: Path) -> bytes:
    """A ``tools.json``'s bytes, read as the daemon reads it.

    Only a regular file of at most 1 MiB, opened without blocking: a FIFO or a device in
    its place (or a link to one) is unreadable, never waited on or read without end.

    Raises:
        ManifestError: ``tools.json could not be read.`` or ``... is larger than 1 MiB.``
    """
    return read_regular_file(path)[0]


def read_for_edit(path: Path) -> bytes:
    """``read_manifest`` for ``enable``/``disable``: a refusal is the editor's ``EditError``."""
    from .editor import EditError

    try:
        return read_manifest(path)
    except ManifestError as exc:
        raise EditError(exc.message) from exc


def _as_answered(text: str) -> str:
    """``text`` as the daemon's answer carries it: a file name's bytes that are not UTF-8
    (kept by ``surrogateescape``) decoded with U+FFFD, as .NET decodes file names."""
    return text if is_utf8(text) else str(loads(dumps(text)))


def _row(
    directory: str,
    source: Source,
    set_dir: Path,
    effective: bool,
    reserved: frozenset[str],
    catalog: str | None,
) -> SetRow:
    manifest = _as_answered(str(set_dir / _MANIFEST))
    if not is_directory_name(directory):
        shown = _as_answered(directory)
        return SetRow(shown, source.value, manifest, None, False, error=INVALID_DIRECTORY_NAME)
    try:
        data = read_manifest(set_dir / _MANIFEST)
    except ManifestError as exc:
        return SetRow(directory, source.value, manifest, None, effective, error=exc.message)
    try:
        toolset = parse_manifest(data, set_dir=set_dir, source=source, reserved=reserved)
    except ManifestError as exc:
        return SetRow(directory, source.value, manifest, None, effective, error=exc.message)
    return SetRow(
        directory=directory,
        source=source.value,
        path=manifest,
        enabled=toolset.enabled,
        effective=effective,
        runner=toolset.runner.value,
        catalogs=catalogs_label(c.value for c in toolset.catalogs),
        approval=toolset.approval.value,
        tools=tuple(
            _tool_label(t.name, t.approval)
            for t in toolset.tools
            if catalog is None or any(c.value == catalog for c in t.catalogs)
        ),
    )


def _scan(root: Path) -> list[Path]:
    try:
        names = subdirectory_names(root)  # an entry it cannot examine is left out
    except OSError:
        return []
    return [root / name for name in names if file_exists(str(root / name / _MANIFEST))]


def inventory(
    home: Path,
    workspace: Path,
    catalog: str | None = None,
    reserved: frozenset[str] = DEFAULT_RESERVED_NAMES,
) -> list[SetRow]:
    """List every tool set on disk, home and project, as the reference host's CLI does.

    Args:
        home: The Crystal home.
        workspace: The workspace root.
        catalog: ``plan`` or ``work`` to show only that catalog's tools in each row.
        reserved: The reserved tool names.

    Returns:
        The rows sorted by directory, then source.
    """
    home_dirs = _scan(home / "tools")
    project_dirs = _scan(workspace / ".crystal" / "tools")
    project_names = {d.name for d in project_dirs if is_directory_name(d.name)}
    rows = [
        _row(d.name, Source.HOME, d, d.name not in project_names, reserved, catalog)
        for d in home_dirs
    ]
    rows += [_row(d.name, Source.PROJECT, d, True, reserved, catalog) for d in project_dirs]
    sort_by_directory(rows, lambda row: (row.directory, row.source))
    return rows


def offline_list(
    home: Path,
    workspace: Path,
    catalog: str | None = None,
    reserved: frozenset[str] = DEFAULT_RESERVED_NAMES,
) -> dict[str, Any]:
    """Build, from the files, the result a daemon's ``list`` would give.

    Args:
        home: The Crystal home.
        workspace: The workspace root.
        catalog: ``plan`` or ``work`` to keep only that catalog's tools.
        reserved: The reserved tool names.

    Returns:
        ``{"generation": 0, "tools", "sets", "notes"}``.
    """
    built = build_catalog(home, workspace, reserved=reserved, cache=ManifestCache())
    tools = [
        tool_info(loaded)
        for loaded in built.tools.values()
        if catalog is None or any(c.value == catalog for c in loaded.tool.catalogs)
    ]
    result = {
        "generation": 0,
        "tools": tools,
        "sets": [set_info(entry) for entry in built.sets],
        "notes": [note_info(note) for note in built.notes],
    }
    # As the wire carries the daemon's: a name or path whose bytes are not UTF-8 with U+FFFD.
    answered: dict[str, Any] = loads(dumps(result))
    return answered


@dataclass(slots=True)
class ValidationReport:
    """The outcome of ``validate_set``.

    Attributes:
        directory: The directory name.
        path: The manifest path.
        problems: Every problem found, in order; empty when the set is valid.
        tools: The tool names, in manifest order, when the manifest parsed.
        runner: The runner, when the manifest parsed.
        notes: What is true of the set besides its problems (toolsetd skips it, or does
            not look where it is).
    """

    directory: str
    path: Path
    problems: list[str] = field(default_factory=list)
    tools: list[str] = field(default_factory=list)
    runner: str | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def valid(self) -> bool:
        """Whether no problem was found."""
        return not self.problems

    def to_json(self) -> dict[str, Any]:
        """The report as a JSON object."""
        return {
            "directory": self.directory,
            "path": str(self.path),
            "valid": self.valid,
            "runner": self.runner,
            "tools": self.tools,
            "problems": self.problems,
            "notes": self.notes,
        }


def _no_manifest(set_dir: Path) -> str | None:
    """Say that ``set_dir`` has no ``tools.json``, and which folders in it do, else None.

    "tools.json could not be read." is the daemon's word for a file it cannot read; for
    a folder that has none (the tools folder itself, or one a set sits one level too
    deep in) it sent the author looking for a permission problem.
    """
    try:
        if os.path.lexists(set_dir / _MANIFEST):
            return None
        inside = sorted(
            entry.name
            for entry in os.scandir(set_dir)
            if entry.is_dir() and os.path.isfile(os.path.join(entry.path, _MANIFEST))
        )
    except OSError:
        return None
    text = f"{set_dir} has no tools.json."
    if inside:
        shown = ", ".join(inside[:5]) + (f" and {len(inside) - 5} more" if len(inside) > 5 else "")
        which = (
            f"The folder {shown} in it has"
            if len(inside) == 1
            else f"The folders {shown} in it have"
        )
        text += (
            f" {which} one: a tool set is a folder with its own tools.json (toolsetctl "
            f"validate {set_dir / inside[0]})."
        )
    return text


def _shorthand_problem(directory: str) -> str:
    return f"Directory '{directory}' is not a valid tool name for exec shorthand."


class _NoSchemaCheck(SchemaChecker):
    """A checker that passes every schema, so the parser returns every tool."""

    def problem(self, schema: Mapping[str, Any]) -> str | None:
        return None


def validate_set(set_dir: Path, extra_reserved: Iterable[str] = ()) -> ValidationReport:
    """Check one set directory as a home set and collect its problems.

    The problems are: the directory name, each structural failure (``_parse_problems``),
    the misspelt members, then for what parsed (every tool, or those left when failing
    ones were left out) each tool's schema problems and the command files.

    Args:
        set_dir: The set directory (the one holding ``tools.json``).
        extra_reserved: Names reserved besides the front ends' built-ins (``--reserve``).

    Returns:
        The report.
    """
    reserved = DEFAULT_RESERVED_NAMES | frozenset(extra_reserved)
    set_dir = Path(set_dir).absolute()
    directory = set_dir.name
    report = ValidationReport(directory, set_dir / _MANIFEST)
    parse_dir = set_dir
    if not is_directory_name(directory):
        report.problems.append(f"Tool set directory '{directory}' is not a valid name.")
        parse_dir = set_dir.parent / _PLACEHOLDER
    try:
        is_dir = set_dir.is_dir()
    except OSError as exc:  # a folder on its way the user may not search
        report.problems.append(
            f"Tool set directory '{set_dir}' cannot be read ({exc.strerror}): run toolsetctl "
            "as a user that may read it."
        )
        return report
    if not is_dir:
        if not set_dir.exists():
            report.problems.append(f"Tool set directory '{set_dir}' does not exist.")
        elif set_dir.name == _MANIFEST:  # `validate .crystal/tools/x/tools.json`: the file
            report.problems.append(
                f"'{set_dir}' is the manifest, not its set: validate takes the set's folder "
                f"(toolsetctl validate {set_dir.parent})."
            )
        else:
            report.problems.append(f"Tool set directory '{set_dir}' is not a directory.")
        return report
    try:
        data = read_manifest(set_dir / _MANIFEST)
    except ManifestError as exc:
        report.problems.append(_no_manifest(set_dir) or exc.message)
        return report
    parsed = _parse_problems(
        data,
        lambda text: parse_manifest(
            text, set_dir=parse_dir, source=Source.HOME, reserved=reserved, schemas=_NoSchemaCheck()
        ),
    )
    for message in parsed.problems:
        shown = (
            _shorthand_problem(directory)
            if parse_dir is not set_dir and _PLACEHOLDER in message
            else message
        )
        if shown not in report.problems:
            report.problems.append(shown)
    report.problems.extend(misspelt_keys(data))
    toolset = parsed.toolset
    if toolset is None:
        return report
    if not parsed.problems:
        report.runner = toolset.runner.value
    if parse_dir is not set_dir and [t.name for t in toolset.tools] == [_PLACEHOLDER]:
        if _shorthand_problem(directory) not in report.problems:
            report.problems.append(_shorthand_problem(directory))
        return report
    if not parsed.problems:
        report.tools = [tool.name for tool in toolset.tools]
    for tool in toolset.tools:  # what parsed, also with the members that did not left out
        invalid = SchemaChecker.problems(tool.schema)
        for problem in invalid:
            report.problems.append(f"Tool '{tool.name}' has an invalid JSON Schema: {problem}")
        for dangling in () if invalid else ref_problems(tool.schema):
            said = report.problems if dangling.every_call else report.notes
            said.append(dangling.message(tool.name))
        report.problems.extend(_unknown_properties(tool))
        report.notes.extend(tool.listing_notes)
    if toolset.runner is RunnerKind.EXEC and parsed.commands:
        report.problems.extend(_command_problems(toolset, set_dir))
    return report


#: The most times ``validate`` parses a manifest again, each without one member that
#: failed: a manifest with more problems than this says its first ones.
_MAX_PASSES = 100
_NO_TOOLS = "exec tools array must not be empty."
_NO_COMMAND = "exec requires a command array."


@dataclass
class _Parsed:
    """What ``_parse_problems`` found."""

    #: The problems, in the parser's order.
    problems: list[str] = field(default_factory=list)
    #: What parsed at last, the failing members left out; None when nothing did.
    toolset: ToolSet | None = None
    #: False when a stand-in command let the rest parse: its command files are not the
    #: file's, and are not checked.
    commands: bool = True


def _parse_problems(data: bytes, parse: Callable[[bytes], ToolSet]) -> _Parsed:
    """Every problem the parser finds in a manifest, not only its first.

    The contract's ``validate`` prints every problem; the parser stops at its first, as
    the daemon and the reference host do. When that one is in a member the rest does not
    depend on (``ManifestError.member``: an optional member of the root or of a tool, one
    tool or overlay), the member is left out and the manifest parsed again, at most
    ``_MAX_PASSES`` times; a failure elsewhere (the runner, the JSON itself, a shorthand's
    own fields) ends it. The manifest is read again as the daemon reads it (its encoding,
    every member of a key given twice, every number as written), so what is left is
    checked as the file says it.

    Leaving out is not the file: a problem it alone makes is not said. With every tool
    left out there is nothing left to check. With every command left out (the root's, a
    tool's, or a tool that had one), a stand-in command lets the rest be checked, and the
    command files are not.
    """
    found = _Parsed()
    root: Any = None
    tools_out = commands_out = False
    for _ in range(_MAX_PASSES):
        try:
            found.toolset = parse(data)
            return found
        except ManifestError as exc:
            if exc.message == _NO_TOOLS and tools_out:
                return found
            if exc.message == _NO_COMMAND and commands_out and isinstance(root, _Members):
                root.put("command", ["true"])  # a stand-in, never run
                found.commands = False
            else:
                found.problems.append(exc.message)
                if exc.member is None:
                    return found
                if root is None:
                    try:
                        root = json.loads(
                            decode_file_text(data),
                            object_pairs_hook=_Members,
                            parse_int=_Number,
                            parse_float=_Number,
                        )
                    except ValueError:
                        return found
                there, taken = _leave_out(root, exc.member)
                if not there:
                    return found
                tools_out |= exc.member[0] == "tools"
                commands_out |= exc.member[-1] == "command" or (
                    isinstance(taken, _Members) and taken.has("command")
                )
            data = _json_text(root).encode()
    return found


class _Members(list[tuple[str, Any]]):
    """A JSON object as its members, in order, a key given twice kept twice (the daemon
    checks every value of a repeated ``argv`` key or dotnet overlay; elsewhere it reads
    the last)."""

    def get(self, key: str) -> Any:
        return next((value for name, value in reversed(self) if name == key), None)

    def has(self, key: str) -> bool:
        return any(name == key for name, _ in self)

    def put(self, key: str, value: Any) -> None:
        self.drop(key)
        self.append((key, value))

    def drop(self, key: str) -> Any:
        """Take out every member named ``key``; the value ``get`` gave."""
        taken = self.get(key)
        self[:] = [(name, value) for name, value in self if name != key]
        return taken


class _Number(str):
    """A number's text, written back as it was read."""


def _json_text(value: Any) -> str:
    """``value`` (as ``_parse_problems`` reads a manifest) as JSON text."""
    if isinstance(value, _Members):
        return "{" + ",".join(f"{json.dumps(k)}:{_json_text(v)}" for k, v in value) + "}"
    if isinstance(value, list):
        return "[" + ",".join(_json_text(item) for item in value) + "]"
    if isinstance(value, _Number):
        return str(value)
    return json.dumps(value)


def _leave_out(root: Any, member: tuple[str | int, ...]) -> tuple[bool, Any]:
    """Take ``member`` (a root member, one element of ``tools``, or a member of one) out of
    ``root``: whether it was there, and what was taken out (the last of a key given
    twice)."""
    owner = root
    for step in member[:-1]:
        if isinstance(owner, _Members) and isinstance(step, str):
            owner = owner.get(step)
        elif isinstance(owner, list) and isinstance(step, int) and 0 <= step < len(owner):
            owner = owner[step]
        else:
            return False, None
    key = member[-1]
    if isinstance(owner, _Members):
        if not isinstance(key, str) or not owner.has(key):
            return False, None
        return True, owner.drop(key)
    if isinstance(owner, list) and isinstance(key, int) and 0 <= key < len(owner):
        return True, owner.pop(key)
    return False, None


#: Schema keywords that can admit a property the top-level ``properties`` do not list.
_MORE_PROPERTIES = (
    "patternProperties",
    "allOf",
    "anyOf",
    "oneOf",
    "$ref",
    "$dynamicRef",
    "dependentSchemas",
    "if",
    "then",
    "else",
    "unevaluatedProperties",
)


def _unknown_properties(tool: ToolDef) -> list[str]:
    """``pathArguments`` and ``argv`` names the tool's schema has no property of.

    Neither is checked against the schema (the reference host does not), so a
    ``pathArguments`` of ``file`` for a schema whose property is ``path`` loads, and the
    path the model sends is never fenced or rewritten; an ``argv`` key misspelt is a flag
    that is never passed. Said only when the schema's ``properties`` are all there is,
    read as the schema's own draft reads them: the schema is looked at as 2020-12
    (``as_2020_12``, what MCP hosts are shown), so a draft's own way of adding properties
    (draft 4 to 7's ``dependencies``, draft 3's ``extends`` or a schema in its ``type``) is
    one of ``_MORE_PROPERTIES``, and ``properties`` beside a draft 7 ``$ref``, which the
    draft passes by, are none.
    """
    schema = as_2020_12(tool.schema)
    properties = schema.get("properties")
    if not isinstance(properties, Mapping) or any(k in schema for k in _MORE_PROPERTIES):
        return []
    found: list[str] = []
    shown = ", ".join(sorted(properties)[:5]) + (" ..." if len(properties) > 5 else "")
    for key, names, effect in (
        ("pathArguments", tool.path_arguments, "the path it was meant for goes unfenced"),
        ("argv", tuple(name for name, _flag in tool.argv), "its flag is never passed"),
    ):
        for name in names:
            if name in properties:
                continue
            close = difflib.get_close_matches(name, sorted(properties), 1, 0.6)
            meant = f": did you mean '{close[0]}'?" if close else "."
            found.append(
                f"Tool '{tool.name}' {key} names '{name}', which is not among its schema's "
                f"properties ({shown}), so {effect}{meant}"
            )
    return found


def _command_problems(toolset: ToolSet, set_dir: Path) -> list[str]:
    """What would stop each tool's process from starting, once per command file."""
    users: dict[str, list[str]] = {}
    problems: dict[str, str] = {}
    for tool in toolset.tools:
        command = [*toolset.command, *tool.command]
        if not command:
            continue  # the parser reports a missing command
        try:
            resolved = resolve_executable(command[0], set_dir)
        except ArgvError as exc:
            key, problem = command[0], f"Command '{command[0]}': {exc.message}"
        else:
            key, problem = resolved, executable_problem(resolved, set_dir)
        if problem:
            users.setdefault(key, []).append(tool.name)
            problems[key] = problem
    return [f"{problems[key]} (used by {', '.join(names)})" for key, names in users.items()]


#: The members a ``tools.json`` root, an exec tool and a dotnet overlay are read for
#: (``name`` at the root: the reference host ignores it, and people write it).
_ROOT_KEYS = (
    "runner",
    "catalogs",
    "approval",
    "timeoutSeconds",
    "stdin",
    "enabled",
    "command",
    "tools",
    "description",
    "argv",
    "pathArguments",
    "output",
    "schema",
    "name",
)
_DOTNET_KEYS = ("assembly", "types")
_TOOL_KEYS = (
    "name",
    "description",
    "schema",
    "catalogs",
    "argv",
    "command",
    "pathArguments",
    "approval",
    "output",
)


def _meant(key: str, known: Sequence[str]) -> str | None:
    """The member ``key`` was probably meant to be: the same in another case, or one
    close in spelling (``comand``, ``pathArgument``, ``timeout_seconds``)."""
    if key in known or key.startswith("$"):  # "$schema": for editors, documented
        return None
    folded = {k.lower(): k for k in known}
    if key.lower() in folded:
        return folded[key.lower()]
    close = difflib.get_close_matches(key.lower().replace("_", ""), list(folded), 1, 0.8)
    return folded[close[0]] if close else None


def misspelt_keys(text: bytes) -> list[str]:
    """Members of the manifest that no rule reads and that look like one that is.

    The reference host, and so toolsetd, ignore members they do not know, so a
    misspelt ``pathArguments`` leaves a path argument unfenced, and a misspelt
    ``command`` fails as "exec requires a command array." with no word of the member
    that was there. Only ``validate`` says so: the file still loads as it always did.
    """
    try:
        root = loads(text.removeprefix(b"\xef\xbb\xbf").decode("utf-8"))
    except ValueError:
        return []
    if not isinstance(root, dict):
        return []
    runner = root.get("runner")
    dotnet = isinstance(runner, str) and runner.strip().lower() == "dotnet"
    found: list[str] = []
    known = (*_ROOT_KEYS, *_DOTNET_KEYS) if dotnet else _ROOT_KEYS
    for key in root:
        meant = _meant(key, known)
        if meant is not None and meant != "name":  # the root's name is ignored anyway
            found.append(
                f"tools.json has the member '{key}', which toolsetd ignores, as the reference "
                f"host does: did you mean '{meant}'?"
            )
    tools = root.get("tools")
    if not dotnet and isinstance(tools, list):
        for tool in tools:
            if not isinstance(tool, dict):
                continue
            name = tool.get("name")
            label = f"Tool '{name}'" if isinstance(name, str) and name.strip() else "A tool"
            for key in tool:
                meant = _meant(key, _TOOL_KEYS)
                if meant is not None:
                    found.append(
                        f"{label} has the member '{key}', which toolsetd ignores, as the "
                        f"reference host does: did you mean '{meant}'?"
                    )
    return found
