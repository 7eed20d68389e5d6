"""Spill files: the full output of a truncated call, capped on disk, old files pruned.

Theory of operation: the runner keeps only a bounded prefix of each stream in memory. When a
stream outgrows that prefix, its bytes from then on can only live on disk, so the runner
starts streaming it here: stdout into the spill file itself, stderr into a hidden sibling
temp file (``.<name>.stderr``), each capped at ``cap`` bytes. When the call ends and its text
was cut, :meth:`Spill.finish` assembles the final file, whose content is the raw combined
output, mirroring the model-facing combination: stdout, then ``\\n`` and stderr when both are
non-empty (or stderr alone when stdout is empty), cut at ``cap`` bytes and then marked with a
final line ``\\n[output capped at <cap> of <n> bytes]``. A stream that never outgrew its
prefix is written from memory at that point. When the text was not cut, or the call has no
outcome (stopped, or cancelled from outside), :meth:`Spill.discard` removes whatever was
written. After a file is finished, :meth:`Spill.finish` prunes the
folder: files older than ``max_age`` go, then all but the ``keep`` newest.

The folder is ``<workspace>/.crystal/data/tools/<dir>/tool-output``. It lies inside the
workspace, which is untrusted content, and the child runs while the daemon writes there: it
can rename, replace or link any name in it, the folder's own included. So the folder is
opened once, on the first spill (``O_DIRECTORY | O_NOFOLLOW``: never through a link), and
checked to be inside the workspace by what ``/proc/self/fd`` names for that descriptor;
every later step goes through the descriptor, never a path: files are made there new
(``O_EXCL``, whatever the child left at the name is unlinked first, never opened: a link, a
FIFO, a hard link to another file) and 0600, the stderr temp file is read back through the
descriptor that wrote it (never reopened by name, and only as far as the daemon wrote it),
and names are unlinked and pruned relative to it (regular files only, links never
followed). The one path the client is given is checked last, after the file is complete: if
it no longer leads to the file written (same device and inode), the child has replaced the
folder or the file, so the result names no file, ``spill_failed`` says why, and the file is
removed. The call id comes from the client: it is reduced to a safe file name (with a
digest of the original when anything had to change).

Writes during draining are blocking ``os.write`` calls into the page cache, or
:meth:`Spill.splice` moving bytes from the child's pipe into the file inside the kernel. At
most ``cap`` bytes of stdout are written, and of stderr only what stdout (on disk so far, and
only growing) leaves of the cap, since no more of it can reach the final file.
:meth:`Spill.finish` may copy up to ``cap`` bytes and list the folder (:func:`prune`), so
the runner calls it in a worker thread.
"""

from __future__ import annotations

import contextlib
import hashlib
import heapq
import os
import re
import stat
import time
from pathlib import Path

import structlog

from .paths import opened_directory_name

__all__ = ["SPILL_FOLDER", "Spill", "SpillResult", "open_folder_within", "prune", "spill_name"]

log = structlog.get_logger("toolsetd.spill")

SPILL_FOLDER = "tool-output"
_UNSAFE = re.compile(r"[^A-Za-z0-9._-]")
_MAX_NAME = 80
_DIGESTED = re.compile(r"-[0-9a-f]{12}$")
#: The most folder entries one prune looks at.
_PRUNE_SCAN = 10_000
# The folder, opened once: every later step goes through this descriptor, never its path.
_FOLDER_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
# Always a new file (O_EXCL): never one the tool left at the name (a FIFO, a hard link).
_OPEN_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
# The stderr temp file is read back through the descriptor that wrote it.
_TEMP_FLAGS = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
_COPY_CHUNK = 1 << 20


def spill_name(call_id: str) -> str:
    """A safe file name for a client-supplied call id (never hidden, never a path)."""
    safe = _UNSAFE.sub("_", call_id)[:_MAX_NAME].lstrip(".-")
    # A changed id gets "-<12 hex>" of its own digest; so does an id that already ends
    # like that, so two ids never share a name ("job:1" and "job_1-d1e888ce6b72").
    if safe != call_id or not safe or _DIGESTED.search(safe):
        digest = hashlib.sha256(call_id.encode("utf-8", "surrogatepass")).hexdigest()[:12]
        safe = f"{safe or 'call'}-{digest}"
    return safe


