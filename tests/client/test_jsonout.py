"""``jsonout.dumps``: every number as the daemon wrote it, json's C encoder where it can."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from decimal import Decimal
from types import FrameType
from typing import Any

import pytest
from toolsetd.client.blocking import read_json
from toolsetd.client.jsonout import _dumps_marked, _IndentEncoder, _needs_texts, _tokens, dumps

_LONG = "7" * 5000  # past Python's default digit limit (4,300), which int() refuses


@pytest.fixture(autouse=True)
def _default_digit_limit() -> Iterator[None]:
    """Python's default limit on integer digits, whatever ``PYTHONINTMAXSTRDIGITS`` says."""
    limit = sys.get_int_max_str_digits()
    sys.set_int_max_str_digits(4300)
    try:
        yield
    finally:
        sys.set_int_max_str_digits(limit)

#: Documents as json.dumps writes them (its default separators), so what is read back and
#: printed must be the text itself; ``needs`` is whether json's own float writer changes it.
CORPUS: list[tuple[str, bool]] = [
    ('{"a": 1.50}', True),
    ('[1e400, -1e400, 2.5E+401]', True),
    ('{"z": -0.0}', False),
    ('[-0, {"n": -0}, 0]', True),  # an integer -0 keeps its sign
    ('["2026-07-28", -1, -0.5e1, 0]', True),  # "-0" in a string, and in a fraction
    ('[1E+2]', True),
    ('[1e4, 1.0e4]', True),
    ('[0.1, 2.5, 1e+16, 1.5e-07]', False),
    ('[123456789012345678901234567890, -0.0, 0]', False),
    (f'{{"big": {_LONG}}}', True),
    (f'{{"big": -{_LONG}, "small": 0.1}}', True),
    ('{"s": "1.50", "n": null, "b": [true, false]}', False),
    ('1.50', True),
    ('0.5', False),
    (
        '{"tools": [{"inputSchema": {"properties": {"level": {"maximum": 2.50, "minimum": 0}}},'
        ' "name": "t", "timeoutSeconds": 120}], "sets": [], "notes": []}',
        True,
    ),
    ('[[[[{"deep": [1.50, {"x": [0.25, 1E2]}]}]]], [1e400]]', True),
]


def _strict(text: str) -> Any:
    """Parse as any JSON reader would: ``Infinity`` and ``NaN`` are no JSON."""

    def refuse(name: str) -> None:
        raise ValueError(f"{name} is not JSON")

    return json.loads(text, parse_constant=refuse, parse_float=Decimal, parse_int=Decimal)


@pytest.mark.parametrize(("text", "needs"), CORPUS)
def test_dumps_prints_every_number_as_written(text: str, needs: bool) -> None:
    """Compact or indented, the text printed is the text read, and it is the same as the slow
    paths' (the markers, and the one-pass Python writer) for every awkward number."""
    value = read_json(text)
    assert dumps(value) == text
    for options in ({}, {"separators": (",", ":")}, {"indent": 2}):
        printed = dumps(value, **options)
        assert printed == _dumps_marked(value, _tokens(), options)
        assert printed == json.dumps(value, ensure_ascii=False, cls=_IndentEncoder, **options)
        assert _strict(printed) == _strict(text)


@pytest.mark.parametrize(("text", "needs"), CORPUS)
def test_dumps_takes_the_slow_path_exactly_when_json_would_change_a_number(
    text: str, needs: bool
) -> None:
    """The walk sends a document to the slow path when, and only when, json's own encoder
    would print one of its numbers otherwise than written (``1.50``, ``1e400``, ``1E+2``,
    an integer past the digit limit), never for ``0.1`` or ``-0.0``, which it prints so."""
    value = read_json(text)
    assert _needs_texts(value) is needs
    try:
        plain = json.dumps(value, ensure_ascii=False)
    except ValueError:  # the integer past the digit limit: json cannot print it at all
        plain = None
    assert (plain != text) is needs


def _python_encoder_frames(value: Any, **options: Any) -> list[str]:
    """The frames of json's Python encoder that ``dumps(value)`` entered."""
    entered: list[str] = []

    def profile(frame: FrameType, event: str, arg: object) -> None:
        code = frame.f_code
        in_json = code.co_filename.endswith(("json/encoder.py", "json\\encoder.py"))
        if event == "call" and in_json and code.co_name.startswith("_iterencode"):
            entered.append(code.co_name)

    sys.setprofile(profile)
    try:
        dumps(value, **options)
    finally:
        sys.setprofile(None)
    return entered


def _listing(maximum: str) -> Any:
    tools = ", ".join(
        f'{{"name": "t{i}", "timeoutSeconds": 120, "catalogs": ["plan"], '
        f'"inputSchema": {{"properties": {{"n": {{"maximum": {maximum}, "minimum": 0.5}}}}}}}}'
        for i in range(50)
    )
    return read_json(f'{{"generation": 3, "tools": [{tools}], "notes": []}}')


def test_compact_output_is_json_s_c_encoder_s_with_or_without_numbers_to_keep() -> None:
    """Compact output (``jsonl``) went through json's Python encoder for every document,
    three times the C encoder's time for a 4 MB listing: a listing of canonical numbers,
    and one with a ``2.50`` to keep, are encoded with no frame of the Python encoder; with
    ``indent`` json itself takes the Python one, and so does ``dumps``."""
    for maximum in ("2.5", "2.50"):
        assert _python_encoder_frames(_listing(maximum), separators=(",", ":")) == []
    assert _python_encoder_frames(_listing("2.5"), indent=2) != []


def test_a_string_that_holds_the_marker_token_takes_another() -> None:
    """The markers' token is checked against the whole text: a string that holds it (here
    the first token given, as a forged marker and inside a longer string) would have been
    replaced too; the next token is taken and the strings stay strings."""
    first = "tfeedface"
    value = read_json(
        f'{{"forged": "{first}-0", "quoted": "a\\"{first}-1\\"", "n": [1.50, 1e400]}}'
    )

    def tokens() -> Iterator[str]:
        yield first
        yield "tcafe"

    for options in ({}, {"indent": 2}):
        printed = _dumps_marked(value, tokens(), options)
        assert printed == json.dumps(value, ensure_ascii=False, cls=_IndentEncoder, **options)
        assert _strict(printed)["forged"] == f"{first}-0"


def test_dumps_leaves_the_value_as_it_was() -> None:
    """Only copies get the markers: the value printed (a container shared by two members
    too) still holds its numbers afterwards, as toolsetctl may print it again."""
    value = read_json('{"a": [1.50, {"b": 1e400}], "c": "x"}')
    value["shared"] = value["a"]
    numbers = (value["a"][0], value["a"][1]["b"])
    assert dumps(value) == '{"a": [1.50, {"b": 1e400}], "c": "x", "shared": [1.50, {"b": 1e400}]}'
    assert (value["a"][0], value["a"][1]["b"]) == numbers
    assert value["a"][0] is numbers[0]
    assert value["shared"] is value["a"]
