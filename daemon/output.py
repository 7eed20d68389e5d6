"""The model-facing text of an exec call: text mode, truncation, content mode and images.

Theory of operation: everything here is a pure function of what the runner captured
(decoded stdout/stderr prefixes, the exit code) except :func:`load_image`, which reads an
image file named by a content-mode tool (call it off the event loop). Messages are the
reference host's, character for character (``reference/crystal-behaviour.md`` sections 3
and 3.1); the runner adds toolsetd's spill hint after the truncation marker.

* Text mode: ``exit <code>\\n`` + combined, where combined is stdout alone when stderr is
  empty, stderr alone when stdout is empty, else stdout + ``\\n`` + stderr.
* Truncation: a text longer than the limit is cut to its first ``limit`` characters followed
  by ``\\n[truncated to <limit> characters]``.
* Content mode: stdout is one JSON object ``{"text"?, "images"?}``; the checks run in the
  reference order and the first failure is the call's text. Images are decoded (base64) or
  read (a path inside the workspace), sniffed and checked against the declared mimeType;
  the result carries the sniffed type and the bytes as base64 without whitespace.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import json
import os
import re
import stat
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson
from toolsetd.protocol.errors import reject_json_constant
from toolsetd.protocol.jsontext import LARGE_TEXT, allocations_checked, nesting_exceeds

from .paths import (
    NET_WHITESPACE,
    expand_user,
    is_credential_identity,
    is_credential_path,
    opened_directory_name,
    trim_path,
)

__all__ = [
    "CANCELLED_TEXT",
    "MAX_IMAGES",
    "MAX_IMAGE_BYTES",
    "MAX_OUTPUT_LIMIT_CHARS",
    "MAX_RESULT_IMAGE_BYTES",
    "OUTPUT_LIMIT_TEXT",
    "ContentError",
    "ContentOutput",
    "ImageSpec",
    "cancelled_text",
    "combine",
    "content_result",
    "io_failure_text",
    "is_credential_path",  # re-exported from paths: the one credential-path check
    "load_image",
    "output_limit_text",
    "parse_content",
    "sniff_image",
    "start_failure_text",
    "text_result",
    "timeout_text",
    "truncate",
]

CANCELLED_TEXT = "The call was cancelled."
MAX_IMAGES = 8
#: One image's limit (the reference host's): 20 MiB.
MAX_IMAGE_BYTES = 20 * 1024 * 1024
#: All images of one result together: 32 MiB decoded, about 42.7 MiB of base64, so the
#: largest result (images plus a text of the largest output limit) fits the 64 MiB line
#: the daemon may send (``protocol.codec.MAX_DAEMON_LINE``; docs/protocol.md, Limits).
MAX_RESULT_IMAGE_BYTES = 32 * 1024 * 1024
#: The largest ``--output-limit``: a text of this many characters is at most 6 MB of JSON
#: (``\u0001`` is the longest escape of one character), which the line budget above holds.
MAX_OUTPUT_LIMIT_CHARS = 1_000_000
OUTPUT_LIMIT_TEXT = "Tool output exceeds the output limit."
_BODY_PREVIEW = 2000
#: The deepest nesting of objects and arrays the reference host's JSON reader takes.
_MAX_CONTENT_DEPTH = 64
_SURROGATE = re.compile("[\ud800-\udfff]")
#: .NET's ``char.IsWhiteSpace``, which the reference host strips from base64 (``\s`` would
#: also strip U+001C..U+001F).
_WHITESPACE = re.compile("[" + re.escape(NET_WHITESPACE) + "]+")


class ContentError(Exception):
    """A content-mode failure; ``message`` is the model-facing text (without stderr)."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


@dataclass(frozen=True, slots=True)
class ImageSpec:
    """One declared image: exactly one of ``base64`` or ``path`` is set."""

    mime_type: str
    base64: str | None = None
    path: str | None = None


