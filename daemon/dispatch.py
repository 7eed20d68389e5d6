"""The JSON-RPC layer: envelope, batches, jsonrpcserver dispatch, and the one boundary.

Theory of operation
-------------------
We parse the envelope ourselves (a cheap hand-written check instead of
jsonrpcserver's per-request schema validation, and correct batch and extra-member
handling), then hand each single request to jsonrpcserver's per-request
``dispatch_request`` (method lookup, argument check, call) with identity
(de)serialisers, and read the response straight from its result. Its per-request costs
are kept small: every wrapped handler carries one precomputed ``__signature__`` whose
``bind`` needs no generic matching, so ``validate_args`` no longer rebuilds a signature
per request. ``_boundary`` wraps every handler: it is the one place where exceptions
become wire errors, and no exception text or traceback ever reaches a client. ``conn_id``
is bound to the log context once per connection; ``method`` and ``request_id`` for each
handler's run (token ``bind``/``reset``, not the context manager).
"""

from __future__ import annotations

import inspect
import logging
import time
import uuid
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import anyio
import structlog
from jsonrpcserver import Error, Success
from jsonrpcserver.async_dispatcher import dispatch_request
from jsonrpcserver.request import Request as JsonRpcRequest
from jsonrpcserver.sentinels import NODATA, NOID
from pydantic import ValidationError
from structlog.contextvars import bind_contextvars, reset_contextvars
from toolsetd.protocol import errors as rpc_errors
from toolsetd.protocol.jsonrpc import (
    InvalidEnvelope,
    Notification,
    Request,
    error_message,
    parse_envelope,
)
from toolsetd.protocol.models import params_error

from .connection import Connection, Handler, RequestContext

__all__ = ["Dispatcher"]

log = structlog.get_logger("toolsetd.server")


class Dispatcher:
    """Answers JSON-RPC messages with the method handlers, each behind ``_boundary``.

    Args:
        methods: Handlers by method name.
    """

    def __init__(self, methods: Mapping[str, Handler]) -> None:
        self._methods = dict(methods)
        self._jsonrpc_methods = {name: _boundary(name, fn) for name, fn in self._methods.items()}
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
        request = JsonRpcRequest(
            method, {} if params is None else params, NOID if notification else request_id
        )
        context = RequestContext(conn, None if notification else request_id)
        # jsonrpcserver's per-request pipeline (method lookup, argument binding, call).
        # Its batch-level entry points run even one request through asyncio.gather,
        # outside anyio's cancel scopes, where a handler's shielded cleanup (killing a
        # child, reaping it) can be cut short; this entry point awaits the handler here.
        _, result = await dispatch_request(self._jsonrpc_methods, context, request)
        if notification:
            return None
        return _to_wire(request_id, result)


class _NoId:
    """Marks a JSON-RPC notification (no id member), distinct from ``"id": null``."""


_NO_ID: Any = _NoId()


def _to_wire(request_id: Any, result: Any) -> dict[str, Any]:
    """jsonrpcserver's result (an oslash ``Right``/``Left``) as our response object.

    Read straight from the result rather than through ``to_response``, which would build
    a second pair of namedtuple and ``Either`` only for us to take them apart again.
    """
    failed = getattr(result, "_error", None)
    if failed is None:
        return {"jsonrpc": "2.0", "result": result._value.result, "id": request_id}
    error: dict[str, Any] = {"code": failed.code, "message": failed.message}
    if failed.data is not NODATA:
        error["data"] = failed.data
    return {"jsonrpc": "2.0", "error": error, "id": request_id}


def _accept_any(context: Any, /, *args: Any, **kwargs: Any) -> None:
    """The shape of every wrapped handler: the context, then any params."""


class _AcceptAnySignature(inspect.Signature):
    """The signature of ``_accept_any``, with a ``bind`` that skips the generic matching.

    jsonrpcserver's ``validate_args`` binds every request's arguments to the method's
    signature to answer Invalid Params early. A wrapped handler takes the context and
    then anything (the boundary and the params models judge the params), so any call
    with a context binds; ``bind`` builds that answer directly (~0.3 µs instead of
    ~1.3 µs) and defers to the generic code for anything else.
    """

    __slots__ = ()

    def bind(self, /, *args: Any, **kwargs: Any) -> inspect.BoundArguments:
        if not args:
            return super().bind(*args, **kwargs)
        arguments: dict[str, Any] = {"context": args[0]}
        if len(args) > 1:
            arguments["args"] = args[1:]
        if kwargs:
            arguments["kwargs"] = kwargs
        return inspect.BoundArguments(self, arguments)


#: ``inspect.signature`` returns a callable's ``__signature__`` as it is; giving every
#: wrapped handler this one, computed once, spares jsonrpcserver's per-request
#: ``validate_args`` from rebuilding it from the code object each time.
_ACCEPT_ANY = _AcceptAnySignature.from_callable(_accept_any)


def _boundary(name: str, handler: Handler) -> Callable[..., Awaitable[Any]]:
    """Wrap a handler so that it is the one place exceptions become wire errors.

    jsonrpcserver's own catch-all would send ``str(exc)`` to the client; this wrapper
    never lets an exception reach it. ``method`` and ``request_id`` are bound to the log
    context for the handler's run (``bind``/``reset`` with tokens: a third of the cost
    of the ``bound_contextvars`` context manager). Whether ``request_served`` (debug) is
    logged is decided once, here: a filtered-out call still costs a microsecond.
    """
    debug = log.bind().is_enabled_for(logging.DEBUG)

    async def method(context: RequestContext, /, *args: Any, **kwargs: Any) -> Any:
        # jsonrpcserver spreads params into arguments; gather them back unchanged.
        params: Any = list(args) if args else kwargs
        started = time.perf_counter()
        tokens = bind_contextvars(method=name, request_id=context.request_id)
        try:
            result = await handler(context, params)
        except rpc_errors.RpcError as exc:
            log.info("request_refused", code=exc.code, ms=_ms(started))
            return Error(exc.code, exc.message, NODATA if exc.data is None else exc.data)
        except ValidationError as exc:
            error = params_error(exc)
            log.info("request_refused", code=error.code, ms=_ms(started))
            return Error(error.code, error.message, error.data)
        except Exception:
            incident = uuid.uuid4().hex[:12]
            log.exception("request_failed", incident=incident)
            return Error(
                rpc_errors.InternalError.CODE,
                f"Internal error (incident {incident}); the daemon log has the details.",
                {"incident": incident},
            )
        else:
            if debug:
                log.debug("request_served", ms=_ms(started))
            return Success(result)
        finally:
            reset_contextvars(**tokens)

    method.__name__ = name
    method.__signature__ = _ACCEPT_ANY  # type: ignore[attr-defined]
    return method


def _ms(started: float) -> float:
    return round((time.perf_counter() - started) * 1000, 3)
