"""The MCP face: one MCP session per bound host, independent of the transport.

Interface (for every transport: the Unix socket and stdio pump, Streamable HTTP)
---------------------------------------------------------------------------------
``McpServer(service, settings)`` is built once per daemon (it holds the key that signs
approval states). ``server.session(binding, outbox, calls, one_request=False)`` opens one
``McpSession`` (``one_request``: for one stateless request, its binding checked for it):

* ``binding``: ``Binding(workspace, catalog, mode, headless)``: the one workspace (a
  canonical path), catalog and approval mode this host sees. ``Binding.from_params``
  checks raw values.
* ``outbox``: an ``Outbox``, where the session sends messages that no response carries:
  ``post(message, droppable=False)`` commits one JSON-RPC message and never waits
  (``droppable`` for periodic progress a slow peer may miss); ``await drained()``
  returns once the peer has taken what was posted (the session waits on it after each
  progress line a tool reported, so a tool that floods its progress fd is slowed down
  rather than any line lost).
* ``calls``: the transport's own map of in-flight call ids to cancel events; the
  transport sets them all when the host goes away.

Then, for each JSON-RPC message from the host: ``response = await session.receive(message,
outbox=None)``. ``message`` is one decoded JSON value (a request, a notification, a
response to a request of ours, or garbage); ``response`` is the JSON-RPC response to send,
or None (notifications, responses, a cancelled request). Messages that belong to the
request (``notifications/progress``, the legacy ``elicitation/create`` request) go to
the given ``outbox``, else to the session's; for HTTP that is the request's own stream.
``receive`` may be called concurrently (one task per message): a ``tools/call`` runs for
as long as the tool does. ``session.close()`` is for when the host is gone: in-flight calls
are cancelled, waits for an elicitation answer end, subscriptions stop.

Theory of operation
-------------------
Both protocol eras are served on one session, decided per request:

* a request whose ``_meta`` carries ``io.modelcontextprotocol/protocolVersion`` is served
  statelessly by the 2026-07-28 rules (capabilities from the same ``_meta``; results carry
  ``resultType`` and ``serverInfo``; ``tools/list`` carries ``ttlMs`` and ``cacheScope``;
  ``subscriptions/listen`` opens the list_changed stream; approvals are input-required
  results whose ``requestState`` is signed). A version we do not serve is -32022;
* ``initialize`` (2025-06-18 or 2025-11-25) opens the legacy era for the session: its
  capabilities count for the requests after it, ``notifications/tools/list_changed`` go to
  the session's outbox, approvals are ``elicitation/create`` requests to the host;
* ``server/discover`` and ``ping`` need neither, so a host may probe ``server/discover``
  and then send ``initialize`` (2026-07-28 removed ``ping``: one that names it is -32601);
* any other request without either is -32602, saying what to send first; one read while
  an ``initialize`` is still under way (pipelined behind it) waits for it instead.

Everything a call means is the service's (``Service.invoke``); the mapping of its shapes
is in ``mcp_mapping.py``. The bookkeeping here is the MCP protocol's own: which requests
are in flight (for ``notifications/cancelled``: the call's cancel event is set, the
process group ends as any cancelled call's does, and no response or progress goes out for
it afterwards), the requests we sent the host (elicitation), and listen subscriptions.

Why one module of this size: the handshake eras, the stateless 2026 requests, list, call
(with progress, cancel and elicitation) and subscriptions all read the same per-request
era and the session's in-flight table; the shapes they translate live in
``mcp_mapping.py``.
"""

from __future__ import annotations

import contextlib
import itertools
import uuid
from collections.abc import Callable, Iterator, Mapping, MutableMapping, Sequence
from dataclasses import dataclass, field, replace
from decimal import Decimal, InvalidOperation
from functools import partial
from pathlib import Path
from typing import Any, Protocol

import anyio
import structlog
from toolsetd.protocol import __version__
from toolsetd.protocol import errors as rpc_errors
from toolsetd.protocol.jsontext import JsonNumber
from toolsetd.protocol.params import check_arguments, check_traceparent

from . import mcp_mapping as mapping
from .exhaustion import out_of_memory_in, request_out_of_memory
from .mcp_mapping import McpError
from .model import LARGE_CATALOG, Catalog
from .service import CatalogListener, InvokeRequest, Service, Unapproved, approval_digest

__all__ = [
    "CAPABILITIES_META",
    "MODERN_VERSIONS",
    "PROTOCOL_VERSION_META",
    "SUPPORTED_VERSIONS",
    "UNSUPPORTED_VERSION",
    "Binding",
    "McpServer",
    "McpSession",
    "McpSettings",
    "Outbox",
    "meta_version",
    "unsupported_version",
]

log = structlog.get_logger("toolsetd.mcp")

#: The requests that end when their host leaves (``McpSession.close``): they run a tool
#: or wait for good.
_WITH_HOST = frozenset({"tools/call", "subscriptions/listen"})
#: The methods served (in one era or the other).
_METHODS = frozenset(
    {"initialize", "ping", "server/discover", "tools/list", "tools/call", "subscriptions/listen"}
)
#: The fields of ``mcp.bind`` (and of the HTTP face's query).
_BIND_FIELDS = frozenset({"workspace", "catalog", "mode", "headless"})
#: Legacy revisions answered by ``initialize``, newest first.
HANDSHAKE_VERSIONS = ("2025-11-25", "2025-06-18")
#: Stateless revisions served by per-request ``_meta``.
MODERN_VERSIONS = ("2026-07-28",)
SUPPORTED_VERSIONS = (*MODERN_VERSIONS, *HANDSHAKE_VERSIONS)
#: MCP's "Unsupported protocol version" (``unsupported_version``).
UNSUPPORTED_VERSION = -32022

