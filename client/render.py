"""How ``toolsetctl`` prints: tables fitted to the terminal, aligned plain text, or JSON.

Theory of operation: commands turn wire results into neutral shapes (rows of cells,
``(label, value)`` fields, lines) with the pure helpers here, then hand them to an
``Output`` bound to one format and two text streams:

* ``table``: for people. Headers over a rule, columns two spaces apart, fitted to a
  width (``$COLUMNS``, else the terminal's; none when stdout is not a terminal): cells of
  the foldable columns wrap inside their column. The inventory is fitted by
  ``inventory_table``: paths shortened, low-value columns folded or dropped by width;
  ``wide`` shows every column in full;
* ``text``: the reference host's ``AlignedRows``, exactly: columns joined by two spaces,
  every column but the last padded to its widest cell; fields as ``Label  value`` lines
  with the labels padded to the widest label; never fitted, never shortened;
* ``json``: the wire result as returned, indented, UTF-8; ``jsonl``: the same, one line.

Nothing here imports rich or pydantic: ``toolsetctl`` pays for its output at every start.

The tool set inventory (``list``, ``show``, ``enable``, ``disable``) is carried by
``SetRow``, the reference host's ``ToolSetEntry``: built from a daemon's ``list`` result
by ``set_rows_from_list``, or from the files on disk by ``toolsetd.client.offline``.
"""

from __future__ import annotations

import os
import re
import signal
import stat
from collections.abc import Iterable, Mapping, Sequence

from toolsetd.protocol.ordinal import sort_by_directory
from toolsetd.protocol.printable import inert_json, inert_line

from .blocking import WrittenNumber
from .command import to_devnull, wait_ready
from .jsonout import dumps
from .table import (
    fields_lines,
    fits,
    fitted_widths,
    output_width,
    printable,
    short_path,
    table_lines,
    terminal_text,
)
from .termination import HELD

TYPE_CHECKING = False  # not typing's: importing typing is a share of the start-up
if TYPE_CHECKING:
    from typing import Any, TextIO

__all__ = [
    "DISCOVERY_OFF",
    "SET_HEADERS",
    "Output",
    "SetRow",
    "aligned_fields",
    "aligned_rows",
    "catalogs_label",
    "classification_fields",
    "classification_path_rows",
    "content_lines",
    "inventory_table",
    "is_directory_name",
    "output_width",
    "printable",
    "reload_rows",
    "set_rows_from_list",
    "short_path",
    "source_label",
    "status_fields",
    "table_lines",
    "terminal_text",
    "tool_fields",
    "yes_no",
]

#: The line printed when ``externalTools`` is false in ``config.json``.
DISCOVERY_OFF = (
    "External tool discovery is off. Enabled tool sets will not load until external tool "
    "discovery is turned on."
)

#: The inventory columns, in the reference host's order.
SET_HEADERS: tuple[str, ...] = (
    "Directory",
    "Source",
    "Enabled",
    "Effective",
    "Path",
    "Runner",
    "Catalogs",
    "Approval",
    "Tools",
)

_DIRECTORY_NAME = re.compile(r"[A-Za-z][A-Za-z0-9._-]*")
_MANIFEST = "tools.json"


def is_directory_name(name: str) -> bool:
    """Return whether ``name`` is a legal set directory name (reference section 1.4)."""
    return len(name) <= 64 and _DIRECTORY_NAME.fullmatch(name) is not None


def yes_no(value: bool | None) -> str:
    """Render a flag as ``Yes``, ``No`` or ``-`` (unknown)."""
    if value is None:
        return "-"
    return "Yes" if value else "No"


def source_label(source: str) -> str:
    """Render ``home``/``project`` as ``Home``/``Project``."""
    return "Home" if source == "home" else "Project" if source == "project" else source or "-"


def catalogs_label(catalogs: Iterable[str]) -> str:
    """Render a catalog selection as ``Plan+Work``, ``Plan``, ``Work`` or ``-``."""
    names = {str(name).lower() for name in catalogs}
    if {"plan", "work"} <= names:
        return "Plan+Work"
    if "plan" in names:
        return "Plan"
    if "work" in names:
        return "Work"
    return "-"


def _dash(value: str | None) -> str:
    return value if value else "-"


