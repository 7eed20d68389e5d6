"""Where the daemon's socket is (``--socket``, else the default): one rule, for all.

Pure: it computes a path from the environment values it is given; the daemon
(``daemon.sockpath``) and the clients (``client.mcp``, which ``toolsetctl`` uses) pass
theirs, so that a client always looks for the socket where the daemon serves it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

__all__ = ["default_socket_path", "shared_tmp_folder", "socket_path"]


def shared_tmp_folder(euid: int) -> str:
    """The default socket folder in the shared ``/tmp``: ``/tmp/toolsetd-<euid>``."""
    return f"/tmp/toolsetd-{euid}"  # noqa: S108 -- the contract's default


def default_socket_path(
    environ: Mapping[str, str], euid: int, expanduser: Callable[[str], str]
) -> str:
    """Return the socket path the contract prescribes when ``--socket`` is not given.

    Args:
        environ: The environment to read.
        euid: Our effective uid.
        expanduser: Expands a leading ``~`` or ``~user`` (``os.path.expanduser``); the
            caller passes it, since it may read the user database.

    Returns:
        ``$TOOLSETD_SOCKET``, ``~`` expanded; else
        ``$XDG_RUNTIME_DIR/toolsetd/toolsetd.sock`` when that variable is an absolute path
        (the XDG spec says to ignore a relative one); else
        ``/tmp/toolsetd-<euid>/toolsetd.sock``.
    """
    explicit = environ.get("TOOLSETD_SOCKET", "")
    if explicit:
        return expanduser(explicit)
    runtime = environ.get("XDG_RUNTIME_DIR", "")
    if runtime.startswith("/"):
        return f"{runtime.rstrip('/')}/toolsetd/toolsetd.sock"
    # A per-uid folder in the shared /tmp: the daemon refuses one planted by others, and
    # the clients refuse to connect into it (``sockfolder``).
    return f"{shared_tmp_folder(euid)}/toolsetd.sock"


def socket_path(
    option: str | None,
    environ: Mapping[str, str],
    euid: int,
    expanduser: Callable[[str], str],
) -> str:
    """Return the socket a client uses: ``--socket`` when given, else the default.

    A leading ``~`` of ``--socket`` is expanded as ``$TOOLSETD_SOCKET``'s is (and as the
    daemon expands its own ``--socket``): ``--socket=~/x.sock`` is one word, which no
    shell expands, and must not name a relative ``~`` folder.

    Args:
        option: The ``--socket`` value, or None (or empty) when not given.
        environ, euid, expanduser: As for ``default_socket_path``.
    """
    if option:
        return expanduser(option)
    return default_socket_path(environ, euid, expanduser)
