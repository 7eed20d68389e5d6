"""``toolsetctl``: the operator's command line for toolsetd.

Theory of operation: ``run(argv)`` parses the arguments (``toolsetd.client.parser``),
resolves their defaults, runs one command and returns the exit code. Every outcome is
printed once: a result, or a failure. A failure is a ``Failure``
(``toolsetd.client.exits``, which holds the exit-code table) carrying its exit code and
an error object (``code``, ``message``, ``data``): in ``table``/``text`` the message
(and its detail lines) goes to stderr; in ``json`` and ``jsonl`` the one document
``{"error": {...}}`` goes to stdout. Never a traceback.

Commands that need the daemon talk to it over ``BlockingClient`` (stdlib sockets: the
start-up of a command is its cost, see ``toolsetd.client.blocking``); ``list`` and
``show`` fall back to reading the files (``toolsetd.client.offline``, imported only
then) when no daemon answers; ``enable`` and ``disable`` edit the files of the running
daemon's home (or ``--home``) and ask it to reload; ``validate`` works on the files.
"""

from __future__ import annotations

import errno
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from toolsetd.protocol.errors import workspace_not_a_directory
from toolsetd.protocol.whitespace import NET_WHITESPACE

from .blocking import BlockingClient
from .command import absolute_path
from .context import (
    Context,
    UsageError,
    call,
    call_params,
    parse_arguments,
    read_arguments,
    request,
)
from .errors import ConnectError
from .exits import (
    CLI_ERROR_CODES,
    EXIT_BUSY,
    EXIT_DAEMON_CANCELLED,
    EXIT_DENIED,
    EXIT_INTERNAL,
    EXIT_INTERRUPTED,
    EXIT_NOT_ALLOWED,
    EXIT_OK,
    EXIT_TIMEOUT,
    EXIT_TOOL_ERROR,
    EXIT_UNREACHABLE,
    EXIT_USAGE,
    Failure,
    usage,
)
from .invoke import cmd_invoke

# One socket default for the CLI and the MCP pump (the pump is stdlib-only, so it owns it).
from .mcp import CONNECT_TIMEOUT, default_socket_path
from .parser import COMMANDS, FORMATS, ParseError, build_parser, command_in
from .render import (
    CHANGE_HEADERS,
    DISCOVERY_OFF,
    PATH_HEADERS,
    SET_HEADERS,
    Output,
    SetRow,
    classification_fields,
    classification_path_rows,
    inventory_table,
    is_directory_name,
    reload_rows,
    set_rows_from_list,
    status_fields,
    tool_fields,
)
from .termination import interruption

# Not typing's TYPE_CHECKING: typing (like dataclasses, which pulls in inspect and ast) is
# a share of the start-up this module avoids; the names are only used in annotations.
TYPE_CHECKING = False
if TYPE_CHECKING:
    import argparse
    from typing import Any, TextIO

# The exit codes are re-exported on purpose: scripts and tests import them from the CLI.
__all__ = [
    "CLI_ERROR_CODES",
    "EXIT_BUSY",
    "EXIT_DAEMON_CANCELLED",
    "EXIT_DENIED",
    "EXIT_INTERNAL",
    "EXIT_INTERRUPTED",
    "EXIT_NOT_ALLOWED",
    "EXIT_OK",
    "EXIT_TIMEOUT",
    "EXIT_TOOL_ERROR",
    "EXIT_UNREACHABLE",
    "EXIT_USAGE",
    "UsageError",
    "build_parser",
    "default_socket_path",
    "parse_arguments",
    "run",
]


def default_home(env: Mapping[str, str] | None = None) -> str:
    """Return the Crystal home: ``$CRYSTAL_HOME``, else ``~/.crystal``, ``~`` as the daemon
    finds it (an empty ``HOME`` is the passwd entry's home, not ``/``)."""
    env = os.environ if env is None else env
    crystal = env.get("CRYSTAL_HOME")
    if crystal:
        return crystal
    # The daemon's rule (os_user_home), from the offline reader: only without HOME.
    user_home = env.get("HOME") or _offline_module().os_user_home(env) or "~"
    return os.path.join(user_home, ".crystal")


def _offline_module() -> Any:
    """Import the offline reader, or explain why it is unavailable (exit 2)."""
    try:
        from . import offline  # the one daemon import, lazily
    except ImportError as exc:
        if _out_of_memory_loading(exc):
            raise MemoryError(str(exc)) from exc  # said as OUT_OF_MEMORY, exit 9
        raise usage(f"Reading tool sets from disk is unavailable: {exc}.") from exc
    offline.check_allocations_if_they_can_fail()
    return offline


