"""jsontext: every JSON number keeps its text through loads and dumps."""

from __future__ import annotations

import contextlib
import copy
import pickle
import sys
import threading
from typing import Any

import orjson
import pytest
from hypothesis import given
from hypothesis import strategies as st
from toolsetd.protocol.codec import Codec, Message, encode
from toolsetd.protocol.jsontext import JsonNumber, dumps, loads, loads_large

# RFC 8259 number grammar: -? int frac? exp?
_INT = st.one_of(st.just("0"), st.from_regex(r"[1-9][0-9]{0,40}", fullmatch=True))
_FRAC = st.one_of(st.just(""), st.from_regex(r"\.[0-9]{1,20}", fullmatch=True))
# Exponents up to four digits: past the double range both ways (1e999, 1e-999) too.
_EXP = st.one_of(st.just(""), st.from_regex(r"[eE][+-]?[0-9]{1,4}", fullmatch=True))
json_numbers = st.tuples(st.sampled_from(["", "-"]), _INT, _FRAC, _EXP).map("".join)


@given(json_numbers)
def test_any_number_text_survives_loads_and_dumps(text: str) -> None:
    """A number written any legal way comes back byte for byte, alone and nested."""
    assert dumps(loads(text)).decode() == text
    nested = f'{{"a":[{text},{{"b":{text}}}],"s":"x"}}'
    assert dumps(loads(nested.encode())).decode() == nested


@pytest.mark.parametrize(
    ("text", "kind", "value"),
    [
        ("1.50", JsonNumber, 1.5),
        ("1e3", JsonNumber, 1000.0),
        ("-0", JsonNumber, 0.0),
        ("123456789012345678901234567890", int, 123456789012345678901234567890),
        ("-9223372036854775809", int, -9223372036854775809),
        ("18446744073709551616", int, 2**64),
        ("7", int, 7),
        ("1e999", JsonNumber, float("inf")),
        ("-1E+400", JsonNumber, float("-inf")),
    ],
)
def test_loads_gives_exact_values(text: str, kind: type, value: object) -> None:
    """Fractions stay JsonNumber (a float); integers stay int at any width, never float."""
    parsed = loads(f"[{text}]".encode())[0]
    assert type(parsed) is kind and parsed == value
    assert str(parsed) == repr(parsed) == text


@pytest.mark.parametrize(
    "text", ['[1e999, NaN]', '[1e999, Infinity]', '[1e999, "\\ud800"]', "[1e999,", "[1e999]]"]
)
def test_a_huge_number_lets_nothing_else_through(text: str) -> None:
    """Beside 1e999, what orjson refuses is still refused, with orjson's error."""
    with pytest.raises(orjson.JSONDecodeError):
        loads(text.encode())


def test_a_huge_number_in_a_deep_or_wide_value() -> None:
    """1e999 300 levels deep, an integer of 400 digits, a surrogate pair: all kept."""
    deep = loads(b"[" * 300 + b"1e999" + b"]" * 300)
    for _ in range(300):
        deep = deep[0]
    assert str(deep) == "1e999"
    wide = "1" + "0" * 400
    assert loads(f"[{wide}]".encode()) == [int(wide)]
    assert loads(b'[1e999, "\\ud83d\\ude00", {"\\u00e9": 1}]')[1:] == ["\U0001f600", {"é": 1}]
    with pytest.raises(orjson.JSONDecodeError):  # a lone surrogate as a key, beside 1e999
        loads(b'{"a": 1e999, "\\udc00": 1}')  # (orjson meets the number first)
    with pytest.raises(orjson.JSONDecodeError):  # or in a value a duplicate key replaced
        loads(b'{"a": 1e999, "b": "\\ud800", "b": ""}')


def test_plain_values_take_the_orjson_path_unchanged() -> None:
    """Without a float the value is orjson's own (no second parse)."""
    value = loads(b'{"a":[1,2,{"b":"1.5"}],"c":"2024-01-05","d":null}')
    assert value == {"a": [1, 2, {"b": "1.5"}], "c": "2024-01-05", "d": None}


def test_json_number_copies_and_pickles_with_its_text() -> None:
    number = JsonNumber("1.50")
    assert copy.deepcopy(number).text == "1.50"
    assert pickle.loads(pickle.dumps(number)).text == "1.50"  # noqa: S301 (our own bytes)


