"""How hard the property tests try: in full under ``make test``, a tenth under ``make test-fast``.

``make test-fast`` sets ``TOOLSETD_TESTS=fast`` for the edit-run loop; CI runs ``make
test``, where every property test runs its full number of examples. The ``fast``
hypothesis profile does the same for the tests that keep hypothesis's default count.
"""

from __future__ import annotations

import os

FAST = os.environ.get("TOOLSETD_TESTS") == "fast"


def examples(full: int) -> int:
    """The examples a property test runs: ``full``, or a tenth of it (at least 20) when fast."""
    return max(20, full // 10) if FAST else full
