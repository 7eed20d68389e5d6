"""A tool's input schema as MCP hosts take it (pure: no I/O).

Theory of operation
-------------------
A manifest's schema is any valid JSON Schema (contract section 4); MCP's ``Tool`` has a
narrower ``inputSchema``, and its SDKs check it. The SDK clients most hosts build on
refuse a whole ``tools/list`` over one entry they do not take, or drop that entry, so
one odd schema cost a host every tool. This module holds, in one place for every MCP
face (socket, stdio, HTTP) and for the operator notes that say so:

* ``listed_schema``: the schema as listed. JSON Schema 2020-12, MCP's default dialect
  (``as_2020_12``: a schema of drafts 3 to 2019-09 as the 2020-12 schema that says the
  same; Claude's API refuses every request of a session whose tools hold one schema of
  another dialect); no ``allOf``/``anyOf``/``oneOf``/``not``/``enum`` at its root
  (Claude's API refuses the first three there, OpenAI's all five: they move under
  ``"if": true, "then"``, which applies them the same);
  ``type: "object"`` at its root; each root ``properties`` entry an object (a boolean
  schema as the object that says the same); and no ``x-mcp-header`` marks when they
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
  the native face and ``tools/call`` keep it. A schema whose root type excludes objects
  (``"type": "array"``) is left out too: an MCP host's arguments are an object, so none
  of its calls could pass.
* ``listing_notes``: the operator notes on both (the catalog's and ``validate``'s).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any
from urllib.parse import quote, unquote

from toolsetd.protocol.jsontext import dumps as json_dumps
from toolsetd.protocol.jsontext import strict_dumps

from .validation import dialect, json_pointer

__all__ = [
    "DIALECT_2020_12",
    "HEADER_MARK",
    "as_2020_12",
    "header_marks",
    "invalid_listing_note",
    "is_unlisted",
    "listed_schema",
    "listing_notes",
    "unlisted_reason",
]

#: What every note of a tool left out of ``tools/list`` says, after the tool's name.
_UNLISTED = "is not listed to MCP hosts:"
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
#: The keywords whose value may be a list of schemas (draft 7's tuple ``items`` too).
_SUBSCHEMA_LISTS = _SUBSCHEMAS | _SUBSCHEMA
#: The keywords whose value is a map of schemas, ``properties`` with them.
_SUBSCHEMA_MAPS = _SUBSCHEMA_MAP | {"properties"}
#: An HTTP field name (RFC 9110 5.6.2 token).
_TOKEN = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
_HEADER_TYPES = ("string", "integer", "boolean")
#: What a JSON Pointer in a URI fragment keeps as it is (RFC 3986 ``pchar`` and ``/``).
_POINTER_SAFE = "!$&'()*+,;=:@-._~"


#: The ``$schema`` of JSON Schema 2020-12, MCP's dialect when none is declared.
DIALECT_2020_12 = "https://json-schema.org/draft/2020-12/schema"
#: The 2020-12 keywords that assert, apply or name something, each in the last older draft
#: that lacks it: a schema of that draft (or an older one) that holds one means nothing by it
#: (its validator passes it by), so its listing as 2020-12 leaves it out.
_ADDED_AFTER: dict[int, frozenset[str]] = {
    2019: frozenset({"prefixItems", "$dynamicRef", "$dynamicAnchor"}),
    7: frozenset({
        "dependentRequired", "dependentSchemas", "unevaluatedItems", "unevaluatedProperties",
        "maxContains", "minContains", "$anchor", "$recursiveRef", "$recursiveAnchor",
    }),
    6: frozenset({"if", "then", "else"}),
    4: frozenset({"const", "contains", "propertyNames", "$id"}),
    3: frozenset({
        "allOf", "anyOf", "oneOf", "not", "multipleOf", "maxProperties", "minProperties",
    }),
}  # fmt: skip
_NEWER_THAN: dict[int, frozenset[str]] = {
    draft: frozenset().union(*(added for last, added in _ADDED_AFTER.items() if last >= draft))
    for draft in _ADDED_AFTER
}
#: The keywords that assert or apply in some draft (or that move what ``$ref`` resolves
#: against): the ones draft 7 and older pass by beside a ``$ref``.
_APPLYING = _NEWER_THAN[3] | {
    "type", "enum", "maximum", "exclusiveMaximum", "minimum", "exclusiveMinimum",
    "maxLength", "minLength", "pattern", "maxItems", "minItems", "uniqueItems", "required",
    "dependencies", "items", "additionalItems", "properties", "patternProperties",
    "additionalProperties", "id", "extends", "disallow", "divisibleBy",
}  # fmt: skip
#: The annotations 2020-12's meta-schema gives a type, with it. A draft that does not know one
#: (``examples`` before draft 6, ``$comment`` before 7, ``deprecated`` before 2019-09) takes
#: any value there: such a value of another type is left out (it annotates nothing).
_ANNOTATION_TYPES: dict[str, type] = {
    "$comment": str,
    "contentEncoding": str,
    "contentMediaType": str,
    "deprecated": bool,
    "readOnly": bool,
    "writeOnly": bool,
    "examples": list,
}
#: The keywords of a document's root that name or hold resources rather than constrain it.
_RESOURCE_KEYWORDS = frozenset(
    {"$schema", "$id", "$anchor", "$dynamicAnchor", "$vocabulary", "$defs", "definitions"}
)
#: A 2020-12 ``$anchor``.
_ANCHOR = re.compile(r"[A-Za-z_][-A-Za-z0-9._]*")
#: What a model's API refuses at an ``input_schema``'s root: Claude's says "input_schema
#: does not support oneOf, allOf, or anyOf at the top level", OpenAI's (Codex's) "schema
#: must have type 'object' and not have 'oneOf'/'anyOf'/'allOf'/'enum'/'not' at the top
#: level"; and the keywords that move with them (``listed_schema``).
_ROOT_REFUSED = ("allOf", "anyOf", "oneOf", "not", "enum")
_CONDITIONAL = frozenset({*_ROOT_REFUSED, "if", "then", "else"})


def as_2020_12(schema: Mapping[str, Any]) -> Mapping[str, Any]:
    """``schema`` as the JSON Schema 2020-12 schema that takes the same instances, without a
    ``$schema`` unless it is 2020-12's (MCP's default dialect; Claude's API refuses every
    request of a session whose tools hold one schema that is not 2020-12). ``schema``
    itself when it is one already (most schemas: no ``$schema``)."""
    declared = schema.get("$schema")
    if declared is None:
        return schema
    draft = dialect(schema)
    if draft == 2020:
        if declared in (DIALECT_2020_12, DIALECT_2020_12 + "#"):
            return schema
        # jsonschema checks an unknown $schema as 2020-12; a host may refuse the name.
        return {k: v for k, v in schema.items() if k != "$schema"}
    moves: _Moves = {}
    converted: Mapping[str, Any] = _converted(schema, draft, moves)
    if _may_refer(converted):
        converted = _kept_for_refs(schema, converted, draft, moves)
        # A pointer to a subschema that moved (``#/items/0``) follows it (``#/prefixItems/0``).
        converted = _refs_moved(converted, lambda path: _moved_to(moves, path))
    return converted


#: Where each subschema is on the way to 2020-12: its path from the root as declared (JSON
#: Pointer tokens) to its path as listed (the same path when it did not move).
_Moves = dict[tuple[str, ...], tuple[str, ...]]
#: The ``$defs`` name (then with ``_`` added till it is new) of a subschema kept for a
#: ``$ref`` only (``_kept_for_refs``).
_KEPT_FOR_REF = "ref"


def _moved_to(moves: _Moves, path: tuple[str, ...]) -> tuple[str, ...] | None:
    """Where the subschema at ``path`` as declared is listed, when it moved (else None)."""
    to = moves.get(path)
    return None if to == path else to


def _kept_for_refs(
    declared: Mapping[str, Any], converted: Mapping[str, Any], draft: int, moves: _Moves
) -> Mapping[str, Any]:
    """``converted`` with each subschema a ``$ref`` pointer leads to, which the listing left
    out (a keyword its draft passes by, such as draft 7's ``dependentSchemas``, or one beside
    a ``$ref`` in draft 7 and older), converted into the root's ``$defs``, where it applies
    only through the ``$ref``; ``moves`` gets its move. jsonschema resolves such a pointer
    into the document whatever keyword it passes through, and applies what it finds: a
    listing without it led nowhere, and a host that resolves it refused the schema."""
    defs = converted.get("$defs")
    if defs is not None and not isinstance(defs, Mapping):
        return converted  # a draft's unknown ``$defs`` of another shape (``_misfit``)
    kept: dict[str, Any] = {}
    pending = [converted]
    while pending:
        targets = sorted(
            {path for node in pending for path in _pointers(node)}, key=lambda p: (len(p), p)
        )
        pending = []
        for path in targets:
            if path in moves:  # listed (maybe within one kept just now)
                continue
            found = _pointed(declared, path)
            if not isinstance(found, (Mapping, bool)):
                continue  # no schema there: it leads nowhere as declared too
            name = _KEPT_FOR_REF
            while name in kept or (defs is not None and name in defs):
                name += "_"
            kept[name] = _converted(found, draft, moves, path, ("$defs", name))
            pending.append(kept[name])
    if not kept:
        return converted
    return {**converted, "$defs": {**(defs or {}), **kept}}


def _pointers(node: Any, root: bool = True) -> Iterator[tuple[str, ...]]:
    """The paths (JSON Pointer tokens) each ``$ref`` pointer of ``node``'s own resource leads
    to (none below a subschema with its own ``$id``, where ``#`` is that subschema)."""
    if not isinstance(node, Mapping) or (not root and "$id" in node):
        return
    ref = node.get("$ref")
    if isinstance(ref, str) and (tokens := _pointer_tokens(ref)) is not None:
        yield tokens
    for keyword, value in node.items():
        for sub in _children(keyword, value):
            yield from _pointers(sub, False)


def _pointed(document: Any, path: tuple[str, ...]) -> Any:
    """What ``path`` (JSON Pointer tokens) leads to in ``document``; None: nothing."""
    for token in path:
        if isinstance(document, Mapping):
            document = document.get(token)
        elif isinstance(document, list) and token.isdigit() and int(token) < len(document):
            document = document[int(token)]
        else:
            return None
    return document


def _converted(
    node: Any, draft: int, moves: _Moves, at: tuple[str, ...] = (), to: tuple[str, ...] = ()
) -> Any:
    """A schema of ``draft`` (3 to 2019-09) as 2020-12 (``as_2020_12``), its subschemas too.

    What changed on the way: tuple ``items`` became ``prefixItems`` (and ``additionalItems``
    ``items``); ``dependencies`` became ``dependentRequired``/``dependentSchemas``; draft 3
    and 4's boolean ``exclusiveMaximum`` the number (``exclusiveMinimum`` alike); draft 3's
    ``required: true`` in a property its parent's list, ``type`` with schemas or ``any`` an
    ``anyOf``, ``extends`` an ``allOf``, ``disallow`` a ``not``, ``divisibleBy``
    ``multipleOf`` (an empty ``type``, which nothing passes, ``allOf: [false]``; an empty
    ``disallow`` or tuple ``items`` nothing: 2020-12 takes none of them empty); draft 3
    and 4's ``id`` an ``$id``, and its fragment, as a draft 6 or 7 ``$id``'s, an
    ``$anchor``; 2019-09's ``$recursiveRef`` a ``$ref``. Keywords an older draft passes by
    (``_NEWER_THAN``; beside a ``$ref`` in draft 7 and older, ``_APPLYING``) are left out,
    as they would apply, and so are values 2020-12 refuses where the draft took any
    (``_misfit``). ``moves`` gets each subschema's path as declared, ``at``, and as listed,
    ``to``, which the pointers of ``$ref`` follow (``_refs_moved``), or, when it is not
    listed, lead to a copy of (``_kept_for_refs``).
    """
    moves[at] = to
    if not isinstance(node, Mapping):
        return node  # a boolean schema (draft 6 on) says the same in 2020-12
    dropped = _NEWER_THAN[draft] | {"$schema"}
    out: dict[str, Any] = {}
    if draft <= 7 and "$ref" in node:
        dropped = dropped | (_APPLYING - {"$ref"})
        # A fragment id beside the ``$ref`` still names this subschema (jsonschema resolves
        # it), though its base is passed by: the name is listed as an ``$anchor``.
        named = node.get("id" if draft <= 4 else "$id")
        if isinstance(named, str) and named.startswith("#") and _ANCHOR.fullmatch(named[1:]):
            out["$anchor"] = named[1:]
    all_of: list[Any] = []
    for keyword, value in node.items():
        if keyword in dropped or _misfit(keyword, value):
            continue
        here = (*at, keyword)
        if keyword == "items":
            if isinstance(value, list):
                if value:  # draft 3's ``[]`` (2020-12's ``prefixItems`` takes none)
                    out["prefixItems"] = [
                        _converted(sub, draft, moves, (*here, str(i)), (*to, "prefixItems", str(i)))
                        for i, sub in enumerate(value)
                    ]
                if "additionalItems" in node:
                    out["items"] = _converted(
                        node["additionalItems"],
                        draft,
                        moves,
                        (*at, "additionalItems"),
                        (*to, "items"),
                    )
            else:
                out["items"] = _converted(value, draft, moves, here, (*to, keyword))
        elif keyword in ("properties", *_SUBSCHEMA_MAP) and isinstance(value, Mapping):
            out[keyword] = {
                key: _converted(sub, draft, moves, (*here, key), (*to, keyword, key))
                for key, sub in value.items()
                if isinstance(sub, (Mapping, bool))  # a draft's unknown ``$defs`` takes any
            }
            if keyword == "properties" and draft == 3:
                needed = [k for k, sub in value.items() if _draft3_required(sub)]
                if needed:
                    out["required"] = needed
        elif keyword in _SUBSCHEMAS and isinstance(value, list):
            out[keyword] = [
                _converted(sub, draft, moves, (*here, str(i)), (*to, keyword, str(i)))
                for i, sub in enumerate(value)
            ]
        elif keyword in _SUBSCHEMA:
            out[keyword] = _converted(value, draft, moves, here, (*to, keyword))
        elif keyword == "dependencies":
            if draft <= 7 and isinstance(value, Mapping):
                for key, sub in value.items():
                    if isinstance(sub, (str, list)):
                        needs = [sub] if isinstance(sub, str) else sub
                        out.setdefault("dependentRequired", {})[key] = needs
                    else:
                        out.setdefault("dependentSchemas", {})[key] = _converted(
                            sub, draft, moves, (*here, key), (*to, "dependentSchemas", key)
                        )
        elif keyword in ("maximum", "minimum") and draft <= 4:
            exclusive = "exclusiveMaximum" if keyword == "maximum" else "exclusiveMinimum"
            out[exclusive if node.get(exclusive) is True else keyword] = value
        elif keyword in ("exclusiveMaximum", "exclusiveMinimum") and isinstance(value, bool):
            continue  # draft 3 and 4's flag, taken with its bound
        elif keyword == "required" and isinstance(value, bool):
            continue  # draft 3's, in its parent's list (at the root it says nothing)
        elif keyword == "additionalItems":
            continue  # with tuple ``items``; passed by beside any other
        elif draft == 3 and keyword in ("type", "disallow", "extends", "divisibleBy"):
            _draft3_keyword(out, all_of, keyword, value, moves, at, to)
        elif keyword == ("id" if draft <= 4 else "$id") and draft <= 7 and isinstance(value, str):
            # Draft 3 and 4's ``id`` and draft 6 and 7's ``$id``, with a fragment or without.
            base, _, fragment = value.partition("#")
            if base:
                out["$id"] = base
            if _ANCHOR.fullmatch(fragment):
                out["$anchor"] = fragment
        elif keyword == "$recursiveRef":
            # Within one document (no ``$id`` below the root), as ``$ref`` resolves.
            if "$ref" in node:
                all_of.append({"$ref": value})
            else:
                out["$ref"] = value
        elif keyword != "$recursiveAnchor":
            out[keyword] = value
    if all_of:
        out["allOf"] = [*out.get("allOf", ()), *all_of]
    return out


def _misfit(keyword: str, value: Any) -> bool:
    """Whether 2020-12's meta-schema refuses ``value`` for ``keyword`` where a draft that
    does not know the keyword took it (and passed it by): an annotation of another type, a
    subschema that is none (``"$defs": 5``, ``"contentSchema": []`` before 2019-09,
    ``definitions`` in draft 3), or ``$vocabulary`` (a meta-schema's, which says nothing of
    arguments). A keyword the draft knows has the type already (its meta-schema's)."""
    kind = _ANNOTATION_TYPES.get(keyword)
    if kind is not None:
        return not isinstance(value, kind)
    if keyword in _SUBSCHEMA_MAP:
        return not isinstance(value, Mapping)
    if keyword == "contentSchema":
        return not isinstance(value, (Mapping, bool))
    return keyword == "$vocabulary"


def _draft3_required(sub: Any) -> bool:
    return isinstance(sub, Mapping) and sub.get("required") is True


def _draft3_keyword(
    out: dict[str, Any],
    all_of: list[Any],
    keyword: str,
    value: Any,
    moves: _Moves,
    at: tuple[str, ...],
    to: tuple[str, ...],
) -> None:
    """Draft 3's ``type`` (names, schemas, ``any``), ``disallow``, ``extends`` and
    ``divisibleBy`` as 2020-12 keywords, into ``out`` (``allOf`` members into ``all_of``;
    draft 3 has no ``allOf`` of its own), each schema's move into ``moves``."""
    if keyword == "divisibleBy":
        out["multipleOf"] = value
        return
    listed = isinstance(value, list)
    kinds = value if listed else [value]
    # Each schema member's path as declared: ``type/1``, or ``type`` for a lone schema.
    paths = [(*at, keyword, str(i)) if listed else (*at, keyword) for i in range(len(kinds))]
    if keyword == "extends":
        for path, sub in zip(paths, kinds, strict=True):
            all_of.append(_converted(sub, 3, moves, path, (*to, "allOf", str(len(all_of)))))
        return
    if not kinds:  # 2020-12 takes no empty ``type`` or ``anyOf``
        if keyword == "type":
            all_of.append(False)  # no type: nothing passes
        return
    if keyword == "type" and all(isinstance(k, str) and k != "any" for k in kinds):
        out["type"] = value
        return
    names = [k for k in kinds if isinstance(k, str)]
    if "any" in names:
        if keyword == "disallow":
            out["not"] = {}
        return  # any type: no constraint (its schemas say nothing)
    choices: list[Any] = [{"type": names}] if names else []
    within = (*to, "anyOf") if keyword == "type" else (*to, "not", "anyOf")
    for path, kind in zip(paths, kinds, strict=True):
        if isinstance(kind, Mapping):
            choices.append(_converted(kind, 3, moves, path, (*within, str(len(choices)))))
    if keyword == "type":
        out["anyOf"] = choices
    else:
        out["not"] = {"anyOf": choices}


def _refs_moved(
    node: Any, moved: Callable[[tuple[str, ...]], tuple[str, ...] | None], root: bool = True
) -> Any:
    """``node`` with each ``$ref`` (and ``$dynamicRef``) that is a JSON Pointer into the
    document to a subschema that ``moved`` (its path as written to its path now, or None)
    pointing where that subschema is now; ``node`` itself when none is. A pointer below a
    subschema with an ``$id`` is into that subschema, and is left as it is."""
    if not isinstance(node, Mapping) or (not root and "$id" in node):
        return node
    changed: dict[str, Any] = {}
    for keyword, value in node.items():
        if keyword in ("$ref", "$dynamicRef") and isinstance(value, str):
            pointer = _moved_pointer(value, moved)
            if pointer is not None:
                changed[keyword] = pointer
        else:
            new = _rebuilt(keyword, value, lambda sub: _refs_moved(sub, moved, False))
            if new is not value:
                changed[keyword] = new
    return {**node, **changed} if changed else node


def _children(keyword: str, value: Any) -> Iterable[Any]:
    """The subschemas in ``value``, the value of ``keyword`` (none when it holds none).
    The walks of this module (``_positions``, ``_unmarked``, ``_refs_moved``,
    ``_root_refs``) take them from here, so that they agree on where a subschema is."""
    if keyword in _SUBSCHEMA_MAPS:
        return value.values() if isinstance(value, Mapping) else ()
    if keyword in _SUBSCHEMA_LISTS and isinstance(value, list):
        return value
    return (value,) if keyword in _SUBSCHEMA else ()


def _rebuilt(keyword: str, value: Any, each: Callable[[Any], Any]) -> Any:
    """``value`` (of ``keyword``) with ``each`` applied to every subschema in it
    (``_children``), in its own shape; ``value`` itself when no subschema changed."""
    if keyword in _SUBSCHEMA_MAPS:
        if not isinstance(value, Mapping):
            return value
        members = {key: each(sub) for key, sub in value.items()}
        return members if any(members[key] is not sub for key, sub in value.items()) else value
    if keyword in _SUBSCHEMA_LISTS and isinstance(value, list):
        items = [each(sub) for sub in value]
        return (
            items if any(new is not old for new, old in zip(items, value, strict=True)) else value
        )
    return each(value) if keyword in _SUBSCHEMA else value


def _pointer_tokens(ref: str) -> tuple[str, ...] | None:
    """The tokens of ``ref``, a JSON Pointer into the document (``#/a/0``); None: another
    kind of reference (an anchor, another document)."""
    if ref in ("#", ""):
        return ()
    if not ref.startswith("#/"):
        return None
    return tuple(
        token.replace("~1", "/").replace("~0", "~") for token in unquote(ref[2:]).split("/")
    )


def _moved_pointer(
    ref: str, moved: Callable[[tuple[str, ...]], tuple[str, ...] | None]
) -> str | None:
    """``ref`` pointing where its target moved (None: not a pointer, or not moved)."""
    tokens = _pointer_tokens(ref)
    if tokens is None:
        return None
    path = moved(tokens)
    if path is None:
        return None
    return "#" + "".join(
        "/" + quote(token.replace("~", "~0").replace("/", "~1"), safe=_POINTER_SAFE)
        for token in path
    )


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
            else:  # draft 7's tuple ``items`` is a list: the TypeScript SDK looks in it too
                children.extend((None, sub) for sub in _children(keyword, value))
        pending.extend(reversed(children))  # depth first, in the file's order


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
    The marks are those of the schema as listed (``as_2020_12``), which a host reads.
    """
    found, problem = _marks(as_2020_12(schema))
    return found if found and problem is None else None


def _unmarked(node: Any) -> Any:
    """``node`` without an ``x-mcp-header`` at any position ``_positions`` walks."""
    if not isinstance(node, Mapping):
        return node
    return {
        keyword: _rebuilt(keyword, value, _unmarked)
        for keyword, value in node.items()
        if keyword != HEADER_MARK
    }


def _may_refer(schema: Mapping[str, Any]) -> bool:
    """Whether ``schema`` may hold a ``$ref`` or ``$dynamicRef`` (one C pass, as
    ``_may_be_marked``)."""
    try:
        text = strict_dumps(schema)
    except TypeError:
        return True
    return b'"$ref"' in text or b'"$dynamicRef"' in text


def _may_be_marked(schema: Mapping[str, Any]) -> bool:
    """Whether ``schema`` may hold a mark: one C pass (~1 us) instead of a walk in Python
    (~6 us a tool, for every tool of a listing); an integer wider than 64 bits, which
    orjson refuses (``strict_dumps``), takes the walk."""
    try:
        return HEADER_MARK.encode() in strict_dumps(schema)
    except TypeError:
        return True


def listed_schema(schema: Mapping[str, Any], *, marks_checked: bool = False) -> Mapping[str, Any]:
    """A tool's schema as an MCP ``inputSchema`` (the module docstring says what changes).

    ``marks_checked``: the caller knows the schema's marks break none of MCP's rules (a
    tool whose parse made no ``listing_notes``), so they are not looked at again.

    MCP's default dialect is JSON Schema 2020-12, and Claude's API refuses every request
    of a session when one tool's schema is not 2020-12 or holds ``allOf``, ``anyOf`` or
    ``oneOf`` at its root (OpenAI's, for Codex, ``not`` and ``enum`` too): a schema of an
    older draft is listed as the 2020-12 schema that says the same (``as_2020_12``), and
    those root keywords move under
    ``"if": true, "then": {...}``, which applies them as the root did (a ``$ref`` pointer to
    one follows it: ``#/anyOf/0`` is ``#/then/anyOf/0``).
    MCP's arguments are always an object, and its schema requires that root type; a host
    that checks it (the SDK) refuses the whole ``tools/list`` when one tool lacks it. A
    manifest may leave ``type`` out or allow other types beside object: for the objects an
    MCP host sends, ``"object"`` says the same (a ``$ref`` to the root, which may take other
    values, points to a copy of the root as declared: ``_root_refs_kept``). MCP's schema
    also makes each root property an object, and the TypeScript SDK's client (most Node
    hosts') refuses the whole list when one is a boolean schema (``"x": true``, valid JSON
    Schema): it is listed as the object that says the same (``{}``, ``{"not": {}}``).
    A mark that breaks MCP's rules makes its SDK clients (Python's on every transport,
    TypeScript's over HTTP) drop the tool on 2026-07-28; the daemon checks no header of
    such a schema, so its marks are left out and the tool is listed. An annotation
    changes no validation: a call is checked against the schema as declared.
    """
    schema = as_2020_12(schema)
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
    if any(keyword in schema for keyword in _ROOT_REFUSED):
        moved = {k: v for k, v in schema.items() if k in _CONDITIONAL}
        schema = {
            **{k: v for k, v in schema.items() if k not in _CONDITIONAL},
            "if": True,
            "then": moved,
        }
        if _may_refer(schema):
            # A pointer to a moved keyword's subschema (``#/anyOf/0``) follows it.
            schema = _refs_moved(
                schema, lambda path: ("then", *path) if path and path[0] in moved else None
            )
    if schema.get("type") == "object":
        return schema
    if _may_refer(schema):
        schema = _root_refs_kept(schema)
    return {**schema, "type": "object"}


def _root_refs_kept(schema: Mapping[str, Any]) -> Mapping[str, Any]:
    """``schema``, whose root is about to take ``type: "object"``, with each ``$ref`` to
    its root (``#``) pointing instead to a copy of the root as it was, in ``$defs``: a
    tree's ``"items": {"$ref": "#"}`` takes what the root takes as declared, not objects
    alone. ``schema`` itself when no ``$ref`` leads to the root.

    The copy names nothing (``_unnamed``): a subschema with its own ``$id`` is a ``$ref`` to
    it there (a second resource of that name is an error, and its pointers are into it),
    and the copy's ``$anchor``s are left out (one name twice in a resource is an error too;
    a ``$ref`` to one finds the root's, which is the same schema)."""
    if _root_refs(schema, root=True) == 0:
        return schema
    defs = schema.get("$defs")
    defs = defs if isinstance(defs, Mapping) else {}
    name = "root"
    while name in defs:
        name += "_"
    copy = {k: v for k, v in schema.items() if k not in _RESOURCE_KEYWORDS}
    with_copy = {**schema, "$defs": {**defs, name: _unmarked(_unnamed(copy, root=True))}}
    moved: _Moves = {(): ("$defs", name)}
    kept: Mapping[str, Any] = _refs_moved(with_copy, moved.get)
    return kept


def _root_refs(node: Any, root: bool = False) -> int:
    """How many ``$ref`` below ``node`` lead to the document's root (``#``): none below a
    subschema with its own ``$id``, whose ``#`` is that subschema."""
    if not isinstance(node, Mapping) or (not root and "$id" in node):
        return 0
    count = 1 if node.get("$ref") in ("#", "") else 0
    for keyword, value in node.items():
        for sub in _children(keyword, value):
            count += _root_refs(sub)
    return count


def _unnamed(node: Any, root: bool = False) -> Any:
    """``node``, a copy of the root (``_root_refs_kept``), naming nothing: each subschema
    with an ``$id`` as a ``$ref`` to that ``$id`` (read against the root's base, as the
    ``$id`` was: no ``$id`` lies between), and without its ``$anchor``s and
    ``$dynamicAnchor``s."""
    if not isinstance(node, Mapping):
        return node
    named = node.get("$id")
    if not root and isinstance(named, str):
        return {"$ref": named}
    return {
        keyword: _rebuilt(keyword, value, _unnamed)
        for keyword, value in node.items()
        if keyword not in ("$anchor", "$dynamicAnchor")
    }


def unlisted_reason(name: str, schema: Mapping[str, Any]) -> str | None:
    """The operator note for a tool MCP hosts cannot be shown, or None (most tools).

    Args:
        name: The tool's name.
        schema: Its schema as declared.
    """
    kinds = schema.get("type", "object")
    if not any(
        kind in ("object", "any") or isinstance(kind, Mapping)  # draft 3's "any", schemas
        for kind in (kinds if isinstance(kinds, list) else [kinds])
    ):
        return (
            f"External tool '{name}' {_UNLISTED} its schema's root type is "
            f"{json_dumps(kinds).decode()}, and MCP hosts send arguments as an object, "
            'so no call of theirs could pass. Give the schema "type": "object" and the '
            "values as its properties; the native invoke still takes the tool as it is."
        )
    try:
        # orjson refuses any integer wider than 64 bits: one C pass clears almost every
        # schema (a walk in Python cost ~10 us a tool, at every catalog build).
        strict_dumps(schema)
    except TypeError:
        return _huge_integer(name, schema)
    return None


def is_unlisted(notes: Iterable[str]) -> bool:
    """Whether a tool's listing notes (``listing_notes``, ``invalid_listing_note``) leave
    it out of ``tools/list``: the notes, made at the manifest's parse and kept in the set
    store's records, are the decision."""
    return any(_UNLISTED in note for note in notes)


def invalid_listing_note(name: str, problem: str) -> str:
    """The note of a tool whose schema, of an older draft, is no valid JSON Schema 2020-12
    once converted (``problem``: the 2020-12 meta-schema's words). Such a draft leaves
    parts of a schema unchecked (draft 3 checks nothing in ``definitions``, drafts before
    2019-09 nothing in ``$defs``), and one of them can hold what 2020-12 refuses: listed,
    it would stop every request of a Claude session, so the manifest's parse checks each
    such listing and the tool is left out, still callable."""
    return (
        f"External tool '{name}' {_UNLISTED} its schema, converted to JSON Schema 2020-12 "
        f"(MCP's dialect, which Claude's API checks every tool of a request against), is "
        f'not valid: {problem}. Declare the schema in 2020-12 (leave "$schema" out), or '
        "mend what the message names."
    )


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
    problem = _marks(as_2020_12(schema))[1]
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
                f"External tool '{name}' {_UNLISTED} its schema holds an "
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
