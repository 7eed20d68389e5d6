"""``parse_mountinfo``: the one reader of ``/proc/<pid>/mountinfo`` lines."""

from __future__ import annotations

from toolsetd.daemon.mountinfo import parse_mountinfo

# Two real lines' shapes: optional fields before " - ", escapes in root and point, a
# U+2028 and a \x1c that only "\n" and " " must not split at.
_TEXT = (
    "36 35 98:0 /mnt1 /mnt/a\\040b\\134c rw,noatime master:1 - ext3 /dev/root rw\n"
    "37 35 0:31 / /sys/fs/cgroup/unified rw,nosuid shared:9 - cgroup2 cgroup2 rw\n"
    "38 35 0:40 / /tmp/ws\u2028x\x1cy ro,relatime - tmpfs tmpfs rw\n"
    "\n"
    "garbage line\n"
)


def test_mountinfo_fields_escapes_and_separators() -> None:
    assert parse_mountinfo(_TEXT) == [
        ("98:0", "/mnt1", "/mnt/a b\\c", "rw,noatime", "ext3"),
        ("0:31", "/", "/sys/fs/cgroup/unified", "rw,nosuid", "cgroup2"),
        ("0:40", "/", "/tmp/ws\u2028x\x1cy", "ro,relatime", "tmpfs"),
    ]


def test_mountinfo_of_this_process_names_the_root() -> None:
    with open("/proc/self/mountinfo", encoding="utf-8", errors="surrogateescape") as f:
        points = [point for _, _, point, _, _ in parse_mountinfo(f.read())]
    assert "/" in points
