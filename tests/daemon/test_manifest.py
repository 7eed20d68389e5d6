"""Tests for ``toolsetd.daemon.manifest``: every rule of the reference host, message for message."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from toolsetd.daemon.manifest import ManifestError, parse_manifest
from toolsetd.daemon.mcpschema import is_unlisted
from toolsetd.daemon.model import (
    DEFAULT_RESERVED_NAMES,
    Approval,
    CatalogName,
    OutputMode,
    RunnerKind,
    Source,
    ToolDef,
)
from toolsetd.daemon.validation import SchemaChecker
from toolsetd.protocol.jsontext import dumps

BOTH = frozenset({CatalogName.PLAN, CatalogName.WORK})
SCHEMA: dict[str, Any] = {"type": "object", "properties": {}}


def tool(name: str = "t", **fields: Any) -> dict[str, Any]:
    """One valid exec tool object, with overrides (None removes a field)."""
    body: dict[str, Any] = {"name": name, "description": "d", "schema": SCHEMA, **fields}
    return {k: v for k, v in body.items() if v is not None}


def exec_set(**fields: Any) -> dict[str, Any]:
    """A valid exec set with one tool, with root overrides."""
    return {"runner": "exec", "command": ["acme"], "tools": [tool()], **fields}


def shorthand(**fields: Any) -> dict[str, Any]:
    """A valid exec shorthand manifest, with root overrides."""
    return {"runner": "exec", "command": ["acme"], "description": "d", "schema": SCHEMA, **fields}


def dotnet(**fields: Any) -> dict[str, Any]:
    """A valid dotnet manifest, with root overrides."""
    return {"runner": "dotnet", "assembly": "Acme.dll", **fields}


def parse(manifest: Any, tmp_path: Path, directory: str = "acme", **kwargs: Any) -> Any:
    """Parse a dict (serialised) or raw bytes as the set ``directory`` under ``tmp_path``."""
    text = manifest if isinstance(manifest, bytes) else json.dumps(manifest).encode()
    kwargs.setdefault("reserved", DEFAULT_RESERVED_NAMES)
    return parse_manifest(text, set_dir=tmp_path / directory, source=Source.HOME, **kwargs)


def message(manifest: Any, tmp_path: Path, directory: str = "acme", **kwargs: Any) -> str:
    """The ManifestError message the manifest produces."""
    with pytest.raises(ManifestError) as caught:
        parse(manifest, tmp_path, directory, **kwargs)
    return caught.value.message


T = "Tool 't' "
REJECTED: list[tuple[str, str, Any, str]] = [
    # 1.1: directory, JSON, root
    ("dir-digit", "9lives", exec_set(), "Tool set directory '9lives' is not a valid name."),
    ("dir-space", "my tools", exec_set(), "Tool set directory 'my tools' is not a valid name."),
    ("dir-dot", ".git", exec_set(), "Tool set directory '.git' is not a valid name."),
    ("dir-65", "a" * 65, exec_set(), f"Tool set directory '{'a' * 65}' is not a valid name."),
    ("dir-newline", "acme\n", exec_set(), "Tool set directory 'acme\n' is not a valid name."),
    ("json-trailing-comma", "acme", b'{"runner": "exec",}',
     "tools.json is not valid JSON: Expecting property name enclosed in double quotes: "
     "line 1 column 19 (char 18)"),
    ("json-comment", "acme", b"// c\n{}", "tools.json is not valid JSON: Expecting value: line 1 column 1 (char 0)"),
    ("json-empty", "acme", b"", "tools.json is not valid JSON: Expecting value: line 1 column 1 (char 0)"),
    ("json-nan", "acme", b'{"runner": NaN}', "tools.json is not valid JSON: NaN is not a valid JSON value."),
    ("json-infinity", "acme", b'{"timeoutSeconds": -Infinity}',
     "tools.json is not valid JSON: -Infinity is not a valid JSON value."),
    ("json-depth-65", "acme", b'{"x":' + b"[" * 64 + b"]" * 64 + b"}",
     "tools.json is not valid JSON: the maximum nesting depth of 64 was exceeded."),
    ("json-depth-deep", "acme", b"[" * 100_000 + b"]" * 100_000,
     "tools.json is not valid JSON: the maximum nesting depth of 64 was exceeded."),
    ("json-lone-surrogate", "acme", b'{"runner": "exec", "description": "x\\ud800y"}',
     "tools.json is not valid JSON: Unpaired surrogate \\ud800: line 1 column 37 (char 36)"),
    ("json-lone-low-surrogate-key", "acme", b'{"runner": "exec", "\\uDC00": 1}',
     "tools.json is not valid JSON: Unpaired surrogate \\uDC00: line 1 column 21 (char 20)"),
    ("json-high-then-high", "acme", b'{"x": "\\ud83d\\ud83d\\ude00"}',
     "tools.json is not valid JSON: Unpaired surrogate \\ud83d: line 1 column 8 (char 7)"),
    ("json-high-at-end", "acme", b'{"x": "a\\ud83d", "y": "\\ude00"}',
     "tools.json is not valid JSON: Unpaired surrogate \\ud83d: line 1 column 9 (char 8)"),
    ("json-number-beyond-double", "acme", b'{"schema": {"maximum": 1e400}}',
     "tools.json has a number toolsetd cannot hold: 1e400 is beyond the range of a double "
     "(about ±1.8e308). Write a smaller number, or leave it out."),
    ("json-number-beyond-double-negative", "acme", b'{"x": -1.5E999}',
     "tools.json has a number toolsetd cannot hold: -1.5E999 is beyond the range of a double "
     "(about ±1.8e308). Write a smaller number, or leave it out."),
    ("json-number-below-double", "acme", b'{"schema": {"exclusiveMinimum": 1e-400}}',
     "tools.json has a number toolsetd cannot hold: 1e-400 is nearer zero than a double can "
     "be (about ±4.9e-324). Write 0, or a larger number."),
    ("json-integer-too-long-after-long-runs", "acme",
     b'{"d": "' + b" ".join([b"7" * 4300] * 3) + b'", "y": ' + b"9" * 4301 + b"}",
     "tools.json has a number toolsetd cannot hold: an integer of more than 4,300 digits: "
     "line 1 column 12918 (char 12917). Write a shorter number."),
    ("json-integer-too-long", "acme", b'{"x": "1234",\n "y": ' + b"9" * 5000 + b"}",
     "tools.json has a number toolsetd cannot hold: an integer of more than 4,300 digits: "
     "line 2 column 7 (char 20). Write a shorter number."),
    # The place is the integer's token, not the first run of as many digits: not one in a
    # string (an escaped quote does not end it, an escaped backslash before one does), nor
    # a float's fraction or exponent, which may be of any length.
    ("json-integer-too-long-after-digits-in-a-string", "acme",
     b'{"d": "' + b"9" * 4301 + b'", "y": ' + b"9" * 4301 + b"}",
     "tools.json has a number toolsetd cannot hold: an integer of more than 4,300 digits: "
     "line 1 column 4317 (char 4316). Write a shorter number."),
    ("json-integer-too-long-after-an-escaped-quote", "acme",
     b'{"d": "say \\"' + b"9" * 4301 + b'\\"", "e": "\\\\", "y": ' + b"9" * 4301 + b"}",
     "tools.json has a number toolsetd cannot hold: an integer of more than 4,300 digits: "
     "line 1 column 4336 (char 4335). Write a shorter number."),
    ("json-integer-too-long-after-a-long-fraction", "acme",
     b'{"f": 0.' + b"9" * 5000 + b', "e": 1E+' + b"0" * 4400 + b'1, "y": ' + b"9" * 4301 + b"}",
     "tools.json has a number toolsetd cannot hold: an integer of more than 4,300 digits: "
     "line 1 column 9427 (char 9426). Write a shorter number."),
    ("json-integer-too-long-negative-multi-line", "acme",
     b'{\n  "d": "' + b"7" * 4301 + b'",\n  "f": -1.' + b"7" * 4301 + b',\n  "y":\n    -'
     + b"7" * 4301 + b"\n}",
     "tools.json has a number toolsetd cannot hold: an integer of more than 4,300 digits: "
     "line 5 column 5 (char 8638). Write a shorter number."),
    ("root-array", "acme", [], "tools.json must be a JSON object."),
    ("root-string", "acme", "exec", "tools.json must be a JSON object."),
    # runner
    ("runner-missing", "acme", {"command": ["x"]}, "tools.json must set runner to exec or dotnet."),
    ("runner-key-case", "acme", {"Runner": "exec"}, "tools.json must set runner to exec or dotnet."),
    ("runner-number", "acme", {"runner": 1}, "tools.json must set runner to exec or dotnet."),
    ("runner-blank", "acme", {"runner": "  "}, "tools.json must set runner to exec or dotnet."),
    ("runner-python", "acme", {"runner": "python"}, "tools.json must set runner to exec or dotnet."),
    ("runner-first", "acme", {"runner": "x", "catalogs": []}, "tools.json must set runner to exec or dotnet."),
    # catalogs
    ("catalogs-empty", "acme", exec_set(catalogs=[]), "catalogs must be plan, work, or both."),
    ("catalogs-mode", "acme", exec_set(catalogs=["review"]), "catalogs must be plan, work, or both."),
    ("catalogs-string", "acme", exec_set(catalogs="plan"), "catalogs must be plan, work, or both."),
    ("catalogs-blank", "acme", exec_set(catalogs=["plan", " "]), "catalogs must be plan, work, or both."),
    ("catalogs-number", "acme", exec_set(catalogs=[1]), "catalogs must be plan, work, or both."),
    # approval
    ("approval-word", "acme", exec_set(approval="never"), "approval must be inherit or always."),
    ("approval-number", "acme", exec_set(approval=1), "approval must be inherit or always."),
    ("approval-bool", "acme", exec_set(approval=True), "approval must be inherit or always."),
    # timeoutSeconds
    *[
        (f"timeout-{label}", "acme", exec_set(timeoutSeconds=value),
         "timeoutSeconds must be a supported positive integer or unlimited.")
        for label, value in [
            ("null", None), ("zero", 0), ("negative", -1), ("fraction", 1.5), ("string", "120"),
            ("Unlimited", "Unlimited"), ("over", 4_294_968), ("true", True), ("int32-over", 2**31),
            ("object", {}),
        ]
    ],
    ("timeout-1.0-literal", "acme", b'{"runner": "exec", "timeoutSeconds": 1.0}',
     "timeoutSeconds must be a supported positive integer or unlimited."),
    ("timeout-exponent", "acme", b'{"runner": "exec", "timeoutSeconds": 1e2}',
     "timeoutSeconds must be a supported positive integer or unlimited."),
    # stdin, enabled, command
    ("stdin-string", "acme", exec_set(stdin="yes"), "stdin must be a boolean."),
    ("stdin-number", "acme", exec_set(stdin=1), "stdin must be a boolean."),
    ("enabled-string", "acme", exec_set(enabled="no"), "enabled must be a boolean."),
    ("command-string", "acme", exec_set(command="acme"), "command must be an array of strings."),
    ("command-blank", "acme", exec_set(command=["acme", " "]), "command must be an array of strings."),
    ("command-number", "acme", exec_set(command=[1]), "command must be an array of strings."),
    ("dotnet-stdin", "acme", dotnet(stdin="x"), "stdin must be a boolean."),
    ("dotnet-command", "acme", dotnet(command="x"), "command must be an array of strings."),
    ("dotnet-output", "acme", dotnet(output="text"), "output is only valid for exec."),
    ("dotnet-output-null", "acme", dotnet(output=None), "output is only valid for exec."),
    # 1.2 exec
    ("exec-tools-object", "acme", exec_set(tools={"t": {}}), "exec tools must be a JSON array."),
    ("mix-description", "acme", exec_set(description="d"), "exec shorthand fields cannot mix with a tools array."),
    ("mix-schema", "acme", exec_set(schema={}), "exec shorthand fields cannot mix with a tools array."),
    ("mix-argv", "acme", exec_set(argv={}), "exec shorthand fields cannot mix with a tools array."),
    ("mix-path-arguments", "acme", exec_set(pathArguments=[]),
     "exec shorthand fields cannot mix with a tools array."),
    ("mix-output", "acme", exec_set(output="text"), "exec shorthand fields cannot mix with a tools array."),
    ("tool-not-object", "acme", exec_set(tools=[tool(), "u"]), "Each exec tool must be a JSON object."),
    ("tool-name-missing", "acme", exec_set(tools=[tool(name=None)]), "Each exec tool requires name."),
    ("tool-name-blank", "acme", exec_set(tools=[tool(name=" ")]), "Each exec tool requires name."),
    ("tool-name-number", "acme", exec_set(tools=[tool(name=5)]), "Each exec tool requires name."),
    ("tool-name-reserved", "acme", exec_set(tools=[tool("read")]), "Tool name 'read' is reserved or invalid."),
    ("tool-name-reserved-later", "acme", exec_set(tools=[tool("a"), tool("bash")]),
     "Tool name 'bash' is reserved or invalid."),
    ("tool-name-dot", "acme", exec_set(tools=[tool("a.b")]), "Tool name 'a.b' is reserved or invalid."),
    ("tool-name-digit", "acme", exec_set(tools=[tool("1a")]), "Tool name '1a' is reserved or invalid."),
    ("tool-name-65", "acme", exec_set(tools=[tool("a" * 65)]), f"Tool name '{'a' * 65}' is reserved or invalid."),
    ("tool-description-missing", "acme", exec_set(tools=[tool(description=None)]), T + "requires description."),
    ("tool-description-blank", "acme", exec_set(tools=[tool(description="\u3000")]), T + "requires description."),
    ("tool-schema-missing", "acme", exec_set(tools=[tool(schema=None)]), T + "requires a JSON Schema object."),
    ("tool-schema-array", "acme", exec_set(tools=[tool(schema=[])]), T + "requires a JSON Schema object."),
    ("tool-catalogs-empty", "acme", exec_set(tools=[tool(catalogs=[])]), T + "has invalid catalogs."),
    ("tool-catalogs-string", "acme", exec_set(tools=[tool(catalogs="work")]), T + "has invalid catalogs."),
    ("argv-not-object", "acme", exec_set(tools=[tool(argv=["--env"])]), "argv must be an object of flag strings."),
    ("argv-blank", "acme", exec_set(tools=[tool(argv={"env": " "})]), "argv 'env' must be a flag string."),
    ("argv-number", "acme", exec_set(tools=[tool(argv={"env": 1})]), "argv 'env' must be a flag string."),
    ("tool-command", "acme", exec_set(tools=[tool(command="deploy")]), T + "command must be an array of strings."),
    ("tool-path-arguments", "acme", exec_set(tools=[tool(pathArguments=[""])]),
     T + "pathArguments must be an array of strings."),
    ("tool-approval", "acme", exec_set(tools=[tool(approval="never")]),
     T + "has invalid approval: approval must be inherit or always."),
    ("tool-output-null", "acme", exec_set(tools=[tool(output=None) | {"output": None}]),
     T + "has invalid output: output must be text or content."),
    ("tool-output-json", "acme", exec_set(tools=[tool(output="json")]),
     T + "has invalid output: output must be text or content."),
    ("tool-duplicate", "acme", exec_set(tools=[tool("t"), tool("u"), tool("t")]), "Duplicate tool name 't'."),
    ("tool-duplicate-after-fields", "acme", exec_set(tools=[tool("t"), tool("t", description=None)]),
     T + "requires description."),
    ("tools-empty", "acme", exec_set(tools=[]), "exec tools array must not be empty."),
    ("shorthand-dotted-dir", "Acme.Tools", shorthand(),
     "Directory 'Acme.Tools' is not a valid tool name for exec shorthand."),
    ("shorthand-reserved-dir", "read", shorthand(), "Directory 'read' is not a valid tool name for exec shorthand."),
    ("shorthand-description", "acme", shorthand(description=None, argv={"a": "--a"}),
     "Tool 'acme' requires description."),
    ("shorthand-output-null", "acme", shorthand(output=None),
     "Tool 'acme' has invalid output: output must be text or content."),
    ("no-command", "acme", exec_set(command=None), "exec requires a command array."),
    ("no-command-empty", "acme", exec_set(command=[], tools=[tool(command=[])]), "exec requires a command array."),
    ("invalid-schema", "acme", exec_set(tools=[tool(schema={"type": "objct"})]),
     "Tool 't' has an invalid JSON Schema: 'objct' is not valid under any of the given schemas (at /type)"),
    ("invalid-schema-nested", "acme", exec_set(tools=[tool(schema={"properties": {"a": {"minimum": "x"}}})]),
     "Tool 't' has an invalid JSON Schema: 'x' is not of type 'number' (at /properties/a/minimum)"),
    ("invalid-schema-draft7", "acme",
     exec_set(tools=[tool(schema={"$schema": "http://json-schema.org/draft-07/schema#", "required": "a"})]),
     "Tool 't' has an invalid JSON Schema: 'a' is not of type 'array' (at /required)"),
    ("invalid-schema-bad-dialect", "acme", exec_set(tools=[tool(schema={"$schema": 5})]),
     "Tool 't' has an invalid JSON Schema: 5 is not of type 'string' (at /$schema)"),
    # 1.3 dotnet
    ("dotnet-tools-array", "acme", dotnet(tools=[]), "dotnet tools must be a JSON object of overlays."),
    ("dotnet-assembly-missing", "acme", dotnet(assembly=None), "dotnet runner requires assembly."),
    ("dotnet-assembly-blank", "acme", dotnet(assembly=" "), "dotnet runner requires assembly."),
    ("dotnet-types", "acme", dotnet(types="Acme.Tool"), "types must be an array of strings."),
    ("overlay-reserved", "acme", dotnet(tools={"read": {}}), "Overlay 'read' is reserved or invalid."),
    ("overlay-invalid", "acme", dotnet(tools={"a/b": {}}), "Overlay 'a/b' is reserved or invalid."),
    ("overlay-not-object", "acme", dotnet(tools={"x": 1}), "Overlay 'x' must be a JSON object."),
    ("overlay-output", "acme", dotnet(tools={"x": {"output": None}}), "Overlay 'x' cannot set output."),
    ("overlay-catalogs", "acme", dotnet(tools={"x": {"catalogs": []}}), "Overlay 'x' has invalid catalogs."),
    ("overlay-argv", "acme", dotnet(tools={"x": {"argv": 1}}), "argv must be an object of flag strings."),
    ("overlay-argv-value", "acme", dotnet(tools={"x": {"argv": {"a": ""}}}), "argv 'a' must be a flag string."),
    # An object that names a key twice: System.Text.Json's EnumerateObject yields every
    # member, so the reference host checks an argv map's and the overlays' earlier values too.
    ("argv-duplicate-earlier-invalid", "acme",
     b'{"runner": "exec", "command": ["x"], "description": "d", "schema": {},'
     b' "argv": {"env": 5, "env": "--env"}}', "argv 'env' must be a flag string."),
    ("argv-duplicate-escaped-key", "acme",
     b'{"runner": "exec", "command": ["x"], "tools": [{"name": "t", "description": "d",'
     b' "schema": {}, "\\u0061rgv": {"env": " ", "env": "--env"}}]}', "argv 'env' must be a flag string."),
    ("overlay-duplicate-earlier-invalid", "acme",
     b'{"runner": "dotnet", "assembly": "a.dll", "tools": {"x": 1, "x": {}}}',
     "Overlay 'x' must be a JSON object."),
    ("overlay-duplicate-earlier-output", "acme",
     b'{"runner": "dotnet", "assembly": "a.dll", "tools": {"x": {"output": "text"}, "x": {}}}',
     "Overlay 'x' cannot set output."),
    ("overlay-argv-duplicate", "acme",
     b'{"runner": "dotnet", "assembly": "a.dll", "tools": {"x": {"argv": {"a": null, "a": "-a"}}}}',
     "argv 'a' must be a flag string."),
    ("overlay-path-arguments", "acme", dotnet(tools={"x": {"pathArguments": "p"}}),
     "Overlay 'x' pathArguments must be an array of strings."),
    ("overlay-approval", "acme", dotnet(tools={"x": {"approval": "yes"}}),
     "Overlay 'x' has invalid approval: approval must be inherit or always."),
]


@pytest.mark.parametrize(("directory", "manifest", "expected"), [r[1:] for r in REJECTED], ids=[r[0] for r in REJECTED])
def test_parse_manifest_rejects_with_reference_message(
    tmp_path: Path, directory: str, manifest: Any, expected: str
) -> None:
    """Each broken manifest fails with the reference host's exact message for its first failing rule."""
    assert message(manifest, tmp_path, directory) == expected


