"""``toolsetctl mcp``: an MCP server on stdin/stdout, pumped to the daemon's socket.

Theory of operation
-------------------
MCP hosts spawn their stdio servers once per session, so this process must answer fast:
it imports the standard library only (no anyio, no pydantic, no MCP SDK; from toolsetd,
only the wire's method names in ``protocol/names.py``) and does no MCP itself. The daemon
speaks MCP on its socket (``daemon/mcp_socket.py``); this is a pump:

1. Parse the few options by hand (``argparse`` alone would cost a tenth of the budget).
2. Connect to the socket. When nobody answers and ``--no-autostart`` is not given, start
   ``toolsetd`` in the background on that socket with the default home, in its own
   session with its log in a file beside the socket (said on stderr), and wait for it to
   answer. A failure is one line on stderr and exit code 5.
3. Send ``mcp.bind`` (workspace, catalog, mode, headless) as the first frame, and at once
   start copying stdin to the socket: the host's first request follows the bind frame
   in the same stream, and the daemon reads it as MCP.
4. Copy the socket to stdout, except the bind's own response (the first line), which is
   read here: an error there (a bad workspace or mode) is printed on stderr, exit 2 (8, 7
   or 6 for a daemon that refuses the connection: busy, this user, stopping; 5 for an
   answer that is no JSON-RPC response: another program's socket). A
   stdout that cannot be written (a full disk) is said as such, exit 9, never taken for a
   lost daemon (5); a host that stopped reading (a broken pipe) ends the pump with 0.
5. When stdin closes (a last line without its newline is ended by it), shut down the
   socket's sending side: the daemon cancels this host's calls and closes the
   connection; the pump exits when the socket closes (or after ``_EXIT_GRACE`` seconds).
6. When the daemon closes first while the host is still there (a restart, a crash), even
   while the host is writing, bridge it (``_Pump.run``): answer what the old daemon left
   unanswered and withdraw its questions to the host; wait up to ``RECONNECT_WINDOW``
   seconds for a daemon at the socket (never starting one: only step 2 does; a full
   listen backlog is tried again within the window, not exit 5 as in step 2); bind it as
   in step 3; replay the host's ``initialize`` (its response swallowed) and the 2026-07-28
   ``subscriptions/listen`` requests left open (the host's streams go on, their new
   acknowledgements dropped: a stream is acknowledged once); once the replayed initialize
   is answered as agreed (``gated`` until then), send ``notifications/initialized`` and
   the host's lines that waited; tell a host that initialized,
   each listen resent for it, and each it opens again after a graceful stop ended it,
   ``notifications/tools/list_changed``. A
   failure of that ends the pump as the same failure at the start would, after answering
   every request that waited; so does a replayed initialize answered with an error or
   with another protocol version than the host was given (exit 5). A close the daemon
   explained as a line over its size limit
   (-32007, id null) is not bridged: exit 5; nor is a daemon that closed it more than
   ``_LOSSES_MAX`` times within ``_LOSS_SPAN`` seconds (a crash loop): exit 5.

What the pump looks at, to do step 6: the host's lines are whole (each is sent once read
to its newline, so none is split between two daemons) and small, and parsed (refused as
the daemon's parser refuses them, ``_host_message``): the pump
notes each request in flight, the ``initialize``, and the host's answers to the daemon's
questions. The daemon's lines may be megabytes (a ``tools/list``): only their head is
read, where the daemon's encoder puts ``"jsonrpc"`` then ``"id"`` (``_daemon_head``; a
test pins it), for the id of a response (no longer in flight) or of a question to the
host (renamed after a restart, as a new daemon numbers them from 1 again). Everything
else is copied as bytes; the daemon answers garbage with JSON-RPC errors.
"""

from __future__ import annotations

import functools
import json
import os
import re
import signal
import socket
import sys
import threading
import time
from collections.abc import Mapping, Sequence

from toolsetd.protocol.names import METHOD_MCP_BIND
from toolsetd.protocol.sockfolder import folder_fault
from toolsetd.protocol.sockpath import shared_tmp_folder
from toolsetd.protocol.sockpath import socket_path as socket_path_rule

# stdlib only, loaded already (``__main__``)
from .command import absolute_path, option_meant, wait_ready, wire_text

__all__ = ["default_socket_path", "main", "shared_tmp_peer_refused", "shared_tmp_squatted"]

EXIT_OK = 0
EXIT_USAGE = 2
EXIT_UNREACHABLE = 5
EXIT_INTERNAL = 9
EXIT_INTERRUPTED = 130
#: The exit code of each error the bind may get: the codes every toolsetctl command gives
#: them (``client/exits.py``, written out: the pump imports nothing of the client's), so
#: that each code means one thing. 2 is what was asked (the workspace, the mode, a path
#: over the line limit); any other code (the daemon's -32603, an incident) is exit 9.
_BIND_EXITS = {
    -32602: EXIT_USAGE,  # InvalidParams: the mode, the catalog
    -32006: EXIT_USAGE,  # InvalidWorkspace
    -32007: EXIT_USAGE,  # MessageTooLarge
    -32008: 8,  # ServerBusy
    -32009: 7,  # PeerNotAllowed
    -32010: 6,  # ShuttingDown
}
_BIND_ID = "toolsetctl-mcp-bind"
#: The systemd service variables an autostarted daemon must not inherit from its host:
#: ``daemon/sdnotify.py``'s ``SYSTEMD_ENV_VARS``, written out (the pump imports nothing
#: of the daemon's: ``toolsetd.daemon`` costs structlog, some 40 ms, style.md section 1).
SYSTEMD_ENV_VARS = frozenset(
    {"LISTEN_FDS", "LISTEN_PID", "LISTEN_FDNAMES", "NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID"}
)
#: Seconds allowed to connect to the daemon, a full listen backlog included: the pump's
#: and every other ``toolsetctl`` command's (``context`` takes it from here).
CONNECT_TIMEOUT = 5.0
#: ``_Pump._copy``: the daemon closed the bound connection (``run`` decides what it means).
_DAEMON_CLOSED = -1
#: ``_Pump._rebind``: no answer to the bind (a daemon still starting or stopping): try again.
_RETRY = -2
#: The bind errors a reconnect tries again within its window: a daemon stopping (-32010,
#: the old one, still listening), a busy one (-32008), no answer.
_BIND_RETRY = frozenset({6, 8, _RETRY})
#: Seconds a pump whose daemon closed the connection while the host is still there (a
#: restart: systemd's ``Restart=``, socket activation, an operator) waits for a daemon to
#: answer at the socket again. It tries at once, then after 0.05 s, 0.1 s, ... (at most 1 s
#: apart). It never starts one: only the first connect autostarts.
RECONNECT_WINDOW = 30.0
_BACKOFF_FIRST = 0.05
_BACKOFF_MAX = 1.0
#: A daemon that binds, answers, then dies, again and again (a crash loop) restarts the
#: window each time it answered: the pump gives up (exit 5) when the daemon closed the
#: connection more than ``_LOSSES_MAX`` times within ``_LOSS_SPAN`` seconds.
_LOSSES_MAX = 10
_LOSS_SPAN = 60.0
#: The most bytes of host lines held while the pump reconnects; a request past them is
#: answered with an error at once.
_WAITING_MAX = 4 << 20
#: A host line is sent whole, once read to its end (so that one the daemon did not get is
#: resent whole to the next); a longer one goes on as it comes (the daemon's default limit:
#: it refuses it), and is not carried across a restart; its id and method are read as it
#: goes (``_LongLine``), so that its request is answered all the same. A daemon whose
#: limit is lower holds the pump to it (``_Pump.held_max``).
_HELD_LINE_MAX = 16 << 20
#: The id of the pump's ping to a daemon, whose answer (swallowed) lets the pump write its
#: own answers between the daemon's lines (``_Pump._long_line_end``), before the pump's
#: random token (``_Pump.token``).
_FLUSH_ID = "toolsetctl-mcp-flush-"
#: ... of its pings sent before and behind a host line over ``_HELD_LINE_MAX``, whose
#: answers say whether the daemon parsed that line (``_Pump.verdict``).
_VERDICT_ID = "toolsetctl-mcp-verdict-"
#: The bytes of a daemon line read for its id (more when the host's ids are long).
_HEAD = 256
_ID_HEAD = b'{"jsonrpc":"2.0","id":'
_CANCELLED_HEAD = b'{"jsonrpc":"2.0","method":"notifications/cancelled"'
#: The id of the host's initialize replayed to a new daemon (its response is swallowed),
#: before the pump's random token and the daemon's number.
_REPLAY_ID = "toolsetctl-mcp-initialize-"
#: The prefix of a new daemon's requests to the host, after its number (2, 3, ...): a new
#: daemon numbers its ``toolsetd-elicit-N`` from 1 again.
_RENAMED = "toolsetctl-mcp-{}:"
#: What follows the id in the head of a stopping daemon's refusal of a call (ShuttingDown).
_REFUSED_STOPPING = ',"error":{"code":-32010'
#: ... of its refusal of a request whose id is in flight already (InvalidRequest).
_REFUSED_DOUBLE = ',"error":{"code":-32600'
_VERSION_META = "io.modelcontextprotocol/protocolVersion"
#: What follows the id in the head of an initialize's result: the daemon puts the protocol
#: version first (``tests/integration/test_mcp_reconnect.py`` pins it).
_AGREED_HEAD = ',"result":{"protocolVersion":'
_LISTEN = "subscriptions/listen"
_SUBSCRIPTION_META = "io.modelcontextprotocol/subscriptionId"
#: The head of a daemon's acknowledgement of a listen, up to its subscription id.
_ACK_HEAD = (
    b'{"jsonrpc":"2.0","method":"notifications/subscriptions/acknowledged",'
    b'"params":{"_meta":{"io.modelcontextprotocol/subscriptionId":'
)
#: What the pump does with a new daemon's acknowledgement of a listen (``_Pump.at_ack``):
#: drop it (the host's stream was acknowledged by an older daemon, and MCP acknowledges a
#: subscription once), or pass it on with ``notifications/tools/list_changed`` behind it
#: (the host's first acknowledgement of the stream; the catalog may differ now).
_SWALLOW = 1
_TELL = 2
#: A host request in flight: its id, method, whether it is 2026-07-28's (its ``_meta``
#: names the version), and an initialize's or a listen's params, their text as the host
#: wrote it (``_params_text``; else None).
_Entry = tuple[object, str, bool, object]
_PASS = 1
_DROP = 2
#: A daemon line that came in part is held until its end, up to ``_HOLD_MAX`` bytes (then
#: it goes on as it comes): a daemon that dies within it leaves the host no half line, a
#: message it cannot parse (a progress notification, an answer, cut short).
_HOLD = 3
_HOLD_MAX = 1 << 20
_ABSENT = object()
_DECODER = json.JSONDecoder()
_START_TIMEOUT = 15.0
#: How long a pump whose daemon exited at start waits for the one that holds the path's
#: lock to make its removed socket again (the daemon checks every 2 s).
_HOLDER_WAIT = 3.0
_EXIT_GRACE = 10.0
#: The longest answer to ``mcp.bind`` read before the pump gives up: the real one is a
#: few hundred bytes; a peer that never ends its line must not fill the memory.
_BIND_LINE_MAX = 1 << 20
#: The most the pump takes from the daemon's socket in one read, into a buffer it keeps.
#: Not ``sock.recv(1 MiB)``: that allocates 1 MiB for each read and shrinks it to what
#: came, and glibc's ``malloc`` maps so large a block afresh each time and unmaps it once
#: the chunk is written (a page fault, an ``munmap`` and a TLB flush): 16-18 µs a read
#: against 2.5 for a 300-byte answer, on the path of every answer and notification.
_COPY_CHUNK = 1 << 20
_USAGE = (
    "usage: toolsetctl [--socket PATH] [--workspace DIR] mcp [--catalog plan|work] "
    "[--mode MODE] [--headless] [--no-autostart]"
)
_HELP = f"""{_USAGE}

Serve the tool sets of one workspace to an MCP host on stdin/stdout, e.g.
  claude mcp add tools -- toolsetctl mcp

options:
  --socket PATH      the daemon's socket (env TOOLSETD_SOCKET)
  --workspace DIR    the workspace (default: the current directory)
  --catalog C        only the tools of catalog plan or work
  --mode MODE        the approval mode (default: default)
  --headless         no operator is there to ask: every 'ask' becomes 'deny'
                     (a 'review' still goes to the host, the reviewer)
  --no-autostart     fail instead of starting toolsetd when none answers
"""


