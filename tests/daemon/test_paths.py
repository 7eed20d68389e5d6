"""Tests for path fencing: expansion, resolution, credential paths, scope, argument rewriting."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from toolsetd.daemon.model import Approval, CatalogName, ToolDef
from toolsetd.daemon.paths import (
    INVALID_PATH_MESSAGE,
    NAME_MAX,
    ArgumentsError,
    PathError,
    Scope,
    canonical_workspace,
    credential_identities,
    existing_directory,
    expand_user,
    is_credential_identity,
    is_credential_path,
    is_within,
    resolve_path,
    rewrite_arguments,
    scope_of,
)

from tests.budget import examples


@pytest.fixture
def root(tmp_path: Path) -> Path:
    """A canonical temporary root (tmp_path itself may sit behind a link)."""
    return Path(os.path.realpath(tmp_path))


@pytest.fixture
def home(root: Path) -> Path:
    """A fake user profile with a .ssh directory holding a key."""
    path = root / "home"
    (path / ".ssh").mkdir(parents=True)
    (path / ".ssh" / "id_rsa").write_text("secret")
    return path


@pytest.fixture
def ws(root: Path) -> Path:
    """A canonical workspace with one file and one subdirectory."""
    path = root / "ws"
    (path / "sub").mkdir(parents=True)
    (path / "file.txt").write_text("x")
    return path


def tool(*path_arguments: str) -> ToolDef:
    """A minimal exec tool declaring the given path arguments."""
    return ToolDef(
        name="t",
        description="d",
        schema={"type": "object"},
        catalogs=frozenset({CatalogName.WORK}),
        approval=Approval.INHERIT,
        path_arguments=path_arguments,
    )


# --- expand_user -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        ("~", "{home}"),
        ("~/", "{home}/"),
        ("~/.ssh/id_rsa", "{home}/.ssh/id_rsa"),
        ("~root", "~root"),
        ("~root/x", "~root/x"),
        ("a/~", "a/~"),
        ("~~", "~~"),
        ("", ""),
    ],
)
def test_expand_user_only_tilde_and_tilde_slash(raw: str, expected: str, home: Path) -> None:
    """Only a leading ``~`` or ``~/`` expands; ``~user`` and inner tildes stay as written."""
    assert expand_user(raw, home) == expected.format(home=home)


# --- resolve_path: ordinary values -------------------------------------------------


def test_resolve_relative_joins_workspace(ws: Path, home: Path) -> None:
    """A relative path lands under the workspace."""
    assert resolve_path("file.txt", ws, home) == ws / "file.txt"


def test_resolve_tilde_goes_to_user_home(ws: Path, home: Path) -> None:
    """``~/.ssh/id_rsa`` resolves into the user profile, not the workspace."""
    assert resolve_path("~/.ssh/id_rsa", ws, home) == home / ".ssh" / "id_rsa"


def test_resolve_tilde_user_is_a_workspace_name(ws: Path, home: Path) -> None:
    """``~root`` is not looked up in the user database: it is a name under the workspace."""
    assert resolve_path("~root", ws, home) == ws / "~root"
    assert resolve_path("~root/.bashrc", ws, home) == ws / "~root" / ".bashrc"


def test_resolve_dotdot_chain_climbs_out(ws: Path, home: Path, root: Path) -> None:
    """``work/../../etc/passwd`` leaves the workspace by two levels, lexically for missing names."""
    assert resolve_path("work/../../etc/passwd", ws, home) == root / "etc" / "passwd"


def test_resolve_dotdot_stops_at_root(ws: Path, home: Path) -> None:
    """More ``..`` than there are levels ends at ``/``."""
    assert resolve_path("../" * 50 + "etc", ws, home) == Path("/etc")


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        ("/etc//passwd/", "/etc/passwd"),
        ("//etc///passwd", "/etc/passwd"),
        ("/etc/./passwd/.", "/etc/passwd"),
        ("/", "/"),
        ("///", "/"),
    ],
)
def test_resolve_absolute_normalises_separators(
    raw: str, expected: str, ws: Path, home: Path
) -> None:
    """Repeated separators, ``.`` and trailing slashes vanish from absolute paths."""
    assert resolve_path(raw, ws, home) == Path(expected)


def test_resolve_missing_parents_kept_as_written(ws: Path, home: Path) -> None:
    """Components that do not exist yet are kept, normalised."""
    assert resolve_path("new//dir/./file.txt/", ws, home) == ws / "new" / "dir" / "file.txt"


def test_resolve_under_a_file_is_kept(ws: Path, home: Path) -> None:
    """A path through a regular file (ENOTDIR) is kept as written, not an error."""
    assert resolve_path("file.txt/x", ws, home) == ws / "file.txt" / "x"


def test_resolve_looks_up_links_after_a_missing_component(ws: Path, home: Path) -> None:
    """``missing/../link`` still follows ``link``: a missing name never stops the lookups."""
    (ws / "key").symlink_to(home / ".ssh" / "id_rsa")
    assert resolve_path("missing/../key", ws, home) == home / ".ssh" / "id_rsa"


# --- resolve_path: links -------------------------------------------------------------


def test_resolve_follows_link_into_ssh(ws: Path, home: Path) -> None:
    """A workspace link pointing into ``~/.ssh`` resolves to its target."""
    (ws / "key").symlink_to(home / ".ssh" / "id_rsa")
    assert resolve_path("key", ws, home) == home / ".ssh" / "id_rsa"


def test_resolve_follows_relative_link_chain(ws: Path, home: Path) -> None:
    """Relative targets chain through several links."""
    (ws / "sub" / "b").symlink_to("../file.txt")
    (ws / "a").symlink_to("sub/b")
    assert resolve_path("a", ws, home) == ws / "file.txt"


def test_resolve_dotdot_after_link_applies_to_target(ws: Path, home: Path, root: Path) -> None:
    """``link/..`` is the parent of the link's target, not the workspace."""
    deep = root / "elsewhere" / "deep"
    deep.mkdir(parents=True)
    (ws / "out").symlink_to(deep)
    assert resolve_path("out/..", ws, home) == root / "elsewhere"
    assert resolve_path("out/../x", ws, home) == root / "elsewhere" / "x"


