"""The JSON-RPC method handlers: status, list, classify, invoke, cancel, reload.

Theory of operation
-------------------
Each handler takes the request context and the named params, validates the params with
the protocol's pydantic model (a ``ValidationError`` becomes InvalidParams at the server's
boundary), and returns a plain dict in the contract's wire shape. Domain refusals are
``RpcError`` subclasses raised here.

``invoke`` enforces everything ``classify`` computes before any process starts, in this
order: workspace, mode, the tool in the (requested) catalog, the arguments against the
tool's JSON Schema, the path fence (arguments it refuses are InvalidArguments, before
anyone is asked), and the policy decision (deny, or ask/review without ``approved``). It then registers the call (so ``cancel`` and a disconnect can reach
it), runs it, and sends ``completed`` before returning the result: the response follows
on the same ordered writer, so the client always sees started, completed, response.
"""

from __future__ import annotations

import os
import re
import time
import uuid
from collections.abc import Callable, Iterable, Mapping, Sized
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import structlog
from toolsetd.protocol import __version__
from toolsetd.protocol import errors as rpc_errors
from toolsetd.protocol import models as m

from .catalog import note_info, set_info, tool_info
from .model import Catalog, CatalogName, LoadedTool
from .observe import NO_OBSERVER, CallInfo, Observer
from .paths import ArgumentsError, rewrite_arguments
from .policy import classify
from .registry import Registry, ReloadOutcome
from .runner import CallRequest, Runner
from .sdnotify import Notifier
from .server import Connection, Handler, RequestContext
from .validation import ArgumentValidators

__all__ = ["HandlerSettings", "Handlers"]

log = structlog.get_logger("toolsetd.methods")

_CALL_ID = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")
_MAX_LISTED_NAMES = 20


@dataclass(frozen=True, slots=True)
class HandlerSettings:
    """Facts the handlers report or need.

    Attributes:
        socket: The socket path served (for ``status``).
        home: The Crystal home.
        user_home: The OS user's home, for ``~`` in path arguments.
    """

    socket: str
    home: Path
    user_home: Path


@dataclass(slots=True)
class _Call:
    connection: Connection
    cancel: anyio.Event


class _Events:
    """The runner's event sink for one call: notifications to the calling connection."""

    def __init__(self, connection: Connection, call_id: str, loaded: LoadedTool) -> None:
        self._connection = connection
        self._call_id = call_id
        self._loaded = loaded
        #: Whether ``started`` went out (so exactly one ``completed`` must follow).
        self.started_sent = False

    async def started(self, pid: int) -> None:
        self.started_sent = True
        await self._connection.notify(
            m.NOTIFICATION_STARTED,
            {
                "callId": self._call_id,
                "tool": self._loaded.tool.name,
                "set": self._loaded.toolset.directory,
                "pid": pid,
            },
        )

    async def completed(
        self, *, status: str, exit_code: int | None, duration_ms: int, truncated: bool
    ) -> None:
        """Send ``completed``; shielded, so a cancelled call still closes its pair."""
        with anyio.CancelScope(shield=True):
            await self._connection.notify(
                m.NOTIFICATION_COMPLETED,
                {
                    "callId": self._call_id,
                    "status": status,
                    "exitCode": exit_code,
                    "durationMs": duration_ms,
                    "truncated": truncated,
                },
            )

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
        params: dict[str, Any] = {
            "callId": self._call_id,
            "elapsedMs": elapsed_ms,
            "stdoutBytes": stdout_bytes,
            "stderrBytes": stderr_bytes,
        }
        if message is not None:
            params["message"] = message
        if fraction is not None:
            params["fraction"] = fraction
        if queued:
            params["queued"] = True
        # Progress is dropped for a client that is not keeping up (the next one carries
        # the same counters); it must never queue behind, or hold up, a stalled reader.
        await self._connection.notify(m.NOTIFICATION_PROGRESS, params, droppable=True)


