"""Spill files: the full output of a truncated call, capped on disk, old files pruned.

Theory of operation: the runner keeps only a bounded prefix of each stream in memory. When a
stream outgrows that prefix, its bytes from then on can only live on disk, so the runner
starts streaming it here: stdout into the spill file itself, stderr into a hidden sibling
temp file (``.<name>.stderr``), each capped at ``cap`` bytes. When the call ends and its text
was cut, :meth:`Spill.finish` assembles the final file, whose content is the raw combined
output, mirroring the model-facing combination: stdout, then ``\\n`` and stderr when both are
non-empty (or stderr alone when stdout is empty), cut at ``cap`` bytes and then marked with a
final line ``\\n[output capped at <cap> of <n> bytes]``. A stream that never outgrew its
prefix is written from memory at that point. When the text was not cut, :meth:`Spill.discard`
removes whatever was written. After a file is finished, the folder is pruned: files older
than ``max_age`` go, then all but the ``keep`` newest.

The folder is ``<workspace>/.crystal/data/tools/<dir>/tool-output``. It lies inside the
workspace, which is untrusted content, so it is checked to resolve inside the workspace
before anything is written, files are opened with ``O_NOFOLLOW`` and created 0600, and
pruning only unlinks regular files. The child can replace any name in the folder while it
runs, so the stderr temp file is read back through the descriptor that wrote it, never
reopened by name, and only as far as the daemon wrote it. The call id comes from the
client: it is reduced to a safe file name (with a digest of the original when anything had
to change).

Writes during draining are blocking ``os.write`` calls into the page cache, or
:meth:`Spill.splice` moving bytes from the child's pipe into the file inside the kernel. At
most ``cap`` bytes of stdout are written, and of stderr only what stdout (on disk so far, and
only growing) leaves of the cap, since no more of it can reach the final file.
:meth:`Spill.finish` and :func:`prune` may copy up to ``cap`` bytes and list a folder, so the
runner calls them in a worker thread.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import stat
import time
from pathlib import Path

import structlog

__all__ = ["SPILL_FOLDER", "Spill", "SpillResult", "prune", "spill_name"]

log = structlog.get_logger("toolsetd.spill")

SPILL_FOLDER = "tool-output"
_UNSAFE = re.compile(r"[^A-Za-z0-9._-]")
_MAX_NAME = 80
_OPEN_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC
# The stderr temp file is read back through the descriptor that wrote it.
_TEMP_FLAGS = os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC
_COPY_CHUNK = 1 << 20


def spill_name(call_id: str) -> str:
    """A safe file name for a client-supplied call id (never hidden, never a path)."""
    safe = _UNSAFE.sub("_", call_id)[:_MAX_NAME].lstrip(".-")
    if safe != call_id or not safe:
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
    """

    def __init__(self, workspace: Path, folder: Path, call_id: str, cap: int) -> None:
        self._workspace = workspace
        self.folder = folder
        self._call_id = call_id
        self._name: str | None = None  # named on first use: most calls never spill
        self._cap = cap
        self._fds: list[int | None] = [None, None]
        self._written = [0, 0]
        self._streaming = [False, False]
        self.failed = False

    @property
    def path(self) -> Path:
        """The spill file."""
        if self._name is None:
            self._name = spill_name(self._call_id)
        return self.folder / self._name

    @property
    def _temp(self) -> Path:
        if self._name is None:
            self._name = spill_name(self._call_id)
        return self.folder / f".{self._name}.stderr"

    # -- while draining -------------------------------------------------------------------

    def _prepare_folder(self) -> str | None:
        """None when the folder is ready, else why it cannot be used."""
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            real = os.path.realpath(self.folder)
        except OSError as exc:
            return exc.strerror or str(exc)
        root = os.path.normpath(str(self._workspace)).rstrip("/") + "/"
        return None if real.startswith(root) else "it resolves outside the workspace"

    def _fail(self, error: OSError | str) -> None:
        """Give up on this spill file; say so once (the call's result has no path)."""
        if not self.failed:
            reason = error if isinstance(error, str) else (error.strerror or str(error))
            log.warning("spill_failed", folder=str(self.folder), error=reason)
        self.failed = True

    def _open(self, which: int) -> int | None:
        if self.failed:
            return None
        unusable = self._prepare_folder()
        if unusable is not None:
            self._fail(unusable)
            return None
        try:
            if which == 0:
                fd = os.open(self.path, _OPEN_FLAGS, 0o600)
            else:
                fd = os.open(self._temp, _TEMP_FLAGS, 0o600)
        except OSError as exc:
            self._fail(exc)
            return None
        self._fds[which] = fd
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
            return SpillResult(self.path, total, capped)
        except OSError as exc:
            self._fail(exc)
            return None
        finally:
            self._close(0)
            self._close(1)
            self._unlink(self._temp)
            if self.failed:
                self._unlink(self.path)

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
            self._unlink(self.path)
        if self._streaming[1]:
            self._unlink(self._temp)

    @staticmethod
    def _unlink(path: Path) -> None:
        with contextlib.suppress(OSError):
            path.unlink()


def prune(folder: Path, *, keep: int, max_age_seconds: float, now: float | None = None) -> int:
    """Remove old spill files: older than ``max_age_seconds``, then all but the ``keep`` newest.

    Hidden temp files (calls in flight) are removed only by age. Only regular files are
    touched; errors are ignored (another call may prune at the same time).

    Returns:
        How many files were removed.
    """
    now = time.time() if now is None else now
    removed = 0
    survivors: list[tuple[float, str]] = []
    try:
        entries = list(os.scandir(folder))
    except OSError:
        return 0
    for entry in entries:
        try:
            st = entry.stat(follow_symlinks=False)
        except OSError:
            continue
        if not stat.S_ISREG(st.st_mode):
            continue
        if now - st.st_mtime > max_age_seconds:
            with contextlib.suppress(OSError):
                os.unlink(entry.path)
                removed += 1
            continue
        if not entry.name.startswith("."):
            survivors.append((st.st_mtime, entry.path))
    survivors.sort(reverse=True)
    for _, path in survivors[keep:]:
        with contextlib.suppress(OSError):
            os.unlink(path)
            removed += 1
    return removed
