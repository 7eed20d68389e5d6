"""Editing a tool set's ``enabled`` field in place (``toolsetctl enable|disable``).

Theory of operation, the reference host's rules (``ToolSetInventory.TrySetEnabled``):

1. ``locate_set`` picks the manifest. The directory name is trimmed and must be a legal
   set directory name (``Directory name is invalid.``). With ``--source`` that copy must
   exist (``Tool set '<d>' was not found in Home.`` / ``... in Project.``); without it the
   project copy wins over the home copy (``Tool set '<d>' was not found.``). A copy
   exists as discovery has it (the caller's ``exists``: .NET's ``File.Exists``), so a
   ``tools.json`` that cannot be read is still the copy meant, and reports its error.
2. ``set_enabled`` reads the bytes. A manifest that is not JSON, not an object, or (when
   the caller passes ``check``, the full manifest parser) fails to parse is left
   byte-for-byte untouched and its parse error is raised. Bytes that are not UTF-8 (the
   daemon reads them as U+FFFD) are refused, naming the first, only when the file must be
   rewritten: the rewrite would replace them.
3. When ``enabled`` (absent or null meaning true) already has the wanted value nothing is
   written. Otherwise the key is set: an existing key keeps its position, a new one is
   appended last. The file is rewritten as 2-space indented JSON (non-ASCII kept, each
   number as written) plus a newline, through a temporary file in the same folder,
   fsync, and ``os.replace``, keeping the file's permission bits (and, for root, its owner
   and group). A symlinked
   ``tools.json`` is written through to its target, so the link survives.

Nothing here talks to the daemon or imports it; the CLI asks a running daemon to reload
afterwards.
"""

from __future__ import annotations

import contextlib
import json
import os
import stat
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from toolsetd.protocol.errors import reject_json_constant
from toolsetd.protocol.whitespace import NET_WHITESPACE

from .render import is_directory_name

__all__ = ["EditError", "EditOutcome", "locate_set", "manifest_path", "set_enabled"]

_MANIFEST = "tools.json"


class EditError(Exception):
    """The edit cannot be done; ``message`` is the operator-facing sentence.

    Attributes:
        message: The English message, printed as is.
    """

    def __init__(self, message: str) -> None:
        """Create the error.

        Args:
            message: The English message.
        """
        super().__init__(message)
        self.message = message


@dataclass(frozen=True, slots=True)
class EditOutcome:
    """What ``set_enabled`` did.

    Attributes:
        path: The manifest path.
        changed: Whether the file was rewritten (False: it already had the value).
    """

    path: Path
    changed: bool


def manifest_path(home: Path, workspace: Path, directory: str, source: str) -> Path:
    """Return the ``tools.json`` path of a set directory.

    Args:
        home: The Crystal home.
        workspace: The workspace root.
        directory: The set directory name.
        source: ``home`` or ``project``.
    """
    root = home / "tools" if source == "home" else workspace / ".crystal" / "tools"
    return root / directory / _MANIFEST


def locate_set(
    home: Path,
    workspace: Path,
    directory: str,
    source: str | None,
    *,
    exists: Callable[[str], bool],
) -> tuple[str, str, Path]:
    """Find the manifest a command means (the project copy wins without ``source``).

    Args:
        home: The Crystal home.
        workspace: The workspace root.
        directory: The directory name as the operator typed it.
        source: ``home``, ``project`` or None.
        exists: Whether a ``tools.json`` makes its folder a candidate, as discovery
            decides (``daemon.paths.file_exists``: anything but a folder, or a link that
            leads nowhere). A FIFO or a dangling link there is the copy ``list`` and
            ``show`` mean, and hides the home copy: picking the home copy past it edited a
            set that does not count.

    Returns:
        ``(directory, source, manifest path)``.

    Raises:
        EditError: The name is invalid or no such set exists.
    """
    name = directory.strip(NET_WHITESPACE)  # as .NET's Trim(): U+001C..U+001F stay
    if not name or not is_directory_name(name):
        raise EditError("Directory name is invalid.")
    if source is not None:
        path = manifest_path(home, workspace, name, source)
        if not exists(str(path)):
            where = "Home" if source == "home" else "Project"
            raise EditError(f"Tool set '{name}' was not found in {where}.")
        return name, source, path
    for candidate in ("project", "home"):
        path = manifest_path(home, workspace, name, candidate)
        if exists(str(path)):
            return name, candidate, path
    raise EditError(f"Tool set '{name}' was not found.")