def test_parse_manifest_keeps_surrogate_pairs_and_escaped_backslashes(tmp_path: Path) -> None:
    """A surrogate pair is one character, and an escaped backslash before ``ud800`` is text."""
    text = b'{"runner": "exec", "command": ["x"], "description": "\\ud83d\\ude00 \\\\ud800", "schema": {}}'
    toolset = parse_manifest(
        text, set_dir=tmp_path / "acme", source=Source.HOME, reserved=frozenset()
    )
    assert toolset.tools[0].description == "\U0001f600 \\ud800"


def test_parse_manifest_invalid_path_message(tmp_path: Path) -> None:
    """A set directory path holding a NUL character is not a valid path."""
    with pytest.raises(ManifestError) as caught:
        parse_manifest(b"{}", set_dir=Path(f"{tmp_path}/a\x00b"), source=Source.HOME, reserved=frozenset())
    assert caught.value.message == "Tool set directory is not a valid path."


def test_parse_manifest_shorthand_defaults(tmp_path: Path) -> None:
    """A shorthand set yields one tool named after the directory with every default applied."""
    toolset = parse(shorthand(name="ignored"), tmp_path, "deploy")
    assert toolset.runner is RunnerKind.EXEC
    assert (toolset.directory, toolset.path, toolset.source) == ("deploy", tmp_path / "deploy", Source.HOME)
    assert (toolset.enabled, toolset.stdin, toolset.timeout_seconds) == (True, True, 120)
    assert (toolset.catalogs, toolset.approval, toolset.command) == (BOTH, Approval.INHERIT, ("acme",))
    (only,) = toolset.tools
    assert (only.name, only.description, only.schema) == ("deploy", "d", SCHEMA)
    assert (only.command, only.argv, only.path_arguments, only.output) == ((), (), (), OutputMode.TEXT)


