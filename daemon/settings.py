"""The daemon's settings: command line, ``toolsetd.toml``, environment and defaults.

Theory of operation
-------------------
``OPTIONS`` is the one table of settings. Each row names a key, its type, its default,
whether a running daemon can take a new value on reload, and the command-line flag,
which is always ``--<key>``. The argument parser and the TOML reader are both built
from the table, so a flag and its key can never drift apart.

A value comes from the first of these that has it: the flag, the environment (only
``socket``, from ``TOOLSETD_SOCKET``, and ``home``, from ``CRYSTAL_HOME``), the config
file, the default. ``Settings.sources`` records which one, for ``--print-config``.

The config file is TOML, read with ``tomllib``: ``--config PATH``, else
``$CONFIGURATION_DIRECTORY/toolsetd.toml`` (systemd's ``ConfigurationDirectory=``),
else ``/etc/toolsetd/toolsetd.toml`` for root, else
``$XDG_CONFIG_HOME/toolsetd/toolsetd.toml`` (``~/.config`` when unset or relative). A
missing default file means no file; a missing ``--config`` file is an error. Every problem raises
``ConfigError`` naming the file, the line and the key.

On reload ``reload_settings`` reads the file again, keeps the flags and the environment
of the start, and splits the keys whose effective value moved into those the daemon
applies now (``Option.reloadable``) and those that need a restart.

``<home>/config.json`` is not read here: it is the reference host's operator policy
(``config_file.load_config``), and stays apart.

To add a setting (for example per-set limits), add a row to ``OPTIONS`` and a field of
the same name (dashes as underscores) to ``Settings``; a TOML table of its own (such as
``[sets.<directory>]``) gets a reader in ``_TABLES`` and a field holding a typed,
frozen value. ``[confinement]`` is one (``confinement.parse_confinement``: cgroups,
sandbox profiles and limits per source and per set); a change to it needs a restart.

Why one module of this size: a third of it is ``OPTIONS``, the one table of every setting
(flag, file key, type, default, reload class, help). The parser, the file reader, the
environment, reload and ``--print-config`` are each derived from that table here; split
apart, the table and the code that interprets it would drift.
"""

from __future__ import annotations

import argparse
import ipaddress
import math
import os
import re
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any, Literal, NoReturn

from toolsetd.protocol.printable import printable  # at load: ConfigError is made short of fds too

from .config_file import KernelFile, read_regular_file, toml_shown
from .confinement import ConfinementConfig, parse_confinement
from .exhaustion import out_of_resources
from .install import at_start, sources_id
from .manifest import ManifestError
from .output import MAX_OUTPUT_LIMIT_CHARS
from .paths import os_user_home

__all__ = [
    "MAX_SECONDS",
    "OPTIONS",
    "ConfigError",
    "Option",
    "Settings",
    "SettingsReload",
    "build_parser",
    "default_config_path",
    "format_settings",
    "key_fault",
    "load_settings",
    "reload_settings",
    "resolve_allow_group",
]

Kind = Literal["int", "float", "str", "bool", "path", "names", "choice", "listen"]
Check = Literal["", "count", "size", "seconds", "loopback"]


@dataclass(frozen=True, slots=True)
class Option:
    """One setting: its key (and flag ``--<key>``), type, default and reload behaviour.

    Attributes:
        key: The TOML key; the flag is ``--`` + key; the ``Settings`` field is the key
            with dashes as underscores.
        kind: The value's type.
        default: The value when nothing sets it.
        help: The ``--help`` text.
        reloadable: Whether a reload applies a new value (else it needs a restart).
        check: ``count`` (an integer of at least 1), ``size`` (an integer of at least 0),
            ``seconds`` (a positive number) or ``loopback`` (names that are each a
            loopback ``HOST:PORT``).
        maximum: The largest value of an ``int``, when it has one.
        least: The smallest value of a ``seconds`` float, when it has a floor above 0.
        endless: Whether a ``seconds`` float may be ``inf`` (never). Only where no wait on
            a peer or a child depends on it: an endless grace never kills, an endless
            interval never ticks, an endless idle timeout never frees a connection.
        choices: The allowed values of a ``choice``.
        metavar: The flag's value name in ``--help``.
        env: An environment variable read when the flag is absent (before the file).
    """

    key: str
    kind: Kind
    default: Any
    help: str
    reloadable: bool = False
    check: Check = ""
    maximum: int | None = None
    least: float | None = None
    endless: bool = False
    choices: tuple[str, ...] = ()
    metavar: str | None = None
    env: str | None = None

    @property
    def attr(self) -> str:
        """The ``Settings`` field name."""
        return self.key.replace("-", "_")

    @property
    def flag(self) -> str:
        """The command-line flag."""
        return f"--{self.key}"


