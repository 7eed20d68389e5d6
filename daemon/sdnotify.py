"""systemd readiness notification (``sd_notify``) without libsystemd.

Theory of operation
-------------------
systemd hands a service the address of its notification socket in ``NOTIFY_SOCKET``: a
filesystem path, or a name in the Linux abstract namespace when it starts with ``@``.
A notification is ONE ``AF_UNIX``/``SOCK_DGRAM`` datagram of newline-separated
``KEY=VALUE`` lines. systemd reads the sender's pid from the datagram's credentials, so
with ``NotifyAccess=main`` only the daemon itself (never a tool it spawned) is believed.

Invariants this module keeps:

* Sending never blocks and never raises on a delivery failure: the datagram goes out
  through a fresh non-blocking socket with a single ``sendto``; a full queue, a missing
  socket or a permission error makes :meth:`Notifier.notify` return ``False``. Logging
  that is the caller's job (it knows the context).
* Without ``NOTIFY_SOCKET`` the notifier is a no-op that returns ``False``, so the daemon
  calls the same code with or without systemd.
* The environment is read once, at construction (:meth:`Notifier.from_environ`); by
  default the variables are then removed from it, and :func:`scrub_environment` gives
  the environment children must get: a tool must never see ``NOTIFY_SOCKET`` (it could
  otherwise tell systemd we are ready or stopping) nor the socket-activation variables.
* No state lives at module level; a ``Notifier`` is a small immutable value that the
  composition root builds and passes around.

Protocol reference: ``sd_notify(3)``; the reload handshake (``RELOADING=1`` with
``MONOTONIC_USEC``) follows ``Type=notify-reload`` in ``systemd.service(5)``.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass

__all__ = ["MIN_WATCHDOG_INTERVAL", "SYSTEMD_ENV_VARS", "Notifier", "scrub_environment"]

#: Variables systemd passes to the daemon that a spawned tool must never inherit.
SYSTEMD_ENV_VARS: frozenset[str] = frozenset(
    {
        "LISTEN_FDS",
        "LISTEN_PID",
        "LISTEN_FDNAMES",
        "NOTIFY_SOCKET",
        "WATCHDOG_USEC",
        "WATCHDOG_PID",
    }
)

_NOTIFY_VARS = ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID")

#: The shortest period between two ``WATCHDOG=1`` pings, in seconds.
MIN_WATCHDOG_INTERVAL = 0.01

#: systemd's ``USEC_INFINITY`` (``UINT64_MAX``): ``WATCHDOG_USEC`` must be below it.
_USEC_INFINITY = (1 << 64) - 1


def scrub_environment(environ: Mapping[str, str]) -> dict[str, str]:
    """Return a copy of ``environ`` without the systemd service variables.

    The runner builds every child's base environment from this, so a tool never sees
    ``LISTEN_FDS``, ``LISTEN_PID``, ``LISTEN_FDNAMES``, ``NOTIFY_SOCKET``,
    ``WATCHDOG_USEC`` or ``WATCHDOG_PID``.

    Args:
        environ: The environment to copy, usually ``os.environ``.

    Returns:
        A new dict; ``environ`` itself is left untouched.
    """
    return {key: value for key, value in environ.items() if key not in SYSTEMD_ENV_VARS}


def _socket_address(raw: str) -> str:
    """Map a ``NOTIFY_SOCKET`` value to a Python ``AF_UNIX`` address."""
    if raw.startswith("@"):
        # Abstract namespace: Linux spells it with a leading NUL byte.
        return "\0" + raw[1:]
    return raw


@dataclass(frozen=True, slots=True)
class Notifier:
    """Sends service-state notifications to systemd, or does nothing without it.

    Attributes:
        address: The ``AF_UNIX`` datagram address (``"\\0name"`` for an abstract
            socket), or ``None`` for the no-op notifier.
        watchdog_usec: The watchdog interval systemd asked for, in microseconds, or
            ``None`` when the watchdog is off or meant for another process.
    """

    address: str | None = None
    watchdog_usec: int | None = None

    @classmethod
    def from_environ(
        cls, environ: MutableMapping[str, str] = os.environ, unset: bool = True
    ) -> Notifier:
        """Build the notifier from ``NOTIFY_SOCKET``, ``WATCHDOG_USEC`` and ``WATCHDOG_PID``.

        A missing or empty ``NOTIFY_SOCKET`` gives the no-op notifier. A
        ``WATCHDOG_USEC`` that is not a positive integer, or a ``WATCHDOG_PID`` naming
        another process, leaves the watchdog off.

        Args:
            environ: The environment to read, ``os.environ`` by default.
            unset: Remove the three variables from ``environ`` after reading them, so a
                child spawned without an explicit environment cannot inherit them.

        Returns:
            The notifier.
        """
        raw_socket = environ.get("NOTIFY_SOCKET", "")
        watchdog_usec = _parse_watchdog(environ)
        if unset:
            for key in _NOTIFY_VARS:
                environ.pop(key, None)
        address = _socket_address(raw_socket) if raw_socket else None
        return cls(address=address, watchdog_usec=watchdog_usec)

    @property
    def shown_address(self) -> str | None:
        """The address as ``NOTIFY_SOCKET`` spelled it (``@name`` for an abstract one)."""
        if self.address is None or not self.address.startswith("\0"):
            return self.address
        return "@" + self.address[1:]

    @property
    def enabled(self) -> bool:
        """Whether notifications go anywhere (``NOTIFY_SOCKET`` was set)."""
        return self.address is not None

    def notify(self, *lines: str) -> bool:
        """Send ``lines`` to systemd as one datagram of newline-separated assignments.

        Args:
            *lines: ``KEY=VALUE`` strings, for example ``"READY=1"``.

        Returns:
            ``True`` if the datagram was handed to the kernel; ``False`` for the no-op
            notifier or on any delivery failure (never raises for those).

        Raises:
            ValueError: A line contains a newline or no ``=`` (a programming error: it
                would smuggle a second assignment into the message).
        """
        for line in lines:
            if "\n" in line or "=" not in line:
                raise ValueError(f"a notification line must be one KEY=VALUE, got {line!r}")
        if self.address is None or not lines:
            return False
        payload = "\n".join(lines).encode("utf-8")
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
                sock.setblocking(False)
                sock.sendto(payload, self.address)
        except OSError:
            # Queue full (EAGAIN), socket gone (ENOENT/ECONNREFUSED), EACCES, a path too
            # long: systemd is not listening the way we hoped; the caller logs it.
            return False
        return True

    def ready(self, status: str | None = None) -> bool:
        """Tell systemd the daemon accepts calls (``READY=1``, optionally with ``STATUS=``).

        Args:
            status: A one-line human-readable status to show in ``systemctl status``.

        Returns:
            Whether the datagram was sent.
        """
        if status is None:
            return self.notify("READY=1")
        return self.notify("READY=1", _status_line(status))

    def reloading(self) -> bool:
        """Tell systemd a reload started (``RELOADING=1`` with ``MONOTONIC_USEC``).

        ``Type=notify-reload`` requires the monotonic timestamp so systemd can tell this
        reload from an earlier one; send :meth:`ready` when the reload is done.

        Returns:
            Whether the datagram was sent.
        """
        usec = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
        return self.notify("RELOADING=1", f"MONOTONIC_USEC={usec}")

    def stopping(self) -> bool:
        """Tell systemd the daemon is shutting down (``STOPPING=1``).

        Returns:
            Whether the datagram was sent.
        """
        return self.notify("STOPPING=1")

    def status(self, text: str) -> bool:
        """Set the free-form status line ``systemctl status`` shows (``STATUS=...``).

        Args:
            text: The status; newlines are replaced by spaces.

        Returns:
            Whether the datagram was sent.
        """
        return self.notify(_status_line(text))

    def watchdog(self) -> bool:
        """Send a watchdog keep-alive (``WATCHDOG=1``).

        Returns:
            Whether the datagram was sent.
        """
        return self.notify("WATCHDOG=1")

    def watchdog_interval(self) -> float | None:
        """Return how often to call :meth:`watchdog`, in seconds: half of ``WATCHDOG_USEC``.

        Returns:
            The ping period in seconds, or ``None`` when systemd did not enable the
            watchdog for this process.
        """
        if self.watchdog_usec is None:
            return None
        # Never a busy loop: WatchdogSec=1us asked for a ping every 0.5 us, which spun the
        # event loop at full CPU sending datagrams systemd could not take.
        return max(self.watchdog_usec / 2 / 1_000_000, MIN_WATCHDOG_INTERVAL)


def _status_line(text: str) -> str:
    """Build a ``STATUS=`` line, flattening newlines that would break the protocol."""
    return "STATUS=" + text.replace("\r", " ").replace("\n", " ")


def _parse_watchdog(environ: Mapping[str, str]) -> int | None:
    """Read ``WATCHDOG_USEC``/``WATCHDOG_PID`` the way ``sd_watchdog_enabled(3)`` does."""
    raw_usec = environ.get("WATCHDOG_USEC", "")
    if not raw_usec:
        return None
    try:
        usec = int(raw_usec)
    except ValueError:
        return None
    if not 0 < usec < _USEC_INFINITY:
        # sd_watchdog_enabled refuses what is not a u64 below USEC_INFINITY; a larger
        # number (400 digits) overflowed the float of watchdog_interval and ended the start.
        return None
    raw_pid = environ.get("WATCHDOG_PID", "")
    if raw_pid:
        try:
            pid = int(raw_pid)
        except ValueError:
            return None
        if pid != os.getpid():
            return None
    return usec
