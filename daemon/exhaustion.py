"""Errors that mean the daemon ran short of descriptors or memory, not that a peer erred.

Theory of operation
-------------------
``EMFILE``, ``ENFILE``, ``ENOBUFS`` and ``ENOMEM`` from ``accept``, ``open`` or ``pipe``
say nothing about the peer, the path or the tool: they pass when calls finish and
clients leave. So an accept loop waits and tries again (the connections in the backlog
keep waiting; stopping would leave a daemon nobody can reach), and a request that needed
the resource is told the daemon is busy (``ServerBusy``, -32008: retry later), never that
its workspace is not a directory or that something internal broke.
"""

from __future__ import annotations

import errno

__all__ = ["OUT_OF_DESCRIPTORS", "OUT_OF_RESOURCES", "out_of_resources"]

#: The ``errno`` values of a daemon short of file descriptors (its own, or the system's).
OUT_OF_DESCRIPTORS = frozenset({errno.EMFILE, errno.ENFILE})
#: The ``errno`` values of a daemon short of descriptors or memory.
OUT_OF_RESOURCES = OUT_OF_DESCRIPTORS | {errno.ENOBUFS, errno.ENOMEM}


def out_of_resources(exc: BaseException | None) -> bool:
    """Whether ``exc`` is an ``OSError`` that means the daemon ran short of a resource."""
    return isinstance(exc, OSError) and exc.errno in OUT_OF_RESOURCES
