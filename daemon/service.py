"""The service core: the one place that looks tools up, judges calls, runs them and reloads.

Theory of operation
-------------------
toolsetd has several faces (the native JSON-RPC methods in ``methods.py``, MCP in
``mcp_session.py``, over the socket or stdio and over HTTP). Each face only translates
shapes; everything a call *means* happens here, once:

* ``workspace`` checks a raw workspace (absolute, an existing directory) and canonicalises
  it; ``catalog`` returns its snapshot from the ``Registry`` (built on first use, after
  which the watcher follows the workspace); ``lookup`` finds a tool in the (requested)
  catalog.
* ``prepare`` is the order of the checks every call goes through: workspace, mode, the
  tool in the catalog, the arguments against the tool's JSON Schema, then
  ``policy.classify`` (paths resolved and scoped, the decision). ``classify`` answers
  that; ``invoke`` goes on to enforce it: arguments the fence refuses are
  InvalidArguments (before anyone is asked), ``deny`` is PolicyDenied, and ``ask`` or
  ``review`` without approval is ApprovalRequired, whose ``data`` is the classification.
  An approval is either ``approved=True`` (the native wire) or ``approved_digest``, the
  ``approval_digest`` of the classification the operator saw and of the tool's definition
  (``LoadedTool.hash``): the call then runs only if it still classifies exactly so, as that
  very tool (MCP asks the operator, who approves *that* call; ``Unapproved`` carries the
  definition's hash to the face that asks).
* ``invoke`` registers the call before all of that, once its id is checked (daemon-wide
  in ``calls``, and in the caller's own ``owner_calls`` so a disconnect can cancel it),
  and unregisters it however it ends; it runs a call that passed, and keeps its event
  bookkeeping: the runner reports ``started`` and ``progress`` through ``_Bookkeeping``,
  which forwards them to the face's ``CallSink``; once a process started, exactly one
  ``completed`` follows (shielded, even when the call is cancelled or the runner fails),
  and only then does ``invoke`` return the outcome. The face answers after that, so its
  client sees started, progress*, completed, response.
* ``reload_catalogs`` is the one reload path (RPC, SIGHUP, the watcher): the registry
  reloads, systemd hears about it, and every ``CatalogListener`` registered for a
  changed key with ``listen`` is told (native ``catalogChanged``, MCP
  ``notifications/tools/list_changed``).

Errors are the protocol's ``RpcError`` subclasses; each face maps them to its wire.

Why one module of this size: it is the one core every face calls. The lookup, the order of
the checks, the verdict, the run and its started/progress/completed bookkeeping stay in
one class on purpose: a second copy anywhere would be a defect, and
``tests/test_layering.py`` checks that classify, the verdict and the run have this
module as their only caller.
"""

from __future__ import annotations

import hashlib
import os
import re
import time
from collections.abc import Awaitable, Callable, Iterable, MutableMapping, Sequence
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import Any, Protocol, TypeVar

import anyio
import orjson
import structlog
from toolsetd.protocol import errors as rpc_errors
from toolsetd.protocol import modes as m
from toolsetd.protocol.jsontext import dumps as json_dumps

from .call import no_process_outcome
from .catalog import MANIFEST_NAME
from .checkworker import CheckWorker
from .confinement import Confinement
from .exhaustion import busy_when_short
from .large import LargeRequests
from .model import Catalog, CatalogName, LoadedTool, SetState
from .observe import NO_OBSERVER, CallInfo, CallObservation, Observer
from .output import CANCELLED_TEXT
from .paths import Scope, existing_directory
from .policy import Classification, classify
from .registry import Registry, ReloadOutcome, Reported
from .runner import CallOutcome, CallRequest, Runner
from .sdnotify import Notifier
from .validation import ArgumentValidators, off_loop

__all__ = [
    "CallSink",
    "CatalogListener",
    "InvokeRequest",
    "Prepared",
    "ProgressReport",
    "ReloadOutcome",
    "Reported",
    "Service",
    "ServiceSettings",
    "Unapproved",
    "approval_digest",
]

log = structlog.get_logger("toolsetd.service")

_V = TypeVar("_V")
_T = TypeVar("_T")

