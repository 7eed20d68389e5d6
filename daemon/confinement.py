"""Confinement: which cgroup limits and which sandbox each call gets, and how it is set up.

Theory of operation
-------------------
The operator decides, in the daemon config (the ``[confinement]`` table of
``toolsetd.toml``; never in ``tools.json``, which comes with the tool set), per source and
per set:

.. code-block:: toml

    [confinement]
    cgroup = "auto"          # "auto" | "off" | "/sys/fs/cgroup/<a writable subtree>"
    sandbox = "auto"         # "auto" (bubblewrap on PATH) | "off" | "/path/to/bwrap"
    hide = ["~/.aws"]        # more paths hidden from every sandboxed call

    [confinement.project]    # sets that came with a workspace
    profile = "workspace-write"
    network = false
    memory-max = "2G"

    [confinement.home]       # sets of the Crystal home
    profile = "off"

    [confinement.sets.lint]  # a set, by its directory name (either source); wins
    profile = "read-only"
    pids-max = 64
    cpu-max = 0.5

A set's settings are its ``sets.<directory>`` table over its source's table over the
defaults: profile ``workspace-write`` for project sets and ``off`` for home sets where
bubblewrap works (``off`` where it does not, logged once at start); network denied under
``workspace-write`` and ``read-only``, allowed under ``off``; no limits.

A probe of bubblewrap that failed for want of processes, threads or memory, or did not
end in time (``exhaustion.ProbeShort``: a daemon started at its ``TasksMax=``, say, or on
a machine swapping at that moment) says nothing about bubblewrap here, and must not turn a
project set's sandbox ``off`` for the daemon's life: the sets whose profile is sandboxed
fail closed meanwhile, saying so, and the whole probe is tried again at the next call
(``retry_probes``, at most every ``RETRY_SECONDS``, in a worker thread), after which the
daemon confines as a probe at start would have made it. So with the cgroup tree's probe:
one whose folder could not be made, or a controller enabled, for want of room (``EAGAIN``
at the base's ``cgroup.max.descendants``, ``ENOMEM``) must not leave every call without a
cgroup of its own for the daemon's life; the sets that need one (limits, the network
beside ``--mcp-listen``) fail closed meanwhile, saying so, and the same retry probes it
again.

A profile the operator *named* that cannot be set up (no bubblewrap) makes the set's calls
fail closed with a result text that says why; so does a limit the cgroup tree cannot
enforce. ``Confinement.prepare`` gives the runner the argv prefix (the cgroup join, then
bubblewrap) and the call's cgroup; ``describe`` is what ``classify`` reports, and
``status`` what ``status`` reports.

Why one module of this size: the config, the per-call decision and the argv it produces
(cgroup join, then bubblewrap) must agree with what ``classify`` and ``status`` report;
keeping the three in one place keeps them from drifting.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import stat
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import structlog

from . import threads
from .argv import executable_problem, found_on_path, interpreter_failure, shebang_interpreter
from .cgroup import (
    JOIN_ARGV,
    JOIN_FAILED_EXIT,
    CallCgroup,
    CallUsage,
    CgroupError,
    CgroupTree,
    Limits,
    cgroup2_mounts,
    daemon_cgroup,
    parse_limits,
)
from .config_file import toml_shown
from .exhaustion import ProbeShort, out_of_resources, out_of_tasks
from .manifest import is_directory_name
from .model import Source, ToolSet
from .paths import CREDENTIAL_FILES, CREDENTIAL_FOLDERS, IDENTITY_DEPTH, is_within, passwd_home
from .sandbox import (
    SETUP_FAILED_PREFIX,
    Profile,
    SandboxPlan,
    bind_identities,
    binds_moved,
    bwrap_argv,
    call_binds,
    exec_failure,
    hidden_below_writable,
    mount_aliases,
    prepare_writable,
    probe_bind_check,
    probe_bwrap,
    probe_ipc,
    probe_no_userns,
    probe_status,
    sandbox_pid,
    setup_done,
    tool_ran,
)
from .spawn import env_path

__all__ = [
    "RETRY_SECONDS",
    "Confinement",
    "ConfinementConfig",
    "ConfinementError",
    "ExecutableError",
    "Prepared",
    "SetConfinement",
    "built_sandbox",
    "command_failure",
    "parse_confinement",
    "setup_failure",
    "usage_text",
]

log = structlog.get_logger("toolsetd.confinement")

#: The credential paths hidden from every sandboxed call, relative to the user's home
#: (the same locations ``paths.is_credential_path`` forbids as arguments). The user's own
#: ``~/.crystal/credentials.json`` is one of them even when the daemon's Crystal home is
#: elsewhere (``--home``, ``$CRYSTAL_HOME``): that home's file is hidden as well.
_USER_CREDENTIALS = (*CREDENTIAL_FOLDERS, *(os.path.join(*parts) for parts in CREDENTIAL_FILES))
_JOIN_FAILED_TEXT = b"toolsetd-join"
_SET_KEYS = frozenset({"profile", "network", "memory-max", "pids-max", "cpu-max"})
_TOP_KEYS = frozenset({"cgroup", "sandbox", "hide", "home", "project", "sets"})
#: Seconds at least between two tries of a probe that failed for want of processes,
#: threads or memory (``Confinement.retry_probes``).
RETRY_SECONDS = 2.0


class ConfinementError(Exception):
    """A call whose confinement cannot be set up; the message is its result text."""


class ExecutableError(Exception):
    """The tool's executable cannot be started; the message is the ``strerror``.

    A confined child is a shell that joins the cgroup and then ``exec``s the tool, so the
    spawn itself no longer fails for a missing or non-executable tool: the same check is
    made here first, so such a call still gets the start-failure result and no events.
    """


#: ``~/.ssh`` and ``~/.gnupg`` are checked for a second hard link as deep as the fence knows
#: their files by identity (``paths.IDENTITY_DEPTH``); other hidden folders (the ``hide``
#: list: ``~/.config``, say, which can be large) this many levels.
_HIDDEN_DEPTH = 2


def linked_credential(hidden: Sequence[str], deep: Sequence[str] = ()) -> str | None:
    """The first credential file with a second hard link, else None.

    The sandbox hides paths, not files: another name of the same file (a hard link, which
    can live anywhere on the same filesystem, the workspace included) would show its
    content. A tool inside cannot make one (the path is hidden), so a second link was
    made outside; the sandboxed calls refuse to run until it is gone.

    Args:
        hidden: The hidden paths.
        deep: Those of them whose files are looked for ``IDENTITY_DEPTH`` levels down
            (the credential folders), not ``_HIDDEN_DEPTH``.
    """
    for path in hidden:
        depth = IDENTITY_DEPTH if path in deep else _HIDDEN_DEPTH
        try:
            entries = [path] if not os.path.isdir(path) else _files_below(path, depth)
        except OSError:
            continue
        for entry in entries:
            try:
                info = os.lstat(entry)
            except OSError:
                continue
            if stat.S_ISREG(info.st_mode) and info.st_nlink > 1:
                return entry
    return None


def _files_below(folder: str, depth: int) -> list[str]:
    found = []
    with os.scandir(folder) as it:
        for entry in it:
            if entry.is_dir(follow_symlinks=False):
                if depth > 1:
                    with contextlib.suppress(OSError):
                        found.extend(_files_below(entry.path, depth - 1))
            else:
                found.append(entry.path)
    return found


def check_executable(name: str, search_path: str | None, set_dir: Path | None = None) -> None:
    """Raise ``ExecutableError`` when ``name`` could not be executed.

    The message is what the spawn itself would have said, the reason, then the file,
    and after it the sentence that names the fix (``argv.executable_problem``). A script
    (given by its path, or the one a bare name finds on ``search_path``) whose ``#!`` line
    names no interpreter that runs (Windows line endings, one not installed) is refused
    here too: bubblewrap's exec of it failed after the sandbox was
    built, and the call was reported as a sandbox that could not be set up.

    Args:
        name: argv[0] (a path, or a name looked up in ``search_path``).
        search_path: The child's ``PATH``.
        set_dir: The set directory, which the sentence about a bare name names.
    """

    def refuse(code: int) -> ExecutableError:
        hint = executable_problem(name, set_dir or Path(os.curdir), search_path)
        return ExecutableError(f"{os.strerror(code)}: {name}" + (f". {hint}" if hint else ""))

    runs = name
    if os.sep not in name:
        # The one found may be a script whose interpreter does not run (a console script
        # whose venv was made anew): its #! line is read below as a path's is.
        found = shutil.which(name, path=search_path)
        if found is None:
            # One there that may not be run fails the spawn as "Permission denied".
            there = found_on_path(name, search_path) is not None
            raise refuse(errno.EACCES if there else errno.ENOENT)
        runs = found
    else:
        try:
            info = os.stat(name)
        except OSError as exc:
            raise refuse(exc.errno or errno.ENOENT) from exc
        if stat.S_ISDIR(info.st_mode) or not os.access(name, os.X_OK):
            raise refuse(errno.EACCES)
    code, problem = interpreter_failure(runs, without_line=False, relative=False)
    if problem:
        raise ExecutableError(f"{os.strerror(code)}: {name}. {problem}")


@dataclass(frozen=True, slots=True)
class _Layer:
    profile: Profile | None = None
    network: bool | None = None
    limits: Limits = field(default_factory=Limits)


@dataclass(frozen=True, slots=True)
class ConfinementConfig:
    """The ``[confinement]`` table, typed.

    Attributes:
        cgroup: ``auto``, ``off`` or a subtree path.
        sandbox: ``auto``, ``off`` or the bubblewrap binary.
        hide: Extra paths hidden from sandboxed calls (``~`` is the user's home).
        sources: Per source (``home``, ``project``) settings.
        sets: Per set directory settings.
    """

    cgroup: str = "auto"
    sandbox: str = "auto"
    hide: tuple[str, ...] = ()
    sources: Mapping[Source, _Layer] = field(default_factory=dict)
    sets: Mapping[str, _Layer] = field(default_factory=dict)


def _layer(table: Any, where: str) -> _Layer:
    if not isinstance(table, dict):
        raise ValueError(f"{where}: must be a table; got {toml_shown(table)}.")
    unknown = sorted(set(table) - _SET_KEYS)
    if unknown:
        raise ValueError(
            f"{where}.{unknown[0]}: unknown key; the keys are {', '.join(sorted(_SET_KEYS))}."
        )
    profile = table.get("profile")
    if profile is not None:
        try:
            profile = Profile(profile)
        except ValueError:
            names = ", ".join(repr(p.value) for p in Profile)
            raise ValueError(
                f"{where}.profile: must be one of {names}; got {toml_shown(profile)}."
            ) from None
    network = table.get("network")
    if network is not None and not isinstance(network, bool):
        raise ValueError(f"{where}.network: must be true or false; got {toml_shown(network)}.")
    return _Layer(profile, network, parse_limits(table, where))


#: Profiles from the least confining to the most.
_STRICTNESS = {Profile.OFF: 0, Profile.WORKSPACE_WRITE: 1, Profile.READ_ONLY: 2}

#: The profile of a source's sets when no table names one (``off`` where bubblewrap does
#: not work): what ``Confinement._resolve`` gives and what ``_no_looser`` measures against.
_DEFAULT_PROFILE: Mapping[Source, Profile] = {
    Source.HOME: Profile.OFF,
    Source.PROJECT: Profile.WORKSPACE_WRITE,
}


def _default_network(profile: Profile) -> bool:
    """Whether a profile allows the network when no table says: only ``off`` does."""
    return profile == Profile.OFF


def _no_looser(by_set: _Layer, by_source: _Layer | None) -> _Layer:
    """A ``sets.<directory>`` table as it applies to a *project* set of that name.

    Such a table is meant for the operator's set, but a project set of the same name is
    anyone's: a cloned repository, or any sandboxed call that can write the workspace, can
    make ``.crystal/tools/<directory>/``, and a project set hides the home set of its name.
    So for a project set the table may confine more than ``[confinement.project]`` (or the
    default) and never less: a looser profile, or the network where that denies it, is left
    out; each limit is the lower of the table's and the project's (a limit only one of them
    sets counts), so a table that raises or leaves out one (``cpu-max`` alone, meant to
    tighten the home set) does not lift the project's ``memory-max`` or ``pids-max``.
    """
    base = by_source.profile if by_source is not None and by_source.profile else None
    base = base or _DEFAULT_PROFILE[Source.PROJECT]
    profile = by_set.profile
    if profile is not None and _STRICTNESS[profile] < _STRICTNESS[base]:
        profile = None
    # The network the project set would have without the table: its table's, else its
    # profile's default (not the table's profile: a stricter one must not take it away).
    if by_source is not None and by_source.network is not None:
        base_network = by_source.network
    else:
        base_network = _default_network(base)
    network = by_set.network
    if network and not base_network:
        network = None
    base_limits = by_source.limits if by_source is not None else Limits()
    return _Layer(profile, network, _lower_limits(by_set.limits, base_limits))


def _lower_limits(one: Limits, other: Limits) -> Limits:
    """Each limit the lower of the two (None, no limit, is the highest)."""

    def cpu(text: str) -> float:
        quota, period = text.split()
        return int(quota) / int(period)

    memory = [v for v in (one.memory_max, other.memory_max) if v is not None]
    pids = [v for v in (one.pids_max, other.pids_max) if v is not None]
    cpus = [v for v in (one.cpu_max, other.cpu_max) if v is not None]
    return Limits(
        min(memory) if memory else None,
        min(pids) if pids else None,
        min(cpus, key=cpu) if cpus else None,
    )


def parse_confinement(table: Mapping[str, Any], where: str = "confinement") -> ConfinementConfig:
    """Read the ``[confinement]`` table of the daemon config.

    Raises:
        ValueError: A key or value that cannot be used; the message names it and the fix.
    """
    unknown = sorted(set(table) - _TOP_KEYS)
    if unknown:
        raise ValueError(
            f"{where}.{unknown[0]}: unknown key; the keys are {', '.join(sorted(_TOP_KEYS))}."
        )
    for key in ("cgroup", "sandbox"):
        value = table.get(key, "auto")
        if not isinstance(value, str) or not (value in ("auto", "off") or value.startswith("/")):
            raise ValueError(
                f'{where}.{key}: must be "auto", "off" or an absolute path; '
                f"got {toml_shown(value)}."
            )
        if "\x00" in value:
            # No file has such a name: sandbox's ended the start in a traceback ("embedded
            # null byte", from the probe's os.access), cgroup's was "not a folder".
            raise ValueError(
                f"{where}.{key}: must be a path without NUL characters; got {toml_shown(value)}."
            )
    hide = table.get("hide", [])
    if not isinstance(hide, list) or not all(isinstance(h, str) and h for h in hide):
        raise ValueError(f"{where}.hide: must be a list of paths; got {toml_shown(hide)}.")
    for entry in hide:
        if "\x00" in entry:  # it hid nothing, and the path's checks met "embedded null byte"
            raise ValueError(
                f"{where}.hide: each path must be without NUL characters; got {toml_shown(entry)}."
            )
        # Anything else named no path the sandbox could find ($HOME is not expanded, a
        # relative path would depend on the daemon's working folder): it hid nothing, silently.
        if not (entry == "~" or entry.startswith(("/", "~/"))):
            raise ValueError(
                f"{where}.hide: each path must be absolute or start with '~/' (variables are "
                f"not expanded); got {toml_shown(entry)}."
            )
    sources = {
        source: _layer(table[source.value], f"{where}.{source.value}")
        for source in Source
        if source.value in table
    }
    sets_table = table.get("sets", {})
    if not isinstance(sets_table, dict):
        raise ValueError(f"{where}.sets: must be a table of set directories.")
    for name in sets_table:
        if not is_directory_name(name):
            # It could never match a set: the confinement it asks for would silently
            # apply to nothing.
            raise ValueError(
                f"{where}.sets.{name}: no set directory can be named {name!r} (a name starts with "
                "a letter, then letters, digits, '.', '_' or '-', 64 characters at most); "
                "use the set's directory name."
            )
    sets = {name: _layer(value, f"{where}.sets.{name}") for name, value in sets_table.items()}
    return ConfinementConfig(
        cgroup=table.get("cgroup", "auto"),
        sandbox=table.get("sandbox", "auto"),
        hide=tuple(hide),
        sources=sources,
        sets=sets,
    )


@dataclass(frozen=True, slots=True)
class SetConfinement:
    """What one set's calls get.

    Attributes:
        profile: The sandbox profile that applies.
        network: Whether calls keep the network.
        limits: The cgroup limits.
        failure: Why its calls cannot run as configured (fail closed), else None.
    """

    profile: Profile
    network: bool
    limits: Limits
    failure: str | None = None


@dataclass(slots=True)
class Prepared:
    """A call's confinement, ready to spawn.

    Attributes:
        argv: The argv to spawn (the prefixes, then the tool's argv).
        cgroup: The call's cgroup, or None (process groups).
        sandboxed: Whether bubblewrap runs the tool.
        limits: The set's cgroup limits.
        enter: Spawn with the daemon inside the cgroup (``CgroupTree.entered``) instead
            of the joining shell.
    """

    argv: list[str]
    cgroup: CallCgroup | None
    sandboxed: bool
    limits: Limits
    enter: bool = False
    #: A sandboxed call's status pipe (read end, write end): bubblewrap's JSON status,
    #: which says whether the tool ran (``setup_failure``). The runner owns both ends.
    status: tuple[int, int] | None = None
    #: A sandboxed call's block pipe (read end, write end): bubblewrap waits on it
    #: with the sandbox built, until the runner has compared ``binds`` with the sandbox
    #: (``sandbox.binds_moved``). The runner owns both ends.
    block: tuple[int, int] | None = None
    #: Each bind as checked: canonical name, device, inode, whether it is writable
    #: (``bind_identities``).
    binds: tuple[tuple[str, int, int, bool], ...] = ()
    #: What bubblewrap executes in the sandbox (the tool's argv[0]): ``command_failure``
    #: tells its failed exec from a sandbox that could not be set up.
    command: str = ""

    def spawning(self) -> contextlib.AbstractContextManager[None]:
        """The context to spawn the child in (inside the cgroup when ``enter``)."""
        if self.enter and self.cgroup is not None:
            return self.cgroup.tree.entered(self.cgroup)
        return contextlib.nullcontext()


@dataclass(frozen=True, slots=True)
class _Sandbox:
    """What the probes of bubblewrap found (``_probe_sandbox``)."""

    bwrap: str | None
    reason: str
    own_ipc: bool = False
    status: bool = False
    #: Why a built sandbox's binds cannot be checked here, else None.
    unchecked: str | None = None
    no_userns: bool = False
    #: The probes could not run for want of processes, threads or memory.
    short: bool = False


def _probe_sandbox(setting: str, http_peers: bool) -> _Sandbox:
    """Probe bubblewrap and each option the profiles may use (blocking: seconds at most)."""
    try:
        bwrap, reason = probe_bwrap(setting)
        if bwrap is None:
            return _Sandbox(None, reason)
        own_ipc = probe_ipc(bwrap)
        # One held sandbox says both, where it can be checked (``probe_bind_check``).
        unchecked = probe_bind_check(bwrap)
        status = unchecked is None or probe_status(bwrap)
        no_userns = http_peers and probe_no_userns(bwrap)
    except ProbeShort as exc:
        return _Sandbox(
            None,
            f"{exc}; bubblewrap is tried again at the next call",
            short=True,
        )
    return _Sandbox(bwrap, "", own_ipc, status, unchecked, no_userns)


def _probe_cgroups(setting: str) -> tuple[CgroupTree | None, str, bool]:
    """Probe the cgroup tree (blocking: a few ``mkdir`` and writes): it, or None and why
    not, and whether that was for want of room (``ProbeShort``: tried again)."""
    try:
        cgroups, reason = CgroupTree.probe(setting)
    except ProbeShort as exc:
        return None, f"{exc}; the cgroup tree is tried again at the next call", True
    return cgroups, reason, False


def _log_cgroups(cgroups: CgroupTree | None, reason: str, short: bool) -> None:
    """Say once what the cgroup tree is (at start, or when a deferred probe has run)."""
    if short:
        log.warning("cgroups_probe_deferred", reason=reason, fallback="process groups")
    elif cgroups is None:
        log.warning("cgroups_unavailable", reason=reason, fallback="process groups")
    else:
        log.info("cgroups_enabled", tree=str(cgroups.folder),
                 controllers=sorted(cgroups.controllers))  # fmt: skip


def _log_sandbox(found: _Sandbox) -> None:
    """Say once what the sandbox lacks (at start, or when a deferred probe has run)."""
    if found.short:
        log.warning("sandbox_probe_deferred", reason=found.reason)
        return
    if found.bwrap is None:
        log.warning("sandbox_unavailable", reason=found.reason)
        return
    if not found.own_ipc:
        log.warning(
            "sandbox_without_ipc",
            reason="bubblewrap cannot create an IPC namespace here (allow 'ipc' in the "
            "unit's RestrictNamespaces=): sandboxed calls share the host's System V IPC",
        )
    if found.unchecked is not None:
        log.warning(
            "sandbox_without_bind_check",
            reason=f"{found.unchecked}: sandboxed calls run without the check that their "
            "binds are what the daemon checked, so a call that may write a folder above "
            "another call's workspace can swap it for a link while that call's sandbox "
            "is made (security.md)",
        )


class Confinement:
    """The daemon's cgroup tree and sandbox, and the operator's per-set choices.

    Args:
        config: The ``[confinement]`` settings.
        cgroups: The cgroup tree, or None.
        cgroup_reason: Why there is none.
        bwrap: The bubblewrap binary, or None.
        sandbox_reason: Why there is none.
        user_home: The operator's home (``~``).
        crystal_home: The Crystal home.
        socket_path: The daemon's socket (hidden from sandboxed calls: a tool cannot call
            the daemon).
        own_ipc: Whether sandboxed calls get their own IPC namespace (``probe_ipc``).
        status: Whether bubblewrap writes its JSON status (``probe_status``).
        http_peers: Whether the daemon serves MCP over loopback TCP (``--mcp-listen``),
            which a sandboxed call that keeps the network shares (``sandboxed_peer``).
        token_file: The MCP HTTP bearer token's file (hidden from sandboxed calls, like
            the socket).
        no_userns: Whether bubblewrap can keep a call from making user namespaces
            (``probe_no_userns``; probed only with ``http_peers``).
        bind_check: Whether the daemon can check a built sandbox's binds before the tool
            runs (``probe_bind_check``; needs ``status``).
        other_home: The user's home in its passwd entry, where ``user_home`` (``HOME``)
            is another folder: its credential paths are hidden too (ssh reads its keys
            there whatever ``HOME`` says).
        sandbox_short: bubblewrap's probe could not run for want of processes, threads
            or memory (``bwrap`` is None): sandboxed sets fail closed until
            ``retry_probes`` has probed it.
        cgroup_short: The cgroup tree's probe could not run for want of room
            (``cgroups`` is None): sets that need a cgroup fail closed until
            ``retry_probes`` has probed it.
    """

    def __init__(
        self,
        config: ConfinementConfig,
        cgroups: CgroupTree | None,
        cgroup_reason: str,
        bwrap: str | None,
        sandbox_reason: str,
        user_home: Path,
        crystal_home: Path,
        socket_path: Path | None = None,
        own_ipc: bool = True,
        status: bool = True,
        http_peers: bool = False,
        token_file: Path | None = None,
        no_userns: bool = False,
        bind_check: bool = True,
        other_home: Path | None = None,
        sandbox_short: bool = False,
        cgroup_short: bool = False,
    ) -> None:
        self.config = config
        self.sandbox_short = sandbox_short
        self.cgroup_short = cgroup_short
        #: Changes whenever what ``status`` reports does (a deferred probe has run).
        self.generation = 0
        self._next_probe = 0.0
        self._probing = False
        #: Told the folder of a cgroup tree a deferred probe made (the orphan guard's
        #: sentinel writes its ``cgroup.kill`` should the daemon die), else None.
        self.on_cgroup_tree: Callable[[Path], None] | None = None
        self.bind_check = bind_check
        self.http_peers = http_peers
        self.no_userns = no_userns
        self.own_ipc = own_ipc
        self.status_fd = status
        self.cgroups = cgroups
        self.cgroup_reason = cgroup_reason
        self.bwrap = bwrap
        self.sandbox_reason = sandbox_reason
        self._cache: dict[tuple[Source, str], SetConfinement] = {}
        home = str(user_home)
        homes = [home]
        if other_home is not None and os.path.realpath(other_home) != os.path.realpath(home):
            homes.append(str(other_home))
        hidden = [os.path.join(top, name) for top in homes for name in _USER_CREDENTIALS]
        self._credential_folders = tuple(
            os.path.join(top, name) for top in homes for name in CREDENTIAL_FOLDERS
        )
        if str(crystal_home / "credentials.json") not in hidden:
            hidden.append(str(crystal_home / "credentials.json"))
        hidden.extend(str(path) for path in (socket_path, token_file) if path is not None)
        hidden.extend(
            home + extra[1:] if extra == "~" or extra.startswith("~/") else extra
            for extra in config.hide
        )
        self._hidden = tuple(hidden)
        # Hidden too from every sandboxed call: clone3(CLONE_INTO_CGROUP) with a cgroup
        # folder's descriptor makes a child in that cgroup, and the kernel checks the mode
        # of its cgroup.procs, not the read-only bind it is seen through. With a cgroup per
        # call the child would be out of the call's limits and accounting, and its sockets
        # not the call's (sandboxed_peer); without, it could be in any cgroup the daemon's
        # uid may write (as root, another service's or another daemon's call's).
        self._cgroup_mounts = tuple(cgroup2_mounts())
        #: Where calls without a cgroup of their own run (the daemon's), shown again to
        #: sandboxed calls as a call's own cgroup is.
        self._daemon_cgroup = () if cgroups is not None else tuple(filter(None, [daemon_cgroup()]))
        #: A sandboxed call may keep the network beside the MCP endpoint: a peer it cannot
        #: name is refused (``sandboxed_peer``).
        self._network_configured = http_peers and self._sandbox_may_keep_network()

    @classmethod
    def probe(
        cls,
        config: ConfinementConfig,
        user_home: Path,
        crystal_home: Path,
        socket_path: Path | None = None,
        http_peers: bool = False,
        token_file: Path | None = None,
    ) -> Confinement:
        """Probe the cgroup tree and bubblewrap, logging once what is not available."""
        cgroups, cgroup_reason, cgroup_short = _probe_cgroups(config.cgroup)
        other_home = passwd_home()
        found = _probe_sandbox(config.sandbox, http_peers)
        _log_cgroups(cgroups, cgroup_reason, cgroup_short)
        _log_sandbox(found)
        return cls(
            config, cgroups, cgroup_reason, found.bwrap, found.reason, user_home, crystal_home,
            socket_path, found.own_ipc, found.status, http_peers, token_file, found.no_userns,
            found.bwrap is not None and found.unchecked is None,
            Path(other_home) if other_home is not None else None, found.short, cgroup_short,
        )  # fmt: skip

    @property
    def short(self) -> bool:
        """Whether a probe at start could not run for want of room (``retry_probes``)."""
        return self.sandbox_short or self.cgroup_short

    async def retry_probes(self) -> None:
        """Probe again what could not be probed for want of processes, threads, memory or
        room (the cgroup tree, bubblewrap), at most every ``RETRY_SECONDS`` and in a worker
        thread; once a probe has run, the sets are confined as that probe at start would
        have made them."""
        if not self.short or self._probing or time.monotonic() < self._next_probe:
            return
        self._probing = True
        try:
            cgroups, found = await threads.run_sync(self._probe_again)
        finally:
            self._probing = False
            self._next_probe = time.monotonic() + RETRY_SECONDS
        changed = False
        if cgroups is not None and not cgroups[2]:
            _log_cgroups(*cgroups)
            if cgroups[0] is not None:
                log.info("cgroups_recovered", tree=str(cgroups[0].folder))
                if self.on_cgroup_tree is not None:
                    self.on_cgroup_tree(cgroups[0].folder)
            self.cgroups, self.cgroup_reason = cgroups[0], cgroups[1]
            self._daemon_cgroup = () if self.cgroups is not None else self._daemon_cgroup
            self.cgroup_short, changed = False, True
        if found is not None and not found.short:
            _log_sandbox(found)
            if found.bwrap is not None:
                log.info("sandbox_recovered", binary=found.bwrap)
            self.bwrap, self.sandbox_reason = found.bwrap, found.reason
            self.own_ipc, self.status_fd = found.own_ipc, found.status
            self.no_userns = found.no_userns
            self.bind_check = found.bwrap is not None and found.unchecked is None
            self.sandbox_short, changed = False, True
        if changed:
            self._cache.clear()
            self._network_configured = self.http_peers and self._sandbox_may_keep_network()
            self.generation += 1

    def _probe_again(self) -> tuple[tuple[CgroupTree | None, str, bool] | None, _Sandbox | None]:
        """The probes ``retry_probes`` runs (in a worker thread): those still short."""
        cgroups = _probe_cgroups(self.config.cgroup) if self.cgroup_short else None
        found = _probe_sandbox(self.config.sandbox, self.http_peers) if self.sandbox_short else None
        return cgroups, found

    def close(self) -> None:
        """Remove the cgroup tree (the daemon stops)."""
        if self.cgroups is not None:
            self.cgroups.close()

    # -- per set -------------------------------------------------------------------------

    def for_set(self, toolset: ToolSet) -> SetConfinement:
        """The confinement of one set's calls (cached per source and directory)."""
        key = (toolset.source, toolset.directory)
        found = self._cache.get(key)
        if found is None:
            found = self._resolve(toolset.source, toolset.directory)
            if len(self._cache) > 4096:
                self._cache.clear()
            self._cache[key] = found
        return found

    def _resolve(self, source: Source, directory: str) -> SetConfinement:
        by_set, by_source = self.config.sets.get(directory), self.config.sources.get(source)
        if by_set is not None and source == Source.PROJECT:
            by_set = _no_looser(by_set, by_source)
        found = (by_set, by_source)
        layers = [layer for layer in found if layer is not None]
        named = next((lay.profile for lay in layers if lay.profile), None)
        network = next((lay.network for lay in layers if lay.network is not None), None)
        limits = next((lay.limits for lay in layers if lay.limits.needs()), Limits())
        failure = None
        # An operator who named bubblewrap's path asked for the sandbox: where it cannot
        # be set up the default profiles stay, and fail closed below, as where the probe
        # could not run. Only "auto" (bubblewrap if installed) falls back to "off".
        named_binary = self.config.sandbox not in ("auto", "off")
        if named is None:
            sandboxes = self.bwrap is not None or self.sandbox_short or named_binary
            profile = _DEFAULT_PROFILE[source] if sandboxes else Profile.OFF
        else:
            profile = named
        if profile != Profile.OFF and self.bwrap is None:
            if self.sandbox_short:
                failure = (
                    f"the sandbox profile '{profile}' of this set cannot be set up yet: "
                    f"{self.sandbox_reason}. The call did not run; retry it once the daemon "
                    "has room (fewer calls at once, or a higher TasksMax=, RLIMIT_NPROC, "
                    "memory or open files limit)."
                )
            elif named is None:
                failure = (
                    f"the sandbox profile '{profile}' (the default for {source} sets) cannot "
                    f"be set up: {self.sandbox_reason}. The call did not run; fix the sandbox "
                    'path in toolsetd.toml, or set sandbox = "auto" (bubblewrap on PATH, '
                    "where installed)."
                )
            else:
                failure = (
                    f"the sandbox profile '{profile}' the daemon config sets for this set "
                    f"cannot be set up: {self.sandbox_reason}. The call did not run; install "
                    'bubblewrap or set profile = "off" for it in toolsetd.toml.'
                )
        if limits.needs() and failure is None:
            if self.cgroups is None and self.cgroup_short:
                failure = (
                    "the cgroup limits the daemon config sets for this set cannot be enforced "
                    f"yet: {self.cgroup_reason}. The call did not run; retry it once the "
                    "daemon has room (fewer calls at once, or a higher memory, open files or "
                    "cgroup.max.descendants limit)."
                )
            elif self.cgroups is None:
                failure = (
                    "the cgroup limits the daemon config sets for this set cannot be enforced: "
                    f"{self.cgroup_reason}. The call did not run; give the daemon a writable "
                    "cgroup v2 subtree or remove the limits from toolsetd.toml."
                )
            else:
                problem = self.cgroups.check(limits, f"set '{directory}'")
                if problem is not None:
                    failure = f"{problem}. The call did not run."
        if network is None:
            network = _default_network(profile)
        if failure is None and network and profile != Profile.OFF and self.http_peers:
            failure = self._shared_loopback_failure()
        return SetConfinement(profile, network, limits, failure)

    def _sandbox_may_keep_network(self) -> bool:
        """Whether some set's sandboxed calls run with the network, as ``_resolve`` says.

        A table's ``network = true`` alone does not say it: beside ``profile = "off"`` (or
        the home sets' default) it is no sandbox's; without bubblewrap nothing is sandboxed;
        without a cgroup tree or ``--disable-userns`` such a call does not run
        (``_shared_loopback_failure``); and a project set's table cannot loosen
        ``[confinement.project]`` (``_no_looser``). Every set resolves like one of the
        ``sets`` tables or like a set without one ("" names none).
        """
        for source in Source:
            for name in (*self.config.sets, ""):
                conf = self._resolve(source, name)
                if conf.failure is None and conf.network and conf.profile != Profile.OFF:
                    return True
        return False

    def _shared_loopback_failure(self) -> str | None:
        """Why a sandboxed call that keeps the network cannot run beside --mcp-listen.

        The endpoint tells the call's connections from a client's by the cgroup their
        socket was made in (``sandboxed_peer``): the call needs a cgroup of its own, and
        must not be able to make a user namespace, in which it could mount a cgroup2 of
        its cgroup and move below it.
        """
        if self.cgroups is None:
            return (
                "this set's sandbox keeps the network, and the daemon serves MCP over HTTP "
                "(--mcp-listen) on the loopback the call would share; without a cgroup per "
                f"call ({self.cgroup_reason}) it cannot tell the call's connections from a "
                "client's, and the call could run tools outside its sandbox. The call did "
                "not run; give the daemon a writable cgroup v2 subtree, drop --mcp-listen, "
                "or set network = false for this set in toolsetd.toml."
            )
        if not self.no_userns:
            return (
                "this set's sandbox keeps the network, and the daemon serves MCP over HTTP "
                "(--mcp-listen) on the loopback the call would share; this bubblewrap cannot "
                "keep the call from making a user namespace (--disable-userns: bubblewrap "
                "0.8 or later, not setuid), in which it could leave its cgroup, by which the "
                "daemon tells the call's connections from a client's. The call did not run; "
                "upgrade bubblewrap, drop --mcp-listen, or set network = false for this set "
                "in toolsetd.toml."
            )
        return None

    def sandboxed_peer(self, cgroup: int | None) -> str | None:
        """Why a loopback TCP peer is refused as a sandboxed call's, else None.

        Args:
            cgroup: The id of the cgroup the peer's socket was created in, or None when
                the lookup could not say (``tcppeer.TcpPeer.cgroup``) or found no peer.
        """
        if cgroup is None:
            # Not "while such a call runs": a connection is judged when it is accepted,
            # which may be long after it was made (a full listen queue: the handshake's
            # last step is resent for minutes), so a call that has ended may be its peer.
            if not self._network_configured:
                return None  # no sandboxed call keeps the network on this daemon
            return (
                "Forbidden: toolsetd cannot tell who made this connection (its socket "
                "closed before it was accepted, or the kernel did not say which cgroup it "
                "comes from), and sandboxed calls that keep the network run on this "
                "daemon: it could be one of them. Keep the connection open until answered."
            )
        tree = self.cgroups
        if tree is None or not tree.sandboxed:
            return None  # no sandboxed call with the network runs (without a tree: _resolve)
        if cgroup in tree.sandboxed:
            return (
                "Forbidden: this connection comes from inside a sandboxed call, which may "
                "not call toolsetd."
            )
        return None

    def describe(self, toolset: ToolSet, writable: Sequence[str] = ()) -> dict[str, Any]:
        """What ``classify`` reports: the sandbox and the cgroup a call would get."""
        conf = self.for_set(toolset)
        sandbox: dict[str, Any] = {"profile": conf.profile.value, "network": conf.network}
        if conf.profile == Profile.WORKSPACE_WRITE and writable:
            sandbox["alsoWritable"] = list(writable)
        return {
            "sandbox": sandbox,
            "cgroup": self.cgroups is not None,
            "limits": conf.limits.describe(),
            "failure": conf.failure,
        }

    def status(self) -> dict[str, Any]:
        """What ``status`` reports: which mode is active, and why not when it is not."""
        cgroup: dict[str, Any] = (
            {"mode": "cgroup", "tree": str(self.cgroups.folder),
             "controllers": sorted(self.cgroups.controllers)}
            if self.cgroups is not None
            else {"mode": "process-group", "reason": self.cgroup_reason}
        )  # fmt: skip
        sandbox: dict[str, Any] = (
            {"mechanism": "bubblewrap", "binary": self.bwrap}
            if self.bwrap is not None
            else {"mechanism": "none", "reason": self.sandbox_reason}
        )
        return {"cgroup": cgroup, "sandbox": sandbox}

    # -- per call ------------------------------------------------------------------------

    def prepare(
        self,
        toolset: ToolSet,
        argv: list[str],
        cwd: str,
        data: tuple[str, str],
        approved: Sequence[str],
        search_path: str | None = None,
    ) -> Prepared:
        """Build the call's argv and cgroup.

        Args:
            toolset: The call's set.
            argv: The tool's argv.
            cwd: The working directory (the workspace).
            data: The set's two data folders (``CRYSTAL_TOOL_DATA``, ``CRYSTAL_PROJECT_DATA``).
            approved: The approved outside-workspace paths (writable for this call only).
            search_path: The child's ``PATH``, to check the executable.

        Raises:
            ConfinementError: It cannot be set up; the message is the call's result text.
            ExecutableError: The tool's executable cannot be started.
            OSError: The status pipe cannot be made (out of descriptors); nothing is left
                open.
        """
        conf = self.for_set(toolset)
        if conf.failure is not None:
            raise ConfinementError(f"toolsetd: {conf.failure}")
        full = argv
        status: tuple[int, int] | None = None
        block: tuple[int, int] | None = None
        binds: tuple[tuple[str, int, int, bool], ...] = ()
        sandboxed = conf.profile != Profile.OFF and self.bwrap is not None
        # Beside the MCP endpoint on the loopback it keeps (``sandboxed_peer``).
        shares_loopback = sandboxed and conf.network and self.http_peers
        if sandboxed or self.cgroups is not None:
            check_executable(argv[0], search_path, toolset.path)
        cgroup = None
        enter = False
        if self.cgroups is not None:
            try:
                cgroup = self.cgroups.create(conf.limits, f"set '{toolset.directory}'")
            except CgroupError as exc:
                raise ConfinementError(f"toolsetd: {exc}. The call did not run.") from exc
            if shares_loopback:
                try:
                    cgroup.mark_sandboxed()
                except OSError as exc:
                    cgroup.discard()
                    raise ConfinementError(
                        f"toolsetd: the call's cgroup cannot be read: {exc.strerror}. The "
                        "call did not run."
                    ) from exc
        try:
            if sandboxed:
                assert self.bwrap is not None
                linked = linked_credential(self._hidden, self._credential_folders)
                if linked is not None:
                    raise ConfinementError(
                        f"toolsetd: the credential file {linked} has another hard link, which "
                        "the sandbox cannot hide (it could be in the workspace). The call did not "
                        "run; remove the extra link (find / -xdev -samefile FILE)."
                    )
                # Where another mount shows a hidden path (a bind mount of the home), it is
                # hidden too: read now, as mounts come and go.
                hiding = (*self._hidden, *mount_aliases(self._hidden))
                # The cgroup it runs in must stay this call's (its limits, ``sandboxed_peer``):
                # the cgroup mounts are hidden, and the call's own cgroup shown again,
                # read-only at its path (a runtime sizes its heap from its ``memory.max``;
                # a process cloned into it stays in it).
                unseen = (*hiding, *self._cgroup_mounts)
                shown = (cgroup.path,) if cgroup is not None else self._daemon_cgroup
                no_userns = shares_loopback and self.no_userns
                own, writable, escaped = call_binds(cwd, str(toolset.path), *data)
                if escaped:
                    raise ConfinementError(
                        f"toolsetd: the project data folder {data[1]} leads out of the workspace "
                        f"(to {escaped}), and the sandbox will not bind it. The call did not run; "
                        "remove the symbolic link."
                    )
                if conf.profile == Profile.WORKSPACE_WRITE:
                    exposed = hidden_below_writable(hiding, (*writable, *approved))
                    if exposed is not None:
                        hidden, root, how = exposed
                        where, could = (
                            (
                                "lies two or more folders below",
                                "move a folder on the way and leave it",
                            )
                            if how == "deep"
                            else (
                                "is a symbolic link below",
                                "remove the link, leaving where it leads",
                            )
                        )
                        raise ConfinementError(
                            f"toolsetd: the hidden path {hidden} {where} {root}, which this call "
                            f"may write: the call could {could} unhidden for the next call. "
                            "The call did not run; keep hidden paths out of the workspace "
                            "and of approved outside paths (or approve a path deeper down)."
                        )
                    try:
                        prepare_writable(approved)
                    except OSError as exc:
                        raise ConfinementError(
                            "toolsetd: the approved outside-workspace path cannot be made "
                            f"writable in the sandbox: {exc.strerror} ({exc.filename}). The call "
                            "did not run."
                        ) from exc
                    plan = SandboxPlan(
                        conf.profile, conf.network, own,
                        (*writable, *approved), unseen, cwd, self.own_ipc, no_userns, shown,
                    )  # fmt: skip
                else:
                    plan = SandboxPlan(
                        conf.profile, conf.network, (*own, *writable), (), unseen, cwd,
                        self.own_ipc, no_userns, shown,
                    )  # fmt: skip
                # What bubblewrap binds, checked again in the built sandbox: a call that may
                # write a folder above one of them can swap it for a link meanwhile, and
                # bubblewrap would bind where the link leads (``binds_moved``). Not a path a
                # later mount covers (``/proc``, ``/sys``, a hidden path: no call can rename what
                # is above those). Each is canonical (the workspace, an approved path as
                # resolved when classified, the others as ``call_binds`` resolved them): a link
                # on its way now is a swap.
                checked = [
                    (path, writes)
                    for paths, writes in ((plan.readable, False), (plan.writable, True))
                    for path in paths
                    if os.path.lexists(path) and not _covered(path, unseen)
                ]
                try:
                    binds = bind_identities(checked)
                except OSError as exc:
                    if out_of_resources(exc):
                        raise
                    raise ConfinementError(_MOVED.format(path=exc.filename or cwd)) from exc
                for (path, _), bind in zip(checked, binds, strict=True):
                    if bind[0] != os.path.normpath(path):
                        raise ConfinementError(_MOVED.format(path=path))
                if self.status_fd:
                    status = os.pipe2(os.O_CLOEXEC)
                    os.set_blocking(status[0], False)
                    if binds and self.bind_check:
                        try:
                            block = os.pipe2(os.O_CLOEXEC)
                        except OSError:
                            _close(status)
                            raise
                full = [
                    *bwrap_argv(
                        self.bwrap, plan, status[1] if status else None, block[0] if block else None
                    ),
                    *argv,
                ]
        except BaseException:
            if cgroup is not None:
                cgroup.discard()
            raise
        if cgroup is not None:
            assert self.cgroups is not None
            # Memory and pids limits would count the daemon while it stands inside: those
            # calls' children join by themselves, through the shell, before the tool runs.
            enter = self.cgroups.can_enter and (
                conf.limits.memory_max is None and conf.limits.pids_max is None
            )
            if not enter:
                full = [*JOIN_ARGV, cgroup.procs, *full]
        return Prepared(full, cgroup, sandboxed, conf.limits, enter, status, block, binds, argv[0])