OPTIONS: tuple[Option, ...] = (
    Option(
        "socket",
        "path",
        None,
        "socket path (default env TOOLSETD_SOCKET, else $XDG_RUNTIME_DIR/toolsetd/"
        "toolsetd.sock, else /tmp/toolsetd-<uid>/toolsetd.sock)",
        metavar="PATH",
        env="TOOLSETD_SOCKET",
    ),
    Option(
        "home",
        "path",
        None,
        "the Crystal home (default env CRYSTAL_HOME, else ~/.crystal)",
        metavar="DIR",
        env="CRYSTAL_HOME",
    ),
    Option(
        "reserve",
        "names",
        (),
        "reserve one more tool name (repeatable; a list in the file)",
        metavar="NAME",
    ),
    Option(
        "log-format", "choice", "json", "log rendering (default json)", choices=("json", "console")
    ),
    Option(
        "log-level",
        "choice",
        "info",
        "log level (default info)",
        choices=("debug", "info", "warning", "error"),
    ),
    Option("no-watch", "bool", False, "do not watch tool-set folders"),
    Option(
        "max-watches",
        "int",
        8192,
        "the most folders watched (inotify watches; never more than a quarter of "
        "fs.inotify.max_user_watches); set folders past it are followed by the stat poll "
        "alone (default 8192)",
        check="count",
        metavar="N",
    ),
    Option("allow-group", "str", None, "also serve members of this group", metavar="GROUP"),
    Option(
        "max-running",
        "int",
        64,
        "children running at once; further calls wait (default 64)",
        reloadable=True,
        check="count",
        metavar="N",
    ),
    Option(
        "output-limit",
        "int",
        100_000,
        "characters of output returned to the caller (default 100000, at most "
        f"{MAX_OUTPUT_LIMIT_CHARS}: a result must fit the longest line the daemon sends)",
        reloadable=True,
        check="count",
        maximum=MAX_OUTPUT_LIMIT_CHARS,
        metavar="CHARS",
    ),
    Option(
        "kill-grace",
        "float",
        5.0,
        "seconds between SIGTERM and SIGKILL of a call's process group on timeout, cancel "
        "or stop (default 5)",
        reloadable=True,
        check="seconds",
        metavar="SECONDS",
    ),
    Option(
        "progress-interval",
        "float",
        1.0,
        "seconds between progress notifications (default 1, at least 0.01)",
        reloadable=True,
        check="seconds",
        least=0.01,
        metavar="SECONDS",
    ),
    Option(
        "shutdown-grace",
        "float",
        10.0,
        "seconds in-flight calls get when stopping (default 10)",
        reloadable=True,
        check="seconds",
        metavar="SECONDS",
    ),
    Option(
        "status-interval",
        "float",
        2.0,
        "seconds between checks of the STATUS= line sent to systemd (default 2, at least 0.01)",
        reloadable=True,
        check="seconds",
        least=0.01,
        metavar="SECONDS",
    ),
    Option(
        "no-orphan-guard",
        "bool",
        False,
        "do not run the sentinel process that kills the "
        "tools if the daemon dies (under systemd the unit's cgroup does that too)",
    ),
    Option(
        "max-connections",
        "int",
        256,
        "connections served at once (default 256)",
        reloadable=True,
        check="count",
        metavar="N",
    ),
    Option(
        "max-calls-per-connection",
        "int",
        128,
        "requests in flight per connection (default 128)",
        reloadable=True,
        check="count",
        metavar="N",
    ),
    Option(
        "idle-timeout",
        "float",
        30.0,
        "close a connection that holds an incomplete request this long (default 30)",
        reloadable=True,
        check="seconds",
        metavar="SECONDS",
    ),
    Option(
        "max-message-bytes",
        "int",
        16 * 1024 * 1024,
        "longest request line or MCP HTTP body (default 16777216)",
        reloadable=True,
        check="count",
        metavar="N",
    ),
    Option(
        "workspace-idle",
        "float",
        3600.0,
        "release a workspace unused this long (default 3600; inf: never)",
        reloadable=True,
        check="seconds",
        endless=True,
        metavar="SECONDS",
    ),
    Option(
        "spawn-threads",
        "int",
        4,
        "worker threads that spawn tools while other calls run, so spawns overlap "
        "(default 4; 0 always spawns on the event loop's thread)",
        check="size",
        metavar="N",
    ),
    Option(
        "cache-dir",
        "path",
        None,
        "where parsed tool sets are cached across restarts (default "
        "$XDG_CACHE_HOME/toolsetd, else ~/.cache/toolsetd)",
        metavar="DIR",
    ),
    Option("no-cache", "bool", False, "parse every tool set at start-up; keep no cache on disk"),
    Option(
        "metrics-listen",
        "listen",
        None,
        "also serve Prometheus metrics at /metrics on this loopback address",
        metavar="HOST:PORT",
    ),
    Option(
        "mcp-listen",
        "names",
        (),
        "also serve MCP over Streamable HTTP at http://HOST:PORT/mcp; loopback only "
        "(127.0.0.1, [::1], localhost); repeatable",
        check="loopback",
        metavar="HOST:PORT",
    ),
    Option(
        "mcp-token-file",
        "path",
        None,
        "a 0600 file with a bearer token for MCP HTTP callers whose user cannot be established",
        metavar="PATH",
    ),
    Option(
        "traces",
        "choice",
        "off",
        "export OpenTelemetry traces (needs toolsetd[otel]; default off)",
        choices=("off", "otlp", "console"),
    ),
)

_BY_KEY = {option.key: option for option in OPTIONS}

#: The longest grace, interval or timeout (``workspace-idle`` aside, which may be ``inf``).
MAX_SECONDS = 86400.0


