"""``toolsetctl``: the operator's command line for toolsetd.

Theory of operation: ``run(argv)`` parses the arguments (argparse; the global options are
accepted before or after the subcommand), resolves their defaults, runs one command and
returns the exit code. Every outcome is printed once: a result, or a failure. A failure
is a ``_Failure`` carrying its exit code and an error object (``code``, ``message``,
``data``): in ``table``/``text`` the message (and its detail lines) goes to stderr; in
``json`` and ``jsonl`` the one document ``{"error": {...}}`` goes to stdout. Never a
traceback.

Commands that need the daemon talk to it over ``BlockingClient`` (stdlib sockets: the
start-up of a command is its cost, see ``toolsetd.client.blocking``); ``list`` and
``show`` fall back to reading the files (``toolsetd.client.offline``, imported only
then) when no daemon answers; ``enable`` and ``disable`` edit the files of the running
daemon's home (or ``--home``) and ask it to reload; ``validate`` works on the files.

The exit codes (each means one thing; ``docs/cli.md`` carries the same table):

====  =============================================================================
code  meaning
====  =============================================================================
0     success (``classify``: the decision is ``allow``)
1     the tool ran and reported an error
2     usage: bad options or ``--args``, unknown tool, arguments that fail its schema,
      a set that is not found or does not parse, ``validate`` found problems
3     the policy stops the call: denied, or approval required (``classify``: ``deny``,
      ``ask`` or ``review``)
4     the tool timed out
5     the daemon is unreachable, or the connection was lost
6     the daemon cancelled the call, or refused it because it is shutting down
7     not allowed: the daemon refuses this user (-32009)
8     the daemon is busy (-32008); try again later
9     an internal error, in the daemon or in toolsetctl
130   interrupted (Ctrl-C; ``invoke`` cancels the call in the daemon first)
====  =============================================================================

With ``invoke --tool-exit-code``, a tool that ran and exited gives its own exit code.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

# Not typing's TYPE_CHECKING: typing (like dataclasses, which pulls in inspect and ast) is
# a share of the start-up this module avoids; the names are only used in annotations.
TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any, NoReturn, TextIO

from toolsetd.client.blocking import BlockingClient, RawJson
from toolsetd.client.errors import ConnectError, ConnectionClosed, RequestTimeout
from toolsetd.client.render import (
    CHANGE_HEADERS,
    DISCOVERY_OFF,
    PATH_HEADERS,
    SET_HEADERS,
    Output,
    SetRow,
    classification_fields,
    classification_path_rows,
    content_lines,
    inventory_table,
    is_directory_name,
    reload_rows,
    set_rows_from_list,
    status_fields,
    tool_fields,
)
from toolsetd.protocol import __version__
from toolsetd.protocol.errors import RpcError

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

EXIT_OK = 0
EXIT_TOOL_ERROR = 1
EXIT_USAGE = 2
EXIT_DENIED = 3
EXIT_TIMEOUT = 4
EXIT_UNREACHABLE = 5
EXIT_DAEMON_CANCELLED = 6
EXIT_NOT_ALLOWED = 7
EXIT_BUSY = 8
EXIT_INTERNAL = 9
EXIT_INTERRUPTED = 130

#: ``error.code`` of the failures toolsetctl finds itself (the daemon's keep their code).
CLI_ERROR_CODES: Mapping[str, int] = {
    "usage": -32090,
    "unreachable": -32091,
    "connection_lost": -32092,
    "not_found": -32093,
    "invalid_set": -32094,
    "interrupted": -32095,
    "internal": -32096,
}

#: The exit code of each daemon error code; any other code is an internal error (9).
_RPC_EXITS: Mapping[int, int] = {
    -32001: EXIT_USAGE,  # UnknownTool
    -32002: EXIT_USAGE,  # InvalidArguments
    -32602: EXIT_USAGE,  # InvalidParams
    -32006: EXIT_USAGE,  # InvalidWorkspace
    -32003: EXIT_DENIED,  # PolicyDenied
    -32004: EXIT_DENIED,  # ApprovalRequired
    -32010: EXIT_DAEMON_CANCELLED,  # ShuttingDown
    -32009: EXIT_NOT_ALLOWED,  # PeerNotAllowed
    -32008: EXIT_BUSY,  # ServerBusy
}

#: Seconds to wait for the ``invoke`` response after sending ``cancel`` on Ctrl-C.
_CANCEL_GRACE = 5.0
#: Seconds allowed to connect to the daemon.
_CONNECT_TIMEOUT = 5.0
_FORMATS = ("table", "text", "json", "jsonl")


class UsageError(Exception):
    """A usage problem found after parsing (bad ``--args``); printed, exit 2."""


class _Failure(Exception):
    """A command failed: its exit code, and the error object printed for it."""

    def __init__(
        self,
        exit_code: int,
        code: int,
        message: str,
        data: Any = None,
        details: list[str] | None = None,
    ) -> None:
        super().__init__(message)
        self.exit_code = exit_code
        self.code = code
        self.message = message
        self.data = data
        self.details = details or []

    def error(self) -> dict[str, Any]:
        return {"code": self.code, "message": self.message, "data": self.data}


def _usage(message: str, data: Any = None) -> _Failure:
    return _Failure(EXIT_USAGE, CLI_ERROR_CODES["usage"], message, data)


def default_socket_path(env: Mapping[str, str] | None = None) -> str:
    """Return the socket path: ``$TOOLSETD_SOCKET``, else the runtime-dir default.

    Args:
        env: The environment (``os.environ`` when None).

    Returns:
        ``$TOOLSETD_SOCKET``, else ``$XDG_RUNTIME_DIR/toolsetd/toolsetd.sock``, else
        ``/tmp/toolsetd-<uid>/toolsetd.sock``.
    """
    env = os.environ if env is None else env
    if env.get("TOOLSETD_SOCKET"):
        return env["TOOLSETD_SOCKET"]
    runtime = env.get("XDG_RUNTIME_DIR")
    if runtime:
        return os.path.join(runtime, "toolsetd", "toolsetd.sock")
    return f"/tmp/toolsetd-{os.getuid()}/toolsetd.sock"  # noqa: S108 - the contract's path


def default_home(env: Mapping[str, str] | None = None) -> str:
    """Return the Crystal home: ``$CRYSTAL_HOME``, else ``~/.crystal``."""
    env = os.environ if env is None else env
    return env.get("CRYSTAL_HOME") or os.path.join(os.path.expanduser("~"), ".crystal")


def _read_arguments(spec: str | None, stdin: TextIO) -> tuple[dict[str, Any], str]:
    """Read ``--args``: the argument object and its JSON text as written."""
    if spec is None:
        return {}, "{}"
    if spec == "-":
        text, where = stdin.read(), "--args from stdin"
    elif spec.startswith("@"):
        name = spec[1:]
        try:
            text = Path(name).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
            raise UsageError(f"Cannot read the --args file {name}: {reason}.") from exc
        where = f"--args file {name}"
    else:
        text, where = spec, "--args"
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise UsageError(f"{where} is not valid JSON: {exc}") from exc
    if not isinstance(value, dict):
        raise UsageError(f"{where} must be a JSON object.")
    return value, text


def parse_arguments(spec: str | None, stdin: TextIO) -> dict[str, Any]:
    """Read a tool's argument object from ``--args``.

    Args:
        spec: JSON text, ``@FILE`` (read that file), ``-`` (read stdin), or None (``{}``).
        stdin: The standard input.

    Returns:
        The argument object.

    Raises:
        UsageError: The file cannot be read, the text is not JSON, or not an object.
    """
    return _read_arguments(spec, stdin)[0]


# -- parsing ---------------------------------------------------------------------------


class _ParseError(Exception):
    """argparse found a usage error (raised instead of exiting, to print it our way)."""

    def __init__(self, parser: argparse.ArgumentParser, message: str) -> None:
        super().__init__(message)
        self.parser = parser
        self.message = message


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise _ParseError(self, message)


def _global_options() -> argparse.ArgumentParser:
    """The options every command takes, before or after the subcommand."""
    common = _Parser(add_help=False)
    common.add_argument(
        "--socket",
        metavar="PATH",
        default=argparse.SUPPRESS,
        help="the daemon's socket (env TOOLSETD_SOCKET, else "
        "$XDG_RUNTIME_DIR/toolsetd/toolsetd.sock, else /tmp/toolsetd-<uid>/toolsetd.sock)",
    )
    common.add_argument(
        "--format",
        choices=_FORMATS,
        default=argparse.SUPPRESS,
        help="table (default: for people, fitted to the terminal), text (aligned columns, "
        "as the reference host prints them), json (one document: the result, or "
        '{"error": ...}), jsonl (one object a line; invoke streams its events)',
    )
    common.add_argument(
        "-w",
        "--wide",
        action="store_true",
        default=argparse.SUPPRESS,
        help="table: every column in full (no shortened paths, no folded columns)",
    )
    common.add_argument(
        "--workspace",
        metavar="DIR",
        default=argparse.SUPPRESS,
        help="the workspace whose project sets count (default the current directory)",
    )
    common.add_argument(
        "--home",
        metavar="DIR",
        default=argparse.SUPPRESS,
        help="the Crystal home for the commands that read or edit files (default: the "
        "running daemon's home, else env CRYSTAL_HOME, else ~/.crystal)",
    )
    return common


def _command_in(argv: Sequence[str]) -> str | None:
    """The subcommand ``argv`` names (the first word that is not an option or its value)."""
    takes_value = {"--socket", "--format", "--workspace", "--home"}
    skip = False
    for arg in argv:
        if skip:
            skip = False
        elif arg in takes_value:
            skip = True
        elif arg == "--" or not arg.startswith("-"):
            return arg
    return None


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """Build the ``toolsetctl`` argument parser.

    Args:
        only: Build only this subcommand (argparse spends most of a short command's
            parse time building the other eight); None builds them all.
    """
    common = _global_options()
    parser = _Parser(
        prog="toolsetctl",
        description="Operate toolsetd: list, check, edit and run operator tool sets.",
        epilog="Exit codes: 0 ok, 1 tool error, 2 usage, 3 denied or approval required, "
        "4 timeout, 5 daemon unreachable, 6 cancelled by the daemon, 7 not allowed, "
        "8 daemon busy, 9 internal error, 130 interrupted (see docs/cli.md).",
        parents=[common],
    )
    parser.add_argument(
        "--version",
        action="version",
        version=f"toolsetctl {__version__}",
        help="print the version and exit",
    )
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    def add(name: str, text: str) -> argparse.ArgumentParser:
        if only is not None and name != only:
            return _Parser(add_help=False)  # never attached: a place for the arguments
        return commands.add_parser(name, help=text, description=text, parents=[common])

    source_help = "which copy of the set (default: the project copy wins over the home copy)"
    add("status", "Show the daemon's status.")
    sub = add("list", "List the tool sets, then the notes.")
    sub.add_argument("--catalog", choices=("plan", "work"), help="only this catalog's tools")
    sub = add("show", "Show one tool by name, or one tool set by directory name.")
    sub.add_argument("name", metavar="NAME", help="a tool name, or a set's directory name")
    sub.add_argument("--source", choices=("home", "project"), help=source_help)
    for verb in ("enable", "disable"):
        sub = add(verb, f"{verb.capitalize()} a tool set (writes 'enabled' in its tools.json).")
        sub.add_argument("directory", metavar="DIR", help="the set's directory name")
        sub.add_argument("--source", choices=("home", "project"), help=source_help)
    sub = add("validate", "Check one tool set offline and print every problem.")
    sub.add_argument(
        "directory",
        metavar="DIR",
        help="the set's folder, or the directory name of a set in the workspace or the home",
    )
    sub.add_argument(
        "--reserve",
        metavar="NAME",
        action="append",
        default=[],
        help="one more reserved tool name (repeatable), as toolsetd --reserve",
    )
    for verb, text in (("classify", "Classify a call without running it."), ("invoke", "Run a tool.")):
        sub = add(verb, text)
        sub.add_argument("tool", metavar="TOOL", help="the tool name")
        sub.add_argument(
            "--args",
            dest="arguments",
            metavar="JSON|@FILE|-",
            help="the argument object: inline JSON, @FILE to read a file, - to read stdin "
            "(default {})",
        )
        sub.add_argument(
            "--mode",
            metavar="M",
            help="approval mode: plan, default, edit, review, audit or full (default default)",
        )
        sub.add_argument(
            "--headless",
            action="store_true",
            help="no operator is there to ask: every 'ask' becomes 'deny'",
        )
        if verb == "invoke":
            sub.add_argument(
                "--approve",
                action="store_true",
                help="the operator approves this call (an 'ask' or 'review' decision)",
            )
            sub.add_argument(
                "--session", metavar="S", help="session string, passed to the tool as CRYSTAL_SESSION"
            )
            sub.add_argument(
                "--catalog", choices=("plan", "work"), help="refuse the tool unless it is in this catalog"
            )
            sub.add_argument(
                "--tool-exit-code",
                action="store_true",
                help="once the tool ran and exited, exit with its exit code",
            )
    add("reload", "Reload the tool sets and print what changed.")
    return parser


class _Context:
    """What every command needs.

    ``home_option`` is ``--home`` as given, or None (then the daemon's home, else
    ``default_home``).
    """

    def __init__(
        self,
        *,
        out: Output,
        socket: str,
        workspace: Path,
        home_option: Path | None,
        default_home: Path,
        stdin: TextIO,
        wide: bool,
        env: Mapping[str, str],
    ) -> None:
        self.out = out
        self.socket = socket
        self.workspace = workspace
        self.home_option = home_option
        self.default_home = default_home
        self.stdin = stdin
        self.wide = wide
        self.env = env

    def emit(self, value: Any) -> None:
        """Print a result document (``jsonl`` wraps it as ``{"result": ...}``)."""
        self.out.json({"result": value} if self.out.format == "jsonl" else value)


# -- daemon helpers --------------------------------------------------------------------


def _rpc_failure(exc: RpcError) -> _Failure:
    """The failure a daemon error means: its exit code, message and detail lines."""
    data = exc.data if isinstance(exc.data, dict) else {}
    message = exc.message
    details: list[str] = []
    if exc.code == -32002:  # InvalidArguments
        for item in data.get("errors") or []:
            # Each message names its field already (it starts with the JSON Pointer). The
            # summary line carries the first one; do not print it twice.
            text = str(item.get("message", "")) if isinstance(item, dict) else str(item)
            if text and text not in message:
                details.append(f"  {text}")
    elif exc.code == -32004 and isinstance(data.get("reason"), str):  # ApprovalRequired
        message = (
            f"Approval required: {data['reason']} If the operator agrees, run the command "
            "again with --approve."
        )
    exit_code = _RPC_EXITS.get(exc.code, EXIT_INTERNAL)
    return _Failure(exit_code, exc.code, message, exc.data, details)


def _connect(ctx: _Context) -> BlockingClient:
    try:
        return BlockingClient.connect(ctx.socket, timeout=_CONNECT_TIMEOUT)
    except ConnectError as exc:
        raise _Failure(
            EXIT_UNREACHABLE, CLI_ERROR_CODES["unreachable"], str(exc), {"socket": ctx.socket}
        ) from exc


def _lost(ctx: _Context, exc: ConnectionClosed | RequestTimeout) -> _Failure:
    reason = getattr(exc, "reason", "timeout")
    return _Failure(
        EXIT_UNREACHABLE,
        CLI_ERROR_CODES["connection_lost"],
        f"Lost the connection to toolsetd at {ctx.socket}: {exc}",
        {"socket": ctx.socket, "reason": reason},
    )


def _call(ctx: _Context, client: BlockingClient, method: str, params: Any = None) -> Any:
    """One request on ``client``; every daemon or transport failure becomes a ``_Failure``."""
    try:
        return client.call(method, params)
    except RpcError as exc:
        raise _rpc_failure(exc) from exc
    except (ConnectionClosed, RequestTimeout) as exc:
        raise _lost(ctx, exc) from exc


def _request(ctx: _Context, method: str, params: Any = None) -> Any:
    with _connect(ctx) as client:
        return _call(ctx, client, method, params)


def _offline_module() -> Any:
    """Import the offline reader, or explain why it is unavailable (exit 2)."""
    try:
        from toolsetd.client import offline  # the one daemon import, lazily
    except ImportError as exc:
        raise _usage(f"Reading tool sets from disk is unavailable: {exc}.") from exc
    return offline


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


def _daemon_home(ctx: _Context, client: BlockingClient) -> Path:
    status = _call(ctx, client, "status")
    home = status.get("home") if isinstance(status, dict) else None
    return Path(home) if isinstance(home, str) and home else ctx.default_home


# -- commands --------------------------------------------------------------------------


def _cmd_status(ctx: _Context, args: argparse.Namespace) -> int:
    result = _request(ctx, "status")
    if ctx.out.is_json:
        ctx.emit(result)
    else:
        ctx.out.fields(status_fields(result))
    return EXIT_OK


def _print_notes(ctx: _Context, notes: Sequence[Mapping[str, Any]]) -> None:
    for note in notes:
        ctx.out.line(f"- {note.get('message', '')}")


class _Listing:
    """A ``list`` result, its inventory rows and the home they were read from."""

    def __init__(
        self, result: dict[str, Any], rows: list[SetRow], home: Path, *, from_daemon: bool
    ) -> None:
        self.result = result
        self.rows = rows
        self.home = home
        self.from_daemon = from_daemon


def _listing(ctx: _Context, catalog: str | None) -> _Listing:
    """The daemon's ``list`` and home, or the files' when no daemon answers."""
    params: dict[str, Any] = {"workspace": str(ctx.workspace)}
    if catalog is not None:
        params["catalog"] = catalog
    try:
        client = BlockingClient.connect(ctx.socket, timeout=_CONNECT_TIMEOUT)
    except ConnectError:
        offline = _offline_module()
        ctx.out.error(f"toolsetd is not running at {ctx.socket}; showing the tool sets on disk.")
        home = ctx.home_option or ctx.default_home
        return _Listing(
            offline.offline_list(home, ctx.workspace, catalog),
            offline.inventory(home, ctx.workspace, catalog),
            home,
            from_daemon=False,
        )
    with client:
        result = _call(ctx, client, "list", params)
        home = _daemon_home(ctx, client)
    return _Listing(result, set_rows_from_list(result), home, from_daemon=True)


def _inventory(ctx: _Context, rows: Sequence[SetRow]) -> None:
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
        workspace=str(ctx.workspace),
        user_home=ctx.env.get("HOME") or None,
    )
    ctx.out.rows(headers, cells, empty="No tool sets.", foldable=foldable)


def _cmd_list(ctx: _Context, args: argparse.Namespace) -> int:
    listing = _listing(ctx, args.catalog)
    if ctx.out.is_json:
        ctx.emit(listing.result)
        return EXIT_OK
    _inventory(ctx, listing.rows)
    _print_notes(ctx, listing.result.get("notes") or [])
    if not _listing_discovery(listing):
        ctx.out.line(DISCOVERY_OFF)
    return EXIT_OK


def _find_row(rows: Sequence[SetRow], name: str, source: str | None) -> SetRow | None:
    matches = [row for row in rows if row.directory == name]
    if source is not None:
        matches = [row for row in matches if row.source == source]
    matches.sort(key=lambda row: row.source != "project")  # the project copy wins
    return matches[0] if matches else None


def _not_found(name: str, source: str | None) -> _Failure:
    where = {"home": " in Home", "project": " in Project"}.get(source or "", "")
    return _Failure(
        EXIT_USAGE,
        CLI_ERROR_CODES["not_found"],
        f"Tool set '{name}' was not found{where}.",
        {"directory": name, "source": source},
    )


def _invalid_name(name: str) -> _Failure:
    return _Failure(
        EXIT_USAGE, CLI_ERROR_CODES["not_found"], "Directory name is invalid.", {"directory": name}
    )


def _cmd_show(ctx: _Context, args: argparse.Namespace) -> int:
    name = args.name.strip()
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
    if not name or not is_directory_name(name):
        raise _invalid_name(name)
    row = _find_row(listing.rows, name, args.source)
    if row is None:
        raise _not_found(name, args.source)
    if ctx.out.is_json:
        raw_sets = {
            (s.get("directory"), s.get("source")): s for s in listing.result.get("sets") or []
        }
        ctx.emit(raw_sets.get((row.directory, row.source)) or row.to_json())
        return EXIT_OK
    ctx.out.fields(row.fields())
    if not _listing_discovery(listing):
        ctx.out.line(DISCOVERY_OFF)
    return EXIT_OK


def _edit_home(ctx: _Context) -> tuple[Path, str, BlockingClient | None]:
    """The home to edit and where it came from, and the daemon's connection if one answers."""
    try:
        client: BlockingClient | None = BlockingClient.connect(ctx.socket, timeout=_CONNECT_TIMEOUT)
    except ConnectError:
        client = None
    if ctx.home_option is not None:
        return ctx.home_option, "option", client
    if client is not None:
        return _daemon_home(ctx, client), "daemon", client
    return ctx.default_home, "default", None


