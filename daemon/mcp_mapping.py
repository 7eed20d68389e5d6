"""The MCP face's shapes: tools, results, progress, approvals (pure but for the clock).

Theory of operation
-------------------
``mcp_session.py`` decides what to do with a request; this module says how toolsetd's
values look in MCP (contract section 7, the table in ``docs/mcp.md``):

* ``ToolPages``: ``tools/list`` entries of a catalog snapshot, computed (and each page
  encoded) once per snapshot and catalog filter, ordered by name (deterministic), paged
  by an opaque cursor that names the snapshot it was cut from (a cursor of an older
  snapshot is -32602: list again). Each entry: ``name``, ``description``,
  ``inputSchema`` as declared, shaped as MCP's hosts take it (``mcpschema``: JSON
  Schema 2020-12, no root ``allOf``/``anyOf``/``oneOf``, ``type: "object"`` at its root,
  its root ``properties`` objects, no ``x-mcp-header`` marks that break MCP's rules; a
  tool whose parse noted it cannot be shown, ``is_unlisted``, is left out),
  ``annotations`` (``readOnlyHint: false``, ``destructiveHint: true``: every external
  tool has write authority), ``_meta`` with ``toolsetd/set``, ``toolsetd/source``,
  ``toolsetd/hash``.
* results: a run's content and ``isError`` as they are (text and image blocks have the
  same shape in both); a schema or fence refusal and a ``deny`` are ``isError`` results
  whose text names each JSON Pointer (SEP-1303: the model can correct itself).
* ``ProgressSink``: the service's call events as ``notifications/progress`` on the
  request's token. ``progress`` is in percent when the tool reports a fraction (with
  ``total: 100``); a report that would not increase it (a tick, a message, a fraction
  that went back) is nudged up by a millionth, so ``progress`` increases strictly (past
  100% too: 100.000001 of 100, which a host rounds; ``total`` goes with every fraction).
  A line the tool wrote is never dropped (the sink waits for the peer instead); a
  periodic tick may be, for a peer that is behind.
* approvals: the ``elicitation/create`` params that show the classification (reason,
  scope, paths, arguments); the 2026-07-28 input-required result with a ``requestState``
  signed by ``StateSigner`` (HMAC-SHA256 over the approved classification's digest, the
  host's binding, the tool, the arguments' digest, a serial number and an expiry), and
  reading the retry: an accept spends its state, so a replay is asked again.
"""

from __future__ import annotations

import base64
import functools
import hashlib
import hmac
import itertools
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson
from toolsetd.protocol import errors as rpc_errors
from toolsetd.protocol.jsonrpc import is_request_id
from toolsetd.protocol.jsontext import RawJson
from toolsetd.protocol.jsontext import dumps as json_dumps
from toolsetd.protocol.jsontext import loads as json_loads
from toolsetd.protocol.printable import printable

from .mcpschema import is_unlisted, listed_schema
from .model import Catalog, CatalogName, SnapshotCache
from .runner import CallOutcome
from .service import Completion, ProgressReport

__all__ = [
    "APPROVAL_KEY",
    "Answer",
    "Listing",
    "McpError",
    "ProgressSink",
    "StateSigner",
    "ToolPages",
    "approval_answer",
    "approval_unavailable_result",
    "call_key",
    "call_result",
    "can_elicit",
    "changed_result",
    "declined_result",
    "elicit_action",
    "elicitation_params",
    "error_response",
    "input_required_result",
    "is_request_id",
    "refusal_result",
]

#: The key of toolsetd's one input request in an input-required result.
APPROVAL_KEY = "toolsetd_approval"
_ANNOTATIONS = {"readOnlyHint": False, "destructiveHint": True}
_NUDGE = 1e-6
_MAX_SHOWN_ARGUMENTS = 2000


