"""The plain params checks (``params``) decide exactly as the pydantic params models do.

The daemon validates params with ``params`` (no pydantic at its start or on its request
path); ``models`` describes the same params for clients and docs. Generated params, built
from each method's field names under both spellings, stray keys, and values of every JSON
type plus the special ones (modes and aliases, catalogs, traceparents, deep arguments), must
give the same values or the same ``InvalidParams`` message and data on both sides.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import BaseModel, ValidationError
from toolsetd.protocol import models, params
from toolsetd.protocol.errors import InvalidParams

from tests.budget import examples

CASES: dict[str, tuple[type[BaseModel], Callable[[dict[str, Any]], Any]]] = {
    "status": (models.StatusParams, params.no_args),
    "list": (models.ListParams, params.list_args),
    "classify": (models.ClassifyParams, params.classify_args),
    "invoke": (models.InvokeParams, params.invoke_args),
    "cancel": (models.CancelParams, params.cancel_args),
    "reload": (models.ReloadParams, params.reload_args),
    "metrics": (models.MetricsParams, params.no_args),
}

GOOD_TRACE = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


def _deep(levels: int) -> Any:
    value: Any = 1
    for _ in range(levels):
        value = [value]
    return value


SPECIAL = st.sampled_from([
    "plan", "work", "review", "default", "full", "yolo", " YOLO ", "FullAuto", "auto", "",
    GOOD_TRACE, GOOD_TRACE.upper(), "00-" + "0" * 32 + "-b7ad6b7169203331-01",
    "/abs/ws", "relative", "x" * 3, "a\x00b", "\x00", "s" * 4097, _deep(63), _deep(64), _deep(65), {"a": _deep(64)},
])
SCALARS = st.one_of(
    st.none(), st.booleans(), st.integers(-2, 2), st.floats(allow_nan=False), st.text(max_size=5)
)
JSON = st.recursive(
    SCALARS,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=3), inner, max_size=3),
    max_leaves=6,
)
VALUES = st.one_of(SPECIAL, JSON)


def _keys(model: type[BaseModel]) -> list[str]:
    keys = ["bogus", "Tool", "call_Id"]
    for name, field in model.model_fields.items():
        keys += [name, field.alias or name]
    return sorted(set(keys))


def _outcome(check: Callable[[], Any]) -> tuple[str, Any]:
    try:
        return "ok", check()
    except InvalidParams as exc:
        return "error", (exc.message, exc.data)


def _model_outcome(model: type[BaseModel], given_params: dict[str, Any]) -> tuple[str, Any]:
    def run() -> Any:
        try:
            return dict(model.model_validate(given_params))
        except ValidationError as exc:
            raise models.params_error(exc) from None

    return _outcome(run)


def _plain_outcome(check: Callable[[dict[str, Any]], Any], given_params: dict[str, Any]) -> tuple[str, Any]:
    def run() -> Any:
        result = check(given_params)
        return {} if result is None else asdict(result)

    return _outcome(run)


@pytest.mark.parametrize("method", sorted(CASES))
@settings(max_examples=examples(400), deadline=None)
@given(data=st.data())
def test_params_checks_decide_as_the_models(method: str, data: st.DataObject) -> None:
    """Same values, or the same message and data, for any params object."""
    model, check = CASES[method]
    given_params = data.draw(st.dictionaries(st.sampled_from(_keys(model)), VALUES, max_size=8))
    assert _plain_outcome(check, given_params) == _model_outcome(model, given_params)


@pytest.mark.parametrize("method", sorted(CASES))
def test_params_checks_accept_the_minimal_valid_params(method: str) -> None:
    """The smallest valid params of each method pass both, so the property test sees passes too."""
    model, check = CASES[method]
    minimal = {
        name: {"tool": "t", "arguments": {}, "workspace": "/w", "call_id": "c"}[name]
        for name, field in model.model_fields.items()
        if field.is_required()
    }
    assert _plain_outcome(check, minimal)[0] == "ok"
    assert _plain_outcome(check, minimal) == _model_outcome(model, minimal)


def test_params_both_spellings_wire_name_wins() -> None:
    """``callId`` and ``call_id`` together: the wire name is read, the other is unknown."""
    given_params = {"tool": "t", "arguments": {}, "workspace": "/w", "callId": "a", "call_id": 5}
    with pytest.raises(InvalidParams) as caught:
        params.invoke_args(given_params)
    assert caught.value.message == "Invalid params: unknown parameter 'call_id'"
    del given_params["callId"]
    given_params["call_id"] = "b"
    assert params.invoke_args(given_params).call_id == "b"


@pytest.mark.parametrize("method", sorted(CASES))
def test_params_name_twenty_unknown_parameters_and_count_the_rest(method: str) -> None:
    """A million stray keys (a 16 MiB line) made an answer naming each of them twice:
    120 MB, built on the daemon's event loop and then refused as over its 64 MiB line.
    The first 20 are named, in order; the rest are counted; both checks agree."""
    model, check = CASES[method]
    given_params: dict[str, Any] = {f"x{i}": 1 for i in range(1000)}
    given_params["workspace"] = 5  # a known field's problem is still named, first
    plain = _plain_outcome(check, given_params)
    assert plain == _model_outcome(model, given_params)
    kind, (message, data) = plain
    assert kind == "error"
    named = [f"x{i}" for i in range(20)]
    assert [entry["field"] for entry in data if entry["message"] == "unknown parameter"] == named
    more = 980 if "workspace" in model.model_fields else 981  # else one more stray key
    assert message.endswith(f"; unknown parameter 'x19'; and {more} more unknown parameters")
    assert "'x20'" not in message
    one_more = {f"x{i}": 1 for i in range(21)}
    assert _plain_outcome(check, one_more)[1][0].endswith("; and 1 more unknown parameter")


def test_params_session_refuses_nul() -> None:
    """``session`` reaches the child's environment: a NUL is refused, naming the field.

    (``callId`` has its own character set, checked after the params.)
    """
    key = "session"
    given_params = {"tool": "t", "arguments": {}, "workspace": "/w", key: "a\x00b"}
    with pytest.raises(InvalidParams) as caught:
        params.invoke_args(given_params)
    assert caught.value.data == [
        {"field": key, "message": "must not contain a NUL character (the tool gets it in its environment)"}
    ]
    assert params.invoke_args({**given_params, key: "a b"}) is not None
    assert params.invoke_args({**given_params, key: "s" * params.MAX_ENV_STRING}) is not None
    with pytest.raises(InvalidParams) as caught:
        params.invoke_args({**given_params, key: "s" * (params.MAX_ENV_STRING + 1)})
    assert caught.value.data == [
        {"field": key, "message": "must be at most 4096 characters (the tool gets it in its environment)"}
    ]


@pytest.mark.parametrize("suffix", ["\n", "\r\n", " ", "-00"])
def test_params_traceparent_is_the_whole_string(suffix: str) -> None:
    """A traceparent with anything after its 55 characters is refused, a trailing newline
    too (``re.match`` with ``$`` took one, and it went to the child's TRACEPARENT); the
    models refuse it the same."""
    good = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
    given_params = {"tool": "t", "arguments": {}, "workspace": "/w", "traceparent": good}
    assert params.invoke_args(given_params) is not None
    with pytest.raises(InvalidParams) as caught:
        params.invoke_args({**given_params, "traceparent": good + suffix})
    assert caught.value.data[0]["field"] == "traceparent"
    with pytest.raises(ValidationError):
        models.InvokeParams.model_validate({**given_params, "traceparent": good + suffix})
