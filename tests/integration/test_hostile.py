"""Hostile and broken clients: every frame that needs an answer gets one, nobody else suffers.

The oracle of "needs an answer" is the JSON-RPC 2.0 specification, written out here
independently of the daemon's envelope check: only a valid notification (an object with
``"jsonrpc": "2.0"``, a string ``method``, no ``id`` member, ``params`` absent or an object
or an array, no other member), or a batch made only of those, goes unanswered. The answer
carries the frame's id when that id is a string or an integer, else ``null``.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import json
import os
import resource
import select
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from .conftest import (
    CpuByThread,
    Daemon,
    RawConn,
    daemon_in,
    descriptors_limited,
    eventually,
    marked_processes,
    memory_limited,
    start_daemon,
    started_at_the_limit,
    tasks_limited,
    write_set,
)

#: One value of every JSON type (and a few shapes of each that have caught parsers out).
VALUES: list[Any] = [
    None, True, False, 0, -1, 7, 2**70, 1.5, -0.0, "", "2.0", "status", "list", "cancel",
    "no-such", [], [1], ["status"], [{}], {}, {"a": 1}, {"method": "status"},
    [[[]]], {"": {"": {}}},
]
MEMBERS = ("jsonrpc", "method", "params", "id")
_ABSENT = object()


def _valid_id(value: Any) -> bool:
    return type(value) is str or type(value) is int


def needs_answer(frame: Any) -> bool:
    """Whether the specification requires a response to this one (non-batch) value."""
    if type(frame) is not dict or "id" in frame:
        return True
    if frame.get("jsonrpc") != "2.0" or type(frame.get("method")) is not str:
        return True
    if not set(frame) <= {"jsonrpc", "method", "params"}:
        return True
    return "params" in frame and type(frame["params"]) not in (dict, list)


def expected_id(frame: Any) -> Any:
    if type(frame) is dict and _valid_id(frame.get("id")):
        return frame["id"]
    return None


def envelope_frames() -> Iterator[dict[str, Any]]:
    """Each member given every value (the others valid), and each member left out."""
    base: dict[str, Any] = {"jsonrpc": "2.0", "method": "status", "params": {}, "id": 1}
    for member in MEMBERS:
        for value in [*VALUES, _ABSENT]:
            frame = dict(base)
            if value is _ABSENT:
                del frame[member]
            else:
                frame[member] = value
            yield frame
    # Pairs of members varied together, for the interactions (method x id above all).
    for (m1, m2), (v1, v2) in itertools.product(
        [("method", "id"), ("method", "params"), ("jsonrpc", "id")],
        itertools.product(VALUES[::3], VALUES[1::3]),
    ):
        yield {**base, m1: v1, m2: v2}


@pytest.fixture(scope="module")
def plain() -> Iterator[Daemon]:
    with daemon_in("tsh-", args=["--no-watch"]) as d:
        yield d


def _answers(conn: RawConn, count: int, probe: str) -> list[Any]:
    """Read ``count`` answers and the probe's (answers come in completion order: the probe,
    answered at once, may overtake slower frames); return all but the probe's."""
    got: list[Any] = []
    probed = False
    while not (probed and len(got) >= count):
        message = conn.receive()
        if isinstance(message, dict) and message.get("id") == probe:
            probed = True
        else:
            got.append(message)
    return got


def test_every_envelope_member_of_every_type_is_answered(plain: Daemon) -> None:
    """Single frames: the right answers (id and all), no -32603, and the connection lives."""
    frames = list(envelope_frames())
    expected = Counter(json.dumps(expected_id(f)) for f in frames if needs_answer(f))
    with plain.raw(timeout=30) as conn:
        payload = b"".join(json.dumps(f).encode() + b"\n" for f in frames)
        conn.send_bytes(payload + b'{"jsonrpc":"2.0","method":"status","id":"probe"}\n')
        got = _answers(conn, sum(expected.values()), "probe")
        assert all("method" not in m for m in got), [m for m in got if "method" in m][:3]
        assert Counter(json.dumps(m["id"]) for m in got) == expected
        codes = Counter(m["error"]["code"] for m in got if "error" in m)
        assert -32603 not in codes, codes
        assert "result" in conn.request("status")
    assert plain.proc.poll() is None


def test_batches_of_hostile_frames_are_answered_in_one_array(plain: Daemon) -> None:
    frames = list(envelope_frames())
    batches = [frames[i:i + 7] for i in range(0, len(frames), 7)]
    with plain.raw(timeout=30) as conn:
        for batch in batches:
            conn.send(batch)
            wanted = [f for f in batch if needs_answer(f)]
            if not wanted:
                continue
            answer = conn.receive()
            assert isinstance(answer, list), answer
            assert Counter(json.dumps(a["id"]) for a in answer) == Counter(
                json.dumps(expected_id(f)) for f in wanted)
            assert all(a.get("error", {}).get("code") != -32603 for a in answer), answer
        assert "result" in conn.request("status")


@pytest.mark.parametrize("method", [[1], {"a": 1}, ["status"], {}])
def test_a_method_that_is_an_array_or_object_gets_32600(plain: Daemon, method: Any) -> None:
    """It used to kill the connection (unhashable type) and every call in flight on it."""
    with plain.raw() as conn:
        conn.send({"jsonrpc": "2.0", "id": 5, "method": method})
        answer = conn.receive()
        assert answer["id"] == 5 and answer["error"]["code"] == -32600, answer
        assert "'method' must be a string" in answer["error"]["message"]
        conn.send({"jsonrpc": "2.0", "method": method})  # no id: still not a notification
        assert conn.receive()["error"]["code"] == -32600
        assert "result" in conn.request("status")


def test_a_call_in_flight_survives_a_hostile_frame_beside_it(plain: Daemon) -> None:
    """The hostile frame arrives while a reload runs: the reload still gets its answer."""
    with plain.raw() as conn:
        conn.send({"jsonrpc": "2.0", "id": "r", "method": "reload", "params": {}})
        conn.send({"jsonrpc": "2.0", "id": "h", "method": ["x"]})
        ids = {conn.receive()["id"] for _ in range(2)}
        assert ids == {"r", "h"}


def test_the_connection_is_not_closed_after_hostile_frames(plain: Daemon) -> None:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(5)
    sock.connect(str(plain.socket))
    try:
        sock.sendall(b'{"jsonrpc":"2.0","method":{"x":[]}}\n' * 50)
        time.sleep(0.2)
        sock.sendall(b'{"jsonrpc":"2.0","method":"status","id":"alive"}\n')
        data = b""
        while b'"alive"' not in data:
            chunk = sock.recv(65536)
            assert chunk, "the daemon closed the connection"
            data += chunk
    finally:
        sock.close()


# -- deep nesting ------------------------------------------------------------------------


def _nested_text(depth: int) -> str:
    """The JSON text of an arguments object ``depth`` levels deep: {"a":[{"a":[...null]}]}."""
    kinds = [k % 2 == 1 for k in range(1, depth + 1)]  # level 1 (the top) is an object
    return ("".join('{"a":' if obj else "[" for obj in kinds) + "null"
            + "".join("}" if obj else "]" for obj in reversed(kinds)))


def _request(d: Daemon, method: str, tool: str, depth: int) -> dict[str, Any]:
    text = (f'{{"jsonrpc":"2.0","id":1,"method":"{method}","params":{{"tool":"{tool}",'
            f'"workspace":{json.dumps(str(d.workspace))},"arguments":{_nested_text(depth)}}}}}')
    with d.raw() as conn:
        conn.send_bytes(text.encode() + b"\n")
        while True:
            buffer = b""
            while b"\n" not in buffer:
                buffer += conn.sock.recv(1 << 20)
            line = buffer.split(b"\n", 1)[0]
            if b'"method"' not in line[:30]:
                return dict(json.loads(line))


def _deep_sets(home: Path, _: Path) -> None:
    tools = home / "tools"
    write_set(tools, "deep", {"runner": "exec", "description": "d", "command": ["true"],
                              "stdin": False, "approval": "always", "schema": {"type": "object"}})
    write_set(tools, "deepask", {"runner": "exec", "description": "d", "command": ["true"],
                                 "stdin": False, "schema": {"type": "object"},
                                 "pathArguments": ["a"]})
    # A plain schema (no pattern): checking many values is plain Python, about 1 µs each.
    write_set(tools, "bulk", {"runner": "exec", "description": "d", "command": ["true"],
                              "stdin": False, "approval": "always",
                              "schema": {"type": "object", "properties": {
                                  "n": {"type": "array", "items": {"type": "integer",
                                                                   "minimum": 0}}}}})
    # Outside the plain subset (propertyNames), so its check stays on the loop; cheap for
    # any value of a property.
    write_set(tools, "names", {"runner": "exec", "description": "d", "command": ["true"],
                               "stdin": False, "approval": "always",
                               "schema": {"type": "object", "propertyNames": {"maxLength": 8}}})
    # Any numbers: a classify of millions of fractions echoes them all.
    write_set(tools, "nums", {"runner": "exec", "description": "d", "command": ["true"],
                              "stdin": False, "approval": "always",
                              "schema": {"type": "object", "properties": {
                                  "n": {"type": "array", "items": {"type": "number"}}}}})
    # A pattern that backtracks: each more "a" before the "!" doubles re's work.
    write_set(tools, "redos", {"runner": "exec", "description": "d", "command": ["true"],
                               "stdin": False, "approval": "always",
                               "schema": {"type": "object",
                                          "properties": {"s": {"pattern": "^(a+)+$"}}}})


@pytest.fixture(scope="module")
def echo_daemon() -> Iterator[Daemon]:
    with daemon_in("tsn-", _deep_sets, ["--no-watch"]) as d:
        yield d


@pytest.mark.parametrize("depth", [65, 251, 300, 1000])
@pytest.mark.parametrize(("method", "tool"), [("classify", "deep"), ("invoke", "deepask")])
def test_arguments_nested_too_deep_get_32602_naming_the_limit(
    echo_daemon: Daemon, depth: int, method: str, tool: str
) -> None:
    response = _request(echo_daemon, method, tool, depth)
    assert response["error"]["code"] == -32602, response
    assert "'arguments' must nest at most 64 levels" in response["error"]["message"]


@pytest.mark.parametrize(("method", "tool"), [("classify", "deep"), ("invoke", "deepask")])
def test_arguments_at_the_depth_limit_are_echoed(echo_daemon: Daemon, method: str, tool: str) -> None:
    arguments = json.loads(_nested_text(64))
    response = _request(echo_daemon, method, tool, 64)
    echoed = response["result"] if method == "classify" else response["error"]["data"]
    assert echoed["arguments"] == arguments, response


def test_a_pattern_that_backtracks_is_stopped_and_the_daemon_serves_on(echo_daemon: Daemon) -> None:
    """A schema pattern against a model's value is bounded: the call is refused, not hung.

    Unbounded, ``^(a+)+$`` against 40 ``a`` and a ``!`` holds the event loop for days.
    """
    params = {"tool": "redos", "arguments": {"s": "a" * 40 + "!"},
              "workspace": str(echo_daemon.workspace)}
    for method in ("invoke", "classify"):
        response = echo_daemon.call(method, params)
        assert response["error"]["code"] == -32002, response
        message = response["error"]["data"]["errors"][0]["message"]
        assert "was stopped after 0.1 s (0.1 s, plus 1 s per MiB of arguments)" in message
        assert "pattern" in message
    assert "result" in echo_daemon.call("status")
    good = echo_daemon.call("invoke", {**params, "arguments": {"s": "aaaa"}})
    assert good["result"]["status"] == "ok", good


def _answered_yet(conn: RawConn) -> bool:
    """Whether the daemon has sent this connection anything (without waiting for it)."""
    conn.sock.setblocking(False)
    try:
        return conn.sock.recv(1, socket.MSG_PEEK) != b""
    except BlockingIOError:
        return False
    finally:
        conn.sock.setblocking(True)
        conn.sock.settimeout(120)


@pytest.mark.parametrize(("method", "last"), [("classify", 0), ("invoke", -1)])
def test_many_arguments_are_checked_without_holding_other_clients(
    echo_daemon: Daemon, method: str, last: int
) -> None:
    """Checking 500,000 integers against a plain schema takes most of a second of Python.
    On the event loop it held every other client for as long: another client's status,
    sent while the check ran, was answered after the big call. It runs in the check
    process now, with the same verdict: while the daemon waits for that process (held
    stopped, so that no load can make the check end first), the status is answered and the
    big call is not. The arguments that fail (the last integer is negative) go on to
    jsonschema for the messages, still under the time limit for their size, which stops it
    there as on the loop."""
    count = 500_000
    arguments = b'{"n":[' + b"0," * (count - 1) + str(last).encode() + b"]}"
    line = (b'{"jsonrpc":"2.0","id":"big","method":"' + method.encode() + b'","params":'
            b'{"tool":"bulk","workspace":' + json.dumps(str(echo_daemon.workspace)).encode()
            + b',"arguments":' + arguments + b"}}\n")
    with echo_daemon.raw(timeout=120) as big, echo_daemon.raw(timeout=120) as other:
        other.request("status")  # connected and served before the big line is sent
        _served_while_checked(echo_daemon, big, line, other)
        reply = big.receive()
    assert reply["id"] == "big"
    if last == 0:
        assert reply["result"]["arguments"]["n"][-1] == 0, reply["result"]["decision"]
    else:
        assert reply["error"]["code"] == -32002, reply["error"]
        [error] = reply["error"]["data"]["errors"]
        assert "was stopped after" in error["message"], error
        assert "plus 1 s per MiB of arguments" in error["message"], error


