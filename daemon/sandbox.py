"""The filesystem sandbox: bubblewrap argv for the three profiles.

Theory of operation
-------------------
A sandboxed call's child is ``bwrap <options> -- <the tool's argv>`` (bubblewrap, Debian's
``bubblewrap`` package, what Codex CLI and Claude Code's sandbox runtime use on Linux).
bubblewrap builds a new mount namespace in which:

* ``/`` is bound read-only (``--ro-bind / /``): the whole system stays readable;
* ``/dev`` is a minimal device tree, ``/proc`` the sandbox's own (``--proc``), ``/tmp`` a
  fresh tmpfs: private to the call, gone with it;
* the set's own folder is bound read-only (it may live under the hidden ``/tmp``), where
  it resolves, unless that is in the workspace (``call_binds``);
* the writable paths are bound read-write on top: for ``workspace-write`` the workspace,
  the set's two data folders and, for a call whose outside-workspace paths were approved,
  exactly those paths; for ``read-only`` nothing (the workspace is bound read-only). The
  data folders go through ``call_binds`` first: the project data folder lies in the
  workspace, where any sandboxed call of that workspace can swap a folder for a symlink,
  so it is never bound by its own path (the workspace's bind covers it) and a call whose
  project data folder leads out of the workspace does not run;
* ``/proc`` is the sandbox's own, mounted after the writable binds, so an approved path
  at or under ``/proc`` never shows the host's processes (their ``/proc/<pid>/root``), and
  ``/proc/sys``, ``/proc/sysrq-trigger`` and ``/sys`` are bound read-only over them, so no
  approved path reopens the kernel's settings (see ``bwrap_argv``);
* once all of it is built (the hiding below included), bubblewrap waits on a pipe
  (``--block-fd``) before it runs the tool: the daemon checks that each bind is what it
  checked, at its very name (``binds_moved``), since a call that may write a folder above
  another call's workspace can swap that for a symlink between the daemon's checks and the
  mount, and bubblewrap follows it;
* the credential paths are hidden last: a directory under an empty read-only tmpfs, a
  file under ``/dev/null``, so neither a path nor a symlink to it reaches the content; a
  hidden path that is a link is hidden where it leads, and one another mount also shows
  (a bind mount of the home) is hidden there too (``mount_aliases``).
  The daemon's own socket is hidden too (``/dev/null`` over it refuses ``connect``), so
  a tool cannot call the daemon.

**Capabilities.** A daemon running as root (a container, a host where it runs as root)
starts bubblewrap as root, and bubblewrap then *keeps* every capability for the tool unless
told otherwise: with ``CAP_SYS_ADMIN`` in the initial user namespace a tool can
``umount`` the tmpfs over ``~/.ssh``, ``mount -o remount,bind,rw /`` and write anywhere,
or uncover the daemon's socket. ``--cap-drop ALL`` takes them all; bubblewrap also sets
``PR_SET_NO_NEW_PRIVS``, so neither a setuid binary nor a root ``execve`` gives them back.
For a daemon that is not root it changes nothing (the tool had none). ``--unshare-ipc``
gives the call its own System V IPC and POSIX message queues: without it a sandboxed tool
could create, read and write the host's shared memory segments and queues of its user.

``--unshare-pid`` gives the call its own PID namespace (its first process is pid 1 there;
when it dies the kernel kills every process in the namespace, ``setsid``'d grandchildren
included), and ``--die-with-parent`` ties that first process to bubblewrap, which is the
daemon's child: a daemon killed by ``SIGKILL`` takes the whole sandbox with it, sentinel or
not. ``--unshare-net`` (network denied) leaves the call a loopback device only;
abstract Unix sockets are per network namespace, so they go too.

Why bubblewrap and not Landlock (this kernel reports ABI 7): Landlock grants access per
file hierarchy and cannot take a sub-folder (``~/.ssh``) back out of a readable tree; its
network rules cover TCP ``bind``/``connect`` only (UDP and Unix sockets stay); and it must
be applied by the child itself before ``exec``, which a Python daemon can do only through
``preexec_fn`` (forcing ``fork()`` of the whole daemon, running Python in the forked
child) or a helper interpreter per call. bubblewrap needs none of that and gives the PID
namespace too. Its cost is measured in ``bench/bench_confine.py``.

``probe`` runs bubblewrap once with every option the profiles use; a machine where it is
missing or the kernel refuses a namespace gets the reason, for the log and ``status``.
A probe that fails for want of processes, threads or memory (the fork, or bubblewrap's
own, fails with ``EAGAIN`` or ``ENOMEM``) says nothing about this machine's bubblewrap:
it raises ``ProbeShort``, and the daemon tries again later (``Confinement.retry_probes``).
"""

from __future__ import annotations

import contextlib
import enum
import errno
import os
import re
import select
import shutil
import stat
import subprocess
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from .exhaustion import SHORT_OF_ROOM, ProbeShort
from .mountinfo import parse_mountinfo
from .paths import is_within

