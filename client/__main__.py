"""``python -m toolsetd.client`` and the ``toolsetctl`` entry point."""

from __future__ import annotations

import sys


def main() -> None:
    """Run ``toolsetctl`` with ``sys.argv`` and exit with its code."""
    from .cli import run

    sys.exit(run())


if __name__ == "__main__":
    main()
