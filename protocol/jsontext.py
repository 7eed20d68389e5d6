"""JSON values that keep their numbers exactly as written (pure, no I/O).

Theory of operation
-------------------
orjson is the parser and the serialiser on every hot path, but it turns each number with a
fraction or an exponent into a binary ``float`` (``1.50`` becomes ``1.5``, ``1e3`` becomes
``1000.0``) and each integer outside the 64-bit range into a float too
(``123456789012345678901234567890`` becomes ``1.2345678901234568e+29``). The reference host
passes a caller's numbers to the child as written, in argv and on stdin, so we must not lose
that text, and an integer must never silently become a float.

``loads`` therefore parses with orjson first and looks at the result, which costs one walk
over the containers (numbers and containers only; strings are skipped). Only when it holds a
``float`` (or an integer zero, which might have been written ``-0``) and the line contains
such text is the line parsed again with the standard library's ``json``, whose hooks see
each number's text:

* a number with a fraction or exponent (and ``-0``) becomes a ``JsonNumber``: a ``float``
  (so validation, comparison and arithmetic work unchanged) that carries ``text``, the
  exact JSON text; ``str()`` and ``repr()`` give that text;
* an integer becomes an exact Python ``int`` of any width.

``dumps`` is orjson with a ``default`` that writes a ``JsonNumber`` as its ``text``
(``orjson.Fragment``) and, only when orjson refuses an integer wider than 64 bits, a second
pass that writes such integers as their exact decimal text. So a value read by ``loads``
is written back by ``dumps`` with every number as it was written.

The same second pass writes a string UTF-8 cannot carry: one holding a lone surrogate,
which is how Python holds a file name's bytes that are not UTF-8 (``surrogateescape``: a
folder ``caf\xe9``, a workspace reached through such a link, a spill folder). Those bytes
are decoded as UTF-8 with U+FFFD for what does not decode, as .NET decodes file names,
so the answer is still given (``caf\ufffd``) instead of failing the whole response. It
costs nothing until orjson refuses a value.

orjson refuses a number past the double range (``1e999``, or an integer of 309 digits or
more), which JSON allows. Such a line is parsed by the standard library as above (with
``NaN`` and ``Infinity`` refused and lone surrogates checked for, as orjson would): the
number keeps its text, its float is ±inf.

Both functions raise only what orjson raises (``orjson.JSONDecodeError``, which is a
``ValueError``, and ``orjson.JSONEncodeError``, a ``TypeError``); the callers map them.
Out of memory, ``loads`` raises ``MemoryError``, whatever orjson said: a ``JSONDecodeError``
("Not enough memory to allocate buffer for parsing", for a text that may well be valid) or
a ``SystemError`` caused by the ``MemoryError`` it met while making the value.

A large text (a request over 64 KiB) is read by ``loads_large`` instead: the same value
or error, from the standard library's parser, because orjson does not survive running
out of memory while it makes a string (see there). Nor while it writes: a process whose
allocations can fail at all (an address-space limit) turns ``check_allocations`` on,
and then ``loads`` is ``loads_large`` for every text and ``dumps`` writes orjson's very
bytes with code of its own on the standard library's string escaper. ``RawJson`` is a
text embedded as it is, for both writers (``orjson.Fragment``'s bytes cannot be read
back); ``strict_dumps`` gives what ``orjson.dumps`` gives (without ``dumps``' second
pass), refusals and all, for callers that use them.
"""

from __future__ import annotations

import enum
import itertools
import json
import re
from collections.abc import Callable
from typing import Any, Final

import orjson

from .errors import reject_json_constant

__all__ = [
    "LARGE_TEXT",
    "JsonNumber",
    "RawJson",
    "allocations_checked",
    "check_allocations",
    "decode_file_text",
    "dumps",
    "file_encoding",
    "is_utf8",
    "is_utf8_bytes",
    "loads",
    "loads_large",
    "long_integer_at",
    "nesting_exceeds",
    "strict_dumps",
]

