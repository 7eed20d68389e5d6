"""The enabled-field editor: the reference host's rules for rewriting ``tools.json``."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest
from toolsetd.client.editor import EditError, locate_set, set_enabled
from toolsetd.daemon.paths import file_exists


def write(path: Path, text: str) -> Path:
    """Write ``text`` as a manifest, creating its folder."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    return path


def test_set_enabled_existing_key_keeps_position(tmp_path: Path) -> None:
    """An existing ``enabled`` key is rewritten where it stands; other keys keep their order."""
    path = write(tmp_path / "tools.json", '{"runner":"exec","enabled":true,"command":["x"]}')
    outcome = set_enabled(path, False)
    assert outcome.changed
    assert list(json.loads(path.read_text())) == ["runner", "enabled", "command"]
    assert path.read_text() == '{\n  "runner": "exec",\n  "enabled": false,\n  "command": [\n    "x"\n  ]\n}\n'


def test_set_enabled_new_key_appended_last(tmp_path: Path) -> None:
    """A missing ``enabled`` key is appended after every other key."""
    path = write(tmp_path / "tools.json", '{"runner":"exec","command":["x"],"zeta":1}')
    set_enabled(path, False)
    assert list(json.loads(path.read_text())) == ["runner", "command", "zeta", "enabled"]


def test_set_enabled_writes_two_space_json_with_newline_and_keeps_non_ascii(tmp_path: Path) -> None:
    """The file is ``json.dumps(indent=2, ensure_ascii=False)`` plus a trailing newline."""
    document = {"runner": "exec", "command": ["échó"], "enabled": True}
    path = write(tmp_path / "tools.json", json.dumps(document))
    set_enabled(path, False)
    document["enabled"] = False
    assert path.read_text(encoding="utf-8") == json.dumps(document, indent=2, ensure_ascii=False) + "\n"


def test_set_enabled_keeps_every_number_as_written(tmp_path: Path) -> None:
    """Only ``enabled`` changes: a number keeps its text (``1.50``, ``1e2``, ``-0``, a wide
    integer), as the reference host's ``JsonNode`` rewrite keeps it, so a disable never
    rewrites the author's schema (``1e2`` was written back as ``100.0``)."""
    path = write(
        tmp_path / "tools.json",
        '{"runner":"exec","schema":{"multipleOf":1.50,"maximum":1e2,"minimum":-0,'
        '"x":-0.0,"y":1E-7,"big":123456789012345678901234567890,"n":12}}',
    )
    set_enabled(path, False)
    assert path.read_text() == (
        '{\n  "runner": "exec",\n  "schema": {\n    "multipleOf": 1.50,\n    "maximum": 1e2,\n'
        '    "minimum": -0,\n    "x": -0.0,\n    "y": 1E-7,\n'
        '    "big": 123456789012345678901234567890,\n    "n": 12\n  },\n  "enabled": false\n}\n'
    )


@pytest.mark.parametrize("encoding", ["utf-8", "utf-16-le", "utf-16-be", "utf-32-le", "utf-32-be"])
def test_set_enabled_reads_a_byte_order_mark_as_the_daemon_does(
    tmp_path: Path, encoding: str
) -> None:
    """A manifest with a UTF-8, UTF-16 or UTF-32 byte order mark loads in the daemon (and in
    the reference host, whose File.ReadAllText detects it), so it can be disabled too; it is
    written back as UTF-8, as the reference host writes it."""
    path = tmp_path / "tools.json"
    path.write_bytes('\ufeff{"runner":"exec","description":"café"}'.encode(encoding))
    assert set_enabled(path, False).changed
    assert path.read_bytes() == (
        '{\n  "runner": "exec",\n  "description": "café",\n  "enabled": false\n}\n'.encode()
    )