@dataclass(frozen=True, slots=True)
class Settings:
    """The effective settings, typed; one field per ``OPTIONS`` row.

    Attributes:
        sources: Where each key's value came from: ``default``, ``flag --<key>``,
            ``env NAME`` or ``<file>:<line>``.
        config_path: The config file read, or None when there was none.
    """

    socket: Path | None = None
    home: Path | None = None
    reserve: tuple[str, ...] = ()
    log_format: str = "json"
    log_level: str = "info"
    no_watch: bool = False
    max_watches: int = 8192
    allow_group: str | None = None
    max_running: int = 64
    output_limit: int = 100_000
    kill_grace: float = 5.0
    progress_interval: float = 1.0
    shutdown_grace: float = 10.0
    status_interval: float = 2.0
    no_orphan_guard: bool = False
    max_connections: int = 256
    max_calls_per_connection: int = 128
    idle_timeout: float = 30.0
    max_message_bytes: int = 16 * 1024 * 1024
    workspace_idle: float = 3600.0
    spawn_threads: int = 4
    cache_dir: Path | None = None
    no_cache: bool = False
    metrics_listen: tuple[str, int] | None = None
    mcp_listen: tuple[str, ...] = ()
    mcp_token_file: Path | None = None
    traces: str = "off"
    confinement: ConfinementConfig = field(default_factory=ConfinementConfig)
    sources: Mapping[str, str] = field(default_factory=dict, compare=False)
    config_path: Path | None = field(default=None, compare=False)

    def value(self, key: str) -> Any:
        """The value of one key (``max-running``)."""
        return getattr(self, _BY_KEY[key].attr)


class ConfigError(Exception):
    """A setting that cannot be used; the message names the file, the line and the key.

    Attributes:
        reason: The message alone, without where or the key (``key_fault`` places it).
        path: The config file, or None for a flag or the environment.
        line: The line in that file, when known.
        key: The key at fault, when there is one.
    """

    def __init__(
        self,
        message: str,
        path: Path | None = None,
        line: int | None = None,
        key: str | None = None,
    ) -> None:
        where = ""
        if path is not None:
            where = f"{path}:{line}: " if line else f"{path}: "
        # One line a terminal shows but cannot act on: keys and values come from the file
        # (toolsetd --config their.toml --print-config checks a file someone else wrote).
        super().__init__(printable(f"{where}{f'{key}: ' if key else ''}{message}"))
        self.reason = message
        self.path = path
        self.line = line
        self.key = key


@dataclass(frozen=True, slots=True)
class SettingsReload:
    """What a reload of the config file found.

    Attributes:
        settings: The settings to run with now (the running ones for restart-only keys).
        applied: Keys whose new value takes effect now.
        restart_needed: Keys whose new value waits for a restart.
        next_start: The settings the next start would read: the file's values for every
            key (a reload refuses a file that start would refuse).
    """

    settings: Settings
    applied: tuple[str, ...]
    restart_needed: tuple[str, ...]
    next_start: Settings


# -- the command line ------------------------------------------------------------------


class _Parser(argparse.ArgumentParser):
    """argparse's parser, its usage error said as the daemon's other start-up errors are.

    Printed by argparse, the error had no priority on the journal, which filed it as
    info: an ``ExecStart=`` typo was missing from ``journalctl -p err``.
    """

    def error(self, message: str) -> NoReturn:
        from .logs import say  # only on the way out

        say(f"{self.format_usage().rstrip()}\n{self.prog}: error: {message}")
        raise SystemExit(2)

    def _print_message(self, message: str, file: Any = None) -> None:
        """Write ``--help`` or ``--version``, its OSError raised (``app.main`` says it):
        argparse swallows it, and ``toolsetd --help > /dev/full`` exited 0, said nothing."""
        if message:
            stream = file or sys.stderr
            stream.write(message)
            stream.flush()  # buffered, the error would come at exit: "Exception ignored", 120


def build_parser(version: str) -> argparse.ArgumentParser:
    """The ``toolsetd`` argument parser; an absent flag leaves no attribute."""
    parser = _Parser(
        prog="toolsetd",
        description="Serve operator tool sets (tools.json) to coding agents over a Unix socket.",
        argument_default=argparse.SUPPRESS,
    )
    parser.add_argument(
        "--config",
        type=Path,
        metavar="PATH",
        help="the config file (default $CONFIGURATION_DIRECTORY/toolsetd.toml under "
        "systemd, else /etc/toolsetd/toolsetd.toml for root, else "
        "$XDG_CONFIG_HOME/toolsetd/toolsetd.toml, ~/.config/toolsetd/toolsetd.toml without it)",
    )
    parser.add_argument(
        "--print-config",
        action="store_true",
        help="print the effective settings and where each came from, then exit",
    )
    for option in OPTIONS:
        if option.kind == "bool":
            parser.add_argument(option.flag, action="store_true", help=option.help)
        elif option.kind == "names":
            parser.add_argument(
                option.flag, action="append", metavar=option.metavar, help=option.help
            )
        elif option.kind == "choice":
            parser.add_argument(option.flag, choices=option.choices, help=option.help)
        else:
            parser.add_argument(option.flag, metavar=option.metavar, help=option.help)
    parser.add_argument("--version", action="version", version=f"toolsetd {version}")
    return parser


# -- reading ---------------------------------------------------------------------------


def default_config_path(environ: Mapping[str, str], uid: int | None = None) -> Path | None:
    """Where the config file is looked for when ``--config`` is not given: None when it
    is under a home that cannot be found (no ``HOME``, and a uid without a passwd entry,
    as a container's arbitrary uid has): ``~`` would be a folder named ``~`` here."""
    if environ.get("CONFIGURATION_DIRECTORY"):
        # systemd's ConfigurationDirectory= (may list several; the first is ours).
        return Path(environ["CONFIGURATION_DIRECTORY"].split(":")[0]) / "toolsetd.toml"
    if (os.getuid() if uid is None else uid) == 0:
        return Path("/etc/toolsetd/toolsetd.toml")
    base = environ.get("XDG_CONFIG_HOME", "")
    if not os.path.isabs(base):  # the XDG spec says to ignore a relative one
        home = os_user_home(environ)
        if not os.path.isabs(home):
            return None
        base = os.path.join(home, ".config")
    return Path(base) / "toolsetd" / "toolsetd.toml"