def test_parse_manifest_digest_is_sha256_of_bytes(tmp_path: Path) -> None:
    """The digest is sha256 of the exact manifest bytes."""
    import hashlib

    text = json.dumps(shorthand()).encode()
    assert parse(text, tmp_path).digest == "sha256:" + hashlib.sha256(text).hexdigest()


@pytest.mark.parametrize(
    ("manifest", "field", "expected"),
    [
        (exec_set(runner=" EXEC "), "runner", RunnerKind.EXEC),
        (exec_set(catalogs=["Plan", "work", "work"]), "catalogs", BOTH),
        (exec_set(catalogs=[" plan "]), "catalogs", frozenset({CatalogName.PLAN})),
        (exec_set(catalogs=None), "catalogs", BOTH),
        (exec_set(approval=""), "approval", Approval.INHERIT),
        (exec_set(approval=" ALWAYS "), "approval", Approval.ALWAYS),
        (exec_set(approval=None), "approval", Approval.INHERIT),
        (exec_set(timeoutSeconds="unlimited"), "timeout_seconds", None),
        (exec_set(timeoutSeconds=1), "timeout_seconds", 1),
        (exec_set(timeoutSeconds=4_294_967), "timeout_seconds", 4_294_967),
        (exec_set(stdin=None), "stdin", True),
        (exec_set(stdin=False), "stdin", False),
        (exec_set(enabled=None), "enabled", True),
        (exec_set(enabled=False), "enabled", False),
        (exec_set(command=[" acme ", "run"]), "command", ("acme", "run")),
        (exec_set(command=None, tools=[tool(command=["x"])]), "command", ()),
    ],
)
def test_parse_manifest_accepts_set_fields(tmp_path: Path, manifest: Any, field: str, expected: Any) -> None:
    """Set-level fields accept the reference host's lenient forms and apply their defaults."""
    assert getattr(parse(manifest, tmp_path), field) == expected