#: A text longer than this (64 KiB) is large: its reader uses ``loads_large``.
LARGE_TEXT: Final = 64 * 1024
_INT64_MIN: Final = -(2**63)
_UINT64_MAX: Final = 2**64 - 1
#: The standard library's refusal of an integer past ``sys.get_int_max_str_digits``.
_DIGIT_LIMIT: Final = re.compile(r"limit \((\d+) digits\) for integer string conversion")
#: How orjson's ``JSONDecodeError`` begins when it had no memory for its parse buffer.
_NO_MEMORY: Final = "Not enough memory"
#: The deepest nesting orjson parses (a deeper text is its "depth limit exceeded").
_ORJSON_DEPTH: Final = 1024
#: A ``\\u`` escape of a UTF-16 surrogate (``\\ud800``-``\\udfff``), or that text after an
#: escaped backslash (``\\\\ud800``, which is no escape).
_SURROGATE_ESCAPE: Final = re.compile(rb"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")
#: A JSON string in a text whose escaped backslashes were made ``__``.
_STRING: Final = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"')
#: ``bytes.translate``'s table and deletions for ``_nests_past``: an opening bracket is 1, a
#: closing one 255 (-1 as a signed byte), and every other byte goes.
_BRACKET_STEPS: Final = bytes.maketrans(b"[{]}", b"\x01\x01\xff\xff")
_NOT_BRACKETS: Final = bytes(b for b in range(256) if b not in b"[{]}")
#: A high surrogate's escape and a low one's: a pair.
_SURROGATE_PAIR: Final = re.compile(rb"\\u[dD][89abAB][0-9a-fA-F]{2}\\u[dD][c-fC-F][0-9a-fA-F]{2}")


#: Whether every text is parsed and written by the standard library (``check_allocations``).
_checked = False


def check_allocations(on: bool = True) -> None:
    """Parse and write every JSON text with code that checks each allocation (or, with
    ``on`` false, with orjson again).

    orjson (3.13) does not check that Python gave it the memory for the string or bytes it
    makes: short of it, it copies to a null pointer and the process dies of SIGSEGV. That
    can only happen to a process whose allocations can fail (an address-space or data
    limit, ``LimitAS=``, or strict overcommit), and does there for a text of a few KiB.
    Such a process turns this on at start, before it parses anything: ``loads`` is then
    ``loads_large`` (the standard library's parser, orjson only for a refusal it reaches
    before it makes a value), and ``dumps`` writes the very bytes orjson writes with the
    standard library's string escaper. Both raise ``MemoryError`` instead. It is
    process-wide: the value is read on each call, so turn it on before any thread parses.
    """
    global _checked
    _checked = bool(on)


def allocations_checked() -> bool:
    """Whether ``check_allocations`` is on."""
    return _checked


class JsonNumber(float):
    """A JSON number with a fraction or an exponent, kept with its exact text.

    It is a ``float`` for every computation; ``text`` (also its ``str`` and ``repr``) is the
    number exactly as the peer wrote it, e.g. ``1.50`` or ``1E3``.
    """

    __slots__ = ("text",)

    text: str

    def __new__(cls, text: str | float) -> JsonNumber:
        self = super().__new__(cls, text)
        # copy/pickle rebuild from the float value first, then restore the slot.
        self.text = text if isinstance(text, str) else float.__repr__(float(text))
        return self

    def __repr__(self) -> str:
        return self.text

    __str__ = __repr__


class RawJson:
    """A JSON text that ``dumps`` writes as it is, where the value holds this.

    ``orjson.Fragment`` for both writers: orjson's writer gets ``fragment`` (through its
    ``default``), ``check_allocations``' writer ``text``, which it can read (a Fragment's
    bytes cannot be read back).
    """

    __slots__ = ("fragment", "text")

    def __init__(self, text: bytes) -> None:
        if type(text) is not bytes:  # as the checked writer passes it through
            raise TypeError(f"RawJson holds bytes, not {type(text).__name__}")
        self.text = text
        self.fragment = orjson.Fragment(text)

    def __repr__(self) -> str:
        return f"RawJson({self.text!r})"