PROTOCOL_VERSION_META = "io.modelcontextprotocol/protocolVersion"
CAPABILITIES_META = "io.modelcontextprotocol/clientCapabilities"
_SERVER_INFO = "io.modelcontextprotocol/serverInfo"
_SUBSCRIPTION = "io.modelcontextprotocol/subscriptionId"
_SERVER = {"name": "toolsetd", "version": __version__}
_INSTRUCTIONS = (
    "The operator's external tools for this workspace (toolsetd). Every tool may write; "
    "calls that need approval are put to the operator."
)
_CAPABILITIES = {"tools": {"listChanged": True}}


def _traceparent(meta: Any) -> str | None:
    """``_meta.traceparent`` of a ``tools/call`` when it is a valid W3C one, else None.

    An invalid one is ignored, not refused: W3C Trace Context has a receiver that cannot
    parse the caller's context start a new trace, and a host's tracing bug must not
    fail its tool calls.
    """
    value = meta.get("traceparent") if isinstance(meta, dict) else None
    try:
        return check_traceparent(value)  # type: ignore[no-any-return]  # str or None
    except ValueError:
        return None


def _is_progress_token(token: object) -> bool:
    """A string or a JSON integer: a number with no fractional part, however written.

    MCP's schema types the token ``["string", "integer"]``, and JSON Schema's ``integer``
    is a number whose fraction is zero, so ``1.0``, ``1e3`` and ``-0`` (which arrive as a
    ``JsonNumber`` keeping their text, and are echoed as written) are tokens: a host whose
    serialiser writes its integer token as ``1.0`` had every such call refused. Decided on
    the text, in decimal: ``1.0000000000000000001`` is a float's ``1.0`` but no integer.
    An exponent past what ``decimal`` can hold (``1.5e99999999999999999999999``) is
    refused as not an integer (it raised: the call was an internal error).
    """
    if isinstance(token, str) or type(token) is int:
        return True
    if not isinstance(token, JsonNumber):
        return False
    try:
        number = Decimal(token.text)
        return number.is_finite() and number == number.to_integral_value()
    except InvalidOperation:  # an exponent past what decimal holds: no integer meant
        return False


class Outbox(Protocol):
    """Where a session sends messages no response carries (see the module docstring)."""

    def post(self, message: dict[str, Any], *, droppable: bool = False) -> None:
        """Commit one message to the peer, in order; never waits."""

    async def drained(self) -> None:
        """Return once the peer has taken every message posted so far (or is gone)."""


@dataclass(frozen=True, slots=True)
class McpSettings:
    """Limits of the MCP face.

    Attributes:
        page_size: Tools per ``tools/list`` page.
        elicitation_timeout: Seconds to wait for the host's answer to an approval request.
        state_ttl_seconds: How long an input-required approval state stays valid.
        list_ttl_ms: ``ttlMs`` of ``tools/list`` and ``server/discover`` (2026-07-28).
    """

    page_size: int = 1000
    elicitation_timeout: float = 600.0
    state_ttl_seconds: float = 600.0
    list_ttl_ms: int = 0


@dataclass(frozen=True, slots=True)
class Binding:
    """The workspace, catalog and approval mode one host is bound to.

    Attributes:
        workspace: The canonical workspace.
        catalog: ``plan``, ``work`` or None (every tool).
        mode: The approval mode (checked: one of the modes or an alias).
        headless: Nobody can be asked: ``ask`` becomes ``deny``.
    """

    workspace: Path
    catalog: str | None = None
    mode: str = "default"
    headless: bool = False

    @classmethod
    def from_params(cls, params: Any) -> Binding:
        """Check raw bind params (``workspace``, ``catalog?``, ``mode?``, ``headless?``).

        Raises:
            InvalidParams, InvalidWorkspace: A value is wrong; the message names it.
        """
        if not isinstance(params, dict):
            raise rpc_errors.InvalidParams("Invalid params: params must be an object.")
        # The first in the order sent (not sorted: a bind may hold millions of stray keys).
        unknown = next((key for key in params if key not in _BIND_FIELDS), None)
        if unknown is not None:
            raise rpc_errors.InvalidParams(
                f"Invalid params: unknown field '{unknown}'; expected workspace, catalog, "
                "mode, headless.",
                {"field": unknown},
            )
        raw = params.get("workspace")
        if not isinstance(raw, str):
            raise rpc_errors.InvalidParams(
                "Invalid params: 'workspace' must be an absolute path (a string).",
                {"field": "workspace"},
            )
        workspace = Service.workspace(raw)
        assert workspace is not None
        catalog = params.get("catalog")
        if catalog not in (None, "plan", "work"):
            raise rpc_errors.InvalidParams(
                "Invalid params: 'catalog' must be 'plan' or 'work'.", {"field": "catalog"}
            )
        mode = params.get("mode", "default")
        if not isinstance(mode, str):
            raise rpc_errors.InvalidParams(
                "Invalid params: 'mode' must be a string.", {"field": "mode"}
            )
        Service.mode(mode)
        headless = params.get("headless", False)
        if type(headless) is not bool:
            raise rpc_errors.InvalidParams(
                "Invalid params: 'headless' must be true or false.", {"field": "headless"}
            )
        return cls(workspace, catalog, mode, headless)