class Handlers:
    """The method handlers and the state they share.

    Args:
        settings: Facts for ``status`` and path resolution.
        registry: The catalog snapshots.
        runner: Runs exec calls.
        validators: Compiled argument validators.
        notifier: systemd notify (a no-op outside systemd).
        connections: Counts the open connections (for ``status``).
        on_workspace: Called with each workspace first used (the watcher follows it).
        observer: Told of each call and reload (metrics, tracing; ``observe.Observer``).
        reload_config: Re-reads the config file on every ``reload``; returns the
            result's ``config`` member.
        metrics_text: Renders the metrics for ``metrics``: (text, content type).
    """

    def __init__(
        self,
        settings: HandlerSettings,
        registry: Registry,
        runner: Runner,
        validators: ArgumentValidators,
        notifier: Notifier,
        connections: Callable[[], Iterable[Connection]],
        on_workspace: Callable[[Path], None] | None = None,
        observer: Observer = NO_OBSERVER,
        reload_config: Callable[[], dict[str, Any]] | None = None,
        metrics_text: Callable[[], tuple[str, str]] | None = None,
    ) -> None:
        self._observer = observer
        self._reload_config = reload_config
        self._metrics_text = metrics_text
        self._settings = settings
        self._registry = registry
        self._runner = runner
        self._validators = validators
        self._notifier = notifier
        self._connections = connections
        self._on_workspace = on_workspace
        self._started = time.monotonic()
        self.calls: dict[str, _Call] = {}
        self._list_cache: dict[tuple[int, str | None], tuple[Catalog, dict[str, Any]]] = {}

    def methods(self) -> Mapping[str, Handler]:
        """The method table the server dispatches to."""
        return {
            m.METHOD_STATUS: self.status,
            m.METHOD_LIST: self.list,
            m.METHOD_CLASSIFY: self.classify,
            m.METHOD_INVOKE: self.invoke,
            m.METHOD_CANCEL: self.cancel,
            m.METHOD_RELOAD: self.reload,
            m.METHOD_METRICS: self.metrics,
        }

    # -- helpers -------------------------------------------------------------------------

    @staticmethod
    def _named(params: Any) -> dict[str, Any]:
        if not isinstance(params, dict):
            raise rpc_errors.InvalidParams(
                "Invalid params: params must be an object of named parameters, not an array."
            )
        return params

    def _workspace(self, raw: str | None) -> Path | None:
        if raw is None:
            return None
        if "\x00" in raw or not os.path.isabs(raw):
            raise rpc_errors.InvalidWorkspace(
                "Invalid workspace: 'workspace' must be an absolute path to a directory; "
                "got a relative path.",
                {"field": "workspace"},
            )
        try:
            canonical = Path(os.path.realpath(raw))
            is_dir = canonical.is_dir()
        except (OSError, ValueError):
            is_dir = False
        if not is_dir:
            raise rpc_errors.InvalidWorkspace(
                f"Invalid workspace: {raw!r} is not a directory; 'workspace' must be an "
                "absolute path to an existing directory.",
                {"field": "workspace"},
            )
        return canonical

    async def _catalog(self, workspace: Path | None) -> Catalog:
        first_use = workspace is not None and self._registry.cached(workspace) is None
        catalog = await self._registry.catalog(workspace)
        if first_use and workspace is not None and self._on_workspace is not None:
            self._on_workspace(workspace)
        return catalog

    @staticmethod
    def _mode(raw: str) -> m.Mode:
        try:
            return m.parse_mode(raw)
        except ValueError as exc:
            raise rpc_errors.InvalidParams(f"Invalid params: 'mode': {exc}", {"field": "mode"}) from None

    @staticmethod
    def _lookup(catalog: Catalog, name: str, wanted: str | None) -> LoadedTool:
        loaded = catalog.tools.get(name)
        where = f"workspace {catalog.workspace}" if catalog.workspace else "the home tool sets"
        if loaded is None:
            names = list(catalog.tools)
            shown = ", ".join(names[:_MAX_LISTED_NAMES]) or "none"
            more = f" and {len(names) - _MAX_LISTED_NAMES} more" if len(names) > _MAX_LISTED_NAMES else ""
            raise rpc_errors.UnknownTool(
                f"Unknown tool '{name}': no such tool in the catalog of {where}. "
                f"Loaded tools: {shown}{more}.",
                {"tool": name},
            )
        if wanted is not None and CatalogName(wanted) not in loaded.tool.catalogs:
            raise rpc_errors.UnknownTool(
                f"Unknown tool '{name}' in the {wanted} catalog: the tool is registered for "
                f"{', '.join(sorted(c.value for c in loaded.tool.catalogs))} only.",
                {"tool": name, "catalog": wanted},
            )
        return loaded

    def _check_arguments(self, loaded: LoadedTool, arguments: Any) -> None:
        errors = self._validators.errors(loaded, arguments)
        if errors:
            more = f" ({len(errors) - 1} more in data.errors)" if len(errors) > 1 else ""
            raise rpc_errors.InvalidArguments(
                f"Invalid arguments for '{loaded.tool.name}': {errors[0]['message']}{more}",
                {"errors": errors},
            )

    def _check_call_id_free(self, call_id: str) -> None:
        if call_id in self.calls:
            raise rpc_errors.InvalidParams(
                f"Invalid params: 'callId' {call_id!r} is already in flight; use a new id.",
                {"field": "callId"},
            )

    def _fence_error(
        self, loaded: LoadedTool, workspace: Path, arguments: Any, message: str
    ) -> rpc_errors.InvalidArguments:
        pointer = ""
        try:
            rewrite_arguments(loaded.tool, arguments, workspace, self._settings.user_home)
        except ArgumentsError as exc:
            if exc.argument is not None:
                pointer = "/" + exc.argument.replace("~", "~0").replace("/", "~1")
        where = pointer or "(the arguments object)"
        return rpc_errors.InvalidArguments(
            f"Invalid arguments for '{loaded.tool.name}': {where}: {message}",
            {"errors": [{"path": pointer, "message": message}]},
        )

    # -- methods -------------------------------------------------------------------------

    async def status(self, ctx: RequestContext, params: Any) -> dict[str, Any]:
        """Report the daemon's state."""
        if params or type(params) is not dict:
            # ``status`` takes no params: only a non-empty object or an array can be wrong,
            # and the empty object every status call carries skips the model.
            m.StatusParams.model_validate(self._named(params))
        connections = self._connections()
        return {
            "version": __version__,
            "pid": os.getpid(),
            "uptimeSeconds": round(time.monotonic() - self._started, 3),
            "socket": self._settings.socket,
            "home": str(self._settings.home),
            "generation": self._registry.generation,
            "workspaces": [str(w) for w in self._registry.workspaces],
            "inFlight": len(self.calls),
            "connections": (
                len(connections) if isinstance(connections, Sized) else sum(1 for _ in connections)
            ),
        }

    async def list(self, ctx: RequestContext, params: Any) -> dict[str, Any]:
        """The catalog of a workspace (or of home alone): tools, sets and notes."""
        p = m.ListParams.model_validate(self._named(params))
        workspace = self._workspace(p.workspace)
        catalog = await self._catalog(workspace)
        if p.subscribe:
            ctx.connection.subscriptions.add(str(workspace) if workspace else None)
        key = (id(catalog), p.catalog)
        cached = self._list_cache.get(key)
        if cached is None or cached[0] is not catalog:
            wanted = CatalogName(p.catalog) if p.catalog else None
            body = {
                "tools": [
                    tool_info(t)
                    for t in catalog.tools.values()
                    if wanted is None or wanted in t.tool.catalogs
                ],
                "sets": [set_info(e) for e in catalog.sets],
                "notes": [note_info(n) for n in catalog.notes],
            }
            if len(self._list_cache) > 64:
                self._list_cache.clear()
            self._list_cache[key] = (catalog, body)
        else:
            body = cached[1]
        return {"generation": self._registry.generation, **body}

    async def _prepare(
        self, tool: str, arguments: Any, workspace_raw: str, mode_raw: str, headless: bool,
        catalog_name: str | None,
    ) -> tuple[Path, m.Mode, LoadedTool, Any]:
        workspace = self._workspace(workspace_raw)
        assert workspace is not None
        mode = self._mode(mode_raw)
        catalog = await self._catalog(workspace)
        loaded = self._lookup(catalog, tool, catalog_name)
        self._check_arguments(loaded, arguments)
        classification = classify(
            loaded, arguments, workspace, mode, headless, self._settings.user_home
        )
        return workspace, mode, loaded, classification

    async def classify(self, ctx: RequestContext, params: Any) -> dict[str, Any]:
        """Classify a prospective call: paths, scope, approval and the decision."""
        p = m.ClassifyParams.model_validate(self._named(params))
        _, _, _, classification = await self._prepare(
            p.tool, p.arguments, p.workspace, p.mode, p.headless, None
        )
        return classification.to_wire()  # type: ignore[no-any-return]

    async def invoke(self, ctx: RequestContext, params: Any) -> dict[str, Any]:
        """Run a tool: enforce the classification, stream events, answer the result."""
        p = m.InvokeParams.model_validate(self._named(params))
        call_id = p.call_id if p.call_id is not None else uuid.uuid4().hex
        if not _CALL_ID.match(call_id):
            raise rpc_errors.InvalidParams(
                "Invalid params: 'callId' must be 1 to 128 characters of letters, digits, "
                "'.', '_', ':' or '-'.",
                {"field": "callId"},
            )
        self._check_call_id_free(call_id)
        workspace, mode, loaded, classification = await self._prepare(
            p.tool, p.arguments, p.workspace, p.mode, p.headless, p.catalog
        )
        decision = classification.decision
        observed = self._observer.call(CallInfo(
            call_id, loaded.tool.name, loaded.toolset.directory, loaded.toolset.source.value,
            decision, p.traceparent,
        ))
        if classification.arguments_error is not None:
            # Arguments the fence refuses can never run: say so before asking anyone.
            observed.refused("arguments")
            raise self._fence_error(loaded, workspace, p.arguments, classification.arguments_error)
        wire = classification.to_wire()
        if decision == "deny":
            observed.refused("deny")
            raise rpc_errors.PolicyDenied(f"Denied: {classification.reason}", wire)
        if decision in ("ask", "review") and not p.approved:
            observed.refused("approval")
            raise rpc_errors.ApprovalRequired(
                f"Approval required: {classification.reason} Ask the operator, then call "
                "again with approved: true.",
                wire,
            )
        # The child receives exactly the arguments that were classified: resolving the
        # paths a second time could let a symlink swapped in between go unjudged.
        fenced = classification.arguments
        self._check_call_id_free(call_id)  # again: it may have been taken while we awaited
        cancel = anyio.Event()
        connection = ctx.connection
        self.calls[call_id] = _Call(connection, cancel)
        connection.calls[call_id] = cancel
        request = CallRequest(
            call_id=call_id,
            loaded=loaded,
            arguments=fenced,
            workspace=workspace,
            home=self._settings.home,
            session=p.session or "",
            approval_mode=mode.value,
            images=p.images,
            extra_env=observed.child_env(),
        )
        log.info("call_started", call_id=call_id, tool=loaded.tool.name, set=loaded.toolset.directory)
        events = _Events(connection, call_id, loaded)
        started_at = time.monotonic()
        try:
            try:
                outcome = await self._runner.run(request, events, cancel)
            except BaseException:
                observed.finished(None)
                # The runner answers with an outcome, never an exception; should one escape
                # anyway, the client that saw ``started`` still gets its ``completed``.
                if events.started_sent:
                    await events.completed(
                        status="error",
                        exit_code=None,
                        duration_ms=int((time.monotonic() - started_at) * 1000),
                        truncated=False,
                    )
                raise
            if outcome.started:
                await events.completed(
                    status=outcome.status,
                    exit_code=outcome.exit_code,
                    duration_ms=outcome.duration_ms,
                    truncated=outcome.truncated,
                )
        finally:
            self.calls.pop(call_id, None)
            connection.calls.pop(call_id, None)
        observed.finished(outcome)
        log.info(
            "call_finished",
            call_id=call_id,
            tool=loaded.tool.name,
            status=outcome.status,
            exit_code=outcome.exit_code,
            duration_ms=outcome.duration_ms,
            stdout_bytes=outcome.stdout_bytes,
            stderr_bytes=outcome.stderr_bytes,
            truncated=outcome.truncated,
        )
        return outcome.to_wire(call_id)

    async def cancel(self, ctx: RequestContext, params: Any) -> dict[str, Any]:
        """Cancel an in-flight call by id (any connection's)."""
        p = m.CancelParams.model_validate(self._named(params))
        call = self.calls.get(p.call_id)
        if call is None:
            raise rpc_errors.UnknownCall(
                f"Unknown call '{p.call_id}': no call with this id is in flight on this daemon.",
                {"callId": p.call_id},
            )
        call.cancel.set()
        return {"cancelled": True}

    async def reload(self, ctx: RequestContext, params: Any) -> dict[str, Any]:
        """Rescan tool sets and answer what changed."""
        p = m.ReloadParams.model_validate(self._named(params))
        workspace = self._workspace(p.workspace)
        config = self._reload_config() if self._reload_config is not None else None
        if workspace is not None:
            await self._catalog(workspace)
            outcome = await self.reload_catalogs([None, workspace])
            catalog = outcome.catalogs[workspace]
            changed = [c.to_wire() for c in outcome.changes.get(workspace, ())]
            notes = [note_info(n) for n in catalog.notes]
        else:
            outcome = await self.reload_catalogs(None)
            changed = [c.to_wire() for c in outcome.all_changes()]
            seen: dict[tuple[str, str | None, str], dict[str, Any]] = {}
            for catalog in outcome.catalogs.values():
                for note in catalog.notes:
                    info = note_info(note)
                    seen.setdefault((info["set"], info["source"], info["message"]), info)
            notes = list(seen.values())
        result = {"generation": outcome.generation, "changed": changed, "notes": notes}
        if config is not None:
            result["config"] = config
        return result

    async def metrics(self, ctx: RequestContext, params: Any) -> dict[str, Any]:
        """The Prometheus exposition of the daemon's metrics."""
        m.MetricsParams.model_validate(self._named(params))
        if self._metrics_text is None:
            raise rpc_errors.MethodNotFound("Method not found: this daemon keeps no metrics.")
        text, content_type = self._metrics_text()
        return {"contentType": content_type, "text": text}

    async def reload_catalogs(self, workspaces: Iterable[Path | None] | None) -> ReloadOutcome:
        """Reload, tell systemd, and send ``catalogChanged`` to subscribers.

        This is the one reload path: the RPC, SIGHUP and the watcher all come here.
        """
        self._notifier.reloading()
        began, failed = time.monotonic(), True
        try:
            outcome = await self._registry.reload(workspaces)
            failed = False
        finally:
            self._notifier.ready()
            self._observer.reload_finished(time.monotonic() - began, failed)
        # Every key in outcome.changes moved the generation (a set, or only the notes,
        # changed), so every one is announced: generation and catalogChanged go together.
        for key, changes in outcome.changes.items():
            name = str(key) if key is not None else None
            params = {
                "workspace": name,
                "generation": outcome.generation,
                "changed": [c.to_wire() for c in changes],
            }
            for connection in list(self._connections()):
                if name in connection.subscriptions:
                    await connection.notify(m.NOTIFICATION_CATALOG_CHANGED, params)
        return outcome