__all__ = [
    "SETUP_FAILED_PREFIX",
    "Profile",
    "SandboxPlan",
    "bind_identities",
    "binds_moved",
    "bwrap_argv",
    "call_binds",
    "exec_failure",
    "hidden_below_writable",
    "mount_aliases",
    "prepare_writable",
    "probe_bind_check",
    "probe_bwrap",
    "probe_ipc",
    "probe_no_userns",
    "probe_status",
    "sandbox_pid",
    "setup_done",
    "tool_ran",
]

#: bubblewrap's messages start with this; with exit status 1 it means "not set up".
SETUP_FAILED_PREFIX = b"bwrap: "
_PROBE_SECONDS = 10.0
#: The private /tmp: a fresh tmpfs inside the sandbox, not the host's shared one.
_PRIVATE_TMP = ("--tmpfs", "/tmp")  # noqa: S108 -- a mount point in the sandbox, no file
#: What every sandbox gets, whatever its profile (see "Capabilities" in the module doc).
_ALWAYS = ("--die-with-parent", "--unshare-pid", "--cap-drop", "ALL")
#: Its own IPC namespace, where the system allows one (``probe_ipc``).
_OWN_IPC = "--unshare-ipc"
#: Kernel settings a tool must not write, bound read-only after the writable binds
#: (``--ro-bind-try``: a kernel without one has nothing to cover): the sandbox's ``/proc``
#: ones, and the host's whole ``/sys`` again, over an approved path at or under it.
_KERNEL_SETTINGS = ("/proc/sys", "/proc/sysrq-trigger", "/sys")
#: No user namespace of its own: a call that shares the loopback with the daemon's MCP
#: endpoint is told apart by its cgroup, which it must not be able to leave.
_NO_USERNS = ("--unshare-user", "--disable-userns")


#: What bubblewrap says when its own fork or allocation fails so: ``die_with_error``'s
#: ``strerror`` ("bwrap: Creating new namespace failed: Resource temporarily unavailable",
#: "bwrap: Can't fork for pid 1: ...") or ``die_oom``'s words.
_SHORT_WORDS = (
    os.strerror(errno.EAGAIN).encode(), os.strerror(errno.ENOMEM).encode(), b"Out of memory",
)  # fmt: skip


def _short_spawn(binary: str, exc: BaseException) -> ProbeShort | None:
    """The ``ProbeShort`` of a probe whose spawn failed for want of tasks or memory, else
    None."""
    if isinstance(exc, MemoryError):
        return ProbeShort(f"bubblewrap at {binary} cannot run: the daemon is out of memory")
    if isinstance(exc, OSError) and exc.errno in SHORT_OF_ROOM:
        return ProbeShort(
            f"bubblewrap at {binary} cannot run: {exc.strerror} (the daemon is short of "
            "processes, threads, memory or descriptors)"
        )
    if isinstance(exc, subprocess.TimeoutExpired):
        return _slow(f"bubblewrap at {binary}")
    return None


def _slow(what: str) -> ProbeShort:
    """The ``ProbeShort`` of a probe that did not end within ``_PROBE_SECONDS``: a machine
    too busy (swapping, its CPUs taken) at that moment, not a bubblewrap that cannot run."""
    return ProbeShort(f"{what} did not finish within {_PROBE_SECONDS:g} s (the machine is busy)")


def _short_exit(binary: str, returncode: int | None, stderr: bytes) -> ProbeShort | None:
    """The ``ProbeShort`` of a probe whose bubblewrap failed for want of tasks or memory,
    else None."""
    if not returncode or not any(words in stderr for words in _SHORT_WORDS):
        return None
    said = stderr.decode(errors="replace").strip().splitlines()
    return ProbeShort(
        f"bubblewrap at {binary} cannot build its sandbox: {said[-1]} (the daemon is short "
        "of processes, threads or memory)"
    )


class Profile(enum.StrEnum):
    """What a sandboxed call may touch."""

    OFF = "off"
    WORKSPACE_WRITE = "workspace-write"
    READ_ONLY = "read-only"


@dataclass(frozen=True, slots=True)
class SandboxPlan:
    """The sandbox of one call.

    Attributes:
        profile: The profile (never ``off`` here).
        network: Whether the call keeps the host's network.
        readable: Folders bound read-only over the private ``/tmp`` (the set's folder).
        writable: Paths bound read-write, in this order.
        hidden: Paths made unreadable.
        cwd: The working directory inside.
        own_ipc: Whether the call gets its own IPC namespace (``probe_ipc``).
        no_userns: Whether the call may not make user namespaces (``probe_no_userns``).
        shown: Folders inside a hidden folder bound read-only again at their paths (the
            call's own cgroup, whose limits a runtime reads to size its heap).
    """

    profile: Profile
    network: bool
    readable: tuple[str, ...]
    writable: tuple[str, ...]
    hidden: tuple[str, ...]
    cwd: str
    own_ipc: bool = True
    no_userns: bool = False
    shown: tuple[str, ...] = ()


