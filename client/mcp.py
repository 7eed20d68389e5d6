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
   When the daemon closes first (it stopped, or a line was over its size limit), the
   pump says so on stderr and exits 5, also when the host was writing at that moment.

Frames are copied as bytes, unparsed; the daemon answers garbage with JSON-RPC errors.
"""

from __future__ import annotations

import json
import os
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
from .command import absolute_path, wait_ready, wire_text

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
#: ``_pump_socket``: the daemon closed the bound connection (main decides what it means).
_DAEMON_CLOSED = -1
_START_TIMEOUT = 15.0
#: How long a pump whose daemon exited at start waits for the one that holds the path's
#: lock to make its removed socket again (the daemon checks every 2 s).
_HOLDER_WAIT = 3.0
_EXIT_GRACE = 10.0
#: The longest answer to ``mcp.bind`` read before the pump gives up: the real one is a
#: few hundred bytes; a peer that never ends its line must not fill the memory.
_BIND_LINE_MAX = 1 << 20
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
            raise _Usage(f"unrecognized argument: {arg}")
        i += 1
    if options.get("catalog") not in (None, "plan", "work"):
        raise _Usage("--catalog must be plan or work")
    return options


class _Refused(OSError):
    """A listener the pump must not use: another user's at the ``/tmp`` default (not
    toolsetd of ours), or one whose backlog stayed full (no daemon is started beside it)."""


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


def _connect(path: str) -> socket.socket | None:
    """The connected socket, or None when nothing listens (``_start_daemon`` may start one).

    Raises:
        _Refused: Someone else listens there (``shared_tmp_peer_refused``), or the
            listener's backlog stayed full for ``CONNECT_TIMEOUT``: no daemon is started
            (ours would only find the path taken and say "already running").
    """
    if shared_tmp_squatted(path) is not None:
        return None  # then _start_daemon: the daemon refuses the folder and says why
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        # A blocking connect waits for room in a full backlog for as long as it stays
        # full: a wedged daemon held the pump, and its host's MCP start-up, forever.
        connect_within(sock, path, CONNECT_TIMEOUT)
    except TimeoutError:
        sock.close()
        raise _Refused(
            f"toolsetd at {path} accepts no connection: its listen backlog stayed full for "
            f"{CONNECT_TIMEOUT:.0f} s (is the daemon stopped or hung?)"
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


def _write_all(fd: int, data: bytes | memoryview) -> None:
    view = memoryview(data)
    while view:
        try:
            written = os.write(fd, view)
        except BlockingIOError:  # a non-blocking stdout, full: wait until it takes more
            wait_ready(fd, write=True)
            continue
        view = view[written:]


def _pump_stdin(
    sock: socket.socket, stdin_closed: threading.Event, bound: threading.Event, path: str
) -> None:
    """stdin to the socket; at EOF, half-close it so the daemon cancels this host's calls.

    The end of input ends the last message as a newline would (``printf '%s' "$json" |
    toolsetctl mcp``; the SDK's stdio server reads it so): the socket's wire drops a line
    its client left unfinished, so the pump finishes it.
    """
    last = b"\n"
    try:
        while True:
            try:
                data = os.read(0, 65536)
            except BlockingIOError:  # a non-blocking stdin with nothing yet: not its end
                wait_ready(0, write=False)
                continue
            except OSError:
                break  # stdin failed: as good as closed
            if not data:
                if last != b"\n":
                    sock.sendall(b"\n")
                break
            sock.sendall(data)
            last = data[-1:]
    except OSError:
        # The send failed: the daemon closed the connection (it stopped, or restarted)
        # while the host was writing. Not the end of the host's input: the socket's reader
        # sees the close and says so (exit 5); taken for stdin's end, it was an exit 0.
        return
    stdin_closed.set()
    try:
        sock.shutdown(socket.SHUT_WR)
    except OSError:
        pass
    # The daemon closes the connection once the calls are cancelled; do not outwait it.
    timer = threading.Timer(_EXIT_GRACE, _outwaited, (bound, path))
    timer.daemon = True
    timer.start()


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
        if code == -32601:
            return EXIT_USAGE, (
                "this toolsetd does not serve MCP (mcp.bind is unknown): upgrade it and restart it"
            )
        from .table import printable  # only on this path: stdlib, but not free

        exit_code = _BIND_EXITS.get(code, EXIT_INTERNAL) if type(code) is int else EXIT_UNREACHABLE
        return exit_code, printable(str(error.get("message")))
    return EXIT_UNREACHABLE, "unexpected answer to mcp.bind"


def _say(text: str) -> None:
    """Write ``text`` to stderr; a stderr that cannot be written (``2>/dev/full``, a log on
    a full disk, a closed pipe) loses the line, and only the line: the OSError must not
    become Python's exit 1, nor stop an autostart that was about to say it was starting.

    What the line quotes (an option as typed, the socket path, the daemon's words) is shown
    with its control characters escaped, as every other command shows them: an ESC in
    ``toolsetctl mcp --x$'\\e]0;...'`` or in ``$TOOLSETD_SOCKET`` reached the terminal."""
    from toolsetd.protocol.printable import printable  # re: loaded with json already

    text = "\n".join(printable(line) for line in text.split("\n"))
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
            _say(
                f"toolsetctl mcp: toolsetd is not running at {path} (--no-autostart is set): "
                "start it with `toolsetd` or `systemctl --user start toolsetd.socket`\n"
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
    stdin_closed = threading.Event()
    bound = threading.Event()
    # SIGINT blocked while the thread starts, so it and the timer it starts inherit the
    # mask: a signal sent to the process then always reaches this thread, whose recv it
    # interrupts (KeyboardInterrupt, 130). Taken by the stdin thread, it left this one in
    # recv until the daemon closed or the exit timer ended the pump with 0.
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        threading.Thread(
            target=_pump_stdin, args=(sock, stdin_closed, bound, path), daemon=True
        ).start()
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
    code = _pump_socket(sock, path, bound)
    if code == _DAEMON_CLOSED:
        if stdin_closed.is_set():
            return EXIT_OK
        # The daemon ended the session while the host was still there (it stopped, or the
        # host sent a line over the size limit): say so, the host shows it.
        _say(f"toolsetctl mcp: toolsetd at {path} closed the connection\n")
        return EXIT_UNREACHABLE
    return code


def _pump_socket(sock: socket.socket, path: str, bound_event: threading.Event) -> int:
    """The socket to stdout, after reading the bind's response off the front (then
    ``bound_event`` is set)."""
    pending = b""
    bound = False
    try:
        while True:
            data = sock.recv(1 << 20)
            if not data:
                break
            if not bound:
                pending += data
                newline = pending.find(b"\n")
                if newline < 0:
                    if len(pending) > _BIND_LINE_MAX:
                        _say(
                            f"toolsetctl mcp: toolsetd at {path} answered mcp.bind with more "
                            f"than {_BIND_LINE_MAX} bytes and no line end\n"
                        )
                        return EXIT_UNREACHABLE
                    continue
                error = _bind_error(pending[:newline])
                if error is not None:
                    _say(f"toolsetctl mcp: {error[1]}\n")
                    return error[0]
                bound = True
                bound_event.set()
                data, pending = pending[newline + 1 :], b""
                if not data:
                    continue
            try:
                _write_all(1, data)
            except BrokenPipeError:
                return EXIT_OK  # the host stopped reading: it is gone
            except OSError as exc:
                # Our stdout (a full disk, an I/O error), not the daemon: not exit 5.
                _say(f"toolsetctl mcp: cannot write to stdout: {exc}\n")
                return EXIT_INTERNAL
    except OSError as exc:
        _say(f"toolsetctl mcp: lost the connection to toolsetd at {path}: {exc}\n")
        return EXIT_UNREACHABLE
    if not bound:
        _say(f"toolsetctl mcp: toolsetd at {path} closed the connection before binding\n")
        return EXIT_UNREACHABLE
    return _DAEMON_CLOSED