@pytest.mark.parametrize(
    ("fields", "attribute", "expected"),
    [
        ({"catalogs": ["work"]}, "catalogs", frozenset({CatalogName.WORK})),
        ({"approval": "inherit"}, "approval", Approval.INHERIT),
        ({"approval": ""}, "approval", Approval.INHERIT),
        ({"approval": None}, "approval", Approval.ALWAYS),
        ({"argv": {"env": " --env ", "path": "p"}}, "argv", (("env", "--env"), ("path", "p"))),
        ({"argv": None}, "argv", ()),
        ({"command": [" deploy "]}, "command", ("deploy",)),
        ({"pathArguments": [" path "]}, "path_arguments", ("path",)),
        ({"output": " CONTENT "}, "output", OutputMode.CONTENT),
        ({"description": "  Ship it.  "}, "description", "Ship it."),
        ({"name": " Bash "}, "name", "Bash"),
    ],
)
def test_parse_manifest_tool_fields(tmp_path: Path, fields: dict[str, Any], attribute: str, expected: Any) -> None:
    """Tool-level fields override the set defaults (catalogs and approval replace, not merge)."""
    manifest = exec_set(catalogs=["plan"], approval="always", tools=[tool(**fields)])
    assert getattr(parse(manifest, tmp_path).tools[0], attribute) == expected