def _cmd_enable(ctx: _Context, args: argparse.Namespace) -> int:
    from toolsetd.client.editor import EditError, locate_set, set_enabled

    enabled = args.command == "enable"
    offline = _offline_module()
    home, home_from, client = _edit_home(ctx)
    try:
        try:
            directory, source, path = locate_set(home, ctx.workspace, args.directory, args.source)
        except EditError as exc:
            failure = _Failure(
                EXIT_USAGE, CLI_ERROR_CODES["not_found"], exc.message, {"home": str(home)}
            )
            if "not found" in exc.message and not home.is_dir():
                failure.details.append(f"  The home {home} does not exist.")
            raise failure from exc
        try:
            check = _manifest_check(offline, path.parent, source)
            outcome = set_enabled(path, enabled, check=check)
        except EditError as exc:
            raise _Failure(
                EXIT_USAGE, CLI_ERROR_CODES["invalid_set"], exc.message, {"path": str(path)}
            ) from exc
        reloaded = False
        if outcome.changed and client is not None:
            try:
                _call(ctx, client, "reload", {"workspace": str(ctx.workspace)})
                reloaded = True
            except _Failure as failure:
                ctx.out.error(f"toolsetd did not reload: {failure.message}")
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
        "default": "no toolsetd answered; CRYSTAL_HOME or ~/.crystal",
    }[home_from]
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
                "entry": row.to_json() if row is not None else None,
                "message": message,
            }
        )
        return EXIT_OK
    if source == "home":
        ctx.out.error(f"Edited {path} in the home {home} ({where}).")
    else:
        ctx.out.error(f"Edited {path} in the workspace {ctx.workspace}.")
    if row is not None:
        ctx.out.fields(row.fields())
    ctx.out.line(message)
    if enabled and not _discovery_enabled(home):
        ctx.out.line(DISCOVERY_OFF)
    return EXIT_OK