#: The result text of a call whose writable path was swapped while its sandbox was made.
_MOVED = (
    "toolsetd: the path {path}, which this call's sandbox binds, changed while its sandbox was "
    "being made (something swapped it, or a folder on its way, for a symbolic link), and "
    "the sandbox would not have bound it as checked. The call did not run; retry it, and "
    "keep other calls from replacing folders above this workspace."
)


def built_sandbox(prepared: Prepared, status: bytes) -> str:
    """Whether a call's sandbox, built and waiting on its block pipe, binds what was checked.

    Args:
        prepared: The call (``block`` set).
        status: What bubblewrap wrote on its status pipe so far (``{"child-pid": N, ...}``
            comes first).

    Returns:
        ``"wait"`` while the sandbox is not built yet (or the pid not written yet),
        ``"gone"`` when its process has ended (bubblewrap could not build it: its own error
        follows), ``""`` when it binds what was checked, else the call's result text (it
        must not run).
    """
    pid = sandbox_pid(status)
    if pid is None:
        return "wait"
    assert prepared.block is not None
    done = setup_done(pid, prepared.block[0])
    if done is None:
        if not os.path.exists(f"/proc/{pid}"):
            return "gone"
        return (
            "toolsetd: the daemon cannot see whether this call's sandbox binds its paths as "
            "checked (neither /proc/<pid>/syscall nor /proc/<pid>/wchan of bubblewrap's "
            "process says it waits). The call did not run."
        )
    if not done:
        return "wait"
    moved = binds_moved(pid, prepared.binds)
    return "" if moved is None else _MOVED.format(path=moved)