def test_parse_manifest_argv_duplicate_key_keeps_first_place_and_last_flag(tmp_path: Path) -> None:
    """Every value of a key named twice in argv must be a flag; the map then holds the key
    where it first stood, with the last flag (the reference host's dictionary assignment)."""
    text = (b'{"runner": "exec", "command": ["x"], "description": "d", "schema": {},'
            b' "argv": {"env": "--e", "path": "--p", "env": " --env "}}')
    assert parse(text, tmp_path).tools[0].argv == (("env", "--env"), ("path", "--p"))


@pytest.mark.parametrize("opening", [b'"argv": {"n": "--n"}, ', b'"catalogs": ["\\u0070lan"], '])
def test_parse_manifest_schema_naming_a_key_twice_is_plain_json(
    tmp_path: Path, opening: bytes
) -> None:
    """A schema object naming a key twice, in a manifest whose argv maps keep duplicate
    members ('"argv"' or a \\u escape in it), is held as plain dicts: jsontext writes an
    integer beyond 64 bits only in those, and the parser's object with its members made
    every ``list``, MCP tools/list and check-process request of the workspace fail."""
    big = b"123456789012345678901234567890"
    text = (b'{"runner": "exec", "command": ["x"], ' + opening + b'"schema": {"type": "object",'
            b' "properties": {"n": {"type": "integer", "maximum": 5, "maximum": ' + big + b'}}},'
            b' "description": "d"}')
    (only,) = parse(text, tmp_path).tools
    assert type(only.schema["properties"]["n"]) is dict
    assert json.loads(dumps(only.schema))["properties"]["n"] == {
        "type": "integer", "maximum": int(big)
    }


