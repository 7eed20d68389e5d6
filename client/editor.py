"""Editing a tool set's ``enabled`` field in place (``toolsetctl enable|disable``).

Theory of operation, the reference host's rules (``ToolSetInventory.TrySetEnabled``) but for
how the file is written:

1. ``locate_set`` picks the manifest. The directory name is trimmed and must be a legal
   set directory name (``Directory name is invalid.``). With ``--source`` that copy must
   exist (``Tool set '<d>' was not found in Home.`` / ``... in Project.``); without it the
   project copy wins over the home copy (``Tool set '<d>' was not found.``). A copy
   exists as discovery has it (the caller's ``exists``: .NET's ``File.Exists``), so a
   ``tools.json`` that cannot be read is still the copy meant, and reports its error.
2. ``set_enabled`` reads the bytes. A manifest that is not JSON, not an object, or (when
   the caller passes ``check``, the full manifest parser) fails to parse is left
   byte-for-byte untouched and its parse error is raised.
3. When ``enabled`` (absent or null meaning true) already has the wanted value nothing is
   written. Otherwise only that value is written, and the rest of the file is left as it
   was (the contract's rule; the reference host rewrites the whole file as 2-space
   indented JSON): every top-level ``enabled`` has its value replaced where it stands, or
   a new member is added after the last one, laid out as that one is. The byte order mark,
   the encoding and UTF-8's undecodable bytes are kept (a UTF-16 or UTF-32 file that does
   not decode is refused, naming the first bad byte: it could not be written back). The
   new bytes go through a temporary file in the same folder, fsync, and ``os.replace``,
   keeping the file's permission bits (and, for root, its owner and group). A symlinked
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

from toolsetd.protocol.errors import reject_json_constant
from toolsetd.protocol.jsontext import decode_file_text, file_encoding
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


def _load_object(data: bytes) -> None:
    """Check that manifest bytes are a JSON object, or raise the parse error in the
    standard library's words (as the daemon reads them: a byte order mark chooses the
    encoding, what does not decode is U+FFFD)."""
    text = decode_file_text(data, "replace")
    try:
        value = json.loads(text, parse_constant=reject_json_constant)
    except (json.JSONDecodeError, ValueError) as exc:
        raise EditError(f"tools.json is not valid JSON: {exc}") from exc
    if not isinstance(value, dict):
        raise EditError("tools.json must be a JSON object.")


#: JSON's whitespace (RFC 8259; the standard library's parser and .NET's read no other).
_SPACE = frozenset(" \t\n\r")
#: The longest gap before a member that an added ``enabled`` copies; a longer one (a
#: hostile file's run of spaces, which would double its size) is written as a line break
#: and two spaces, or one space.
_GAP_MAX = 80


@dataclass(frozen=True, slots=True)
class _Member:
    """One member of the top-level object, by its offsets in the text."""

    key: str  # escapes decoded: "en\u0061bled" is enabled, as every reader reads it
    key_start: int  # its opening quote
    key_end: int  # past its closing quote
    value_start: int
    value_end: int


def _members(text: str) -> tuple[list[_Member], int]:
    """The top-level object's members, and the offset of its closing brace. ``text`` is
    JSON the standard library parsed (``_load_object``): its layout is not in doubt."""
    decoder = json.JSONDecoder(parse_constant=reject_json_constant)
    members: list[_Member] = []
    at = _skip(text, _skip(text, 0) + 1)  # past "{"
    while text[at] != "}":
        key_start = at
        key, key_end = decoder.raw_decode(text, at)  # a key is a JSON string
        value_start = _skip(text, _skip(text, key_end) + 1)  # past ":"
        _, value_end = decoder.raw_decode(text, value_start)
        members.append(_Member(key, key_start, key_end, value_start, value_end))
        at = _skip(text, value_end)
        if text[at] == ",":
            at = _skip(text, at + 1)
    return members, at


def _skip(text: str, at: int) -> int:
    """The offset of the first character from ``at`` on that is not JSON whitespace."""
    while text[at] in _SPACE:  # the text is an object: a "}" ends it before its end
        at += 1
    return at


def _with_enabled(text: str, enabled: bool) -> str | None:
    """``text`` with ``enabled`` set, the rest of it as it was; None when it already has
    the value (absent or null meaning true, as the daemon reads it).

    Every ``enabled`` member has its value replaced where it stands (a repeated key too:
    then no reader, whichever copy it takes, sees the old value). Without one, a member is
    added after the last, laid out as that one is: the same gap before it (a line break
    and its indent, or a space) and around its colon, in the file's own line ends.
    """
    members, close = _members(text)
    word = "true" if enabled else "false"
    found = [m for m in members if m.key == "enabled"]
    if found:
        values = [text[m.value_start : m.value_end] for m in found]
        if all(v == word or (enabled and v == "null") for v in values):
            return None
        pieces: list[str] = []  # one pass: 70,000 copies do not copy the text 70,000 times
        done = 0
        for m in found:
            pieces += (text[done : m.value_start], word)
            done = m.value_end
        pieces.append(text[done:])
        return "".join(pieces)
    if enabled:
        return None
    if not members:
        return text[:close] + f'"enabled": {word}' + text[close:]
    last = members[-1]
    # The comma before it (or the brace): what follows, to the key, is its gap.
    before = text.index(",", members[-2].value_end) if len(members) > 1 else text.index("{")
    gap = text[before + 1 : last.key_start]  # "\n  ", "\r\n\t", " " or ""
    if len(gap) > _GAP_MAX:
        gap = ("\r\n  " if "\r\n" in gap else "\n  ") if "\n" in gap else " "
    colon = text[last.key_end : last.value_start]  # ": ", ":" or " : ", as written
    if len(colon) > _GAP_MAX:
        colon = ": "
    return f'{text[: last.value_end]},{gap}"enabled"{colon}{word}{text[last.value_end :]}'


def _undecodable(exc: UnicodeDecodeError) -> str:
    """The refusal of a UTF-16 or UTF-32 manifest that does not decode, naming where (the
    line and column in characters, as an editor shows them) and its code unit."""
    before = exc.object[: exc.start].decode(exc.encoding)  # all that comes before decodes
    line = before.count("\n") + 1
    column = len(before) - (before.rfind("\n") + 1) + 1
    unit = " ".join(f"{byte:02x}" for byte in exc.object[exc.start : exc.end])
    return (
        f"tools.json is not valid {exc.encoding.upper()} (bytes {unit} at line {line}, column "
        f"{column}): writing enabled would replace what does not decode (the daemon reads it "
        "as U+FFFD); save the file as UTF-8, or edit it by hand."
    )


def set_enabled(
    path: Path,
    enabled: bool,
    *,
    check: Callable[[bytes], str | None] | None = None,
    read: Callable[[Path], bytes] | None = None,
    max_bytes: int | None = None,
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
        max_bytes: The largest manifest the daemon reads (1 MiB): an edit that would make
            the file larger is refused, as the daemon would then skip the set and no
            ``enable`` could read it again to undo it.

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
    _load_object(data)
    bom, encoding = file_encoding(data)
    # UTF-8's bytes that do not decode are carried through as they were (the daemon reads
    # them as U+FFFD either way); UTF-16 and UTF-32 have no such carrier.
    errors = "surrogateescape" if encoding == "utf-8" else "strict"
    unwritable: str | None = None
    try:
        text = data[len(bom) :].decode(encoding, errors)
    except UnicodeDecodeError as exc:
        unwritable = _undecodable(exc)
        text = decode_file_text(data, "replace")  # as the daemon reads it
    edited = _with_enabled(text, enabled)
    if edited is None:
        return EditOutcome(path, changed=False)
    if unwritable is not None:  # what does not decode would be written as U+FFFD
        raise EditError(unwritable)
    data = bom + edited.encode(encoding, errors)
    if max_bytes is not None and len(data) > max_bytes:
        raise EditError(
            f"tools.json would be {len(data):,} bytes with enabled written, past the "
            f"{max_bytes:,} the daemon reads (it would skip the set): nothing was written; "
            "make the file smaller first."
        )
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
