"""Tests for toolsetd.daemon.httpguard and tcppeer: binds, Host/Origin, tokens, TCP peer uids."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from toolsetd.daemon.httpguard import (
    ListenAddress,
    ListenError,
    TokenFileError,
    check_host_origin,
    check_token,
    parse_listen,
    peer_refusal,
    read_token_file,
)
from toolsetd.daemon.peercred import PeerCred, PeerPolicy
from toolsetd.daemon.tcppeer import (
    TcpPeer,
    peer_from_proc,
    peer_from_sock_diag,
    tcp_peer,
    tcp_peer_credentials,
)

V4 = ListenAddress(socket.AF_INET, "127.0.0.1", 8765)


@pytest.mark.parametrize(
    ("text", "family", "host", "port"),
    [
        ("127.0.0.1:8765", socket.AF_INET, "127.0.0.1", 8765),
        ("127.1.2.3:0", socket.AF_INET, "127.1.2.3", 0),
        ("[::1]:9000", socket.AF_INET6, "::1", 9000),
        ("localhost:80", socket.AF_INET, "127.0.0.1", 80),
    ],
)
def test_parse_listen_accepts_loopback(text: str, family: int, host: str, port: int) -> None:
    """Loopback addresses (127/8, ::1, localhost) are accepted as given."""
    assert parse_listen(text) == ListenAddress(family, host, port)


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("0.0.0.0:8765", "not a loopback address"),
        ("[::]:8765", "not a loopback address"),
        ("10.0.0.1:80", "not a loopback address"),
        ("example.com:80", "not an IP address"),
        ("127.0.0.1", "expected HOST:PORT"),
        ("127.0.0.1:http", "the port must be a number"),
        ("127.0.0.1:70000", "the port must be a number"),
        ("::1:80", "in brackets"),
    ],
)
def test_parse_listen_refuses_with_reason(text: str, needle: str) -> None:
    """Anything but a loopback HOST:PORT is refused, and the message says why."""
    with pytest.raises(ListenError, match=needle):
        parse_listen(text)


@pytest.mark.parametrize(
    ("host", "origin", "status"),
    [
        ("127.0.0.1:8765", None, None),
        ("localhost:8765", "http://localhost:8765", None),
        ("LOCALHOST", "https://127.0.0.1", None),
        ("[::1]:8765", "http://[::1]:8765", None),
        (None, None, 400),
        ("evil.example.com", None, 421),
        ("evil.example.com:8765", None, 421),
        ("127.0.0.1:9999", None, 421),
        ("127.0.0.1:8765", "http://evil.example.com", 403),
        ("127.0.0.1:8765", "null", 403),
        ("127.0.0.1:8765", "file://localhost", 403),
        # An Origin whose authority cannot be read (an IPv6 literal never closed, a
        # bracketed name): urlsplit raised, and the request was a traceback in the log
        # and a connection closed unanswered (the MCP endpoint and /metrics both).
        ("127.0.0.1:8765", "http://[::1", 403),
        ("127.0.0.1:8765", "http://[localhost]", 403),
        # RFC 9112 3.2: a Host that is no host[:port] is 400 (a MUST), not 421: two
        # values in one line, a space, a port that is no number, userinfo, a bracket.
        ("127.0.0.1:8765, evil.example.com", None, 400),
        ("127.0.0.1 evil.example.com", None, 400),
        ("127.0.0.1:87a5", None, 400),
        ("127.0.0.1:8765:1", None, 400),
        ("evil@127.0.0.1:8765", None, 400),
        ("[::1", None, 400),
        ("127.0.0.1/x", None, 400),
    ],
)
def test_check_host_origin(host: str | None, origin: str | None, status: int | None) -> None:
    """Only loopback Host (with our port) and loopback Origin pass (DNS rebinding)."""
    refused = check_host_origin(host, origin, V4, 8765)
    assert (refused[0] if refused else None) == status


def test_check_token_constant_answer() -> None:
    """The bearer token must match exactly; anything else is 401 saying what to send."""
    assert check_token("Bearer abc", "abc") is None
    assert check_token("bearer abc ", "abc") is None
    for wrong in (None, "Bearer abd", "Basic abc", "abc", "Bearer "):
        refused = check_token(wrong, "abc")
        assert refused is not None
        assert refused[0] == 401
        assert "Authorization: Bearer" in refused[1]


def test_peer_refusal_follows_the_socket_policy() -> None:
    """Own uid and root pass, another uid is 403 naming it, an unknown peer needs a token."""
    policy = PeerPolicy(frozenset({1000, 0}), frozenset({50}))
    assert peer_refusal(PeerCred(0, 1000, 1000, frozenset()), policy, token=False) is None
    assert peer_refusal(PeerCred(0, 2000, 50, frozenset()), policy, token=False) is None
    assert peer_refusal(PeerCred(0, 2000, 7, frozenset({50})), policy, token=False) is None
    refused = peer_refusal(PeerCred(0, 2000, 7, frozenset()), policy, token=True)
    assert refused is not None
    assert refused[0] == 403
    assert "uid 2000" in refused[1]
    assert peer_refusal(None, policy, token=True) is None
    unknown = peer_refusal(None, policy, token=False)
    assert unknown is not None
    assert "--mcp-token-file" in unknown[1]


def test_a_non_ascii_token_matches_the_bytes_sent(tmp_path: Path) -> None:
    """A token file holding non-ASCII bytes (UTF-8 or not) is matched by a header carrying
    the same bytes (the server reads header values as Latin-1); it used to be compared
    re-encoded as UTF-8, or with U+FFFD in place of bytes that are not UTF-8, and no
    header could ever match it."""
    for raw in ("s3cr\u00e9t-\u20ac".encode(), b"tok\xff\xfeen"):
        token_file = tmp_path / "token"
        token_file.write_bytes(raw + b"\n")
        token_file.chmod(0o600)
        token = read_token_file(token_file)
        header = "Bearer " + raw.decode("latin-1")  # as h11's bytes reach the endpoint
        assert check_token(header, token) is None
        assert check_token("Bearer " + (raw + b"x").decode("latin-1"), token) is not None


def test_a_token_ending_in_byte_a0_or_85_matches(tmp_path: Path) -> None:
    """Bytes 0x85 and 0xA0, which end many UTF-8 characters ("voil\u00e0" ends in
    0xC3 0xA0), read as Latin-1 are whitespace to ``str.strip``: the header's value lost
    them and such a token could never match. Only spaces and tabs are trimmed."""
    for raw in ("voil\u00e0".encode(), "\u00c5".encode() + b"-key-\xc3\x85", b"\xa0tok\x85"):
        token_file = tmp_path / "token"
        token_file.write_bytes(raw + b"\n")
        token_file.chmod(0o600)
        token = read_token_file(token_file)
        assert check_token("Bearer " + raw.decode("latin-1"), token) is None, raw
        assert check_token("Bearer  " + raw.decode("latin-1") + " \t", token) is None, raw
        assert check_token("Bearer " + raw[:-1].decode("latin-1"), token) is not None, raw


def test_a_token_file_ending_in_a_unicode_space_is_refused(tmp_path: Path) -> None:
    """A token ending in U+00A0 was trimmed to what precedes it, silently: a client
    sending the file's bytes was refused 401. It is refused at start-up instead, as a
    space anywhere in the token is."""
    token_file = tmp_path / "token"
    for raw in ("tok\u00a0".encode(), "\u2003tok".encode()):
        token_file.write_bytes(raw + b"\n")
        token_file.chmod(0o600)
        with pytest.raises(TokenFileError, match="without spaces"):
            read_token_file(token_file)


def test_read_token_file_checks_mode_and_content(tmp_path: Path) -> None:
    """A 0600 file's token is read; group/other bits, links, dirs and empty files are refused."""
    token = tmp_path / "token"
    token.write_text("  s3cret-token\n")
    token.chmod(0o600)
    assert read_token_file(token) == "s3cret-token"
    token.chmod(0o640)
    with pytest.raises(TokenFileError, match="chmod 600"):
        read_token_file(token)
    token.chmod(0o600)
    link = tmp_path / "link"
    link.symlink_to(token)
    with pytest.raises(TokenFileError, match="cannot open"):
        read_token_file(link)
    with pytest.raises(TokenFileError, match="not a regular file"):
        read_token_file(tmp_path)
    empty = tmp_path / "empty"
    empty.write_text("\n")
    empty.chmod(0o600)
    with pytest.raises(TokenFileError, match="one token"):
        read_token_file(empty)
    with pytest.raises(TokenFileError, match="cannot open"):
        read_token_file(tmp_path / "missing")