def test_resolve_link_to_dangling_target(ws: Path, home: Path, root: Path) -> None:
    """A dangling link resolves to its (missing) target."""
    (ws / "dangling").symlink_to(root / "nowhere" / "file")
    assert resolve_path("dangling", ws, home) == root / "nowhere" / "file"


def test_resolve_link_loop_is_invalid(ws: Path, home: Path) -> None:
    """A loop a→b→a raises ``Path is not valid.``"""
    (ws / "a").symlink_to("b")
    (ws / "b").symlink_to("a")
    with pytest.raises(PathError) as info:
        resolve_path("a", ws, home)
    assert info.value.message == INVALID_PATH_MESSAGE
    assert "loop" in info.value.detail


def test_resolve_link_targets_walk_a_bounded_number_of_components(ws: Path, home: Path) -> None:
    """Links whose targets add over ``MAX_LINK_COMPONENTS`` components are not walked.

    Forty links of 4,000-byte ``a/../a/../...`` targets, which a repository can ship, cost
    some 80,000 lookups on the daemon's loop for one path; the walk stops at the bound.
    """
    (ws / "a").mkdir()
    pad = "a/../" * 300  # 600 components
    (ws / "l0").symlink_to(pad + "l1")
    (ws / "l1").symlink_to(pad + "file.txt")
    with pytest.raises(PathError) as info:
        resolve_path("l0", ws, home)
    assert "components" in info.value.detail
    # One such link alone stays within the bound and resolves as the kernel does.
    assert resolve_path("l1", ws, home) == ws / "file.txt"


def test_resolve_self_loop_is_invalid(ws: Path, home: Path) -> None:
    """A link to itself, reached through a deeper path, is a loop too."""
    (ws / "self").symlink_to("self")
    with pytest.raises(PathError):
        resolve_path("sub/../self/x", ws, home)


def test_resolve_growing_link_is_bounded(ws: Path, home: Path) -> None:
    """A link whose target contains itself stops after the link limit."""
    (ws / "grow").symlink_to("grow/grow")
    with pytest.raises(PathError):
        resolve_path("grow", ws, home)


def test_resolve_through_symlinked_workspace(root: Path, ws: Path, home: Path) -> None:
    """A workspace reached through a link resolves to the real workspace."""
    link = root / "wslink"
    link.symlink_to(ws)
    assert resolve_path("file.txt", link, home) == ws / "file.txt"
    assert resolve_path(str(link / "sub"), ws, home) == ws / "sub"
    assert canonical_workspace(link) == ws


