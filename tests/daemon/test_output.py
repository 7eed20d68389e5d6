"""Model-facing text, content mode, image loading and spill files (pure or file-level)."""

from __future__ import annotations

import base64
import errno
import os
import time
from pathlib import Path

import pytest
from structlog.testing import capture_logs
from toolsetd.daemon.output import (
    ContentError,
    ImageSpec,
    combine,
    content_result,
    is_credential_path,
    load_image,
    parse_content,
    sniff_image,
    start_failure_text,
    text_result,
    timeout_text,
    truncate,
)
from toolsetd.daemon.spill import Spill, open_folder_within, prune, spill_name

PNG = b"\x89PNG\r\n\x1a\n" + b"\0" * 16
GIF = b"GIF89a" + b"\0" * 10
JPEG = b"\xff\xd8\xff\xe0" + b"\0" * 10
WEBP = b"RIFF\0\0\0\0WEBPVP8 "
MiB = 1024 * 1024


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


@pytest.mark.parametrize(
    ("stdout", "stderr", "expected"),
    [("out", "", "out"), ("", "err", "err"), ("out", "err", "out\nerr"), ("", "", "")],
)
def test_combine_rules(stdout: str, stderr: str, expected: str) -> None:
    """Combined output is stdout, stderr, or both joined by LF."""
    assert combine(stdout, stderr) == expected


def test_text_result_always_has_exit_line() -> None:
    """Text mode always starts with the exit line, exit 0 included."""
    assert text_result(0, "", "") == "exit 0\n"
    assert text_result(42, "a\n", "b\n") == "exit 42\na\n\nb\n"


def test_truncate_marker() -> None:
    """A text over the limit is cut with the reference marker; at the limit it is kept."""
    assert truncate("abc", 3) == ("abc", False)
    assert truncate("abcd", 3) == ("abc\n[truncated to 3 characters]", True)
    text, cut = truncate("x" * 100_001, 100_000)
    assert cut
    assert text == "x" * 100_000 + "\n[truncated to 100000 characters]"


def test_timeout_and_start_texts() -> None:
    """The timeout sentence is singular for one second; start failures name the error."""
    assert timeout_text(1) == "The command timed out after 1 second."
    assert timeout_text(120) == "The command timed out after 120 seconds."
    assert start_failure_text("No such file or directory") == (
        "The external process failed to start: No such file or directory"
    )
    assert start_failure_text(None) == "The external process failed to start."


@pytest.mark.parametrize(
    ("stdout", "message"),
    [
        ("x" * 11, "Tool output exceeds the output limit."),
        ("", "Tool output is not valid content JSON."),
        ("nope", "Tool output is not valid content JSON.\nnope"),
        ("[1]", "Tool output is not valid content JSON.\n[1]"),
        ('{"text": 1}', "Content text must be a string."),
        ('{"images": {}}', "Content images must be an array."),
        ('{"images": [1]}', "Each content image must be a JSON object."),
        ('{"images": [{}]}', "Each content image requires mimeType."),
        ('{"images": [{"mimeType": " "}]}', "Each content image requires mimeType."),
        ('{"images": [{"mimeType": "a"}]}', "An image must set exactly one of base64 or path."),
        ('{"images": [{"mimeType": "a", "base64": "x", "path": "y"}]}',
         "An image must set exactly one of base64 or path."),
        ('{"images": [{"mimeType": "a", "base64": ""}]}', "Image base64 cannot be empty."),
        ('{"images": [{"mimeType": "a", "base64": 1}]}', "Image base64 must be a string."),
        ('{"images": [{"mimeType": "a", "path": ""}]}', "Image path cannot be empty."),
        ('{"images": [{"mimeType": "a", "path": []}]}', "Image path must be a string."),
    ],
)
def test_parse_content_errors(stdout: str, message: str) -> None:
    """Each content check fails with the reference message, in the reference order."""
    limit = 10 if stdout.startswith("x") else 1000
    with pytest.raises(ContentError) as info:
        parse_content(stdout, limit)
    assert info.value.message.startswith(message)


def test_parse_content_too_many_images() -> None:
    """More than eight images is refused."""
    images = ",".join(['{"mimeType":"image/png","base64":"eA=="}'] * 9)
    with pytest.raises(ContentError) as info:
        parse_content('{"images":[' + images + "]}", 100_000)
    assert info.value.message == "A tool can return at most 8 images."