_CALL_ID = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")
_MAX_LISTED_NAMES = 20


@dataclass(frozen=True, slots=True)
class ServiceSettings:
    """Facts the service reports or needs.

    Attributes:
        socket: The socket path served (for ``status``).
        home: The Crystal home.
        user_home: The OS user's home, for ``~`` in path arguments.
    """

    socket: str
    home: Path
    user_home: Path


@dataclass(frozen=True, slots=True)
class ProgressReport:
    """One progress event of a running (or queued) call.

    Attributes:
        elapsed_ms: Milliseconds since the call began.
        stdout_bytes: Bytes the child wrote to stdout so far.
        stderr_bytes: Bytes the child wrote to stderr so far.
        message: The child's message, if this report carries one.
        fraction: The child's fraction (0 to 1), if this report carries one.
        queued: The call still waits for a runner slot.
    """

    elapsed_ms: int
    stdout_bytes: int
    stderr_bytes: int
    message: str | None = None
    fraction: float | None = None
    queued: bool = False

    @property
    def reported(self) -> bool:
        """Whether the child itself reported this (a line on its progress fd)."""
        return self.message is not None or self.fraction is not None


@dataclass(frozen=True, slots=True)
class Completion:
    """How a call that started a process ended (the ``completed`` event)."""

    status: str
    exit_code: int | None
    duration_ms: int
    truncated: bool


class CallSink(Protocol):
    """Where a face receives the events of one call (its wire shapes are its own).

    ``started`` comes once when the child runs; ``progress`` any number of times;
    ``completed`` exactly once after ``started``, shielded from cancellation.
    """

    async def started(self, call_id: str, loaded: LoadedTool, pid: int) -> None:
        """The child is running."""

    async def progress(self, call_id: str, report: ProgressReport) -> None:
        """A periodic, child-reported or queued progress report."""

    async def completed(self, call_id: str, completion: Completion) -> None:
        """The call that started a process has ended."""


#: Called after a reload that changed a key's catalog: (workspace key, generation,
#: the changes in wire shape).
CatalogListener = Callable[[Path | None, int, Sequence[dict[str, Any]]], Awaitable[None]]


@dataclass(frozen=True, slots=True)
class InvokeRequest:
    """One call as a face asks for it (raw values; the service judges them).

    Attributes:
        tool: The tool name.
        arguments: The arguments as sent.
        workspace: The workspace as sent (must be absolute).
        call_id: The caller's call id, else one is made.
        catalog: ``plan`` or ``work`` to require the tool in that catalog.
        mode: The approval mode (or an alias).
        headless: Nobody can be asked: ``ask`` becomes ``deny``.
        approved: The operator (or reviewer) approved this call.
        approved_digest: The ``approval_digest`` of the classification the operator
            approved and of the tool's definition; the call runs only if it still
            classifies so, as the same tool.
        session: ``CRYSTAL_SESSION`` for the child.
        images: Whether the caller can take images.
        every_progress_line: Deliver every progress line the child writes (no
            coalescing of bursts).
        traceparent: The caller's W3C ``traceparent`` (for the observers), or None.
        checked_workspace: ``workspace`` as the face checked it (``Service.workspace``)
            for this very request, or None. The call is judged in it without a second
            check: a stateless MCP exchange binds its URL's workspace for its one request
            (a check is a few system calls: an open, its name, its identity). A face that
            checked it for earlier requests (a bound session) leaves it None: the
            directory may be gone since.
    """

    tool: str
    arguments: Any
    workspace: str
    call_id: str | None = None
    catalog: str | None = None
    mode: str = "default"
    headless: bool = False
    approved: bool = False
    approved_digest: str | None = None
    session: str = ""
    images: bool = True
    every_progress_line: bool = False
    traceparent: str | None = None
    checked_workspace: Path | None = None


@dataclass(frozen=True, slots=True)
class Prepared:
    """A call that passed the catalog and schema checks, with its classification."""

    workspace: Path
    mode: m.Mode
    loaded: LoadedTool
    classification: Classification


class CallCancelled(Exception):
    """A call's cancel event was set while it was being judged (``_unless_set``)."""


