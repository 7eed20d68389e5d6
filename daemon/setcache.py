"""A persistent cache of parsed and validated tool sets, keyed by manifest content.

Theory of operation
-------------------
Parsing a ``tools.json`` (the reference host's rules, then the schema checks) costs far
more than reading it, so a cold start with many sets spends most of its time re-deciding
what it decided last time. ``SetStore`` keeps those decisions on disk, under
``$XDG_CACHE_HOME/toolsetd/`` (else ``~/.cache/toolsetd/``):

* **Key.** A record is found by the SHA-256 of the manifest bytes, the set directory's
  name (shorthand names the tool after it), its source and a fingerprint of the reserved
  names. Nothing else goes into a parse, so equal keys mean equal results. Changed bytes
  are a new key; the old record simply stops being used.
* **What is kept.** The parse result (every field of the ``ToolSet`` and its ``ToolDef``
  values except the path, or the manifest's error message) and each tool's hash under
  both source policies, as a JSON list per set (enum members as their positions, sets of
  catalogs as bit masks: it is decoded at every start). The file name carries a
  fingerprint of everything whose output a record holds (``_DECIDING_MODULES``: the
  parser, its messages, its decoder (``protocol.jsontext``), the types, ``catalog.tool_hash``
  and this module; the versions
  of toolsetd, Python, orjson and jsonschema, and of the optional packages jsonschema's
  format checks come from; the interpreter's limit on integer digits),
  so a daemon never reads decisions another build, or another limit, made.
* **Index.** Each manifest path maps to the stat signature its bytes had when their key
  was recorded, once that signature can be trusted (``catalog.trusted_signature``), so a
  restart neither reads nor parses an unchanged manifest.
* **Only exact round trips.** A record is stored only if its JSON reads back equal: a
  schema holding an integer beyond 64 bits is parsed afresh every time rather than cached
  wrongly. A manifest path that is not UTF-8 (a folder ``caf\xe9`` on the way) is not
  indexed: JSON cannot hold it, so that set is read at every start (nor is its record
  stored when the name is that set's own directory).
* **Files.** A *snapshot* (``sets-<build>.json``: a magic line, the SHA-256 of the
  body, the body: a JSON head of the index and the records' keys, then each record's
  JSON after a tab, so records are cut apart without decoding them) and a *journal*
  (``sets-<build>.journal``) of checksummed lines of the same form, one per flush that
  added a few records, so a reload that parsed one set appends one line
  instead of rewriting thousands of records. A journal grown past a quarter of the
  snapshot (or 1 MiB) is compacted into a new snapshot.
* **Only regular files.** A snapshot or journal is opened without following a symlink and
  without blocking, and read only if its ``fstat`` says it is a regular file of at most
  ``MAX_CACHE_BYTES``: a FIFO in its place would block the start (and SIGTERM) forever, a
  link to ``/dev/zero`` would be read until memory runs out. Anything else is ignored,
  and replaced by the next compaction.
* **Truncation and corruption.** A short, torn or altered snapshot fails its check and
  is ignored as a whole (the daemon parses, and writes a new one); a journal line that
  fails its check is skipped alone; a record that does not decode costs one parse.
* **Concurrent daemons.** Writers never modify the live snapshot: a compaction writes a
  private temporary file and renames it over the snapshot, which is atomic, so a reader
  sees the old file or the new one, never a mix, and it merges what other daemons wrote
  meanwhile. Journal lines go out as one ``write`` on an ``O_APPEND`` descriptor, so two
  daemons' lines never interleave. When writers race, a compaction may drop a line
  appended meanwhile and its sets are parsed again next time: a cache can lose entries,
  never give a wrong one.
* **Bound.** A compaction keeps only the records some manifest path is indexed to and
  those this process uses (an edit releases the old bytes' key), so an edited
  manifest's old records go: a set edited a thousand times would otherwise leave a
  thousand records in the file (and read by every start). At most
  ``max_records``, and at most ``max_bytes`` (``MAX_CACHE_BYTES``, what a start reads):
  the records used by this process are kept first, and past the byte bound the largest
  go first, so the fewest sets are parsed again. Refused whole instead, a store past the
  bound wrote nothing more, and every flush read the whole store again to find that out.
* **Memory.** The store holds no record, decoded or not: only where each one is in the
  snapshot or journal it was read from or appended to (or the new snapshot a compaction
  wrote), which stay open while a record points into them (``_File``: the snapshot and
  the journal, one more for each journal another daemon's compaction put in place since
  this process last compacted). ``get`` and ``lookup`` read a record's bytes back with
  one ``pread`` and decode their own copy; only records not yet flushed are bytes in
  memory, and, from a start until its first flush (the end of the first build), the
  bytes of the files the start read, so a cold load cuts its records out of them rather
  than paying a ``pread`` for each (~10% of a cold load of 1,000 sets). The set decoded
  from a record lives in the manifest cache for as long as a
  cached manifest holds its key, then goes (a released workspace's sets). Kept decoded,
  a record costs ~9 times its bytes: three released workspaces of ten 0.7 MB manifests
  held ~140 MB after their release, and the decoded JSON of 10,000 small sets doubled
  what the cyclic collector traversed (a cold load took 610 ms with it, 430 ms without).
  Kept as bytes, every record the daemon ever read or wrote stayed in its memory, up to
  the 128 MiB a file may hold: ten cycles of two new workspaces of ten 0.5 MB manifests,
  each released when idle, took a daemon from 106 to 234 MB, ~13 MB a cycle.

* **Only the daemon's own.** A record decides what a tool runs, and the checksums have no
  key: anyone who can write the folder or a file in it can re-sign one. So, as ssh does
  with ``~/.ssh``, the folder is used only if it is owned by the daemon's uid and not
  writable by group or others, and a file in it is read (or appended to) only if it is
  too. The checks are ``fstat`` of the opened folder and files, and every file is opened
  relative to the folder's descriptor, so what was checked is what is used. The log line
  says how to fix it; for a shared (sticky) folder such as ``/tmp``, never by chmod or
  removal, which would break its other users.

The cache folder is created 0700. A cache that cannot be read or written (read-only
home, full disk), or cannot be trusted, only costs speed: every error here is swallowed
after one log line.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import hashlib
import importlib
import importlib.util
import os
import stat
import sys
import threading
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, NamedTuple, TypeAlias

import orjson
import structlog
from toolsetd.protocol.jsontext import is_utf8

from .config_file import read_descriptor
from .install import FORMAT_DISTRIBUTIONS
from .install import installed_version as _installed_version
from .model import (
    Approval,
    ApprovalSource,
    CatalogName,
    OutputMode,
    RunnerKind,
    Source,
    ToolDef,
    ToolSet,
)
from .paths import os_user_home

__all__ = ["MAX_CACHE_BYTES", "SetStore", "default_cache_dir"]

log = structlog.get_logger("toolsetd.setcache")

_MAGIC = b"toolsetd-sets 1\n"
_DIGEST_SIZE = 32
#: A snapshot or journal larger than this is ignored unread, and never written. 10,000
#: small sets (``bench_catalog``'s) make a 7.5 MB snapshot and at most a quarter of that
#: in journal; 100,000 (``max_records``) of them, 75 MB.
MAX_CACHE_BYTES = 128 << 20
_READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
# Read and write: the records a journal line carries are read back from it (``_File``).
_APPEND_FLAGS = os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
_CREATE_FLAGS = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
#: The journal is compacted into the snapshot once it outgrows this or a quarter of it.
_JOURNAL_MIN_BYTES = 1 << 20
#: Records whose parse is an error are stored as ``[_ERROR, message]``.
_ERROR = "error"
# A record holds each enum member as its position in the enum, and a set of catalogs as a
# bit mask over ``CatalogName``'s order: parsing the store of 1,000 sets made ~10 small
# strings and lists a set out of the names, and decoding them took dict lookups of tuples.
# (The order is the code's, and the store's file name changes with the code.)
_RUNNERS = dict(enumerate(RunnerKind))
_APPROVALS = dict(enumerate(Approval))
_OUTPUTS = dict(enumerate(OutputMode))
_RUNNER_CODES = {member: code for code, member in _RUNNERS.items()}
_APPROVAL_CODES = {member: code for code, member in _APPROVALS.items()}
_OUTPUT_CODES = {member: code for code, member in _OUTPUTS.items()}
_CATALOG_BITS = {catalog: 1 << i for i, catalog in enumerate(CatalogName)}
_CATALOG_SETS = {
    mask: frozenset(c for c, bit in _CATALOG_BITS.items() if mask & bit)
    for mask in range(1 << len(_CATALOG_BITS))
}
_AUTHOR = ApprovalSource.AUTHOR
_HOST = ApprovalSource.HOST


class _File:
    """An open snapshot or journal that records point into; closed when the last goes.

    A record the store holds is ``(file, offset, length)`` into the file it was read from
    or written to, not its bytes, so the descriptor lives exactly as long as some record
    points into it (reference counting: no cycle holds one). The bytes there never
    change: a snapshot is only ever renamed over, never written in place, and a journal
    is only appended to (and renamed over), so the open file still holds what was
    checked, whatever another daemon's compaction put at its name since.
    """

    __slots__ = ("data", "fd", "ino")

    def __init__(self, fd: int) -> None:
        self.fd = fd
        #: The file's bytes as a start read them, until the first flush drops them: a cold
        #: load then cuts its records out of them instead of reading each one back.
        self.data: bytes | None = None
        st = os.fstat(fd)
        #: Which file it is: a journal appended to again reuses the one open already.
        self.ino = (st.st_dev, st.st_ino)

    def __del__(self) -> None:
        with contextlib.suppress(OSError):
            os.close(self.fd)


#: A record as the store holds it: the bytes of one not yet written (or read from a
#: payload the store was handed), else where it is in an open cache file.
_Held: TypeAlias = bytes | tuple[_File, int, int]


def _held_bytes(held: _Held) -> bytes | None:
    """A held record's bytes, read back from its file when it is there; None when that
    read fails or comes up short (the record then counts as missing: one parse)."""
    if isinstance(held, bytes):
        return held
    file, offset, length = held
    data = file.data
    if data is not None:
        return data[offset : offset + length]
    try:
        raw = os.pread(file.fd, length, offset)
    except OSError:
        return None
    return raw if len(raw) == length else None


def default_cache_dir(environ: Mapping[str, str]) -> Path:
    """``$XDG_CACHE_HOME/toolsetd`` when that is absolute, else ``~/.cache/toolsetd``.

    Args:
        environ: The environment to read.

    Returns:
        The folder (not created).
    """
    xdg = environ.get("XDG_CACHE_HOME", "")
    if xdg and os.path.isabs(xdg):  # the XDG spec says to ignore a relative one
        return Path(xdg) / "toolsetd"
    return Path(os_user_home(environ) or "~") / ".cache" / "toolsetd"


#: The modules whose output a record holds: the parser and its messages (``manifest``,
#: ``validation``'s schema checks and ``canonical_json``, ``protocol.errors``'
#: ``reject_json_constant``), the types (``model``), the tools' hashes (``catalog``'s
#: ``tool_hash``) and the encoding (this module). A test traces the parses and hashes
#: that records are made from and checks that this names every module they ran.
_DECIDING_MODULES = (
    "toolsetd.protocol.errors",
    "toolsetd.protocol.jsontext",
    "toolsetd.daemon.catalog",
    "toolsetd.daemon.manifest",
    "toolsetd.daemon.mcpschema",
    "toolsetd.daemon.model",
    "toolsetd.daemon.setcache",
    "toolsetd.daemon.validation",
)
#: The distributions whose output a record holds: jsonschema's schema-check messages
#: and verdicts, which also depend on its meta-schemas and its resolver.
_DECIDING_DISTRIBUTIONS = ("jsonschema", "jsonschema_specifications", "referencing")
#: The optional packages jsonschema takes its ``format`` checks from, installed or not:
#: the meta-schema check of a tool's schema checks ``"format": "uri-reference"`` (``$ref``,
#: ``$id``) and ``"uri"`` (``$schema``) only when one of them is there, so a schema such as
#: ``{"$ref": "a b"}`` passes without them and is refused with them.
_FORMAT_DISTRIBUTIONS = FORMAT_DISTRIBUTIONS


@functools.cache
def _code_fingerprint(digit_limit: int) -> str:
    """A short hash of the code whose decisions the store keeps (the code imported).

    Covers ``_DECIDING_MODULES``' source, the version of toolsetd, of Python (its JSON
    parser's messages, ``re``), of orjson (``canonical_json`` under ``tool_hash``) and of
    ``_DECIDING_DISTRIBUTIONS``, which of ``_FORMAT_DISTRIBUTIONS`` are installed (and
    their versions), and ``digit_limit``: the interpreter's limit on the digits
    of an integer (``sys.get_int_max_str_digits``, which ``PYTHONINTMAXSTRDIGITS`` or
    ``-X int_max_str_digits`` set), which decides whether a long integer refuses a set,
    and words that refusal. Computed once per process and limit: what decides is the code
    this process runs, not what the files hold by the time a later store is opened. Cheap:
    the start pays for it (0.4-0.8 ms here), so jsonschema is found, not imported (~100 ms),
    and its version read from its ``.dist-info`` folder's name, not with
    ``importlib.metadata`` (~30 ms).
    """
    from toolsetd.protocol import __version__

    h = hashlib.sha256(
        "\x00".join([__version__, sys.version, orjson.__version__, str(digit_limit)]).encode()
    )
    for name in _DECIDING_MODULES:
        module = sys.modules.get(name) or importlib.import_module(name)
        with open(module.__file__ or "", "rb") as f:
            h.update(f.read())
    listings: dict[str, list[str]] = {}  # they are usually installed side by side
    for name in (*_DECIDING_DISTRIBUTIONS, *_FORMAT_DISTRIBUTIONS):
        h.update(b"\x00" + _installed_version(name, listings).encode())
    return h.hexdigest()[:16]


def reserved_fingerprint(reserved: frozenset[str]) -> str:
    """A short hash of a set of reserved names (part of every key).

    Each name goes in as its length and its bytes, so no two sets hash alike: joined
    with NULs, ``{"a", "b"}`` and a config file's ``{"a\\u0000b"}`` made one key for
    different decisions (``a`` refused by one, loaded by the other). A name that is not
    UTF-8 (``--reserve $'\\xff'``, which Python holds as a lone surrogate) is encoded
    with ``surrogatepass``: with a strict ``encode`` it stopped the daemon at its first
    set.
    """
    h = hashlib.sha256()
    for name in sorted(reserved):
        data = name.encode("utf-8", "surrogatepass")
        h.update(b"%d:" % len(data))
        h.update(data)
    return h.hexdigest()[:16]


def _catalog_mask(catalogs: frozenset[CatalogName]) -> int:
    mask = 0
    for catalog in catalogs:
        mask |= _CATALOG_BITS[catalog]
    return mask


def encode_record(
    result: ToolSet | str, hashes: Mapping[tuple[str, ApprovalSource], str]
) -> list[Any]:
    """The JSON form of a parse result: a set (without its path) or an error message.

    Args:
        result: The parsed set, or the manifest's error message.
        hashes: Each tool's hash by (tool name, policy), for both policies.

    Returns:
        A JSON-compatible list.
    """
    if isinstance(result, str):
        return [_ERROR, result]
    tools = [
        [
            t.name,
            t.description,
            t.schema,
            _catalog_mask(t.catalogs),
            _APPROVAL_CODES[t.approval],
            list(t.command),
            [list(pair) for pair in t.argv],
            list(t.path_arguments),
            _OUTPUT_CODES[t.output],
            hashes[(t.name, _AUTHOR)],
            hashes[(t.name, _HOST)],
            list(t.listing_notes),
        ]
        for t in result.tools
    ]
    return [
        _RUNNER_CODES[result.runner],
        result.enabled,
        _APPROVAL_CODES[result.approval],
        _catalog_mask(result.catalogs),
        list(result.command),
        result.stdin,
        result.timeout_seconds,
        result.digest,
        tools,
    ]


def decode_record(
    record: list[Any], *, directory: str, source: Source, path: Path
) -> tuple[ToolSet | str, dict[tuple[str, ApprovalSource], str]]:
    """Rebuild a parse result from its JSON form (the inverse of ``encode_record``).

    Args:
        record: What ``encode_record`` returned, read back.
        directory: The set's directory name.
        source: Home or project.
        path: The absolute set directory.

    Returns:
        The set or error message, and the tools' hashes.

    Raises:
        ValueError, TypeError, KeyError, IndexError: The record is malformed. (Its codes
            are looked up, not type-checked: a ``true`` where a code goes would pass as
            1. Only this module writes records, into a file named for this code, each
            snapshot and journal line under its SHA-256.)
    """
    if record[0] == _ERROR:
        message = record[1]
        if not isinstance(message, str):
            raise TypeError("error record without a message")
        return message, {}
    runner, enabled, approval, catalogs, command, stdin, timeout, digest, tools = record
    hashes: dict[tuple[str, ApprovalSource], str] = {}
    defs = []
    for (
        name,
        description,
        schema,
        t_catalogs,
        t_approval,
        t_command,
        argv,
        path_args,
        output,
        h_author,
        h_host,
        notes,
    ) in tools:
        if not isinstance(schema, dict):
            raise TypeError("schema is not an object")
        defs.append(
            ToolDef(
                name,
                description,
                schema,
                _CATALOG_SETS[t_catalogs],
                _APPROVALS[t_approval],
                tuple(t_command),
                tuple([(k, v) for k, v in argv]) if argv else (),
                tuple(path_args),
                _OUTPUTS[output],
                tuple(notes),
            )
        )
        hashes[(name, _AUTHOR)] = h_author
        hashes[(name, _HOST)] = h_host
    toolset = ToolSet(  # positional, in declaration order: this runs once per set
        directory,
        source,
        path,
        _RUNNERS[runner],
        bool(enabled),
        _APPROVALS[approval],
        _CATALOG_SETS[catalogs],
        tuple(command),
        bool(stdin),
        timeout,
        tuple(defs),
        digest,
    )
    return toolset, hashes


class SetStore:
    """Parse results on disk, keyed by manifest content (see the module docstring).

    Args:
        folder: The cache folder (``default_cache_dir`` in the daemon).
        max_records: How many records (and index entries) the file keeps at most.
        max_bytes: How large a snapshot a compaction writes at most (at most
            ``MAX_CACHE_BYTES``, the largest file a start reads).
    """

    def __init__(
        self, folder: Path, *, max_records: int = 100_000, max_bytes: int = MAX_CACHE_BYTES
    ) -> None:
        self.folder = folder
        build = _code_fingerprint(sys.get_int_max_str_digits())
        self.path = folder / f"sets-{build}.json"
        self.journal = folder / f"sets-{build}.journal"
        self._snapshot_bytes = 0
        self._journal_bytes = 0
        self.max_records = max_records
        self.max_bytes = min(max_bytes, MAX_CACHE_BYTES)
        #: Every record: where it is in the file it was read from or written to, or the
        #: bytes of one a compaction could not place (see "Memory").
        self._records: dict[str, _Held] | None = None
        #: The journal this process last read or appended to, while records point into it.
        self._journal_file: _File | None = None
        #: The files a start read whose bytes are kept until the first flush (``_File``).
        self._buffered: list[_File] = []
        self._index: dict[str, list[Any]] = {}
        self._new: dict[str, bytes] = {}
        self._new_index: dict[str, list[Any]] = {}
        self._used: set[str] = set()
        self._lock = threading.Lock()
        self._warned = False
        self._warned_paths: set[tuple[str, Path]] = set()
        #: How many records were found (hits) and stored (puts) in this process.
        self.hits = 0
        self.puts = 0

    def _read_in(self, folder: int) -> tuple[dict[str, _Held], dict[str, list[Any]]]:
        """The records and index of the snapshot plus the journal's intact lines.

        A snapshot that is missing, short or altered counts as empty; a journal line that
        is torn or altered is skipped (the lines after it still count). The records are
        where they are in the files, which stay open while a record points into them.

        Args:
            folder: A descriptor of the cache folder (``_open_folder``).
        """
        records: dict[str, _Held] = {}
        index: dict[str, list[Any]] = {}
        data, file = self._read_file(folder, self.path)
        self._keep_until_flush(file, data)
        head = len(_MAGIC) + _DIGEST_SIZE
        self._snapshot_bytes = 0  # no intact snapshot: the next flush writes one
        if data:
            with memoryview(data) as view:
                intact = (
                    len(data) >= head
                    and data.startswith(_MAGIC)
                    and hashlib.sha256(view[head:]).digest() == data[len(_MAGIC) : head]
                )
            if not intact:
                self._warn_once("set_cache_ignored", self.path, reason="truncated or altered")
            else:
                _merge(records, index, data, start=head, file=file)
                self._snapshot_bytes = len(data) - head
        journal, file = self._read_file(folder, self.journal)
        self._keep_until_flush(file, journal)
        self._journal_bytes = len(journal)
        if file is not None:
            self._journal_file = file
        start = 0
        with memoryview(journal) as view:
            while start < len(journal):
                end = journal.find(b"\n", start)
                if end < 0:
                    end = len(journal)
                space = journal.find(b" ", start, end)
                if (
                    0 <= space < end - 1
                    and hashlib.sha256(view[space + 1 : end]).hexdigest().encode()
                    == journal[start:space]
                ):
                    _merge(records, index, journal, start=space + 1, end=end, file=file)
                start = end + 1
        return records, index

    def _keep_until_flush(self, file: _File | None, data: bytes) -> None:
        """Let records of ``file`` be cut out of ``data`` until the next ``flush``.

        A cold load asks for every record right after the start read the files: one
        ``pread`` each cost ~10% of it (1,000 sets). The first build flushes when it ends,
        and with it the bytes go: only a start holds a file's bytes, never a daemon's life.
        """
        if file is not None and data:
            file.data = data
            self._buffered.append(file)

    def _drop_buffers(self) -> None:
        """Forget the bytes ``_keep_until_flush`` kept: records are read back from here on."""
        for file in self._buffered:
            file.data = None
        self._buffered.clear()

    def _read_file(self, folder: int, path: Path) -> tuple[bytes, _File | None]:
        """The bytes of a cache file, and the file held open (records point into it); empty
        and None when it is missing, or not one this store wrote.

        Opened in the folder's descriptor, without following a symlink and without
        blocking (a FIFO answers the open at once), then judged by the descriptor's
        ``fstat``: only a regular file of at most ``MAX_CACHE_BYTES``, this daemon's and
        writable by it alone, is read. A FIFO or a link to ``/dev/zero`` is ignored rather
        than hanging or filling memory, another user's file rather than obeyed.
        """
        try:
            fd = os.open(path.name, _READ_FLAGS, dir_fd=folder)
        except FileNotFoundError:
            return b"", None
        except OSError as exc:  # ELOOP: a symlink
            self._warn_once("set_cache_unreadable", path, error=exc.strerror)
            return b"", None
        file = _File(fd)  # closed when nothing points into it (at once, unless returned)
        try:
            st = os.fstat(fd)
            if not self._usable(st, path):
                return b"", None
            data = read_descriptor(fd, MAX_CACHE_BYTES, st.st_size)
        except OSError as exc:
            self._warn_once("set_cache_unreadable", path, error=exc.strerror)
            return b"", None
        if data is None:
            reason = f"larger than {MAX_CACHE_BYTES >> 20} MiB"
            self._warn_once("set_cache_ignored", path, reason=reason)
            return b"", None
        return data, file

    def _usable(self, st: os.stat_result, path: Path) -> bool:
        """Whether the cache file whose ``fstat`` is ``st`` may be read or appended to: a
        regular file (not a FIFO or a device in its place), and ``_trusted``."""
        if not stat.S_ISREG(st.st_mode):
            self._warn_once("set_cache_ignored", path, reason="not a regular file")
            return False
        return self._trusted(st, path)

    def _trusted(self, st: os.stat_result, path: Path) -> bool:
        """Whether a cache folder or file is this daemon's alone (else logged once, with the fix).

        As ssh does with ``~/.ssh``: owned by the daemon's uid, writable by nobody else.
        Anyone else who can write a record decides what a tool runs (the checksums have no
        key), so such a cache is not used: that only costs a parse.
        """
        uid = os.geteuid()
        if st.st_uid != uid:
            reason = f"owned by uid {st.st_uid}, not this daemon's uid {uid}"
            fix = f"remove {path} (the daemon makes a new one) or give it another --cache-dir"
        elif st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
            reason = "writable by group or others"
            fix = f"chmod {'700' if stat.S_ISDIR(st.st_mode) else '600'} {path}"
        else:
            return True
        if stat.S_ISDIR(st.st_mode) and st.st_mode & stat.S_ISVTX:
            # A shared folder such as /tmp (``--cache-dir /tmp``, or a link to it): chmod
            # (which follows a link) or removing it would break everyone else who uses it.
            fix = f"give the daemon a folder of its own with --cache-dir (such as {path}/toolsetd)"
        self._warn_once("set_cache_untrusted", path, reason=reason, fix=fix)
        return False

    def _open_folder(self) -> int | None:
        """A descriptor of the cache folder, or None when it is not this daemon's alone.

        Everything else is opened relative to it, so what was checked is what is used:
        the folder cannot be swapped between the check and the reads or writes.

        Raises:
            OSError: It cannot be opened (FileNotFoundError: it does not exist yet).
        """
        fd = os.open(self.folder, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            if self._trusted(os.fstat(fd), self.folder):
                return fd
        except BaseException:
            os.close(fd)
            raise
        os.close(fd)
        return None

    def _read(self) -> tuple[dict[str, _Held], dict[str, list[Any]]]:
        """``_read_in`` the cache folder; empty when it is missing, unreadable or untrusted."""
        try:
            folder = self._open_folder()
        except FileNotFoundError:
            folder = None
        except OSError as exc:
            self._warn_once("set_cache_unreadable", self.folder, error=exc.strerror)
            folder = None
        if folder is None:
            self._snapshot_bytes = self._journal_bytes = 0
            return {}, {}
        try:
            return self._read_in(folder)
        finally:
            os.close(folder)

    def _warn_once(self, event: str, path: Path, **detail: str | None) -> None:
        """Log a file the store cannot use, once per process (a compaction reads it again)."""
        if (event, path) not in self._warned_paths:
            self._warned_paths.add((event, path))
            log.warning(event, path=str(path), **detail)

    def _loaded(self) -> dict[str, _Held]:
        if self._records is None:
            self._records, self._index = self._read()
        return self._records

    def get(self, key: str) -> list[Any] | None:
        """The record stored under ``key``, decoded afresh from its bytes, or None."""
        with self._lock:
            held = self._new.get(key) or self._loaded().get(key)
        raw = None if held is None else _held_bytes(held)
        if raw is None:
            if held is not None:
                self.discard(key)  # its file no longer reads back
            return None
        with self._lock:
            self._used.add(key)
            self.hits += 1
        return self.decode(key, raw)

    def decode(self, key: str, raw: bytes) -> list[Any] | None:
        """A record's bytes (from ``lookup``) decoded: a fresh list each time.

        A record that is not a JSON list is forgotten (``discard``) and counts as missing.
        """
        try:
            record = orjson.loads(raw)
        except orjson.JSONDecodeError:
            record = None
        if type(record) is not list:
            self.discard(key)
            return None
        return record

    def lookup(
        self, manifest: str, signature: tuple[int, int, int, int]
    ) -> tuple[str, bytes | None] | None:
        """The key and record bytes of a manifest whose stat signature is the one indexed.

        The index maps a manifest path to the trusted stat signature its bytes had when
        their key was recorded (see ``catalog.trusted_signature``), so an unchanged file
        is found without being read. ``decode`` gives the record.

        Args:
            manifest: The manifest's absolute path.
            signature: Its current ``(mtime_ns, size, ino, ctime_ns)``.

        Returns:
            ``(key, bytes)``, the bytes None when the store holds no record for the key;
            None when the file is not indexed with that signature.
        """
        with self._lock:
            records = self._records
            if records is None:
                records = self._loaded()
            entry = self._new_index.get(manifest) or self._index.get(manifest)
            if (
                entry is None
                or len(entry) != 5
                or entry[0] != signature[0]
                or entry[1] != signature[1]
                or entry[2] != signature[2]
                or entry[3] != signature[3]
            ):
                return None
            key: str = entry[4]
            held = self._new.get(key) or records.get(key)
            self._used.add(key)
        raw = None if held is None else _held_bytes(held)  # read outside the lock
        if raw is not None:
            with self._lock:
                self.hits += 1
        elif held is not None:  # its file no longer reads back: forgotten (one parse)
            self.discard(key)
        return key, raw

    def put(self, key: str, record: list[Any]) -> None:
        """Remember a record, if it survives a JSON round trip exactly (flushed later)."""
        try:
            key.encode()  # the files hold it as JSON
            raw = orjson.dumps(record)
            if orjson.loads(raw) != record:
                return
        except (orjson.JSONEncodeError, TypeError, UnicodeEncodeError):
            return  # integers beyond 64 bits, lone surrogates (a file name's stray bytes)
        # Kept as a copy of exactly its length: the buffer orjson returns keeps what it
        # grew to (2 MB for a 0.5 MB record), and the store holds it as long as the daemon.
        raw = bytes(memoryview(raw))
        with self._lock:
            self._new[key] = raw
            self._used.add(key)
            self.puts += 1

    def index(self, manifest: str, signature: tuple[int, int, int, int] | None, key: str) -> None:
        """Remember that ``manifest`` with a trusted ``signature`` holds the bytes of ``key``.

        Args:
            manifest: The manifest's absolute path.
            signature: Its trusted stat signature; None (too fresh to trust) forgets it.
            key: The record key of its bytes.
        """
        if not manifest.isascii() and not is_utf8(manifest):
            return  # file-name bytes that are not UTF-8: the store's JSON cannot hold the path
        with self._lock:
            self._loaded()
            if signature is None:
                if manifest in self._index or manifest in self._new_index:
                    self._new_index[manifest] = []
                return
            entry = [*signature, key]
            if self._index.get(manifest) != entry:
                self._new_index[manifest] = entry

    def release(self, key: str) -> None:
        """Stop counting ``key`` as used: the manifest that held its bytes holds others now.

        A compaction keeps it only while some manifest path is still indexed to it.
        """
        with self._lock:
            self._used.discard(key)

    def discard(self, key: str) -> None:
        """Forget a record that did not decode or no longer reads back (it is not written
        back; the set is parsed again, and ``put`` marks its new record used)."""
        with self._lock:
            self._new.pop(key, None)
            if self._records is not None:
                self._records.pop(key, None)
            self._used.discard(key)

    def flush(self) -> bool:
        """Write what was added since the last flush; True when it was written.

        A few new records are appended to the journal as one checksummed line (one
        ``write`` on an ``O_APPEND`` descriptor, so concurrent daemons' lines never
        interleave). When the journal outgrows a quarter of the snapshot (or 1 MiB), the
        store is compacted instead: the snapshot and journal are read, merged with what
        is new, bounded to ``max_records`` (the ones this process used first), written to
        a private temporary file and renamed over the snapshot; the journal is then
        emptied the same way. A line another daemon appended during a compaction is
        lost, which costs it one parse later.
        """
        try:
            return self._flush()
        finally:
            with self._lock:
                self._drop_buffers()  # a compaction read the files again: theirs too

    def _flush(self) -> bool:
        with self._lock:
            if not self._new and not self._new_index:
                return False
            self._loaded()
            new, self._new = self._new, {}
            new_index, self._new_index = self._new_index, {}
            used = set(self._used)
        try:
            self.folder.mkdir(mode=0o700, parents=True, exist_ok=True)
            folder = self._open_folder()
            if folder is None:
                return False
            try:
                head = _pack_head(new, new_index)
                line = _join(head, new)
                limit = max(_JOURNAL_MIN_BYTES, self._snapshot_bytes // 4)
                appended = False
                if self._snapshot_bytes and self._journal_bytes + len(line) <= limit:
                    entry = hashlib.sha256(line).hexdigest().encode() + b" " + line + b"\n"
                    placed = self._append(folder, entry)  # None: not a journal to trust
                    appended = placed is not None
                    if placed is not None:
                        self._journal_bytes += len(entry)
                        # What a compaction lays over the file: without the lines it
                        # appended, a later one put back each path's entry from before
                        # (its old key: that record kept, the new one unindexed).
                        # Its records are read back from the line, for ``get``: kept as
                        # bytes, every set this daemon ever parsed stayed in its memory.
                        file, offset = placed
                        # The line's head begins after the digest and its space.
                        spans = _placed(new, file, offset + len(entry) - len(line) - 1 + len(head))
                        with self._lock:
                            self._index.update(new_index)
                            if self._records is not None:
                                self._records.update(spans)
                if not appended:
                    self._compact(folder, new, new_index, used)
            finally:
                os.close(folder)
        except OSError as exc:
            if not self._warned:  # once: a read-only cache folder is not news on every reload
                self._warned = True
                error = exc.strerror
                # mkdir's words ("File exists") for a file where the folder, or one of the
                # folders above it, should be: say which, and what is wrong with it.
                if isinstance(exc, FileExistsError):
                    error = f"{exc.strerror}: {exc.filename} is not a folder"
                elif isinstance(exc, NotADirectoryError):
                    error = f"{exc.strerror}: a folder above {exc.filename} is not a folder"
                log.warning("set_cache_unwritable", path=str(self.path), error=error)
            return False
        return True

    def _append(self, folder: int, entry: bytes) -> tuple[_File, int] | None:
        """Append one line to the journal: the file and the offset the line went to; None
        when it is not one to append to (compact then).

        Not following a symlink, and not blocking: opening a FIFO for writing would wait
        for a reader (here it fails with ENXIO instead). A compaction renames a new, empty
        journal over whatever was there, another user's journal too.

        Raises:
            OSError: The write failed, or wrote part of the line (a torn line is skipped
                when read).
        """
        try:
            fd = os.open(self.journal.name, _APPEND_FLAGS, 0o600, dir_fd=folder)
        except OSError as exc:
            if exc.errno in (errno.ELOOP, errno.ENXIO):  # a symlink; a FIFO nobody reads
                return None
            raise
        file = _File(fd)  # closed when nothing points into it
        if not self._usable(os.fstat(fd), self.journal):
            return None
        if os.write(fd, entry) != len(entry):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        # O_APPEND: the write went to the end, whatever other daemons appended, and left
        # the offset after it.
        offset = os.lseek(fd, 0, os.SEEK_CUR) - len(entry)
        with self._lock:
            held = self._journal_file
            if held is not None and held.ino == file.ino:
                file = held  # one descriptor per journal, however many lines it took
            else:
                self._journal_file = file
        return file, offset

    def _compact(
        self,
        folder: int,
        new: dict[str, bytes],
        new_index: dict[str, list[Any]],
        used: set[str],
    ) -> None:
        # The snapshot's temporary file is made first. In a folder this process may not
        # write (a read-only mount, another owner's, ``chattr +i``), it used to fail only
        # at the end, after both files were read and hashed (up to 128 MiB), and again at
        # every reload that parsed a set. Now that failure comes before any read, with the
        # system's own words; a folder made writable again is written at the next flush.
        with _replacing(folder, self.path) as file:
            snapshot = self._compacted(folder, file, new, new_index, used)
        with _replacing(folder, self.journal) as journal:
            pass  # emptied
        self._snapshot_bytes, self._journal_bytes = snapshot.size, 0
        # Every record is now where the new snapshot holds it: the store holds no
        # record's bytes, and the files read before close with their last record.
        with self._lock:
            self._records, self._index = snapshot.records, snapshot.entries
            self._journal_file = journal

    def _compacted(
        self,
        folder: int,
        file: _File,
        new: dict[str, bytes],
        new_index: dict[str, list[Any]],
        used: set[str],
    ) -> _Compacted:
        """Merge the files with what is new, bounded, and write the snapshot to ``file``."""
        records, index = self._read_in(folder)
        with self._lock:
            records.update(self._records or {})
            index.update(self._index)
        records.update(new)
        index.update(new_index)
        # A record that no manifest path indexes and this process does not use (``release``)
        # is one a manifest no longer holds (each edit makes a new key):
        # kept, every edit of a big schema stayed in the file and, decoded, in memory, so
        # a reload storm grew the daemon by a record's size per reload (250 kB for a
        # 200-property schema) up to ``max_records`` of them, and every start read them.
        live = {entry[4] for entry in index.values() if len(entry) == 5}
        records = {k: v for k, v in records.items() if k in live or k in used}
        if len(records) > self.max_records:
            keep = [k for k in records if k in used]
            keep += [k for k in records if k not in used][: max(0, self.max_records - len(keep))]
            records = {k: records[k] for k in keep[: self.max_records]}
        raws = {k: raw for k, held in records.items() if (raw := _held_bytes(held)) is not None}
        del records
        # The snapshot is the magic, the body's digest, then the body: at most max_bytes.
        room = self.max_bytes - len(_MAGIC) - _DIGEST_SIZE
        head, index = _fitted(raws, index, used, self.max_records, room)
        body = _join(head, raws)
        with os.fdopen(file.fd, "wb", closefd=False) as f:
            f.write(_MAGIC)
            f.write(hashlib.sha256(body).digest())
            f.write(body)
        size = len(body)
        del body
        placed = _placed(raws, file, len(_MAGIC) + _DIGEST_SIZE + len(head))
        return _Compacted(placed, index, size)


class _Compacted(NamedTuple):
    """A snapshot a compaction wrote: where its records are, its index (each manifest
    path's entry) and the size of its body."""

    records: dict[str, _Held]
    entries: dict[str, list[Any]]
    size: int


@contextlib.contextmanager
def _replacing(folder: int, path: Path) -> Iterator[_File]:
    """A new private file in ``folder``, renamed over ``path``'s name when the block ends
    (and removed when it raises); the file stays open: records are read back from it."""
    tmp = f".sets-{os.urandom(8).hex()}.tmp"
    file = _File(os.open(tmp, _CREATE_FLAGS, 0o600, dir_fd=folder))
    try:
        yield file
        os.replace(tmp, path.name, src_dir_fd=folder, dst_dir_fd=folder)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp, dir_fd=folder)
        raise