def test_resolve_non_utf8_link_target_is_invalid(ws: Path, home: Path) -> None:
    """A link whose target is not UTF-8 cannot travel in JSON: ``Path is not valid.``"""
    os.symlink(b"\xff\xfe", os.fsencode(ws / "bad"))
    with pytest.raises(PathError) as info:
        resolve_path("bad", ws, home)
    assert "UTF-8" in info.value.detail


@pytest.mark.skipif(os.geteuid() == 0, reason="root bypasses directory permissions")
def test_resolve_unsearchable_directory_is_invalid(ws: Path, home: Path) -> None:
    """A directory that cannot be searched hides whether a name is a link: refused."""
    locked = ws / "locked"
    locked.mkdir()
    locked.chmod(0)
    try:
        with pytest.raises(PathError):
            resolve_path("locked/x", ws, home)
    finally:
        locked.chmod(0o700)


# --- resolve_path: bad input ---------------------------------------------------------


@pytest.mark.parametrize(
    ("raw", "detail"),
    [
        ("", "empty"),
        ("   ", "empty"),
        ("\t\n", "empty"),
        ("\x00", "NUL"),
        ("a\x00b", "NUL"),
        ("~/.ssh\x00", "NUL"),
        ("a" * 5000, "longer"),
        ("/" + "a/" * 2100, "longer"),
        ("x" * 300, "component"),
        ("sub/" + "é" * 128, "component"),  # 256 bytes in UTF-8
        ("\ud800", "UTF-8"),
    ],
)
def test_resolve_bad_input_is_invalid(raw: str, detail: str, ws: Path, home: Path) -> None:
    """Blank, NUL, over-long and non-UTF-8 values raise ``Path is not valid.``"""
    with pytest.raises(PathError) as info:
        resolve_path(raw, ws, home)
    assert info.value.message == INVALID_PATH_MESSAGE
    assert detail in info.value.detail


def test_resolve_longest_component_is_fine(ws: Path, home: Path) -> None:
    """A component of exactly NAME_MAX bytes is accepted."""
    assert resolve_path("x" * NAME_MAX, ws, home) == ws / ("x" * NAME_MAX)


@pytest.mark.parametrize("value", [None, 3, 1.5, True, ["a"], {"a": 1}, b"a"])
def test_resolve_non_string_is_invalid(value: object, ws: Path, home: Path) -> None:
    """A non-string value raises PathError rather than TypeError."""
    with pytest.raises(PathError):
        resolve_path(value, ws, home)  # type: ignore[arg-type]


def test_resolve_joined_path_too_long(root: Path, home: Path) -> None:
    """A relative path that only gets too long once joined to the workspace is refused."""
    deep = Path("/" + "/".join(["d" * 200] * 19))  # about 3,800 bytes, never created
    with pytest.raises(PathError):
        resolve_path("e" * 250 + "/" + "f" * 250, deep, home)


def test_resolve_relative_workspace_is_a_caller_bug(home: Path) -> None:
    """A relative workspace is a programming error, reported as ValueError."""
    with pytest.raises(ValueError, match="absolute"):
        resolve_path("x", Path("rel"), home)