def test_dumps_writes_wide_integers_exactly() -> None:
    assert dumps({"n": [2**64, -(2**63) - 1, 1]}) == b'{"n":[18446744073709551616,-9223372036854775809,1]}'
    assert encode(2**70) == b"1180591620717411303424\n"


def test_dumps_writes_a_file_names_undecodable_bytes_as_replacement_characters() -> None:
    """A string UTF-8 cannot carry (surrogateescape, or a bare surrogate) is written, with U+FFFD."""
    name = b"caf\xe9".decode("utf-8", "surrogateescape")
    value = {"set": name, name: [2**64, "x\ud800", "d\u00e9j\u00e0"]}
    assert dumps(value).decode() == (
        '{"set":"caf\ufffd","caf\ufffd":[18446744073709551616,"x\ufffd\ufffd\ufffd","d\u00e9j\u00e0"]}'
    )
    assert encode(name) == '"caf\ufffd"\n'.encode()


def test_dumps_still_refuses_what_is_not_json() -> None:
    with pytest.raises(orjson.JSONEncodeError):
        dumps({"k": object()})


def test_codec_message_keeps_the_text() -> None:
    codec = Codec()
    codec.receive_data(b'{"n":1.50}\n')
    event = codec.next_event()
    assert isinstance(event, Message)
    assert encode(event.value) == b'{"n":1.50}\n'


def test_an_integer_past_the_interpreters_digit_limit_is_refused_saying_so() -> None:
    """Up to ``sys.get_int_max_str_digits`` digits an integer is exact; past it the error
    names the limit, not orjson's "number is infinity" (which it is not)."""
    limit = sys.get_int_max_str_digits()
    assert loads(b"[" + b"7" * limit + b"]") == [int("7" * limit)]
    for text in (b"[" + b"7" * (limit + 1) + b"]", b'{"n": -' + b"1" * (limit + 700) + b"}"):
        with pytest.raises(orjson.JSONDecodeError) as caught:
            loads(text)
        assert f"more than {limit:,} digits" in str(caught.value)
        assert "(send it as a string)" in str(caught.value)
        assert "infinity" not in str(caught.value)
    # orjson stops at the first number past the double range; the error names the long one.
    text = b'{"a": 1e999, "b": ' + b"9" * 400 + b', "c": ' + b"7" * (limit + 1) + b"}"
    with pytest.raises(orjson.JSONDecodeError) as caught:
        loads(text)
    assert caught.value.pos == text.index(b"777")


def _outcome(parse: Any, text: Any) -> tuple[Any, ...]:
    """What a parse gives: its value, each item with its type and each scalar as written
    back, or its error's words and position."""
    try:
        value = parse(text)
    except orjson.JSONDecodeError as exc:
        return ("error", exc.msg, exc.pos)
    items: list[tuple[str, Any]] = []
    stack = [value]
    while stack:  # iteratively: the deepest texts below nest 1,024 levels
        item = stack.pop()
        if type(item) is dict:
            items.append(("dict", len(item)))
            for key, child in item.items():
                items.append(("key", key))
                stack.append(child)
        elif type(item) is list:
            items.append(("list", len(item)))
            stack.extend(item)
        else:
            items.append((type(item).__name__, dumps(item)))
    return ("value", items)