def default_socket_path(env: Mapping[str, str] | None = None, option: str | None = None) -> str:
    """Return the socket path, by the one rule the clients share with the daemon.

    Args:
        env: The environment (``os.environ`` when None).
        option: ``--socket``, when given.

    Returns:
        ``--socket``, else ``$TOOLSETD_SOCKET``, each with a leading ``~`` expanded (as the
        daemon does); else ``$XDG_RUNTIME_DIR/toolsetd/toolsetd.sock``, else
        ``/tmp/toolsetd-<uid>/toolsetd.sock`` (``protocol.sockpath``).
    """
    env = os.environ if env is None else env
    return socket_path_rule(option, env, os.geteuid(), os.path.expanduser)


def _shared_tmp_folder() -> str:
    """The default socket folder in the shared ``/tmp`` (tests point it elsewhere)."""
    return shared_tmp_folder(os.geteuid())


def shared_tmp_squatted(path: str) -> str | None:
    """Why the default socket folder in the shared ``/tmp`` must not be used, or None.

    ``/tmp/toolsetd-<uid>`` is ours by name only: any user can create it first and listen
    in it, and every request (the arguments of each call, secrets included) would go to
    them, and their answers be taken for toolsetd's. The daemon refuses to serve from such
    a folder (``daemon.sockpath``); the clients refuse to connect into it, by the same
    rule: a directory (a symlink only if we or root own it) owned by us and writable by
    nobody else. Any other path (``--socket``, ``$TOOLSETD_SOCKET`` elsewhere,
    ``$XDG_RUNTIME_DIR``) is the operator's choice and not checked.
    """
    euid = os.geteuid()
    folder = _shared_tmp_folder()
    if os.path.dirname(os.path.normpath(path)) != folder:
        return None
    try:
        link = os.lstat(folder)
        info = os.stat(folder)
    except OSError:
        return None  # nothing there: the connect says "no such socket"
    fault = folder_fault(link.st_mode, link.st_uid, info.st_mode, info.st_uid, euid)
    if fault is None:
        return None
    kind, value = fault
    if kind == "not_directory":
        return f"the socket folder {folder} is not a directory; refusing to connect"
    if kind == "writable":
        return (
            f"the socket folder {folder} is writable by group or others "
            f"(mode {value:04o}); refusing to connect: run "
            f"'chmod 0700 {folder}'"
        )
    return (  # "link" or "owner"
        f"the socket folder {folder} belongs to uid {value}, not to us (uid {euid}): "
        "someone else may have created it to capture the socket; refusing to connect"
    )


def shared_tmp_peer_refused(sock: socket.socket, path: str) -> str | None:
    """Why a connection made into the shared ``/tmp`` default folder must be dropped, or None.

    ``shared_tmp_squatted`` looks at the folder before the connect, and the folder can
    change in between: another user who swaps their own folder (with their listener in
    it) in and out of ``/tmp/toolsetd-<uid>`` by ``rename`` wins that race now and then.
    So, before anything is sent, the listener itself must be ours: the uid the kernel
    recorded when it called ``listen`` (``SO_PEERCRED``) is ours or root's (a system
    manager's socket activation). Any other path is not checked, as above.
    """
    if os.path.dirname(os.path.normpath(path)) != _shared_tmp_folder():
        return None
    option = getattr(socket, "SO_PEERCRED", None)
    if option is None:  # not Linux: the folder check above is all there is
        return None
    import struct

    euid = os.geteuid()
    try:
        _pid, uid, _gid = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, option, 12))
    except OSError as exc:
        return f"cannot tell who listens at {path} ({exc.strerror}); refusing to use it"
    if uid in (euid, 0):
        return None
    return (
        f"the server listening at {path} runs as uid {uid}, not as us (uid {euid}): "
        "someone else may have planted it to capture the socket; refusing to use it"
    )


class _Usage(Exception):
    """A command-line mistake (exit 2)."""


#: The options naming a path: an empty one is a mistake, not "the default".
_PATH_OPTIONS = frozenset({"--socket", "--workspace", "--home"})
#: Every option ``_parse`` takes, for the hint at one it does not.
_OPTIONS = _PATH_OPTIONS | {"--catalog", "--mode", "--format", "--wide", "--headless"}
_OPTIONS |= {"--no-autostart", "--help"}


def _parse(argv: Sequence[str]) -> dict[str, object]:
    """The options of ``toolsetctl ... mcp ...`` (globals before or after ``mcp``)."""
    options: dict[str, object] = {"headless": False, "autostart": True}
    valued = {
        "--socket": "socket",
        "--workspace": "workspace",
        "--catalog": "catalog",
        "--mode": "mode",
        "--home": "home",
        "--format": "format",
    }
    seen_mcp = False
    args = list(argv)
    i = 0
    while i < len(args):
        arg = args[i]
        name, eq, inline = arg.partition("=")
        if name in valued:
            if eq:
                value = inline
            elif i + 1 < len(args):
                i += 1
                value = args[i]
            else:
                raise _Usage(f"{name} needs a value")
            if not value and name in _PATH_OPTIONS:  # as toolsetctl's parser and the daemon
                raise _Usage(f"{name} must be a path, not empty")
            options[valued[name]] = value
        elif arg in ("-w", "--wide"):
            pass  # a global option of toolsetctl; the pump's stdout carries MCP only
        elif arg == "--headless":
            options["headless"] = True
        elif arg == "--no-autostart":
            options["autostart"] = False
        elif arg in ("-h", "--help"):
            options["help"] = True
        elif arg == "mcp" and not seen_mcp:
            seen_mcp = True
        else:
            hint = option_meant(arg, _OPTIONS, formats=False)
            raise _Usage(f"unrecognized argument: {arg}{f'; {hint}' if hint else ''}")
        i += 1
    if options.get("catalog") not in (None, "plan", "work"):
        raise _Usage("--catalog must be plan or work")
    return options


class _Refused(OSError):
    """A listener the pump must not use: another user's at the ``/tmp`` default (not
    toolsetd of ours), or one whose backlog stayed full (no daemon is started beside it)."""


class _Backlog(_Refused):
    """The listener's backlog stayed full (a reconnect tries again within its window)."""


#: Seconds between connect attempts while the listener's backlog is full.
_BACKLOG_RETRY = 0.02


def connect_within(sock: socket.socket, path: str, timeout: float) -> None:
    """Connect, waiting up to ``timeout`` seconds, a full backlog included.

    With a timeout the socket is non-blocking, and a Unix socket's ``connect`` to a
    listener whose backlog is full fails at once with ``EAGAIN`` (a blocking one would
    wait): a daemon busy with a burst of clients, or restarting behind systemd's socket,
    is there and answers soon, so the connect is tried again until the timeout.

    Raises:
        TimeoutError: The backlog stayed full for ``timeout`` seconds.
        OSError: Any other failure of the connect.
    """
    deadline = time.monotonic() + timeout
    while True:
        sock.settimeout(max(deadline - time.monotonic(), 0.001))
        try:
            sock.connect(path)
            return
        except BlockingIOError:
            if time.monotonic() >= deadline:
                raise TimeoutError(f"the backlog of {path} stayed full") from None
            time.sleep(_BACKLOG_RETRY)


def _connect(path: str, timeout: float = CONNECT_TIMEOUT) -> socket.socket | None:
    """The connected socket, or None when nothing listens (``_start_daemon`` may start one).

    Raises:
        _Refused: Someone else listens there (``shared_tmp_peer_refused``), or (``_Backlog``)
            the listener's backlog stayed full for ``timeout`` seconds: no daemon is
            started (ours would only find the path taken and say "already running").
    """
    if shared_tmp_squatted(path) is not None:
        return None  # then _start_daemon: the daemon refuses the folder and says why
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        # A blocking connect waits for room in a full backlog for as long as it stays
        # full: a wedged daemon held the pump, and its host's MCP start-up, forever.
        connect_within(sock, path, timeout)
    except TimeoutError:
        sock.close()
        raise _Backlog(
            f"toolsetd at {path} accepts no connection: its listen backlog stayed full for "
            f"{timeout:.0f} s (is the daemon stopped or hung?)"
        ) from None
    except OSError:
        sock.close()
        return None
    sock.settimeout(None)
    refused = shared_tmp_peer_refused(sock, path)
    if refused is not None:
        sock.close()
        raise _Refused(f"not connecting to toolsetd at {path}: {refused}")
    return sock


def _start_daemon(path: str) -> socket.socket:
    """Start ``toolsetd`` on ``path`` and connect to it; raises OSError with one line."""
    import subprocess  # only on this path: it costs milliseconds

    folder = os.path.dirname(path) or "."
    squatted = shared_tmp_squatted(path)
    if squatted is not None:  # neither the log nor the daemon goes into someone else's folder
        raise OSError(squatted)
    try:
        os.makedirs(folder, mode=0o700, exist_ok=True)
    except OSError as exc:
        raise OSError(f"cannot create the socket folder {folder}: {exc.strerror}") from None
    log_path = os.path.join(folder, "toolsetd.log")
    _say(f"toolsetctl mcp: starting toolsetd on {path}; its log is {log_path}\n")
    try:  # not through a symlink someone planted: the log is appended to as we; and not
        # blocking: a FIFO there with no reader held the pump (and its host) forever
        log_fd = os.open(
            log_path,
            os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK,
            0o600,
        )
    except OSError as exc:
        raise OSError(f"cannot open the log {log_path}: {exc.strerror}") from None
    import stat  # only on this path

    if not stat.S_ISREG(os.fstat(log_fd).st_mode):
        os.close(log_fd)
        raise OSError(f"the log {log_path} is not a regular file: move it away")
    with open(log_fd, "ab") as log_file:
        daemon = subprocess.Popen(  # noqa: TID251 -- a detached daemon, not a child we wait on
            # Absolute: the daemon runs in / (below), where a relative path names another
            # socket than the one this pump then waits for.
            [sys.executable, "-m", "toolsetd.daemon", "--socket", os.path.abspath(path)],
            # Not the host's systemd service: a daemon started here that inherited
            # NOTIFY_SOCKET told the host's unit READY=1, STATUS= and, when it stopped,
            # STOPPING=1.
            env={k: v for k, v in os.environ.items() if k not in SYSTEMD_ENV_VARS},
            stdin=subprocess.DEVNULL,
            stdout=log_file,
            stderr=log_file,
            start_new_session=True,  # the host may kill the pump's group: not the daemon's
            close_fds=True,
            cwd="/",  # hold no workspace open
        )
    deadline = time.monotonic() + _START_TIMEOUT
    exited: float | None = None
    while time.monotonic() < deadline:
        sock = _connect(path)
        if sock is not None:
            return sock
        if daemon.poll() is not None:
            sock = _connect(path)  # another pump's daemon may have won the race
            if sock is not None:
                return sock
            exited = time.monotonic() if exited is None else exited
            if time.monotonic() - exited < _HOLDER_WAIT and _lock_holder_alive(path):
                # A running daemon holds the path (ours exited for that): a cleanup removed
                # its socket, which it makes again within 2 s. Wait for that one.
                time.sleep(0.01)
                continue
            raise OSError(
                f"toolsetd exited with code {daemon.returncode} while starting: "
                f"{_last_line(log_path)} (log: {log_path})"
            )
        time.sleep(0.01)
    raise OSError(
        f"toolsetd did not answer on {path} within {_START_TIMEOUT:.0f} s (log: {log_path})"
    )


def _lock_holder_alive(path: str) -> bool:
    """Whether the pid in the socket's lock file (``<socket>.lock``) is a live process."""
    try:
        fd = os.open(f"{path}.lock", os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        pid = int(os.pread(fd, 32, 0).decode("ascii").strip())
    except (OSError, ValueError, UnicodeDecodeError):
        return False
    finally:
        os.close(fd)
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except PermissionError:
        return True
    except OSError:
        return False
    return True


def _last_line(log_path: str) -> str:
    """The last log line's event or message, for the one line a host shows."""
    try:
        with open(log_path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 4096))
            lines = [
                line for line in f.read().decode(errors="replace").splitlines() if line.strip()
            ]
    except OSError:
        return "no log"
    if not lines:
        return "no log output"
    last = lines[-1]
    try:
        event = json.loads(last)
    except ValueError:
        return last[:300]
    if isinstance(event, dict):
        return str(event.get("message") or event.get("error") or event.get("event") or last)[:300]
    return last[:300]


