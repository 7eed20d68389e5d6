"""``toolsetctl``'s exit codes and failures: one table, one meaning per code.

The exit codes (each means one thing; ``docs/cli.md`` carries the same table):

====  =============================================================================
code  meaning
====  =============================================================================
0     success (``classify``: the decision is ``allow``)
1     the tool ran and reported an error
2     usage: bad options or ``--args``, unknown tool, arguments that fail its schema,
      a set that is not found or does not parse, ``validate`` found problems,
      ``reload`` found the daemon's config file unusable
3     the policy stops the call: denied, or approval required (``classify``: ``deny``,
      ``ask`` or ``review``)
4     the tool timed out
5     the daemon is unreachable, or the connection was lost
6     the daemon cancelled the call, or refused it because it is shutting down
7     not allowed: the daemon refuses this user (-32009)
8     the daemon is busy (-32008); try again later
9     an internal error, in the daemon or in toolsetctl
129   ended by SIGHUP, as 143 (``toolsetctl`` ends by the signal itself)
130   interrupted (Ctrl-C; ``invoke`` cancels the call in the daemon first)
141   ``invoke``: stdout was closed while the call ran (``--format jsonl | head``); the
      call was cancelled in the daemon, as a SIGPIPE would have ended toolsetctl
143   ended by SIGTERM (a CI runner stopping the job, ``timeout``; ``invoke`` cancels the
      call and prints its outcome first): ``toolsetctl`` ends by the signal itself
====  =============================================================================

With ``invoke --tool-exit-code``, a tool that ran and exited gives its own exit code (1
still when it exited 0 but its result is an error).

A ``Failure`` is how a command ends when it does not succeed: its exit code and the error
object printed for it (``code``, ``message``, ``data``, and detail lines for stderr).
``rpc_failure`` maps a daemon error to one, by its JSON-RPC code.
"""

from __future__ import annotations

from collections.abc import Mapping

from toolsetd.protocol.errors import RpcError

TYPE_CHECKING = False  # not typing's: importing typing is a share of the start-up
if TYPE_CHECKING:
    from typing import Any

__all__ = [
    "CLI_ERROR_CODES",
    "EXIT_BUSY",
    "EXIT_DAEMON_CANCELLED",
    "EXIT_DENIED",
    "EXIT_HUNG_UP",
    "EXIT_INTERNAL",
    "EXIT_INTERRUPTED",
    "EXIT_NOT_ALLOWED",
    "EXIT_OK",
    "EXIT_STDOUT_CLOSED",
    "EXIT_TERMINATED",
    "EXIT_TIMEOUT",
    "EXIT_TOOL_ERROR",
    "EXIT_UNREACHABLE",
    "EXIT_USAGE",
    "Failure",
    "rpc_failure",
    "usage",
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
EXIT_HUNG_UP = 129  # 128 + SIGHUP: what a shell reports for a process the signal ended
EXIT_TERMINATED = 143  # 128 + SIGTERM, the same
EXIT_STDOUT_CLOSED = 141  # 128 + SIGPIPE: what a shell reports for a writer whose reader left

#: ``error.code`` of the failures toolsetctl finds itself (the daemon's keep their code).
CLI_ERROR_CODES: Mapping[str, int] = {
    "usage": -32090,
    "unreachable": -32091,
    "connection_lost": -32092,
    "not_found": -32093,
    "invalid_set": -32094,
    "interrupted": -32095,
    "internal": -32096,
    "invalid_config": -32097,
}

#: The exit code of each daemon error code; any other code is an internal error (9).
_RPC_EXITS: Mapping[int, int] = {
    -32001: EXIT_USAGE,  # UnknownTool
    -32002: EXIT_USAGE,  # InvalidArguments
    -32602: EXIT_USAGE,  # InvalidParams
    -32006: EXIT_USAGE,  # InvalidWorkspace
    # MessageTooLarge: the request (--args), or the answer asked for (a list of a catalog
    # over 64 MiB): ask for less either way.
    -32007: EXIT_USAGE,
    -32003: EXIT_DENIED,  # PolicyDenied
    -32004: EXIT_DENIED,  # ApprovalRequired
    -32010: EXIT_DAEMON_CANCELLED,  # ShuttingDown
    -32009: EXIT_NOT_ALLOWED,  # PeerNotAllowed
    -32008: EXIT_BUSY,  # ServerBusy
}


class Failure(Exception):
    """A command failed: its exit code, and the error object printed for it."""

    def __init__(
        self,
        exit_code: int,
        code: int,
        message: str,
        data: Any = None,
        details: list[str] | None = None,
        said: str | None = None,
    ) -> None:
        super().__init__(message)
        self.exit_code = exit_code
        self.code = code
        self.message = message
        self.data = data
        self.details = details or []
        #: The message as the text formats print it, above ``details`` (``message``).
        self.said = message if said is None else said

    def error(self) -> dict[str, Any]:
        """The error object: ``{"code", "message", "data"}``."""
        return {"code": self.code, "message": self.message, "data": self.data}


def usage(message: str, data: Any = None) -> Failure:
    """A usage failure (exit 2) found by toolsetctl."""
    return Failure(EXIT_USAGE, CLI_ERROR_CODES["usage"], message, data)


def rpc_failure(exc: RpcError) -> Failure:
    """The failure a daemon error means: its exit code, message and detail lines."""
    data = exc.data if isinstance(exc.data, dict) else {}
    message = exc.message
    said: str | None = None  # the message
    details: list[str] = []
    if exc.code == -32002:  # InvalidArguments
        errors = data.get("errors")
        errors = errors if isinstance(errors, list) else []
        for index, item in enumerate(errors):
            # A schema error's message names its field already (it starts with the JSON
            # Pointer); the arguments object's own does not. The summary line carries the
            # first one; do not print it twice (a later one is printed whatever its words,
            # so the lines below are as many as the summary counts).
            text = str(item.get("message", "")) if isinstance(item, dict) else str(item)
            if text and not (index == 0 and text in message):
                path = item.get("path") if isinstance(item, dict) else None
                if not (path and text.startswith(f"{path}: ")):
                    text = f"{path or '(the arguments object)'}: {text}"
                details.append(f"  {text}")
        # The rest are printed below it, not "in data.errors" (the JSON document's).
        counted = f" ({len(errors) - 1} more in data.errors)"
        if details and message.endswith(counted):
            said = f"{message.removesuffix(counted)} ({len(errors) - 1} more below)"
    elif exc.code == -32004 and isinstance(data.get("reason"), str):  # ApprovalRequired
        message = (
            f"Approval required: {data['reason']} If the operator agrees, run the command "
            "again with --approve."
        )
    exit_code = _RPC_EXITS.get(exc.code, EXIT_INTERNAL)
    return Failure(exit_code, exc.code, message, exc.data, details, said)