class McpError(Exception):
    """A JSON-RPC error answer of the MCP face (its codes are MCP's, not toolsetd's)."""

    def __init__(self, code: int, message: str, data: Any = None) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.data = data

    def to_error(self) -> dict[str, Any]:
        """The JSON-RPC ``error`` member."""
        error: dict[str, Any] = {"code": self.code, "message": self.message}
        if self.data is not None:
            error["data"] = self.data
        return error


def error_response(request_id: Any, error: dict[str, Any]) -> dict[str, Any]:
    """A JSON-RPC error response, on every face: it echoes the id only when that can name
    a request (``is_request_id``), else it carries ``null``."""
    return {
        "jsonrpc": "2.0",
        "id": request_id if is_request_id(request_id) else None,
        "error": error,
    }


# -- tools/list ----------------------------------------------------------------------------


#: The most bytes of tools a ``tools/list`` page holds (unless one tool alone is more):
#: a page of long descriptions is cut short, well within the daemon's 64 MiB line.
PAGE_BYTES = 16 << 20


class Listing:
    """One snapshot's ``tools/list`` entries under one filter, and its pages as JSON."""

    __slots__ = ("handed", "pages", "tag", "tools")

    def __init__(self, tools: list[dict[str, Any]], tag: str) -> None:
        self.tools = tools
        self.tag = tag
        #: (start, page size) -> the page from ``start``, encoded once, and its end.
        self.pages: dict[tuple[int, int], tuple[RawJson, int]] = {}
        #: (start, page size) of the pages a cursor was given out for (all but the first).
        self.handed: set[tuple[int, int]] = set()


class ToolPages:
    """``tools/list`` entries per catalog snapshot and filter, computed once each.

    A page is encoded once as well (``RawJson``, embedded verbatim in the
    response): a listing of 1,000 tools is ~0.5 MB of JSON, and encoding it again per
    request cost ~0.3 ms. Responses share no mutable value this way.

    A page holds ``size`` tools, or fewer when they would pass ``page_bytes`` of JSON
    (halved until they do not): an MCP host cannot ask for less, and over the socket a
    page past the daemon's line would be an error in its place.

    One listing is kept per workspace and filter (``SnapshotCache``). A cursor carries
    its offset, and a client can forge any: only the pages this class gives cursors for
    (the first, and each one a cursor was handed out for) are kept, so a listing holds
    at most its own entries' JSON once per page size.
    """

    def __init__(self, page_bytes: int = PAGE_BYTES) -> None:
        self._listings: SnapshotCache[Listing] = SnapshotCache()
        self._page_bytes = page_bytes

    @staticmethod
    def _listing(catalog: Catalog, wanted: str | None) -> Listing:
        want = CatalogName(wanted) if wanted else None
        tools: list[dict[str, Any]] = [
            {
                "name": loaded.tool.name,
                "description": loaded.tool.description,
                "inputSchema": listed_schema(
                    loaded.tool.schema, marks_checked=not loaded.tool.listing_notes
                ),
                "annotations": _ANNOTATIONS,
                "_meta": {
                    "toolsetd/set": loaded.toolset.directory,
                    "toolsetd/source": loaded.toolset.source.value,
                    "toolsetd/hash": loaded.hash,
                },
            }
            for _, loaded in sorted(catalog.tools.items())
            if (want is None or want in loaded.tool.catalogs)
            # A schema no MCP host can be shown: left out, and noted (its parse made the
            # note; a tool without one is listed, with no walk of its schema).
            and not (loaded.tool.listing_notes and is_unlisted(loaded.tool.listing_notes))
        ]
        tag = hashlib.sha256(
            "\n".join(t["_meta"]["toolsetd/hash"] for t in tools).encode()
        ).hexdigest()[:16]
        return Listing(tools, tag)

    def listing(self, catalog: Catalog, wanted: str | None) -> Listing:
        """The listing of ``catalog`` under ``wanted``, built on the event loop the first
        time (a small catalog's: a thread hand-off costs more)."""
        return self._listings.get(catalog, wanted, lambda: self._listing(catalog, wanted))

    async def listing_apart(self, catalog: Catalog, wanted: str | None) -> Listing:
        """``listing``, built in a worker thread (``SnapshotCache.get_apart``: one build at
        a time per workspace and filter). Its ``tag`` and ``page`` then cost no more than a
        page's encoding, whether or not the cache kept it (a newer snapshot's stays)."""
        return await self._listings.get_apart(
            catalog, wanted, functools.partial(self._listing, catalog, wanted)
        )

    def building(self, workspace: Path | None, wanted: str | None) -> Any:
        """The lock the builds of the listings of ``workspace`` under ``wanted`` take."""
        return self._listings.building(workspace, wanted)

    def page(self, listing: Listing, cursor: Any, size: int) -> tuple[RawJson, str | None]:
        """One page of ``listing`` from ``cursor`` (None: the first), as JSON, and the next
        page's cursor. An equal ``tag`` of two listings means equal lists (every entry's
        ``_meta`` hash covers the rest of it).

        Raises:
            McpError: -32602 for a cursor that is not ours or of an older catalog.
        """
        start = 0
        if cursor is not None:
            start = _read_cursor(cursor, listing.tag)
        kept = listing.pages.get((start, size))
        if kept is None:
            end = start + size
            # A schema may hold an integer wider than 64 bits: jsontext writes it exactly.
            data = json_dumps(listing.tools[start:end])
            while len(data) > self._page_bytes and end - start > 1:
                end = start + (end - start) // 2
                data = json_dumps(listing.tools[start:end])
            kept = RawJson(data), end
            if start == 0 or (start, size) in listing.handed:
                # A page of the walk from the first: kept, and its end is the next one's
                # start. (A forged offset's page is neither: forged walks take no room.)
                listing.pages[(start, size)] = kept
                listing.handed.add((kept[1], size))
        encoded, end = kept
        if end >= len(listing.tools):
            return encoded, None
        return encoded, _cursor(listing.tag, end)