#: Byte order marks, UTF-32 before UTF-16 (whose little-endian mark starts UTF-32's).
_BOMS: Final = (
    (b"\xff\xfe\x00\x00", "utf-32-le"),
    (b"\x00\x00\xfe\xff", "utf-32-be"),
    (b"\xef\xbb\xbf", "utf-8"),
    (b"\xff\xfe", "utf-16-le"),
    (b"\xfe\xff", "utf-16-be"),
)


def decode_file_text(data: bytes, errors: str = "replace") -> str:
    """A JSON file's bytes as .NET's ``File.ReadAllText`` reads them (``tools.json``).

    A UTF-8, UTF-16 or UTF-32 byte order mark chooses the encoding and is dropped; without
    one the bytes are UTF-8.

    Args:
        data: The file's bytes.
        errors: ``"replace"`` (U+FFFD for what does not decode, as .NET) or ``"strict"``.

    Returns:
        The text.

    Raises:
        UnicodeDecodeError: Only with ``errors="strict"``.
    """
    bom, encoding = file_encoding(data)
    return data[len(bom) :].decode(encoding, errors)


def file_encoding(data: bytes) -> tuple[bytes, str]:
    """The byte order mark a JSON file's bytes start with (``b""`` for none) and the
    encoding it chooses (UTF-8 without one), as ``decode_file_text`` reads them."""
    for bom, encoding in _BOMS:
        if data.startswith(bom):
            return bom, encoding
    return b"", "utf-8"


def nesting_exceeds(value: Any, limit: int) -> bool:
    """Whether a JSON value nests objects and arrays more than ``limit`` levels deep.

    A scalar is level 0, ``{}`` and ``[]`` level 1. Iterative, and it stops at the first
    container past the limit, so a hostile value costs at most one walk.

    Args:
        value: The JSON value.
        limit: The deepest nesting allowed.

    Returns:
        True when some container sits deeper than ``limit``.
    """
    kind = type(value)
    if kind is not dict and kind is not list:
        return False
    if limit < 1:
        return True
    # One iterator a level open: memory in proportion to the depth, not to the width (a
    # list of five million lists pushed a tuple for each, some 300 MB).
    stack: list[Any] = [iter(value.values() if kind is dict else value)]
    push = stack.append
    while stack:
        for child in stack[-1]:
            kind = type(child)
            if kind is dict or kind is list:
                if len(stack) >= limit:
                    return True
                push(iter(child.values() if kind is dict else child))
                break
        else:
            stack.pop()
    return False


def _parse_int(text: str) -> int | JsonNumber:
    """An integer's text as an exact ``int`` (``-0`` keeps its sign as a ``JsonNumber``)."""
    return JsonNumber(text) if text == "-0" else int(text)


def _may_lose_text(value: Any, line: bytes | bytearray | memoryview | str) -> bool:
    """Whether orjson's reading of ``line`` may have changed a number's text."""
    zero = False
    stack = [value]
    pop = stack.pop
    push = stack.append
    while stack:
        container = pop()
        for item in container.values() if type(container) is dict else container:  # list, tuple
            kind = type(item)
            if kind is str:
                continue
            if kind is dict or kind is list:
                push(item)
            elif kind is float:
                return True
            elif kind is int and item == 0:
                zero = True
    if not zero:
        return False
    if isinstance(line, memoryview):  # ``in`` looks for an item (an int) in one
        line = line.tobytes()
    needle: Any = "-0" if isinstance(line, str) else b"-0"
    return needle in line


def loads(line: bytes | bytearray | memoryview | str) -> Any:
    """Parse one JSON text, keeping every number exactly (see the module docstring).

    With ``check_allocations`` on, this is ``loads_large``: the same value or error.

    Args:
        line: The JSON text (UTF-8 bytes or str).

    Returns:
        The value: dicts, lists, str, bool, None, exact ``int`` and ``JsonNumber``.

    Raises:
        orjson.JSONDecodeError: The text is not valid JSON (orjson's verdict; a number
            past the double range is the one thing orjson refuses that this accepts).
        MemoryError: There was no memory to parse it (the text may be valid).
    """
    if _checked:
        return loads_large(line)
    return _loads_orjson(line)