def _fitted(
    raws: dict[str, bytes],
    index: dict[str, list[Any]],
    used: set[str],
    max_records: int,
    max_bytes: int,
) -> tuple[bytes, dict[str, list[Any]]]:
    """Bound a compaction's snapshot: the head to write, and the index it holds.

    Drops records from ``raws`` (in place) until the body (``_join``) is at most
    ``max_bytes``: the records this process does not use first, the largest of each kind
    first, so the fewest sets are parsed again. The index keeps the entries of the
    records kept, the last ``max_records`` of them.

    Raises:
        OSError: EFBIG, when the head alone is larger than ``max_bytes``.
    """
    while True:
        index = {
            path: entry for path, entry in index.items() if len(entry) == 5 and entry[4] in raws
        }
        if len(index) > max_records:
            index = dict(list(index.items())[-max_records:])
        head = _pack_head(raws, index)
        excess = len(head) + sum(1 + len(raw) for raw in raws.values()) - max_bytes
        if excess <= 0:
            return head, index
        if not raws:  # it would be ignored when read
            raise OSError(errno.EFBIG, os.strerror(errno.EFBIG))
        for key in sorted(raws, key=lambda k: (k in used, -len(raws[k]))):
            excess -= 1 + len(raws.pop(key))
            if excess <= 0:
                break