def aligned_rows(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    """Align rows under headers: two-space gaps, no padding in the last column.

    Args:
        headers: The column headers.
        rows: The rows, each as long as ``headers``.

    Returns:
        The header line, then one line per row.
    """
    widths = [len(header) for header in headers]
    for row in rows:
        for index, cell in enumerate(row):
            widths[index] = max(widths[index], len(cell))
    last = len(headers) - 1

    def join(cells: Sequence[str]) -> str:
        return "  ".join(
            cell if index == last else cell.ljust(widths[index]) for index, cell in enumerate(cells)
        )

    return [join(headers), *(join(row) for row in rows)]


def aligned_fields(fields: Sequence[tuple[str, str]]) -> list[str]:
    """Render ``(label, value)`` pairs as ``Label  value`` lines, labels padded.

    Args:
        fields: The pairs, in order.

    Returns:
        One line per pair.
    """
    width = max((len(label) for label, _ in fields), default=0)
    return [f"{label.ljust(width)}  {value}" for label, value in fields]


class SetRow:
    """One tool set as the inventory shows it (the reference host's ``ToolSetEntry``).

    A plain immutable value (not a dataclass: toolsetctl does not import dataclasses).

    Attributes:
        directory: The directory name.
        source: ``home`` or ``project``.
        path: The manifest path.
        enabled: The manifest's ``enabled``, or None when it did not parse.
        effective: Whether this copy is the one that takes effect (valid name, not hidden).
        runner: The set's runner, or ``""`` when unknown.
        catalogs: The set-level catalogs label (``Plan+Work``...), or ``""``.
        approval: The set-level declared approval, or ``""``.
        tools: Tool labels: ``name`` or ``name (always)``.
        error: Why the manifest is broken, or ``""``.
    """

    __slots__ = (
        "approval",
        "catalogs",
        "directory",
        "effective",
        "enabled",
        "error",
        "path",
        "runner",
        "source",
        "tools",
    )

    def __init__(
        self,
        directory: str,
        source: str,
        path: str,
        enabled: bool | None,
        effective: bool,
        runner: str = "",
        catalogs: str = "",
        approval: str = "",
        tools: tuple[str, ...] = (),
        error: str = "",
    ) -> None:
        self.directory = directory
        self.source = source
        self.path = path
        self.enabled = enabled
        self.effective = effective
        self.runner = runner
        self.catalogs = catalogs
        self.approval = approval
        self.tools = tools
        self.error = error

    def _key(self) -> tuple[Any, ...]:
        return (
            self.directory,
            self.source,
            self.path,
            self.enabled,
            self.effective,
            self.runner,
            self.catalogs,
            self.approval,
            self.tools,
            self.error,
        )

    def __eq__(self, other: object) -> bool:
        return isinstance(other, SetRow) and self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self._key())

    def __repr__(self) -> str:
        return f"SetRow{self._key()!r}"

    def tools_cell(self) -> str:
        """The Tools column: the error when broken, else the labels or ``-``."""
        if self.error:
            return self.error
        return ", ".join(self.tools) if self.tools else "-"

    def cells(self) -> list[str]:
        """The row's cells, in ``SET_HEADERS`` order."""
        return [
            self.directory,
            source_label(self.source),
            yes_no(self.enabled),
            yes_no(self.effective),
            self.path,
            _dash(self.runner),
            _dash(self.catalogs),
            _dash(self.approval),
            self.tools_cell(),
        ]

    def fields(self) -> list[tuple[str, str]]:
        """The ``show`` fields: every column, Tools as names, then ``Error`` if any."""
        fields = [
            ("Directory", self.directory),
            ("Source", source_label(self.source)),
            ("Enabled", yes_no(self.enabled)),
            ("Effective", yes_no(self.effective)),
            ("Path", self.path),
            ("Runner", _dash(self.runner)),
            ("Catalogs", _dash(self.catalogs)),
            ("Approval", _dash(self.approval)),
            ("Tools", ", ".join(self.tools) if self.tools else "-"),
        ]
        if self.error:
            fields.append(("Error", self.error))
        return fields

    def to_json(self) -> dict[str, Any]:
        """The row as a JSON object (camelCase, for ``--format json``)."""
        return {
            "directory": self.directory,
            "source": self.source,
            "path": self.path,
            "enabled": self.enabled,
            "effective": self.effective,
            "runner": self.runner or None,
            "catalogs": self.catalogs or None,
            "approval": self.approval or None,
            "tools": list(self.tools),
            "error": self.error or None,
        }


