"""The rule a socket folder must meet before the daemon serves in it or a client connects.

Pure: it judges what ``lstat`` and ``stat`` said of the folder; the daemon
(``daemon.sockpath``) and the clients (``client.mcp``) do the I/O and word the refusal,
so that a client never refuses a folder the daemon would serve from, nor the reverse.
"""

from __future__ import annotations

import stat

__all__ = ["folder_fault"]


def folder_fault(
    link_mode: int, link_uid: int, mode: int, uid: int, euid: int
) -> tuple[str, int] | None:
    """What is wrong with a socket folder, or None when it is safe.

    Safe means a directory owned by us, writable by nobody else, reached through a symlink
    only if we or root own the link: anything else someone else could have planted or may
    tamper with, to capture the socket and every request sent to it.

    Args:
        link_mode, link_uid: ``lstat`` of the folder's path.
        mode, uid: ``stat`` of it (where a link leads).
        euid: Our effective uid.

    Returns:
        ``("link", owner)``, ``("not_directory", 0)``, ``("owner", owner)`` or
        ``("writable", permission bits)``; None when safe.
    """
    if stat.S_ISLNK(link_mode) and link_uid not in (euid, 0):
        return "link", link_uid
    if not stat.S_ISDIR(mode):
        return "not_directory", 0
    if uid != euid:
        return "owner", uid
    if mode & (stat.S_IWGRP | stat.S_IWOTH):
        return "writable", stat.S_IMODE(mode)
    return None