def _covered(path: str, hidden: Sequence[str]) -> bool:
    """Whether a mount after the writable binds covers ``path`` (``sandbox.bwrap_argv``)."""
    return any(is_within(Path(path), Path(top)) for top in ("/proc", "/sys", *hidden))


def _close(fds: Sequence[int]) -> None:
    for fd in fds:
        os.close(fd)


def setup_failure(
    prepared: Prepared, returncode: int | None, stderr: bytes, status: bytes = b""
) -> str | None:
    """The result text of a call whose confinement failed in the child, else None.

    ``status`` is what bubblewrap wrote on the status pipe: a tool that ran is never a
    setup failure, whatever it printed.
    """
    if (
        prepared.cgroup is not None
        and not prepared.enter
        and returncode == JOIN_FAILED_EXIT
        and stderr.startswith(_JOIN_FAILED_TEXT)
    ):
        return (
            "toolsetd: the call could not enter its cgroup, so it did not run: "
            + stderr.decode(errors="replace").strip()
        )
    if (
        prepared.sandboxed
        and returncode == 1
        and stderr.startswith(SETUP_FAILED_PREFIX)
        and not tool_ran(status)
        and exec_failure(stderr, prepared.command) is None  # the sandbox was built
    ):
        # bubblewrap's own fork failed for want of tasks: its words name no limit either.
        said = stderr.decode(errors="replace").strip().splitlines()[0]
        return "toolsetd: the sandbox could not be set up, so the tool did not run: " + (
            out_of_tasks(said)
        )
    return None