def _out_of_memory_loading(exc: ImportError) -> bool:
    """Whether an import failed for want of memory: an extension module the loader could not
    map (dlopen's "failed to map segment from shared object", or ENOMEM's words) under the
    limit toolsetctl runs under, which is no missing module and no usage error."""
    text = str(exc)
    return "failed to map segment" in text or os.strerror(errno.ENOMEM) in text


def _listing_discovery(listing: _Listing) -> bool:
    """Whether discovery is on for a listing: a set the daemon loaded proves it."""
    if listing.from_daemon and any(
        entry.get("state") == "loaded" for entry in listing.result.get("sets") or []
    ):
        return True  # no need to import the daemon's config reader
    return _discovery_enabled(listing.home)


def _discovery_enabled(home: Path) -> bool:
    try:
        return bool(_offline_module().discovery_enabled(home))
    except Exception:  # a config.json the daemon side cannot read: say nothing more here
        return True


def _daemon_home(ctx: Context, client: BlockingClient) -> Path:
    status = call(ctx, client, "status")
    home = status.get("home") if isinstance(status, dict) else None
    return Path(home) if isinstance(home, str) and home else ctx.default_home


# -- commands --------------------------------------------------------------------------


def _cmd_status(ctx: Context, args: argparse.Namespace) -> int:
    result = request(ctx, "status")
    if ctx.out.is_json:
        ctx.emit(result)
    else:
        ctx.out.fields(status_fields(result))
    return EXIT_OK


def _print_notes(
    ctx: Context, notes: Sequence[Mapping[str, Any]], tools: Sequence[Any] = ()
) -> None:
    loaded = {t.get("name"): t for t in tools if isinstance(t, Mapping)}
    for note in notes:
        message = str(note.get("message", ""))
        ctx.out.line(f"- {message}{_omitted_where(note, message, loaded)}")


_OMITTED = "was omitted because the name is already registered."


def _omitted_where(note: Mapping[str, Any], message: str, loaded: Mapping[Any, Any]) -> str:
    """Which sets a tool name clashes between, after the reference host's note.

    "External tool 'lint' was omitted because the name is already registered." named
    neither the set that lost the tool nor the one that has it: an operator with two sets
    declaring one name could not tell which copy runs. The note itself stays the
    reference host's; the wire's note carries the set, ``list``'s tools the winner.
    """
    prefix = "External tool '"
    if not (message.startswith(prefix) and message.endswith(_OMITTED)):
        return ""
    name = message[len(prefix) : -len(_OMITTED)].removesuffix("' ")
    lost, source = note.get("set"), note.get("source")
    if not isinstance(lost, str) or not isinstance(source, str):
        return ""
    text = f" It is tool set {lost}'s ({source})"
    owner = loaded.get(name)
    if isinstance(owner, Mapping) and owner.get("set") != lost:
        winner = f"tool set {owner.get('set')}'s ({owner.get('source')})"
        text += f"; the '{name}' that loaded is {winner}"
    return f"{text}: rename one of them."


class _Listing:
    """A ``list`` result, its inventory rows and the home they were read from.

    ``workspace`` is the workspace as the rows' paths name it: the daemon names project
    sets under the workspace it resolved (a ``--workspace`` through a link is served as its
    target); the files read here are named under the workspace as it was given.
    """

    def __init__(
        self,
        result: dict[str, Any],
        rows: list[SetRow],
        home: Path,
        *,
        from_daemon: bool,
        workspace: str,
    ) -> None:
        self.result = result
        self.rows = rows
        self.home = home
        self.from_daemon = from_daemon
        self.workspace = workspace


def _is_dir(path: Path) -> bool | str:
    """Whether ``path`` is a directory, or the system's reason it cannot be looked at (a
    folder on its way the user may not search: pathlib raises there, not False)."""
    try:
        return path.is_dir()
    except OSError as exc:
        return exc.strerror or type(exc).__name__


def _not_a_folder(path: Path) -> str:
    """Why ``path``, which is no directory, cannot be a home: a file named by mistake (a
    ``--home`` given the ``config.json``) is not "missing"."""
    return "is not a directory" if os.path.lexists(path) else "does not exist"


def _cannot_read(path: Path, reason: str) -> str:
    return f"{path} cannot be read ({reason}): run toolsetctl as a user that may read it"


def _require_workspace(ctx: Context) -> None:
    """Refuse a workspace that is not a directory, in the daemon's code and words (exit 2)."""
    state = _is_dir(ctx.workspace)
    if state is True:
        return
    message = (
        workspace_not_a_directory(str(ctx.workspace))
        if state is False
        else f"Invalid workspace: {_cannot_read(ctx.workspace, state)}."
    )
    raise Failure(EXIT_USAGE, -32006, message, {"field": "workspace"})  # InvalidWorkspace


