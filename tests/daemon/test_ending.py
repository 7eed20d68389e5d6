"""The /proc readings the call's end relies on (``daemon/ending.py``)."""

from __future__ import annotations

import os
import subprocess
import time

from toolsetd.daemon import ending


def test_children_and_the_proc_pass_find_a_child() -> None:
    """``_children`` reads the kernel's list; the pass over ``/proc`` it falls back on
    (a kernel without CONFIG_PROC_CHILDREN) finds the same child."""
    child = subprocess.Popen(["/bin/sleep", "60"])
    try:
        assert child.pid in ending._children(os.getpid())
        assert child.pid in ending._with_stat_field(ending._PPID, os.getpid())
    finally:
        child.kill()
        child.wait()


def test_members_but_leader_are_the_groups_others() -> None:
    """A group's members other than its leader, read from ``/proc``."""
    leader = subprocess.Popen(
        ["/bin/sh", "-c", "sleep 60 & echo $!; wait"],
        stdout=subprocess.PIPE, start_new_session=True, text=True,
    )
    try:
        assert leader.stdout is not None
        member = int(leader.stdout.readline())
        deadline = time.monotonic() + 10  # a hang guard: the member is there at once
        while member not in ending._members_but_leader(leader.pid):
            assert time.monotonic() < deadline, "the member was not found"
            time.sleep(0.01)
        assert leader.pid not in ending._members_but_leader(leader.pid)
    finally:
        os.killpg(leader.pid, 9)
        leader.wait()
        assert leader.stdout is not None
        leader.stdout.close()
