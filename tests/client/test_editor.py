"""The enabled-field editor: the reference host's rules for rewriting ``tools.json``."""

from __future__ import annotations

import json
import os
import stat
from collections.abc import Callable
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from toolsetd.client.editor import EditError, _with_enabled, locate_set, set_enabled
from toolsetd.daemon.paths import file_exists


def write(path: Path, text: str) -> Path:
    """Write ``text`` as a manifest, creating its folder."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    return path


def test_set_enabled_existing_key_keeps_position(tmp_path: Path) -> None:
    """An existing ``enabled`` has its value replaced where it stands; nothing else moves."""
    path = write(tmp_path / "tools.json", '{"runner":"exec","enabled":true,"command":["x"]}')
    outcome = set_enabled(path, False)
    assert outcome.changed
    assert path.read_text() == '{"runner":"exec","enabled":false,"command":["x"]}'


def test_set_enabled_new_key_appended_last(tmp_path: Path) -> None:
    """A missing ``enabled`` key is appended after every other key."""
    path = write(tmp_path / "tools.json", '{"runner":"exec","command":["x"],"zeta":1}')
    set_enabled(path, False)
    assert list(json.loads(path.read_text())) == ["runner", "command", "zeta", "enabled"]


@pytest.mark.parametrize(
    ("before", "disabled"),
    [
        # The author's layout, indent and line ends: the new member is laid out as the last.
        ('{\n    "runner": "exec",\n    "command": [ "x" ]\n}\n',
         '{\n    "runner": "exec",\n    "command": [ "x" ],\n    "enabled": false\n}\n'),
        ('{\r\n\t"runner" : "exec" ,\r\n\t"command" : ["x"]\r\n}',
         '{\r\n\t"runner" : "exec" ,\r\n\t"command" : ["x"],\r\n\t"enabled" : false\r\n}'),
        ('{"runner": "exec", "command": ["x"]}',
         '{"runner": "exec", "command": ["x"], "enabled": false}'),
        ('  {\n  "runner":"exec"}  \n', '  {\n  "runner":"exec",\n  "enabled":false}  \n'),
        # Escapes stay escapes; every number keeps its text (1e2 was written as 100.0).
        ('{"runner":"exec","description":"caf\\u00e9 \\/ \\ud83d\\ude00",'
         '"schema":{"multipleOf":1.50,"maximum":1e2,"minimum":-0,"big":123456789012345678901234567890}}',
         '{"runner":"exec","description":"caf\\u00e9 \\/ \\ud83d\\ude00",'
         '"schema":{"multipleOf":1.50,"maximum":1e2,"minimum":-0,"big":123456789012345678901234567890},'
         '"enabled":false}'),
        # A nested "enabled" is not the set's; null is true, and is replaced where it is.
        ('{"runner":"exec","x":{"enabled":"no"},"enabled":null,"y":1}',
         '{"runner":"exec","x":{"enabled":"no"},"enabled":false,"y":1}'),
        # A repeated key (or one spelled with an escape) is the same key: every copy is set.
        ('{"enabled":true,"runner":"exec","en\\u0061bled":null}',
         '{"enabled":false,"runner":"exec","en\\u0061bled":false}'),
    ],
    ids=["indent-4", "crlf-tabs", "one-line", "odd-spaces", "escapes-numbers", "nested-null",
         "repeated"],
)
def test_set_enabled_leaves_the_rest_of_the_file_as_it_was(
    tmp_path: Path, before: str, disabled: str
) -> None:
    """The contract: write ``enabled``, and leave the rest of the file as it was. The whole
    file was rewritten as 2-space JSON (as the reference host rewrites it): the author's
    layout, CRLF line ends, escapes and a repeated key's other copy were gone after one
    ``disable``, and a review diff showed every line changed. Enabling again keeps all of
    it too."""
    path = tmp_path / "tools.json"
    path.write_bytes(before.encode())
    assert set_enabled(path, False).changed
    assert path.read_bytes() == disabled.encode()
    assert set_enabled(path, True).changed
    assert path.read_bytes() == disabled.replace('false', 'true').encode()
    assert not set_enabled(path, True).changed


_JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=6),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=8,
)


@settings(deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    others=st.dictionaries(st.sampled_from(["runner", "a", "é", "b\n", "x y"]), _JSON),
    current=st.sampled_from(["absent", None, True, False]),
    position=st.integers(0, 5),
    indent=st.sampled_from([None, 0, 1, 2, 4, "\t"]),
    separators=st.sampled_from([(",", ":"), (", ", ": "), (" , ", " : ")]),
    ascii_only=st.booleans(),
    crlf=st.booleans(),
    enabled=st.booleans(),
)
def test_set_enabled_changes_only_enabled_in_any_layout(
    others: dict[str, object],
    current: object,
    position: int,
    indent: int | str | None,
    separators: tuple[str, str],
    ascii_only: bool,
    crlf: bool,
    enabled: bool,
) -> None:
    """Whatever the layout, the text read back is the document with ``enabled`` set (last
    when it was not there), and differs from the old one in one place only: the value
    replaced, or the member added. (The editor's text step; the file's round trip is the
    tests above.)"""
    members = list(others.items())
    if current != "absent":
        members.insert(position, ("enabled", current))
    document = dict(members)
    text = json.dumps(document, indent=indent, separators=separators, ensure_ascii=ascii_only)
    if crlf:
        text = text.replace("\n", "\r\n")
    after = _with_enabled(text, enabled)
    assert (after is not None) == ((current in ("absent", None, True)) is not enabled)
    if after is None:
        return
    assert json.loads(after) == {**document, "enabled": enabled}
    assert list(json.loads(after)) == list({**document, "enabled": enabled})
    head = _common_prefix(text, after)
    tail = _common_prefix(text[head:][::-1], after[head:][::-1])
    changed = after[head : len(after) - tail]
    assert len(text) - head - tail <= len("false"), (text, after)
    assert "enabled" in changed or changed.strip("truefalsn") == "", (text, after)


def _common_prefix(one: str, other: str) -> int:
    """The length of the longest prefix the two strings share."""
    shorter = min(len(one), len(other))
    return next((i for i in range(shorter) if one[i] != other[i]), shorter)


def test_set_enabled_refuses_to_write_past_the_size_the_daemon_reads(tmp_path: Path) -> None:
    """A manifest at the daemon's 1 MiB limit grew past it with ``enabled`` written (one
    byte for ``true`` to ``false``, sixteen for a new member): the edit succeeded, the
    daemon then skipped the set, and no ``enable`` could read the file to undo it. Such an
    edit is refused, and nothing is written."""
    head = '{"runner":"exec","command":["true"],"description":"'
    path = write(tmp_path / "tools.json", head + "d" * (1000 - len(head) - 17) + '","enabled":true}')
    data = path.read_bytes()
    assert len(data) == 1000
    with pytest.raises(EditError) as caught:
        set_enabled(path, False, max_bytes=1000)
    assert caught.value.message.startswith(
        "tools.json would be 1,001 bytes with enabled written, past the 1,000 the daemon reads"
    )
    assert path.read_bytes() == data
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tools.json"]
    assert set_enabled(path, False, max_bytes=1001).changed  # at the limit: written


def test_set_enabled_does_not_copy_a_hostile_gap(tmp_path: Path) -> None:
    """The added member copies the gap before the last one, but not a run of 600,000 spaces
    (which doubled the file, past the size the daemon reads): a line break and two spaces,
    or one space, stand for a gap that long."""
    path = write(tmp_path / "tools.json", '{"runner":"exec",' + " " * 600_000 + '"a":1}')
    assert set_enabled(path, False).changed
    assert path.read_text().endswith('"a":1, "enabled":false}')
    path = write(tmp_path / "tools.json", '{"runner":"exec",\r\n' + " " * 600 + '"a":1}')
    assert set_enabled(path, False).changed
    assert path.read_bytes().endswith(b'"a":1,\r\n  "enabled":false}')


def test_set_enabled_writes_many_copies_in_one_pass(tmp_path: Path) -> None:
    """Every one of 70,000 copies of ``enabled`` is written (in one pass: copying the whole
    text again for each took 19 s for this file, just under 1 MiB)."""
    path = write(tmp_path / "tools.json", '{"runner":"exec"' + ',"enabled":true' * 70_000 + "}")
    assert set_enabled(path, False).changed
    assert path.read_text() == '{"runner":"exec"' + ',"enabled":false' * 70_000 + "}"


def test_set_enabled_writes_only_the_sets_own_enabled(tmp_path: Path) -> None:
    """An ``enabled`` inside another member (a schema property) is not the set's."""
    path = write(tmp_path / "tools.json", '{"enabled":false,"schema":{"enabled":false}}')
    assert set_enabled(path, True).changed
    assert path.read_text() == '{"enabled":true,"schema":{"enabled":false}}'
    path = write(tmp_path / "tools.json", '{"schema":{"enabled":true}}')
    assert set_enabled(path, False).changed
    assert path.read_text() == '{"schema":{"enabled":true},"enabled":false}'