def _present(path: Path) -> bool:
    """Whether something is at the default file's path: only nothing there means no file.

    ``os.path.exists`` said no for a symlink whose target is gone (a dotfiles checkout not
    mounted) and for a folder that cannot be searched: the daemon then started with every
    default, its ``[confinement]`` and limits silently dropped. Such a file is the
    operator's, unusable; ``_file_values`` says why.
    """
    try:
        os.lstat(path)
    except (FileNotFoundError, NotADirectoryError):
        return False
    except OSError:  # EACCES, ELOOP: something may be there, and it cannot be judged
        pass
    return True


#: One part of a dotted TOML key: bare, "basic" (its escapes left as written) or 'literal'.
_KEY_PART = r"""(?:"(?:[^"\\]|\\.)*"|'[^']*'|[A-Za-z0-9_-]+)"""
_KEY_PATH = rf"{_KEY_PART}(?:\s*\.\s*{_KEY_PART})*"
_HEADER = re.compile(rf"^\s*\[\[?\s*({_KEY_PATH})\s*\]")
_ASSIGNMENT = re.compile(rf"^\s*({_KEY_PATH})\s*=")


def _key_parts(path: str) -> list[str]:
    """The parts of a dotted key as written, quotes removed (``a."b c"`` is a, b c)."""
    return [p[1:-1] if p[0] in "\"'" else p for p in re.findall(_KEY_PART, path)]


def _key_lines(text: str) -> dict[str, int]:
    """The first line of each dotted key and ``[table]`` (tomllib keeps no positions).

    Every prefix is a key too: ``limits.x = 1`` is the line of ``limits`` (a dotted key
    makes that table), ``confinement = {...}`` that of ``confinement``, and
    ``[confinement.sets."a b"]`` that of ``[confinement.sets.a b]`` and ``[confinement]``.
    """
    lines: dict[str, int] = {}
    table: list[str] = []
    # Lines end at "\n" alone, as tomllib counts them: splitlines() also ends one at
    # U+2028, U+2029 and U+0085, which a string may hold.
    for number, line in enumerate(text.split("\n"), start=1):
        match = _HEADER.match(line)
        if match:
            table = _key_parts(match.group(1))[:_KEY_DEPTH]
            _record_prefixes(lines, table, 1, number, "[{}]")
            continue
        match = _ASSIGNMENT.match(line)
        if match:
            full = table + _key_parts(match.group(1))[:_KEY_DEPTH]
            _record_prefixes(lines, full, len(table) + 1, number, "{}")
    return lines


#: No setting is deeper or longer: names past these are not given lines, so a 1 MiB key of
#: 400,000 dotted parts costs its length, not the square of it (every prefix joined).
_KEY_DEPTH = 8
_KEY_LENGTH = 256


def _record_prefixes(
    lines: dict[str, int], parts: list[str], first: int, number: int, form: str
) -> None:
    """Give line ``number`` to each dotted prefix of ``parts`` from the ``first`` part on
    (in ``form``), those already seen keeping theirs, the deep and the long none."""
    size = -1
    for end, part in enumerate(parts[:_KEY_DEPTH], start=1):
        size += len(part) + 1
        if size > _KEY_LENGTH:
            return
        if end >= first:
            lines.setdefault(form.format(".".join(parts[:end])), number)


def _read_file(path: Path) -> tuple[dict[str, Any], dict[str, int]]:
    try:
        # Never blocks (a FIFO is refused) and reads at most 1 MiB: a reload reads the
        # file on the event loop.
        data, _ = read_regular_file(path)
    except ManifestError as exc:
        if out_of_resources(exc.__cause__):
            # The daemon's state, not the file's: say so, or an operator goes hunting for
            # a mistake in a file nobody could read.
            raise ConfigError(
                f"could not be read now ({exc.__cause__.strerror}): toolsetd is short of "
                "descriptors or memory, and the file was not judged; reload again when some "
                "calls have finished",
                path,
            ) from None
        reason = getattr(exc.__cause__, "strerror", None)
        if isinstance(exc, KernelFile):
            # A regular file by its mode (``stat -L`` says so): "not a regular file" sent
            # the operator looking for a FIFO or a folder.
            reason = (
                f"it is in the kernel's {exc.kind} file system (a view of kernel state, not a "
                "file) and is not read: make it a regular file on a disk, or a link to one"
            )
        elif reason is None:
            reason = (
                "it is larger than 1 MiB" if "larger" in exc.message else "it is not a regular file"
            )
        raise ConfigError(f"cannot be used: {reason}", path) from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data[: exc.start].count(b"\n") + 1
        raise ConfigError("is not UTF-8", path, line) from None
    # A byte order mark (Notepad, some editors) is no TOML, but the text is what the
    # operator meant: as config.json, take the file with or without one.
    text = text.removeprefix("\ufeff")
    import tomllib  # only when there is a file: a daemon without one never loads it

    try:
        table = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        found = re.search(r"at line (\d+)", str(exc))
        line = int(found.group(1)) if found else text.rstrip("\r\n").count("\n") + 1
        if str(exc).startswith(("Cannot overwrite a value", "Cannot declare")):
            # tomllib names neither the key nor where it was set first.
            twice = _set_twice(text, line)
            if twice is not None:
                key, first, declared, at = twice
                fix = "write its keys in one place" if declared else "keep one of them"
                said = "declared" if declared else "set"
                raise ConfigError(
                    f"is {said} twice (first at line {first}); {fix}", path, at, key
                ) from None
        raise ConfigError(f"is not valid TOML: {exc}", path, line) from None
    except RecursionError:
        # tomllib parses nested arrays and inline tables by recursion: a value a few
        # thousand deep (a few KiB) raised this past every handler, and ended the daemon
        # at a SIGHUP's reload.
        raise ConfigError(
            "is not valid TOML: an array or inline table is nested too deeply",
            path,
            _deep_line(text),
        ) from None
    except ValueError:
        # tomllib reads an integer with int(), which refuses one of more digits than
        # Python's limit (4,300 by default): that ValueError (no TOMLDecodeError) went past
        # every handler, as the deep value's did: a traceback at start, an internal error
        # for the reload RPC, and the daemon's end on SIGHUP.
        limit = sys.get_int_max_str_digits()
        # From a run's first digit only: tried from each, a run just short of the limit
        # was read to its end once a digit, its length squared (seconds on the loop).
        found = re.search(rf"(?<![0-9_])[0-9_]{{{limit or 1},}}", text)
        long_line = text.count("\n", 0, found.start()) + 1 if found is not None else None
        raise ConfigError(
            f"holds an integer of more than {limit:,} digits, which toolsetd does not read; "
            "write a shorter number",
            path,
            long_line,
        ) from None
    return table, _key_lines(text)


