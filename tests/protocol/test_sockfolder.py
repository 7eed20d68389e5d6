"""The socket folder rule the daemon and the clients share."""

from __future__ import annotations

import stat

import pytest
from toolsetd.protocol.sockfolder import folder_fault

DIR, LINK, FILE = stat.S_IFDIR, stat.S_IFLNK, stat.S_IFREG
ME, ROOT, OTHER = 1000, 0, 65534


@pytest.mark.parametrize(
    ("link", "target", "fault"),
    [
        ((DIR | 0o700, ME), (DIR | 0o700, ME), None),
        ((LINK | 0o777, ME), (DIR | 0o700, ME), None),  # our own link to our folder
        ((LINK | 0o777, ROOT), (DIR | 0o700, ME), None),  # a link root made
        ((LINK | 0o777, OTHER), (DIR | 0o700, ME), ("link", OTHER)),
        ((FILE | 0o600, ME), (FILE | 0o600, ME), ("not_directory", 0)),
        ((DIR | 0o700, OTHER), (DIR | 0o700, OTHER), ("owner", OTHER)),
        ((DIR | 0o1777, ROOT), (DIR | 0o1777, ROOT), ("owner", ROOT)),
        ((DIR | 0o770, ME), (DIR | 0o770, ME), ("writable", 0o770)),
        ((DIR | 0o702, ME), (DIR | 0o702, ME), ("writable", 0o702)),
        ((DIR | 0o755, ME), (DIR | 0o755, ME), None),  # readable by others is no risk
    ],
)
def test_sockfolder_fault(
    link: tuple[int, int], target: tuple[int, int], fault: tuple[str, int] | None
) -> None:
    assert folder_fault(link[0], link[1], target[0], target[1], ME) == fault