def test_set_enabled_is_unchanged_only_when_every_copy_has_the_value(tmp_path: Path) -> None:
    """With ``enabled`` repeated, readers differ on which copy counts: the set is already
    disabled only when every copy says so, else each is written."""
    path = write(tmp_path / "tools.json", '{"enabled":false,"enabled":true}')
    assert set_enabled(path, False).changed
    assert path.read_text() == '{"enabled":false,"enabled":false}'
    assert not set_enabled(path, False).changed


@pytest.mark.parametrize("encoding", ["utf-8", "utf-16-le", "utf-16-be", "utf-32-le", "utf-32-be"])
def test_set_enabled_keeps_the_byte_order_mark_and_the_encoding(
    tmp_path: Path, encoding: str
) -> None:
    """A manifest with a UTF-8, UTF-16 or UTF-32 byte order mark loads in the daemon (and in
    the reference host, whose File.ReadAllText detects it), so it can be disabled too; it
    stays in its encoding, with its mark (the reference host writes it back as UTF-8)."""
    path = tmp_path / "tools.json"
    path.write_bytes('\ufeff{"runner":"exec","description":"café"}'.encode(encoding))
    assert set_enabled(path, False).changed
    assert path.read_bytes() == (
        '\ufeff{"runner":"exec","description":"café","enabled":false}'.encode(encoding)
    )