async def _unless_set(
    cancel: anyio.Event | None, step: Callable[..., Awaitable[_T]], *args: Any
) -> _T:
    """``await step(*args)``, ended at once when ``cancel`` is set meanwhile.

    For a step of a call's judging that can take seconds (a check in the check process):
    a caller that cancelled should neither wait for it nor hold the check process from
    the next call's check. Costs a task group: only for such steps, never for every call.

    Raises:
        CallCancelled: ``cancel`` was set (before the step too); the step was cancelled.
    """
    if cancel is None:
        return await step(*args)
    if cancel.is_set():
        raise CallCancelled
    result: list[_T] = []
    error: Exception | None = None
    async with anyio.create_task_group() as tg:

        async def watch() -> None:
            await cancel.wait()
            tg.cancel_scope.cancel()

        tg.start_soon(watch)
        try:
            result.append(await step(*args))
        except Exception as exc:  # raised as it is, not in the task group's ExceptionGroup
            error = exc
        tg.cancel_scope.cancel()
    if error is not None:
        raise error
    if not result:
        raise CallCancelled
    return result[0]


def _log_finished(call_id: str, tool: str, outcome: CallOutcome) -> None:
    log.info(
        "call_finished",
        call_id=call_id,
        tool=tool,
        status=outcome.status,
        exit_code=outcome.exit_code,
        duration_ms=outcome.duration_ms,
        stdout_bytes=outcome.stdout_bytes,
        stderr_bytes=outcome.stderr_bytes,
        truncated=outcome.truncated,
        peak_memory_bytes=outcome.peak_memory_bytes,
        cpu_ms=outcome.cpu_ms,
    )


class _Call:
    """A call in flight (plain and slotted: a dataclass costs every start ~0.4 ms)."""

    __slots__ = ("cancel",)

    def __init__(self, cancel: anyio.Event) -> None:
        self.cancel = cancel


def approval_digest(classification_wire: dict[str, Any], *, tool: str) -> str:
    """A digest of what the operator is shown and approves: the whole classification, and
    the definition of the tool it is of (``tool``, its ``LoadedTool.hash``).

    The classification names the tool and its set, not what it runs: without the hash, a
    tools.json edited while the operator was asked (another command, the same name) ran
    on the strength of an accept given for the tool as it was.
    """
    # jsontext: the arguments may hold exact numbers (JsonNumber, integers past 64 bits).
    body = json_dumps(classification_wire, orjson.OPT_SORT_KEYS)
    return hashlib.sha256(tool.encode() + b"\x00" + body).hexdigest()


class Unapproved(rpc_errors.ApprovalRequired):
    """``ApprovalRequired`` (its ``data`` the classification), with the hash of the tool's
    definition it was judged for: what a face that asks the operator digests along with
    the classification (``approval_digest``). On the wire it is ``ApprovalRequired``."""

    def __init__(self, message: str, data: dict[str, Any], tool_hash: str) -> None:
        super().__init__(message, data)
        self.tool_hash = tool_hash


class _Bookkeeping:
    """The runner's event sink for one call: forwards to the face, tracks ``started``."""

    __slots__ = ("_call_id", "_loaded", "_sink", "started_sent", "stderr_bytes", "stdout_bytes")

    def __init__(self, sink: CallSink, call_id: str, loaded: LoadedTool) -> None:
        self._sink = sink
        self._call_id = call_id
        self._loaded = loaded
        #: Whether ``started`` went out (so exactly one ``completed`` must follow).
        self.started_sent = False
        #: The output counts of the last progress (for a run cancelled from outside).
        self.stdout_bytes = self.stderr_bytes = 0

    async def started(self, pid: int) -> None:
        self.started_sent = True
        await self._sink.started(self._call_id, self._loaded, pid)

    async def progress(
        self,
        *,
        elapsed_ms: int,
        stdout_bytes: int,
        stderr_bytes: int,
        message: str | None = None,
        fraction: float | None = None,
        queued: bool = False,
    ) -> None:
        self.stdout_bytes, self.stderr_bytes = stdout_bytes, stderr_bytes
        await self._sink.progress(
            self._call_id,
            ProgressReport(elapsed_ms, stdout_bytes, stderr_bytes, message, fraction, queued),
        )

    async def completed(self, completion: Completion) -> None:
        with anyio.CancelScope(shield=True):
            await self._sink.completed(self._call_id, completion)