def _listing(ctx: Context, catalog: str | None) -> _Listing:
    """The daemon's ``list`` and home, or the files' when no daemon answers."""
    params: dict[str, Any] = {"workspace": ctx.wire_workspace}
    if catalog is not None:
        params["catalog"] = catalog
    try:
        client = BlockingClient.connect(ctx.socket, timeout=CONNECT_TIMEOUT)
    except ConnectError as exc:
        # The daemon's refusal (exit 2), not the home sets alone: a mistyped --workspace
        # must not pass without a daemon and fail with one.
        _require_workspace(ctx)
        offline = _offline_module()
        if exc.absent:
            ctx.out.error(
                f"toolsetd is not running at {ctx.socket}; showing the tool sets on disk."
            )
        else:  # something is there (a socket we may not open, a full backlog): say so
            ctx.out.error(f"{exc} Showing the tool sets on disk.")
        home = ctx.home_option or ctx.default_home
        return _Listing(
            offline.offline_list(home, ctx.workspace, catalog),
            offline.inventory(home, ctx.workspace, catalog),
            home,
            from_daemon=False,
            workspace=str(ctx.workspace),
        )
    with client:
        result = call(ctx, client, "list", params)
        home = _daemon_home(ctx, client)
    rows = set_rows_from_list(result, catalog)
    workspace = os.path.realpath(ctx.workspace)
    if not rows and not _discovery_enabled(home):
        # Discovery off: the daemon scans nothing, but the inventory is still the files on
        # disk, as the reference host's `tools list` and the offline reader show it.
        rows = _offline_module().inventory(home, ctx.workspace, catalog)
        workspace = str(ctx.workspace)
    return _Listing(result, rows, home, from_daemon=True, workspace=workspace)


def _inventory(ctx: Context, listing: _Listing) -> None:
    rows = listing.rows
    if not rows:
        ctx.out.line("No tool sets.")
        return
    if ctx.out.format == "text":
        ctx.out.rows(SET_HEADERS, [row.cells() for row in rows], empty="No tool sets.")
        return
    width = None if ctx.wide else ctx.out.width
    headers, cells, foldable = inventory_table(
        rows,
        width,
        wide=ctx.wide,
        workspace=listing.workspace,
        user_home=ctx.env.get("HOME") or None,
    )
    ctx.out.rows(headers, cells, empty="No tool sets.", foldable=foldable)


def _cmd_list(ctx: Context, args: argparse.Namespace) -> int:
    listing = _listing(ctx, args.catalog)
    if ctx.out.is_json:
        ctx.emit(listing.result)
        return EXIT_OK
    _inventory(ctx, listing)
    _print_notes(ctx, listing.result.get("notes") or [], listing.result.get("tools") or [])
    if not _listing_discovery(listing):
        ctx.out.line(DISCOVERY_OFF)
    return EXIT_OK


def _find_row(rows: Sequence[SetRow], name: str, source: str | None) -> SetRow | None:
    matches = [row for row in rows if row.directory == name]
    if source is not None:
        matches = [row for row in matches if row.source == source]
    matches.sort(key=lambda row: row.source != "project")  # the project copy wins
    return matches[0] if matches else None


def _set_entry(result: Mapping[str, Any], directory: str, source: str) -> Any:
    """A set's ``sets[]`` entry in a ``list`` result (the daemon's, or ``offline_list``'s:
    both ``daemon.catalog.set_info``), or None when it has none (discovery off)."""
    key = (directory, source)
    sets = result.get("sets") or []
    return next((s for s in sets if (s.get("directory"), s.get("source")) == key), None)


def _not_found(name: str, source: str | None) -> Failure:
    where = {"home": " in Home", "project": " in Project"}.get(source or "", "")
    return Failure(
        EXIT_USAGE,
        CLI_ERROR_CODES["not_found"],
        f"Tool set '{name}' was not found{where}.",
        {"directory": name, "source": source},
    )


def _required_name() -> Failure:
    """A blank set directory, as the reference host's console says before it looks."""
    return Failure(EXIT_USAGE, CLI_ERROR_CODES["usage"], "Directory is required.", {})


def _invalid_name(name: str) -> Failure:
    return Failure(
        EXIT_USAGE, CLI_ERROR_CODES["not_found"], "Directory name is invalid.", {"directory": name}
    )


def _cmd_show(ctx: Context, args: argparse.Namespace) -> int:
    name = args.name.strip(NET_WHITESPACE)  # as .NET's Trim(): U+001C..U+001F stay
    listing = _listing(ctx, None)
    if args.source is None:
        tools = listing.result.get("tools") or []
        tool = next((t for t in tools if t.get("name") == name), None)
        if tool is not None:
            if ctx.out.is_json:
                ctx.emit(tool)
            else:
                ctx.out.fields(tool_fields(tool))
            return EXIT_OK
    if not name:
        raise _required_name()
    if not is_directory_name(name):
        raise _invalid_name(name)
    row = _find_row(listing.rows, name, args.source)
    if row is None:
        raise _not_found(name, args.source)
    if ctx.out.is_json:
        ctx.emit(_set_entry(listing.result, row.directory, row.source) or row.to_json())
        return EXIT_OK
    ctx.out.fields(row.fields())
    if not _listing_discovery(listing):
        ctx.out.line(DISCOVERY_OFF)
    return EXIT_OK


