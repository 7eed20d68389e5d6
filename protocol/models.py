"""Pydantic models of every method's params and result and every notification.

Python names are snake_case; wire names are camelCase (``alias_generator=to_camel``).
Dump with ``model.model_dump(mode="json", by_alias=True)`` (the builders in
``jsonrpc`` do it for you). Both names are accepted on input.

* Params models are strict, frozen and forbid unknown fields, so an unknown or
  mistyped parameter is an error naming it (see ``params_error``).
* Result and notification models are frozen and ignore unknown fields, so an older
  client survives a newer daemon.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Annotated, Any, Final, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    ValidationError,
    field_validator,
    model_serializer,
)
from pydantic.alias_generators import to_camel

from .errors import InvalidParams
from .modes import Mode, parse_mode
from .names import (
    METHOD_CANCEL,
    METHOD_CLASSIFY,
    METHOD_INVOKE,
    METHOD_LIST,
    METHOD_METRICS,
    METHOD_RELOAD,
    METHOD_STATUS,
    METHODS,
    NOTIFICATION_CATALOG_CHANGED,
    NOTIFICATION_COMPLETED,
    NOTIFICATION_PROGRESS,
    NOTIFICATION_STARTED,
    NOTIFICATIONS,
)
from .params import (
    MAX_ARGUMENT_DEPTH,
    check_arguments,
    check_env_string,
    check_mode,
    check_traceparent,
    invalid_params,
)

# names and modes are re-exported (their names are in __all__): clients that import them from
# models, as before they had their own modules, keep working.
__all__ = [
    "MAX_ARGUMENT_DEPTH",
    "METHODS",
    "METHOD_CANCEL",
    "METHOD_CLASSIFY",
    "METHOD_INVOKE",
    "METHOD_LIST",
    "METHOD_METRICS",
    "METHOD_RELOAD",
    "METHOD_STATUS",
    "NOTIFICATIONS",
    "NOTIFICATION_CATALOG_CHANGED",
    "NOTIFICATION_COMPLETED",
    "NOTIFICATION_PARAMS",
    "NOTIFICATION_PROGRESS",
    "NOTIFICATION_STARTED",
    "PARAMS_MODELS",
    "RESULT_MODELS",
    "ApprovalInfo",
    "CallStatus",
    "CancelParams",
    "CancelResult",
    "CatalogChangedParams",
    "Classification",
    "ClassifyParams",
    "CompletedParams",
    "ContentBlock",
    "DeclaredTool",
    "ImageContent",
    "InvokeParams",
    "InvokeResult",
    "ListParams",
    "ListResult",
    "MetricsParams",
    "MetricsResult",
    "Mode",
    "NoteInfo",
    "PathInfo",
    "ProgressParams",
    "ReloadConfig",
    "ReloadParams",
    "ReloadResult",
    "SetChange",
    "SetInfo",
    "Source",
    "StartedParams",
    "StatusParams",
    "StatusResult",
    "TextContent",
    "ToolInfo",
    "params_error",
    "parse_mode",
]

ModeField = Annotated[Mode, BeforeValidator(check_mode)]

#: The ``arguments`` of classify and invoke: any JSON value, nested at most 64 deep.
ArgumentsField = Annotated[Any, AfterValidator(check_arguments)]

Source = Literal["home", "project"]
Catalog = Literal["plan", "work"]
Scope = Literal["workspace", "outsideWorkspace", "forbidden"]
CallStatus = Literal["ok", "error", "timeout", "cancelled"]


# ``defer_build``: a model's validator is built on its first use, not at import. Building
# all of them cost ~150 ms of every start of the daemon and of toolsetctl, most of which
# never use most of them.


class _Params(BaseModel):
    """Base of params models: strict, frozen, unknown fields are errors."""

    model_config = ConfigDict(
        alias_generator=to_camel,
        populate_by_name=True,
        frozen=True,
        extra="forbid",
        strict=True,
        defer_build=True,
    )


class _Wire(BaseModel):
    """Base of results, notifications and nested values: frozen, unknown fields ignored."""

    model_config = ConfigDict(
        alias_generator=to_camel,
        populate_by_name=True,
        frozen=True,
        extra="ignore",
        defer_build=True,
    )


# ---- nested values --------------------------------------------------------------------


class ApprovalInfo(_Wire):
    """A tool's approval: declared by the author, the source policy, and the result."""

    declared: Literal["inherit", "always"]
    policy: Literal["author", "host"]
    effective: Literal["inherit", "always"]


class ToolInfo(_Wire):
    """One ``tools[]`` entry of ``list``."""

    name: str
    description: str
    input_schema: dict[str, Any]
    set: str
    source: Source
    runner: str
    catalogs: list[str]
    approval: ApprovalInfo
    timeout_seconds: int | None
    output: str
    path_arguments: list[str]
    hash: str