def _write_all(fd: int, data: bytes | bytearray | memoryview) -> None:
    view = memoryview(data)
    while view:
        try:
            written = os.write(fd, view)
        except BlockingIOError:  # a non-blocking stdout, full: wait until it takes more
            wait_ready(fd, write=True)
            continue
        view = view[written:]


class _Pump:
    """The copying both ways, and what it keeps to carry the session across a restart.

    Two threads: the stdin thread (``stdin``) reads the host's lines, notes each request
    in flight (and the host's ``initialize``), and sends the line to the daemon, or holds
    it while the pump reconnects; the main thread (``run``) copies the daemon's lines to
    stdout, reading only the head of each (``_daemon_head``), and reconnects when the
    daemon closes the connection while the host is still there (``_reconnect``).
    """

    def __init__(self, path: str, bind: Mapping[str, object], sock: socket.socket) -> None:
        self.path = path
        self.bind = bind
        self.sock: socket.socket | None = sock  # None while the pump reconnects
        #: Guards what both threads read and write below (never held across a send).
        self.lock = threading.Lock()
        #: Held across each send to the daemon, so lines go in the order they were read.
        self.send_lock = threading.Lock()
        self.stdin_closed = threading.Event()
        self.bound = threading.Event()
        #: Set by the stdin thread when it ends or holds an answer for the main thread.
        self.wake = threading.Event()
        self.generation = 1
        #: In the ids of the pump's own requests (its ping, the replayed initialize),
        #: which share the daemon's id space with the host's: a host cannot guess it. A
        #: host request of the fixed ``toolsetctl-mcp-flush`` answered while the pump's
        #: ping was out had its answer swallowed, and the ping's ``{}`` given to it.
        self.token = os.urandom(12).hex()
        self.flush_id = _FLUSH_ID + self.token
        self.verdict_id = _VERDICT_ID + self.token
        self.mark_id = self.verdict_id + "-before"
        #: A host line over ``_HELD_LINE_MAX`` read as a request (key, entry) that went to
        #: the daemon whole, until the pump's ping behind it (``verdict_id``) is answered.
        #: Before its first byte goes the pump sends a ping too (``mark_id``), and each
        #: time the host's lines wait in the pipe (the stdin thread reads no more until
        #: ``verdict_done``): the daemon answers a line's parse error (id null) as it reads
        #: it, so the parse errors between the two answers are the long line's own, and
        #: one there means it is no longer in flight. Python's json cannot read such a line
        #: as it streams: a NaN, a lone surrogate or a stray comma within it was taken for a
        #: request in flight, and a restart answered it, after the daemon's refusal. Nor is
        #: the count of the parse errors before it guessed from the host's short lines: a
        #: pump whose install went cannot tell whether the daemon reads a line nested past
        #: Python's json, and a guess one too many kept a refused call in flight.
        self.verdict: tuple[object, _Entry] | None = None
        self.verdict_done = threading.Event()
        self.verdict_done.set()
        #: The parse errors the daemon answered, and how many of them came before the
        #: answer to the ``mark_id`` ping (the main thread's).
        self._unparsed_seen = 0
        self._unparsed_mark = 0
        #: The host's requests sent to this daemon and not answered (key -> ``_Entry``):
        #: the pump answers them when the daemon goes away.
        self.in_flight: dict[object, _Entry] = {}
        #: The host's requests sent under an id in flight already (key -> entries, in the
        #: order sent; MCP forbids it, JSON-RPC leaves it to the host): the daemon refuses
        #: each (-32600, ``_REFUSED_DOUBLE``) while the first is in flight, or serves it
        #: when it had answered the first before reading it. Each response under the id
        #: ends one of them (``_ended``): a refusal the last sent, any other the first.
        self.doubles: dict[object, list[_Entry]] = {}
        #: The lines of the ``tools/call`` requests in flight (key -> line), up to
        #: ``_WAITING_MAX`` bytes in all (``calls_bytes``): one a stopping daemon refuses
        #: (-32010: it started nothing) waits for the next daemon (``_refused``).
        self.calls: dict[object, bytes] = {}
        self.calls_bytes = 0
        #: The daemon's requests to the host not answered yet: host key -> (host id, daemon
        #: id); after a restart the pump renames them (``_RENAMED``).
        self.asked: dict[object, tuple[object, object]] = {}
        self.initialize: tuple[object, object] | None = None  # the host's (id key, params text)
        #: 2026-07-28 ``subscriptions/listen`` requests a daemon that went away left open:
        #: sent to the next one as they were (key -> ``_Entry``), so the host's streams go on.
        self.listens: dict[object, _Entry] = {}
        #: The host's open listens it has seen acknowledged (keys).
        self.acked: set[object] = set()
        #: Listens whose next acknowledgement the pump handles (key -> ``_SWALLOW`` or
        #: ``_TELL``).
        self.at_ack: dict[object, int] = {}
        #: Listens (asking for list_changed) a stopping daemon ended with their completion
        #: result and the host has not opened again since; ``ended_in``: the generation of
        #: the daemon that ended the last of them. The host's next listens to a later
        #: daemon are told list_changed after their acknowledgement, as a legacy host is
        #: after a restart: what changed in between was told to no stream.
        self.unopened = 0
        self.ended_in = 0
        self.initialized = False
        #: The host's lines read while the pump reconnects, and their size.
        self.waiting: list[tuple[bytes, object, _Entry | None]] = []
        self.waiting_bytes = 0
        #: The pump's own answers the stdin thread leaves for the main thread to write.
        self.replies: list[bytes] = []
        #: How many bytes of a daemon line's head are read to find its id (grows with the
        #: host's longest id).
        self.head_max = _HEAD
        #: The longest host line held whole, and parsed (``_host_message``): the bound
        #: daemon's line limit, which it says in its answer to the bind
        #: (``maxMessageBytes``), ``_HELD_LINE_MAX`` at most. A longer one goes on as it
        #: comes, and that daemon refuses it unread (-32007); the pump parsed every line
        #: up to 16 MiB whole first (16 MiB of ``[],`` took 1.6 s and 420 MB).
        self.held_max = _HELD_LINE_MAX
        # The main thread's: the daemon line being copied.
        self._head = bytearray()
        self._mode = 0  # 0: at a line's start; _PASS, _DROP or _HOLD: within a line
        self._held = bytearray()  # the line ``_HOLD`` holds
        self._line_entry: tuple[object, _Entry] | None = None
        self._swallow: object = None  # the replayed initialize's id
        #: The host's lines wait while the replayed initialize is unanswered (``_resume``):
        #: a new daemon that refuses it ends the pump, and they must not have run.
        self.gated = False
        self._agreed_again = False  # the main thread's: the replay was answered as agreed
        self._replay_refused: str | None = None
        #: The protocol version the host's initialize was given (a replay must agree on it).
        self._agreed: object = None
        self._too_large = False  # the daemon said a line of the host's was over its limit
        self._heard = False  # the daemon sent something since the last reconnect
        #: The stdin thread's: the daemon a line over ``_HELD_LINE_MAX`` is going to.
        self._streaming_to: socket.socket | None = None

    # -- host to daemon (the stdin thread) -----------------------------------------------

    def stdin(self) -> None:
        """stdin to the daemon, line by line; at its end, half-close the socket so the
        daemon cancels this host's calls (and the pump ends when it closes).

        The end of input ends the last message as a newline would (``printf '%s' "$json" |
        toolsetctl mcp``; the SDK's stdio server reads it so): the socket's wire drops a
        line its client left unfinished, so the pump finishes it. A line longer than
        ``_HELD_LINE_MAX`` goes on as it comes (and is not carried across a restart).
        """
        partial = bytearray()
        streaming: _LongLine | None = None  # a long line goes on as it comes, to its daemon
        while True:
            try:
                data = os.read(0, 65536)
            except BlockingIOError:  # a non-blocking stdin with nothing yet: not its end
                wait_ready(0, write=False)
                continue
            except OSError:
                break  # stdin failed: as good as closed
            if not data:
                if partial or streaming is not None:
                    data = b"\n"
                else:
                    break
            start = 0
            while True:
                newline = data.find(b"\n", start)
                if newline < 0:
                    break
                if streaming is not None:
                    self._long_line_end(streaming, data[start : newline + 1])
                    streaming = None
                elif partial:
                    partial += data[start : newline + 1]
                    self._host_line(bytes(partial))
                    partial.clear()
                else:
                    self._host_line(data[start : newline + 1])
                start = newline + 1
            rest = data[start:]
            if streaming is not None:
                streaming.feed(rest)
                self._send_raw(rest)
            elif rest:
                partial += rest
                if len(partial) > self.held_max:
                    streaming = _LongLine()
                    streaming.feed(partial)
                    with self.lock:  # not ahead of the lines that wait for the gate
                        self._streaming_to = to = None if self.gated else self.sock
                        head = self._long_answer(streaming, bytes(partial))
                    if to is not None and not streaming.answer:
                        self._ask(to, self.mark_id)  # the parse errors before it
                    self._send_raw(head)
                    partial.clear()
        with self.lock:
            self.stdin_closed.set()
            sock = self.sock
            gated = self.gated
        self.wake.set()
        if sock is None:
            return  # the main thread, reconnecting, sees the end
        if not gated:  # else ``_send_gated`` half-closes once what waits is sent
            with self.send_lock:
                _half_close(sock)
        # The daemon closes the connection once the calls are cancelled; do not outwait it.
        timer = threading.Timer(_EXIT_GRACE, _outwaited, (self.bound, self.path))
        timer.daemon = True
        timer.start()

    def _host_line(self, line: bytes) -> None:
        """One whole line of the host's: note it, then send it (or hold it)."""
        message = _host_message(line)
        entry: _Entry | None = None
        key: object = None
        answer = False
        cancel = False  # a notifications/cancelled: it never waits for a new daemon
        reaches = False  # it names a request the daemon has (``_host_notification``)
        if type(message) is dict:
            method = message.get("method")
            request_id = message.get("id", _ABSENT)
            if (
                method is None
                and request_id is not _ABSENT
                and ("result" in message or "error" in message)
            ):
                answer = True
                line = self._host_answer(message, line)
                if not line:
                    return
            elif type(method) is str and request_id is _ABSENT:
                reaches = self._host_notification(method, message.get("params"))
                cancel = method == "notifications/cancelled"
            elif type(method) is str:
                key = _key(request_id)
                if key is not None:
                    params = message.get("params")
                    meta = params.get("_meta") if type(params) is dict else None
                    modern = type(meta) is dict and _VERSION_META in meta
                    # An initialize and a listen keep their params' text: a new daemon is
                    # given them again.
                    kept = (
                        _params_text(line) if method == "initialize" or method == _LISTEN else None
                    )
                    entry = (request_id, method, modern, kept)
                    self._room_for(request_id)
        with self.lock:
            sock = self.sock
            if sock is None or (self.gated and not reaches):
                if not cancel and not answer:  # an answer's daemon is gone: dropped
                    self._wait(line, key, entry)
                return
            first = entry is not None and self._sending(key, entry)
            if entry is not None:
                self._opening(key, entry)
                self._keep_call(key, entry, line)
        with self.send_lock:
            try:
                sock.sendall(line)
            except OSError:
                # The daemon closed the connection (it stopped, or restarted) before the
                # main thread saw it: not the end of the host's input. The line did not
                # reach it whole (its newline, last, was not sent), so it waits for the
                # new daemon as one read a moment later does; held here, before the main
                # thread (which closes the socket under ``send_lock`` first) answers what
                # was in flight. An answer to the old daemon's question is dropped: the
                # pump withdraws that question; so is a cancel (``_host_notification``).
                if not answer and not cancel:
                    with self.lock:
                        if entry is not None and self._unsent(key, entry):
                            self._drop_call(key)
                            if first:
                                self.initialize = None
                        self._wait(line, key, entry)

    def _room_for(self, request_id: object) -> None:
        """A host request goes in flight: the daemon lines' heads are read far enough to
        hold its id whole (``_id_room``), whatever the line it came in."""
        room = _id_room(request_id)
        if room > _HEAD - 64:
            self.head_max = max(self.head_max, room + _HEAD)

    def _wait(self, line: bytes, key: object, entry: _Entry | None) -> None:
        """Hold a host line for the new daemon (``lock`` held); a request past
        ``_WAITING_MAX`` is answered at once."""
        if self.waiting_bytes + len(line) > _WAITING_MAX:
            if entry is not None:
                self.replies.append(_gone_answer(entry, "overflow"))
                self.wake.set()
            return
        self.waiting.append((line, key, entry))
        self.waiting_bytes += len(line)

    def _keep_call(self, key: object, entry: _Entry, line: bytes) -> None:
        """Keep the line of a ``tools/call`` going to the daemon (``lock`` held), room
        allowing: a stopping daemon that refuses it sends it to the next. Not one sent
        under an id in flight already (``doubles``): its line took the first's place, and
        when the stopping daemon refused the first, the next one ran the second in its
        stead (the second's refusal, its own, goes on to the host)."""
        if key in self.doubles:
            return
        if entry[1] == "tools/call" and self.calls_bytes + len(line) <= _WAITING_MAX:
            self._drop_call(key)
            self.calls[key] = line
            self.calls_bytes += len(line)

    def _drop_call(self, key: object) -> bytes | None:
        """The kept line of a call no longer in flight, forgotten (``lock`` held)."""
        line = self.calls.pop(key, None)
        if line is not None:
            self.calls_bytes -= len(line)
        return line

    def _sending(self, key: object, entry: _Entry) -> bool:
        """A host request goes to the daemon now (``lock`` held): it is in flight, and
        the session's first initialize is the one a new daemon is given again (one that
        waited for the new daemon is sent as itself, not replayed as well). Whether it is
        that first initialize."""
        self._in_flight(key, entry)
        if entry[1] == "initialize" and self.initialize is None:
            self.initialize = (key, entry[3])
            return True
        return False

    def _in_flight(self, key: object, entry: _Entry) -> None:
        """A host request is in flight now (``lock`` held): under an id in flight already,
        it is one more (``doubles``), and the first stays tracked."""
        if key in self.in_flight:
            self.doubles.setdefault(key, []).append(entry)
        else:
            self.in_flight[key] = entry

    def _ended(self, key: object, *, refused: bool = False) -> tuple[_Entry | None, bool]:
        """The request a response (or a cancel) under ``key`` ends, no longer in flight
        (``lock`` held), and whether it was one sent under an id in flight already. A
        refusal (``refused``: the daemon's -32600) ends the last sent, any other the first,
        the next then standing first."""
        entry = self.in_flight.pop(key, None)
        doubles = self.doubles.get(key)
        if entry is None or not doubles:
            return entry, False
        if refused:
            self.in_flight[key], ended = entry, doubles.pop()
        else:
            self.in_flight[key], ended = doubles.pop(0), entry
        if not doubles:
            del self.doubles[key]
        return ended, refused

    def _unsent(self, key: object, entry: _Entry) -> bool:
        """A host request whose send failed is not in flight (``lock`` held); whether it
        was."""
        doubles = self.doubles.get(key, [])
        for i, double in enumerate(doubles):
            if double is entry:
                del doubles[i]
                if not doubles:
                    del self.doubles[key]
                return True
        if self.in_flight.get(key) is not entry:
            return False
        self._ended(key)
        return True

    def _opening(self, key: object, entry: _Entry) -> None:
        """A host request goes to the daemon as the host sent it (``lock`` held): a listen
        that opens a stream again after a graceful stop, on a later daemon, is told
        list_changed once acknowledged."""
        if entry[1] != _LISTEN or not entry[2] or not _wants_tools(entry[3]) or not self.unopened:
            return
        self.unopened -= 1
        if self.generation > self.ended_in:
            self.at_ack[key] = _TELL

    def _listen_over(self, key: object) -> None:
        """The host's listen ``key`` ended (answered or cancelled; ``lock`` held)."""
        self.acked.discard(key)
        self.at_ack.pop(key, None)

    def _host_answer(self, message: dict[str, object], line: bytes) -> bytes:
        """The host's answer to a request of the daemon's: the line to send, or b"" when
        it answers none the daemon has open after a restart: one the pump or the daemon
        withdrew (an older daemon's, whose id a new daemon, numbering from 1 again, gives
        its own), or one answered already. Such an answer, late, was sent on, and a new
        daemon took an accept of an old daemon's question for the operator's approval of
        another call. The first daemon is sent every answer: it knows what it asked."""
        with self.lock:
            asked = self.asked.pop(_key(message.get("id")), None)
            if asked is None:
                return b"" if self.generation > 1 else line
        if asked[0] != asked[1]:  # renamed after a restart: its own id
            return _with_id(line, asked[1]) or b""  # (or none: see _with_id)
        return line

    def _host_notification(self, method: str, params: object) -> bool:
        """Note a host notification; whether it is a cancel of a request in flight."""
        reaches = False
        if method == "notifications/initialized":
            with self.lock:
                self.initialized = True
        elif method == "notifications/cancelled" and type(params) is dict:
            key = _key(params.get("requestId"))
            # A cancel never waits for a new daemon (``_host_line``): it named a request
            # that waits (not sent now: it never reaches a daemon), one the old daemon had
            # (answered, or a listen not sent again), a listen resent to the new daemon
            # (sent to it at once, while the replayed initialize is unanswered too: the
            # listen ends there) or none; held, it could be dropped past ``_WAITING_MAX``
            # while its request went on, and ran.
            with self.lock:  # a cancelled request gets no answer, from the pump neither
                reaches = self._ended(key)[0] is not None
                self._drop_call(key)
                self.listens.pop(key, None)  # nor is a cancelled listen sent again
                self._listen_over(key)
                if key is not None and self.waiting:
                    kept: list[tuple[bytes, object, _Entry | None]] = []
                    for held in self.waiting:
                        if held[1] == key and _cancellable(held[2]):
                            self.waiting_bytes -= len(held[0])
                        else:
                            kept.append(held)
                    self.waiting = kept
        return reaches

    def _send(self, sock: socket.socket, line: bytes) -> None:
        with self.send_lock:
            try:
                sock.sendall(line)
            except OSError:
                # The daemon closed the connection (it stopped, or restarted) while the
                # host was writing: the main thread sees the close and reconnects.
                pass

    def _long_answer(self, line: _LongLine, head: bytes) -> bytes:
        """The first ``_HELD_LINE_MAX`` bytes of a long line (``lock`` held), as they go to
        the daemon. A host answer to a question of the daemon's is looked at as
        ``_host_answer`` looks at a short one: after a restart, one to a question no
        daemon has open now goes nowhere, and one to a question renamed goes under the
        daemon's id, rewritten here; one whose id is not in these bytes (a TypeScript
        host writes it last) goes nowhere either, and its question is answered at its end
        (``_long_line_end``). Every such answer went on as the host wrote it: under the
        pump's id, unknown to the daemon, whose call then waited for it for ever; or, late,
        to a question of the old daemon's, to the new daemon under the id of one of its
        own (an approval of another call)."""
        outer = line.so_far()
        if outer is None or "method" in outer or not ("result" in outer or "error" in outer):
            return head  # a request (or not a message): as it comes
        line.answer = True
        if self.generation == 1:
            return head  # the first daemon is sent every answer: it knows what it asked
        asked = self.asked.get(_key(outer.get("id")))
        renamed = None if asked is None else line.with_id(head, asked[1])
        if renamed is None:
            self._streaming_to = None
            return b""
        return renamed

    def _long_line_end(self, line: _LongLine, tail: bytes) -> None:
        """The end of a line over ``_HELD_LINE_MAX``: a request in it is in flight when all
        of it went to one daemon; else (its daemon went away, or none was there when it
        began: the rest went nowhere) the pump answers it, as not run. It went
        unanswered, and the host waited for ever. An answer's question is no longer open
        (a restart withdrew it again); one that went nowhere is answered to the daemon
        with an error (``_long_answer``)."""
        line.feed(tail)
        found = line.request(modern=self.initialize is None)
        answered = line.answered() if line.answer else None
        with self.lock:
            sock = self.sock
            whole = sock is not None and sock is self._streaming_to
            asked = None if answered is None else self.asked.pop(_key(answered[0]), None)
            if found is not None:
                if whole:
                    self._room_for(found[1][0])
                    self._in_flight(*found)
                    self.verdict = found
                else:
                    self.replies.append(_gone_answer(found[1], "cut"))
        if whole and sock is not None:
            self._send(sock, tail)
            if found is not None:  # whether the daemon took it: no line goes before that
                self._ask(sock, self.verdict_id)
        elif asked is not None and sock is not None:
            failed = {
                "jsonrpc": "2.0",
                "id": asked[1],
                "error": {
                    "code": -32603,
                    "message": "Internal error: the host's answer could not be passed on "
                    f"(a line over {_HELD_LINE_MAX} bytes whose id came after them)",
                },
            }
            self._send(sock, json.dumps(failed).encode() + b"\n")
        elif found is not None:
            self.wake.set()  # a reconnecting pump writes it
            if sock is not None:  # one copying a daemon's lines: after the next
                ping = {"jsonrpc": "2.0", "id": self.flush_id, "method": "ping"}
                self._send(sock, json.dumps(ping).encode() + b"\n")

    def _ask(self, sock: socket.socket, request_id: str) -> None:
        """Ping the daemon (``mark_id``, ``verdict_id``) and wait for the main thread to
        read its answer, or to see the daemon go (``verdict``): one gone already
        (``sock`` is no longer the pump's) answers nothing."""
        with self.lock:
            if self.sock is not sock:
                return
            self.verdict_done.clear()  # set again when it goes (``_abandon``)
        ping = {"jsonrpc": "2.0", "id": request_id, "method": "ping"}
        self._send(sock, json.dumps(ping).encode() + b"\n")
        self.verdict_done.wait()

    def _send_raw(self, data: bytes) -> None:
        """Part of a long line: to the daemon it began with, else nowhere (a new daemon
        would take the rest for a line of its own)."""
        with self.lock:
            sock = self.sock
        if sock is not None and sock is self._streaming_to:
            self._send(sock, data)

    # -- daemon to host (the main thread) ------------------------------------------------

    def run(self) -> int:
        """Copy the daemon's lines to stdout; bridge a restart. Returns the exit code."""
        sock = self.sock
        assert sock is not None
        code = self._copy(sock, first=True)
        deadline: float | None = None
        losses: list[float] = []
        while code == _DAEMON_CLOSED:
            with self.lock:
                self.sock = None  # the host's lines wait from now on
                self.gated = False
                held = bool(self.waiting)
            self._agreed_again = False
            with self.send_lock:  # no send is under way on it: its number may be reused
                sock.close()
            if self.stdin_closed.is_set() and not held:
                # (Lines that waited for a replay never answered are answered below.)
                return EXIT_OK
            if self._too_large:
                # The daemon closed the connection for a line of the host's over its size
                # limit (and said so, -32007): not a restart; a new session would only
                # meet the next such line.
                return self._fail(
                    f"toolsetd at {self.path} closed the connection: a line of the host's "
                    "was over its size limit",
                    EXIT_UNREACHABLE,
                )
            now = time.monotonic()
            losses = [t for t in losses if now - t < _LOSS_SPAN] + [now]
            if len(losses) > _LOSSES_MAX:
                return self._fail(
                    f"toolsetd at {self.path} closed the connection {len(losses)} times "
                    f"within {_LOSS_SPAN:.0f} s (is it crashing?); not reconnecting again",
                    EXIT_UNREACHABLE,
                )
            if deadline is None or self._heard:
                # The window runs from the first loss, and again only once a new daemon has
                # said something: one that binds and closes at once, again and again (a
                # crash loop, a peer that is no toolsetd), ends the pump within it.
                deadline = time.monotonic() + RECONNECT_WINDOW
            self._heard = False
            reconnected = self._reconnect(deadline)
            if isinstance(reconnected, int):
                return reconnected
            sock = reconnected
            code = self._copy(sock, first=False)
        return code

    def _copy(self, sock: socket.socket, *, first: bool) -> int:
        """The socket to stdout until it closes (``_DAEMON_CLOSED``) or an exit code; the
        first connection's bind response is read off its front."""
        pending = b""
        bound = not first
        buffer = memoryview(bytearray(_COPY_CHUNK))
        try:
            while True:
                try:
                    data = bytes(buffer[: sock.recv_into(buffer)])
                except ConnectionResetError:
                    data = b""
                if not data:
                    break
                if not bound:
                    pending += data
                    newline = pending.find(b"\n")
                    if newline < 0:
                        if len(pending) > _BIND_LINE_MAX:
                            _say(
                                f"toolsetctl mcp: toolsetd at {self.path} answered mcp.bind "
                                f"with more than {_BIND_LINE_MAX} bytes and no line end\n"
                            )
                            return EXIT_UNREACHABLE
                        continue
                    error = _bind_error(pending[:newline])
                    if error is not None:
                        _say(f"toolsetctl mcp: {error[1]}\n")
                        return error[0]
                    bound = True
                    self.held_max = _line_limit(pending[:newline])
                    self.bound.set()
                    _hold_words()
                    data, pending = pending[newline + 1 :], b""
                    if not data:
                        continue
                self._feed(data)
                if self._replay_refused is not None:
                    return self._fail(self._replay_refused, EXIT_UNREACHABLE)
                if self._agreed_again:
                    self._agreed_again = False
                    self._open_gate(sock)
                if self.replies and not self._mode and not self._head:
                    # Answers to lines past _WAITING_MAX while gated, between whole lines.
                    self._flush_replies()
        except _StdoutGone as exc:
            return exc.code
        except OSError as exc:
            if not bound:
                _say(f"toolsetctl mcp: lost the connection to toolsetd at {self.path}: {exc}\n")
                return EXIT_UNREACHABLE
        if not bound:
            _say(f"toolsetctl mcp: toolsetd at {self.path} closed the connection before binding\n")
            return EXIT_UNREACHABLE
        return _DAEMON_CLOSED

    def _feed(self, data: bytes) -> None:
        """Write the daemon's bytes to stdout, line by line, each as its head says."""
        self._heard = True
        view = memoryview(data)
        size = len(data)
        pos = 0
        out: list[bytes | bytearray | memoryview] = []
        while pos < size:
            if self._mode:
                newline = data.find(b"\n", pos)
                end = size if newline < 0 else newline + 1
                if self._mode == _PASS:
                    out.append(view[pos:end])
                elif self._mode == _HOLD:
                    self._held += view[pos:end]
                    if newline >= 0 or len(self._held) > _HOLD_MAX:
                        out.append(self._held)
                        self._held = bytearray()
                        self._mode = _PASS
                pos = end
                if newline >= 0:
                    self._mode = 0
                    self._line_entry = None
                continue
            head = self._head
            room = self.head_max - len(head)
            newline = data.find(b"\n", pos, pos + room)
            end = min(size, pos + room) if newline < 0 else newline + 1
            complete = newline >= 0
            if not head and (complete or end - pos >= room):
                line: bytes = data[pos:end]  # the common case: the head in one piece
            else:
                head += view[pos:end]
                if not complete and len(head) < self.head_max:
                    break  # the head's end comes with the next bytes
                line = bytes(head)
                head.clear()
            pos = end
            kept = self._daemon_head(line, complete)
            if not complete:
                self._mode = _HOLD if kept else _DROP
                self._held += kept
            else:
                if kept:
                    out.append(kept)
                self._line_entry = None
        if out:
            self._write(b"".join(out) if len(out) > 1 else out[0])

    def _daemon_head(self, head: bytes, complete: bool) -> bytes:
        """What of a daemon line's head goes to the host (b"": none of the line).

        The daemon encodes each message with ``"jsonrpc"`` first and ``"id"`` second
        (``tests/integration/test_mcp_reconnect.py`` pins it): a response is
        ``{"jsonrpc":"2.0","id":<id>,"result"|"error"``, a request of the daemon's is
        ``...,"id":<id>,"method"``; so the id is read from the head only, never by parsing
        a whole (maybe megabytes) line.
        """
        if head.startswith(_ID_HEAD):
            text = head[len(_ID_HEAD) :].decode("utf-8", "replace")
            try:
                value, end = _DECODER.raw_decode(text)
            except (ValueError, RecursionError):
                return head  # not ours to follow: copied as it is
            after = text[end : end + 24]
            key = _key(value)
            if after.startswith(',"method"'):
                if key is None:
                    return head
                host_id = value
                if self.generation > 1:  # never the id of an older daemon's question
                    host_id = _RENAMED.format(self.generation) + str(value)
                    cut = len(_ID_HEAD) + len(text[:end].encode())
                    head = _ID_HEAD + json.dumps(host_id).encode() + head[cut:]
                with self.lock:
                    self.asked[_key(host_id)] = (host_id, value)
                return head
            if value == self.flush_id:  # no host id has the pump's token (``token``)
                return b""  # the answer to the pump's ping: its answers follow this line
            if key is not None and key == self._swallow:
                self._swallow = None
                if after.startswith(',"error"'):
                    self._replay_refused = (
                        f"toolsetd at {self.path} refused the host's initialize after its "
                        f"restart: {_error_text(head, complete)}"
                    )
                else:
                    agreed = _agreed_version(text, end)
                    if agreed != self._agreed and self._agreed is not None:
                        # A downgraded daemon: the host would go on speaking the version it
                        # was given; ended, it starts the server again and negotiates anew.
                        self._replay_refused = (
                            f"toolsetd at {self.path} agreed on protocol version {agreed} "
                            f"after its restart, not on {self._agreed}, the host's: ending "
                            "the session, for the host to start it again"
                        )
                    else:
                        self._agreed_again = True
                return b""
            if value is None and after.startswith(',"error":{"code":-32007'):
                self._too_large = True
            if value is None and after.startswith(',"error":{"code":-32700'):
                self._unparsed_seen += 1
            if value == self.mark_id:
                self._unparsed_mark = self._unparsed_seen
                self.verdict_done.set()
                return b""
            if value == self.verdict_id:
                with self.lock:  # the stdin thread waits: it sends nothing meanwhile
                    verdict, self.verdict = self.verdict, None
                    if verdict is not None and self._unparsed_seen > self._unparsed_mark:
                        self._unsent(*verdict)  # refused: no request
                self.verdict_done.set()
                return b""
            with self.lock:
                entry, double = self._ended(key, refused=after.startswith(_REFUSED_DOUBLE))
                if double and entry is not None:  # the first sent under its id goes on
                    if not complete:
                        self._line_entry = (key, entry)
                    return head
                line = self._drop_call(key) if entry is not None else None
                if line is not None and complete and after.startswith(_REFUSED_STOPPING):
                    # A stopping daemon refused the call before it started anything (a
                    # graceful restart's last moments): it goes to the next daemon, as one
                    # the host sent a moment later does. It was answered with the error.
                    self._wait(line, key, entry)
                    return b""
                if entry is not None and entry[1] == _LISTEN:
                    self._listen_over(key)
                    if entry[2] and _wants_tools(entry[3]) and after.startswith(',"result"'):
                        # Ended by a stopping daemon (MCP's graceful closure).
                        self.unopened += 1
                        self.ended_in = self.generation
                if (
                    entry is not None
                    and entry[1] == "initialize"
                    and self.initialize is not None
                    and self.initialize[0] == key
                ):
                    if after.startswith(',"error"'):
                        self.initialize = None  # refused: the host may send another
                    else:
                        self._agreed = _agreed_version(text, end)
            if entry is not None and not complete:
                self._line_entry = (key, entry)
            return head
        if head.startswith(_ACK_HEAD) and complete:
            return self._acknowledged(head)
        if head.startswith(_CANCELLED_HEAD) and complete:
            try:
                message = json.loads(head)
                asked_id = message["params"]["requestId"]
            except (ValueError, RecursionError, KeyError, TypeError):
                return head
            with self.lock:
                for host_key, (host_id, daemon_id) in list(self.asked.items()):
                    if _key(daemon_id) == _key(asked_id):
                        del self.asked[host_key]  # withdrawn by the daemon itself
                        if host_id != daemon_id:
                            message["params"]["requestId"] = host_id
                            return json.dumps(message).encode() + b"\n"
                        break
        return head

    def _acknowledged(self, line: bytes) -> bytes:
        """What of a daemon's acknowledgement of a listen goes to the host (``_SWALLOW``,
        ``_TELL``; else all of it)."""
        try:
            params = json.loads(line)["params"]
            subscription = params["_meta"][_SUBSCRIPTION_META]
            honoured = params.get("notifications")
        except (ValueError, RecursionError, KeyError, TypeError, AttributeError):
            return line
        key = _key(subscription)
        with self.lock:
            then = self.at_ack.pop(key, None)
            if then == _SWALLOW:
                return b""
            if key in self.in_flight:
                self.acked.add(key)
        if then == _TELL and type(honoured) is dict and honoured.get("toolsListChanged") is True:
            return line + _stream_changed(subscription)
        return line

    def _write(self, data: bytes | bytearray | memoryview) -> None:
        try:
            _write_all(1, data)
        except BrokenPipeError:
            raise _StdoutGone(EXIT_OK) from None  # the host stopped reading: it is gone
        except OSError as exc:
            # Our stdout (a full disk, an I/O error), not the daemon: not exit 5.
            _say(f"toolsetctl mcp: cannot write to stdout: {exc}\n")
            raise _StdoutGone(EXIT_INTERNAL) from None

    # -- the restart ---------------------------------------------------------------------

    def _abandon(self, *, keep_listens: bool = False) -> None:
        """The daemon went away: answer what it left unanswered, withdraw its questions.
        With ``keep_listens`` (a reconnect), a 2026-07-28 listen left open is kept for the
        next daemon instead (``listens``); else it is answered too."""
        out: list[bytes] = []
        if self._mode == _PASS:
            out.append(b"\n")  # a long line the daemon did not finish: ended, not continued
        self._held.clear()  # a shorter one: never shown
        if self._line_entry is not None:  # its answer was that line
            with self.lock:
                self._in_flight(*self._line_entry)
        self._mode, self._line_entry = 0, None
        self._head.clear()
        self._swallow = None
        self._unparsed_seen = self._unparsed_mark = 0
        with self.lock:
            self.verdict = None  # taken in flight: it may be
            self.verdict_done.set()
            entries = list(self.in_flight.values())
            for doubles in self.doubles.values():
                entries.extend(doubles)
            self.in_flight.clear()
            self.doubles.clear()
            self.calls.clear()
            self.calls_bytes = 0
            if keep_listens:
                for entry in entries:
                    if entry[1] == _LISTEN and entry[2]:
                        self.listens[_key(entry[0])] = entry
                entries = [entry for entry in entries if not (entry[1] == _LISTEN and entry[2])]
            else:
                entries.extend(self.listens.values())
                self.listens.clear()
                self.acked.clear()
                self.at_ack.clear()
            if self.initialize is not None and any(
                _key(entry[0]) == self.initialize[0] and entry[1] == "initialize"
                for entry in entries
            ):
                self.initialize = None  # answered with an error here: the host may send another
                self.initialized = False
            asked = list(self.asked.values())
            self.asked.clear()
        out.extend(_gone_answer(entry, "sent") for entry in entries)
        for host_id, _ in asked:
            cancelled = {
                "jsonrpc": "2.0",
                "method": "notifications/cancelled",
                "params": {"requestId": host_id, "reason": "toolsetd went away"},
            }
            out.append(json.dumps(cancelled).encode() + b"\n")
        if out:
            self._write(b"".join(out))

    def _flush_replies(self) -> None:
        with self.lock:
            replies, self.replies = self.replies, []
        if replies:
            self._write(b"".join(replies))

    def _fail(self, why: str, code: int) -> int:
        """Reconnecting failed for good: answer everything, say why, end with ``code``."""
        try:
            self._abandon()
            with self.lock:
                waiting, self.waiting, self.waiting_bytes = self.waiting, [], 0
                self.sock = None
                self.replies.extend(
                    _gone_answer(entry, "unsent") for _, _, entry in waiting if entry is not None
                )
            self._flush_replies()
        except _StdoutGone:
            pass
        _say(f"toolsetctl mcp: {why}\n")
        return code

    def _input_ended(self) -> int:
        """The host's input ended while the pump waited for a daemon to come back."""
        return self._fail(
            f"toolsetd at {self.path} closed the connection (the input ended while the pump "
            "waited for it to come back)",
            EXIT_UNREACHABLE,
        )

    def _reconnect(self, deadline: float) -> socket.socket | int:
        """Wait for a daemon at the socket again (``RECONNECT_WINDOW``), bind it, replay the
        host's initialize and send what waited. Returns the socket or the exit code."""
        try:
            self._abandon(keep_listens=True)
        except _StdoutGone as exc:
            return exc.code
        delay = _BACKOFF_FIRST
        gone = (
            f"toolsetd at {self.path} closed the connection and did not come back within "
            f"{RECONNECT_WINDOW:.0f} s"
        )
        while True:
            why = gone
            try:
                self._flush_replies()
            except _StdoutGone as exc:
                return exc.code
            if self.stdin_closed.is_set():
                return self._input_ended()
            try:  # a daemon starting or busy may have a full backlog for a while
                left = deadline - time.monotonic()
                sock = _connect(self.path, min(CONNECT_TIMEOUT, max(left, _BACKLOG_RETRY)))
            except _Backlog:
                sock = None
                why = (
                    f"toolsetd at {self.path} closed the connection, and the listen backlog "
                    f"at the socket stayed full until {RECONNECT_WINDOW:.0f} s had passed"
                )
            except _Refused as exc:
                return self._fail(str(exc), EXIT_UNREACHABLE)
            if sock is not None:
                bound = self._rebind(sock)
                if bound is None:
                    return self._resume(sock)
                sock.close()
                if bound[0] not in _BIND_RETRY:
                    return self._fail(
                        f"toolsetd at {self.path} closed the connection, and binding a new "
                        f"one failed: {bound[1]}",
                        bound[0],
                    )
            left = deadline - time.monotonic()
            if left <= 0:
                return self._fail(why, EXIT_UNREACHABLE)
            self.wake.wait(min(delay, left))
            self.wake.clear()
            delay = min(delay * 2, _BACKOFF_MAX)

    def _rebind(self, sock: socket.socket) -> tuple[int, str] | None:
        """Bind a new connection as the first was: None, or the exit code and the reason
        (-32010, -32008 and a close before the answer are tried again)."""
        try:
            sock.settimeout(CONNECT_TIMEOUT)
            sock.sendall(json.dumps(self.bind).encode() + b"\n")
            answer = b""
            while b"\n" not in answer:
                data = sock.recv(65536)
                if not data:
                    return _RETRY, f"toolsetd at {self.path} closed the connection"
                answer += data
                if len(answer) > _BIND_LINE_MAX:
                    return EXIT_UNREACHABLE, "unexpected answer to mcp.bind"
            sock.settimeout(None)
        except OSError as exc:
            return _RETRY, f"lost the connection to toolsetd at {self.path}: {exc}"
        line, _, rest = answer.partition(b"\n")
        if rest:  # the daemon sends nothing unasked before the first request
            return EXIT_UNREACHABLE, "unexpected answer to mcp.bind"
        error = _bind_error(line)
        if error is None:
            self.held_max = _line_limit(line)
        return error

    def _resume(self, sock: socket.socket) -> socket.socket | int:
        """The new daemon is bound: restore the session on it, then send what waited."""
        replay: list[bytes] = []
        changed: list[object] = []  # the listens told list_changed
        self.send_lock.acquire()  # released by the sender below, once all of it is sent
        with self.lock:
            ended = self.stdin_closed.is_set()
            # Only a session that was initialized before the restart is told list_changed:
            # an initialize that waited for this daemon is answered after it (MCP: no
            # notification before the initialize's answer).
            legacy = self.initialize is not None
            if not ended:
                self.generation += 1
                if self.initialize is not None:
                    replay_id = f"{_REPLAY_ID}{self.token}-{self.generation}"
                    self._swallow = replay_id
                    replay.append(_request_line(replay_id, "initialize", self.initialize[1]))
                    # The host's lines (and its initialized) wait for the answer: one that
                    # refuses the session ends the pump, and they must not have run.
                    self.gated = True
                # The host's open listens, as it sent them: its streams go on. One the host
                # saw acknowledged is not acknowledged again (the new daemon's is dropped),
                # and is told list_changed at once when it asked for it: the catalog may
                # differ now. One that was not is, by the new daemon, and then told.
                for key, open_listen in self.listens.items():
                    replay.append(_request_line(open_listen[0], _LISTEN, open_listen[3]))
                    self._sending(key, open_listen)
                    wanted = _wants_tools(open_listen[3])
                    if key in self.acked:
                        self.at_ack[key] = _SWALLOW
                        if wanted:
                            changed.append(open_listen[0])
                    elif wanted:
                        self.at_ack[key] = _TELL
                self.listens.clear()
                if not self.gated:
                    replay.extend(self._take_waiting())
                self.sock = sock
        if ended:
            self.send_lock.release()
            sock.close()
            return self._input_ended()
        # Sent by a thread of its own while this one reads: what waited may be answered at
        # length, and a daemon whose output waits reads nothing more.
        sender = threading.Thread(target=self._send_held, args=(sock, b"".join(replay)))
        sender.daemon = True
        sender.start()
        try:
            self._flush_replies()
            if legacy:  # the catalog may differ now
                self._write(b'{"jsonrpc":"2.0","method":"notifications/tools/list_changed"}\n')
            for subscription in changed:
                self._write(_stream_changed(subscription))
        except _StdoutGone as exc:
            return exc.code
        return sock

    def _take_waiting(self) -> list[bytes]:
        """The host's lines that waited, going to the daemon now (``lock`` held)."""
        lines = []
        for line, key, entry in self.waiting:
            if entry is not None:
                self._sending(key, entry)
                self._opening(key, entry)
                self._keep_call(key, entry, line)
            lines.append(line)
        self.waiting, self.waiting_bytes = [], 0
        return lines

    def _open_gate(self, sock: socket.socket) -> None:
        """The new daemon agreed to the replayed initialize: send the host's initialized
        and the lines that waited, by a thread of its own (``_resume``'s reason)."""
        sender = threading.Thread(target=self._send_gated, args=(sock,))
        sender.daemon = True
        sender.start()

    def _send_gated(self, sock: socket.socket) -> None:
        with self.send_lock:  # before the gate opens: a line read after it goes after these
            with self.lock:
                if self.sock is not sock or not self.gated:
                    return  # gone again meanwhile: they wait for the next daemon
                initialized = b'{"jsonrpc":"2.0","method":"notifications/initialized"}\n'
                lines = [initialized] if self.initialized else []
                lines.extend(self._take_waiting())
                self.gated = False
                ended = self.stdin_closed.is_set()
            try:
                sock.sendall(b"".join(lines))
            except OSError:
                return  # gone again: ``_copy`` sees it
            if ended:  # the stdin thread left the half-close to this one
                _half_close(sock)

    def _send_held(self, sock: socket.socket, data: bytes) -> None:
        """Send ``data`` with ``send_lock`` held already (``_resume``), then release it."""
        try:
            sock.sendall(data)
        except OSError:
            pass  # gone again: ``_copy`` sees it
        finally:
            self.send_lock.release()