def _not_loaded(catalog: Catalog, name: str) -> str:
    """Why the tool ``name`` is not in ``catalog`` when a tool set on disk has it, else "".

    A set that is disabled, skipped (its manifest does not parse, its runner is not
    supported) or hidden by a project copy declares tools nobody can call. The operator
    who called one was told only that no such tool is loaded, and a front end's list
    of loaded tools does not name it either: the set, its ``tools.json`` and the fix are
    what they need. A set whose manifest did not parse names no tools; one whose
    directory is ``name`` (the shorthand's tool name) is the likely one.
    """
    if not catalog.config.external_tools:
        return (
            " External tool discovery is off (externalTools in the Crystal home's "
            "config.json), so no tool set loads."
        )
    for entry in catalog.sets:
        if entry.state is SetState.LOADED:
            continue
        if entry.toolset is not None:
            if name not in (tool.name for tool in entry.toolset.tools):
                continue
        elif entry.directory != name:
            continue
        where = f"Tool set '{entry.directory}' ({entry.source.value}, {entry.path / MANIFEST_NAME})"
        if entry.state is SetState.DISABLED:
            return (
                f' {where} declares it but is disabled: set "enabled": true in it, or run '
                f"toolsetctl enable {entry.directory} --source {entry.source.value}."
            )
        if entry.state is SetState.HIDDEN:
            return (
                f" {where} declares it but is hidden by the project tool set of the same "
                "directory name, which replaces it whole."
            )
        if entry.error is not None:
            return (
                f" {where} was skipped (toolsetctl validate {entry.directory} lists every "
                f"problem): {entry.error}"
            )
        return f" {where} declares it but did not load: {' '.join(entry.notes)}"
    return ""


