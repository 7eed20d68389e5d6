"""toolsetd's command line: every option is described, limits are checked."""

from __future__ import annotations

import pytest

from toolsetd.daemon.app import parse_args
from toolsetd.daemon.settings import ConfigError, build_parser


def test_every_option_has_a_description() -> None:
    """``toolsetd --help`` says what each flag does (issue 11: six had no text)."""
    actions = build_parser("0")._actions  # noqa: SLF001 (argparse has no public list)
    missing = [a.option_strings for a in actions if a.option_strings and not a.help]
    assert missing == []


def test_output_limit_is_bounded_by_the_line_budget() -> None:
    """A result must fit the longest line the daemon sends (docs/protocol.md, Limits)."""
    with pytest.raises(ConfigError, match="--output-limit: must be at most 1000000"):
        parse_args(["--output-limit", "1000001"])
    assert parse_args(["--output-limit", "1000000"]).runner.output_limit_chars == 1_000_000
