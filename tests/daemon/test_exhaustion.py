"""exhaustion: whether the daemon's allocations can fail, told at start."""

from __future__ import annotations

import contextlib
import resource
from collections.abc import Iterator
from pathlib import Path

import pytest
from toolsetd.daemon.exhaustion import allocations_can_fail


@contextlib.contextmanager
def _soft_limits(**soft: int) -> Iterator[None]:
    """Inside, this process's soft limits (``AS``, ``DATA``) are those given, the others'
    unlimited (a test run under ``prlimit`` may have set them); then as they were."""
    kept = {name: resource.getrlimit(getattr(resource, f"RLIMIT_{name}")) for name in ("AS", "DATA")}
    try:
        for name, (_, hard) in kept.items():
            value = soft.get(name, resource.RLIM_INFINITY)
            resource.setrlimit(getattr(resource, f"RLIMIT_{name}"), (value, hard))
        yield
    finally:
        for name, limits in kept.items():
            resource.setrlimit(getattr(resource, f"RLIMIT_{name}"), limits)


@pytest.fixture
def overcommit(tmp_path: Path) -> Path:
    """A stand-in for ``/proc/sys/vm/overcommit_memory``, at the kernel's default."""
    setting = tmp_path / "overcommit_memory"
    setting.write_text("0\n")
    return setting


def _hard_is_unlimited() -> bool:
    return all(resource.getrlimit(getattr(resource, f"RLIMIT_{name}"))[1] == resource.RLIM_INFINITY
               for name in ("AS", "DATA"))


@pytest.mark.skipif(not _hard_is_unlimited(), reason="a hard memory limit: no soft one can be lifted")
def test_allocations_fail_only_under_a_limit_or_strict_overcommit(overcommit: Path) -> None:
    """An address-space or data limit, or the kernel's strict accounting, is why; with
    none of them, only the OOM killer stops the daemon (its allocations never fail)."""
    terabyte = 1 << 40
    with _soft_limits():
        assert allocations_can_fail(overcommit) is None
        overcommit.write_text("1\n")  # always overcommit: allocations never fail either
        assert allocations_can_fail(overcommit) is None
        overcommit.write_text("2\n")
        assert allocations_can_fail(overcommit) == "vm.overcommit_memory=2"
        assert allocations_can_fail(overcommit.with_name("absent")) is None  # no procfs
    overcommit.write_text("0\n")
    with _soft_limits(AS=terabyte):
        assert allocations_can_fail(overcommit) == "RLIMIT_AS"
    with _soft_limits(DATA=terabyte):
        assert allocations_can_fail(overcommit) == "RLIMIT_DATA"