def test_set_enabled_keeps_bytes_that_are_not_utf8(tmp_path: Path) -> None:
    """A manifest the daemon loads (it reads what does not decode as U+FFFD) but whose bytes
    are not UTF-8 was refused: the rewrite would have replaced them. Only ``enabled`` is
    written now, so they are kept as they were."""
    data = b'{"runner":"exec",\n"description":"caf\xe9","enabled":false}'
    path = tmp_path / "tools.json"
    path.write_bytes(data)
    assert set_enabled(path, True).changed
    assert path.read_bytes() == data.replace(b"false", b"true")


def test_set_enabled_names_utf16_that_does_not_decode_and_writes_nothing(tmp_path: Path) -> None:
    """A UTF-16 manifest with a lone surrogate loads in the daemon (as U+FFFD), but could not
    be written back as it was: the refusal names the byte, and nothing is written; a set
    that already has the value is left as it is without a refusal (exit 0 for a CI step)."""
    data = '\ufeff{"runner":"exec",\n"description":"'.encode("utf-16-le") + b"\x00\xd8" + (
        '","enabled":false}'.encode("utf-16-le")
    )
    path = tmp_path / "tools.json"
    path.write_bytes(data)
    with pytest.raises(EditError) as caught:
        set_enabled(path, True)
    message = caught.value.message
    assert "not valid JSON" not in message
    assert message.startswith("tools.json is not valid UTF-16-LE (bytes 00 d8 at line 2, column 16)")
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


def test_set_enabled_says_why_and_where_the_file_could_not_be_written(
    tmp_path: Path, unwritable: Callable[[Path], None]
) -> None:
    """A folder the CI user may not write (a checkout owned by another user, a read-only
    mount): "tools.json could not be written." named neither the reason nor the path; the
    message now carries the operating system's words and the file."""
    folder = tmp_path / "set"
    folder.mkdir()
    path = write(folder / "tools.json", '{"runner":"exec"}')
    unwritable(folder)
    with pytest.raises(EditError) as caught:
        set_enabled(path, False)
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
