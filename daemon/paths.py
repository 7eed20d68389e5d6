"""Path fencing: resolve path arguments, scope them, rewrite what the child receives.

Theory of operation
-------------------
A tool names some of its properties in ``pathArguments``. Each string value of such a
property is turned into one absolute, canonical path, and that path is both what the
policy judges and what the child receives. Because the two are the same string, a
child never sees a path other than the one that was classified (short of the
filesystem changing between ``classify`` and the spawn, see below).

Resolution (``resolve_path``) follows the kernel, not a lexical normaliser:

0. Surrounding white space is trimmed first (``trim_path``), as the reference host's
   ``Workspace.TryNormalize`` does (``path.Trim()``): a model's ``"src/a.py\n"`` names
   ``src/a.py``. The set trimmed is .NET's ``char.IsWhiteSpace``, not Python's.
1. ``~`` and ``~/...`` expand to the operator's user profile (passed in, never read
   from ``$HOME`` here). ``~user`` forms are **not** expanded: ``~root`` is an
   ordinary relative name under the workspace, as the reference host's
   ``GetFullPath`` treats it. The child receives the absolute result, so nothing
   downstream can expand it differently, and the answer never depends on the
   system's user database.
2. A relative path is joined to the workspace.
3. The path is walked component by component from ``/``. Each existing component
   is ``lstat``-ed; a symlink is replaced by its target (an absolute target restarts
   at ``/``) and walking continues through the target, so a ``..`` after a link
   applies to the link's target, as it does in the kernel. Components that do not
   exist (yet) are kept as written; ``.``, empty components and trailing slashes
   vanish. Every component is looked up, even after a missing one, so
   ``missing/../link`` still resolves ``link``.
4. Anything the kernel would refuse, or that cannot be told safely, raises
   ``PathError("Path is not valid.")`` with a ``detail`` for the operator: a NUL byte,
   a path longer than ``PATH_MAX`` or a component longer than ``NAME_MAX``, more
   than 40 links (loops included), link targets that add more than
   ``MAX_LINK_COMPONENTS`` components to the walk, an unreadable directory on the way,
   text that is not valid UTF-8, a ``/proc/<pid>`` of no process now (the tool started
   for the call may be that process: its ``/proc/<pid>/cwd`` is the workspace, and a
   name kept as written there would reach the child unjudged).

The module only reads the filesystem (``os.lstat``, ``os.readlink``, and ``O_PATH``
opens for ``existing_directory``, the workspace check); it never writes. No resolution is
cached: a link may change between two calls, and a cache would hide it.

Scope (``scope_of``) is one of ``workspace``, ``outsideWorkspace`` or ``forbidden``.
Credential paths (``.ssh``, ``.gnupg``, ``.crystal/credentials.json`` segments,
case-insensitive) are checked on the raw text and on the resolved path, so a link
into ``~/.ssh`` is caught. A value that cannot be resolved is never "inside": it
counts as outside the workspace (fail closed). Inside means equal to the canonical
workspace or below it, compared component-wise (``/ws2`` is not inside ``/ws``).

Credential paths are also caught by identity (``is_credential_identity``): the resolved
path and each of its existing ancestors are ``stat``-ed, and a ``(st_dev, st_ino)`` equal
to that of a credential location of the user's home (``~/.ssh`` and ``~/.gnupg``, each
with everything below it up to ``IDENTITY_DEPTH`` levels and ``_IDENTITY_ENTRIES`` entries
a folder, and ``~/.crystal/credentials.json``; of the home in the user's passwd entry as
well, where ``HOME`` names another folder), read at the time of the check, makes the path
``forbidden``. So does the Crystal home's ``credentials.json`` (``--home``,
``$CRYSTAL_HOME``; the file the sandbox hides), by its canonical path and by identity, since
a home not called ``.crystal`` has no segment to name it. That catches a hard link to a key
inside the workspace, and a bind mount of a credential folder or file (a file below a
bind-mounted folder too, since the folder is an ancestor).

Limits, stated rather than hidden: a credential file created (or hard-linked into the
workspace) after the check, a copy of a key (a copy is a new file), a key in a folder
deeper or fuller than the bounds above, a credential outside the user's home (another
user's, a key in a project folder under another name), and a file reached through a
different mount of the same file system that shows other inode numbers (some network and
FUSE file systems) are not recognised; and a path rewritten at ``classify`` time can be
changed on disk before the child opens it (a race only a process that can already write
the workspace can win).
"""

