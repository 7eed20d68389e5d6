"""The JSON-RPC layer: envelope, batches, dispatch, and the one boundary.

Theory of operation
-------------------
We parse the envelope ourselves (a cheap hand-written check instead of a per-request
schema validation, and correct batch and extra-member handling), look the method up and
await its wrapped handler directly. ``_boundary`` wraps every handler: it is the one
place where exceptions become wire errors, and no exception text or traceback ever
reaches a client. ``conn_id`` is bound to the log context once per connection; ``method``
and ``request_id`` for each handler's run (token ``bind``/``reset``, not the context
manager).

Until issue 16 each request went through jsonrpcserver's per-request
``dispatch_request``; all it still did for us was to spread the params into arguments,
bind them to a signature that accepts anything, call, and wrap the answer in an
``Either`` that we took apart again: ~5 µs a request, and importing it costs ~100 ms of
every start (its own request validator imports jsonschema). Params reach a handler as
they did through it: an object as the dict, an array as the list (every method refuses
positional params, an empty array too), and a missing member as ``{}``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import anyio
import structlog
from toolsetd.protocol import errors as rpc_errors
from toolsetd.protocol.jsonrpc import (
    InvalidEnvelope,
    Notification,
    Request,
    error_message,
    parse_envelope,
)

from .connection import Connection, Handler, RequestContext
from .exhaustion import out_of_memory_in, request_out_of_memory
from .logs import REQUEST, Throttle, log_incident

__all__ = ["Dispatcher"]

log = structlog.get_logger("toolsetd.server")

#: Seconds between two ``request_refused`` lines of one method and error code.
_REFUSED_LOG_SECONDS = 1.0


class Dispatcher:
    """Answers JSON-RPC messages with the method handlers, each behind ``_boundary``.

    Args:
        methods: Handlers by method name.
    """

    def __init__(self, methods: Mapping[str, Handler]) -> None:
        self._methods = dict(methods)
        # A client can have every request refused, as fast as it writes: request_refused
        # is said once a second per method and error code, counting the refusals since the
        # last line.
        refusals = Throttle(interval=_REFUSED_LOG_SECONDS)
        self._jsonrpc_methods = {
            name: _boundary(name, fn, refusals) for name, fn in self._methods.items()
        }
        #: False once a graceful stop has begun: ``refused_while_stopping`` are refused.
        self.accepting = True
        #: Methods refused once a graceful stop has begun.
        self.refused_while_stopping: frozenset[str] = frozenset({"invoke", "reload"})

    @property
    def names(self) -> frozenset[str]:
        """The method names served."""
        return frozenset(self._methods)

    # -- JSON-RPC ----------------------------------------------------------------------

    async def dispatch_batch(self, conn: Connection, items: list[Any]) -> Any:
        """Answer a batch: one response per request item, in order; None if there are none."""
        if not items:
            return error_message(
                None, rpc_errors.InvalidRequest("Invalid Request: a batch must not be empty.")
            )
        responses: list[Any] = [None] * len(items)

        async def one(index: int, item: Any) -> None:
            responses[index] = await self.dispatch_one(conn, item)

        async with anyio.create_task_group() as tg:
            for index, item in enumerate(items):
                tg.start_soon(one, index, item)
        answered = [r for r in responses if r is not None]
        return answered or None

    async def dispatch_one(self, conn: Connection, value: Any) -> Any:
        """Answer one request object; None for a notification."""
        envelope = parse_envelope(value)
        kind = type(envelope)
        if kind is Request:
            request_id: Any = envelope.id  # type: ignore[union-attr]  # kind is Request: it has one
        elif kind is Notification:
            request_id = _NO_ID
        else:
            assert isinstance(envelope, InvalidEnvelope)
            return error_message(envelope.id, rpc_errors.InvalidRequest(envelope.message))
        assert not isinstance(envelope, InvalidEnvelope)
        method = envelope.method
        error: rpc_errors.RpcError
        if method not in self._jsonrpc_methods:
            known = ", ".join(sorted(self._methods))
            error = rpc_errors.MethodNotFound(
                f"Method not found: '{method}'. Methods: {known}.", {"method": method}
            )
            return None if request_id is _NO_ID else error_message(request_id, error)
        if not self.accepting and method in self.refused_while_stopping:
            error = rpc_errors.ShuttingDown(
                f"toolsetd is shutting down: no new '{method}' calls are accepted."
            )
            return None if request_id is _NO_ID else error_message(request_id, error)
        params = envelope.params
        notification = request_id is _NO_ID
        context = RequestContext(conn, None if notification else request_id)
        # A missing member is no params; an array, even an empty one, is positional params,
        # which every method refuses (-32602), as protocol.md says.
        answer = await self._jsonrpc_methods[method](context, {} if params is None else params)
        if notification:
            return None
        if type(answer) is _Failure:
            wire: dict[str, Any] = {"code": answer.code, "message": answer.message}
            if answer.data is not _NO_DATA:
                wire["data"] = answer.data
            return {"jsonrpc": "2.0", "error": wire, "id": request_id}
        return {"jsonrpc": "2.0", "result": answer, "id": request_id}


class _NoId:
    """Marks a JSON-RPC notification (no id member), distinct from ``"id": null``."""


_NO_ID: Any = _NoId()
#: A ``_Failure`` without a ``data`` member (an RpcError raised without data).
_NO_DATA: Any = object()


class _Failure:
    """What a wrapped handler returns instead of a result: the error to answer with."""

    __slots__ = ("code", "data", "message")

    def __init__(self, code: int, message: str, data: Any) -> None:
        self.code = code
        self.message = message
        self.data = data


def _boundary(
    name: str, handler: Handler, refusals: Throttle
) -> Callable[[RequestContext, Any], Awaitable[Any]]:
    """Wrap a handler so that it is the one place exceptions become wire errors.

    The wrapper returns the handler's result, or a ``_Failure`` for an error: no exception
    (text or traceback) gets past it. ``method`` and ``request_id`` are set in the log
    context for the handler's run (``logs.REQUEST``: one variable, 0.1 µs, where binding
    the two through structlog cost 1.7). Whether ``request_served`` (debug) is logged is
    decided once, here: a filtered-out call still costs a microsecond.
    """
    debug = log.bind().is_enabled_for(logging.DEBUG)

    async def method(context: RequestContext, params: Any) -> Any:
        started = time.perf_counter()
        token = REQUEST.set((name, context.request_id))
        try:
            result = await handler(context, params)
        except rpc_errors.RpcError as exc:
            said = refusals.count((name, exc.code))
            if said is not None:
                log.info("request_refused", code=exc.code, ms=_ms(started), refused=said)
            return _Failure(exc.code, exc.message, _NO_DATA if exc.data is None else exc.data)
        except Exception as exc:
            if out_of_memory_in(exc):
                busy = request_out_of_memory(name)
                return _Failure(busy.code, busy.message, busy.data)
            incident = log_incident(log, "request_failed")
            return _Failure(
                rpc_errors.InternalError.CODE,
                f"Internal error (incident {incident}); the daemon log has the details.",
                {"incident": incident},
            )
        else:
            if debug:
                log.debug("request_served", ms=_ms(started))
            return result
        finally:
            REQUEST.reset(token)

    method.__name__ = name
    return method


def _ms(started: float) -> float:
    return round((time.perf_counter() - started) * 1000, 3)