@pytest.fixture(params=[socket.AF_INET, socket.AF_INET6], ids=["ipv4", "ipv6"])
def tcp_pair(request: pytest.FixtureRequest) -> Iterator[tuple[socket.socket, socket.socket]]:
    """An accepted loopback connection and its client end."""
    family = request.param
    host = "127.0.0.1" if family == socket.AF_INET else "::1"
    try:
        server = socket.socket(family, socket.SOCK_STREAM)
        server.bind((host, 0))
    except OSError:
        pytest.skip(f"no {host} on this machine")
    with server:
        server.listen()
        client = socket.create_connection(server.getsockname()[:2])
        accepted, _ = server.accept()
        with client, accepted:
            yield accepted, client


def test_tcp_peer_uid_is_ours(tcp_pair) -> None:
    """Both lookups find the client socket's owner: this process's uid."""
    accepted, _ = tcp_pair
    local, remote = accepted.getsockname()[:2], accepted.getpeername()[:2]
    by_diag = peer_from_sock_diag(accepted.family, local, remote)
    assert by_diag is not None and by_diag.uid == os.geteuid()
    # The cgroup the client socket was made in: this process's (the folder's inode).
    assert by_diag.cgroup == _own_cgroup_id()
    assert peer_from_proc(accepted.family, local, remote) == TcpPeer(os.geteuid())
    assert tcp_peer(accepted) == by_diag
    assert tcp_peer_credentials(os.geteuid()).uid == os.geteuid()


