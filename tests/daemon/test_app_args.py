"""toolsetd's command line: every option is described, limits are checked."""

from __future__ import annotations

import subprocess
import sys

import pytest
from toolsetd.daemon.app import parse_args
from toolsetd.daemon.settings import ConfigError, build_parser


def test_every_option_has_a_description() -> None:
    """``toolsetd --help`` says what each flag does (issue 11: six had no text)."""
    actions = build_parser("0")._actions  # argparse has no public list
    missing = [a.option_strings for a in actions if a.option_strings and not a.help]
    assert missing == []


def test_output_limit_is_bounded_by_the_line_budget() -> None:
    """A result must fit the longest line the daemon sends (docs/protocol.md, Limits)."""
    with pytest.raises(ConfigError, match="--output-limit: must be at most 1000000"):
        parse_args(["--output-limit", "1000001"])
    assert parse_args(["--output-limit", "1000000"]).runner.output_limit_chars == 1_000_000


def test_a_missing_allow_group_fails_the_start_but_not_a_reload(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """allow-group applies from a restart: a group that is gone (or a group database that
    cannot be asked now) stops a start with exit 2, and must not fail every later reload,
    which builds its options again from the same settings."""
    from toolsetd.daemon.app import main, options_from_settings
    from toolsetd.daemon.settings import load_settings

    config = tmp_path / "toolsetd.toml"
    config.write_text('allow-group = "no-such-group-toolsetd-test"\n')
    args = build_parser("toolsetd").parse_args(["--config", str(config)])
    options_from_settings(load_settings(args, {}), args)  # what a reload runs: no error
    assert main(["--config", str(config), "--socket", str(tmp_path / "s.sock")]) == 2


def test_allow_group_is_looked_up_once_into_the_gid_the_policy_allows(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """The start looks allow-group up once: the options carry its gid (what the peer policy
    allows); a name no group has is the settings error, never a later startup failure."""
    import grp
    import os

    name = grp.getgrgid(os.getegid()).gr_name
    config = tmp_path / "toolsetd.toml"
    config.touch()
    options = parse_args(["--config", str(config), "--allow-group", name])
    assert options.allow_gid == os.getegid()
    assert parse_args(["--config", str(config)]).allow_gid is None
    with pytest.raises(ConfigError, match='--allow-group: no group is named "no-such-grp-tsd"'):
        parse_args(["--config", str(config), "--allow-group", "no-such-grp-tsd"])


@pytest.mark.parametrize("flag", ["--print-config", "--help", "--version"])
def test_a_stdout_that_cannot_be_written_is_said_and_a_gone_reader_is_not(
    tmp_path, flag: str  # type: ignore[no-untyped-def]
) -> None:
    """``toolsetd --print-config > /dev/full`` (a full disk) ended in a traceback, and so did
    ``toolsetd --print-config`` into a pipe whose reader had left; ``--help`` and
    ``--version`` there exited 0 with nothing said (argparse swallows the write's error).
    Now a failing stdout is one line on stderr and exit 1; a reader gone is no failure."""
    import os
    import subprocess
    import sys

    if not os.path.exists("/dev/full"):
        pytest.skip("needs /dev/full")
    config = tmp_path / "toolsetd.toml"
    config.write_text("")
    argv = [sys.executable, "-m", "toolsetd.daemon", "--config", str(config), flag]
    # Buffered, as a service's stdout is: an error the write does not raise comes at exit.
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path)}
    env.pop("PYTHONUNBUFFERED", None)
    with open("/dev/full", "w") as full:
        r = subprocess.run(
            argv, stdout=full, stderr=subprocess.PIPE, text=True, timeout=60, env=env,
            check=False,
        )
    assert r.stderr.splitlines() == ["toolsetd: cannot write to stdout: No space left on device"]
    assert r.returncode == 1
    read_end, write_end = os.pipe()
    os.close(read_end)  # the reader left before a byte was written
    try:
        closed = subprocess.run(
            argv, stdout=write_end, stderr=subprocess.PIPE, text=True, timeout=60, env=env,
            check=False,
        )
    finally:
        os.close(write_end)
    assert (closed.returncode, closed.stderr) == (0, "")


@pytest.mark.parametrize(
    "locale_env",
    [
        {"PYTHONIOENCODING": "ascii"},
        {"PYTHONIOENCODING": "latin-1"},
        {"LC_ALL": "C", "PYTHONCOERCECLOCALE": "0", "PYTHONUTF8": "0"},
    ],
)
def test_print_config_is_utf8_in_any_locale(tmp_path, locale_env: dict[str, str]) -> None:  # type: ignore[no-untyped-def]
    """``toolsetd --print-config`` in a minimal image's legacy locale: a value with a letter
    outside ASCII (``home = "/srv/Zoë"``, as the file has it in UTF-8) ended in a
    UnicodeEncodeError traceback, or came out in latin-1, no valid toolsetd.toml. It is the
    file's own encoding, UTF-8, whatever the locale."""
    import os
    import subprocess
    import sys
    import tomllib

    config = tmp_path / "toolsetd.toml"
    config.write_text('home = "/srv/Zoë ✓"\n', encoding="utf-8")
    env = {k: v for k, v in os.environ.items()
           if k not in ("LANG", "LC_ALL", "LC_CTYPE", "PYTHONUTF8", "PYTHONIOENCODING")}
    r = subprocess.run(
        [sys.executable, "-m", "toolsetd.daemon", "--config", str(config), "--print-config"],
        capture_output=True, timeout=60, env={**env, **locale_env}, check=False,
    )
    assert r.returncode == 0, r.stderr
    assert tomllib.loads(r.stdout.decode("utf-8"))["home"] == "/srv/Zoë ✓"


