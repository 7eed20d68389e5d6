"""``toolsetctl invoke``: run a tool, stream its events, map its outcome to an exit code.

The call goes out on one ``BlockingClient`` connection with a fresh call id; its events
feed the progress line (``toolsetd.client.progress``) and, in ``jsonl``, are printed as
they arrive. Ctrl-C sends ``cancel`` for the call on the same connection and waits up to
``CANCEL_GRACE`` seconds for the result (a second Ctrl-C stops waiting): exit 130. SIGTERM
and SIGHUP (``termination``) do the same, waiting ``TERMINATED_GRACE`` seconds at most, and
the process then ends by the signal (a second one is ignored). A call the daemon cancels
by itself exits 6; ``--tool-exit-code`` exits with the tool's code.

A reader that goes away (``toolsetctl --format jsonl invoke ... | head -n1``) is never a
success: while the call runs, the events stop, the call is cancelled like on Ctrl-C, and
the exit is 141 (what a shell reports for a SIGPIPE); once the result is in, its exit code
stands whether or not all of its text could be written.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping

from toolsetd.protocol.errors import RpcError

from .blocking import BlockingClient
from .context import (
    Context,
    call_params,
    check_result,
    connect,
    lost,
    read_arguments,
    wire_text,
)
from .errors import ConnectionClosed, RequestTimeout
from .exits import (
    CLI_ERROR_CODES,
    EXIT_DAEMON_CANCELLED,
    EXIT_INTERRUPTED,
    EXIT_OK,
    EXIT_STDOUT_CLOSED,
    EXIT_TIMEOUT,
    EXIT_TOOL_ERROR,
    Failure,
    rpc_failure,
    usage,
)
from .progress import Progress, progress_stream
from .render import content_lines
from .termination import Terminated, interruption

TYPE_CHECKING = False  # not typing's: importing typing is a share of the start-up
if TYPE_CHECKING:
    import argparse
    from typing import Any

__all__ = ["CANCEL_GRACE", "TERMINATED_GRACE", "cmd_invoke"]

#: Seconds to wait for the ``invoke`` response after sending ``cancel`` on Ctrl-C.
CANCEL_GRACE = 5.0
#: The same after SIGTERM or SIGHUP: a runner that sends SIGTERM kills a few seconds later
#: (GitHub Actions 2.5 s after it), and the result line should be out before then.
TERMINATED_GRACE = 2.0


def _reviews(mode: str | None) -> bool:
    """Whether ``mode`` sends calls to the reviewing model, headless too (docs/policy.md):
    there ``--approve`` is the reviewer's allow, and ``--headless`` keeps it from passing a
    call only the operator may allow (a credential path), which it would pass without it.
    A name that is no mode is left for the daemon to refuse, naming the valid ones."""
    from toolsetd.protocol.modes import Mode, parse_mode  # only with both flags

    try:
        return parse_mode(mode or "default") in (Mode.REVIEW, Mode.AUDIT)
    except ValueError:
        return True


def cmd_invoke(ctx: Context, args: argparse.Namespace) -> int:
    """Run ``toolsetctl invoke``; return the exit code (failures raise ``Failure``)."""
    if args.headless and args.approve and not _reviews(args.mode):
        raise usage(
            "--headless and --approve cannot be used together outside the review and audit "
            "modes: headless turns every 'ask' into 'deny', so the approval would never "
            "count. Drop --headless to approve the call, or --approve to run it headless.",
            {"options": ["--headless", "--approve"]},
        )
    _, text = read_arguments(args.arguments, ctx.stdin)
    call_id = os.urandom(16).hex()
    params = call_params(ctx, args, text)
    params["callId"] = call_id
    optional = {
        "approved": True if args.approve else None,
        "catalog": args.catalog,
        "session": None if args.session is None else wire_text(args.session),
    }
    params.update({key: value for key, value in optional.items() if value is not None})
    progress = Progress(
        args.tool,
        progress_stream(ctx.env, ctx.out.stdout, ctx.out.stderr, json_output=ctx.out.is_json),
    )
    streaming = ctx.out.format == "jsonl"

    def on_event(method: str, event: dict[str, Any]) -> None:
        if streaming:
            try:
                ctx.out.json({"method": method, "params": event})
            except BrokenPipeError:
                raise _StdoutClosed(method) from None
        progress.event(method, event)

    def on_event_after(method: str, event: dict[str, Any]) -> None:
        progress.event(method, event)

    interrupted: int | None = None  # Ctrl-C, SIGTERM, SIGHUP: the exit code that says which
    reason = ""
    stdout_closed = False
    ended = False  # the stream broke at 'completed': nothing of ours cancelled the call
    request_id: int | None = None
    with connect(ctx) as client:
        try:
            try:
                request_id = client.send("invoke", params)
                result = client.wait(request_id, on_event=on_event)
            except KeyboardInterrupt as exc:
                if request_id is None:
                    raise  # nothing was sent: nothing to cancel
                reason, interrupted = interruption(exc)
                progress.stop()
                ctx.out.error(f"{reason}; cancelling the call.")
                grace = TERMINATED_GRACE if isinstance(exc, Terminated) else CANCEL_GRACE
                result = _cancel(client, call_id, request_id, on_event, grace)
            except _StdoutClosed as closed:
                assert request_id is not None  # events come only after the send
                stdout_closed = True
                ctx.out.discard()
                progress.stop()
                ended = closed.method == "completed"
                if ended:  # over: only its response is to come
                    ctx.out.error("The output was closed; the call had already ended.")
                    result = _cancel(client, None, request_id, on_event_after, CANCEL_GRACE)
                else:
                    ctx.out.error("The output was closed; cancelling the call.")
                    result = _cancel(client, call_id, request_id, on_event_after, CANCEL_GRACE)
        except RpcError as exc:
            raise rpc_failure(exc) from exc
        except (ConnectionClosed, RequestTimeout) as exc:
            raise lost(ctx, exc) from exc
        finally:
            progress.stop()
    if result is not None:
        check_result(ctx, "invoke", result)
    if stdout_closed:
        # 141 says this toolsetctl cancelled the call; a call that had already ended (even
        # cancelled by the daemon, 6) keeps its own code.
        if not isinstance(result, dict) or (result.get("status") == "cancelled" and not ended):
            return EXIT_STDOUT_CLOSED
        return _exit_code(result, interrupted=None, tool_exit_code=args.tool_exit_code)
    if result is None:
        raise Failure(
            interrupted or EXIT_INTERRUPTED,
            CLI_ERROR_CODES["interrupted"],
            f"{reason or 'Interrupted'}; the call was cancelled.",
            {"callId": call_id},
        )
    return _print_result(ctx, result, interrupted=interrupted, tool_exit_code=args.tool_exit_code)


class _StdoutClosed(Exception):
    """stdout broke while the call's events were being printed (``jsonl``).

    Attributes:
        method: The event that could not be printed (``completed``: the call is over).
    """

    def __init__(self, method: str) -> None:
        super().__init__(method)
        self.method = method


def _cancel(
    client: BlockingClient,
    call_id: str | None,
    request_id: int,
    on_event: Callable[[str, dict[str, Any]], None],
    grace: float,
) -> Any:
    """After Ctrl-C (SIGTERM, SIGHUP) or a closed stdout: cancel the call (unless
    ``call_id`` is None: it is over) and wait up to ``grace`` seconds for its result; None
    if none came."""
    try:
        if call_id is not None:
            client.send("cancel", {"callId": call_id})
        return client.wait(request_id, on_event=on_event, timeout=grace)
    except KeyboardInterrupt:  # a second Ctrl-C: stop waiting at once
        return None
    except (RpcError, ConnectionClosed, RequestTimeout):
        return None


def _print_result(
    ctx: Context, result: Mapping[str, Any], *, interrupted: int | None, tool_exit_code: bool
) -> int:
    """Print a call result; return the exit code it means (also when stdout is closed)."""
    code = _exit_code(result, interrupted=interrupted, tool_exit_code=tool_exit_code)
    try:
        if ctx.out.is_json:
            ctx.emit(result)
        else:
            for text in content_lines(result.get("content") or []):
                ctx.out.tool_text(text if text.endswith("\n") else text + "\n")
        ctx.out.flush()
    except BrokenPipeError:
        ctx.out.discard()  # the reader went away; the call's outcome is still the exit code
    return code


def _exit_code(result: Mapping[str, Any], *, interrupted: int | None, tool_exit_code: bool) -> int:
    """The exit code a call result means (``interrupted``: the code of the Ctrl-C or the
    signal that had this toolsetctl cancel it)."""
    status = result.get("status")
    exit_code = result.get("exitCode")
    if status == "cancelled":
        return EXIT_DAEMON_CANCELLED if interrupted is None else interrupted
    if status == "timeout":
        return EXIT_TIMEOUT
    failed = bool(result.get("isError")) or status == "error"
    # A tool that exited 0 but whose result is still an error (content mode: stdout that is
    # not content JSON, an image that cannot be read) failed all the same: its own 0 would
    # pass a CI step that gates on it.
    if (
        tool_exit_code
        and type(exit_code) is int
        and status in ("ok", "error")
        and (exit_code & 0xFF or not failed)
    ):
        return exit_code & 0xFF
    if failed:
        return EXIT_TOOL_ERROR
    return EXIT_OK