def _loads_orjson(line: bytes | bytearray | memoryview | str) -> Any:
    """``loads`` by orjson (its verdict on any text, and its value for most)."""
    try:
        value = orjson.loads(line)
    except orjson.JSONDecodeError as exc:
        if exc.msg.startswith(_NO_MEMORY):
            raise MemoryError(exc.msg) from None
        if "infinity" not in str(exc):
            raise
        return _beyond_doubles(line, exc)
    except SystemError as exc:
        if isinstance(exc.__cause__, MemoryError):  # orjson returned with it set
            raise MemoryError("no memory to make the parsed value") from None
        raise
    kind = type(value)
    if kind is dict or kind is list:
        if not _may_lose_text(value, line):
            return value
    elif not _may_lose_text((value,), line):  # a bare scalar
        return value
    try:
        return _exact_loads(line)
    except (ValueError, RecursionError):
        # orjson accepted it, so this is the stdlib's own limit (nesting, digits): keep
        # orjson's value rather than refuse a valid line.
        return value


def loads_large(line: bytes | bytearray | memoryview | str) -> Any:
    """``loads`` for a large text, which must not crash the process out of memory.

    orjson (3.13) does not check that Python gave it the memory for a string it makes: short
    of it (an address-space limit, ``LimitAS=``), it copies the string to a null pointer and
    the process dies of SIGSEGV, with every client's calls. So the standard library parses
    it, which checks every allocation, with every number's text kept as ``loads`` keeps it.
    For a valid text it takes about half the address space ``loads`` takes at its peak,
    and 0.9 to 2.5 times its time (objects the most: a hook watches for a key given
    twice), 11 times for a text of escaped emoji
    (``bench/bench_parse_large.py``); an invalid one costs more (the standard library
    makes the value before it meets the error, which orjson then words).
    orjson only gives the verdict on a text the standard library refuses, which it reaches
    before it makes any value, in its own words as for any other text. Two things the
    standard library takes and orjson does not are refused as orjson refuses them: a lone
    surrogate escape, and ``NaN``/``Infinity`` (``reject_json_constant``).

    orjson reads 1,024 levels of nesting and no more, so a deeper text goes to orjson for
    its verdict too. So does one nested deeper than the interpreter's recursion limit
    allows the standard library (1,000 levels by default, less the caller's frames): a
    caller that parses texts nested 1,000 to 1,024 levels deep raises the limit past that
    (``large.parse_large``), else those are parsed by orjson.

    Args:
        line: The JSON text (UTF-8 bytes or str).

    Returns:
        What ``loads`` returns for it.

    Raises:
        orjson.JSONDecodeError: As ``loads``, word for word.
        MemoryError: There was no memory to parse it (the text may be valid).
    """
    if isinstance(line, memoryview):
        if not line.c_contiguous:
            return _loads_orjson(line)  # orjson refuses such a view, as it refuses it small
        line = line.tobytes()
    # Looked for in the text, not the value (a duplicate key's later value replaces one),
    # and first: orjson refuses such a text before it makes a value, and so need not the
    # standard library (on a text that is not JSON the look may be wrong, but orjson
    # refuses that too).
    if (isinstance(line, str) and not is_utf8(line)) or _has_lone_surrogate_escape(line):
        return _loads_orjson(line)
    # Past orjson's depth it refuses the text: the value's depth tells, unless a key given
    # twice replaced a deeper value; only then is the text read for it (a slower read).
    deep = _brackets(line) > _ORJSON_DEPTH
    replaced: list[bool] = []

    def pairs(items: list[tuple[str, Any]]) -> dict[str, Any]:
        made = dict(items)
        if len(made) != len(items):
            replaced.append(True)
        return made

    try:
        value = _exact_loads(line, pairs if deep else None)
    except MemoryError:
        raise
    except (ValueError, RecursionError):
        return _loads_orjson(line)
    if deep and (
        nesting_exceeds(value, _ORJSON_DEPTH) or (replaced and _nests_past(line, _ORJSON_DEPTH))
    ):
        return _loads_orjson(line)  # and this
    return value


