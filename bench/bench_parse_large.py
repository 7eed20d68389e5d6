"""A large request's parse (``jsontext.loads_large``) against ``loads``, in time and memory.

``python -m bench.bench_parse_large [--rounds 9] [--memory]``

Not a goal row: a check that the large texts' parse, the standard library's since orjson
crashed the daemon out of memory, costs about what ``loads`` (orjson, and the standard
library again for a text with a fraction) cost, for the shapes a large request takes. Each
round times both, interleaved, on the same text, with the cyclic collector off as
``large.parse_large`` runs them; the ratio is the median of the per-round ratios.

``--memory`` also parses each text once with each parser in a fresh process, in a thread
as the daemon does, and prints the address space the parse took at its peak (``VmPeak``
less ``VmSize`` before it, in MiB): what a daemon whose memory is bounded (``LimitAS=``)
must have free for it. The thread's own stack and malloc arena are in it (some 70 MiB,
the whole figure for a small text).
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    __package__ = "bench"

import argparse
import gc
import json
import statistics
import subprocess
import time
from collections.abc import Callable
from typing import Any

from toolsetd.protocol.jsontext import loads, loads_large

MIB = 1 << 20


def _texts() -> dict[str, bytes]:
    """Each shape, at about the 16 MiB a line may hold (and two smaller ones)."""
    objects = [{"name": f"n{i}", "ok": True, "path": "/a/b/c"} for i in range(300_000)]
    return {
        "one ASCII string, 15 MiB": json.dumps({"s": "a" * (15 * MIB)}).encode(),
        "one string of é, 14 MiB": json.dumps({"s": "é" * (7 * MIB)}, ensure_ascii=False).encode(),
        "escaped emoji, 12 MiB": json.dumps({"s": "😀" * MIB}).encode(),
        "backslash, emoji, 14 MiB": json.dumps({"s": "\\😀" * MIB}).encode(),
        "integers, 16 MiB": json.dumps(list(range(2_000_000))).encode(),
        "fractions, 14 MiB": json.dumps([i / 7 for i in range(800_000)]).encode(),
        "small objects, 15 MiB": json.dumps(objects).encode(),
        "small objects, 1 MiB": json.dumps(objects[:20_000]).encode(),
        "small objects, 65 KiB": json.dumps(objects[:1_300]).encode(),
    }


_PARSERS: dict[str, Callable[[bytes], Any]] = {"loads": loads, "loads_large": loads_large}

#: Run in a fresh process: one parse in a thread, the address space it took at its peak.
_PEAK = """
import sys, threading
from toolsetd.protocol.jsontext import loads, loads_large
text = sys.stdin.buffer.read()
parse = {"loads": loads, "loads_large": loads_large}[sys.argv[1]]
def size(field):
    for line in open("/proc/self/status"):
        if line.startswith(field):
            return int(line.split()[1]) * 1024
before = max(size("VmSize:"), size("VmPeak:"))
worker = threading.Thread(target=parse, args=(text,))
worker.start()
worker.join()
print(size("VmPeak:") - before)
"""


def _peak(parser: str, text: bytes) -> int:
    done = subprocess.run(
        [sys.executable, "-c", _PEAK, parser], input=text, capture_output=True, check=True
    )
    return int(done.stdout)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--memory", action="store_true", help="also the peak address space")
    args = parser.parse_args()
    sys.setrecursionlimit(max(sys.getrecursionlimit(), 1024 + 200))  # as parse_large
    head = f"{'text':26} {'loads ms':>9} {'large ms':>9} {'ratio':>6} (range)"
    print(head + ("   peak MiB: loads  large" if args.memory else ""))
    for name, text in _texts().items():
        if loads_large(text) != loads(text):
            raise SystemExit(f"loads_large differs from loads: {name}")
        times: dict[str, list[float]] = {label: [] for label in _PARSERS}
        ratios: list[float] = []
        gc.disable()
        try:
            for i in range(args.rounds):
                took = {}
                order = list(_PARSERS.items())
                for label, parse in order if i % 2 == 0 else order[::-1]:
                    started = time.perf_counter()
                    value = parse(text)
                    took[label] = time.perf_counter() - started
                    times[label].append(took[label])
                    del value
                    gc.collect()
                ratios.append(took["loads_large"] / took["loads"])
        finally:
            gc.enable()
        line = (
            f"{name:26} {statistics.median(times['loads']) * 1e3:9.1f} "
            f"{statistics.median(times['loads_large']) * 1e3:9.1f} "
            f"{statistics.median(ratios):6.3f} ({min(ratios):.3f}-{max(ratios):.3f})"
        )
        if args.memory:
            peaks = [_peak(label, text) / MIB for label in _PARSERS]
            line += f"   {peaks[0]:14.1f} {peaks[1]:6.1f}"
        print(line, flush=True)


if __name__ == "__main__":
    main()
