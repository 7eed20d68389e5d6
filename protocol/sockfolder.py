"""The rule a socket folder must meet before the daemon serves in it or a client connects.

Pure: it judges what ``lstat`` and ``stat`` said of the folder; the daemon
(``daemon.sockpath``) and the clients (``client.mcp``) do the I/O and word the refusal,
so that a client never refuses a folder the daemon would serve from, nor the reverse.
"""

from __future__ import annotations

__all__ = ["folder_fault"]

# The POSIX mode bits the rule reads (``stat``'s values; this package imports no module
# that touches files, ``stat`` included).
_S_IFMT = 0o170000
_S_IFLNK = 0o120000
_S_IFDIR = 0o040000
_S_IWGRP_IWOTH = 0o022
_PERMISSIONS = 0o7777


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
    if link_mode & _S_IFMT == _S_IFLNK and link_uid not in (euid, 0):
        return "link", link_uid
    if mode & _S_IFMT != _S_IFDIR:
        return "not_directory", 0
    if uid != euid:
        return "owner", uid
    if mode & _S_IWGRP_IWOTH:
        return "writable", mode & _PERMISSIONS
    return None
