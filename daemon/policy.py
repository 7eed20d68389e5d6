"""The invocation policy: approval modes, the decision table, and ``classify``.

Theory of operation
-------------------
Every external tool call starts from the floor: authority ``write``, scope
``workspace``. The tool's declared ``pathArguments`` can only make it worse: each
path is resolved and scoped by ``toolsetd.daemon.paths`` and the worst scope wins
(``forbidden`` over ``outsideWorkspace`` over ``workspace``). A tool-provided input
can never lower the floor.

The decision is a pure function of four values, and it is written down as a table,
not as branches: ``_DECISIONS`` has one row per (scope, effective approval, headless)
and one column per mode, and ``DECISION_TABLE`` spreads it into one ``Rule`` per
combination (72 of them). ``docs/policy.md`` prints the same table; the tests check
every cell against an expectation written independently from the reference host's
table. The decisions mean:

* ``allow``: run it. Only a workspace call runs unasked, and only in ``full`` mode or
  when the effective approval is ``always``.
* ``ask``: the operator must approve it (``invoke`` needs ``approved: true``).
* ``review``: send it to the reviewing model first; its allow may run a
  non-forbidden call, anything else goes on to the operator. ``invoke`` still needs
  ``approved: true``: the front end sets it after the reviewer or the operator.
* ``deny``: refused; ``invoke`` never starts a process.

``headless: true`` turns every ``ask`` into ``deny`` and nothing else: a ``review``
stays ``review`` because the reviewing model is not a person, and its allow may
still run a workspace or outside-workspace call. Forbidden calls are never
``review`` (the reviewer's allow does not count for them), so headless they deny.

``requirePrompt`` is true exactly for forbidden calls. ``grantScopes`` is what a front
end may offer when it asks: ``once``/``session``/``persistent`` for workspace calls,
``once`` alone for anything outside or forbidden, nothing when the decision is
``allow`` or ``deny``.

``classify`` is pure apart from the filesystem reads of path resolution; it returns
the arguments as the child would receive them, so ``invoke`` enforces exactly what
``classify`` reported.

Why one module of this size: the rule table, the path inspection and the reasons are one
pure decision; ``tests/daemon/test_policy.py`` checks every one of its 72 cells against
an independent reading of the reference host's table.
"""

from __future__ import annotations

import enum
import os
import posixpath
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from toolsetd.protocol.modes import Mode, parse_mode

from .model import Approval, ApprovalSource, LoadedTool, Source
from .paths import (
    ArgumentsError,
    OwnProcessLinkError,
    PathError,
    Scope,
    canonical_workspace,
    is_credential_identity,
    is_credential_path,
    is_crystal_credentials,
    resolve_path,
    rewrite_arguments,
    scope_of,
    trim_path,
)

__all__ = [
    "AUTHORITY",
    "DECISION_TABLE",
    "ApprovalState",
    "Classification",
    "Decision",
    "Mode",
    "PathCheck",
    "Rule",
    "classify",
    "decide",
    "parse_mode",
]

#: The authority of every external tool call: the floor, never lowered.
AUTHORITY = "write"


class Decision(enum.StrEnum):
    """What happens to a call."""

    ALLOW = "allow"
    ASK = "ask"
    REVIEW = "review"
    DENY = "deny"


@dataclass(frozen=True, slots=True)
class Rule:
    """One cell of the decision table.

    Attributes:
        decision: allow, ask, review or deny.
        require_prompt: Only the operator may pass the call (forbidden calls).
        grant_scopes: The grant scopes a front end may offer when it asks.
    """

    decision: Decision
    require_prompt: bool
    grant_scopes: tuple[str, ...]


_A, _K, _R, _D = Decision.ALLOW, Decision.ASK, Decision.REVIEW, Decision.DENY
_MODE_COLUMNS = (Mode.PLAN, Mode.DEFAULT, Mode.EDIT, Mode.REVIEW, Mode.AUDIT, Mode.FULL)

