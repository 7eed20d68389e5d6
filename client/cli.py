"""``toolsetctl``: the operator's command line for toolsetd.

Theory of operation: ``run(argv)`` parses the arguments (argparse; the global options
``--socket``, ``--format``, ``--workspace`` and ``--home`` are accepted before or after
the subcommand), resolves their defaults, runs one command under ``anyio.run`` and
returns the exit code. Every failure becomes a message on stderr and an exit code, never
a traceback:

====  =============================================================================
code  meaning
====  =============================================================================
0     success
1     the tool ran and reported an error (or an unexpected failure)
2     usage or invalid arguments (bad flags, bad ``--args``, unknown tool, schema
      errors, a set that was not found or does not parse)
3     denied, or approval required
4     the tool timed out
5     the daemon is unreachable
130   interrupted (Ctrl-C; ``invoke`` cancels the call in the daemon first)
====  =============================================================================

Commands that need the daemon connect through ``Client``; ``list`` and ``show`` fall back
to reading the files (``toolsetd.client.offline``) when no daemon answers, and
``enable``, ``disable`` and ``validate`` always work on the files.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, NoReturn, TextIO

import anyio
from .client import Client
from .editor import EditError, locate_set, set_enabled
from .errors import (
    ApprovalRequired,
    ConnectError,
    ConnectionClosed,
    InvalidArguments,
    InvalidParams,
    InvalidWorkspace,
    PolicyDenied,
    RequestTimeout,
    RpcError,
    UnknownTool,
)
# One socket default for the CLI and the MCP pump (the pump is stdlib-only, so it owns it).
from .mcp import default_socket_path
from .render import (
    CHANGE_HEADERS,
    DISCOVERY_OFF,
    PATH_HEADERS,
    SET_HEADERS,
    Output,
    SetRow,
    classification_fields,
    classification_path_rows,
    content_lines,
    is_directory_name,
    reload_rows,
    set_rows_from_list,
    status_fields,
    tool_fields,
)

__all__ = [
    "EXIT_DENIED",
    "EXIT_INTERRUPTED",
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
EXIT_INTERRUPTED = 130

#: Seconds to wait for the ``invoke`` response after sending ``cancel`` on Ctrl-C.
_CANCEL_GRACE = 5.0
#: Seconds allowed to connect to the daemon.
_CONNECT_TIMEOUT = 5.0


class UsageError(Exception):
    """A usage problem found after parsing (bad ``--args``); printed, exit 2."""


class _Exit(Exception):
    """Leave a command with an exit code (after its message was printed)."""

    def __init__(self, code: int) -> None:
        super().__init__(code)
        self.code = code


def default_home(env: Mapping[str, str] | None = None) -> str:
    """Return the Crystal home: ``$CRYSTAL_HOME``, else ``~/.crystal``."""
    env = os.environ if env is None else env
    return env.get("CRYSTAL_HOME") or os.path.join(os.path.expanduser("~"), ".crystal")


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
    if spec is None:
        return {}
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
    return value


# -- parsing ---------------------------------------------------------------------------


def _global_options() -> argparse.ArgumentParser:
    """The options every command takes, before or after the subcommand."""
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--socket",
        metavar="PATH",
        default=argparse.SUPPRESS,
        help="the daemon's socket (env TOOLSETD_SOCKET)",
    )
    common.add_argument(
        "--format",
        choices=("table", "text", "json"),
        default=argparse.SUPPRESS,
        help="output format (default table)",
    )
    common.add_argument(
        "--workspace",
        metavar="DIR",
        default=argparse.SUPPRESS,
        help="the workspace (default the current directory)",
    )
    common.add_argument(
        "--home",
        metavar="DIR",
        default=argparse.SUPPRESS,
        help="the Crystal home for file commands (env CRYSTAL_HOME, else ~/.crystal)",
    )
    return common


def build_parser() -> argparse.ArgumentParser:
    """Build the ``toolsetctl`` argument parser."""
    common = _global_options()
    parser = argparse.ArgumentParser(
        prog="toolsetctl",
        description="Operate toolsetd: list, check, edit and run operator tool sets.",
        parents=[common],
    )
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    def add(name: str, text: str) -> argparse.ArgumentParser:
        return commands.add_parser(name, help=text, description=text, parents=[common])

    add("status", "Show the daemon's status.")
    sub = add("list", "List the tool sets, then the notes.")
    sub.add_argument("--catalog", choices=("plan", "work"), help="only this catalog's tools")
    sub = add("show", "Show one tool by name, or one tool set by directory name.")
    sub.add_argument("name", metavar="NAME")
    sub.add_argument("--source", choices=("home", "project"), help="which copy of the set")
    for verb in ("enable", "disable"):
        sub = add(verb, f"{verb.capitalize()} a tool set (writes 'enabled' in its tools.json).")
        sub.add_argument("directory", metavar="DIR")
        sub.add_argument("--source", choices=("home", "project"), help="which copy of the set")
    sub = add("validate", "Check one tool set directory offline and print every problem.")
    sub.add_argument("directory", metavar="DIR")
    sub.add_argument(
        "--reserve", metavar="NAME", action="append", default=[], help="another reserved name"
    )
    for verb, text in (("classify", "Classify a call without running it."), ("invoke", "Run a tool.")):
        sub = add(verb, text)
        sub.add_argument("tool", metavar="TOOL")
        sub.add_argument(
            "--args", dest="arguments", metavar="JSON|@FILE|-", help="the argument object"
        )
        sub.add_argument("--mode", metavar="M", help="approval mode (default 'default')")
        sub.add_argument("--headless", action="store_true", help="turn every 'ask' into 'deny'")
        if verb == "invoke":
            sub.add_argument("--approve", action="store_true", help="the operator approves")
            sub.add_argument("--session", metavar="S", help="session string for the child")
            sub.add_argument("--catalog", choices=("plan", "work"), help="require this catalog")
    sub = add("reload", "Reload the config file and the tool sets and print what changed.")
    sub.add_argument("--all", action="store_true", help="every loaded workspace, not only "
                     "--workspace (what SIGHUP does; systemd's ExecReload uses it)")
    add("metrics", "Print the daemon's Prometheus metrics (text exposition format).")
    sub = add("mcp", "Serve the workspace's tools to an MCP host on stdin/stdout (docs/mcp.md).")
    sub.add_argument("--catalog", choices=("plan", "work"), help="only this catalog's tools")
    sub.add_argument("--mode", metavar="M", help="approval mode (default 'default')")
    sub.add_argument("--headless", action="store_true", help="turn every 'ask' into 'deny'")
    sub.add_argument(
        "--no-autostart", action="store_true", help="fail instead of starting toolsetd"
    )
    return parser


@dataclass(frozen=True, slots=True)
class _Context:
    """What every command needs."""

    out: Output
    socket: str
    workspace: Path
    home: Path
    stdin: TextIO


# -- daemon helpers --------------------------------------------------------------------


def _unreachable(ctx: _Context, exc: ConnectError | ConnectionClosed) -> NoReturn:
    message = str(exc)
    if isinstance(exc, ConnectionClosed):
        message = f"Lost the connection to toolsetd at {ctx.socket}: {exc}"
    ctx.out.error(message)
    raise _Exit(EXIT_UNREACHABLE)


def _rpc_failure(ctx: _Context, exc: RpcError) -> NoReturn:
    """Print a daemon error and leave with its exit code."""
    ctx.out.error(exc.message)
    data = exc.data if isinstance(exc.data, dict) else {}
    if isinstance(exc, InvalidArguments):
        for item in data.get("errors") or []:
            # Each message names its field already (it starts with the JSON Pointer). The
            # summary line carries the first one; do not print it twice.
            message = str(item.get("message", "")) if isinstance(item, dict) else str(item)
            if message and message not in exc.message:
                ctx.out.error(f"  {message}")
        raise _Exit(EXIT_USAGE)
    if isinstance(exc, PolicyDenied | ApprovalRequired):
        # The daemon's message already carries the classification's reason.
        raise _Exit(EXIT_DENIED)
    if isinstance(exc, UnknownTool | InvalidParams | InvalidWorkspace):
        raise _Exit(EXIT_USAGE)
    raise _Exit(EXIT_TOOL_ERROR)


async def _with_daemon(
    ctx: _Context, work: Callable[[Client], Awaitable[int]]
) -> int:
    """Connect, run ``work``, and map every daemon failure to a message and exit code."""
    try:
        async with await Client.connect(ctx.socket, timeout=_CONNECT_TIMEOUT) as client:
            return await work(client)
    except (ConnectError, ConnectionClosed) as exc:
        _unreachable(ctx, exc)
    except RequestTimeout as exc:
        ctx.out.error(str(exc))
        raise _Exit(EXIT_UNREACHABLE) from exc
    except RpcError as exc:
        _rpc_failure(ctx, exc)


def _offline_module(ctx: _Context) -> Any:
    """Import the offline reader, or explain why it is unavailable (exit 2)."""
    try:
        from . import offline  # the one daemon import, lazily
    except ImportError as exc:
        ctx.out.error(f"Reading tool sets from disk is unavailable: {exc}.")
        raise _Exit(EXIT_USAGE) from exc
    return offline


def _discovery_enabled(ctx: _Context, home: Path) -> bool:
    try:
        return bool(_offline_module(ctx).discovery_enabled(home))
    except _Exit:
        return True
    except Exception:  # a config.json the daemon side cannot read: say nothing more here
        return True


# -- commands --------------------------------------------------------------------------


async def _cmd_status(ctx: _Context, args: argparse.Namespace) -> int:
    async def work(client: Client) -> int:
        result = await client.status()
        if ctx.out.is_json:
            ctx.out.json(result)
        else:
            ctx.out.fields(status_fields(result))
        return EXIT_OK

    return await _with_daemon(ctx, work)


def _print_notes(ctx: _Context, notes: Sequence[Mapping[str, Any]]) -> None:
    for note in notes:
        ctx.out.line(f"- {note.get('message', '')}")


async def _daemon_list(ctx: _Context, catalog: str | None) -> tuple[dict[str, Any], str] | None:
    """The daemon's ``list`` result and its home, or None when no daemon answers."""
    try:
        async with await Client.connect(ctx.socket, timeout=_CONNECT_TIMEOUT) as client:
            result = await client.list(ctx.workspace, catalog=catalog)
            status = await client.status()
            return result, str(status.get("home") or ctx.home)
    except ConnectError:
        return None
    except ConnectionClosed as exc:
        _unreachable(ctx, exc)
    except RpcError as exc:
        _rpc_failure(ctx, exc)