def test_set_enabled_names_bytes_that_are_not_utf8_and_rewrites_nothing(tmp_path: Path) -> None:
    """A manifest the daemon loads (it reads what does not decode as U+FFFD) but whose bytes
    are not UTF-8 is not rewritten: the edit would replace them. The refusal says so and
    where, not "not valid JSON" (the JSON is valid: validate and list accept it); and a set
    that already has the value is left as it is without a refusal (exit 0 for a CI step)."""
    data = b'{"runner":"exec",\n"description":"caf\xe9","enabled":false}'
    path = tmp_path / "tools.json"
    path.write_bytes(data)
    with pytest.raises(EditError) as caught:
        set_enabled(path, True)
    message = caught.value.message
    assert "not valid JSON" not in message
    assert message.startswith("tools.json is not valid UTF-8 (byte 0xe9 at line 2, column 19)")
    assert path.read_bytes() == data
    assert not set_enabled(path, False).changed  # already disabled: nothing to write
    assert path.read_bytes() == data


def test_set_enabled_already_enabled_leaves_file_alone(tmp_path: Path) -> None:
    """Enabling a set whose ``enabled`` is absent, true or null changes nothing."""
    for text in ('{"runner":"exec"}', '{"runner":"exec","enabled":true}', '{"enabled":null}'):
        path = write(tmp_path / "tools.json", text)
        assert not set_enabled(path, True).changed
        assert path.read_text() == text


def test_set_enabled_already_disabled_reports_unchanged(tmp_path: Path) -> None:
    """Disabling a disabled set reports no change and does not rewrite."""
    text = '{"enabled": false,   "runner":"exec"}'
    path = write(tmp_path / "tools.json", text)
    assert not set_enabled(path, False).changed
    assert path.read_text() == text


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('{"runner": "exec",', "tools.json is not valid JSON: "),
        ("[1, 2]", "tools.json must be a JSON object."),
        ('{"a": NaN}', "tools.json is not valid JSON: "),
    ],
)
def test_set_enabled_broken_manifest_left_byte_identical(
    tmp_path: Path, text: str, message: str
) -> None:
    """A manifest that is not JSON or not an object is reported and left untouched."""
    path = write(tmp_path / "tools.json", text)
    before = path.read_bytes()
    with pytest.raises(EditError) as caught:
        set_enabled(path, False)
    assert caught.value.message.startswith(message)
    assert path.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tools.json"]


def test_set_enabled_check_failure_leaves_file_untouched(tmp_path: Path) -> None:
    """When the full manifest check reports a problem, that message is raised and nothing is written."""
    path = write(tmp_path / "tools.json", '{"runner": "perl"}')
    with pytest.raises(EditError, match=r"^tools\.json must set runner to exec or dotnet\.$"):
        set_enabled(path, False, check=lambda data: "tools.json must set runner to exec or dotnet.")
    assert path.read_text() == '{"runner": "perl"}'


def test_set_enabled_keeps_file_mode(tmp_path: Path) -> None:
    """The rewritten file keeps the permission bits of the original."""
    path = write(tmp_path / "tools.json", '{"runner":"exec"}')
    os.chmod(path, 0o640)
    set_enabled(path, False)
    assert stat.S_IMODE(path.stat().st_mode) == 0o640


def test_set_enabled_writes_through_a_symlink(tmp_path: Path) -> None:
    """A symlinked ``tools.json`` stays a symlink; its target gets the edit."""
    target = write(tmp_path / "real.json", '{"runner":"exec"}')
    link = tmp_path / "set" / "tools.json"
    link.parent.mkdir()
    link.symlink_to(target)
    set_enabled(link, False)
    assert link.is_symlink()
    assert json.loads(target.read_text())["enabled"] is False


def test_locate_set_project_wins_over_home(tmp_path: Path) -> None:
    """Without a source the project copy is chosen; with one, that copy."""
    home, workspace = tmp_path / "home", tmp_path / "ws"
    write(home / "tools" / "acme" / "tools.json", "{}")
    write(workspace / ".crystal" / "tools" / "acme" / "tools.json", "{}")
    assert locate_set(home, workspace, " acme ", None, exists=file_exists)[1] == "project"
    assert locate_set(home, workspace, "acme", "home", exists=file_exists)[1] == "home"


