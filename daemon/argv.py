"""Argv composition and executable resolution for exec tools (pure, no I/O but one stat).

Theory of operation: the argv of one call is the set ``command``, then the tool's
``command`` suffix, then, for each ``argv`` entry of the manifest in manifest order whose
property is present in the arguments, the flag followed by the rendered value
(reference host section 3, step 1). Values arrive as Python objects (the arguments were
parsed and validated before the runner sees them), so:

* a string is passed as is;
* ``True``/``False`` render as ``true``/``false`` (a deliberate difference from the
  reference host's ``True``/``False``), checked before numbers because ``bool`` is an ``int``;
* a number renders as its JSON text exactly as the caller wrote it, as the reference host
  does (``1.50`` stays ``1.50``, ``1e3`` stays ``1e3``): the codec keeps that text in a
  ``JsonNumber`` (``protocol.jsontext``) and integers exactly at any width, so an ``int``
  renders as ``str(int)`` and a ``JsonNumber`` as its ``text``; any other ``float`` (not
  from the wire) as orjson writes it;
* a list of strings adds the flag once per element, an empty list adds nothing;
* anything else fails with the reference host's messages.

Executable resolution (step 2): a bare name (no ``/`` or ``\\``, not rooted) that exists in
the set directory as .NET's ``File.Exists`` sees it (anything but a folder, a link that leads
nowhere included) runs from there, else it is left for the PATH search of the child
environment; a relative path containing a separator must stay inside the set directory
(checked lexically, as .NET ``GetFullPath`` does); an absolute path is used as
``GetFullPath`` writes it (``.`` and ``..`` applied lexically).
"""

from __future__ import annotations

import errno
import os
import shutil
import stat
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from toolsetd.protocol.jsontext import JsonNumber, strict_dumps

from .binfmt import runs_through_binfmt
from .model import LoadedTool
from .paths import file_exists

__all__ = [
    "ArgvError",
    "build_argv",
    "render_flags",
    "resolve_executable",
    "shebang_interpreter",
]

COMMAND_REQUIRED = "exec requires a command array."
ARGUMENTS_NOT_OBJECT = "Arguments must be a JSON object."
EXECUTABLE_OUTSIDE = "Executable path must stay inside the tool set directory."
EXECUTABLE_INVALID = "Executable path is not valid."