def probe_bwrap(setting: str) -> tuple[str | None, str]:
    """Find bubblewrap and check it can build every namespace the profiles use.

    Args:
        setting: ``auto`` (``bwrap`` on PATH), ``off``, or the path of the binary.

    Returns:
        The binary's path, or None and why not (one sentence).

    Raises:
        ProbeShort: It could not run for want of processes, threads or memory, or did not
            end in time.
    """
    if setting == "off":
        return None, 'the sandbox is off in the config (sandbox = "off")'
    binary = shutil.which("bwrap") if setting == "auto" else setting
    if binary is None or not os.access(binary, os.X_OK):
        return None, (
            "bubblewrap is not installed (bwrap not found on PATH; install the 'bubblewrap' "
            "package)"
            if setting == "auto"
            else f"sandbox = {setting!r} is not an executable file"
        )
    argv = [
        binary, *_ALWAYS, "--unshare-net",
        "--ro-bind", "/", "/", "--dev", "/dev", "--proc", "/proc", *_PRIVATE_TMP,
        "--", "/bin/true",
    ]  # fmt: skip
    try:
        done = _run(binary, argv)
    except (OSError, subprocess.SubprocessError) as exc:
        return None, f"bubblewrap at {binary} cannot run: {exc}"
    if done.returncode != 0:
        message = done.stderr.decode(errors="replace").strip().splitlines()
        why = message[-1] if message else f"exit status {done.returncode}"
        return None, f"bubblewrap at {binary} cannot build its namespaces: {why}"
    return binary, ""


def probe_ipc(binary: str) -> bool:
    """Whether bubblewrap can also give a call its own IPC namespace here.

    Not part of ``probe_bwrap``'s requirements: a unit whose ``RestrictNamespaces=`` predates
    it (no ``ipc``) keeps its sandbox, without that namespace (``sandbox_without_ipc``).
    """
    return _works(binary, _OWN_IPC)


def probe_status(binary: str) -> bool:
    """Whether this bubblewrap writes a JSON status (``--json-status-fd``, 0.5 and later).

    Without it a sandboxed call that exits 1 with ``bwrap: `` on stderr still counts as a
    setup failure (``tool_ran`` cannot tell); an older bubblewrap keeps working.
    """
    return _works(binary, "--json-status-fd", "1")


def probe_bind_check(binary: str) -> str | None:
    """Whether the daemon can check a built sandbox's binds here (``binds_moved``): None
    when it can, else why not (one sentence).

    One sandbox of ``/`` is built and held on its block pipe as a call's is, and looked
    at as a call's is: where ``/proc`` of bubblewrap's process cannot be read (a setuid
    bubblewrap, which the kernel makes undumpable) or does not say it waits (neither
    ``syscall`` nor ``wchan``), or this bubblewrap has no ``--json-status-fd`` or
    ``--block-fd``, every sandboxed call would be refused; the daemon then runs them
    without the check (``Confinement.probe`` logs it). A bubblewrap that passes also
    writes its JSON status (``probe_status``).

    Raises:
        ProbeShort: bubblewrap could not run, or build its sandbox, for want of processes,
            threads or memory, or did not build it in time.
    """
    status_r, status_w, block_r, block_w = _two_pipes(binary)
    argv = [
        binary, *_ALWAYS, "--json-status-fd", str(status_w), "--block-fd", str(block_r),
        "--ro-bind", "/", "/", "--", "/bin/true",
    ]  # fmt: skip
    proc: subprocess.Popen[bytes] | None = None  # noqa: TID251 -- as below
    said = b""
    try:
        try:
            proc = subprocess.Popen(  # noqa: TID251 -- a fixed argv, no call's
                argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE, pass_fds=(status_w, block_r),
            )  # fmt: skip
        except (OSError, MemoryError, subprocess.SubprocessError) as exc:
            short = _short_spawn(binary, exc)
            if short is not None:
                raise short from exc
            if isinstance(exc, MemoryError):
                raise
            return f"bubblewrap cannot run: {exc}"
        os.close(status_w)
        status_w = -1
        why = _held_sandbox_checks(proc.poll, status_r, block_r)
    finally:
        with contextlib.suppress(OSError):
            os.write(block_w, b"x")  # let it go, whatever was seen
        for fd in (status_r, status_w, block_r, block_w):
            if fd >= 0:
                os.close(fd)
        if proc is not None:
            try:
                proc.wait(timeout=_PROBE_SECONDS)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            assert proc.stderr is not None
            with proc.stderr:
                # Its own words, a line or two (it has exited: the pipe holds all of them).
                os.set_blocking(proc.stderr.fileno(), False)
                said = proc.stderr.read() or b""
    # One that died for want of tasks or memory before its pid was written said no more
    # than an old bubblewrap without a JSON status: its own words tell them apart.
    short = _short_exit(binary, proc.returncode, said) if why is not None else None
    if short is not None:
        raise short
    return why


