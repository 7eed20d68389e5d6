"""Which subcommand a ``toolsetctl`` command line names, with no imports.

``__main__`` asks this before anything else is imported (``toolsetctl mcp`` goes to the
stdlib-only pump), and ``parser`` asks it to build only the subcommand named. Before
that, ``__main__`` opens the standard descriptors it was started without
(``open_standard_streams``). ``to_devnull`` points a stream that cannot be written at
``/dev/null`` (``render`` and ``progress`` use it). ``option_meant`` is the hint for an
option that is not one, for ``parser`` and the pump alike.
"""

from __future__ import annotations

import io
import os
import sys

TYPE_CHECKING = False  # not typing's: importing typing is a share of the start-up
if TYPE_CHECKING:
    from typing import Any, TextIO

__all__ = [
    "absolute_path",
    "command_in",
    "open_standard_streams",
    "option_meant",
    "to_devnull",
    "utf8_output",
    "wait_ready",
    "waiting_output",
    "wire_text",
]

#: Global options that take a value (so their value is not taken for the command).
_TAKES_VALUE = frozenset({"--socket", "--format", "--workspace", "--home"})


def command_in(argv: list[str]) -> str | None:
    """The subcommand ``argv`` names (the first word that is not an option or its value)."""
    skip = False
    for arg in argv:
        if skip:
            skip = False
        elif arg in _TAKES_VALUE:
            skip = True
        elif arg == "--" or not arg.startswith("-"):
            return arg
    return None


def open_standard_streams() -> None:
    """Open ``/dev/null`` on any of descriptors 0, 1 and 2 ``toolsetctl`` was started without.

    A CI step or a supervisor may run it with one closed (``toolsetctl invoke build >&-``,
    ``toolsetctl mcp <&-``). Python then has ``sys.stdout`` (or ``stdin``, ``stderr``)
    ``None``, and the connection to the daemon takes the free number: every command ended
    in an internal error (exit 9) instead of its outcome, and ``mcp`` read its own socket
    as its host's input (it never exited) or wrote the daemon's answers back into it. A
    closed stdout is one nobody reads (docs/cli.md: the outcome is the exit code), a closed
    stdin is an empty one. (``daemon/exhaustion.py`` does the same for ``toolsetd``, whose
    modules the client does not import.)
    """
    for fd in (0, 1, 2):
        try:
            os.fstat(fd)
        except OSError:
            null = os.open(os.devnull, os.O_RDWR)  # the lowest free number: fd itself
            if null != fd:
                os.dup2(null, fd)
                os.close(null)
            os.set_inheritable(fd, True)  # a standard one: children get it (os.open's is not)
    if sys.stdin is None:
        sys.stdin = io.TextIOWrapper(io.FileIO(0, "r", closefd=False))
    if sys.stdout is None:
        sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), write_through=True)
    if sys.stderr is None:
        sys.stderr = io.TextIOWrapper(
            io.FileIO(2, "w", closefd=False), errors="backslashreplace", write_through=True
        )


def to_devnull(stream: TextIO) -> None:
    """Point a stream's file descriptor at ``/dev/null`` (what it still buffers goes there)."""
    try:
        fd = stream.fileno()
        devnull = os.open(os.devnull, os.O_WRONLY)
    except (AttributeError, ValueError, OSError):
        return  # not a file (a test's StringIO): nothing to redirect
    try:
        os.dup2(devnull, fd)
    except OSError:
        pass
    finally:
        os.close(devnull)


def waiting_output() -> None:
    """Make stdout and stderr wait for their reader when their descriptor is non-blocking.

    A CI runner may start ``toolsetctl`` with a non-blocking descriptor (a Node parent's
    own stdout, inherited). Once the pipe was full, Python's writer kept what fitted,
    dropped the rest without an error, and the command exited 0 with its output cut at
    64 KiB. Such a stream is rebuilt over ``_WaitingWriter``, which waits until the
    descriptor takes more, as a blocking one would. The flag is left as it is: the file
    description is shared with the process that set it.
    """
    for name, fd in (("stdout", 1), ("stderr", 2)):
        stream = getattr(sys, name)
        try:
            if os.get_blocking(fd) or stream.fileno() != fd:
                continue
        except (AttributeError, OSError, ValueError):
            continue
        stream.flush()
        setattr(
            sys,
            name,
            io.TextIOWrapper(
                io.BufferedWriter(_WaitingWriter(fd)),
                encoding=stream.encoding,
                errors=stream.errors,
                line_buffering=stream.line_buffering,
                write_through=stream.write_through,
            ),
        )


class _WaitingWriter(io.RawIOBase):
    """A non-blocking descriptor written as a blocking one: ``write`` waits until it takes
    some of the data. The descriptor stays open when this object is closed."""

    def __init__(self, fd: int) -> None:
        super().__init__()
        self._fd = fd

    def writable(self) -> bool:
        return True

    def fileno(self) -> int:
        return self._fd

    def isatty(self) -> bool:
        return os.isatty(self._fd)

    def write(self, data: Any) -> int:
        while True:
            try:
                return os.write(self._fd, data)
            except BlockingIOError:  # full: wait until it takes more
                wait_ready(self._fd, write=True)


