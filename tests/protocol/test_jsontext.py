"""jsontext: every JSON number keeps its text through loads and dumps."""

from __future__ import annotations

import contextlib
import copy
import enum
import pickle
import sys
import threading
from collections.abc import Iterator
from typing import Any

import orjson
import pytest
from hypothesis import given
from hypothesis import strategies as st
from toolsetd.protocol import jsontext
from toolsetd.protocol.codec import Codec, Message, encode
from toolsetd.protocol.jsontext import (
    JsonNumber,
    RawJson,
    check_allocations,
    dumps,
    loads,
    loads_large,
    strict_dumps,
)

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


@pytest.mark.parametrize(
    "before",
    [
        b'"d": "%(long)s", ',  # a string's digits
        b'"d": "say \\"%(long)s\\"", "e": "\\\\", ',  # after an escaped quote, and before one
        b'"f": 0.%(long)s, "e": -1E+%(zeros)s1, ',  # a float's fraction and exponent
        b'"d": "%(long)s",\n "f": [1.%(long)s],\n ',  # lines
    ],
    ids=["string", "escaped-quote", "fraction", "lines"],
)
def test_an_integer_past_the_digit_limit_is_placed_at_its_own_token(before: bytes) -> None:
    """The error's position is the long integer's first character (its ``-``), not the
    first run of as many digits, which may be in a string or a float."""
    limit = sys.get_int_max_str_digits()
    long = b"7" * (limit + 1)
    head = b"{" + before % {b"long": long, b"zeros": b"0" * (limit + 1)} + b'"n": '
    text = head + b"-" + long + b"}"
    with pytest.raises(orjson.JSONDecodeError) as caught:
        loads(text)
    assert f"more than {limit:,} digits" in str(caught.value)
    assert caught.value.pos == len(head)


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


# -- check_allocations: the standard library's code, orjson's bytes ---------------------


@contextlib.contextmanager
def _checked() -> Iterator[None]:
    """``check_allocations`` on inside (this worker process's tests run one at a time)."""
    check_allocations()
    try:
        yield
    finally:
        check_allocations(False)


class _Float(float):
    pass


class _Tuple(tuple):  # type: ignore[type-arg]
    __slots__ = ()


class _List(list):  # type: ignore[type-arg]
    pass


class _Dict(dict):  # type: ignore[type-arg]
    pass


class _Str(str):
    __slots__ = ()

    def __str__(self) -> str:
        return "not the value"


class _Int(int):
    pass


class _Kind(enum.Enum):
    LIST = (1, "x", [2])
    TEXT = "t\u00e9"


class _Number(enum.IntEnum):
    SEVEN = 7


#: Strings orjson writes, escapes, or refuses (a lone surrogate: a file name's stray byte).
_TEXTS = st.text(
    st.sampled_from(["a", "\u00e9", '"', "\\", "\n", "\x00", "\x1f", "\x7f", "\u2028",
                     "\U0001f600", "\ud800", "\udc80", "\udced", "\udca0", "/"]),
    max_size=6,
)
_VALUES = st.recursive(
    st.one_of(
        st.none(), st.booleans(), _TEXTS,
        st.integers(), st.integers(-(2**70), 2**70),
        st.floats(),  # NaN and the infinities too: orjson writes null
        st.floats(min_value=1e-10, max_value=1e-4),  # where orjson's form is not repr's
        json_numbers.map(JsonNumber),
        st.sampled_from([RawJson(b"[1,2]"), RawJson(b'{"a":"\xc3\xa9"}'), _Kind.TEXT,
                         _Kind.LIST, _Number.SEVEN, _Str("s"), _Int(5)]),
    ),
    lambda inner: st.one_of(
        st.lists(inner, max_size=4),
        st.lists(inner, max_size=3).map(tuple),
        st.lists(inner, max_size=2).map(_List),
        st.dictionaries(_TEXTS, inner, max_size=4),
        st.dictionaries(_TEXTS, inner, max_size=2).map(_Dict),
    ),
    max_leaves=12,
)
_OPTIONS = [0, orjson.OPT_SORT_KEYS, orjson.OPT_APPEND_NEWLINE,
            orjson.OPT_SORT_KEYS | orjson.OPT_APPEND_NEWLINE]


def _written(write: Any, value: Any, option: int) -> tuple[Any, ...]:
    try:
        return ("bytes", write(value, option))
    except TypeError as exc:  # orjson.JSONEncodeError is TypeError
        return ("error", type(exc), str(exc))
    except ValueError as exc:  # an integer past the interpreter's digit limit
        return ("error", type(exc), str(exc).split(":")[0])


@given(_VALUES)
def test_the_checked_writer_writes_the_bytes_orjson_writes(value: Any) -> None:
    """With allocations checked, ``dumps`` and ``strict_dumps`` give what they give with
    orjson, byte for byte, or the same refusal in the same words, for every option they
    take: numbers as orjson writes them, a lone surrogate as U+FFFD (or refused), keys
    sorted after that, enums and subclasses as orjson takes them."""
    for option in _OPTIONS:
        plain = (_written(dumps, value, option), _written(strict_dumps, value, option))
        with _checked():
            checked = (_written(dumps, value, option), _written(strict_dumps, value, option))
        assert checked == plain, (option, checked, plain)