@pytest.mark.parametrize(
    ("first", "message"),
    [
        ("1", "Each content image must be a JSON object."),
        ('{"base64": "eA=="}', "Each content image requires mimeType."),
        ('{"mimeType": "image/png"}', "An image must set exactly one of base64 or path."),
    ],
)
def test_parse_content_checks_the_first_eight_images_before_counting(
    first: str, message: str
) -> None:
    """The reference host checks each image as it walks the array and refuses the ninth
    only when it reaches it: a bad image among the first eight is what it reports."""
    images = ",".join([first] + ['{"mimeType":"image/png","base64":"eA=="}'] * 8)
    with pytest.raises(ContentError) as info:
        parse_content('{"images":[' + images + "]}", 100_000)
    assert info.value.message == message


def test_parse_content_nesting_is_bounded_as_in_the_reference_host() -> None:
    """System.Text.Json reads at most 64 nested objects and arrays: a content object that
    nests deeper is not valid content JSON there, whatever member holds it."""
    body = '{"text":"T","x":' + "[" * 63 + "]" * 63 + "}"  # 64 levels
    assert parse_content(body, 100_000).text == "T"
    body = '{"text":"T","x":' + "[" * 64 + "]" * 64 + "}"  # 65 levels
    with pytest.raises(ContentError) as info:
        parse_content(body, 100_000)
    assert info.value.message == "Tool output is not valid content JSON.\n" + body


@pytest.mark.parametrize(
    "member",
    ["1e400", "-1E+999", "9" * 500, '"\\ud800"', '["\\udc00", 1]'],
)
def test_parse_content_takes_what_the_reference_host_reads(member: str) -> None:
    """System.Text.Json keeps any number's text and checks a string's escapes only when it is
    read: a number beyond a double, or a lone surrogate in a member nobody reads, is a valid
    content object there (orjson refuses both)."""
    assert parse_content('{"text": "T", "x": ' + member + "}", 100_000).text == "T"


@pytest.mark.parametrize(
    "body",
    [
        '{"text": "a\\ud800", "x": 1e400}',
        '{"images": [{"mimeType": "image/png", "path": "\\udc00"}], "x": 1e400}',
        '{"text": "T", "x": NaN}',
        '{"text": "T", "x": [' + "[" * 64 + "1e400" + "]" * 64 + "]}",
    ],
)
def test_parse_content_refuses_what_it_cannot_carry(body: str) -> None:
    """A lone surrogate in a string the result would carry, NaN, or nesting past 64 levels
    stays not valid content JSON, whatever else the object holds."""
    with pytest.raises(ContentError) as info:
        parse_content(body, 100_000)
    assert info.value.message.startswith("Tool output is not valid content JSON.\n")


@pytest.mark.parametrize(
    "member",
    [
        '"T"',
        '"a\\ud800"',
        '"\\ud83d\\ude00"',
        '"T", "x": 1e400',
        '"T", "x": "\\ud800"',
        '"T", "x": NaN',
        '"T", "x": ' + "[" * 64 + "]" * 64,
        '"T", "x": ' + "[" * 2000 + "]" * 2000,
        '"T", "x": [1,]',
        '"T", "text": "U"',
        '"T", "images": [{"mimeType": "image/png", "base64": "eA=="}]',
        '"T", "images": [{"mimeType": "image/png", "path": "\\udc00"}]',
    ],
)
def test_parse_content_reads_a_large_body_as_a_small_one(member: str) -> None:
    """A body over 64 KiB is read by the standard library alone (orjson does not survive
    running out of memory while it makes a string): it gives what the same object gives
    small, a content or the same refusal."""

    def outcome(body: str) -> object:
        try:
            content = parse_content(body, 1_000_000)
        except ContentError as exc:
            return exc.message.split("\n")[0]
        return (content.text, [(i.mime_type, i.base64, i.path) for i in content.images])

    pad = '"' + "p" * (70 * 1024) + '"'
    small = outcome('{"pad": 1, "text": ' + member + "}")
    assert outcome('{"pad": ' + pad + ', "text": ' + member + "}") == small