@pytest.mark.parametrize(
    ("name", "source", "message"),
    [
        ("my tools", None, "Directory name is invalid."),
        ("9lives", None, "Directory name is invalid."),
        ("", None, "Directory name is invalid."),
        ("ghost", None, "Tool set 'ghost' was not found."),
        ("ghost", "home", "Tool set 'ghost' was not found in Home."),
        ("ghost", "project", "Tool set 'ghost' was not found in Project."),
    ],
)
def test_locate_set_errors_use_reference_messages(
    tmp_path: Path, name: str, source: str | None, message: str
) -> None:
    """Bad names and missing sets give the reference host's messages."""
    with pytest.raises(EditError) as caught:
        locate_set(tmp_path / "home", tmp_path / "ws", name, source, exists=file_exists)
    assert caught.value.message == message


def test_set_enabled_with_the_daemons_reader_refuses_a_fifo_at_once(tmp_path: Path) -> None:
    """A FIFO swapped in for tools.json after the set was located is refused, not waited on."""
    from toolsetd.client.offline import read_for_edit

    path = tmp_path / "tools.json"
    os.mkfifo(path)  # nobody writes: a blocking open or read would hang the test
    with pytest.raises(EditError, match=r"^tools\.json could not be read\.$"):
        set_enabled(path, True, read=read_for_edit)
    assert stat.S_ISFIFO(os.stat(path).st_mode)  # left as it was


def _unwritable_folder(folder: Path) -> bool:
    """Make ``folder`` refuse new files, even to root (``chattr +i``); False if it cannot."""
    import shutil
    import subprocess

    folder.chmod(0o555)
    probe = folder / ".probe"
    try:
        probe.touch()
    except PermissionError:
        return True
    probe.unlink()
    chattr = shutil.which("chattr")
    if chattr is None:
        return False
    done = subprocess.run([chattr, "+i", str(folder)], capture_output=True, check=False)
    return done.returncode == 0


def test_set_enabled_says_why_and_where_the_file_could_not_be_written(tmp_path: Path) -> None:
    """A folder the CI user may not write (a checkout owned by another user, a read-only
    mount): "tools.json could not be written." named neither the reason nor the path; the
    message now carries the operating system's words and the file."""
    import subprocess

    folder = tmp_path / "set"
    folder.mkdir()
    path = write(folder / "tools.json", '{"runner":"exec"}')
    if not _unwritable_folder(folder):
        pytest.skip("cannot make a folder unwritable here")
    try:
        with pytest.raises(EditError) as caught:
            set_enabled(path, False)
    finally:
        subprocess.run(["chattr", "-i", str(folder)], capture_output=True, check=False)
        folder.chmod(0o755)
    message = caught.value.message
    assert message.startswith("tools.json could not be written: ")
    assert str(folder) in message
    assert ("Permission denied" in message) or ("Operation not permitted" in message)
    assert path.read_text() == '{"runner":"exec"}'


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a file to another user needs root")
def test_set_enabled_by_root_keeps_the_files_owner(tmp_path: Path) -> None:
    """``sudo toolsetctl enable x`` (or a CI job running as root) on the sets of a daemon that
    runs as its own user: the file was replaced by one root owns, and with the mode kept
    (0600) the daemon could no longer read its own manifest ("tools.json could not be
    read.") nor its owner edit it. The replacement now gets the old file's owner and group
    (the reference host, which renames a new file over it too, leaves it root's)."""
    path = write(tmp_path / "tools.json", '{"runner":"exec","enabled":false}')
    os.chown(path, 65534, 65534)
    path.chmod(0o600)
    assert set_enabled(path, True).changed
    info = path.stat()
    assert (info.st_uid, info.st_gid, stat.S_IMODE(info.st_mode)) == (65534, 65534, 0o600)
    assert json.loads(path.read_text())["enabled"] is True