def _cursor(tag: str, offset: int) -> str:
    return base64.urlsafe_b64encode(f"{tag}:{offset}".encode()).decode()


def _read_cursor(cursor: Any, tag: str) -> int:
    try:
        if type(cursor) is not str:  # str() of a list nested a thousand deep: RecursionError
            raise ValueError("a cursor is a string")
        text = base64.urlsafe_b64decode(cursor.encode()).decode()
        seen, offset = text.split(":")
        value = int(offset)
    except (ValueError, UnicodeDecodeError):
        raise McpError(
            -32602,
            "Invalid params: 'cursor' is not a cursor toolsetd gave out; list again without it.",
            {"field": "cursor"},
        ) from None
    if seen != tag:
        raise McpError(
            -32602,
            "Invalid params: 'cursor' belongs to a tool list that has "
            "changed since; list again without it.",
            {"field": "cursor"},
        )
    return max(value, 0)


# -- results -------------------------------------------------------------------------------


def _text_result(text: str) -> dict[str, Any]:
    return {"content": [{"type": "text", "text": text}], "isError": True}


def call_result(outcome: CallOutcome) -> dict[str, Any]:
    """A run's ``CallToolResult``: its content and ``isError`` as they are."""
    return {
        "content": [dict(block) for block in outcome.content],
        "isError": outcome.is_error,
        "_meta": {
            "toolsetd/status": outcome.status,
            "toolsetd/exitCode": outcome.exit_code,
            "toolsetd/truncated": outcome.truncated,
            "toolsetd/outputPath": outcome.output_path,
        },
    }