def _edit_home(ctx: Context) -> tuple[Path, str, BlockingClient | None]:
    """The home to edit and where it came from, and the daemon's connection if one answers.

    The contract's order (section 6): ``--home``, else ``$CRYSTAL_HOME``, else
    ``~/.crystal``; with neither given, the home of the daemon at ``--socket`` comes
    before ``~/.crystal``, so that a plain ``disable hello`` edits the sets that daemon
    serves (issue 12). ``$CRYSTAL_HOME`` came after the daemon's home: a home the operator
    named was passed over for another one, and left as it was.
    """
    named: tuple[Path, str] | None = None
    if ctx.home_option is not None:
        named = ctx.home_option, "option"
    elif ctx.env.get("CRYSTAL_HOME"):
        named = ctx.default_home, "environment"  # default_home is $CRYSTAL_HOME then
    try:
        client: BlockingClient | None = BlockingClient.connect(ctx.socket, timeout=CONNECT_TIMEOUT)
    except ConnectError as exc:
        if not exc.absent and not exc.not_socket and named is None:
            # A socket is there that could not be asked (one we may not open, a full
            # backlog): its home is not known, and the default one may be a home that
            # daemon does not serve. (A file or folder there is no daemon: as none.)
            raise Failure(
                EXIT_UNREACHABLE,
                CLI_ERROR_CODES["unreachable"],
                f"{exc} Nothing was written: the sets edited are those of the toolsetd at "
                "--socket, which could not be asked for its home; give --home to edit a "
                "home's sets without it.",
                {"socket": ctx.socket},
            ) from exc
        client = None
    if named is not None:
        return *named, client
    if client is not None:
        try:
            return _daemon_home(ctx, client), "daemon", client
        except BaseException:
            client.close()
            raise
    return ctx.default_home, "default", None


def _cmd_enable(ctx: Context, args: argparse.Namespace) -> int:
    from .editor import EditError, locate_set, set_enabled

    if not args.directory.strip(NET_WHITESPACE):
        raise _required_name()
    enabled = args.command == "enable"
    offline = _offline_module()
    # Its project copy is the one meant: in a mistyped workspace there is none, and the
    # home copy would be edited instead, a set the job never meant.
    _require_workspace(ctx)
    home, home_from, client = _edit_home(ctx)
    try:
        try:
            directory, source, path = locate_set(
                home, ctx.workspace, args.directory, args.source, exists=offline.file_exists
            )
        except EditError as exc:
            failure = Failure(
                EXIT_USAGE, CLI_ERROR_CODES["not_found"], exc.message, {"home": str(home)}
            )
            state = _is_dir(home) if "not found" in exc.message else True
            if state is False:
                failure.details.append(f"  The home {home} {_not_a_folder(home)}.")
            elif state is not True:
                failure.details.append(f"  The home {_cannot_read(home, state)}.")
            elif "not found" in exc.message and args.source != "project":
                # The home is there, but not a tools folder the sets can be found in: the
                # daemon skips it without a word (as the reference host does), so say it.
                tools = home / "tools"
                tools_state = _is_dir(tools)
                if tools_state is False and os.path.lexists(tools):
                    failure.details.append(f"  The home's tools folder {tools} is not a directory.")
                elif isinstance(tools_state, str):
                    failure.details.append(
                        f"  The home's tools folder {_cannot_read(tools, tools_state)}."
                    )
                elif tools_state is True and not os.access(tools, os.R_OK | os.X_OK):
                    failure.details.append(
                        f"  The home's tools folder {_cannot_read(tools, 'Permission denied')}."
                    )
            raise failure from exc
        try:
            check = _manifest_check(offline, path.parent, source)
            outcome = set_enabled(
                path,
                enabled,
                check=check,
                read=offline.read_for_edit,
                max_bytes=offline.MAX_MANIFEST_BYTES,
            )
        except EditError as exc:
            raise Failure(
                EXIT_USAGE, CLI_ERROR_CODES["invalid_set"], exc.message, {"path": str(path)}
            ) from exc
        reloaded = False
        if outcome.changed and client is not None:
            try:
                call(ctx, client, "reload", {"workspace": ctx.wire_workspace})
                reloaded = True
            except Failure as failure:
                ctx.out.error(f"toolsetd did not reload: {failure.message}")
        served = home if home_from == "daemon" else _served_home(ctx, client)
        serves_it = served is not None and _same_folder(served, home)
        # The daemon's view, when it took the edit in (or there was none to take): after a
        # reload that failed it still holds the set as it was, and the files say better.
        # A project set is the workspace's, whatever home the daemon serves.
        ours = source == "project" or serves_it
        current = served is not None and ours and (reloaded or not outcome.changed)
        listed = _served_list(ctx, client) if ctx.out.is_json and current else None
    finally:
        if client is not None:
            client.close()
    rows: list[SetRow] = offline.inventory(home, ctx.workspace)
    row = _find_row(rows, directory, source)
    word = "enabled" if enabled else "disabled"
    message = (
        f"Tool set {directory} {word}."
        if outcome.changed
        else f"Tool set {directory} is already {word}."
    )
    where = {
        "daemon": f"the home of the toolsetd at {ctx.socket}",
        "option": "--home",
        "environment": "CRYSTAL_HOME",
        "default": "no toolsetd answered; ~/.crystal",
    }[home_from]
    if source == "home" and served is not None and not serves_it:
        ctx.out.error(
            f"The toolsetd at {ctx.socket} serves the home {served}, not this one: what it "
            f"serves is unchanged (give --home {served} to edit its sets)."
        )
    if ctx.out.is_json:
        ctx.emit(
            {
                "directory": directory,
                "source": source,
                "path": str(path),
                "home": str(home),
                "homeFrom": home_from,
                "enabled": enabled,
                "changed": outcome.changed,
                "reloaded": reloaded,
                "entry": _edited_entry(offline, listed, home, ctx.workspace, row),
                "message": message,
            }
        )
        return EXIT_OK
    # The file and where its home came from, said even when it already had the value (then
    # it was left byte for byte as it was, so "Edited" would be untrue).
    done = f"Edited {path}" if outcome.changed else f"Left {path} as it was,"
    if source == "home":
        ctx.out.error(f"{done} in the home {home} ({where}).")
    else:
        ctx.out.error(f"{done} in the workspace {ctx.workspace}.")
    if row is not None:
        ctx.out.fields(row.fields())
    ctx.out.line(message)
    if enabled and not _discovery_enabled(home):
        ctx.out.line(DISCOVERY_OFF)
    return EXIT_OK


