"""toolsetd daemon.

Importing the package first imports structlog with ``rich`` hidden: structlog's ``dev``
and ``tracebacks`` modules import rich (~100 ms, most of it ``rich.pretty`` and
``rich.traceback``) whenever it is installed, even for JSON logs. toolsetd does not depend
on rich, but an environment it is installed into may have it. The daemon never renders
with rich: its console format prints plain tracebacks. Everything else may import rich as
usual afterwards.

The import runs under a promoting ``GcPause``: structlog and asyncio make ~10,000
long-lived objects, and the young collections they would start free none of them (see
``__main__``).
"""

from __future__ import annotations

import sys

from .gcpause import GcPause


def _import_structlog_without_rich() -> None:
    if "structlog" in sys.modules or "rich" in sys.modules:
        return  # already imported (rich too, or by someone who wants it): nothing to save
    sys.modules["rich"] = None  # type: ignore[assignment]  # None makes `import rich` fail
    try:
        with GcPause(promote=True):  # long-lived objects only (see ``__main__``)
            import structlog  # noqa: F401 - imported for its side effect on sys.modules
    finally:
        del sys.modules["rich"]


_import_structlog_without_rich()
