"""The pump's reading of a host line over 16 MiB as it streams (``_LongLine``): the request
it is, wherever its id and method are and whatever its nested values hold, in whatever
pieces it comes. The line's integration tests (``test_mcp_reconnect.py``) send a few such
lines through a real pump; here many shapes are read in many cuts, with no daemon."""

from __future__ import annotations

import json
import random

import pytest
from toolsetd.client.mcp import _LongLine

#: Nested values whose brackets, quotes and backslashes must be read as JSON reads them:
#: brackets within strings, escaped quotes and backslashes (one at a piece's end), dense
#: small objects, deep nesting, and a random walk of brackets (its peaks of every shape).
_NESTED = [
    b"[" + b"{}," * 5000 + b"{}]",
    b"[" + b'{"a":1},' * 3000 + b"{}]",
    b'["}]", "\\"{", "\\\\", "\\\\\\"]", "x\\\\\\\\"]',
    b'{"k": "' + b"\\\\" * 3001 + b'", "q": "\\"' + b"]" * 100 + b'"}',
    b"[" * 900 + b"1" + b"]" * 900,
    b"[" + b",".join([b"[[],[[]],[[[]]]]"] * 500) + b"]",
]


def _walk(seed: int, steps: int) -> bytes:
    r = random.Random(seed)  # noqa: S311 - a shape, not a secret
    out, depth = bytearray(b"["), 1
    for _ in range(steps):
        if depth > 1 and (r.random() < 0.5 or depth >= 900):
            out += b"]"
            depth -= 1
        else:
            out += b",[" if out.endswith(b"]") else b"["
            depth += 1
    return bytes(out + b"]" * depth)


def _read(line: bytes, cuts: list[int]) -> object:
    scan = _LongLine()
    start = 0
    for end in [*cuts, len(line)]:
        scan.feed(line[start:end])
        start = end
    return scan.request(modern=False)


@pytest.mark.parametrize("nested", [*_NESTED, _walk(1, 40_000)], ids=range(len(_NESTED) + 1))
@pytest.mark.parametrize("id_last", [False, True], ids=["id-first", "id-last"])
def test_a_long_lines_request_is_read_whatever_its_nested_values_and_cuts(
    nested: bytes, id_last: bool
) -> None:
    members = [
        b'"jsonrpc":"2.0"',
        b'"id":"the-id"',
        b'"method":"tools/call"',
        b'"params":{"name":"t","arguments":{"x":' + nested + b',"y":"]}"}}',
    ]
    if id_last:  # as a TypeScript host writes a request
        members.append(members.pop(1))
    line = b"{" + b",".join(members) + b"}"
    json.loads(line)  # each is valid JSON
    r = random.Random(len(line))  # noqa: S311 - cuts, not a secret
    for pieces in (1, 2, 7, 300):
        cuts = sorted(r.sample(range(1, len(line)), min(pieces, len(line)) - 1))
        assert _read(line, cuts) == ("the-id", ("the-id", "tools/call", False, None)), cuts


def test_a_nested_id_or_method_is_no_request() -> None:
    """A nested value is kept as ``[]`` in the outer object, which no id or method is: as
    ``0`` it was an id (0) the daemon never saw, as it refuses such a request with id
    null, and the pump kept it in flight and answered it at the next restart."""
    assert _read(b'{"jsonrpc":"2.0","id":{"a":1},"method":"ping"}', []) is None
    assert _read(b'{"jsonrpc":"2.0","id":1,"method":["ping"]}', []) is None


@pytest.mark.parametrize("deeper", [0, 1], ids=["1024-levels", "1025-levels"])
def test_a_line_nested_past_the_daemons_parser_is_no_request(deeper: int) -> None:
    """The daemon's parser (orjson) reads 1,024 levels of nesting: a line nested deeper
    is a parse error (id null) there, and no request. The pump took its id and method for
    a request in flight, which the next restart answered ("the tool may have run")."""
    levels = 1024 - 3 + deeper  # under the outer object, params and arguments
    nested = b"[" * levels + b"]" * levels
    line = (
        b'{"jsonrpc":"2.0","id":2,"method":"tools/call","params":{"name":"t","arguments":'
        b'{"x":' + nested + b"}}}"
    )
    found = _read(line, [len(line) // 3])
    assert found == (None if deeper else ((2,), (2, "tools/call", False, None)))