def test_parse_content_trims_as_the_reference_host_trims() -> None:
    """``TrimStart('\\uFEFF').Trim()``: every leading byte order mark, then .NET's white
    space, which does not hold the information separators U+001C..U+001F (Python's does)."""
    assert parse_content('\ufeff\ufeff\ufeff {"text": "T"}\u2028', 1000).text == "T"
    with pytest.raises(ContentError) as info:
        parse_content('\x1c{"text": "T"}\x1f', 1000)
    assert info.value.message == 'Tool output is not valid content JSON.\n\x1c{"text": "T"}\x1f'
    parsed = parse_content('{"images": [{"mimeType": "\\u00a0image/png\\u2028", "path": "a"}]}', 1000)
    assert parsed.images[0].mime_type == "image/png"
    parsed = parse_content('{"images": [{"mimeType": "\\u001cimage/png", "path": "a"}]}', 1000)
    assert parsed.images[0].mime_type == "\x1cimage/png"  # then not image/png: a mismatch


def test_parse_content_trims_bom_and_accepts_nulls() -> None:
    """A BOM and whitespace are trimmed; null text and images mean absent."""
    parsed = parse_content('\ufeff  {"text": null, "images": null} \n', 1000)
    assert parsed.text == ""
    assert parsed.images == ()
    long_body = "y" * 3000
    with pytest.raises(ContentError) as info:
        parse_content(long_body, 100_000)
    assert info.value.message == "Tool output is not valid content JSON.\n" + "y" * 2000


def _content(stdout: str, stderr: str = "", code: int = 0, images_ok: bool = True,
             workspace: Path = Path("/nonexistent")) -> tuple[list[dict[str, str]], bool]:
    return content_result(stdout, stderr, code, limit=100_000, images_ok=images_ok,
                          workspace=workspace, max_image_bytes=20 * MiB)


def test_content_result_text_and_stderr() -> None:
    """Success text gets stderr appended; no exit prefix on success."""
    assert _content('{"text": "hi"}') == ([{"type": "text", "text": "hi"}], False)
    assert _content('{"text": "hi"}', "log") == ([{"type": "text", "text": "hi\nlog"}], False)
    assert _content("{}", "log") == ([{"type": "text", "text": "log"}], False)


def test_content_result_errors_get_exit_prefix_and_stderr() -> None:
    """A parse error is prefixed by the exit line only when the code is not 0."""
    assert _content("bad", "log", 0)[0][0]["text"] == (
        "Tool output is not valid content JSON.\nbad\nlog"
    )
    assert _content("bad", "", 2)[0][0]["text"] == (
        "exit 2\nTool output is not valid content JSON.\nbad"
    )
    assert _content('{"text": "t"}', "e", 3) == ([{"type": "text", "text": "exit 3\nt\ne"}], True)


def test_content_result_images_refused_without_image_channel() -> None:
    """Declared images fail the call when the caller cannot take images."""
    stdout = '{"text": "t", "images": [{"mimeType": "image/png", "base64": "!!"}]}'
    assert _content(stdout, images_ok=False) == (
        [{"type": "text", "text": "This model cannot accept tool images."}],
        True,
    )
    assert _content('{"text": "t"}', images_ok=False) == ([{"type": "text", "text": "t"}], False)


def test_content_result_base64_image() -> None:
    """A base64 image (whitespace allowed) is checked and re-encoded compactly."""
    data = b64(PNG)
    stdout = ('{"text": "t", "images": [{"mimeType": "IMAGE/PNG", "base64": "' + data[:8]
              + '\\n ' + data[8:] + '"}]}')
    blocks, is_error = _content(stdout)
    assert not is_error
    assert blocks == [
        {"type": "text", "text": "t"},
        {"type": "image", "data": data, "mimeType": "image/png"},
    ]


@pytest.mark.parametrize(
    ("data", "mime", "message"),
    [
        ("@@@@", "image/png", "Image base64 is not valid."),
        ("abc", "image/png", "Image base64 is not valid."),
        (b64(b"hello world"), "image/png",
         "The file is not a supported PNG, JPEG, GIF, or WebP image."),
        (b64(GIF), "image/png", "Image bytes do not match mimeType."),
        # .NET's white space is stripped from base64, not U+001C..U+001F (Python's \\s is)
        (b64(PNG)[:8] + "\x1c" + b64(PNG)[8:], "image/png", "Image base64 is not valid."),
    ],
)
def test_load_image_base64_errors(data: str, mime: str, message: str) -> None:
    """Invalid, unsupported or mismatched base64 images fail with the reference messages."""
    with pytest.raises(ContentError) as info:
        load_image(ImageSpec(mime_type=mime, base64=data), Path("/"), 20 * MiB)
    assert info.value.message == message