def refusal_result(exc: rpc_errors.RpcError) -> dict[str, Any]:
    """A schema or fence refusal, or a ``deny``, as an ``isError`` result the model reads."""
    lines = [exc.message]
    data = exc.data if isinstance(exc.data, dict) else {}
    errors = data.get("errors")
    if isinstance(errors, list) and len(errors) > 1:
        # The native message counts the rest "in data.errors", which an MCP result lacks.
        native = f" ({len(errors) - 1} more in data.errors)"
        if exc.message.endswith(native):
            lines[0] = f"{exc.message.removesuffix(native)} ({len(errors) - 1} more below)"
        lines.append("Every problem (JSON Pointer into the arguments: message):")
        lines.extend(f"- {_problem(e)}" for e in errors)
    return _text_result("\n".join(lines))


def _problem(error: Any) -> str:
    """One ``data.errors[]`` entry as ``JSON Pointer: message``, the pointer named once.

    A schema error's message starts with its pointer already (``/name: expected
    string``); a fence error's (``Path is not valid.``) and the object's own do not.
    """
    if not isinstance(error, dict):
        return str(error)
    path, message = error.get("path"), str(error.get("message"))
    if path and message.startswith(f"{path}: "):
        return message
    return f"{path or '(the arguments object)'}: {message}"


#: The actions of an ``ElicitResult``.
_ACTIONS = ("accept", "decline", "cancel")


def elicit_action(answer: Any) -> str | None:
    """The action of the host's answer to the approval question (an ``ElicitResult``, or
    an ``inputResponses`` entry), or None for one that is not such an answer: not an
    object, no known ``action``, or a ``content`` that is neither absent, null nor an
    object (``{"action": "accept", "content": "x"}`` ran the call as an accept).

    Args:
        answer: The ``result`` of the host's response, or its ``inputResponses`` entry.

    Returns:
        ``accept``, ``decline`` or ``cancel``; None for no such answer.
    """
    if type(answer) is not dict:
        return None
    action = answer.get("action")
    if action not in _ACTIONS:
        return None
    content = answer.get("content")
    if content is not None and type(content) is not dict:
        return None
    return str(action)


#: What the model is told when the operator declines (or dismisses) the approval request:
#: the reference host's words for a denied prompt, verbatim (crystal-behaviour.md section
#: 5), so an agent behaves as it does there.
USER_DECLINED = (
    "The user declined this action. Do not retry the same call. Change the approach or ask "
    "the user."
)


def declined_result(action: str) -> dict[str, Any]:
    """The operator did not approve (declined, cancelled, no answer, or the daemon stopped
    waiting for the answer): the call did not run."""
    if action in ("decline", "cancel"):
        return _text_result(USER_DECLINED)
    if action == "stopping":
        return _text_result(
            "toolsetd is stopping, so it no longer waits for the operator's approval; the "
            "call did not run."
        )
    why = {
        "timeout": "The operator did not answer the approval request in time",
        "uninitialized": "The host never sent notifications/initialized, so toolsetd could "
        "not put the approval request to the operator",
    }.get(action, "The host could not ask the operator for approval")
    return _text_result(f"{why}; it did not run. Do not retry it unless the operator asks you to.")


def changed_result() -> dict[str, Any]:
    """The call classifies differently from what the operator approved."""
    return _text_result(
        "The call changed while the operator was asked (a tool set or a path changed), so the "
        "approval no longer matches it; it did not run. Call the tool again to ask anew."
    )


def approval_unavailable_result(classification: dict[str, Any]) -> dict[str, Any]:
    """An ask or review this host cannot put to the operator (no elicitation)."""
    tool = classification.get("tool", "?")
    reason = classification.get("reason", "")
    if classification.get("requirePrompt"):
        how = (
            "It touches a path only the operator may allow, one call at a time, so no mode or "
            "grant passes it: the operator can run it with `toolsetctl invoke "
            f"{tool} --args '<json>' --approve` in the workspace."
        )
    else:
        how = (
            "To allow it, the operator can run it with `toolsetctl invoke "
            f"{tool} --args '<json>' --approve`, register this server with a mode that "
            "allows it (`toolsetctl mcp --mode full`, or `mode=full` in the URL of an HTTP "
            "endpoint, runs workspace calls unasked), or use "
            "an MCP host that supports elicitation, which asks the operator."
        )
    return _text_result(
        f"Approval required: {reason} This MCP host did not declare elicitation, so toolsetd "
        f"cannot ask the operator; the call did not run. {how}"
    )