# The policy. One row per (scope, effective approval, headless), one column per mode.
# docs/policy.md prints this same table; change both together.
_DECISIONS: Mapping[tuple[Scope, Approval, bool], tuple[Decision, ...]] = {
    # scope            approval          headless   plan default edit review audit full
    (Scope.WORKSPACE, Approval.ALWAYS, False): (_A, _A, _A, _A, _A, _A),
    (Scope.WORKSPACE, Approval.INHERIT, False): (_K, _K, _K, _R, _R, _A),
    (Scope.OUTSIDE, Approval.ALWAYS, False): (_K, _K, _K, _R, _R, _K),
    (Scope.OUTSIDE, Approval.INHERIT, False): (_K, _K, _K, _R, _R, _K),
    (Scope.FORBIDDEN, Approval.ALWAYS, False): (_K, _K, _K, _K, _K, _K),
    (Scope.FORBIDDEN, Approval.INHERIT, False): (_K, _K, _K, _K, _K, _K),
    (Scope.WORKSPACE, Approval.ALWAYS, True): (_A, _A, _A, _A, _A, _A),
    (Scope.WORKSPACE, Approval.INHERIT, True): (_D, _D, _D, _R, _R, _A),
    (Scope.OUTSIDE, Approval.ALWAYS, True): (_D, _D, _D, _R, _R, _D),
    (Scope.OUTSIDE, Approval.INHERIT, True): (_D, _D, _D, _R, _R, _D),
    (Scope.FORBIDDEN, Approval.ALWAYS, True): (_D, _D, _D, _D, _D, _D),
    (Scope.FORBIDDEN, Approval.INHERIT, True): (_D, _D, _D, _D, _D, _D),
}

#: Only the operator may pass a forbidden call: no policy, grant or reviewer allow.
_REQUIRE_PROMPT: Mapping[Scope, bool] = {
    Scope.WORKSPACE: False,
    Scope.OUTSIDE: False,
    Scope.FORBIDDEN: True,
}

#: What a front end may offer the operator when it asks (or reviews, then asks).
_GRANT_SCOPES: Mapping[Scope, tuple[str, ...]] = {
    Scope.WORKSPACE: ("once", "session", "persistent"),
    Scope.OUTSIDE: ("once",),
    Scope.FORBIDDEN: ("once",),
}

#: Nobody is asked after allow or deny, so no grant can be offered.
_OFFERS_GRANTS: Mapping[Decision, bool] = {_A: False, _K: True, _R: True, _D: False}


def _rule(scope: Scope, decision: Decision) -> Rule:
    scopes = _GRANT_SCOPES[scope] if _OFFERS_GRANTS[decision] else ()
    return Rule(decision, _REQUIRE_PROMPT[scope], scopes)


#: Every (scope, mode, effective approval, headless) and its rule, spread from ``_DECISIONS``.
DECISION_TABLE: Mapping[tuple[Scope, Mode, Approval, bool], Rule] = {
    (scope, mode, approval, headless): _rule(scope, decision)
    for (scope, approval, headless), row in _DECISIONS.items()
    for mode, decision in zip(_MODE_COLUMNS, row, strict=True)
}
assert len(DECISION_TABLE) == len(Scope) * len(Mode) * len(Approval) * 2


def decide(scope: Scope, mode: Mode, approval: Approval, headless: bool) -> Rule:
    """Look up the rule for one call.

    Args:
        scope: The worst scope of the call's paths.
        mode: The approval mode.
        approval: The tool's effective approval.
        headless: Whether nobody can be asked.

    Returns:
        The table's rule.

    Raises:
        ValueError: A value that is not a scope, mode or approval.
    """
    return DECISION_TABLE[(Scope(scope), Mode(mode), Approval(approval), bool(headless))]


@dataclass(frozen=True, slots=True)
class PathCheck:
    """One inspected path argument.

    Attributes:
        argument: The property name.
        value: The value as sent.
        resolved: The canonical absolute path, or None when it could not be resolved.
        scope: Its scope.
        detail: Why it could not be resolved, else None (not on the wire).
    """

    argument: str
    value: Any
    resolved: str | None
    scope: Scope
    detail: str | None = None


@dataclass(frozen=True, slots=True)
class ApprovalState:
    """A tool's approval: as declared, the source policy, and the result."""

    declared: Approval
    policy: ApprovalSource
    effective: Approval


