"""Plain checks of every method's params: what the pydantic params models accept, without pydantic.

Theory of operation
-------------------
The daemon checks every request's params here, so neither its start nor its request path
loads pydantic (importing it and the models was about a third of the daemon's imports).
``models`` keeps the params models as the contract's description for clients and docs.
``tests/protocol/test_params.py`` runs both over generated params and proves them alike:
the same objects pass, with the same values, and the same objects fail, with the same
``InvalidParams`` message and data.

The rules are the models' own:

* Strict types. A string is a ``str``, a boolean is a ``bool`` (never ``1``), ``null``
  is accepted only where the field may be absent and has no other default.
* Names. Each field is read under its camelCase wire name, else under its snake_case
  Python name. When both are given, the wire name wins and the other is an unknown
  parameter.
* Errors. Every field is checked in the model's order, and then every unknown key in
  the order given. Each error names the key it read, and no error repeats an input value.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

from .errors import InvalidParams
from .jsontext import nesting_exceeds
from .modes import MODE_EXPECTED, Mode, parse_mode

__all__ = [
    "MAX_ARGUMENT_DEPTH",
    "MAX_ENV_STRING",
    "NAMED_UNKNOWN",
    "UNKNOWN_PARAMETER",
    "CancelArgs",
    "ClassifyArgs",
    "InvokeArgs",
    "ListArgs",
    "ReloadArgs",
    "cancel_args",
    "check_arguments",
    "check_env_string",
    "check_mode",
    "check_traceparent",
    "classify_args",
    "invalid_params",
    "invoke_args",
    "list_args",
    "no_args",
    "reload_args",
]

#: The deepest ``arguments`` accepted (objects and arrays, the arguments object itself
#: counting as 1), as System.Text.Json's default in the reference host. Deeper arguments get
#: -32602: every response that echoes them (classify, -32003/-32004 data) stays encodable.
MAX_ARGUMENT_DEPTH: Final = 64
#: The longest ``session`` accepted, in characters (it becomes ``CRYSTAL_SESSION``).
MAX_ENV_STRING: Final = 4096
_TRACEPARENT: Final = re.compile(r"00-(?!0{32})[0-9a-f]{32}-(?!0{16})[0-9a-f]{16}-[0-9a-f]{2}")
_REQUIRED: Final = object()
#: The message of a parameter no method takes.
UNKNOWN_PARAMETER: Final = "unknown parameter"
#: The most unknown parameters an ``InvalidParams`` names; the rest are counted.
NAMED_UNKNOWN: Final = 20


class _Bad(ValueError):
    """One field's value is wrong; the message says what was expected, never the value.

    A ``ValueError``, so ``models`` uses the same checks as pydantic validators.
    """


def _string(value: Any) -> Any:
    if type(value) is not str:
        raise _Bad("must be a string")
    return value


def _optional_string(value: Any) -> Any:
    return None if value is None else _string(value)


def check_env_string(value: Any) -> Any:
    """None, or a string the child gets in its environment.

    An environment cannot hold a NUL, and Linux refuses to start a program with one
    variable over 128 KiB (``E2BIG``); a session id needs far less than ``MAX_ENV_STRING``.
    """
    if value is None:
        return value
    if "\x00" in _string(value):
        raise _Bad("must not contain a NUL character (the tool gets it in its environment)")
    if len(value) > MAX_ENV_STRING:
        raise _Bad(
            f"must be at most {MAX_ENV_STRING} characters (the tool gets it in its environment)"
        )
    return value


def _boolean(value: Any) -> Any:
    if type(value) is not bool:
        raise _Bad("must be a boolean")
    return value


def _catalog(value: Any) -> Any:
    if value is None or (type(value) is str and value in ("plan", "work")):
        return value
    raise _Bad("must be 'plan' or 'work'")


def check_mode(value: Any) -> Mode:
    """A mode name or alias as a ``Mode`` (``ValueError`` listing the names otherwise)."""
    if isinstance(value, str):
        try:
            return parse_mode(value)
        except ValueError:
            pass
    raise _Bad(MODE_EXPECTED)


def check_arguments(value: Any) -> Any:
    """``arguments``, unless nested deeper than ``MAX_ARGUMENT_DEPTH``."""
    if nesting_exceeds(value, MAX_ARGUMENT_DEPTH):
        raise _Bad(
            f"must nest at most {MAX_ARGUMENT_DEPTH} levels of objects and arrays "
            "(the arguments object is level 1)"
        )
    return value


def check_traceparent(value: Any) -> Any:
    """A W3C ``traceparent`` (version 00) or None."""
    if value is None:
        return None
    if type(value) is not str:
        raise _Bad("must be a string")
    if not _TRACEPARENT.fullmatch(value):  # match with $ would take a trailing newline
        raise _Bad("must be a W3C traceparent: 00-<32 hex digits>-<16 hex digits>-<2 hex digits>")
    return value


@dataclass(frozen=True, slots=True)
class _Field:
    name: str  # the Python name
    wire: str  # the camelCase name
    check: Callable[[Any], Any]
    default: Any = _REQUIRED


def _fields(*spec: tuple[Any, ...]) -> tuple[_Field, ...]:
    """Fields from ``(python_name, check[, default])``; the wire name is its camelCase."""
    fields = []
    for name, check, *default in spec:
        head, *rest = name.split("_")
        wire = head + "".join(part.title() for part in rest)
        fields.append(_Field(name, wire, check, *default))
    return tuple(fields)


def _read(fields: tuple[_Field, ...], params: Mapping[str, Any]) -> dict[str, Any]:
    """The values of ``fields`` in ``params``, or ``InvalidParams`` naming every problem
    (the first ``NAMED_UNKNOWN`` unknown parameters by name, the others by count)."""
    values: dict[str, Any] = {}
    problems: list[tuple[str, str]] = []
    used = 0
    for field in fields:
        key = field.wire if field.wire in params else field.name
        if key not in params:
            if field.default is _REQUIRED:
                problems.append((field.wire, "is required"))
            else:
                values[field.name] = field.default
            continue
        used += 1
        try:
            values[field.name] = field.check(params[key])
        except _Bad as bad:
            problems.append((key, str(bad)))
    more = 0
    if used != len(params):
        known = {f.wire for f in fields}
        taken = {f.name for f in fields if f.wire not in params}
        # Each field took one key (its wire name, else its Python name): the rest are
        # unknown. The first few are named, and the others only counted.
        named = 0
        for key in params:
            if key not in known and key not in taken:
                if named == NAMED_UNKNOWN:
                    break
                problems.append((key, UNKNOWN_PARAMETER))
                named += 1
        more = len(params) - used - named
    if problems:
        raise invalid_params(problems, more)
    return values


def invalid_params(problems: Sequence[tuple[str, str]], more: int = 0) -> InvalidParams:
    """``InvalidParams`` naming each ``(field, message)`` problem, in order.

    At most ``NAMED_UNKNOWN`` unknown parameters are named; the others (and ``more``, the
    ones the caller did not list) are counted at the end. Every name costs its answer a
    few dozen bytes: a 16 MiB line of a million stray keys made an answer of 120 MB,
    built on the event loop (a second of every other client's time) and then refused
    as over the daemon's line.
    """
    parts: list[str] = []
    data: list[dict[str, str]] = []
    named = 0
    for key, message in problems:
        if message == UNKNOWN_PARAMETER:
            if named == NAMED_UNKNOWN:
                more += 1
                continue
            named += 1
            parts.append(f"unknown parameter '{key}'")
        else:
            parts.append(f"'{key}' {message}")
        data.append({"field": key, "message": message})
    if more:
        parts.append(f"and {more} more unknown parameter{'s' if more > 1 else ''}")
    return InvalidParams("Invalid params: " + "; ".join(parts), data)


@dataclass(frozen=True, slots=True)
class ListArgs:
    """The params of ``list``."""

    workspace: str | None
    catalog: str | None
    subscribe: bool


@dataclass(frozen=True, slots=True)
class ClassifyArgs:
    """The params of ``classify``."""

    tool: str
    arguments: Any
    workspace: str
    mode: Mode
    headless: bool


@dataclass(frozen=True, slots=True)
class InvokeArgs:
    """The params of ``invoke``."""

    tool: str
    arguments: Any
    workspace: str
    call_id: str | None
    catalog: str | None
    mode: Mode
    headless: bool
    approved: bool
    session: str | None
    images: bool
    traceparent: str | None


@dataclass(frozen=True, slots=True)
class CancelArgs:
    """The params of ``cancel``."""

    call_id: str


@dataclass(frozen=True, slots=True)
class ReloadArgs:
    """The params of ``reload``."""

    workspace: str | None


_LIST: Final = _fields(
    ("workspace", _optional_string, None),
    ("catalog", _catalog, None),
    ("subscribe", _boolean, False),
)
_CLASSIFY: Final = _fields(
    ("tool", _string),
    ("arguments", check_arguments),
    ("workspace", _string),
    ("mode", check_mode, Mode.DEFAULT),
    ("headless", _boolean, False),
)
_INVOKE: Final = _fields(
    ("tool", _string),
    ("arguments", check_arguments),
    ("workspace", _string),
    ("call_id", _optional_string, None),
    ("catalog", _catalog, None),
    ("mode", check_mode, Mode.DEFAULT),
    ("headless", _boolean, False),
    ("approved", _boolean, False),
    ("session", check_env_string, None),
    ("images", _boolean, True),
    ("traceparent", check_traceparent, None),
)
_CANCEL: Final = _fields(("call_id", _string))
_RELOAD: Final = _fields(("workspace", _optional_string, None))


def list_args(params: Mapping[str, Any]) -> ListArgs:
    """Check ``list`` params."""
    return ListArgs(**_read(_LIST, params))


def classify_args(params: Mapping[str, Any]) -> ClassifyArgs:
    """Check ``classify`` params."""
    return ClassifyArgs(**_read(_CLASSIFY, params))


def invoke_args(params: Mapping[str, Any]) -> InvokeArgs:
    """Check ``invoke`` params."""
    return InvokeArgs(**_read(_INVOKE, params))


def cancel_args(params: Mapping[str, Any]) -> CancelArgs:
    """Check ``cancel`` params."""
    return CancelArgs(**_read(_CANCEL, params))


def reload_args(params: Mapping[str, Any]) -> ReloadArgs:
    """Check ``reload`` params."""
    return ReloadArgs(**_read(_RELOAD, params))


def no_args(params: Mapping[str, Any]) -> None:
    """Check the params of a method that takes none (``status``, ``metrics``)."""
    _read((), params)