# -- approvals -----------------------------------------------------------------------------


def can_elicit(capabilities: dict[str, Any]) -> bool:
    """Whether the client declared form elicitation (an empty object means form)."""
    elicitation = capabilities.get("elicitation")
    if not isinstance(elicitation, dict):
        return False
    return not elicitation or "form" in elicitation or "url" not in elicitation


def _shown(value: Any) -> str:
    """A value of the question as one line: text as it is, anything else as compact JSON
    (numbers as written); control characters, bidirectional controls and line breaks as
    escapes. Path values are the model's text: shown raw, a line feed or an escape
    sequence in one would forge or hide lines of the question the operator answers."""
    return printable(value if isinstance(value, str) else json_dumps(value).decode())


def approval_message(classification: dict[str, Any]) -> str:
    """What the operator is shown: the tool, the reason, the scope, paths and arguments.

    Every value is shown with its control characters escaped (``printable``), as
    toolsetctl shows them: a path argument is the model's, a set's folder name a cloned
    repository's, and a newline in either forged lines of the question, an ESC reached a
    terminal host as a control sequence.
    """

    def shown(key: str, within: dict[str, Any] = classification) -> str:
        return _shown(within.get(key, ""))

    lines = [
        f"Allow the tool '{shown('tool')}' (set '{shown('set')}', {shown('source')}) to run?",
        f"Why you are asked: {shown('reason')}",
        f"Scope: {shown('scope')}; authority: {shown('authority')}.",
    ]
    paths = classification.get("paths") or []
    if paths:
        lines.append("Paths:")
        lines.extend(
            f"- {shown('argument', p)}: {shown('value', p)} -> {shown('resolved', p)} "
            f"({shown('scope', p)})"
            for p in paths
        )
    # Numbers as written; JSON escapes the C0 controls, not DEL, C1 or bidi controls.
    arguments = _shown(classification.get("arguments"))
    if len(arguments) > _MAX_SHOWN_ARGUMENTS:
        arguments = arguments[:_MAX_SHOWN_ARGUMENTS] + " ..."
    lines.append(f"Arguments: {arguments}")
    if classification.get("requirePrompt"):
        lines.append("This call reaches a forbidden path: only your explicit accept passes it.")
    lines.append("Accept runs this call once; decline refuses it.")
    return "\n".join(lines)


def elicitation_params(classification: dict[str, Any], *, with_mode: bool) -> dict[str, Any]:
    """``elicitation/create`` params asking to approve one call (an empty form)."""
    params: dict[str, Any] = {
        "message": approval_message(classification),
        "requestedSchema": {"type": "object", "properties": {}},
    }
    if with_mode:
        params = {"mode": "form", **params}
    return params


