"""A tool's schema as MCP hosts are shown it (``daemon/mcpschema.py``): JSON Schema 2020-12.

Claude's API checks every tool of a request against JSON Schema 2020-12 and refuses the
whole request ("tools.N.custom.input_schema: JSON schema is invalid. It must match JSON
Schema draft 2020-12", "input_schema does not support oneOf, allOf, or anyOf at the top
level"): one such schema in a tool set stopped every request of a Claude Code session. A
manifest may use drafts 3 to 2020-12, so each listing is checked three ways here: it is a
valid 2020-12 schema with no other ``$schema``, its root holds none of those keywords, and
it takes exactly the object arguments the schema as declared takes (the daemon validates
calls against that).
"""

from __future__ import annotations

from typing import Any

import pytest
from jsonschema import Draft202012Validator
from jsonschema.validators import validator_for
from toolsetd.daemon.mcpschema import (
    DIALECT_2020_12,
    as_2020_12,
    header_marks,
    listed_schema,
    listing_notes,
    unlisted_reason,
)

D3 = "http://json-schema.org/draft-03/schema#"
D4 = "http://json-schema.org/draft-04/schema#"
D6 = "http://json-schema.org/draft-06/schema#"
D7 = "http://json-schema.org/draft-07/schema#"
D2019 = "https://json-schema.org/draft/2019-09/schema"