def _same_folder(one: Path, other: Path) -> bool:
    """Whether two paths name one folder: a home named through a link to the one the
    daemon serves is that home (compared as text when either cannot be looked at)."""
    try:
        return os.path.samefile(one, other)
    except OSError:
        return one == other


def _served_home(ctx: Context, client: BlockingClient | None) -> Path | None:
    """The home the daemon serves, or None when none answers (the file is written by now:
    a daemon that fails to answer leaves the files to say it)."""
    if client is None:
        return None
    try:
        return _daemon_home(ctx, client)
    except Failure:
        return None


def _served_list(ctx: Context, client: BlockingClient | None) -> dict[str, Any] | None:
    """The daemon's ``list`` after an edit of the home it serves, else None.

    ``show`` prints the daemon's view of a set when one answers (its state as loaded, a
    project set under the workspace it resolved), so the edited set's ``entry`` is taken
    from it too; a home the daemon does not serve is read from the files.
    """
    if client is None:
        return None
    try:
        listed: dict[str, Any] = call(ctx, client, "list", {"workspace": ctx.wire_workspace})
    except Failure:
        return None
    return listed


def _edited_entry(
    offline: Any, listed: dict[str, Any] | None, home: Path, workspace: Path, row: SetRow | None
) -> Any:
    """The edited set as ``show --source <source> --format json`` prints it: its ``sets[]``
    entry in the daemon's ``list`` (``listed``), else in the one the files make, else (with
    discovery off neither has one) its inventory row, as ``show`` falls back to."""
    if row is None:
        return None
    entry = _set_entry(listed, row.directory, row.source) if listed is not None else None
    if entry is None:  # no daemon serves the home, or it scans nothing
        entry = _set_entry(offline.offline_list(home, workspace), row.directory, row.source)
    return entry or row.to_json()


def _manifest_check(offline: Any, set_dir: Path, source: str) -> Callable[[bytes], str | None]:
    def check(data: bytes) -> str | None:
        problem: str | None = offline.manifest_problem(data, set_dir=set_dir, source=source)
        return problem

    return check


