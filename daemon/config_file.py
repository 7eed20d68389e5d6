"""Reading operator files safely, and ``<home>/config.json``.

Theory of operation: ``read_regular_file`` is the one way toolsetd reads a manifest or
the config file. It never blocks and never reads without bound: it accepts only regular
files (after following symlinks), checks the size before reading, opens with
``O_NONBLOCK`` so a FIFO swapped in after the ``stat`` cannot hang a worker thread,
re-checks the opened descriptor, refuses unread a file of the kernel's own file systems
(``/proc``, ``/sys``: regular files by their mode, kernel state by their reads), and stops
reading past ``MAX_MANIFEST_BYTES``. Its last
step, ``read_descriptor`` (read to the end, never past a bound), also serves the set cache,
which opens and checks its files its own way (``setcache.py``).

``load_config`` keeps the daemon serving whatever the file says: each bad part falls
back and yields an operator ``Note`` naming the field and the fix, each to its strict
reading: an ``externalTools`` that cannot be read, or a file that cannot be read or
parsed, turns discovery off; an approval source policy that cannot be read falls back to
``host`` (never to the ``author`` default, which would honour ``approval: always``).
"""

from __future__ import annotations

import functools
import json
import os
import platform
import stat
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

from toolsetd.protocol.jsontext import decode_file_text

from .manifest import ManifestError
from .model import ApprovalSource, Config, Note, Source
from .paths import NET_WHITESPACE

__all__ = [
    "MAX_MANIFEST_BYTES",
    "KernelFile",
    "ManifestUnchecked",
    "ManifestUnreadable",
    "load_config",
    "read_descriptor",
    "read_regular_file",
    "toml_shown",
]


def toml_shown(value: Any) -> str:
    """A TOML value as a config error message shows it: as the file writes it (``true``,
    ``"text"``, ``5``), or what it is (``a table``, ``a list``, ``a date (1979-05-27)``),
    never Python's ``repr`` (``True``, ``'text'``, ``datetime.date(1979, 5, 27)``)."""
    import datetime  # only for a message

    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return f'"{value}"'  # its control characters are made inert with the whole message
    if isinstance(value, dict):
        return "a table"
    if isinstance(value, list):
        return "a list"
    if isinstance(value, datetime.datetime):
        return f"a date and time ({value.isoformat()})"
    if isinstance(value, datetime.date):
        return f"a date ({value.isoformat()})"
    if isinstance(value, datetime.time):
        return f"a time ({value.isoformat()})"
    return repr(value)


#: Manifests and config.json larger than this are refused unread.
MAX_MANIFEST_BYTES = 1 << 20
_CONFIG_SET = "config.json"


class ManifestUnreadable(ManifestError):
    """A ``tools.json`` that could not be read (missing, not a regular file, too large, I/O)."""


class ManifestUnchecked(ManifestError):
    """A ``tools.json`` whose schemas the daemon cannot check with its own code now
    (``validation.JsonschemaChanged``): a note, never a cached verdict."""


def _unreadable(path: str | Path) -> ManifestUnreadable:
    return ManifestUnreadable(f"{os.path.basename(path)} could not be read.")


#: The kernel's own file systems (``statfs(2)``'s ``f_type``): their "regular files" are
#: views of kernel state, not files. ``/proc/self/environ`` is the daemon's environment,
#: ``/proc/kmsg`` a read that takes the kernel's messages from whoever else reads them (as
#: root), and their stat says 0 bytes whatever a read returns.
_KERNEL_FILE_SYSTEMS = {
    0x9FA0: "proc",
    0x62656572: "sysfs",
    0x64626720: "debugfs",
    0x74726163: "tracefs",
    0x73636673: "securityfs",
    0x62656570: "configfs",
    0x27E0EB: "cgroup",
    0x63677270: "cgroup2",
    0xCAFE4A11: "bpf",
    0x6165676C: "pstore",
    0xDE5E81E4: "efivarfs",
    0x42494E4D: "binfmt_misc",
    0x65735543: "fusectl",
    0xF97CFF8C: "selinuxfs",
    0x43415D53: "smackfs",
}
#: The low bits of a size that is 0 or a multiple of 4 KiB (every page size Linux uses):
#: the only sizes the kernel's file systems give their files but a few sysfs binary
#: attributes (firmware tables, a device's config space), whose reads change nothing.
_PAGE_MULTIPLE = 4095
#: ``struct statfs`` is 120 bytes on 64-bit Linux; room to spare for any other.
_STATFS_SIZE = 256