def test_tcp_peer_uid_unknown_socket_is_none(tcp_pair) -> None:
    """A four-tuple no socket has is answered None by both lookups, never a guess."""
    accepted, _ = tcp_pair
    local = accepted.getsockname()[:2]
    bogus = (local[0], 1)
    assert peer_from_sock_diag(accepted.family, local, bogus) is None
    assert peer_from_proc(accepted.family, local, bogus) is None


def test_tcp_peer_of_a_dual_stack_client_is_found_in_proc_too() -> None:
    """A client whose socket is IPv6 dual-stack (Java's default, ``AF_INET6`` without
    ``IPV6_V6ONLY``) reaches 127.0.0.1 as ``::ffff:127.0.0.1``: the kernel lists its socket
    in ``/proc/net/tcp6``, not ``tcp``. The fallback read only ``tcp`` for an IPv4 listener,
    so on a kernel without ``inet_diag`` such a client was unknown (refused, or 401)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        try:
            client = socket.socket(socket.AF_INET6, socket.SOCK_STREAM)
        except OSError:
            pytest.skip("no IPv6 sockets on this machine")
        with client:
            client.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
            client.connect(("::ffff:127.0.0.1", server.getsockname()[1]))
            accepted, _ = server.accept()
            with accepted:
                local, remote = accepted.getsockname()[:2], accepted.getpeername()[:2]
                found = peer_from_sock_diag(socket.AF_INET, local, remote)
                assert found is not None and found.uid == os.geteuid()
                assert peer_from_proc(socket.AF_INET, local, remote) == TcpPeer(os.geteuid())


def _own_cgroup_id() -> int | None:
    """The inode number of this process's cgroup v2 folder (None: no cgroup v2 here)."""
    line = next(
        (x for x in Path("/proc/self/cgroup").read_text().splitlines() if x.startswith("0::")),
        None,
    )
    mounts = [
        fields[1]
        for fields in (x.split() for x in Path("/proc/self/mounts").read_text().splitlines())
        if fields[2] == "cgroup2"
    ]
    if line is None or not mounts:
        return None
    return os.stat(mounts[0] + line[3:].rstrip("/")).st_ino