class ArgvError(Exception):
    """The argv of a call could not be built; ``message`` is the model-facing text."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


def _render_number(value: float) -> str:
    if type(value) is JsonNumber:
        return value.text
    try:
        return strict_dumps(value).decode()
    except TypeError:  # nan/inf cannot come from JSON; be safe
        return repr(value)


def render_flags(flags: Sequence[tuple[str, str]], arguments: Any) -> list[str]:
    """Render the manifest's ``argv`` map against one call's arguments.

    Args:
        flags: ``(property, flag)`` pairs in manifest order.
        arguments: The (fenced) argument value.

    Returns:
        The flag/value words, in manifest order.

    Raises:
        ArgvError: With the reference host's message.
    """
    if not flags:
        return []
    if not isinstance(arguments, Mapping):
        raise ArgvError(ARGUMENTS_NOT_OBJECT)
    words: list[str] = []
    for prop, flag in flags:
        if prop not in arguments:
            continue
        value = arguments[prop]
        if isinstance(value, str):
            words += (flag, value)
        elif isinstance(value, bool):
            words += (flag, "true" if value else "false")
        elif isinstance(value, int):
            words += (flag, str(value))
        elif isinstance(value, float):
            words += (flag, _render_number(value))
        elif isinstance(value, list | tuple):
            if not all(isinstance(item, str) for item in value):
                raise ArgvError(f"Argument for '{flag}' arrays must contain strings.")
            for item in value:
                words += (flag, item)
        else:
            raise ArgvError(
                f"Argument for '{flag}' must be a string, number, boolean, or string array."
            )
    return words


def _full_path(path: str) -> str:
    """.NET ``Path.GetFullPath`` of an absolute path: ``.`` and ``..`` applied lexically,
    repeated separators collapsed, a trailing separator kept."""
    full = "/" + os.path.normpath(path).lstrip("/")
    return full + "/" if path.endswith("/") and full != "/" else full


def resolve_executable(name: str, set_dir: Path) -> str:
    """Resolve argv[0] as the reference host does.

    Args:
        name: The first word of the command.
        set_dir: The absolute set directory.

    Returns:
        The path to execute, or the bare name for a PATH search.

    Raises:
        ArgvError: When the path is invalid or a relative path leaves the set directory.
    """
    if not name or "\0" in name:
        raise ArgvError(EXECUTABLE_INVALID)
    if name.startswith("/"):
        return _full_path(name)  # the reference host runs GetFullPath's result
    base = os.path.normpath(str(set_dir))
    if "/" not in name and "\\" not in name:
        candidate = os.path.join(base, name)
        # File.Exists: a link there that leads nowhere still names this file (the start
        # then fails), never a program of the same name on PATH.
        return candidate if file_exists(candidate) else name
    candidate = _full_path(os.path.join(base, name))
    inside, root = candidate.rstrip("/"), base.rstrip("/")
    # ExternalPath.IsInside: the set directory itself is inside (``./`` then fails to start).
    if inside != root and not inside.startswith(root + "/"):
        raise ArgvError(EXECUTABLE_OUTSIDE)
    return candidate


def build_argv(loaded: LoadedTool, arguments: Any) -> list[str]:
    """Compose the full argv of one call: set prefix, tool suffix, flags; argv[0] resolved.

    Args:
        loaded: The tool being called.
        arguments: The validated, fenced arguments.

    Returns:
        The argv list, argv[0] resolved.

    Raises:
        ArgvError: ``exec requires a command array.``, a rendering error or an executable error.
    """
    command = [*loaded.toolset.command, *loaded.tool.command]
    if not command:
        raise ArgvError(COMMAND_REQUIRED)
    flags = render_flags(loaded.tool.argv, arguments)
    command[0] = resolve_executable(command[0], loaded.toolset.path)
    return command + flags


#: How much of a command file the kernel reads for its ``#!`` line: ``BINPRM_BUF_SIZE``,
#: 256 bytes since Linux 5.1 (128 before). A line that ends past it is cut there; one whose
#: interpreter's name does not end within it is refused (ENOEXEC, since Linux 5.0).
_HEAD_BYTES = 256

#: How many scripts the kernel runs in a chain of ``#!`` interpreters (a script whose
#: interpreter is a script, ...): exec gives up at a sixth with ELOOP (``fs/exec.c``).
_MAX_SCRIPTS = 5


def _shebang(head: bytes) -> tuple[bytes, bytes | None] | None:
    """The interpreter and the optional argument the kernel reads from the ``#!`` line in
    ``head`` (``fs/binfmt_script.c``); None when the kernel refuses the line (ENOEXEC):
    it names no interpreter, or the name does not end (a space, a tab or a NUL) within
    the bytes read.

    The kernel's buffer holds NULs past a shorter file's end; the line ends at the first
    line feed in it, else it is cut before the buffer's last byte; spaces and tabs around
    it are dropped; the name ends at a space, a tab or a NUL, and the rest, from its first
    character that is neither space nor tab, is one argument (none after a NUL).
    """
    buf = head[:_HEAD_BYTES].ljust(_HEAD_BYTES, b"\0")
    end = buf.find(b"\n")
    if end < 0:
        body = buf[2 : _HEAD_BYTES - 1].lstrip(b" \t")
        if not body or not any(c in body + buf[-1:] for c in (b" ", b"\t", b"\0")):
            return None  # spaces only, or an interpreter's name the buffer cuts
        end = _HEAD_BYTES - 1  # the argument is cut there
    line = buf[2:end].strip(b" \t")
    if not line:
        return None
    stops = [i for i in (line.find(b" "), line.find(b"\t"), line.find(b"\0")) if i >= 0]
    if not stops:
        return line, None
    stop = min(stops)
    rest = line[stop:].lstrip(b" \t") if line[stop : stop + 1] != b"\0" else b""
    return line[:stop], rest.split(b"\0", 1)[0] or None


def interpreter_failure(
    path: str, *, without_line: bool = True, relative: bool = True
) -> tuple[int, str]:
    """Why the executable regular file ``path`` cannot be run as it stands: the errno its
    start fails with and the sentence that names the fix, else ``(0, "")``.

    The kernel reads a script's ``#!`` line to find its interpreter, and when it cannot,
    ``execve`` fails with words that point elsewhere: a ``#!/bin/sh`` line saved with
    Windows line endings names the interpreter ``/bin/sh\\r``, and an interpreter that
    is not installed, say ``/usr/bin/python9``, both fail as "No such file or directory"
    for the script that is right there; a script with no ``#!`` line at all, or a ``#!``
    line that names no interpreter or one whose name runs past the 256 bytes the kernel
    reads (not cut, as before Linux 5.0: refused), fails as "Exec format error". An
    interpreter that is itself a script is read the same way, to the kernel's depth
    (past it: "Too many levels of symbolic links"). These are the sentences that name
    the fix.

    Args:
        path: The command file (an absolute path).
        without_line: Whether a file that starts with neither ``#!`` nor an ELF header
            counts as a problem. bubblewrap's ``execvp`` runs such a file with
            ``/bin/sh``, so only unsandboxed starts fail for it; and none does when a
            binfmt_misc format of the machine matches it (``binfmt``).
        relative: Whether an interpreter named by a relative path (``#!bash``) counts as
            a problem. The kernel looks for it from the folder the tool starts in (the
            workspace), never on ``PATH``: there is almost never one there, but a check
            before a start, which cannot look there, must not refuse the call for it.
    """
    head = _head(path)
    subject, chain = f"Command file {path}", [path]
    while True:
        if head.startswith(b"\x7fELF"):
            return 0, ""
        if not head.startswith(b"#!"):
            if not without_line or not head or runs_through_binfmt(chain[-1], head):
                return 0, ""  # a format binfmt_misc has registered (a .jar, an MZ program)
            return errno.ENOEXEC, (
                f"{subject} does not start with a #! line: make its first line one that names "
                "its interpreter, such as #!/bin/sh."
            )
        parsed = _shebang(head)
        if parsed is None:
            return errno.ENOEXEC, _unread_line(subject, head)
        name, argument = parsed
        if (name if argument is None else argument).endswith(b"\r"):
            return errno.ENOENT, _crlf(subject, chain[-1])
        interpreter = os.fsdecode(name)
        named = f"{subject} names the interpreter {interpreter} on its #! line, "
        if not interpreter.startswith("/"):
            if not relative or not interpreter:
                return 0, ""
            return errno.ENOENT, named + (
                "a relative path, which the system looks for from the folder the tool runs "
                "in (the workspace), not on PATH: name it by its full path, or through env "
                f"(#!/usr/bin/env {interpreter})."
            )
        if not os.path.exists(interpreter):
            return errno.ENOENT, named + "which does not exist: install it, or name one that does."
        if os.path.isdir(interpreter):
            return errno.EACCES, named + "which is a folder: name the program in it."
        if not os.access(interpreter, os.X_OK):
            if _on_noexec(interpreter):
                return errno.EACCES, named + (
                    "which is on a file system mounted noexec, from which the system starts "
                    "no program: name an interpreter on another file system."
                )
            return errno.EACCES, named + (
                f"which is not executable: run chmod +x {interpreter}, or name another."
            )
        head = _head(interpreter)
        if not head.startswith(b"#!"):
            return 0, ""  # a program (or what the kernel's other formats run)
        # A script: the kernel runs its interpreter in turn, a few levels deep.
        chain.append(interpreter)
        if len(chain) > _MAX_SCRIPTS:
            return errno.ELOOP, (
                f"Command file {path} starts a chain of scripts, each the #! interpreter of "
                f"the one before ({', '.join(chain[1:])}), longer than the "
                f"{_MAX_SCRIPTS} the system runs: name a program, not a script, on one of "
                "their #! lines."
            )
        subject = named + "a script that"


def shebang_interpreter(path: str) -> str | None:
    """The interpreter the ``#!`` line of the regular file ``path`` names as an absolute
    path, else None (no such line, or one the kernel refuses, or a relative name)."""
    head = _head(path)
    parsed = _shebang(head) if head.startswith(b"#!") else None
    if parsed is None or not parsed[0].startswith(b"/"):
        return None
    return os.fsdecode(parsed[0])


def _unread_line(subject: str, head: bytes) -> str:
    """The sentence for a ``#!`` line the kernel refuses (``_shebang`` is None)."""
    if head[2:_HEAD_BYTES].split(b"\n", 1)[0].strip(b" \t\r\0"):
        return (
            f"{subject} has a #! line whose interpreter's name does not end within the first "
            f"{_HEAD_BYTES} bytes of the file, all the system reads of it, so the system "
            "refuses to run it: name the interpreter by a shorter path (a link to it)."
        )
    return f"{subject} has a #! line that names no interpreter: name one, such as #!/bin/sh."


def _head(path: str) -> bytes:
    """The first bytes of the regular file ``path`` (where a ``#!`` line is), else b""."""
    try:
        # Never blocking: a FIFO with its x bit set (or one swapped in for the file)
        # would hold the daemon's loop in open() until a writer came.
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY)
    except OSError:
        return b""
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return b""
        return os.read(fd, _HEAD_BYTES)
    except OSError:
        return b""
    finally:
        os.close(fd)