def _redos_line(d: Daemon, request_id: str, text: str, method: str = "invoke") -> bytes:
    """A call of ``redos`` with ``{"s": text}`` as one line."""
    return json.dumps({"jsonrpc": "2.0", "id": request_id, "method": method, "params": {
        "tool": "redos", "workspace": str(d.workspace), "arguments": {"s": text}}}).encode() + b"\n"


#: 600,000 "a" and a "!": more than 64 Ki characters, so checked in the check process,
#: where ``^(a+)+$`` backtracks until the limit for its size stops it (0.67 s).
_LONG_REDOS = "a" * 600_000 + "!"


def _check_processes(daemon_pid: int) -> list[int]:
    """The pids of the check processes a daemon started (``checkworker``)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"toolsetd.daemon.checkworker" in argv and str(daemon_pid).encode() in argv:
            found.append(int(entry.name))
    return found


def test_a_pattern_that_backtracks_on_large_arguments_holds_no_other_client(
    echo_daemon: Daemon,
) -> None:
    """A pattern that backtracks over a long string is stopped only at the limit for the
    arguments' size: 0.67 s for these 600 KB, 16 s for a 16 MiB message. On the event
    loop that held every other client as long (``re`` holds the GIL, so a thread would
    too). Large arguments are checked in the check process: another client's status, sent
    while the daemon waits for it, is answered first (the process held stopped meanwhile:
    its alarm, 0.67 s of the wall clock, could end the check before a loaded machine had
    served the status), and the call gets the same error."""
    with echo_daemon.raw(timeout=120) as big, echo_daemon.raw(timeout=120) as other:
        other.request("status")
        line = _redos_line(echo_daemon, "big", _LONG_REDOS)
        _served_while_checked(echo_daemon, big, line, other)
        reply = big.receive()
    assert reply["error"]["code"] == -32002, reply
    [error] = reply["error"]["data"]["errors"]
    assert "was stopped after 0.67 s (0.1 s, plus 1 s per MiB of arguments)" in error["message"]
    assert "a pattern in the schema may backtrack" in error["message"]
    assert _check_processes(echo_daemon.proc.pid), "no check process ran it"


def test_a_check_process_that_dies_or_is_left_fails_its_call_only(echo_daemon: Daemon) -> None:
    """The check process killed mid-check (the OOM killer) fails that call with an error
    that says so, and the next large check starts a new one. A caller that leaves
    mid-check leaves its answer to its own request, not to the next call's."""
    good = json.loads(_redos_line(echo_daemon, "good", "a" * 70_000, "classify"))
    assert conn_result(echo_daemon, good)["decision"] == "allow"  # a process runs
    [worker] = _check_processes(echo_daemon.proc.pid)
    before = _bytes_read(worker)
    with echo_daemon.raw(timeout=120) as conn:
        conn.send_bytes(_redos_line(echo_daemon, "killed", "a" * 3_000_000 + "!"))  # 3 s
        eventually(lambda: _bytes_read(worker) - before > 3_000_000, timeout=60,
                   what="the request read by the check process")
        os.kill(worker, signal.SIGKILL)
        reply = conn.receive()
    [error] = reply["error"]["data"]["errors"]
    assert "the check process ended (killed by SIGKILL) before it answered" in error["message"]
    assert conn_result(echo_daemon, good)["decision"] == "allow"

    with echo_daemon.raw(timeout=120) as conn:
        conn.send_bytes(_redos_line(echo_daemon, "left", "a" * 3_000_000 + "!"))
        eventually(lambda: _unread(conn.sock) == 0, timeout=60, what="the line read")
        time.sleep(0.3)  # the check under way
    # The next check waits for the left caller's, then gets its own answer, not that one.
    assert conn_result(echo_daemon, good)["decision"] == "allow"


def test_a_cancel_reaches_a_call_while_its_arguments_are_checked(echo_daemon: Daemon) -> None:
    """A call is in flight from the moment its invoke is read, while it is judged too. A
    ``cancel`` of its id during a check of large arguments in the check process (3 s of
    backtracking here) ends the check at once, and the call answers ``cancelled`` without
    a process; the next large check gets a new process. It was registered only once
    judged: the cancel was -32005 ("no call with this id is in flight"), and the call went
    on to its own answer when the check ended."""
    good = json.loads(_redos_line(echo_daemon, "good", "a" * 70_000, "classify"))
    assert conn_result(echo_daemon, good)["decision"] == "allow"  # a process runs
    [worker] = _check_processes(echo_daemon.proc.pid)
    before = _bytes_read(worker)
    request = json.loads(_redos_line(echo_daemon, "slow", "a" * 3_000_000 + "!"))
    request["params"]["callId"] = "judged-1"
    with echo_daemon.raw(timeout=120) as conn:
        conn.send_bytes(json.dumps(request).encode() + b"\n")
        eventually(lambda: _bytes_read(worker) - before > 3_000_000, timeout=60,
                   what="the arguments read by the check process")
        cancelled = echo_daemon.call("cancel", {"callId": "judged-1"})
        assert cancelled.get("result") == {"cancelled": True}, cancelled
        reply = conn.receive()
    assert reply["id"] == "slow"
    assert reply["result"]["status"] == "cancelled", reply
    assert reply["result"]["exitCode"] is None
    assert reply["result"]["content"] == [{"type": "text", "text": "The call was cancelled."}]
    eventually(lambda: _gone(worker), timeout=30, what="the cancelled check's process gone")
    assert conn_result(echo_daemon, good)["decision"] == "allow"
    assert echo_daemon.call("cancel", {"callId": "judged-1"})["error"]["code"] == -32005


def _bytes_written(pid: int) -> int | None:
    """The bytes process ``pid`` has written (``wchar``), or None once it has ended."""
    try:
        return _proc_number(pid, "io", "wchar")
    except FileNotFoundError:
        return None


def _check_answered(d: Daemon) -> Any:
    """A condition: the check process running now (started by a small large check) has
    written an answer since (or ended, having answered and left).

    More than one byte: before each check the daemon asks the process for the echo of a
    blank line (``checkworker._alive``), which comes before the check is even under way.
    """
    warm = json.loads(_redos_line(d, "warm", "a" * 70_000, "classify"))
    assert conn_result(d, warm)["decision"] == "allow"  # a check process runs
    [worker] = _check_processes(d.proc.pid)
    before = _bytes_written(worker)
    assert before is not None

    def answered() -> bool:
        written = _bytes_written(worker)
        return written is None or written > before + 1

    return answered


def _unread_input(pid: int) -> int:
    """Bytes written to process ``pid``'s stdin (a pipe) that it has not read yet."""
    import fcntl  # Linux-only ioctl, as the daemon's platform
    import termios

    fd = os.open(f"/proc/{pid}/fd/0", os.O_RDONLY | os.O_NONBLOCK)  # the pipe, never read
    try:
        return int(struct.unpack("i", fcntl.ioctl(fd, termios.FIONREAD, b"\0" * 4))[0])
    finally:
        os.close(fd)


@contextlib.contextmanager
def _check_process_stopped(d: Daemon) -> Iterator[Callable[[], bool]]:
    """The daemon's check process (started by a small large check) stopped until the block
    ends; yields a condition: the daemon waits for it.

    Once the daemon has asked the process whether it is alive (``checkworker._alive``: the
    blank line in its stdin, unread), a large call's parse, depth check and encode for the
    process are done, and nothing that follows its check can have begun: its verdict and
    answer wait for the process, however slow or loaded the machine.
    """
    for _ in range(3):  # one that ended after its answer is replaced by the next check
        conn_result(d, json.loads(_redos_line(d, "warm", "a" * 70_000, "classify")))
        workers = _check_processes(d.proc.pid)
        assert len(workers) == 1, f"the check processes of a large check: {workers}"
        [worker] = workers
        with contextlib.suppress(ProcessLookupError):
            os.kill(worker, signal.SIGSTOP)
        eventually(lambda: _state(worker) not in ("R", "S", "D"), timeout=30,  # noqa: B023
                   what="the check process stopped")
        if _state(worker) in ("T", "t"):
            break
    else:
        raise AssertionError("no check process lived on after its answer")

    def waiting() -> bool:
        assert _state(worker) in ("T", "t"), f"the check process {worker} ended, held stopped"
        return _unread_input(worker) > 0

    try:
        yield waiting
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(worker, signal.SIGCONT)


def _state(pid: int) -> str | None:
    """Process ``pid``'s state (``T`` stopped, ``Z`` ended, ...), None once it is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return None


def _served_while_checked(d: Daemon, big: RawConn, line: bytes, other: RawConn) -> None:
    """Send ``line``, a call with large arguments, on ``big``; check that its check is the
    check process's, and that ``other`` is served while the daemon waits for it.

    On the loop the check would answer the call without a word to the process.
    """
    with _check_process_stopped(d) as waiting:
        big.send_bytes(line)
        eventually(lambda: waiting() or _answered_yet(big), timeout=60,
                   what="the daemon waiting for its check process")
        assert not _answered_yet(big), "the big call was answered without its check process"
        assert "result" in other.request("status")
        assert not _answered_yet(big), "the big call was answered, its check process stopped"


def _answered_off_the_loop(d: Daemon, conn: RawConn, line: bytes) -> Any:
    """Send ``line``, a large call, on ``conn``; check that what the daemon does with its
    arguments once they are checked (encodes of them, for an answer, a digest, a question)
    runs off the event loop (``CpuByThread``); return the first message that follows.

    The window starts while the daemon waits for its check process
    (``_check_process_stopped``) and ends at the answer's first byte (its frame is encoded
    whole before). It holds one to three encodes of the same arguments (0.35 s each here):
    one of them on the loop gives its thread at least half of what the worker threads spend.
    """
    with _check_process_stopped(d) as waiting:
        conn.send_bytes(line)
        eventually(waiting, timeout=60, what="the daemon waiting for its check process")
        cpu = CpuByThread(d.proc.pid)
    conn.sock.recv(1, socket.MSG_PEEK)
    cpu.stop()
    first = conn.receive()
    # An error (the check stopped, the process lost) encodes no arguments: not the case here.
    assert all("error" not in m for m in (first if isinstance(first, list) else [first])), (
        str(first)[:500])
    cpu.assert_off_the_loop("the checked arguments were encoded")
    return first


@pytest.mark.timeout(180)  # large arguments parsed, checked and echoed (~12 s in CI, 37 at a load of 10)
@pytest.mark.parametrize("batch", [False, True], ids=["request", "batch"])
def test_the_answer_that_echoes_large_arguments_is_encoded_off_the_loop(
    echo_daemon: Daemon, batch: bool
) -> None:
    """A ``classify`` answers with its arguments, and orjson calls back into Python for
    every fraction kept as written: three million of them took most of a second to encode,
    on the event loop, after the check, and every other client waited as long. The answer
    to a large line is encoded in a worker thread: from the check on, the loop's thread
    spends a small part of what the worker threads spend on it. A batch of more than one
    request answers in one array, posted by its own path (``_handle_batch``), whose encode
    held every other client as long until it went to the worker slot too."""
    count = 3_000_000
    request = (b'{"jsonrpc":"2.0","id":"big","method":"classify","params":{"tool":"nums",'
               b'"workspace":' + json.dumps(str(echo_daemon.workspace)).encode()
               + b',"arguments":{"n":[' + b"0.5," * (count - 1) + b"0.5]}}}")
    small = b'{"jsonrpc":"2.0","id":"small","method":"status"}'
    line = (b"[" + request + b"," + small + b"]\n") if batch else request + b"\n"
    with echo_daemon.raw(timeout=120) as big:
        reply = _answered_off_the_loop(echo_daemon, big, line)
    if batch:
        assert [answer["id"] for answer in reply] == ["big", "small"]
        reply = reply[0]
    assert len(reply["result"]["arguments"]["n"]) == count


@pytest.mark.timeout(180)  # a 12 MB call encoded four times, and parsed by both ends (~20 s in CI, over 60 at a load of 10)
@pytest.mark.parametrize("era", ["2025-11-25", "2026-07-28"])
def test_an_mcp_approval_of_large_arguments_holds_no_other_client(
    echo_daemon: Daemon, era: str
) -> None:
    """An MCP call that needs the operator's approval encodes its arguments for the
    approval's digest, for the question put to the operator, and (2026-07-28) for the key
    its ``requestState`` is bound to, and again for the digest when the accepted call comes
    back. With three million fractions each encode held the event loop, and every other
    client, about 0.35 s. They run in the large requests' worker slot: from the check on,
    the loop's thread spends a small part of what the worker threads spend, for the
    accepted retry's digest too (which no order of answers told apart: the tool's run
    comes after it anyway)."""
    # 2026-07-28 says its version and capabilities on each request; 2025-11-25 at initialize.
    meta = {"_meta": {"io.modelcontextprotocol/protocolVersion": era,
                      "io.modelcontextprotocol/clientCapabilities": {"elicitation": {}}}}
    if era == "2025-11-25":
        meta = {}
    count = 3_000_000
    arguments = b'{"a":"x","n":[' + b"0.5," * (count - 1) + b"0.5]}"

    def call(request_id: str, extra: dict[str, Any]) -> bytes:
        params = json.dumps({"name": "deepask", **meta, **extra}).encode()
        return (b'{"jsonrpc":"2.0","id":"' + request_id.encode() + b'","method":"tools/call",'
                b'"params":' + params[:-1] + b',"arguments":' + arguments + b"}}\n")

    with echo_daemon.raw(timeout=120) as conn:
        conn.send({"jsonrpc": "2.0", "id": "b", "method": "mcp.bind",
                   "params": {"workspace": str(echo_daemon.workspace)}})
        assert conn.receive()["result"]["bound"] is True
        if era == "2025-11-25":
            conn.send({"jsonrpc": "2.0", "id": "i", "method": "initialize",
                       "params": {"protocolVersion": era, "capabilities": {"elicitation": {}}, "clientInfo": {"name": "t", "version": "1"}}})
            assert "result" in conn.receive()
            conn.send({"jsonrpc": "2.0", "method": "notifications/initialized"})
            asked = _answered_off_the_loop(echo_daemon, conn, call("c", {}))
            assert asked["method"] == "elicitation/create", asked
            return
        first = _answered_off_the_loop(echo_daemon, conn, call("c", {}))
        assert first["result"]["resultType"] == "input_required", first
        (key,) = first["result"]["inputRequests"]
        retry = {"requestState": first["result"]["requestState"],
                 "inputResponses": {key: {"action": "accept", "content": {}}}}
        ran = _answered_off_the_loop(echo_daemon, conn, call("r", retry))
        assert ran["result"]["isError"] is False, ran


@pytest.mark.slow  # waits out a second after each cancel, for a question that must not come
@pytest.mark.timeout(180)  # four calls of 12 MB, each parsed and checked (~6 s here)
def test_an_mcp_call_cancelled_while_its_question_is_made_puts_none_to_the_operator(
    echo_daemon: Daemon,
) -> None:
    """A host's cancel that came before the question is put (``_elicit``'s check) means no
    question: the operator is not asked about a call nobody waits for. With large arguments
    the question is encoded in the worker slot (~0.35 s for three million fractions); a
    cancel that came during that encode was not seen, and the question went out after it.
    The cancel is sent at several delays after the check process answered (the question
    came 0.7 to 0.9 s after it, the digest's encode and then its own: some land in the
    second); a ``ping`` sent right after it is answered after the cancel was read, so
    no question may come after the ping's answer."""
    count = 3_000_000
    arguments = b'{"a":"x","n":[' + b"0.5," * (count - 1) + b"0.5]}"
    with echo_daemon.raw(timeout=120) as conn:
        conn.send({"jsonrpc": "2.0", "id": "b", "method": "mcp.bind",
                   "params": {"workspace": str(echo_daemon.workspace)}})
        assert conn.receive()["result"]["bound"] is True
        conn.send({"jsonrpc": "2.0", "id": "i", "method": "initialize",
                   "params": {"protocolVersion": "2025-11-25",
                              "capabilities": {"elicitation": {}}, "clientInfo": {"name": "t", "version": "1"}}})
        assert "result" in conn.receive()
        conn.send({"jsonrpc": "2.0", "method": "notifications/initialized"})
        late = []
        for n, delay in enumerate((0.35, 0.45, 0.55, 0.65)):
            answered = _check_answered(echo_daemon)
            conn.send_bytes(b'{"jsonrpc":"2.0","id":"c%d","method":"tools/call","params":'
                            b'{"name":"deepask","arguments":%s}}\n' % (n, arguments))
            eventually(answered, timeout=60, what="the check process's answer")
            time.sleep(delay)
            conn.send({"jsonrpc": "2.0", "method": "notifications/cancelled",
                       "params": {"requestId": f"c{n}"}})
            conn.send({"jsonrpc": "2.0", "id": f"p{n}", "method": "ping"})
            while conn.receive().get("id") != f"p{n}":
                pass
            time.sleep(1.0)  # the question's encode, had the cancel gone unseen
            conn.send({"jsonrpc": "2.0", "id": f"q{n}", "method": "ping"})
            while (message := conn.receive()).get("id") != f"q{n}":
                if message.get("method") == "elicitation/create":
                    late.append(n)
    assert late == [], f"questions put after their call was cancelled: {late}"