def test_a_peer_that_closed_is_unknown_not_root() -> None:
    """A client that sent its request and closed before the lookup is nobody, not uid 0.

    Its socket is then an orphan or a TIME_WAIT mini-socket, for which the kernel reports
    uid 0 (and inode 0): the lookups used to answer "root", whom the policy admits.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        client = socket.create_connection(server.getsockname()[:2])
        client.sendall(b"POST /mcp HTTP/1.1\r\n\r\n")
        client.close()
        accepted, _ = server.accept()
        with accepted:
            assert accepted.recv(100).startswith(b"POST")  # the request is there to serve
            local, remote = accepted.getsockname()[:2], accepted.getpeername()[:2]
            assert peer_from_sock_diag(socket.AF_INET, local, remote) is None
            assert peer_from_proc(socket.AF_INET, local, remote) is None
            assert tcp_peer(accepted) is None


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to connect as another user")
@pytest.mark.skipif(not os.access("/usr/bin/python3", os.X_OK), reason="no /usr/bin/python3")
def test_tcp_peer_uid_of_another_user() -> None:
    """A client running as nobody is reported as uid 65534, by both lookups."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        code = ("import socket, sys, time\n"
                "s = socket.create_connection(('127.0.0.1', int(sys.argv[1])))\n"
                "s.recv(1)\n")
        child = subprocess.Popen(
            ["/usr/bin/python3", "-S", "-c", code, str(port)], user=65534, group=65534,
            extra_groups=[], cwd="/", stdout=sys.stderr,
        )
        try:
            accepted, _ = server.accept()
            with accepted:
                local, remote = accepted.getsockname()[:2], accepted.getpeername()[:2]
                found = peer_from_sock_diag(socket.AF_INET, local, remote)
                assert found is not None and found.uid == 65534
                assert peer_from_proc(socket.AF_INET, local, remote) == TcpPeer(65534)
                accepted.sendall(b"x")
        finally:
            child.wait(timeout=10)


def test_endpoint_modules_load_only_with_mcp_listen() -> None:
    """Without --mcp-listen the daemon never imports h11 or the HTTP modules (cold start)."""
    code = (
        "import sys\n"
        "from toolsetd.daemon.app import parse_args\n"
        "parse_args(['--home', '/tmp'])\n"
        "names = ('h11', 'toolsetd.daemon.httpserver', 'toolsetd.daemon.mcphttp',\n"
        "         'toolsetd.daemon.httpguard', 'toolsetd.daemon.tcppeer')\n"
        "print(sorted(n for n in names if n in sys.modules))\n"
        "options = parse_args(['--home', '/tmp', '--mcp-listen', '127.0.0.1:0'])\n"
        "print(sorted(n for n in names if n in sys.modules), options.mcp_listen[0].host)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    )
    without, with_listen = out.stdout.splitlines()
    assert without == "[]"
    assert with_listen == "['toolsetd.daemon.httpguard'] 127.0.0.1"


def test_a_sock_diag_answer_cut_short_is_no_answer() -> None:
    """An answer cut anywhere, or a message too short for an ``inet_diag_msg``, gives no
    peer and raises nothing (struct.error used to escape the lookup)."""
    import struct

    from toolsetd.daemon.tcppeer import _diag_answer

    diag = struct.pack("=BBBB", socket.AF_INET, 1, 0, 0) + bytes(48)
    diag += struct.pack("=IIIII", 0, 0, 0, 1234, 99)  # expires, rqueue, wqueue, uid, inode
    attribute = struct.pack("=HHQ", 12, 21, 777)  # INET_DIAG_CGROUP_ID
    body = diag + attribute
    whole = struct.pack("=IHHII", 16 + len(body), 20, 0, 1, 0) + body
    assert _diag_answer(whole) == TcpPeer(1234, 777)
    for cut in range(len(whole)):
        assert _diag_answer(whole[:cut]) is None, cut
    short = struct.pack("=IHHII", 16 + 8, 20, 0, 1, 0) + diag[:8]
    assert _diag_answer(short) is None
