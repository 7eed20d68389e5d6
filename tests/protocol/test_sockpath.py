"""The default socket path rule the daemon and the clients share."""

from __future__ import annotations

import pytest
from toolsetd.protocol.sockpath import default_socket_path, shared_tmp_folder, socket_path


def _expand(path: str) -> str:
    """A stand-in for ``os.path.expanduser`` with a fixed home."""
    return "/home/me" + path[1:] if path.startswith("~") else path


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({"TOOLSETD_SOCKET": "/srv/t.sock", "XDG_RUNTIME_DIR": "/run/user/1"}, "/srv/t.sock"),
        ({"TOOLSETD_SOCKET": "~/t.sock"}, "/home/me/t.sock"),
        ({"XDG_RUNTIME_DIR": "/run/user/1"}, "/run/user/1/toolsetd/toolsetd.sock"),
        ({"XDG_RUNTIME_DIR": "/run/user/1/"}, "/run/user/1/toolsetd/toolsetd.sock"),
        (
            {"TOOLSETD_SOCKET": "", "XDG_RUNTIME_DIR": "/run/user/1"},
            "/run/user/1/toolsetd/toolsetd.sock",
        ),
        ({"XDG_RUNTIME_DIR": "relative/dir"}, "/tmp/toolsetd-1000/toolsetd.sock"),
        ({"XDG_RUNTIME_DIR": "~/run"}, "/tmp/toolsetd-1000/toolsetd.sock"),
        ({}, "/tmp/toolsetd-1000/toolsetd.sock"),
    ],
)
def test_default_socket_path(env: dict[str, str], expected: str) -> None:
    """TOOLSETD_SOCKET (``~`` expanded) wins, then an absolute XDG_RUNTIME_DIR, then /tmp."""
    assert default_socket_path(env, 1000, _expand) == expected
    assert shared_tmp_folder(1000) == "/tmp/toolsetd-1000"


@pytest.mark.parametrize(
    ("option", "expected"),
    [
        ("~/x.sock", "/home/me/x.sock"),  # --socket=~/x.sock: one word, no shell expands it
        ("/srv/x.sock", "/srv/x.sock"),
        ("rel/x.sock", "rel/x.sock"),
        (None, "/home/me/t.sock"),
        ("", "/home/me/t.sock"),
    ],
)
def test_socket_option_is_expanded_as_the_environment_is(
    option: str | None, expected: str
) -> None:
    """``--socket`` wins over TOOLSETD_SOCKET, with its leading ``~`` expanded the same way."""
    assert socket_path(option, {"TOOLSETD_SOCKET": "~/t.sock"}, 1000, _expand) == expected
