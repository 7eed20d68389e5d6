"""The MCP HTTP endpoint's own pieces that need no daemon."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

from toolsetd.daemon.mcphttp import _HeaderMarks


class _Walked(Mapping[str, Any]):
    """A schema that counts how often its members are gone through."""

    def __init__(self, data: dict[str, Any]) -> None:
        self._data = data
        self.walks = 0

    def __getitem__(self, key: str) -> Any:
        return self._data[key]

    def __len__(self) -> int:
        return len(self._data)

    def __iter__(self) -> Iterator[str]:
        self.walks += 1
        return iter(self._data)


_SCHEMA = {
    "type": "object",
    "properties": {"region": {"type": "string", "x-mcp-header": "Region"}},
}


def test_header_marks_walk_a_tool_schema_once_per_hash() -> None:
    """Every 2026-07-28 ``tools/call`` needs its tool's ``x-mcp-header`` marks, which walk
    the whole schema (1 ms a call for 1,100 properties): they are worked out once per tool
    hash (which covers the schema), and a changed schema, with a new hash, is walked
    again."""
    marks = _HeaderMarks()
    schema = _Walked(_SCHEMA)
    assert marks.of("sha256:a", schema) == [(("region",), "Region")]
    assert marks.of("sha256:a", schema) == [(("region",), "Region")]
    assert schema.walks == 1
    changed = _Walked({"type": "object", "properties": {"zone": {"type": "string"}}})
    assert marks.of("sha256:b", changed) is None
    assert changed.walks == 1


def test_header_marks_keep_at_most_max_entries() -> None:
    """The marks kept are bounded: the oldest go first."""
    marks = _HeaderMarks(max_entries=2)
    schemas = {key: _Walked(_SCHEMA) for key in ("a", "b", "c")}
    for key, schema in schemas.items():
        marks.of(key, schema)
    marks.of("c", schemas["c"])
    marks.of("a", schemas["a"])
    assert [schemas[key].walks for key in "abc"] == [2, 1, 1]
