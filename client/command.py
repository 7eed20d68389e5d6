"""Which subcommand a ``toolsetctl`` command line names, with no imports.

``__main__`` asks this before anything else is imported (``toolsetctl mcp`` goes to the
stdlib-only pump), and ``parser`` asks it to build only the subcommand named.
"""

from __future__ import annotations

__all__ = ["command_in"]

#: Global options that take a value (so their value is not taken for the command).
_TAKES_VALUE = frozenset({"--socket", "--format", "--workspace", "--home"})


def command_in(argv: list[str]) -> str | None:
    """The subcommand ``argv`` names (the first word that is not an option or its value)."""
    skip = False
    for arg in argv:
        if skip:
            skip = False
        elif arg in _TAKES_VALUE:
            skip = True
        elif arg == "--" or not arg.startswith("-"):
            return arg
    return None