@pytest.mark.timeout(300)  # two batches of 12 MB parsed and checked (~6 s here): against a hang
def test_a_connection_whose_large_batch_is_being_answered_is_not_evicted() -> None:
    """A full table makes room by closing the idlest connection that holds nothing, never
    one with a request in flight. The answer to a large batch is encoded in the worker slot
    (``_handle_batch``), after its items had left the in-flight count: during that encode
    (~0.4 s for three million fractions) the connection counted as idle, and a newcomer
    had it closed to make room, its answer coming after the eviction notice.

    The newcomer comes in that encode, whatever the load: once the check process has
    answered, the daemon's worker threads spend CPU on nothing but the answer's encode, so
    the daemon is stopped (SIGSTOP) as soon as they spend some, while the answer is not
    out yet; the newcomer connects and asks while it is stopped, and is taken when it goes
    on, the encode still under way. (Landing there at delays after the check's answer, 0
    to 0.3 s, took four rounds of this, past 180 s at a load of 11.) The batch's client
    reads its answer first, for a round that landed in the encode, and one at least does.
    """
    count = 3_000_000
    args = ["--no-watch", "--max-connections", "2"]
    with daemon_in("tsv-", _deep_sets, args) as d:
        line = (b'[{"jsonrpc":"2.0","id":"big","method":"classify","params":{"tool":"nums",'
                b'"workspace":' + json.dumps(str(d.workspace)).encode()
                + b',"arguments":{"n":[' + b"0.5," * (count - 1) + b"0.5]}}},"
                b'{"jsonrpc":"2.0","id":"small","method":"status"}]\n')
        landed = 0
        for _ in range(2):
            answered = _check_answered(d)
            with d.raw(timeout=120) as big, d.raw(timeout=120) as subscriber:
                # Only these two count (the check's connection is gone): the table is full.
                while subscriber.request("status")["result"]["connections"] != 2:
                    pass
                assert "result" in subscriber.request("list", {"subscribe": True})
                big.send_bytes(line)
                eventually(answered, timeout=120, what="the check process's answer")
                cpu = CpuByThread(d.proc.pid)
                # A few ticks (of the ~35 the encode takes): a stray one is not the encode.
                eventually(lambda: cpu.spent()[1] > 2 or _readable(big),  # noqa: B023
                           timeout=120, what="the answer's encode under way")
                os.kill(d.proc.pid, signal.SIGSTOP)
                try:
                    encoding = not _readable(big)
                    newcomer = d.raw(timeout=120)
                    newcomer.send({"jsonrpc": "2.0", "id": 1, "method": "status"})
                finally:
                    os.kill(d.proc.pid, signal.SIGCONT)
                with newcomer:
                    newcomer.receive()  # served (one was evicted to make room) or refused
                first = big.receive()
                landed += encoding
                assert isinstance(first, list), str(first)[:300]
                assert [answer["id"] for answer in first] == ["big", "small"]
        assert landed, "no newcomer came while the answer was encoded"


def _readable(conn: RawConn) -> bool:
    """Whether ``conn`` has something to read now (an answer's first byte, at least)."""
    return bool(select.select([conn.sock], [], [], 0)[0])


def conn_result(d: Daemon, request: dict[str, Any]) -> dict[str, Any]:
    """Send one request on a new connection; its result (the test fails on an error)."""
    with d.raw(timeout=120) as conn:
        conn.send_bytes(json.dumps(request).encode() + b"\n")
        reply = conn.receive()
    assert "result" in reply, reply
    return dict(reply["result"])


def test_the_check_process_dies_with_the_daemon() -> None:
    """However the daemon ends, its check process does not outlive it: a stop closes its
    stdin, and a SIGKILL of the daemon in the middle of a check (9 s of backtracking)
    reaches it through its parent-death signal, not when the check ends (without the
    orphan guard, whose cgroup kill would reach it too where the daemon has a cgroup)."""
    for how in (signal.SIGTERM, signal.SIGKILL):
        args = ["--no-watch", "--no-orphan-guard"]
        with daemon_in("tsc-", _deep_sets, args) as d, d.raw(timeout=120) as conn:
            conn.send_bytes(_redos_line(d, "warm", "a" * 70_000, "classify"))
            assert "result" in conn.receive()  # the process started, and idle again
            [worker] = _check_processes(d.proc.pid)
            before = _bytes_read(worker)  # its imports' files included
            conn.send_bytes(_redos_line(d, "long", "a" * 9_000_000 + "!", "classify"))
            eventually(lambda: _bytes_read(worker) - before > 9_000_000,  # noqa: B023
                       timeout=60,
                       what="the request read by the check process")
            d.proc.send_signal(how)
            eventually(lambda: _gone(worker),  # noqa: B023
                       timeout=3 if how == signal.SIGKILL else 10,
                       what=f"the check process gone after {how.name}")


def _bytes_read(pid: int) -> int:
    """The bytes process ``pid`` has read (``rchar`` of ``/proc/<pid>/io``)."""
    return _proc_number(pid, "io", "rchar")


def _proc_number(pid: int, file: str, name: str) -> int:
    """The number on the ``name:`` line of ``/proc/<pid>/<file>``."""
    for line in Path(f"/proc/{pid}/{file}").read_text().splitlines():
        if line.startswith(f"{name}:"):
            return int(line.split()[1])
    raise AssertionError(f"no {name}: line in /proc/{pid}/{file}")


def _gone(pid: int) -> bool:
    """Whether process ``pid`` has ended (gone, or a zombie waiting for its parent)."""
    try:
        return b"State:\tZ" in Path(f"/proc/{pid}/status").read_bytes()
    except FileNotFoundError:
        return True

def test_the_depth_check_of_many_arguments_does_not_hold_other_requests(
    echo_daemon: Daemon,
) -> None:
    """Checking that arguments nest at most 64 levels walks every object and array in
    them: five million empty objects took 5 s, on the event loop, and no other request was
    served meanwhile. It runs in a worker thread now: a small request sent behind the big
    one, on the same connection, is answered while the big one's depth is being checked
    (on the loop it was answered after it: the big one names a tool the catalog does not
    have, so its check and its answer were one step of the loop). ``invoke`` and MCP's
    ``tools/call`` take the same path (``Service.check_request``)."""
    count = 5_000_000
    workspace = json.dumps(str(echo_daemon.workspace)).encode()
    big = (b'{"jsonrpc":"2.0","id":"big","method":"classify","params":'
           b'{"tool":"nope","workspace":' + workspace + b',"arguments":{"n":['
           + b"{}," * (count - 1) + b"{}]}}}\n")
    small = {"tool": "names", "workspace": str(echo_daemon.workspace), "arguments": {}}
    with echo_daemon.raw(timeout=120) as conn:
        assert "result" in conn.request("classify", small)  # the catalog is built
        conn.send_bytes(big + json.dumps(
            {"jsonrpc": "2.0", "id": "small", "method": "classify", "params": small}
        ).encode() + b"\n")
        first, second = conn.receive(), conn.receive()
    assert first["id"] == "small", "the big request's depth check held the small one"
    assert second["id"] == "big"
    assert "nope" in second["error"]["message"], str(second)[:300]


def test_the_depth_check_of_many_arguments_does_not_hold_other_mcp_requests(
    echo_daemon: Daemon,
) -> None:
    """The same on the MCP face (a connection bound with ``mcp.bind``): a ``tools/call``
    of five million empty objects, for a tool the catalog does not have (its answer
    follows the check at once), no longer holds the ``tools/list`` sent behind it."""
    count = 5_000_000
    meta = {"io.modelcontextprotocol/protocolVersion": "2026-07-28",
        "io.modelcontextprotocol/clientCapabilities": {}}
    big = (b'{"jsonrpc":"2.0","id":"big","method":"tools/call","params":{"_meta":'
           + json.dumps(meta).encode() + b',"name":"nope","arguments":{"n":['
           + b"{}," * (count - 1) + b"{}]}}}\n")
    small = {"jsonrpc": "2.0", "id": "small", "method": "tools/list", "params": {"_meta": meta}}
    with echo_daemon.raw(timeout=120) as conn:
        bound = conn.request("mcp.bind", {"workspace": str(echo_daemon.workspace)})
        assert bound["result"]["bound"] is True, bound
        conn.send(small)
        assert "result" in conn.receive()  # the catalog is built
        conn.send_bytes(big + json.dumps(small).encode() + b"\n")
        first, second = conn.receive(), conn.receive()
    assert first["id"] == "small", "the big request's depth check held the small one"
    assert second["id"] == "big"
    assert "nope" in json.dumps(second), str(second)[:300]


# -- slow and idle clients -------------------------------------------------------------------


@pytest.fixture
def small() -> Iterator[Daemon]:
    """A daemon with 4 connection slots and a 1 s idle timeout."""
    with daemon_in("tsl-", args=["--no-watch", "--max-connections", "4", "--idle-timeout", "1"]) as d:
        yield d


def _closed_within(sock: socket.socket, seconds: float, drip: bytes | None = None) -> float | None:
    """Seconds until the daemon closes ``sock`` (dripping a byte every 0.2 s), or None."""
    started = time.monotonic()
    sock.settimeout(0.2)
    while time.monotonic() - started < seconds:
        if drip is not None:
            try:
                sock.sendall(drip)
            except OSError:
                return time.monotonic() - started
        try:
            data = sock.recv(65536)
        except TimeoutError:
            continue
        except OSError:
            return time.monotonic() - started
        if not data:
            return time.monotonic() - started
    return None


def _connect(d: Daemon) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(str(d.socket))
    return sock


@pytest.mark.slow
def test_an_incomplete_line_must_complete_within_the_idle_timeout(small: Daemon) -> None:
    """One byte every 0.2 s used to keep a connection forever (the timer restarted)."""
    with _connect(small) as sock:
        sock.sendall(b'{"jsonrpc":"2.0","id":1,"method":"status"}\n')
        sock.settimeout(5)
        assert b'"result"' in sock.recv(65536)
        waited = _closed_within(sock, 4.0, drip=b" ")
    assert waited is not None and waited < 2.5, waited