def _cmd_validate(ctx: Context, args: argparse.Namespace) -> int:
    offline = _offline_module()
    target = Path(args.directory)
    problems: list[str] = []
    elsewhere: list[str] = []  # said after the folder's own problem
    home = ctx.home_option
    state = True if home is None else _is_dir(home)
    if home is not None and state is False:
        problems.append(f"The home {home} (--home) {_not_a_folder(home)}.")
    elif home is not None and isinstance(state, str):
        problems.append(f"The home (--home) {_cannot_read(home, state)}.")
    if not _exists(target) and is_directory_name(args.directory):
        from .editor import EditError, locate_set, manifest_path

        _require_workspace(ctx)  # a name is looked up in it first, as enable does

        try:
            located = locate_set(
                home or ctx.default_home,
                ctx.workspace,
                args.directory,
                None,
                exists=offline.file_exists,
            )
            target = located[2].parent
        except EditError:
            # Found nowhere: say where else it was looked for, not only "./NAME".
            where = {
                source: manifest_path(
                    home or ctx.default_home, ctx.workspace, args.directory, source
                ).parent
                for source in ("project", "home")
            }
            elsewhere.append(
                f"No tool set '{args.directory}' in the workspace ({where['project']}) or "
                f"the home ({where['home']}) either."
            )
    try:  # a relative DIR needs the current folder, which a CI step may have removed
        target = target.absolute()
    except OSError as exc:
        raise UsageError(
            f"the current folder cannot be used ({exc.strerror}): run toolsetctl from an "
            "existing folder, or give validate an absolute DIR"
        ) from None
    report = offline.validate_set(target, args.reserve)
    report.problems[:0] = problems
    report.problems.extend(elsewhere)
    if report.runner == "dotnet":
        # Valid, and still not served: "valid: 0 tools" alone read as if it were.
        report.notes.append(
            "toolsetd skips it: the dotnet runner is not supported (no .NET runtime)."
        )
    if report.runner is not None:
        report.notes.extend(_not_looked_for(ctx, target, home))
    try:  # the verdict is the exit code, read or not (toolsetctl validate x | head -n1)
        if ctx.out.is_json:
            ctx.emit(report.to_json())
        elif report.valid:
            count = len(report.tools)
            noun = "tool" if count == 1 else "tools"
            names = f" ({', '.join(report.tools)})" if report.tools else ""
            ctx.out.line(f"Tool set {report.directory} is valid: {count} {noun}{names}.")
            for note in report.notes:
                ctx.out.line(note)
        else:
            ctx.out.line(f"Tool set {report.directory} is not valid:")
            for problem in report.problems:
                ctx.out.line(f"- {problem}")
            for note in report.notes:
                ctx.out.line(note)
    except BrokenPipeError:
        ctx.out.discard()
    return EXIT_OK if report.valid else EXIT_USAGE


def _not_looked_for(ctx: Context, target: Path, home: Path | None) -> list[str]:
    """A sentence when toolsetd never reads the set at ``target`` (it is not a folder of
    ``<home>/tools`` or ``<workspace>/.crystal/tools``), else none.

    A set made in ``~/.crystal/x``, ``.crystal/tool/x`` or one level too deep was called
    valid, and then was in no list and no catalog, with no word of where sets go. The
    home is ``--home``, else the default one, else (only when the set is in neither)
    the home of the toolsetd at ``--socket``, as ``enable`` finds it: a daemon started
    with ``--home`` reads its sets there.
    """
    try:
        parent = os.path.realpath(target.parent)
    except (OSError, ValueError):
        return []

    def roots(home: Path) -> tuple[Path, Path]:
        return home / "tools", ctx.workspace / ".crystal" / "tools"

    def reads(home: Path) -> bool:
        return any(parent == os.path.realpath(root) for root in roots(home))

    home = home or ctx.default_home
    if reads(home):
        return []
    if ctx.home_option is None:
        try:
            client = BlockingClient.connect(ctx.socket, timeout=CONNECT_TIMEOUT)
        except ConnectError:
            client = None
        if client is not None:
            try:
                home = _daemon_home(ctx, client)
            except Failure:
                pass
            finally:
                client.close()
            if reads(home):
                return []
    looked = roots(home)
    return [
        f"toolsetd does not load it from {target.parent}: it reads the tool sets in "
        f"{looked[0]} (the home's) and {looked[1]} (this workspace's); move the folder "
        "into one of them."
    ]


def _exists(path: Path) -> bool:
    try:
        return path.exists()
    except OSError:  # not to be looked at: validate_set says why
        return True


def _cmd_classify(ctx: Context, args: argparse.Namespace) -> int:
    _, text = read_arguments(args.arguments, ctx.stdin)
    result = request(ctx, "classify", call_params(ctx, args, text))
    decision = result.get("decision") if isinstance(result, dict) else None
    code = EXIT_OK if decision == "allow" else EXIT_DENIED
    try:  # the decision is the exit code, read or not (toolsetctl classify x | head -n1)
        if ctx.out.is_json:
            ctx.emit(result)
            return code
        ctx.out.fields(classification_fields(result))
        paths = classification_path_rows(result)
        if paths:
            ctx.out.rows(PATH_HEADERS, paths, empty="", foldable=(1, 2))
    except BrokenPipeError:
        ctx.out.discard()
    return code


