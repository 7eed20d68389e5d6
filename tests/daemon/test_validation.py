"""Tests for ``toolsetd.daemon.validation``: schema checks and argument errors."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from toolsetd.daemon.catalog import tool_hash
from toolsetd.daemon.large import PARSE_RECURSION_LIMIT
from toolsetd.daemon.model import (
    Approval,
    ApprovalSource,
    CatalogName,
    LoadedTool,
    RunnerKind,
    Source,
    ToolDef,
    ToolSet,
)
from toolsetd.daemon.validation import (
    ArgumentValidators,
    SchemaChecker,
    canonical_json,
    dialect,
    json_pointer,
    off_loop,
)
from toolsetd.protocol.jsontext import JsonNumber

from tests.budget import examples


def loaded(schema: dict[str, Any]) -> LoadedTool:
    """A loaded exec tool with ``schema`` as its input schema."""
    tool = ToolDef(
        name="deploy",
        description="Deploy.",
        schema=schema,
        catalogs=frozenset({CatalogName.WORK}),
        approval=Approval.INHERIT,
    )
    toolset = ToolSet(
        directory="acme", source=Source.HOME, path=Path("/x/acme"), runner=RunnerKind.EXEC, tools=(tool,)
    )
    policy = ApprovalSource.AUTHOR
    return LoadedTool(tool, toolset, Approval.INHERIT, policy, tool_hash(tool, toolset, policy))


DEPLOY: dict[str, Any] = {
    "type": "object",
    "properties": {
        "environment": {"type": "string", "enum": ["staging", "prod"]},
        "count": {"type": "integer", "minimum": 1},
        "tags": {"type": "array", "items": {"type": "string"}},
        "a/b~c": {"type": "boolean"},
        "nested": {"type": "object", "required": ["x"]},
    },
    "required": ["environment"],
    "additionalProperties": False,
}


@pytest.mark.parametrize(
    ("arguments", "expected"),
    [
        ({"environment": "prod"}, []),
        ({}, [{"path": "", "message": "required property 'environment' is missing"}]),
        (
            {"environment": "prod", "count": "x"},
            [{"path": "/count", "message": "/count: expected integer, got string"}],
        ),
        (
            {"environment": 3},
            [
                {"path": "/environment", "message": '/environment: expected one of ["staging", "prod"], got 3'},
                {"path": "/environment", "message": "/environment: expected string, got integer"},
            ],
        ),
        (
            {"environment": "dev"},
            [{"path": "/environment", "message": '/environment: expected one of ["staging", "prod"], got "dev"'}],
        ),
        (
            {"environment": "prod", "count": 0},
            [{"path": "/count", "message": "/count: expected a number >= 1, got 0"}],
        ),
        (
            {"environment": "prod", "tags": ["a", 2]},
            [{"path": "/tags/1", "message": "/tags/1: expected string, got integer"}],
        ),
        (
            {"environment": "prod", "a/b~c": "yes"},
            [{"path": "/a~1b~0c", "message": "/a~1b~0c: expected boolean, got string"}],
        ),
        (
            {"environment": "prod", "nested": {}},
            [{"path": "/nested", "message": "/nested: required property 'x' is missing"}],
        ),
        ({"environment": "prod", "extra": 1}, [{"path": "", "message": "property 'extra' is not allowed"}]),
        ([], [{"path": "", "message": "expected object, got array"}]),
    ],
)
def test_argument_validators_messages(arguments: Any, expected: list[dict[str, str]]) -> None:
    """Each failure names the field by JSON Pointer and says what was expected."""
    assert ArgumentValidators().errors(loaded(DEPLOY), arguments) == expected


def test_argument_validators_every_error_sorted_by_path() -> None:
    """Every error is reported, sorted by path."""
    errors = ArgumentValidators().errors(loaded(DEPLOY), {"count": "x", "tags": [1], "a/b~c": 1})
    assert [e["path"] for e in errors] == ["", "/a~1b~0c", "/count", "/tags/0"]


def test_argument_validators_truncate_echoed_values() -> None:
    """A huge argument value is echoed truncated, never verbatim."""
    (error,) = ArgumentValidators().errors(loaded(DEPLOY), {"environment": "x" * 10_000})
    assert len(error["message"]) < 200
    assert error["message"].endswith("…")


def test_argument_validators_compile_once_per_hash() -> None:
    """The validator is compiled once per tool hash and reused."""
    validators = ArgumentValidators()
    tool = loaded(DEPLOY)
    validators.errors(tool, {})
    validators.errors(tool, {"environment": "prod"})
    assert validators.compiled == 1
    validators.errors(loaded({"type": "object", "properties": {"p": {"pattern": "x"}}}), {})
    assert validators.compiled == 2


def test_argument_validators_cache_is_bounded() -> None:
    """The oldest compiled validator is dropped once the cache is full."""
    validators = ArgumentValidators(max_entries=1)
    first, second = loaded(DEPLOY), loaded({"type": "object", "required": ["x"]})
    validators.errors(first, {})
    validators.errors(second, {})
    validators.errors(first, {})
    assert validators.compiled == 3


def test_argument_validators_never_fetch_remote_refs() -> None:
    """A remote $ref is not fetched; the call gets one error explaining the schema cannot be used."""
    (error,) = ArgumentValidators().errors(loaded({"$ref": "https://example.invalid/s.json"}), {})
    assert error["path"] == ""
    assert error["message"].startswith("the tool's input schema cannot be used: ")


def test_argument_validators_any_of_reports_closest() -> None:
    """An anyOf failure reports the closest alternative's problem."""
    schema = {"type": "object", "properties": {"n": {"anyOf": [{"type": "integer"}, {"type": "null"}]}}}
    (error,) = ArgumentValidators().errors(loaded(schema), {"n": "x"})
    assert error["path"] == "/n"
    assert error["message"].startswith("/n: matches none of the allowed alternatives (anyOf); closest: expected")


