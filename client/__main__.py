"""``python -m toolsetd.client`` and the ``toolsetctl`` entry point."""

from __future__ import annotations

import sys

from .command import command_in, open_standard_streams, utf8_output, waiting_output


def main() -> None:
    """Run ``toolsetctl`` with ``sys.argv`` and exit with its code.

    ``toolsetctl mcp`` goes to the stdlib-only pump before anything else is imported: MCP
    hosts start it once per session and wait for its first answer. Every other command
    handles SIGTERM and SIGHUP as Ctrl-C (``termination``), then ends by the signal.
    """
    open_standard_streams()
    if command_in(sys.argv[1:]) == "mcp":
        from .mcp import main as mcp_main

        sys.exit(mcp_main(sys.argv[1:]))
    from .cli import run
    from .termination import Termination

    waiting_output()
    utf8_output()
    # A SIGTERM or SIGHUP caught, even once run has returned, ends the process by that
    # signal once run's outcome is printed; a Ctrl-C once it has returned is exit 130.
    sys.exit(Termination().run(run))


if __name__ == "__main__":
    main()