def _load_object(data: bytes) -> tuple[dict[str, Any], str | None]:
    """Parse manifest bytes into an ordered object, or raise the parse error.

    Each number keeps its text (``protocol.jsontext``), so writing the object back changes
    no number: the reference host's ``JsonNode`` keeps a number's text too.

    Returns:
        The object, and why it may not be written back (bytes that are not UTF-8, which
        the daemon reads as U+FFFD and a rewrite would replace), or None.
    """
    from toolsetd.protocol.jsontext import decode_file_text, loads  # orjson: for an edit only

    unwritable: str | None = None
    try:
        text = decode_file_text(data, "strict")  # a byte order mark read as the daemon reads it
    except UnicodeDecodeError as exc:
        unwritable = _not_utf8(exc)
        text = decode_file_text(data, "replace")  # as the daemon reads it
    try:
        json.loads(text, parse_constant=reject_json_constant)  # the parse error, in its words
        value = loads(text)
    except (json.JSONDecodeError, ValueError) as exc:
        raise EditError(f"tools.json is not valid JSON: {exc}") from exc
    if not isinstance(value, dict):
        raise EditError("tools.json must be a JSON object.")
    return value, unwritable


def _not_utf8(exc: UnicodeDecodeError) -> str:
    """The refusal of a manifest whose bytes do not decode, naming the first bad byte."""
    before = exc.object[: exc.start]
    line = before.count(b"\n") + 1
    column = exc.start - (before.rfind(b"\n") + 1) + 1
    return (
        f"tools.json is not valid {exc.encoding.upper()} (byte 0x{exc.object[exc.start]:02x} "
        f"at line {line}, column {column}): writing enabled would replace what does not "
        "decode (the daemon reads it as U+FFFD); save the file as UTF-8, or edit it by hand."
    )


def set_enabled(
    path: Path,
    enabled: bool,
    *,
    check: Callable[[bytes], str | None] | None = None,
    read: Callable[[Path], bytes] | None = None,
) -> EditOutcome:
    """Write ``enabled`` into one manifest, leaving the rest of it as it was.

    Args:
        path: The ``tools.json`` path.
        enabled: The wanted value.
        check: The full manifest check: returns the parse error of the bytes, or None
            when they parse. Without it only JSON and the object root are checked.
        read: Reads the manifest's bytes, raising ``EditError`` when it cannot (the CLI
            passes the daemon's reader: regular files only, never a blocking open).
            Without it the file is read as it is.

    Returns:
        The path and whether the file changed.

    Raises:
        EditError: The file cannot be read, does not parse (it is left untouched), or
            cannot be written.
    """
    try:
        data = read(path) if read is not None else path.read_bytes()
    except OSError as exc:
        raise EditError("tools.json could not be read.") from exc
    if check is not None:
        problem = check(data)
        if problem is not None:
            raise EditError(problem)
    document, unwritable = _load_object(data)
    current = document.get("enabled")
    current_value = True if current is None else current
    if current_value is enabled:
        return EditOutcome(path, changed=False)
    if unwritable is not None:
        raise EditError(unwritable)
    document["enabled"] = enabled
    import orjson
    from toolsetd.protocol.jsontext import dumps

    # 2-space indented, non-ASCII kept, every number as written, a trailing newline.
    data = dumps(document, orjson.OPT_INDENT_2 | orjson.OPT_APPEND_NEWLINE)
    target = Path(os.path.realpath(path))
    try:
        _replace(target, data)
    except OSError as exc:
        # The operating system's words and the folder: a CI user that may not write the
        # checkout, a read-only mount, a full disk.
        raise EditError(
            f"tools.json could not be written: {exc.strerror or type(exc).__name__}: the "
            f"edit writes a new file in {target.parent} and renames it over {target.name}."
        ) from exc
    return EditOutcome(path, changed=True)


def _replace(target: Path, data: bytes) -> None:
    """Atomically replace ``target`` with ``data``, keeping its permission bits and, where
    this user may give it (root), its owner and group."""
    info = target.stat()
    mode = stat.S_IMODE(info.st_mode)
    fd, temp_name = tempfile.mkstemp(dir=target.parent, prefix=".tools.json.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
            if (info.st_uid, info.st_gid) != (os.geteuid(), os.getegid()):
                # root editing the sets of a daemon that runs as its own user: a root-owned
                # 0600 manifest is one that daemon can no longer read. (The reference host
                # renames a new file over it too, and leaves it root's: here it is given
                # back.) Anyone else may not give files away.
                with contextlib.suppress(PermissionError):
                    os.fchown(handle.fileno(), info.st_uid, info.st_gid)
        os.chmod(temp_name, mode)
        os.replace(temp_name, target)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temp_name)
        raise
