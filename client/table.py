"""Laying out tables and fields for people: fitted to a width, cells folded in place.

``table_lines`` puts headers over a rule and the rows below, two spaces between columns;
when a width is given and the natural table is wider, the foldable columns share what is
left and their cells wrap inside the column (breaking after ``, `` or ``/``).
``fields_lines`` is the ``Label  value`` form with values wrapped under themselves.
``output_width`` says how wide stdout is; ``short_path`` shortens a path for people.
Nothing here imports rich: ``toolsetctl`` pays for its output at every start.
"""

from __future__ import annotations

import os
import re
import textwrap
from collections.abc import Mapping, Sequence

from toolsetd.protocol.printable import BIDI_AND_BREAKS, escaped, printable

TYPE_CHECKING = False  # not typing's: importing typing is a share of the start-up
if TYPE_CHECKING:
    from typing import TextIO

__all__ = [
    "cells",
    "chunks",
    "fields_lines",
    "fits",
    "fitted_widths",
    "output_width",
    "printable",
    "short_path",
    "table_lines",
    "terminal_text",
]

# ``printable`` (protocol/printable.py) escapes what a terminal would act on. The same, for
# multi-line text shown as it is (a tool's output): line feeds, tabs and the CR of a CRLF
# pair stay, and so do colours (SGR: ESC [ digits and separators m), which a terminal only
# paints with: a linter's red stays red.
_SGR = "\x1b\\[[0-9;:]{0,64}m"
_UNSAFE_IN_TEXT = re.compile(
    f"({_SGR})|\r(?!\n)|[\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x9f{BIDI_AND_BREAKS}]"
)


#: Back to the terminal's default colours and attributes.
_SGR_RESET = "\x1b[0m"


#: The general categories a terminal draws in no cell of their own: nonspacing and
#: enclosing marks (an accent, a Thai or Devanagari vowel sign, an emoji's variation
#: selector) and format characters (a zero-width joiner or space). ``unicodedata.combining``
#: is not that test: it is the canonical combining class, 0 for most such marks (Thai
#: U+0E34, U+FE0F), which then counted one cell each and pushed a table's columns apart.
_NO_CELL = ("Mn", "Me", "Cf")


def _cell_widths(text: str) -> list[int]:
    import unicodedata  # only for text that is not ASCII

    return [
        0
        if unicodedata.category(c) in _NO_CELL and c != "\xad"  # a soft hyphen is drawn
        else 2
        if unicodedata.east_asian_width(c) in "WF"
        else 1
        for c in text
    ]


def cells(text: str) -> int:
    """How many terminal cells ``text`` takes: a wide or full-width character (CJK, most
    emoji) two, a nonspacing or enclosing mark and a format character none, any other
    one."""
    return len(text) if text.isascii() else sum(_cell_widths(text))


def chunks(text: str, width: int) -> list[str]:
    """``text`` cut into pieces of at most ``width`` cells (at least one character each)."""
    if text.isascii():
        return [text[i : i + width] for i in range(0, len(text), max(width, 1))] or [""]
    out: list[str] = []
    start = used = 0
    for index, size in enumerate(_cell_widths(text)):
        if used + size > width and index > start:
            out.append(text[start:index])
            start, used = index, 0
        used += size
    out.append(text[start:])
    return out


def _pad(text: str, width: int) -> str:
    """``text`` followed by the spaces that make it ``width`` cells wide."""
    return text + " " * (width - cells(text))


def terminal_text(text: str) -> str:
    """Multi-line text for a terminal: as ``printable``, but line feeds, tabs, CRLF and
    colours (SGR sequences) stay; when any colour passed, a reset follows the text, so
    what the tool left on (red, or concealed text) does not carry over into what is
    printed next, the shell's prompt included."""
    painted = False

    def escaped_but_colour(match: re.Match[str]) -> str:
        nonlocal painted
        if match.group(1):
            painted = True
            return match.group()
        return escaped(match)

    shown = _UNSAFE_IN_TEXT.sub(escaped_but_colour, text)
    return shown + _SGR_RESET if painted else shown