#: The bytes a long line's scan stops at: outside a string, and within one.
_OUTSIDE = re.compile(rb'[\\"{}\[\]]')
_INSIDE = re.compile(rb'[\\"]')
#: The most bytes of a long line's outer object kept (its nested values left out).
_TOP_MAX = 64 << 10
#: What a nested value is kept as in the outer object: no id, method or params is a list.
_HOLE = b"[]"
#: ``_skim``'s tools: a backslash and a byte of note it escapes; the brackets as ``(`` and
#: ``)`` (every other byte dropped).
_ESCAPED_PAIRS = (b'\\"', b"\\{", b"\\}", b"\\[", b"\\]")
_AS_PARENS = bytes.maketrans(b"{[}]", b"(())")
#: ``_extremes``'s: the brackets as bits (``(`` is 1).
_AS_BITS = bytes.maketrans(b"()", b"10")
#: ``_skim``'s answer: the lowest, the last and the highest depth, within a string, after a
#: backslash.
_Skimmed = tuple[int, int, int, bool, bool]
#: The deepest nesting the daemon's parser (orjson) reads: a line nested deeper is a
#: parse error (id null), no request.
_NESTING_MAX = 1024
#: The bytes a long line's nested value is read by hand (``_LongLine._within``) around the
#: end ``_skim`` found; ``_skim`` narrows everything else down to that.
_BY_HAND = 64