@pytest.mark.parametrize(
    ("step", "text", "valid"),
    [
        (0.01, "19.99", True),
        (0.1, "0.3", True),
        (0.1, "0.7", True),
        (0.1, "1e-1", True),
        (0.5, "2.5", True),
        (0.05, "0.35", True),
        (0.1, "0.35", False),
        (0.01, "19.995", False),
        (3, "4.5", False),
    ],
)
def test_argument_validators_multiple_of_is_exact_for_decimal_numbers(
    step: float, text: str, valid: bool
) -> None:
    """multipleOf asks whether the quotient is an integer (JSON Schema), decided on the
    numbers as written: 19.99 is a multiple of 0.01 though 19.99 / 0.01 is 1998.9999999999998
    in binary floating point. The reference host checks no arguments, so a price a model sends
    to a tool written for it must not be refused here for a rounding error."""
    schema = {"type": "object", "properties": {"n": {"type": "number", "multipleOf": step}}}
    validators = ArgumentValidators()
    for number in (JsonNumber(text), float(text)):  # as the wire keeps it, and a plain float
        errors = validators.errors(loaded(schema), {"n": number})
        assert (errors == []) is valid, (number, errors)


@pytest.mark.parametrize(
    ("step", "text"), [(0.1, "0.30000000000000001"), (0.1, "1e-400"), (3, "4.50")]
)
def test_argument_validators_echo_a_number_as_written(step: float, text: str) -> None:
    """A number is echoed as the client wrote it, which is what multipleOf decides on: the
    double it reads as (``0.3``, ``0.0``) is a multiple, so "expected a multiple of 0.1,
    got 0.3" said the call was refused for a value that passes."""
    schema = {"type": "object", "properties": {"n": {"type": "number", "multipleOf": step}}}
    errors = ArgumentValidators().errors(loaded(schema), {"n": JsonNumber(text)})
    assert [e["message"] for e in errors] == [f"/n: expected a multiple of {step}, got {text}"]


#: A keyword outside the plain subset: the same bound is then decided by jsonschema.
_NOT_PLAIN: dict[str, Any] = {"not": {"type": "string"}}
_DRAFT4 = "http://json-schema.org/draft-04/schema#"


@pytest.mark.parametrize(
    ("bounds", "text", "valid"),
    [
        ({"exclusiveMinimum": 0}, "1e-400", True),
        ({"exclusiveMinimum": 0.1}, "0.1000000000000000001", True),
        ({"exclusiveMaximum": 1}, "0.99999999999999999999", True),
        ({"minimum": 0}, "-1e-400", False),
        ({"maximum": 1}, "1.0000000000000000001", False),
        ({"maximum": 9007199254740992}, "9007199254740992.5", False),
        ({"minimum": 0.1, "maximum": 0.1}, "0.1", True),
        ({"minimum": 0.1, "maximum": 0.1}, "1e-1", True),
        ({"maximum": 0}, "-0", True),
        ({"exclusiveMinimum": 0}, "1e400", True),
        ({"maximum": 1e300}, "1e400", False),
    ],
)
def test_argument_validators_bounds_compare_the_numbers_as_written(
    bounds: dict[str, Any], text: str, valid: bool
) -> None:
    """minimum, maximum and the exclusive bounds compare the number the client wrote
    (JSON Schema: numbers by their mathematical value), not the double it reads as:
    ``1e-400`` is greater than 0 though it reads as 0.0, and ``1.0000000000000000001`` is
    more than 1 though it reads as 1.0. Binary comparison refused the first (the reference
    host checks no arguments, so a tool set written for it lost the call) and let the
    second through. Both the plain fast path and jsonschema decide so."""
    validators = ArgumentValidators()
    for extra in ({}, _NOT_PLAIN):
        schema = {"type": "object", "properties": {"n": {**bounds, **extra}}}
        errors = validators.errors(loaded(schema), {"n": JsonNumber(text)})
        assert (errors == []) is valid, (schema, text, errors)


@pytest.mark.parametrize(
    ("text", "valid"),
    [
        ("1e-400", True),
        ("0", False),
        ("0.0", False),
    ],
)
def test_argument_validators_draft4_exclusive_bounds_compare_as_written(text: str, valid: bool) -> None:
    """Draft 4's boolean exclusiveMinimum compares the number as written too."""
    schema = {"$schema": _DRAFT4, "properties": {"n": {"minimum": 0, "exclusiveMinimum": True}}}
    value: Any = 0 if text == "0" else JsonNumber(text)
    errors = ArgumentValidators().errors(loaded(schema), {"n": value})
    assert (errors == []) is valid, (text, errors)


@pytest.mark.parametrize(
    ("schema", "value", "message"),
    [
        ({"minimum": 0, "exclusiveMinimum": True}, 0, "/n: expected a number > 0, got 0"),
        ({"maximum": 5, "exclusiveMaximum": True}, 5, "/n: expected a number < 5, got 5"),
        ({"minimum": 0, "exclusiveMinimum": False}, -1, "/n: expected a number >= 0, got -1"),
        ({"maximum": 5}, 6, "/n: expected a number <= 5, got 6"),
    ],
)
def test_argument_validators_draft4_exclusive_bound_message(
    schema: dict[str, Any], value: int, message: str
) -> None:
    """Draft 4 writes an exclusive bound as ``minimum`` plus ``exclusiveMinimum: true``;
    the message names the bound that failed (it said ``expected a number >= 0, got 0``)."""
    tool = loaded({"$schema": _DRAFT4, "properties": {"n": schema}})
    assert ArgumentValidators().errors(tool, {"n": value}) == [{"path": "/n", "message": message}]


@pytest.mark.parametrize(
    ("text", "valid"),
    [
        ("1.0", True),
        ("1e2", True),
        ("-0.0", True),
        ("1E+2", True),
        ("1e400", True),
        ("12345678901234567890.000", True),
        ("1.5", False),
        ("1.0000000000000000001", False),
        ("9007199254740993.5", False),
        ("1e-400", False),
    ],
)
def test_argument_validators_integer_is_decided_on_the_number_as_written(text: str, valid: bool) -> None:
    """"type": "integer" holds for a number with no fractional part as written: ``1e400``
    is an integer (it reads as infinity, which was "expected integer, got number"), and
    ``1.0000000000000000001`` is not (it reads as 1.0, which passed)."""
    validators = ArgumentValidators()
    for extra in ({}, _NOT_PLAIN):
        schema = {"type": "object", "properties": {"n": {"type": "integer", **extra}}}
        errors = validators.errors(loaded(schema), {"n": JsonNumber(text)})
        assert (errors == []) is valid, (schema, text, errors)


