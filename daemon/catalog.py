"""Discovery, overlay and loading of tool sets into one immutable ``Catalog`` snapshot.

Theory of operation: ``build_catalog`` scans ``<home>/tools`` and then
``<workspace>/.crystal/tools``. Every immediate subdirectory (symlinks followed) that
holds a ``tools.json`` is a candidate set, taken in ordinal name order; an entry that
cannot be examined (a symlink loop, a link into a folder we may not search) is no
subdirectory, and costs nothing but itself. A project
candidate hides the home set of the same directory name *before* its manifest is read,
so a broken project manifest still hides the home set. The enabled sets that survive
are loaded in ordinal directory order; each exec tool registers its name unless an
earlier set already took it, in which case only that tool is omitted with a note (a
reserved name anywhere in a set refuses the whole set: the parser's rule). Dotnet sets
are validated and then skipped (no .NET runtime).
Every candidate ends as one ``SetEntry`` (loaded, disabled, refused or hidden), and
every problem as one English ``Note``: config notes first, then discovery notes (home
scan, then project scan), then load notes in set order.

``ManifestCache`` makes a rebuild cheap: a manifest is re-read only when its stat
signature changed and re-parsed only when its bytes changed; the schema-check cache and
the per-tool hashes live with it. Given a ``SetStore`` (``setcache.py``) it also looks new
bytes up on disk before parsing them, so a daemon's cold start decides again only the
manifests that changed since any daemon last saw them. It is shared by worker threads, so
a lock guards its dicts; file I/O and parsing happen outside the lock.

The manifest and config readers never block on special files: they ``stat`` first,
accept only regular files, and open with ``O_NONBLOCK`` so a FIFO swapped in after the
``stat`` cannot hang a worker.

Why one module of this size: discovery, the overlay and the manifest cache decide together
which bytes are read and which set wins; the wire shapes (``tool_info``, ``set_info``,
``note_info``) sit beside them because ``tool_hash`` hashes exactly that shape.
"""

from __future__ import annotations

import hashlib
import os
import stat
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from types import MappingProxyType
from typing import Any

from toolsetd.protocol.ordinal import ordinal_key, sort_by_directory

from .config_file import (
    MAX_MANIFEST_BYTES,
    ManifestUnchecked,
    ManifestUnreadable,
    load_config,
    read_regular_file,
)
from .exhaustion import out_of_resources
from .gcpause import GcPause
from .manifest import ManifestError, is_directory_name, parse_manifest
from .model import (
    Approval,
    ApprovalSource,
    Catalog,
    Config,
    LoadedTool,
    Note,
    RunnerKind,
    SetEntry,
    SetState,
    Source,
    ToolDef,
    ToolSet,
)
from .paths import unreachable_link
from .setcache import SetStore, decode_record, encode_record, reserved_fingerprint
from .validation import JsonschemaChanged, SchemaChecker, canonical_json

__all__ = [
    "INVALID_DIRECTORY_NAME",
    "MANIFEST_NAME",
    "MAX_MANIFEST_BYTES",
    "ManifestCache",
    "ManifestUnreadable",
    "build_catalog",
    "load_config",
    "note_info",
    "set_info",
    "subdirectory_names",
    "tool_hash",
    "tool_info",
]

MANIFEST_NAME = "tools.json"
#: The inventory's error cell of a set whose directory name is not legal (both paths).
INVALID_DIRECTORY_NAME = "directory name is invalid."


# --- the manifest cache ----------------------------------------------------------------


#: A file modified this recently may be modified again within the same timestamp tick
#: without its stat signature changing ("racy git"), so its signature is not trusted yet.
RACY_NS = 2_000_000_000


def _signature(st: os.stat_result) -> tuple[int, int, int, int]:
    return (st.st_mtime_ns, st.st_size, st.st_ino, st.st_ctime_ns)


def trusted_signature(st: os.stat_result, now_ns: int) -> tuple[int, int, int, int] | None:
    """The stat signature, or None while the file is too fresh to be judged by it.

    Timestamps advance in ticks (milliseconds on most filesystems), so two writes of the
    same size inside one tick leave mtime, ctime and size alike. A signature is trusted
    only once the file is older than ``RACY_NS``; until then the caller re-reads the bytes
    (and re-parses only if they changed).
    """
    if now_ns - max(st.st_mtime_ns, st.st_ctime_ns) < RACY_NS:
        return None
    return _signature(st)