@pytest.mark.parametrize(
    "value",
    [
        *[float(f"{m}e{e}") for e in range(-330, 310, 7) for m in ("1", "-2.5", "9.87654321")],
        1e-5, -1e-5, 1.5e-05, 1e-6, 1e-9, 1e-10, 1e16, 1e15, 1e22, 5e-324, -0.0, 0.0,
        float("nan"), float("inf"), -float("inf"), 1.7976931348623157e308,
        _Float(2.5), _Tuple((1,)), {1, 2}, b"x", bytearray(b"x"), object(),
        {1: "a"}, {_Str("k"): 1}, {"a": 1, 2: "b"}, {"\ud800": 1, "\udced\udca0\udc80": 2},
        2**64, 2**64 - 1, -(2**63), -(2**63) - 1, 10**5000,
        JsonNumber("1e999"), JsonNumber("-0"), RawJson(b"null"),
        "\ud800", {"k": ["\udc80", {"\udc81": JsonNumber("1.50")}]},
        # orjson meets the bad value before the key that its second pass makes the same.
        {"\ufffd": {1: 2}, chr(0xDCE9): 0.5}, {"\ufffd": _Tuple((1,)), chr(0xDCE9): 1},
    ],
    ids=lambda value: _shown(value),
)
def test_the_checked_writer_agrees_with_orjson_at_its_edges(value: Any) -> None:
    """The exponents where orjson's form differs from ``repr``, the types it refuses, keys
    it refuses, the 64-bit range, and the two keys a file name's bytes make one."""
    for option in _OPTIONS:
        plain = (_written(dumps, value, option), _written(strict_dumps, value, option))
        with _checked():
            checked = (_written(dumps, value, option), _written(strict_dumps, value, option))
        assert checked == plain, (option, checked, plain)


def test_the_checked_writer_nests_as_deep_as_orjson_and_ends_a_cycle() -> None:
    """orjson writes 254 levels and refuses the 255th ("Recursion limit reached"); a value
    that holds itself is refused the same way, not written for ever."""
    cycle: dict[str, Any] = {}
    cycle["self"] = [cycle]
    stray = {"\udce9": 1}  # a file name's byte: the second pass, which made a cycle's copy
    stray["self"] = stray  # for ever (RecursionError)
    for value in (_nested(254), _nested(255), cycle, stray):
        plain = _written(dumps, value, 0)
        with _checked():
            assert _written(dumps, value, 0) == plain
    for value in (_nested(255), cycle, stray):
        assert _written(dumps, value, 0) == ("error", TypeError, "Recursion limit reached")


def _shown(value: Any) -> str:
    """A test id: the value's repr, short (an integer past the digit limit has none)."""
    if type(value) is object:
        return "an object"
    try:
        return repr(value)[:40]
    except ValueError:
        return f"a {type(value).__name__} of many digits"


def _nested(depth: int) -> list[Any]:
    value: list[Any] = []
    for _ in range(depth - 1):
        value = [value]
    return value


class _NoOrjson:
    """orjson's module with no parser and no writer: ``check_allocations`` needs neither."""

    def __getattr__(self, name: str) -> Any:
        if name in ("loads", "dumps"):
            raise AssertionError(f"orjson.{name} was called")
        return getattr(orjson, name)


@pytest.mark.parametrize("text", [t for t in _LARGE_CASES if _outcome(loads, t)[0] == "value"])
def test_with_allocations_checked_orjson_neither_parses_nor_writes(
    text: bytes, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The point of it: orjson, which dies of SIGSEGV when an allocation of its fails, does
    not run for a valid text or for a value written (``loads`` is ``loads_large``, whose
    refusals alone are orjson's words). The value is the one orjson's path gives."""
    expected = _outcome(loads, text)
    written = _written(dumps, loads(text), 0)  # or orjson's refusal past 254 levels
    monkeypatch.setattr(jsontext, "orjson", _NoOrjson())
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(1024 + 200)  # as the daemon raises it (``large.PARSE_RECURSION_LIMIT``)
    try:
        with _checked():
            assert _outcome(loads, text) == expected
            assert _written(dumps, loads(text), 0) == written
            assert strict_dumps({"a": [1, 2.5, "b"]}) == b'{"a":[1,2.5,"b"]}'
    finally:
        sys.setrecursionlimit(limit)


@pytest.mark.parametrize("text", _LARGE_CASES)
def test_with_allocations_checked_loads_gives_what_it_gave(text: bytes) -> None:
    """Every edge case of ``loads_large``, through ``loads`` with allocations checked:
    the same value or the same error."""
    expected = _outcome(loads, text)
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(1024 + 200)
    try:
        with _checked():
            assert _outcome(loads, text) == expected
    finally:
        sys.setrecursionlimit(limit)