@dataclass(frozen=True, slots=True)
class Classification:
    """Everything ``classify`` decides about one prospective call.

    Attributes:
        tool: The tool name.
        set: The set's directory name.
        source: home or project.
        authority: Always ``write``.
        scope: The worst scope of the inspected paths (``workspace`` when there are none).
        paths: The inspected path arguments, in declaration order.
        approval: Declared, policy, effective.
        require_prompt: Only the operator may pass it.
        grant_scopes: The grant scopes a front end may offer.
        decision: allow, ask, review or deny.
        reason: Plain English, naming the cause.
        arguments: The arguments as the child would receive them (the originals when
            the fence refuses them).
        arguments_error: The fence's message when it refuses the arguments, else None
            (not on the wire; ``invoke`` reports it as invalid arguments).
        arguments_error_argument: The property the fence refused, when one is to blame.
    """

    tool: str
    set: str
    source: Source
    authority: str
    scope: Scope
    paths: tuple[PathCheck, ...]
    approval: ApprovalState
    require_prompt: bool
    grant_scopes: tuple[str, ...]
    decision: Decision
    reason: str
    arguments: Any
    arguments_error: str | None = None
    arguments_error_argument: str | None = None

    def to_wire(self) -> dict[str, Any]:
        """Return the contract's camelCase classification object."""
        return {
            "tool": self.tool,
            "set": self.set,
            "source": self.source.value,
            "authority": self.authority,
            "scope": self.scope.value,
            "paths": [
                {
                    "argument": p.argument,
                    "value": p.value,
                    "resolved": p.resolved,
                    "scope": p.scope.value,
                }
                for p in self.paths
            ],
            "approval": {
                "declared": self.approval.declared.value,
                "policy": self.approval.policy.value,
                "effective": self.approval.effective.value,
            },
            "requirePrompt": self.require_prompt,
            "grantScopes": list(self.grant_scopes),
            "decision": self.decision.value,
            "reason": self.reason,
            "arguments": self.arguments,
        }


_SEVERITY: Mapping[Scope, int] = {Scope.WORKSPACE: 0, Scope.OUTSIDE: 1, Scope.FORBIDDEN: 2}

#: Nested strings resolved inside one array or object path value before giving up.
_MAX_NESTED_STRINGS = 64


def _nested_strings(value: Any) -> list[str]:
    """Collect every string inside a JSON array or object, iteratively (no recursion limit)."""
    found: list[str] = []
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            found.append(item)
        elif isinstance(item, Mapping):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list | tuple):
            stack.extend(item)
    return found


def _check_string(
    value: str,
    workspace: Path,
    user_home: Path,
    crystal_home: Path | None,
    followed_by_tool: bool = False,
    as_written: bool = False,
) -> tuple[str | None, Scope, str | None]:
    """Resolve and scope one path string: (resolved or None, scope, why unresolved).

    ``followed_by_tool``: the child gets the string itself (inside an array or object); one
    that leads through ``/proc/self`` or any ``/proc/<pid>`` cannot be judged for it, and
    counts as forbidden.
    ``as_written``: resolve it as the kernel opens it (not trimmed, no ``~`` expanded).
    """
    try:
        resolved: Path | None = resolve_path(
            value,
            workspace,
            user_home,
            followed_by_tool=followed_by_tool,
            as_written=as_written,
        )
        detail = None
    except OwnProcessLinkError as exc:
        return None, Scope.FORBIDDEN, exc.detail
    except PathError as exc:
        resolved, detail = None, exc.detail
    return (
        os.fspath(resolved) if resolved is not None else None,
        scope_of(value, resolved, workspace, user_home, crystal_home),
        detail,
    )