#: (name, schema as declared, object instances to compare verdicts on).
CASES: list[tuple[str, dict[str, Any], list[Any]]] = [
    (
        "draft 7 tuple items and additionalItems",
        {
            "$schema": D7,
            "type": "object",
            "properties": {
                "t": {
                    "type": "array",
                    "items": [{"type": "string"}, {"type": "integer"}],
                    "additionalItems": False,
                }
            },
        },
        [{"t": ["a", 1]}, {"t": ["a", "b"]}, {"t": ["a", 1, 2]}, {"t": []}, {}],
    ),
    (
        "draft 7 tuple items without additionalItems",
        {
            "$schema": D7,
            "properties": {"t": {"items": [{"type": "string"}]}},
        },
        [{"t": ["a", 1, None]}, {"t": [1]}],
    ),
    (
        "draft 7 additionalItems beside a schema items (passed by)",
        {
            "$schema": D7,
            "properties": {"t": {"items": {"type": "string"}, "additionalItems": False}},
        },
        [{"t": ["a", "b"]}, {"t": [1]}],
    ),
    (
        "draft 7 dependencies",
        {
            "$schema": D7,
            "type": "object",
            "dependencies": {"a": ["b"], "c": {"required": ["d"]}, "e": True},
        },
        [{"a": 1}, {"a": 1, "b": 2}, {"c": 1}, {"c": 1, "d": 1}, {"e": 1}, {}],
    ),
    (
        "draft 7 $ref siblings (passed by)",
        {
            "$schema": D7,
            "type": "object",
            "properties": {"q": {"$ref": "#/definitions/s", "minLength": 3, "type": "integer"}},
            "definitions": {"s": {"type": "string"}},
        },
        [{"q": "a"}, {"q": 1}, {"q": "abcd"}],
    ),
    (
        "draft 7 root $ref with siblings (passed by)",
        {
            "$schema": D7,
            "$ref": "#/definitions/args",
            "required": ["nope"],
            "definitions": {"args": {"type": "object", "properties": {"n": {"type": "integer"}}}},
        },
        [{"n": 1}, {"n": "x"}, {}],
    ),
    (
        "draft 7 $id fragment beside a $ref names the subschema still",
        {
            "$schema": D7,
            "type": "object",
            "properties": {
                "a": {"$id": "#named", "$ref": "#/definitions/s"},
                "b": {"$ref": "#named"},
            },
            "definitions": {"s": {"type": "string"}},
        },
        [{"b": "x"}, {"b": 1}, {"a": 1}],
    ),
    (
        "draft 7 keywords it does not know (passed by)",
        {
            "$schema": D7,
            "type": "object",
            "properties": {"t": {"prefixItems": [{"type": "string"}]}, "n": {"type": "integer"}},
            "dependentRequired": {"a": ["b"]},
            "unevaluatedProperties": False,
        },
        [{"t": [1]}, {"a": 1}, {"zzz": 1}, {"n": "x"}],
    ),
    (
        "draft 7 if/then/else",
        {
            "$schema": D7,
            "type": "object",
            "if": {"required": ["a"]},
            "then": {"required": ["b"]},
            "else": {"required": ["c"]},
        },
        [{"a": 1}, {"a": 1, "b": 1}, {}, {"c": 1}],
    ),
    (
        "draft 6 keywords it does not know (passed by)",
        {
            "$schema": D6,
            "type": "object",
            "if": {"required": ["a"]},
            "then": False,
            "properties": {"k": {"const": 1}},
        },
        [{"a": 1}, {"k": 2}, {"k": 1}],
    ),
    (
        "draft 6 $id fragments",
        {
            "$schema": D6,
            "$id": "#root",
            "type": "object",
            "properties": {"k": {"$id": "http://example.com/k#frag", "type": "string"}},
        },
        [{"k": "a"}, {"k": 1}],
    ),
    (
        "draft 6 keywords it does not know, of types 2020-12 refuses (passed by)",
        {
            "$schema": D6,
            "type": "object",
            "$comment": 5,
            "readOnly": "x",
            "$defs": 5,
            "properties": {
                "a": {
                    "type": "string",
                    "contentMediaType": [],
                    "contentSchema": 0,
                    "$vocabulary": [],
                },
                "b": {"deprecated": {}, "$defs": {"n": 1, "s": {"type": "integer"}}},
            },
        },
        [{"a": "s"}, {"a": 1}, {"b": 1}],
    ),
    (
        "draft 4 ids, a fragment's and a URI's, and $refs to them",
        {
            "$schema": D4,
            "type": "object",
            "properties": {
                "c": {"$ref": "#an0"},
                "d": {"id": "#an0", "type": "string"},
                "e": {"id": "http://example.com/e", "type": "integer"},
                "f": {"$ref": "http://example.com/e"},
            },
        },
        [{"c": "x"}, {"c": 0}, {"f": 1}, {"f": "x"}],
    ),
    (
        "draft 4 boolean exclusive bounds",
        {
            "$schema": D4,
            "type": "object",
            "properties": {
                "n": {
                    "type": "number",
                    "maximum": 5,
                    "exclusiveMaximum": True,
                    "minimum": 0,
                    "exclusiveMinimum": False,
                },
                "m": {"minimum": 1, "exclusiveMinimum": True},
            },
        },
        [{"n": 5}, {"n": 4.5}, {"n": 0}, {"n": -1}, {"m": 1}, {"m": 1.5}],
    ),
    (
        "draft 4 keywords it does not know (passed by)",
        {
            "$schema": D4,
            "type": "object",
            "properties": {"a": {"type": "string", "const": "x", "contains": {"type": "string"}}},
            "propertyNames": {"maxLength": 1},
        },
        [{"a": "y"}, {"abc": 1}, {"a": 1}],
    ),
    (
        "draft 4 oneOf at the root",
        {
            "$schema": D4,
            "type": "object",
            "properties": {"a": {}, "b": {}},
            "oneOf": [{"required": ["a"]}, {"required": ["b"]}],
        },
        [{"a": 1}, {"b": 1}, {"a": 1, "b": 1}, {}],
    ),
    (
        "draft 3 required, type, disallow, extends, divisibleBy, dependencies",
        {
            "$schema": D3,
            "type": "object",
            "required": True,
            "properties": {
                "x": {"type": "string", "required": True},
                "y": {"type": ["string", {"type": "integer", "divisibleBy": 2}]},
                "z": {"disallow": ["null", {"type": "integer"}], "extends": {"type": "number"}},
                "w": {"type": "any"},
                "v": {"disallow": "any"},
                "u": {"type": ["integer", "any"]},
            },
            "dependencies": {"x": "y", "z": ["w"], "w": {"properties": {"x": {"maxLength": 1}}}},
            "additionalProperties": {"type": "string", "required": True},
        },
        [
            {"x": "a"},
            {},
            {"x": "a", "y": 3},
            {"x": "a", "y": 4},
            {"x": "ab", "y": "s"},
            {"x": "a", "y": "s", "z": 1.5},
            {"x": "a", "y": "s", "z": 2},
            {"x": "a", "y": "s", "z": None},
            {"x": "ab", "y": "s", "w": 1},
            {"x": "a", "y": "s", "w": 1},
            {"x": "a", "y": "s", "v": 1},
            {"x": "a", "y": "s", "u": []},
            {"x": "a", "y": "s", "other": 1},
        ],
    ),
    (
        "draft 3 empty type, disallow and tuple items (2020-12 takes none of them empty)",
        {
            "$schema": D3,
            "type": "object",
            "properties": {
                "n": {"type": []},
                "d": {"disallow": []},
                "t": {"items": [], "additionalItems": False},
            },
        },
        [{"n": 1}, {"d": 1}, {"t": []}, {"t": [1]}, {}],
    ),
    (
        "2019-09 tuple items, $recursiveRef, dependencies (passed by)",
        {
            "$schema": D2019,
            "type": "object",
            "$recursiveAnchor": False,
            "properties": {
                "t": {"items": [{"type": "string"}], "additionalItems": {"type": "integer"}},
                "r": {"type": "object", "properties": {"again": {"$recursiveRef": "#"}}},
            },
            "dependencies": {"a": ["b"]},
            "dependentRequired": {"c": ["d"]},
        },
        [
            {"t": ["a", 1]},
            {"t": ["a", "b"]},
            {"r": {"again": {"t": [1]}}},
            {"r": {"again": {"t": ["a"]}}},
            {"a": 1},
            {"c": 1},
        ],
    ),
    (
        "2020-12 anyOf and if/then at the root",
        {
            "type": "object",
            "properties": {"a": {}, "b": {}, "c": {}, "d": {}},
            "anyOf": [{"required": ["a"]}, {"required": ["b"]}],
            "if": {"required": ["c"]},
            "then": {"required": ["d"]},
            "else": {"maxProperties": 1},
        },
        [{"a": 1}, {"b": 1, "c": 1}, {"b": 1, "c": 1, "d": 1}, {}, {"a": 1, "b": 1}],
    ),
    (
        "2020-12 allOf at the root read by unevaluatedProperties",
        {
            "type": "object",
            "allOf": [{"properties": {"a": {"type": "string"}}}],
            "unevaluatedProperties": False,
        },
        [{"a": "x"}, {"a": 1}, {"b": 1}],
    ),
    (
        "draft 7 pointers into renamed subschemas follow them",
        {
            "$schema": D7,
            "type": "object",
            "properties": {
                "t": {
                    "items": [{"type": "string"}, {"type": "integer"}],
                    "additionalItems": {"type": "boolean"},
                },
                "u": {"$ref": "#/properties/t/items/1"},
                "v": {"$ref": "#/dependencies/a"},
                "w": {"$ref": "#/properties/t/additionalItems"},
            },
            "dependencies": {"a": {"required": ["b"]}},
        },
        [{"u": 1}, {"u": "s"}, {"v": {}}, {"v": {"b": 1}}, {"w": True}, {"w": 1}],
    ),
    (
        "draft 3 pointers into extends, type and disallow follow them",
        {
            "$schema": D3,
            "type": "object",
            "properties": {
                "e": {"extends": [{}, {"type": "string"}]},
                "f": {"$ref": "#/properties/e/extends/1"},
                "g": {"type": ["null", {"type": "integer"}]},
                "h": {"$ref": "#/properties/g/type/1"},
                "i": {"disallow": [{"type": "boolean"}]},
                "j": {"$ref": "#/properties/i/disallow/0"},
            },
        },
        [{"f": "s"}, {"f": 1}, {"h": 1}, {"h": None}, {"j": True}, {"j": 1}],
    ),
    (
        "2020-12 pointers into a root combinator moved under then follow it",
        {
            "type": "object",
            "oneOf": [{"required": ["a"]}, {"required": ["b"]}],
            "properties": {"a": {}, "b": {"$ref": "#/oneOf/0"}},
        },
        [{"b": {"a": 1}}, {"b": {}}, {"a": 1}, {}],
    ),
    (
        "a $ref to the root takes what the root takes as declared, not objects alone",
        {
            "properties": {
                "kids": {"type": "array", "items": {"$ref": "#"}},
                "n": {"not": {"$ref": "#"}},
            }
        },
        [{"kids": [1, "x"]}, {"kids": [{"kids": 5}]}, {"n": 5}, {"n": {"kids": 1}}, {}],
    ),
    (
        "draft 7 keywords it does not know, of shapes 2020-12 refuses",
        {
            "$schema": D7,
            "type": "object",
            "$defs": [{"type": "string"}],
            "deprecated": "soon",
            "$vocabulary": 1,
            "$anchor": "1",
            "dependentSchemas": [],
            "properties": {"n": {"type": "integer"}},
        },
        [{"n": 1}, {"n": "x"}],
    ),
    (
        "draft 4 annotations of later drafts' names, of other shapes",
        {
            "$schema": D4,
            "type": "object",
            "examples": {"a": 1},
            "contentMediaType": 1,
            "properties": {
                "n": {
                    "type": "integer",
                    "writeOnly": 0,
                    "contentEncoding": [],
                    "$comment": 5,
                    "readOnly": "yes",
                }
            },
        },
        [{"n": 1}, {"n": "x"}],
    ),
    (
        "draft 3 definitions that are no map",
        {
            "$schema": D3,
            "type": "object",
            "definitions": [1],
            "properties": {"n": {"type": "integer"}},
        },
        [{"n": 1}, {"n": "x"}],
    ),
    (
        "2020-12 not and enum at the root, which OpenAI's API refuses there",
        {
            "type": "object",
            "properties": {"a": {}, "b": {}},
            "not": {"required": ["a", "b"]},
            "enum": [{"a": 1}, {"b": 2}, {"a": 1, "b": 2}],
        },
        [{"a": 1}, {"b": 2}, {"a": 1, "b": 2}, {"a": 2}, {}],
    ),
    (
        "an unknown $schema, checked as 2020-12",
        {
            "$schema": "https://json-schema.org/draft-07/schema#",
            "type": "object",
            "properties": {"t": {"prefixItems": [{"type": "string"}]}},
        },
        [{"t": [1]}, {"t": ["a"]}],
    ),
    (
        "draft 7 $ref into dependentSchemas, a keyword it does not know",
        {
            "$schema": D7,
            "type": "object",
            "properties": {"a": {"$ref": "#/dependentSchemas/x"}},
            "dependentSchemas": {"x": {"type": "string"}},
        },
        [{"a": "s"}, {"a": 1}],
    ),
    (
        "draft 4 $ref into then, and into what a $ref passes by, through a tuple",
        {
            "$schema": D4,
            "type": "object",
            "properties": {
                "a": {"$ref": "#/then"},
                "b": {"$ref": "#/definitions/o", "properties": {"c": {"items": [{"minimum": 2}]}}},
                "d": {"$ref": "#/properties/b/properties/c/items/0"},
            },
            "definitions": {"o": {}},
            "then": {"type": "string", "not": {"$ref": "#/else"}},
            "else": {"maxLength": 1},
        },
        [{"a": "st", "d": 3}, {"a": 1}, {"a": "s"}, {"d": 1}, {"b": {"c": [1]}}],
    ),
    (
        "a $ref to a root that takes arrays too, beside a subschema with its own $id",
        {
            "type": ["object", "array"],
            "properties": {
                "kids": {"$ref": "#"},
                "name": {"$id": "name.json", "type": "string", "$anchor": "n"},
            },
        },
        [{"kids": []}, {"kids": [1], "name": "a"}, {"kids": {"name": 1}}, {"name": 1}],
    ),
]