def _has_lone_surrogate_escape(text: bytes | bytearray | memoryview | str) -> bool:
    """Whether a valid JSON text escapes a surrogate that is not half of a pair: a high
    one (``\\ud800``-``\\udbff``) not followed at once by a low one, or a low one alone.

    With escaped backslashes made ``__`` (``_plain_backslashes``), every ``\\u`` left is
    an escape, and one is lone if any is left once the pairs are taken out. The
    regular expression engine does it all (12 MiB of escaped emoji, a million pairs, in
    some 0.15 s); a text without a surrogate's escape costs one scan.
    """
    if isinstance(text, str):  # its own lone surrogates are not escapes: kept as they are
        text = text.encode("utf-8", "surrogatepass")
    if _SURROGATE_ESCAPE.search(text) is None:
        return False
    escapes = _plain_backslashes(text)
    return _SURROGATE_ESCAPE.search(_SURROGATE_PAIR.sub(b"", escapes)) is not None


def _plain_backslashes(text: bytes | bytearray | memoryview | str) -> bytes:
    """A valid JSON text's bytes with each escaped backslash (``\\\\``) made ``__``: every
    backslash left begins an escape of another character. In a valid text every
    backslash is in a string and begins an escape, so read from the left each ``\\\\`` is
    one (a str's own lone surrogates are kept as they are: they are no escapes)."""
    if isinstance(text, str):
        text = text.encode("utf-8", "surrogatepass")
    return bytes(text).replace(b"\\\\", b"__")


def _brackets(line: bytes | bytearray | str) -> int:
    """How many objects and arrays ``line`` opens (its strings' brackets counted too)."""
    opening: Any = ("[", "{") if isinstance(line, str) else (b"[", b"{")
    return int(line.count(opening[0]) + line.count(opening[1]))


def _nests_past(line: bytes | bytearray | str, depth: int) -> bool:
    """Whether a valid JSON text nests objects and arrays past ``depth`` levels.

    Read from the text, as orjson reads it, not from the value: a duplicate key's later
    value replaces a deeper one. The strings are taken out (``_plain_backslashes`` first),
    the brackets left as +1 and -1, and their running sum's highest value is the depth:
    the regular expression engine, ``bytes.translate`` and ``itertools.accumulate`` do it
    all, in C.
    """
    text = _STRING.sub(b"", _plain_backslashes(line)).translate(_BRACKET_STEPS, _NOT_BRACKETS)
    return max(itertools.accumulate(memoryview(text).cast("b")), default=0) > depth


def _exact_loads(
    line: bytes | bytearray | memoryview | str,
    pairs: Callable[[list[tuple[str, Any]]], dict[str, Any]] | None = None,
) -> Any:
    """The standard library's parse, with every number's text kept (and no ``NaN``);
    ``pairs`` makes each object from its members, if given."""
    text = line if isinstance(line, str) else bytes(line).decode("utf-8")
    return json.loads(
        text,
        parse_float=JsonNumber,
        parse_int=_parse_int,
        parse_constant=reject_json_constant,
        object_pairs_hook=pairs,
    )


def long_integer_at(text: str, digits: int) -> int | None:
    """Where the first integer token of more than ``digits`` digits starts in a JSON text.

    This is the integer the standard library's ``int()`` refused (it parses in text order,
    and converts each integer as it meets it), so an error can point at it. The first run
    of that many digits is not always it: a string may hold one, and so may a float's
    fraction or exponent, which ``float()`` takes at any length. So the text is read as
    JSON tokens up to it, in one anchored match that never backtracks (its repeats are
    possessive): linear in the text, some 50 ms a MiB at worst (a list of one-digit
    integers), less than the parse that failed took, and on its failure path only.

    Args:
        text: The text, valid JSON up to that integer (the parse got that far).
        digits: The most digits an integer may have (at least 1).

    Returns:
        The index of the integer's first character (its ``-``, if it has one, as in
        JSON's own grammar), or None when there is no such integer.
    """
    found = re.match(
        r'(?:[^"0-9-]++'  # punctuation, white space, true, false, null
        r'|"[^"\\]*+(?:\\.[^"\\]*+)*+"'  # a string: \" does not end it, \\" does
        r"|-?+[0-9]++[.eE][0-9.eE+-]*+"  # a float, however many digits it has
        rf"|-?+[0-9]{{1,{digits}}}+(?![0-9])"  # an integer int() converts
        rf")*+(?=-?[0-9]{{{digits + 1}}})",
        text,
    )
    return None if found is None else found.end()