def test_load_image_base64_drops_dotnet_white_space() -> None:
    """Line breaks, spaces and the Unicode spaces .NET counts may sit inside base64."""
    text = b64(PNG)
    spaced = text[:4] + "\r\n" + text[4:8] + "\u2028\u00a0 " + text[8:] + "\n"
    block = load_image(ImageSpec(mime_type="image/png", base64=spaced), Path("/"), 20 * MiB)
    assert block["data"] == text


def test_load_image_size_limit() -> None:
    """An image over the limit is refused with the MiB message."""
    with pytest.raises(ContentError) as info:
        load_image(ImageSpec(mime_type="image/png", base64=b64(PNG)), Path("/"), 8)
    assert info.value.message == "The image file exceeds the 7.62939e-06 MiB host limit."
    with pytest.raises(ContentError) as info:
        load_image(ImageSpec(mime_type="image/png", base64=b64(PNG * 100)), Path("/"), MiB // 1024)
    assert "exceeds the" in info.value.message


@pytest.mark.parametrize(
    ("data", "mime"), [(PNG, "image/png"), (GIF, "image/gif"), (JPEG, "image/jpeg"),
                       (WEBP, "image/webp")],
)
def test_sniff_image_formats(data: bytes, mime: str) -> None:
    """PNG, GIF, JPEG and WebP are recognised by their magic bytes."""
    assert sniff_image(data) == mime
    assert sniff_image(data[:3] if mime != "image/jpeg" else b"\xff\xd8") is None


def test_load_image_by_path(tmp_path: Path) -> None:
    """A path inside the workspace is read, sniffed and returned as base64."""
    ws = Path(os.path.realpath(tmp_path))
    (ws / "img").mkdir()
    (ws / "img" / "a.gif").write_bytes(GIF)
    block = load_image(ImageSpec(mime_type="image/gif", path="img/a.gif"), ws, 20 * MiB)
    assert block == {"type": "image", "data": b64(GIF), "mimeType": "image/gif"}
    block = load_image(ImageSpec(mime_type="image/gif", path=str(ws / "img/a.gif")), ws, 20 * MiB)
    assert block["mimeType"] == "image/gif"


def test_load_image_path_errors(tmp_path: Path) -> None:
    """Every path failure has the reference message, and a FIFO is never opened."""
    ws = Path(os.path.realpath(tmp_path)) / "ws"
    ws.mkdir()
    (ws / "dir").mkdir()
    (ws / "empty.png").write_bytes(b"")
    (ws / "big.png").write_bytes(PNG * 10)
    os.mkfifo(ws / "fifo.png")
    (tmp_path / "outside.png").write_bytes(PNG)
    (ws / "link.png").symlink_to(tmp_path / "outside.png")
    (ws / ".ssh").mkdir()
    (ws / ".ssh" / "k.png").write_bytes(PNG)
    (ws / "keys").symlink_to(ws / ".ssh")

    def error(path: str, limit: int = 20 * MiB) -> str:
        with pytest.raises(ContentError) as info:
            load_image(ImageSpec(mime_type="image/png", path=path), ws, limit)
        return info.value.message

    assert error("missing.png") == "File not found: missing.png"
    assert error("dir") == "Path is a directory: dir"
    assert error("fifo.png") == "The image file could not be read."
    assert error("empty.png") == "The image file is empty."
    assert error("big.png", 100) == "The image file exceeds the 9.53674e-05 MiB host limit."
    assert error("../outside.png") == "Path is outside the workspace."
    assert error("link.png") == "Path is outside the workspace."
    assert error("/etc/passwd") == "Path is outside the workspace."
    assert error(".ssh/k.png") == "Reading credential paths is not allowed."
    assert error(".SSH/k.png") == "Reading credential paths is not allowed."
    assert error("keys/k.png") == "Reading credential paths is not allowed."
    assert error(".crystal/credentials.json") == "Reading credential paths is not allowed."


def test_load_image_folder_swapped_after_the_checks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A folder swapped for a link outside between the checks and the open is not read.

    ``O_NOFOLLOW`` covers the last name only; the swap is made during the credential
    check, after the path was found inside the workspace.
    """
    from toolsetd.daemon import output

    root = Path(os.path.realpath(tmp_path))
    ws, outside = root / "ws", root / "hidden"
    (ws / "img").mkdir(parents=True)
    (ws / "img" / "a.png").write_bytes(PNG)
    outside.mkdir()
    (outside / "a.png").write_bytes(PNG + b"outside")
    real = output.is_credential_identity

    def swap_then_check(*args: object) -> bool:
        (ws / "img").rename(ws / "was-img")
        (ws / "img").symlink_to(outside)
        return real(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(output, "is_credential_identity", swap_then_check)
    with pytest.raises(ContentError) as info:
        load_image(ImageSpec(mime_type="image/png", path="img/a.png"), ws, 20 * MiB)
    assert info.value.message == "The image file could not be read."


def test_content_result_image_failure_appends_stderr(tmp_path: Path) -> None:
    """An image load failure fails the call with the error and stderr."""
    stdout = '{"text": "t", "images": [{"mimeType": "image/png", "path": "nope.png"}]}'
    assert _content(stdout, "log", workspace=tmp_path) == (
        [{"type": "text", "text": "File not found: nope.png\nlog"}],
        True,
    )


@pytest.mark.parametrize(
    ("path", "expected"),
    [
        ("/home/u/.ssh/id_rsa", True),
        ("C:\\Users\\u\\.GnuPG\\x", True),
        ("/w/.crystal/credentials.json", True),
        ("/w/.ssh/", True),
        ("/w/.ssh.bak/x", False),
        ("/w/credentials.json", False),
        ("/w/.crystal/x/credentials.json", False),
    ],
)
def test_is_credential_path(path: str, expected: bool) -> None:
    """Credential segments are matched whole and case-insensitively."""
    assert is_credential_path(path) is expected


@pytest.mark.parametrize(
    ("call_id", "safe"),
    [("abc-1.2_x", True), ("../../etc/passwd", False), ("", False), (".hidden", False),
     ("a/b", False), ("x" * 200, False)],
)
def test_spill_name_is_safe(call_id: str, safe: bool) -> None:
    """Call ids become plain file names; changed ones get a digest so they stay distinct."""
    name = spill_name(call_id)
    assert "/" not in name
    assert not name.startswith(".")
    assert name
    assert len(name) <= 100
    assert (name == call_id) is safe
    assert spill_name("a/b") != spill_name("a_b")


def test_spill_streams_caps_and_marks(tmp_path: Path) -> None:
    """Streamed stdout and stderr are assembled in order, capped, and marked."""
    ws = Path(os.path.realpath(tmp_path))
    spill = Spill(ws, ws / "out", "c", cap=10, keep=100, max_age_seconds=3600)
    spill.write(0, b"0123456")
    spill.write(1, b"abcdef")
    result = spill.finish(b"", b"", 7, 6)
    assert result is not None
    assert result.capped
    assert result.total_bytes == 14
    assert (ws / "out" / "c").read_bytes() == b"0123456\nab\n[output capped at 10 of 14 bytes]\n"
    assert os.listdir(ws / "out") == ["c"]
    assert oct((ws / "out" / "c").stat().st_mode & 0o777) == "0o600"


def test_spill_from_memory_and_discard(tmp_path: Path) -> None:
    """Unstreamed output is written from memory; discard removes streamed files."""
    ws = Path(os.path.realpath(tmp_path))
    spill = Spill(ws, ws / "out", "c", cap=100, keep=100, max_age_seconds=3600)
    result = spill.finish(b"", b"err", 0, 3)
    assert result is not None
    assert not result.capped
    assert (ws / "out" / "c").read_bytes() == b"err"
    spill = Spill(ws, ws / "out", "d", cap=100, keep=100, max_age_seconds=3600)
    spill.write(1, b"x")
    spill.discard()
    assert os.listdir(ws / "out") == ["c"]


def test_spill_stderr_temp_swapped_for_a_link_is_not_followed(tmp_path: Path) -> None:
    """A stderr temp file swapped for a link: the spill holds what was written, not its target."""
    ws = Path(os.path.realpath(tmp_path)) / "ws"
    ws.mkdir()
    secret = tmp_path / "secret"
    secret.write_bytes(b"SECRET")
    spill = Spill(ws, ws / "out", "c", cap=100, keep=100, max_age_seconds=3600)
    spill.write(1, b"err")
    temp = ws / "out" / ".c.stderr"
    temp.unlink()
    temp.symlink_to(secret)
    result = spill.finish(b"out", b"", 3, 3)
    assert result is not None
    assert (ws / "out" / "c").read_bytes() == b"out\nerr"
    assert secret.read_bytes() == b"SECRET"
    # The daemon removes its own temp file only: the tool's link at that name stays.
    assert sorted(os.listdir(ws / "out")) == [".c.stderr", "c"]
    assert temp.is_symlink()


def test_spill_folder_swapped_for_a_link_is_not_followed(tmp_path: Path) -> None:
    """A folder swapped for a link after the spill began: nothing is written, named or pruned
    through the link, the path is not reported, and the daemon's file is removed."""
    ws = Path(os.path.realpath(tmp_path)) / "ws"
    ws.mkdir()
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "old").write_text("precious")
    os.utime(victim / "old", (time.time() - 86400, time.time() - 86400))
    spill = Spill(ws, ws / "out", "c", cap=100, keep=0, max_age_seconds=60)
    spill.write(0, b"data")
    (ws / "out").rename(ws / "moved")
    (ws / "out").symlink_to(victim)
    with capture_logs() as logs:
        assert spill.finish(b"", b"err", 4, 3) is None
    assert [e["error"] for e in logs if e["event"] == "spill_failed"] == [
        "the folder or the file was replaced while the call ran"
    ]
    assert os.listdir(victim) == ["old"]
    assert (victim / "old").read_text() == "precious"
    assert os.listdir(ws / "moved") == []


