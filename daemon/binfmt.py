"""Whether the kernel's binfmt_misc runs a file that is neither a script nor ELF.

Theory of operation: Linux hands a file whose first bytes are neither a ``#!`` line nor an
ELF header to each registered binfmt_misc format (``/proc/sys/fs/binfmt_misc``, one file a
format: ``enabled``, ``interpreter``, ``flags``, then ``extension .x``, or ``offset``,
``magic`` and ``mask`` in hex), and runs it with that format's interpreter when one matches
(a ``.jar`` through a Java wrapper, an ``MZ`` program through Wine or Mono, a foreign
program through qemu). Only where none does is its start "Exec format error". ``toolsetctl
validate`` asks here before it calls such a file unrunnable: a machine that runs it through
binfmt_misc runs the tool too. Nothing is written; what cannot be read counts as no format
(the verdict is then the one without binfmt_misc, as on a machine that has not mounted it).
"""

from __future__ import annotations

import os

__all__ = ["BINFMT_MISC", "runs_through_binfmt"]

#: Where the kernel's binfmt_misc is mounted (not on every machine, nor in every container).
BINFMT_MISC = "/proc/sys/fs/binfmt_misc"
#: The files of that folder that are no format.
_NOT_FORMATS = frozenset({"register", "status"})


def runs_through_binfmt(path: str, head: bytes, folder: str = BINFMT_MISC) -> bool:
    """Whether an enabled binfmt_misc format of ``folder`` matches the file ``path``, whose
    first bytes are ``head`` (the kernel reads 256), with binfmt_misc itself enabled.

    Args:
        path: The file, by its path (an extension format matches its name).
        head: Its first bytes (a magic format matches them).
        folder: Where binfmt_misc is mounted.
    """
    try:
        if _read(os.path.join(folder, "status")).strip() != "enabled":
            return False
        names = sorted(set(os.listdir(folder)) - _NOT_FORMATS)
    except OSError:
        return False
    base = os.path.basename(path)
    for name in names:
        try:
            lines = _read(os.path.join(folder, name)).splitlines()
        except OSError:
            continue
        if lines and lines[0] == "enabled" and _matches(lines[1:], base, head):
            return True
    return False


def _read(path: str) -> str:
    with open(path, encoding="utf-8", errors="replace") as entry:
        return entry.read(4096)


def _matches(lines: list[str], base: str, head: bytes) -> bool:
    """Whether a format's lines (after ``enabled``) match a file named ``base`` that starts
    with ``head``: its extension is the part of the name after the last dot (the kernel's
    ``strrchr``), its magic the bytes at ``offset``, each under the mask's bits."""
    fields: dict[str, str] = {}
    for line in lines:
        key, _, value = line.partition(" ")
        fields[key] = value
    if "extension" in fields:
        dot = base.rfind(".")
        return dot >= 0 and base[dot:] == fields["extension"]
    try:
        offset = int(fields.get("offset", "0"))
        magic = bytes.fromhex(fields["magic"])
        mask = bytes.fromhex(fields["mask"]) if "mask" in fields else b"\xff" * len(magic)
    except (KeyError, ValueError):
        return False
    found = head[offset : offset + len(magic)]
    return len(found) == len(magic) and all(
        f & m == g & m for f, g, m in zip(found, magic, mask, strict=False)
    )