@functools.cache
def _skim_tables() -> tuple[bytes, bytes, bytes, bytes]:
    """``_skim``'s bytes that are no bracket, and ``_extremes``'s depth at the end of each
    byte of eight steps (the first the highest bit), and the lowest and the highest within
    it (with the depth before it), as signed bytes. Made at the first long line: 2 ms that
    no pump start pays."""
    not_bracket = bytes(set(range(256)) - set(b"{}[]"))
    steps = [[2 * bin(b >> (8 - i)).count("1") - i for i in range(9)] for b in range(256)]
    change = bytes(depths[8] & 0xFF for depths in steps)
    low = bytes(min(depths) & 0xFF for depths in steps)
    high = bytes(max(depths) & 0xFF for depths in steps)
    return not_bracket, change, low, high


def _skim(piece: bytes, in_string: bool, escaped: bool, room: int) -> _Skimmed:
    """JSON text read in C (its bytes split, translated, replaced), never a byte at a time:
    the lowest depth reached relative to its start (0 or below), the depth at its end, the
    highest reached (exact when above ``room``, else no more than ``room``), and whether
    it ends within a string and after a backslash.

    ``in_string`` and ``escaped`` say where it begins. A byte after a backslash is passed
    over wherever it is (as ``_LongLine._by_hand`` does; outside a string it is no JSON);
    quotes then bound the strings, whose brackets do not count. The brackets outside are
    ``(`` and ``)``: a peak (``(())``) taken out leaves the lowest depth as it was and the
    highest one lower, and what is left without one is ``)...)(...(``. A line of
    ``[{},{},...]`` or of small objects cost a Python step a byte; this is some ten
    passes in C over each byte.
    """
    if escaped:
        if not piece:
            return 0, 0, 0, in_string, True
        piece = piece[1:]
        escaped = False
    if b"\\" in piece:
        piece = piece.replace(b"\\\\", b"")  # then each backslash left escapes the next byte
        for pair in _ESCAPED_PAIRS:
            piece = piece.replace(pair, b"")
        if piece.endswith(b"\\"):
            piece, escaped = piece[:-1], True
    parts = piece.split(b'"')
    outside = b"".join(parts[1::2] if in_string else parts[::2])
    if not len(parts) % 2:
        in_string = not in_string
    parens = left = outside.translate(_AS_PARENS, _skim_tables()[0])
    peaks = 0  # each pass takes one from the highest
    while b"()" in left:
        before = len(left)
        left = left.replace(b"()", b"")
        peaks += 1
        if 2 * len(left) > before:  # deeper peaks, whatever their shape: summed
            low, change, high = _extremes(left)
            break
    else:
        closes = left.count(b")")
        low, change = -closes, len(left) - 2 * closes
        high = max(0, change)
    high += peaks  # no lower than the highest
    if high > room:  # maybe too deep: exactly
        low, change, high = _extremes(parens)
    return low, change, high, in_string, escaped