class McpServer:
    """The daemon-wide MCP core: opens sessions, holds the approval-state key.

    Args:
        service: The service core.
        settings: Limits.
    """

    def __init__(self, service: Service, settings: McpSettings | None = None) -> None:
        self.service = service
        self.settings = settings or McpSettings()
        self.signer = mapping.StateSigner(ttl_seconds=self.settings.state_ttl_seconds)
        self.pages = mapping.ToolPages()
        self._ids = itertools.count(1)
        #: The daemon is stopping: ``subscriptions/listen`` streams end with a result, and
        #: no approval is asked for.
        self.stopping = False
        #: Every ``subscriptions/listen`` request being served, of every session.
        self.listens: set[_InFlight] = set()
        #: Every ``tools/call`` waiting for the operator's answer to its approval request.
        self.asking: set[_InFlight] = set()

    async def listing(self, catalog: Catalog, wanted: str | None) -> mapping.Listing:
        """The listing of ``catalog`` under ``wanted`` from ``pages``: a large one is built
        in a worker thread (``LARGE_CATALOG``), one at a time per workspace and filter, so
        its ``tag`` and ``page`` cost the loop no more than a page. 20,000 tools took
        0.15-0.4 s there, at each host's first ``tools/list`` and at every reload any MCP
        session saw. The caller pages the listing returned: the cache keeps only the
        newest snapshot's, and one built for an older snapshot (a reload landed during its
        build) was built again on the loop by ``page``."""
        if len(catalog.tools) > LARGE_CATALOG:
            return await self.pages.listing_apart(catalog, wanted)
        return self.pages.listing(catalog, wanted)

    def end_waits(self) -> None:
        """A graceful stop: answer every ``subscriptions/listen`` with its completion
        result (MCP's graceful closure: a stream that just drops reads as an unexpected
        disconnect), and every one that comes later at once; answer every call waiting
        for the operator's approval (it did not run), its request to the host withdrawn."""
        self.stopping = True
        for flight in [*self.listens, *self.asking]:
            flight.ended = True
            if flight.wait_scope is not None:
                flight.wait_scope.cancel()

    def waiting(self) -> bool:
        """Whether a listen, or a call waiting for its approval, is still being served."""
        return bool(self.listens or self.asking)

    def session(
        self,
        binding: Binding,
        outbox: Outbox,
        calls: MutableMapping[str, anyio.Event],
        *,
        one_request: bool = False,
    ) -> McpSession:
        """Open a session for one host bound to ``binding``.

        ``one_request``: the session serves the one request its binding was checked for
        (a stateless HTTP exchange), so a call is judged in that checked workspace as it is.
        """
        return McpSession(self, binding, outbox, calls, next(self._ids), one_request)


@dataclass(slots=True, eq=False)  # eq=False: hashed by identity (McpServer.listens)
class _InFlight:
    """One request of the host being served."""

    cancel: anyio.Event = field(default_factory=anyio.Event)
    cancelled: bool = False
    #: A listen, or a wait for an approval, the server ended (a graceful stop):
    #: answered, unlike a cancelled one.
    ended: bool = False
    #: Cancelled when the request is cancelled while it waits (not while a tool runs:
    #: the call ends through ``cancel``, the way every cancelled call does).
    wait_scope: anyio.CancelScope | None = None
    #: Announced (``McpSession.announce``) and not yet taken up by ``receive``.
    announced: bool = False
    #: A tool call or a listen: cancelled when the host leaves (``McpSession.close``).
    #: Any other request is answered all the same: the transport may still carry it.
    with_host: bool = False
    #: An ``initialize``: never cancelled (MCP: a client MUST NOT cancel it), as it opens
    #: the session whether or not its answer goes out.
    initialize: bool = False
    #: Frees the request's slot in its transport's limit of requests in flight (the
    #: socket's), called when the host cancels it: it gets no response, so the host
    #: counts it done, while its tool may take up to the kill grace to end.
    release: Callable[[], None] | None = None

    @classmethod
    def of(cls, method: Any, *, announced: bool = False) -> _InFlight:
        """The flight of a request for ``method`` (as sent: any JSON value; an array or an
        object, unhashable, raised TypeError in the set's lookup and ended the host's
        connection where ``receive`` answers it -32600)."""
        with_host = type(method) is str and method in _WITH_HOST
        return cls(announced=announced, with_host=with_host, initialize=method == "initialize")


@dataclass(slots=True)
class _Asked:
    """A request we sent the host, waiting for its response."""

    done: anyio.Event = field(default_factory=anyio.Event)
    response: dict[str, Any] | None = None
    #: Whether it went out: an answer that comes before (its question held until
    #: ``notifications/initialized``) answers nothing the operator saw.
    posted: bool = False


@dataclass(frozen=True, slots=True)
class _Era:
    """How one request is served: its version and the capabilities it may count on."""

    version: str
    modern: bool
    capabilities: dict[str, Any]


