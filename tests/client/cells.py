"""How many terminal cells a text takes, counted by the tests independently of
``toolsetd.client.table.cells`` (which they check): a wide or full-width character two,
a mark or format character (categories Mn, Me, Cf) none, any other one."""

from __future__ import annotations

import unicodedata


def cells(text: str) -> int:
    return sum(
        0
        if unicodedata.category(c) in ("Mn", "Me", "Cf")
        else 2
        if unicodedata.east_asian_width(c) in "WF"
        else 1
        for c in text
    )
