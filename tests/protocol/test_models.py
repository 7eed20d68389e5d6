"""Tests for toolsetd.protocol.models: aliases, strictness, modes and params errors."""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Any

import pytest
from pydantic import BaseModel, ValidationError
from toolsetd import protocol
from toolsetd.protocol import errors, models
from toolsetd.protocol.models import (
    NOTIFICATION_PARAMS,
    PARAMS_MODELS,
    RESULT_MODELS,
    Classification,
    ClassifyParams,
    InvokeParams,
    InvokeResult,
    ListParams,
    ListResult,
    Mode,
    ProgressParams,
    StatusResult,
    params_error,
    parse_mode,
)

TOOL = {
    "name": "fmt", "description": "Format", "inputSchema": {"type": "object"}, "set": "dev",
    "source": "project", "runner": "exec", "catalogs": ["work"],
    "approval": {"declared": "inherit", "policy": "host", "effective": "inherit"},
    "timeoutSeconds": None, "output": "text", "pathArguments": ["path"], "hash": "sha256:00",
}
SET = {"directory": "dev", "source": "project", "path": "/w/.crystal/tools/dev", "enabled": None,
       "state": "loaded", "tools": ["fmt"], "notes": [],
       "runner": "exec", "catalogs": ["work"], "approval": "inherit",
       "declaredTools": [{"name": "fmt", "approval": "always", "catalogs": ["work"]}], "error": None}
CLASSIFICATION = {
    "tool": "fmt", "set": "dev", "source": "project", "authority": "write",
    "scope": "workspace",
    "paths": [{"argument": "path", "value": "a.py", "resolved": "/w/a.py", "scope": "workspace"}],
    "approval": {"declared": "inherit", "policy": "host", "effective": "inherit"},
    "requirePrompt": False, "grantScopes": ["once", "session", "persistent"], "decision": "ask",
    "reason": "write in the workspace asks in default mode", "arguments": {"path": "/w/a.py"},
}
INVOKE_RESULT = {
    "callId": "c1", "status": "ok", "exitCode": 0,
    "content": [{"type": "text", "text": "exit 0\n"},
                {"type": "image", "data": "iVBO", "mimeType": "image/png"}],
    "isError": False, "truncated": False, "outputPath": None, "durationMs": 12,
    "stdoutBytes": 7, "stderrBytes": 0,
}
STATUS = {"version": "0.1.0", "pid": 42, "uptimeSeconds": 1.5, "socket": "/run/t.sock",
          "home": "/h", "generation": 3, "workspaces": ["/w"], "inFlight": 0, "connections": 1}


@pytest.mark.parametrize(
    ("model", "wire"),
    [
        (ListResult, {"generation": 1, "tools": [TOOL], "sets": [SET],
                      "notes": [{"set": "dev", "source": None, "message": "m"}]}),
        (Classification, {**CLASSIFICATION, "confinement": None}),
        (Classification, {**CLASSIFICATION, "confinement": {
            "sandbox": {"profile": "workspace-write", "network": False}, "cgroup": True,
            "limits": {}, "failure": None}}),
        (InvokeResult, INVOKE_RESULT),
        (StatusResult, {**STATUS, "confinement": None, "watch": None}),
        (StatusResult, {**STATUS, "confinement": {
            "cgroup": {"mode": "process-group", "reason": "r"},
            "sandbox": {"mechanism": "none", "reason": "r"}},
            "watch": {"state": "watching", "reason": None, "watched": 4, "pastCap": 0,
                      "maxWatches": 8192, "pollSeconds": 2.0}}),
        (ProgressParams, {"callId": "c", "elapsedMs": 1000, "stdoutBytes": 1, "stderrBytes": 2,
                          "message": "half", "fraction": 0.5, "queued": False}),
    ],
)
def test_models_wire_round_trip_uses_camel_case(model: type[BaseModel], wire: dict[str, Any]) -> None:
    """Results validate from camelCase wire dicts and dump back to the same dict by alias."""
    assert model.model_validate(wire).model_dump(mode="json", by_alias=True) == wire


def test_models_python_names_are_snake_case() -> None:
    """Models are built with snake_case names and expose them as attributes."""
    params = InvokeParams(tool="t", arguments={}, workspace="/w", call_id="c", approved=True)
    assert (params.call_id, params.approved, params.images) == ("c", True, True)
    assert params.model_dump(by_alias=True)["callId"] == "c"


