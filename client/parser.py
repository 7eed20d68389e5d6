"""``toolsetctl``'s argument parser.

Every global option is accepted before or after the subcommand. argparse raises
``ParseError`` instead of exiting, so the CLI can print the error in the format asked
for. Building a subparser is most of a short command's parse time, so ``build_parser``
builds only the subcommand the command line names (``command_in``), and all of them for
``--help`` and for a word it does not know.
"""

from __future__ import annotations

import argparse
import sys

from toolsetd.protocol import __version__
from toolsetd.protocol.whitespace import NET_WHITESPACE

from .command import command_in, option_meant

TYPE_CHECKING = False  # not typing's: importing typing is a share of the start-up
if TYPE_CHECKING:
    from typing import Any, NoReturn

    from _typeshed import SupportsWrite

__all__ = ["COMMANDS", "FORMATS", "ParseError", "build_parser", "command_in"]

#: The output formats.
FORMATS = ("table", "text", "json", "jsonl")
#: The subcommands.
COMMANDS = (
    "status",
    "list",
    "show",
    "enable",
    "disable",
    "validate",
    "classify",
    "invoke",
    "reload",
    "metrics",
    "mcp",
)


class ParseError(Exception):
    """argparse found a usage error (raised instead of exiting, to print it our way)."""

    def __init__(self, parser: argparse.ArgumentParser, message: str) -> None:
        super().__init__(message)
        self.parser = parser
        self.message = message


class _Parser(argparse.ArgumentParser):
    """argparse without abbreviations: an option is spelled in full.

    ``--form json`` and ``--sock PATH`` were taken for ``--format`` and ``--socket``, but
    what reads the command line before argparse (``command_in``, which sends ``mcp`` to its
    pump, and the format a usage error is printed in) and the ``mcp`` pump itself know the
    full spellings only: ``toolsetctl --sock S mcp`` ended in an internal error (exit 9)
    and ``toolsetctl --form json invoke`` printed its usage error as text, not JSON.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)  # the subcommands' parsers too
        super().__init__(*args, **kwargs)

    _argv: list[str] | None = None

    def parse_known_args(self, args: Any = None, namespace: Any = None) -> Any:
        self._argv = list(sys.argv[1:] if args is None else args)  # for ``error``'s hints
        return super().parse_known_args(args, namespace)

    def error(self, message: str) -> NoReturn:
        raise ParseError(self, message + _meant(self, message, self._argv or []))

    def _print_message(self, message: str, file: SupportsWrite[str] | None = None) -> None:
        """argparse's, without its ``except OSError: pass``: ``--help > /dev/full`` printed
        nothing and exited 0. The error is ``cli.run``'s to report, as any other command's
        stdout that fails (exit 9)."""
        if message:
            (file or sys.stderr).write(message)


def _option_strings(parser: argparse.ArgumentParser) -> set[str]:
    """Every option the parser and the subcommand parsers it holds take."""
    found: set[str] = set()
    for action in parser._actions:
        found.update(s for s in action.option_strings if s.startswith("--"))
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                found |= _option_strings(sub)
    return found


def _meant(parser: argparse.ArgumentParser, message: str, argv: list[str]) -> str:
    """For "unrecognized arguments", the option each unknown one was probably meant to be.

    Options are spelled in full (``_Parser``), so ``--arg '{}'`` (for ``--args``), and
    ``--json`` (another tool's flag), were an "unrecognized arguments" error that named no
    way out. Only the options of the command being parsed are suggested (``build_parser``
    builds that one alone).
    """
    prefix = "unrecognized arguments: "
    if message.startswith(prefix):
        words = message.removeprefix(prefix).split(" ")
    elif message.startswith("argument COMMAND: invalid choice"):
        # ``--sock S list``: argparse took S for the command, and said only that.
        words = argv
    else:
        return ""
    known = _option_strings(parser)
    hints = [hint for word in words if (hint := option_meant(word, known))]
    return f"; {'; '.join(hints)}" if hints else ""


def _path(value: str) -> str:
    """A path option's value: an empty one (``--socket ''``, an unset variable in a CI
    script) is a mistake, not the default, as the daemon says of its own."""
    if not value:
        raise argparse.ArgumentTypeError("must be a path, not empty")
    return value


def _source(value: str) -> str:
    """``--source``: trimmed and any case, as the reference host's console reads it (its
    ``Trim()``'s white space, which keeps U+001C..U+001F)."""
    word = value.strip(NET_WHITESPACE).lower()
    if word not in ("home", "project"):
        raise argparse.ArgumentTypeError("Source must be home or project.")
    return word