async def _cmd_list(ctx: _Context, args: argparse.Namespace) -> int:
    listed = await _daemon_list(ctx, args.catalog)
    if listed is None:
        offline = _offline_module(ctx)
        ctx.out.error(f"toolsetd is not running at {ctx.socket}; showing the tool sets on disk.")
        result = offline.offline_list(ctx.home, ctx.workspace, args.catalog)
        rows: list[SetRow] = offline.inventory(ctx.home, ctx.workspace, args.catalog)
        home = ctx.home
    else:
        result, home_text = listed
        rows = set_rows_from_list(result)
        home = Path(home_text)
    if ctx.out.is_json:
        ctx.out.json(result)
        return EXIT_OK
    ctx.out.rows(SET_HEADERS, [row.cells() for row in rows], empty="No tool sets.")
    _print_notes(ctx, result.get("notes") or [])
    if not _discovery_enabled(ctx, home):
        ctx.out.line(DISCOVERY_OFF)
    return EXIT_OK


def _find_row(rows: Sequence[SetRow], name: str, source: str | None) -> SetRow | None:
    matches = [row for row in rows if row.directory == name]
    if source is not None:
        matches = [row for row in matches if row.source == source]
    matches.sort(key=lambda row: row.source != "project")  # the project copy wins
    return matches[0] if matches else None