def _crlf(subject: str, path: str) -> str:
    return (
        f"{subject} has Windows (CRLF) line endings: its #! line ends in a carriage return, "
        "which the system reads as part of the interpreter's name; save it with LF line "
        f"endings (dos2unix {path})."
    )


def env_failure(path: str, search_path: str | None) -> str:
    """Why the script ``path``, started, could not run when its ``#!`` line has ``env``
    look its interpreter up (``#!/usr/bin/env python9``) and ``env`` finds none: the
    sentence that names the fix, else "".

    The start succeeds (``env`` is there), and ``env`` exits 127 with its own "No such file
    or directory", which names neither the script nor the ``PATH`` searched. Said only when
    that is certain: the name ``env`` looks up is not on ``search_path`` (the child's
    ``PATH``), so whatever exited 127, the script never ran. Linux passes all of the line
    after the interpreter as one argument, so ``#!/usr/bin/env python3 -u`` looks up a
    program named ``python3 -u``: that one is told to use ``env -S``. Forms ``env`` reads
    otherwise (other options, ``NAME=value``) are left alone. A CRLF line ends in ``\r``,
    which ``env`` looks up too: that is said as ``interpreter_failure`` says it.

    Args:
        path: The command file (an absolute path).
        search_path: The child's ``PATH`` (None: it has none, and ``env`` searches the
            system's default, ``os.defpath``).
    """
    head = _head(path)
    parsed = _shebang(head) if head.startswith(b"#!") else None
    if parsed is None:
        return ""
    program, argument = parsed
    if argument is None or not program.startswith(b"/") or os.path.basename(program) != b"env":
        return ""
    env, rest = os.fsdecode(program), os.fsdecode(argument)
    if rest.endswith("\r"):
        return _crlf(f"Command file {path}", path)
    split = rest.startswith("-S")
    words = rest[2:].split() if split else [rest]
    if not words or words[0].startswith("-") or "=" in words[0]:
        return ""  # another option, or a variable: not a form read here
    name = words[0]
    folders = os.defpath if search_path is None else search_path
    if "/" in name or shutil.which(name, path=folders) is not None:
        return ""  # found (or a path: env runs it itself, and the system says why not)
    named = f"Command file {path} names the interpreter '{name}' on its #! line, through {env}"
    if not split and len(rest.split()) > 1:
        return named + (
            ": the system passes the rest of a #! line as one argument, so env looks for one "
            f"program of that name, spaces and all; write #!{env} -S {rest}."
        )
    return named + (
        ", which finds no such program on PATH (the tool's, which is toolsetd's): install "
        "it, or name one that is."
    )