@pytest.mark.parametrize(
    ("schema", "value", "valid"),
    [
        ({"uniqueItems": True}, [1, "1.0000000000000000001"], True),
        ({"uniqueItems": True}, [{"a": 1}, {"a": "0.99999999999999999999"}], True),
        ({"uniqueItems": True}, [1, "1.0"], False),
        ({"uniqueItems": True}, ["1e2", 100], False),
        ({"uniqueItems": True}, [[1], ["1.00"]], False),
        ({"uniqueItems": True}, [True, 1], True),
        ({"uniqueItems": True}, ["1.0000000000000000001", 1, "1.0000000000000000001"], False),
        ({"enum": [1, "a"]}, "1.0000000000000000001", False),
        ({"enum": [1, "a"]}, "1.0", True),
        ({"enum": [[0.1]]}, ["0.1000000000000000001"], False),
        ({"const": 0.1}, "0.1000000000000000001", False),
        ({"const": 0.1}, "1e-1", True),
        ({"const": {"a": 1}}, {"a": "1e0"}, True),
        ({"const": 1}, True, False),
    ],
)
def test_argument_validators_equality_is_decided_on_the_numbers_as_written(
    schema: dict[str, Any], value: Any, valid: bool
) -> None:
    """enum, const and uniqueItems compare numbers by their value as written (JSON Schema:
    the same mathematical value), not by the doubles they read as: ``1`` and
    ``1.0000000000000000001`` are two items (uniqueItems refused them as duplicates), and
    ``1.0000000000000000001`` is not ``1`` (enum let it through). A string here stands
    for the number with that text."""

    def number(item: Any) -> Any:
        if isinstance(item, str):
            return JsonNumber(item)
        if isinstance(item, list):
            return [number(x) for x in item]
        if isinstance(item, dict):
            return {k: number(x) for k, x in item.items()}
        return item

    tool = loaded({"type": "object", "properties": {"n": schema}})
    errors = ArgumentValidators().errors(tool, {"n": number(value)})
    assert (errors == []) is valid, (schema, value, errors)


@pytest.mark.parametrize(
    ("keyword", "text", "valid"),
    [
        ({"minimum": 0}, "1e9999999999999999999", True),
        ({"maximum": 1e308}, "1e9999999999999999999", False),
        ({"minimum": 0}, "-1e-9999999999999999999", False),
        ({"exclusiveMinimum": 0}, "1e-9999999999999999999", True),
        ({"exclusiveMinimum": 0}, "0e-9999999999999999999", False),
        ({"maximum": 5e-324}, "1e-9999999999999999999", True),
        ({"type": "integer"}, "1E+9999999999999999999", True),
        ({"type": "integer"}, "2.5e-9999999999999999999", False),
        ({"type": "integer"}, "-0.0e-9999999999999999999", True),
        ({"enum": [1]}, "1e9999999999999999999", False),
        ({"const": 0}, "1e-9999999999999999999", False),
        ({"uniqueItems": True, "type": "array"}, "[1e9999999999999999999, 1]", True),
    ],
)
def test_argument_validators_numbers_beyond_a_decimal_exponent(
    keyword: dict[str, Any], text: str, valid: bool
) -> None:
    """A number whose exponent has more digits than a Decimal holds (``1e9999999999999999999``,
    valid JSON, kept as written) is still decided, on its sign, digits and side of every
    number a schema can hold, never an internal error (deciding bounds in decimal made
    each of these an ``Internal error (incident …)``)."""
    from toolsetd.protocol.jsontext import loads

    value = loads(f'{{"n": {text}}}'.encode())
    validators = ArgumentValidators()
    for extra in ({}, _NOT_PLAIN):
        schema = {"type": "object", "properties": {"n": {**keyword, **extra}}}
        errors = validators.errors(loaded(schema), value)
        assert (errors == []) is valid, (schema, text, errors)


@pytest.mark.parametrize(
    ("step", "text", "valid"),
    [
        (2, "1e400", True),
        (0.5, "1e400", True),
        (3, "1e400", False),
        (0.5, "1" + "0" * 400, True),
        (0.3, "3" + "0" * 200 + ".3", True),
        (0.9, "3" + "0" * 200 + ".3", False),
        (2, "1e-1000000", False),
        (0.5, "3e-1000000", False),
        (2, "2e1000000", True),
        (3, "1e1000000", False),
        (0.01, "19.99", True),
    ],
)
def test_argument_validators_multiple_of_past_a_double_or_a_long_quotient(
    step: float, text: str, valid: bool
) -> None:
    """multipleOf is exact for a number a double cannot hold and for a long quotient: 1e400
    is a multiple of 2 (it reads as infinity, and jsonschema said "expected a multiple of 2,
    got 1e400"; 10**400 against 0.5 was "too large to check"), and 1e-1000000 is not one
    of 2 (past the decimal context's exponents it fell back to 0.0, a multiple of all)."""
    from toolsetd.protocol.jsontext import loads

    value = loads(f'{{"n": {text}}}'.encode())
    schema = {"type": "object", "properties": {"n": {"multipleOf": step}}}
    errors = ArgumentValidators().errors(loaded(schema), value)
    assert (errors == []) is valid, (step, text, errors)