def _check_container(
    name: str, value: Any, workspace: Path, user_home: Path, crystal_home: Path | None
) -> PathCheck:
    """Scope an array or object where a path string belongs.

    The reference host passes such values through unchecked; the child would then
    receive paths nobody looked at. We pass them through too, but never as
    ``workspace``: at least ``outsideWorkspace``, and ``forbidden`` when any string
    inside names (or resolves to) a credential path (read as tools read it too, when the
    kernel cannot resolve it: ``_forbidden_for_tool``), leads through ``/proc/self`` (the
    tool's own process when it follows the string: ``/proc/self/cwd`` is the workspace for
    it, whatever the daemon's is) or any ``/proc/<pid>`` (whose links take the tool to that
    process's own folders, in its namespaces), or there are too many to check. Each string is
    resolved as written, as the kernel opens it (``"~/k"`` is ``<workspace>/~/k``,
    ``" k"`` keeps its space), and, unless blank, as a string argument is (trimmed, ``~``
    expanded), since the tool may read it either way.
    """
    strings = [s for s in _nested_strings(value) if s]
    scope = Scope.OUTSIDE
    if any(is_credential_path(s, user_home) for s in strings) or len(strings) > _MAX_NESTED_STRINGS:
        scope = Scope.FORBIDDEN
    else:
        for text in strings:
            # The two readings differ only for surrounding white space or a leading ~.
            trimmed = trim_path(text)
            if not trimmed:
                readings: tuple[bool, ...] = (True,)
            elif trimmed != text or text.startswith("~"):
                readings = (True, False)
            else:
                readings = (False,)
            if any(
                _forbidden_for_tool(text, workspace, user_home, crystal_home, as_written)
                for as_written in readings
            ):
                scope = Scope.FORBIDDEN
                break
    return PathCheck(name, value, None, scope, "it is not a path string")


def _forbidden_for_tool(
    text: str, workspace: Path, user_home: Path, crystal_home: Path | None, as_written: bool
) -> bool:
    """Whether a string inside an array or object, which the tool follows itself, is
    forbidden: it names or resolves to a credential path (or through ``/proc/self``), or,
    when the kernel cannot resolve it, it does once read as tools read such a string.

    Python's ``resolve`` and Node's ``path.resolve`` drop ``./`` and ``name/..`` before they
    follow links, and a C tool stops at a NUL byte: ``"./" * 2100 + "key"`` (too long for
    the kernel) and a 300-byte name then ``/../key`` reached the workspace's link ``key``
    to ``~/.ssh/id_rsa``, where the daemon saw a path it could not resolve
    (``outsideWorkspace``, which a reviewer's allow runs). So a string that cannot be
    resolved is also read cut at its NUL byte and with those steps dropped
    (``posixpath.normpath``); a long text that is no path stays ``outsideWorkspace``. A
    string argument is refused instead (``Path is not valid.``): the tool would receive
    the daemon's resolution of it, and there is none.
    """
    resolved, scope, detail = _check_string(
        text, workspace, user_home, crystal_home, True, as_written
    )
    if scope is Scope.FORBIDDEN:
        return True
    if resolved is not None or detail is None:
        return False
    head = text.split("\x00", 1)[0]
    return any(
        _check_string(reading, workspace, user_home, crystal_home, True, as_written)[1]
        is Scope.FORBIDDEN  # its text, as scope_of reads it first, or where it resolves
        for reading in dict.fromkeys((head, posixpath.normpath(head) if head else ""))
        if reading and reading != text
    )


def _inspect(
    loaded: LoadedTool,
    arguments: Any,
    workspace: Path,
    user_home: Path,
    crystal_home: Path | None,
) -> tuple[PathCheck, ...]:
    """Scope each declared path argument that holds something to check, in declaration order."""
    if not loaded.tool.path_arguments or not isinstance(arguments, Mapping):
        return ()
    checks: list[PathCheck] = []
    for name in dict.fromkeys(loaded.tool.path_arguments):
        if name not in arguments:
            continue
        value = arguments[name]
        if isinstance(value, str):
            if not trim_path(value):
                continue  # blank: nothing to scope; the fence refuses it at invoke
            resolved, scope, detail = _check_string(value, workspace, user_home, crystal_home)
            checks.append(PathCheck(name, value, resolved, scope, detail))
        elif isinstance(value, Mapping | list | tuple):
            checks.append(_check_container(name, value, workspace, user_home, crystal_home))
        # numbers, booleans and null name no path: they pass through unchecked.
    return tuple(checks)


def _show(text: str) -> str:
    """Render a value for a reason: control characters escaped, long text cut."""
    shown = "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)
    return shown if len(shown) <= 160 else shown[:157] + "..."