def test_spill_file_swapped_for_a_link_is_not_reported(tmp_path: Path) -> None:
    """The spill file swapped for a link to another file: no path leads the client there."""
    ws = Path(os.path.realpath(tmp_path)) / "ws"
    ws.mkdir()
    secret = tmp_path / "secret"
    secret.write_text("SECRET")
    spill = Spill(ws, ws / "out", "c", cap=100, keep=100, max_age_seconds=3600)
    spill.write(0, b"data")
    (ws / "out" / "c").unlink()
    (ws / "out" / "c").symlink_to(secret)
    assert spill.finish(b"", b"", 4, 0) is None
    assert os.listdir(ws / "out") == ["c"]  # the tool's link: not the daemon's to remove
    assert (ws / "out" / "c").is_symlink()
    assert secret.read_text() == "SECRET"


def test_spill_never_opens_what_was_planted_at_its_name(tmp_path: Path) -> None:
    """A FIFO or a hard link left at the file's name is replaced, never opened or written."""
    ws = Path(os.path.realpath(tmp_path)) / "ws"
    (ws / "out").mkdir(parents=True)
    os.mkfifo(ws / "out" / "c")  # opening it to write would block the daemon for good
    other = ws / "other"
    other.write_text("keep me")
    os.link(other, ws / "out" / ".c.stderr")
    spill = Spill(ws, ws / "out", "c", cap=100, keep=100, max_age_seconds=3600)
    spill.write(0, b"data")
    spill.write(1, b"err")
    result = spill.finish(b"", b"", 4, 3)
    assert result is not None
    assert (ws / "out" / "c").read_bytes() == b"data\nerr"
    assert other.read_text() == "keep me"