async def _cmd_show(ctx: _Context, args: argparse.Namespace) -> int:
    name = args.name.strip()
    listed = await _daemon_list(ctx, None)
    if listed is None:
        offline = _offline_module(ctx)
        ctx.out.error(f"toolsetd is not running at {ctx.socket}; showing the tool sets on disk.")
        result = offline.offline_list(ctx.home, ctx.workspace)
        rows: list[SetRow] = offline.inventory(ctx.home, ctx.workspace)
        home = ctx.home
        raw_sets: dict[tuple[str, str], Any] = {}
    else:
        result, home_text = listed
        rows = set_rows_from_list(result)
        home = Path(home_text)
        raw_sets = {(s.get("directory"), s.get("source")): s for s in result.get("sets") or []}
    if args.source is None:
        tool = next((t for t in result.get("tools") or [] if t.get("name") == name), None)
        if tool is not None:
            if ctx.out.is_json:
                ctx.out.json(tool)
            else:
                ctx.out.fields(tool_fields(tool))
            return EXIT_OK
    if not name or not is_directory_name(name):
        ctx.out.error("Directory name is invalid.")
        return EXIT_USAGE
    row = _find_row(rows, name, args.source)
    if row is None:
        where = {"home": " in Home", "project": " in Project"}.get(args.source or "", "")
        ctx.out.error(f"Tool set '{name}' was not found{where}.")
        return EXIT_USAGE
    if ctx.out.is_json:
        ctx.out.json(raw_sets.get((row.directory, row.source)) or row.to_json())
        return EXIT_OK
    ctx.out.fields(row.fields())
    if not _discovery_enabled(ctx, home):
        ctx.out.line(DISCOVERY_OFF)
    return EXIT_OK