class Service:
    """The core every face calls: catalogs, the checks in order, calls, cancel, reload.

    Args:
        settings: Facts for ``status`` and path resolution.
        registry: The catalog snapshots.
        runner: Runs exec calls.
        validators: Compiled argument validators.
        notifier: systemd notify (a no-op outside systemd).
        on_workspace: Called with each workspace first used (the watcher follows it).
        observer: Told of each call and reload (metrics, tracing; ``observe.Observer``).
        confinement: The cgroups and the sandbox (``status`` and the classification
            report them; the runner applies them).
        checks: The check process (``checkworker.CheckWorker``), where large arguments
            are checked (``validation.off_loop``); without it they are checked on the loop.
        large_requests: The daemon's worker slot for large requests
            (``large.LargeRequests``): the params check of large arguments takes it.
    """

    def __init__(
        self,
        settings: ServiceSettings,
        registry: Registry,
        runner: Runner,
        validators: ArgumentValidators,
        notifier: Notifier,
        on_workspace: Callable[[Path], None] | None = None,
        observer: Observer = NO_OBSERVER,
        confinement: Confinement | None = None,
        checks: CheckWorker | None = None,
        large_requests: LargeRequests | None = None,
    ) -> None:
        self.settings = settings
        self.confinement = confinement
        self._observer = observer
        self.registry = registry
        self._runner = runner
        self._validators = validators
        self._notifier = notifier
        self._on_workspace = on_workspace
        self.started_at = time.monotonic()
        #: Every call in flight on this daemon, by call id.
        self.calls: dict[str, _Call] = {}
        #: Set when a graceful stop begins: no new call starts, on any face.
        self.stopping = False
        self._listeners: dict[Path | None, set[CatalogListener]] = {}
        self._listen_all: list[CatalogListener] = []
        self._checks = checks
        self._large = large_requests if large_requests is not None else LargeRequests()

    # -- lookup --------------------------------------------------------------------------

    @staticmethod
    def workspace(raw: str | None) -> Path | None:
        """Check and canonicalise a workspace as sent; None stays None (home alone).

        Raises:
            InvalidWorkspace: Not absolute, or not an existing directory.
        """
        if raw is None:
            return None
        if "\x00" in raw:  # no file name holds one: say so, not "relative"
            raise rpc_errors.InvalidWorkspace(
                "Invalid workspace: 'workspace' must be an absolute path to a directory; "
                "got a path with a NUL character in it.",
                {"field": "workspace"},
            )
        if not os.path.isabs(raw):
            raise rpc_errors.InvalidWorkspace(
                rpc_errors.workspace_relative(raw), {"field": "workspace"}
            )
        with busy_when_short("open the workspace to check it"):
            canonical = existing_directory(raw)
        if canonical is None:
            raise rpc_errors.InvalidWorkspace(
                rpc_errors.workspace_not_a_directory(raw), {"field": "workspace"}
            )
        return canonical

    async def catalog(self, workspace: Path | None) -> Catalog:
        """The workspace's catalog snapshot (home alone for None), built on first use."""
        first_use = workspace is not None and self.registry.cached(workspace) is None
        with busy_when_short("read the tool sets"):  # nothing is kept: the next one builds it
            catalog = await self.registry.catalog(workspace)
        if first_use and workspace is not None and self._on_workspace is not None:
            self._on_workspace(workspace)
        return catalog

    @staticmethod
    def mode(raw: str) -> m.Mode:
        """Parse an approval mode or alias.

        Raises:
            InvalidParams: Not a mode; the message lists the valid names.
        """
        try:
            return m.parse_mode(raw)
        except ValueError as exc:
            raise rpc_errors.InvalidParams(
                f"Invalid params: 'mode': {exc}", {"field": "mode"}
            ) from None

    @staticmethod
    def lookup(catalog: Catalog, name: str, wanted: str | None) -> LoadedTool:
        """The tool ``name`` of ``catalog``, required in catalog ``wanted`` when given.

        Raises:
            UnknownTool: No such tool, or not in the requested catalog.
        """
        loaded = catalog.tools.get(name)
        where = f"workspace {catalog.workspace}" if catalog.workspace else "the home tool sets"
        if loaded is None:
            names = list(catalog.tools)
            shown = ", ".join(names[:_MAX_LISTED_NAMES]) or "none"
            more = (
                f" and {len(names) - _MAX_LISTED_NAMES} more"
                if len(names) > _MAX_LISTED_NAMES
                else ""
            )
            raise rpc_errors.UnknownTool(
                f"Unknown tool '{name}': no such tool in the catalog of {where}. "
                f"Loaded tools: {shown}{more}.{_not_loaded(catalog, name)}",
                {"tool": name},
            )
        if wanted is not None and CatalogName(wanted) not in loaded.tool.catalogs:
            raise rpc_errors.UnknownTool(
                f"Unknown tool '{name}' in the {wanted} catalog: the tool is registered for "
                f"{', '.join(sorted(c.value for c in loaded.tool.catalogs))} only.",
                {"tool": name, "catalog": wanted},
            )
        return loaded

    # -- the checks, in order ------------------------------------------------------------

    async def check_request(self, check: Callable[[_V], _T], value: _V, arguments: Any) -> _T:
        """``check(value)``: a face's check of a request that carries ``arguments`` (or
        other work that walks or encodes them: an approval's digest, the question put to
        the operator), in the large requests' worker slot when they are large
        (``validation.off_loop``; their schema check then goes to the check process,
        ``prepare``).

        The check walks every object and array of the arguments for their depth: five
        million ``{}`` (a 16 MiB line) held the event loop, and every other client, for 5 s.
        In a thread it shares the GIL, which the loop gets back within the switch interval.
        What it raises is raised here.
        """
        if not off_loop(arguments):
            return check(value)
        return await self._large.check(check, value)

    async def prepare(
        self,
        tool: str,
        arguments: Any,
        workspace_raw: str,
        mode_raw: str,
        headless: bool,
        catalog_name: str | None,
        cancel: anyio.Event | None = None,
        checked_workspace: Path | None = None,
    ) -> Prepared:
        """Workspace, mode, the tool in the catalog, the schema, then the classification.

        Args:
            cancel: The call's cancel event, when it is a call: setting it ends a check
                in the check process (which can take seconds) at once.
            checked_workspace: ``workspace_raw`` already checked for this request
                (``InvokeRequest.checked_workspace``): taken as it is.

        Raises:
            InvalidWorkspace, InvalidParams, UnknownTool, InvalidArguments: In that order.
            CallCancelled: ``cancel`` was set during the check in the check process.
        """
        workspace = (
            checked_workspace if checked_workspace is not None else self.workspace(workspace_raw)
        )
        assert workspace is not None
        mode = self.mode(mode_raw)
        catalog = await self.catalog(workspace)
        loaded = self.lookup(catalog, tool, catalog_name)
        errors = None
        if self._checks is not None and off_loop(arguments):
            errors = await _unless_set(cancel, self._checks.errors, loaded, arguments)
        if errors is None:
            errors = self._validators.errors(loaded, arguments)
        if errors:
            more = f" ({len(errors) - 1} more in data.errors)" if len(errors) > 1 else ""
            raise rpc_errors.InvalidArguments(
                f"Invalid arguments for '{loaded.tool.name}': {errors[0]['message']}{more}",
                {"errors": errors},
            )
        confinement = self.confinement
        if confinement is not None and confinement.short:
            # A probe at start could not run (the daemon was short of tasks, memory or
            # room in its cgroup tree): bubblewrap, the cgroup tree or both are
            # tried again now, at most every few seconds, before the call is judged.
            await confinement.retry_probes()
        classification = classify(
            loaded,
            arguments,
            workspace,
            mode,
            headless,
            self.settings.user_home,
            crystal_home=self.settings.home,
        )
        return Prepared(workspace, mode, loaded, classification)

    def classification_wire(self, prepared: Prepared) -> dict[str, Any]:
        """The classification's wire shape with the confinement the call would get.

        It is what ``classify`` answers and what a refusal carries, so an approval digest
        covers the sandbox the operator was shown.
        """
        wire: dict[str, Any] = prepared.classification.to_wire()
        if self.confinement is not None:
            wire["confinement"] = self.confinement.describe(
                prepared.loaded.toolset, _outside_paths(prepared.classification)
            )
        return wire

    @staticmethod
    def _fence_error(
        loaded: LoadedTool, argument: str | None, message: str
    ) -> rpc_errors.InvalidArguments:
        # The property the classification refused: the arguments are not resolved again.
        pointer = ""
        if argument is not None:
            pointer = "/" + argument.replace("~", "~0").replace("/", "~1")
        where = pointer or "(the arguments object)"
        return rpc_errors.InvalidArguments(
            f"Invalid arguments for '{loaded.tool.name}': {where}: {message}",
            {"errors": [{"path": pointer, "message": message}]},
        )

    def _check_call_id_free(self, call_id: str) -> None:
        if call_id in self.calls:
            raise rpc_errors.InvalidParams(
                f"Invalid params: 'callId' {call_id!r} is already in flight; use a new id.",
                {"field": "callId"},
            )

    async def _enforce(
        self, request: InvokeRequest, prepared: Prepared, observed: CallObservation
    ) -> None:
        """The policy's verdict on a prepared call: return to run it, or raise."""
        classification = prepared.classification
        if classification.arguments_error is not None:
            # Arguments the fence refuses can never run: say so before asking anyone.
            observed.refused("arguments")
            _log_refused(prepared, "arguments")
            raise self._fence_error(
                prepared.loaded,
                classification.arguments_error_argument,
                classification.arguments_error,
            )
        decision = classification.decision
        if decision == "allow":
            return
        wire = self.classification_wire(prepared)
        if decision == "deny":
            observed.refused("deny")
            _log_refused(prepared, "deny")
            raise rpc_errors.PolicyDenied(f"Denied: {classification.reason}", wire)
        tool_hash = prepared.loaded.hash
        approved = request.approved or (
            request.approved_digest is not None
            # An encode of the arguments: large ones in the worker slot (``check_request``).
            and request.approved_digest
            == await self.check_request(
                partial(approval_digest, tool=tool_hash),
                wire,
                prepared.classification.arguments,
            )
        )
        if not approved:
            observed.refused("approval")
            _log_refused(prepared, "approval")
            raise Unapproved(
                f"Approval required: {classification.reason} Ask the operator, then call "
                "again with approved: true.",
                wire,
                tool_hash,
            )

    # -- calls ---------------------------------------------------------------------------

    async def invoke(
        self,
        request: InvokeRequest,
        sink: CallSink,
        owner_calls: MutableMapping[str, anyio.Event],
        cancel: anyio.Event | None = None,
    ) -> tuple[str, CallOutcome]:
        """Judge and run one call; events go to ``sink``; returns (call id, outcome).

        Args:
            request: The call as the face received it.
            sink: Receives started, progress and completed.
            owner_calls: The caller's own in-flight calls (cancelled when it goes away).
            cancel: Set to cancel the call (else one is made; ``cancel`` reaches it too).

        Raises:
            RpcError: InvalidParams, InvalidWorkspace, UnknownTool, InvalidArguments,
                PolicyDenied or ApprovalRequired; no process was started.
        """
        if self.stopping:
            raise rpc_errors.ShuttingDown("toolsetd is shutting down: no new calls are accepted.")
        t0 = time.monotonic()
        # A fresh id is 128 random bits in hex (the length of a uuid4's, a quarter the cost).
        call_id = request.call_id if request.call_id is not None else os.urandom(16).hex()
        if not _CALL_ID.match(call_id):
            raise rpc_errors.InvalidParams(
                "Invalid params: 'callId' must be 1 to 128 characters of letters, digits, "
                "'.', '_', ':' or '-'.",
                {"field": "callId"},
            )
        self._check_call_id_free(call_id)
        if cancel is None:
            cancel = anyio.Event()
        # In flight from here, while it is judged too: its catalog may be built and its
        # arguments checked in the check process first, each of which can take seconds. A
        # ``cancel`` of its id, its caller's leaving and a stop reach it meanwhile (the
        # runner starts no process for a cancelled call), and its id is taken.
        self.calls[call_id] = _Call(cancel)
        owner_calls[call_id] = cancel
        try:
            return await self._judged_call(request, sink, call_id, cancel)
        except CallCancelled:
            outcome = no_process_outcome(t0, CANCELLED_TEXT, "cancelled")
            _log_finished(call_id, request.tool, outcome)  # no call_started: never judged
            return call_id, outcome
        finally:
            self.calls.pop(call_id, None)
            owner_calls.pop(call_id, None)

    async def _judged_call(
        self, request: InvokeRequest, sink: CallSink, call_id: str, cancel: anyio.Event
    ) -> tuple[str, CallOutcome]:
        """``invoke`` of a call registered in flight: judge it, then run it."""
        prepared = await self.prepare(
            request.tool,
            request.arguments,
            request.workspace,
            request.mode,
            request.headless,
            request.catalog,
            cancel,
            request.checked_workspace,
        )
        loaded = prepared.loaded
        observed = self._observer.call(
            CallInfo(
                call_id,
                loaded.tool.name,
                loaded.toolset.directory,
                loaded.toolset.source.value,
                prepared.classification.decision,
                request.traceparent,
            )
        )
        await self._enforce(request, prepared, observed)
        run = CallRequest(
            call_id=call_id,
            loaded=loaded,
            # The child receives exactly the arguments that were classified: resolving the
            # paths a second time could let a symlink swapped in between go unjudged.
            arguments=prepared.classification.arguments,
            workspace=prepared.workspace,
            home=self.settings.home,
            session=request.session,
            approval_mode=prepared.mode.value,
            images=request.images,
            every_progress_line=request.every_progress_line,
            extra_env=observed.child_env(),
            approved_paths=_outside_paths(prepared.classification),
            user_home=self.settings.user_home,
        )
        log.info(
            "call_started",
            call_id=call_id,
            tool=loaded.tool.name,
            set=loaded.toolset.directory,
            decision=prepared.classification.decision,  # ask/review: it ran approved
        )
        events = _Bookkeeping(sink, call_id, loaded)
        started_at = time.monotonic()
        try:
            outcome = await self._runner.run(run, events, cancel)
        except BaseException as exc:
            status = "error"
            if isinstance(exc, anyio.get_cancelled_exc_class()):
                # Cancelled from outside (a forced stop, a connection aborted for a peer
                # that reads nothing): the runner ended the group, so the call ended,
                # cancelled; the audit trail that has its call_started says so.
                status = "cancelled"
                ended = replace(
                    no_process_outcome(started_at, CANCELLED_TEXT, status),
                    started=events.started_sent,
                    stdout_bytes=events.stdout_bytes,
                    stderr_bytes=events.stderr_bytes,
                )
                observed.finished(ended)
                _log_finished(call_id, loaded.tool.name, ended)
            else:
                observed.finished(None)
            # The runner answers with an outcome, never an exception; should one escape
            # anyway, the client that saw ``started`` still gets its ``completed``.
            if events.started_sent:
                await events.completed(
                    Completion(status, None, int((time.monotonic() - started_at) * 1000), False)
                )
            raise
        if outcome.started:
            await events.completed(
                Completion(
                    outcome.status, outcome.exit_code, outcome.duration_ms, outcome.truncated
                )
            )
        observed.finished(outcome)
        _log_finished(call_id, loaded.tool.name, outcome)
        return call_id, outcome

    def cancel(self, call_id: str) -> None:
        """Cancel an in-flight call by id (any caller's).

        Raises:
            UnknownCall: No call with this id is in flight.
        """
        call = self.calls.get(call_id)
        if call is None:
            raise rpc_errors.UnknownCall(
                f"Unknown call '{call_id}': no call with this id is in flight on this daemon.",
                {"callId": call_id},
            )
        call.cancel.set()

    # -- reload --------------------------------------------------------------------------

    def listen(self, key: Path | None, listener: CatalogListener) -> Callable[[], None]:
        """Tell ``listener`` about every reload that changes ``key``; returns the undo."""
        self._listeners.setdefault(key, set()).add(listener)

        def stop() -> None:
            listeners = self._listeners.get(key)
            if listeners is not None:
                listeners.discard(listener)
                if not listeners:
                    del self._listeners[key]

        return stop

    def listen_all(self, listener: CatalogListener) -> None:
        """Tell ``listener`` about every reload that changes any key (for the native face)."""
        self._listen_all.append(listener)

    def listened(self) -> set[Path]:
        """The workspaces someone listens to (they are in use: never released as idle)."""
        return {key for key in self._listeners if key is not None}

    async def reload_catalogs(
        self, workspaces: Iterable[Path | None] | None, reported: Reported | None = None
    ) -> ReloadOutcome:
        """Reload, tell systemd, and tell the listeners of every changed key.

        This is the one reload path: the RPC, SIGHUP and the watcher all come here; the
        watcher says what it saw change (``reported``, see ``Registry.reload``).
        """
        self._notifier.reloading()
        began, failed = time.monotonic(), True
        try:
            # Short of a resource, no snapshot is swapped (``Registry.reload``).
            with busy_when_short("read the tool sets"):
                outcome = await self.registry.reload(workspaces, reported)
            failed = False
        finally:
            self._notifier.ready()
            self._observer.reload_finished(time.monotonic() - began, failed)
        # Every key in outcome.changes moved the generation (a set, or only the notes,
        # changed), so every one is announced: generation and the announcement go together.
        for key, changes in outcome.changes.items():
            wire = [c.to_wire() for c in changes]
            for listener in [*self._listen_all, *self._listeners.get(key, ())]:
                await listener(key, outcome.generation, wire)
        return outcome


def _log_refused(prepared: Prepared, refused: str) -> None:
    """The audit line of an ``invoke`` the policy or the fence refused (one per call: what
    an operator reviews, so never throttled; ``request_refused`` is)."""
    c = prepared.classification
    log.info(
        "call_refused",
        tool=c.tool,
        set=c.set,
        source=c.source.value,
        scope=c.scope.value,
        decision=c.decision,
        refused=refused,
    )


def _outside_paths(classification: Classification) -> tuple[str, ...]:
    """The resolved outside-workspace paths of a call the decision lets run."""
    return tuple(
        p.resolved for p in classification.paths if p.scope == Scope.OUTSIDE and p.resolved
    )
