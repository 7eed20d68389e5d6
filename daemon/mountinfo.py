"""``/proc/<pid>/mountinfo``, parsed: the one reader of its lines for the cgroup probe and
the sandbox's bind check.

Pure text work: the caller reads the file (as the file system's bytes, ``os.fsdecode``).
A line is split at ``"\\n"`` and its fields at ``" "`` alone: ``splitlines`` and ``split()``
also split at U+2028, U+0085 and ``\\x1c``-``\\x1f``, which a path may hold, since the
kernel escapes only space, tab, newline and backslash (as three octal digits, ``\\040``).
"""

from __future__ import annotations

import re

__all__ = ["Mount", "parse_mountinfo"]

_ESCAPE = re.compile(r"\\([0-7]{3})")

#: One mount: ``major:minor``, its root and mount point (unescaped), its mount options
#: (``rw,nosuid,...``) and its file-system type (``cgroup2``, ``tmpfs``, ...).
Mount = tuple[str, str, str, str, str]


def _unescape(field: str) -> str:
    return _ESCAPE.sub(lambda m: chr(int(m.group(1), 8)), field) if "\\" in field else field


def parse_mountinfo(text: str) -> list[Mount]:
    """Each mount of a ``mountinfo`` text, in the order listed (the last at a point is on top)."""
    mounts = []
    for line in text.split("\n"):
        left, _, right = line.partition(" - ")
        fields = left.split(" ")
        if len(fields) >= 6:
            kind = right.split(" ", 1)[0]
            mounts.append((fields[2], _unescape(fields[3]), _unescape(fields[4]), fields[5], kind))
    return mounts