def test_argument_validators_echo_nested_numbers_as_written() -> None:
    """A number inside an echoed array or object is shown as the client wrote it, as a
    number alone is: the message said "expected [0.1], got [0.1]" (the double it reads as),
    which contradicts itself."""
    schema = {"type": "object", "properties": {"n": {"const": [0.1]}, "m": {"enum": [{"a": 1}]}}}
    value = {"n": [JsonNumber("0.1000000000000000001")], "m": {"a": JsonNumber("1.0000000000000000001")}}
    assert ArgumentValidators().errors(loaded(schema), value) == [
        {"path": "/m", "message": '/m: expected one of [{"a": 1}], got {"a": 1.0000000000000000001}'},
        {"path": "/n", "message": "/n: expected [0.1], got [0.1000000000000000001]"},
    ]


def test_argument_validators_draft7_dialect() -> None:
    """``$schema`` selects the dialect (draft-07 ``dependencies``)."""
    schema = {"$schema": "http://json-schema.org/draft-07/schema#", "dependencies": {"a": ["b"]}}
    errors = ArgumentValidators().errors(loaded(schema), {"a": 1})
    assert [e["path"] for e in errors] == [""]


_DRAFT3 = "http://json-schema.org/draft-03/schema#"


@pytest.mark.parametrize(
    ("schema", "arguments", "expected"),
    [
        (  # draft 3 says a property is required with a boolean beside it
            {"$schema": _DRAFT3, "properties": {"a": {"type": "integer", "required": True}}},
            {},
            [{"path": "", "message": "required property 'a' is missing"}],
        ),
        (
            {
                "$schema": _DRAFT3,
                "properties": {"n": {"properties": {"a": {"required": True}}}},
            },
            {"n": {}},
            [{"path": "/n", "message": "/n: required property 'a' is missing"}],
        ),
        (  # draft 3 lets a type list hold schemas as well as type names
            {"$schema": _DRAFT3, "properties": {"a": {"type": [{"type": "string"}, "integer"]}}},
            {"a": 1.5},
            [
                {
                    "path": "/a",
                    "message": '/a: expected a value matching {"type": "string"} or integer, got number',
                }
            ],
        ),
    ],
)
def test_argument_validators_draft3_required_and_schema_types(
    schema: dict[str, Any], arguments: Any, expected: list[dict[str, str]]
) -> None:
    """A draft-03 tool schema (its ``$schema`` picks the dialect, and the manifest check
    takes it) reports a missing property and a failed type list as argument errors: they
    were a TypeError, so the call was an internal error (-32603) instead of ``InvalidArguments``."""
    assert ArgumentValidators().errors(loaded(schema), arguments) == expected


@pytest.mark.parametrize("dialect", [_DRAFT3, _DRAFT4])
@pytest.mark.parametrize(("text", "valid"), [("7", True), ("1.0", False), ("1e2", False), ("1e400", False)])
def test_argument_validators_draft3_and_draft4_integers_are_literals(
    dialect: str, text: str, valid: bool
) -> None:
    """Draft 3 and 4 define an integer as a literal without a fraction or exponent, so a
    schema declaring them refuses ``1.0`` and ``1e2`` (later drafts take them, as
    docs/manifest.md says)."""
    value = int(text) if text.isdigit() else JsonNumber(text)
    schema = {"$schema": dialect, "properties": {"n": {"type": "integer"}}}
    errors = ArgumentValidators().errors(loaded(schema), {"n": value})
    assert (errors == []) is valid, errors


_LATER = {
    "draft 6": "http://json-schema.org/draft-06/schema#",
    "draft 7": "http://json-schema.org/draft-07/schema#",
    "2019-09": "https://json-schema.org/draft/2019-09/schema",
}


@pytest.mark.parametrize(
    ("dialect", "keyword"),
    [(d, "additionalItems") for d in _LATER] + [("2019-09", "unevaluatedItems")],
)
@pytest.mark.parametrize(("items", "expected"), [(True, []), (False, ["/t"])])
def test_argument_validators_take_a_boolean_items_beside_later_item_keywords(
    dialect: str, keyword: str, items: bool, expected: list[str]
) -> None:
    """Drafts 6 to 2019-09 take ``true`` and ``false`` as schemas, ``items`` too; beside
    one, ``additionalItems`` is passed by, and 2019-09's ``unevaluatedItems`` finds every
    item evaluated. jsonschema took the length of the boolean (``TypeError``), so every
    call with an array there was an internal error (-32603) for a valid schema."""
    schema = {"$schema": _LATER[dialect], "properties": {"t": {"items": items, keyword: False}}}
    errors = ArgumentValidators().errors(loaded(schema), {"t": [1]})
    assert [e["path"] for e in errors] == expected


def test_a_schema_whose_schema_keyword_is_no_uri_is_checked_as_2020_12() -> None:
    """``"$schema": "http://[x/schema"`` (an unclosed IPv6 bracket) made jsonschema's
    ``validator_for`` raise ``ValueError``: ``toolsetctl validate`` ended with "unexpected
    error" (exit 9). Like any unknown ``$schema``, it is checked as 2020-12, and its
    ``$ref`` resolves."""
    schema = {
        "$schema": "http://[x/schema", "type": "object",
        "properties": {"a": {"$ref": "#/$defs/x"}}, "$defs": {"x": {"type": "string"}},
    }
    assert SchemaChecker().problem(schema) is None
    assert dialect(schema) == 2020
    assert ArgumentValidators().errors(loaded(schema), {"a": "x"}) == []
    assert [e["path"] for e in ArgumentValidators().errors(loaded(schema), {"a": 1})] == ["/a"]


_NO_URI_USE = "the tool's input schema cannot be used: "


