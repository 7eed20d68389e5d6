"""The native face: the JSON-RPC methods status, list, classify, invoke, cancel, reload.

Theory of operation
-------------------
Each handler takes the request context and the named params, checks the params with
the protocol's plain checks (``protocol/params.py``: the params models' rules without
pydantic; a bad field is InvalidParams naming it), calls the ``Service`` (``service.py``),
and returns a plain dict in the contract's wire shape. Everything a call means (the
order of the checks, the policy, the run and its event bookkeeping) lives in the
service; this module only translates shapes:
``_NativeSink`` turns the service's call events into ``started``, ``progress`` and
``completed`` notifications on the calling connection, and a catalog listener turns
reloads into ``catalogChanged`` for the connections that listed with ``subscribe``.
The service's ``RpcError`` refusals go to the client as they are.
"""

from __future__ import annotations

import functools
import os
import time
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from toolsetd.protocol import __version__
from toolsetd.protocol import errors as rpc_errors
from toolsetd.protocol import names as m
from toolsetd.protocol import params as params_check
from toolsetd.protocol.jsonrpc import notification_message
from toolsetd.protocol.jsontext import RawJson
from toolsetd.protocol.jsontext import dumps as json_dumps

from .catalog import note_info, set_info, tool_info
from .model import LARGE_CATALOG, Catalog, CatalogName, LoadedTool, SnapshotCache
from .server import Connection, Handler, RequestContext
from .service import Completion, InvokeRequest, ProgressReport, ReloadOutcome, Reported, Service

__all__ = ["Handlers"]


class _NativeSink:
    """The service's call events as native notifications to the calling connection."""

    __slots__ = ("_connection",)

    def __init__(self, connection: Connection) -> None:
        self._connection = connection

    async def started(self, call_id: str, loaded: LoadedTool, pid: int) -> None:
        await self._connection.notify(
            m.NOTIFICATION_STARTED,
            {
                "callId": call_id,
                "tool": loaded.tool.name,
                "set": loaded.toolset.directory,
                "pid": pid,
            },
        )

    async def progress(self, call_id: str, report: ProgressReport) -> None:
        params: dict[str, Any] = {
            "callId": call_id,
            "elapsedMs": report.elapsed_ms,
            "stdoutBytes": report.stdout_bytes,
            "stderrBytes": report.stderr_bytes,
        }
        if report.message is not None:
            params["message"] = report.message
        if report.fraction is not None:
            params["fraction"] = report.fraction
        if report.queued:
            params["queued"] = True
        # Progress is dropped for a client that is not keeping up (the next one carries
        # the same counters); it must never queue behind, or hold up, a stalled reader.
        await self._connection.notify(m.NOTIFICATION_PROGRESS, params, droppable=True)

    async def completed(self, call_id: str, completion: Completion) -> None:
        # The response follows at once: both go out in one write.
        self._connection.post_with_next(
            notification_message(
                m.NOTIFICATION_COMPLETED,
                {
                    "callId": call_id,
                    "status": completion.status,
                    "exitCode": completion.exit_code,
                    "durationMs": completion.duration_ms,
                    "truncated": completion.truncated,
                },
            )
        )


def _list_body(catalog: Catalog, wanted_name: str | None) -> dict[str, Any]:
    """``list``'s tools, sets and notes of a snapshot, encoded once per snapshot and filter.

    A later list of the same catalog writes these bytes as they are (orjson embeds a
    Fragment verbatim). A schema may hold an integer wider than 64 bits: jsontext writes
    it exactly.
    """
    wanted = CatalogName(wanted_name) if wanted_name else None
    tools = [
        tool_info(t) for t in catalog.tools.values() if wanted is None or wanted in t.tool.catalogs
    ]
    return {
        "tools": RawJson(json_dumps(tools)),
        "sets": RawJson(json_dumps([set_info(e) for e in catalog.sets])),
        "notes": RawJson(json_dumps([note_info(n) for n in catalog.notes])),
    }


#: ``status``'s ``watch`` under ``--no-watch``: neither a watch nor a poll runs (encoded
#: once, as the confinement report is: no response shares a mutable dict).
_NOT_WATCHING = RawJson(
    json_dumps(
        {
            "state": "off",
            "reason": "--no-watch: only SIGHUP, the reload method and toolsetctl reload",
            "watched": 0,
            "pastCap": 0,
            "maxWatches": None,
            "pollSeconds": None,
        }
    )
)