def test_models_content_is_discriminated_by_type() -> None:
    """Content blocks become TextContent or ImageContent by their type member."""
    result = InvokeResult.model_validate(INVOKE_RESULT)
    assert [type(block).__name__ for block in result.content] == ["TextContent", "ImageContent"]
    with pytest.raises(ValidationError):
        InvokeResult.model_validate({**INVOKE_RESULT, "content": [{"type": "audio"}]})


def test_models_results_ignore_unknown_fields() -> None:
    """An older client accepts a newer daemon's result with extra members."""
    result = InvokeResult.model_validate({**INVOKE_RESULT, "futureField": 1})
    assert "futureField" not in result.model_dump(by_alias=True)


def test_models_progress_omits_absent_optionals() -> None:
    """progress leaves message, fraction and queued out of the wire form when None."""
    dumped = ProgressParams(call_id="c", elapsed_ms=1, stdout_bytes=0, stderr_bytes=0,
                            queued=True).model_dump(mode="json", by_alias=True)
    assert dumped == {"callId": "c", "elapsedMs": 1, "stdoutBytes": 0, "stderrBytes": 0,
                      "queued": True}


@pytest.mark.parametrize("model", [*PARAMS_MODELS.values(), *RESULT_MODELS.values(),
                                   *NOTIFICATION_PARAMS.values()])
def test_models_are_frozen(model: type[BaseModel]) -> None:
    """Every params, result and notification model is frozen."""
    assert model.model_config.get("frozen") is True


def test_models_registries_cover_every_method_and_notification() -> None:
    """The params/result/notification tables cover exactly the contract's names (and metrics)."""
    assert set(PARAMS_MODELS) == set(RESULT_MODELS) == set(models.METHODS) == {
        "status", "list", "classify", "invoke", "cancel", "reload", "metrics"}
    assert set(NOTIFICATION_PARAMS) == set(models.NOTIFICATIONS) == {
        "started", "progress", "completed", "catalogChanged"}


@pytest.mark.parametrize(
    ("model", "params", "expected"),
    [
        (ListParams, {"workspace": "/w", "foo": 1}, "unknown parameter 'foo'"),
        (ListParams, {"catalog": "all"}, "'catalog' must be 'plan' or 'work'"),
        (ListParams, {"subscribe": "yes"}, "'subscribe' must be a boolean"),
        (ListParams, {"workspace": 5}, "'workspace' must be a string"),
        (ClassifyParams, {"tool": "t", "workspace": "/w"}, "'arguments' is required"),
        (InvokeParams, {"tool": "t", "arguments": {}, "workspace": "/w", "approved": 1},
         "'approved' must be a boolean"),
        (InvokeParams, {"tool": "t", "arguments": {}, "workspace": "/w", "call_id": 1,
                        "callId": "x"}, "unknown parameter 'call_id'"),
        (models.CancelParams, {"callId": None}, "'callId' must be a string"),
        (models.StatusParams, {"x": 1}, "unknown parameter 'x'"),
    ],
)
def test_models_params_errors_name_the_field(
    model: type[BaseModel], params: dict[str, Any], expected: str
) -> None:
    """Bad params produce an InvalidParams message naming the field and what was expected."""
    with pytest.raises(ValidationError) as info:
        model.model_validate(params)
    err = params_error(info.value)
    assert isinstance(err, errors.InvalidParams)
    assert err.code == -32602
    assert err.message.startswith("Invalid params: ")
    assert expected in err.message


def test_models_params_error_lists_every_problem_in_data() -> None:
    """params_error gives one {field, message} entry per problem, in the documented shape."""
    with pytest.raises(ValidationError) as info:
        ListParams.model_validate({"workspace": 1, "foo": 2})
    err = params_error(info.value)
    assert err.message == "Invalid params: 'workspace' must be a string; unknown parameter 'foo'"
    assert err.data == [{"field": "workspace", "message": "must be a string"},
                        {"field": "foo", "message": "unknown parameter"}]


def test_models_params_error_for_non_object_params() -> None:
    """Params that are not an object name the params as a whole."""
    with pytest.raises(ValidationError) as info:
        ClassifyParams.model_validate(["t", {}, "/w"])
    assert params_error(info.value).message == "Invalid params: 'params' must be an object"