def _beyond_doubles(
    line: bytes | bytearray | memoryview | str, error: orjson.JSONDecodeError
) -> Any:
    """A line orjson refused only for a number past the double range (``1e999``).

    JSON has no such range, so the number is kept like any other: a ``JsonNumber`` with its
    text (its float is ±inf). Everything else must still be what orjson accepts: the
    standard library's extras (``NaN``, ``Infinity``, lone surrogates) are refused with
    orjson's error. orjson says "infinity" for an integer of 309 digits or more too; those
    become exact ``int``s, up to the interpreter's limit for parsing one
    (``sys.get_int_max_str_digits``, 4,300 by default): past it the error says so, not
    orjson's "infinity".
    """
    try:
        value = _exact_loads(line)
    except ValueError as exc:
        # The interpreter's digit limit: "Exceeds the limit (4300 digits) for integer
        # string conversion: ..." (read from its text: the protocol package imports no sys).
        if (limit := _DIGIT_LIMIT.search(str(exc))) is not None:
            digits = int(limit[1])
            # orjson's position is its first number past the double range, which may be
            # another one: point at the integer the standard library refused instead.
            at = long_integer_at(error.doc, digits)
            raise orjson.JSONDecodeError(
                f"an integer has more than {digits:,} digits, more than can be kept exactly "
                "(send it as a string)",
                error.doc,
                error.pos if at is None else at,
            ) from None
        raise error from None
    except RecursionError:
        raise error from None
    if _has_lone_surrogate_escape(line):  # which orjson never lets through
        raise error
    return value


def is_utf8_bytes(data: bytes | bytearray) -> bool:
    """Whether ``data`` is valid UTF-8: what a message that does not parse is told first
    (a socket's line, an HTTP body), rather than the JSON parser's words for it."""
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def is_utf8(text: str) -> bool:
    """Whether UTF-8 (and so JSON) can carry ``text``: it holds no lone surrogate (such as
    a file name's, or a %-escape's, undecodable bytes kept with ``surrogateescape``)."""
    if text.isascii():
        return True
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _default(value: Any) -> Any:
    kind = type(value)
    if kind is JsonNumber:
        return orjson.Fragment(value.text)
    if kind is RawJson:
        return value.fragment
    raise TypeError(f"Type is not JSON serializable: {kind.__name__}")


def _utf8_text(text: str) -> str:
    """``text`` as UTF-8 can carry it: lone surrogates (a file name's undecodable bytes)
    decoded as UTF-8 with U+FFFD for what does not decode, as .NET decodes file names."""
    try:
        raw = text.encode("utf-8", "surrogateescape")  # the bytes the file name had
    except UnicodeEncodeError:  # a surrogate that stands for no byte (U+D800)
        raw = text.encode("utf-8", "surrogatepass")
    return raw.decode("utf-8", "replace")


def _encodable(value: Any, depth: int = 0) -> Any:
    """A copy of ``value`` orjson can write: every integer beyond 64 bits as a ``RawJson``
    of its digits, every string (and key) UTF-8 cannot carry through ``_utf8_text``. Past
    the depth orjson writes, the rest is left as it is (orjson refuses it: no cycle is
    followed for ever)."""
    kind = type(value)
    if kind is str:
        return value if value.isascii() else _utf8_text(value)
    if depth > _ORJSON_WRITE_DEPTH:
        return value
    if kind is dict:
        return {
            (key if type(key) is not str or key.isascii() else _utf8_text(key)): _encodable(
                item, depth + 1
            )
            for key, item in value.items()
        }
    if kind is list or kind is tuple:
        return [_encodable(item, depth + 1) for item in value]
    if (
        isinstance(value, int)
        and not isinstance(value, bool)
        and not (_INT64_MIN <= value <= _UINT64_MAX)
    ):
        return RawJson(int.__repr__(int.__int__(value)).encode())
    if kind not in _KNOWN and isinstance(value, (enum.Enum, str, dict, list)):
        # orjson writes these as their value or base type: so, then, is what they hold.
        return _encodable(_as_orjson_takes(value), depth)
    return value