class McpSession:
    """One host's MCP session (see the module docstring for the interface)."""

    def __init__(
        self,
        server: McpServer,
        binding: Binding,
        outbox: Outbox,
        calls: MutableMapping[str, anyio.Event],
        number: int,
        one_request: bool = False,
    ) -> None:
        self._server = server
        self._service = server.service
        self.binding = binding
        self._outbox = outbox
        self._calls = calls
        self.session_id = f"mcp-{number}-{uuid.uuid4().hex[:8]}"
        self._call_ids = itertools.count(1)
        self._asked_ids = itertools.count(1)
        #: The binding's workspace, checked for the one request this session serves, else
        #: None (a bound session's calls have it checked again: it may be gone since).
        self._checked_workspace = binding.workspace if one_request else None
        #: The legacy era's negotiated version (after ``initialize``), else None.
        self.legacy_version: str | None = None
        self._legacy_caps: dict[str, Any] = {}
        #: An initialize is under way (its catalog not built yet): set when it ends.
        self._initializing: anyio.Event | None = None
        #: The host sent ``notifications/initialized``: from then on we may send it requests.
        self._initialized = anyio.Event()
        self._in_flight: dict[Any, _InFlight] = {}
        self._asked: dict[Any, _Asked] = {}
        #: Open ``subscriptions/listen`` requests: request id -> their outbox.
        self._listens: dict[Any, tuple[Outbox, _InFlight]] = {}
        self._closed = False
        #: The tag (``ToolPages.tag``) of the tools/list the host knows of, as of its
        #: initialize, its first listen or the last reload: list_changed goes out when a
        #: reload changes that list, not for every change of the workspace's sets (a tool of
        #: the catalog the binding leaves out, a set refused for another reason). None: not
        #: known yet, so every change is told.
        self._listed: str | None = None
        listener: CatalogListener = self._catalog_changed
        self._stop_listening = self._service.listen(binding.workspace, listener)

    # -- the interface -------------------------------------------------------------------

    async def receive(self, message: Any, outbox: Outbox | None = None) -> Any:
        """Serve one message from the host; returns the response, or None."""
        out = outbox or self._outbox
        if type(message) is list:
            return _error(
                None,
                McpError(
                    -32600,
                    "Invalid Request: MCP does not take batches; "
                    "send one JSON-RPC message per line.",
                ),
            )
        if type(message) is not dict:
            return _error(None, McpError(-32600, "Invalid Request: expected a JSON object."))
        request_id = message.get("id", _ABSENT)
        if "method" not in message:
            if request_id is not _ABSENT and ("result" in message or "error" in message):
                self._answered(message)  # the host's answer to a request of ours
                return None
            return _error(
                request_id,
                McpError(-32600, "Invalid Request: a message needs 'method' (or is a response)."),
            )
        if message.get("jsonrpc") != "2.0":
            return _error(
                request_id, McpError(-32600, "Invalid Request: 'jsonrpc' must be exactly \"2.0\".")
            )
        if request_id is _ABSENT:
            await self._notification(message)
            return None
        if not mapping.is_request_id(request_id):
            return _error(
                None, McpError(-32600, "Invalid Request: 'id' must be a string or an integer.")
            )
        flight = self._in_flight.get(request_id)
        if flight is not None and flight.announced:
            flight.announced = False  # this request's own, made when it was read
        elif flight is not None:
            return _error(
                request_id,
                McpError(
                    -32600,
                    f"Invalid Request: id {request_id!r} is already in flight; use a new id.",
                ),
            )
        else:
            flight = self._in_flight[request_id] = _InFlight.of(message.get("method"))
        try:
            result = await self._request(request_id, message, out, flight)
        except McpError as exc:
            response: Any = _error(request_id, exc)
        except rpc_errors.RpcError as exc:
            response = _error(request_id, McpError(exc.code, exc.message, exc.data))
        except anyio.get_cancelled_exc_class():
            raise
        except Exception as exc:
            if out_of_memory_in(exc):
                busy = request_out_of_memory(message.get("method"))
                response = _error(request_id, McpError(busy.code, busy.message, busy.data))
            else:
                incident = uuid.uuid4().hex[:12]
                log.exception("mcp_request_failed", incident=incident, method=message.get("method"))
                response = _error(
                    request_id,
                    McpError(
                        -32603,
                        f"Internal error (incident {incident}); the daemon log has the details.",
                        {"incident": incident},
                    ),
                )
        else:
            response = (
                None if result is None else {"jsonrpc": "2.0", "id": request_id, "result": result}
            )
        finally:
            del self._in_flight[request_id]
        if flight.cancelled:
            return None  # no response for a cancelled request
        return response

    def announce(self, message: Any, release: Callable[[], None] | None = None) -> None:
        """A request was read and handed to a task that will ``receive`` it: it is in
        flight from now on, so a ``notifications/cancelled`` read right behind it (served
        at once, before that task has begun) finds it and cancels it, and calls
        ``release`` (its transport's in-flight slot). A request whose id is in flight
        already is left to ``receive``, which refuses it."""
        if type(message) is not dict or "method" not in message:
            return
        request_id = message.get("id")
        if (
            message.get("jsonrpc") == "2.0"  # else ``receive`` refuses it before its flight
            and mapping.is_request_id(request_id)
            and request_id not in self._in_flight
        ):
            flight = _InFlight.of(message.get("method"), announced=True)
            flight.release = release
            self._in_flight[request_id] = flight

    def close(self) -> None:
        """The host is gone: cancel its calls, end its waits and subscriptions. Its other
        requests (initialize, tools/list, ...) finish and are answered: a host that wrote
        them and closed its input (a script's pipe) may still read their answers."""
        if self._closed:
            return
        self._closed = True
        self._stop_listening()
        for flight in list(self._in_flight.values()):
            if flight.with_host:
                self._cancel(flight)
        for asked in self._asked.values():
            asked.done.set()

    def version_of(self, message: Any = None) -> str | None:
        """The protocol version a message will be served by, as known before serving it.

        That is the version its ``_meta`` names (the 2026-07-28 rules), else the one
        ``initialize`` agreed on for this session, else None (not known yet: a probe, or
        a request the session will refuse). Without a message: the session's version.
        """
        version = meta_version(message)
        if isinstance(version, str):
            return version
        return self.legacy_version

    async def tool_schema(self, name: str) -> tuple[str, Mapping[str, Any]] | None:
        """The hash (contract section 4: it covers the schema) and the schema
        ``tools/list`` gives the tool ``name`` of this binding, or None.

        None when no such tool is served (not in the binding's catalog, or its tool sets
        cannot be read now): the call itself then answers why.
        """
        try:
            catalog = await self._service.catalog(self.binding.workspace)
            loaded = Service.lookup(catalog, name, self.binding.catalog)
        except rpc_errors.RpcError:
            return None
        return loaded.hash, loaded.tool.schema

    # -- dispatch ------------------------------------------------------------------------

    async def _notification(self, message: dict[str, Any]) -> None:
        method = message.get("method")
        params = message.get("params")
        if method == "notifications/cancelled" and isinstance(params, dict):
            cancelled = params.get("requestId")
            # Only a string or an integer can name a request in flight (an object or an
            # array, unhashable, names none: the notification is ignored like any other).
            flight = self._in_flight.get(cancelled) if mapping.is_request_id(cancelled) else None
            # A cancel of initialize is ignored, as MCP lets a receiver ignore one for a
            # request that cannot be cancelled: it opens the session either way, and its
            # answer withheld left a host that sent it again refused "already initialized".
            if flight is not None and not flight.initialize:
                # MCP's reason is a string; anything else is not logged (str() of a list
                # nested a thousand deep, which the parser takes, raised RecursionError
                # and ended the host's connection, its calls and all).
                reason = params.get("reason")
                log.info(
                    "mcp_request_cancelled", reason=reason[:200] if type(reason) is str else ""
                )
                self._cancel(flight)
                # It gets no response, so for the host it is over: its slot is free now,
                # not once its tool has ended (up to the kill grace later), or the host's
                # next requests, a ping too, were refused busy, told to wait for a
                # response that never comes. ``--max-running`` still counts the tool.
                if flight.release is not None:
                    flight.release()
        elif method == "notifications/initialized":
            # Counted whenever it comes (twice is once; one before initialize, a host's
            # mistake, still says it is ready): the SDKs' servers take it so too.
            self._initialized.set()
        # roots/list_changed and the like need nothing from us; unknown notifications are
        # ignored, as JSON-RPC asks.

    def _answered(self, message: dict[str, Any]) -> None:
        answered = message.get("id")
        asked = self._asked.get(answered) if mapping.is_request_id(answered) else None
        # A request has one response (JSON-RPC): the first is the operator's answer. A
        # second for the same id, read before the call took the first (a decline then an
        # accept in one write), must not replace it; one for an id we never sent, or no
        # longer wait for, names nothing and is ignored; so does one that came before the
        # question went out (held until initialized): a stale answer, not the operator's.
        if asked is not None and asked.posted and asked.response is None:
            asked.response = message
            asked.done.set()

    def _cancel(self, flight: _InFlight) -> None:
        flight.cancelled = True
        flight.cancel.set()
        if flight.wait_scope is not None:
            flight.wait_scope.cancel()

    @contextlib.contextmanager
    def _wait_scope(self, flight: _InFlight) -> Iterator[None]:
        """A wait of ``flight``'s that its cancellation (or the session's close) ends.

        The request may have been cancelled, or the session closed, before the wait
        began (while its catalog was being built, or its tool ran): ``_cancel`` found no
        scope then, so the wait starts cancelled. Else a request whose client left would
        wait for good (a listen) or for the elicitation timeout, holding its transport
        (an HTTP connection) all that time.
        """
        with anyio.CancelScope() as scope:
            flight.wait_scope = scope
            if flight.cancelled or flight.ended or self._closed:
                scope.cancel()
            try:
                yield
            finally:
                flight.wait_scope = None

    async def _request(
        self, request_id: Any, message: dict[str, Any], out: Outbox, flight: _InFlight
    ) -> Any:
        method = message.get("method")
        params = message.get("params", {})
        if params is None:
            params = {}
        if not isinstance(method, str) or not isinstance(params, (dict, list)):
            raise McpError(
                -32600, "Invalid Request: 'method' must be a string and 'params' an object."
            )
        if isinstance(params, list):  # well-formed JSON-RPC, but MCP passes params by name
            raise McpError(
                -32602, f"Invalid params: {method} takes its params by name, as an object."
            )
        _check_meta(params)
        if method == "initialize":
            return await self._initialize(message.get("params"))
        initializing = self._initializing
        if (
            initializing is not None
            and method not in ("ping", "server/discover")
            and meta_version(message) is None
        ):
            # Pipelined behind an initialize that is still building its catalog: it was
            # sent after it, so it is served under what it agrees on (the host's order
            # holds), not refused as sent before it. (That build always ends.)
            await initializing.wait()
            if flight.cancelled:
                return None
        era = self._era(method, params)
        if method == "ping":
            if era.modern:
                # 2026-07-28 removed ping: a request that names the revision is served by
                # its rules, and it has no such method (an unversioned probe is answered).
                raise McpError(
                    -32601,
                    f"Method not found: 'ping' is no method of protocol {era.version} (that "
                    "revision removed it); send it without a protocol version in _meta, or "
                    "in a session opened by initialize.",
                    {"method": method},
                )
            return self._complete(era, {})
        if method == "server/discover":
            return self._discover(era)
        if method == "tools/list":
            return await self._tools_list(era, params)
        if method == "tools/call":
            return await self._tools_call(era, params, out, flight)
        if method == "subscriptions/listen":
            return await self._listen(era, request_id, params, out, flight)
        raise _method_not_found(method)

    def _era(self, method: str, params: dict[str, Any]) -> _Era:
        meta = params.get("_meta")
        version = meta.get(PROTOCOL_VERSION_META) if isinstance(meta, dict) else None
        if version is not None:
            if not isinstance(version, str):
                # Malformed, not a version we do not serve: -32022's data.requested is a
                # string (the schema), and the value, however large, is not echoed.
                raise McpError(
                    -32602,
                    f"Invalid params: '_meta.{PROTOCOL_VERSION_META}' must be a string (a "
                    f"protocol version, such as '{MODERN_VERSIONS[-1]}').",
                    {"field": f"_meta.{PROTOCOL_VERSION_META}"},
                )
            if version not in MODERN_VERSIONS:
                raise unsupported_version(version)
            assert isinstance(meta, dict)
            caps = meta.get(CAPABILITIES_META)
            if not isinstance(caps, dict):
                # A required field of the request (MCP: a request missing one is malformed,
                # -32602), not a host that declared nothing: that one sends {}.
                raise McpError(
                    -32602,
                    f"Invalid params: a {version} request must carry "
                    f"'_meta.{CAPABILITIES_META}', the client's capabilities for it, as an "
                    "object ({} when it declares none).",
                    {"field": f"_meta.{CAPABILITIES_META}"},
                )
            return _Era(version, True, caps)
        if self.legacy_version is not None:
            return _Era(self.legacy_version, False, self._legacy_caps)
        if method in ("ping", "server/discover"):
            return _Era(MODERN_VERSIONS[-1], method == "server/discover", {})
        if method not in _METHODS:
            # Not served whatever comes first: -32601, as the SDK's server answers it
            # before the handshake too (a host probing a method keys off that code), not
            # "initialize first", which would not make it one.
            raise _method_not_found(method)
        raise McpError(
            -32602,
            f"Invalid params: '{method}' before initialize: send initialize first (protocol "
            f"{' or '.join(HANDSHAKE_VERSIONS)}), or carry _meta "
            f"'{PROTOCOL_VERSION_META}': '{MODERN_VERSIONS[-1]}' on every request.",
            {"field": "_meta"},
        )

    @staticmethod
    def _complete(era: _Era, result: dict[str, Any]) -> dict[str, Any]:
        """A result for ``era``: 2026-07-28 adds ``resultType`` (unless set) and serverInfo."""
        if era.modern:
            result = {"resultType": "complete", **result}
            meta = dict(result.get("_meta") or {})
            meta[_SERVER_INFO] = _SERVER
            result["_meta"] = meta
        return result

    # -- lifecycle -----------------------------------------------------------------------

    async def _initialize(self, params: Any) -> dict[str, Any]:
        _check_initialize(params)
        if self.legacy_version is not None or self._initializing is not None:
            # MCP's lifecycle: initialize is the session's first exchange, once. A second
            # one would change the version and capabilities the first agreed on under the
            # requests already in flight. (One that failed may be sent again.)
            agreed = self.legacy_version or "still being agreed"
            raise McpError(
                -32600,
                f"Invalid Request: this session is already initialized (protocol {agreed}); "
                "start a new session to initialize again.",
            )
        asked = params["protocolVersion"]
        version = asked if asked in HANDSHAKE_VERSIONS else HANDSHAKE_VERSIONS[0]
        caps: dict[str, Any] = params["capabilities"]
        done = self._initializing = anyio.Event()
        try:
            catalog = await self._service.catalog(self.binding.workspace)  # watched from now
            await self._know_list(catalog)
        finally:
            self._initializing = None
            done.set()
        self._legacy_caps = caps
        self.legacy_version = version
        return {
            "protocolVersion": version,
            "capabilities": _CAPABILITIES,
            "serverInfo": _SERVER,
            "instructions": _INSTRUCTIONS,
        }

    def _discover(self, era: _Era) -> dict[str, Any]:
        return self._complete(
            _Era(era.version, True, era.capabilities),
            {
                "supportedVersions": list(SUPPORTED_VERSIONS),
                "capabilities": _CAPABILITIES,
                "instructions": _INSTRUCTIONS,
                "ttlMs": self._server.settings.list_ttl_ms,
                "cacheScope": "private",
            },
        )

    # -- tools ---------------------------------------------------------------------------

    async def _tools_list(self, era: _Era, params: dict[str, Any]) -> dict[str, Any]:
        catalog = await self._service.catalog(self.binding.workspace)
        listing = await self._server.listing(catalog, self.binding.catalog)
        tools, cursor = self._server.pages.page(
            listing, params.get("cursor"), self._server.settings.page_size
        )
        result: dict[str, Any] = {"tools": tools}
        if cursor is not None:
            result["nextCursor"] = cursor
        if era.modern:
            result["ttlMs"] = self._server.settings.list_ttl_ms
            result["cacheScope"] = "private"
        return self._complete(era, result)

    async def _tools_call(
        self, era: _Era, params: dict[str, Any], out: Outbox, flight: _InFlight
    ) -> dict[str, Any]:
        name = params.get("name")
        if not isinstance(name, str):
            raise McpError(
                -32602,
                "Invalid params: 'name' must be the tool's name (a string).",
                {"field": "name"},
            )
        arguments = params.get("arguments", {})
        if arguments is None:
            arguments = {}
        if not isinstance(arguments, dict):
            # MCP's CallToolRequest: the arguments by name. Anything else is a malformed
            # request (a protocol error), not one the tool's schema may happen to pass.
            raise McpError(
                -32602,
                "Invalid params: 'arguments' must be an object (the tool's arguments by name).",
                {"field": "arguments"},
            )
        try:  # the native face's cap (protocol/params.py): every echo of them stays encodable
            await self._service.check_request(check_arguments, arguments, arguments)
        except ValueError as exc:
            raise McpError(
                -32602, f"Invalid params: 'arguments' {exc}", {"field": "arguments"}
            ) from None
        meta = params.get("_meta")
        token = meta.get("progressToken") if isinstance(meta, dict) else None
        if token is not None and not _is_progress_token(token):
            # MCP: a progress token MUST be a string or an integer; anything else would be
            # echoed back in every notifications/progress as the host never sent it.
            raise McpError(
                -32602,
                "Invalid params: '_meta.progressToken' must be a string or an integer.",
                {"field": "_meta.progressToken"},
            )
        binding = self.binding
        request = InvokeRequest(
            traceparent=_traceparent(meta),
            tool=name,
            arguments=arguments,
            workspace=str(binding.workspace),
            call_id=f"{self.session_id}-{next(self._call_ids)}",
            catalog=binding.catalog,
            mode=binding.mode,
            headless=binding.headless,
            session=self.session_id,
            images=True,
            every_progress_line=True,
            checked_workspace=self._checked_workspace,
        )
        # What a requestState is bound to (an encode of the arguments: large ones in the
        # worker slot), made at most once: a retry whose state is stale is asked again.
        key: str | None = None
        if era.modern and ("requestState" in params or "inputResponses" in params):
            key = await self._service.check_request(
                partial(mapping.call_key, binding_key(binding), name), arguments, arguments
            )
            answer = mapping.approval_answer(
                self._server.signer, params, binding_key(binding), name, arguments, key=key
            )
            if answer.declined:
                return self._complete(era, mapping.declined_result(answer.action))
            request = replace(request, approved_digest=answer.digest)
        sink = mapping.ProgressSink(out, token, lambda: flight.cancelled)
        try:
            return self._complete(era, await self._run(request, sink, flight))
        except Unapproved as exc:
            classification = exc.data if isinstance(exc.data, dict) else {}
            if not mapping.can_elicit(era.capabilities):
                return self._complete(era, mapping.approval_unavailable_result(classification))
            # Each of these encodes the arguments: large ones in the worker slot, as their
            # checks were (three million fractions took the event loop 0.35 s an encode).
            check = self._service.check_request
            # Of the tool as it was judged: an accept does not run it edited meanwhile.
            digest = await check(
                partial(approval_digest, tool=exc.tool_hash), classification, arguments
            )
            if era.modern:
                elicitation = await check(
                    partial(mapping.elicitation_params, with_mode=True), classification, arguments
                )
                if key is None:
                    key = await check(
                        partial(mapping.call_key, binding_key(binding), name), arguments, arguments
                    )
                return self._complete(
                    era,
                    mapping.input_required_result(
                        self._server.signer,
                        classification,
                        digest,
                        binding_key(binding),
                        name,
                        arguments,
                        elicitation=elicitation,
                        key=key,
                    ),
                )
            action = await self._elicit(out, flight, classification, era)
            if action != "accept":
                return mapping.declined_result(action)
            request = replace(request, approved_digest=digest)
            try:
                return await self._run(request, sink, flight)
            except Unapproved:
                return mapping.changed_result()

    async def _run(
        self, request: InvokeRequest, sink: mapping.ProgressSink, flight: _InFlight
    ) -> dict[str, Any]:
        """Invoke through the service; the policy's refusals become MCP shapes."""
        try:
            _, outcome = await self._service.invoke(request, sink, self._calls, flight.cancel)
        except rpc_errors.UnknownTool as exc:
            raise McpError(-32602, exc.message, exc.data) from None
        except (rpc_errors.InvalidArguments, rpc_errors.PolicyDenied) as exc:
            return mapping.refusal_result(exc)
        return mapping.call_result(outcome)

    async def _elicit(
        self, out: Outbox, flight: _InFlight, classification: dict[str, Any], era: _Era
    ) -> str:
        """Ask the operator through the host (legacy ``elicitation/create``): the action."""
        # Made first: with large arguments it is awaited (the worker slot), and a cancel or a
        # close that comes meanwhile must still keep the question from the operator.
        params = await self._service.check_request(
            partial(mapping.elicitation_params, with_mode=era.version != "2025-06-18"),
            classification,
            classification.get("arguments"),
        )
        if flight.cancelled or self._closed:
            return "cancel"  # cancelled before the question: put none to the operator
        if self._server.stopping:
            return "stopping"  # an answer the daemon would not wait for
        asked_id = f"toolsetd-elicit-{next(self._asked_ids)}"
        asked = self._asked[asked_id] = _Asked()
        self._server.asking.add(flight)
        try:
            with self._wait_scope(flight):
                with anyio.move_on_after(self._server.settings.elicitation_timeout):
                    if not self._initialized.is_set():
                        # MCP's lifecycle: the server SHOULD NOT send requests (but pings
                        # and logging) before the host's notifications/initialized. A call
                        # that overtook it (pipelined, or a POST that came first) keeps its
                        # place and its question waits, rather than be refused as a host
                        # without elicitation: the host MUST send it, at once.
                        log.info("mcp_approval_held", tool=str(classification.get("tool")))
                        await self._initialized.wait()
                    asked.posted = True
                    out.post(
                        {
                            "jsonrpc": "2.0",
                            "id": asked_id,
                            "method": "elicitation/create",
                            "params": params,
                        }
                    )
                    await asked.done.wait()
        finally:
            self._server.asking.discard(flight)
            del self._asked[asked_id]
            if asked.posted and asked.response is None and not self._closed:
                # We stop waiting (the call was cancelled, the daemon is stopping, or no
                # answer came in time): MCP has the sender cancel its request, so the host
                # takes the question down rather than leave the operator an accept that
                # would run nothing.
                reason = (
                    "the call was cancelled"
                    if flight.cancelled
                    else "toolsetd is stopping"
                    if flight.ended
                    else "no answer in time"
                )
                out.post(
                    {
                        "jsonrpc": "2.0",
                        "method": "notifications/cancelled",
                        "params": {"requestId": asked_id, "reason": reason},
                    }
                )
        response = asked.response
        if response is None:
            if flight.cancelled or self._closed:
                return "cancel"
            if flight.ended:
                return "stopping"
            return "timeout" if asked.posted else "uninitialized"
        # A JSON-RPC 2.0 response, else not an accept: with both a result and an error, or
        # another version (or none), it is no answer of the operator's.
        action = (
            mapping.elicit_action(response.get("result"))
            if response.get("jsonrpc") == "2.0" and "error" not in response
            else None
        )
        return "error" if action is None else action

    # -- list_changed --------------------------------------------------------------------

    async def _listen(
        self, era: _Era, request_id: Any, params: dict[str, Any], out: Outbox, flight: _InFlight
    ) -> dict[str, Any] | None:
        if not era.modern:
            raise McpError(
                -32601,
                "Method not found: 'subscriptions/listen' is a 2026-07-28 "
                "method; after initialize, list_changed comes unasked.",
            )
        server = self._server
        wanted = params.get("notifications")
        honoured = (
            {"toolsListChanged": True}
            if isinstance(wanted, dict) and wanted.get("toolsListChanged") is True
            else {}
        )
        server.listens.add(flight)
        if server.stopping:
            flight.ended = True
        try:
            if honoured:
                # A change is a difference to a snapshot: there is one to differ from
                # before the acknowledgement goes out. Taken after it, a change the host
                # made on seeing it (a tool set edited) was in the snapshot already, and
                # never announced.
                await self._know_list(await self._service.catalog(self.binding.workspace))
            out.post(
                {
                    "jsonrpc": "2.0",
                    "method": "notifications/subscriptions/acknowledged",
                    "params": {"_meta": {_SUBSCRIPTION: request_id}, "notifications": honoured},
                }
            )
            if honoured:  # told of changes from now on, never before its acknowledgement
                self._listens[request_id] = (out, flight)
            with self._wait_scope(flight):
                await anyio.sleep_forever()
        finally:
            self._listens.pop(request_id, None)
            server.listens.discard(flight)
        if flight.ended and not flight.cancelled and not self._closed:
            # The daemon is stopping: MCP's graceful closure, the listen's own result.
            return self._complete(era, {"_meta": {_SUBSCRIPTION: request_id}})
        return None  # cancelled: no response goes out

    async def _know_list(self, catalog: Catalog) -> None:
        """The host is served ``catalog`` from now on: the list a change differs from."""
        if self._listed is None:
            listing = await self._server.listing(catalog, self.binding.catalog)
            if self._listed is None:  # not taken by a change meanwhile
                self._listed = listing.tag

    async def _catalog_changed(
        self, key: Path | None, generation: int, changed: Sequence[dict[str, Any]]
    ) -> None:
        if self._closed:
            return
        registry = self._service.registry
        catalog = registry.cached(self.binding.workspace)
        listing: mapping.Listing | None = None
        while catalog is not None:
            listing = await self._server.listing(catalog, self.binding.catalog)
            if self._closed:
                return
            # A reload that landed while this one's listing was built was checked first
            # when its catalog needed no build: this older snapshot's list, noted after
            # it, was taken for the one the host knew. The newest is compared instead.
            newest = registry.cached(self.binding.workspace)
            if newest is None or newest is catalog:
                break
            catalog = newest
        if listing is not None:
            listed = listing.tag
            unchanged = listed == self._listed
            self._listed = listed
            if unchanged:
                return
        if self.legacy_version is not None:
            self._outbox.post({"jsonrpc": "2.0", "method": "notifications/tools/list_changed"})
        for request_id, (out, _) in list(self._listens.items()):
            out.post(
                {
                    "jsonrpc": "2.0",
                    "method": "notifications/tools/list_changed",
                    "params": {"_meta": {_SUBSCRIPTION: request_id}},
                }
            )