@pytest.mark.slow
def test_a_connection_that_never_completes_a_request_is_closed(small: Daemon) -> None:
    with _connect(small) as sock:
        waited = _closed_within(sock, 4.0, drip=b"\n")  # blank lines are not requests
    assert waited is not None and waited < 2.5, waited


def test_idle_connections_make_room_for_a_newcomer(small: Daemon) -> None:
    """A full table of idle clients: the idlest is told why and closed; the newcomer served."""
    idle = [small.raw() for _ in range(4)]
    try:
        for conn in idle:
            assert "result" in conn.request("status")
        with small.raw() as newcomer:
            assert "result" in newcomer.request("status")
        notice = idle[0].receive()
        assert notice["id"] is None and notice["error"]["code"] == -32008, notice
        assert "make room" in notice["error"]["message"]
        assert idle[0].closed_by_peer()
        assert "result" in idle[1].request("status")  # the others live on
    finally:
        for conn in idle:
            conn.close()


def test_a_request_answered_at_once_counts_as_activity(small: Daemon) -> None:
    """The idlest is the one that asked least recently, however its answer was made.

    The first request of each connection is answered by its reader; the second one of
    the first connection, arriving while that reader waits between requests, in the
    transport's callback (``Connection._answer_at_once``). It must still count.
    """
    idle = [small.raw() for _ in range(4)]
    try:
        for conn in idle:
            assert "result" in conn.request("status")
        assert "result" in idle[0].request("status")
        with small.raw() as newcomer:
            assert "result" in newcomer.request("status")
        notice = idle[1].receive()
        assert notice["id"] is None and notice["error"]["code"] == -32008, notice
        assert idle[1].closed_by_peer()
        assert "result" in idle[0].request("status")
    finally:
        for conn in idle:
            conn.close()


def test_inline_requests_between_requests_are_answered_whatever_their_spelling(
    small: Daemon,
) -> None:
    """Whichever path takes them, the answers come in order.

    An escaped method name, two requests in one chunk (the reader's), a CRLF line and a
    blank line before a request (the reader's) all arrive while the reader waits between
    requests.
    """
    with small.raw() as conn:
        assert "result" in conn.request("status")
        conn.send_bytes(b'{"jsonrpc":"2.0","id":"esc","method":"st\\u0061tus"}\n')
        assert conn.receive()["id"] == "esc"
        conn.send_bytes(b'{"jsonrpc":"2.0","id":1,"method":"status"}\n'
                        b'{"jsonrpc":"2.0","id":2,"method":"status"}\n')
        assert [conn.receive()["id"], conn.receive()["id"]] == [1, 2]
        conn.send_bytes(b'{"jsonrpc":"2.0","id":"crlf","method":"status"}\r\n')
        assert conn.receive()["id"] == "crlf"
        conn.send_bytes(b'\n{"jsonrpc":"2.0","id":"after-blank","method":"status"}\n')
        reply = conn.receive()
        assert reply["id"] == "after-blank" and "result" in reply


@pytest.mark.parametrize(
    ("line", "expected"),
    [
        (b"5\n", -32600),
        (b"[]\n", -32600),
        (b'{"jsonrpc":"2.0","id":"u","method":"no.such.method"}\n', -32601),
        (b'{"jsonrpc":"2.0","id":"p","method":"invoke","params":{"tool":1}}\n', -32602),
        (b'{"jsonrpc":"2.0","id":"p","method":"invoke","params":[1, 2]}\n', -32602),
        (b'{"jsonrpc":"1.0","id":"v","method":"list"}\n', -32600),
        (b"{not json\n", -32700),  # not taken at once: the reader answers it
        (b'[{"jsonrpc":"2.0","id":"b","method":"status"}, 7]\n', "batch"),
        (b'{"jsonrpc":"2.0","id":"l","method":"list","params":{}}\n', "result"),
        (b'{"jsonrpc":"2.0","method":"status"}\n', "nothing"),  # a notification
    ],
    ids=lambda value: value.decode().strip()[:40] if isinstance(value, bytes) else str(value),
)
def test_a_message_between_requests_gets_the_readers_answer(
    small: Daemon, line: bytes, expected: Any
) -> None:
    """A lone line that arrives while the reader waits between requests is taken in the
    transport's callback (``Connection._answer_at_once``), whatever it holds: it gets the
    answer the reader would give, and the connection goes on serving."""
    with small.raw() as conn:
        assert "result" in conn.request("status")  # now the reader waits between requests
        conn.send_bytes(line)
        if expected != "nothing":
            reply = conn.receive()
            if expected == "batch":
                assert [item.get("id") for item in reply] == ["b", None], reply
                assert "result" in reply[0] and reply[1]["error"]["code"] == -32600
            elif expected == "result":
                assert "result" in reply, reply
            else:
                assert reply["error"]["code"] == expected, reply
        after = conn.request("status")
        assert "result" in after and after["id"] == 2, after


def test_busy_connections_are_never_evicted(small: Daemon) -> None:
    """Subscribers hold their slots: with all four subscribed, a newcomer is refused."""
    subscribers = [small.raw() for _ in range(4)]
    try:
        for conn in subscribers:
            assert "result" in conn.request("list", {"subscribe": True})
        with small.raw() as newcomer:
            refused = newcomer.receive()
        assert refused["error"]["code"] == -32008 and "Too many connections" in refused["error"]["message"]
        for conn in subscribers:
            assert "result" in conn.request("status")
    finally:
        for conn in subscribers:
            conn.close()


def test_an_idle_mcp_session_is_never_evicted(small: Daemon) -> None:
    """A connection bound to MCP is a host's whole session (its tool server, its
    list_changed stream): idle between calls, it holds its slot like a subscriber, and
    the idlest native connection makes room instead."""
    mcp = small.raw()
    others: list[RawConn] = []
    try:
        assert mcp.request("mcp.bind", {"workspace": str(small.workspace)})["result"]["bound"]
        mcp.send({"jsonrpc": "2.0", "id": "i", "method": "initialize",
                  "params": {"protocolVersion": "2025-11-25", "capabilities": {}, "clientInfo": {"name": "t", "version": "1"}}})
        assert "result" in mcp.receive()
        others = [small.raw() for _ in range(3)]
        for conn in others:
            assert "result" in conn.request("status")
        with small.raw() as newcomer:
            assert "result" in newcomer.request("status")
        notice = others[0].receive()
        assert notice["id"] is None and notice["error"]["code"] == -32008, notice
        mcp.send({"jsonrpc": "2.0", "id": "p", "method": "ping"})
        assert mcp.receive() == {"jsonrpc": "2.0", "id": "p", "result": {}}
    finally:
        for conn in [mcp, *others]:
            conn.close()


# -- refusals arrive (lingering close) -------------------------------------------------------


async def _asyncio_exchange(path: Path, payload: bytes) -> bytes:
    import asyncio

    reader, writer = await asyncio.open_unix_connection(str(path), limit=1 << 20)
    try:
        writer.write(payload)
        try:
            await writer.drain()
        except ConnectionError:
            pass
        return await asyncio.wait_for(reader.readline(), 10)
    finally:
        writer.close()


def test_a_refused_asyncio_client_reads_the_error_not_a_reset(small: Daemon) -> None:
    import asyncio

    subscribers = [small.raw() for _ in range(4)]
    try:
        for conn in subscribers:
            assert "result" in conn.request("list", {"subscribe": True})
        payload = b'{"jsonrpc":"2.0","id":1,"method":"status"}\n' * 2000
        for _ in range(10):
            line = asyncio.run(_asyncio_exchange(small.socket, payload))
            assert json.loads(line)["error"]["code"] == -32008, line
    finally:
        for conn in subscribers:
            conn.close()


def test_an_oversize_line_is_answered_before_the_close() -> None:
    import asyncio

    with daemon_in("tso-", args=["--no-watch", "--max-message-bytes", "65536"]) as d:
        for _ in range(5):
            line = asyncio.run(_asyncio_exchange(d.socket, b'{"x":"' + b"a" * 8_000_000 + b'"}\n'))
            assert json.loads(line)["error"]["code"] == -32007, line


@pytest.mark.parametrize("method", ["list", "status"])
def test_an_oversize_line_between_requests_is_refused_too(method: str) -> None:
    """The size limit holds for a lone line that arrives while the reader waits between
    requests (taken in the transport's callback when it is within the limit): over it,
    -32007 and the close, whether it names an inline method or not."""
    with daemon_in("tsz-", args=["--no-watch", "--max-message-bytes", "100"]) as d:
        with d.raw() as conn:
            assert "result" in conn.request("status")
            line = json.dumps({"jsonrpc": "2.0", "id": 2, "method": method,
                               "params": {"pad": "a" * 200}}).encode() + b"\n"
            conn.send_bytes(line)
            reply = conn.receive()
            assert reply["error"]["code"] == -32007, reply
            assert conn.closed_by_peer()
        with d.raw() as conn:  # just within the limit: answered
            assert "result" in conn.request("status")
            line = json.dumps({"jsonrpc": "2.0", "id": 2, "method": method}).encode()
            conn.send_bytes(line + b" " * (100 - len(line)) + b"\n")
            assert conn.receive()["id"] == 2


def test_a_newcomer_is_served_while_the_table_holds_a_connection_being_closed() -> None:
    """A connection the daemon is closing (after its -32007 here) lingers, its writing side
    shut down, until its client closes too: it holds nothing, so a newcomer to a full
    table has it make room. Its eviction notice was written after that shutdown, which
    asyncio refuses (``RuntimeError``), and that ended the whole daemon."""
    with daemon_in(
        "tsl-", args=["--no-watch", "--max-connections", "1", "--max-message-bytes", "100"]
    ) as d, d.raw() as closing:
        closing.send_bytes(b"x" * 200 + b"\n")
        assert closing.receive()["error"]["code"] == -32007  # then it lingers, open
        with d.raw() as newcomer:
            assert "result" in newcomer.request("status")
        assert d.proc.poll() is None, d.log()[-3000:]


@pytest.mark.timeout(180)  # a large line parsed while clients come (~12 s in CI, 30 at a load of 10)
def test_a_connection_whose_large_line_is_being_parsed_does_not_make_room() -> None:
    """A complete request whose large line waits for its parse (seconds, for millions of
    numbers) is in flight: its connection is not closed to make room for a newcomer while
    an idle one is there. It was: the request then ran on a closed connection, and an
    invoke was answered ``cancelled`` after the -32008, without running."""
    with (
        daemon_in("tsp-", _noop_set, args=["--no-watch", "--max-connections", "2"]) as d,
        d.raw(timeout=60) as parsing,
        d.raw() as idle,
    ):
        assert "result" in idle.request("status")
        numbers = ",".join(["1.5"] * 3_000_000)  # 12 MB: seconds to parse
        parsing.send_bytes(
            b'{"jsonrpc": "2.0", "id": "big", "method": "invoke", "params": {"tool": '
            b'"noop", "workspace": "' + str(d.workspace).encode() + b'", "arguments": '
            b'{"n": [' + numbers.encode() + b"]}}}\n"
        )
        # Read whole (a line still coming in is idle, and older than the other's
        # status): its parse takes seconds more, and its request is in flight since.
        eventually(lambda: _unread(parsing.sock) == 0, timeout=60, what="the line read")
        with d.raw() as newcomer:
            assert "result" in newcomer.request("status")
        assert idle.closed_by_peer(), "the idle connection made room"
        answer = parsing.receive()
        while "method" in answer:  # started, progress, completed
            answer = parsing.receive()
        assert answer.get("id") == "big", answer
        assert answer["result"]["status"] == "ok", answer


def test_a_reload_announces_while_a_subscriber_is_being_closed() -> None:
    """A subscriber the daemon is closing is told nothing more, and the reload that would
    have told it answers all the same (it was -32603: the catalogChanged was written
    after the connection's writing side was shut down)."""

    def fill(home: Path, workspace: Path) -> None:
        write_set(home / "tools", "noop", {
            "runner": "exec", "description": "one", "schema": {"type": "object"},
            "command": ["/bin/true"], "approval": "always", "stdin": False,
        })

    with (
        daemon_in("tsr-", fill, args=["--no-watch", "--max-message-bytes", "200"]) as d,
        d.raw() as closing,
        d.raw() as other,
    ):
        for conn in (closing, other):
            assert "result" in conn.request("list", {"subscribe": True})
        closing.send_bytes(b"x" * 300 + b"\n")
        assert closing.receive()["error"]["code"] == -32007  # then it lingers, open
        manifest = d.home / "tools" / "noop" / "tools.json"
        manifest.write_text(manifest.read_text().replace('"one"', '"two"'))
        other.send({"jsonrpc": "2.0", "id": "r", "method": "reload", "params": {}})
        told = []
        while "method" in (reload := other.receive()):
            told.append(reload["method"])
        assert reload["result"]["changed"], reload
        assert told == ["catalogChanged"], told


def test_past_the_in_flight_limit_each_frame_is_answered_as_itself() -> None:
    """-32008 carries the request's id; a notification gets nothing; a batch an array."""
    args = ["--no-watch", "--max-calls-per-connection", "1"]
    with daemon_in("tsq-", args=args) as d, d.raw() as conn:
        frames: list[Any] = [{"jsonrpc": "2.0", "id": i, "method": "list"} for i in range(5)]
        frames += [{"jsonrpc": "2.0", "method": "list"},
                   [{"jsonrpc": "2.0", "id": "b1", "method": "list"},
                    {"jsonrpc": "2.0", "method": "list"}],
                   {"jsonrpc": "2.0", "id": "bad", "method": "list", "x": 1}]
        conn.send_bytes(b"".join(json.dumps(f).encode() + b"\n" for f in frames))
        got = [conn.receive() for _ in range(7)]
        singles = sorted(str(m["id"]) for m in got if isinstance(m, dict))
        assert singles == ["0", "1", "2", "3", "4", "bad"], got
        batch = next(m for m in got if isinstance(m, list))
        assert [m["id"] for m in batch] == ["b1"], batch
        assert "result" in conn.request("status")  # nothing else was sent