@dataclass(frozen=True, slots=True)
class ContentOutput:
    """A parsed content object: the text (``""`` when absent) and the declared images."""

    text: str
    images: tuple[ImageSpec, ...]


def combine(stdout: str, stderr: str) -> str:
    """Combine the two streams as the reference host does (LF between, only when both)."""
    if not stderr:
        return stdout
    if not stdout:
        return stderr
    return f"{stdout}\n{stderr}"


def text_result(exit_code: int, stdout: str, stderr: str) -> str:
    """The text-mode result text: ``exit <code>`` line, then the combined output."""
    return f"exit {exit_code}\n{combine(stdout, stderr)}"


def truncate(text: str, limit: int) -> tuple[str, bool]:
    """Cut ``text`` to ``limit`` characters with the reference marker.

    Returns:
        The (possibly cut) text and whether it was cut.
    """
    if len(text) <= limit:
        return text, False
    return f"{text[:limit]}\n[truncated to {limit} characters]", True


def timeout_text(seconds: int) -> str:
    """The reference host's timeout sentence."""
    unit = "second" if seconds == 1 else "seconds"
    return f"The command timed out after {seconds} {unit}."


def cancelled_text() -> str:
    """The text of a call cancelled by the client."""
    return CANCELLED_TEXT


def start_failure_text(message: str | None) -> str:
    """The text of a process that could not be started."""
    if not message:
        return "The external process failed to start."
    return f"The external process failed to start: {message}"


def io_failure_text(message: str) -> str:
    """The text of an I/O failure on the child's stdin or output."""
    return f"The external process stdin or output failed: {message}"


# ---------------------------------------------------------------------------------------
# content mode


def _with_stderr(message: str, stderr: str) -> str:
    return f"{message}\n{stderr}" if stderr else message


def _exit_prefixed(exit_code: int, message: str) -> str:
    return f"exit {exit_code}\n{message}" if exit_code != 0 else message


def _optional_string(obj: Mapping[str, Any], key: str, type_message: str, empty: str) -> str | None:
    value = obj.get(key)
    if value is None:
        return None
    if not isinstance(value, str):
        raise ContentError(type_message)
    if not value.strip(NET_WHITESPACE):  # .NET's IsNullOrWhiteSpace, as the reference host
        raise ContentError(empty)
    return value


def output_limit_text(stdout_bytes: int | None, limit: int) -> str:
    """The reference message for a content stdout over the limit, with the figures and the fix.

    Args:
        stdout_bytes: How many bytes the tool wrote to stdout, when known.
        limit: The output limit in characters.

    Returns:
        ``Tool output exceeds the output limit.`` followed by how big the output was, the
        limit, and that images returned by ``path`` do not count against it; the reference
        sentence alone when that would not fit the limit itself (it would be cut).
    """
    size = f"stdout was {stdout_bytes:,} bytes" if stdout_bytes is not None else "stdout was longer"
    text = (
        f"{OUTPUT_LIMIT_TEXT} ({size}; the limit is {limit:,} characters.) Return large images "
        'by "path" (a file in the workspace) instead of inline "base64": an image file does '
        "not count against the output limit."
    )
    return text if len(text) <= limit else OUTPUT_LIMIT_TEXT


def _any_number(text: str) -> int:
    """``parse_int``/``parse_float`` of the lenient read: a number's value is never used."""
    return 0


def _carries_surrogate(value: Mapping[str, Any]) -> bool:
    """Whether a string the result would carry (``text``, an image's ``mimeType``,
    ``base64`` or ``path``) holds a lone surrogate, which no answer can encode."""
    images = value.get("images")
    items = images if isinstance(images, list) else []
    strings = [value.get("text")]
    keys = ("mimeType", "base64", "path")
    strings += [item.get(key) for item in items if isinstance(item, dict) for key in keys]
    return any(isinstance(s, str) and _SURROGATE.search(s) is not None for s in strings)


#: ``_content_json``'s mark for a body orjson has not read.
_UNREAD: Any = object()