def test_parse_manifest_tool_defaults_come_from_set(tmp_path: Path) -> None:
    """A tool without catalogs or approval takes the set's values."""
    (only,) = parse(exec_set(catalogs=["plan"], approval="always"), tmp_path).tools
    assert (only.catalogs, only.approval) == (frozenset({CatalogName.PLAN}), Approval.ALWAYS)


def test_parse_manifest_names_are_case_sensitive(tmp_path: Path) -> None:
    """Tool names differing only by case are distinct, and reserved names compare case-sensitively."""
    toolset = parse(exec_set(tools=[tool("t"), tool("T"), tool("Read")]), tmp_path)
    assert [t.name for t in toolset.tools] == ["t", "T", "Read"]


def test_parse_manifest_reserved_argument_is_used(tmp_path: Path) -> None:
    """Reserved names come from the ``reserved`` argument, so a --reserve name refuses the set."""
    manifest = exec_set(tools=[tool("deploy")])
    assert parse(manifest, tmp_path, reserved=frozenset()).tools[0].name == "deploy"
    assert message(manifest, tmp_path, reserved=frozenset({"deploy"})) == "Tool name 'deploy' is reserved or invalid."


def test_parse_manifest_some_tools_without_command(tmp_path: Path) -> None:
    """When only some tools have a command the set still parses."""
    toolset = parse(exec_set(command=None, tools=[tool("a", command=["x"]), tool("b")]), tmp_path)
    assert [t.command for t in toolset.tools] == [("x",), ()]