def _frames(*frames: Any) -> bytes:
    """Frames sent in one write: the reader takes them all before any handler runs."""
    return b"".join(json.dumps(f).encode() + b"\n" for f in frames)


def test_each_item_of_a_batch_counts_towards_the_in_flight_limit() -> None:
    """A batch holds a slot per item: the items past the free slots get -32008 in the
    batch's array, and a batch that took every slot leaves none for the next request."""
    args = ["--no-watch", "--max-calls-per-connection", "3"]
    with daemon_in("tsq-", args=args) as d, d.raw() as conn:
        batch = [{"jsonrpc": "2.0", "id": f"b{i}", "method": "list"} for i in range(3)]
        conn.send_bytes(_frames({"jsonrpc": "2.0", "id": "s", "method": "list"}, batch))
        got = [conn.receive() for _ in range(2)]
        answers = next(m for m in got if isinstance(m, list))
        assert [(m["id"], "result" in m) for m in answers] == [
            ("b0", True), ("b1", True), ("b2", False)
        ], answers
        assert answers[2]["error"]["code"] == -32008
        conn.send_bytes(_frames(batch, {"jsonrpc": "2.0", "id": "late", "method": "list"}))
        got = [conn.receive() for _ in range(2)]
        late = next(m for m in got if isinstance(m, dict))
        assert late["id"] == "late" and late["error"]["code"] == -32008, got
        answers = next(m for m in got if isinstance(m, list))
        assert all("result" in m for m in answers), answers


def test_a_batch_longer_than_the_in_flight_limit_runs_what_fits() -> None:
    """Its first items run, every later request gets -32008 in the one array, and the
    connection carries on: a huge batch no longer starts a task for each of its items (200,000
    of them held every client up for seconds and took most of a gigabyte)."""
    args = ["--no-watch", "--max-calls-per-connection", "4"]
    with daemon_in("tsq-", args=args) as d, d.raw() as conn, d.raw() as other:
        items: list[Any] = [{"jsonrpc": "2.0", "id": i, "method": "list"} for i in range(6)]
        items.insert(2, {"jsonrpc": "2.0", "method": "list"})
        conn.send_bytes(_frames(items))
        answers = conn.receive()
        assert [m["id"] for m in answers] == [0, 1, 2, 3, 4, 5], answers
        assert ["result" in m for m in answers] == [True, True, True, False, False, False]
        assert {m["error"]["code"] for m in answers[3:]} == {-32008}
        conn.send_bytes(_frames([{"jsonrpc": "2.0", "method": "status"}] * 200_000))
        assert "result" in conn.request("status")
        assert "result" in other.request("status")


# -- a daemon out of file descriptors ----------------------------------------------------


def _noop_set(home: Path, workspace: Path) -> None:
    write_set(home / "tools", "noop", {
        "runner": "exec", "description": "true", "schema": {"type": "object"},
        "command": ["/bin/true"], "approval": "always", "stdin": False,
    })


def _unconfined(tmp_path: Path) -> list[str]:
    config = tmp_path / "unconfined.toml"
    config.write_text('[confinement]\ncgroup = "off"\nsandbox = "off"\n')
    return ["--no-watch", "--config", str(config)]


def test_a_daemon_out_of_descriptors_keeps_its_socket_and_says_busy(tmp_path: Path) -> None:
    """EMFILE at accept, at the workspace check and at a call's pipes: clear answers, and
    the connection that waited is served once descriptors are free again."""
    call = {"tool": "noop", "arguments": {}}
    with daemon_in("tsf-", _noop_set, args=_unconfined(tmp_path)) as d, d.raw() as held:
        call["workspace"] = str(d.workspace)
        assert "result" in held.request("invoke", call)  # the workspace's catalog is built
        with descriptors_limited(d.proc.pid):
            waiting = RawConn(d.socket)  # in the backlog: accept() fails with EMFILE
            waiting.send({"jsonrpc": "2.0", "id": "w", "method": "status"})
            busy = held.request("invoke", call)
            assert busy["error"]["code"] == -32008, busy
            assert "Too many open files" in busy["error"]["message"], busy
            assert busy["error"]["data"] == {"resource": "descriptors"}, busy
            eventually(lambda: any(e.get("event") == "accept_retry" for e in d.log_events()),
                       what="accept_retry logged")
        with waiting:
            assert "result" in waiting.receive(), "the connection that waited is served"
        events = [e.get("event") for e in d.log_events()]
        assert events.count("accept_retry") == 1, "said once per episode"
        assert "accept_resumed" in events
        assert "accept_failed" not in events
        with descriptors_limited(d.proc.pid, free=1):
            # One descriptor: enough for the workspace check, not for the call's pipes.
            _, failed = held.invoke(call)
            assert failed["result"]["status"] == "error", failed
            assert "Too many open files" in json.dumps(failed["result"]), failed
        assert "result" in held.request("invoke", call)
        with d.raw() as fresh:
            assert "result" in fresh.request("status")


def test_a_catalog_read_short_of_descriptors_is_not_kept(tmp_path: Path) -> None:
    """A first build or a reload that runs out of descriptors is -32008 (SIGHUP's is
    logged), and no snapshot loses the sets it could not read: once descriptors are free
    the tools are all there."""
    call = {"tool": "noop", "arguments": {}}
    with daemon_in("tsc-", _noop_set, args=_unconfined(tmp_path)) as d, d.raw() as held:
        other = d.workspace.parent / "other"
        other.mkdir()
        call["workspace"] = str(other)
        assert "result" in held.request("status")
        with descriptors_limited(d.proc.pid, free=1):
            first = held.request("invoke", call)  # the workspace check passes, the scan not
            reload = held.request("reload", {})
            d.proc.send_signal(signal.SIGHUP)
            eventually(
                lambda: any(e.get("event") == "signal_reload_failed" for e in d.log_events()),
                what="signal_reload_failed logged",
            )
        for answer in (first, reload):
            assert answer["error"]["code"] == -32008, answer
            assert "could not read the tool sets" in answer["error"]["message"], answer
        assert d.proc.poll() is None, "SIGHUP's failed reload did not stop the daemon"
        with descriptors_limited(d.proc.pid, free=0):
            assert held.request("reload", {})["error"]["code"] == -32008
        config = [e for e in d.log_events() if e.get("event") == "config_reload_failed"]
        assert config, "the config file could not be read with no descriptor free"
        assert all("toolsetd is short of descriptors" in e["error"] for e in config), config
        assert "result" in held.request("invoke", call), "the workspace's tools are all there"
        listed = held.request("list", {"workspace": str(other)})["result"]
        assert [t["name"] for t in listed["tools"]] == ["noop"], listed
        assert listed["notes"] == [], listed


def test_a_change_the_watcher_could_not_reload_short_of_descriptors_is_not_lost(
    tmp_path: Path,
) -> None:
    """A manifest edited while the daemon is out of descriptors reaches the catalog once
    they are back, with no reload asked for."""
    args = [a for a in _unconfined(tmp_path) if a != "--no-watch"]
    with daemon_in("tsw-", _noop_set, args=args) as d, d.raw() as held:
        def description() -> str:
            listed = held.request("list", {"workspace": str(d.workspace)})["result"]
            found = {t["name"]: t["description"] for t in listed["tools"]}["noop"]
            assert isinstance(found, str)
            return found

        assert description() == "true"
        eventually(lambda: any(e.get("event") == "watch_started" for e in d.log_events()),
                   what="the watch started")
        manifest = d.home / "tools" / "noop" / "tools.json"
        edited = {**json.loads(manifest.read_text()), "description": "edited"}
        with descriptors_limited(d.proc.pid):
            manifest.write_text(json.dumps(edited))
            eventually(
                lambda: any(e.get("event") == "watch_reload_deferred" for e in d.log_events()),
                what="the watcher's reload deferred",
            )
        eventually(lambda: description() == "edited", what="the edit in the catalog")


# -- a daemon that cannot start a thread -------------------------------------------------

#: Prints a megabyte (past what a call keeps in memory: it streams to its spill file),
#: says so with a file, and waits for the test's file ``go`` (it starts no process).
_SPEW = (
    f"#!{sys.executable}\nimport os, sys, time\nsys.stdout.write('a' * 1_000_000)\n"
    "sys.stdout.flush()\nopen('written', 'w').close()\n"
    "while not os.path.exists('go'):\n    time.sleep(0.02)\n"
)


def _spew_set(home: Path, workspace: Path) -> None:
    _noop_set(home, workspace)
    write_set(home / "tools", "spew", {
        "runner": "exec", "description": "a megabyte", "schema": {"type": "object"},
        "command": ["spew.py"], "approval": "always", "stdin": False, "timeoutSeconds": 120,
    }, **{"spew.py": _SPEW})


def test_a_daemon_that_cannot_start_a_thread_does_its_blocking_work_on_the_loop(
    tmp_path: Path,
) -> None:
    """At its limit of processes and threads (a cgroup's pids.max here, RLIMIT_NPROC for
    a user other than root) no worker thread can start: a new workspace's catalog, a
    large line's parse and a truncated call's spill file are made on the event loop's
    thread instead. They were -32603 (an internal error) for the list, a connection closed
    unanswered for the line, and -32603 for a call whose tool had run. A call's own
    process cannot start either, and says so; once threads can start, they are used."""
    with daemon_in("tst-", _spew_set, args=_unconfined(tmp_path)) as d, \
            d.raw(timeout=60) as held, d.raw(timeout=60) as conn:
        workspace = str(d.workspace)
        other = d.workspace.parent / "other"
        other.mkdir()
        held.send({"jsonrpc": "2.0", "id": "spew", "method": "invoke",
                   "params": {"tool": "spew", "arguments": {}, "workspace": workspace}})
        eventually(lambda: (d.workspace / "written").exists(), timeout=60, what="the output")
        eventually(lambda: _threads(d.proc.pid) == 1, what="the idle workers ended")
        with tasks_limited(d.proc.pid):
            listed = conn.request("list", {"workspace": str(other)})
            assert [t["name"] for t in listed["result"]["tools"]] == ["noop", "spew"], listed
            large = conn.request("status", {"pad": "x" * 100_000})
            assert large["error"]["code"] == -32602, large
            _, failed = conn.invoke({"tool": "noop", "arguments": {}, "workspace": workspace})
            assert failed["result"]["status"] == "error", failed
            text = failed["result"]["content"][0]["text"]
            assert text.startswith("The external process failed to start: "), text
            (d.workspace / "go").touch()
            while (spewed := held.receive()).get("id") != "spew":
                pass
            assert spewed["result"]["truncated"] is True, spewed
            assert spewed["result"]["outputPath"] is not None, spewed
            assert Path(spewed["result"]["outputPath"]).stat().st_size == 1_000_000
            assert _threads(d.proc.pid) == 1
        events = [e.get("event") for e in d.log_events()]
        assert events.count("worker_thread_unavailable") == 1, "said once per episode"
        assert "request_failed" not in events
        third = d.workspace.parent / "third"
        third.mkdir()
        assert "result" in conn.request("list", {"workspace": str(third)})
        eventually(lambda: any(e.get("event") == "worker_threads_resumed"
                               for e in d.log_events()), what="worker_threads_resumed")


def test_a_watch_restarted_where_no_thread_can_start_leaves_the_daemon_running(
    tmp_path: Path,
) -> None:
    """watchfiles' Rust watcher starts a thread when it is made; at the limit of processes
    and threads it cannot, notify panics, and again in its destructor: the daemon aborted
    (SIGABRT) when a new workspace restarted its watch. The watch runs in a process of its
    own, which cannot start here: the watch fails as any other (watch_unavailable, the poll
    serves on) and starts again once there is room."""
    args = [a for a in _unconfined(tmp_path) if a != "--no-watch"]
    with daemon_in("tsv-", _noop_set, args=args) as d, d.raw(timeout=60) as conn:
        eventually(lambda: any(e.get("event") == "watch_started" for e in d.log_events()),
                   what="the watch started")
        other = d.workspace.parent / "other"
        write_set(other / ".crystal" / "tools", "local", {
            "runner": "exec", "description": "local", "schema": {"type": "object"},
            "command": ["/bin/true"], "approval": "always", "stdin": False,
        })
        with tasks_limited(d.proc.pid):
            listed = conn.request("list", {"workspace": str(other)})
            assert [t["name"] for t in listed["result"]["tools"]] == ["local", "noop"], listed
            eventually(
                lambda: d.proc.poll() is not None
                or any(e.get("event") == "watch_unavailable" for e in d.log_events()),
                what="watch_unavailable logged",
            )
            assert d.proc.poll() is None, f"the daemon ended: {d.log()[-300:]}"
            # status says so, not only the log: an operator asking why edits come late.
            watch = conn.request("status")["result"]["watch"]
            assert watch["state"] == "polling", watch
            assert watch["reason"] == (
                "BlockingIOError: [Errno 11] the watch process could not start: Resource "
                "temporarily unavailable"
            ), watch
            assert watch["watched"] == 0, watch
            assert watch["pollSeconds"] >= 2, watch
            exposition = conn.request("metrics", {})["result"]["text"]
            assert "toolsetd_watch_available 0.0\n" in exposition
        unavailable = [e for e in d.log_events() if e.get("event") == "watch_unavailable"]
        assert unavailable[0]["message"] == (
            "[Errno 11] the watch process could not start: Resource temporarily unavailable"
        ), unavailable
        third = d.workspace.parent / "third"
        third.mkdir()
        assert "result" in conn.request("list", {"workspace": str(third)})  # a restart
        manifest = other / ".crystal" / "tools" / "local" / "tools.json"
        manifest.write_text(manifest.read_text().replace('"local"', '"edited"', 1))

        def described() -> bool:
            listed = conn.request("list", {"workspace": str(other)})["result"]
            return bool({t["name"]: t["description"] for t in listed["tools"]}["local"] == "edited")

        eventually(described, what="the edit in the catalog")

        def started_again() -> bool:  # said once the retried watch's process watches
            events = [e.get("event") for e in d.log_events()]
            if "watch_started" in events[events.index("watch_unavailable"):]:
                return True
            manifest.touch()
            return False

        eventually(started_again, what="the watch started again")
        assert d.proc.poll() is None
        watch = conn.request("status")["result"]["watch"]
        assert (watch["state"], watch["reason"]) == ("watching", None), watch
        assert watch["watched"] > 0, watch