@pytest.mark.parametrize(
    "params",
    [
        {"tool": "hunter2-secret", "arguments": {}, "workspace": 7},
        {"tool": 7, "arguments": {}, "workspace": "/w", "session": ["hunter2-secret"]},
        {"tool": "t", "arguments": {}, "workspace": "/w", "mode": "hunter2-secret"},
        {"tool": "t", "arguments": {}, "workspace": "/w", "catalog": "hunter2-secret"},
        {"tool": "t", "arguments": {}, "workspace": "/w", "images": "hunter2-secret"},
        {"tool": "t", "arguments": {}, "workspace": "/w", "callId": {"k": "hunter2-secret"}},
    ],
)
def test_models_params_error_never_leaks_values(params: dict[str, Any]) -> None:
    """Neither the message nor the data of params_error contains an input value."""
    with pytest.raises(ValidationError) as info:
        InvokeParams.model_validate(params)
    err = params_error(info.value)
    assert "hunter2" not in repr(err.to_error())


@pytest.mark.parametrize(
    ("name", "mode"),
    [
        ("plan", Mode.PLAN), ("default", Mode.DEFAULT), ("edit", Mode.EDIT),
        ("review", Mode.REVIEW), ("audit", Mode.AUDIT), ("full", Mode.FULL),
        ("autoedit", Mode.EDIT), ("fullreview", Mode.AUDIT), ("full-review", Mode.AUDIT),
        ("fullauto", Mode.FULL), ("yolo", Mode.FULL), ("  YOLO\t", Mode.FULL),
        ("Full-Review", Mode.AUDIT), ("PLAN", Mode.PLAN),
    ],
)
def test_models_parse_mode_names_and_aliases(name: str, mode: Mode) -> None:
    """parse_mode accepts the six modes and the reference host's aliases, trimmed, any case."""
    assert parse_mode(name) is mode
    assert InvokeParams(tool="t", arguments={}, workspace="/w", mode=name).mode is mode


@pytest.mark.parametrize("name", ["auto", "", "  ", "full review", "yolo!", "fullautoedit", "x"])
def test_models_parse_mode_rejects_others_listing_valid_names(name: str) -> None:
    """Unknown modes, auto included, raise ValueError listing every mode and alias."""
    with pytest.raises(ValueError, match="invalid mode") as info:
        parse_mode(name)
    message = str(info.value)
    for valid in [*Mode, "autoedit", "fullreview", "full-review", "fullauto", "yolo"]:
        assert valid in message


def test_models_mode_defaults_and_wire_form() -> None:
    """mode defaults to default and goes on the wire as its plain name."""
    params = ClassifyParams.model_validate({"tool": "t", "arguments": {}, "workspace": "/w",
                                            "mode": "autoedit"})
    assert params.model_dump(mode="json", by_alias=True)["mode"] == "edit"
    assert ClassifyParams(tool="t", arguments=None, workspace="/w").mode is Mode.DEFAULT


# json: jsontext re-reads a line whose numbers orjson would change (pure, no I/O);
# itertools: its depth of a large text (accumulate; pure).
ALLOWED_IMPORTS = {"__future__", "collections", "dataclasses", "enum", "itertools", "json",
                   "re", "types", "typing", "pydantic", "orjson"}


@pytest.mark.parametrize("path", sorted(Path(protocol.__file__).parent.glob("*.py")),
                         ids=lambda p: p.name)
def test_models_protocol_imports_only_stdlib_pydantic_orjson(path: Path) -> None:
    """Every protocol module imports only pure stdlib modules, pydantic, orjson and itself."""
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            names = [node.module or ""]
        else:
            continue
        for name in names:
            assert name.split(".")[0] in ALLOWED_IMPORTS, f"{path.name} imports {name}"


@pytest.mark.parametrize("value", [None, 1, ["full"]])
def test_models_parse_mode_rejects_non_strings(value: object) -> None:
    """A non-string mode is a ValueError listing the valid names, not a TypeError."""
    with pytest.raises(ValueError, match="invalid mode"):
        parse_mode(value)  # type: ignore[arg-type]


@pytest.mark.parametrize("name", ["full\x1c", "\x1dyolo", "audit\x1e", "\x1fdefault\x1f"])
def test_models_parse_mode_trims_only_net_white_space(name: str) -> None:
    """Mode names are trimmed as the reference host trims them (.NET ``Trim()``), not as
    Python's ``strip()`` does: U+001C..U+001F are not white space there, so ``"full\\x1c"``
    is not a mode (Python's ``strip`` made it ``full``)."""
    with pytest.raises(ValueError, match="invalid mode"):
        parse_mode(name)


@pytest.mark.parametrize("name", ["\u3000full\u2028", "\x85audit\xa0", "\u205fyolo\t"])
def test_models_parse_mode_trims_net_white_space(name: str) -> None:
    """The .NET white space around a mode name (Unicode spaces and separators included) goes."""
    assert parse_mode(name) in (Mode.FULL, Mode.AUDIT)