@functools.cache
def _fstatfs() -> Callable[[int], int | None] | None:
    """``fstatfs(2)``'s ``f_type`` of a descriptor (None when the call fails), or None
    where libc cannot be reached: Python's ``os`` has ``statvfs``, which has no type."""
    try:
        import ctypes

        call = ctypes.CDLL(None, use_errno=True).fstatfs
    except (ImportError, OSError, AttributeError):
        return None
    # ``f_type`` comes first: a long, but an unsigned int on s390x (glibc's __fsword_t),
    # in the machine's own size and byte order ("=" read 4 bytes little or big, so on a
    # 64-bit big-endian machine the high half of the long: no kernel file system known).
    layout = "@I" if platform.machine() == "s390x" else "@l"

    def f_type(fd: int) -> int | None:
        buffer = ctypes.create_string_buffer(_STATFS_SIZE)
        if call(fd, buffer) != 0:
            return None
        return int(struct.unpack_from(layout, buffer.raw)[0]) & 0xFFFFFFFF

    return f_type


def kernel_file_system(fd: int) -> str | None:
    """The name of the kernel file system an open descriptor is on (``proc``, ``sysfs``,
    ...), or None for a file system that holds files (a disk, tmpfs, NFS, FUSE)."""
    f_type = _fstatfs()
    if f_type is None:
        return None
    return _KERNEL_FILE_SYSTEMS.get(f_type(fd) or 0)


class KernelFile(ManifestUnreadable):
    """A file of the kernel's own file systems (``kernel_file_system``), refused unread;
    ``kind`` names its file system (``proc``, ``sysfs``, ...)."""

    def __init__(self, path: str | Path, kind: str) -> None:
        name = os.path.basename(path)
        super().__init__(
            f"{name} is in the kernel's {kind} file system (a view of kernel state, not a "
            f"file) and is not read: make {name} a regular file on a disk, or a link to one."
        )
        self.kind = kind


def _too_large(path: str | Path) -> ManifestUnreadable:
    limit = MAX_MANIFEST_BYTES >> 20
    return ManifestUnreadable(f"{os.path.basename(path)} is larger than {limit} MiB.")


def read_descriptor(fd: int, limit: int, expected: int | None = None) -> bytes | None:
    """Read an open descriptor to its end, never holding more than ``limit`` + 1 bytes.

    Args:
        fd: The descriptor (its owner closes it).
        limit: The most bytes accepted.
        expected: The size ``fstat`` gave, when known: each read then asks for what is
            left of it (and 64 KiB more at a time past it). Asked for ``limit`` + 1 at
            once, ``os.read`` allocates that much (128 MiB for the set cache) and
            shrinks it: 0.37 ms for a 0.8 MB file, against 0.04 ms.

    Returns:
        The bytes, or None when there are more than ``limit``.

    Raises:
        OSError: The read failed.
    """
    chunks: list[bytes] = []
    size = 0
    while True:
        want = limit + 1 - size
        if expected is not None:
            want = min(want, max(expected + 1 - size, 1 << 16))
        chunk = os.read(fd, want)
        if not chunk:
            break
        chunks.append(chunk)
        size += len(chunk)
        if size > limit:
            return None
    return b"".join(chunks)