def _set_twice(text: str, line: int) -> tuple[str, int, bool, int] | None:
    """The key or table set again where tomllib stopped at ``line``, the line that set it
    first, whether it is a table, and the line that sets it again (None when that cannot be
    told). tomllib stops after the value, so the assignment is the nearest one at or above
    ``line`` (the first line of a value written over several)."""
    rows = text.split("\n")
    if not 1 <= line <= len(rows):
        return None
    at = line
    while at > 1 and not (_HEADER.match(rows[at - 1]) or _ASSIGNMENT.match(rows[at - 1])):
        at -= 1
    table: list[str] = []
    for row in rows[: at - 1]:
        header = _HEADER.match(row)
        if header:
            table = _key_parts(header.group(1))
    header = _HEADER.match(rows[at - 1])
    forms: tuple[str, ...] = ("{}",)
    if header:
        name, forms = ".".join(_key_parts(header.group(1))), ("[{}]", "{}")
    else:
        assignment = _ASSIGNMENT.match(rows[at - 1])
        if assignment is None:
            return None
        name = ".".join(table + _key_parts(assignment.group(1)))
    earlier = _key_lines("\n".join(rows[: at - 1]))
    first = [earlier[form.format(name)] for form in forms if form.format(name) in earlier]
    return (name, min(first), header is not None, at) if first else None


def _deep_line(text: str, depth: int = 64) -> int | None:
    """The line where the brackets and braces open (less those closed) first pass ``depth``
    (strings are not told apart: this only points at the place, for the message)."""
    opened, line = 0, 1
    for char in text:
        if char in "[{":
            opened += 1
            if opened > depth:
                return line
        elif char in "]}":
            opened -= 1
        elif char == "\n":
            line += 1
    return None


def _check_value(option: Option, raw: Any, where: str, started: bool = False) -> Any:
    """Convert and check one value; raises ValueError with what was expected.

    ``started``: the daemon runs already (a reload): a listen address's rules are taken
    only from its own code (``_own_listen_rules``).
    """
    kind = option.kind
    if kind == "bool":
        if not isinstance(raw, bool):
            raise ValueError(f"must be true or false, got {_show(raw)}")
        return raw
    if kind == "int":
        number = _number(raw, where, int, "an integer")
        if option.check == "count" and number < 1:
            raise ValueError(f"must be at least 1, got {number}")
        if option.check == "size" and number < 0:
            raise ValueError(f"must be at least 0, got {number}")
        if option.maximum is not None and number > option.maximum:
            raise ValueError(f"must be at most {option.maximum}, got {number}")
        return number
    if kind == "float":
        number = _number(raw, where, float, "a number of seconds")
        try:
            seconds = float(number)
        except OverflowError:
            # An integer past a double's range (``kill-grace = 1`` and 400 zeros): float()
            # raised past every handler, a traceback at start, an internal error for the
            # reload RPC and the daemon's end on SIGHUP. It is as endless as ``1e400``,
            # which TOML reads as inf: judged as that below (a negative one as -inf).
            seconds = math.inf if number > 0 else -math.inf
        if option.check == "seconds" and not seconds > 0:
            raise ValueError(f"must be a positive number of seconds, got {_show(raw)}")
        if seconds == math.inf and option.endless:
            return seconds
        if not math.isfinite(seconds):  # an endless grace or interval is a wait with no bound
            raise ValueError(f"must be a finite number of seconds, got {_show(raw)}")
        if seconds > MAX_SECONDS and not option.endless:
            # As endless as inf: a grace of 1e308 never kills a child that ignores SIGTERM.
            raise ValueError(f"must be at most {MAX_SECONDS:g} seconds (a day), got {_show(raw)}")
        if option.least is not None and seconds < option.least:
            raise ValueError(f"must be at least {option.least} seconds, got {_show(raw)}")
        return seconds
    if kind == "names":
        if isinstance(raw, str):
            raw = [raw]
        entries = "a list of names"
        if option.check == "loopback":
            entries = 'a list of "HOST:PORT" addresses'  # mcp-listen
        if not isinstance(raw, list):
            raise ValueError(f"must be {entries}, got {_show(raw)}")
        for number, name in enumerate(raw, start=1):
            if not isinstance(name, str) or not name:
                # Which entry: "got a list" did not say what was wrong with it.
                what = "empty" if name == "" else _show(name)
                raise ValueError(f"must be {entries}; entry {number} is {what}")
        if option.check == "loopback":
            _check_loopback(raw, started)
        return tuple(raw)
    if not isinstance(raw, str):
        raise ValueError(f"must be a string, got {_show(raw)}")
    if kind == "choice":
        if raw not in option.choices:
            raise ValueError(f"must be one of {', '.join(option.choices)}; got {_show(raw)}")
        return raw
    if kind == "path":
        if not raw:
            raise ValueError("must be a path")
        if "\x00" in raw:
            # Before expanduser: "~\u0000x" looked up a user of that name, and its
            # ValueError said only "embedded null byte", no word of what to change.
            raise ValueError(f"must be a path without NUL characters (\\u0000), got {_show(raw)}")
        expanded = os.path.expanduser(raw)
        if where == "file" and not os.path.isabs(expanded):
            if raw.startswith("~"):  # ~name of no user (expanduser leaves it as it is)
                user = raw[1:].split("/", 1)[0]
                raise ValueError(
                    f"starts with {_show('~' + user)}, and there is no user {_show(user)}; "
                    "give an absolute path, or ~/ for the daemon's home"
                )
            raise ValueError(f"must be an absolute path (or start with ~), got {_show(raw)}")
        try:
            return Path(os.path.abspath(expanded))
        except OSError:  # a relative one from the environment, its directory removed
            raise ValueError(
                f"is relative ({_show(raw)}) and the working directory it was relative to "
                "is gone; give an absolute path"
            ) from None
    if kind == "listen":
        return _parse_listen(raw, started)
    if not raw:
        raise ValueError("must not be empty")
    return raw