def test_spill_refuses_folder_outside_workspace(tmp_path: Path) -> None:
    """A spill folder that resolves outside the workspace (a planted link) is not written."""
    ws = Path(os.path.realpath(tmp_path)) / "ws"
    ws.mkdir()
    (tmp_path / "elsewhere").mkdir()
    (ws / "out").symlink_to(tmp_path / "elsewhere")
    spill = Spill(ws, ws / "out", "c", cap=100, keep=100, max_age_seconds=3600)
    spill.write(0, b"data")
    assert spill.finish(b"", b"", 4, 0) is None
    assert os.listdir(tmp_path / "elsewhere") == []


def test_prune_by_age_and_count(tmp_path: Path) -> None:
    """Files past the age go, then all but the newest N; links and dirs are left alone."""
    now = time.time()
    for i in range(6):
        path = tmp_path / f"f{i}"
        path.write_text("x")
        os.utime(path, (now - i * 10, now - i * 10))
    old_temp = tmp_path / ".f.stderr"
    old_temp.write_text("x")
    os.utime(old_temp, (now - 1000, now - 1000))
    (tmp_path / ".new.stderr").write_text("x")
    (tmp_path / "sub").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "sub")
    folder = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        removed = prune(folder, keep=2, max_age_seconds=45, now=now)
    finally:
        os.close(folder)
    assert removed == 5
    assert sorted(os.listdir(tmp_path)) == [".new.stderr", "f0", "f1", "link", "sub"]