@pytest.mark.parametrize(
    ("schema", "expected"),
    [
        # A subschema's $schema, as the root's: checked by the draft of its parent, as any
        # $schema jsonschema has no draft of.
        ({"properties": {"a": {"$schema": "http://[x/schema", "type": "string"}}},
         [("/a", "/a: expected string, got integer")]),
        # A $ref or $dynamicRef with a fragment, or one read against an $id: no schema it
        # names, as for any $ref that resolves to none; so for an $id read against another.
        ({"properties": {"a": {"$ref": "http://[x/schema#/$defs/y"}}},
         [("", _NO_URI_USE + "a $ref or $id in it is no URI (Invalid IPv6 URL)")]),
        ({"properties": {"a": {"$dynamicRef": "http://[x/schema#y"}}},
         [("", _NO_URI_USE + "a $ref or $id in it is no URI (Invalid IPv6 URL)")]),
        ({"$id": "https://example.com/s", "properties": {"a": {"$ref": "http://[x/schema"}}},
         [("", _NO_URI_USE + "a $ref or $id in it is no URI (Invalid IPv6 URL)")]),
        # An $id below one: the subschema's base is read against the root's.
        ({"$id": "https://example.com/s", "properties": {"a": {"$id": "http://[x/"}}},
         [("", _NO_URI_USE + "a $ref or $id in it is no URI (Invalid IPv6 URL)")]),
        # A bracketed host that is no address: ipaddress raises it, within urlsplit.
        ({"properties": {"a": {"$ref": "http://[::1x]/s#/$defs/y"}}},
         [("", _NO_URI_USE + "a $ref or $id in it is no URI ('::1x' does not appear to be "
                             "an IPv4 or IPv6 address)")]),
        ({"$id": "https://example.com/s", "properties": {"a": {"$id": "http://[::1x]/"}}},
         [("", _NO_URI_USE + "a $ref or $id in it is no URI ('::1x' does not appear to be "
                             "an IPv4 or IPv6 address)")]),
    ],
)
def test_a_uri_in_a_subschema_that_is_no_uri_is_no_internal_error(
    schema: dict[str, Any], expected: list[tuple[str, str]]
) -> None:
    """The root's ``$schema`` was mended (checked as 2020-12), but the same unclosed "["
    below it still made jsonschema (``validator_for``, as it enters the subschema) or
    referencing (``urljoin``, ``urldefrag`` of a ``$ref``) raise ``ValueError``, which
    ``errors_for`` re-raises: a schema that loads, and every call that reached it was
    -32603 with an incident id."""
    schema = {"type": "object", **schema}
    assert SchemaChecker().problem(schema) is None
    errors = ArgumentValidators().errors(loaded(schema), {"a": 1})
    assert [(e["path"], e["message"]) for e in errors] == expected


@pytest.mark.parametrize(
    "schema",
    [
        {"$ref": "#"},
        {"allOf": [{"$ref": "#"}]},
        {"$defs": {"x": {"$ref": "#/$defs/x"}}, "$ref": "#/$defs/x"},
        # A loop met only below a member the arguments have (two levels down).
        {"properties": {"a": {"properties": {"b": {"$ref": "#/properties/a/properties/b"}}}}},
    ],
)
def test_argument_validators_blame_a_schema_that_refers_to_itself_without_end(
    schema: dict[str, Any],
) -> None:
    """A schema whose ``$ref`` loops without checking anything passes the manifest check
    but can never finish; the error says so, rather than blaming the (shallow) arguments
    as "nested too deeply", which sent the caller to fix what was not wrong."""
    errors = ArgumentValidators().errors(loaded(schema), {"a": {"b": 1}})
    assert len(errors) == 1 and errors[0]["path"] == ""
    assert "input schema" in errors[0]["message"] and "$ref" in errors[0]["message"], errors
    assert "arguments are nested" not in errors[0]["message"]


@pytest.fixture
def daemon_recursion_limit() -> Iterator[None]:
    """The recursion limit the daemon and its check process run with from their start
    (``large.raise_recursion_limit``), which the check spends."""
    before = sys.getrecursionlimit()
    sys.setrecursionlimit(max(before, PARSE_RECURSION_LIMIT))
    try:
        yield
    finally:
        sys.setrecursionlimit(before)


@pytest.mark.usefixtures("daemon_recursion_limit")
def test_argument_validators_a_recursive_schema_is_not_blamed_for_deep_arguments() -> None:
    """A schema that recurses through the arguments (a tree), with several keywords on
    the way to each level, exhausts the check at a nesting the wire takes (63 here): that
    is the arguments' depth, not a schema that "cannot be checked to its end" (the same
    schema takes shallow arguments), and the error must not send the caller to the set's
    author."""
    node: Any = {"type": "object", "properties": {"c": {"$ref": "#"}}}
    for _ in range(8):
        node = {"allOf": [node]}
    schema = node
    assert ArgumentValidators().errors(loaded(schema), {"c": {"c": {}}, "d": 1}) == []
    deep: Any = {}
    for _ in range(63):
        deep = {"c": deep}
    errors = ArgumentValidators().errors(loaded(schema), {**deep, "d": 1})
    assert errors == [{"path": "", "message": "the arguments are nested too deeply to validate"}]


@pytest.mark.usefixtures("own_sigalrm")  # the check here is limited as in the daemon
def test_argument_validators_the_schema_loop_probe_runs_within_the_checks_time_limit() -> None:
    """The probe that decides whom a RecursionError blames (the same arguments cut to 16
    levels, checked again) is part of the check and has only what is left of its time
    limit. Given a whole limit of its own, a check ran up to twice its limit, on the loop
    (holding every other client) or in the check process (killed past its limit and
    ``_GRACE``); a probe that runs out of the check's time says the check was stopped.

    Here the deep arguments exhaust the recursion before any ``pattern`` is checked (the
    pattern's member comes after the one the schema recurses through), and the cut ones
    reach the patterns, which backtrack far past the limit."""
    node: Any = {
        "type": "object",
        "properties": {"c": {"$ref": "#"}, "t": {"type": "string", "pattern": "^(a+)+$"}},
    }
    for _ in range(6):
        node = {"allOf": [node]}
    deep: Any = {}
    for level in range(63):
        deep = {"c": deep, "t": "a" * 40 + "!"} if level >= 48 else {"c": deep}
    validators = ArgumentValidators(time_limit=0.5)
    errors = validators.errors(loaded(node), deep)
    assert len(errors) == 1 and errors[0]["path"] == "", errors
    assert "was stopped after" in errors[0]["message"], errors


