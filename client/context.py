"""What every ``toolsetctl`` command needs: the context, the daemon, the arguments.

``Context`` holds the output, the socket, the workspace and the homes. ``connect``,
``call`` and ``request`` reach the daemon over ``BlockingClient`` and turn every daemon
or transport failure into a ``Failure`` with its exit code. ``read_arguments`` reads
``--args`` and keeps its text, which goes on the wire as written (``RawJson``), so
numbers keep their spelling.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path

from toolsetd.protocol.errors import RpcError, reject_json_constant

from .blocking import BlockingClient, RawJson, json_number
from .command import wait_ready, wire_text
from .errors import ConnectError, ConnectionClosed, RequestTimeout
from .exits import CLI_ERROR_CODES, EXIT_UNREACHABLE, Failure, rpc_failure
from .mcp import CONNECT_TIMEOUT
from .render import Output
from .results import result_problem

TYPE_CHECKING = False  # not typing's: importing typing is a share of the start-up
if TYPE_CHECKING:
    import argparse
    from typing import Any, TextIO

__all__ = [
    "Context",
    "UsageError",
    "call",
    "call_params",
    "check_result",
    "connect",
    "lost",
    "parse_arguments",
    "read_arguments",
    "request",
    "wire_text",
]

#: Seconds allowed for the daemon's answer to any request but ``invoke`` (whose tool may
#: run as long as its set allows): a daemon that accepted the connection but is stopped
#: or stuck fails the command (exit 5) instead of hanging a CI job until its own limit.
#: Generous: a healthy daemon answers nothing until its first catalog is built, and with
#: tens of thousands of sets and no set cache that took half a minute on a CI-sized machine
#: (a review measured 28 s for 10,000 sets with schemas off the fast path).
REQUEST_TIMEOUT = 300.0
#: The longest ``--args`` text read: ``@/dev/zero`` or an endless stdin stops here instead
#: of filling the memory. Not the daemon's line limit: that is 16 MiB by default but the
#: operator's to raise (``--max-message-bytes``), and the daemon refuses what is over its
#: own (-32007, exit 2). This is the longest line toolsetctl reads (``MAX_LINE_BYTES``).
MAX_ARGS_BYTES = 64 * 1024 * 1024


class UsageError(Exception):
    """A usage problem found after parsing (bad ``--args``); printed, exit 2."""


def read_arguments(spec: str | None, stdin: TextIO) -> tuple[dict[str, Any], str]:
    """Read ``--args``: the argument object and its JSON text as written."""
    if spec is None:
        return {}, "{}"
    if spec == "-":
        where = "--args from stdin"
        raw = getattr(stdin, "buffer", None)  # bytes: the locale's decoder may be strict
        if raw is None:
            text = stdin.read(MAX_ARGS_BYTES + 1)
        else:
            data = _read_stdin(raw, MAX_ARGS_BYTES + 1)
            _check_size(len(data), where)
            try:
                text = data.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise UsageError(f"{where} is not valid UTF-8 (at byte {exc.start}).") from None
    elif spec.startswith("@"):
        name = spec[1:]
        where = f"--args file {name}"
        try:
            with open(name, "rb") as file:
                data = file.read(MAX_ARGS_BYTES + 1)
            _check_size(len(data), where)
            text = data.decode("utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
            raise UsageError(f"Cannot read the --args file {name}: {reason}.") from exc
    else:
        text, where = wire_text(spec), "--args"
    # A leading byte order mark (an editor's, or PowerShell 5's Out-File) is no JSON text
    # but says UTF-8; dropped, as the daemon drops it from manifests and its config file.
    text = text.removeprefix("\ufeff")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:  # undecodable bytes, kept by surrogateescape
        raise UsageError(f"{where} is not valid UTF-8 (at character {exc.start}).") from None
    _check_size(len(text), where)
    if not text.strip(" \t\n\r"):  # JSON's whitespace: nothing piped in, an unset $ARGS
        raise UsageError(f"{where} is empty: give the argument object as JSON ('{{}}' for none).")
    try:
        value = json.loads(text, parse_constant=reject_json_constant, parse_float=json_number)
    except ValueError as exc:
        raise UsageError(f"{where} is not valid JSON: {exc}{_file_hint(spec)}") from exc
    except RecursionError:  # the stdlib decoder recurses once per level
        raise UsageError(f"{where} is nested too deeply to be read.") from None
    if not isinstance(value, dict):
        raise UsageError(f"{where} must be a JSON object.")
    try:
        # Half a surrogate pair can only come from a \u escape (the text itself encoded
        # above); without one, no dump, which writes out every integer in full, slowly for
        # a long one under PYTHONINTMAXSTRDIGITS=0.
        if "\\u" in text:
            json.dumps(value, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        raise UsageError(
            f"{where} has a \\u escape of half a surrogate pair (\\ud800 to \\udfff "
            "without its other half), which is no character: the daemon refuses it."
        ) from None
    return value, text


def _file_hint(spec: str) -> str:
    """When inline ``--args`` text that is no JSON names a file: the way to read it.

    ``--args args.json`` (for ``--args @args.json``) was "not valid JSON: Expecting value:
    line 1 column 1", about a file the author knew was valid.
    """
    try:
        named = not spec.startswith(("@", "-", "{")) and os.path.isfile(spec)
    except (OSError, ValueError):
        named = False
    if not named:
        return ""
    return f" ({spec} is a file: give --args @{spec} to read the arguments from it)"


def _read_stdin(raw: Any, limit: int) -> bytes:
    """Read stdin's bytes to its end (at most ``limit``).

    A non-blocking stdin (a CI runner's pipe) gives what is there, or None when nothing is
    yet: read on, waiting for more, until its end. A blocking one is read in one call (a
    second would wait for a second Ctrl-D on a terminal).
    """
    try:
        blocking = os.get_blocking(raw.fileno())
    except (AttributeError, OSError, ValueError):
        blocking = True  # not a descriptor (a test's stream)
    if blocking:
        data: bytes = raw.read(limit)
        return data
    chunks: list[bytes] = []
    size = 0
    while size < limit:
        chunk = raw.read(limit - size)
        if chunk is None:  # nothing yet
            wait_ready(raw.fileno(), write=False)
            continue
        if not chunk:
            break
        chunks.append(chunk)
        size += len(chunk)
    return b"".join(chunks)


def _check_size(size: int, where: str) -> None:
    if size > MAX_ARGS_BYTES:
        raise UsageError(
            f"{where} is larger than {MAX_ARGS_BYTES} bytes, the most toolsetctl sends in one "
            "request."
        )


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
    return read_arguments(spec, stdin)[0]


class Context:
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

    @property
    def wire_workspace(self) -> str:
        """The workspace as the daemon must get it (``wire_text``)."""
        return wire_text(str(self.workspace))

    def emit(self, value: Any) -> None:
        """Print a result document (``jsonl`` wraps it as ``{"result": ...}``)."""
        self.out.json({"result": value} if self.out.format == "jsonl" else value)


def connect(ctx: Context) -> BlockingClient:
    """Connect to the daemon at ``ctx.socket``; unreachable is a ``Failure`` (exit 5)."""
    try:
        return BlockingClient.connect(ctx.socket, timeout=CONNECT_TIMEOUT)
    except ConnectError as exc:
        raise Failure(
            EXIT_UNREACHABLE, CLI_ERROR_CODES["unreachable"], str(exc), {"socket": ctx.socket}
        ) from exc


def lost(ctx: Context, exc: ConnectionClosed | RequestTimeout) -> Failure:
    """The failure of a connection that ended, or went silent, before its answer came (exit 5)."""
    reason = getattr(exc, "reason", "timeout")
    message = f"Lost the connection to toolsetd at {ctx.socket}: {exc}"
    if isinstance(exc, RequestTimeout):
        message = (
            f"toolsetd at {ctx.socket} accepted the connection but did not answer: {exc} "
            "A daemon that has just started answers once its first catalog is built; see "
            "its log (journalctl -u toolsetd) for what it is doing."
        )
    return Failure(
        EXIT_UNREACHABLE,
        CLI_ERROR_CODES["connection_lost"],
        message,
        {"socket": ctx.socket, "reason": reason},
    )


def call(ctx: Context, client: BlockingClient, method: str, params: Any = None) -> Any:
    """One request on ``client``; every daemon or transport failure becomes a ``Failure``.

    Every method toolsetctl calls answers an object: any other result, or one whose members
    have the wrong type (a daemon of another protocol or version), breaks the protocol, as
    for ``invoke`` (exit 5), not a traceback.
    """
    try:
        result = client.wait(client.send(method, params), timeout=REQUEST_TIMEOUT)
    except RpcError as exc:
        raise rpc_failure(exc) from exc
    except (ConnectionClosed, RequestTimeout) as exc:
        raise lost(ctx, exc) from exc
    check_result(ctx, method, result)
    return result


def check_result(ctx: Context, method: str, result: Any) -> None:
    """Refuse a result that is not an object, or whose members toolsetctl reads have the
    wrong type (``toolsetd.client.results``): the protocol is broken (exit 5)."""
    problem = (
        "that is not an object"
        if not isinstance(result, dict)
        else _whose(result_problem(method, result))
    )
    if problem:
        article = "an" if method[:1] in ("a", "e", "i", "o", "u") else "a"
        invalid = f"toolsetd sent {article} {method} result {problem}."
        raise lost(ctx, ConnectionClosed(invalid, "protocol"))


def _whose(problem: str | None) -> str:
    return "" if problem is None else f"whose {problem}"


def request(ctx: Context, method: str, params: Any = None) -> Any:
    """One request on a connection of its own (see ``call``)."""
    with connect(ctx) as client:
        return call(ctx, client, method, params)


def call_params(ctx: Context, args: argparse.Namespace, text: str) -> dict[str, Any]:
    """The params ``classify`` and ``invoke`` share: tool, arguments as written, workspace."""
    params: dict[str, Any] = {
        "tool": wire_text(args.tool),
        "arguments": RawJson(text),  # sent as written: numbers keep their spelling
        "workspace": ctx.wire_workspace,
    }
    if args.mode is not None:
        params["mode"] = wire_text(args.mode)
    if args.headless:
        params["headless"] = True
    return params
