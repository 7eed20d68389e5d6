"""Parse one ``tools.json`` into a frozen ``ToolSet``, with the reference host's messages.

Theory of operation: ``parse_manifest`` is a pure function of the manifest bytes, the set
directory's path, its source and the reserved names (plus an injected ``SchemaChecker``
cache). It applies the reference host's rules (``reference/crystal-behaviour.md`` section
1) in their order and stops at the first failure, raising ``ManifestError`` whose
``message`` is the reference host's exact English text. Only after every structural rule
passes does it check each exec tool's input schema with jsonschema, a toolsetd addition
the reference host does not make.

A few facts of the reference host's JSON layer (System.Text.Json) are reproduced so a
set behaves the same under both hosts: a leading byte order mark is accepted (UTF-8, and
UTF-16/32 as ``File.ReadAllText`` detects them), invalid UTF-8 decodes to U+FFFD, the
literals ``NaN``/``Infinity`` are invalid, nesting deeper than 64 is invalid, duplicate
keys keep the last value (``TryGetProperty``) except where the reference host enumerates an
object (an ``argv`` map, the dotnet overlays: every member is checked, ``_members``), and
"blank" and "trim" use .NET's notion of white space.
The parser messages themselves are Python's ``json`` module's.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import re
import sys
from collections.abc import Mapping
from functools import partial
from pathlib import Path
from typing import Any, NoReturn

from toolsetd.protocol.errors import reject_json_constant
from toolsetd.protocol.jsontext import decode_file_text, long_integer_at
from toolsetd.protocol.whitespace import NET_WHITESPACE

from .mcpschema import invalid_listing_note, is_unlisted, listed_schema, listing_notes
from .model import (
    DEFAULT_TIMEOUT_SECONDS,
    Approval,
    CatalogName,
    OutputMode,
    RunnerKind,
    Source,
    ToolDef,
    ToolSet,
)
from .validation import SchemaChecker, dialect

__all__ = ["ManifestError", "is_directory_name", "is_tool_name", "parse_manifest"]

_DIRECTORY_NAME = re.compile(r"[A-Za-z][A-Za-z0-9._-]{0,63}")
_TOOL_NAME = re.compile(r"[A-Za-z][A-Za-z0-9_-]{0,63}")
#: System.Text.Json's default maximum depth.
_MAX_DEPTH = 64
#: Upper bound of timeoutSeconds: (uint.MaxValue - 1) / 1000.
_MAX_TIMEOUT_SECONDS = 4_294_967
_BOTH = frozenset({CatalogName.PLAN, CatalogName.WORK})
_SHORTHAND_NON_NULL = ("description", "argv", "pathArguments", "output")
_MISSING: Any = object()
#: The start of the message for a valid JSON number toolsetd cannot keep as written.
_CANNOT_HOLD = "tools.json has a number toolsetd cannot hold: "
#: One escape inside a JSON string; group 1 holds the hex digits of a ``\\uXXXX``.
_ESCAPE = re.compile(r"\\(?:u([0-9A-Fa-f]{4})|.)", re.DOTALL)


class ManifestError(Exception):
    """A ``tools.json`` that cannot be used; ``message`` is the operator-facing English text.

    Attributes:
        message: The reference host's message, e.g. ``stdin must be a boolean.``
        member: The member it is about, when the rest of the manifest can be checked
            without it: an optional member of the root or of a tool
            (``("timeoutSeconds",)``, ``("tools", 2, "approval")``), or one element of
            ``tools`` (``("tools", 2)``, ``("tools", "read")`` for a dotnet overlay); None
            for anything else. ``toolsetctl validate`` leaves it out and parses again, to
            say every problem; the daemon stops at the first, as the reference host does.
    """

    def __init__(self, message: str, member: tuple[str | int, ...] | None = None) -> None:
        """Create the error.

        Args:
            message: The operator-facing English text.
            member: The member it is about (see above).
        """
        super().__init__(message)
        self.message = message
        self.member = member


def _fail(message: str, member: tuple[str | int, ...] | None = None) -> NoReturn:
    raise ManifestError(message, member)


def _in(element: str | int, exc: ManifestError) -> NoReturn:
    """Raise ``exc`` again as about ``tools``' ``element`` (or a member of it)."""
    exc.member = ("tools", element, *(exc.member or ()))
    raise exc


