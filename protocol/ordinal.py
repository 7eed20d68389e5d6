"""The reference host's order of names: .NET's ``StringComparer.Ordinal``.

The reference host sorts set folders, and the inventory's rows, by ordinal comparison:
UTF-16 code units, of the name as .NET reads it (a file name's bytes that are not UTF-8
each U+FFFD). Python's own order of ``str`` is by code point, the same for every name
that is ASCII; for others a character past U+FFFF sorts below U+E000 to U+FFFF in
UTF-16, and a stray byte, kept as a lone surrogate (``surrogateescape``), sorts as the
U+FFFD the wire shows. The daemon's scan and listing and the CLI's rows (from a daemon
or from the files) sort with this, so they agree.
"""

from __future__ import annotations

TYPE_CHECKING = False  # not typing's: ``toolsetctl list`` imports this (``client/render.py``)
if TYPE_CHECKING:
    from collections.abc import Callable
    from typing import TypeVar

    _Sorted = TypeVar("_Sorted")

__all__ = ["ordinal_key", "sort_by_directory"]


def ordinal_key(name: str) -> str:
    """A name's place in .NET's ordinal order, as a ``str`` that sorts by it.

    Args:
        name: A folder's name as ``os`` gives it (undecodable bytes as lone surrogates).

    Returns:
        Its UTF-16 code units as read by .NET, each byte of them one character.
    """
    shown = name.encode("utf-8", "surrogateescape").decode("utf-8", "replace")
    return shown.encode("utf-16-be").decode("latin-1")


def sort_by_directory(items: list[_Sorted], key: Callable[[_Sorted], tuple[str, str]]) -> None:
    """Sort ``items`` in place by ``key``'s (directory name, source), the name in .NET's
    ordinal order (``ordinal_key``), which is Python's when every name is ASCII.

    Args:
        items: The rows or entries to sort.
        key: Each one's directory name and source (``home`` before ``project``).
    """
    items.sort(key=key)
    if not "".join(key(item)[0] for item in items).isascii():
        items.sort(key=lambda item: (ordinal_key(key(item)[0]), key(item)[1]))