def _content_json(body: str) -> Any:
    """The content object as the reference host's ``JsonDocument.Parse`` reads it, else None.

    orjson refuses a number beyond a double (``1e400``, a 500-digit integer) and a lone
    surrogate escape; System.Text.Json keeps any number's text and checks an escape only
    when that string is read. Such a body is read again leniently (its numbers' values are
    never used), and refused only if a string the result would carry has a lone surrogate.
    System.Text.Json also refuses nesting deeper than 64 levels (orjson reads 1,024).

    A body that may be over ``LARGE_TEXT`` in UTF-8 (over a quarter of it in characters)
    is read leniently at once: orjson does not survive running out of memory while it
    makes a string (``jsontext.loads_large``), and the lenient reading is what it gives
    wherever orjson would give a value (the depth past which the standard library stops is
    far past the 64 levels allowed). So is every body when allocations can fail
    (``jsontext.check_allocations``).
    """
    value: Any = _UNREAD
    if len(body) <= LARGE_TEXT // 4 and not allocations_checked():
        with contextlib.suppress(orjson.JSONDecodeError):
            value = orjson.loads(body)
    if value is _UNREAD:
        try:
            value = json.loads(
                body,
                parse_int=_any_number,
                parse_float=_any_number,
                parse_constant=reject_json_constant,
            )
        except (ValueError, RecursionError):
            return None
        if isinstance(value, dict) and _carries_surrogate(value):
            return None
    if isinstance(value, dict) and nesting_exceeds(value, _MAX_CONTENT_DEPTH):
        return None
    return value


def parse_content(stdout: str, limit: int, stdout_bytes: int | None = None) -> ContentOutput:
    """Parse a content-mode stdout in the reference order of checks.

    Args:
        stdout: The decoded stdout (at most ``limit + 1`` characters are needed).
        limit: The output limit in characters.
        stdout_bytes: The whole stdout's size in bytes, for the over-the-limit message.

    Returns:
        The text and the declared images.

    Raises:
        ContentError: The first failing check's message.
    """
    if len(stdout) > limit:
        raise ContentError(output_limit_text(stdout_bytes, limit))
    # The reference host's TrimStart('\uFEFF').Trim(): every leading byte order mark, then
    # .NET's white space (Python's strip would also take U+001C..U+001F).
    body = stdout.lstrip("\ufeff").strip(NET_WHITESPACE)
    value = _content_json(body)
    if not isinstance(value, dict):
        message = "Tool output is not valid content JSON."
        if body:
            message += "\n" + body[:_BODY_PREVIEW]
        raise ContentError(message)
    text = value.get("text")
    if text is not None and not isinstance(text, str):
        raise ContentError("Content text must be a string.")
    raw_images = value.get("images")
    if raw_images is None:
        raw_images = []
    if not isinstance(raw_images, list):
        raise ContentError("Content images must be an array.")
    images: list[ImageSpec] = []
    for item in raw_images:
        # As the reference host: each image is checked as the walk reaches it, and the
        # ninth is refused only then, so a bad image among the first eight is reported.
        if len(images) >= MAX_IMAGES:
            raise ContentError(f"A tool can return at most {MAX_IMAGES} images.")
        if not isinstance(item, dict):
            raise ContentError("Each content image must be a JSON object.")
        mime = item.get("mimeType")
        if not isinstance(mime, str) or not mime.strip(NET_WHITESPACE):
            raise ContentError("Each content image requires mimeType.")
        has_b64 = item.get("base64") is not None
        has_path = item.get("path") is not None
        if has_b64 == has_path:
            raise ContentError("An image must set exactly one of base64 or path.")
        if has_b64:
            data = _optional_string(
                item, "base64", "Image base64 must be a string.", "Image base64 cannot be empty."
            )
            images.append(ImageSpec(mime_type=mime.strip(NET_WHITESPACE), base64=data))
        else:
            path = _optional_string(
                item, "path", "Image path must be a string.", "Image path cannot be empty."
            )
            images.append(ImageSpec(mime_type=mime.strip(NET_WHITESPACE), path=path))
    return ContentOutput(text=text or "", images=tuple(images))