class Handlers:
    """The native method handlers over the service.

    Args:
        service: The core.
        connections: The open connections (for ``status`` and ``catalogChanged``).
        extra: More methods to serve beside the native ones (the MCP bind method).
        reload_config: Re-reads the config file on every ``reload``; returns the
            result's ``config`` member.
        metrics_text: Renders the metrics for ``metrics``: (text, content type).
        watch_status: ``status``'s ``watch`` member (``Watcher.status``), or None when
            the daemon does not watch (``--no-watch``).
    """

    def __init__(
        self,
        service: Service,
        connections: Callable[[], Collection[Connection]],
        extra: Mapping[str, Handler] | None = None,
        reload_config: Callable[[], dict[str, Any]] | None = None,
        metrics_text: Callable[[], tuple[str, str]] | None = None,
        watch_status: Callable[[], dict[str, Any] | None] | None = None,
    ) -> None:
        self.service = service
        self._watch_status = watch_status
        self._connections = connections
        self._extra = dict(extra or {})
        self._reload_config = reload_config
        self._metrics_text = metrics_text
        #: ``list``'s bodies: a large one is built in a worker thread, one at a time per
        #: workspace and filter (a second list of the same snapshot takes the first's).
        self._list_cache: SnapshotCache[dict[str, Any]] = SnapshotCache()
        self._status_fixed: tuple[Any, ...] = (None, None, 0)
        #: ``status``'s ``watch``: the watcher's last report, and it encoded once.
        self._watch_said: tuple[dict[str, Any] | None, Any] = (None, _NOT_WATCHING)
        service.listen_all(self._announce)

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
            **self._extra,
        }

    def watch(self) -> dict[str, Any] | None:
        """``status``'s ``watch`` (``Watcher.status``), or None when nothing watches."""
        return self._watch_status() if self._watch_status is not None else None

    @staticmethod
    def _named(params: Any) -> dict[str, Any]:
        if not isinstance(params, dict):
            raise rpc_errors.InvalidParams(
                "Invalid params: params must be an object of named parameters, not an array."
            )
        return params

    # -- methods -------------------------------------------------------------------------

    async def status(self, ctx: RequestContext, params: Any) -> dict[str, Any]:
        """Report the daemon's state."""
        if params or type(params) is not dict:
            # ``status`` takes no params: only a non-empty object or an array can be wrong,
            # and the empty object every status call carries skips the model.
            params_check.no_args(self._named(params))
        connections = self._connections()
        service = self.service
        held = service.confinement
        if held is not None and held.short:
            await held.retry_probes()  # its report changes once the probe has run
        fixed = self._status_fixed
        if (
            fixed[0] is not service.settings
            or fixed[1] is not held
            or (held is not None and fixed[2] != held.generation)
        ):
            fixed = self._status_fixed = self._fixed_status()
        _, _, _, pid, socket, home, confinement = fixed
        registry = service.registry
        return {
            "version": __version__,
            "pid": pid,
            # Whole milliseconds, truncated: a fifth of what ``round(x, 3)`` costs.
            "uptimeSeconds": int((time.monotonic() - service.started_at) * 1000) / 1000,
            "socket": socket,
            "home": home,
            "generation": registry.generation,
            "workspaces": registry.workspace_names,
            "inFlight": len(service.calls),
            "connections": len(connections),
            "confinement": confinement,
            "watch": self._watch_encoded(),
        }

    def _watch_encoded(self) -> Any:
        """``status``'s ``watch``, encoded once per report of the watcher (``Watcher.status``
        is the same dict until what it says changes): building and encoding it at every
        call was a quarter of a ``status``."""
        watch = self.watch()
        said, encoded = self._watch_said
        if watch is not said:
            encoded = _NOT_WATCHING if watch is None else RawJson(json_dumps(watch))
            self._watch_said = (watch, encoded)
        return encoded

    def _fixed_status(self) -> tuple[Any, Any, int, int, str, str, Any]:
        """The members of ``status`` that only new settings or confinement change (or a
        deferred probe of bubblewrap, ``Confinement.generation``).

        Worked out once (they were most of a status call's cost) and kept beside the
        objects they came from. The confinement report is encoded once as well
        (``RawJson``), so no response shares a mutable dict with another.
        """
        service = self.service
        settings, confinement = service.settings, service.confinement
        report = confinement.status() if confinement is not None else None
        return (
            settings,
            confinement,
            confinement.generation if confinement is not None else 0,
            os.getpid(),  # the daemon never forks without exec
            settings.socket,
            str(settings.home),
            RawJson(json_dumps(report)),
        )

    async def list(self, ctx: RequestContext, params: Any) -> dict[str, Any]:
        """The catalog of a workspace (or of home alone): tools, sets and notes."""
        p = params_check.list_args(self._named(params))
        workspace = self.service.workspace(p.workspace)
        catalog = await self.service.catalog(workspace)
        # The generation of this snapshot, taken with it: a large body is built in a
        # worker thread, and a reload landing meanwhile moved the generation, which then
        # named a catalog this list does not hold ("seen N again: the same catalog").
        generation = self.service.registry.generation
        if p.subscribe:
            ctx.connection.subscriptions.add(str(workspace) if workspace else None)
        body = await self._list_body(catalog, p.catalog)
        return {"generation": generation, **body}

    async def _list_body(self, catalog: Catalog, wanted: str | None) -> dict[str, Any]:
        """``list``'s encoded body of a snapshot, from the cache, else built: on the loop
        for a small catalog, else in a worker thread (``LARGE_CATALOG``: 20,000 tools took
        0.3-0.6 s, and a ``status`` beside it waited as long)."""
        cache = self._list_cache
        build = functools.partial(_list_body, catalog, wanted)
        if len(catalog.tools) + len(catalog.sets) <= LARGE_CATALOG:
            return cache.get(catalog, wanted, build)
        return await cache.get_apart(catalog, wanted, build)

    async def classify(self, ctx: RequestContext, params: Any) -> dict[str, Any]:
        """Classify a prospective call: paths, scope, approval and the decision."""
        named = self._named(params)
        p = await self.service.check_request(
            params_check.classify_args, named, named.get("arguments")
        )
        prepared = await self.service.prepare(
            p.tool, p.arguments, p.workspace, p.mode, p.headless, None
        )
        return self.service.classification_wire(prepared)

    async def invoke(self, ctx: RequestContext, params: Any) -> dict[str, Any]:
        """Run a tool: enforce the classification, stream events, answer the result."""
        named = self._named(params)
        p = await self.service.check_request(
            params_check.invoke_args, named, named.get("arguments")
        )
        connection = ctx.connection
        call_id, outcome = await self.service.invoke(
            InvokeRequest(
                tool=p.tool,
                arguments=p.arguments,
                workspace=p.workspace,
                call_id=p.call_id,
                catalog=p.catalog,
                mode=p.mode,
                headless=p.headless,
                approved=p.approved,
                session=p.session or "",
                images=p.images,
                traceparent=p.traceparent,
            ),
            _NativeSink(connection),
            connection.calls,
        )
        return outcome.to_wire(call_id)

    async def cancel(self, ctx: RequestContext, params: Any) -> dict[str, Any]:
        """Cancel an in-flight call by id (any connection's)."""
        p = params_check.cancel_args(self._named(params))
        try:
            self.service.cancel(p.call_id)
        except rpc_errors.UnknownCall:
            # An invoke of this connection's read before this cancel, whose task has not
            # registered its call yet: cancelled as it registers.
            if not ctx.connection.calls.cancel_announced(p.call_id):
                raise
        return {"cancelled": True}

    async def reload(self, ctx: RequestContext, params: Any) -> dict[str, Any]:
        """Rescan tool sets and answer what changed."""
        p = params_check.reload_args(self._named(params))
        workspace = self.service.workspace(p.workspace)
        if workspace is not None:
            config = self._reload_config() if self._reload_config is not None else None
            await self.service.catalog(workspace)
            outcome = await self.reload_catalogs([None, workspace])
            catalog = outcome.catalogs.get(workspace)
            if catalog is None:  # released as idle meanwhile (a reload builds no workspace)
                catalog = await self.service.catalog(workspace)
            changed = [c.to_wire() for c in outcome.changes.get(workspace, ())]
            notes = [note_info(n) for n in catalog.notes]
        else:
            config, outcome = await self.reload_all()
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
        params_check.no_args(self._named(params))
        if self._metrics_text is None:
            raise rpc_errors.MethodNotFound("Method not found: this daemon keeps no metrics.")
        text, content_type = self._metrics_text()
        return {"contentType": content_type, "text": text}

    async def reload_all(self) -> tuple[dict[str, Any] | None, ReloadOutcome]:
        """The config file, then every catalog: ``reload`` without a workspace, and SIGHUP's.

        Returns:
            ``reload``'s ``config`` member (None without a config reloader), and what the
            catalogs' reload found.
        """
        config = self._reload_config() if self._reload_config is not None else None
        return config, await self.reload_catalogs(None)

    async def reload_catalogs(
        self, workspaces: Iterable[Path | None] | None, reported: Reported | None = None
    ) -> ReloadOutcome:
        """The service's one reload path (kept here for the composition root's callers)."""
        return await self.service.reload_catalogs(workspaces, reported)

    async def _announce(
        self, key: Path | None, generation: int, changed: Sequence[dict[str, Any]]
    ) -> None:
        """``catalogChanged`` to the connections that listed ``key`` with ``subscribe``."""
        name = str(key) if key is not None else None
        params = {"workspace": name, "generation": generation, "changed": changed}
        for connection in list(self._connections()):
            if name in connection.subscriptions:
                await connection.notify(m.NOTIFICATION_CATALOG_CHANGED, params)