def _two_pipes(binary: str) -> tuple[int, int, int, int]:
    """Two pipes (read end, write end, read end, write end) for ``probe_bind_check``.

    Raises:
        ProbeShort: The daemon is out of descriptors or memory.
    """
    made: list[int] = []
    try:
        for _ in range(2):
            made.extend(os.pipe2(os.O_CLOEXEC))
    except OSError as exc:
        for fd in made:
            os.close(fd)
        short = _short_spawn(binary, exc)
        if short is not None:
            raise short from exc
        raise
    return made[0], made[1], made[2], made[3]


def _held_sandbox_checks(poll: Callable[[], int | None], status_r: int, block_r: int) -> str | None:
    """``probe_bind_check``'s look at its sandbox, held on ``block_r``.

    Raises:
        ProbeShort: The sandbox was not built within ``_PROBE_SECONDS``.
    """
    deadline = time.monotonic() + _PROBE_SECONDS
    status = b""
    pid = None
    while pid is None:
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([status_r], [], [], left)[0]:
            raise _slow("bubblewrap's sandbox (its pid on --json-status-fd)")
        chunk = os.read(status_r, 4096)
        if not chunk:
            return "this bubblewrap writes no JSON status (--json-status-fd, 0.5 and later)"
        status += chunk
        pid = sandbox_pid(status)
    while not (done := setup_done(pid, block_r)):
        if poll() is not None or (done is None and not os.path.exists(f"/proc/{pid}")):
            return "bubblewrap ran its sandbox's command without waiting on --block-fd"
        if done is None:
            return (
                "the daemon cannot see bubblewrap's sandbox wait for it (/proc/<pid>/syscall "
                "and /proc/<pid>/wchan of its process; a setuid bubblewrap hides them)"
            )
        if time.monotonic() >= deadline:
            raise _slow("bubblewrap's sandbox (its wait on --block-fd)")
        time.sleep(0.001)
    if binds_moved(pid, bind_identities([("/", False)])) is not None:
        return (
            "the daemon cannot read the mounts of bubblewrap's sandbox (/proc/<pid>/mountinfo "
            "and /proc/<pid>/root of its process; a setuid bubblewrap hides them)"
        )
    return None


def probe_no_userns(binary: str) -> bool:
    """Whether this bubblewrap can keep a call from making user namespaces (0.8, not setuid).

    In a user namespace of its own a call that is not root's can mount a cgroup2 of its
    own cgroup, make a cgroup below it and move there (``_NO_USERNS``).
    """
    return _works(binary, *_NO_USERNS)


def _works(binary: str, *options: str) -> bool:
    """Whether bubblewrap runs a sandbox with ``options``.

    Raises:
        ProbeShort: It could not run for want of processes, threads or memory, or did not
            end in time.
    """
    argv = [binary, *_ALWAYS, *options, "--ro-bind", "/", "/", "--", "/bin/true"]
    try:
        done = _run(binary, argv)
    except (OSError, subprocess.SubprocessError):
        return False
    return done.returncode == 0


def _run(binary: str, argv: list[str]) -> subprocess.CompletedProcess[bytes]:
    """Run one probe's bubblewrap (a fixed argv, at start or when the probe is tried again).

    Raises:
        ProbeShort: The spawn, or bubblewrap's own fork or allocation, failed for want of
            processes, threads or memory, or it did not end in time.
        OSError: It cannot run otherwise.
    """
    try:
        done = subprocess.run(  # noqa: TID251 -- a fixed argv, no call's
            argv, capture_output=True, timeout=_PROBE_SECONDS, check=False
        )
    except (OSError, MemoryError, subprocess.TimeoutExpired) as exc:
        short = _short_spawn(binary, exc)
        if short is not None:
            raise short from exc
        raise
    short = _short_exit(binary, done.returncode, done.stderr)
    if short is not None:
        raise short
    return done


def _existing(paths: Iterable[str]) -> list[str]:
    seen: list[str] = []
    for path in paths:
        if path not in seen and os.path.lexists(path):
            seen.append(path)
    return seen