@pytest.mark.parametrize(
    ("declared", "instances"), [c[1:] for c in CASES], ids=[c[0] for c in CASES]
)
def test_a_listing_is_2020_12_and_takes_what_the_schema_as_declared_takes(
    declared: dict[str, Any], instances: list[Any]
) -> None:
    """Each listing is valid 2020-12 with no other ``$schema``, with no ``allOf``/``anyOf``/
    ``oneOf`` at its root, and each object argument gets the verdict it gets against the
    schema as declared (under that schema's own draft)."""
    own = validator_for(declared, default=Draft202012Validator)
    own.check_schema(declared)
    listed = listed_schema(declared)
    Draft202012Validator.check_schema(listed)
    assert listed.get("$schema", DIALECT_2020_12) == DIALECT_2020_12
    assert not {"allOf", "anyOf", "oneOf", "not", "enum"} & set(listed)
    assert listed["type"] == "object"
    declared_verdicts = [own(declared).is_valid(i) for i in instances]
    listed_verdicts = [Draft202012Validator(listed).is_valid(i) for i in instances]
    assert listed_verdicts == declared_verdicts
    assert len(set(declared_verdicts)) == 2, "each case needs an instance of each verdict"


def test_a_2020_12_schema_without_root_combinators_is_listed_as_it_is() -> None:
    """Most schemas pay nothing: no copy for a schema of no other dialect."""
    plain = {"type": "object", "properties": {"a": {"type": "string"}}}
    declared = {"$schema": DIALECT_2020_12, **plain}
    assert as_2020_12(plain) is plain
    assert listed_schema(plain) is plain
    assert listed_schema(declared) is declared