@settings(
    max_examples=examples(300),
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(
    raw=st.one_of(
        st.text(max_size=40),
        st.lists(st.sampled_from([*"ab./~\\ \x00é", "..", "sub", "file.txt", "loop", "key"]))
        .map("".join),
    )
)
def test_resolve_any_text_is_canonical_or_invalid(raw: str, ws: Path, home: Path) -> None:
    """Any text either resolves to an absolute path free of ``.``/``..`` or raises PathError."""
    if not (ws / "loop").is_symlink():
        (ws / "loop").symlink_to("loop")
        (ws / "key").symlink_to(home / ".ssh")
    try:
        result = resolve_path(raw, ws, home)
    except PathError as exc:  # either outcome is allowed; an error must be this one
        assert exc.message == INVALID_PATH_MESSAGE  # noqa: PT017
        return
    text = str(result)
    assert text.startswith("/")
    assert "//" not in text
    assert all(part not in (".", "..") for part in result.parts)


# --- is_credential_path --------------------------------------------------------------


@pytest.mark.parametrize(
    ("path", "expected"),
    [
        ("/home/u/.ssh", True),
        ("/home/u/.ssh/", True),
        ("/home/u/.ssh//", True),
        ("/home/u/.ssh/id_rsa", True),
        (".ssh", True),
        ("a/.SSH/b", True),
        ("/x/.GnuPG/pubring.kbx", True),
        ("C:\\Users\\u\\.ssh\\id_rsa", True),
        ("~\\.ssh", True),
        ("~/.ssh/id_rsa", True),
        ("/h/.crystal/credentials.json", True),
        ("/h/.Crystal/Credentials.JSON", True),
        ("/h/.crystal/credentials.json/", True),
        ("/p/.crystal/data/credentials.json", False),
        ("/h/credentials.json", False),
        ("/h/.crystal", False),
        ("/h/.ssh.bak/id_rsa", False),
        ("/h/ssh/id_rsa", False),
        ("/h/x.ssh", False),
        ("/h/.gnupg2", False),
        ("", False),
        ("/", False),
        ("/h/.ssh\x00/junk", True),
    ],
)
def test_is_credential_path_segments(path: str, expected: bool) -> None:
    """Whole segments ``.ssh``, ``.gnupg`` and ``.crystal/credentials.json`` match, any case."""
    assert is_credential_path(path) is expected


def test_is_credential_path_expands_bare_tilde(root: Path) -> None:
    """A bare ``~`` is judged as the user profile it expands to."""
    profile = root / ".gnupg"
    assert is_credential_path("~", profile) is True
    assert is_credential_path("~", root) is False


# --- scope_of ------------------------------------------------------------------------


def test_scope_workspace_and_the_workspace_itself(ws: Path, home: Path) -> None:
    """A path under the workspace, or the workspace itself, scopes as workspace."""
    assert scope_of("file.txt", ws / "file.txt", ws, home) is Scope.WORKSPACE
    assert scope_of(".", ws, ws, home) is Scope.WORKSPACE


def test_scope_sibling_with_common_prefix_is_outside(root: Path, ws: Path, home: Path) -> None:
    """``/ws2`` is not inside ``/ws``: containment is component-wise."""
    sibling = root / (ws.name + "2")
    assert scope_of(str(sibling), sibling, ws, home) is Scope.OUTSIDE
    assert not is_within(sibling, ws)
    assert is_within(ws / "a" / "b", ws)


def test_scope_unresolved_is_outside(ws: Path, home: Path) -> None:
    """A value that could not be resolved fails closed: outside the workspace."""
    assert scope_of("a", None, ws, home) is Scope.OUTSIDE


def test_scope_raw_credential_wins_even_unresolved(ws: Path, home: Path) -> None:
    """A credential raw text is forbidden even when it could not be resolved."""
    assert scope_of("~/.ssh/id_rsa\x00", None, ws, home) is Scope.FORBIDDEN


def test_scope_link_into_ssh_is_forbidden(ws: Path, home: Path) -> None:
    """A harmless-looking workspace name that links into ``~/.ssh`` is forbidden."""
    (ws / "notes").symlink_to(home / ".ssh")
    resolved = resolve_path("notes/id_rsa", ws, home)
    assert scope_of("notes/id_rsa", resolved, ws, home) is Scope.FORBIDDEN


def test_scope_hard_link_to_a_key_is_forbidden(ws: Path, home: Path) -> None:
    """A hard link to ``~/.ssh/id_rsa`` has no credential segment; its inode gives it away."""
    os.link(home / ".ssh" / "id_rsa", ws / "innocent.txt")
    resolved = resolve_path("innocent.txt", ws, home)
    assert is_credential_identity(resolved, home)
    assert scope_of("innocent.txt", resolved, ws, home) is Scope.FORBIDDEN


def test_scope_hard_link_to_credentials_json_and_gnupg_files(ws: Path, home: Path) -> None:
    (home / ".crystal").mkdir()
    (home / ".crystal" / "credentials.json").write_text("{}")
    (home / ".gnupg" / "private-keys-v1.d").mkdir(parents=True)
    (home / ".gnupg" / "private-keys-v1.d" / "k.key").write_text("k")
    os.link(home / ".crystal" / "credentials.json", ws / "a.json")
    os.link(home / ".gnupg" / "private-keys-v1.d" / "k.key", ws / "b")
    for name in ("a.json", "b"):
        assert scope_of(name, ws / name, ws, home) is Scope.FORBIDDEN
    assert scope_of("file.txt", ws / "file.txt", ws, home) is Scope.WORKSPACE


def test_credential_identities_skip_what_is_missing(root: Path) -> None:
    assert credential_identities(root / "nobody", passwd=False) == frozenset()


def test_scope_bind_mount_of_ssh_is_forbidden(ws: Path, home: Path) -> None:
    """A bind mount of ``~/.ssh`` inside the workspace: the folder and its files, by identity."""
    import subprocess

    target = ws / "keys"
    target.mkdir()
    mounted = subprocess.run(["mount", "--bind", str(home / ".ssh"), str(target)],
                             capture_output=True, check=False)
    if mounted.returncode != 0:
        pytest.skip("bind mounts need CAP_SYS_ADMIN here")
    try:
        (home / ".ssh" / "later").write_text("made after the mount")
        for raw in ("keys", "keys/id_rsa", "keys/later"):
            assert scope_of(raw, resolve_path(raw, ws, home), ws, home) is Scope.FORBIDDEN, raw
    finally:
        subprocess.run(["umount", str(target)], check=False)


def test_scope_link_out_of_workspace_is_outside(root: Path, ws: Path, home: Path) -> None:
    """A workspace link to a directory outside it scopes as outside."""
    (root / "other").mkdir()
    (ws / "escape").symlink_to(root / "other")
    resolved = resolve_path("escape/f", ws, home)
    assert scope_of("escape/f", resolved, ws, home) is Scope.OUTSIDE


def test_scope_with_symlinked_workspace(root: Path, ws: Path, home: Path) -> None:
    """Scope compares against the canonical workspace even when given its link."""
    link = root / "wslink"
    link.symlink_to(ws)
    for raw in ("file.txt", str(link / "file.txt"), str(ws / "file.txt")):
        resolved = resolve_path(raw, link, home)
        assert scope_of(raw, resolved, link, home) is Scope.WORKSPACE


def test_scope_tilde_user_stays_in_workspace(ws: Path, home: Path) -> None:
    """``~root`` scopes as workspace, and the child gets the workspace path."""
    resolved = resolve_path("~root", ws, home)
    assert scope_of("~root", resolved, ws, home) is Scope.WORKSPACE


# --- rewrite_arguments ---------------------------------------------------------------


def test_rewrite_without_path_arguments_is_identity(ws: Path, home: Path) -> None:
    """Tools without path arguments get their arguments back untouched, of any type."""
    for arguments in ({"path": "x"}, [1], "text", None):
        assert rewrite_arguments(tool(), arguments, ws, home) is arguments


@pytest.mark.parametrize("arguments", [[], "x", 3, None, ["path"]])
def test_rewrite_requires_object(arguments: object, ws: Path, home: Path) -> None:
    """A tool with path arguments needs an object."""
    with pytest.raises(ArgumentsError) as info:
        rewrite_arguments(tool("path"), arguments, ws, home)
    assert info.value.message == "Arguments must be a JSON object."


def test_rewrite_replaces_paths_and_keeps_order(ws: Path, home: Path) -> None:
    """Path strings become absolute; other values and properties pass through, in order."""
    arguments = {"z": 1, "path": "sub/../file.txt", "n": None, "out": 7, "home": "~"}
    result = rewrite_arguments(tool("path", "out", "home", "absent"), arguments, ws, home)
    assert list(result) == ["z", "path", "n", "out", "home"]
    assert result == {"z": 1, "path": str(ws / "file.txt"), "n": None, "out": 7, "home": str(home)}
    assert arguments["path"] == "sub/../file.txt"  # the input is not mutated


@pytest.mark.parametrize("value", ["", "  ", "\t"])
def test_rewrite_blank_is_refused(value: str, ws: Path, home: Path) -> None:
    """A blank path string is refused with the reference message."""
    with pytest.raises(ArgumentsError) as info:
        rewrite_arguments(tool("path"), {"path": value}, ws, home)
    assert info.value.message == "Argument 'path' must be a path string."
    assert info.value.argument == "path"


def test_rewrite_invalid_path_is_refused(ws: Path, home: Path) -> None:
    """An unresolvable value is refused with ``Path is not valid.``"""
    (ws / "a").symlink_to("b")
    (ws / "b").symlink_to("a")
    for value in ("a", "\x00", "x" * 5000):
        with pytest.raises(ArgumentsError) as info:
            rewrite_arguments(tool("path"), {"path": value}, ws, home)
        assert info.value.message == INVALID_PATH_MESSAGE


def test_rewrite_forbidden_path_is_rewritten_not_refused(ws: Path, home: Path) -> None:
    """The fence does not refuse credential paths; approval does. The child sees the target."""
    (ws / "key").symlink_to(home / ".ssh" / "id_rsa")
    result = rewrite_arguments(tool("path"), {"path": "key"}, ws, home)
    assert result == {"path": str(home / ".ssh" / "id_rsa")}


def test_rewrite_does_not_write(ws: Path, home: Path) -> None:
    """Resolving missing parents creates nothing on disk."""
    before = sorted(p.name for p in ws.iterdir())
    rewrite_arguments(tool("path"), {"path": "new/dir/file"}, ws, home)
    assert sorted(p.name for p in ws.iterdir()) == before


def test_resolve_lookup_error_is_invalid(
    ws: Path, home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An lstat failure other than "missing" (here EACCES) fails closed with PathError."""
    real_lstat = os.lstat

    def lstat(path: str) -> os.stat_result:
        if path.endswith("/locked"):
            raise PermissionError(13, "Permission denied", path)
        return real_lstat(path)

    monkeypatch.setattr(os, "lstat", lstat)
    with pytest.raises(PathError) as info:
        resolve_path("locked/x", ws, home)
    assert "Permission denied" in info.value.detail


def test_resolve_unreadable_link_is_invalid(
    ws: Path, home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A link that cannot be read fails closed with PathError."""
    (ws / "link").symlink_to("file.txt")

    def readlink(path: str) -> str:
        raise OSError(5, "Input/output error", path)

    monkeypatch.setattr(os, "readlink", readlink)
    with pytest.raises(PathError):
        resolve_path("link", ws, home)


def test_existing_directory_is_the_kernels_canonical_directory(tmp_path: Path) -> None:
    """The workspace check: links and ``..`` resolved as the kernel does, like realpath."""
    real = tmp_path / "a" / "b"
    real.mkdir(parents=True)
    (tmp_path / "file").write_text("x")
    (tmp_path / "to_b").symlink_to(real)
    (tmp_path / "to_file").symlink_to(tmp_path / "file")
    (tmp_path / "dangling").symlink_to(tmp_path / "missing")
    cases = [
        str(real),
        str(tmp_path / "to_b"),
        str(tmp_path / "to_b") + "/",
        str(tmp_path / "to_b" / ".."),  # the link's parent: a, not tmp_path
        str(tmp_path / "a" / "." / "b"),
    ]
    for raw in cases:
        found = existing_directory(raw)
        assert found == Path(os.path.realpath(raw)), raw
        assert found is not None and found.is_dir()
    assert existing_directory(str(tmp_path / "to_b" / "..")) == tmp_path / "a"
    for raw in ("file", "to_file", "dangling", "missing", "to_b/missing/.."):
        assert existing_directory(str(tmp_path / raw)) is None, raw


def test_existing_directory_needs_no_read_permission_on_it(tmp_path: Path) -> None:
    """A directory the daemon may not list is still a directory (as with ``is_dir``)."""
    closed = tmp_path / "closed"
    closed.mkdir(mode=0o000)
    try:
        assert existing_directory(str(closed)) == closed
    finally:
        closed.chmod(0o700)


def test_existing_directory_refuses_a_name_that_leads_elsewhere_here(tmp_path: Path) -> None:
    """A /proc link into another mount namespace opens a directory whose name is not it here.

    The other process sits at the root of a tmpfs mounted only in its namespace; the name
    read back from /proc is the mount point, which here is another, empty folder.
    """
    import shutil
    import subprocess

    assert existing_directory(f"/proc/{os.getpid()}/cwd") == Path(os.path.realpath(os.getcwd()))
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("needs root and unshare for a private mount namespace")
    point = tmp_path / "mnt"
    point.mkdir()
    script = f"mount -t tmpfs none {point} && cd {point} && echo ready && exec sleep 30"
    other = subprocess.Popen(
        ["unshare", "-m", "--propagation", "private", "sh", "-c", script],
        stdout=subprocess.PIPE,
    )
    try:
        assert other.stdout is not None
        if other.stdout.readline() != b"ready\n":
            pytest.skip("unshare could not make a mount namespace here")
        raw = f"/proc/{other.pid}/cwd"
        assert os.readlink(raw) == str(point)  # a folder here too, but not that one
        assert existing_directory(raw) is None
        assert existing_directory(str(point)) == point
    finally:
        other.kill()
        other.communicate()