def bwrap_argv(
    binary: str, plan: SandboxPlan, status_fd: int | None = None, block_fd: int | None = None
) -> list[str]:
    """The bubblewrap prefix of a call's argv (the tool's argv follows it).

    A writable path that does not exist is left out (the fence refuses nothing here;
    the runner creates the data folders and ``prepare_writable`` the approved paths).

    Args:
        binary: bubblewrap.
        plan: The call's sandbox.
        status_fd: Where bubblewrap writes its JSON status (``tool_ran`` reads it).
        block_fd: What bubblewrap reads a byte from once the sandbox is built, before it
            runs the tool (``setup_done``, ``binds_moved``).
    """
    argv = [binary, *_ALWAYS]
    if plan.own_ipc:
        argv.append(_OWN_IPC)
    if plan.no_userns:
        argv += _NO_USERNS
    if status_fd is not None:
        argv += ["--json-status-fd", str(status_fd)]
    if block_fd is not None:
        argv += ["--block-fd", str(block_fd)]
    if not plan.network:
        argv.append("--unshare-net")
    argv += ["--ro-bind", "/", "/", "--dev", "/dev", *_PRIVATE_TMP]
    for path in _existing(plan.readable):
        argv += ["--ro-bind", path, path]
    for path in _existing(plan.writable):
        argv += ["--bind", path, path]
    # The sandbox's own /proc, after the writable binds: an approved path at or under
    # ``/proc`` binds the host's (the daemon's PID namespace), where ``/proc/<pid>/root``
    # of a process of the same uid without a capability (bubblewrap's own, outside the
    # sandbox) leads to the host's root, writable, its ``/proc/sys`` and hidden paths
    # included. Mounted over them, the call sees its own processes only.
    argv += ["--proc", "/proc"]
    # The kernel's settings stay read-only, after the writable binds so that no approved
    # path (``/proc``, ``/proc/sys/kernel``) opens them again. ``--proc`` alone leaves
    # ``/proc/sys`` writable where the daemon runs as root: bubblewrap covers it only when
    # its own ``access(W_OK)`` of the folder succeeds, and without ``CAP_DAC_OVERRIDE`` it
    # fails on the 0555 folder, so uid 0 (no capability needed) could write the 0644
    # sysctls: ``kernel/core_pattern`` runs a program of its choosing as root, outside.
    # ``/sys`` likewise: an approved ``/sys`` (or a folder below) was bound writable, and
    # uid 0 could write its 0644 settings (``power/state``) and a cgroup's ``cgroup.procs``,
    # and so leave the call's cgroup and its limits.
    for path in _KERNEL_SETTINGS:
        argv += ["--ro-bind-try", path, path]
    # A hidden path that is a link (``~/.ssh`` kept elsewhere by a dotfile manager) is
    # hidden where it leads, so the link leads to the hiding mount too: bubblewrap can bind
    # /dev/null over a link to a file but not over a link to a folder, nor mount a tmpfs
    # through one, and it refused every sandboxed call.
    # A dangling link stays as it is: bubblewrap then refuses the call (fail closed).
    hidden = [
        os.path.realpath(p) if os.path.islink(p) and os.path.exists(p) else p
        for p in _existing(plan.hidden)
    ]
    # A path inside a hidden folder is hidden by the folder's empty tmpfs already; mounted
    # after it, bubblewrap could not make its mount point there (read-only) and refused
    # every sandboxed call (a ``hide`` list naming a folder, then a file in it; a cgroup2
    # mount below another). Compared where they lead, as bubblewrap follows them: a path
    # named through a linked folder (``~/.aws/credentials``, ``~/.aws`` a link) lies where
    # the link leads, where the folder is hidden.
    hidden = _existing(hidden)
    real = {path: Path(os.path.realpath(path)) for path in hidden}
    folders = [real[path] for path in hidden if os.path.isdir(path)]
    for path in hidden:
        if any(top != real[path] and is_within(real[path], top) for top in folders):
            continue
        if os.path.isdir(path):
            argv += ["--tmpfs", path]
            # Made inside the tmpfs while it is still writable, then it is made read-only.
            for inside in plan.shown:
                if is_within(Path(inside), real[path]) and os.path.isdir(inside):
                    argv += ["--ro-bind", inside, inside]
            argv += ["--remount-ro", path]
        else:
            argv += ["--ro-bind", "/dev/null", path]
    argv += ["--chdir", plan.cwd, "--"]
    return argv


def _below(path: str, top: str) -> str | None:
    """``path`` relative to ``top`` ("" for ``top`` itself), component-wise, else None."""
    if path == top:
        return ""
    prefix = top.rstrip("/") + "/"
    return path[len(prefix) :] if path.startswith(prefix) else None


def _joined(top: str, relative: str) -> str:
    return os.path.join(top, relative) if relative else top


def _read_mountinfo(pid: str) -> str:
    """``/proc/<pid>/mountinfo`` as the file system's text (``os.fsdecode``), its line ends
    untouched: read in text mode, a ``"\r"`` in a path (which the kernel does not escape)
    became ``"\n"``, and that mount's line two.

    Raises:
        OSError: It cannot be read.
    """
    with open(f"/proc/{pid}/mountinfo", "rb") as f:
        return os.fsdecode(f.read())


