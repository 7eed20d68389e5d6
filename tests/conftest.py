"""Shared fixtures: the anyio backend for every async test."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def anyio_backend() -> str:
    """Run async tests on asyncio, the backend the daemon runs on."""
    return "asyncio"
