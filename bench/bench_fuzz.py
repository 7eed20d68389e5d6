"""Envelope fuzz against a real daemon: every frame that needs an answer gets one.

``python -m bench.bench_fuzz [--frames 100000] [--connections 100] [--parallel 8] [--seed 1]``

Not a speed benchmark and not part of ``make test``: it sends ``--frames`` frames over
``--connections`` connections (``--parallel`` at a time), each connection pipelining its
share and then a probe ``status``. The frames are random JSON-RPC envelopes (each member
absent or any JSON type, real and bogus methods, valid-looking and broken params, ids of
every type), batches of them, arguments nested past every limit, lines that are not JSON
or not UTF-8, and now and then a real ``invoke`` whose answers arrive among the others.
The oracle of what needs an answer is the JSON-RPC 2.0 specification
(``tests/integration/test_hostile.py``: ``needs_answer``, ``expected_id``).

It reports, and exits non-zero unless both are zero:

* connections closed without an answer: a connection that reached end of file before the
  answer to its probe (so some answer was never sent);
* internal errors: answers (or batch items) with code -32603.

It also checks, per connection, that the answers' ids are exactly the expected multiset.
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    __package__ = "bench"

import argparse
import asyncio
import json
import random
import time
from collections import Counter
from typing import Any

from bench._common import (
    TRUE_SET,
    make_home,
    start_daemon,
    stop_cleanly_on_sigterm,
    temp_base,
    write_results,
)
from tests.integration.test_hostile import VALUES, expected_id, needs_answer

_METHODS = ["status", "list", "classify", "cancel", "reload", "invoke", "nope", ""]
_ABSENT = object()


def _params(rng: random.Random, workspace: str) -> Any:
    roll = rng.random()
    if roll < 0.4:
        return rng.choice(VALUES)
    if roll < 0.7:
        return {
            "tool": rng.choice([TRUE_SET, "nope", 1, None]),
            "workspace": rng.choice([workspace, "relative", 7]),
            "arguments": rng.choice([{}, {"a": 1.50}, [], None]),
        }
    if roll < 0.8:
        return {"callId": rng.choice(["x", 1, None, "y" * 200])}
    if roll < 0.9:
        return {"subscribe": rng.choice([True, False, 1]), "catalog": rng.choice(["plan", "x"])}
    depth = rng.choice([63, 64, 65, 300])
    nested: Any = {}
    for _ in range(depth - 1):
        nested = {"a": nested}
    return {"tool": TRUE_SET, "workspace": workspace, "arguments": nested}


def _envelope(rng: random.Random, workspace: str, next_id: list[int]) -> Any:
    frame: dict[str, Any] = {}
    for member, good in (("jsonrpc", "2.0"), ("method", None), ("params", None), ("id", None)):
        roll = rng.random()
        if member == "jsonrpc":
            value: Any = good if roll < 0.85 else rng.choice([*VALUES, _ABSENT])
        elif member == "method":
            value = rng.choice(_METHODS) if roll < 0.7 else rng.choice([*VALUES, _ABSENT])
        elif member == "params":
            value = _params(rng, workspace) if roll < 0.8 else _ABSENT
        else:
            next_id[0] += 1
            value = next_id[0] if roll < 0.6 else rng.choice([*VALUES, _ABSENT, f"s{next_id[0]}"])
        if value is not _ABSENT:
            frame[member] = value
    if rng.random() < 0.03:
        frame[rng.choice(["extra", "result", "error"])] = 1
    return frame


def _line(rng: random.Random, workspace: str, next_id: list[int]) -> tuple[bytes, list[Any]]:
    """One line to send and the ids of the answers it needs (one item per answer line)."""
    roll = rng.random()
    if roll < 0.02:
        return rng.choice([b"{not json", b"\xff\xfe", b'{"a":', b"[" * 1100 + b"]" * 1100]), [None]
    if roll < 0.03:
        next_id[0] += 1
        call = {
            "jsonrpc": "2.0",
            "id": next_id[0],
            "method": "invoke",
            "params": {"tool": TRUE_SET, "arguments": {}, "workspace": workspace},
        }
        return json.dumps(call).encode(), [next_id[0]]
    if roll < 0.10:
        batch = [_envelope(rng, workspace, next_id) for _ in range(rng.randint(1, 6))]
        wanted = [f for f in batch if needs_answer(f)]
        ids = tuple(sorted(json.dumps(expected_id(f)) for f in wanted))
        return json.dumps(batch).encode(), [("batch", ids)] if wanted else []
    frame = _envelope(rng, workspace, next_id)
    return json.dumps(frame).encode(), [expected_id(frame)] if needs_answer(frame) else []


async def _one_connection(
    sock: Path, lines: list[tuple[bytes, list[Any]]], probe: str, stats: Counter[str]
) -> None:
    reader, writer = await asyncio.open_unix_connection(str(sock), limit=64 << 20)
    expected: Counter[str] = Counter()
    for _, answers in lines:
        for answer in answers:
            expected[json.dumps(answer) if not isinstance(answer, tuple) else repr(answer)] += 1

    async def send() -> None:
        for text, _ in lines:
            writer.write(text + b"\n")
            await writer.drain()
        probe_frame = {"jsonrpc": "2.0", "id": probe, "method": "status"}
        writer.write(json.dumps(probe_frame).encode() + b"\n")
        await writer.drain()

    got: Counter[str] = Counter()
    want = sum(expected.values())
    probed = False
    sender = asyncio.ensure_future(send())
    try:
        # Answers come in completion order (the probe, answered inline, may overtake
        # earlier frames): read until the probe and every expected answer are in.
        while not (probed and sum(got.values()) >= want):
            try:
                line = await asyncio.wait_for(reader.readline(), 20)
            except TimeoutError:
                stats["connections that went silent"] += 1
                break
            if not line:
                stats["connections closed without an answer"] += 1
                break
            message = json.loads(line)
            if isinstance(message, list):
                stats["internal errors"] += sum(
                    1 for m in message if m.get("error", {}).get("code") == -32603
                )
                # a batch answer: its ids as a multiset (items are answered in order, but
                # the oracle only says which items need one)
                got[repr(("batch", tuple(sorted(json.dumps(m["id"]) for m in message))))] += 1
                continue
            if "method" in message and "id" not in message:
                continue  # started/progress/completed of an invoke
            if message.get("error", {}).get("code") == -32603:
                stats["internal errors"] += 1
            if message.get("id") == probe:
                probed = True
                continue
            got[json.dumps(message.get("id"))] += 1
    finally:
        sender.cancel()
        writer.close()
    stats["frames"] += len(lines)
    stats["answers expected"] += sum(expected.values())
    stats["answers received"] += sum(got.values())
    if got != expected:
        stats["connections with wrong answers"] += 1
        missing = expected - got
        extra = got - expected
        if stats["connections with wrong answers"] <= 3:
            print(
                f"  mismatch: missing {dict(list(missing.items())[:5])} "
                f"extra {dict(list(extra.items())[:5])}",
                file=sys.stderr,
            )


async def _run(
    sock: Path, workspace: str, frames: int, connections: int, parallel: int, seed: int
) -> Counter[str]:
    rng = random.Random(seed)  # noqa: S311 (reproducible fuzz input, not a secret)
    next_id = [0]
    per = frames // connections
    plans = [[_line(rng, workspace, next_id) for _ in range(per)] for _ in range(connections)]
    stats: Counter[str] = Counter()
    gate = asyncio.Semaphore(parallel)

    async def guarded(index: int) -> None:
        async with gate:
            try:
                await _one_connection(sock, plans[index], f"probe-{index}", stats)
            except (TimeoutError, ConnectionError) as exc:
                stats["connections closed without an answer"] += 1
                print(f"  connection {index}: {type(exc).__name__}", file=sys.stderr)

    await asyncio.gather(*(guarded(i) for i in range(connections)))
    return stats


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--frames", type=int, default=100_000)
    parser.add_argument("--connections", type=int, default=100)
    parser.add_argument("--parallel", type=int, default=8)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    stop_cleanly_on_sigterm()
    with temp_base() as base:
        home = make_home(base, 0, trivial=True)
        workspace = base / "ws"
        workspace.mkdir()
        daemon = start_daemon(home, base, extra=["--progress-interval", "60"])
        try:
            started = time.monotonic()
            stats = asyncio.run(
                _run(
                    daemon.socket,
                    str(workspace),
                    args.frames,
                    args.connections,
                    args.parallel,
                    args.seed,
                )
            )
            seconds = time.monotonic() - started
            alive = daemon.popen.poll() is None
        finally:
            daemon.stop()
    for key in (
        "frames",
        "answers expected",
        "answers received",
        "connections closed without an answer",
        "internal errors",
        "connections with wrong answers",
        "connections that went silent",
    ):
        print(f"{key:40} {stats[key]:>9,}")
    print(f"{'daemon alive at the end':40} {alive!s:>9}")
    print(f"{'seconds':40} {seconds:>9.1f}")
    write_results("fuzz", {"stats": dict(stats), "seconds": seconds, "seed": args.seed})
    bad = (
        stats["connections closed without an answer"]
        + stats["internal errors"]
        + stats["connections with wrong answers"]
        + stats["connections that went silent"]
    )
    return 0 if bad == 0 and alive else 1


if __name__ == "__main__":
    sys.exit(main())