async def _reload_quietly(ctx: _Context) -> bool:
    """Ask a running daemon to reload; an unreachable daemon is fine."""
    try:
        async with await Client.connect(ctx.socket, timeout=_CONNECT_TIMEOUT) as client:
            await client.reload(ctx.workspace)
    except (ConnectError, ConnectionClosed):
        return False
    except RpcError as exc:
        ctx.out.error(f"toolsetd did not reload: {exc.message}")
        return False
    return True


async def _cmd_enable(ctx: _Context, args: argparse.Namespace) -> int:
    enabled = args.command == "enable"
    offline = _offline_module(ctx)
    try:
        directory, source, path = locate_set(ctx.home, ctx.workspace, args.directory, args.source)
        check = partial(offline.manifest_problem, set_dir=path.parent, source=source)
        outcome = set_enabled(path, enabled, check=check)
    except EditError as exc:
        ctx.out.error(exc.message)
        return EXIT_USAGE
    rows: list[SetRow] = offline.inventory(ctx.home, ctx.workspace)
    row = _find_row(rows, directory, source)
    word = "enabled" if enabled else "disabled"
    message = (
        f"Tool set {directory} {word}."
        if outcome.changed
        else f"Tool set {directory} is already {word}."
    )
    reloaded = await _reload_quietly(ctx) if outcome.changed else False
    discovery = _discovery_enabled(ctx, ctx.home)
    if ctx.out.is_json:
        ctx.out.json(
            {
                "directory": directory,
                "source": source,
                "path": str(path),
                "enabled": enabled,
                "changed": outcome.changed,
                "reloaded": reloaded,
                "entry": row.to_json() if row is not None else None,
                "message": message,
            }
        )
        return EXIT_OK
    if row is not None:
        ctx.out.fields(row.fields())
    ctx.out.line(message)
    if enabled and not discovery:
        ctx.out.line(DISCOVERY_OFF)
    return EXIT_OK


async def _cmd_validate(ctx: _Context, args: argparse.Namespace) -> int:
    offline = _offline_module(ctx)
    report = offline.validate_set(Path(args.directory), args.reserve)
    if ctx.out.is_json:
        ctx.out.json(report.to_json())
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


async def _cmd_classify(ctx: _Context, args: argparse.Namespace) -> int:
    arguments = parse_arguments(args.arguments, ctx.stdin)

    async def work(client: Client) -> int:
        result = await client.classify(
            args.tool,
            arguments,
            ctx.workspace,
            mode=args.mode,
            headless=True if args.headless else None,
        )
        if ctx.out.is_json:
            ctx.out.json(result)
            return EXIT_OK
        ctx.out.fields(classification_fields(result))
        paths = classification_path_rows(result)
        if paths:
            ctx.out.rows(PATH_HEADERS, paths, empty="")
        return EXIT_OK

    return await _with_daemon(ctx, work)


