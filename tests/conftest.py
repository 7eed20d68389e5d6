"""Shared fixtures: the anyio backend for every async test, and a private cache folder.

Under ``make test-fast`` the property tests run the ``fast`` profile (``budget.py``).
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
from hypothesis import settings

from .budget import FAST

settings.register_profile("fast", max_examples=20)
if FAST:
    settings.load_profile("fast")


@pytest.fixture(scope="session")
def anyio_backend() -> str:
    """Run async tests on asyncio, the backend the daemon runs on."""
    return "asyncio"


@pytest.fixture(scope="session", autouse=True)
def _private_cache_home(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Every daemon a test starts keeps its set cache here, never in the user's ~/.cache."""
    old = os.environ.get("XDG_CACHE_HOME")
    os.environ["XDG_CACHE_HOME"] = str(tmp_path_factory.mktemp("xdg-cache"))
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("XDG_CACHE_HOME", None)
        else:
            os.environ["XDG_CACHE_HOME"] = old