def _cmd_reload(ctx: Context, args: argparse.Namespace) -> int:
    result = request(ctx, "reload", {} if args.all else {"workspace": ctx.wire_workspace})
    config = result.get("config") or {}
    error = config.get("error")
    if ctx.out.is_json:
        if error:  # a config file the daemon could not use fails the reload (systemctl
            # reload reports it); the daemon keeps its running settings
            raise Failure(EXIT_USAGE, CLI_ERROR_CODES["invalid_config"], str(error), result)
        ctx.emit(result)
        return EXIT_OK
    try:  # an unusable config file is the exit code, read or not (reload | head -n1)
        # Nothing changed *since the last load*: the watcher may have taken the edit in
        # already, and the operator who runs reload after it should not read "ignored".
        ctx.out.rows(
            CHANGE_HEADERS,
            reload_rows(result),
            empty=f"Nothing changed since the last load (generation {result.get('generation')}).",
        )
        _print_notes(ctx, result.get("notes") or [])
        if config.get("applied"):
            ctx.out.line(f"Config applied: {', '.join(config['applied'])}")
        if config.get("restartNeeded"):
            ctx.out.line(f"Config needs a restart: {', '.join(config['restartNeeded'])}")
    except BrokenPipeError:
        ctx.out.discard()
    if error:
        raise Failure(
            EXIT_USAGE,
            CLI_ERROR_CODES["invalid_config"],
            f"toolsetd kept its settings: {error}",
            result,
        )
    return EXIT_OK


def _cmd_metrics(ctx: Context, args: argparse.Namespace) -> int:
    result = request(ctx, "metrics", {})
    if ctx.out.is_json:
        ctx.emit(result)
    else:
        ctx.out.tool_text(str(result.get("text", "")))
    return EXIT_OK


_COMMANDS: dict[str, Callable[[Context, argparse.Namespace], int]] = {
    "status": _cmd_status,
    "list": _cmd_list,
    "show": _cmd_show,
    "enable": _cmd_enable,
    "disable": _cmd_enable,
    "validate": _cmd_validate,
    "classify": _cmd_classify,
    "invoke": cmd_invoke,
    "reload": _cmd_reload,
    "metrics": _cmd_metrics,
}


def _report(out: Output, failure: Failure) -> int:
    """Print a failure in the output's format; return its exit code.

    The code stands when the failure cannot be printed (a closed pipe): a denial, a
    timeout or a lost daemon is never an exit 0 because nobody read the message. A stdout
    that fails otherwise (``> /dev/full``, a full disk: often the very failure reported)
    gets the message on stderr instead of a traceback.
    """
    try:
        if out.is_json and not out.documented:
            out.json({"error": failure.error()})
            out.flush()
        else:
            # json prints one document: after the result's (a signal while a reader lagged
            # stopped its printing), the failure goes to stderr, the document whole first.
            out.finish()
            out.error(failure.said)
            for line in failure.details:
                out.error(line)
    except BrokenPipeError:
        out.discard()
    except OSError:
        out.discard()
        out.error(failure.message)  # nothing of the details can follow it
    return failure.exit_code


def _requested_format(argv: Sequence[str]) -> str:
    """The ``--format`` in ``argv`` (for reporting an argparse error in that format)."""
    found = "table"
    for index, arg in enumerate(argv):
        if arg == "--format" and index + 1 < len(argv):
            found = argv[index + 1]
        elif arg.startswith("--format="):
            found = arg.split("=", 1)[1]
    return found if found in FORMATS else "table"


