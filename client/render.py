"""How ``toolsetctl`` prints: rich tables, aligned plain text, or JSON.

Theory of operation: commands turn wire results into neutral shapes (rows of cells,
``(label, value)`` fields, lines) with the pure helpers here, then hand them to an
``Output`` bound to one format and two text streams:

* ``table``: a rich table (``box.SIMPLE``, as the reference host's Spectre tables);
* ``text``: the reference host's ``AlignedRows``: columns joined by two spaces, every
  column but the last padded to its widest cell; fields as ``Label  value`` lines with
  the labels padded to the widest label;
* ``json``: the wire result as returned, indented, UTF-8.

The tool set inventory (``list``, ``show``, ``enable``, ``disable``) is carried by
``SetRow``, the reference host's ``ToolSetEntry``: built from a daemon's ``list`` result
by ``set_rows_from_list``, or from the files on disk by ``toolsetd.client.offline``.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TextIO

from rich import box
from rich.console import Console
from rich.markup import escape
from rich.table import Table

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
    "is_directory_name",
    "reload_rows",
    "set_rows_from_list",
    "source_label",
    "status_fields",
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


@dataclass(frozen=True, slots=True)
class SetRow:
    """One tool set as the inventory shows it (the reference host's ``ToolSetEntry``).

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

    directory: str
    source: str
    path: str
    enabled: bool | None
    effective: bool
    runner: str = ""
    catalogs: str = ""
    approval: str = ""
    tools: tuple[str, ...] = ()
    error: str = ""

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


def set_rows_from_list(result: Mapping[str, Any]) -> list[SetRow]:
    """Build the inventory rows from a daemon's ``list`` result.

    A ``sets[]`` entry carries ``directory``, ``source``, ``path``, ``enabled``, ``state``,
    ``tools`` and ``notes``; the set-level ``runner``, ``catalogs``, ``approval`` and an
    ``error`` are used when the daemon sends them, and otherwise taken from the set's
    loaded tools (runner, the union of catalogs, ``(always)`` labels) and notes.

    Args:
        result: The ``list`` result.

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
        labels = []
        for name in entry.get("tools") or []:
            declared = (loaded.get(str(name), {}).get("approval") or {}).get("declared")
            labels.append(f"{name} ({declared})" if declared and declared != "inherit" else name)
        error = entry.get("error")
        if not isinstance(error, str):
            notes = entry.get("notes") or []
            error = str(notes[-1]) if state == "refused" and not labels and notes else ""
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
    rows.sort(key=lambda row: (row.directory, row.source))
    return rows


def _isatty(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False


def _compact(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


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
        ("Uptime", f"{uptime:.0f} s" if isinstance(uptime, int | float) else "-"),
        ("Socket", str(status.get("socket", "-"))),
        ("Home", str(status.get("home", "-"))),
        ("Generation", str(status.get("generation", "-"))),
        ("Workspaces", workspaces_text),
        ("In flight", str(status.get("inFlight", "-"))),
        ("Connections", str(status.get("connections", "-"))),
    ]


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
    ]


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
    for item in content:
        if item.get("type") == "image":
            data = str(item.get("data", ""))
            size = len(data) * 3 // 4 - data[-2:].count("=")
            out.append(f"[image {item.get('mimeType', 'application/octet-stream')}, {size} bytes]")
        else:
            out.append(str(item.get("text", "")))
    return out


class Output:
    """Prints in one format to one stdout and one stderr.

    Args:
        fmt: ``table``, ``text`` or ``json``.
        stdout: Where results go.
        stderr: Where errors and notices go.
    """

    def __init__(self, fmt: str, stdout: TextIO, stderr: TextIO) -> None:
        self.format = fmt
        self.stdout = stdout
        self.stderr = stderr
        # Off a terminal rich would wrap every table to 80 columns; let rows run long
        # so piped output stays one row a line.
        width = None if _isatty(stdout) else 1000
        self._console = Console(file=stdout, highlight=False, soft_wrap=False, width=width)

    @property
    def is_json(self) -> bool:
        """Whether results print as JSON."""
        return self.format == "json"

    def line(self, text: str = "") -> None:
        """Print one plain line to stdout."""
        self.stdout.write(text + "\n")

    def error(self, text: str) -> None:
        """Print one line to stderr."""
        self.stderr.write(text + "\n")
        self.stderr.flush()

    def json(self, value: Any) -> None:
        """Print a JSON value, indented, UTF-8."""
        self.stdout.write(json.dumps(value, indent=2, ensure_ascii=False) + "\n")

    def rows(self, headers: Sequence[str], rows: Sequence[Sequence[str]], *, empty: str) -> None:
        """Print a table (rich or aligned text); ``empty`` when there are no rows."""
        if not rows:
            self.line(empty)
            return
        if self.format == "text":
            for text in aligned_rows(headers, rows):
                self.line(text)
            return
        table = Table(box=box.SIMPLE)
        for header in headers:
            table.add_column(escape(header))
        for row in rows:
            table.add_row(*(escape(cell) for cell in row))
        self._console.print(table)

    def fields(self, fields: Sequence[tuple[str, str]]) -> None:
        """Print ``Label  value`` pairs (rich Field/Value table, or aligned text)."""
        if self.format == "text":
            for text in aligned_fields(fields):
                self.line(text)
            return
        table = Table(box=box.SIMPLE)
        table.add_column("Field")
        table.add_column("Value")
        for label, value in fields:
            table.add_row(escape(label), escape(value))
        self._console.print(table)

    def flush(self) -> None:
        """Flush stdout."""
        self.stdout.flush()