def _isatty(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False


def output_width(stream: TextIO, env: Mapping[str, str] | None = None) -> int | None:
    """The width a table on ``stream`` must fit: ``$COLUMNS`` (a positive number in ASCII
    digits), else the terminal's, else None.

    Args:
        stream: Where the table goes.
        env: The environment (``os.environ`` when None).

    Returns:
        Columns, or None (no limit) when ``stream`` is not a terminal and ``COLUMNS`` is unset.
    """
    env = os.environ if env is None else env
    columns = env.get("COLUMNS", "")
    # ASCII digits, at most nine of them: str.isdigit() also says yes to "²", which int()
    # refuses, and int() refuses more than 4300 digits. Any other value is ignored.
    if columns.isascii() and columns.isdigit() and len(columns.lstrip("0")) in range(1, 10):
        return int(columns)
    if not _isatty(stream):
        return None
    try:
        return os.get_terminal_size(stream.fileno()).columns or None
    except (AttributeError, ValueError, OSError):
        return None


def _wrap(cell: str, width: int) -> list[str]:
    """Fold one cell into lines of at most ``width``, breaking after ``, `` or ``/``."""
    if cells(cell) <= width:
        return [cell]
    pieces = re.findall(r"[^/ ]*(?:/|, | |$)", cell)
    lines: list[str] = []
    current = ""
    for piece in pieces:
        if not piece:
            continue
        if current and cells(current) + cells(piece.rstrip()) > width:
            lines.append(current.rstrip())
            current = ""
        if cells(piece) > width:  # one piece longer than the column: cut it
            *full, current = chunks(current + piece, width)
            lines.extend(full)
            continue
        current += piece
    if current.strip():
        lines.append(current.rstrip())
    return lines or [""]


def fits(headers: Sequence[str], rows: Sequence[Sequence[str]], width: int | None) -> bool:
    """Whether the table at its natural width fits ``width`` (None: no limit)."""
    natural = _natural(headers, rows)
    return width is None or sum(natural) + 2 * (len(natural) - 1) <= width


def _natural(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> list[int]:
    widths = [cells(header) for header in headers]
    for row in rows:
        for index, cell in enumerate(row):
            widths[index] = max(widths[index], cells(cell))
    return widths


def fitted_widths(
    headers: Sequence[str],
    rows: Sequence[Sequence[str]],
    width: int | None,
    foldable: Sequence[int],
) -> list[int] | None:
    """Column widths that fit ``width`` by folding ``foldable`` columns; None if impossible."""
    natural = _natural(headers, rows)
    if width is None or sum(natural) + 2 * (len(natural) - 1) <= width:
        return natural
    fixed = sum(w for i, w in enumerate(natural) if i not in foldable) + 2 * (len(natural) - 1)
    room = width - fixed
    floors = {i: min(natural[i], max(len(headers[i]), 12)) for i in foldable}
    if not foldable or room < sum(floors.values()):
        return None
    widths = list(natural)
    # Share the room out: each foldable column gets what it needs up to an equal share,
    # and what a narrow one leaves goes to the others.
    left = sorted(foldable, key=lambda i: natural[i])
    while left:
        share = room // len(left)
        index = left.pop(0)
        widths[index] = max(floors[index], min(natural[index], share))
        room -= widths[index]
    return widths


def table_lines(
    headers: Sequence[str],
    rows: Sequence[Sequence[str]],
    width: int | None = None,
    foldable: Sequence[int] = (),
) -> list[str]:
    """Lay a table out: headers, a rule, then the rows, two spaces between columns.

    Args:
        headers: The column headers.
        rows: The rows, each as long as ``headers``.
        width: The width to fit, or None for no limit.
        foldable: The columns whose cells may wrap (the last one when empty).

    Returns:
        The lines, trailing spaces stripped. When even folding cannot fit ``width`` the
        table is laid out at its natural width.
    """
    foldable = tuple(foldable) or (len(headers) - 1,)
    widths = fitted_widths(headers, rows, width, foldable) or _natural(headers, rows)
    out = ["  ".join(_pad(h, w) for h, w in zip(headers, widths, strict=True)).rstrip()]
    out.append("  ".join("─" * w for w in widths))
    for row in rows:
        cells = [_wrap(cell, w) for cell, w in zip(row, widths, strict=True)]
        for depth in range(max(len(lines) for lines in cells)):
            line = "  ".join(
                _pad(lines[depth] if depth < len(lines) else "", w)
                for lines, w in zip(cells, widths, strict=True)
            )
            out.append(line.rstrip())
    return out


def short_path(path: str, workspace: str | None, user_home: str | None) -> str:
    """Shorten a path for people: relative to the workspace, else ``~/``, else as it is.

    Args:
        path: An absolute path.
        workspace: The workspace root, or None.
        user_home: The user's home directory (``~``), or None.
    """
    for root, prefix in ((workspace, ""), (user_home, "~/")):
        if root and root != "/" and path.startswith(root.rstrip("/") + "/"):
            return prefix + path[len(root.rstrip("/")) + 1 :]
    return path


def fields_lines(fields: Sequence[tuple[str, str]], width: int | None) -> list[str]:
    """``Label  value`` lines, the values wrapped under themselves to fit ``width``."""
    label_width = max((len(label) for label, _ in fields), default=0)
    room = None if width is None else max(width - label_width - 2, 20)
    out = []
    for label, value in fields:
        if room is None or cells(value) <= room:
            lines = [value]
        elif value.isascii():
            lines = textwrap.wrap(value, room, break_on_hyphens=False) or [""]
        else:  # textwrap counts characters, not the cells they take
            lines = _wrap(value, room)
        out.append(f"{label.ljust(label_width)}  {lines[0]}".rstrip())
        out.extend(f"{'':{label_width}}  {line}".rstrip() for line in lines[1:])
    return out