def dumps(value: Any, option: int = 0) -> bytes:
    """Serialise a JSON value compactly with orjson, numbers as ``loads`` read them.

    Args:
        value: A JSON value; ``JsonNumber`` and integers of any width are allowed.
        option: orjson options: ``OPT_APPEND_NEWLINE`` and ``OPT_SORT_KEYS`` (the two
            ``check_allocations``' writer knows).

    Returns:
        The UTF-8 JSON text. With ``check_allocations`` on, the same bytes, from the
        standard library's string escaper.

    Raises:
        orjson.JSONEncodeError: The value is not JSON-serialisable. A string holding a lone
            surrogate is not such a value: it is written with U+FFFD (module docstring).
    """
    try:
        if _checked:
            return _dumps_checked(value, option, own=True)
        return orjson.dumps(value, default=_default, option=option)
    except orjson.JSONEncodeError as exc:
        reason = str(exc)
        if "64-bit" not in reason and "surrogates" not in reason:
            raise
    encodable = _encodable(value)
    if _checked:
        return _dumps_checked(encodable, option, own=True)
    return orjson.dumps(encodable, default=_default, option=option)


def strict_dumps(value: Any, option: int = 0) -> bytes:
    """``orjson.dumps(value, option=option)``, with no ``default``: its bytes, or its
    ``TypeError`` for what it refuses (an integer past 64 bits, a lone surrogate, a
    ``JsonNumber``). For callers that use that refusal (a schema's huge integer, the set
    cache's exact round trip, a canonical hash). With ``check_allocations`` on, the same,
    from ``dumps``' checked writer.
    """
    if _checked:
        return _dumps_checked(value, option, own=False)
    return orjson.dumps(value, option=option)


#: The deepest nesting orjson writes (a deeper value is its "Recursion limit reached").
_ORJSON_WRITE_DEPTH: Final = 254
#: The options ``_dumps_checked`` knows.
_CHECKED_OPTIONS: Final = orjson.OPT_APPEND_NEWLINE | orjson.OPT_SORT_KEYS
#: ``json.encoder``'s escaper for ``ensure_ascii=False`` (C when the interpreter has it):
#: the same escapes orjson writes (``\"``, ``\\``, ``\b\f\n\r\t``, ``\u00XX``).
_quote: Final[Callable[[str], str]] = json.encoder.encode_basestring
_INFINITY: Final = float("inf")


def _dumps_checked(value: Any, option: int, *, own: bool) -> bytes:
    """``orjson.dumps(value, option=option)`` for ``check_allocations``, with ``default``
    ``_default`` if ``own`` (``JsonNumber`` and ``RawJson`` written, as ``dumps``' first
    pass has them): orjson's bytes and refusals, from code that checks every allocation
    (``MemoryError``). As deep as orjson writes lists and objects, and no deeper, which
    also ends a cycle; a tuple counts as a level here, not in orjson (whose own writer
    corrupted its heap on a thousand nested tuples), where nothing of ours makes one."""
    if option & ~_CHECKED_OPTIONS:
        raise ValueError(f"check_allocations' writer does not know the option {option:#x}")
    sort_keys = bool(option & orjson.OPT_SORT_KEYS)
    #: The text written since the last ``RawJson``, whose bytes go to ``chunks`` as they
    #: are (a listing's half megabyte is neither decoded nor encoded again).
    parts: list[str] = []
    chunks: list[bytes] = []
    out = parts.append
    quote = _quote

    def write(item: Any, depth: int) -> None:
        kind = type(item)
        if kind is str:
            out(quote(item) if item.isascii() else _scalar_text(item, own))
        elif kind is RawJson and own:
            chunks.append("".join(parts).encode("utf-8"))
            parts.clear()
            chunks.append(item.text)
        elif kind is dict:
            if depth >= _ORJSON_WRITE_DEPTH:
                raise TypeError("Recursion limit reached")
            members: Any = item.items()
            if sort_keys:
                for key in item:
                    _check_key(key)
                members = sorted(members, key=_first)
            out("{")
            sep = ""
            for key, member in members:
                out(sep)
                sep = ","
                if type(key) is not str or not (key.isascii() or is_utf8(key)):
                    _check_key(key)
                out(quote(key))
                out(":")
                write(member, depth + 1)
            out("}")
        elif kind is list or kind is tuple:
            if depth >= _ORJSON_WRITE_DEPTH:
                raise TypeError("Recursion limit reached")
            out("[")
            sep = ""
            for member in item:
                out(sep)
                sep = ","
                write(member, depth + 1)
            out("]")
        elif kind in _KNOWN:
            out(_scalar_text(item, own))
        else:
            write(_as_orjson_takes(item), depth)

    write(value, 0)
    if option & orjson.OPT_APPEND_NEWLINE:
        out("\n")
    if not chunks:
        return "".join(parts).encode("utf-8")
    chunks.append("".join(parts).encode("utf-8"))
    return b"".join(chunks)