@pytest.mark.usefixtures("daemon_recursion_limit")
def test_argument_validators_arguments_too_deep_for_the_check_are_still_named() -> None:
    """Arguments deeper than the wire allows (a direct caller) that exhaust the check
    still get the arguments' message."""
    deep: Any = {}
    for _ in range(250):
        deep = {"c": deep}
    schema = {"allOf": [{"type": "object", "properties": {"c": {"$ref": "#"}}, "minProperties": 2}]}
    errors = ArgumentValidators().errors(loaded(schema), deep)
    assert errors == [{"path": "", "message": "the arguments are nested too deeply to validate"}]


def test_many_values_or_long_strings_are_checked_off_the_loop() -> None:
    """Past 4,096 values on all levels, or 64 Ki characters of strings (keys included),
    the check goes to the check process, whatever the schema."""
    assert not off_loop({"n": [0] * 4095})  # 4,096 values with "n"
    assert off_loop({"n": [0] * 4096})
    assert off_loop({"n": [[0]] * 2048})  # counted on every level
    assert not off_loop({"n": [[0]] * 2047})
    assert off_loop({"n": [{"a": 1, "b": 2}] * 1400})
    assert not off_loop({"s": "a" * 65_535})  # with the key: 65,536 characters
    assert off_loop({"s": "a" * 65_536})
    assert off_loop({"a" * 65_537: 1})
    assert off_loop({"n": [["a" * 30_000]] * 3})  # on every level
    assert off_loop("a" * 65_537)
    assert not off_loop(7)


def test_schema_checker_caches_by_content() -> None:
    """Equal schemas with different key order are checked once; verdicts are cached too."""
    checker = SchemaChecker()
    assert checker.problem({"type": "object", "required": ["a"]}) is None
    assert checker.problem({"required": ["a"], "type": "object"}) is None
    assert checker.problem({"type": 5}) == "5 is not valid under any of the given schemas (at /type)"
    assert checker.problem({"type": 5}) is not None
    assert checker.checks == 2


_FIRST_PROBLEM = """
from toolsetd.daemon.validation import SchemaChecker
schema = {"type": "object", "properties": {f"p{i}": {"type": i} for i in range(8)}}
print(SchemaChecker().problem(schema))
print(SchemaChecker.problems(schema)[0])
"""


def test_schema_checker_reports_the_same_first_problem_in_every_process() -> None:
    """Of several problems the one reported is the first by path, whatever the process's
    string hash seed: jsonschema walks a schema's properties through a set, so the first it
    yields changed from one daemon to the next, and a stored verdict named another problem
    than a fresh check."""
    seen = set()
    for seed in range(8):
        done = subprocess.run(
            [sys.executable, "-c", _FIRST_PROBLEM],
            capture_output=True, text=True, timeout=60, check=True,
            env={**os.environ, "PYTHONHASHSEED": str(seed)},
        )
        seen.add(done.stdout)
    assert seen == {
        "0 is not valid under any of the given schemas (at /properties/p0/type)\n" * 2
    }


def test_schema_checker_keeps_a_bounded_number_of_verdicts() -> None:
    """Past its bound the checker forgets its oldest verdicts: a daemon that lives long
    meets a new schema at every edit of one, and kept them all. A forgotten schema is
    checked again, with the same verdict."""
    checker = SchemaChecker(max_verdicts=8)
    for i in range(100):
        assert checker.problem({"type": "object", "title": f"t{i}"}) is None
    assert len(checker._verdicts) <= 8
    assert checker.checks == 100
    assert checker.problem({"type": 5}) is not None
    assert checker.problem({"type": "object", "title": "t99"}) is None  # kept: newest
    assert checker.checks == 101
    assert checker.problem({"type": "object", "title": "t0"}) is None  # forgotten: again
    assert checker.checks == 102


def test_schema_checker_uses_declared_dialect() -> None:
    """``$schema`` selects the meta-schema the schema is checked against."""
    draft7 = "http://json-schema.org/draft-07/schema#"
    assert SchemaChecker().problem({"$schema": draft7, "dependencies": {"a": 5}}) is not None
    assert SchemaChecker().problem({"$schema": draft7, "dependentRequired": 5}) is None
    assert SchemaChecker().problem({"dependentRequired": 5}) == "5 is not of type 'object' (at /dependentRequired)"


def test_json_pointer_escapes() -> None:
    """Pointers escape ``~`` as ``~0`` and ``/`` as ``~1``; the root is empty."""
    assert json_pointer([]) == ""
    assert json_pointer(["a/b", "~", 0]) == "/a~1b/~0/0"


def test_canonical_json_is_order_independent_and_utf8() -> None:
    """Canonical JSON sorts keys, has no spaces and keeps non-ASCII as UTF-8."""
    assert canonical_json({"b": 1, "a": "é"}) == '{"a":"é","b":1}'.encode()
    assert canonical_json({"a": "\ud800"}) == b'{"a":"\xed\xa0\x80"}'


# -- the check_schema fast path ------------------------------------------------------

from jsonschema import Draft202012Validator  # noqa: E402
from jsonschema.exceptions import SchemaError  # noqa: E402
from toolsetd.daemon.validation import _plainly_valid  # noqa: E402

_ANY_JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-5, 5) | st.floats(-2, 2, allow_nan=False)
    | st.sampled_from(["", "string", "object", "x", "integer", "nope"]),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=3), inner, max_size=3),
    max_leaves=6,
)


