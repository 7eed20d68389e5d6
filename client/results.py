"""The shape ``toolsetctl`` needs of each result it reads, checked before it reads one.

Every member a command prints or decides on is checked here once, at the boundary, for
the JSON type the protocol gives it (``toolsetd.protocol.models``): a daemon of another
protocol or version that sends ``tools`` as a string, a ``paths`` entry that is no
object, or an ``invoke`` result whose ``exitCode`` is text, breaks the protocol (exit 5,
naming the member), as a result that is not an object does. Without the check such a
result ended in a traceback's exit 9. So does an ``invoke`` result whose ``status`` is
none of the four, or missing: it says nothing of the outcome, and was read as a success
(exit 0) unless ``isError`` said otherwise.

The check is as lenient as the printing: a member that is absent or null is left for the
command's own default (an older daemon that lacks it), unknown members are ignored, and a
member printed with ``str()`` whatever it is (a name, a count) is not checked. Plain data,
no pydantic: this runs at every start of toolsetctl.
"""

from __future__ import annotations

TYPE_CHECKING = False  # not typing's: importing typing is a share of the start-up
if TYPE_CHECKING:
    from typing import Any

__all__ = ["result_problem"]

# A shape is a JSON type name ("string", "integer", "boolean", "array"), a tuple of the
# strings allowed, ("array", item shape), or a dict: an object whose listed members have
# those shapes (absent or null members pass).
_STRINGS: Any = ("array", "string")
_OBJECTS: Any = ("array", {})

_TOOL = {
    "runner": "string",
    "catalogs": _STRINGS,
    "output": "string",
    "pathArguments": _STRINGS,
    "hash": "string",
}
_SET = {
    "directory": "string",
    "source": "string",
    "tools": "array",
    "notes": "array",
    "declaredTools": "array",
}
_CONFIG = {"applied": _STRINGS, "restartNeeded": _STRINGS}

#: The members without which a result cannot be read at all, by method.
_REQUIRED: dict[str, tuple[str, ...]] = {"invoke": ("status",)}

#: The members each command reads, by method.
_RESULTS: dict[str, Any] = {
    "status": {
        "confinement": {
            "cgroup": {"controllers": _STRINGS},
            "sandbox": {},
        },
    },
    "list": {"tools": ("array", _TOOL), "sets": ("array", _SET), "notes": _OBJECTS},
    "classify": {
        "authority": "string",
        "scope": "string",
        "decision": "string",
        "reason": "string",
        "paths": _OBJECTS,
        "grantScopes": _STRINGS,
        "confinement": {"sandbox": {"alsoWritable": "array"}},
    },
    "invoke": {
        "status": ("ok", "error", "timeout", "cancelled"),
        "exitCode": "integer",
        "isError": "boolean",
    },
    "reload": {"changed": _OBJECTS, "notes": _OBJECTS, "config": _CONFIG},
}

_NAMES = {
    "string": "a string",
    "integer": "an integer",
    "boolean": "true or false",
    "array": "an array",
}


def result_problem(method: str, result: dict[str, Any]) -> str | None:
    """What is wrong with the shape of ``method``'s ``result`` (an object), or None.

    Returns:
        ``"<member> is not <what it must be>"``, the member as a path such as
        ``tools[2].pathArguments``, for the first member of the wrong type.
    """
    for key in _REQUIRED.get(method, ()):
        if result.get(key) is None:
            return f"{key} is missing"
    shape = _RESULTS.get(method)
    return None if shape is None else _problem(result, shape, "")


def _problem(value: Any, shape: Any, where: str) -> str | None:
    if isinstance(shape, dict):
        if type(value) is not dict:
            return f"{where} is not an object"
        for key, member in shape.items():
            if value.get(key) is not None:
                problem = _problem(value[key], member, f"{where}.{key}" if where else key)
                if problem is not None:
                    return problem
        return None
    if isinstance(shape, tuple) and shape[0] == "array":
        if type(value) is not list:
            return f"{where} is not an array"
        for index, item in enumerate(value):
            problem = _problem(item, shape[1], f"{where}[{index}]")
            if problem is not None:
                return problem
        return None
    if isinstance(shape, tuple):
        if value not in shape or type(value) is not str:
            return f"{where} is none of {', '.join(shape)}"
        return None
    if not _is(value, shape):
        return f"{where} is not {_NAMES[shape]}"
    return None


def _is(value: Any, kind: str) -> bool:
    if kind == "string":
        return type(value) is str
    if kind == "integer":
        return type(value) is int
    if kind == "boolean":
        return type(value) is bool
    return type(value) is list  # "array"
