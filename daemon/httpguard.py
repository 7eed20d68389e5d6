"""Who may use the MCP HTTP endpoint: loopback binds, peer uid, Host/Origin, bearer token.

Theory of operation
-------------------
The HTTP endpoint admits exactly the callers the Unix socket admits. Four gates, each
with its own refusal:

1. **Loopback only.** :func:`parse_listen` accepts ``127.0.0.1:PORT`` (any ``127/8``
   address), ``[::1]:PORT`` and ``localhost:PORT``; any other address is refused at
   start-up with a sentence saying why: the uid check below only exists on loopback.
2. **Peer uid.** For every connection the kernel is asked who owns the connecting socket
   (``tcppeer``) and the Unix socket's ``PeerPolicy`` decides: the daemon's uid, root,
   ``--allow-group``. Another user gets ``403``. When the owner cannot be established,
   a bearer token (below) is the only way in.
3. **DNS rebinding.** A browser tricked into calling us sends the attacker's name as
   ``Host`` and its page as ``Origin``. ``Host`` must name a loopback host (``localhost``,
   ``127.0.0.1``, ``[::1]``, or the bound address) with the port we listen on, else
   ``421``; an ``Origin``, when present, must be ``http://`` or ``https://`` one of those
   loopback hosts, else ``403``. A ``Host`` that is no ``host[:port]`` is ``400`` (RFC 9112
   3.2).
4. **Bearer token** (optional, ``--mcp-token-file``): a file only its owner can read
   (mode 0600 or stricter, owned by the daemon's user, regular, not a link). When the
   peer's uid cannot be established, a request must carry
   ``Authorization: Bearer <token>`` (compared in constant time), else ``401``.
"""

from __future__ import annotations

import hmac
import ipaddress
import os
import re
import socket
import stat
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from .peercred import PeerCred, PeerPolicy

__all__ = [
    "ListenAddress",
    "ListenError",
    "TokenFileError",
    "check_host_origin",
    "check_token",
    "parse_listen",
    "peer_refusal",
    "port_number",
    "read_token_file",
]

_LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "[::1]"})
#: What a ``Host`` may be (RFC 9110 7.2, RFC 3986 3.2.2-3.2.3): an IP literal in brackets
#: or a reg-name (unreserved, %-escapes, sub-delims), then an optional ``:port``.
_HOST_FIELD = re.compile(
    r"(?:\[[0-9A-Za-z._~!$&'()*+,;=:%-]+\]|[0-9A-Za-z._~!$&'()*+,;=%-]*)(?::[0-9]*)?"
)


class ListenError(ValueError):
    """A ``--mcp-listen`` value that cannot be served (not loopback, bad port, ...).

    Attributes:
        reason: Why, without the value (the config file names its key and line instead).
    """

    def __init__(self, text: str, reason: str) -> None:
        super().__init__(f"--mcp-listen {text!r}: {reason}")
        self.reason = reason


class TokenFileError(ValueError):
    """A bearer-token file that is unsafe or unreadable."""


@dataclass(frozen=True, slots=True)
class ListenAddress:
    """Where to listen.

    Attributes:
        family: ``AF_INET`` or ``AF_INET6``.
        host: The literal address to bind.
        port: The port (0: the kernel picks one).
    """

    family: int
    host: str
    port: int

    def url(self, port: int | None = None) -> str:
        """The endpoint's URL for this address (with the bound port when given)."""
        host = f"[{self.host}]" if self.family == socket.AF_INET6 else self.host
        return f"http://{host}:{self.port if port is None else port}/mcp"


def port_number(text: str) -> int | None:
    """The port ``text`` names (ASCII digits, 0 to 65535), else None.

    ASCII: ``str.isdigit()`` also says yes to "²" (which ``int()`` refuses) and "٩٠".
    """
    if not text.isascii() or not text.isdigit():
        return None
    port = int(text)
    return port if port <= 65535 else None


