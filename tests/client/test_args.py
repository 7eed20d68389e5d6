"""``--args`` parsing: inline JSON, ``@FILE``, ``-`` for stdin, and the usage errors."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from toolsetd.client.cli import UsageError, parse_arguments
from toolsetd.client.context import read_arguments


def test_parse_arguments_inline_json() -> None:
    """Inline JSON text is the argument object."""
    assert parse_arguments('{"path": "a.txt", "n": 2}', io.StringIO()) == {"path": "a.txt", "n": 2}


def test_parse_arguments_absent_is_empty_object() -> None:
    """Without ``--args`` the arguments are ``{}``."""
    assert parse_arguments(None, io.StringIO()) == {}


def test_parse_arguments_from_file(tmp_path: Path) -> None:
    """``@FILE`` reads the object from that file."""
    path = tmp_path / "args.json"
    path.write_text('{"q": "ünïcode"}', encoding="utf-8")
    assert parse_arguments(f"@{path}", io.StringIO()) == {"q": "ünïcode"}


def test_parse_arguments_from_stdin() -> None:
    """``-`` reads the object from stdin."""
    assert parse_arguments("-", io.StringIO('{"a": [1]}\n')) == {"a": [1]}


def test_args_with_a_byte_order_mark_are_read(tmp_path: Path) -> None:
    """An argument file saved by an editor that starts it with a UTF-8 byte order mark
    (Notepad, PowerShell 5's ``Out-File``), given as ``@FILE``, on stdin or inline
    (``--args "$(cat args.json)"``): it was refused as "not valid JSON: Unexpected UTF-8
    BOM", where the daemon reads manifests and its config file with one. The mark is
    dropped, and the text sent (as written otherwise) no longer starts with it."""
    path = tmp_path / "args.json"
    path.write_bytes(b'\xef\xbb\xbf{"n": 1.50}')
    stdin = io.TextIOWrapper(io.BytesIO(b'\xef\xbb\xbf{"n": 1.50}\n'), encoding="utf-8")
    for spec, source in ((f"@{path}", io.StringIO()), ("-", stdin), ('\ufeff{"n": 1.50}', None)):
        value, text = read_arguments(spec, source or io.StringIO())
        assert value == {"n": 1.5}
        assert text.strip() == '{"n": 1.50}'
    # Only a leading one: a mark anywhere else is no JSON whitespace.
    with pytest.raises(UsageError):
        read_arguments('{"n": 1}\ufeff', io.StringIO())
    with pytest.raises(UsageError):
        read_arguments('\ufeff\ufeff{"n": 1}', io.StringIO())


def test_args_past_the_double_range_are_kept_as_written() -> None:
    """A number past the double range, even with an exponent past what ``decimal`` holds
    (it was ``InvalidOperation``, "unexpected error", exit 9), is read as written and sent
    so: nothing computes its digits."""
    value, text = read_arguments('{"n": 1e99999999999999999999999, "m": 1e5000}', io.StringIO())
    assert [value["n"].text, value["m"].text] == ["1e99999999999999999999999", "1e5000"]
    assert text == '{"n": 1e99999999999999999999999, "m": 1e5000}'


@pytest.mark.parametrize(
    ("spec", "stdin", "message"),
    [
        ("{bad", "", "--args is not valid JSON: "),
        ('{"n": NaN}', "", "--args is not valid JSON: NaN is not a valid JSON value."),
        ('{"n": -Infinity}', "", "--args is not valid JSON: -Infinity is not a valid JSON value."),
        ("[1]", "", "--args must be a JSON object."),
        ("-", "nope", "--args from stdin is not valid JSON: "),
        ("@/nonexistent/args.json", "", "Cannot read the --args file /nonexistent/args.json: "),
        ('{"s": "\\ud800"}', "", "--args has a \\u escape of half a surrogate pair"),
        ('{"\\udc00": 1}', "", "--args has a \\u escape of half a surrogate pair"),
        ("-", '{"a": "\udcff"}', "--args from stdin is not valid UTF-8 (at character 7)."),
    ],
)
def test_parse_arguments_errors(spec: str, stdin: str, message: str) -> None:
    """Bad ``--args`` raise ``UsageError`` with a message naming the source."""
    with pytest.raises(UsageError) as caught:
        parse_arguments(spec, io.StringIO(stdin))
    assert str(caught.value).startswith(message)


def test_empty_args_say_they_are_empty(tmp_path: Path) -> None:
    """``--args -`` with nothing piped in (a closed stdin, a heredoc that went missing),
    an empty ``@FILE`` or ``--args "$ARGS"`` of an unset variable: "is not valid JSON:
    Expecting value: line 1 column 1 (char 0)" pointed at a character that is not there.
    The message says the text is empty, and what to give instead."""
    empty = tmp_path / "args.json"
    empty.write_bytes(b"")
    cases = [("-", ""), ("-", " \n\t"), (f"@{empty}", ""), ("", ""), ("  ", "")]
    for spec, stdin in cases:
        with pytest.raises(UsageError) as caught:
            parse_arguments(spec, io.StringIO(stdin))
        message = str(caught.value)
        assert "is empty" in message, (spec, message)
        assert "Expecting value" not in message
        assert "'{}'" in message
    proc = subprocess.run(
        [sys.executable, "-m", "toolsetd.client", "--socket", str(tmp_path / "none.sock"),
         "classify", "t", "--args", "-"],
        stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=60, check=False,
    )
    assert proc.returncode == 2
    assert proc.stderr.startswith("--args from stdin is empty"), proc.stderr


def test_cli_invalid_args_json_exits_2(tmp_path: Path) -> None:
    """``classify`` with invalid ``--args`` JSON exits 2 with the message on stderr, before any connect."""
    proc = subprocess.run(
        [sys.executable, "-m", "toolsetd.client", "classify", "t", "--args", "{bad",
         "--socket", str(tmp_path / "none.sock")],
        capture_output=True, text=True, timeout=30, check=False,
    )
    assert proc.returncode == 2
    assert proc.stderr.startswith("--args is not valid JSON: ")
    assert proc.stdout == ""
    assert "Traceback" not in proc.stderr


def test_cli_args_not_utf8_on_stdin_exits_2(tmp_path: Path) -> None:
    """Bytes that are not UTF-8 on stdin are a usage error (exit 2), not an internal one."""
    proc = subprocess.run(
        [sys.executable, "-m", "toolsetd.client", "classify", "t", "--args", "-",
         "--socket", str(tmp_path / "none.sock")],
        input=b'{"a": "\xff"}', capture_output=True, timeout=30, check=False,
    )
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.startswith(b"--args from stdin is not valid UTF-8")


def test_cli_args_from_a_non_blocking_stdin_are_waited_for(tmp_path: Path) -> None:
    """``--args -`` on a non-blocking stdin (a CI runner's pipe) that has no data yet: the
    read returned None and toolsetctl ended in an internal error (exit 9, ``TypeError``).
    It waits for the text as on a blocking one, then goes on (here: no daemon, exit 5)."""
    read_end, write_end = os.pipe()
    os.set_blocking(read_end, False)
    proc = subprocess.Popen(
        [sys.executable, "-m", "toolsetd.client", "classify", "t", "--args", "-",
         "--socket", str(tmp_path / "none.sock")],
        stdin=read_end, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )
    os.close(read_end)
    try:
        proc.wait(timeout=3)  # the time it takes to start and find the pipe empty
    except subprocess.TimeoutExpired:
        pass
    try:
        os.write(write_end, b'{"a": 1}')
    except BrokenPipeError:  # it did not wait
        pass
    os.close(write_end)
    _out, err = proc.communicate(timeout=30)
    assert proc.returncode == 5, err
    assert b"toolsetd is not running" in err


def test_cli_args_not_utf8_on_stdin_exits_2_with_a_strict_decoder(tmp_path: Path) -> None:
    """The same under a locale whose stdin decoder is strict (en_US.UTF-8, not C)."""
    proc = subprocess.run(
        [sys.executable, "-m", "toolsetd.client", "classify", "t", "--args", "-",
         "--socket", str(tmp_path / "none.sock")],
        input=b'{"a": "\xff"}', capture_output=True, timeout=30, check=False,
        env={**os.environ, "PYTHONIOENCODING": "utf-8:strict"},
    )
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.startswith(b"--args from stdin is not valid UTF-8 (at byte 7).")


def test_parse_arguments_nested_too_deeply_is_a_usage_error() -> None:
    """JSON nested past the stdlib decoder's recursion: exit 2's UsageError, not a crash (9)."""
    deep = '{"a": ' + "[" * 100_000 + "]" * 100_000 + "}"
    with pytest.raises(UsageError, match="nested too deeply"):
        parse_arguments(deep, io.StringIO())


@pytest.mark.parametrize("spec", ["@/dev/zero", "-"])
def test_parse_arguments_reads_a_bounded_amount(
    spec: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``@/dev/zero`` or an endless stdin stops at the daemon's line limit, not at the OOM killer."""
    from toolsetd.client import context

    monkeypatch.setattr(context, "MAX_ARGS_BYTES", 1024)
    with open("/dev/zero", "rb") as zero:
        stdin = io.TextIOWrapper(zero)
        with pytest.raises(UsageError, match="is larger than 1024 bytes"):
            parse_arguments(spec, stdin)


def test_parse_arguments_reads_more_than_the_daemons_default_line_limit(tmp_path: Path) -> None:
    """An operator may raise the daemon's limit (``--max-message-bytes``): 16 MiB is not the
    client's to enforce; the daemon refuses what is over its own (-32007, exit 2)."""
    big = tmp_path / "args.json"
    big.write_text(json.dumps({"pad": "a" * (20 * 1024 * 1024)}), encoding="utf-8")
    assert len(parse_arguments(f"@{big}", io.StringIO(""))["pad"]) == 20 * 1024 * 1024


def test_a_request_over_the_daemons_line_limit_exits_2() -> None:
    """-32007 (MessageTooLarge) can only be the caller's --args: a usage error, not internal."""
    from toolsetd.client.exits import EXIT_USAGE, rpc_failure
    from toolsetd.protocol.errors import RpcError

    failure = rpc_failure(RpcError.from_error({"code": -32007, "message": "Message too large"}))
    assert failure.exit_code == EXIT_USAGE


def test_a_schema_refusal_prints_each_error_after_the_first_below_it() -> None:
    """The summary carries the first error; each later one is a line below, whatever its
    words: two errors of the same words (at two pointers of one schema keyword), or one
    whose words the first holds, printed fewer lines than "(N more below)" counts. An
    error of the arguments object itself is named so; the JSON message is the daemon's."""
    from toolsetd.client.exits import rpc_failure
    from toolsetd.protocol.errors import RpcError

    errors = [
        {"path": "", "message": "property 'extra' is not allowed"},
        {"path": "", "message": "property 'extra' is not allowed"},
        {"path": "/a", "message": "/a: not allowed"},
        {"path": "", "message": "not allowed"},
    ]
    message = "Invalid arguments for 't': property 'extra' is not allowed (3 more in data.errors)"
    failure = rpc_failure(RpcError.from_error(
        {"code": -32002, "message": message, "data": {"errors": errors}}))
    assert failure.message == message
    assert failure.said == message.replace("(3 more in data.errors)", "(3 more below)")
    assert failure.details == [
        "  (the arguments object): property 'extra' is not allowed",
        "  /a: not allowed",
        "  (the arguments object): not allowed",
    ]