def _manifest_check(offline: Any, set_dir: Path, source: str) -> Callable[[bytes], str | None]:
    def check(data: bytes) -> str | None:
        problem: str | None = offline.manifest_problem(data, set_dir=set_dir, source=source)
        return problem

    return check


def _cmd_validate(ctx: _Context, args: argparse.Namespace) -> int:
    offline = _offline_module()
    target = Path(args.directory)
    problems: list[str] = []
    home = ctx.home_option
    if home is not None and not home.is_dir():
        problems.append(f"The home {home} (--home) does not exist.")
    if not target.exists() and is_directory_name(args.directory):
        from toolsetd.client.editor import EditError, locate_set

        try:
            located = locate_set(home or ctx.default_home, ctx.workspace, args.directory, None)
            target = located[2].parent
        except EditError:
            pass
    report = offline.validate_set(target, args.reserve)
    report.problems[:0] = problems
    if ctx.out.is_json:
        ctx.emit(report.to_json())
    elif report.valid:
        count = len(report.tools)
        noun = "tool" if count == 1 else "tools"
        names = f" ({', '.join(report.tools)})" if report.tools else ""
        ctx.out.line(f"Tool set {report.directory} is valid: {count} {noun}{names}.")
    else:
        ctx.out.line(f"Tool set {report.directory} is not valid:")
        for problem in report.problems:
            ctx.out.line(f"- {problem}")
    return EXIT_OK if report.valid else EXIT_USAGE