def sniff_image(data: bytes) -> str | None:
    """The MIME type of PNG, JPEG, GIF or WebP bytes, else None."""
    if data.startswith(b"\x89PNG\r\n\x1a\n"):
        return "image/png"
    if data.startswith(b"\xff\xd8\xff"):
        return "image/jpeg"
    if data.startswith((b"GIF87a", b"GIF89a")):
        return "image/gif"
    if len(data) >= 12 and data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "image/webp"
    return None


def _size_limit_message(max_bytes: int) -> str:
    mib = max_bytes / (1024 * 1024)
    return f"The image file exceeds the {mib:g} MiB host limit."


def _check_bytes(data: bytes, declared: str, max_bytes: int) -> dict[str, str]:
    if len(data) > max_bytes:
        raise ContentError(_size_limit_message(max_bytes))
    sniffed = sniff_image(data)
    if sniffed is None:
        raise ContentError("The file is not a supported PNG, JPEG, GIF, or WebP image.")
    if sniffed != declared.lower():
        raise ContentError("Image bytes do not match mimeType.")
    return {"type": "image", "data": base64.b64encode(data).decode("ascii"), "mimeType": sniffed}


def _read_image_file(
    raw: str,
    workspace: Path,
    max_bytes: int,
    user_home: Path | None,
    crystal_home: Path | None = None,
) -> bytes:
    # As the reference host's Workspace.TryResolveExistingFile: trim, expand ``~``/``~/``,
    # join to the workspace, fold ``..`` (GetFullPath), then resolve the links.
    home = user_home if user_home is not None else Path.home()
    root = os.path.normpath(str(workspace))
    joined = os.path.normpath(os.path.join(root, expand_user(trim_path(raw), home)))
    if is_credential_path(raw) or is_credential_path(joined):
        raise ContentError("Reading credential paths is not allowed.")
    resolved = os.path.realpath(joined)
    if is_credential_path(resolved) or is_credential_identity(resolved, home, crystal_home):
        raise ContentError("Reading credential paths is not allowed.")
    if resolved != root and not resolved.startswith(root.rstrip("/") + "/"):
        raise ContentError("Path is outside the workspace.")
    rel = os.path.relpath(resolved, root)
    try:
        st = os.stat(resolved)
    except FileNotFoundError:
        raise ContentError(f"File not found: {rel}") from None
    except OSError:
        raise ContentError("The image file could not be read.") from None
    if stat.S_ISDIR(st.st_mode):
        raise ContentError(f"Path is a directory: {rel}")
    if not stat.S_ISREG(st.st_mode):
        raise ContentError("The image file could not be read.")
    if st.st_size == 0:
        raise ContentError("The image file is empty.")
    if st.st_size > max_bytes:
        raise ContentError(_size_limit_message(max_bytes))
    flags = os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK
    try:
        fd = os.open(resolved, flags)
    except OSError:
        raise ContentError("The image file could not be read.") from None
    try:
        # The file could have been swapped since the stat: check the opened object again.
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ContentError("The image file could not be read.")
        # O_NOFOLLOW guards the last name only: a folder on the way swapped for a link
        # since the checks (by another call writing the workspace) would lead elsewhere.
        # What was opened must still be the file the checked path names.
        if opened_directory_name(fd, resolved) != resolved:
            raise ContentError("The image file could not be read.")
        chunks: list[bytes] = []
        size = 0
        while size <= max_bytes:
            chunk = os.read(fd, min(1 << 20, max_bytes + 1 - size))
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
    except OSError:
        raise ContentError("The image file could not be read.") from None
    finally:
        os.close(fd)
    data = b"".join(chunks)
    if not data:
        raise ContentError("The image file is empty.")
    return data


