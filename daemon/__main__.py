"""``python -m toolsetd.daemon`` (and the ``toolsetd`` script): run the daemon.

The daemon's imports run under a promoting ``GcPause``, as a catalog build does
(``gcpause.py``): they make some 20,000 objects that live as long as the process (modules,
classes, functions), and with the collector on, each 700 of them start a young collection
that traverses them and can free none of them (~5 ms of a start here, about 50 young and a
few middle collections). The package's own ``__init__`` holds one around structlog.

Before them, the install is hashed (``install.at_start``), so that an upgrade landing
while they load is told from the daemon's code.
"""

from __future__ import annotations

import contextlib
import sys

from . import install
from .gcpause import GcPause

# What the daemon runs, before its modules load (install.at_start); what cannot be read
# now is looked at again at the start proper, which then says so.
with contextlib.suppress(OSError):
    install.at_start()
with GcPause(promote=True):
    from .app import main

if __name__ == "__main__":
    sys.exit(main())