def _schemas() -> st.SearchStrategy[object]:
    """Schemas that are mostly valid, with near misses a sloppy fast path would let through."""
    types = st.sampled_from(["string", "object", "integer", "array", "null", "strin", "Object"])
    names = st.sampled_from(["a", "b", "c"])
    count = st.integers(-1, 3) | st.sampled_from([1.0, True, "1"])
    number = st.integers(-3, 3) | st.floats(-2, 2, allow_nan=False) | st.sampled_from([True, "1"])

    def keyword_values(sub: st.SearchStrategy[object]) -> dict[str, st.SearchStrategy[object]]:
        return {
            "type": types | st.lists(types, max_size=3),
            "properties": st.dictionaries(names, sub, max_size=3) | st.just([]),
            "required": st.lists(names, max_size=3) | st.just("a"),
            "items": sub | st.lists(sub, max_size=2),
            "additionalProperties": sub | st.just(1),
            "not": sub,
            "propertyNames": sub,
            "anyOf": st.lists(sub, max_size=2),
            "oneOf": st.lists(sub, max_size=2),
            "allOf": st.lists(sub, max_size=2) | sub,
            "enum": st.lists(_ANY_JSON, max_size=2) | _ANY_JSON,
            "examples": st.lists(_ANY_JSON, max_size=2) | _ANY_JSON,
            "const": _ANY_JSON,
            "default": _ANY_JSON,
            "description": st.text(max_size=3) | st.just(5),
            "title": st.text(max_size=3) | st.none(),
            "format": st.sampled_from(["date", "x"]) | st.just(3),
            "minLength": count,
            "maxItems": count,
            "minimum": number,
            "exclusiveMinimum": number,
            "multipleOf": number,
            "uniqueItems": st.booleans() | st.just(0),
            "deprecated": st.booleans() | st.just("yes"),
            "pattern": st.sampled_from(["^a$", "("]),
            "$ref": st.just("#"),
            "unknownKw": _ANY_JSON,
        }

    def objects(sub: st.SearchStrategy[object]) -> st.SearchStrategy[object]:
        values = keyword_values(sub)
        return st.lists(st.sampled_from(sorted(values)), max_size=4, unique=True).flatmap(
            lambda keys: st.fixed_dictionaries({k: values[k] for k in keys})
        )

    leaf = st.booleans() | objects(st.booleans() | st.just({}))
    return st.recursive(leaf, objects, max_leaves=8)


def _meta_accepts(schema: object) -> bool:
    try:
        Draft202012Validator.check_schema(schema)  # type: ignore[arg-type]
    except SchemaError:
        return False
    return True


@pytest.mark.slow
@settings(max_examples=examples(600), deadline=None)
@given(_schemas())
def test_schema_fast_path_never_accepts_what_the_meta_schema_rejects(schema: object) -> None:
    """Whatever the fast path calls valid, jsonschema's check_schema accepts too."""
    if _plainly_valid(schema):
        assert _meta_accepts(schema)


@settings(max_examples=examples(300), deadline=None)
@given(_schemas())
def test_schema_checker_verdict_matches_check_schema(schema: object) -> None:
    """The checker, fast path included, says valid exactly when check_schema does."""
    if not isinstance(schema, dict):
        return
    assert (SchemaChecker().problem(schema) is None) == _meta_accepts(schema)


def test_schema_fast_path_takes_the_common_tool_schema() -> None:
    """A typical tool schema is decided by the fast path, without the meta-schema."""
    schema = {
        "type": "object",
        "properties": {
            "environment": {"type": "string", "enum": ["dev", "prod"], "description": "where"},
            "count": {"type": "integer", "minimum": 1},
            "tags": {"type": "array", "items": {"type": "string"}, "uniqueItems": True},
        },
        "required": ["environment"],
        "additionalProperties": False,
    }
    assert _plainly_valid(schema)
    assert not _plainly_valid({**schema, "required": ["a", "a"]})
    assert not _plainly_valid({"type": "strin"})


# --- the plain fast path ------------------------------------------------------------

PLAIN_KEYWORDS = st.recursive(
    st.one_of(
        st.booleans(),
        st.fixed_dictionaries({}, optional={
            "type": st.one_of(
                st.sampled_from(["object", "array", "string", "boolean", "null", "number", "integer"]),
                st.lists(st.sampled_from(["string", "integer", "null", "number", "boolean"]),
                         min_size=1, max_size=3, unique=True),
            ),
            "minimum": st.integers(-3, 3) | st.floats(-3, 3, allow_nan=False),
            "maximum": st.integers(-3, 3),
            "exclusiveMinimum": st.floats(-3, 3, allow_nan=False),
            "exclusiveMaximum": st.integers(-3, 3),
            "minLength": st.integers(0, 3),
            "maxLength": st.integers(0, 3),
            "minItems": st.integers(0, 2),
            "maxItems": st.integers(0, 3),
            "minProperties": st.integers(0, 2),
            "maxProperties": st.integers(0, 3),
            "description": st.text(max_size=3),
            "format": st.sampled_from(["email", "date-time"]),
        }),
    ),
    lambda inner: st.fixed_dictionaries({}, optional={
        "type": st.sampled_from(["object", "array"]),
        "properties": st.dictionaries(st.sampled_from(["a", "b", "c"]), inner, max_size=3),
        "required": st.lists(st.sampled_from(["a", "b", "c"]), unique=True, max_size=3),
        "additionalProperties": inner,
        "items": inner,
    }),
    max_leaves=6,
)
JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-4, 4) | st.floats(-4, 4, allow_nan=False)
    | st.sampled_from([1.0, -0.0, 2.5]) | st.text(max_size=4),
    lambda inner: st.lists(inner, max_size=3)
    | st.dictionaries(st.sampled_from(["a", "b", "c", "d"]), inner, max_size=4),
    max_leaves=8,
)