def _check_initialize(params: Any) -> None:
    """Refuse ``initialize`` params MCP's ``InitializeRequestParams`` does not allow
    (-32602 naming the field), as the SDKs' servers do.

    Every field checked is required by the schema of both handshake revisions, and every
    host of docs/mcp.md sends it (the SDKs' clients build it, and their servers refuse
    it missing): ``protocolVersion`` (a string), ``capabilities`` (an object) and
    ``clientInfo`` (an object with string ``name`` and ``version``). Taken as they were, a
    host that sent ``capabilities: "x"`` was served as one that declared nothing, a
    mistake it was never told of. Fields beyond these (``title``, ``icons``, ``_meta``,
    another revision's) are left alone: the schema keeps these objects open.
    """
    if not isinstance(params, dict):
        raise McpError(
            -32602,
            "Invalid params: initialize needs its 'params': an object with protocolVersion, "
            "capabilities and clientInfo.",
            {"field": "params"},
        )
    if not isinstance(params.get("protocolVersion"), str):
        raise McpError(
            -32602,
            "Invalid params: initialize needs 'protocolVersion', the latest protocol version "
            f"the client supports, as a string (such as '{HANDSHAKE_VERSIONS[0]}').",
            {"field": "protocolVersion"},
        )
    if not isinstance(params.get("capabilities"), dict):
        raise McpError(
            -32602,
            "Invalid params: initialize needs 'capabilities', the client's capabilities, as "
            "an object ({} when it declares none).",
            {"field": "capabilities"},
        )
    info = params.get("clientInfo")
    if not isinstance(info, dict):
        raise McpError(
            -32602,
            "Invalid params: initialize needs 'clientInfo', the client's name and version, as "
            'an object such as {"name": "my-host", "version": "1.0"}.',
            {"field": "clientInfo"},
        )
    for name in ("name", "version"):
        if not isinstance(info.get(name), str):
            raise McpError(
                -32602,
                f"Invalid params: initialize needs 'clientInfo.{name}', the client's {name}, "
                "as a string.",
                {"field": f"clientInfo.{name}"},
            )