def parse_listen(text: str) -> ListenAddress:
    """Parse a ``--mcp-listen`` value and refuse anything but loopback.

    Args:
        text: ``127.0.0.1:PORT``, ``[::1]:PORT`` or ``localhost:PORT``.

    Returns:
        The address to bind.

    Raises:
        ListenError: The value is malformed or not a loopback address, with the reason.
    """
    host, sep, port_text = text.rpartition(":")
    if not sep or not host:
        raise ListenError(text, "expected HOST:PORT, for example 127.0.0.1:8765 or [::1]:8765.")
    port = port_number(port_text)
    if port is None:
        raise ListenError(text, "the port must be a number from 0 to 65535.")
    if host == "localhost":
        return ListenAddress(socket.AF_INET, "127.0.0.1", port)
    literal = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    try:
        address = ipaddress.ip_address(literal)
    except ValueError:
        raise ListenError(
            text,
            f"{host!r} is not an IP address; give a loopback address such as 127.0.0.1 or [::1].",
        ) from None
    if isinstance(address, ipaddress.IPv6Address) and not host.startswith("["):
        raise ListenError(text, "write an IPv6 address in brackets, as [::1]:PORT.")
    if not address.is_loopback:
        raise ListenError(
            text,
            f"refusing to listen on {literal}, which is not a loopback "
            "address. toolsetd admits only its own user (and root, and --allow-group), and "
            "it can tell who is calling only on loopback; use 127.0.0.1 or [::1].",
        )
    family = socket.AF_INET6 if isinstance(address, ipaddress.IPv6Address) else socket.AF_INET
    return ListenAddress(family, str(address), port)


