"""``python -m toolsetd.client`` and the ``toolsetctl`` entry point."""

from __future__ import annotations

import signal
import sys

TYPE_CHECKING = False  # not typing's: importing typing is a share of the start-up
if TYPE_CHECKING:
    from collections.abc import Callable


def main() -> None:
    """Run ``toolsetctl`` with ``sys.argv`` and exit with its code.

    ``toolsetctl mcp`` goes to the stdlib-only pump before anything else is imported: MCP
    hosts start it once per session and wait for its first answer. Every other command
    handles SIGTERM and SIGHUP as Ctrl-C (``termination``), then ends by the signal.
    """
    # Ctrl-C while the command's modules load (a CI job cancelled as it starts): before any
    # handler of ours, it was Python's traceback and a death by SIGINT. Nothing was asked
    # yet: exit 130, as for a Ctrl-C, with nothing to say. The signal is only noted while
    # they load, never raised there: a KeyboardInterrupt raised inside the import system's
    # own callbacks (a module lock's weakref) is printed as "Exception ignored" with a
    # traceback, and lost, so the command ran on as if no Ctrl-C had come. (Before this
    # function runs, the interpreter's own start and its import of this module are
    # Python's: a Ctrl-C there is its traceback.)
    interrupted: list[int] = []
    try:
        noted = signal.getsignal(signal.SIGINT) is signal.default_int_handler
        if noted:  # not when it was started with SIGINT ignored: that is kept
            signal.signal(signal.SIGINT, lambda signum, frame: interrupted.append(signum))
        command = _loaded()
        if noted:
            signal.signal(signal.SIGINT, signal.default_int_handler)
    except KeyboardInterrupt:  # before the note was set up
        interrupted.append(signal.SIGINT)
    if interrupted:
        from .exits import EXIT_INTERRUPTED  # here: the pump's start imports no more

        sys.exit(EXIT_INTERRUPTED)
    sys.exit(command())


def _loaded() -> Callable[[], int]:
    """The command to run, its modules imported."""
    from .command import command_in, open_standard_streams, utf8_output, waiting_output

    open_standard_streams()
    if command_in(sys.argv[1:]) == "mcp":
        from .mcp import main as mcp_main

        return lambda: mcp_main(sys.argv[1:])
    from .cli import run
    from .termination import Termination

    def command() -> int:
        waiting_output()
        utf8_output()
        # A SIGTERM or SIGHUP caught, even once run has returned, ends the process by that
        # signal once run's outcome is printed; a Ctrl-C once it has returned is exit 130.
        return Termination().run(run)

    return command


if __name__ == "__main__":
    main()