class DeclaredTool(_Wire):
    """One tool a set's manifest declares, whether it loaded or not (``sets[].declaredTools``)."""

    name: str
    approval: Literal["inherit", "always"]
    catalogs: list[Catalog]


class SetInfo(_Wire):
    """One ``sets[]`` entry of ``list``."""

    directory: str
    source: Source
    path: str
    enabled: bool | None
    state: Literal["loaded", "disabled", "refused", "hidden"]
    tools: list[str]
    notes: list[str]
    runner: Literal["exec", "dotnet"] | None = None
    catalogs: list[Catalog] | None = None
    approval: Literal["inherit", "always"] | None = None
    declared_tools: list[DeclaredTool] = []
    error: str | None = None


class NoteInfo(_Wire):
    """One ``notes[]`` entry: an English message for the operator."""

    set: str | None
    source: Source | None
    message: str


class PathInfo(_Wire):
    """One path argument of a classification."""

    argument: str
    value: str
    resolved: str | None
    scope: Scope


class SetChange(_Wire):
    """One set added, removed or updated by a reload."""

    set: str
    source: Source
    change: Literal["added", "removed", "updated"]


class TextContent(_Wire):
    """A text block of a call result."""

    type: Literal["text"] = "text"
    text: str


class ImageContent(_Wire):
    """An image block of a call result (base64 data)."""

    type: Literal["image"] = "image"
    data: str
    mime_type: str


ContentBlock = Annotated[TextContent | ImageContent, Field(discriminator="type")]


# ---- methods --------------------------------------------------------------------------


class StatusParams(_Params):
    """``status`` takes no params."""


class StatusResult(_Wire):
    """The result of ``status``."""

    version: str
    pid: int
    uptime_seconds: float
    socket: str
    home: str
    generation: int
    workspaces: list[str]
    in_flight: int
    connections: int
    confinement: dict[str, Any] | None = None  # cgroup and sandbox modes (docs/security.md)
    watch: dict[str, Any] | None = None  # its state: watching, polling, starting, off


class ListParams(_Params):
    """The params of ``list``."""

    workspace: str | None = None
    catalog: Catalog | None = None
    subscribe: bool = False


class ListResult(_Wire):
    """The result of ``list``."""

    generation: int
    tools: list[ToolInfo]
    sets: list[SetInfo]
    notes: list[NoteInfo]


class ClassifyParams(_Params):
    """The params of ``classify``."""

    tool: str
    arguments: ArgumentsField
    workspace: str
    mode: ModeField = Mode.DEFAULT
    headless: bool = False


class Classification(_Wire):
    """The result of ``classify``, and the ``data`` of PolicyDenied/ApprovalRequired."""

    tool: str
    set: str
    source: Source
    authority: str
    scope: Scope
    paths: list[PathInfo]
    approval: ApprovalInfo
    require_prompt: bool
    grant_scopes: list[Literal["once", "session", "persistent"]]
    decision: Literal["allow", "ask", "review", "deny"]
    reason: str
    arguments: Any
    confinement: dict[str, Any] | None = None  # the sandbox and cgroup the call would get


class InvokeParams(_Params):
    """The params of ``invoke``."""

    tool: str
    arguments: ArgumentsField
    workspace: str
    call_id: str | None = None
    catalog: Catalog | None = None
    mode: ModeField = Mode.DEFAULT
    headless: bool = False
    approved: bool = False
    session: str | None = None
    images: bool = True
    #: The caller's W3C trace context, ``00-<32 hex trace id>-<16 hex parent id>-<2 hex>``.
    traceparent: str | None = None

    @field_validator("traceparent")
    @classmethod
    def _w3c_traceparent(cls, value: str | None) -> str | None:
        return check_traceparent(value)  # type: ignore[no-any-return]  # str or None, as given

    @field_validator("session")
    @classmethod
    def _no_nul(cls, value: str | None) -> str | None:
        return check_env_string(value)  # type: ignore[no-any-return]  # str or None, as given


class InvokeResult(_Wire):
    """The result of ``invoke``; a failing tool is ``is_error=True``, not an RPC error."""

    call_id: str
    status: CallStatus
    exit_code: int | None
    content: list[ContentBlock]
    is_error: bool
    truncated: bool
    output_path: str | None
    duration_ms: int
    stdout_bytes: int
    stderr_bytes: int


class CancelParams(_Params):
    """The params of ``cancel``."""

    call_id: str


class CancelResult(_Wire):
    """The result of ``cancel``."""

    cancelled: bool


class ReloadParams(_Params):
    """The params of ``reload``."""

    workspace: str | None = None


class ReloadConfig(_Wire):
    """What a ``reload`` did with the config file (``toolsetd.toml``)."""

    applied: list[str]
    restart_needed: list[str]
    error: str | None = None


class ReloadResult(_Wire):
    """The result of ``reload``."""

    generation: int
    changed: list[SetChange]
    notes: list[NoteInfo]
    config: ReloadConfig | None = None