class _Progress:
    """The live progress line of ``invoke`` (rich, on stderr, only on a terminal)."""

    def __init__(self, tool: str, enabled: bool) -> None:
        self._tool = tool
        self._live: Any = None
        self._started = time.monotonic()
        if enabled:
            from rich.console import Console
            from rich.live import Live

            self._live = Live(
                self._text(0, 0, None, None),
                console=Console(file=sys.stderr),
                auto_refresh=False,
                transient=True,
            )
            self._live.start()

    def _text(self, elapsed_ms: float, size: int, message: str | None, fraction: Any) -> str:
        parts = [self._tool, f"{elapsed_ms / 1000:.1f}s", f"{size} bytes"]
        if isinstance(fraction, int | float):
            parts.append(f"{fraction:.0%}")
        if message:
            parts.append(message)
        return "  ".join(parts)

    def event(self, method: str, params: dict[str, Any]) -> None:
        """Update the line from one ``started``/``progress``/``completed`` event."""
        if self._live is None:
            return
        if method == "progress":
            size = int(params.get("stdoutBytes") or 0) + int(params.get("stderrBytes") or 0)
            elapsed = params.get("elapsedMs") or (time.monotonic() - self._started) * 1000
            line = self._text(float(elapsed), size, params.get("message"), params.get("fraction"))
            self._live.update(line, refresh=True)
        elif method == "started":
            self._live.update(f"{self._tool}  started (pid {params.get('pid')})", refresh=True)

    def stop(self) -> None:
        """Remove the line."""
        if self._live is not None:
            self._live.stop()
            self._live = None


async def _cmd_invoke(ctx: _Context, args: argparse.Namespace) -> int:
    arguments = parse_arguments(args.arguments, ctx.stdin)
    interactive = sys.stdout.isatty() and sys.stderr.isatty() and not ctx.out.is_json
    progress = _Progress(args.tool, interactive)
    interrupted = False

    async def work(client: Client) -> int:
        nonlocal interrupted
        call_id = os.urandom(16).hex()
        outcome: list[dict[str, Any]] = []
        failure: list[Exception] = []

        async def watch_interrupts(scope: anyio.CancelScope) -> None:
            nonlocal interrupted
            with anyio.open_signal_receiver(signal.SIGINT) as signals:
                async for _ in signals:
                    if interrupted:  # a second Ctrl-C: stop waiting at once
                        scope.cancel()
                        return
                    interrupted = True
                    progress.stop()
                    ctx.out.error("Interrupted; cancelling the call.")
                    scope.deadline = anyio.current_time() + _CANCEL_GRACE
                    try:
                        await client.cancel(call_id)
                    except (RpcError, ConnectionClosed):
                        pass

        async with anyio.create_task_group() as task_group:
            task_group.start_soon(watch_interrupts, task_group.cancel_scope)
            try:
                outcome.append(
                    await client.invoke(
                        args.tool,
                        arguments,
                        ctx.workspace,
                        call_id=call_id,
                        mode=args.mode,
                        headless=True if args.headless else None,
                        approved=True if args.approve else None,
                        catalog=args.catalog,
                        session=args.session,
                        on_event=progress.event,
                    )
                )
            except Exception as exc:  # re-raised below, unwrapped by the task group
                failure.append(exc)
            finally:
                progress.stop()
                task_group.cancel_scope.cancel()
        if failure and not interrupted:
            raise failure[0]
        if interrupted or not outcome:
            return EXIT_INTERRUPTED
        return _print_result(ctx, outcome[0])

    try:
        return await _with_daemon(ctx, work)
    finally:
        progress.stop()