def mount_aliases(paths: Iterable[str], mountinfo: str | None = None) -> list[str]:
    """Other places where a mount shows one of ``paths`` (or a part of it), to hide too.

    The sandbox hides paths, not files: a bind mount of the home (or of ``~/.ssh``, or of
    a key) elsewhere shows the same files under another name. For each path that exists,
    the mount it is on gives its place in its file system (``root`` of
    ``/proc/self/mountinfo`` and what is below the mount point); every mount of the same
    file system (``major:minor``) whose root is at or above that place shows it too, and
    one whose root is below it shows a part of it. A place is kept only if it is the very
    file (same device and inode) or a whole mount inside it.

    Args:
        paths: The hidden paths.
        mountinfo: The text of ``/proc/self/mountinfo`` (read here when None).

    Returns:
        The other places, in order, none of ``paths`` among them; empty without ``/proc``.
    """
    if mountinfo is None:
        try:
            mountinfo = _read_mountinfo("self")
        except OSError:
            return []
    mounts = [(device, root, point) for device, root, point, _, _ in parse_mountinfo(mountinfo)]
    wanted = list(dict.fromkeys(paths))
    # A place inside a hidden path is hidden with it (and a mount there could not be made).
    covered = [*wanted, *(os.path.realpath(p) for p in wanted if os.path.lexists(p))]
    found: list[str] = []
    for path in wanted:
        if not os.path.lexists(path):
            continue
        real = os.path.realpath(path)
        try:
            identity = os.stat(real)
        except OSError:
            continue
        # The mount it is on: the longest mount point above it, the last one listed there.
        best: tuple[str, str, str] | None = None
        for mount in mounts:
            if _below(real, mount[2]) is not None and (
                best is None or len(mount[2]) >= len(best[2])
            ):
                best = mount
        if best is None:
            continue
        relative = _below(real, best[2])
        assert relative is not None
        place = _joined(best[1], relative)
        for device, root, point in mounts:
            if device != best[0]:
                continue
            inner = _below(place, root)
            if inner is not None:
                alias = _joined(point, inner)
                try:
                    seen = os.stat(alias)
                except OSError:
                    continue
                if (seen.st_dev, seen.st_ino) != (identity.st_dev, identity.st_ino):
                    continue  # something else is mounted over it there
            elif _below(root, place) is not None:
                alias = point  # a mount of a part of it
            else:
                continue
            if alias not in found and all(_below(alias, c) is None for c in covered):
                found.append(alias)
    return found


def sandbox_pid(status: bytes) -> int | None:
    """The sandbox's pid in bubblewrap's JSON status (``{"child-pid": N, ...}``, written
    as it starts), or None while it has not been written."""
    match = re.search(rb'"child-pid"\s*:\s*(\d+)', status)
    return int(match.group(1)) if match else None


def tool_ran(status: bytes) -> bool:
    """Whether bubblewrap's JSON status says the tool ran (it reports its ``exit-code``).

    bubblewrap writes ``{"child-pid": ...}`` as it starts and ``{"exit-code": N}`` only once
    the command it executed has exited: a setup failure, or an exec that failed, has none.
    So a tool that exits 1 with a stderr starting ``bwrap: `` (its own bubblewrap, or a
    lie) is not mistaken for a sandbox that could not be set up.
    """
    return b'"exit-code"' in status


def exec_failure(stderr: bytes, command: str) -> str | None:
    """The reason bubblewrap's ``execvp`` of the tool's ``command`` failed, else None.

    Once the sandbox is built bubblewrap executes the command, and when that fails it
    exits 1 with ``bwrap: execvp <command>: <strerror>`` (``die_with_error``) and, as for a
    setup failure, no ``exit-code`` in its status (``tool_ran``). Every setup step's words
    differ, so these are the command's own: a script whose ``#!`` interpreter is relative
    or not in the sandbox, a file that may not be executed. The sandbox was fine.
    """
    prefix = SETUP_FAILED_PREFIX + b"execvp " + os.fsencode(command) + b": "
    if not stderr.startswith(prefix):
        return None
    return stderr[len(prefix) :].split(b"\n", 1)[0].decode(errors="replace").strip() or None


