"""The check process (``checkworker``): its answers are the in-process check's, a cancelled
check's answer is never read as the next one's, and no process at all falls back."""

from __future__ import annotations

import contextlib
import os
import signal
from typing import Any

import anyio
import pytest
from anyio import wait_all_tasks_blocked
from toolsetd.daemon.checkworker import CheckWorker
from toolsetd.daemon.exhaustion import allocations_can_fail
from toolsetd.daemon.large import LargeRequests
from toolsetd.daemon.validation import ArgumentValidators
from toolsetd.protocol.jsontext import loads

from .test_validation import loaded

_REDOS = {"type": "object", "properties": {"s": {"pattern": "^(a+)+$"}}}

#: (schema, arguments, the base time limit): a check that ends is given ample time, so
#: that a busy machine cannot stop one side of the comparison and not the other; one that
#: backtracks is stopped at 0.1 s and a little on both.
_CASES: list[tuple[dict[str, Any], Any, float]] = [
    (_REDOS, {"s": "a" * 70_000}, 30),
    (_REDOS, {"s": "a" * 70_000 + "b"}, 0.1),
    (_REDOS, {"s": "a" * 600_000 + "!"}, 0.1),  # stopped at its limit, 0.67 s
    (
        {"type": "object", "properties": {"n": {"type": "array", "items": {"minimum": 0}}}},
        {"n": [0] * 5_000 + [-1, -2]},
        30,
    ),
    (
        {"type": "object", "properties": {"n": {"items": {"type": "integer", "maximum": 10}}}},
        # numbers as written (exact), past 64 bits and past the double range
        loads(b'{"n": [' + b"1, " * 5_000 + b"123456789012345678901234567890, 1e999, 2.50]}"),
        30,
    ),
    ({"type": "object", "required": ["x"], "additionalProperties": False}, {"y" * 70_000: 1}, 30),
    (
        # the schema's numbers as tools.json gives them (floats): shown as Python writes them
        {"type": "object", "properties": {"n": {"items": {"minimum": 1e-7, "maximum": 1.5e-5}}}},
        {"n": [0] * 5_000 + [1]},
        30,
    ),
]


@pytest.mark.usefixtures("own_sigalrm")  # the check here is limited as in the daemon
@pytest.mark.parametrize(("schema", "arguments", "limit"), _CASES)
def test_the_check_process_answers_as_the_check_in_process(
    schema: dict[str, Any], arguments: Any, limit: float
) -> None:
    tool = loaded(schema)
    here = ArgumentValidators(time_limit=limit).errors(tool, arguments)

    async def there() -> list[dict[str, str]] | None:
        worker = CheckWorker(limit)
        try:
            return await worker.errors(tool, arguments)
        finally:
            await worker.aclose()

    assert anyio.run(there) == here


def test_a_check_starved_of_cpu_is_not_stopped_for_the_wall_time_it_waited() -> None:
    """The process's limit counts its CPU time: a valid check that takes a fraction of its
    limit in CPU passes however long the machine keeps it waiting. Here it runs 10 ms in
    every 110 (stopped and continued, as a tenth of a CPU), so its wall time is several
    times its limit; counted in wall time, it was "stopped after 0.57 s"."""
    # A pattern: jsonschema's check, under the limit (a plain schema is checked without).
    schema = {"type": "object", "properties": {"n": {"items": {"pattern": "^a+$"}}}}
    tool = loaded(schema)
    arguments = {"n": ["aaaa"] * 40_000}  # ~0.2 s of CPU to check; limit 0.3 s + 0.27 s

    async def main() -> tuple[list[dict[str, str]] | None, float]:
        worker = CheckWorker(0.3)
        done = anyio.Event()
        answer: list[list[dict[str, str]] | None] = []

        async def check() -> None:
            answer.append(await worker.errors(tool, arguments))
            done.set()

        try:
            assert await worker.errors(tool, {"n": ["a"] * 5_000}) == []  # started, warm
            pid = worker.pid
            assert pid is not None
            started = anyio.current_time()
            async with anyio.create_task_group() as tg:
                tg.start_soon(check)
                while not done.is_set():
                    os.kill(pid, signal.SIGSTOP)
                    await anyio.sleep(0.1)
                    os.kill(pid, signal.SIGCONT)
                    await anyio.sleep(0.01)
            return answer[0], anyio.current_time() - started
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
            await worker.aclose()

    errors, took = anyio.run(main)
    assert errors == [], errors
    assert took > 0.57, f"took {took:.2f} s: not starved past its limit, so this tells nothing"


def test_a_cancelled_check_leaves_no_answer_for_the_next() -> None:
    """A check cancelled mid-way (its caller gone) ends the process: read later, its
    answer ("was stopped") would have been taken for the next check's."""
    tool = loaded(_REDOS)

    async def main() -> tuple[list[dict[str, str]] | None, int]:
        worker = CheckWorker(ArgumentValidators().time_limit)
        try:
            with anyio.move_on_after(0.5):  # the check takes 1.1 s to be stopped
                await worker.errors(tool, {"s": "a" * 1_000_000 + "!"})
            return await worker.errors(tool, {"s": "a" * 70_000}), worker.started
        finally:
            await worker.aclose()

    errors, started = anyio.run(main)
    assert errors == []
    assert started == 2