class _Cached:
    """One manifest's parse result and what it was judged by.

    This and ``_Candidate`` are plain slotted classes: nothing compares or prints them, and
    a dataclass would cost every start ~0.4 ms to create (``@dataclass`` compiles its
    methods with ``exec``).
    """

    __slots__ = ("digest", "hashes", "reserved", "result", "signature")

    def __init__(
        self,
        signature: tuple[int, int, int, int] | None,
        digest: bytes,
        reserved: frozenset[str],
        result: ToolSet | ManifestError,
        hashes: dict[tuple[str, ApprovalSource], str],
    ) -> None:
        self.signature = signature
        self.digest = digest
        self.reserved = reserved
        self.result = result
        self.hashes = hashes


#: The fewest store decisions a manifest cache keeps before it may start over (it keeps up
#: to twice as many as it has manifests).
_DECIDED_MIN = 4096

#: pathlib's own child constructor (what ``iterdir`` uses): a plain folder name below a
#: Path already parsed, without parsing the name again (a third of ``parent / name``).
#: Private, so looked up once, with ``/`` where it is missing.
_CHILD: Callable[[Path, str], Path] = getattr(Path, "_make_child_relpath", Path.__truediv__)


def _set_path(set_dir: str, parent: Path | None, name: str | None = None) -> Path:
    if parent is None:
        return Path(set_dir)
    return _CHILD(parent, os.path.basename(set_dir) if name is None else name)


