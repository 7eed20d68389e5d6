"""Unit tests for ``toolsetd.daemon.mcp_session``'s pure helpers (the session itself is
driven through a real daemon in tests/integration/test_mcp.py)."""

from __future__ import annotations

import pytest

from toolsetd.daemon.mcp_session import _is_progress_token
from toolsetd.protocol.jsontext import loads


@pytest.mark.parametrize(
    ("text", "taken"),
    [
        ('"abc"', True),
        ("7", True),
        ("-0", True),  # an integer in JSON's grammar, kept as a number with its text
        (str(2**80), True),
        ("0.0", False),
        ("1e2", False),
        ("true", False),
        ("{}", False),
        ("[]", False),
    ],
)
def test_a_progress_token_is_a_string_or_a_json_integer(text: str, taken: bool) -> None:
    assert _is_progress_token(loads(text.encode())) is taken
