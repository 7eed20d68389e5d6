"""A tool's input schema as MCP hosts take it (pure: no I/O).

Theory of operation
-------------------
A manifest's schema is any valid JSON Schema (contract section 4); MCP's ``Tool`` has a
narrower ``inputSchema``, and its SDKs check it. The SDK clients most hosts build on
refuse a whole ``tools/list`` over one entry they do not take, or drop that entry, so
one odd schema cost a host every tool. This module holds, in one place for every MCP
face (socket, stdio, HTTP) and for the operator notes that say so:

* ``listed_schema``: the schema as listed. ``type: "object"`` at its root; each root
  ``properties`` entry an object (a boolean schema as the object that says the same);
  no draft 3 boolean ``required`` at the root; and no ``x-mcp-header`` marks when they
  break MCP's rules (``header_marks``: the daemon checks no header for such a schema,
  and the SDK clients drop the tool). None of these changes what the daemon validates:
  a call is checked against the schema as declared.
* ``header_marks``: the ``x-mcp-header`` marks the HTTP face checks.
* ``unlisted_reason``: why a tool cannot be listed at all. An integer no double holds
  (309 digits or more; the manifest parser refuses such a number written with a fraction
  or an exponent, not an integer) reads as ``Infinity`` in a JavaScript host: the
  TypeScript SDK's 2.x client refuses the whole list over one in a root property, its
  1.x client shows ``null`` in its place. No listing says the same number, so the tool
  is left out of ``tools/list`` and the catalog (and ``toolsetctl validate``) notes why;
  the native face and ``tools/call`` keep it.
* ``listing_notes``: the operator notes on both (the catalog's and ``validate``'s).
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from typing import Any

import orjson

from .validation import json_pointer

__all__ = [
    "HEADER_MARK",
    "header_marks",
    "listed_schema",
    "listing_notes",
    "unlisted_reason",
]

#: The annotation that has a 2026-07-28 HTTP client mirror an argument into a header.
HEADER_MARK = "x-mcp-header"
#: The object form of JSON Schema's boolean schemas: ``true`` takes anything, ``false`` nothing.
_BOOLEAN_SCHEMAS: dict[bool, dict[str, Any]] = {True: {}, False: {"not": {}}}
#: JSON Schema keywords whose value is a schema, a list of schemas, or a map of them
#: (besides ``properties``, the one keyword that keeps a property statically reachable):
#: the positions MCP's SDKs look for marks in (instance data such as ``const`` is none).
_SUBSCHEMA = frozenset(
    {
        "items",
        "contains",
        "unevaluatedItems",
        "additionalProperties",
        "propertyNames",
        "unevaluatedProperties",
        "not",
        "if",
        "then",
        "else",
        "contentSchema",
    }
)
_SUBSCHEMAS = frozenset({"allOf", "anyOf", "oneOf", "prefixItems"})
_SUBSCHEMA_MAP = frozenset({"patternProperties", "dependentSchemas", "$defs", "definitions"})
#: Every keyword ``_positions`` walks besides ``properties``.
_WALKED = _SUBSCHEMA | _SUBSCHEMAS | _SUBSCHEMA_MAP
#: An HTTP field name (RFC 9110 5.6.2 token).
_TOKEN = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
_HEADER_TYPES = ("string", "integer", "boolean")


def _positions(
    schema: Mapping[str, Any],
) -> Iterator[tuple[tuple[str, ...] | None, Mapping[str, Any]]]:
    """Every schema position MCP's SDKs walk for marks, with its path of ``properties``
    keys from the root (None once the chain passes any other keyword)."""
    pending: list[tuple[tuple[str, ...] | None, Any]] = [((), schema)]
    while pending:
        path, node = pending.pop()
        if not isinstance(node, Mapping):
            continue
        yield path, node
        children: list[tuple[tuple[str, ...] | None, Any]] = []
        for keyword, value in node.items():
            if keyword == "properties" and isinstance(value, Mapping):
                children.extend(
                    ((*path, key) if path is not None else None, sub) for key, sub in value.items()
                )
            elif keyword in _WALKED:
                children.extend((None, sub) for sub in _subschemas(keyword, value))
        pending.extend(reversed(children))  # depth first, in the file's order


def _subschemas(keyword: str, value: Any) -> list[Any]:
    """The schemas under ``keyword`` (one of ``_WALKED``), whatever the shape of its value,
    as the TypeScript SDK's client takes them: a list's items (draft 7's tuple ``items``),
    a map keyword's values, or the value itself. A value of another shape than its
    keyword's (``"prefixItems": {...}``, ``"$defs": [...]``) is valid JSON Schema where the
    schema's ``$schema`` names a draft that does not know that keyword (draft 7 knows
    neither), and that client looks in it all the same: a mark there dropped the tool."""
    if isinstance(value, list):
        return value
    if isinstance(value, Mapping) and keyword in _SUBSCHEMA_MAP:
        return list(value.values())
    return [value]


def _marks(schema: Mapping[str, Any]) -> tuple[list[tuple[tuple[str, ...], str]], str | None]:
    """The schema's marks, and the first way one breaks MCP's rules (None: none does)."""
    found: list[tuple[tuple[str, ...], str]] = []
    seen: dict[str, str] = {}
    for path, node in _positions(schema):
        if HEADER_MARK not in node:
            continue
        marked = node[HEADER_MARK]
        where = ".".join(path) if path else ""
        if not path:
            return [], "one is not on a property reached from the root through properties alone"
        if not isinstance(marked, str) or not _TOKEN.fullmatch(marked):
            return [], f"the one on '{where}' is no HTTP header name"
        if node.get("type") not in _HEADER_TYPES:
            return [], f"the one on '{where}' is on a type other than string, integer or boolean"
        if (other := seen.get(marked.lower())) is not None:
            return [], f"'{other}' and '{where}' are marked with the same name"
        seen[marked.lower()] = where
        found.append((path, marked))
    return found, None


def header_marks(schema: Mapping[str, Any]) -> list[tuple[tuple[str, ...], str]] | None:
    """The (property path, header name) of every ``x-mcp-header`` of a tool's schema.

    None when there is none, or when one breaks MCP's constraints (on a property not
    reached from the root through ``properties`` keys alone, not a token, on a type
    other than string, integer or boolean, or the same name twice in any case): such a
    schema is listed without its marks (``listed_schema``), so no header is checked.
    """
    found, problem = _marks(schema)
    return found if found and problem is None else None


def _unmarked(node: Any) -> Any:
    """``node`` without an ``x-mcp-header`` at any position ``_positions`` walks."""
    if not isinstance(node, Mapping):
        return node
    out: dict[str, Any] = {}
    for keyword, value in node.items():
        if keyword == HEADER_MARK:
            continue
        if keyword in ("properties", *_SUBSCHEMA_MAP) and isinstance(value, Mapping):
            out[keyword] = {key: _unmarked(sub) for key, sub in value.items()}
        elif keyword in _WALKED and isinstance(value, list):
            out[keyword] = [_unmarked(sub) for sub in value]
        elif keyword in _WALKED:
            out[keyword] = _unmarked(value)
        else:
            out[keyword] = value
    return out


def _may_be_marked(schema: Mapping[str, Any]) -> bool:
    """Whether ``schema`` may hold a mark: one C pass (~1 us) instead of a walk in Python
    (~6 us a tool, for every tool of a listing); an integer wider than 64 bits, which
    orjson refuses, takes the walk."""
    try:
        return HEADER_MARK.encode() in orjson.dumps(schema)
    except orjson.JSONEncodeError:
        return True


def listed_schema(schema: Mapping[str, Any], *, marks_checked: bool = False) -> Mapping[str, Any]:
    """A tool's schema as an MCP ``inputSchema`` (the module docstring says what changes).

    ``marks_checked``: the caller knows the schema's marks break none of MCP's rules (a
    tool whose parse made no ``listing_notes``), so they are not looked at again.

    MCP's arguments are always an object, and its schema requires that root type; a host
    that checks it (the SDK) refuses the whole ``tools/list`` when one tool lacks it. A
    manifest may leave ``type`` out or allow other types beside object: for the objects an
    MCP host sends, ``"object"`` says the same. MCP's schema also makes each root property
    an object, and the TypeScript SDK's client (most Node hosts') refuses the whole list
    when one is a boolean schema (``"x": true``, valid JSON Schema): it is listed as the
    object that says the same (``{}``, ``{"not": {}}``); its root ``required`` must be a
    list of names, and draft 3's boolean one (which says nothing at the root) is left out.
    A mark that breaks MCP's rules makes its SDK clients (Python's on every transport,
    TypeScript's over HTTP) drop the tool on 2026-07-28; the daemon checks no header of
    such a schema, so its marks are left out and the tool is listed. An annotation
    changes no validation.
    """
    if not marks_checked and _may_be_marked(schema) and _marks(schema)[1] is not None:
        schema = _unmarked(schema)
    properties = schema.get("properties")
    if isinstance(properties, Mapping) and any(
        isinstance(sub, bool) for sub in properties.values()
    ):
        fixed = {
            k: _BOOLEAN_SCHEMAS[v] if isinstance(v, bool) else v for k, v in properties.items()
        }
        schema = {**schema, "properties": fixed}
    if isinstance(schema.get("required"), bool):
        # Draft 3's ``required`` is a boolean (its instance must be present), which the
        # root always is; MCP's schema (and the TypeScript SDK's) has a list of names there.
        schema = {k: v for k, v in schema.items() if k != "required"}
    if schema.get("type") == "object":
        return schema
    return {**schema, "type": "object"}


def unlisted_reason(name: str, schema: Mapping[str, Any]) -> str | None:
    """The operator note for a tool MCP hosts cannot be shown, or None (most tools).

    Args:
        name: The tool's name.
        schema: Its schema as declared.
    """
    try:
        # orjson refuses any integer wider than 64 bits: one C pass clears almost every
        # schema (a walk in Python cost ~10 us a tool, at every catalog build).
        orjson.dumps(schema)
    except orjson.JSONEncodeError:
        return _huge_integer(name, schema)
    return None


def listing_notes(name: str, schema: Mapping[str, Any]) -> list[str]:
    """The operator notes on how MCP hosts are shown a tool (the catalog's, ``validate``'s):
    left out (``unlisted_reason``), or listed without its ``x-mcp-header`` marks.

    Args:
        name: The tool's name.
        schema: Its schema as declared.
    """
    unlisted = unlisted_reason(name, schema)
    if unlisted is not None:
        return [unlisted]
    if not _may_be_marked(schema):
        return []
    problem = _marks(schema)[1]
    if problem is None:
        return []
    return [
        f"External tool '{name}' is listed to MCP hosts without its {HEADER_MARK} marks: "
        f"{problem}, which MCP's rules refuse (its 2026-07-28 clients drop such a tool), so "
        "no argument of it is mirrored into a header, nor checked in one."
    ]


def _huge_integer(name: str, schema: Mapping[str, Any]) -> str | None:
    """``unlisted_reason`` past its fast path: the first integer no double holds."""
    pending: list[tuple[tuple[str | int, ...], Any]] = [((), schema)]
    while pending:
        path, node = pending.pop()
        if isinstance(node, Mapping):
            pending.extend(((*path, k), v) for k, v in reversed(list(node.items())))
        elif isinstance(node, list):
            pending.extend(((*path, i), v) for i, v in reversed(list(enumerate(node))))
        elif type(node) is int and not _double_holds(node):
            return (
                f"External tool '{name}' is not listed to MCP hosts: its schema holds an "
                f"integer beyond the range of a double (about ±1.8e308) at "
                f"{json_pointer(path)}, which a JavaScript host reads as Infinity (the "
                "TypeScript SDK's client refuses the whole tools/list over it). Write a "
                "smaller number, or leave it out."
            )
    return None


def _double_holds(number: int) -> bool:
    """Whether a double holds ``number`` (rounded as JavaScript's ``JSON.parse`` rounds)."""
    try:
        float(number)
    except OverflowError:
        return False
    return True