def is_directory_name(name: str) -> bool:
    """Whether ``name`` is a legal set directory name (``^[A-Za-z][A-Za-z0-9._-]*$``, <= 64).

    Args:
        name: The directory name.

    Returns:
        True when legal.
    """
    return _DIRECTORY_NAME.fullmatch(name) is not None


def is_tool_name(name: str, reserved: frozenset[str]) -> bool:
    """Whether ``name`` is a legal, unreserved tool name (``^[A-Za-z][A-Za-z0-9_-]*$``, <= 64).

    Args:
        name: The model-facing name.
        reserved: Names no external tool may take, compared case-sensitively.

    Returns:
        True when legal and not reserved.
    """
    return _TOOL_NAME.fullmatch(name) is not None and name not in reserved


def _too_deep(value: Any) -> bool:
    """Whether containers nest deeper than System.Text.Json's default of 64."""
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        children = item.values() if isinstance(item, dict) else item
        for child in children:
            if isinstance(child, dict | list):
                if depth + 1 > _MAX_DEPTH:
                    return True
                stack.append((child, depth + 1))
    return False


def _lone_surrogate(decoded: str) -> str | None:
    """The parser message for the first ``\\uXXXX`` escape of a lone surrogate, else None.

    Python's ``json`` reads ``"\\ud800"`` as a one-character string that UTF-8 cannot
    carry; System.Text.Json refuses it as invalid UTF-16 when the string is read. ``decoded``
    is valid JSON, so every backslash in it starts an escape inside a string.
    """
    high = None  # the escape of a high surrogate still waiting for its low half
    for escape in _ESCAPE.finditer(decoded):
        digits = escape[1]
        code = int(digits, 16) if digits is not None else -1
        if high is not None:
            if escape.start() == high.end() and 0xDC00 <= code <= 0xDFFF:
                high = None
                continue
            break
        if 0xD800 <= code <= 0xDBFF:
            high = escape
        elif 0xDC00 <= code <= 0xDFFF:
            high = escape
            break
    if high is None:
        return None
    return str(json.JSONDecodeError(f"Unpaired surrogate {high[0]}", decoded, high.start()))


def _finite(text: str) -> float:
    """``parse_float``: the number, unless a double cannot hold it (Python reads ``1e400``
    as infinity, which JSON cannot write back: it would become ``null``)."""
    value = float(text)
    shown = text if len(text) <= 40 else text[:39] + "…"
    if math.isinf(value):
        _fail(
            f"{_CANNOT_HOLD}{shown} is beyond the range of a double (about ±1.8e308). "
            "Write a smaller number, or leave it out."
        )
    if value == 0.0 and any(c in "123456789" for c in text.lower().partition("e")[0]):
        _fail(  # 1e-400 would read as 0.0: the schema would not say what the file says
            f"{_CANNOT_HOLD}{shown} is nearer zero than a double can be (about ±4.9e-324). "
            "Write 0, or a larger number."
        )
    return value


def _too_many_digits(decoded: str) -> NoReturn:
    """Refuse an integer longer than the interpreter converts (``sys.int_info``'s limit),
    at that integer: not the first run of as many digits, which may be in a string or in a
    float's fraction (rule 3a)."""
    limit = sys.get_int_max_str_digits()
    where = str(json.JSONDecodeError("", decoded, long_integer_at(decoded, limit) or 0))
    _fail(f"{_CANNOT_HOLD}an integer of more than {limit:,} digits{where}. Write a shorter number.")


class _Duplicated(dict):  # type: ignore[type-arg]
    """A JSON object that names a key twice: the last value, as ``TryGetProperty`` reads
    it, and in ``members`` every member in file order, as ``EnumerateObject`` yields them."""

    __slots__ = ("members",)

    members: list[tuple[str, Any]]