def test_the_listing_moves_each_draft_7_item_it_changes() -> None:
    """The conversions, spelt out where the verdicts alone would not show them."""
    assert listed_schema(
        {
            "$schema": D7,
            "type": "object",
            "properties": {
                "t": {"items": [{"type": "string"}], "additionalItems": {"type": "integer"}}
            },
            "dependencies": {"a": ["b"], "c": {"required": ["d"]}},
        }
    ) == {
        "type": "object",
        "properties": {"t": {"prefixItems": [{"type": "string"}], "items": {"type": "integer"}}},
        "dependentRequired": {"a": ["b"]},
        "dependentSchemas": {"c": {"required": ["d"]}},
    }
    pointed = {
        "$schema": D7,
        "properties": {"t": {"items": [{}]}, "u": {"$ref": "#/properties/t/items/0"}},
    }
    assert listed_schema(pointed)["properties"]["u"] == {"$ref": "#/properties/t/prefixItems/0"}
    assert listed_schema(
        {
            "$schema": D4,
            "patternProperties": {"^[a-c]~/$": {"items": [{}]}},
            "not": {"$ref": "#/patternProperties/^[a-c]~0~1$/items/0"},
        }
    )["then"]["not"] == {"$ref": "#/patternProperties/%5E%5Ba-c%5D~0~1$/prefixItems/0"}
    tree = {"type": ["object", "string"], "properties": {"kids": {"items": {"$ref": "#"}}}}
    assert listed_schema(tree) == {
        "type": "object",
        "properties": {"kids": {"items": {"$ref": "#/$defs/root"}}},
        "$defs": {
            "root": {
                "type": ["object", "string"],
                "properties": {"kids": {"items": {"$ref": "#/$defs/root"}}},
            }
        },
    }
    assert listed_schema({"$schema": D6, "$id": "http://e.x/s#top", "type": "object"}) == {
        "$id": "http://e.x/s",
        "$anchor": "top",
        "type": "object",
    }
    # OpenAI's API (Codex) refuses a root ``not`` or ``enum`` too: they move with the rest.
    assert listed_schema(
        {"type": "object", "oneOf": [{"required": ["a"]}], "not": {"required": ["b"]}}
    ) == {
        "type": "object",
        "if": True,
        "then": {"oneOf": [{"required": ["a"]}], "not": {"required": ["b"]}},
    }
    assert listed_schema({"type": "object", "enum": [{"a": 1}]}) == {
        "type": "object",
        "if": True,
        "then": {"enum": [{"a": 1}]},
    }