from __future__ import annotations

import enum
import errno
import functools
import itertools
import os
import stat
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from toolsetd.protocol.whitespace import NET_WHITESPACE

from .exhaustion import out_of_resources
from .model import ToolDef

__all__ = [
    "CREDENTIAL_FILES",
    "CREDENTIAL_FOLDERS",
    "IDENTITY_DEPTH",
    "INVALID_PATH_MESSAGE",
    "MAX_LINK_COMPONENTS",
    "MAX_SYMLINKS",
    "NAME_MAX",
    "NET_WHITESPACE",
    "PATH_MAX",
    "ArgumentsError",
    "OwnProcessLinkError",
    "PathError",
    "Scope",
    "canonical_workspace",
    "credential_identities",
    "existing_directory",
    "expand_user",
    "file_exists",
    "is_credential_identity",
    "is_credential_path",
    "is_crystal_credentials",
    "is_within",
    "opened_directory_name",
    "os_user_home",
    "passwd_home",
    "resolve_path",
    "rewrite_arguments",
    "scope_of",
    "trim_path",
    "unreachable_link",
]

#: The reference host's message for a path that cannot be resolved.
INVALID_PATH_MESSAGE = "Path is not valid."

#: Linux ``PATH_MAX``: a path of this many bytes or more is refused (it includes the NUL).
PATH_MAX = 4096
#: Linux ``NAME_MAX``: the longest single component, in bytes.
NAME_MAX = 255
#: Linux ``MAXSYMLINKS``: more link expansions than this is a loop as far as we care.
MAX_SYMLINKS = 40
#: Most components the link targets of one path may add to its walk, all links together.
#: The walk runs on the daemon's event loop, a few microseconds a component: 40 links of
#: 4,095-byte targets (``a/../a/../...``, which a repository can ship) would otherwise make
#: one path cost some 80,000 lookups, a quarter of a second, and one call with 64 such
#: strings stall every other call for seconds. Real link chains (a home on another disk,
#: a Nix profile) add tens.
MAX_LINK_COMPONENTS = 1024

#: Whole segments that make a path a credential path (compared case-folded).
_CREDENTIAL_SEGMENTS: frozenset[str] = frozenset({".ssh", ".gnupg"})
#: Adjacent segment pairs that make a path a credential path (compared case-folded).
_CREDENTIAL_PAIRS: frozenset[tuple[str, str]] = frozenset({(".crystal", "credentials.json")})

#: Credential folders (below the user's home) whose contents are credentials by identity
#: (and which the sandbox hides: ``confinement``).
CREDENTIAL_FOLDERS: tuple[str, ...] = (".ssh", ".gnupg")
#: Credential files (below the user's home), by identity.
CREDENTIAL_FILES: tuple[tuple[str, ...], ...] = ((".crystal", "credentials.json"),)
#: How deep below a credential folder identities are collected (and the sandbox looks for
#: a second hard link), and how many entries a folder.
IDENTITY_DEPTH = 4
_IDENTITY_ENTRIES = 1024

#: lstat errors that mean "this component is not there": keep it, and the rest, as written.
_MISSING_ERRNOS: frozenset[int] = frozenset({errno.ENOENT, errno.ENOTDIR})


class PathError(Exception):
    """A path value that cannot be resolved safely.

    Attributes:
        message: The reference host's message, ``Path is not valid.``
        detail: Why, in plain English, for reasons and logs (never the path itself).
    """

    def __init__(self, detail: str, message: str = INVALID_PATH_MESSAGE) -> None:
        super().__init__(message)
        self.message = message
        self.detail = detail