def _object(found: list[_Duplicated], pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """``object_pairs_hook``: the object the parser builds, keeping a duplicate's members
    (each such object is also put in ``found``)."""
    obj = dict(pairs)
    if len(obj) != len(pairs):
        obj = _Duplicated(obj)
        obj.members = pairs
        found.append(obj)
    return obj


def _plain(value: Any) -> Any:
    """``value`` with every object a plain ``dict``: a ``_Duplicated`` is for the parser's
    own checks, never for what the daemon keeps. ``jsontext.dumps`` writes an integer
    beyond 64 bits only inside plain dicts (it walks them by their exact type), so one in a
    schema object that named a key twice failed every ``list`` and MCP ``tools/list`` of its
    workspace, and every check of a large call's arguments in the check process."""
    kind = type(value)
    if kind is dict or kind is _Duplicated:
        return {key: _plain(item) for key, item in value.items()}
    if kind is list:
        return [_plain(item) for item in value]
    return value


def _members(obj: Mapping[str, Any]) -> Any:
    """Every member of an object in file order, duplicate keys included (``EnumerateObject``)."""
    return obj.members if type(obj) is _Duplicated else obj.items()


def _load_json(text: bytes, *, members: bool = False) -> tuple[Any, list[_Duplicated] | None]:
    """Parse the manifest; with ``members`` (or when an ``argv`` map may be in it), an
    object that names a key twice keeps every member (``_members``).

    Returns:
        The value, and the objects that keep their duplicate members (None when none can:
        the text was parsed without them).
    """
    decoded = decode_file_text(text)
    # The reference host enumerates argv maps and dotnet overlays member by member, so an
    # earlier duplicate is checked too. Only those need the (slower) hook: "argv" can only
    # be written as is, or with a \u escape.
    found: list[_Duplicated] | None = None
    hook = None
    if members or '"argv"' in decoded or "\\u" in decoded:
        found = []
        hook = partial(_object, found)
    try:
        value = json.loads(
            decoded,
            parse_float=_finite,
            parse_constant=reject_json_constant,
            object_pairs_hook=hook,
        )
    except RecursionError:
        _fail(
            f"tools.json is not valid JSON: the maximum nesting depth of {_MAX_DEPTH} was exceeded."
        )
    except ValueError as exc:  # JSONDecodeError, NaN/Infinity, over-long integers
        if not isinstance(exc, json.JSONDecodeError) and "integer string conversion" in str(exc):
            _too_many_digits(decoded)
        _fail(f"tools.json is not valid JSON: {exc}")
    # Counting brackets is an upper bound on depth, so most manifests skip the walk.
    if (
        isinstance(value, dict | list)
        and decoded.count("{") + decoded.count("[") > _MAX_DEPTH
        and _too_deep(value)
    ):
        _fail(
            f"tools.json is not valid JSON: the maximum nesting depth of {_MAX_DEPTH} was exceeded."
        )
    if "\\u" in decoded and (problem := _lone_surrogate(decoded)) is not None:
        _fail(f"tools.json is not valid JSON: {problem}")
    return value, found


def _blank(value: str) -> bool:
    return not value.strip(NET_WHITESPACE)


def _string(obj: Mapping[str, Any], key: str) -> str | None:
    """A present, non-blank string, trimmed; else None (``TryReadString``)."""
    value = obj.get(key)
    if isinstance(value, str) and not _blank(value):
        return value.strip(NET_WHITESPACE)
    return None


def _string_list(obj: Mapping[str, Any], key: str, message: str) -> tuple[str, ...] | None:
    """An optional array of non-blank strings, each trimmed; None when absent or null."""
    value = obj.get(key)
    if value is None:
        return None
    if not isinstance(value, list):
        _fail(message, (key,))
    items: list[str] = []
    for item in value:
        if not isinstance(item, str) or _blank(item):
            _fail(message, (key,))
        items.append(item.strip(NET_WHITESPACE))
    return tuple(items)


def _catalogs(
    obj: Mapping[str, Any], default: frozenset[CatalogName], message: str
) -> frozenset[CatalogName]:
    values = _string_list(obj, "catalogs", message)
    if values is None:
        return default
    members = {value.lower() for value in values}
    if not values or not members <= {"plan", "work"}:
        _fail(message, ("catalogs",))
    return frozenset(CatalogName(member) for member in members)


def _approval(obj: Mapping[str, Any], default: Approval, prefix: str = "") -> Approval:
    value = obj.get("approval")
    if value is None:
        return default
    if isinstance(value, str):
        if _blank(value):
            return Approval.INHERIT  # blank means inherit, even under an "always" set
        word = value.strip(NET_WHITESPACE).lower()
        if word in ("inherit", "always"):
            return Approval(word)
    _fail(f"{prefix}approval must be inherit or always.", ("approval",))


def _optional_bool(obj: Mapping[str, Any], key: str) -> bool:
    value = obj.get(key)
    if value is None:
        return True
    if not isinstance(value, bool):
        _fail(f"{key} must be a boolean.", (key,))
    return value


def _timeout(root: Mapping[str, Any]) -> int | None:
    value = root.get("timeoutSeconds", _MISSING)
    if value is _MISSING:
        return DEFAULT_TIMEOUT_SECONDS
    if value == "unlimited" and isinstance(value, str):
        return None
    # bool is an int subclass in Python; JSON true is not a number. 1.0 parses as float.
    if type(value) is int and 1 <= value <= _MAX_TIMEOUT_SECONDS:
        return value
    _fail("timeoutSeconds must be a supported positive integer or unlimited.", ("timeoutSeconds",))


def _argv(obj: Mapping[str, Any]) -> tuple[tuple[str, str], ...]:
    value = obj.get("argv")
    if value is None:
        return ()
    if not isinstance(value, dict):
        _fail("argv must be an object of flag strings.", ("argv",))
    for key, flag in _members(value):  # a duplicate key's every value, as the reference host
        if not isinstance(flag, str) or _blank(flag):
            _fail(f"argv '{key}' must be a flag string.", ("argv",))
    return tuple((key, flag.strip(NET_WHITESPACE)) for key, flag in value.items())


def _output(obj: Mapping[str, Any], name: str) -> OutputMode:
    value = obj.get("output", _MISSING)
    if value is _MISSING:
        return OutputMode.TEXT
    if isinstance(value, str) and value.strip(NET_WHITESPACE).lower() in ("text", "content"):
        return OutputMode(value.strip(NET_WHITESPACE).lower())
    _fail(f"Tool '{name}' has invalid output: output must be text or content.", ("output",))


def _exec_tool(
    obj: Mapping[str, Any],
    *,
    name: str | None,
    catalogs: frozenset[CatalogName],
    approval: Approval,
    reserved: frozenset[str],
) -> ToolDef:
    """Read one exec tool (an element of ``tools``, or the root for shorthand)."""
    shorthand = name is not None
    if name is None:
        name = _string(obj, "name")
        if name is None:
            _fail("Each exec tool requires name.")
    if not is_tool_name(name, reserved):
        _fail(f"Tool name '{name}' is reserved or invalid.")
    description = _string(obj, "description")
    if description is None:
        _fail(f"Tool '{name}' requires description.")
    schema = obj.get("schema")
    if not isinstance(schema, dict):
        _fail(f"Tool '{name}' requires a JSON Schema object.")
    tool_catalogs = _catalogs(obj, catalogs, f"Tool '{name}' has invalid catalogs.")
    argv = _argv(obj)
    suffix = _string_list(obj, "command", f"Tool '{name}' command must be an array of strings.")
    path_arguments = _string_list(
        obj, "pathArguments", f"Tool '{name}' pathArguments must be an array of strings."
    )
    tool_approval = _approval(obj, approval, f"Tool '{name}' has invalid approval: ")
    output = _output(obj, name)
    return ToolDef(
        name=name,
        description=description,
        schema=schema,
        catalogs=tool_catalogs,
        approval=tool_approval,
        # Shorthand: the root ``command`` is the set prefix, not also a suffix (seed wins).
        command=() if shorthand else (suffix or ()),
        argv=argv,
        path_arguments=path_arguments or (),
        output=output,
        listing_notes=tuple(listing_notes(name, schema)),
    )


def _exec_tools(
    root: Mapping[str, Any],
    tools: Any,
    *,
    directory: str,
    catalogs: frozenset[CatalogName],
    approval: Approval,
    reserved: frozenset[str],
) -> tuple[ToolDef, ...]:
    if tools is None:
        if not is_tool_name(directory, reserved):
            _fail(f"Directory '{directory}' is not a valid tool name for exec shorthand.")
        return (
            _exec_tool(
                root, name=directory, catalogs=catalogs, approval=approval, reserved=reserved
            ),
        )
    result: list[ToolDef] = []
    names: set[str] = set()
    for index, element in enumerate(tools):
        if not isinstance(element, dict):
            _fail("Each exec tool must be a JSON object.", ("tools", index))
        try:
            tool = _exec_tool(
                element, name=None, catalogs=catalogs, approval=approval, reserved=reserved
            )
        except ManifestError as exc:
            _in(index, exc)
        if tool.name in names:
            _fail(f"Duplicate tool name '{tool.name}'.", ("tools", index))
        names.add(tool.name)
        result.append(tool)
    if not result:
        _fail("exec tools array must not be empty.")
    return tuple(result)


def _dotnet_overlays(
    overlays: Mapping[str, Any],
    *,
    catalogs: frozenset[CatalogName],
    approval: Approval,
    reserved: frozenset[str],
) -> tuple[ToolDef, ...]:
    """Validate dotnet overlays with every reference rule; toolsetd never runs them.

    Returns:
        Each overlay as the reference host keeps it, in manifest order: a tool of its key's
        name (also its description) with an empty schema, its catalogs, approval and
        ``pathArguments``. Nothing loads them; the set's row names them, as the reference
        host's inventory does (``name`` or ``name (always)``).
    """
    declared: list[ToolDef] = []
    for key, value in _members(overlays):  # a duplicate key's every value, as the reference host
        try:
            declared.append(
                _dotnet_overlay(key, value, catalogs=catalogs, approval=approval, reserved=reserved)
            )
        except ManifestError as exc:
            _in(key, exc)
    return tuple(declared)


def _dotnet_overlay(
    key: str,
    value: Any,
    *,
    catalogs: frozenset[CatalogName],
    approval: Approval,
    reserved: frozenset[str],
) -> ToolDef:
    """One overlay of ``_dotnet_overlays``."""
    if not is_tool_name(key, reserved):
        _fail(f"Overlay '{key}' is reserved or invalid.")
    if not isinstance(value, dict):
        _fail(f"Overlay '{key}' must be a JSON object.")
    if "output" in value:
        _fail(f"Overlay '{key}' cannot set output.")
    overlay_catalogs = _catalogs(value, catalogs, f"Overlay '{key}' has invalid catalogs.")
    _argv(value)
    path_arguments = _string_list(
        value, "pathArguments", f"Overlay '{key}' pathArguments must be an array of strings."
    )
    overlay_approval = _approval(value, approval, f"Overlay '{key}' has invalid approval: ")
    return ToolDef(
        name=key,
        description=key,
        schema={},
        catalogs=overlay_catalogs,
        approval=overlay_approval,
        path_arguments=path_arguments or (),
    )


def parse_manifest(
    text: bytes,
    *,
    set_dir: Path,
    source: Source,
    reserved: frozenset[str],
    schemas: SchemaChecker | None = None,
) -> ToolSet:
    """Parse one ``tools.json``; the first failing rule raises.

    Args:
        text: The manifest bytes.
        set_dir: The set directory; its last segment is the set's identity.
        source: Home or project.
        reserved: Tool names no external tool may take (case-sensitive).
        schemas: The schema-check cache to use; a fresh one when None.

    Returns:
        The parsed set. Dotnet sets come back with ``runner`` DOTNET and their overlays
        as ``tools`` (``_dotnet_overlays``), which nothing loads.

    Raises:
        ManifestError: With the reference host's message for the first rule that fails,
            or ``Tool '<name>' has an invalid JSON Schema: ...`` after all of them pass.
    """
    raw = os.fspath(set_dir)
    if not raw or "\x00" in raw:
        _fail("Tool set directory is not a valid path.")
    absolute = os.path.abspath(raw)  # GetFullPath: absolute, ".." applied lexically
    path = set_dir if isinstance(set_dir, Path) and absolute == raw else Path(absolute)
    directory = path.name
    if not is_directory_name(directory):
        _fail(f"Tool set directory '{directory}' is not a valid name.")
    root, duplicated = _load_json(text)
    if not isinstance(root, dict):
        _fail("tools.json must be a JSON object.")

    runner_text = _string(root, "runner")
    if runner_text is None or runner_text.lower() not in ("exec", "dotnet"):
        _fail("tools.json must set runner to exec or dotnet.")
    runner = RunnerKind(runner_text.lower())
    catalogs = _catalogs(root, _BOTH, "catalogs must be plan, work, or both.")
    approval = _approval(root, Approval.INHERIT)
    timeout = _timeout(root)
    stdin = _optional_bool(root, "stdin")
    enabled = _optional_bool(root, "enabled")
    command = _string_list(root, "command", "command must be an array of strings.") or ()
    tools = root.get("tools")
    if not isinstance(tools, list | dict):
        tools = None  # any other kind, such as a string, is ignored
    shorthand = any(root.get(key) is not None for key in _SHORTHAND_NON_NULL) or isinstance(
        root.get("schema"), dict
    )
    if runner is RunnerKind.DOTNET and "output" in root:
        _fail("output is only valid for exec.", ("output",))

    common: dict[str, Any] = {
        "directory": directory,
        "source": source,
        "path": path,
        "runner": runner,
        "enabled": enabled,
        "approval": approval,
        "catalogs": catalogs,
        "command": command,
        "stdin": stdin,
        "timeout_seconds": timeout,
        "digest": "sha256:" + hashlib.sha256(text).hexdigest(),
    }

    if runner is RunnerKind.DOTNET:
        if isinstance(tools, list):
            _fail("dotnet tools must be a JSON object of overlays.")
        if _string(root, "assembly") is None:
            _fail("dotnet runner requires assembly.")
        _string_list(root, "types", "types must be an array of strings.")
        if tools:
            if duplicated is None:  # the overlays' members, duplicates included: parsed again
                tools = _load_json(text, members=True)[0]["tools"]
            overlays = _dotnet_overlays(
                tools, catalogs=catalogs, approval=approval, reserved=reserved
            )
            return ToolSet(**common, tools=overlays)
        return ToolSet(**common)

    if isinstance(tools, dict):
        _fail("exec tools must be a JSON array.")
    if tools is not None and shorthand:
        _fail("exec shorthand fields cannot mix with a tools array.")
    defs = _exec_tools(
        root, tools, directory=directory, catalogs=catalogs, approval=approval, reserved=reserved
    )
    if duplicated:  # a schema holds only plain dicts, as a manifest without argv does
        defs = tuple(dataclasses.replace(tool, schema=_plain(tool.schema)) for tool in defs)
    if not command and not any(tool.command for tool in defs):
        _fail("exec requires a command array.")
    checker = schemas if schemas is not None else SchemaChecker()
    for tool in defs:
        problem = checker.problem(tool.schema)
        if problem is not None:
            _fail(f"Tool '{tool.name}' has an invalid JSON Schema: {problem}")
    return ToolSet(**common, tools=tuple(_listable(tool, checker) for tool in defs))


def _listable(tool: ToolDef, checker: SchemaChecker) -> ToolDef:
    """``tool``, noted as left out of MCP's ``tools/list`` when its schema, of an older
    draft than 2020-12, is none once converted (``mcpschema.invalid_listing_note``): the
    2020-12 meta-schema checks each such listing here, once per content (``checker``'s
    verdicts), and a schema of 2020-12 (most: no ``$schema``) is not looked at again."""
    if dialect(tool.schema) == 2020 or is_unlisted(tool.listing_notes):
        return tool
    problem = checker.problem(listed_schema(tool.schema))
    if problem is None:
        return tool
    notes = (invalid_listing_note(tool.name, problem), *tool.listing_notes)
    return dataclasses.replace(tool, listing_notes=notes)