def test_the_copy_of_the_root_names_nothing() -> None:
    """The copy of the root a ``$ref`` to it leads to holds no second resource of an
    ``$id`` (a ``$ref`` to it instead) and no second ``$anchor`` of a name: either is an
    error to a validator that checks it, and it was why no copy was made, so the ``$ref``
    took only objects where the root took arrays too."""
    listed = listed_schema(
        {
            "type": ["object", "array"],
            "items": {"$ref": "#"},
            "properties": {"n": {"$id": "n.json", "type": "string"}, "a": {"$anchor": "A"}},
        }
    )
    assert listed["items"] == {"$ref": "#/$defs/root"}
    assert listed["$defs"]["root"]["properties"] == {"n": {"$ref": "n.json"}, "a": {}}


def test_marks_are_judged_on_the_schema_as_listed() -> None:
    """A mark in draft 7's tuple ``items`` is in ``prefixItems`` once listed, off the
    ``properties`` chain: the listing leaves it out, the notes say so, and no header is
    checked. A mark on a property of a draft 7 schema is listed and checked."""
    tuple_mark = {
        "$schema": D7,
        "type": "object",
        "properties": {"t": {"type": "array", "items": [{"type": "string", "x-mcp-header": "T"}]}},
    }
    assert listed_schema(tuple_mark)["properties"]["t"] == {
        "type": "array",
        "prefixItems": [{"type": "string"}],
    }
    assert header_marks(tuple_mark) is None
    assert "without its x-mcp-header marks" in listing_notes("t", tuple_mark)[0]
    good = {
        "$schema": D7,
        "type": "object",
        "properties": {"r": {"type": "string", "x-mcp-header": "Region"}},
    }
    assert header_marks(good) == [(("r",), "Region")]
    assert listed_schema(good, marks_checked=True)["properties"] == good["properties"]
    assert listing_notes("g", good) == []


@pytest.mark.parametrize(
    ("kind", "listed"),
    [
        ("array", False),
        (["array", "null"], False),
        (["object", "null"], True),
        ("object", True),
        (None, True),
    ],
)
def test_a_schema_whose_root_type_takes_no_object_is_not_listed(kind: Any, listed: bool) -> None:
    """MCP hosts send arguments as an object: a root ``type`` without ``object`` can take
    none of their calls, so the tool is left out of their listing, and the note names the
    type and the fix. Draft 3's ``any`` and a schema among its types may take an object."""
    schema: dict[str, Any] = {"properties": {}} if kind is None else {"type": kind}
    reason = unlisted_reason("arr", schema)
    assert (reason is None) is listed
    if not listed:
        assert reason is not None
        assert "External tool 'arr' is not listed to MCP hosts" in reason
        assert '"type": "object"' in reason
        assert listing_notes("arr", schema) == [reason]
    for draft3 in (["array", "any"], ["array", {"type": "object"}]):
        assert unlisted_reason("d3", {"$schema": D3, "type": draft3}) is None