def _number(raw: Any, where: str, convert: type[int] | type[float], what: str) -> int | float:
    """A number from the file (an int or float, never a bool) or a flag's text."""
    if isinstance(raw, str) and where == "flag":
        try:
            return convert(raw)
        except ValueError:
            raise ValueError(f"must be {what}, got {_show(raw)}") from None
    allowed = int if convert is int else (int, float)
    if isinstance(raw, bool) or not isinstance(raw, allowed):
        raise ValueError(f"must be {what}, got {_show(raw)}")
    return raw


#: Why a listen address read at a reload is not judged (``_own_listen_rules``).
_LISTEN_UPGRADED = (
    "toolsetd was upgraded (or removed) under this daemon, which loads its rules of listen "
    "addresses at the first one it reads: restart it"
)


def _own_listen_rules(started: bool) -> None:
    """Before ``httpguard``'s first import at a reload (a listen key added to the file since
    a start that had none, so loaded none): refuse when the install is no longer the
    daemon's code (``install.sources_id``). Imported from another release, its rules were
    mixed into the daemon's, and from an install half replaced or removed its
    ``ImportError`` failed the ``reload`` call as an internal error and ended the daemon
    at a SIGHUP. Looked at (~3 ms) only until it is imported: not at the start, which
    loads it from the code the daemon starts with; what cannot be read now is not judged.

    Raises:
        ValueError: It is no longer the daemon's code (the reload keeps the running
            settings and says why).
    """
    if not started or f"{__package__}.httpguard" in sys.modules:
        return
    try:
        same = sources_id() == at_start()[1]
    except OSError:
        return
    if not same:
        raise ValueError(_LISTEN_UPGRADED)


def _check_loopback(values: Sequence[str], started: bool = False) -> None:
    """Refuse an address the HTTP endpoint would refuse to bind, at start and at reload."""
    _own_listen_rules(started)
    from .httpguard import ListenError, parse_listen  # its rules; loaded only when used

    for text in values:
        try:
            parse_listen(text)
        except ListenError as exc:
            raise ValueError(f"{_show(text)}: {exc.reason}") from None


def _parse_listen(raw: str, started: bool = False) -> tuple[str, int]:
    _own_listen_rules(started)
    from .httpguard import port_number  # loaded only when used

    host, sep, port_text = raw.rpartition(":")
    host = host.strip("[]")
    port = port_number(port_text)
    if not sep or port is None:
        raise ValueError(
            f"must be HOST:PORT with a port from 0 (any free one) to 65535, got {_show(raw)}"
        )
    if host == "localhost":
        host = "127.0.0.1"
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        raise ValueError(
            f"must be a loopback address (127.0.0.1, [::1] or localhost), got {_show(raw)}"
        ) from None
    if not address.is_loopback:
        raise ValueError(
            f"must be a loopback address (127.0.0.1, [::1] or localhost), got {_show(raw)}"
        )
    return str(address), port


#: A value as a message shows it (``config_file.toml_shown``).
_show = toml_shown


def _file_values(path: Path, started: bool = False) -> tuple[dict[str, Any], dict[str, str]]:
    """Read and check the file: (values by attribute, sources by key); ``started``: as
    ``_check_value``'s."""
    table, lines = _read_file(path)
    values: dict[str, Any] = {}
    sources: dict[str, str] = {}
    for key, raw in table.items():
        line = lines.get(key) or lines.get(f"[{key}]")
        if key in _TABLES:
            values[key] = _read_table(key, raw, path, lines)
            sources[key] = f"{path}:{line}" if line else str(path)
            continue
        option = _BY_KEY.get(key)
        if option is None:
            import difflib  # only for the error message

            guess = difflib.get_close_matches(key.replace("_", "-"), list(_BY_KEY), n=1)
            hint = f"; did you mean {guess[0]!r}?" if guess else "; see toolsetd --help"
            raise ConfigError(f"unknown key{hint}", path, line, key)
        try:
            values[option.attr] = _check_value(option, raw, "file", started)
        except ValueError as exc:
            raise ConfigError(str(exc), path, line, key) from None
        sources[key] = f"{path}:{line}" if line else str(path)
    return values, sources


