"""Tables and limits that must agree: docs/cli.md with the code, the CLI reader with the codec."""

from __future__ import annotations

import re
from pathlib import Path

from toolsetd.client import exits

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


def test_cli_help_names_every_exit_code() -> None:
    """``toolsetctl --help`` ends with the exit codes: it left out 129 and 143, which a CI
    job's cancel gives."""
    from toolsetd.client.parser import build_parser

    epilog = build_parser().epilog or ""
    codes = {value for name, value in vars(exits).items() if name.startswith("EXIT_")}
    assert {int(n) for n in re.findall(r"(?<![\w.])(\d+) [a-z]", epilog)} == codes, epilog


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


def test_cli_docs_give_every_command_a_section_with_its_options() -> None:
    """Each toolsetctl subcommand has a ``### `name ...``` heading in docs/cli.md that
    names every option of its own, and no option it does not have; the global options
    have their table."""
    import argparse

    from toolsetd.client.parser import COMMANDS, build_parser

    parser = build_parser()
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    assert set(commands.choices) == set(COMMANDS)
    headings = re.findall(r"^### `(.+)$", DOC, re.M)
    global_rows = _global_options_in_docs()
    for name, sub in commands.choices.items():
        heading = next((h for h in headings if re.search(rf"(^|`|/ `){name}\b", h)), None)
        assert heading is not None, name
        own = {o for a in sub._actions for o in a.option_strings if o.startswith("--")}
        own -= global_rows | {"--help"}
        named = set(re.findall(r"--[a-z][a-z-]*", heading))
        assert own == named, (name, heading)
    top = {o for a in parser._actions for o in a.option_strings if o.startswith("--")}
    assert top - {"--help", "--version"} == global_rows


def _global_options_in_docs() -> set[str]:
    body = DOC.split("## Global options", 1)[1].split("\n## ", 1)[0]
    return {
        flag
        for row in re.findall(r"^\| `([^|]+)", body, re.M)
        for flag in re.findall(r"--[a-z-]+", row)
    }


def test_mcp_help_says_headless_as_the_docs_do() -> None:
    """``toolsetctl mcp --help`` said ``--headless`` denies every call that needs approval;
    a ``review`` still goes to the host, which stands in for the reviewer (docs/mcp.md),
    and the host is asked. The line says what the other commands' ``--headless`` says,
    and that a review still goes to the host."""
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-m", "toolsetd.client", "mcp", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    option = out.split("--headless", 2)[2].split("\n  --", 1)[0]  # its text, wrapped
    line = " ".join(option.split())
    assert "every 'ask' becomes 'deny'" in line, line
    assert "a 'review' still goes to the host" in line, line
    doc = (Path(__file__).resolve().parents[2] / "docs" / "mcp.md").read_text()
    assert "a `review` is still sent to the host" in doc