class ManifestCache:
    """Parsed manifests by path: re-read on a new stat signature, re-parse on new bytes.

    Attributes:
        reads: How many times a manifest file was read.
        parses: How many times manifest bytes were parsed.
        schemas: The schema-check cache the parser uses.
    """

    def __init__(
        self,
        schemas: SchemaChecker | None = None,
        *,
        clock_ns: Callable[[], int] = time.time_ns,
        store: SetStore | None = None,
    ) -> None:
        """Create an empty cache.

        Args:
            schemas: The schema-check cache to share; a fresh one when None.
            clock_ns: Wall-clock nanoseconds, to judge whether a file is too fresh for its
                stat signature to be trusted (injectable for tests).
            store: The persistent cache of parse results to consult before parsing (and
                to fill; ``flush`` writes it), or None for none.
        """
        self.schemas = schemas if schemas is not None else SchemaChecker()
        self.store = store
        #: Per set of reserved names, the store-key part after the digest, per source.
        self._suffixes: dict[frozenset[str], dict[Source, str]] = {}
        self._clock_ns = clock_ns
        self.reads = 0
        self.parses = 0
        self._entries: dict[tuple[str, Source], _Cached] = {}
        #: The decisions of the cached manifests by store key: a second manifest with
        #: the same key (the same set in two worktrees) shares its decision, neither
        #: decoded nor parsed again. ``forget`` drops those no cached manifest holds (the
        #: store still has their records, as bytes).
        self._decided: dict[
            str, tuple[ToolSet | ManifestError, dict[tuple[str, ApprovalSource], str]]
        ] = {}
        self._lock = threading.Lock()

    def get(
        self,
        set_dir: str | Path,
        source: Source,
        reserved: frozenset[str],
        *,
        stat_result: os.stat_result | None = None,
    ) -> ToolSet:
        """Return the parsed set in ``set_dir``, reading and parsing only what changed.

        Args:
            set_dir: The set directory.
            source: Home or project.
            reserved: Reserved tool names (a change forces a re-parse).
            stat_result: A fresh ``os.stat`` of the manifest, when the caller has one.

        Returns:
            The parsed set.

        Raises:
            ManifestUnreadable: The file could not be read.
            ManifestError: The manifest is invalid (cached like a success).
        """
        # Plain strings: pathlib costs more than the stat on a warm rebuild.
        set_dir = os.path.abspath(set_dir)
        manifest = os.path.join(set_dir, MANIFEST_NAME)
        if stat_result is None:
            try:
                stat_result = os.stat(manifest)
            except OSError as exc:
                raise ManifestUnreadable("tools.json could not be read.") from exc
        return self._unwrap(self.entry(set_dir, manifest, source, reserved, stat_result, None))

    def entry(
        self,
        set_dir: str,
        manifest: str,
        source: Source,
        reserved: frozenset[str],
        stat_result: os.stat_result,
        parent: Path | None,
    ) -> _Cached:
        """``get`` for a caller that already has the absolute paths and a fresh stat.

        Args:
            set_dir: The absolute set directory.
            manifest: ``set_dir``'s ``tools.json``.
            source: Home or project.
            reserved: Reserved tool names.
            stat_result: A fresh ``os.stat`` of the manifest.
            parent: ``set_dir``'s parent folder as a ``Path``, when the caller has one (a
                child path is cheaper to build than a parsed one).

        Returns:
            The cache entry (``_unwrap`` gives the set or raises its error).

        Raises:
            ManifestUnreadable: The file could not be read.
        """
        key = (manifest, source)
        with self._lock:
            cached = self._entries.get(key)
        if (
            cached is not None
            and cached.signature == _signature(stat_result)
            and cached.reserved == reserved
        ):
            return cached
        if self.store is not None and cached is None:
            found = self._indexed(key, set_dir, source, reserved, stat_result, parent)
            if found is not None:
                return found
        read = self._reread(cached, manifest, reserved, stat_result)
        if read is None:
            assert cached is not None
            return cached
        text, digest, signature = read
        result, hashes, parsed, store_key = self._decide(
            text, digest, set_dir, source, reserved, _set_path(set_dir, parent)
        )
        if store_key is not None and self.store is not None:
            self.store.index(manifest, signature, store_key)
        found = _Cached(signature, digest, reserved, result, hashes)
        with self._lock:
            self.parses += parsed
            self._entries[key] = found
        if cached is not None and self.store is not None:
            # The bytes this manifest held before are gone from it: their decision (a whole
            # parsed set) is no longer one to recall, nor their record one to keep. Kept, an
            # edit storm of one big set grew the daemon by a set per reload.
            old_key = self._store_key(
                cached.digest, source, cached.reserved, os.path.basename(set_dir)
            )
            with self._lock:
                self._decided.pop(old_key, None)
            self.store.release(old_key)
        return found

    def unchanged(
        self,
        manifest: str,
        source: Source,
        reserved: frozenset[str],
        result: ToolSet,
        max_bytes: int,
    ) -> bool:
        """Whether ``manifest`` still holds the bytes ``result`` was loaded from: ``entry``
        without its parse, for a caller that must not parse (the event loop).

        True when the manifest's cached entry holds ``result`` and either its stat signature
        still matches or its bytes, read again, have the same digest (the entry then takes
        the new signature, as ``entry`` gives it). False when only ``entry`` can tell: not
        cached, another result, more than ``max_bytes`` (by its stat, or by what a read
        finds: no more than ``max_bytes`` + 1 are read), unreadable, or other bytes.

        Args:
            manifest: The absolute path of a set's ``tools.json``.
            source: Home or project.
            reserved: Reserved tool names.
            result: The set a snapshot holds for it.
            max_bytes: A larger file is not read here (nor read further than this).
        """
        with self._lock:
            cached = self._entries.get((manifest, source))
        if cached is None or cached.result is not result or cached.reserved != reserved:
            return False
        try:
            stat_result = os.stat(manifest)
        except OSError:
            return False
        if cached.signature == _signature(stat_result):
            return True
        if stat_result.st_size > max_bytes:
            return False
        try:
            # Bounded on the bytes read too: a file that grew since the stat (or another
            # renamed over it) is left to ``entry``, not read to 1 MiB here.
            return self._reread(cached, manifest, reserved, stat_result, max_bytes) is None
        except ManifestUnreadable:
            return False

    def _reread(
        self,
        cached: _Cached | None,
        manifest: str,
        reserved: frozenset[str],
        stat_result: os.stat_result,
        max_bytes: int = MAX_MANIFEST_BYTES,
    ) -> tuple[bytes, bytes, tuple[int, int, int, int] | None] | None:
        """Read a manifest: None when its bytes are ``cached``'s (which then takes their
        signature), else the bytes, their digest and their trusted signature.

        Raises:
            ManifestUnreadable: The file could not be read, or holds more than
                ``max_bytes``.
        """
        text, st = read_regular_file(manifest, stat_result, max_bytes)
        digest = hashlib.sha256(text).digest()
        signature = trusted_signature(st, self._clock_ns())
        with self._lock:
            self.reads += 1
            if cached is not None and cached.digest == digest and cached.reserved == reserved:
                cached.signature = signature
                return None
        return text, digest, signature

    def _store_key(
        self, digest: bytes, source: Source, reserved: frozenset[str], directory: str
    ) -> str:
        """The store's key of a decision: the bytes, the source, the reserved names and the
        set's directory name, all of which it depends on."""
        return digest.hex() + self._key_suffix(source, reserved) + directory

    def _key_suffix(self, source: Source, reserved: frozenset[str]) -> str:
        """The part of a store key after the digest, up to the directory name."""
        suffixes = self._suffixes.get(reserved)
        if suffixes is None:
            fp = reserved_fingerprint(reserved)
            suffixes = self._suffixes[reserved] = {s: f"/{s.value}/{fp}/" for s in Source}
        return suffixes[source]

    def _indexed(
        self,
        key: tuple[str, Source],
        set_dir: str,
        source: Source,
        reserved: frozenset[str],
        st: os.stat_result,
        parent: Path | None,
    ) -> _Cached | None:
        """The store's decision for a file it indexed with this trusted signature, unread,
        entered in the cache under ``key`` (the manifest path and source).

        A cold start takes this path for every set: the remembered decision and the cache
        entry go in under one lock acquisition (``_remember``'s ``entry``).
        """
        store = self.store
        assert store is not None
        signature = trusted_signature(st, self._clock_ns())
        if signature is None or not stat.S_ISREG(st.st_mode) or st.st_size > MAX_MANIFEST_BYTES:
            return None
        found = store.lookup(key[0], signature)
        if found is None:
            return None
        store_key, raw = found
        directory = set_dir[set_dir.rfind(os.sep) + 1 :]  # set_dir is absolute
        if store_key[64:] != self._key_suffix(source, reserved) + directory:
            return None  # indexed under another source or other reserved names
        path = _set_path(set_dir, parent, directory)
        try:
            digest = bytes.fromhex(store_key[:64])
            decided = self._recall(store_key, path)  # another worktree's copy, decoded
            if decided is not None:
                entry = _Cached(signature, digest, reserved, *decided)
                with self._lock:
                    self._entries[key] = entry
                return entry
            record = None if raw is None else store.decode(store_key, raw)
            if record is None:
                return None
            result, hashes = decode_record(record, directory=directory, source=source, path=path)
        except (ValueError, TypeError, KeyError, IndexError):
            store.discard(store_key)
            return None
        value = ManifestError(result) if isinstance(result, str) else result
        entry = _Cached(signature, digest, reserved, value, hashes)
        self._remember(store_key, value, hashes, (key, entry))
        return entry

    def _from_record(
        self, key: str, record: list[Any], directory: str, source: Source, path: Path
    ) -> tuple[ToolSet | ManifestError, dict[tuple[str, ApprovalSource], str]]:
        """The decision a store record holds, remembered under its key.

        Raises:
            ValueError, TypeError, KeyError, IndexError: The record is malformed.
        """
        result, hashes = decode_record(record, directory=directory, source=source, path=path)
        value = ManifestError(result) if isinstance(result, str) else result
        self._remember(key, value, hashes)
        return value, hashes

    def _remember(
        self,
        key: str,
        value: ToolSet | ManifestError,
        hashes: dict[tuple[str, ApprovalSource], str],
        entry: tuple[tuple[str, Source], _Cached] | None = None,
    ) -> None:
        """Keep the decision for a store key (bounded: past the bound it starts over), and
        enter ``entry`` (a manifest's key and cache entry) under the same lock."""
        with self._lock:
            if len(self._decided) >= max(_DECIDED_MIN, 2 * len(self._entries)):
                self._decided.clear()  # costs a decode at worst, never a wrong set
            self._decided[key] = (value, hashes)
            if entry is not None:
                self._entries[entry[0]] = entry[1]

    def _recall(
        self, key: str, path: Path
    ) -> tuple[ToolSet | ManifestError, dict[tuple[str, ApprovalSource], str]] | None:
        """A decision this process made for ``key``, for the set at ``path``, or None.

        Equal keys mean equal bytes, directory name, source and reserved names, so only
        the path can differ (another worktree's copy of the same set).
        """
        with self._lock:
            decided = self._decided.get(key)
        if decided is None:
            return None
        value, hashes = decided
        if isinstance(value, ToolSet) and value.path != path:
            value = replace(value, path=path)
        return value, dict(hashes)  # the memo of tool hashes grows per entry

    def _decide(
        self,
        text: bytes,
        digest: bytes,
        set_dir: str,
        source: Source,
        reserved: frozenset[str],
        path: Path,
    ) -> tuple[ToolSet | ManifestError, dict[tuple[str, ApprovalSource], str], bool, str | None]:
        """Parse new bytes, or take the decision from the store.

        Returns:
            The result, the tools' hashes known so far, whether the bytes were parsed, and
            the store key (None without a store).
        """
        store = self.store
        key = None
        if store is not None:
            key = self._store_key(digest, source, reserved, path.name)
            decided = self._recall(key, path)
            if decided is not None:
                return decided[0], decided[1], False, key
            record = store.get(key)
            if record is not None:
                try:
                    value, hashes = self._from_record(key, record, path.name, source, path)
                except (ValueError, TypeError, KeyError, IndexError):
                    store.discard(key)  # a bad record costs one parse, never a wrong set
                else:
                    return value, hashes, False, key
        result: ToolSet | ManifestError
        try:
            result = parse_manifest(
                text, set_dir=path, source=source, reserved=reserved, schemas=self.schemas
            )
        except ManifestError as exc:
            # Kept without its traceback: that holds the parser's frames (the manifest's
            # bytes and parsed JSON) and this frame, a cycle only the collector can free.
            result = ManifestError(exc.message)
        except JsonschemaChanged as exc:
            # Not the set's fault, nor a verdict on it: skipped with a note, not cached,
            # and parsed again at the next look (after the restart it asks for).
            raise ManifestUnchecked(exc.message) from None
        if store is None or key is None:
            return result, {}, True, None
        if isinstance(result, ManifestError):
            store.put(key, encode_record(result.message, {}))
            self._remember(key, result, {})
            return result, {}, True, key
        computed = {
            (tool.name, policy): tool_hash(tool, result, policy)
            for tool in result.tools
            for policy in ApprovalSource
        }
        store.put(key, encode_record(result, computed))
        self._remember(key, result, computed)
        return result, computed, True, key

    def flush(self) -> None:
        """Write the persistent store's new records, if there is a store."""
        if self.store is not None:
            self.store.flush()

    @staticmethod
    def _unwrap(cached: _Cached) -> ToolSet:
        """The set of an entry, or its error raised (a fresh exception each time)."""
        if isinstance(cached.result, ManifestError):
            raise ManifestError(cached.result.message)
        return cached.result

    def tool_hash(self, tool: ToolDef, toolset: ToolSet, policy: ApprovalSource) -> str:
        """``tool_hash`` memoised with the cached manifest, so unchanged sets hash once.

        Args:
            tool: The tool.
            toolset: Its set (as returned by ``get``).
            policy: The source policy that applies.

        Returns:
            The ``sha256:`` hash.
        """
        with self._lock:
            manifest = os.path.join(str(toolset.path), MANIFEST_NAME)
            cached = self._entries.get((manifest, toolset.source))
        memo = cached.hashes if cached is not None and cached.result is toolset else None
        if memo is not None and (found := memo.get((tool.name, policy))) is not None:
            return found
        value = tool_hash(tool, toolset, policy)
        if memo is not None:
            with self._lock:
                memo[(tool.name, policy)] = value
        return value

    def __len__(self) -> int:
        """How many manifests are cached."""
        with self._lock:
            return len(self._entries)

    def forget(self, keep: set[str] | None = None) -> None:
        """Drop cached manifests, all of them or those whose manifest path is not in ``keep``.

        Args:
            keep: Manifest paths (``<set dir>/tools.json``, absolute) to keep.
        """
        with self._lock:
            for key in [k for k in self._entries if keep is None or k[0] not in keep]:
                del self._entries[key]
            if self._decided:
                # The decisions no cached manifest holds now (a released workspace's sets)
                # go with them: kept, a daemon held every set it ever served, decoded
                # (~9 bytes a byte of manifest). The store keeps their records as bytes.
                live = {
                    self._store_key(
                        cached.digest, source, cached.reserved, os.path.basename(set_dir)
                    )
                    for (manifest, source), cached in self._entries.items()
                    for set_dir in (os.path.dirname(manifest),)
                }
                self._decided = {k: v for k, v in self._decided.items() if k in live}


