"""The daemon's own helper processes end with it (``PR_SET_PDEATHSIG``).

The watch process runs this module from its source, sent by the daemon, without the
package (``watchproc._MODULES``): it imports the standard library only.
"""

from __future__ import annotations

import os
import signal

__all__ = ["die_with"]

_PR_SET_PDEATHSIG = 1


def die_with(parent: int) -> None:
    """Have the kernel kill this process when the daemon (``parent``) dies, however it
    dies; called first thing in a helper process (the check process, the watch process)."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent:  # it died before the call above
        os._exit(0)