def read_regular_file(
    path: str | Path, st: os.stat_result | None = None, limit: int = MAX_MANIFEST_BYTES
) -> tuple[bytes, os.stat_result]:
    """Read a regular file of at most ``MAX_MANIFEST_BYTES`` without ever blocking.

    The bound holds on the bytes read, not only on the stat: a file that grew after it,
    or another renamed over the path, is read no further than ``limit`` + 1 bytes.

    Args:
        path: The file.
        st: A fresh ``os.stat(path)`` when the caller already has one.
        limit: A smaller bound of the caller's (a read on the event loop): a larger file
            raises as one past ``MAX_MANIFEST_BYTES`` does.

    Returns:
        The bytes and the ``fstat`` of the descriptor they were read from.

    Raises:
        ManifestUnreadable: ``<file name> could not be read.`` (caused by the OSError, if
            any), ``<file name> is larger than 1 MiB.``, or, for a file of the kernel's
            own file systems (``/proc``, ``/sys``: ``kernel_file_system``), a message that
            names its file system and the fix.
    """
    try:
        if st is None:
            st = os.stat(path)
        if not stat.S_ISREG(st.st_mode):
            raise _unreadable(path)
        if st.st_size > limit:
            raise _too_large(path)
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise _unreadable(path)
            # A link to /proc/self/environ or /proc/kmsg is a "regular file" of size 0
            # whose read returns (or takes) kernel state: judged by its file system, unread.
            # Asked only of a file whose size is what those file systems report (0 bytes,
            # or a page for sysfs's and configfs's attributes): the question costs 1.6 us
            # through ctypes, a fifth of reading a small manifest, and every set's read at
            # a cold load takes this path.
            if not st.st_size & _PAGE_MULTIPLE:
                kind = kernel_file_system(fd)
                if kind is not None:
                    raise KernelFile(path, kind)
            data = read_descriptor(fd, limit, st.st_size)
        finally:
            os.close(fd)
    except OSError as exc:
        raise _unreadable(path) from exc
    if data is None:
        raise _too_large(path)
    return data, st


