"""``large.parse_large``: a large text is parsed with the cyclic collector held off."""

from __future__ import annotations

import gc

from toolsetd.daemon.large import check_large, parse_large
from toolsetd.protocol.jsontext import loads


def test_a_large_parse_holds_the_collector_off_and_promotes_what_it_made() -> None:
    """Each full collection during a parse of millions of numbers traversed all of them
    again, holding the GIL the event loop waits for. The parse runs with the collector off;
    what it made is in the oldest generation afterwards (a young collection after it
    would traverse all of it once more), and the collector is on again."""
    seen: list[bool] = []

    def parse(text: bytes) -> object:
        seen.append(gc.isenabled())
        return loads(text)

    gc.collect()
    value = parse_large(parse, b"[" + b"[1.5]," * 300_000 + b"[]]")
    assert seen == [False]
    assert gc.isenabled()
    assert gc.get_count()[0] < 1_000, gc.get_count()
    assert len(value) == 300_001  # type: ignore[arg-type]


def test_a_check_of_a_large_value_holds_the_collector_off_and_promotes_nothing() -> None:
    """The depth walk of millions of containers made the collector's full passes run over
    all of them, again and again. The check runs with the collector off; what it made is
    garbage afterwards, so nothing it leaves young is moved to the oldest generation."""
    seen: list[bool] = []
    kept: list[object] = []

    def check(value: list[object]) -> int:
        seen.append(gc.isenabled())
        kept.extend([[]] * 2_000)  # young objects the check leaves alive
        return len(value)

    gc.collect()
    assert check_large(check, [[]] * 10) == 10
    assert seen == [False]
    assert gc.isenabled()
    assert gc.get_count()[0] >= 1, "what the check left young was promoted"