class MetricsParams(_Params):
    """The params of ``metrics`` (none)."""


class MetricsResult(_Wire):
    """The result of ``metrics``: the Prometheus text exposition."""

    content_type: str
    text: str


# ---- notifications --------------------------------------------------------------------


class StartedParams(_Wire):
    """``started``: the child is running."""

    call_id: str
    tool: str
    set: str
    pid: int


class ProgressParams(_Wire):
    """``progress``: the call is queued or running; sent at least once a second."""

    call_id: str
    elapsed_ms: int
    stdout_bytes: int
    stderr_bytes: int
    message: str | None = None
    fraction: float | None = None
    #: True while the call waits for a free runner slot.
    queued: bool | None = None

    @model_serializer(mode="wrap")
    def _omit_absent(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        """Leave the optional members out of the wire form when they are None."""
        data: dict[str, Any] = handler(self)
        for key in _PROGRESS_OPTIONAL:
            if data.get(key, 0) is None:
                del data[key]
        return data


_PROGRESS_OPTIONAL: Final = ("message", "fraction", "queued")


class CompletedParams(_Wire):
    """``completed``: sent just before the ``invoke`` response."""

    call_id: str
    status: CallStatus
    exit_code: int | None
    duration_ms: int
    truncated: bool


class CatalogChangedParams(_Wire):
    """``catalogChanged``: a reload changed something (to subscribed connections)."""

    workspace: str | None
    generation: int
    changed: list[SetChange]


PARAMS_MODELS: Final[Mapping[str, type[BaseModel]]] = MappingProxyType(
    {
        METHOD_STATUS: StatusParams,
        METHOD_LIST: ListParams,
        METHOD_CLASSIFY: ClassifyParams,
        METHOD_INVOKE: InvokeParams,
        METHOD_CANCEL: CancelParams,
        METHOD_RELOAD: ReloadParams,
        METHOD_METRICS: MetricsParams,
    }
)
RESULT_MODELS: Final[Mapping[str, type[BaseModel]]] = MappingProxyType(
    {
        METHOD_STATUS: StatusResult,
        METHOD_LIST: ListResult,
        METHOD_CLASSIFY: Classification,
        METHOD_INVOKE: InvokeResult,
        METHOD_CANCEL: CancelResult,
        METHOD_RELOAD: ReloadResult,
        METHOD_METRICS: MetricsResult,
    }
)
NOTIFICATION_PARAMS: Final[Mapping[str, type[BaseModel]]] = MappingProxyType(
    {
        NOTIFICATION_STARTED: StartedParams,
        NOTIFICATION_PROGRESS: ProgressParams,
        NOTIFICATION_COMPLETED: CompletedParams,
        NOTIFICATION_CATALOG_CHANGED: CatalogChangedParams,
    }
)


# ---- validation errors ----------------------------------------------------------------

_EXPECTED: Final = MappingProxyType(
    {
        "string_type": "must be a string",
        "bool_type": "must be a boolean",
        "int_type": "must be an integer",
        "int_from_float": "must be an integer",
        "float_type": "must be a number",
        "dict_type": "must be an object",
        "model_type": "must be an object",
        "model_attributes_type": "must be an object",
        "list_type": "must be an array",
        "enum": "must be a valid value",
        "missing": "is required",
        "extra_forbidden": "unknown parameter",
    }
)


def _field_name(loc: tuple[int | str, ...]) -> str:
    """Render an error location as ``a.b[0]``; an empty location is the params object."""
    name = ""
    for part in loc:
        if isinstance(part, int):
            name += f"[{part}]"
        else:
            name += f".{part}" if name else part
    return name or "params"


def _expectation(error: Mapping[str, Any]) -> str:
    """Say what was expected for one pydantic error, without the input value."""
    kind = error["type"]
    ctx = error.get("ctx") or {}
    if kind in ("literal_error", "enum") and "expected" in ctx:
        return f"must be {ctx['expected']}"
    if kind == "value_error" and "error" in ctx:
        # Only our own validators raise ValueError here, and they never echo input.
        return str(ctx["error"])
    return _EXPECTED.get(kind) or str(error["msg"]).replace("Input should", "should")


def params_error(exc: ValidationError) -> InvalidParams:
    """Turn a params validation error into an ``InvalidParams`` that names every field
    (and at most ``NAMED_UNKNOWN`` unknown parameters, counting the rest).

    Args:
        exc: The error raised by validating one of the params models.

    Returns:
        ``InvalidParams`` with a message such as ``Invalid params: 'workspace' must be a
        string; unknown parameter 'foo'`` and data ``[{"field", "message"}, ...]``. Input
        values never appear (they may hold secrets).
    """
    return invalid_params(
        [
            (_field_name(error["loc"]), _expectation(error))
            for error in exc.errors(include_url=False, include_input=False)
        ]
    )