def load_config(home: Path) -> tuple[Config, list[Note]]:
    """Read ``<home>/config.json``; a bad part falls back with a note.

    Every fallback is the strict reading of what the operator may have meant, never the
    default: a bad ``externalTools`` value, or a file that cannot be read or parsed (it may
    have said ``false``), turns discovery off; an approval source policy that cannot be
    read is ``host`` for every source it may have named, never ``author`` (a typo must not
    make manifests' ``approval: always`` count). The reference host refuses such a file
    outright; toolsetd keeps serving (its own methods, and the tools once it is fixed),
    no looser than the operator could have meant.

    Args:
        home: The Crystal home directory.

    Returns:
        The settings and the operator notes (``set`` is ``config.json``, ``source`` None).
    """
    notes: list[Note] = []

    def note(message: str) -> None:
        notes.append(Note(set=_CONFIG_SET, source=None, message=message))

    path = home / _CONFIG_SET
    try:
        text, _ = read_regular_file(path)
    except ManifestUnreadable as exc:
        # Only a file that is not there means the defaults. A symlink to one that is gone
        # (a dotfiles checkout not mounted, a target moved) is the operator's file that
        # cannot be read: it may say false, so it is unusable, not absent.
        if not isinstance(exc.__cause__, FileNotFoundError) or os.path.lexists(path):
            note(f"{exc.message} {_UNUSABLE_FALLBACK}")
            return _UNUSABLE, notes
        return Config(), notes
    try:
        # Read as the reference host's File.ReadAllText reads it: a UTF-16 or UTF-32 byte
        # order mark chooses that encoding (an editor's "Unicode" file), as for tools.json.
        root = json.loads(decode_file_text(text), parse_constant=_reject)
    except (ValueError, RecursionError) as exc:
        note(f"config.json is not valid JSON: {exc}; {_UNUSABLE_FALLBACK_LOWER}")
        return _UNUSABLE, notes
    if not isinstance(root, dict):
        note(f"config.json must be a JSON object; {_UNUSABLE_FALLBACK_LOWER}")
        return _UNUSABLE, notes

    # Property names match in any case, as the reference host reads them. Where several
    # spellings of one name are present, the stricter reading wins (off over on, host
    # over author).
    found = [v for v in _members(root, "externalTools") if v is not None]
    if any(not isinstance(v, bool) for v in found):
        note(
            "config.json: externalTools must be true or false; external tool discovery is off "
            "until it is fixed."
        )
    external_tools = all(v is True for v in found)

    policies = {Source.HOME: ApprovalSource.AUTHOR, Source.PROJECT: ApprovalSource.HOST}
    # A null spelling says the defaults, as an empty object does (beside an "author" in
    # another spelling it keeps the project source host; the reference host reads the
    # last spelling alone).
    approvals = [{} if a is None else a for a in _members(root, "externalToolApproval")]
    if any(not isinstance(a, dict) for a in approvals):
        note(
            'config.json: externalToolApproval must be an object such as {"home": "author", '
            '"project": "host"}; using host for both, so no manifest\'s approval counts, '
            "until it is fixed."
        )
        policies = {Source.HOME: ApprovalSource.HOST, Source.PROJECT: ApprovalSource.HOST}
    else:
        for source in list(policies):
            default = policies[source].value
            words: set[str | None] = set()
            for a in approvals:
                values = [v for v in _members(a, source.value) if v is not None]
                # Trimmed as .NET's Trim() trims (ExternalToolTrustPolicy): Python's strip()
                # would also take U+001C..U+001F, and make "author\x1c", which the
                # reference host refuses, author.
                # An object that leaves the source out says its default: merged with another
                # spelling's "author" it must not make the project source author (the
                # reference host reads the last spelling alone, and that one says host).
                # A blank value says the default too, as the reference host reads it
                # (string.IsNullOrWhiteSpace in ReadExternalToolApproval).
                read = [_word(v) for v in values]
                words |= {default if w == "" else w for w in read} if read else {default}
            if not words:
                continue
            if words <= {"author", "host"}:
                policies[source] = ApprovalSource("host" if "host" in words else "author")
            else:
                note(
                    f"config.json: externalToolApproval.{source.value} must be author or host. "
                    f"External tool trust policy must be author or host. "
                    f"Using host for {source.value} sets, so no {source.value} manifest's "
                    "approval counts, until it is fixed."
                )
                policies[source] = ApprovalSource.HOST
    return (
        Config(
            external_tools=external_tools,
            home_policy=policies[Source.HOME],
            project_policy=policies[Source.PROJECT],
        ),
        notes,
    )


#: What an unreadable or unparsable config.json means: discovery off (it may have said
#: false), and the approval source policy ``host`` for both sources (see ``load_config``).
_UNUSABLE = Config(
    external_tools=False, home_policy=ApprovalSource.HOST, project_policy=ApprovalSource.HOST
)
_UNUSABLE_FALLBACK = (
    "External tool discovery is off, and the approval policy host for both sources, "
    "until it is fixed."
)
_UNUSABLE_FALLBACK_LOWER = "e" + _UNUSABLE_FALLBACK[1:]


def _word(value: Any) -> str | None:
    """A policy value trimmed (.NET white space) and lower-cased; None if not a string."""
    return value.strip(NET_WHITESPACE).lower() if isinstance(value, str) else None


def _fold(name: str) -> str:
    """``name`` upper-cased character by character (simple mappings only), as .NET's
    ``OrdinalIgnoreCase`` compares property names."""
    return "".join(u if len(u := c.upper()) == 1 else c for c in name)


def _members(obj: dict[str, Any], name: str) -> list[Any]:
    """The values of the properties called ``name`` in any case, in document order.

    The reference host reads ``config.json`` with ``PropertyNameCaseInsensitive``: an
    operator's ``"ExternalToolApproval": {"Home": "host"}`` is obeyed there; read
    case-sensitively it was ignored here, leaving home ``author`` (``approval: always``
    honoured without asking).
    """
    wanted = _fold(name)
    return [value for key, value in obj.items() if key == name or _fold(key) == wanted]


def _reject(name: str) -> Any:
    raise ValueError(f"{name} is not a valid JSON value.")