#: The types ``_dumps_checked`` writes as they are: containers, and what ``_scalar_text``
#: writes.
_KNOWN: Final = frozenset(
    {dict, list, tuple, str, int, float, bool, type(None), JsonNumber, RawJson}
)


def _as_orjson_takes(value: Any) -> Any:
    """A value of a type orjson writes through another one, as that one: an enum as its
    value, a subclass of str, int, dict or list as that type; refused as orjson refuses
    any other (a float or tuple subclass, a set, bytes)."""
    if isinstance(value, enum.Enum):
        value = value.value
        return value if type(value) in _KNOWN else _as_orjson_takes(value)
    # The value as the base type holds it, whatever the subclass's methods say.
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, dict):
        return dict.copy(value)
    if isinstance(value, list):
        return list.copy(value)
    raise TypeError(f"Type is not JSON serializable: {type(value).__name__}")


def _scalar_text(value: Any, own: bool) -> str:
    """A value of one of ``_KNOWN``'s scalar types as orjson writes it, or its refusal
    (``JsonNumber`` and ``RawJson`` are written only if ``own``)."""
    kind = type(value)
    if kind is str:
        if value.isascii() or is_utf8(value):
            return _quote(value)
        raise TypeError("str is not valid UTF-8: surrogates not allowed")
    if value is None:
        return "null"
    if value is True:
        return "true"
    if value is False:
        return "false"
    if kind is int:
        if not (_INT64_MIN <= value <= _UINT64_MAX):
            raise TypeError("Integer exceeds 64-bit range")
        return int.__repr__(value)
    if kind is float:
        return _float_text(value)
    if not own:
        raise TypeError(f"Type is not JSON serializable: {kind.__name__}")
    return str(value.text)  # JsonNumber (``_dumps_checked`` writes RawJson's bytes itself)


def _float_text(value: float) -> str:
    """A float as orjson writes it: ``null`` for NaN and the infinities, else Python's
    shortest ``repr`` but for exponents -5 to -9, which orjson writes ``0.00001``
    (-5) and ``1e-6`` (no zero before the digit)."""
    if value != value or value in (_INFINITY, -_INFINITY):
        return "null"
    text = float.__repr__(value)
    mantissa, mark, power = text.partition("e-0")
    if not mark:
        return text
    if power != "5":
        return f"{mantissa}e-{power}"
    sign = "-" if mantissa.startswith("-") else ""
    return f"{sign}0.0000{mantissa.lstrip('-').replace('.', '')}"


def _first(pair: tuple[str, Any]) -> str:
    return pair[0]


def _check_key(key: Any) -> None:
    """Refuse an object's key as orjson refuses it: any type but str (a str subclass
    too), and a lone surrogate."""
    if type(key) is not str:
        raise TypeError("Dict key must be str")
    if not is_utf8(key):
        raise TypeError("str is not valid UTF-8: surrogates not allowed")
