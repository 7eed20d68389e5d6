"""The ``$ref``s of a tool's schema that lead nowhere, or around in a circle (pure: no I/O).

Theory of operation: the meta-schema takes any ``$ref`` text, and jsonschema resolves one
only when a check reaches it, so a schema whose ``$ref`` names nothing loads, and the
daemon serves the tool: a call whose arguments reach that ``$ref`` is refused ("the tool's
input schema cannot be used"), and so is every call when the ``$ref`` applies to whatever
the arguments are, as one at the root, in a root ``allOf``, or first in a root ``anyOf``
or ``oneOf`` does. A ``$ref`` that leads back to itself through such keywords alone
(``{"$ref": "#"}``) never ends a check of any arguments, and each call is refused as well.
(Under ``not`` or ``if`` jsonschema checks a subschema only up to its first failing
keyword, which the arguments decide: a ``$ref`` there is a note.) ``toolsetctl validate``
says both before any call does: ``ref_problems`` walks the schema as jsonschema would
resolve it (the ``referencing`` library, with the bundled meta-schemas and nothing
fetched, as the daemon has it), by the schema's own draft.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from .validation import dialect, json_pointer

__all__ = ["RefProblem", "ref_problems"]

#: The longest ``$ref`` chain, and the deepest nesting, walked (past them, nothing is said).
_MAX_DEPTH = 200


@dataclass(frozen=True, slots=True)
class RefProblem:
    """A ``$ref`` of a schema that cannot be followed.

    Attributes:
        pointer: Where the ``$ref`` is, a JSON Pointer into the schema.
        ref: The ``$ref`` as written.
        reason: Why it cannot be followed (None: it leads back to itself).
        every_call: Whether every call's arguments reach it (the tool can take no call).
    """

    pointer: str
    ref: str
    reason: str | None
    every_call: bool

    def message(self, name: str) -> str:
        """The sentence ``validate`` shows of it, for the tool ``name``."""
        where = f"$ref '{self.ref}' at {self.pointer or 'the schema root'}"
        if self.reason is None:
            return (
                f"Tool '{name}' can take no call: its schema's {where} leads back to itself "
                "before checking anything, so no check of arguments ends."
            )
        if self.every_call:
            return (
                f"Tool '{name}' can take no call: its schema's {where} leads nowhere "
                f"({self.reason}), and every call's arguments pass through it."
            )
        return (
            f"Tool '{name}''s schema has a {where} that leads nowhere ({self.reason}): a "
            "call whose arguments reach it is refused."
        )


def ref_problems(schema: Mapping[str, Any]) -> list[RefProblem]:
    """Every ``$ref`` of ``schema`` that leads nowhere, or back to itself through keywords
    that apply to the same arguments, in the schema's order (the same ``$ref`` once).

    Args:
        schema: A tool's schema as declared (one that passes its meta-schema).
    """
    import jsonschema_specifications  # type: ignore[import-untyped]  # it ships no py.typed
    import referencing.jsonschema

    specification = {
        3: referencing.jsonschema.DRAFT3,
        4: referencing.jsonschema.DRAFT4,
        6: referencing.jsonschema.DRAFT6,
        7: referencing.jsonschema.DRAFT7,
        2019: referencing.jsonschema.DRAFT201909,
        2020: referencing.jsonschema.DRAFT202012,
    }[draft := dialect(schema)]
    resolver = jsonschema_specifications.REGISTRY.resolver_with_root(
        specification.create_resource(schema)
    )
    walk = _Walk(specification, draft <= 7, _paths(schema))
    walk.node(schema, resolver, (), always=True, through=())
    found: dict[tuple[str, str], RefProblem] = {}
    for problem in walk.found:
        key = (problem.pointer, problem.ref)
        if key not in found or (problem.every_call and not found[key].every_call):
            found[key] = problem
    return list(found.values())


class _Walk:
    """One walk of a schema's subschemas, each with the resolver jsonschema has there."""

    def __init__(
        self, specification: Any, legacy_ref: bool, paths: Mapping[int, tuple[str | int, ...]]
    ) -> None:
        self._specification = specification
        #: Where each object of the schema is (by its id): a ``$ref``'s target's place.
        self._paths = paths
        #: Draft 7 and older pass by every keyword beside a ``$ref``.
        self._legacy_ref = legacy_ref
        self.found: list[RefProblem] = []

    def node(
        self,
        node: Any,
        resolver: Any,
        path: tuple[str | int, ...],
        *,
        always: bool,
        through: tuple[int, ...],
    ) -> None:
        """Walk ``node`` (at ``path``); ``always``: every call's arguments reach it, by the
        nodes ``through`` (their ids), which apply to the same arguments."""
        if not isinstance(node, Mapping) or len(path) + len(through) > _MAX_DEPTH:
            return
        from referencing.exceptions import Unresolvable

        try:
            resolver = resolver.in_subresource(self._specification.create_resource(node))
        except ValueError:  # an ``$id`` that is no URI: what it names is the daemon's to say
            return
        through = (*through, id(node)) if always else ()
        ref = node.get("$ref")
        if isinstance(ref, str):
            where = json_pointer((*path, "$ref"))
            try:
                resolved = resolver.lookup(ref)
            except Unresolvable as exc:
                self.found.append(RefProblem(where, ref, _reason(exc), always))
            except ValueError as exc:  # no URI (an unclosed "["), as the daemon says
                self.found.append(RefProblem(where, ref, _reason(exc), always))
            else:
                target = self._paths.get(id(resolved.contents))
                if always and id(resolved.contents) in through:
                    self.found.append(RefProblem(where, ref, None, True))
                elif always and target is not None:  # it applies to the same arguments
                    self.node(
                        resolved.contents, resolved.resolver, target, always=True, through=through
                    )
            if self._legacy_ref:
                return
        for sub_path, sub, applies in self._children(node):
            self.node(
                sub,
                resolver,
                (*path, *sub_path),
                always=always and applies,
                through=through,
            )

    def _children(
        self, node: Mapping[str, Any]
    ) -> Iterator[tuple[tuple[str | int, ...], Any, bool]]:
        """Each subschema of ``node`` by its draft (``referencing``'s), with its path below
        ``node`` and whether it applies to the same arguments, checked whole: an ``allOf``
        member, draft 3's ``extends``, and the first member of an ``anyOf`` or ``oneOf``
        (jsonschema checks that one whole before it looks at the next, whatever the
        arguments; a later one only when those before it fail or, in a ``oneOf``, pass)."""
        subs = {id(sub) for sub in self._specification.subresources_of(node)}
        for keyword, value in node.items():
            applies = keyword in ("allOf", "extends")
            if id(value) in subs:
                yield (keyword,), value, applies
            elif isinstance(value, list):
                first = keyword in ("anyOf", "oneOf")
                for index, sub in enumerate(value):
                    if id(sub) in subs:
                        yield (keyword, index), sub, applies or (first and index == 0)
            elif isinstance(value, Mapping):
                for key, sub in value.items():
                    if id(sub) in subs:
                        yield (keyword, key), sub, False


def _paths(document: Any) -> dict[int, tuple[str | int, ...]]:
    """Where each object and array of ``document`` is, by its id."""
    found: dict[int, tuple[str | int, ...]] = {}
    pending: list[tuple[tuple[str | int, ...], Any]] = [((), document)]
    while pending:
        path, node = pending.pop()
        if isinstance(node, Mapping):
            found[id(node)] = path
            pending.extend(((*path, key), sub) for key, sub in node.items())
        elif isinstance(node, list):
            found[id(node)] = path
            pending.extend(((*path, index), sub) for index, sub in enumerate(node))
    return found


def _reason(exc: BaseException) -> str:
    """Why a ``$ref`` cannot be followed, in words (referencing's own quote the schema)."""
    from referencing.exceptions import NoSuchAnchor, PointerToNowhere

    said: tuple[tuple[type[BaseException], str], ...] = (
        (PointerToNowhere, "the schema has nothing at that pointer"),
        (NoSuchAnchor, "the schema has no such anchor"),
        (ValueError, "it is no URI"),
    )
    words = next((words for kind, words in said if isinstance(exc, kind)), None)
    return words or (
        "it is neither in the schema nor a standard meta-schema, and toolsetd fetches nothing"
    )