def test_a_spill_that_cannot_be_written_says_why_once(tmp_path: Path) -> None:
    """The full output of a truncated call that cannot be kept is logged, once, with why."""
    ws = Path(os.path.realpath(tmp_path))
    (ws / "out").write_text("a file where the folder should be")
    spill = Spill(ws, ws / "out", "c", cap=100, keep=100, max_age_seconds=3600)
    with capture_logs() as logs:
        spill.write(0, b"data")
        spill.write(1, b"more")
        assert spill.finish(b"", b"", 4, 4) is None
    failed = [e for e in logs if e["event"] == "spill_failed"]
    assert len(failed) == 1, logs
    assert failed[0]["folder"] == str(ws / "out")
    assert "File exists" in failed[0]["error"] or "Not a directory" in failed[0]["error"]


def test_open_folder_within_makes_folders_and_follows_no_link(tmp_path: Path) -> None:
    """A link anywhere below the root stops it: nothing is made or opened outside."""
    root, outside = tmp_path / "ws", tmp_path / "outside"
    root.mkdir()
    outside.mkdir()
    fd = open_folder_within(str(root), str(root / ".crystal" / "data" / "tools" / "s"))
    os.close(fd)
    assert (root / ".crystal" / "data" / "tools" / "s").is_dir()
    (root / "linked").symlink_to(outside)
    refused = f"{os.strerror(errno.ELOOP)}|{os.strerror(errno.ENOTDIR)}"  # a link on the way
    for folder in (root / "linked" / "s", root / "linked"):
        with pytest.raises(OSError, match=refused):
            open_folder_within(str(root), str(folder))
    assert list(outside.iterdir()) == []
    with pytest.raises(ValueError, match="is not below"):
        open_folder_within(str(root), str(outside / "s"))


def test_spill_names_are_one_to_one() -> None:
    """An id that is already safe but ends like a digested one is digested too."""
    unsafe, safe = spill_name("job:1"), "job_1-d1e888ce6b72"
    assert unsafe == safe  # what "job:1" becomes
    assert spill_name(safe) != unsafe
    assert spill_name("plain-id") == "plain-id"
    assert spill_name("0123456789abcdef0123456789abcdef") == "0123456789abcdef0123456789abcdef"


def test_spill_failure_removes_its_own_file_not_another_calls(tmp_path: Path) -> None:
    """A spill that fails removes the file it wrote, never what is at the name now."""
    ws = Path(os.path.realpath(tmp_path)) / "ws"
    ws.mkdir()
    a = Spill(ws, ws / "out", "c", cap=100, keep=100, max_age_seconds=3600)
    a.write(0, b"mine")
    (ws / "out" / "c").unlink()
    (ws / "out" / "c").write_text("another call's")  # the name now leads elsewhere
    assert a.finish(b"", b"", 4, 0) is None
    assert (ws / "out" / "c").read_text() == "another call's"


def test_prune_keeps_the_newest_from_a_streamed_listing(tmp_path: Path) -> None:
    """All but the ``keep`` newest go (the listing is streamed into a heap of that size)."""
    folder = tmp_path / "out"
    folder.mkdir()
    for i in range(5):
        (folder / f"f{i}").write_text("x")
        os.utime(folder / f"f{i}", (1000 + i, 1000 + i))
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        assert prune(fd, keep=2, max_age_seconds=1e12, now=2000) == 3
        assert sorted(os.listdir(folder)) == ["f3", "f4"]
    finally:
        os.close(fd)
