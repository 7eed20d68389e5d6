"""Tests for ``toolsetd.daemon.validation``: schema checks and argument errors."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from toolsetd.daemon.catalog import tool_hash
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
from toolsetd.daemon.validation import ArgumentValidators, SchemaChecker, canonical_json, json_pointer


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
    validators.errors(loaded({"type": "object"}), {})
    assert validators.compiled == 2


def test_argument_validators_cache_is_bounded() -> None:
    """The oldest compiled validator is dropped once the cache is full."""
    validators = ArgumentValidators(max_entries=1)
    first, second = loaded(DEPLOY), loaded({"type": "object"})
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


def test_argument_validators_draft7_dialect() -> None:
    """``$schema`` selects the dialect (draft-07 ``dependencies``)."""
    schema = {"$schema": "http://json-schema.org/draft-07/schema#", "dependencies": {"a": ["b"]}}
    errors = ArgumentValidators().errors(loaded(schema), {"a": 1})
    assert [e["path"] for e in errors] == [""]


def test_schema_checker_caches_by_content() -> None:
    """Equal schemas with different key order are checked once; verdicts are cached too."""
    checker = SchemaChecker()
    assert checker.problem({"type": "object", "required": ["a"]}) is None
    assert checker.problem({"required": ["a"], "type": "object"}) is None
    assert checker.problem({"type": 5}) == "5 is not valid under any of the given schemas (at /type)"
    assert checker.problem({"type": 5}) is not None
    assert checker.checks == 2


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
