"""The observer interface: what metrics and tracing are told about calls, connections and reloads.

Theory of operation
-------------------
The service code tells an ``Observer`` a few facts and knows nothing of what is done with
them. Per ``invoke`` it asks for a ``CallObservation`` once the tool and the policy
decision are known, takes the child's extra environment from it (``TRACEPARENT``), and
ends it exactly once: ``refused`` when the policy or the fence stopped the call,
``finished`` with the runner's outcome otherwise (``None`` when no outcome came, for
example a bug or the daemon stopping at once). Connections report refusals; reloads
report their duration and whether they failed.

``ObserverSet`` fans out to several observers (the metrics always, the tracing when the
``otel`` extra is configured). Observers must be cheap and must never raise into the call
path: they count, they do not decide.

An observer sees tool and set names, statuses, decisions, counts and durations: never
argument values, environments or output.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from .call import CallOutcome

__all__ = [
    "CallInfo",
    "CallObservation",
    "Observer",
    "ObserverSet",
]


@dataclass(frozen=True, slots=True)
class CallInfo:
    """What an observer may know of one call before it runs.

    Attributes:
        call_id: The call id.
        tool: The tool's name.
        set: The tool set's directory name.
        source: ``home`` or ``project``.
        decision: The policy decision: ``allow``, ``ask``, ``review`` or ``deny``.
        traceparent: The caller's W3C ``traceparent``, or None.
    """

    call_id: str
    tool: str
    set: str
    source: str
    decision: str
    traceparent: str | None = None


class CallObservation(Protocol):
    """One call, from its decision to its end."""

    def child_env(self) -> Mapping[str, str]:
        """Variables added to the child's environment (``TRACEPARENT``)."""

    def refused(self, reason: str) -> None:
        """The call did not run: ``deny``, ``approval`` or ``arguments``."""

    def finished(self, outcome: CallOutcome | None) -> None:
        """The runner's outcome (None if it ended without one)."""


class Observer(Protocol):
    """Told about calls, connection refusals and reloads."""

    def call(self, info: CallInfo) -> CallObservation:
        """Begin observing one call."""

    def connection_refused(self, reason: str) -> None:
        """A connection was turned away: ``peer``, ``limit``, ``stopping`` or ``memory``."""

    def reload_finished(self, seconds: float, failed: bool) -> None:
        """A catalog reload ended (``failed`` when it raised)."""


class _Calls:
    """One call seen by several observers (or none)."""

    __slots__ = ("_parts", "_traceparent")

    def __init__(self, parts: Sequence[CallObservation], traceparent: str | None) -> None:
        self._parts = parts
        self._traceparent = traceparent

    def child_env(self) -> Mapping[str, str]:
        env: dict[str, str] = {}
        for part in self._parts:
            env.update(part.child_env())
        if self._traceparent is not None and "TRACEPARENT" not in env:
            # Nobody traces here: the caller's context still reaches the tool, so the
            # tool's own spans join the caller's trace.
            env["TRACEPARENT"] = self._traceparent
        return env

    def refused(self, reason: str) -> None:
        for part in self._parts:
            part.refused(reason)

    def finished(self, outcome: CallOutcome | None) -> None:
        for part in self._parts:
            part.finished(outcome)


class ObserverSet:
    """Several observers as one.

    Args:
        observers: Told in this order.
    """

    def __init__(self, observers: Sequence[Observer] = ()) -> None:
        self._observers = tuple(observers)

    def call(self, info: CallInfo) -> CallObservation:
        """Begin observing one call with every observer."""
        return _Calls([o.call(info) for o in self._observers], info.traceparent)

    def connection_refused(self, reason: str) -> None:
        """Tell every observer."""
        for observer in self._observers:
            observer.connection_refused(reason)

    def reload_finished(self, seconds: float, failed: bool) -> None:
        """Tell every observer."""
        for observer in self._observers:
            observer.reload_finished(seconds, failed)


#: Observes nothing (the default of the handlers and the server).
NO_OBSERVER = ObserverSet()