def run(
    argv: Sequence[str] | None = None,
    *,
    stdout: TextIO | None = None,
    stderr: TextIO | None = None,
    stdin: TextIO | None = None,
) -> int:
    """Run ``toolsetctl`` and return its exit code.

    Args:
        argv: The arguments (``sys.argv[1:]`` when None).
        stdout: Where results go (``sys.stdout`` when None).
        stderr: Where errors go (``sys.stderr`` when None).
        stdin: Where ``--args -`` reads (``sys.stdin`` when None).

    Returns:
        The exit code.
    """
    stdout = sys.stdout if stdout is None else stdout
    stderr = sys.stderr if stderr is None else stderr
    stdin = sys.stdin if stdin is None else stdin
    argv = list(sys.argv[1:] if argv is None else argv)
    command = command_in(argv)
    if command == "mcp" and not {"-h", "--help"} & set(argv):
        # The stdlib-only pump (``__main__`` goes there directly, without this module).
        from .mcp import main as mcp_main

        return mcp_main(argv)
    try:
        args = build_parser(command if command in COMMANDS else None).parse_args(argv)
    except ParseError as exc:
        out = Output(_requested_format(argv), stdout, stderr, width=None)
        if not out.is_json:
            try:
                exc.parser.print_usage(stderr)
            except OSError:
                pass  # a stderr that cannot be written loses the line, not the code
        return _report(out, usage(f"{exc.parser.prog}: error: {exc.message}"))
    except SystemExit as exc:  # --help, --version
        return exc.code if isinstance(exc.code, int) else EXIT_USAGE
    except OSError as exc:  # --help or --version could not be written (parser._Parser)
        out = Output("table", stdout, stderr, width=None)
        out.discard()  # what is still buffered would fail again at exit
        if isinstance(exc, BrokenPipeError):
            return EXIT_OK  # the reader went away (toolsetctl --help | head)
        return _report(out, _unexpected(exc))
    except KeyboardInterrupt as exc:  # while the options were read: said as any other time
        return _report_interrupted(Output(_requested_format(argv), stdout, stderr, width=None), exc)
    env = os.environ
    out = Output(getattr(args, "format", None) or "table", stdout, stderr)
    home_option = getattr(args, "home", None)
    try:  # a relative path needs the current folder, which a CI step may have removed
        ctx = Context(
            out=out,
            socket=default_socket_path(env, getattr(args, "socket", None)),
            workspace=Path(
                absolute_path(os.path.expanduser(getattr(args, "workspace", None) or "."))
            ),
            home_option=(
                Path(os.path.abspath(os.path.expanduser(home_option))) if home_option else None
            ),
            default_home=Path(os.path.abspath(os.path.expanduser(default_home(env)))),
            stdin=stdin,
            wide=bool(getattr(args, "wide", False)),
            env=env,
        )
    except OSError as exc:
        return _report(
            out,
            usage(
                f"the current folder cannot be used ({exc.strerror}): run toolsetctl from an "
                "existing folder, or pass absolute paths (--workspace DIR)"
            ),
        )
    except KeyboardInterrupt as exc:
        return _report_interrupted(out, exc)
    try:
        try:
            code = _COMMANDS[args.command](ctx, args)
        except UsageError as exc:
            code = _report(out, usage(str(exc)))
        except UnicodeEncodeError as exc:
            # A name from the command line or the file system (argv and paths keep their
            # undecodable bytes as lone surrogates); the daemon's wire is UTF-8 only.
            text = str(exc.object)
            around = text[max(0, exc.start - 40) : exc.end + 10].encode("utf-8", "surrogateescape")
            code = _report(
                out,
                usage(
                    "a name or value given is not valid UTF-8, which toolsetd needs "
                    f"(the current folder's path counts): ...{around!r}..."
                ),
            )
        except Failure as failure:
            code = _report(out, failure)
        try:
            out.flush()
        except BrokenPipeError:  # what was buffered is lost; the command's code stands
            out.discard()
        return code
    except BrokenPipeError:
        out.discard()  # so that the interpreter's own flush at exit stays quiet
        return EXIT_OK  # the reader went away (toolsetctl list | head)
    except KeyboardInterrupt as exc:
        return _report_interrupted(out, exc)
    except Exception as exc:
        return _report(out, _unexpected(exc))


def _report_interrupted(out: Output, exc: KeyboardInterrupt) -> int:
    """A Ctrl-C, SIGTERM or SIGHUP that stopped the command: a failure like any other, so in
    json and jsonl the one document says so (a CI runner cancels a job with SIGINT or
    SIGTERM); a second signal stops even that."""
    reason, exit_code = interruption(exc)
    interrupted = Failure(exit_code, CLI_ERROR_CODES["interrupted"], f"{reason}.", None)
    try:
        return _report(out, interrupted)
    except KeyboardInterrupt:
        return exit_code


#: toolsetctl's own ``MemoryError`` (a limit it runs under: ``ulimit -v``, a CI job's
#: unit), said as what it is and what to do, not as a bug.
OUT_OF_MEMORY = (
    "toolsetctl ran out of memory: raise the limit it runs under (ulimit -v, a unit's "
    "LimitAS= or MemoryMax=), or give it less to read."
)


def _unexpected(exc: Exception) -> Failure:
    """toolsetctl's own failure (exit 9): a bug, a stdout that cannot be written, or no
    memory left under its limit."""
    if isinstance(exc, MemoryError) or getattr(exc, "errno", None) == errno.ENOMEM:
        return Failure(EXIT_INTERNAL, CLI_ERROR_CODES["internal"], OUT_OF_MEMORY)
    return Failure(
        EXIT_INTERNAL,
        CLI_ERROR_CODES["internal"],
        f"toolsetctl: unexpected error: {type(exc).__name__}: {exc}",
    )