class SpillResult:
    """Where a finished spill file is, and how much output it stands for."""

    __slots__ = ("capped", "path", "total_bytes")

    def __init__(self, path: Path, total_bytes: int, capped: bool) -> None:
        self.path = path
        self.total_bytes = total_bytes
        self.capped = capped

    def hint(self, cap: int) -> str:
        """The one-line hint appended to a cut text, naming the file."""
        if self.capped:
            return (
                f"\n[full output: {self.path} (first {cap} of {self.total_bytes} bytes);"
                " read it with a file tool]"
            )
        return f"\n[full output: {self.path} ({self.total_bytes} bytes); read it with a file tool]"


class Spill:
    """The spill file of one call (not thread-safe; one owner at a time).

    Args:
        workspace: The canonical workspace.
        folder: The spill folder (inside the workspace).
        call_id: The client's call id.
        cap: The most bytes of output kept on disk.
        keep: After a file is finished, prune all but this many newest files.
        max_age_seconds: After a file is finished, prune files older than this.
    """

    def __init__(
        self,
        workspace: Path,
        folder: Path,
        call_id: str,
        cap: int,
        *,
        keep: int,
        max_age_seconds: float,
    ) -> None:
        self._workspace = workspace
        self.folder = folder
        self._call_id = call_id
        self._name: str | None = None  # named on first use: most calls never spill
        self._cap = cap
        self._keep = keep
        self._max_age = max_age_seconds
        self._dir: int | None = None  # the folder, opened on first use
        self._fds: list[int | None] = [None, None]
        # What each file is ((st_dev, st_ino)): only that is ever removed by name, not
        # whatever another call or the tool put at the name since.
        self._made: list[tuple[int, int] | None] = [None, None]
        self._written = [0, 0]
        self._streaming = [False, False]
        self.failed = False

    @property
    def path(self) -> Path:
        """The spill file."""
        return self.folder / self._file_name

    @property
    def _file_name(self) -> str:
        if self._name is None:
            self._name = spill_name(self._call_id)
        return self._name

    @property
    def _temp_name(self) -> str:
        return f".{self._file_name}.stderr"

    # -- while draining -------------------------------------------------------------------

    def _open_folder(self) -> int | None:
        """The folder's descriptor, opened once (made first if missing); None if unusable."""
        if self._dir is not None:
            return self._dir
        try:
            fd = open_folder_within(str(self._workspace), str(self.folder))
        except (OSError, ValueError) as exc:
            self._fail(exc if isinstance(exc, OSError) else "it is not in the workspace")
            return None
        root = os.path.normpath(str(self._workspace)).rstrip("/") + "/"
        where = opened_directory_name(fd, str(self.folder))
        if where is None or not where.startswith(root):
            os.close(fd)
            self._fail("it resolves outside the workspace")
            return None
        self._dir = fd
        return fd

    def _create(self, name: str, flags: int) -> int:
        """A new file ``name`` in the folder; what the tool left at that name goes first."""
        try:
            return os.open(name, flags, 0o600, dir_fd=self._dir)
        except FileExistsError:  # an earlier call's file under a reused call id, or a plant
            os.unlink(name, dir_fd=self._dir)
            return os.open(name, flags, 0o600, dir_fd=self._dir)

    def _fail(self, error: OSError | str) -> None:
        """Give up on this spill file; say so once (the call's result has no path)."""
        if not self.failed:
            reason = error if isinstance(error, str) else (error.strerror or str(error))
            log.warning("spill_failed", folder=str(self.folder), error=reason)
        self.failed = True

    def _open(self, which: int) -> int | None:
        if self.failed or self._open_folder() is None:
            return None
        try:
            if which == 0:
                fd = self._create(self._file_name, _OPEN_FLAGS)
            else:
                fd = self._create(self._temp_name, _TEMP_FLAGS)
        except OSError as exc:
            self._fail(exc)
            return None
        self._fds[which] = fd
        made = os.fstat(fd)
        self._made[which] = (made.st_dev, made.st_ino)
        self._streaming[which] = True
        return fd

    def streaming(self, which: int) -> bool:
        """Whether stream ``which`` (0 stdout, 1 stderr) is being written to disk."""
        return self._streaming[which]

    def write(self, which: int, data: bytes | bytearray | memoryview) -> None:
        """Append bytes of stream ``which`` (0 stdout, 1 stderr), up to the cap."""
        fd = self._fds[which]
        if fd is None:
            if self._streaming[which] or self.failed:
                return
            fd = self._open(which)
            if fd is None:
                return
        room = self._room(which)
        if room <= 0:
            return
        view = memoryview(data)[:room]
        try:
            while view:
                n = os.write(fd, view)
                self._written[which] += n
                view = view[n:]
        except OSError as exc:
            self._fail(exc)
            self._close(which)

    def _room(self, which: int) -> int:
        room = self._cap - self._written[which]
        if which:
            # The final file is stdout, then stderr, cut at the cap: stderr beyond what
            # stdout (already on disk, and only growing) leaves of the cap is never needed.
            room = min(room, self._cap - self._written[0])
        return room

    def splice(self, which: int, src: int, size: int) -> int | None:
        """Move up to ``size`` bytes of stream ``which`` from pipe ``src`` into its file.

        The bytes go from the pipe to the page cache inside the kernel (``splice``), never
        through the daemon's memory. Only for a stream already being written (see
        :meth:`streaming`).

        Returns:
            The bytes moved (0 at the pipe's EOF), or None when the file takes no more
            (cap reached, or it failed).

        Raises:
            BlockingIOError: The pipe is empty.
            OSError: ``splice`` failed (a file system without it, a full disk): nothing was
                moved; the caller reads the bytes and :meth:`write` s them instead.
        """
        fd = self._fds[which]
        if fd is None:
            return None
        room = self._room(which)
        if room <= 0:
            return None
        n = os.splice(src, fd, min(room, size), flags=os.SPLICE_F_NONBLOCK)
        self._written[which] += n
        return n

    def _close(self, which: int) -> None:
        fd = self._fds[which]
        if fd is not None:
            self._fds[which] = None
            with contextlib.suppress(OSError):
                os.close(fd)

    # -- at the end (blocking: run in a worker thread) ------------------------------------

    def finish(
        self, stdout: bytes, stderr: bytes, stdout_total: int, stderr_total: int
    ) -> SpillResult | None:
        """Assemble the spill file; returns None when it could not be written.

        Args:
            stdout: The retained stdout prefix (all of it when stdout was not streamed).
            stderr: The retained stderr prefix (all of it when stderr was not streamed).
            stdout_total: All stdout bytes the child wrote.
            stderr_total: All stderr bytes the child wrote.
        """
        try:
            if self.failed:
                return None
            if not self._streaming[0]:
                self.write(0, stdout)
                if self.failed:
                    return None
            if stdout_total and stderr_total:
                self.write(0, b"\n")
            if self._streaming[1]:
                self._copy_temp()
            else:
                self.write(0, stderr)
            if self._fds[0] is None and not self._streaming[0]:
                # Nothing at all was written (both streams empty): still create the file.
                self._open(0)
            total = stdout_total + stderr_total + (1 if stdout_total and stderr_total else 0)
            capped = total > self._cap
            fd = self._fds[0]
            if self.failed or fd is None:
                return None
            if capped:
                os.write(fd, f"\n[output capped at {self._cap} of {total} bytes]\n".encode())
            if not self._reachable(fd):
                self._fail("the folder or the file was replaced while the call ran")
                return None
            if self._dir is not None:
                prune(self._dir, keep=self._keep, max_age_seconds=self._max_age)
            return SpillResult(self.path, total, capped)
        except OSError as exc:
            self._fail(exc)
            return None
        finally:
            self._close(0)
            self._close(1)
            if self._streaming[1]:
                self._unlink(1)
            if self.failed:
                self._unlink(0)
            self._close_folder()

    def _reachable(self, fd: int) -> bool:
        """Whether the path the client is given leads to the file written through ``fd``.

        The tool may have moved the folder away and left a link to another in its place:
        the daemon's writes went on in the folder it opened, wherever that is now.
        """
        try:
            named = os.stat(self.path)
        except OSError:
            return False
        written = os.fstat(fd)
        return (named.st_dev, named.st_ino) == (written.st_dev, written.st_ino)

    def _copy_temp(self) -> None:
        """Append the streamed stderr to the spill file, read back through its descriptor.

        Never reopened by name: the child can replace the name (with a link to a file it may
        not read), not the file the daemon holds. At most what the daemon wrote is read.
        """
        fd = self._fds[1]
        if fd is None:
            return
        offset = 0
        while self._written[0] < self._cap and offset < self._written[1]:
            chunk = os.pread(fd, min(_COPY_CHUNK, self._written[1] - offset), offset)
            if not chunk:
                break
            self.write(0, chunk)
            offset += len(chunk)

    def discard(self) -> None:
        """Close and remove whatever was written (the call's text was not cut)."""
        self._close(0)
        self._close(1)
        if self._streaming[0]:
            self._unlink(0)
        if self._streaming[1]:
            self._unlink(1)
        self._close_folder()

    def _unlink(self, which: int) -> None:
        """Remove this spill's file ``which`` (0 the spill file, 1 the stderr temp file),
        if the name still leads to it."""
        made = self._made[which]
        if self._dir is None or made is None:
            return
        name = self._file_name if which == 0 else self._temp_name
        with contextlib.suppress(OSError):
            found = os.stat(name, dir_fd=self._dir, follow_symlinks=False)
            if (found.st_dev, found.st_ino) == made:
                os.unlink(name, dir_fd=self._dir)

    def _close_folder(self) -> None:
        fd = self._dir
        if fd is not None:
            self._dir = None
            with contextlib.suppress(OSError):
                os.close(fd)