def _call_params(ctx: _Context, args: argparse.Namespace, text: str) -> dict[str, Any]:
    params: dict[str, Any] = {
        "tool": args.tool,
        "arguments": RawJson(text),  # sent as written: numbers keep their spelling
        "workspace": str(ctx.workspace),
    }
    if args.mode is not None:
        params["mode"] = args.mode
    if args.headless:
        params["headless"] = True
    return params


def _cmd_classify(ctx: _Context, args: argparse.Namespace) -> int:
    _, text = _read_arguments(args.arguments, ctx.stdin)
    result = _request(ctx, "classify", _call_params(ctx, args, text))
    decision = result.get("decision") if isinstance(result, dict) else None
    code = EXIT_OK if decision == "allow" else EXIT_DENIED
    if ctx.out.is_json:
        ctx.emit(result)
        return code
    ctx.out.fields(classification_fields(result))
    paths = classification_path_rows(result)
    if paths:
        ctx.out.rows(PATH_HEADERS, paths, empty="", foldable=(1, 2))
    return code


def _progress_stream(ctx: _Context) -> TextIO | None:
    """Where the progress line goes: stderr when it is a terminal, never under CI."""
    if ctx.env.get("CI"):
        return None
    stderr = ctx.out.stderr
    if not _isatty(stderr):
        return None
    if ctx.out.is_json and _isatty(ctx.out.stdout):
        return None  # the JSON lines would be drawn over
    return stderr


