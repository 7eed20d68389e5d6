"""Tables and limits that must agree: docs/cli.md with the code, the CLI reader with the codec."""

from __future__ import annotations

import re
from pathlib import Path

from toolsetd.client import cli, exits

DOC = (Path(__file__).resolve().parents[2] / "docs" / "cli.md").read_text()


def _first_column(section: str) -> list[int]:
    body = DOC.split(section, 1)[1].split("\n#", 1)[0]
    return [int(m.group(1)) for m in re.finditer(r"^\| (-?\d+) \|", body, re.M)]


def test_cli_docs_exit_code_table_matches_the_code() -> None:
    """Every EXIT_* constant has exactly one row in docs/cli.md, and no row is extra."""
    codes = {value for name, value in vars(exits).items() if name.startswith("EXIT_")}
    rows = _first_column("## Exit codes")
    assert sorted(rows) == sorted(codes)
    assert DOC.count("## Exit codes") == 1


def test_cli_docs_error_code_table_matches_the_code() -> None:
    """The error.code table lists exactly toolsetctl's own codes."""
    assert sorted(_first_column("### `error.code`")) == sorted(exits.CLI_ERROR_CODES.values())


def test_cli_exits_docstring_table_matches_the_code() -> None:
    """The table in exits.py's docstring has the same codes as the constants."""
    assert exits.__doc__ is not None
    rows = [int(m.group(1)) for m in re.finditer(r"^(\d+)\s{2,}\S", exits.__doc__, re.M)]
    codes = {value for name, value in vars(exits).items() if name.startswith("EXIT_")}
    assert sorted(rows) == sorted(codes)


def test_blocking_client_accepts_the_frames_the_codec_allows() -> None:
    """The CLI's reader and the async client take the longest line the daemon sends."""
    from toolsetd.client import blocking, client
    from toolsetd.protocol import codec

    assert blocking.MAX_LINE_BYTES == codec.MAX_DAEMON_LINE
    assert client._DEFAULT_MAX_FRAME == codec.MAX_DAEMON_LINE