def open_folder_within(root: str, folder: str) -> int:
    """Open ``folder`` (a folder below ``root``), making what is missing, following no link.

    Each component below ``root`` is made with ``mkdir`` and opened with ``O_NOFOLLOW``
    relative to its parent's descriptor, so a symlink anywhere on the way (a repository
    can ship ``.crystal/data`` as one, a sandboxed call can plant one) is ``ELOOP`` or
    ``ENOTDIR``, never followed: nothing is made, and nothing is opened, outside ``root``.
    ``root`` itself (the workspace) is opened as named.

    Returns:
        A descriptor of the folder; the caller closes it.

    Raises:
        OSError: A component is a link or not a folder, or cannot be made or opened.
        ValueError: ``folder`` is not below ``root``.
    """
    relative = os.path.relpath(folder, root)
    parts = [] if relative == "." else relative.split(os.sep)
    if ".." in parts:
        raise ValueError(f"{folder} is not below {root}")
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        for part in parts:
            try:
                os.mkdir(part, 0o777, dir_fd=fd)
            except FileExistsError:
                pass
            inner = os.open(part, _FOLDER_FLAGS, dir_fd=fd)
            os.close(fd)
            fd = inner
    except BaseException:
        os.close(fd)
        raise
    return fd


def prune(folder: int, *, keep: int, max_age_seconds: float, now: float | None = None) -> int:
    """Remove old spill files: older than ``max_age_seconds``, then all but the ``keep`` newest.

    ``folder`` is a descriptor of the folder: it is listed, and its files are looked at and
    removed, through that descriptor, never through a path (whose folder the tool may have
    swapped for a link to another). Hidden temp files (calls in flight) are removed only by
    age. Only regular files are touched, links never followed; errors are ignored (another
    call may prune at the same time).

    Returns:
        How many files were removed.
    """
    now = time.time() if now is None else now
    doomed: list[str] = []
    newest: list[tuple[float, str]] = []  # a min-heap of the ``keep`` newest spill files
    try:
        # Streamed, and at most _PRUNE_SCAN entries: a tool can fill its folder with
        # links or folders prune never removes, and every later spill would list them all.
        with os.scandir(folder) as listing:  # closing it rewinds the shared descriptor
            for seen, entry in enumerate(listing):
                if seen >= _PRUNE_SCAN:
                    break
                try:
                    if not entry.is_file(follow_symlinks=False):  # d_type: no syscall
                        continue
                    st = entry.stat(follow_symlinks=False)
                except OSError:
                    continue
                if not stat.S_ISREG(st.st_mode):
                    continue
                if now - st.st_mtime > max_age_seconds:
                    doomed.append(entry.name)
                elif not entry.name.startswith("."):
                    heapq.heappush(newest, (st.st_mtime, entry.name))
                    if len(newest) > keep:
                        doomed.append(heapq.heappop(newest)[1])
    except OSError:
        return 0
    removed = 0
    for name in doomed:  # after the listing: never unlink under a running readdir
        with contextlib.suppress(OSError):
            os.unlink(name, dir_fd=folder)
            removed += 1
    return removed