#: The TOML tables with a reader of their own, by key (the ``Settings`` field's name).
_TABLES: dict[str, Any] = {"confinement": parse_confinement}


def _read_table(key: str, raw: Any, path: Path, lines: Mapping[str, int]) -> Any:
    """One table through its reader; its ``ValueError`` names the dotted key at fault."""
    if not isinstance(raw, dict):
        # [[confinement]] is an array of tables: its header is its line.
        line = lines.get(key) or lines.get(f"[{key}]")
        raise ConfigError(f"must be a table ([{key}]), got {_show(raw)}", path, line, key)
    try:
        return _TABLES[key](raw, key)
    except ValueError as exc:
        where, _, message = str(exc).partition(": ")
        # The key's line, else its nearest table's (an inline table: the line naming it).
        line, parts = None, where.split(".")
        while parts and line is None:
            name = ".".join(parts)
            line = lines.get(name) or lines.get(f"[{name}]")
            parts.pop()
        raise ConfigError(message, path, line or lines.get(key), where) from None


def load_settings(
    args: argparse.Namespace,
    environ: Mapping[str, str],
    *,
    uid: int | None = None,
    started: bool = False,
) -> Settings:
    """The effective settings from the parsed flags, the environment and the config file.

    Args:
        args: ``build_parser().parse_args()`` (absent flags leave no attribute).
        environ: The environment.
        uid: The user id deciding the default file (the process's by default).
        started: The daemon runs already (``reload_settings``): a module its start did not
            load is loaded only from its own code (``_own_listen_rules``).

    Returns:
        The settings, with the source of every value.

    Raises:
        ConfigError: A flag, an environment value or the file is unusable.
    """
    explicit = getattr(args, "config", None)
    path: Path | None = (
        Path(os.path.abspath(explicit)) if explicit else default_config_path(environ, uid)
    )
    file_values: dict[str, Any] = {}
    file_sources: dict[str, str] = {}
    if path is not None and (explicit or _present(path)):
        file_values, file_sources = _file_values(path, started)
    elif not explicit:
        path = None
    values: dict[str, Any] = {}
    sources: dict[str, str] = {}
    for option in OPTIONS:
        raw = getattr(args, option.attr, None)
        if raw is not None:
            try:
                values[option.attr] = _check_value(option, raw, "flag", started)
            except ValueError as exc:
                raise ConfigError(str(exc), key=option.flag) from None
            sources[option.key] = f"flag {option.flag}"
        elif option.env and environ.get(option.env):
            try:
                values[option.attr] = _check_value(option, environ[option.env], "env", started)
            except ValueError as exc:
                raise ConfigError(f"(from {option.env}) {exc}", key=option.key) from None
            sources[option.key] = f"env {option.env}"
        elif option.attr in file_values:
            values[option.attr] = file_values[option.attr]
            sources[option.key] = file_sources[option.key]
        else:
            sources[option.key] = "default"
    for key in _TABLES:
        if key in file_values:
            values[key] = file_values[key]
            sources[key] = file_sources[key]
    return Settings(**values, sources=sources, config_path=path)


def resolve_allow_group(settings: Settings) -> int | None:
    """Look ``allow-group`` up, once, at start: its gid, for the peer policy.

    A name no group has is refused before anything is bound (not a traceback).

    Returns:
        The group's gid, or None when no group is named.

    Raises:
        ConfigError: No group has that name; naming the flag, or the file, the line and
            the key.
    """
    name = settings.allow_group
    if not name:
        return None
    import grp  # only when a group is named

    try:
        return grp.getgrnam(name).gr_gid
    except KeyError:
        pass
    raise key_fault(
        settings,
        "allow-group",
        f"no group is named {_show(name)} in the group database; "
        "create it (groupadd --system NAME) or fix the name",
    )


def key_fault(settings: Settings, key: str, message: str) -> ConfigError:
    """The error for ``key``'s value, named where that value came from.

    For a check across keys, made after the settings were merged (``allow-group``'s
    group, ``mcp-token-file`` without ``mcp-listen``, ``traces``' exporter): they named
    a flag, or nothing, for a value the file gave.

    Args:
        settings: The merged settings; ``Settings.sources`` says where ``key`` came from.
        key: The key at fault (``traces``).
        message: What is wrong with its value, without where.

    Returns:
        The error naming the flag, the environment variable, or the config file and line.
    """
    source = settings.sources.get(key, "")
    if source.startswith("flag "):
        return ConfigError(message, key=source.removeprefix("flag "))
    if source.startswith("env "):
        return ConfigError(f"(from {source.removeprefix('env ')}) {message}", key=key)
    path = settings.config_path
    if path is None or source in ("", "default"):
        return ConfigError(message, key=key)
    # "<path>:<line>", or the path alone when the key's line is not known: a line is read
    # only after the path, whose own name may end in ":7".
    line = source.removeprefix(f"{path}:") if source != str(path) else ""
    return ConfigError(message, path, int(line) if line.isdigit() else None, key)