#: A Watcher over ``home`` (argv[1]) whose watch factory, once told ``race`` on stdin, first
#: takes every place for a task left (threads that wait), as a tool's fork or another
#: process of the user can between the daemon's look and the watch's start, then makes
#: the watch as the daemon does (the Watcher's default factory). Its log on stdout.
_RACED_WATCHER = """
import inspect, json, os, sys, threading
import anyio, structlog
from pathlib import Path
from toolsetd.daemon.app import _wait_for_children_by_pidfd
from toolsetd.daemon.watcher import Watcher

structlog.configure(
    processors=[structlog.processors.add_log_level, structlog.processors.JSONRenderer()],
    logger_factory=structlog.PrintLoggerFactory(sys.stdout),
)
default = inspect.signature(Watcher.__init__).parameters["watch_factory"].default
racing = threading.Event()
holds = []  # the threads that take the places, each with the event it waits for
room = sys.argv[2] == "1"

def say(event):
    print(json.dumps({"event": event}), flush=True)

def factory(*paths, **options):
    if racing.is_set():
        racing.clear()
        try:
            while True:
                ending = threading.Event()
                thread = threading.Thread(target=ending.wait, daemon=True)
                thread.start()
                holds.append((thread, ending))
        except RuntimeError:
            if room:  # one place back: the watch process starts, its watcher's thread not
                thread, ending = holds.pop()
                ending.set()
                thread.join()
                while os.path.exists(f"/proc/self/task/{thread.native_id}"):
                    pass
            say("places_taken")
    return default(*paths, **options)

async def changed(keys):
    say("changed")

async def main():
    _wait_for_children_by_pidfd()  # as the daemon waits for its processes
    home = Path(sys.argv[1])
    watcher = Watcher(home, changed, recheck_seconds=60, retry_seconds=0.5,
                      watch_factory=factory)
    async with anyio.create_task_group() as tg:
        await tg.start(watcher.run)
        say("running")
        while True:
            await anyio.wait_readable(0)
            for command in os.read(0, 100).decode().split():
                if command == "race":
                    racing.set()
                    (home / "tools" / "second").mkdir()  # the poll restarts the watch
                elif command == "release":
                    for _, ending in holds:
                        ending.set()
                elif command == "stop":
                    tg.cancel_scope.cancel()

anyio.run(main)
"""