def call_binds(
    workspace: str, set_folder: str, tool_data: str, project_data: str
) -> tuple[tuple[str, ...], tuple[str, ...], str]:
    """What a sandboxed call binds: its set's folder, and its workspace and data folders.

    bubblewrap follows symlinks in a bind's source and its target, and a sandboxed call may
    write anywhere in its workspace. A path in the workspace needs no bind of its own (the
    workspace's covers it), and must not get one: any sandboxed call of that workspace can
    swap a folder on its way for a symlink while another call's bubblewrap mounts it (a
    project data folder planted as a link to ``$HOME`` was bound read-write; a project
    set's own folder, flipped to and from a link to the host's ``/tmp``, put that over a
    sandbox's private one). So:

    * a path whose spelling is in the workspace, or that resolves into it, is left out,
      wherever it resolves at this moment (resolving it could meet a link mid-flip);
    * any other path (a home set's folder, the tool data folder under the home, which
      calls cannot write) is bound where it resolves;
    * a project data folder that resolves outside the workspace is refused.

    Args:
        workspace: The call's workspace (bound by this path: only a call that may write a
            folder above it, of a workspace around it, can change it, and ``binds_moved``
            then stops the call before its tool runs).
        set_folder: The set's own folder (bound read-only).
        tool_data: ``CRYSTAL_TOOL_DATA``.
        project_data: ``CRYSTAL_PROJECT_DATA``.

    Returns:
        The set folder's binds, the writable binds in order, and ``""``; or two empty
        tuples and the path the project data folder resolves to, when that is outside the
        workspace.
    """
    spelled, real = Path(os.path.normpath(workspace)), Path(os.path.realpath(workspace))
    project = Path(os.path.realpath(project_data))
    if not is_within(project, real):
        return (), (), str(project)

    def outside(path: str) -> tuple[str, ...]:
        normal = Path(os.path.normpath(path))
        if is_within(normal, spelled) or is_within(normal, real):
            return ()
        resolved = Path(os.path.realpath(path))
        return () if is_within(resolved, real) else (str(resolved),)

    return outside(set_folder), (workspace, *outside(tool_data)), ""


def hidden_below_writable(
    hidden: Iterable[str], writable: Iterable[str]
) -> tuple[str, str, str] | None:
    """The first hidden path a call could uncover for the next one, the bind that lets it,
    and how.

    A hidden path is a mount point in the sandbox, which the tool can neither rename nor
    remove, and so is each writable bind's root. But a folder *between* the two can be
    renamed (the mount moves with it): a call that may write ``~/.config`` renames
    ``~/.config/gh`` (``hosts.yml`` hidden in it) and makes an empty ``gh``; the next
    call's sandbox hides the empty one and the token is readable as ``~/.config/gh2``.
    So a hidden path, as spelled or where it leads (a link to a folder is hidden there),
    two or more levels below a writable path is refused. One level below is safe.

    A hidden path that is itself a symbolic link is hidden where it leads, so the link is
    no mount point: a call that may write where the link lies (``$HOME`` as the workspace,
    ``~/.ssh`` a dotfile manager's link) removes it, and the next call's sandbox hides
    nothing there. Such a link, at any depth below a writable path, is refused too.

    Returns:
        ``(hidden path, writable path, "deep" or "link")``, or None.
    """
    roots = []
    for root in writable:
        roots += [os.path.normpath(root), os.path.realpath(root)]
    for path in hidden:
        normal = os.path.normpath(path)
        if os.path.islink(path):
            # Where the link itself lies: as spelled, and in the folder its parent leads to.
            places = {
                normal,
                os.path.join(os.path.realpath(os.path.dirname(normal)), os.path.basename(normal)),
            }
            for place in places:
                for root in roots:
                    if is_within(Path(place), Path(root)) and Path(place) != Path(root):
                        return path, root, "link"
        spellings = {normal}
        if os.path.lexists(path):
            spellings.add(os.path.realpath(path))
        for spelled in spellings:
            for root in roots:
                if (
                    is_within(Path(spelled), Path(root))
                    and len(Path(spelled).relative_to(root).parts) >= 2
                ):
                    return path, root, "deep"
    return None