def _where(check: PathCheck, user_home: Path, crystal_home: Path | None) -> str:
    """Say where the culprit path lands, as the start of a sentence."""
    name = check.argument
    if check.scope is Scope.FORBIDDEN:
        if check.resolved is not None and (
            is_credential_path(check.resolved, user_home)
            or is_crystal_credentials(check.resolved, crystal_home)
        ):
            return f"Argument '{name}' resolves to {_show(check.resolved)}, a credential path"
        if check.resolved is not None and is_credential_identity(
            check.resolved, user_home, crystal_home
        ):
            return (
                f"Argument '{name}' resolves to {_show(check.resolved)}, which is a credential "
                "file or folder of the user's home or the Crystal home (under another name: "
                "a hard link or a mount)"
            )
        if isinstance(check.value, str):
            return f"Argument '{name}' names a credential path ({_show(check.value)})"
        return (
            f"Argument '{name}' is not a path string and holds a credential path, a path "
            "through /proc/self or /proc/<pid> (the tool's own process, or a process's "
            "own folders, when it follows it), or too many paths to check"
        )
    if check.resolved is not None:
        return f"Argument '{name}' resolves to {_show(check.resolved)}, outside the workspace"
    if isinstance(check.value, str):
        return (
            f"Argument '{name}' cannot be resolved ({check.detail}), "
            "so it counts as outside the workspace"
        )
    return f"Argument '{name}' is not a path string, so it counts as outside the workspace"


_INSIDE = "this call stays inside the workspace."

# The reason of the attended (not headless) decision, by (scope, decision).
# {mode} is the mode name, {Mode} capitalised, {where} the culprit sentence.
_REASONS: Mapping[tuple[Scope, Decision], str] = {
    (Scope.WORKSPACE, _K): "External tools need approval in {mode} mode; " + _INSIDE,
    (Scope.WORKSPACE, _R): "{Mode} mode sends external tools to the reviewing model, "
    "then asks; " + _INSIDE,
    (Scope.OUTSIDE, _K): "{where}: the operator must approve it, once, in {mode} mode.",
    (Scope.OUTSIDE, _R): "{where}: {mode} mode sends it to the reviewing model, "
    "then asks the operator to approve it once.",
    (Scope.FORBIDDEN, _K): "{where}: only the operator can approve it, once.",
}
_ALWAYS_REASON = "The tool's effective approval is 'always', so it runs in any mode; " + _INSIDE
_FULL_REASON = "Full mode runs external tools without asking; " + _INSIDE
_ALWAYS_LIMIT = " Approval 'always' covers only calls inside the workspace."
_REVIEWER_LIMIT = " The reviewing model's allow does not count for it."
_HEADLESS_DENY = "Headless run: a call that needs a person's approval is denied. "
_HEADLESS_REVIEW = " Headless run: unless the reviewing model allows it, it is denied."


_HOST_IGNORES = (
    " The tool declares approval 'always', which does not count for {source} tool sets: "
    "externalToolApproval.{source} in the Crystal home's config.json is host; set it to "
    "author to let the declaration count."
)
_HEADLESS_FIX_AUTHOR = (
    ' To let it run headless, declare "approval": "always" for the tool in its '
    "tools.json, or run in full mode (--mode full; mode=full in an MCP URL)."
)
_HEADLESS_FIX_HOST = (
    " To let it run headless, run in full mode (--mode full; mode=full in an MCP URL)."
)


def _fix(scope: Scope, decision: Decision, loaded: LoadedTool) -> str:
    """What the operator can change so that a workspace call that is not allowed runs.

    A tool set's ``"approval": "always"`` under the host policy (a project set's, by
    default) reads as ``inherit``, and the call asks although its author wrote
    ``always``: the operator was told only that external tools need approval. A
    headless job whose workspace call is denied was told why, not how to let it run.
    """
    if scope is not Scope.WORKSPACE or decision is _A:
        return ""
    if loaded.policy is ApprovalSource.HOST and loaded.tool.approval is Approval.ALWAYS:
        return _HOST_IGNORES.format(source=loaded.toolset.source.value)
    if decision is not _D:
        return ""
    return _HEADLESS_FIX_HOST if loaded.policy is ApprovalSource.HOST else _HEADLESS_FIX_AUTHOR


