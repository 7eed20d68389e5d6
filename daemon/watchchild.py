"""The watch process's own code: the child side of ``watchproc``.

The daemon never starts this module by name. ``watchproc`` reads its source and
``pdeath``'s once, when the daemon imports it, and writes them to each watch process,
which runs them as the modules of these names (``watchproc._BOOTSTRAP``), without the
``toolsetd.daemon`` package: the process runs the code the daemon loaded, whatever an
upgrade put on disk since, and imports only what its job needs. So this module imports
the standard library, ``pdeath`` (standard library only, made first) and, once the
request came, watchfiles: nothing else of toolsetd, nor anything its package imports.
"""

from __future__ import annotations

import contextlib
import json
import select
import signal
import sys
from collections.abc import Callable
from typing import Any

from .pdeath import die_with

__all__ = ["CHUNK", "main"]

#: Changes written to one line at most.
CHUNK = 1000


class _StdinEnded:
    """The watch's stop event: set once the daemon closed stdin (or died). Its first look,
    made by the watcher once it is watching, says ``ready``."""

    def __init__(self, say: Callable[[dict[str, Any]], None]) -> None:
        self._say = say
        self._ready = False

    def is_set(self) -> bool:
        if not self._ready:
            self._ready = True
            self._say({"ready": True})
        return bool(select.select([sys.stdin.fileno()], [], [], 0)[0])


def main() -> None:
    """The watch process: watch what the request names, a line per batch, until EOF."""
    die_with(int(sys.argv[1]))
    for signum in (signal.SIGINT, signal.SIGHUP):
        signal.signal(signum, signal.SIG_IGN)
    line = sys.stdin.buffer.readline()
    if not line:
        return
    request = json.loads(line)
    out = sys.stdout

    def say(message: dict[str, Any]) -> None:
        out.write(json.dumps(message) + "\n")
        out.flush()

    import watchfiles

    try:
        for batch in watchfiles.watch(
            *request["paths"],
            watch_filter=None,
            debounce=request["debounce"],
            step=request["step"],
            stop_event=_StdinEnded(say),
            rust_timeout=request["timeout"],
            yield_on_timeout=False,
            raise_interrupt=False,
            recursive=request["recursive"],
        ):
            changes = [[int(change), path] for change, path in batch]
            for start in range(0, len(changes), CHUNK):
                chunk: dict[str, Any] = {"changes": changes[start : start + CHUNK]}
                if start + CHUNK < len(changes):
                    chunk["more"] = True
                say(chunk)
    except BrokenPipeError:
        return
    except Exception as exc:
        with contextlib.suppress(BrokenPipeError):
            say({"error": type(exc).__name__, "message": str(exc)})
        sys.exit(1)