def _global_options() -> _Parser:
    """The options every command takes, before or after the subcommand."""
    common = _Parser(add_help=False)
    common.add_argument(
        "--socket",
        metavar="PATH",
        type=_path,
        default=argparse.SUPPRESS,
        help="the daemon's socket (env TOOLSETD_SOCKET, else "
        "$XDG_RUNTIME_DIR/toolsetd/toolsetd.sock, else /tmp/toolsetd-<uid>/toolsetd.sock)",
    )
    common.add_argument(
        "--format",
        choices=FORMATS,
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
        type=_path,
        default=argparse.SUPPRESS,
        help="the workspace whose project sets count (default the current directory)",
    )
    common.add_argument(
        "--home",
        metavar="DIR",
        type=_path,
        default=argparse.SUPPRESS,
        help="the Crystal home for the commands that read or edit files (default: env "
        "CRYSTAL_HOME, else ~/.crystal; enable and disable ask the running daemon first)",
    )
    return common


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
        "8 daemon busy, 9 internal error, 129 hung up, 130 interrupted, 141 invoke's "
        "stdout closed, 143 terminated (see docs/cli.md).",
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
    sub.add_argument("--source", type=_source, metavar="home|project", help=source_help)
    for verb in ("enable", "disable"):
        sub = add(verb, f"{verb.capitalize()} a tool set (writes 'enabled' in its tools.json).")
        sub.add_argument("directory", metavar="DIR", help="the set's directory name")
        sub.add_argument("--source", type=_source, metavar="home|project", help=source_help)
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
    for verb, text in (
        ("classify", "Classify a call without running it."),
        ("invoke", "Run a tool."),
    ):
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
            help="approval mode: plan, default, edit, review, audit or full, or an alias "
            "(autoedit, fullreview, full-review, fullauto, yolo); default default",
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
                "--session",
                metavar="S",
                help="session string, passed to the tool as CRYSTAL_SESSION",
            )
            sub.add_argument(
                "--catalog",
                choices=("plan", "work"),
                help="refuse the tool unless it is in this catalog",
            )
            sub.add_argument(
                "--tool-exit-code",
                action="store_true",
                help="once the tool ran and exited, exit with its exit code",
            )
    sub = add("reload", "Reload the config file and the tool sets and print what changed.")
    sub.add_argument(
        "--all",
        action="store_true",
        help="every loaded workspace, not only --workspace (what SIGHUP does; systemd's "
        "ExecReload uses it)",
    )
    add("metrics", "Print the daemon's Prometheus metrics (text exposition format).")
    # ``toolsetctl mcp`` is served by the stdlib-only pump (client/mcp.py), which parses its
    # own options; this entry gives it a place in --help.
    sub = add("mcp", "Serve the workspace's tools to an MCP host on stdin/stdout (docs/mcp.md).")
    sub.add_argument("--catalog", choices=("plan", "work"), help="only this catalog's tools")
    sub.add_argument("--mode", metavar="M", help="approval mode (default 'default')")
    sub.add_argument("--headless", action="store_true", help="turn every 'ask' into 'deny'")
    sub.add_argument(
        "--no-autostart", action="store_true", help="fail instead of starting toolsetd"
    )
    return parser
