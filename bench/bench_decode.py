"""A stream's text at the end of a call (``streams.decode``), against decoding it whole.

``python -m bench.bench_decode [--rounds 15]``

Not a goal row: a check that turning a call's kept prefix (up to four bytes a character,
``4 * (limit + 1)`` bytes) into at most ``limit + 1`` characters costs no more than the
one-call decode it replaced, and much less for a flood of invalid bytes (one U+FFFD a
byte). It runs on the event loop, once per stream, after the child exits. Each round times
both, interleaved, on the same bytes; the ratio is the median of the per-round ratios.
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    __package__ = "bench"

import argparse
import codecs
import statistics
import time

from toolsetd.daemon.streams import decode


def whole(prefix: bytes | bytearray, complete: bool, limit: int) -> str:
    """The baseline: the whole prefix decoded in one call, then cut."""
    if complete:
        return prefix.decode("utf-8-sig", "replace")[: limit + 1]
    decoder = codecs.getincrementaldecoder("utf-8-sig")("replace")
    return decoder.decode(bytes(prefix), final=False)[: limit + 1]


def _cases() -> dict[str, tuple[bytearray, int]]:
    cases = {}
    for limit in (100_000, 1_000_000):  # the default --output-limit, and a large one
        keep = 4 * (limit + 1)
        cases[f"invalid bytes, limit {limit:,}"] = (bytearray(b"\xff" * keep), limit)
        cases[f"ASCII, limit {limit:,}"] = (bytearray(b"a" * keep), limit)
        cjk = ("語" * (keep // 3 + 1)).encode()[:keep]
        cases[f"3-byte text, limit {limit:,}"] = (bytearray(cjk), limit)
        cases[f"4-byte text, limit {limit:,}"] = (bytearray(("😀" * (keep // 4)).encode()), limit)
    cases["2,000 bytes, limit 100,000"] = (bytearray(b"x" * 2000), 100_000)
    return cases


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--rounds", type=int, default=15)
    args = parser.parse_args()
    print(f"{'prefix':32} {'stream':6} {'whole ms':>9} {'decode ms':>10} {'ratio':>6} (range)")
    for name, (data, limit) in _cases().items():
        for complete in (True, False):
            if decode(data, complete, limit) != whole(data, complete, limit):
                raise SystemExit(f"decode differs from the whole decode: {name}")
            ratios: list[float] = []
            times: dict[str, list[float]] = {"whole": [], "decode": []}
            for i in range(args.rounds):
                order = [("whole", whole), ("decode", decode)]
                took = {}
                for label, f in order if i % 2 == 0 else order[::-1]:
                    t = time.perf_counter()
                    f(data, complete, limit)
                    took[label] = time.perf_counter() - t
                    times[label].append(took[label])
                ratios.append(took["decode"] / took["whole"])
            print(
                f"{name:32} {'ended' if complete else 'cut':6} "
                f"{statistics.median(times['whole']) * 1e3:9.3f} "
                f"{statistics.median(times['decode']) * 1e3:10.3f} "
                f"{statistics.median(ratios):6.3f} ({min(ratios):.3f}-{max(ratios):.3f})"
            )


if __name__ == "__main__":
    main()
