"""Tests for toolsetd.daemon.peercred with real sockets and, as root, a real other user."""

from __future__ import annotations

import os
import pwd
import socket
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from toolsetd.daemon.peercred import (
    PeerCred,
    PeerPolicy,
    peer_credentials,
    proc_supplementary_groups,
)


@pytest.fixture
def listener() -> Iterator[tuple[socket.socket, str]]:
    """A listening Unix socket that any user may connect to, and its path."""
    with tempfile.TemporaryDirectory() as folder:
        os.chmod(folder, 0o755)  # the test's "nobody" client must reach it
        path = os.path.join(folder, "toolsetd.sock")
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.bind(path)
            os.chmod(path, 0o777)  # idem
            sock.listen()
            sock.setblocking(False)
            yield sock, path


def test_peer_credentials_socketpair_is_ourselves() -> None:
    """A socketpair's peer is this very process: our pid, euid and egid."""
    left, right = socket.socketpair()
    with left, right:
        cred = peer_credentials(left)
    assert (cred.pid, cred.uid, cred.gid) == (os.getpid(), os.geteuid(), os.getegid())
    if cred.groups is not None:
        assert cred.groups == frozenset(os.getgroups())


def test_peer_credentials_connected_client(listener) -> None:
    """The accepted end of a real connection reports the connecting process."""
    sock, path = listener
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as client:
        client.connect(path)
        conn, _ = sock.accept()
        with conn:
            cred = peer_credentials(conn)
    assert (cred.pid, cred.uid, cred.gid) == (os.getpid(), os.geteuid(), os.getegid())


def test_peer_credentials_unconnected_socket_raises() -> None:
    """An unconnected socket has no peer: ENOTCONN, not made-up credentials."""
    with (
        socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock,
        pytest.raises(OSError, match="no connected peer"),
    ):
        peer_credentials(sock)


def test_peer_policy_default_allows_own_uid_and_root() -> None:
    """The default policy allows our own euid and root, and refuses anyone else."""
    policy = PeerPolicy.default()
    assert policy.allowed_uids == frozenset({os.geteuid(), 0})
    assert policy.allowed_gids == frozenset()
    assert policy.allows(PeerCred(pid=1, uid=os.geteuid(), gid=12345))
    assert policy.allows(PeerCred(pid=1, uid=0, gid=0))
    other = max(os.geteuid(), 0) + 54321
    # Even sharing our primary gid does not help when no group is configured.
    assert not policy.allows(PeerCred(pid=1, uid=other, gid=os.getegid(), groups=frozenset()))


def test_peer_policy_group_membership() -> None:
    """A configured gid admits peers by primary gid or by supplementary group."""
    policy = PeerPolicy(allowed_uids=frozenset({1000}), allowed_gids=frozenset({4242}))
    assert policy.allows(PeerCred(pid=1, uid=2000, gid=4242, groups=frozenset()))
    assert policy.allows(PeerCred(pid=1, uid=2000, gid=2000, groups=frozenset({7, 4242})))
    assert not policy.allows(PeerCred(pid=1, uid=2000, gid=2000, groups=frozenset({7})))


def _fake_proc(root: Path, pid: int, uid_line: str, groups_line: str) -> Path:
    """Write a minimal /proc/<pid>/status under ``root``."""
    (root / str(pid)).mkdir()
    (root / str(pid) / "status").write_text(
        f"Name:\tclient\nPid:\t{pid}\nUid:\t{uid_line}\nGid:\t2000\t2000\t2000\t2000\n"
        f"Groups:\t{groups_line}\n"
    )
    return root


def test_peer_policy_proc_fallback_reads_groups(tmp_path: Path) -> None:
    """Without SO_PEERGROUPS data the Groups: line of /proc/<pid>/status decides."""
    proc = _fake_proc(tmp_path, 77, "2000\t2000\t2000\t2000", "7 4242 9")
    cred = PeerCred(pid=77, uid=2000, gid=2000)
    assert proc_supplementary_groups(cred, proc) == frozenset({7, 4242, 9})
    policy = PeerPolicy(allowed_uids=frozenset(), allowed_gids=frozenset({4242}))
    assert policy.allows(cred, proc)


def test_peer_policy_proc_fallback_distrusts_changed_process(tmp_path: Path) -> None:
    """If /proc/<pid> now belongs to another uid (pid reused), its groups are ignored."""
    proc = _fake_proc(tmp_path, 78, "3000\t3000\t3000\t3000", "4242")
    cred = PeerCred(pid=78, uid=2000, gid=2000)
    assert proc_supplementary_groups(cred, proc) == frozenset()
    policy = PeerPolicy(allowed_uids=frozenset(), allowed_gids=frozenset({4242}))
    assert not policy.allows(cred, proc)
    # A vanished process has no groups either.
    assert proc_supplementary_groups(PeerCred(pid=79, uid=2000, gid=2000), proc) == frozenset()


def _connect_as(path: str, uid: int, gid: int, extra_gid: int) -> None:
    """Fork a child that drops to ``uid``/``gid`` (plus ``extra_gid``) and connects to ``path``.

    The connection completes in the listener's backlog, so the child can exit before we
    accept; the kernel keeps its credentials as they were at connect().
    """
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child, measured by its exit status
        status = 1
        try:
            os.setgroups([extra_gid])
            os.setgid(gid)
            os.setuid(uid)
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as client:
                client.connect(path)
                client.sendall(b"hi")
            status = 0
        finally:
            os._exit(status)
    _, wait_status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(wait_status) == 0


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run a client as nobody")
def test_peer_credentials_of_nobody_refused_by_default(listener) -> None:
    """A client running as nobody is seen as nobody, refused by default, admitted by group."""
    try:
        nobody = pwd.getpwnam("nobody")
    except KeyError:
        pytest.skip("no 'nobody' user on this machine")
    sock, path = listener
    extra_gid = 54321
    _connect_as(path, nobody.pw_uid, nobody.pw_gid, extra_gid)
    conn, _ = sock.accept()
    with conn:
        cred = peer_credentials(conn)
    assert cred.uid == nobody.pw_uid
    assert cred.gid == nobody.pw_gid
    assert cred.pid != os.getpid()
    assert not PeerPolicy.default().allows(cred)
    assert PeerPolicy(frozenset({0}), frozenset({nobody.pw_gid})).allows(cred)
    # The supplementary group comes from SO_PEERGROUPS: the client has exited, so the
    # /proc fallback could not have supplied it.
    assert cred.groups == frozenset({extra_gid})
    assert PeerPolicy(frozenset({0}), frozenset({extra_gid})).allows(cred)