def executable_problem(resolved: str, set_dir: Path, search_path: str | None = None) -> str:
    """What would stop the command ``resolved`` (``resolve_executable``'s answer) from
    starting, as one sentence with the fix, else "".

    ``toolsetctl validate`` lists it before a call, and a call that failed to start adds
    it to the system's reason, so both say the same.

    Args:
        resolved: The path to execute, or a bare name for a PATH search.
        set_dir: The set directory (a bare name was not found there).
        search_path: The ``PATH`` a bare name is looked up in (None: this process's).
    """
    child_path = search_path if search_path is not None else os.environ.get("PATH")
    if "/" not in resolved:
        runs = shutil.which(resolved, path=search_path)
        if runs is None:
            found = found_on_path(resolved, search_path)
            if found is not None:  # there, but not to be run: its own fix (chmod, noexec)
                return executable_problem(found, set_dir)
            return (
                f"Command '{resolved}' is neither a file in {set_dir} nor found on PATH "
                "(toolsetd searches its own PATH)."
            )
        # The one found, a script whose #! line may name no interpreter that runs (a
        # console script whose venv was made anew): the system says "No such file or
        # directory" of a name that is on PATH; or one env looks up and finds none.
        return interpreter_failure(runs)[1] or env_failure(runs, child_path)
    if not os.path.exists(resolved):
        return f"Command file {resolved} does not exist."
    if not os.path.isfile(resolved):
        return f"Command file {resolved} is not a file."
    if not os.access(resolved, os.X_OK):
        if _on_noexec(resolved):  # its x bits are no use there: chmod would not help
            return (
                f"Command file {resolved} is on a file system mounted noexec, from which the "
                "system starts no program: move the tool set to another file system, or "
                "mount this one without noexec."
            )
        return f"Command file {resolved} is not executable: run chmod +x {resolved}."
    return interpreter_failure(resolved)[1] or env_failure(resolved, child_path)


def found_on_path(name: str, search_path: str | None = None) -> str | None:
    """The first entry named ``name`` in a folder of ``search_path`` (None: this process's
    ``PATH``), executable or not, else None.

    ``shutil.which`` finds only a file that may be run; a spawn tries every folder, and
    where the only ``name`` there is not executable (or on a ``noexec`` mount) it fails as
    "Permission denied", for a command that is on ``PATH`` all the same.
    """
    folders = os.get_exec_path({"PATH": search_path} if search_path is not None else None)
    for folder in folders:
        if os.path.isabs(folder):  # a relative one is the child's folder, not ours
            candidate = os.path.join(folder, name)
            if os.path.exists(candidate):  # a link leading nowhere: the exec goes on
                return candidate
    return None


def _on_noexec(path: str) -> bool:
    """Whether ``path`` is on a file system mounted ``noexec`` (where ``access(X_OK)``
    and the exec both fail with ``EACCES``, whatever the file's mode)."""
    try:
        return bool(os.statvfs(path).f_flag & os.ST_NOEXEC)
    except OSError:
        return False
