"""``schema/tools.schema.json`` against the parser, over every manifest of the test corpus.

The corpus is the manifest parser's own tests (``test_manifest.py``: its REJECTED table and
the manifests of its accepting tests, read from their parametrize marks) plus the bundled
examples. Every manifest the parser accepts must validate. Every manifest it rejects must
fail the schema too, except the ones in ``NOT_EXPRESSIBLE``: each names the rule a JSON
Schema cannot state, and ``LIMITS`` shows each such rule on a manifest that breaks only
it (the parser refuses it, the schema accepts it).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from jsonschema import Draft202012Validator
from toolsetd.daemon.manifest import ManifestError, parse_manifest
from toolsetd.daemon.model import DEFAULT_RESERVED_NAMES, Source

from tests.daemon import test_manifest as corpus

REPO = Path(__file__).resolve().parents[2]
SCHEMA = json.loads((REPO / "schema" / "tools.schema.json").read_text())

#: Rejected manifests of the corpus whose rule a schema cannot state (the schema may still
#: reject them for another reason). docs/manifest.md lists the same rules; LIMITS proves each.
NOT_EXPRESSIBLE: dict[str, str] = {
    **dict.fromkeys(
        ("dir-digit", "dir-space", "dir-dot", "dir-65", "dir-newline"),
        "the folder name is not in the file",
    ),
    "shorthand-dotted-dir": "shorthand needs a folder name that is a legal tool name",
    "shorthand-reserved-dir": "shorthand needs a folder name that is a legal tool name",
    "json-depth-65": "nesting deeper than 64",
    "timeout-1.0-literal": "JSON Schema sees 1.0 as an integer; the parser wants an integer literal",
    "timeout-exponent": "JSON Schema sees 1e2 as an integer; the parser wants an integer literal",
    "tool-duplicate": "tool names unique within the set (uniqueItems compares whole objects)",
    **dict.fromkeys(
        (
            "argv-duplicate-earlier-invalid",
            "argv-duplicate-escaped-key",
            "overlay-duplicate-earlier-invalid",
            "overlay-duplicate-earlier-output",
            "overlay-argv-duplicate",
        ),
        "a key named twice: a validator sees its last value only",
    ),
}


def _json(manifest: Any) -> Any:
    """The manifest as a JSON value, or a marker when its text is not strict JSON."""
    if not isinstance(manifest, bytes):
        return json.loads(json.dumps(manifest))
    try:
        return json.loads(manifest.decode("utf-8-sig"), parse_constant=_no_constant)
    except (ValueError, RecursionError):
        return _NOT_JSON


def _no_constant(name: str) -> Any:
    raise ValueError(name)


_NOT_JSON = object()


def _accepted() -> Iterator[tuple[str, Any]]:
    """Every manifest the accepting tests of test_manifest.py parse, with an id."""
    for mark in corpus.test_parse_manifest_accepts_set_fields.pytestmark:  # type: ignore[attr-defined]
        for index, (manifest, _field, _expected) in enumerate(mark.args[1]):
            yield f"set-fields-{index}", manifest
    for mark in corpus.test_parse_manifest_tool_fields.pytestmark:  # type: ignore[attr-defined]
        for index, (fields, _attribute, _expected) in enumerate(mark.args[1]):
            yield (
                f"tool-fields-{index}",
                corpus.exec_set(
                    catalogs=["plan"], approval="always", tools=[corpus.tool(**fields)]
                ),
            )
    yield "shorthand", corpus.shorthand(name="ignored")
    yield (
        "case-sensitive-names",
        corpus.exec_set(tools=[corpus.tool("t"), corpus.tool("T"), corpus.tool("Read")]),
    )
    yield (
        "some-without-command",
        corpus.exec_set(command=None, tools=[corpus.tool("a", command=["x"]), corpus.tool("b")]),
    )
    yield (
        "ignored-fields",
        corpus.shorthand(
            tools="nope", name=1, assembly=5, types=5, schema=corpus.SCHEMA, extra=[1]
        ),
    )
    yield "non-object-schema", corpus.exec_set(schema="x", output=None, description=None, argv=None)
    yield (
        "dotnet-overlays",
        corpus.dotnet(
            types=["Acme.Tool"],
            description=5,
            tools={"acme_x": {"catalogs": ["plan"], "argv": {"a": "-a"}}},
        ),
    )
    deep: Any = {}
    for _ in range(61):
        deep = {"a": deep}
    yield "depth-64", corpus.shorthand(schema={"type": "object", "x": deep})
    for path in sorted((REPO / "examples" / "tools").glob("*/tools.json")):
        yield f"example-{path.parent.name}", json.loads(path.read_text())


def _schema_errors(value: Any) -> list[str]:
    return [error.message for error in Draft202012Validator(SCHEMA).iter_errors(value)]


def _parses(manifest: Any, directory: str, tmp_path: Path) -> bool:
    text = manifest if isinstance(manifest, bytes) else json.dumps(manifest).encode()
    try:
        parse_manifest(
            text, set_dir=tmp_path / directory, source=Source.HOME, reserved=DEFAULT_RESERVED_NAMES
        )
    except ManifestError:
        return False
    return True


def test_schema_is_a_valid_draft_2020_12_schema() -> None:
    """The published schema is itself valid under its meta-schema."""
    Draft202012Validator.check_schema(SCHEMA)
    assert SCHEMA["$schema"] == "https://json-schema.org/draft/2020-12/schema"


@pytest.mark.parametrize(("name", "manifest"), list(_accepted()), ids=[n for n, _ in _accepted()])
def test_schema_accepts_what_the_parser_accepts(name: str, manifest: Any, tmp_path: Path) -> None:
    """Every manifest the parser accepts validates against the schema."""
    directory = name.removeprefix("example-") if name.startswith("example-") else "acme"
    assert _parses(manifest, directory, tmp_path), name
    assert _schema_errors(_json(manifest)) == []


@pytest.mark.parametrize(
    ("name", "directory", "manifest"),
    [(r[0], r[1], r[2]) for r in corpus.REJECTED],
    ids=[r[0] for r in corpus.REJECTED],
)
def test_schema_rejects_what_the_parser_rejects(
    name: str, directory: str, manifest: Any, tmp_path: Path
) -> None:
    """A rejected manifest fails the schema, unless its rule is one a schema cannot state."""
    assert not _parses(manifest, directory, tmp_path)
    value = _json(manifest)
    if value is _NOT_JSON:
        assert name.startswith("json-"), name  # JSON syntax: the editor's parser reports it
        return
    if name not in NOT_EXPRESSIBLE:
        assert _schema_errors(value), f"{name}: the schema accepts a manifest the parser rejects"


_VALID = b'"runner": "exec", "command": ["acme"], "description": "d", "schema": {"type": "object"}'

#: For each rule of NOT_EXPRESSIBLE, a manifest that breaks only that rule: the parser
#: refuses it and the schema lets it through (so the docs' list of limits stays true).
LIMITS: list[tuple[str, str, bytes]] = [
    ("folder-name", "9lives", b"{" + _VALID + b"}"),
    ("shorthand-folder", "Acme.Tools", b"{" + _VALID + b"}"),
    ("depth-65", "acme", b"{" + _VALID + b', "x": ' + b"[" * 64 + b"]" * 64 + b"}"),
    ("timeout-1.0", "acme", b"{" + _VALID + b', "timeoutSeconds": 1.0}'),
    ("timeout-1e2", "acme", b"{" + _VALID + b', "timeoutSeconds": 1e2}'),
    (
        "duplicate-name",
        "acme",
        json.dumps(corpus.exec_set(tools=[corpus.tool("t"), corpus.tool("t")])).encode(),
    ),
    ("reserve-option", "deploy", b"{" + _VALID + b"}"),
    ("duplicate-key", "acme", b"{" + _VALID + b', "argv": {"a": 1, "a": "--a"}}'),
]


@pytest.mark.parametrize(("rule", "directory", "text"), LIMITS, ids=[r[0] for r in LIMITS])
def test_schema_limits_are_real(rule: str, directory: str, text: bytes, tmp_path: Path) -> None:
    """Each listed limit is one: the parser refuses the manifest, the schema accepts it."""
    reserved = DEFAULT_RESERVED_NAMES | ({"deploy"} if rule == "reserve-option" else set())
    with pytest.raises(ManifestError):
        parse_manifest(text, set_dir=tmp_path / directory, source=Source.HOME, reserved=reserved)
    assert _schema_errors(json.loads(text)) == []