def _manifest_path(path: str) -> str:
    if not path or path.endswith("/" + _MANIFEST):
        return path
    return f"{path.rstrip('/')}/{_MANIFEST}"


def _tool_label(item: Any, loaded: Mapping[str, Mapping[str, Any]]) -> str:
    """One Tools label: ``name`` or ``name (always)``.

    A ``sets[]`` tool is a name, or an object ``{name, approval}`` (the declared tools of
    a set that did not load); the approval is the object's, else the loaded tool's.
    """
    if isinstance(item, Mapping):
        name = str(item.get("name", ""))
        approval = item.get("approval")
    else:
        name = str(item)
        approval = loaded.get(name, {}).get("approval")
    declared = approval.get("declared") if isinstance(approval, Mapping) else approval
    if isinstance(declared, str) and declared not in ("", "inherit"):
        return f"{name} ({declared})"
    return name


def _catalogs_of(item: Any, loaded: Mapping[str, Mapping[str, Any]]) -> list[Any]:
    """The catalogs of a ``sets[]`` tool: its own (``declaredTools``), else the loaded tool's."""
    if isinstance(item, Mapping) and isinstance(item.get("catalogs"), list):
        return list(item["catalogs"])
    name = str(item.get("name", "")) if isinstance(item, Mapping) else str(item)
    return list(loaded.get(name, {}).get("catalogs") or [])


def set_rows_from_list(result: Mapping[str, Any], catalog: str | None = None) -> list[SetRow]:
    """Build the inventory rows from a daemon's ``list`` result.

    A ``sets[]`` entry carries ``directory``, ``source``, ``path``, ``enabled``, ``state``,
    ``tools`` (names, or ``{name, approval}`` objects) and ``notes``; the set-level
    ``runner``, ``catalogs``, ``approval``, ``declaredTools`` (every declared tool, loaded
    or not, ``{name, approval, catalogs}``: the Tools cell then names them all, as the
    offline reader does) and an ``error`` are used when the daemon sends them (a null
    ``error`` means none, as offline), and otherwise taken from the set's loaded tools
    (runner, the union of catalogs, ``(always)`` labels) and notes.

    Args:
        result: The ``list`` result.
        catalog: ``plan`` or ``work`` to name only that catalog's tools in each row.

    Returns:
        The rows sorted by directory, then source (``home`` before ``project``).
    """
    tools_by_set: dict[tuple[str, str], dict[str, Mapping[str, Any]]] = {}
    for tool in result.get("tools") or []:
        key = (str(tool.get("set", "")), str(tool.get("source", "")))
        tools_by_set.setdefault(key, {})[str(tool.get("name", ""))] = tool
    rows = []
    for entry in result.get("sets") or []:
        directory = str(entry.get("directory", ""))
        source = str(entry.get("source", ""))
        loaded = tools_by_set.get((directory, source), {})
        state = entry.get("state")
        effective = entry.get("effective")
        if not isinstance(effective, bool):
            effective = state != "hidden" and is_directory_name(directory)
        runner = entry.get("runner")
        if not isinstance(runner, str):
            runner = next((str(t.get("runner", "")) for t in loaded.values()), "")
        catalogs = entry.get("catalogs")
        if isinstance(catalogs, list):
            catalogs_text = catalogs_label(catalogs)
        elif isinstance(catalogs, str):
            catalogs_text = catalogs
        else:
            union = {c for t in loaded.values() for c in t.get("catalogs") or []}
            catalogs_text = catalogs_label(union) if union else ""
        approval = entry.get("approval")
        if isinstance(approval, Mapping):
            approval = approval.get("declared")
        declared_tools = entry.get("declaredTools")
        items: list[Any] = (
            declared_tools if isinstance(declared_tools, list) else list(entry.get("tools") or [])
        )
        if catalog is not None:
            items = [item for item in items if catalog in _catalogs_of(item, loaded)]
        labels = [_tool_label(item, loaded) for item in items]
        error = entry.get("error")
        if "error" not in entry:
            # An older daemon without ``error``: take the refused set's last note.
            notes = entry.get("notes") or []
            error = str(notes[-1]) if state == "refused" and not labels and notes else ""
        elif not isinstance(error, str):
            # The daemon says the manifest has no error (a valid dotnet set skipped with a
            # note, tools that collided): the cell is what the offline reader prints.
            error = ""
        rows.append(
            SetRow(
                directory=directory,
                source=source,
                path=_manifest_path(str(entry.get("path", ""))),
                enabled=entry.get("enabled") if isinstance(entry.get("enabled"), bool) else None,
                effective=effective,
                runner=runner,
                catalogs=catalogs_text,
                approval=approval if isinstance(approval, str) else "",
                tools=tuple(str(label) for label in labels),
                error=error,
            )
        )
    # The daemon's order already; sorted again as the offline rows are, in the reference
    # host's ordinal order (Python's own put a name past U+FFFF after U+E000-U+FFFF).
    sort_by_directory(rows, lambda row: (row.directory, row.source))
    return rows


