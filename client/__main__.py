"""``python -m toolsetd.client`` and the ``toolsetctl`` entry point."""

from __future__ import annotations

import sys

#: Global options that take a value (so their value is not taken for the command).
_VALUED = frozenset({"--socket", "--workspace", "--home", "--format"})


def _command(argv: list[str]) -> str | None:
    """The subcommand named in ``argv``: the first word that is not an option or its value."""
    skip = False
    for arg in argv:
        if skip:
            skip = False
        elif arg in _VALUED:
            skip = True
        elif not arg.startswith("-"):
            return arg
    return None


def main() -> None:
    """Run ``toolsetctl`` with ``sys.argv`` and exit with its code.

    ``toolsetctl mcp`` goes to the stdlib-only pump before anything else is imported: MCP
    hosts start it once per session and wait for its first answer.
    """
    if _command(sys.argv[1:]) == "mcp":
        from .mcp import main as mcp_main

        sys.exit(mcp_main(sys.argv[1:]))
    from .cli import run

    sys.exit(run())


if __name__ == "__main__":
    main()