def wait_ready(fd: int, *, write: bool, timeout: float | None = None) -> bool:
    """Wait until a non-blocking descriptor can be read (or, with ``write``, written): its
    EAGAIN is no end of input and no failed output (a CI runner or an MCP host may hand
    us such a descriptor). Returns whether it can, which only a ``timeout`` (seconds; 0:
    not at all) makes False."""
    import select  # only for a non-blocking descriptor

    read, written, _ = select.select([] if write else [fd], [fd] if write else [], [], timeout)
    return bool(written if write else read)


def absolute_path(path: str) -> str:
    """``path`` made absolute against the current folder, its ``..`` left for the kernel.

    ``os.path.abspath`` folds ``..`` away as text: ``/a/link/..`` becomes ``/a``, where the
    kernel (and the daemon, which resolves the workspace it is sent) climbs from the link's
    target. A folder named so would be another workspace here than over the wire or HTTP.
    Only ``.`` and empty components (``//``, a trailing ``/``) are dropped: they name
    nothing else to the kernel either.
    """
    joined = path if os.path.isabs(path) else os.path.join(os.getcwd(), path)
    return "/" + "/".join(part for part in joined.split("/") if part not in ("", "."))


def wire_text(value: str) -> str:
    """A value from the command line or the file system as the daemon must get it: the
    bytes it was given as, read as UTF-8.

    Python decodes argv and paths with the locale's encoding. Under a locale that is not
    UTF-8 (``LC_ALL=C`` with Python's UTF-8 mode off, a Latin-1 locale), ``Zoë`` typed in
    UTF-8 became lone surrogates (refused as "not valid UTF-8") or ``ZoÃ«`` (sent as
    such). Bytes that are not UTF-8 stay lone surrogates, which the wire refuses.
    """
    try:
        data = os.fsencode(value)
    except UnicodeEncodeError:  # not from the command line or the file system
        return value
    return data.decode("utf-8", "surrogateescape")


def utf8_output() -> None:
    """Make stdout (and stderr) print whatever the daemon sent, in any locale.

    Names, descriptions and a tool's output come as UTF-8 JSON. Under a locale whose
    encoding cannot hold them (``LANG=en_US.ISO-8859-1``, ``PYTHONIOENCODING=ascii``, a C
    locale with coercion off), printing ``café ✓`` raised ``UnicodeEncodeError``: the call's
    output was lost and ``toolsetctl`` exited 2 blaming the current folder's name. Into a
    file or a pipe the text now goes as UTF-8, byte for byte as the daemon sent it; on a
    terminal it stays in the terminal's encoding, a character it lacks shown as its
    ``\\uXXXX`` escape (``_escape``), which ``--format json`` reads as the same character.
    """
    import codecs  # loaded at every start: free

    codecs.register_error(_ESCAPE, _escape)
    for stream in (sys.stdout, sys.stderr):
        encoding = (getattr(stream, "encoding", None) or "").lower().replace("-", "")
        if encoding in ("utf8", "utf_8"):
            continue
        try:
            if stream.isatty():
                stream.reconfigure(errors=_ESCAPE)  # type: ignore[union-attr]
            else:
                stream.reconfigure(  # type: ignore[union-attr]
                    encoding="utf-8", errors="backslashreplace"
                )
        except (AttributeError, OSError, ValueError):
            pass  # not a text file of ours: left as it is


#: The error handler ``utf8_output`` gives a terminal whose encoding lacks a character.
_ESCAPE = "toolsetctl.escape"


def _escape(error: UnicodeError) -> tuple[str, int]:
    """The characters a terminal's encoding lacks, as ``\\uXXXX`` (UTF-16 pairs past U+FFFF).

    Python's ``backslashreplace`` wrote ``\\xe9`` for ``é`` and ``\\U0001f600`` past
    U+FFFF: escapes JSON does not have, so ``--format json`` on such a terminal printed a
    document no JSON reader takes. These escapes read the same in a table and are JSON.
    """
    if not isinstance(error, UnicodeEncodeError):
        raise error
    escapes = []
    for char in error.object[error.start : error.end]:
        code = ord(char)
        if code > 0xFFFF:
            code -= 0x10000
            escapes.append(f"\\u{0xD800 | code >> 10:04x}\\u{0xDC00 | code & 0x3FF:04x}")
        else:
            escapes.append(f"\\u{code:04x}")
    return "".join(escapes), error.end


#: Output flags other tools have, and the ``--format`` that says the same here.
FORMAT_FLAGS = {"--json": "json", "--jsonl": "jsonl", "--text": "text", "--table": "table"}


def option_meant(word: str, known: frozenset[str] | set[str], *, formats: bool = True) -> str:
    """The hint for ``word``, an option that is not among ``known``: "" when none fits.

    Options are spelled in full, so an abbreviation (``--arg '{}'`` for ``--args``) and
    another tool's flag (``--json``) were an "unrecognized argument" error that named no
    way out. ``formats``: also point ``--json`` and the like at ``--format``.
    """
    flag = word.split("=", 1)[0]
    if not flag.startswith("--") or flag in known:
        return ""
    if formats and flag in FORMAT_FLAGS:
        return f"for {flag}, give --format {FORMAT_FLAGS[flag]}"
    longer = sorted(k for k in known if k.startswith(flag))
    if len(longer) == 1:
        return f"did you mean {longer[0]}? (options are spelled in full)"
    import difflib  # only on the way out

    close = difflib.get_close_matches(flag, sorted(known), 1, 0.8)
    return f"did you mean {close[0]}?" if close else ""