def reload_settings(
    running: Settings, args: argparse.Namespace, environ: Mapping[str, str]
) -> SettingsReload:
    """Read the config file again; split what moved into applied now and restart needed.

    Args:
        running: The settings the daemon runs with.
        args: The flags of the start (they still win).
        environ: The environment of the start.

    Returns:
        The settings to run with: new values for reloadable keys, the running ones for
        the others.

    Raises:
        ConfigError: The file is unusable now; the running settings stay.
    """
    # A relative path from the environment (CRYSTAL_HOME=home) was made absolute at start,
    # against the working directory then, as a relative flag is (parse_command_line):
    # read again, it named whatever that directory had become (a restart "needed" for a
    # value nobody changed), or, the directory removed, failed every reload.
    environ = dict(environ)
    for option in OPTIONS:
        if option.env and running.sources.get(option.key) == f"env {option.env}":
            environ[option.env] = str(getattr(running, option.attr))
    fresh = load_settings(args, environ, started=True)
    applied: list[str] = []
    restart: list[str] = []
    keep: dict[str, Any] = {}
    sources = dict(fresh.sources)
    for option in OPTIONS:
        old, new = getattr(running, option.attr), getattr(fresh, option.attr)
        if old == new:
            continue
        if option.reloadable:
            applied.append(option.key)
        else:
            restart.append(option.key)
            keep[option.attr] = old
            sources[option.key] = running.sources.get(option.key, "default")
    for key in _TABLES:
        if getattr(running, key) != getattr(fresh, key):
            restart.append(key)
            keep[key] = getattr(running, key)
            sources[key] = running.sources.get(key, "default")
    settings = replace(fresh, **keep, sources=sources)
    return SettingsReload(settings, tuple(applied), tuple(restart), fresh)


# -- printing ----------------------------------------------------------------------------


def _toml_value(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, tuple) and len(value) == 2 and isinstance(value[1], int):
        host = f"[{value[0]}]" if ":" in value[0] else value[0]
        return f'"{host}:{value[1]}"'
    if isinstance(value, tuple):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    return f'"{_toml_escaped(str(value))}"'


#: Characters a TOML basic string (or a comment) must not hold raw, with their escapes:
#: the C0 controls and DEL (TOML), and the C1 controls, which a terminal acts on (CSI).
_TOML_ESCAPES = {
    **{chr(c): f"\\u{c:04x}" for c in (*range(0x20), *range(0x7F, 0xA0))},
    "\b": "\\b",
    "\t": "\\t",
    "\n": "\\n",
    "\f": "\\f",
    "\r": "\\r",
    '"': '\\"',
    "\\": "\\\\",
}
_TOML_ESCAPE_TABLE = str.maketrans(_TOML_ESCAPES)


def _toml_escaped(text: str) -> str:
    """``text`` as the inside of a TOML basic string: quotes, backslashes and controls
    escaped (a path may hold a newline, which ended the string, or an ESC)."""
    return text.translate(_TOML_ESCAPE_TABLE)


def format_settings(
    settings: Settings,
    resolved: Mapping[str, str] | None = None,
    looked_for: Path | None = None,
) -> str:
    """The effective settings as TOML, each line commented with its source.

    Args:
        settings: The settings.
        resolved: Values shown for unset keys that the daemon fills in at start
            (the default socket, home and cache folder), by key.
        looked_for: Where a config file was looked for, when none was found.

    Returns:
        Text that is itself a valid ``toolsetd.toml``; unset keys are commented out.
    """
    resolved = resolved or {}
    where = _toml_escaped(str(settings.config_path)) if settings.config_path else "none"
    if settings.config_path is None and looked_for is not None:
        where = f"none ({_toml_escaped(str(looked_for))} does not exist)"
    lines = [f"# config file: {where}"]
    width = max(len(o.key) for o in OPTIONS)
    for option in OPTIONS:
        value = settings.value(option.key)
        source = _toml_escaped(settings.sources.get(option.key, "default"))  # a file's path
        reload_note = "" if option.reloadable else ", restart to change"
        if value is None:
            shown = resolved.get(option.key)
            text = f"# {option.key} = {_toml_value(shown)}" if shown else f"# {option.key} ="
            lines.append(f"{text:<{width + 40}} # {source}{reload_note}")
            continue
        text = f"{option.key} = {_toml_value(value)}"
        lines.append(f"{text:<{width + 40}} # {source}{reload_note}")
    for key in _TABLES:  # tables are shown by where they came from, not spelled out
        text = f"# [{key}] (see the file)" if key in settings.sources else f"# [{key}] ="
        source = _toml_escaped(settings.sources.get(key, "default"))
        lines.append(f"{text:<{width + 40}} # {source}, restart to change")
    return "\n".join(lines) + "\n"


def settings_fields() -> tuple[str, ...]:
    """The ``Settings`` fields that hold values (for tests that check the table)."""
    skip = {"sources", "config_path", *_TABLES}
    return tuple(f.name for f in fields(Settings) if f.name not in skip)


def parse_command_line(argv: Sequence[str] | None, version: str) -> argparse.Namespace:
    """Parse ``toolsetd``'s flags (exits with status 2 on a usage error).

    A relative path (``--config t.toml``, ``--home ../home``) is made absolute here, once,
    against the working directory of the start: a reload merges these flags again, and
    resolved then it named whatever the directory had become, or raised FileNotFoundError
    (``os.getcwd``) once it was removed, which ended the daemon on SIGHUP.
    """
    parser = build_parser(version)
    args = parser.parse_args(argv)
    for name in ("config", *(o.attr for o in OPTIONS if o.kind == "path")):
        value = getattr(args, name, None)
        if value:  # "" is left for _check_value to refuse
            try:
                setattr(args, name, os.path.abspath(os.path.expanduser(value)))
            except OSError:  # relative, and the working directory is gone
                flag = "--" + name.replace("_", "-")
                parser.error(
                    f"{flag} {value} is relative and the working directory was removed: "
                    "give an absolute path, or start toolsetd in an existing directory"
                )
    return args