def test_a_process_killed_while_idle_fails_no_call() -> None:
    """The process killed between two checks (the OOM killer's first choice is it, idle or
    not): the next check came before its end was known, its request went to a process
    already gone, and the call failed with "the check process ended (killed by SIGKILL)
    before it answered; send smaller values". That check was never made: it gets its
    answer from a new process."""
    tool = loaded(_REDOS)

    async def main() -> tuple[list[Any], int]:
        worker = CheckWorker(30)
        seen = []
        try:
            assert await worker.errors(tool, {"s": "a" * 70_000}) == []
            for _ in range(3):
                if worker.pid is None:  # the check before failed, and its process went
                    assert await worker.errors(tool, {"s": "a" * 70_000}) == []
                assert worker.pid is not None
                os.kill(worker.pid, signal.SIGKILL)
                seen.append(await worker.errors(tool, {"s": "a" * 70_000}))
            return seen, worker.started
        finally:
            await worker.aclose()

    assert anyio.run(main) == ([[], [], []], 4)


def test_a_closed_worker_or_one_that_cannot_start_answers_none() -> None:
    """None tells the caller to check on the loop, as before the process existed."""
    tool = loaded(_REDOS)
    arguments = {"s": "a" * 70_000}

    async def main() -> tuple[Any, Any, int | None]:
        missing = CheckWorker(0.1, python="/nonexistent/python3")
        none = await missing.errors(tool, arguments)
        worker = CheckWorker(0.1)
        assert await worker.errors(tool, arguments) == []
        pid = worker.pid
        await worker.aclose()
        return none, await worker.errors(tool, arguments), pid

    none, after_close, pid = anyio.run(main)
    assert none is None
    assert after_close is None
    assert pid is not None
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


@pytest.mark.skipif(
    allocations_can_fail() is not None,
    reason="allocations can fail here: the check process parses with the standard library, "
    "which keeps less",
)
def test_a_process_that_kept_memory_after_a_check_ends_and_the_next_starts_anew() -> None:
    """A check of 1.5 million integers leaves the process ~40 MB larger than it started
    (not all of it goes back to the system), so it ends once it has answered; long strings
    do not leave it larger, so it is kept after those."""
    schema = {"type": "object", "properties": {"s": {"type": "array", "items": {"type": "string"}}}}
    tool = loaded(schema)

    async def main() -> list[tuple[int, int | None, int]]:
        worker = CheckWorker(30)
        seen = []
        try:
            for arguments in (
                {"s": ["x" * 100_000] * 20},  # 2 MB of strings
                {"s": list(range(1_500_000))},
                {"s": ["y"] * 5_000},
            ):
                errors = await worker.errors(tool, arguments)
                assert errors is not None
                seen.append((len(errors), worker.pid, worker.started))
        finally:
            await worker.aclose()
        return seen

    kept, ended, again = anyio.run(main)
    assert kept[0] == 0 and kept[1] is not None and kept[2] == 1
    assert ended[0] == 100 and ended[1] is None and ended[2] == 1
    assert again[0] == 0 and again[1] is not None and again[2] == 2


def test_the_check_process_is_the_out_of_memory_killers_first_choice() -> None:
    """It holds a second copy of the largest arguments (12 MB of ``[]`` took 394 MB
    parsed, as in the daemon): out of memory, it should go, failing one call, before the
    daemon does, failing every client."""
    tool = loaded(_REDOS)

    async def main() -> str:
        worker = CheckWorker(0.1)
        try:
            assert await worker.errors(tool, {"s": "a" * 70_000}) == []
            return (await anyio.Path(f"/proc/{worker.pid}/oom_score_adj").read_text()).strip()
        finally:
            await worker.aclose()

    assert anyio.run(main) == "1000"


def test_a_process_that_cannot_run_is_no_process() -> None:
    """One that exits by itself before its first answer (an install changed under the
    daemon) is as good as none: the check runs on the loop (None), and no other process is
    tried for a minute, rather than a failing start for every large call."""
    tool = loaded(_REDOS)

    async def main() -> tuple[Any, Any, int]:
        worker = CheckWorker(0.1, python="/bin/false")
        try:
            first = await worker.errors(tool, {"s": "a" * 70_000})
            second = await worker.errors(tool, {"s": "a" * 70_000})
            return first, second, worker.started
        finally:
            await worker.aclose()

    assert anyio.run(main) == (None, None, 1)


def test_an_answer_too_long_to_read_says_so() -> None:
    """Errors whose paths name a key of 8.4 million ``/`` (each escaped as ``~1``) make an
    answer over 64 MiB: the call is told that, not that the process died."""
    schema = {"type": "object", "additionalProperties": {"minLength": 1, "pattern": "x"}}
    tool = loaded(schema)

    async def main() -> Any:
        worker = CheckWorker(30)
        try:
            return await worker.errors(tool, {"/" * 8_400_000: ""})
        finally:
            await worker.aclose()

    [error] = anyio.run(main)
    assert error["path"] == ""
    assert "the errors found are longer than 67108864 bytes" in error["message"], error


def test_the_arguments_are_encoded_for_the_process_in_the_worker_slot() -> None:
    """Encoding three million fractions for the process (orjson calls back into Python for
    each) held the loop most of a second: it is done in the large requests' worker slot,
    so a check waits for that slot before anything else."""
    tool = loaded(_REDOS)

    async def main() -> tuple[int, list[dict[str, str]] | None]:
        large = LargeRequests()
        worker = CheckWorker(0.1, large_requests=large)
        result: list[list[dict[str, str]] | None] = []
        try:
            async with anyio.create_task_group() as tg, large.slot:
                tg.start_soon(lambda: _append(result, worker.errors(tool, {"s": "a" * 70_000})))
                await wait_all_tasks_blocked()
                waiting = large.slot.statistics().tasks_waiting
            return waiting, result[0]
        finally:
            await worker.aclose()

    assert anyio.run(main) == (1, [])


async def _append(into: list[Any], awaitable: Any) -> None:
    into.append(await awaitable)