def test_parse_manifest_ignored_fields(tmp_path: Path) -> None:
    """Unknown root keys, a non-container tools value and exec's assembly/types are ignored."""
    toolset = parse(shorthand(tools="nope", name=1, assembly=5, types=5, schema=SCHEMA, extra=[1]), tmp_path)
    assert [t.name for t in toolset.tools] == ["acme"]


def test_parse_manifest_non_object_schema_is_not_shorthand(tmp_path: Path) -> None:
    """A non-object root schema and a null output do not count as shorthand beside a tools array."""
    toolset = parse(exec_set(schema="x", output=None, description=None, argv=None), tmp_path)
    assert [t.name for t in toolset.tools] == ["t"]


def test_parse_manifest_dotnet_overlays(tmp_path: Path) -> None:
    """A valid dotnet manifest parses to a dotnet set whose tools are its overlays, as the
    reference host's parser keeps them (its inventory names them): the key as name and
    description, an empty schema, the overlay's catalogs, approval (else the set's) and
    pathArguments; argv is thrown away, and root shorthand is ignored. A key given twice
    is two overlays, as the reference host enumerates them."""
    toolset = parse(
        dotnet(types=["Acme.Tool"], description=5, approval="always", tools={
            "acme_x": {"catalogs": ["plan"], "argv": {"a": "-a"}, "pathArguments": [" p "]},
            "acme_y": {"approval": "inherit"},
        }),
        tmp_path,
    )
    assert toolset.runner is RunnerKind.DOTNET
    assert toolset.tools == (
        ToolDef("acme_x", "acme_x", {}, frozenset({CatalogName.PLAN}), Approval.ALWAYS,
                path_arguments=("p",)),
        ToolDef("acme_y", "acme_y", {}, frozenset(CatalogName), Approval.INHERIT),
    )
    twice = parse(
        b'{"runner": "dotnet", "assembly": "a.dll", "tools": {"o": {}, "o": {"approval": "always"}}}',
        tmp_path,
    )
    assert [(t.name, t.approval) for t in twice.tools] == [
        ("o", Approval.INHERIT), ("o", Approval.ALWAYS)]
    assert parse(dotnet(), tmp_path).tools == ()