def _check_meta(params: dict[str, Any]) -> None:
    """Refuse a request whose ``_meta`` is not an object (MCP's schema). One of another
    type was read as none, so the version, capabilities or progress token the host meant
    were lost unsaid (the SDK's server refuses it too; null it takes as none, as here)."""
    meta = params.get("_meta")
    if meta is not None and not isinstance(meta, dict):
        raise McpError(
            -32602, "Invalid params: '_meta' must be an object (or left out).", {"field": "_meta"}
        )


def meta_version(message: Any) -> Any:
    """The protocol version a message's ``params._meta`` names, as sent (any JSON value;
    None when it names none)."""
    params = message.get("params") if isinstance(message, dict) else None
    meta = params.get("_meta") if isinstance(params, dict) else None
    return meta.get(PROTOCOL_VERSION_META) if isinstance(meta, dict) else None


def malformed_envelope(error: Any) -> bool:
    """Whether ``error`` (a response's) refuses the request's per-request ``_meta`` fields:
    its protocol version or its client capabilities, missing or not of their type. Such a
    request is malformed, which the HTTP transport MUST answer ``400 Bad Request``."""
    if not isinstance(error, dict) or error.get("code") != rpc_errors.InvalidParams.CODE:
        return False
    data = error.get("data")
    return isinstance(data, dict) and data.get("field") in (
        f"_meta.{PROTOCOL_VERSION_META}",
        f"_meta.{CAPABILITIES_META}",
    )


def _method_not_found(method: str) -> McpError:
    return McpError(
        -32601,
        f"Method not found: '{method}'. toolsetd serves tools only: {', '.join(sorted(_METHODS))}.",
        {"method": method},
    )


def unsupported_version(version: Any) -> McpError:
    """The error for a protocol version toolsetd does not serve (-32022, listing those it
    does), whether a request's ``_meta`` or a transport's header named it."""
    return McpError(
        UNSUPPORTED_VERSION,
        f"Unsupported protocol version {version!r}: toolsetd serves "
        f"{', '.join(MODERN_VERSIONS)} per request, and "
        f"{', '.join(HANDSHAKE_VERSIONS)} through initialize.",
        {"supported": list(SUPPORTED_VERSIONS), "requested": version},
    )


def binding_key(binding: Binding) -> str:
    """What an approval state is bound to, besides the call: the host's binding."""
    return f"{binding.workspace}\x00{binding.catalog}\x00{binding.mode}\x00{binding.headless}"


_ABSENT: Any = object()


def _error(request_id: Any, exc: McpError) -> dict[str, Any]:
    return mapping.error_response(request_id, exc.to_error())