def command_failure(
    prepared: Prepared,
    returncode: int | None,
    stderr: bytes,
    status: bytes,
    set_dir: Path,
    env: Sequence[bytes],
) -> str | None:
    """Why a sandboxed call's command could not be executed in its built sandbox, as an
    unsandboxed start says it (the reason, the file, then the sentence that names the
    fix), else None.

    ``check_executable`` refuses what it can see before the sandbox is built; what only
    the sandbox's exec meets (a ``#!bash`` line, looked for in the workspace; an
    interpreter under the host's ``/tmp``, which the sandbox's own ``/tmp`` hides) is
    bubblewrap's ``execvp`` failing (``sandbox.exec_failure``): the tool's command, not
    the sandbox.
    """
    if not prepared.sandboxed or returncode != 1 or tool_ran(status):
        return None
    reason = exec_failure(stderr, prepared.command)
    if reason is None:
        return None
    name = prepared.command
    search_path = env_path(env)  # the child's PATH, read only once the exec failed
    hint = _hidden_interpreter(name, set_dir, search_path) or executable_problem(
        name, set_dir, search_path
    )
    return f"{reason}: {name}" + (f". {hint}" if hint else "")


def _hidden_interpreter(name: str, set_dir: Path, search_path: str | None) -> str:
    """The sentence for a command whose ``#!`` interpreter is under the host's ``/tmp``
    (as named, or where it leads), which a sandboxed call does not see, else ""."""
    runs = name if os.sep in name else shutil.which(name, path=search_path)
    interpreter = shebang_interpreter(runs) if runs is not None else None
    if interpreter is None:
        return ""
    tmp, own = Path("/tmp"), Path(os.path.realpath(set_dir))  # noqa: S108 -- a path compared
    places = (Path(os.path.normpath(interpreter)), Path(os.path.realpath(interpreter)))
    if not any(is_within(p, tmp) and not is_within(p, own) for p in places):
        return ""
    return (
        f"Command file {runs} names the interpreter {interpreter} on its #! line, which is "
        "under the host's /tmp: a sandboxed call has a /tmp of its own, without it; "
        "install it elsewhere, or name one outside /tmp."
    )


def usage_text(usage: CallUsage, limits: Limits) -> str | None:
    """The note a call killed by the OOM killer gets in its result text, else None."""
    if not usage.oom_killed:
        return None
    cap = f" ({limits.memory_max} bytes, memory-max)" if limits.memory_max else ""
    return (
        f"toolsetd: the tool was killed by the out-of-memory killer: the call reached the "
        f"memory limit of its set{cap}."
    )