# --- hashes and wire helpers -----------------------------------------------------------


# Enum members read through the class cost ~0.25 µs each on Python 3.11; the loops over
# thousands of sets below use these module constants instead.
_AUTHOR = ApprovalSource.AUTHOR
_INHERIT = Approval.INHERIT
_HOME = Source.HOME
_PROJECT = Source.PROJECT
_DOTNET = RunnerKind.DOTNET
_LOADED = SetState.LOADED
_REFUSED = SetState.REFUSED
_DISABLED = SetState.DISABLED
_HIDDEN = SetState.HIDDEN


def _effective(tool: ToolDef, policy: ApprovalSource) -> Approval:
    return tool.approval if policy is _AUTHOR else _INHERIT


def _definition(tool: ToolDef, toolset: ToolSet, policy: ApprovalSource) -> dict[str, Any]:
    return {
        "name": tool.name,
        "description": tool.description,
        "inputSchema": tool.schema,
        "set": toolset.directory,
        "source": toolset.source.value,
        "runner": toolset.runner.value,
        "catalogs": sorted(c.value for c in tool.catalogs),
        "approval": {
            "declared": tool.approval.value,
            "policy": policy.value,
            "effective": _effective(tool, policy).value,
        },
        "timeoutSeconds": toolset.timeout_seconds,
        "output": tool.output.value,
        "pathArguments": list(tool.path_arguments),
    }