def test_print_config_shows_the_cache_folder_a_start_would_use(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """The cache folder, when no flag or file sets it, is XDG_CACHE_HOME's: the line read
    ``# cache-dir =``, with no value, and the operator could not tell where the sets are
    kept. With ``--no-cache`` there is none to show."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache ✓")}
    env.pop("CONFIGURATION_DIRECTORY", None)

    def shown(*flags: str) -> list[str]:
        r = subprocess.run(
            [sys.executable, "-m", "toolsetd.daemon", "--config", str(tmp_path / "t.toml"),
             *flags, "--print-config"],
            capture_output=True, timeout=60, env=env, check=False, encoding="utf-8",
        )
        assert r.returncode == 0, r.stderr
        return [line.rpartition(" # ")[0].rstrip() for line in r.stdout.splitlines() if "cache-dir =" in line]

    (tmp_path / "t.toml").write_text("")
    assert shown() == [f'# cache-dir = "{tmp_path}/cache ✓/toolsetd"']
    assert shown("--no-cache") == ["# cache-dir ="]


_EMBEDDED = """
import signal, sys, tempfile
from pathlib import Path
import anyio
from toolsetd.daemon.app import DaemonOptions, run_daemon

signal.signal(signal.SIGALRM, signal.SIG_IGN)

async def main(base):
    (base / "home" / "tools").mkdir(parents=True)
    options = DaemonOptions(home=base / "home", socket=base / "s.sock", orphan_guard=False,
                            watch=False)
    async with anyio.create_task_group() as tg:
        await tg.start(run_daemon, options)
        tg.cancel_scope.cancel()

with tempfile.TemporaryDirectory(prefix="emb-") as folder:
    anyio.run(main, Path(folder))
print("kept" if signal.getsignal(signal.SIGALRM) is signal.SIG_IGN else "changed")
"""


def test_an_embedded_daemon_leaves_its_host_programs_ignored_signals_alone() -> None:
    """``run_daemon`` inside another program (``process_exit=False``) keeps that program's
    signals: only a daemon that is its own process (``main``) sets the signals it was
    started ignoring back to their defaults. Run in a child, so the test's own process
    is not touched."""
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-c", _EMBEDDED], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split()[-1:] == ["kept"], done.stdout + done.stderr


def test_a_crash_traceback_is_said_shown_not_obeyed(capfd: pytest.CaptureFixture[str]) -> None:
    """What ended the daemon unexpectedly was raised for the interpreter to print when
    stderr was a terminal or a file: raw, an exception's message (it quotes paths and
    values) put ESC sequences on the terminal and CI runner commands in a job's log. It is
    said now, as through a pipe, each line shown and not obeyed, and the exit code is 1."""
    from toolsetd.daemon.app import _exit_code

    with pytest.raises(RuntimeError) as raised:
        raise RuntimeError("in /tmp/\x1b]0;pwned\x07x\n::set-output name=a::b ##vso[task.x]y")
    assert _exit_code(raised.value) == 1
    err = capfd.readouterr().err
    assert "Traceback (most recent call last):" in err
    assert "\x1b" not in err and "\x07" not in err
    assert "##vso[" not in err
    assert not any(line.lstrip().startswith("::") for line in err.splitlines()), err


_WATCH_THE_HANDOVER = """
import _signal, signal, sys, anyio
from toolsetd.daemon import app

seen = []

def watch(frame, event, arg):
    if event == "c_return" and arg is _signal.signal:  # signal.signal wraps it
        for s in app._HANDLED_SIGNALS:
            if signal.getsignal(s) in (signal.SIG_DFL, signal.default_int_handler):
                seen.append(signal.Signals(s).name)

async def main():
    with anyio.open_signal_receiver(*app._HANDLED_SIGNALS):
        sys.setprofile(watch)
        try:
            app._ignore_to_the_exit()
        finally:
            sys.setprofile(None)

anyio.run(main)
left = sorted({signal.Signals(s).name for s in app._HANDLED_SIGNALS
               if signal.getsignal(s) is not signal.SIG_IGN})
print(sorted(set(seen)), left, signal.set_wakeup_fd(-1))
"""


def test_the_signals_are_never_at_their_default_actions_as_the_daemon_ends() -> None:
    """At the end of a stop the daemon's signals go from the loop's handlers to ignored.
    The loop's own removal put each back to its default action first, for as long as the
    daemon took to reach the next call: a SIGQUIT sent through a stop, on a loaded
    machine, ended the daemon by that signal instead of exit 0 (a whole run of the tests
    met it once). Every change of a signal's handler is watched here, and none of them
    leaves a daemon's signal at its default action; after the loop's end each is still
    ignored, and no wakeup descriptor is left behind."""
    done = subprocess.run(
        [sys.executable, "-c", _WATCH_THE_HANDOVER],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["[]", "[]", "-1"], done.stdout
