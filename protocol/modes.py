"""The approval modes of the reference host, and how their names are read.

Pure and small (no pydantic): the daemon's policy and its params checks (``params``) import
it at every start; ``models`` re-exports it for the wire models.
"""

from __future__ import annotations

import enum
from types import MappingProxyType
from typing import Final

from .whitespace import NET_WHITESPACE

__all__ = ["MODE_EXPECTED", "NET_WHITESPACE", "Mode", "parse_mode"]


class Mode(enum.StrEnum):
    """The six approval modes of the reference host."""

    PLAN = "plan"
    DEFAULT = "default"
    EDIT = "edit"
    REVIEW = "review"
    AUDIT = "audit"
    FULL = "full"


_MODE_ALIASES: Final = MappingProxyType(
    {
        "autoedit": Mode.EDIT,
        "fullreview": Mode.AUDIT,
        "full-review": Mode.AUDIT,
        "fullauto": Mode.FULL,
        "yolo": Mode.FULL,
    }
)
MODE_EXPECTED: Final = (
    f"must be one of {', '.join(Mode)} "
    f"or an alias ({', '.join(f'{a} for {m}' for a, m in _MODE_ALIASES.items())})"
)


def parse_mode(name: str) -> Mode:
    """Parse an approval mode name the way the reference host does.

    Args:
        name: A mode or alias, compared case-insensitively after trimming the white space
            .NET's ``Trim()`` trims (``NET_WHITESPACE``: not U+001C..U+001F, which
            Python's ``strip()`` would take too, so ``"full\\x1c"`` is no mode).

    Returns:
        The mode.

    Raises:
        ValueError: Not a mode or alias (``auto`` included); the message lists the valid
            names and aliases and never repeats the input.
    """
    if isinstance(name, Mode):
        return name
    if not isinstance(name, str):
        raise ValueError(f"invalid mode: {MODE_EXPECTED}")
    key = name.strip(NET_WHITESPACE).lower()
    try:
        return Mode(key)
    except ValueError:
        pass
    mode = _MODE_ALIASES.get(key)
    if mode is None:
        raise ValueError(f"invalid mode: {MODE_EXPECTED}")
    return mode