def tool_hash(tool: ToolDef, toolset: ToolSet, policy: ApprovalSource) -> str:
    """Hash a tool's wire definition plus how it runs (contract section 4, ``hash``).

    The hashed object is the ``tools[]`` entry without ``hash``, plus ``command`` (set
    prefix then tool suffix), ``argv`` (``[[property, flag], ...]``) and ``stdin``,
    serialised by ``canonical_json``.

    Args:
        tool: The tool.
        toolset: Its set.
        policy: The source policy that applies.

    Returns:
        ``"sha256:"`` and 64 hex digits.
    """
    body = _definition(tool, toolset, policy)
    body["command"] = [*toolset.command, *tool.command]
    body["argv"] = [list(pair) for pair in tool.argv]
    body["stdin"] = toolset.stdin
    return "sha256:" + hashlib.sha256(canonical_json(body)).hexdigest()


def tool_info(loaded: LoadedTool) -> dict[str, Any]:
    """The contract's ``tools[]`` entry for one loaded tool.

    Args:
        loaded: The tool.

    Returns:
        A camelCase dict.
    """
    info = _definition(loaded.tool, loaded.toolset, loaded.policy)
    info["hash"] = loaded.hash
    return info


def set_info(entry: SetEntry) -> dict[str, Any]:
    """The contract's ``sets[]`` entry, plus the reference inventory's columns.

    Beyond the contract's fields it carries ``runner``, ``catalogs`` and ``approval``
    (the set-level values, null when the manifest did not parse), ``declaredTools`` (every
    tool the manifest declares, loaded or not: ``name``, declared ``approval``,
    ``catalogs``) and ``error`` (the manifest error, or ``directory name is invalid.``,
    else null), so a front end draws the operator's inventory table without reading files,
    exactly as the offline reader does.

    Args:
        entry: The set entry.

    Returns:
        A camelCase dict.
    """
    toolset = entry.toolset
    return {
        "directory": entry.directory,
        "source": entry.source.value,
        "path": str(entry.path),
        "enabled": entry.enabled,
        "state": entry.state.value,
        "tools": list(entry.tools),
        "notes": list(entry.notes),
        "runner": toolset.runner.value if toolset else None,
        "catalogs": sorted(c.value for c in toolset.catalogs) if toolset else None,
        "approval": toolset.approval.value if toolset else None,
        "declaredTools": [
            {
                "name": tool.name,
                "approval": tool.approval.value,
                "catalogs": sorted(c.value for c in tool.catalogs),
            }
            for tool in toolset.tools
        ]
        if toolset
        else [],
        "error": entry.error,
    }