@settings(max_examples=examples(400), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(schema=PLAIN_KEYWORDS, value=JSON_VALUES)
def test_argument_validators_plain_fast_path_agrees_with_jsonschema(schema: Any, value: Any) -> None:
    """For schemas of the plain subset, the fast check accepts exactly what jsonschema does."""
    from jsonschema import Draft202012Validator
    from toolsetd.daemon.validation import _plain_subset, _satisfies

    if not isinstance(schema, dict):
        schema = {"items": schema}
    assert _plain_subset(schema)
    expected = not any(Draft202012Validator(schema).iter_errors(value))
    assert _satisfies(schema, value) is expected


def test_argument_validators_plain_valid_call_compiles_nothing() -> None:
    """A valid call against a plain schema is answered without building a jsonschema validator."""
    validators = ArgumentValidators()
    tool = loaded({"type": "object", "properties": {"n": {"type": "integer", "minimum": 0}},
                   "required": ["n"], "additionalProperties": False})
    assert validators.errors(tool, {"n": 3}) == []
    assert validators.compiled == 0
    assert validators.errors(tool, {"n": -1}) == [
        {"path": "/n", "message": "/n: expected a number >= 0, got -1"}
    ]
    assert validators.compiled == 1


@pytest.mark.parametrize(
    "schema",
    [
        {"type": "object", "properties": {"a": {"enum": [1]}}},
        {"pattern": "x"},
        {"$ref": "#/$defs/x", "$defs": {"x": {}}},
        {"$schema": "http://json-schema.org/draft-07/schema#", "type": "object"},
        {"anyOf": [{"type": "string"}]},
        {"type": "object", "patternProperties": {"x": {}}},
        {"type": "object", "properties": {"a": {"type": "integer", "multipleOf": 2}}},
    ],
)
def test_argument_validators_other_schemas_take_the_jsonschema_path(schema: dict[str, Any]) -> None:
    """Any keyword outside the plain subset leaves the decision to jsonschema."""
    from toolsetd.daemon.validation import _plain_subset

    assert not _plain_subset(schema)


@pytest.mark.parametrize(
    "declared",
    [
        "http://json-schema.org/draft-03/schema#",
        "http://json-schema.org/draft-04/schema",
        "http://json-schema.org/draft-06/schema#",
        "http://json-schema.org/draft-07/schema#",
        "HTTP://json-schema.org/draft-07/schema",
        "https://json-schema.org/draft-07/schema#",
        "http://json-schema.org/draft-07/schema##",
        "http://JSON-schema.org/draft-07/schema#",
        "https://json-schema.org/draft/2019-09/schema",
        "https://json-schema.org/draft/2020-12/schema#",
        "http://json-schema.org/schema#",
        "",
    ],
)
def test_dialect_names_the_draft_jsonschema_checks_with(declared: str) -> None:
    """``dialect`` reads ``$schema`` without jsonschema (the MCP listing asks before the
    schema's check, which imports jsonschema only while it is the daemon's own); it must
    name the draft jsonschema's ``validator_for`` picks."""
    from jsonschema import validators

    drafts = {
        validators.Draft3Validator: 3,
        validators.Draft4Validator: 4,
        validators.Draft6Validator: 6,
        validators.Draft7Validator: 7,
        validators.Draft201909Validator: 2019,
    }
    picked = validators.validator_for({"$schema": declared}, default=validators.Draft202012Validator)
    assert dialect({"$schema": declared}) == drafts.get(picked, 2020)


def test_a_listing_of_a_draft_7_schema_imports_no_jsonschema() -> None:
    """A manifest's parse makes its tools' MCP listing notes before it checks their
    schemas; for a draft 7 schema that read its draft through jsonschema, which it
    imported from disk before the check could see whether it is still the daemon's."""
    code = (
        "import sys\n"
        "from toolsetd.daemon.mcpschema import listed_schema, listing_notes\n"
        "s = {'$schema': 'http://json-schema.org/draft-07/schema#', 'type': 'object',\n"
        "     'properties': {'a': {'type': 'number', 'x-mcp-header': 'A'}}}\n"
        "assert listing_notes('t', s) and listed_schema(s)\n"
        "print('jsonschema' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout == "False\n"


_D2019 = "https://json-schema.org/draft/2019-09/schema"


@pytest.mark.parametrize(
    ("schema", "arguments", "expected"),
    [
        ({"additionalProperties": {"type": "string"}, "unevaluatedProperties": False}, {"x": "a"}, []),
        (
            {"allOf": [{"additionalProperties": {"type": "string"}}], "unevaluatedProperties": False},
            {"x": "a"},
            [],
        ),
        (
            {"allOf": [{"unevaluatedProperties": {"type": "string"}}], "unevaluatedProperties": False},
            {"x": "a"},
            [],
        ),
        ({"unevaluatedProperties": {"type": "string"}}, {"type": 5}, [""]),
        ({"unevaluatedProperties": {"minLength": 2}}, {"minLength": "a", "b": "cd"}, [""]),
    ],
)
def test_argument_validators_2019_09_schema_valued_additional_properties_evaluate_members(
    schema: dict[str, Any], arguments: Any, expected: list[str]
) -> None:
    """Under 2019-09, a schema-valued ``additionalProperties`` or ``unevaluatedProperties``
    evaluates each member that passes it, and no other, as the spec says and the 2020-12
    listing does: jsonschema read such a schema as a ``properties`` map, so it refused
    members ``unevaluatedProperties: false`` should take, and took a member named like a
    keyword of the schema (``"type"``) that fails it."""
    declared = {"$schema": _D2019, "type": "object", **schema}
    errors = ArgumentValidators().errors(loaded(declared), arguments)
    assert [e["path"] for e in errors] == expected, errors


@pytest.mark.parametrize("dialect", [_DRAFT3, _DRAFT4])
@pytest.mark.parametrize(("text", "sent"), [("1.0", "send 1"), ("-2e1", "send -20"), ("1e400", "")])
def test_argument_validators_a_draft3_or_4_integer_refusal_says_why(
    dialect: str, text: str, sent: str
) -> None:
    """A number with no fractional part refused as an integer under draft 3 or 4 is told
    why and what to send: MCP hosts are shown the schema as 2020-12, where ``1.0`` is an
    integer, and "expected integer, got number" left a model with a whole number nothing
    to change."""
    schema = {"$schema": dialect, "properties": {"n": {"type": ["integer", "null"]}}}
    (error,) = ArgumentValidators().errors(loaded(schema), {"n": JsonNumber(text)})
    assert error["message"].startswith(f"/n: expected integer or null, got number {text}, which"), error
    assert "JSON Schema draft 3 or 4" in error["message"]
    assert error["message"].endswith(f"; {sent}") == bool(sent), error
    (plain,) = ArgumentValidators().errors(loaded(schema), {"n": JsonNumber("1.5")})
    assert plain["message"] == "/n: expected integer or null, got number"
