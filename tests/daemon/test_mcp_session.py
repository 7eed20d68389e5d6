"""Unit tests for ``toolsetd.daemon.mcp_session``'s pure helpers (the session itself is
driven through a real daemon in tests/integration/test_mcp.py)."""

from __future__ import annotations

from pathlib import Path

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
        # JSON Schema's integer is a number whose fraction is zero, however written
        # (fccc697); decided in decimal, never through a float.
        ("0.0", True),
        ("1e2", True),
        ("1.5", False),
        ("1e-2", False),
        ("1.0000000000000000001", False),  # a float's 1.0, but no integer
        ("1.5e99999999999999999999999", False),  # past decimal's exponent: refused (692d00a)
        ("true", False),
        ("{}", False),
        ("[]", False),
    ],
)
def test_a_progress_token_is_a_string_or_a_json_integer(text: str, taken: bool) -> None:
    assert _is_progress_token(loads(text.encode())) is taken


def test_a_bind_names_its_first_unknown_field_as_sent(tmp_path: Path) -> None:
    """mcp.bind (and the HTTP query, by the same check) names the first unknown field in
    the order sent, as every native params error does; it sorted all of them first, which
    for a 16 MiB bind of 1.6 million stray keys held the event loop 0.7 s longer."""
    from toolsetd.daemon.mcp_session import Binding
    from toolsetd.protocol.errors import InvalidParams

    with pytest.raises(InvalidParams) as caught:
        Binding.from_params({"workspace": str(tmp_path), "zeta": 1, "alpha": 2})
    assert caught.value.data == {"field": "zeta"}
    assert "unknown field 'zeta'" in caught.value.message