#: Texts on which the standard library and orjson part ways, or might.
_LARGE_CASES = [
    b'{"a": [1, 2.50, -0, 1e3, 18446744073709551616, "x"], "b": null, "c": true}',
    b'"\\\\ud800"',  # an escaped backslash, then text: no surrogate at all
    b'"\\\\\\ud800"',  # an escaped backslash, then a lone surrogate escape
    b'"\\\\\\ud83d\\ude00"',  # an escaped backslash, then a pair
    b'"\\ud83d\\\\ude00"',  # a high surrogate, an escaped backslash, text
    b'["\\\\ud800"]',
    b'["\\ud800"]',  # a lone surrogate escape
    b'{"\\udc00": 1}',  # as a key
    b'["\\ud83d\\ude02", "\\u00e9"]',  # a pair, and a plain escape
    b'{"a": "\xff"}',  # not UTF-8
    b'\xef\xbb\xbf[1]',  # a byte order mark
    b"[NaN]",
    b"[Infinity]",
    b"[-Infinity]",
    b"[1e999, 1.50, -1E+400]",
    b"[-0]",  # no float: orjson's value, then a second look for the sign
    b'{"a": 0, "b": -0}',
    b"[01]",
    b"[1,]",
    b'{"a" 1}',
    b"[1] [2]",
    b"",
    b"  ",
    b" [1] ",
    b"[\t1\r\n]",
    b'["a\x01"]',  # a control character in a string
    b"[" + b"7" * 5000 + b"]",  # past the interpreter's digit limit
    b"[" * 1024 + b"]" * 1024,  # orjson's deepest
    b"[" * 1025 + b"]" * 1025,
    b'{"a":' * 1025 + b"1" + b"}" * 1025,
    b"[" * 3000 + b"]" * 3000,
    b"[" * 1100 + b"1," * 50 + b"]",  # deep, and not JSON either
    b"[" * 1022 + b'{"a":[[]],"a":0}' + b"]" * 1022,  # too deep, under a replaced key
    b"[" * 1022 + b'{"a":[],"a":0}' + b"]" * 1022,  # 1,024 deep, so not
    b"[" * 1022 + b'{"a":[[]],"a":0,"s":"[["}' + b"]" * 1022,  # as many brackets in a string
    b'["[[[[", {"\\\\": "]]"}, "\\"["]',  # brackets in strings count for nothing
]


@pytest.mark.parametrize("text", _LARGE_CASES)
def test_loads_large_gives_what_loads_gives(text: bytes) -> None:
    """The standard library's parse, with orjson's verdict where the two differ: the same
    value (numbers as written, the same types) or the same error, word for word, for
    bytes, a bytearray, a memoryview and (where it is one) a str. With the interpreter's
    recursion limit raised as ``large.parse_large`` raises it, run in a thread as there."""
    inputs: list[Any] = [text, bytearray(text), memoryview(text)]
    with contextlib.suppress(UnicodeDecodeError):
        inputs.append(text.decode())
    results: list[tuple[Any, Any]] = []

    def run() -> None:
        results.extend((_outcome(loads, each), _outcome(loads_large, each)) for each in inputs)

    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(1024 + 200)
    try:
        worker = threading.Thread(target=run)
        worker.start()
        worker.join()
    finally:
        sys.setrecursionlimit(limit)
    assert len(results) == len(inputs)
    for expected, got in results:
        assert got == expected


def test_loads_large_takes_a_strided_memoryview_as_loads() -> None:
    """orjson refuses a memoryview that is not contiguous: so does ``loads_large``, in the
    same words, rather than parse the bytes the view shows."""
    view = memoryview(b"[-0,  1 ]  ")[::2]
    assert _outcome(loads_large, view) == _outcome(loads, view)
    assert _outcome(loads, view)[0] == "error"


def test_loads_large_refuses_a_str_with_a_lone_surrogate_as_loads() -> None:
    """A str may hold a lone surrogate itself (no escape to look for): refused all the
    same, as orjson refuses it."""
    text = '["ok", {"k": "\ud800"}]'
    with pytest.raises(orjson.JSONDecodeError) as large:
        loads_large(text)
    with pytest.raises(orjson.JSONDecodeError) as small:
        loads(text)
    assert (large.value.msg, large.value.pos) == (small.value.msg, small.value.pos)


@given(
    st.recursive(
        st.one_of(
            json_numbers,
            st.text(max_size=8).map(lambda s: orjson.dumps(s).decode()),
            st.sampled_from(
                ["true", "false", "null", '"\\ud800"', '"\\udfff"', '"\\ud83d\\ude02"',
                 '"\\\\ud800"', '"\\\\\\ud800"', '"a\\ud800\\\\udc00"']
            ),
        ),
        lambda inner: st.one_of(
            st.lists(inner, max_size=4).map(lambda items: "[" + ",".join(items) + "]"),
            st.lists(st.tuples(st.text(max_size=4), inner), max_size=4).map(
                lambda pairs: "{"
                + ",".join(orjson.dumps(k).decode() + ":" + v for k, v in pairs)
                + "}"
            ),
        ),
        max_leaves=20,
    )
)
def test_loads_large_gives_what_loads_gives_for_any_text(text: str) -> None:
    """Any text built of numbers written any legal way, strings, lone surrogate escapes
    and nesting: the same value, or the same error."""
    assert _outcome(loads_large, text.encode()) == _outcome(loads, text.encode())