def read_token_file(path: Path) -> str:
    """Read a bearer token from a file only its owner can read.

    Args:
        path: The token file.

    Returns:
        The token (surrounding whitespace removed).

    Raises:
        TokenFileError: The file is missing, not a regular file, a symlink, readable or
            writable by group or others, owned by another user, or empty.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        raise TokenFileError(f"--mcp-token-file {path}: cannot open it ({exc.strerror}).") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise TokenFileError(f"--mcp-token-file {path}: not a regular file.")
        if info.st_mode & 0o077:
            raise TokenFileError(
                f"--mcp-token-file {path}: its mode is {stat.S_IMODE(info.st_mode):04o}; "
                "other users could read or change it. Make it 0600 (chmod 600)."
            )
        if info.st_uid != os.geteuid():
            raise TokenFileError(
                f"--mcp-token-file {path}: owned by uid {info.st_uid}, not by the daemon's "
                f"user (uid {os.geteuid()})."
            )
        data = os.read(fd, 4097)
    finally:
        os.close(fd)
    # Undecodable bytes stay themselves (surrogateescape), so ``check_token`` compares the
    # very bytes of the file with those of the header. Only ASCII whitespace (the line's
    # end) is trimmed: a Unicode space at an end (U+00A0) was trimmed silently, leaving a
    # token that the file's own bytes, as a client sends them, did not match; it is
    # refused below like a space anywhere else.
    token = data.decode("utf-8", errors="surrogateescape").strip(" \t\r\n\v\f")
    if not token or len(data) > 4096 or any(c.isspace() for c in token):
        raise TokenFileError(
            f"--mcp-token-file {path}: expected one token of 1 to 4096 characters without spaces."
        )
    return token


def peer_refusal(
    cred: PeerCred | None, policy: PeerPolicy, *, token: bool
) -> tuple[int, str] | None:
    """Whether a connection's peer is refused (``403``), and why.

    Args:
        cred: The peer as the kernel reported it, or None when it could not be found.
        policy: The Unix socket's peer policy.
        token: Whether a bearer token is configured (then an unknown peer may still
            come in with it, request by request).

    Returns:
        None to serve, else (status, message).
    """
    if cred is None:
        if token:
            return None
        return (
            403,
            "Forbidden: toolsetd could not establish which user owns this connection, "
            "and no bearer token is configured (--mcp-token-file).",
        )
    if policy.allows(cred):
        return None
    return (
        403,
        f"Forbidden: uid {cred.uid} may not call toolsetd; it serves only its own user "
        f"(uid {os.geteuid()}) and root, and a group allowed with --allow-group.",
    )


def _split_host(value: str) -> tuple[str, str | None]:
    """``host[:port]`` as (lower-case host, port text or None); IPv6 stays bracketed."""
    value = value.strip().lower()
    if value.startswith("["):
        end = value.find("]")
        if end < 0:
            return value, None
        host, rest = value[: end + 1], value[end + 1 :]
        return host, rest[1:] if rest.startswith(":") else None
    host, sep, port = value.partition(":")
    return host, port if sep else None


def _is_loopback_host(host: str, bound: ListenAddress) -> bool:
    if host in _LOOPBACK_NAMES:
        return True
    literal = host[1:-1] if host.startswith("[") else host
    return literal == bound.host


def check_host_origin(
    host: str | None, origin: str | None, bound: ListenAddress, port: int
) -> tuple[int, str] | None:
    """Validate ``Host`` and ``Origin`` against DNS rebinding.

    Args:
        host: The ``Host`` header (None if absent).
        origin: The ``Origin`` header (None if absent).
        bound: The address this listener is bound to.
        port: The port it actually listens on.

    Returns:
        None when both are acceptable, else (status, message).
    """
    if host is None:
        return 400, "Bad request: the Host header is required."
    if not _HOST_FIELD.fullmatch(host.strip()):
        # RFC 9112 3.2: a Host with an invalid field value MUST be 400 (two hosts on one
        # line, a space, a port that is no number, userinfo), not judged as a name.
        return 400, f"Bad request: Host {host!r} is not a host[:port]."
    name, host_port = _split_host(host)
    if not _is_loopback_host(name, bound) or (host_port is not None and host_port != str(port)):
        return (
            421,
            f"Misdirected request: Host {host!r} is not this loopback endpoint; toolsetd "
            f"answers only to localhost, 127.0.0.1 or [::1] on port {port} (DNS rebinding "
            "protection).",
        )
    if origin is not None:
        try:
            parts = urlsplit(origin.strip())
        except ValueError:  # an authority it cannot read (``http://[::1``)
            return 403, f"Forbidden: Origin {origin!r} is malformed."
        origin_host, origin_port = _split_host(parts.netloc)
        if parts.scheme not in ("http", "https") or not _is_loopback_host(origin_host, bound):
            return (
                403,
                f"Forbidden: Origin {origin!r} is not a loopback origin; toolsetd answers "
                "only pages served from localhost, 127.0.0.1 or [::1] (DNS rebinding "
                "protection).",
            )
        if origin_port is not None and not origin_port.isdigit():
            return 403, f"Forbidden: Origin {origin!r} is malformed."
    return None


#: What HTTP counts as whitespace around a header value and its parts (RFC 9110 5.6.3).
_HTTP_SPACE = " \t"


def check_token(authorization: str | None, expected: str) -> tuple[int, str] | None:
    """Check ``Authorization: Bearer <token>`` in constant time.

    Args:
        authorization: The header's value (None if absent).
        expected: The configured token.

    Returns:
        None when it matches, else (401, message).
    """
    if authorization is not None:
        # Only HTTP's own whitespace is trimmed: str.strip() would also take U+0085 and
        # U+00A0, the Latin-1 reading of the bytes 0x85 and 0xA0, which end many UTF-8
        # characters ("voil\u00e0" is ...\xc3\xa0) and so a token's last byte.
        scheme, _, value = authorization.strip(_HTTP_SPACE).partition(" ")
        # The header's text is its bytes decoded as Latin-1: encoding it back gives the
        # bytes the client sent, to compare with the token file's (a non-ASCII token was
        # re-encoded as UTF-8 here, and could never match).
        sent = value.strip(_HTTP_SPACE).encode("latin-1", errors="replace")
        if scheme.lower() == "bearer" and hmac.compare_digest(
            sent, expected.encode("utf-8", errors="surrogateescape")
        ):
            return None
    return (
        401,
        "Unauthorized: toolsetd could not establish which user owns this connection; "
        "send the token of --mcp-token-file as 'Authorization: Bearer <token>'.",
    )