def prepare_writable(paths: Iterable[str]) -> None:
    """Make each approved path exist so it can be bound: a missing one becomes an empty file.

    Each path is canonical (resolved when the call was checked), so its folders are opened
    one at a time without following a link, and the file made in the last of them: whoever
    may write a folder on the way (a sandboxed call of a workspace around it, another user
    owning a folder there) could otherwise swap a folder for a link meanwhile and have the
    daemon make the file where the link leads (``~/.ssh``, say), outside what was approved.

    Raises:
        OSError: A path cannot be created (its folder is missing or not writable, or a
            folder on its way is now a symbolic link); ``filename`` is the path.
    """
    for path in paths:
        if os.path.lexists(path):
            continue
        folder, name = os.path.split(os.path.normpath(path))
        try:
            top = os.open("/", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
            try:
                fd = _open_no_link(top, folder)
            finally:
                os.close(top)
            try:
                # A link on the way is a handle of the link itself (O_PATH): the next
                # component below it, or the file, is ENOTDIR.
                if not stat.S_ISDIR(os.fstat(fd).st_mode):
                    raise OSError(
                        errno.ENOTDIR, "a folder on its way is not a folder (a symbolic link?)"
                    )
                os.close(
                    os.open(
                        name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                        0o644, dir_fd=fd,
                    )
                )  # fmt: skip
            finally:
                os.close(fd)
        except OSError as exc:
            exc.filename = path
            raise


#: ``read``'s system call number, as ``/proc/<pid>/syscall`` shows it (``setup_done``).
_READ_SYSCALL = {
    "x86_64": "0", "aarch64": "63", "riscv64": "63", "loongarch64": "63", "i686": "3",
    "i386": "3", "armv7l": "3", "armv6l": "3", "ppc64le": "3", "ppc64": "3", "s390x": "3",
}  # fmt: skip
#: This machine's (None: ``setup_done`` looks at ``wchan`` alone), looked up once.
_READ_NUMBER = _READ_SYSCALL.get(os.uname().machine)
#: Opens one component of a path as a handle, never through a symbolic link.
_NO_LINK = os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC


def bind_identities(
    paths: Iterable[tuple[str, bool]],
) -> tuple[tuple[str, int, int, bool], ...]:
    """What each bind is now: its canonical name, device and inode, and whether it is
    writable (``paths`` gives each path with that flag).

    ``binds_moved`` compares the sandbox with them once bubblewrap has built it. A path on
    a read-only mount (a snapshot, a read-only export, ``ProtectSystem=``) is not writable
    whatever its flag: bubblewrap's bind of it is read-only as that mount is.

    Raises:
        OSError: A path cannot be opened (gone, or the daemon is out of descriptors).
    """
    found = []
    for path, writable in paths:
        fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
        try:
            name = os.readlink(f"/proc/self/fd/{fd}")
            seen = os.fstat(fd)
            if writable:
                writable = not os.fstatvfs(fd).f_flag & os.ST_RDONLY
        finally:
            os.close(fd)
        found.append((name, seen.st_dev, seen.st_ino, writable))
    return tuple(found)


def setup_done(pid: int, block_fd: int) -> bool | None:
    """Whether bubblewrap's sandbox process ``pid`` waits on ``block_fd``: its mounts are
    built and the tool not yet started. None when that cannot be seen (the process is
    gone, or ``/proc`` does not say).

    ``/proc/<pid>/syscall`` says it exactly (``read`` of that descriptor); where it may not
    be read (Yama's ``ptrace_scope`` 2 or 3) or ``read``'s number is not known here, the
    kernel function it sleeps in (``/proc/<pid>/wchan``) does: no other step of
    bubblewrap's reads a pipe.
    """
    if _READ_NUMBER is not None:
        try:
            with open(f"/proc/{pid}/syscall", encoding="ascii") as f:
                return f.read().split()[:2] == [_READ_NUMBER, hex(block_fd)]
        except PermissionError:
            pass
        except (OSError, ValueError):
            return None
    try:
        with open(f"/proc/{pid}/wchan", encoding="ascii") as f:
            sleeping = f.read().strip()
    except (OSError, ValueError):
        return None
    return sleeping.endswith("pipe_read")


def binds_moved(pid: int, expected: Iterable[tuple[str, int, int, bool]]) -> str | None:
    """The first bind that bubblewrap did not mount as the daemon checked it.

    bubblewrap binds paths, and follows a symbolic link in a bind's source or target: a
    call that may write the folder above another call's workspace (nested workspaces) can
    swap the workspace for a link between the daemon's checks and the mount, and the other
    call would write (or read) where the link leads. So, with the sandbox built and the
    tool not yet started, each bound path must be, in the sandbox (``/proc/<pid>``), the
    last mount listed at that very name (read-write for a writable one), reached without a
    link, and the very file or folder the daemon checked (same device and inode). Returns
    the path that is not, else None.
    """
    try:
        mountinfo = _read_mountinfo(str(pid))
        root = os.open(f"/proc/{pid}/root", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        return "/"
    try:
        # Each mount point: whether the last mount listed there is read-write.
        top = {
            point: "rw" in options.split(",")
            for _, _, point, options, _ in parse_mountinfo(mountinfo)
        }
        for name, device, inode, writable in expected:
            if (
                name not in top
                or (writable and not top[name])
                or _identity_within(root, name) != (device, inode)
            ):
                return name
        return None
    finally:
        os.close(root)


def _open_no_link(root: int, path: str) -> int:
    """A handle (``O_PATH``) of ``path`` below the open folder ``root``, opened component by
    component without following a link: a link on the way is opened as itself, and
    whatever is opened below it fails with ``ENOTDIR``. The caller closes it.

    Raises:
        OSError: A component is missing, or below a link or a file.
    """
    fd = os.dup(root)
    try:
        for part in [p for p in path.split("/") if p]:
            following = os.open(part, _NO_LINK, dir_fd=fd)
            os.close(fd)
            fd = following
    except BaseException:
        os.close(fd)
        raise
    return fd


def _identity_within(root: int, path: str) -> tuple[int, int] | None:
    """Device and inode of ``path`` below the open folder ``root``, opened component by
    component without following a link; None when a component is a link or missing."""
    try:
        fd = _open_no_link(root, path)
    except OSError:
        return None
    try:
        seen = os.fstat(fd)
    finally:
        os.close(fd)
    if stat.S_ISLNK(seen.st_mode):
        return None
    return seen.st_dev, seen.st_ino