def _extremes(parens: bytes) -> tuple[int, int, int]:
    """The lowest depth (0 or below), the depth at the end and the highest depth (0 or
    above) of ``(`` and ``)`` steps from depth 0, eight steps a byte (an ``int`` of them
    in base 2, read in C) so that the sums left to Python are an eighth of the steps."""
    import array  # only here (a long line nested in peaks upon peaks): 0.3 ms at start
    import itertools
    import operator

    whole = len(parens) - len(parens) % 8
    eights = (
        int(parens[:whole].translate(_AS_BITS), 2).to_bytes(whole // 8, "big") if whole else b""
    )
    _, byte_change, byte_low, byte_high = _skim_tables()
    changes = array.array("b", eights.translate(byte_change))
    lows = array.array("b", eights.translate(byte_low))
    highs = array.array("b", eights.translate(byte_high))
    low = min(map(operator.add, itertools.accumulate(changes, initial=0), lows), default=0)
    high = max(map(operator.add, itertools.accumulate(changes, initial=0), highs), default=0)
    depth = sum(changes)
    for step in parens[whole:]:  # the last steps, fewer than eight
        depth += 1 if step == 40 else -1  # "("
        low, high = min(low, depth), max(high, depth)
    return min(low, 0), depth, max(high, 0)


class _LongLine:
    """A host line over ``_HELD_LINE_MAX``, scanned as it streams to the daemon: its outer
    object's own bytes are kept (``top``), each value nested in it as ``[]``, enough to tell
    its id and method wherever they are in the line (a TypeScript host's id comes last).

    The outer object's own bytes are read by hand (a Python step for each quote, bracket
    and backslash: at most ``_TOP_MAX`` of them are kept, and a line whose outer object is
    longer is not read further). A nested value is read by ``_skim`` for where it ends,
    however it is made: a Python step a byte took 3 to 9 s of CPU for 18 MB of
    ``[{},{},...]`` or of small objects, strings or escapes, which a host could send.
    """

    def __init__(self) -> None:
        self.depth = 0
        self.in_string = False
        self.escaped = False
        self.top = bytearray()
        #: Nothing more is read: the outer object passed _TOP_MAX, or the nesting
        #: _NESTING_MAX.
        self.over = False
        #: Where each value nested in the outer object begins and ends in the line.
        self.nested: list[tuple[int, int]] = []
        self._fed = 0  # the line's bytes fed before
        self.answer = False  # a host answer (``_Pump._long_answer``)

    def feed(self, data: bytes | bytearray) -> None:
        pos, size = 0, len(data)
        while pos < size and not self.over:
            if self.depth < 2:
                pos = self._by_hand(data, pos, size)
                continue
            pos = self._within(data, pos, size)
            if pos < size:  # the nested value ends within _BY_HAND bytes of here
                pos = self._by_hand(data, pos, size)
        self._fed += size

    def _within(self, data: bytes | bytearray, pos: int, size: int) -> int:
        """Pass over a nested value's bytes from ``pos``, in C (``_skim``): to ``size`` when
        it does not end before, else to ``_BY_HAND`` bytes or less before its end. The
        bytes skimmed double from ``_BY_HAND`` until they hold its end, which is then
        halved down to: the bytes up to its end are skimmed some four times in all, and an
        outer object of many small members is not skimmed to ``size`` for each."""
        end = ends_by = min(size, pos + 4 * _BY_HAND)
        while True:
            room = _NESTING_MAX - self.depth
            skimmed = _skim(bytes(data[pos:end]), self.in_string, self.escaped, room)
            if self.depth + skimmed[0] > 1:  # it does not end here: go on after it
                if skimmed[2] > room:  # the daemon refuses the line: no request
                    self.over = True
                    return size
                self.depth += skimmed[1]
                self.in_string, self.escaped = skimmed[3], skimmed[4]
                if end == size:
                    return size
                if end == ends_by:  # still looking for its end: twice as far
                    ends_by = min(size, end + 2 * (end - pos))
                pos, end = end, ends_by
                continue
            ends_by = end  # it ends within data[pos:ends_by]
            if ends_by - pos <= _BY_HAND:
                return pos
            end = (pos + ends_by) // 2

    def _by_hand(self, data: bytes | bytearray, pos: int, size: int) -> int:
        """Read from ``pos`` a byte of note at a time, up to ``size`` or to where the
        depth changes between the outer object and a value nested in it."""
        top = self.depth < 2
        while pos < size:
            if self.escaped:
                self.escaped = False
                self._keep(data[pos : pos + 1])
                pos += 1
                continue
            found = (_INSIDE if self.in_string else _OUTSIDE).search(data, pos)
            end = size if found is None else found.start()
            self._keep(data[pos:end])
            if found is None:
                return size
            char = data[end : end + 1]
            pos = end + 1
            if char == b"\\":
                self.escaped = True
                self._keep(char)
            elif char == b'"':
                self.in_string = not self.in_string
                self._keep(char)
            elif char in (b"{", b"["):
                self.depth += 1
                if self.depth > _NESTING_MAX:  # the daemon refuses the line: no request
                    self.over = True
                    return size
                if self.depth == 1:
                    self.top += char
                elif self.depth == 2:  # a nested value is kept as []
                    self.top += _HOLE
                    self.nested.append((self._fed + end, -1))
                    return pos
            else:
                self._keep(char)
                self.depth -= 1
                if not top and self.depth < 2:
                    if self.nested:
                        self.nested[-1] = (self.nested[-1][0], self._fed + pos)
                    return pos
        return pos

    def _keep(self, data: bytes | bytearray) -> None:
        if self.depth <= 1 and data:
            self.top += data
            if len(self.top) > _TOP_MAX:
                self.over = True

    def so_far(self) -> dict[str, object] | None:
        """The outer object's members read so far (each nested value ``[]``), while within
        a value nested in it; else None."""
        if self.over or self.depth < 2:
            return None
        try:
            message = json.loads(self.top + b"}")
        except ValueError:
            return None
        return message if type(message) is dict else None

    def with_id(self, head: bytes, request_id: object) -> bytes | None:
        """``head``, the line's bytes fed so far (``so_far`` has members), with
        ``request_id`` for each ``id`` in it, the rest as the host wrote it."""
        text = self.top.decode() + "}"
        try:
            members = _members(text)
        except ValueError:
            return None
        pieces, _ = _id_rewritten(text, members, self.texts(text, members, head), request_id)
        return b"".join(pieces)  # up to the end of head, within the last nested value

    def texts(
        self, text: str, members: list[tuple[object, int, int]], line: bytes
    ) -> dict[int, bytes]:
        """The text in ``line`` of each nested value, by where its ``[]`` begins in
        ``text``, the outer object as kept (the last to the end of ``line`` when it has not
        ended yet)."""
        holes = [start for _, start, _ in members if text.startswith("[", start)]
        return {
            start: line[begins:] if ends < 0 else line[begins:ends]
            for start, (begins, ends) in zip(holes, self.nested, strict=False)
        }

    def answered(self) -> tuple[object] | None:
        """The id of the answer the whole line is (in a tuple), or None."""
        message = self._message()
        if message is None or "method" in message:
            return None
        return (message.get("id"),) if "result" in message or "error" in message else None

    def _message(self) -> dict[str, object] | None:
        if self.over:
            return None
        try:
            message = json.loads(self.top)
        except (ValueError, RecursionError):
            return None
        return message if type(message) is dict else None

    def request(self, *, modern: bool) -> tuple[object, _Entry] | None:
        """The key and entry of the request the line is, or None (not one, or not told)."""
        message = self._message()
        method = None if message is None else message.get("method")
        if message is None or not isinstance(method, str):
            return None
        request_id = message.get("id")
        key = _key(request_id)
        if key is None:
            return None
        return key, (request_id, method, modern, None)


class _StdoutGone(Exception):
    """stdout cannot be written: the pump ends with ``code``."""

    def __init__(self, code: int) -> None:
        super().__init__(code)
        self.code = code


def _no_constant(name: str) -> object:
    """``NaN``, ``Infinity``, ``-Infinity``: Python's, not JSON's (``_HOST_DECODER``)."""
    raise ValueError(f"{name} is not JSON")


#: The standard library's parser without its extras (``NaN``, ``Infinity``), as the daemon's.
_HOST_DECODER = json.JSONDecoder(parse_constant=_no_constant)
#: A surrogate's escape (``\\ud800`` to ``\\udfff``), or a backslash's and then such text.
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")
_SPACE = re.compile(r"[ \t\n\r]*")


def _host_message(line: bytes) -> object:
    """A host line parsed as the daemon parses it, or ``_ABSENT`` for a line the daemon
    refuses (a parse error, with id null: the daemon cannot tell whose it is, so the
    request is not in flight; a line ``null`` is JSON, which the daemon answers -32600).
    ``json.loads`` alone took what the daemon's parser (orjson) refuses: ``NaN`` or
    ``Infinity``, a lone surrogate (``\\ud800``, as Python writes a file name's
    undecodable bytes), a surrogate written in UTF-8; the request stayed in flight for
    ever (a call's line kept too, in the 4 MiB ``calls``), and a restart answered it:
    "the tool may have run", of a call that never ran."""
    try:
        text = line.decode()  # strict: no surrogate written in UTF-8
        message = _HOST_DECODER.decode(text)
        if _SURROGATE_ESCAPE.search(text) is not None:  # is each one paired?
            json.dumps(message, ensure_ascii=False).encode()  # a lone one: a ValueError
    except ValueError:
        return _ABSENT
    except RecursionError:
        deep = _deep_message(line)  # nested so deep, it is no null
        return _ABSENT if deep is None else deep
    return message


def _deep_message(data: bytes | str) -> object:
    """A host line (or a part of one) nested past what Python's json reads (some 990
    levels), read by the daemon's own parser (orjson: 1,024 levels), or None where that
    refuses it too. The pump took such a line for a parse error while the daemon served
    it: its request was not in flight (nobody answered it when the daemon went away), its
    initialize not replayed, its cancel not seen."""
    try:
        from toolsetd.protocol.jsontext import loads  # orjson: only for such a line
    except ImportError:  # its install went under the pump (a venv made anew): as before
        return None
    try:
        return loads(data)
    except (ValueError, MemoryError):
        return None


def _key(value: object) -> object:
    """A request id as a dict key (1 and "1" are two ids), or None for no id."""
    if type(value) is str:
        return value
    if type(value) is int:
        return (value,)
    return None


def _id_room(request_id: object) -> int:
    """The most bytes the daemon's encoding of a request id (a str or an int) takes: 6 a
    character (an escape), a digit each (an int's are at most the 4,300 ``json`` parses).
    A long int's head was read cut short, its id taken for another, and its answer left
    in flight: answered again by the pump at the next restart."""
    if type(request_id) is str:
        return 6 * len(request_id)
    return len(str(request_id)) if type(request_id) is int else 0


def _params_text(line: bytes) -> object:
    """The text of a host request's ``params``, as the host wrote it (the last, as a parse
    keeps it), or ``_ABSENT``; the line is an object (``_host_message`` parsed it)."""
    outer = _outer(line)
    if outer is None:
        return _ABSENT
    text, members, nested = outer
    found: object = _ABSENT
    for name, start, end in members:
        if name == "params":
            found = nested[start].decode() if start in nested else text[start:end]
    return found


def _with_id(line: bytes, request_id: object) -> bytes | None:
    """A host line (an object, parsed) with ``request_id`` for its ``id`` (each, as a parse
    keeps the last), the rest as the host wrote it; None when it cannot be read so (an
    outer object over ``_TOP_MAX`` nested past Python's json). Parsed and written again,
    a number past the double range (``1e999``, which the daemon takes) became
    ``Infinity``, which no JSON parser takes: the daemon never had the host's answer."""
    outer = _outer(line)
    if outer is None:
        return None
    text, members, nested = outer
    pieces, end = _id_rewritten(text, members, nested, request_id)
    return b"".join(pieces) + text[end:].encode()


def _id_rewritten(
    text: str, members: list[tuple[object, int, int]], nested: dict[int, bytes], request_id: object
) -> tuple[list[bytes], int]:
    """The pieces of an object's text (``_outer``'s) up to its last member's value, with
    ``request_id`` for each ``id``, and where that value ends."""
    out: list[bytes] = []
    pos = 0
    for name, start, end in members:
        out.append(text[pos:start].encode())
        if name == "id":
            out.append(json.dumps(request_id).encode())
        else:
            out.append(nested.get(start) or text[start:end].encode())
        pos = end
    return out, pos


def _outer(line: bytes) -> tuple[str, list[tuple[object, int, int]], dict[int, bytes]] | None:
    """A host line (an object, parsed) read for its members: its text, and each member's
    name and where its value's text begins and ends in it. A line nested past Python's
    json (which the daemon's parser reads) is its outer object as ``_LongLine`` keeps it,
    each nested value ``[]``, whose text in the line is given by where it begins there
    (else no such text is: the line's text is whole); None when that is over
    ``_TOP_MAX``."""
    text = line.decode()
    try:
        return text, _members(text), {}
    except RecursionError:
        pass
    scan = _LongLine()
    scan.feed(line)
    if scan.over:
        return None
    text = scan.top.decode()
    members = _members(text)
    return text, members, scan.texts(text, members, line)


def _members(text: str) -> list[tuple[object, int, int]]:
    """The members of the JSON object ``text``: each name, and where its value's text
    begins and ends.

    Raises:
        RecursionError: A value nested past Python's json.
    """
    members: list[tuple[object, int, int]] = []
    pos = _skip(text, 0) + 1  # past the "{"
    while True:
        pos = _skip(text, pos)
        if text[pos] == "}":
            return members
        name, pos = _HOST_DECODER.raw_decode(text, pos)
        pos = _skip(text, _skip(text, pos) + 1)  # past the ":"
        end = _HOST_DECODER.raw_decode(text, pos)[1]
        members.append((name, pos, end))
        pos = _skip(text, end)
        if text[pos] == ",":
            pos += 1


def _skip(text: str, pos: int) -> int:
    """The position of the first character at ``pos`` or after that is no JSON space."""
    space = _SPACE.match(text, pos)
    return pos if space is None else space.end()


def _request_line(request_id: object, method: str, params: object) -> bytes:
    """A request of the host's as the pump sends it again (``_resume``): its params' text
    as the host wrote it (``_params_text``), none where it sent none (``_ABSENT``). Parsed
    and written again, a number past the double range (``1e999``, which the daemon takes)
    became ``Infinity``, which no JSON parser takes: the new daemon refused the replayed
    initialize with a parse error, whose id is null, and the host's lines waited behind it
    for ever."""
    head = json.dumps({"jsonrpc": "2.0", "id": request_id, "method": method})
    if type(params) is not str:
        return head.encode() + b"\n"
    return f'{head[:-1]}, "params": {params}}}\n'.encode()


def _half_close(sock: socket.socket) -> None:
    """The host's input ended and all of it is sent (``send_lock`` held): the daemon
    cancels this host's calls and closes the connection."""
    try:
        sock.shutdown(socket.SHUT_WR)
    except OSError:
        pass


def _wants_tools(params: object) -> bool:
    """Whether a listen's params (their text) ask for ``notifications/tools/list_changed``."""
    if isinstance(params, str):
        text = params
        try:
            params = json.loads(text)
        except RecursionError:  # the daemon read it: so does its parser
            params = _deep_message(text)
    wanted = params.get("notifications") if type(params) is dict else None
    return type(wanted) is dict and wanted.get("toolsListChanged") is True


def _stream_changed(subscription: object) -> bytes:
    """The pump's ``notifications/tools/list_changed`` on the host's listen stream."""
    notification = {
        "jsonrpc": "2.0",
        "method": "notifications/tools/list_changed",
        "params": {"_meta": {_SUBSCRIPTION_META: subscription}},
    }
    return json.dumps(notification).encode() + b"\n"


def _cancellable(entry: _Entry | None) -> bool:
    """Whether a host request is unanswered once cancelled (an initialize is answered)."""
    return entry is not None and entry[1] != "initialize"


def _gone_answer(entry: _Entry, why: str) -> bytes:
    """The pump's answer to a host request the daemon did not answer: for ``tools/call`` an
    ``isError`` result, else a JSON-RPC error. ``why``: "sent" (the daemon went away with
    it), "cut" (with part of it), "unsent" (it waited, and no daemon came back) or
    "overflow" (too much waited)."""
    request_id, method, modern, _ = entry
    if why == "sent":
        text = "toolsetd went away while it served this request (it stopped or restarted)" + (
            "; the tool may have run: check before calling it again."
            if method == "tools/call"
            else "."
        )
    elif why == "cut":
        text = (
            "toolsetd restarted while the request was being sent to it (a line over "
            f"{_HELD_LINE_MAX} bytes, or over toolsetd's line limit, which the pump does not "
            "hold to send again); the "
            "request was not run."
        )
    elif why == "unsent":
        text = (
            "toolsetd went away, and the pump could not reconnect to it (its stderr says "
            "why); the request was not sent."
        )
    else:
        text = (
            f"toolsetd is restarting, and more than {_WAITING_MAX} bytes of requests already "
            "wait for it; the request was not sent."
        )
    message: dict[str, object] = {"jsonrpc": "2.0", "id": request_id}
    if method == "tools/call":
        result: dict[str, object] = {"content": [{"type": "text", "text": text}], "isError": True}
        if modern:
            result = {"resultType": "complete", **result}
        message["result"] = result
    else:
        message["error"] = {"code": -32603, "message": f"Internal error: {text}"}
    return json.dumps(message).encode() + b"\n"


def _agreed_version(text: str, end: int) -> object:
    """The ``protocolVersion`` of an initialize's result, from its head's text after the
    id (which ends at ``end``); None when it is not where the daemon puts it."""
    if not text.startswith(_AGREED_HEAD, end):
        return None
    try:
        return _DECODER.raw_decode(text, end + len(_AGREED_HEAD))[0]
    except (ValueError, RecursionError):
        return None


def _error_text(head: bytes, complete: bool) -> str:
    """The message of an error response's line (its head, when that is all there is)."""
    if complete:
        try:
            error = json.loads(head).get("error")
            if isinstance(error, dict):
                return str(error.get("message"))[:300]
        except (ValueError, RecursionError, AttributeError):
            pass
    return head[:300].decode("utf-8", "replace")


def _outwaited(bound: threading.Event, path: str) -> None:
    """``_EXIT_GRACE`` after stdin closed, the peer still holds the connection: end. A
    session that was bound ended well enough (its host is gone); a bind never answered (a
    wedged daemon, a program that is no toolsetd) is said, and is no success."""
    if bound.is_set():
        os._exit(EXIT_OK)
    _say(f"toolsetctl mcp: toolsetd at {path} did not answer mcp.bind\n")
    os._exit(EXIT_UNREACHABLE)


def _bind_error(line: bytes) -> tuple[int, str] | None:
    """None when the bind's response is a success, else the exit code and the message."""
    # A peer whose answer is no JSON-RPC response (another program's socket, a daemon of
    # another protocol) broke the protocol: exit 5, as for every command, not the 2 that
    # sends the operator to check the options, the workspace and the mode.
    try:
        reply = json.loads(line)
    except (ValueError, RecursionError):  # the stdlib decoder recurses once per level
        return EXIT_UNREACHABLE, "the daemon's answer to mcp.bind is not JSON"
    if isinstance(reply, dict) and isinstance(reply.get("result"), dict):
        return None
    error = reply.get("error") if isinstance(reply, dict) else None
    if isinstance(error, dict):
        code = error.get("code")
        if code == -32601:  # an older daemon, still running after an upgrade: not usage
            return EXIT_INTERNAL, (
                "this toolsetd does not serve MCP (mcp.bind is unknown): upgrade it and restart it"
            )
        from toolsetd.protocol.printable import printable  # as ``_say``: see ``_hold_words``

        exit_code = _BIND_EXITS.get(code, EXIT_INTERNAL) if type(code) is int else EXIT_UNREACHABLE
        return exit_code, printable(str(error.get("message")))
    return EXIT_UNREACHABLE, "unexpected answer to mcp.bind"


def _line_limit(line: bytes) -> int:
    """The longest host line to hold whole for the daemon whose bind succeeded with
    ``line``: its ``maxMessageBytes`` (an older daemon says none), ``_HELD_LINE_MAX`` at
    most."""
    limit = json.loads(line)["result"].get("maxMessageBytes")
    return min(limit, _HELD_LINE_MAX) if type(limit) is int and limit > 0 else _HELD_LINE_MAX


def _hold_words() -> None:
    """Once the first bind is answered, load what the pump's last words are written with
    (``_say``, ``_bind_error``): it lives as long as its host's session, and its install
    may be upgraded or removed meanwhile (``pip install -U``, a venv made anew). Loaded
    then, at its ending, an ``ImportError`` ended it with exit 1 and a traceback, in place
    of exit 5 and what happened. Not at the start, where every host waits for the pump
    (0.6 ms here)."""
    import toolsetd.protocol.printable  # noqa: F401 - kept in sys.modules for _say


def _say(text: str) -> None:
    """Write ``text`` to stderr; a stderr that cannot be written (``2>/dev/full``, a log on
    a full disk, a closed pipe) loses the line, and only the line: the OSError must not
    become Python's exit 1, nor stop an autostart that was about to say it was starting.

    What the line quotes (an option as typed, the socket path, the daemon's words) is shown
    with its control characters escaped, as every other command shows them: an ESC in
    ``toolsetctl mcp --x$'\\e]0;...'`` or in ``$TOOLSETD_SOCKET`` reached the terminal. And
    no CI runner takes it for a command (``inert_line``, as ``render``'s lines): a socket
    path holding ``##vso[``, or a newline then ``::add-mask::``, was one in a job's log."""
    from toolsetd.protocol.printable import inert_line, printable  # re: loaded with json

    text = "\n".join(inert_line(printable(line)) for line in text.split("\n"))
    try:
        sys.stderr.write(text)
        sys.stderr.flush()
    except (OSError, ValueError):
        # What it still buffers goes to /dev/null, not to a second failure at exit.
        try:
            devnull = os.open(os.devnull, os.O_WRONLY)
        except OSError:
            return
        try:
            os.dup2(devnull, 2)
        except OSError:
            pass
        finally:
            os.close(devnull)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the pump; returns the exit code (see the module docstring).

    SIGINT (a host stopping its servers, Ctrl-C) ends it with 130 and no traceback: the
    socket closes with the process, and the daemon cancels this host's calls.
    """
    try:
        return _main(argv)
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED


def _main(argv: Sequence[str] | None) -> int:
    try:
        options = _parse(sys.argv[1:] if argv is None else argv)
    except _Usage as exc:
        _say(f"{_USAGE}\ntoolsetctl mcp: error: {exc}\n")
        return EXIT_USAGE
    if options.get("help"):
        try:
            _write_all(1, _HELP.encode())
        except BrokenPipeError:
            pass  # the reader went away (toolsetctl mcp --help | true), as for the others
        except OSError as exc:
            _say(f"toolsetctl mcp: cannot write to stdout: {exc}\n")
            return EXIT_INTERNAL
        return EXIT_OK
    socket_option = options.get("socket")
    path = default_socket_path(option=str(socket_option) if socket_option else None)
    try:  # the current folder may have been removed (a CI step's, a deleted checkout)
        # ~ as toolsetctl's other commands read it: a host's config has no shell to expand it
        given = os.path.expanduser(str(options.get("workspace") or os.getcwd()))
        workspace = absolute_path(given)
    except OSError as exc:
        _say(
            f"toolsetctl mcp: error: the current folder cannot be used ({exc.strerror}): "
            "run it from an existing folder, or pass --workspace DIR\n"
        )
        return EXIT_USAGE
    if not workspace.isascii():
        from toolsetd.protocol.jsontext import is_utf8  # orjson: only for such a path

        given, workspace = workspace, wire_text(workspace)  # the bytes, read as UTF-8
        if not is_utf8(workspace):
            _say(
                f"toolsetctl mcp: error: the workspace {os.fsencode(given)!r} is not "
                "UTF-8, and toolsetd takes UTF-8 paths only; run it in (or pass --workspace) "
                "a directory whose path is UTF-8.\n"
            )
            return EXIT_USAGE
    try:
        sock = _connect(path)
    except _Refused as exc:
        _say(f"toolsetctl mcp: {exc}\n")
        return EXIT_UNREACHABLE
    if sock is None:
        if not options["autostart"]:
            import shlex  # only on the way out

            _say(
                f"toolsetctl mcp: toolsetd is not running at {path} (--no-autostart is set): "
                f"start it (toolsetd --socket {shlex.quote(path)}), or give --socket (or "
                "TOOLSETD_SOCKET) the socket a running toolsetd serves.\n"
            )
            return EXIT_UNREACHABLE
        try:
            sock = _start_daemon(path)
        except OSError as exc:
            _say(f"toolsetctl mcp: cannot start toolsetd: {exc}\n")
            return EXIT_UNREACHABLE
    params: dict[str, object] = {"workspace": workspace, "headless": options["headless"]}
    if options.get("catalog"):
        params["catalog"] = options["catalog"]
    mode = options.get("mode")
    if mode is not None:  # an empty one too: the daemon refuses it, as invoke's
        if not str(mode).isascii():
            mode = wire_text(str(mode))
        params["mode"] = mode
    bind = {"jsonrpc": "2.0", "id": _BIND_ID, "method": METHOD_MCP_BIND, "params": params}
    try:
        sock.sendall(json.dumps(bind).encode() + b"\n")
    except OSError as exc:
        _say(f"toolsetctl mcp: lost the connection to toolsetd at {path}: {exc}\n")
        return EXIT_UNREACHABLE
    pump = _Pump(path, bind, sock)
    # SIGINT blocked while the thread starts, so it and the timer it starts inherit the
    # mask: a signal sent to the process then always reaches this thread, whose recv it
    # interrupts (KeyboardInterrupt, 130). Taken by the stdin thread, it left this one in
    # recv until the daemon closed or the exit timer ended the pump with 0.
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        threading.Thread(target=pump.stdin, daemon=True).start()
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
    return pump.run()