class OwnProcessLinkError(PathError):
    """A path that leads through ``/proc/self`` or ``/proc/thread-self`` (``/dev/fd`` and
    ``/dev/stdin`` lead there too), or through any ``/proc/<pid>``, resolved for a tool that
    follows it itself: there those are the tool's own process (working in the workspace),
    not the daemon's, and a ``/proc/<pid>`` link (``cwd``, ``root``, ``fd/<n>``) takes the
    kernel to that process's own folder in its own namespaces (a sandboxed call's PID
    namespace, another mount namespace), not where its text names in the daemon's; so the
    daemon's walk cannot say where the path leads for the tool."""


class ArgumentsError(Exception):
    """Arguments that the fence cannot rewrite; ``invoke`` reports them as invalid.

    Attributes:
        message: The reference host's message, e.g. ``Arguments must be a JSON object.``
        argument: The offending property, when one is to blame.
    """

    def __init__(self, message: str, argument: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.argument = argument


class Scope(enum.StrEnum):
    """Where a path (or a whole call, the worst of its paths) lands."""

    WORKSPACE = "workspace"
    OUTSIDE = "outsideWorkspace"
    FORBIDDEN = "forbidden"


def trim_path(raw: str) -> str:
    """The path text without surrounding white space, as the reference host trims it.

    An empty result means a blank value (``Argument '<name>' must be a path string.``).
    """
    return raw.strip(NET_WHITESPACE)


def os_user_home(environ: Mapping[str, str]) -> str:
    """The OS user's home as .NET's ``GetFolderPath(UserProfile)`` finds it: ``HOME``
    unless unset or empty, else the passwd entry's ("" when the uid has none).

    ``os.path.expanduser("~")`` makes an empty ``HOME`` ``/``, which would put the
    credential paths at ``/.ssh`` and ``~`` in path arguments at the root.
    """
    home = environ.get("HOME")
    if home:
        return home
    return _passwd_entry_home() or ""


@functools.cache
def passwd_home() -> str | None:
    """The daemon user's home in its passwd entry (None: no entry, or not an absolute path).

    Where ``HOME`` names another folder, this is still the one ssh reads its keys from.
    Read once per process: the fence asks for it at every path check, and a passwd lookup
    may go over the network (NSS), which the event loop must not wait for each time; the
    confinement's probe at start shares that one lookup.
    """
    home = _passwd_entry_home()
    return home if home is not None and os.path.isabs(home) else None


def _passwd_entry_home() -> str | None:
    """The ``pw_dir`` of the user's passwd entry, as written (None: the uid has none)."""
    import pwd  # only where HOME does not say, or the sandbox asks

    try:
        return pwd.getpwuid(os.getuid()).pw_dir
    except KeyError:
        return None


def expand_user(raw: str, user_home: Path) -> str:
    """Expand a leading ``~`` or ``~/`` to the user profile; leave every other text alone.

    ``~user`` is deliberately not expanded (see the module docstring): it stays a
    relative name, so it lands under the workspace.

    Args:
        raw: The path text as the caller sent it.
        user_home: The operator's user profile directory.

    Returns:
        The text with the home prefix substituted, or ``raw`` unchanged.
    """
    if raw == "~":
        return os.fspath(user_home)
    if raw.startswith("~/"):
        return os.fspath(user_home) + raw[1:]
    return raw


def _encoded(text: str) -> bytes:
    """Encode ``text`` as the kernel will see it, refusing what JSON cannot carry."""
    try:
        return text.encode("utf-8")
    except UnicodeEncodeError:
        raise PathError("it is not valid UTF-8") from None


def _check_whole(text: str) -> None:
    """Refuse NUL bytes and paths the kernel would call too long."""
    if "\x00" in text:
        raise PathError("it contains a NUL byte")
    # A cheap character bound first, so a megabyte of text is not encoded for nothing.
    if len(text) >= PATH_MAX or len(_encoded(text)) >= PATH_MAX:
        raise PathError(f"it is longer than {PATH_MAX - 1} bytes")


def _check_name(name: str) -> None:
    """Refuse a component the kernel would call too long."""
    if len(name) > NAME_MAX or len(_encoded(name)) > NAME_MAX:
        raise PathError(f"a component is longer than {NAME_MAX} bytes")


def _names_own_process(name: str, target: str) -> bool:
    """Whether a link is procfs's ``self`` (``<pid>``) or ``thread-self`` (``<pid>/task/<tid>``),
    told by its shape: a ``/proc`` of another PID namespace names the process by another pid."""
    if name == "self":
        return target.isdigit()
    pid, _, tid = target.partition("/task/")
    return name == "thread-self" and pid.isdigit() and tid.isdigit()


def _is_procfs(folder: str) -> bool:
    """Whether ``folder`` (canonical, "" for ``/``) is the root of a procfs: its ``self`` is
    the link to a process, told by its shape (``_names_own_process``)."""
    try:
        return _names_own_process("self", os.readlink(f"{folder}/self"))
    except OSError:
        return False


def _canonicalize(path: str, followed_by_tool: bool = False) -> str:
    """Resolve an absolute path component by component, following links as the kernel does.

    Args:
        path: An absolute path (``/`` first).
        followed_by_tool: The tool, not the daemon, follows the path (``OwnProcessLinkError``).

    Returns:
        The canonical path: no links among its existing components, no ``.``, ``..``
        or empty components, no trailing slash.

    Raises:
        PathError: A loop or too many links, an over-long component, an unreadable
            directory on the way.
        OwnProcessLinkError: ``followed_by_tool`` and the path leads through
            ``/proc/self``, ``/proc/thread-self`` or any ``/proc/<pid>``.
    """
    # ``pending`` is a stack of components still to walk, the next one last.
    pending = path.split("/")
    pending.reverse()
    resolved = ""  # the canonical prefix walked so far; "" stands for "/"
    links = 0
    budget = MAX_LINK_COMPONENTS  # components link targets may still add
    while pending:
        name = pending.pop()
        if name in ("", "."):
            continue
        if name == "..":
            # ``resolved`` holds no links, so its lexical parent is its real parent.
            resolved = resolved.rpartition("/")[0]
            continue
        _check_name(name)
        candidate = f"{resolved}/{name}"
        try:
            mode = os.lstat(candidate).st_mode
        except OSError as exc:
            if exc.errno in _MISSING_ERRNOS:
                if name.isdigit() and _is_procfs(resolved):
                    # /proc/<pid> of no process now: the tool started for the call may be
                    # that process, and /proc/<pid>/cwd then its workspace. Kept as written,
                    # the child would follow a path nobody judged.
                    error = OwnProcessLinkError if followed_by_tool else PathError
                    raise error(
                        "it leads through /proc/<pid> of a process that is not there, which "
                        "may be the tool's own process when it runs"
                    ) from None
                resolved = candidate
                continue
            raise PathError(f"it cannot be looked up ({os.strerror(exc.errno or 0)})") from None
        if followed_by_tool and name.isdigit() and _is_procfs(resolved):
            # /proc/<pid> of a process that is there: its links (cwd, root, fd/<n>) take
            # the kernel to that process's own folder and root, in its mount namespace,
            # not where their text names in the daemon's; and a sandboxed call's /proc
            # is its own PID namespace's, where /proc/1 works in the workspace.
            raise OwnProcessLinkError(
                "it leads through /proc/<pid>, whose links the tool follows to that "
                "process's own folders (in its namespaces), not to where their text names"
            )
        if not stat.S_ISLNK(mode):
            resolved = candidate
            continue
        links += 1
        if links > MAX_SYMLINKS:
            raise PathError("it is a symbolic link loop or has too many links")
        try:
            target = os.readlink(candidate)
        except OSError as exc:
            raise PathError(f"a link cannot be read ({os.strerror(exc.errno or 0)})") from None
        if "\x00" in target:  # pragma: no cover - the kernel never returns one
            raise PathError("a link target contains a NUL byte")
        if followed_by_tool and _names_own_process(name, target):
            raise OwnProcessLinkError(
                "it leads through /proc/self, which is the tool's own process when the tool "
                "follows it, not the daemon's"
            )
        parts = target.split("/")
        budget -= len(parts)
        if budget < 0:
            raise PathError(f"its links name more than {MAX_LINK_COMPONENTS} components to walk")
        if target.startswith("/"):
            resolved = ""
        # Walk the target next; a ``..`` after the link now climbs from the target.
        pending.extend(reversed(parts))
    return resolved or "/"


def resolve_path(
    raw: str,
    workspace: Path,
    user_home: Path,
    *,
    followed_by_tool: bool = False,
    as_written: bool = False,
) -> Path:
    """Resolve a path argument to the absolute, canonical path the child will receive.

    Args:
        raw: The argument's string value.
        workspace: The absolute workspace directory (a symlinked one is fine).
        user_home: The operator's user profile, for ``~`` and ``~/``.
        followed_by_tool: The child receives ``raw`` itself, not the result (a string
            inside an array or object), and follows it from the workspace: a path through
            ``/proc/self`` or ``/proc/<pid>`` then leads somewhere else for it, and is
            refused.
        as_written: Resolve ``raw`` as the kernel opens it: not trimmed, no ``~`` expanded
            (``"~/k"`` is ``<workspace>/~/k``), for a child that receives it as it is.

    Returns:
        The canonical absolute path. Components that do not exist are kept as written.

    Raises:
        PathError: The value is not a non-blank string, holds a NUL byte, is too long,
            runs into a link loop or an unreadable directory, or is not valid UTF-8;
            ``OwnProcessLinkError`` for a path through ``/proc/self`` or ``/proc/<pid>``
            the tool follows.
        ValueError: ``workspace`` is not absolute (a caller bug, not bad input).
    """
    if not isinstance(raw, str):
        raise PathError("it is not a string")
    if not as_written:
        raw = trim_path(raw)
    if not raw:
        raise PathError("it is empty")
    _check_whole(raw)
    text = raw if as_written else expand_user(raw, user_home)
    if not text.startswith("/"):
        base = os.fspath(workspace)
        if not base.startswith("/"):
            raise ValueError(f"workspace must be an absolute path, got {base!r}")
        text = f"{base}/{text}"
    _check_whole(text)
    result = _canonicalize(text, followed_by_tool)
    _check_whole(result)
    return Path(result)


def canonical_workspace(workspace: Path) -> Path:
    """Return the workspace with its links resolved, so containment checks compare like with like.

    Args:
        workspace: The absolute workspace directory, possibly reached through links.

    Returns:
        The canonical workspace, or its lexical normal form when it cannot be resolved.
    """
    text = os.fspath(workspace)
    try:
        _check_whole(text)
        return Path(_canonicalize(text))
    except PathError:
        return Path(os.path.normpath(text))


#: Opens a directory as a handle only (no read permission needed), following links.
_DIRECTORY_HANDLE = getattr(os, "O_PATH", os.O_RDONLY) | os.O_DIRECTORY | os.O_CLOEXEC
#: Canonical directory texts already turned into a ``Path`` (a request names few).
_DIRECTORY_PATHS: dict[str, Path] = {}
_DIRECTORY_PATHS_MAX = 1024


def existing_directory(raw: str) -> Path | None:
    """The canonical path of the existing directory ``raw`` names, or None.

    The kernel resolves ``raw`` (links, ``..``) as it opens the directory, and
    ``/proc/self/fd`` names what it opened: a few system calls, where ``realpath`` then
    ``is_dir`` would ``lstat`` every component from Python. The name is then checked to
    lead, in the daemon's own view, to the very directory opened (same device and inode):
    that refuses a directory removed or renamed meanwhile, and one reached through a
    ``/proc`` link into another mount namespace or root, whose name means something else
    here. Without ``/proc``, ``realpath`` gives the name, under the same check.

    Args:
        raw: An absolute path without NUL bytes.

    Raises:
        OSError: The daemon is out of descriptors or memory (``exhaustion``).
    """
    try:
        fd = os.open(raw, _DIRECTORY_HANDLE)
    except ValueError:
        return None
    except OSError as exc:
        if out_of_resources(exc):
            raise  # the daemon's want, not the path's
        return None
    try:
        canonical = opened_directory_name(fd, raw)
    finally:
        os.close(fd)
    if canonical is None:
        return None
    found = _DIRECTORY_PATHS.get(canonical)
    if found is None:
        if len(_DIRECTORY_PATHS) >= _DIRECTORY_PATHS_MAX:
            _DIRECTORY_PATHS.clear()
        found = _DIRECTORY_PATHS[canonical] = Path(canonical)
    return found


def opened_directory_name(fd: int, raw: str) -> str | None:
    """The canonical name of the directory (or file) open as ``fd`` (opened by the name ``raw``).

    ``/proc/self/fd`` names it; without ``/proc``, ``realpath(raw)`` does. Either name
    counts only if it leads, in the daemon's own view, to the very directory opened (same
    device and inode): that refuses one removed or renamed since, and one reached through
    a ``/proc`` link into another mount namespace or root. None otherwise.
    """
    try:
        try:
            canonical = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            canonical = os.path.realpath(raw)
        opened = os.fstat(fd)
        named = os.stat(canonical)
    except (OSError, ValueError):
        return None
    if (named.st_dev, named.st_ino) != (opened.st_dev, opened.st_ino):
        return None
    return canonical


def unreachable_link(path: str, dir_fd: int | None = None) -> bool:
    """Whether ``path``, which ``os.stat`` could not examine, is a symbolic link itself.

    The reference host asks .NET's ``File.Exists`` whether a file is there (a set folder's
    ``tools.json``, a command in the set folder); on Unix that is true for a symlink whose
    target cannot be reached (a dangling link, a loop).

    Args:
        path: The path (relative to ``dir_fd`` when given).
        dir_fd: An open folder ``path`` is relative to, or None.

    Returns:
        True for a link; False when nothing is there, or the folder on the way cannot be
        searched either.
    """
    try:
        return stat.S_ISLNK(os.lstat(path, dir_fd=dir_fd).st_mode)
    except OSError:
        return False


def file_exists(path: str) -> bool:
    """.NET ``File.Exists`` on Unix: anything but a folder is there, or a link whose target
    cannot be reached (``unreachable_link``)."""
    try:
        return not stat.S_ISDIR(os.stat(path).st_mode)
    except OSError:
        return unreachable_link(path)


def is_within(path: Path, workspace: Path) -> bool:
    """Tell whether ``path`` is ``workspace`` or below it, component-wise.

    Args:
        path: A canonical absolute path.
        workspace: A canonical absolute directory.

    Returns:
        True when ``path`` is the workspace or inside it (``/ws2`` is not inside ``/ws``).
    """
    return path == workspace or workspace in path.parents


def is_credential_path(path: str, user_home: Path | None = None) -> bool:
    """Tell whether a path text names a credential location.

    After ``~`` expansion (when ``user_home`` is given), backslashes become slashes and
    trailing slashes are trimmed; then the path is a credential path when any whole
    segment is ``.ssh`` or ``.gnupg``, or a ``.crystal`` segment is immediately
    followed by ``credentials.json``. Segments compare case-insensitively (case-folded,
    which errs on the side of matching). Text with a NUL byte is also judged on the
    part before it, which is what a C program would open.

    Args:
        path: The raw or resolved path text.
        user_home: The operator's user profile, for ``~`` expansion.

    Returns:
        True for a credential path.
    """
    texts = [path]
    if "\x00" in path:
        texts.append(path.partition("\x00")[0])
    for text in texts:
        if user_home is not None:
            text = expand_user(text, user_home)
        segments = [s.casefold() for s in text.replace("\\", "/").rstrip("/").split("/")]
        if any(s in _CREDENTIAL_SEGMENTS for s in segments):
            return True
        if any(pair in _CREDENTIAL_PAIRS for pair in itertools.pairwise(segments)):
            return True
    return False


def _collect_identities(path: str, found: set[tuple[int, int]], depth: int) -> None:
    try:
        st = os.stat(path)
    except (OSError, ValueError):
        return
    found.add((st.st_dev, st.st_ino))
    if not stat.S_ISDIR(st.st_mode) or depth >= IDENTITY_DEPTH:
        return
    try:
        with os.scandir(path) as entries:
            names = [
                entry.path for _, entry in zip(range(_IDENTITY_ENTRIES), entries, strict=False)
            ]
    except OSError:
        return
    for name in names:
        _collect_identities(name, found, depth + 1)


def credential_identities(
    user_home: Path, crystal_home: Path | None = None, *, passwd: bool = True
) -> frozenset[tuple[int, int]]:
    """The ``(st_dev, st_ino)`` of the user's credential folders and files, read now.

    Args:
        user_home: The operator's user profile.
        crystal_home: The Crystal home (``--home``, ``$CRYSTAL_HOME``), when it is not
            ``~/.crystal``: its ``credentials.json`` is a credential file too.
        passwd: Also the credential locations of the home in the user's passwd entry,
            where it is another folder than ``user_home`` (``HOME`` set elsewhere): ssh
            reads its keys from there whatever ``HOME`` says, and the sandbox hides them.

    Returns:
        The identities of ``~/.ssh`` and ``~/.gnupg`` and what is below them (bounded),
        and of ``~/.crystal/credentials.json`` and ``<crystal_home>/credentials.json``;
        those that do not exist are left out.
    """
    found: set[tuple[int, int]] = set()
    homes = [os.fspath(user_home)]
    other = passwd_home() if passwd else None
    if other is not None and os.path.normpath(other) != os.path.normpath(homes[0]):
        homes.append(other)
    for home in homes:
        for folder in CREDENTIAL_FOLDERS:
            _collect_identities(os.path.join(home, folder), found, 0)
        for parts in CREDENTIAL_FILES:
            _collect_identities(os.path.join(home, *parts), found, IDENTITY_DEPTH)
    if crystal_home is not None:
        _collect_identities(
            os.path.join(os.fspath(crystal_home), CREDENTIAL_FILES[0][-1]), found, IDENTITY_DEPTH
        )
    return frozenset(found)


def _crystal_credentials(crystal_home: Path) -> Path | None:
    """The canonical path of the Crystal home's ``credentials.json`` (None: unresolvable)."""
    try:
        return resolve_path(CREDENTIAL_FILES[0][-1], crystal_home, crystal_home)
    except (PathError, ValueError):
        return None


def is_crystal_credentials(resolved: Path | str, crystal_home: Path | None) -> bool:
    """Whether a resolved path is the Crystal home's ``credentials.json`` by its place (it
    need not exist yet; the home need not be called ``.crystal``).

    Args:
        resolved: The canonical path (symlinks already resolved).
        crystal_home: The Crystal home, or None (then no path is).

    Returns:
        True when it is that file's canonical path.
    """
    return crystal_home is not None and Path(resolved) == _crystal_credentials(crystal_home)


def is_credential_identity(
    resolved: Path | str, user_home: Path, crystal_home: Path | None = None
) -> bool:
    """Tell whether a resolved path is, or lies below, a credential location by identity.

    A hard link to ``~/.ssh/id_rsa`` or a bind mount of ``~/.ssh`` has no credential
    segment; its device and inode give it away. The path and each existing ancestor are
    compared with ``credential_identities(user_home, crystal_home)``. The Crystal home's
    ``credentials.json`` is also caught by its canonical path, so one that does not exist
    yet counts too (the home need not be called ``.crystal``, so no segment names it).

    Args:
        resolved: The canonical path (symlinks already resolved).
        user_home: The operator's user profile.
        crystal_home: The Crystal home, whose ``credentials.json`` is a credential file.

    Returns:
        True when the path or an ancestor is a credential file or folder.
    """
    if is_crystal_credentials(resolved, crystal_home):
        return True
    mine: set[tuple[int, int]] = set()
    current = os.fspath(resolved)
    while True:
        try:
            st = os.stat(current)
        except (OSError, ValueError):
            pass
        else:
            mine.add((st.st_dev, st.st_ino))
        parent = os.path.dirname(current)
        if parent == current:
            break
        current = parent
    return not mine.isdisjoint(credential_identities(user_home, crystal_home))


def scope_of(
    raw: str,
    resolved: Path | None,
    workspace: Path,
    user_home: Path,
    crystal_home: Path | None = None,
) -> Scope:
    """Scope one path argument.

    Args:
        raw: The argument's text as sent.
        resolved: Its canonical path, or None when it could not be resolved.
        workspace: The workspace directory (canonicalized here if it is not already).
        user_home: The operator's user profile.
        crystal_home: The Crystal home, whose ``credentials.json`` is a credential file.

    Returns:
        ``forbidden`` when the raw or the resolved path is a credential path, or the
        resolved path is one by identity (``is_credential_identity``);
        ``outsideWorkspace`` when it is outside the workspace or could not be
        resolved; ``workspace`` otherwise.
    """
    if is_credential_path(raw, user_home):
        return Scope.FORBIDDEN
    if resolved is None:
        return Scope.OUTSIDE
    if is_credential_path(os.fspath(resolved), user_home):
        return Scope.FORBIDDEN
    if is_credential_identity(resolved, user_home, crystal_home):
        return Scope.FORBIDDEN
    if is_within(resolved, canonical_workspace(workspace)):
        return Scope.WORKSPACE
    return Scope.OUTSIDE


def rewrite_arguments(
    tool: ToolDef,
    arguments: Any,
    workspace: Path,
    user_home: Path,
    resolved: Mapping[str, str | None] | None = None,
) -> Any:
    """Build the arguments the child receives: path arguments rewritten to absolute paths.

    Only tools with ``pathArguments`` are touched. Their arguments must be an object;
    each named property holding a string is resolved, other values (numbers, null,
    arrays, objects) and other properties pass through unchanged, in their order.

    Args:
        tool: The tool definition (its ``path_arguments``).
        arguments: The arguments as the caller sent them.
        workspace: The workspace directory.
        user_home: The operator's user profile.
        resolved: The paths already resolved (and judged) by property name, None for one
            that could not be resolved. ``classify`` passes what it scoped, so the child
            receives exactly the path that was judged: resolving a second time would let a
            link swapped in between reach the child unjudged (a ``~/.ssh`` key under a name
            that was scoped ``workspace``). A name missing here is resolved now.

    Returns:
        ``arguments`` itself when the tool declares no path arguments, else a new dict.

    Raises:
        ArgumentsError: ``Arguments must be a JSON object.``, ``Argument '<name>' must
            be a path string.`` for a blank value, ``Path is not valid.`` for a value
            that cannot be resolved.
    """
    if not tool.path_arguments:
        return arguments
    if not isinstance(arguments, Mapping):
        raise ArgumentsError("Arguments must be a JSON object.")
    names = frozenset(tool.path_arguments)
    rewritten: dict[str, Any] = {}
    for name, value in arguments.items():
        if name in names and isinstance(value, str):
            if not trim_path(value):
                raise ArgumentsError(f"Argument '{name}' must be a path string.", name)
            if resolved is not None and name in resolved:
                judged = resolved[name]
                if judged is None:
                    raise ArgumentsError(INVALID_PATH_MESSAGE, name)
                value = judged
            else:
                try:
                    value = os.fspath(resolve_path(value, workspace, user_home))
                except PathError as exc:
                    raise ArgumentsError(exc.message, name) from None
        rewritten[name] = value
    return rewritten