class StateSigner:
    """Signs and checks approval ``requestState``s (HMAC-SHA256, a key per daemon).

    Each state carries a serial number and an expiry, and an accept spends it: the
    operator's "accept runs this call once" holds however often the host sends the state
    back. Spent serials are kept until their states expire, at most ``max_spent`` at
    once. At that cap, the expired ones are forgotten first; if none has expired, the
    oldest spent serial is forgotten and every state numbered up to it is refused from
    then on, spent or not (asked again, like an expired one). So memory stays bounded and
    the cap fails closed: a state can be refused that would have run, never run twice.

    Every spend runs a tool, so the cap is high enough (65,536 within the 10 minutes a
    state lives) that no host reaches it by accepting its own approvals and so costs
    another host's operator a question. The clock is monotonic: the key lives as long as
    the daemon, so a state needs no wall time, and a wall clock stepped forward then back
    would let a forgotten spent state run again.

    Args:
        ttl_seconds: How long a state stays valid.
        key: The HMAC key (random by default; tests pass one).
        clock: A monotonic clock (``time.monotonic``).
        max_spent: Spent states remembered at once.
    """

    def __init__(
        self,
        ttl_seconds: float,
        key: bytes | None = None,
        clock: Callable[[], float] = time.monotonic,
        max_spent: int = 65536,
    ) -> None:
        self._key = key or os.urandom(32)
        self._ttl = ttl_seconds
        self._clock = clock
        self._max_spent = max_spent
        self._serials = itertools.count(1)
        #: Serials of the states accepted so far, with their expiry.
        self._spent: dict[int, float] = {}
        #: States numbered up to this are refused (see the class docstring).
        self._floor = 0

    def sign(self, payload: dict[str, Any]) -> str:
        """A state carrying ``payload``, a serial number and an expiry."""
        body = json_dumps({**payload, "n": next(self._serials), "x": self._clock() + self._ttl})
        mac = hmac.new(self._key, body, hashlib.sha256).digest()
        return f"{_b64(body)}.{_b64(mac)}"

    def spend(self, payload: dict[str, Any]) -> bool:
        """Spend a verified state for a run: False if it was spent already (then run nothing)."""
        serial = int(payload["n"])
        if serial <= self._floor or serial in self._spent:
            return False
        if len(self._spent) >= self._max_spent:
            now = self._clock()
            self._spent = {n: x for n, x in self._spent.items() if x >= now}
            if len(self._spent) >= self._max_spent:
                oldest = min(self._spent)
                del self._spent[oldest]
                self._floor = oldest
        if serial > self._floor:
            self._spent[serial] = float(payload["x"])
        return True

    def verify(self, state: Any) -> dict[str, Any] | None:
        """The payload of a state we signed, None when it expired (or is below the floor).

        Raises:
            McpError: -32602 when the state is not one we signed unchanged.
        """
        try:
            if type(state) is not str:  # as a cursor (``_read_cursor``)
                raise ValueError("a state is a string")
            body_text, mac_text = state.split(".")
            body, mac = _unb64(body_text), _unb64(mac_text)
        except ValueError:
            body, mac = b"", b""
        expected = hmac.new(self._key, body, hashlib.sha256).digest()
        if not body or not hmac.compare_digest(mac, expected):
            raise McpError(
                -32602,
                "Invalid params: 'requestState' is not a state toolsetd gave "
                "out, or it was changed; call the tool again without it.",
                {"field": "requestState"},
            )
        payload: dict[str, Any] = json_loads(body)
        if float(payload["x"]) < self._clock() or int(payload["n"]) <= self._floor:
            return None
        return payload


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).decode().rstrip("=")


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def call_key(binding_key: str, tool: str, arguments: Any) -> str:
    """What a ``requestState`` is bound to: the binding, the tool and the arguments (an
    encode of all of them: large arguments call for the worker slot, ``Service.check_request``)."""
    try:
        args = json_dumps(arguments, orjson.OPT_SORT_KEYS)
    except TypeError:
        args = repr(arguments).encode()
    return hashlib.sha256(
        binding_key.encode() + b"\x00" + tool.encode() + b"\x00" + args
    ).hexdigest()


def input_required_result(
    signer: StateSigner,
    classification: dict[str, Any],
    digest: str,
    binding_key: str,
    tool: str,
    arguments: Any,
    *,
    elicitation: dict[str, Any] | None = None,
    key: str | None = None,
) -> dict[str, Any]:
    """The 2026-07-28 ``InputRequiredResult``: ask the operator, then retry with the state.

    ``elicitation`` (``elicitation_params(classification, with_mode=True)``) and ``key``
    (``call_key``) are made here unless given: both encode the arguments, which a caller
    with large ones does in the worker slot.
    """
    if elicitation is None:
        elicitation = elicitation_params(classification, with_mode=True)
    if key is None:
        key = call_key(binding_key, tool, arguments)
    return {
        "resultType": "input_required",
        "inputRequests": {APPROVAL_KEY: {"method": "elicitation/create", "params": elicitation}},
        "requestState": signer.sign({"d": digest, "c": key}),
    }