def _pack_head(records: Mapping[str, bytes], index: Mapping[str, list[Any]]) -> bytes:
    """The JSON head of a snapshot body or journal payload: the index and the records' keys."""
    return orjson.dumps({"index": index, "keys": list(records)})


def _placed(records: Mapping[str, bytes], file: _File, head_end: int) -> dict[str, _Held]:
    """Where ``_pack``'s records lie in ``file`` once written there, its head ending at
    offset ``head_end``: each record follows a tab, in order."""
    placed: dict[str, _Held] = {}
    offset = head_end
    for key, raw in records.items():
        placed[key] = (file, offset + 1, len(raw))
        offset += 1 + len(raw)
    return placed


def _pack(records: Mapping[str, bytes], index: Mapping[str, list[Any]]) -> bytes:
    """A snapshot body or journal payload: a JSON head of the index and the records' keys,
    then each record's JSON after a tab (compact JSON holds no raw tab or newline)."""
    return _join(_pack_head(records, index), records)


def _join(head: bytes, records: Mapping[str, bytes]) -> bytes:
    """``_pack``'s body from its head (``_pack_head``): each record after a tab, in order
    (``_placed`` says where each lands)."""
    return b"\t".join([head, *records.values()])


def _merge(
    records: dict[str, _Held],
    index: dict[str, list[Any]],
    data: bytes,
    *,
    start: int = 0,
    end: int | None = None,
    file: _File | None = None,
) -> None:
    """Add the records and index entries of one snapshot body or journal payload.

    A record is not decoded (``SetStore.decode`` decodes the ones asked for), nor kept as
    bytes when it is in a ``file``: it is kept as where it is there. A payload whose head
    is not what ``_pack`` writes, or whose keys do not match its records one for one,
    adds nothing.

    Args:
        records: Where to add the records.
        index: Where to add the index entries.
        data: Bytes holding the payload (searched in place, not copied).
        start: Where the payload begins in ``data``.
        end: Where it ends (the end of ``data`` when None).
        file: The open file ``data`` was read from (its whole content), else None (the
            records are then kept as copies of their bytes).
    """
    end = len(data) if end is None else end
    cut = data.find(b"\t", start, end)
    cuts = []
    while cut >= 0:
        cuts.append(cut)
        cut = data.find(b"\t", cut + 1, end)
    try:
        value = orjson.loads(data[start : cuts[0] if cuts else end])
        entries, keys = value["index"], value["keys"]
    except (orjson.JSONDecodeError, TypeError, KeyError):
        return
    if (
        not isinstance(entries, dict)
        or not isinstance(keys, list)
        or len(keys) != len(cuts)
        or not all(type(key) is str for key in keys)
    ):
        return
    stops = [*cuts[1:], end] if cuts else []
    if file is None:
        records.update(
            (key, data[cut + 1 : stop]) for key, cut, stop in zip(keys, cuts, stops, strict=True)
        )
    else:
        records.update(
            (key, (file, cut + 1, stop - cut - 1))
            for key, cut, stop in zip(keys, cuts, stops, strict=True)
        )
    index.update(entries)