def _isatty(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False


class _Progress:
    """The live progress line of ``invoke``: one line on a terminal, redrawn in place.

    It shows the tool, the elapsed time and the bytes written, and keeps the tool's last
    message and fraction until the tool sends new ones (periodic ticks carry neither).
    """

    def __init__(self, tool: str, stream: TextIO | None) -> None:
        self._tool = tool
        self._stream = stream
        self._started = time.monotonic()
        self._drawn = False
        self._elapsed_ms = 0.0
        self._bytes = 0
        self._message: str | None = None
        self._fraction: float | None = None

    def line(self) -> str:
        """The line as it reads now."""
        parts = [self._tool, f"{self._elapsed_ms / 1000:.1f}s", f"{self._bytes} bytes"]
        if self._fraction is not None:
            parts.append(f"{self._fraction:.0%}")
        if self._message:
            parts.append(self._message)
        return "  ".join(parts)

    def event(self, method: str, params: dict[str, Any]) -> None:
        """Update the line from one ``started``/``progress``/``completed`` event."""
        if method == "progress":
            size = int(params.get("stdoutBytes") or 0) + int(params.get("stderrBytes") or 0)
            self._bytes = size
            elapsed = params.get("elapsedMs")
            self._elapsed_ms = (
                float(elapsed)
                if isinstance(elapsed, int | float)
                else (time.monotonic() - self._started) * 1000
            )
            if isinstance(params.get("message"), str):
                self._message = params["message"]
            fraction = params.get("fraction")
            if isinstance(fraction, int | float) and not isinstance(fraction, bool):
                self._fraction = float(fraction)
            self._draw(self.line())
        elif method == "started":
            self._draw(f"{self._tool}  started (pid {params.get('pid')})")

    def _draw(self, text: str) -> None:
        if self._stream is None:
            return
        try:
            columns = os.get_terminal_size(self._stream.fileno()).columns
        except (AttributeError, ValueError, OSError):
            columns = 80
        self._stream.write("\r\x1b[2K" + text[: max(columns - 1, 10)])
        self._stream.flush()
        self._drawn = True

    def stop(self) -> None:
        """Remove the line."""
        if self._stream is not None and self._drawn:
            self._stream.write("\r\x1b[2K")
            self._stream.flush()
            self._drawn = False


def _cmd_invoke(ctx: _Context, args: argparse.Namespace) -> int:
    if args.headless and args.approve:
        raise _usage(
            "--headless and --approve cannot be used together: headless turns every 'ask' "
            "into 'deny', so the approval would never count. Drop --headless to approve the "
            "call, or --approve to run it headless.",
            {"options": ["--headless", "--approve"]},
        )
    _, text = _read_arguments(args.arguments, ctx.stdin)
    call_id = os.urandom(16).hex()
    params = _call_params(ctx, args, text)
    params["callId"] = call_id
    optional = {
        "approved": True if args.approve else None,
        "catalog": args.catalog,
        "session": args.session,
    }
    params.update({key: value for key, value in optional.items() if value is not None})
    progress = _Progress(args.tool, _progress_stream(ctx))
    streaming = ctx.out.format == "jsonl"

    def on_event(method: str, event: dict[str, Any]) -> None:
        if streaming:
            ctx.out.json({"method": method, "params": event})
        progress.event(method, event)

    interrupted = False
    with _connect(ctx) as client:
        try:
            try:
                request_id = client.send("invoke", params)
                result = client.wait(request_id, on_event=on_event)
            except KeyboardInterrupt:
                interrupted = True
                progress.stop()
                ctx.out.error("Interrupted; cancelling the call.")
                result = _cancel(client, call_id, request_id, on_event)
        except RpcError as exc:
            raise _rpc_failure(exc) from exc
        except (ConnectionClosed, RequestTimeout) as exc:
            raise _lost(ctx, exc) from exc
        finally:
            progress.stop()
    if result is None:
        raise _Failure(
            EXIT_INTERRUPTED,
            CLI_ERROR_CODES["interrupted"],
            "Interrupted; the call was cancelled.",
            {"callId": call_id},
        )
    return _print_result(ctx, result, interrupted=interrupted, tool_exit_code=args.tool_exit_code)


def _cancel(
    client: BlockingClient,
    call_id: str,
    request_id: int,
    on_event: Callable[[str, dict[str, Any]], None],
) -> Any:
    """After Ctrl-C: cancel the call and wait (bounded) for its result; None if none came."""
    try:
        client.send("cancel", {"callId": call_id})
        return client.wait(request_id, on_event=on_event, timeout=_CANCEL_GRACE)
    except KeyboardInterrupt:  # a second Ctrl-C: stop waiting at once
        return None
    except (RpcError, ConnectionClosed, RequestTimeout):
        return None


def _print_result(
    ctx: _Context, result: Mapping[str, Any], *, interrupted: bool, tool_exit_code: bool
) -> int:
    """Print a call result; return the exit code it means."""
    if ctx.out.is_json:
        ctx.emit(result)
    else:
        for text in content_lines(result.get("content") or []):
            ctx.out.stdout.write(text if text.endswith("\n") else text + "\n")
    status = result.get("status")
    exit_code = result.get("exitCode")
    if status == "cancelled":
        return EXIT_INTERRUPTED if interrupted else EXIT_DAEMON_CANCELLED
    if status == "timeout":
        return EXIT_TIMEOUT
    if tool_exit_code and type(exit_code) is int and status in ("ok", "error"):
        return exit_code & 0xFF
    if result.get("isError") or status == "error":
        return EXIT_TOOL_ERROR
    return EXIT_OK


def _cmd_reload(ctx: _Context, args: argparse.Namespace) -> int:
    result = _request(ctx, "reload", {"workspace": str(ctx.workspace)})
    if ctx.out.is_json:
        ctx.emit(result)
        return EXIT_OK
    ctx.out.rows(CHANGE_HEADERS, reload_rows(result), empty="Nothing changed.")
    _print_notes(ctx, result.get("notes") or [])
    return EXIT_OK


_COMMANDS: dict[str, Callable[[_Context, argparse.Namespace], int]] = {
    "status": _cmd_status,
    "list": _cmd_list,
    "show": _cmd_show,
    "enable": _cmd_enable,
    "disable": _cmd_enable,
    "validate": _cmd_validate,
    "classify": _cmd_classify,
    "invoke": _cmd_invoke,
    "reload": _cmd_reload,
}


def _report(out: Output, failure: _Failure) -> int:
    """Print a failure in the output's format; return its exit code."""
    if out.is_json:
        out.json({"error": failure.error()})
    else:
        out.error(failure.message)
        for line in failure.details:
            out.error(line)
    return failure.exit_code


def _requested_format(argv: Sequence[str]) -> str:
    """The ``--format`` in ``argv`` (for reporting an argparse error in that format)."""
    found = "table"
    for index, arg in enumerate(argv):
        if arg == "--format" and index + 1 < len(argv):
            found = argv[index + 1]
        elif arg.startswith("--format="):
            found = arg.split("=", 1)[1]
    return found if found in _FORMATS else "table"


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
    try:
        command = _command_in(argv)
        args = build_parser(command if command in _COMMANDS else None).parse_args(argv)
    except _ParseError as exc:
        out = Output(_requested_format(argv), stdout, stderr, width=None)
        if not out.is_json:
            exc.parser.print_usage(stderr)
        return _report(out, _usage(f"{exc.parser.prog}: error: {exc.message}"))
    except SystemExit as exc:  # --help, --version
        return exc.code if isinstance(exc.code, int) else EXIT_USAGE
    env = os.environ
    out = Output(getattr(args, "format", None) or "table", stdout, stderr)
    home_option = getattr(args, "home", None)
    ctx = _Context(
        out=out,
        socket=getattr(args, "socket", None) or default_socket_path(env),
        workspace=Path(os.path.abspath(os.path.expanduser(getattr(args, "workspace", None) or "."))),
        home_option=Path(os.path.abspath(os.path.expanduser(home_option))) if home_option else None,
        default_home=Path(os.path.abspath(os.path.expanduser(default_home(env)))),
        stdin=stdin,
        wide=bool(getattr(args, "wide", False)),
        env=env,
    )
    try:
        try:
            code = _COMMANDS[args.command](ctx, args)
        except UsageError as exc:
            code = _report(out, _usage(str(exc)))
        except _Failure as failure:
            code = _report(out, failure)
        out.flush()
        return code
    except BrokenPipeError:
        return EXIT_OK  # the reader went away (toolsetctl list | head)
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED
    except Exception as exc:
        return _report(
            out,
            _Failure(
                EXIT_INTERNAL,
                CLI_ERROR_CODES["internal"],
                f"toolsetctl: unexpected error: {type(exc).__name__}: {exc}",
            ),
        )