def note_info(note: Note) -> dict[str, Any]:
    """The contract's ``notes[]`` entry.

    Args:
        note: The note.

    Returns:
        A dict with ``set``, ``source`` (None for config notes) and ``message``.
    """
    return {
        "set": note.set,
        "source": note.source.value if note.source is not None else None,
        "message": note.message,
    }


# --- discovery, overlay, load ----------------------------------------------------------


def subdirectory_names(folder: int | str | Path) -> list[str]:
    """The names of a folder's subdirectories (symlinks followed), in ordinal order.

    An entry that cannot be examined (a symlink loop, a symlink into a folder this process
    may not search) is not a subdirectory: it is left out, and the rest are listed. That is
    what the reference host's ``Directory.GetDirectories`` does (a link it cannot stat
    counts as a file); raising instead would drop every set of the root for one bad entry.

    Args:
        folder: An open directory descriptor, or the folder's path.

    Returns:
        The sorted names.

    Raises:
        OSError: The folder itself could not be listed, or an entry could not be examined
            for want of descriptors or memory (``out_of_resources``: not the entry's fault).
    """
    names: list[str] = []
    with os.scandir(folder) as it:
        for entry in it:
            try:
                if entry.is_dir():  # follows symlinks
                    names.append(entry.name)
            except OSError as exc:
                if out_of_resources(exc):
                    raise
    names.sort()
    if not "".join(names).isascii():  # the reference host's order (a stable sort: ties kept)
        names.sort(key=ordinal_key)
    return names