def load_image(
    spec: ImageSpec,
    workspace: Path,
    max_bytes: int,
    user_home: Path | None = None,
    crystal_home: Path | None = None,
) -> dict[str, str]:
    """Load one declared image into a content block (blocking: call it off the loop).

    Args:
        spec: The declared image.
        workspace: The canonical workspace; a path must resolve inside it.
        max_bytes: The per-image size limit.
        user_home: The operator's user profile, whose credential files a path may not be
            (by name or by identity); None for the process's home.
        crystal_home: The Crystal home, whose ``credentials.json`` a path may not be.

    Returns:
        ``{"type": "image", "data": <base64>, "mimeType": <sniffed>}``.

    Raises:
        ContentError: With the reference host's message.
    """
    if spec.base64 is not None:
        compact = _WHITESPACE.sub("", spec.base64)
        if len(compact) // 4 * 3 > max_bytes + 3:
            raise ContentError(_size_limit_message(max_bytes))
        try:
            data = base64.b64decode(compact, validate=True)
        except (binascii.Error, ValueError):
            raise ContentError("Image base64 is not valid.") from None
        if not data:
            raise ContentError("Image base64 is not valid.")
        return _check_bytes(data, spec.mime_type, max_bytes)
    assert spec.path is not None
    data = _read_image_file(spec.path, workspace, max_bytes, user_home, crystal_home)
    return _check_bytes(data, spec.mime_type, max_bytes)


def content_result(
    stdout: str,
    stderr: str,
    exit_code: int,
    *,
    limit: int,
    images_ok: bool,
    workspace: Path,
    max_image_bytes: int,
    max_total_image_bytes: int = MAX_RESULT_IMAGE_BYTES,
    stdout_bytes: int | None = None,
    user_home: Path | None = None,
    crystal_home: Path | None = None,
) -> tuple[list[dict[str, str]], bool]:
    """The content blocks and error flag of a content-mode call (blocking when images load).

    Args:
        stdout: The decoded stdout prefix (``limit + 1`` characters suffice).
        stderr: The decoded stderr prefix.
        exit_code: The child's exit code.
        limit: The output limit in characters.
        images_ok: Whether the caller can take images (the multimodal channel).
        workspace: The canonical workspace for image paths.
        max_image_bytes: The per-image size limit.
        max_total_image_bytes: The limit of all images of the result together.
        stdout_bytes: The whole stdout's size in bytes (for the over-the-limit message).
        user_home: The operator's user profile (credential files by identity).
        crystal_home: The Crystal home (its ``credentials.json`` is a credential file).

    Returns:
        The content blocks (text blocks not yet truncated) and ``is_error``.
    """
    try:
        parsed = parse_content(stdout, limit, stdout_bytes)
    except ContentError as exc:
        text = _exit_prefixed(exit_code, _with_stderr(exc.message, stderr))
        return [{"type": "text", "text": text}], True
    text = combine(parsed.text, stderr)
    if exit_code != 0:
        return [{"type": "text", "text": f"exit {exit_code}\n{text}"}], True
    if not parsed.images:
        return [{"type": "text", "text": text}], False
    if not images_ok:
        return [{"type": "text", "text": "This model cannot accept tool images."}], True
    blocks: list[dict[str, str]] = [{"type": "text", "text": text}]
    total = 0
    for spec in parsed.images:
        try:
            block = load_image(spec, workspace, max_image_bytes, user_home, crystal_home)
            data = block["data"]
            total += len(data) // 4 * 3 - data[-2:].count("=")
            if total > max_total_image_bytes:
                raise ContentError(_total_limit_message(total, max_total_image_bytes))
            blocks.append(block)
        except ContentError as exc:
            return [{"type": "text", "text": _with_stderr(exc.message, stderr)}], True
    return blocks, False


def _total_limit_message(total: int, max_bytes: int) -> str:
    mib = 1024 * 1024
    return (
        f"The images of this result exceed the {max_bytes / mib:g} MiB limit of one result "
        f"(at least {total / mib:.1f} MiB so far); return fewer or smaller images."
    )