@dataclass(frozen=True, slots=True)
class Answer:
    """What a 2026-07-28 retry says about the approval.

    Attributes:
        digest: The approved classification's digest (None: ask again).
        declined: The operator declined or cancelled.
        action: The operator's action as sent.
    """

    digest: str | None
    declined: bool = False
    action: str = ""


def approval_answer(
    signer: StateSigner,
    params: dict[str, Any],
    binding_key: str,
    tool: str,
    arguments: Any,
    *,
    key: str | None = None,
) -> Answer:
    """Read a retry's ``requestState`` and ``inputResponses`` (``key``: the call's
    ``call_key``, made here unless given).

    An expired state, or one an earlier accept spent, is no answer: the call asks again.

    Raises:
        McpError: -32602 for a state we did not sign, or one signed for another call.
    """
    state = params.get("requestState")
    if state is None:
        return Answer(None)
    payload = signer.verify(state)
    if payload is None:
        return Answer(None)  # expired: ask again
    if key is None:
        key = call_key(binding_key, tool, arguments)
    if payload.get("c") != key:
        raise McpError(
            -32602,
            "Invalid params: 'requestState' was given out for another call "
            "(tool or arguments differ); call the tool again without it.",
            {"field": "requestState"},
        )
    responses = params.get("inputResponses")
    action = elicit_action(responses.get(APPROVAL_KEY) if isinstance(responses, dict) else None)
    if action == "accept":
        if not signer.spend(payload):
            return Answer(None)  # spent by an earlier accept: ask again, never run twice
        return Answer(str(payload.get("d")), action="accept")
    if action is not None:  # decline or cancel
        return Answer(None, declined=True, action=action)
    return Answer(None)


# -- progress ------------------------------------------------------------------------------


class _Poster:
    """What the sink needs of an outbox (``mcp_session.Outbox``)."""

    def post(self, message: dict[str, Any], *, droppable: bool = False) -> None: ...

    async def drained(self) -> None: ...


class ProgressSink:
    """The service's call events as ``notifications/progress`` on one request's token.

    Args:
        outbox: Where the notifications go.
        token: The request's ``progressToken`` (None: no progress is sent).
        cancelled: Whether the request was cancelled (then nothing more is sent).
    """

    def __init__(self, outbox: Any, token: Any, cancelled: Callable[[], bool]) -> None:
        self._outbox = outbox
        self._token = token
        self._cancelled = cancelled
        self._last: float | None = None

    async def started(self, call_id: str, loaded: Any, pid: int) -> None:
        """Nothing: MCP has no started event."""

    async def completed(self, call_id: str, completion: Completion) -> None:
        """Nothing: the response follows."""

    async def progress(self, call_id: str, report: ProgressReport) -> None:
        """One ``notifications/progress``; a line the tool wrote waits for the peer."""
        if self._token is None or self._cancelled():
            return
        last = self._last
        value = last if last is not None else 0.0
        if report.fraction is not None:
            value = min(max(report.fraction, 0.0), 1.0) * 100.0
        if last is not None and value <= last:
            value = last + _NUDGE
        self._last = value
        params: dict[str, Any] = {"progressToken": self._token, "progress": value}
        if report.fraction is not None:
            params["total"] = 100
        if report.message is not None:
            params["message"] = report.message
        elif report.queued:
            params["message"] = "waiting for a free runner slot"
        message = {"jsonrpc": "2.0", "method": "notifications/progress", "params": params}
        if report.reported:
            self._outbox.post(message)
            await self._outbox.drained()
        else:
            self._outbox.post(message, droppable=True)