def _print_result(ctx: _Context, result: Mapping[str, Any]) -> int:
    """Print a call result; return the exit code its status means."""
    if ctx.out.is_json:
        ctx.out.json(result)
    else:
        for text in content_lines(result.get("content") or []):
            ctx.out.stdout.write(text if text.endswith("\n") else text + "\n")
    status = result.get("status")
    if status == "timeout":
        return EXIT_TIMEOUT
    if status == "cancelled":
        return EXIT_INTERRUPTED
    if result.get("isError") or status == "error":
        return EXIT_TOOL_ERROR
    return EXIT_OK


async def _cmd_reload(ctx: _Context, args: argparse.Namespace) -> int:
    async def work(client: Client) -> int:
        result = await client.reload(None if args.all else ctx.workspace)
        config = result.get("config") or {}
        # A config file the daemon could not use fails the reload (systemctl reload
        # reports it); the daemon keeps its running settings.
        code = EXIT_TOOL_ERROR if config.get("error") else EXIT_OK
        if ctx.out.is_json:
            ctx.out.json(result)
            return code
        rows = reload_rows(result)
        ctx.out.rows(CHANGE_HEADERS, rows, empty="Nothing changed.")
        _print_notes(ctx, result.get("notes") or [])
        if config.get("error"):
            ctx.out.error(f"toolsetd kept its settings: {config['error']}")
        if config.get("applied"):
            ctx.out.line(f"Config applied: {', '.join(config['applied'])}")
        if config.get("restartNeeded"):
            ctx.out.line(f"Config needs a restart: {', '.join(config['restartNeeded'])}")
        return code

    return await _with_daemon(ctx, work)


async def _cmd_metrics(ctx: _Context, args: argparse.Namespace) -> int:
    async def work(client: Client) -> int:
        result = await client.call("metrics", {})
        if ctx.out.is_json:
            ctx.out.json(result)
        else:
            ctx.out.stdout.write(result.get("text", ""))
        return EXIT_OK

    return await _with_daemon(ctx, work)


_COMMANDS: dict[str, Callable[[_Context, argparse.Namespace], Awaitable[int]]] = {
    "status": _cmd_status,
    "list": _cmd_list,
    "show": _cmd_show,
    "enable": _cmd_enable,
    "disable": _cmd_enable,
    "validate": _cmd_validate,
    "classify": _cmd_classify,
    "invoke": _cmd_invoke,
    "reload": _cmd_reload,
    "metrics": _cmd_metrics,
}


async def _dispatch(ctx: _Context, args: argparse.Namespace) -> int:
    try:
        return await _COMMANDS[args.command](ctx, args)
    except _Exit as exc:
        return exc.code
    except UsageError as exc:
        ctx.out.error(str(exc))
        return EXIT_USAGE


def _interrupted(exc: BaseException) -> bool:
    if isinstance(exc, KeyboardInterrupt):
        return True
    if isinstance(exc, BaseExceptionGroup):
        return any(_interrupted(inner) for inner in exc.exceptions)
    return False


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
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as exc:  # argparse: --help (0) or a usage error (2)
        return exc.code if isinstance(exc.code, int) else EXIT_USAGE
    if args.command == "mcp":
        # The stdlib-only pump (``__main__`` goes there directly, without this module).
        from .mcp import main as mcp_main

        return mcp_main(sys.argv[1:] if argv is None else argv)
    env = os.environ
    socket_path = getattr(args, "socket", None) or default_socket_path(env)
    workspace = Path(os.path.abspath(os.path.expanduser(getattr(args, "workspace", None) or ".")))
    home = Path(os.path.abspath(os.path.expanduser(getattr(args, "home", None) or default_home(env))))
    out = Output(getattr(args, "format", None) or "table", stdout, stderr)
    ctx = _Context(out=out, socket=socket_path, workspace=workspace, home=home, stdin=stdin)
    try:
        code = anyio.run(_dispatch, ctx, args)
        out.flush()
        return code
    except BrokenPipeError:
        return EXIT_OK  # the reader went away (toolsetctl list | head)
    except BaseException as exc:
        if _interrupted(exc):
            return EXIT_INTERRUPTED
        if isinstance(exc, SystemExit):
            raise
        stderr.write(f"toolsetctl: unexpected error: {type(exc).__name__}: {exc}\n")
        return EXIT_TOOL_ERROR