@pytest.mark.parametrize(
    "prefix",
    [b"\xef\xbb\xbf", b""],
    ids=["utf8-bom", "no-bom"],
)
def test_parse_manifest_accepts_bom(tmp_path: Path, prefix: bytes) -> None:
    """A UTF-8 byte order mark at the start is accepted."""
    assert parse(prefix + json.dumps(shorthand()).encode(), tmp_path).tools[0].name == "acme"


def test_parse_manifest_accepts_utf16_with_bom(tmp_path: Path) -> None:
    """A UTF-16 manifest with a byte order mark decodes as File.ReadAllText would."""
    assert parse(json.dumps(shorthand()).encode("utf-16"), tmp_path).tools[0].name == "acme"


def test_parse_manifest_depth_64_is_allowed(tmp_path: Path) -> None:
    """Nesting of exactly 64 containers is within System.Text.Json's default limit."""
    deep: Any = {}
    for _ in range(61):  # root, schema, then 62 nested objects: 64 in all
        deep = {"a": deep}
    toolset = parse(shorthand(schema={"type": "object", "x": deep}), tmp_path)
    assert toolset.tools[0].name == "acme"


def test_parse_manifest_schema_checks_are_cached(tmp_path: Path) -> None:
    """The injected SchemaChecker checks each distinct schema content once."""
    checker = SchemaChecker()
    same = {"properties": {"a": {"type": "string"}}, "type": "object"}
    reordered = {"type": "object", "properties": {"a": {"type": "string"}}}
    parse(exec_set(tools=[tool("a", schema=same), tool("b", schema=reordered)]), tmp_path, schemas=checker)
    parse(shorthand(schema=same), tmp_path, schemas=checker)
    assert checker.checks == 1


def test_a_schema_whose_2020_12_listing_is_invalid_is_noted_unlisted(tmp_path: Path) -> None:
    """Draft 3 checks nothing in ``definitions`` (not one of its keywords), so a valid
    draft 3 schema can hold ``{"type": 5}`` there; converted to 2020-12 for MCP hosts it
    became ``{"anyOf": []}``, which 2020-12 refuses, and Claude's API would refuse every
    request of a session that listed it. The parse checks such a listing: the tool is
    noted as left out of ``tools/list`` (``is_unlisted``), and a valid one is not."""
    d3 = "http://json-schema.org/draft-03/schema#"
    bad = {"$schema": d3, "type": "object", "definitions": {"x": {"type": 5}},
           "properties": {"a": {"$ref": "#/definitions/x"}}}
    (tool,) = parse(shorthand(schema=bad), tmp_path).tools
    (note,) = tool.listing_notes
    assert note.startswith(
        "External tool 'acme' is not listed to MCP hosts: its schema, converted to JSON "
        "Schema 2020-12 (MCP's dialect, which Claude's API checks every tool of a request "
        "against), is not valid: [] should be non-empty"
    )
    assert is_unlisted(tool.listing_notes)
    good = {**bad, "definitions": {"x": {"type": "string"}}}
    (tool,) = parse(shorthand(schema=good), tmp_path).tools
    assert tool.listing_notes == ()
