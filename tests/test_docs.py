"""The docs stand on their own: no pointers outside the repository, the goals carried here."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DOCS = sorted([*(REPO / "docs").glob("*.md"), REPO / "README.md", *(REPO / "bench").glob("*.py")])


@pytest.mark.parametrize("path", DOCS, ids=lambda p: p.name)
def test_no_absolute_path_outside_the_repository(path: Path) -> None:
    """A reader of the repository cannot follow ``/work/...``: nothing may point there."""
    assert not re.search(r"/work/(shared|main|wt-)", path.read_text()), path


def test_benchmarks_carry_the_performance_goals() -> None:
    text = (REPO / "docs" / "benchmarks.md").read_text()
    goals = re.findall(r"^(\d)\. \*\*", text.split("## Goals", 1)[1], flags=re.M)
    assert goals[:8] == [str(n) for n in range(1, 9)]
    assert "spawn and reap `/bin/true`, C `posix_spawn`" in text  # the floors too