def _isatty(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False


def _compact(value: Any) -> str:
    return dumps(value, separators=(",", ":"))


def _approval_text(approval: Any) -> str:
    if isinstance(approval, Mapping):
        return (
            f"{approval.get('effective', '-')} (declared {approval.get('declared', '-')}, "
            f"policy {approval.get('policy', '-')})"
        )
    return _dash(str(approval) if approval is not None else "")


def tool_fields(tool: Mapping[str, Any]) -> list[tuple[str, str]]:
    """The ``show`` fields of one ``tools[]`` entry.

    Args:
        tool: The wire tool entry.

    Returns:
        ``(label, value)`` pairs.
    """
    timeout = tool.get("timeoutSeconds")
    return [
        ("Name", str(tool.get("name", ""))),
        ("Description", str(tool.get("description", ""))),
        ("Set", str(tool.get("set", ""))),
        ("Source", source_label(str(tool.get("source", "")))),
        ("Runner", _dash(tool.get("runner"))),
        ("Catalogs", catalogs_label(tool.get("catalogs") or [])),
        ("Approval", _approval_text(tool.get("approval"))),
        ("Timeout", "unlimited" if timeout is None else f"{timeout} s"),
        ("Output", _dash(tool.get("output"))),
        ("Path arguments", ", ".join(tool.get("pathArguments") or []) or "-"),
        ("Hash", _dash(tool.get("hash"))),
        ("Input schema", _compact(tool.get("inputSchema", {}))),
    ]


def status_fields(status: Mapping[str, Any]) -> list[tuple[str, str]]:
    """The fields of a ``status`` result.

    Args:
        status: The wire status.

    Returns:
        ``(label, value)`` pairs.
    """
    workspaces = status.get("workspaces")
    if isinstance(workspaces, list):
        workspaces_text = ", ".join(str(w) for w in workspaces) or "-"
    else:
        workspaces_text = _dash(str(workspaces) if workspaces is not None else "")
    uptime = status.get("uptimeSeconds")
    return [
        ("Version", str(status.get("version", "-"))),
        ("PID", str(status.get("pid", "-"))),
        ("Uptime", _uptime(uptime)),
        ("Socket", str(status.get("socket", "-"))),
        ("Home", str(status.get("home", "-"))),
        ("Generation", str(status.get("generation", "-"))),
        ("Workspaces", workspaces_text),
        ("In flight", str(status.get("inFlight", "-"))),
        ("Connections", str(status.get("connections", "-"))),
        *_confinement_rows(status.get("confinement")),
        *_watch_rows(status.get("watch")),
    ]


def _watch_rows(watch: Any) -> list[tuple[str, str]]:
    """``Watch``: whether edits are seen at once (watching), at the next poll (polling, and
    why), or only on a reload (``--no-watch``); and set folders left to the poll."""
    if not isinstance(watch, Mapping):
        return []
    state = watch.get("state")
    seconds = watch.get("pollSeconds")
    # isinstance, not type(): the reader gives a number with a fraction as a float
    # subclass that keeps its text (``blocking.WrittenNumber``), and ``2.0`` printed "-".
    numeric = isinstance(seconds, int | float) and not isinstance(seconds, bool)
    poll = f"every {seconds:g} s" if numeric else "-"
    if state == "watching":
        text = f"watching {watch.get('watched', '-')} folders, and a poll {poll}"
        past = watch.get("pastCap")
        if type(past) is int and past > 0:
            text += (
                f"; {past} set folders past the bound of {watch.get('maxWatches', '-')} "
                "(--max-watches) are followed by the poll alone"
            )
    elif state == "polling":
        text = f"polling {poll}: the watch is unavailable ({_dash(watch.get('reason'))})"
    elif state == "starting":
        text = f"starting, and a poll {poll}"
    else:
        text = f"off ({_dash(watch.get('reason'))})"
    return [("Watch", text)]


def _uptime(uptime: Any) -> str:
    """Whole seconds: an integer as it is (past the double range too, where ``:.0f`` raised
    OverflowError, a traceback's exit 9), a float rounded, anything else ``-``."""
    if type(uptime) is int:
        return f"{uptime} s"
    if isinstance(uptime, WrittenNumber) and uptime - uptime != 0:  # past the double range
        return f"{uptime.text} s"
    return f"{uptime:.0f} s" if isinstance(uptime, float) else "-"


def _confinement_rows(confinement: Any) -> list[tuple[str, str]]:
    """``Cgroups`` and ``Sandbox``: which mode is active, or why not."""
    if not isinstance(confinement, Mapping):
        return []
    cgroup = confinement.get("cgroup") or {}
    sandbox = confinement.get("sandbox") or {}
    if cgroup.get("mode") == "cgroup":
        controllers = ", ".join(cgroup.get("controllers") or []) or "no controllers"
        cgroup_text = f"a cgroup per call under {cgroup.get('tree')} ({controllers})"
    else:
        cgroup_text = f"process groups ({_dash(cgroup.get('reason'))})"
    if sandbox.get("mechanism") == "bubblewrap":
        sandbox_text = f"bubblewrap ({sandbox.get('binary')})"
    else:
        sandbox_text = f"none ({_dash(sandbox.get('reason'))})"
    return [("Cgroups", cgroup_text), ("Sandbox", sandbox_text)]


def classification_fields(classification: Mapping[str, Any]) -> list[tuple[str, str]]:
    """The label/value rows of a classification (its paths come separately).

    Args:
        classification: The wire classification.

    Returns:
        ``(label, value)`` pairs.
    """
    return [
        ("Tool", str(classification.get("tool", ""))),
        ("Set", str(classification.get("set", ""))),
        ("Source", source_label(str(classification.get("source", "")))),
        ("Authority", _dash(classification.get("authority"))),
        ("Scope", _dash(classification.get("scope"))),
        ("Approval", _approval_text(classification.get("approval"))),
        ("Decision", _dash(classification.get("decision"))),
        ("Require prompt", yes_no(classification.get("requirePrompt"))),
        ("Grant scopes", ", ".join(classification.get("grantScopes") or []) or "-"),
        ("Reason", _dash(classification.get("reason"))),
        ("Arguments", _compact(classification.get("arguments", {}))),
        *_sandbox_rows(classification.get("confinement")),
    ]


def _sandbox_rows(confinement: Any) -> list[tuple[str, str]]:
    """The sandbox a call would get, and why it would not run if it would not."""
    if not isinstance(confinement, Mapping):
        return []
    sandbox = confinement.get("sandbox") or {}
    network = "allowed" if sandbox.get("network") else "denied"
    text = f"{sandbox.get('profile', '-')}, network {network}"
    extra = sandbox.get("alsoWritable")
    if extra:
        text += f", also writable: {', '.join(str(p) for p in extra)}"
    rows = [("Sandbox", text)]
    if confinement.get("failure"):
        rows.append(("Confinement", f"fails closed: {confinement['failure']}"))
    return rows


#: The headers of the classification's path table.
PATH_HEADERS: tuple[str, ...] = ("Argument", "Value", "Resolved", "Scope")


def classification_path_rows(classification: Mapping[str, Any]) -> list[list[str]]:
    """The rows of a classification's ``paths[]``.

    Args:
        classification: The wire classification.

    Returns:
        One ``[argument, value, resolved, scope]`` row per path.
    """
    return [
        [
            str(path.get("argument", "")),
            str(path.get("value", "")),
            str(path.get("resolved", "")),
            str(path.get("scope", "")),
        ]
        for path in classification.get("paths") or []
    ]


#: The headers of the ``reload`` change table.
CHANGE_HEADERS: tuple[str, ...] = ("Change", "Directory", "Source")


def reload_rows(result: Mapping[str, Any]) -> list[list[str]]:
    """The rows of a ``reload`` result's ``changed[]``.

    Args:
        result: The wire reload result.

    Returns:
        One ``[change, directory, Source]`` row per change.
    """
    return [
        [str(c.get("change", "")), str(c.get("set", "")), source_label(str(c.get("source", "")))]
        for c in result.get("changed") or []
    ]


def content_lines(content: Iterable[Mapping[str, Any]]) -> list[str]:
    """The printable form of a call result's ``content[]``.

    Text items print as they are; an image prints as ``[image <mimeType>, N bytes]``
    (N is the decoded size of its base64 data).

    Args:
        content: The wire content items.

    Returns:
        One string per item.
    """
    out = []
    for item in content if isinstance(content, list) else []:
        if not isinstance(item, Mapping):
            continue  # not a content item: nothing a person could read
        if item.get("type") == "image":
            data = str(item.get("data", ""))
            size = len(data) * 3 // 4 - data[-2:].count("=")
            out.append(f"[image {item.get('mimeType', 'application/octet-stream')}, {size} bytes]")
        else:
            out.append(str(item.get("text", "")))
    return out


def _state(row: SetRow) -> str:
    if row.enabled is None:
        return "-"
    if not row.enabled:
        return "off"
    return "on" if row.effective else "hidden"


#: The inventory's foldings, applied in turn until the table fits: what the table shows
#: in place of the reference columns when they are too wide.
_INVENTORY_STEPS: tuple[str, ...] = ("state", "runner", "catalogs", "approval", "path")


def inventory_table(
    rows: Sequence[SetRow],
    width: int | None,
    *,
    wide: bool = False,
    workspace: str | None = None,
    user_home: str | None = None,
) -> tuple[list[str], list[list[str]], list[int]]:
    """The inventory as a table that fits ``width``.

    Unless ``wide``, paths are shown as their set's folder, shortened by ``short_path``.
    While the rows do not fit, in turn: Enabled and Effective fold into one State column
    (``on``, ``off``, ``hidden`` for a copy that does not take effect, ``-`` for a manifest
    that does not parse); Runner, Catalogs and Approval are dropped; Path and Tools wrap
    inside their columns; last, Path is dropped.

    Args:
        rows: The inventory rows.
        width: The width to fit, or None for no limit.
        wide: Every column in full (nothing shortened, folded or dropped).
        workspace: The workspace, for shortening paths.
        user_home: The user's home directory, for shortening paths.

    Returns:
        ``(headers, cells, foldable column indexes)``.
    """
    if wide:
        return list(SET_HEADERS), [row.cells() for row in rows], [4, 8]
    folded: set[str] = set()

    def layout() -> tuple[list[str], list[list[str]], list[int]]:
        headers: list[str] = ["Directory", "Source"]
        headers += ["State"] if "state" in folded else ["Enabled", "Effective"]
        for name, step in (("Path", "path"), ("Runner", "runner"), ("Catalogs", "catalogs")):
            if step not in folded:
                headers.append(name)
        if "approval" not in folded:
            headers.append("Approval")
        headers.append("Tools")
        cells = []
        for row in rows:
            full = dict(zip(SET_HEADERS, row.cells(), strict=True))
            folder = row.path.removesuffix("/tools.json")
            full["Path"] = short_path(folder, workspace, user_home)
            full["State"] = _state(row)
            cells.append([full[header] for header in headers])
        foldable = [headers.index(h) for h in ("Path", "Tools") if h in headers]
        return headers, cells, foldable

    headers, cells, foldable = layout()
    for step in _INVENTORY_STEPS:
        if fits(headers, cells, width):
            break
        if step == "path" and fitted_widths(headers, cells, width, foldable) is not None:
            break  # folding Path and Tools is enough
        folded.add(step)
        headers, cells, foldable = layout()
    return headers, cells, foldable


#: In JSON text: what ``json.dumps(ensure_ascii=False)`` leaves raw but a terminal may act
#: on (DEL, the C1 controls, bidirectional controls, separators, lone surrogates). Outside
#: strings JSON is ASCII, so each is inside a string and ``\\uXXXX`` is the same value.
_JSON_UNSAFE = re.compile(
    "[\x7f-\x9f\u061c\u200e\u200f\u2028\u2029\u202a-\u202e\u2066-\u2069\ud800-\udfff]"
)


def _json_text(value: Any, **options: Any) -> str:
    text = dumps(value, **options)
    return inert_json(_JSON_UNSAFE.sub(lambda match: f"\\u{ord(match.group()):04x}", text))


#: The ASCII whitespace ``textwrap`` turns into spaces when it wraps a ``table`` value.
_LAYOUT_WHITESPACE = re.compile("[\t\n\x0b\x0c\r]")


class Output:
    """Prints in one format to one stdout and one stderr.

    What it prints in ``table`` and ``text`` goes through ``printable`` (cells, field
    values, lines, error messages): names, descriptions, notes and the daemon's messages
    come from tool sets nobody reviewed (a cloned repository's ``.crystal/tools``), and a
    terminal must show them, not obey them; each line then goes through ``inert_line``, so
    a CI runner logs it and does not take it for a workflow command (``::add-mask::``,
    ``##vso[``). JSON escapes the same characters as ``\\uXXXX`` (the same document). A
    tool's output is the one thing printed as it is (``tool_text``), and on a terminal
    only with its control characters shown as escapes.

    Args:
        fmt: ``table``, ``text``, ``json`` or ``jsonl``.
        stdout: Where results go.
        stderr: Where errors and notices go.
        width: The table width (``output_width(stdout)`` when not given).
    """

    def __init__(
        self, fmt: str, stdout: TextIO, stderr: TextIO, width: int | bool | None = False
    ) -> None:
        self.format = fmt
        self.stdout = stdout
        self.stderr = stderr
        self._owed = memoryview(b"")  # the rest of a line a signal stopped (``_whole``)
        #: Whether ``json``'s one document has begun on stdout: encoded whole and owed,
        #: so written before anything else (a failure then goes to stderr).
        self.documented = False
        self.width: int | None = output_width(stdout) if width is False else width or None

    @property
    def is_json(self) -> bool:
        """Whether results print as JSON (``json`` or ``jsonl``)."""
        return self.format in ("json", "jsonl")

    def line(self, text: str = "") -> None:
        """Print one plain line to stdout (its control characters shown as escapes)."""
        self.stdout.write(inert_line(printable(text)) + "\n")

    def error(self, text: str) -> None:
        """Print one line to stderr (its control characters shown as escapes).

        A stderr whose reader went away (``2>&1 | head``) or that cannot be written
        (``>log 2>&1`` on a full disk, ``2>/dev/full``) loses the line, and only the line:
        the command goes on to its own exit code (a call still running is cancelled, a
        failure keeps its code), never to the exit 0 of a closed stdout nor to Python's
        exit 1 of an uncaught error (which reads as "the tool failed").
        """
        try:
            if self._owed and _same_file(self.stdout, self.stderr):  # 2>&1: finish the line
                self._drain()
            self.stderr.write(inert_line(printable(text)) + "\n")
            self.stderr.flush()
        except OSError:
            to_devnull(self.stderr)

    def tool_text(self, text: str) -> None:
        """Print a tool's output: as it is into a file or a pipe; on a terminal, its
        control characters (but line feeds, tabs and CRLF) shown as escapes."""
        if _isatty(self.stdout):
            text = terminal_text(text)
        self.stdout.write(text)

    def json(self, value: Any) -> None:
        """Print a JSON value: indented (``json``) or on one line (``jsonl``), UTF-8, whole
        (``_whole``) even when a signal stops the command while a reader lags.

        Ctrl-C, SIGTERM and SIGHUP are held from here until the text is owed (``_whole``):
        one raised while the value was encoded lost it (a ``jsonl`` call event: the log
        began at the cancelled call's ``completed``). One that came meanwhile is raised
        from the wait for a lagging reader (``_drain``), or once the text is written.
        """
        mask = signal.pthread_sigmask(signal.SIG_BLOCK, HELD)
        try:
            if self.format == "jsonl":
                self._whole(_json_text(value, separators=(",", ":")) + "\n")
            else:
                # Begun once it is owed (``_whole``): a failure after it goes to stderr. A
                # signal while it is encoded (a tenth of a second for 4 MB) waits for that.
                self._whole(_json_text(value, indent=2) + "\n", document=True)
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, mask)

    def finish(self) -> None:
        """Write what a signal left owed of the last JSON line or document (``_whole``)."""
        if self._owed:
            self._drain()

    def _whole(self, text: str, *, document: bool = False) -> None:
        """Write ``text`` to stdout's descriptor so that no signal leaves part of it.

        Ctrl-C, SIGTERM or SIGHUP while a write waited for a lagging reader (a full pipe)
        raised from the middle of it: Python's writer dropped the rest, and the ``error``
        line that says "Interrupted" followed the part written, so a ``jsonl`` consumer's
        parser failed on the joined line. Here each write is one a pipe takes at once
        (``PIPE_BUF`` bytes, once it has room), with the three signals held only around
        it, so what is left is known exactly; the signal is raised from the wait for room,
        and what is left is owed (``_owed``): written, before anything else, by the next
        line (the ``completed`` event of the cancelled call, the "Interrupted" error) or
        the next line to stderr when it is the same pipe (``2>&1``).
        """
        try:
            self.stdout.fileno()
        except (AttributeError, OSError, ValueError):  # not a file (a test's StringIO)
            self.stdout.write(text)
            self.documented = self.documented or document
            self.stdout.flush()
            return
        self.stdout.flush()  # nothing in json: everything it prints comes here
        encoding = getattr(self.stdout, "encoding", None) or "utf-8"
        data = text.encode(encoding, getattr(self.stdout, "errors", None) or "strict")
        # Owed behind what is still owed, before any wait: a signal raised from the wait
        # for the earlier line's room must not lose this one. Owed, a document has begun:
        # nothing is written before it.
        self._owed = memoryview(bytes(self._owed) + data) if self._owed else memoryview(data)
        self.documented = self.documented or document
        self._drain()

    def _drain(self) -> None:
        """Write what is owed of the last line (see ``_whole``); a signal may raise from
        the wait for room (let in there even where a caller holds it: ``json``,
        ``BlockingClient._read_once``), never between a write and the count of what it
        took."""
        if not self._owed:
            return
        fd = self.stdout.fileno()
        chunk = _PIPE_BUF if not stat.S_ISREG(os.fstat(fd).st_mode) else len(self._owed)
        mask = signal.pthread_sigmask(signal.SIG_BLOCK, HELD)
        try:
            while self._owed:
                if not wait_ready(fd, write=True, timeout=0):  # no room now: wait for it
                    signal.pthread_sigmask(signal.SIG_UNBLOCK, HELD)
                    wait_ready(fd, write=True)
                    signal.pthread_sigmask(signal.SIG_BLOCK, HELD)
                try:
                    self._owed = self._owed[os.write(fd, self._owed[:chunk]) :]
                except BlockingIOError:  # a non-blocking descriptor another writer filled
                    pass
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, mask)

    def rows(
        self,
        headers: Sequence[str],
        rows: Sequence[Sequence[str]],
        *,
        empty: str,
        foldable: Sequence[int] = (),
    ) -> None:
        """Print a table (fitted, or aligned text); ``empty`` when there are no rows."""
        if not rows:
            self.line(empty)
            return
        headers = [self._cell(header) for header in headers]
        rows = [[self._cell(cell) for cell in row] for row in rows]
        lines = (
            aligned_rows(headers, rows)
            if self.format == "text"
            else table_lines(headers, rows, self.width, foldable)
        )
        for text in lines:
            self.line(text)

    def fields(self, fields: Sequence[tuple[str, str]]) -> None:
        """Print ``Label  value`` pairs (values wrapped to the width in ``table``)."""
        fields = [(self._cell(label), self._cell(value)) for label, value in fields]
        lines = (
            aligned_fields(fields) if self.format == "text" else fields_lines(fields, self.width)
        )
        for text in lines:
            self.line(text)

    def _cell(self, text: str) -> str:
        """A cell or a field value as shown: in ``table`` (wrapped to the width) a line
        break or a tab is a space, as the wrapping makes it (a multi-line description reads
        as one paragraph, not as ``\\n``); in ``text`` (one line per row or field) it is
        escaped like every other control character."""
        if self.format == "table":
            text = _LAYOUT_WHITESPACE.sub(" ", text)
        return inert_line(printable(text))

    def flush(self) -> None:
        """Flush stdout."""
        self.stdout.flush()

    def discard(self) -> None:
        """After a broken pipe: send what is still buffered for stdout to ``/dev/null``.

        The reader went away (``toolsetctl ... | head``); without this every later flush,
        the interpreter's own at exit included, fails again (Python then prints "Exception
        ignored" and exits 120 instead of the command's code).
        """
        self._owed = memoryview(b"")
        to_devnull(self.stdout)


#: What a pipe takes in one write once it has room at all (Linux's ``PIPE_BUF``): a larger
#: write waits for the reader part-way, where only a signal could end it.
_PIPE_BUF = 4096


def _same_file(one: TextIO, other: TextIO) -> bool:
    """Whether two streams write to the same file (``2>&1``)."""
    try:
        return os.path.samestat(os.fstat(one.fileno()), os.fstat(other.fileno()))
    except (AttributeError, OSError, ValueError):
        return False