def _reason(
    scope: Scope,
    mode: Mode,
    approval: Approval,
    headless: bool,
    culprit: PathCheck | None,
    user_home: Path,
    crystal_home: Path | None = None,
) -> str:
    attended = decide(scope, mode, approval, False).decision
    if attended is _A:
        text = _ALWAYS_REASON if approval is Approval.ALWAYS else _FULL_REASON
    else:
        where = _where(culprit, user_home, crystal_home) if culprit is not None else ""
        text = _REASONS[(scope, attended)].format(
            mode=mode.value, Mode=mode.value.capitalize(), where=where
        )
        if scope is Scope.FORBIDDEN and mode in (Mode.REVIEW, Mode.AUDIT):
            text += _REVIEWER_LIMIT
        if scope is not Scope.WORKSPACE and approval is Approval.ALWAYS:
            text += _ALWAYS_LIMIT
    final = decide(scope, mode, approval, headless).decision
    if final is _D:
        return _HEADLESS_DENY + text
    if final is _R and headless:
        return text + _HEADLESS_REVIEW
    return text


def classify(
    loaded: LoadedTool,
    arguments: Any,
    workspace: Path,
    mode: Mode | str,
    headless: bool,
    user_home: Path,
    crystal_home: Path | None = None,
) -> Classification:
    """Classify a prospective call: scope, approval, decision, reason, rewritten arguments.

    Args:
        loaded: The tool as the catalog loaded it.
        arguments: The call's arguments as sent (any JSON value).
        workspace: The absolute workspace directory.
        mode: The approval mode (a ``Mode`` or a name ``parse_mode`` accepts).
        headless: Whether nobody can be asked.
        user_home: The operator's user profile, for ``~``.
        crystal_home: The Crystal home: its ``credentials.json`` is a credential path
            wherever the home is (``--home``, ``$CRYSTAL_HOME``), as the sandbox hides it.

    Returns:
        The classification. When the fence refuses the arguments, ``arguments`` holds
        the originals and ``arguments_error`` the fence's message.

    Raises:
        ValueError: ``mode`` is not a mode name.
    """
    mode = parse_mode(mode)
    approval = loaded.effective_approval
    arguments_error: str | None = None
    arguments_error_argument: str | None = None
    checks: tuple[PathCheck, ...] = ()
    if not loaded.tool.path_arguments:
        # No path to judge: the scope is the workspace, the arguments go through as they
        # are, and the rule and reason depend on (mode, approval, headless) alone.
        scope = _WORKSPACE
        rule, reason = _PATHLESS[(mode, approval, bool(headless))]
        child_arguments = arguments
    else:
        workspace = canonical_workspace(workspace)
        checks = _inspect(loaded, arguments, workspace, user_home, crystal_home)
        scope = Scope.WORKSPACE
        culprit: PathCheck | None = None
        for check in checks:
            if _SEVERITY[check.scope] > _SEVERITY[scope]:
                scope, culprit = check.scope, check
        rule = decide(scope, mode, approval, headless)
        reason = _reason(scope, mode, approval, headless, culprit, user_home, crystal_home)
        # The child receives the paths judged above, never a second resolution of them.
        judged = {c.argument: c.resolved for c in checks if isinstance(c.value, str)}
        try:
            child_arguments = rewrite_arguments(
                loaded.tool, arguments, workspace, user_home, resolved=judged
            )
        except ArgumentsError as exc:
            child_arguments, arguments_error = arguments, exc.message
            arguments_error_argument = exc.argument
            reason += f" The arguments are refused: {exc.message}"
    reason += _fix(scope, rule.decision, loaded)
    return Classification(
        tool=loaded.tool.name,
        set=loaded.toolset.directory,
        source=loaded.toolset.source,
        authority=AUTHORITY,
        scope=scope,
        paths=checks,
        approval=ApprovalState(loaded.tool.approval, loaded.policy, approval),
        require_prompt=rule.require_prompt,
        grant_scopes=rule.grant_scopes,
        decision=rule.decision,
        reason=reason,
        arguments=child_arguments,
        arguments_error=arguments_error,
        arguments_error_argument=arguments_error_argument,
    )


_WORKSPACE = Scope.WORKSPACE
#: The rule and reason of every call without path arguments, by (mode, effective approval,
#: headless): what ``classify`` computes for them, decided once at import (the reason of a
#: workspace-scoped call names no path, so it does not depend on the user's home).
_PATHLESS: Mapping[tuple[Mode, Approval, bool], tuple[Rule, str]] = {
    (mode, approval, headless): (
        decide(Scope.WORKSPACE, mode, approval, headless),
        _reason(Scope.WORKSPACE, mode, approval, headless, None, Path("/")),
    )
    for mode in Mode
    for approval in Approval
    for headless in (False, True)
}