@pytest.mark.parametrize("room", [0, 1], ids=["no-process", "no-thread"])
def test_a_watch_whose_thread_loses_the_last_place_to_a_spawn_leaves_the_watcher_running(
    tmp_path: Path, room: int
) -> None:
    """The daemon looked whether a watch's threads could start before it made the watch,
    but a tool's fork could take the last place in between: watchfiles' watcher then
    could not start its thread, and notify's panic aborted the daemon (SIGABRT). The
    watch runs in a process of its own now, whose start fails (or which dies) alone: the
    watch is unavailable, said once, the watcher runs on, and once there is room the
    watch starts again and reports changes. With no place left the watch process cannot
    start; with one, it starts and its watcher's thread cannot, and it aborts alone."""
    home = tmp_path / "home"
    write_set(home / "tools", "first", {
        "runner": "exec", "description": "d", "schema": {"type": "object"},
        "command": ["/bin/true"], "approval": "always", "stdin": False,
    })
    with subprocess.Popen(
        [sys.executable, "-c", _RACED_WATCHER, str(home), str(room)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    ) as proc:
        try:
            unavailable = _race_a_watch(proc, home)
        finally:
            if proc.poll() is None:
                proc.kill()
    if room:
        # The last line the watch process wrote on stderr is in the message too (it went
        # to /dev/null): the panic that says why, where SIGABRT alone does not.
        assert unavailable.startswith("the watch process ended (killed by SIGABRT; it said: ")
        assert "panic" in unavailable, unavailable
    else:
        assert unavailable == (
            "[Errno 11] the watch process could not start: Resource temporarily unavailable"
        )


def _race_a_watch(proc: subprocess.Popen[str], home: Path) -> str:
    """``_RACED_WATCHER`` (``proc``): its watch raced at the limit, then given room; the
    message of its ``watch_unavailable``."""
    seen: list[str] = []
    unavailable: list[str] = []

    def read() -> None:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line, f"the watcher ended ({proc.wait()}): {seen}"
        event = json.loads(line)
        seen.append(event["event"])
        if event["event"] == "watch_unavailable":
            unavailable.append(event["message"])

    def wait_for(event: str) -> None:
        while event not in seen:
            read()

    def send(command: str) -> None:
        assert proc.stdin is not None
        proc.stdin.write(command + "\n")
        proc.stdin.flush()

    wait_for("running")
    with tasks_limited(proc.pid, free=10):
        send("race")
        wait_for("places_taken")
        wait_for("watch_unavailable")
    send("release")
    while "watch_started" not in seen[seen.index("watch_unavailable"):]:
        read()  # said once the retried watch's process watches
    del seen[:]
    (home / "tools" / "first" / "tools.json").touch()
    wait_for("changed")
    assert proc.poll() is None
    send("stop")
    assert proc.wait(timeout=30) == 0
    assert len(unavailable) == 1, unavailable
    return unavailable[0]


def test_an_orphan_guard_that_could_not_start_at_the_limit_starts_once_there_is_room(
    tmp_path: Path,
) -> None:
    """A daemon started at its limit of processes and threads could not start its orphan
    guard's sentinel (orphan_guard_unavailable) and never tried again: killed by SIGKILL
    later, it left its tools running (no cgroup here). A later spawn starts the sentinel,
    and a SIGKILLed daemon's tool dies with it."""
    marker = f"toolsetd-guard-{os.getpid()}-{time.monotonic_ns()}"
    base = Path(tempfile.mkdtemp(prefix="tsg-"))
    home, workspace = base / "home", base / "ws"
    (home / "tools").mkdir(parents=True)
    workspace.mkdir()
    _noop_set(home, workspace)
    write_set(home / "tools", "hold", {
        "runner": "exec", "description": "holds", "schema": {"type": "object"},
        "command": [sys.executable, "-c", "import time; time.sleep(600)", marker],
        "approval": "always", "stdin": False,
    })
    call = {"tool": "noop", "arguments": {}, "workspace": str(workspace)}
    d: Daemon | None = None
    try:
        with started_at_the_limit(home, workspace, base, _unconfined(tmp_path)) as d:
            events = [e.get("event") for e in d.log_events()]
            assert "orphan_guard_unavailable" in events, events
        with d.raw(timeout=60) as conn:

            def started() -> bool:
                assert "result" in conn.request("invoke", call)
                return any(e.get("event") == "orphan_guard_started_late"
                           for e in d.log_events())

            eventually(started, timeout=30, what="the sentinel started")
            conn.send({"jsonrpc": "2.0", "id": "hold", "method": "invoke",
                       "params": {**call, "tool": "hold"}})
            # ``started`` comes once the daemon has registered the tool with the guard; seen
            # in /proc it may not be yet (a SIGKILL between the exec and the register is a
            # window no guard that learns the pid from the spawn can close). Nor is its
            # command line always there by ``started``: the exec-status pipe closes within
            # the exec, before the kernel has set the new argv, so it is waited for too.
            while conn.receive().get("method") != "started":
                pass
            eventually(lambda: bool(marked_processes(marker)), what="the tool running")
            d.stop(signal.SIGKILL)
        eventually(lambda: not marked_processes(marker), what="the tool killed with the daemon")
    finally:
        if d is not None:
            d.stop(signal.SIGKILL)
        for pid in marked_processes(marker):
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        shutil.rmtree(base, ignore_errors=True)


def test_a_call_whose_process_cannot_start_for_want_of_tasks_says_what_ran_out(
    tmp_path: Path,
) -> None:
    """At the daemon's limit of processes and threads a call's fork fails with EAGAIN,
    whose words ("Resource temporarily unavailable") name neither the limit nor what to
    do: the text says both. Once there is room the call runs."""
    with daemon_in("tsn-", _noop_set, args=_unconfined(tmp_path)) as d, d.raw() as conn:
        call = {"tool": "noop", "arguments": {}, "workspace": str(d.workspace)}
        assert "result" in conn.request("invoke", call)
        with tasks_limited(d.proc.pid):
            _, failed = conn.invoke(call)
        assert failed["result"]["content"][0]["text"] == (
            "The external process failed to start: Resource temporarily unavailable: "
            "toolsetd is at its limit of processes and threads (RLIMIT_NPROC, or its "
            "cgroup's pids.max, such as a unit's TasksMax=); retry when some calls have "
            "finished."
        ), failed
        assert conn.request("invoke", call)["result"]["status"] == "ok"


def _children(pid: int) -> set[int]:
    """The processes ``pid`` started that are still there."""
    tasks = Path(f"/proc/{pid}/task")
    return {int(child) for task in tasks.iterdir()
            for child in (task / "children").read_text().split()}


def test_a_check_process_started_where_no_thread_can_start_is_waited_for(
    tmp_path: Path,
) -> None:
    """A call's large arguments are checked in a process the daemon starts on first use.
    On Python 3.11 asyncio waited for it in a thread of its own, and with room for the
    process but not that thread (the limit of processes and threads) the call was -32603,
    and the process was left running, unwaited, its pipes open in the daemon. It is
    waited for through a pidfd: the check is made, and the one process serves the next
    call."""
    def fill(home: Path, workspace: Path) -> None:
        write_set(home / "tools", "sum", {
            "runner": "exec", "description": "sums",
            "schema": {"type": "object",
                       "properties": {"a": {"type": "array", "items": {"type": "integer"}}}},
            "command": ["/bin/true"], "approval": "always", "stdin": False,
        })

    with daemon_in("tsk-", fill, args=_unconfined(tmp_path)) as d, d.raw(timeout=60) as conn:
        call = {"tool": "sum", "arguments": {"a": list(range(5_000))},
                "workspace": str(d.workspace)}
        assert "result" in conn.request("list", {"workspace": str(d.workspace)})
        eventually(lambda: _threads(d.proc.pid) == 1, what="the idle workers ended")
        before = _children(d.proc.pid)  # the orphan guard's sentinel
        # Room for two: the worker thread of the arguments' depth check, and the check
        # process; none for asyncio's thread (started with the process). The tool
        # cannot start either, unless the worker thread has ended meanwhile (idle for
        # IDLE_SECONDS while the check process started up, on a loaded machine): then
        # it takes that room.
        with tasks_limited(d.proc.pid, free=2):
            _, checked = conn.invoke(call)
        assert "result" in checked, checked
        text = checked["result"]["content"][0]["text"]
        assert checked["result"]["status"] == "ok" or text.startswith(
            "The external process failed to start: "
        ), text
        checker = _children(d.proc.pid) - before
        assert len(checker) == 1, checker
        _, again = conn.invoke(call)
        assert again["result"]["status"] == "ok", again
        assert _children(d.proc.pid) - before == checker, "one check process, still"


# -- a daemon out of memory --------------------------------------------------------------

#: A valid line of 5,000,000 empty lists: parsed, some 300 MB of objects.
_LISTS_LINE = b'{"jsonrpc":"2.0","id":"big","method":"status","params":{"x":[' + b"[]," * 5_000_000


#: Two 15 MB lines parsed as far as memory goes: orjson at the memory limit is slow (some
#: 13 s of the daemon's CPU for the second line, 36 s for the test at a load of 5): each
#: wait of its clients, and the test, allow for a heavily loaded machine.
@pytest.mark.timeout(360)
def test_a_line_the_daemon_has_no_memory_to_parse_is_busy_not_a_parse_error(
    tmp_path: Path,
) -> None:
    """A valid line the daemon had no memory to parse (RLIMIT_AS) is -32008 with
    ``{"resource": "memory"}`` (id null: it was not read), and the connection is closed.
    It was -32700 "line is not valid JSON" (orjson's "Not enough memory" error), or, once
    orjson had the buffer and the objects ran short, the connection closed unanswered
    (connection_failed, logged as a bug). Other clients are served meanwhile, and large
    lines are taken once the memory is back."""
    with daemon_in("tsm-", _noop_set, args=_unconfined(tmp_path)) as d, \
            d.raw(timeout=150) as other:
        assert "result" in other.request("status")
        for headroom in (150 << 20, 300 << 20):  # orjson's buffer fails; then the objects
            with memory_limited(d.proc.pid, headroom), d.raw(timeout=150) as big:
                big.send_bytes(_LISTS_LINE + b"[]]}}\n")
                busy = big.receive()
                assert busy["id"] is None and busy["error"]["code"] == -32008, busy
                assert busy["error"]["data"] == {"resource": "memory"}, busy
                assert big.closed_by_peer(timeout=150)
                assert "result" in other.request("status")
        events = [e.get("event") for e in d.log_events()]
        assert events.count("connection_out_of_memory") == 2, events
        assert "connection_failed" not in events
        with d.raw(timeout=150) as big:  # a large line is taken again
            big.send_bytes(_LISTS_LINE[:100_000] + b"[]]}}\n")
            assert big.receive()["error"]["code"] == -32602  # status takes no params


#: A valid 15 MB line whose value holds one string of 15 MB.
_STRING_LINE = b'{"jsonrpc":"2.0","id":"big","method":"status","params":{"s":"' + b"a" * (15 << 20)


@pytest.mark.timeout(600)
def test_a_large_line_at_any_memory_headroom_is_answered_and_the_daemon_lives(
    tmp_path: Path,
) -> None:
    """A 15 MB line of one string, sent with the daemon's memory bounded (RLIMIT_AS) at
    every headroom from 10 to 300 MiB, 2 MiB apart: each is answered, with its answer or
    -32008 busy, and the daemon lives. orjson, given the memory for its parse buffer but
    not for the string, copied the string to a null pointer: the daemon died of SIGSEGV
    (here at 34 MiB of headroom), with every client's calls."""
    with daemon_in("tsn-", _noop_set, args=_unconfined(tmp_path)) as d, \
            d.raw(timeout=150) as other:
        # A request at once: a connection that sends none within the idle timeout (30 s) is
        # closed, and the sweep took longer than that in a full run on a loaded machine.
        assert "result" in other.request("status")
        answers = set()
        for headroom in range(10 << 20, 300 << 20, 2 << 20):
            with memory_limited(d.proc.pid, headroom), d.raw(timeout=150) as big:
                big.send_bytes(_STRING_LINE + b'"}}\n')
                try:
                    reply = big.receive()
                except EOFError:
                    with contextlib.suppress(subprocess.TimeoutExpired):
                        d.proc.wait(timeout=5)
                    pytest.fail(f"no answer at {headroom >> 20} MiB of headroom; the "
                                f"daemon's exit status: {d.proc.poll()}")
            if reply["id"] is None:
                assert reply["error"]["code"] == -32008, reply
                answers.add("busy")
            else:  # parsed: status takes no params
                assert reply["id"] == "big" and reply["error"]["code"] == -32602, reply
                answers.add("answered")
        assert answers == {"busy", "answered"}, answers  # the sweep crossed the limit
        assert "result" in other.request("status")
        assert "connection_failed" not in [e.get("event") for e in d.log_events()]


def _bounded() -> list[str]:
    """``python -m toolsetd.daemon`` with its address space bounded from the start, as
    ``LimitAS=`` bounds it: a soft limit of a terabyte (or the hard limit, if lower), so
    that only ``memory_limited``, below it, binds. The hard limit is left as it is."""
    hard = resource.getrlimit(resource.RLIMIT_AS)[1]
    soft = 1 << 40 if hard == resource.RLIM_INFINITY else min(1 << 40, hard)
    return ["prlimit", f"--as={soft}:", "--", sys.executable, "-m", "toolsetd.daemon"]
#: The bytes ``_printing_set``'s tool prints: its answer holds the first 100,000 or so
#: (the rest is spilled to a file).
_PRINTED = 900_000


def _printing_set(home: Path, workspace: Path) -> None:
    write_set(home / "tools", "print", {
        "runner": "exec", "description": "prints", "schema": {"type": "object"},
        "command": ["/bin/sh", "-c", f"head -c {_PRINTED} /dev/zero | tr '\\0' a"],
        "approval": "always", "stdin": False,
    })


@pytest.mark.timeout(600)
def test_a_daemon_bounded_from_start_writes_and_reads_at_any_headroom(tmp_path: Path) -> None:
    """With its address space bounded from the start (``LimitAS=``), the daemon parses and
    writes JSON with code that checks each allocation. orjson does not: short of memory
    for the bytes of a 100 KB answer it wrote to a null pointer, and the daemon died of
    SIGSEGV (here at 768 KiB of headroom), with every client's calls; a 60 KB line could
    do the same as it was parsed. Swept from 64 KiB to 24 MiB of headroom, every call
    is answered, with its result or -32008 busy (never -32603, an incident), on the
    native face (alone and in a batch) and the MCP one, every line too, and no tool is
    left behind. A connection the daemon had no memory to open or to read, or a batch
    whose answers it had no memory to write, is busy too (``id`` null), and closed."""
    with daemon_in("tsb-", _printing_set, args=_unconfined(tmp_path), launcher=_bounded()) as d, \
            d.raw(timeout=150) as other:
        events = [e.get("event") for e in d.log_events()]
        assert "json_allocations_checked" in events, events
        before = _children(d.proc.pid)  # the orphan guard's sentinel
        call = {"tool": "print", "arguments": {}, "workspace": str(d.workspace)}
        meta = {"io.modelcontextprotocol/protocolVersion": "2026-07-28",
                "io.modelcontextprotocol/clientCapabilities": {}}
        answers: Counter[tuple[str, str]] = Counter()
        mcp: RawConn | None = None
        steps = [*range(64 << 10, 4 << 20, 64 << 10), *range(4 << 20, 24 << 20, 256 << 10)]
        try:
            for step, headroom in enumerate(steps):
                if mcp is None:  # bound with room to spare; again if it was closed busy
                    mcp = d.raw(timeout=150)
                    bound = mcp.request("mcp.bind", {"workspace": str(d.workspace)})
                    assert bound["result"]["bound"], bound
                with memory_limited(d.proc.pid, headroom), d.raw(timeout=150) as conn:
                    try:
                        called = _answer(conn, {"jsonrpc": "2.0", "id": 1, "method": "invoke",
                                                "params": call})
                        lined = (_answer(conn, {"jsonrpc": "2.0", "id": 2, "method": "status",
                                                "params": {"s": "a" * 60_000}})
                                 if called["id"] is not None else called)
                        batched = (_answer(conn, [{"jsonrpc": "2.0", "id": 3, "method": "invoke",
                                                   "params": call}])
                                   if lined["id"] is not None else lined)
                        mcp_called = _answer(mcp, {
                            "jsonrpc": "2.0", "id": step, "method": "tools/call",
                            "params": {"_meta": meta, "name": "print", "arguments": {}}})
                    except EOFError:
                        with contextlib.suppress(subprocess.TimeoutExpired):
                            d.proc.wait(timeout=5)
                        pytest.fail(f"no answer at {headroom >> 10} KiB of headroom; the "
                                    f"daemon's exit status: {d.proc.poll()}; its last lines: "
                                    f"{d.log_events()[-6:]}")
                if mcp_called["id"] is None:
                    mcp.close()
                    mcp = None
                for face, answer in (("native", called), ("mcp", mcp_called)):
                    if "error" in answer:
                        assert answer["error"]["code"] == -32008, (answer, _failures(d))
                        assert answer["error"]["data"] == {"resource": "memory"}, answer
                        answers[face, "busy"] += 1
                    else:
                        result = answer["result"]
                        assert result.get("status", "ok") == "ok" and not result.get("isError")
                        assert "a" * 90_000 in result["content"][0]["text"]
                        answers[face, "answered"] += 1
                assert lined["error"]["code"] in (-32602, -32008), lined  # status takes none
                # The batch's answer, or busy (id null) for all of it, and closed.
                (item,) = batched if isinstance(batched, list) else [batched]
                if "error" in item:
                    assert item["error"]["code"] == -32008, (batched, _failures(d))
                    answers["batch", "busy"] += 1
                else:
                    assert item["id"] == 3 and item["result"]["status"] == "ok", batched
                    answers["batch", "answered"] += 1
        finally:
            if mcp is not None:
                mcp.close()
        # The sweep crossed the limit, on both faces.
        assert {kind for _, kind in answers} == {"busy", "answered"}, answers
        assert answers["mcp", "answered"] and answers["native", "answered"], answers
        assert "result" in other.request("status")
        events = [e.get("event") for e in d.log_events()]
        assert "request_out_of_memory" in events
        assert "request_failed" not in events and "connection_failed" not in events
        eventually(lambda: _children(d.proc.pid) <= before, what="every call's tool gone")


def _answer(conn: RawConn, message: Any) -> Any:
    """The answer to ``message`` (a batch's array), or the ``id`` null error of a
    connection the daemon had no memory to open or read, or of a batch whose answers it
    had no memory to write (then it closes it); notifications are skipped."""
    conn.send(message)
    asked = message.get("id") if isinstance(message, dict) else None  # a batch: none
    while True:
        reply = conn.receive()
        if isinstance(reply, list):
            return reply
        if "method" not in reply and reply.get("id") in (asked, None):
            return reply


def _failures(d: Daemon) -> list[str]:
    """The tracebacks of the daemon's internal errors, for a test's failure message."""
    return [str(e.get("exception")) for e in d.log_events()
            if e.get("event") in ("request_failed", "mcp_request_failed")]


def _unread(sock: socket.socket) -> int:
    """Bytes this socket sent that its peer has not read yet (``SIOCOUTQ``)."""
    import fcntl  # Linux-only ioctl, as the daemon's platform
    import struct
    import termios

    return int(struct.unpack("i", fcntl.ioctl(sock, termios.TIOCOUTQ, b"\0" * 4))[0])


@pytest.mark.timeout(180)  # a huge line of numbers parsed (17 s at a load of 10)
def test_a_huge_line_of_numbers_is_parsed_without_holding_other_clients(plain: Daemon) -> None:
    """A 16 MiB line of numbers (each kept with its text) takes seconds to parse: that is
    done off the event loop, which serves every other client meanwhile. Told by thread
    (``CpuByThread``), from before the line's newline is sent (its parse cannot have
    begun) to its answer's first byte: no order of two clients' answers, which a loaded
    machine can turn around."""
    count = (16 * 1024 * 1024 - 100) // 4
    head = b'{"jsonrpc":"2.0","id":"big","method":"list","params":{"x":[' + b"1.5," * count
    with plain.raw(timeout=120) as big:
        big.send_bytes(head + b"1]}}")
        eventually(lambda: _unread(big.sock) == 0, timeout=60, what="the partial line read")
        cpu = CpuByThread(plain.proc.pid)
        big.send_bytes(b"\n")
        big.sock.recv(1, socket.MSG_PEEK)
        cpu.assert_off_the_loop("the big line was parsed")
        reply = big.receive()
    assert reply["id"] == "big" and reply["error"]["code"] == -32602


def _threads(pid: int) -> int:
    """How many threads the process has now."""
    return _proc_number(pid, "status", "Threads")


def test_large_lines_of_many_clients_are_parsed_one_at_a_time(plain: Daemon) -> None:
    """Parsing a large line holds the GIL, which the event loop needs too: with a worker
    thread parsing for each of many clients, the loop got it so rarely that another
    client's status waited for the whole flood. The daemon parses one large line at a time
    on all connections together: two dozen clients each sending one take one worker."""
    line = b'{"jsonrpc":"2.0","id":1,"method":"list","params":{"x":['
    line += b",".join([b"1.5"] * 40_000) + b"]}}\n"
    before = _threads(plain.proc.pid)
    conns = [plain.raw(timeout=120) for _ in range(24)]
    try:
        for conn in conns:
            conn.send_bytes(line)
        peak = before
        for conn in conns:
            peak = max(peak, _threads(plain.proc.pid))
            assert conn.receive()["error"]["code"] == -32602
    finally:
        for conn in conns:
            conn.close()
    assert peak <= before + 2, f"{peak - before} threads more while parsing"


@pytest.mark.timeout(180)  # large lines parsed one after another (~12 s in CI, 19 at a load of 10)
def test_a_wait_for_the_large_line_parser_does_not_count_against_the_next_line() -> None:
    """Large lines are parsed one at a time on all connections together, so a client's
    line may wait behind other clients' for longer than the idle timeout, while its
    reader takes nothing. The next line, begun in the same chunk and sent in full as fast
    as the daemon read it, used to be timed from before that wait: the connection was
    closed as idle and the line never answered."""
    with daemon_in("tsq-", args=["--no-watch", "--idle-timeout", "2"]) as d:
        floats = b'{"jsonrpc":"2.0","id":1,"method":"status","params":{"x":['
        floats += b",".join([b"1.5"] * 800_000) + b"]}}\n"  # seconds of parsing each
        heavy = [d.raw(timeout=120) for _ in range(6)]
        try:
            for conn in heavy:
                conn.send_bytes(floats)
            with d.raw(timeout=120) as client:
                first: dict[str, Any] = {"jsonrpc": "2.0", "id": "l1", "method": "status"}
                first["params"] = {"pad": "y" * 100_000}
                second: dict[str, Any] = {"jsonrpc": "2.0", "id": "l2", "method": "status"}
                second["params"] = {"pad": "z" * 1_500_000}  # more than the reader buffers
                client.send_bytes(json.dumps(first).encode() + b"\n" + json.dumps(second).encode() + b"\n")
                answers = [client.receive(), client.receive()]
                assert [a["id"] for a in answers] == ["l1", "l2"], answers
                assert all(a["error"]["code"] == -32602 for a in answers)
            for conn in heavy:
                assert conn.receive()["error"]["code"] == -32602
        finally:
            for conn in heavy:
                conn.close()
        assert not [e for e in d.log_events() if e.get("event") == "connection_idle_closed"]


def _fill_sleeper(home: Path, workspace: Path) -> None:
    write_set(home / "tools", "nap", {
        "runner": "exec", "description": "sleeps", "schema": {"type": "object"},
        "command": ["nap.sh"], "stdin": False, "approval": "always", "timeoutSeconds": 60,
    }, **{"nap.sh": "#!/bin/sh\nsleep 60\n"})


def _big_invoke(workspace: Path, call_id: str, size: int) -> dict[str, Any]:
    return {"jsonrpc": "2.0", "id": call_id, "method": "invoke", "params": {
        "tool": "nap", "arguments": {"pad": "x" * size}, "workspace": str(workspace),
        "callId": call_id}}


def test_large_requests_in_flight_are_bounded_daemon_wide() -> None:
    """Requests of large lines may hold at most four times the line limit together: parsed,
    a line takes many times its size, and an invoke keeps it until answered. One more is
    refused with -32008 (resource memory) and its connection closed; once the earlier ones
    are answered, a large request is taken again. Small requests are never held up."""
    limit = 300_000
    with daemon_in("tsl-", _fill_sleeper, args=["--no-watch", "--max-message-bytes", str(limit)]) as d:
        size = limit - 1_000
        holder = d.raw(timeout=60)
        for n in range(4):  # 4 lines of just under the limit: within four times the limit
            holder.send(_big_invoke(d.workspace, f"big-{n}", size))
        started: set[str] = set()
        while len(started) < 4:
            message = holder.receive()
            if message.get("method") == "started":
                started.add(message["params"]["callId"])
        with d.raw(timeout=60) as late:
            late.send(_big_invoke(d.workspace, "late", size))
            refusal = late.receive()
            assert "error" in refusal, f"taken past the bound: {refusal}"
            assert refusal["id"] is None and refusal["error"]["code"] == -32008
            assert refusal["error"]["data"]["resource"] == "memory"
            assert late.closed_by_peer(timeout=30)
        assert "result" in d.call("status")  # small requests are served meanwhile
        holder.close()  # its calls are cancelled and answered: their lines are released

        def taken_again() -> bool:
            with d.raw(timeout=60) as again:
                again.send(_big_invoke(d.workspace, "again", size))
                first = again.receive()
                if first.get("method") != "started":
                    return False
                assert "result" in again.request("cancel", {"callId": "again"})
                return True

        eventually(taken_again, timeout=60, what="a large request taken once the others ended")


def _unread_is_zero(conn: RawConn) -> bool:
    return _unread(conn.sock) == 0


def test_large_incomplete_lines_count_towards_the_same_bound() -> None:
    """A line being received is held in memory too: incomplete lines over 64 KiB count
    towards the bound on large requests, so connections that each start a line just under
    the limit and never end it cannot make the daemon hold one limit per connection."""
    limit = 300_000
    with daemon_in("tsp-", args=["--no-watch", "--max-message-bytes", str(limit)]) as d:
        head = b'{"jsonrpc":"2.0","id":1,"method":"status","params":{"pad":"'
        part = head + b"x" * (limit - 1_000 - len(head))
        holders = [d.raw(timeout=60) for _ in range(4)]
        try:
            for conn in holders:
                conn.send_bytes(part)
                eventually(functools.partial(_unread_is_zero, conn), what="the part read")
            with d.raw(timeout=60) as late:
                late.send_bytes(part)
                refusal = late.receive()
                assert refusal["id"] is None and refusal["error"]["code"] == -32008
                assert refusal["error"]["data"]["resource"] == "memory"
            assert "result" in d.call("status")  # small requests are served meanwhile
            holders[0].send_bytes(b'"}}\n')  # completed and answered: no longer held
            assert holders[0].receive()["error"]["code"] == -32602
            with d.raw(timeout=60) as again:
                again.send_bytes(part + b'"}}\n')
                assert again.receive()["error"]["code"] == -32602
        finally:
            for conn in holders:
                conn.close()


def test_a_call_whose_client_left_before_it_registered_is_cancelled() -> None:
    """A client sends an invoke and resets the connection at once: its reader stops and
    cancels the connection's calls before the call registers (its line parsed in a worker
    thread). It is cancelled as it registers, not run for nobody until its timeout (60 s,
    holding a runner slot and its line's share of the large-request bound): its large
    arguments are not even checked, and no process starts."""
    with daemon_in("tsg-", _fill_sleeper, args=["--no-watch"]) as d:
        for n in range(5):
            gone = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            gone.connect(str(d.socket))
            gone.sendall(json.dumps(_big_invoke(d.workspace, f"gone-{n}", 100_000)).encode() + b"\n")
            gone.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            gone.close()  # a reset: the daemon sees the connection lost

        def ended() -> bool:
            events = d.log_events()
            return sum(1 for e in events if e.get("event") == "call_finished") == 5

        eventually(ended, timeout=30, what="the five calls registered and ended")
        finished = [e for e in d.log_events() if e.get("event") == "call_finished"]
        assert {e["status"] for e in finished} == {"cancelled"}, finished
        assert not [e for e in d.log_events() if e.get("event") == "call_started"]

        def idle() -> bool:
            return bool(d.call("status")["result"]["inFlight"] == 0)

        eventually(idle, timeout=30, what="the calls of the clients that left are cancelled")


#: A launcher for the daemon whose ``pidfd_open`` of any process but itself fails with
#: EMFILE, as it does at the descriptor limit: a seccomp filter (x86-64) set before the
#: daemon's ``exec``, so the kernel answers it, not a stand-in of the daemon's code.
_NO_PIDFDS_OF_OTHERS = r"""
import ctypes, errno, os, struct, sys
pid = os.getpid()
code = [  # (op, jt, jf, k)
    (0x20, 0, 0, 4), (0x15, 0, 5, 0xC000003E),  # arch is x86-64, else allow
    (0x20, 0, 0, 0), (0x15, 0, 3, 434),  # nr is pidfd_open, else allow
    (0x20, 0, 0, 16), (0x15, 1, 0, pid),  # its pid is ours: allow
    (0x06, 0, 0, 0x00050000 | errno.EMFILE), (0x06, 0, 0, 0x7FFF0000),
]
insns = ctypes.create_string_buffer(b"".join(struct.pack("HBBI", *c) for c in code))
prog = struct.pack("HxxxxxxP", len(code), ctypes.addressof(insns))
libc = ctypes.CDLL(None, use_errno=True)
if libc.prctl(22, 2, ctypes.c_char_p(prog), 0, 0) != 0:  # PR_SET_SECCOMP, MODE_FILTER
    sys.exit(f"seccomp: {os.strerror(ctypes.get_errno())}")
os.execv(sys.executable, [sys.executable, "-m", "toolsetd.daemon", *sys.argv[1:]])
"""


def _children_of(pid: int) -> list[str]:
    """The processes whose parent is ``pid`` but its orphan guard (``reaper``), each as
    its ``stat`` line (zombies too)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                stat = (entry / "stat").read_text()
                guard = b"toolsetd orphan guard" in (entry / "cmdline").read_bytes()
                if int(stat.rsplit(")", 1)[1].split()[1]) == pid and not guard:
                    found.append(stat)
    return found


def _pipes_of(pid: int) -> int:
    """How many pipes process ``pid`` holds open."""
    count = 0
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        with contextlib.suppress(OSError):
            count += os.readlink(fd).startswith("pipe:")
    return count


def test_a_check_process_the_loop_cannot_wait_for_is_reaped_and_not_kept(tmp_base: Path) -> None:
    """The daemon waits for its check process through a pidfd (asyncio's child watcher).
    Where ``pidfd_open`` fails after the spawn (EMFILE: the descriptor limit), asyncio
    raised with the process started: the check ran on the loop, and the process was left
    running, never waited for, its two pipes open in the daemon, until the daemon ended
    (one more each minute). It is killed and reaped at once, its pipes closed; the call
    is answered (checked on the loop, as where no process can be had) and the failure is
    logged with its reason."""
    if sys.platform != "linux" or os.uname().machine != "x86_64":
        pytest.skip("the seccomp filter is written for x86-64 Linux")
    home, workspace = tmp_base / "home", tmp_base / "ws"
    (home / "tools").mkdir(parents=True)
    workspace.mkdir()
    _deep_sets(home, workspace)
    d = start_daemon(home, workspace, tmp_base, ["--no-watch"],
                     launcher=[sys.executable, "-c", _NO_PIDFDS_OF_OTHERS])
    try:
        assert d.call("status")["result"]
        pipes = _pipes_of(d.proc.pid)
        good = json.loads(_redos_line(d, "good", "a" * 70_000, "classify"))
        assert conn_result(d, good)["decision"] == "allow"
        failed = [e for e in d.log_events() if e.get("event") == "argument_check_process_failed"]
        assert failed, "no argument_check_process_failed"
        assert "Too many open files" in failed[0]["error"], failed
        assert _children_of(d.proc.pid) == [], "the check process is left (or unreaped)"
        eventually(lambda: _pipes_of(d.proc.pid) == pipes, what="its pipes closed")
        assert conn_result(d, good)["decision"] == "allow"  # on the loop meanwhile
        assert "Traceback" not in d.log(), d.log()
    finally:
        d.stop()


def _many_tools(home: Path, _workspace: Path) -> None:
    """1,000 home sets of 20 tools each: a catalog of 20,000 tools."""
    schema = {"type": "object", "properties": {"path": {"type": "string"}}}
    for index in range(1000):
        write_set(home / "tools", f"set{index:04d}", {
            "runner": "exec", "command": ["true"],
            "tools": [{"name": f"t{index}_{n}", "description": f"tool {n} of set {index}",
                       "schema": schema, "pathArguments": ["path"]} for n in range(20)],
        })


@pytest.mark.timeout(180)  # 1,000 manifests written and parsed at start
def test_a_list_of_twenty_thousand_tools_is_built_off_the_loop() -> None:
    """A list's body (each tool's and set's wire shape, encoded once per snapshot) was
    built on the event loop: 20,000 tools took 0.3-0.6 s, and a status beside it waited as
    long. A large catalog's body is built in a worker thread: from the request to the
    answer's first byte, the loop's thread spends a small part of what the others spend.
    The next list of that snapshot is the cached bytes."""
    with daemon_in("tsl-", _many_tools, args=["--no-watch"]) as d, d.raw(timeout=120) as conn:
        cpu = CpuByThread(d.proc.pid)
        conn.send_bytes(b'{"jsonrpc":"2.0","id":1,"method":"list"}\n')
        conn.sock.recv(1, socket.MSG_PEEK)
        cpu.assert_off_the_loop("the list body of 20,000 tools was built")
        first = conn.receive()
        assert len(first["result"]["tools"]) == 20_000
        assert conn.request("list")["result"] == first["result"]


@pytest.mark.timeout(180)  # 1,000 manifests written and parsed at start
def test_a_large_list_answers_the_generation_of_the_catalog_it_lists() -> None:
    """A large list's body is built in a worker thread (eaafc79), and the list took the
    generation after the build: a reload landing meanwhile answered the old catalog under
    the new generation, and a front end that saw that generation again (a status, a
    reload that changed nothing) kept the old tools as current. Each list says the
    generation of the catalog it lists, whichever of the two it is."""
    with (daemon_in("tsl-", _many_tools, args=["--no-watch"]) as d,
          d.raw(timeout=120) as first, d.raw(timeout=120) as second,
          d.raw(timeout=120) as other):
        before = other.request("status")["result"]["generation"]
        # Two builds, one behind the other (one large build at a time), and a reload
        # that changes one tool while they run.
        first.send_bytes(b'{"jsonrpc":"2.0","id":1,"method":"list","params":{"catalog":"plan"}}\n')
        second.send_bytes(b'{"jsonrpc":"2.0","id":2,"method":"list"}\n')
        manifest = d.home / "tools" / "set0999" / "tools.json"
        manifest.write_text(manifest.read_text().replace("tool 0 of set 999", "edited"))
        assert other.request("reload")["result"]["generation"] == before + 1
        for conn in (first, second):
            listed = conn.receive()["result"]
            (tool,) = [t for t in listed["tools"] if t["name"] == "t999_0"]
            edited = tool["description"] == "edited"
            assert listed["generation"] == (before + 1 if edited else before), (
                listed["generation"], tool["description"])


@pytest.mark.timeout(180)  # 1,000 manifests written and parsed at start
def test_an_mcp_tools_list_of_twenty_thousand_tools_is_built_off_the_loop() -> None:
    """MCP's tools/list entries of a snapshot (each tool's schema as MCP hosts take it),
    built once per snapshot, were built on the event loop at a host's first tools/list
    (and at each reload an MCP session saw): 20,000 tools took 0.15-0.4 s there. A large
    catalog's are built in a worker thread; the loop encodes the page alone."""
    meta = {"io.modelcontextprotocol/protocolVersion": "2026-07-28",
            "io.modelcontextprotocol/clientCapabilities": {}}
    listing = {"jsonrpc": "2.0", "id": "list", "method": "tools/list", "params": {"_meta": meta}}
    with daemon_in("tsl-", _many_tools, args=["--no-watch"]) as d, d.raw(timeout=120) as conn:
        bound = conn.request("mcp.bind", {"workspace": str(d.workspace)})
        assert bound["result"]["bound"] is True, bound
        cpu = CpuByThread(d.proc.pid)
        conn.send(listing)
        conn.sock.recv(1, socket.MSG_PEEK)
        cpu.assert_off_the_loop("the MCP listing of 20,000 tools was built")
        page = conn.receive()["result"]
        assert len(page["tools"]) > 0
        assert "nextCursor" in page
