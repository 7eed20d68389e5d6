"""Review checks of the confinement commits (review-confine): each test pins a finding."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

BWRAP = shutil.which("bwrap")


@pytest.mark.xfail(reason="review-confine finding 1: a hidden path under a writable bind")
def test_hidden_path_below_a_writable_bind_stays_hidden_for_the_next_call() -> None:
    """A call that may write an ancestor of a hidden path renames that ancestor; the next
    call, with no approval at all, reads the file the operator hid (here a ``hide`` entry
    below an approved outside path; likewise ``~/.ssh`` linked into the workspace, hidden
    where it leads since f69b835, or the Crystal home under a workspace that is ``~``)."""
    import subprocess
    import tempfile

    from toolsetd.daemon.sandbox import Profile, SandboxPlan, bwrap_argv

    if BWRAP is None:
        pytest.skip("bubblewrap is not installed")
    # Not under /tmp: the sandbox's /tmp is its own, which would hide everything there.
    root = Path(os.path.realpath(tempfile.mkdtemp(dir="/var/tmp")))
    home = root / "home"
    ws, config = home / "ws", home / ".config"
    ws.mkdir(parents=True)
    (config / "gh").mkdir(parents=True)
    (config / "gh" / "hosts.yml").write_text("TOKEN\n")
    hidden = (str(home / ".ssh"), str(config / "gh" / "hosts.yml"))

    def call(writable: tuple[str, ...], script: str) -> subprocess.CompletedProcess[str]:
        plan = SandboxPlan(Profile.WORKSPACE_WRITE, False, (), writable, hidden, str(ws))
        argv = [*bwrap_argv(BWRAP, plan), "sh", "-c", script]  # type: ignore[arg-type]
        return subprocess.run(  # noqa: TID251 -- a test of bwrap's argv
            argv, capture_output=True, text=True, check=False
        )

    first = call(
        (str(ws), str(config)),  # an approved outside-workspace folder
        f"mv {config}/gh {config}/gh2 && mkdir {config}/gh",
    )
    assert first.returncode == 0, first.stderr
    second = call((str(ws),), f"cat {config}/gh2/hosts.yml")
    shutil.rmtree(root)
    assert "TOKEN" not in second.stdout