class _Candidate:
    """One set folder found by a scan, until ``freeze`` makes its ``SetEntry``."""

    __slots__ = (
        "directory",
        "error",
        "hashes",
        "notes",
        "path",
        "source",
        "state",
        "tools",
        "toolset",
    )

    def __init__(self, directory: str, source: Source, path: str) -> None:
        self.directory = directory
        self.source = source
        self.path = path
        self.state = SetState.REFUSED
        self.toolset: ToolSet | None = None
        self.error: str | None = None
        self.tools: list[str] = []
        self.notes: list[str] = []
        #: The manifest cache's memo of this set's tool hashes.
        self.hashes: dict[tuple[str, ApprovalSource], str] | None = None

    def freeze(self) -> SetEntry:
        toolset = self.toolset
        return SetEntry(  # positional: this runs once per set (fields in declaration order)
            self.directory,
            self.source,
            toolset.path if toolset is not None else Path(self.path),
            toolset.enabled if toolset is not None else None,
            self.state,
            tuple(self.tools),
            tuple(self.notes),
            toolset,
            self.error,
        )


class _Builder:
    """The mutable working state of one ``build_catalog`` call."""

    def __init__(self, reserved: frozenset[str], cache: ManifestCache, pause: GcPause) -> None:
        self.reserved = reserved
        self.cache = cache
        self.pause = pause
        self.notes: list[Note] = []
        self.candidates: list[_Candidate] = []
        self.active: dict[str, _Candidate] = {}  # overlay map: directory -> winning candidate
        self.home: dict[str, _Candidate] = {}  # home candidates with a valid name, by directory

    def note(self, candidate: _Candidate, message: str) -> None:
        candidate.notes.append(message)
        self.notes.append(Note(set=candidate.directory, source=candidate.source, message=message))

    def scan(self, root: Path, source: Source) -> None:
        base = os.path.abspath(root)
        try:
            root_fd = os.open(base, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except OSError as exc:
            if out_of_resources(exc):
                raise  # the daemon's want: no snapshot without the sets it could not see
            return  # a missing or unreadable root is skipped, as the reference host does
        try:
            self._scan(root, base, root_fd, source)
        finally:
            os.close(root_fd)

    def _scan(self, root: Path, base: str, root_fd: int, source: Source) -> None:
        try:
            names = subdirectory_names(root_fd)
        except OSError as exc:
            if out_of_resources(exc):
                raise
            return
        root_path = root if isinstance(root, Path) and str(root) == base else Path(base)
        stat_ = os.stat
        in_set = os.sep + MANIFEST_NAME
        tick = self.pause.tick
        cache_entry = self.cache.entry
        reserved = self.reserved
        for name in names:
            tick()
            set_dir = base + os.sep + name
            manifest = set_dir + in_set
            try:
                # Relative to the open folder: the kernel walks two path components, not
                # the whole path (as the registry's reload scan does).
                found = stat_(name + in_set, dir_fd=root_fd)
            except OSError:
                if not unreachable_link(name + in_set, root_fd):
                    continue  # no tools.json: not a candidate
                st = None  # a link that leads nowhere: a candidate that cannot be read
            else:
                if stat.S_ISDIR(found.st_mode):
                    continue
                st = found
            candidate = _Candidate(name, source, set_dir)
            self.candidates.append(candidate)
            if not is_directory_name(name):
                candidate.error = INVALID_DIRECTORY_NAME
                self.note(
                    candidate, f"External tool set '{name}' was skipped: {INVALID_DIRECTORY_NAME}"
                )
                continue
            if source is _PROJECT:
                if (home := self.home.get(name)) is not None:
                    home.state = _HIDDEN
                self.active.pop(name, None)
            else:
                self.home[name] = candidate
            try:
                if st is None:
                    raise ManifestUnreadable(f"{MANIFEST_NAME} could not be read.")
                entry = cache_entry(set_dir, manifest, source, reserved, st, root_path)
            except ManifestError as exc:
                if out_of_resources(exc.__cause__):  # not the set's fault: it is not skipped
                    raise exc.__cause__ from None
                error = exc.message
            else:
                toolset = entry.result
                if not isinstance(toolset, ManifestError):  # ``_unwrap``, without a raise
                    candidate.toolset = toolset
                    candidate.hashes = entry.hashes
                    if toolset.enabled:
                        self.active[name] = candidate
                    else:
                        candidate.state = _DISABLED
                        self.active.pop(name, None)
                    continue
                error = toolset.message
            candidate.error = error
            self.note(candidate, f"External tool set '{name}' was skipped: {error}")

    def load(self, config: Config) -> dict[str, LoadedTool]:
        registered = set(self.reserved)
        tools: dict[str, LoadedTool] = {}
        tick = self.pause.tick
        for name in sorted(self.active):
            tick()
            candidate = self.active[name]
            toolset = candidate.toolset
            assert toolset is not None
            if toolset.runner is _DOTNET:
                self.note(
                    candidate,
                    f"External tool set '{name}' was skipped: dotnet runner is not supported by "
                    "toolsetd (no .NET runtime); the manifest is valid.",
                )
                continue
            policy = config.home_policy if toolset.source is _HOME else config.project_policy
            effective_author = policy is _AUTHOR
            memo = candidate.hashes if candidate.hashes is not None else {}
            for tool in toolset.tools:
                if tool.name in registered:
                    self.note(
                        candidate,
                        f"External tool '{tool.name}' was omitted because the name is already "
                        "registered.",
                    )
                    continue
                registered.add(tool.name)
                digest = memo.get((tool.name, policy))
                if digest is None:
                    digest = memo[(tool.name, policy)] = tool_hash(tool, toolset, policy)
                tools[tool.name] = LoadedTool(
                    tool, toolset, tool.approval if effective_author else _INHERIT, policy, digest
                )
                candidate.tools.append(tool.name)
                for note in tool.listing_notes:  # made by the parse, kept in the store
                    self.note(candidate, note)
            candidate.state = _LOADED if candidate.tools else _REFUSED
        return tools


def build_catalog(
    home: Path,
    workspace: Path | None,
    *,
    reserved: frozenset[str],
    cache: ManifestCache,
    config: Config | None = None,
) -> Catalog:
    """Discover, overlay and load the tool sets of a home and an optional workspace.

    Args:
        home: The Crystal home; sets live in ``<home>/tools``.
        workspace: The workspace; its sets live in ``<workspace>/.crystal/tools``. None
            for home sets only.
        reserved: Names no external tool may take (case-sensitive).
        cache: The manifest cache to read through.
        config: The settings; when None, ``load_config(home)`` is read and its notes
            come first in the catalog's notes.

    Returns:
        The immutable snapshot. With ``externalTools`` false nothing is scanned: no
        tools, no sets, and only config notes.
    """
    config_notes: list[Note] = []
    if config is None:
        config, config_notes = load_config(home)
    if not config.external_tools:
        return Catalog(workspace=workspace, notes=tuple(config_notes), config=config)
    # Every object the build makes lives on in the snapshot: no young collection can free
    # any of them, so the collector is held off while they are made, and they go straight
    # to the oldest generation after (gcpause.py).
    with GcPause(promote=True) as pause:
        builder = _Builder(reserved, cache, pause)
        builder.scan(home / "tools", Source.HOME)
        if workspace is not None:
            builder.scan(workspace / ".crystal" / "tools", Source.PROJECT)
        tools = builder.load(config)
        entries = [candidate.freeze() for candidate in builder.candidates]
        if workspace is not None:  # one scan's candidates come in directory order already
            sort_by_directory(entries, lambda entry: (entry.directory, entry.source))
    return Catalog(
        workspace=workspace,
        tools=MappingProxyType(tools),
        sets=tuple(entries),
        notes=(*config_notes, *builder.notes),
        config=config,
    )
