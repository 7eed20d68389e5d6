"""toolsetd.toml: precedence, every error message, --print-config and the reload split."""

from __future__ import annotations

import argparse
import math
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from toolsetd.daemon.app import options_from_settings
from toolsetd.daemon.settings import (
    OPTIONS,
    ConfigError,
    Settings,
    build_parser,
    default_config_path,
    format_settings,
    load_settings,
    parse_command_line,
    reload_settings,
    settings_fields,
)


def _args(*argv: str) -> argparse.Namespace:
    return build_parser("test").parse_args(list(argv))


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "toolsetd.toml"
    path.write_text(text)
    return path


def _load(path: Path, *argv: str, environ: dict[str, str] | None = None) -> Settings:
    return load_settings(_args("--config", str(path), *argv), environ or {})


def test_settings_table_matches_the_settings_fields() -> None:
    """Every option row has a Settings field of its name, its default, and a --<key> flag."""
    assert tuple(o.attr for o in OPTIONS) == settings_fields()
    defaults = Settings()
    for option in OPTIONS:
        assert getattr(defaults, option.attr) == option.default or (
            option.kind == "names" and getattr(defaults, option.attr) == ()
        )
        assert option.flag in build_parser("test").format_help()


def test_settings_precedence_flag_over_env_over_file_over_default(tmp_path: Path) -> None:
    """A flag wins over the environment, which wins over the file, which wins over the default."""
    path = _write(
        tmp_path, 'max-running = 8\nsocket = "/run/file.sock"\nhome = "/srv/home"\nkill-grace = 3\n'
    )
    s = _load(path, "--max-running", "4", environ={"TOOLSETD_SOCKET": "/run/env.sock"})
    assert s.max_running == 4
    assert s.sources["max-running"] == "flag --max-running"
    assert s.socket == Path("/run/env.sock")
    assert s.sources["socket"] == "env TOOLSETD_SOCKET"
    assert s.home == Path("/srv/home")
    assert s.sources["home"] == f"{path}:3"
    assert s.kill_grace == 3.0 and isinstance(s.kill_grace, float)
    assert s.sources["kill-grace"] == f"{path}:4"
    assert s.output_limit == 100_000
    assert s.sources["output-limit"] == "default"
    assert s.config_path == path


def test_settings_every_flag_has_its_key(tmp_path: Path) -> None:
    """Each key is its flag without the dashes, and sets the same field."""
    text = "\n".join(
        [
            'socket = "/tmp/x.sock"',
            'home = "~/crystal"',
            'reserve = ["deploy", "ship"]',
            'log-format = "console"',
            'log-level = "debug"',
            "no-watch = true",
            'allow-group = "staff"',
            "max-running = 2",
            "output-limit = 10",
            "kill-grace = 1.5",
            "progress-interval = 0.5",
            "shutdown-grace = 4",
            "status-interval = 9",
            "no-orphan-guard = true",
            "max-connections = 3",
            "max-calls-per-connection = 4",
            "idle-timeout = 5",
            "max-message-bytes = 4096",
            "workspace-idle = 60",
            'metrics-listen = "127.0.0.1:9464"',
            'mcp-listen = ["127.0.0.1:8765", "[::1]:8765"]',
            'mcp-token-file = "~/mcp-token"',
            'traces = "console"',
            "spawn-threads = 2",
            "max-watches = 100",
            'cache-dir = "/tmp/toolsetd-cache"',
            "no-cache = true",
        ]
    )
    s = _load(_write(tmp_path, text))
    assert {k for k, v in s.sources.items() if v != "default"} == {o.key for o in OPTIONS}
    assert s.home == Path(os.path.expanduser("~/crystal"))
    assert s.reserve == ("deploy", "ship")
    assert s.no_watch is True and s.no_orphan_guard is True
    assert s.metrics_listen == ("127.0.0.1", 9464)
    options = options_from_settings(s)
    assert options.max_running == 2 and options.runner.output_limit_chars == 10
    assert options.server.max_frame_size == 4096 and options.server.idle_timeout == 5.0
    assert {"deploy", "ship"} <= options.reserved and "bash" in options.reserved
    assert options.watch is False and options.orphan_guard is False
    assert options.max_watches == 100
    assert [(a.host, a.port) for a in options.mcp_listen] == [("127.0.0.1", 8765), ("::1", 8765)]
    assert options.mcp_token_file == Path(os.path.expanduser("~/mcp-token"))
    assert options.runner.spawn_threads == 2 and options.cache_dir is None  # no-cache wins


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("max-running = 0\n", "toolsetd.toml:1: max-running: must be at least 1, got 0"),
        ("spawn-threads = -1\n", "toolsetd.toml:1: spawn-threads: must be at least 0, got -1"),
        ('max-running = "8"\n', 'toolsetd.toml:1: max-running: must be an integer, got "8"'),
        ("max-running = true\n", "max-running: must be an integer, got true"),
        (
            "\n\nkill-grace = -1\n",
            "toolsetd.toml:3: kill-grace: must be a positive number of seconds, got -1",
        ),
        ('kill-grace = "5"\n', 'kill-grace: must be a number of seconds, got "5"'),
        ("kill-grace = inf\n", "toolsetd.toml:1: kill-grace: must be a finite number of seconds, got inf"),
        ("progress-interval = 1e-300\n", "progress-interval: must be at least 0.01 seconds, got 1e-300"),
        ("kill-grace = 1e308\n", "kill-grace: must be at most 86400 seconds (a day), got 1e+308"),
        ("shutdown-grace = 86401\n", "shutdown-grace: must be at most 86400 seconds (a day), got 86401"),
        ("idle-timeout = 1e300\n", "idle-timeout: must be at most 86400 seconds (a day), got 1e+300"),
        ("progress-interval = 1e9\n", "progress-interval: must be at most 86400 seconds (a day), got 1000000000.0"),
        ("status-interval = 1e9\n", "status-interval: must be at most 86400 seconds (a day), got 1000000000.0"),
        ("no-watch = 1\n", "no-watch: must be true or false, got 1"),
        (
            'log-level = "loud"\n',
            'log-level: must be one of debug, info, warning, error; got "loud"',
        ),
        (
            'socket = "relative.sock"\n',
            'socket: must be an absolute path (or start with ~), got "relative.sock"',
        ),
        (
            'home = "~toolsetd-no-such-user/h"\n',
            'home: starts with "~toolsetd-no-such-user", and there is no user '
            '"toolsetd-no-such-user"; give an absolute path, or ~/ for the daemon\'s home',
        ),
        ("reserve = [1]\n", "reserve: must be a list of names; entry 1 is 1"),
        ('reserve = ["a", ""]\n', "reserve: must be a list of names; entry 2 is empty"),
        ("reserve = {a = 1}\n", "reserve: must be a list of names, got a table"),
        ("allow-group = 5\n", "allow-group: must be a string, got 5"),
        ('allow-group = ""\n', "allow-group: must not be empty"),
        (
            'metrics-listen = "0.0.0.0:9464"\n',
            'metrics-listen: must be a loopback address (127.0.0.1, [::1] or localhost), got "0.0.0.0:9464"',
        ),
        ('metrics-listen = "9464"\n', "metrics-listen: must be HOST:PORT"),
        (
            'mcp-listen = ["127.0.0.1:8765", "0.0.0.0:8765"]\n',
            'toolsetd.toml:1: mcp-listen: "0.0.0.0:8765": refusing to listen on 0.0.0.0, which is '
            "not a loopback address",
        ),
        # A string may hold U+2028, U+2029 or U+0085: splitlines() took each for a line
        # end, and every key after it was named at a line too far.
        (
            'reserve = ["a\u2028b\u2029c\x85d"]\nmax-runing = 3\n',
            "toolsetd.toml:2: max-runing: unknown key",
        ),
        (
            'reserve = ["a\u2028b"]\nmax-running = 1\nmax-running = 2\n',
            "toolsetd.toml:3: max-running: is set twice (first at line 2)",
        ),
        # tomllib stops after the value: a value over several lines put it at the last.
        (
            'reserve = ["a"]\nmax-running = 2\nreserve = [\n  "b",\n  "c",\n]\n',
            "toolsetd.toml:3: reserve: is set twice (first at line 1); keep one of them",
        ),
        # Its entries are addresses: "a list of names" sent the operator the wrong way.
        (
            'mcp-listen = ["127.0.0.1:8765", 8766]\n',
            'toolsetd.toml:1: mcp-listen: must be a list of "HOST:PORT" addresses; entry 2 is 8766',
        ),
        (
            "mcp-listen = {port = 8765}\n",
            'toolsetd.toml:1: mcp-listen: must be a list of "HOST:PORT" addresses, got a table',
        ),
        (
            "max-runing = 3\n",
            "toolsetd.toml:1: max-runing: unknown key; did you mean 'max-running'?",
        ),
        ("[limits]\nx = 1\n", "toolsetd.toml:1: limits: unknown key"),
        # A dotted key, an inline table and a quoted table name are lines too: each was
        # reported with no line at all.
        ("\n\nlimits.x = 1\n", "toolsetd.toml:3: limits: unknown key"),
        ("\nmax-running.x = 1\n", "toolsetd.toml:2: max-running: must be an integer, got a table"),
        ("\nconfinement = {cgroup = 5}\n", "toolsetd.toml:2: confinement.cgroup: must be"),
        (
            '\n[confinement.sets."a b"]\nprofile = "off"\n',
            "toolsetd.toml:2: confinement.sets.a b: no set directory can be named 'a b'",
        ),
        (
            "\n[confinement]\nsets . 'lint' . profile = 'of'\n",
            "toolsetd.toml:3: confinement.sets.lint.profile: must be one of",
        ),
        (
            "max-running = \n",
            "toolsetd.toml:1: is not valid TOML: Invalid value (at line 1, column 15)",
        ),
        # A key set twice (a line appended to a file that had it): tomllib's "Cannot
        # overwrite a value" named neither the key nor the fix.
        (
            "max-running = 1\nkill-grace = 2\nmax-running = 2\n",
            "toolsetd.toml:3: max-running: is set twice (first at line 1); keep one of them",
        ),
        (
            'max-running = 1\n"max-running" = 2',
            "toolsetd.toml:2: max-running: is set twice (first at line 1); keep one of them",
        ),
        (
            '[confinement.project]\nprofile = "off"\nnetwork = true\nprofile = "read-only"\n',
            "toolsetd.toml:4: confinement.project.profile: is set twice (first at line 2); "
            "keep one of them",
        ),
        (
            '[confinement]\ncgroup = "off"\n\n[confinement]\nsandbox = "off"\n',
            "toolsetd.toml:4: confinement: is declared twice (first at line 1); write its keys "
            "in one place",
        ),
        (
            'confinement.cgroup = "off"\n[confinement]\nsandbox = "off"\n',
            "toolsetd.toml:2: confinement: is declared twice (first at line 1); write its keys "
            "in one place",
        ),
    ],
)
def test_settings_file_errors_name_file_line_and_key(
    tmp_path: Path, text: str, message: str
) -> None:
    """A bad file raises ConfigError naming the file, the line and the key, and the fix."""
    path = _write(tmp_path, text)
    with pytest.raises(ConfigError) as caught:
        _load(path)
    assert message in str(caught.value)
    assert str(caught.value).startswith(str(path))


@pytest.mark.parametrize("value", ["~\\u0000x", "~root\\u0000/x", "~/\\u0000s", "/srv/a\\u0000b"])
@pytest.mark.parametrize("key", [o.key for o in OPTIONS if o.kind == "path"])
def test_settings_a_path_with_a_nul_names_its_key_and_the_fix(
    tmp_path: Path, key: str, value: str
) -> None:
    """A path-valued key holding U+0000 (which no file name can) names the file, line and
    key, and says what a path must be: "~\\u0000x" said only "embedded null byte", from the
    user lookup of ``~`` before the check; "~/\\u0000s" only "must be a path"."""
    path = _write(tmp_path, f'\n{key} = "{value}"\n')
    with pytest.raises(ConfigError) as caught:
        _load(path)
    shown = value.replace("\\u0000", "\\x00")  # as ConfigError shows it
    assert str(caught.value) == (
        f'{path}:2: {key}: must be a path without NUL characters (\\u0000), got "{shown}"'
    )


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (
            '[confinement]\nsandbox = "/usr/bin/bwrap\\u0000x"\n',
            "toolsetd.toml:2: confinement.sandbox: must be a path without NUL characters; "
            'got "/usr/bin/bwrap\\x00x".',
        ),
        (
            '[confinement]\ncgroup = "/sys/fs/cgroup/a\\u0000b"\n',
            "toolsetd.toml:2: confinement.cgroup: must be a path without NUL characters; "
            'got "/sys/fs/cgroup/a\\x00b".',
        ),
        (
            '[confinement]\nhide = ["~/.aws", "~/\\u0000x"]\n',
            "toolsetd.toml:2: confinement.hide: each path must be without NUL characters; "
            'got "~/\\x00x".',
        ),
    ],
)
def test_settings_a_confinement_path_with_a_nul_names_its_key(
    tmp_path: Path, text: str, message: str
) -> None:
    """The paths of [confinement] too: a sandbox binary named with U+0000 ended the start
    in a traceback (the probe's os.access: "embedded null byte"), a hide entry with one
    was taken, and hid nothing."""
    with pytest.raises(ConfigError) as caught:
        _load(_write(tmp_path, text))
    assert str(caught.value).endswith(message)


@pytest.mark.parametrize(
    ("text", "shown"),
    [
        ("max-running = 1979-05-27\n", "got a date (1979-05-27)"),
        ("kill-grace = 07:32:00\n", "got a time (07:32:00)"),
        ("[confinement.sets]\nlint = 5\n", "must be a table; got 5."),
        ('[confinement]\n[confinement.sets.lint]\nnetwork = "yes"\n', 'got "yes".'),
    ],
)
def test_settings_a_bad_value_is_shown_as_toml_writes_it(
    tmp_path: Path, text: str, shown: str
) -> None:
    """A value the file gives is shown as TOML writes it, or as what it is: it was Python's
    repr (``datetime.date(1979, 5, 27)``, ``got int``, ``'yes'``)."""
    with pytest.raises(ConfigError) as caught:
        _load(_write(tmp_path, text))
    assert shown in str(caught.value), str(caught.value)
    assert "datetime" not in str(caught.value) and "got int" not in str(caught.value)


def test_settings_an_array_of_confinement_tables_names_its_line(tmp_path: Path) -> None:
    """``[[confinement]]`` (an array of tables, one bracket too many) is refused at the line
    of its header: the message named no line, so the file had to be searched for it."""
    with pytest.raises(ConfigError) as caught:
        _load(_write(tmp_path, 'log-level = "info"\n\n[[confinement]]\ncgroups = true\n'))
    assert "toolsetd.toml:3: confinement: must be a table ([confinement]), got a list" in str(
        caught.value
    )


def test_settings_a_check_across_keys_names_the_file_and_line_of_the_value(tmp_path: Path) -> None:
    """``key_fault`` names the file and line the value came from, or the flag; and it
    reads no line out of the file's own name when the key has none (an escaped key is
    given no line): ``t.toml:7`` named line 7 of ``t.toml``."""
    from toolsetd.daemon.settings import key_fault

    path = _write(tmp_path, 'log-level = "info"\ntraces = "console"\n')
    assert str(key_fault(_load(path), "traces", "m")) == f"{path}:2: traces: m"
    assert str(key_fault(_load(path, "--traces", "off"), "traces", "m")) == "--traces: m"
    folder = tmp_path / "a:1"
    folder.mkdir()
    odd = folder / "t.toml:7"
    odd.write_text('log-level = "info"\n"tr\\u0061ces" = "console"\n')
    fault = key_fault(_load(odd), "traces", "m")
    assert fault.line is None and str(fault) == f"{odd}: traces: m"


def test_settings_key_lines_of_a_long_dotted_key_stay_few_and_short() -> None:
    """Each dotted prefix of a key is given its line, but only up to a depth and a length
    no setting passes: every prefix of a key of 400,000 parts, joined, was the square of
    its length (gigabytes for a 1 MiB file)."""
    from toolsetd.daemon.settings import _key_lines

    lines = _key_lines("a" + ".a" * 1000 + " = 1\n[" + "b." * 1000 + "b]\nc = 1\n")
    assert lines["a"] == 1 and lines["[b]"] == 2 and lines["[b.b.b]"] == 2
    assert len(lines) <= 16 and all(len(name) <= 258 for name in lines)


def test_settings_file_not_utf8_or_not_a_file(tmp_path: Path) -> None:
    """Bytes that are not UTF-8, a directory and a missing --config file are refused."""
    path = tmp_path / "toolsetd.toml"
    path.write_bytes(b"max-running = 1\n\xff\n")
    with pytest.raises(ConfigError, match=r"toolsetd\.toml:2: is not UTF-8"):
        _load(path)
    with pytest.raises(ConfigError, match="cannot be used: it is not a regular file"):
        _load(tmp_path)
    path.write_text("#" * (1 << 20) + "\n")
    with pytest.raises(ConfigError, match="cannot be used: it is larger than 1 MiB"):
        _load(path)
    with pytest.raises(ConfigError, match="No such file or directory"):
        _load(tmp_path / "missing.toml")


def test_settings_file_in_a_kernel_file_system_says_so(tmp_path: Path) -> None:
    """A toolsetd.toml linked into /proc is refused unread, as a manifest is (34e5a8a), but
    its error said 'it is not a regular file', which stat -L contradicts: it names the
    file system and the fix, as tools.json's note does."""
    path = tmp_path / "toolsetd.toml"
    path.symlink_to("/proc/self/environ")
    with pytest.raises(ConfigError) as caught:
        _load(path)
    assert str(caught.value) == (
        f"{path}: cannot be used: it is in the kernel's proc file system (a view of kernel "
        "state, not a file) and is not read: make it a regular file on a disk, or a link to one"
    )


def test_settings_flag_and_env_errors() -> None:
    """A bad flag value names the flag; a bad environment value names its variable."""
    with pytest.raises(ConfigError, match="--max-running: must be at least 1, got 0"):
        load_settings(_args("--max-running", "0"), {}, uid=1000)
    with pytest.raises(ConfigError, match="--spawn-threads: must be at least 0, got -2"):
        load_settings(_args("--spawn-threads", "-2"), {}, uid=1000)
    assert load_settings(_args("--spawn-threads", "0"), {}, uid=1000).spawn_threads == 0
    with pytest.raises(ConfigError, match="--kill-grace: must be a number of seconds"):
        load_settings(_args("--kill-grace", "soon"), {}, uid=1000)
    with pytest.raises(ConfigError, match="--kill-grace: must be a finite number of seconds"):
        load_settings(_args("--kill-grace", "inf"), {}, uid=1000)
    with pytest.raises(ConfigError, match="--idle-timeout: must be a finite number of seconds"):
        load_settings(_args("--idle-timeout", "Infinity"), {}, uid=1000)
    assert load_settings(_args("--workspace-idle", "inf"), {}, uid=1000).workspace_idle == math.inf
    with pytest.raises(ConfigError, match="--kill-grace: must be at most 86400 seconds"):
        load_settings(_args("--kill-grace", "1e308"), {}, uid=1000)
    assert load_settings(_args("--kill-grace", "86400"), {}, uid=1000).kill_grace == 86400
    assert load_settings(_args("--workspace-idle", "1e300"), {}, uid=1000).workspace_idle == 1e300
    with pytest.raises(ConfigError, match="--metrics-listen: must be a loopback address"):
        load_settings(_args("--metrics-listen", "10.0.0.1:80"), {}, uid=1000)
    with pytest.raises(ConfigError, match=r'--mcp-listen: "10\.0\.0\.1:80": refusing to listen'):
        load_settings(_args("--mcp-listen", "10.0.0.1:80"), {}, uid=1000)
    # A port is ASCII digits: "²" (str.isdigit() says yes) gave int()'s own message, and
    # Arabic-Indic "٩٠" was taken for port 90.
    for port in ("²", "٩٠"):
        with pytest.raises(ConfigError, match="--metrics-listen: must be HOST:PORT with a port"):
            load_settings(_args("--metrics-listen", f"127.0.0.1:{port}"), {}, uid=1000)
        with pytest.raises(ConfigError, match=r"--mcp-listen: .*the port must be a number"):
            load_settings(_args("--mcp-listen", f"127.0.0.1:{port}"), {}, uid=1000)


def test_settings_default_path_and_missing_default_file(tmp_path: Path) -> None:
    """The default file is systemd's, else /etc for root, else XDG; missing means defaults."""
    assert default_config_path({"CONFIGURATION_DIRECTORY": "/etc/toolsetd"}, 1000) == Path(
        "/etc/toolsetd/toolsetd.toml"
    )
    assert default_config_path({}, 0) == Path("/etc/toolsetd/toolsetd.toml")
    assert default_config_path({"XDG_CONFIG_HOME": "/x"}, 1000) == Path("/x/toolsetd/toolsetd.toml")
    assert default_config_path({"HOME": "/home/a"}, 1000) == Path(
        "/home/a/.config/toolsetd/toolsetd.toml"
    )
    # The XDG spec says to ignore a relative XDG_CONFIG_HOME (as XDG_RUNTIME_DIR and
    # XDG_CACHE_HOME are): taken, the file was looked for under the working directory.
    assert default_config_path({"XDG_CONFIG_HOME": "rel", "HOME": "/home/a"}, 1000) == Path(
        "/home/a/.config/toolsetd/toolsetd.toml"
    )
    # No home (HOME relative here; or unset with no passwd entry): no default file, rather
    # than a folder named "~" or "rel" under the working directory.
    assert default_config_path({"HOME": "rel"}, 1000) is None
    s = load_settings(_args(), {"XDG_CONFIG_HOME": str(tmp_path)}, uid=1000)
    assert s.config_path is None and set(s.sources.values()) == {"default"}
    (tmp_path / "toolsetd").mkdir()
    (tmp_path / "toolsetd" / "toolsetd.toml").write_text("max-running = 5\n")
    s = load_settings(_args(), {"XDG_CONFIG_HOME": str(tmp_path)}, uid=1000)
    assert s.max_running == 5


def test_settings_default_file_that_is_there_but_unusable_is_not_missing(
    tmp_path: Path,
) -> None:
    """Only nothing at the default path means no file. A symlink whose target is gone
    (a dotfiles checkout not mounted) was taken for a missing file: every default, the
    operator's [confinement] and limits silently dropped, at start and at reload."""
    folder = tmp_path / "toolsetd"
    folder.mkdir()
    (folder / "toolsetd.toml").symlink_to(tmp_path / "dotfiles" / "toolsetd.toml")
    environ = {"CONFIGURATION_DIRECTORY": str(folder)}  # whoever runs the test
    with pytest.raises(ConfigError, match=r"toolsetd\.toml: cannot be used: No such file"):
        load_settings(_args(), environ, uid=1000)
    (folder / "toolsetd.toml").unlink()
    (folder / "toolsetd.toml").write_text("max-running = 5\n")
    running = load_settings(_args(), environ, uid=1000)
    assert running.max_running == 5
    (folder / "toolsetd.toml").unlink()
    (folder / "toolsetd.toml").symlink_to(tmp_path / "dotfiles" / "toolsetd.toml")
    with pytest.raises(ConfigError, match="cannot be used"):
        reload_settings(running, _args(), environ)
    # A path through a file (ENOTDIR) is as missing as one through nothing.
    through = {"CONFIGURATION_DIRECTORY": str(folder / "toolsetd.toml")}
    assert load_settings(_args(), through, uid=1000).config_path is None


def test_settings_relative_flags_are_the_start_directorys_at_every_reload(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``toolsetd --config t.toml --home ../home`` resolved its relative paths again at each
    reload, against whatever the working directory had become: once it was removed, the
    reload raised FileNotFoundError (os.getcwd), the reload RPC was an internal error, and
    SIGHUP ended the daemon. They are resolved once, at start."""
    start = tmp_path / "start"
    start.mkdir()
    (start / "t.toml").write_text("max-running = 3\n")
    monkeypatch.chdir(start)
    args = parse_command_line(["--config", "t.toml", "--home", "../home", "--socket", "s"], "t")
    running = load_settings(args, {})
    assert running.config_path == start / "t.toml" and running.home == tmp_path / "home"
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (start / "t.toml").rename(elsewhere / "t.toml")
    start.rmdir()  # the daemon's working directory is gone
    (elsewhere / "start").mkdir()
    (elsewhere / "start" / "t.toml").write_text("max-running = 4\n")
    with pytest.raises(ConfigError, match=f"{start}/t.toml: cannot be used: No such file"):
        reload_settings(running, args, {})
    start.mkdir()
    (start / "t.toml").write_text("max-running = 5\n")
    monkeypatch.chdir(elsewhere / "start")  # moved on: the start's paths still count
    outcome = reload_settings(running, args, {})
    assert outcome.settings.max_running == 5 and outcome.restart_needed == ()
    assert outcome.settings.home == tmp_path / "home"


def test_settings_relative_environment_paths_are_the_start_directorys_at_every_reload(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``CRYSTAL_HOME=home TOOLSETD_SOCKET=s.sock toolsetd``: the flags' relative paths are
    resolved once, at start, but the environment's were resolved again at each reload,
    against whatever the working directory had become: moved, every reload said socket and
    home need a restart (nobody had changed them); removed, every reload failed
    ("(from CRYSTAL_HOME) is relative ... gone"), and so did systemctl reload."""
    start = tmp_path / "start"
    start.mkdir()
    config = tmp_path / "t.toml"
    config.write_text("max-running = 3\n")
    monkeypatch.chdir(start)
    args = parse_command_line(["--config", str(config)], "t")
    environ = {"CRYSTAL_HOME": "home", "TOOLSETD_SOCKET": "s.sock"}
    running = load_settings(args, environ)
    assert running.home == start / "home" and running.socket == start / "s.sock"
    config.write_text("max-running = 4\n")
    start.rename(tmp_path / "moved")  # the daemon's working directory moved
    outcome = reload_settings(running, args, environ)
    assert outcome.restart_needed == () and outcome.applied == ("max-running",)
    assert outcome.settings.home == start / "home"
    assert outcome.settings.socket == start / "s.sock"
    (tmp_path / "moved").rmdir()  # and is gone
    config.write_text("max-running = 5\n")
    outcome = reload_settings(outcome.settings, args, environ)
    assert outcome.settings.max_running == 5 and outcome.restart_needed == ()
    assert outcome.settings.sources["home"] == "env CRYSTAL_HOME"


def test_settings_relative_flags_in_a_removed_working_directory_are_a_usage_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Started in a directory already removed, ``toolsetd --home ../home`` ended in a
    FileNotFoundError traceback (os.getcwd, as the flag was made absolute). It is a usage
    error (exit 2) that names the flag; an absolute flag is still fine there."""
    gone = tmp_path / "gone"
    gone.mkdir()
    monkeypatch.chdir(gone)
    gone.rmdir()
    with pytest.raises(SystemExit) as stopped:
        parse_command_line(["--home", "../home"], "t")
    assert stopped.value.code == 2
    assert "toolsetd: error: --home ../home is relative and the working directory was " \
        "removed" in capsys.readouterr().err
    args = parse_command_line(["--home", str(tmp_path / "home")], "t")
    assert args.home == str(tmp_path / "home")


def test_settings_print_format_is_valid_toml_with_sources(tmp_path: Path) -> None:
    """--print-config output parses as TOML giving the same values, each line with its source."""
    path = _write(tmp_path, "max-running = 7\n")
    s = _load(path, "--no-watch")
    text = format_settings(s, {"socket": "/run/x.sock"})
    assert f"# config file: {path}" in text
    assert "max-running = 7" in text and f"# {path}:1" in text
    assert "# flag --no-watch, restart to change" in text
    assert '# socket = "/run/x.sock"' in text
    again = tomllib.loads(text)
    assert again["max-running"] == 7 and again["no-watch"] is True
    assert load_settings(_args("--config", str(_write(tmp_path, text))), {}).max_running == 7


def test_settings_reload_splits_applied_and_restart(tmp_path: Path) -> None:
    """A reload applies the changed limits, keeps restart-only keys, and flags still win."""
    path = _write(tmp_path, 'max-running = 8\nallow-group = "a"\noutput-limit = 10\n')
    args = _args("--config", str(path), "--output-limit", "20")
    running = load_settings(args, {})
    path.write_text('max-running = 9\nallow-group = "b"\noutput-limit = 30\nkill-grace = 2\n')
    outcome = reload_settings(running, args, {})
    assert outcome.applied == ("max-running", "kill-grace")
    assert outcome.restart_needed == ("allow-group",)
    assert outcome.settings.max_running == 9 and outcome.settings.kill_grace == 2.0
    assert outcome.settings.allow_group == "a"  # still the running value
    assert outcome.settings.output_limit == 20  # the flag wins
    path.write_text("max-running = nine\n")
    with pytest.raises(ConfigError, match=r"toolsetd\.toml:1: is not valid TOML"):
        reload_settings(running, args, {})


def _toolsetd(*argv: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "toolsetd.daemon", *argv],
        capture_output=True,
        text=True,
        timeout=30,
        env={**os.environ, **(env or {})},
        check=False,
    )


def test_settings_bad_file_stops_startup(tmp_path: Path) -> None:
    """toolsetd exits 2 before serving, with the file, the line and the key."""
    path = _write(tmp_path, "# limits\nmax-running = -3\n")
    result = _toolsetd("--config", str(path), "--socket", str(tmp_path / "s.sock"))
    assert result.returncode == 2
    assert result.stderr == f"toolsetd: {path}:2: max-running: must be at least 1, got -3\n"
    assert not (tmp_path / "s.sock").exists()


def test_settings_print_config_command(tmp_path: Path) -> None:
    """toolsetd --print-config prints each value and its source, then exits 0."""
    path = _write(tmp_path, 'log-level = "warning"\n')
    result = _toolsetd(
        "--config",
        str(path),
        "--max-running",
        "3",
        "--print-config",
        env={"CRYSTAL_HOME": "/srv/crystal"},
    )
    assert result.returncode == 0, result.stderr
    lines = {line.split(" = ")[0].lstrip("# "): line for line in result.stdout.splitlines()}
    assert lines["log-level"].split("#")[1].strip().startswith(f"{path}:1")
    assert "# flag --max-running" in lines["max-running"]
    assert 'home = "/srv/crystal"' in lines["home"] and "env CRYSTAL_HOME" in lines["home"]
    assert "# default" in lines["output-limit"]


def test_settings_print_format_says_where_it_looked(tmp_path: Path) -> None:
    """Without a file, --print-config names the file it looked for."""
    looked = tmp_path / "toolsetd" / "toolsetd.toml"
    s = load_settings(_args(), {"XDG_CONFIG_HOME": str(tmp_path)}, uid=1000)
    text = format_settings(s, looked_for=looked)
    assert text.splitlines()[0] == f"# config file: none ({looked} does not exist)"


def test_settings_print_format_escapes_control_characters(tmp_path: Path) -> None:
    """A value with a newline, an escape or DEL (a path may hold any of them) is printed as a
    TOML escape: written raw, --print-config was no valid TOML (a newline ended the string,
    or a comment, which the rest of the value then escaped) and put the ESC on the terminal."""
    odd = '/tmp/a\nb\x1b[31m\x7f"\\\tz'
    folder = tmp_path / "a\nb"
    folder.mkdir()
    config = folder / "toolsetd.toml"
    config.write_text("[confinement]\n")  # its path is in the comments
    s = load_settings(_args("--home", odd, "--reserve", "x\ny", "--config", str(config)), {})
    text = format_settings(s, {"socket": odd + "/s.sock"}, looked_for=Path(odd))
    assert "\x1b" not in text and "\x7f" not in text
    parsed = tomllib.loads(text)
    assert parsed["home"] == odd
    assert parsed["reserve"] == ["x\ny"]
    commented = [line for line in text.splitlines() if line.startswith("# socket = ")]
    assert len(commented) == 1
    assert tomllib.loads(commented[0][2:].partition("#")[0])["socket"] == odd + "/s.sock"
    s = load_settings(_args(), {"XDG_CONFIG_HOME": odd}, uid=1000)
    first = format_settings(s, looked_for=Path(odd) / "toolsetd.toml").splitlines()[0]
    assert first.startswith("# config file: none (") and "\n" not in first


def test_settings_file_nested_too_deeply_is_a_config_error(tmp_path: Path) -> None:
    """tomllib parses nested arrays and inline tables by recursion: a value nested some
    thousands deep (a few KiB) raised RecursionError, a traceback at start, an internal
    error for the reload RPC, and the daemon's end on SIGHUP. It is a file that cannot be
    used, like any other TOML error, and a reload keeps the running settings."""
    for value in ("[" * 5000 + "]" * 5000, "{a=" * 3000 + "1" + "}" * 3000):
        path = _write(tmp_path, f"max-running = 2\n\nreserve = {value}\n")
        with pytest.raises(ConfigError, match=r"toolsetd\.toml:3: is not valid TOML: .*deeply"):
            _load(path)
    running = _load(_write(tmp_path, "max-running = 2\n"))
    _write(tmp_path, "reserve = " + "[" * 5000 + "]" * 5000 + "\n")
    with pytest.raises(ConfigError, match="is not valid TOML"):
        reload_settings(running, _args("--config", str(tmp_path / "toolsetd.toml")), {})


def test_settings_file_with_a_byte_order_mark(tmp_path: Path) -> None:
    """A toolsetd.toml saved with a UTF-8 byte order mark is read as the text it holds (as
    config.json is), keys and lines as without one; tomllib alone said "Invalid statement
    (at line 1, column 1)" of a line that looks right in every editor."""
    path = tmp_path / "toolsetd.toml"
    path.write_bytes(b"\xef\xbb\xbfmax-running = 3\nkill-grace = 2\n")
    settings = _load(path)
    assert (settings.max_running, settings.kill_grace) == (3, 2.0)
    assert settings.sources["max-running"] == f"{path}:1"
    path.write_bytes(b"\xef\xbb\xbfmax-running = 0\n")
    with pytest.raises(ConfigError, match=r":1: max-running: must be at least 1, got 0"):
        _load(path)


def test_an_empty_home_is_the_passwd_entrys(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``HOME=`` (set, but empty) is no home: the passwd entry's is the user's, as .NET's
    ``GetFolderPath(UserProfile)`` and the shell find it. Python's ``expanduser`` makes it
    ``/``: the credential paths the sandbox hides and the fence forbids were ``/.ssh`` and
    ``/.gnupg``, not the user's own, and ``~`` in a path argument was ``/``."""
    import pwd

    from toolsetd.daemon.setcache import default_cache_dir

    entry = Path(pwd.getpwuid(os.getuid()).pw_dir)
    monkeypatch.setenv("HOME", "")
    options = options_from_settings(_load(_write(tmp_path, "")))
    assert options.user_home == entry
    assert options.home == entry / ".crystal"
    assert default_config_path({"HOME": ""}, 1000) == entry / ".config" / "toolsetd" / "toolsetd.toml"
    assert default_cache_dir({"HOME": ""}) == entry / ".cache" / "toolsetd"


def test_settings_errors_show_the_files_control_characters_escaped(tmp_path: Path) -> None:
    """``toolsetd --config their.toml --print-config`` (checking a file someone else wrote)
    writes every value with its control characters escaped, so none reaches the terminal
    raw; but an error naming an unknown key, a bad value or a set name printed them as
    they came: an ESC sequence in the file could clear the screen or retitle the window,
    and a newline forge a line of the message. They are escapes now, as in the console log."""
    for text in (
        '"\\u001b[2Jevil" = 1\n',
        'log-level = "\\u001b]0;title\\u0007"\n',
        'home = "relative\\nforged"\n',
        '[confinement.sets."\\u001b[2Jx"]\nprofile = "strict"\n',
    ):
        path = _write(tmp_path, text)
        with pytest.raises(ConfigError) as caught:
            load_settings(_args("--config", str(path)), {})
        message = str(caught.value)
        assert not any(ord(c) < 0x20 or 0x7F <= ord(c) < 0xA0 for c in message), message
        assert "\\x1b" in message or "\\n" in message, message


def test_settings_file_with_an_integer_past_pythons_digit_limit_is_a_config_error(
    tmp_path: Path,
) -> None:
    """tomllib reads an integer with ``int()``, which refuses one of more than 4,300 digits
    with a ValueError, no TOMLDecodeError: as the deep value's RecursionError, it went past
    every handler (a traceback at start, an internal error for the reload RPC, and the
    daemon's end on SIGHUP). It is a file that cannot be used, with its line, and a reload
    keeps the running settings."""
    huge = "1" + "0" * 5000
    path = _write(tmp_path, f"max-running = 2\n\nreserve = [{huge}]\n")
    with pytest.raises(
        ConfigError, match=r"toolsetd\.toml:3: holds an integer of more than 4,300 digits"
    ):
        _load(path)
    running = _load(_write(tmp_path, "max-running = 2\n"))
    _write(tmp_path, f"max-running = {huge}\n")
    with pytest.raises(ConfigError, match="write a shorter number"):
        reload_settings(running, _args("--config", str(tmp_path / "toolsetd.toml")), {})


def test_settings_seconds_past_a_doubles_range_are_judged_as_inf(tmp_path: Path) -> None:
    """A seconds key written as an integer past a double's range (``kill-grace = 1`` and
    400 zeros, under the digit limit) raised OverflowError from ``float()``, no ValueError:
    a traceback at start, an internal error for the reload RPC, and the daemon's end on
    SIGHUP. It is read as ``1e400`` is (TOML's inf): not finite where a bound is needed,
    never where ``inf`` means never, and a negative one is not positive."""
    huge = "1" + "0" * 400
    with pytest.raises(ConfigError, match=r"toolsetd\.toml:2: kill-grace: must be a finite"):
        _load(_write(tmp_path, f"max-running = 2\nkill-grace = {huge}\n"))
    with pytest.raises(ConfigError, match="shutdown-grace: must be a positive number"):
        _load(_write(tmp_path, f"shutdown-grace = -{huge}\n"))
    assert _load(_write(tmp_path, f"workspace-idle = {huge}\n")).workspace_idle == math.inf
    running = _load(_write(tmp_path, "kill-grace = 2\n"))
    _write(tmp_path, f"kill-grace = {huge}\n")
    with pytest.raises(ConfigError, match="must be a finite number of seconds"):
        reload_settings(running, _args("--config", str(tmp_path / "toolsetd.toml")), {})


def test_the_line_of_an_integer_past_the_digit_limit_is_found_in_one_pass(
    tmp_path: Path,
) -> None:
    """The line of the integer tomllib refused was looked for with ``[0-9_]{limit,}``,
    which from each digit of a shorter run went to that run's end again: runs just under
    the limit (in strings, which tomllib reads) cost their length squared, on the event
    loop of a reload (5 s for a 1 MiB file at 4,300 digits; far more where
    ``PYTHONINTMAXSTRDIGITS`` raises the limit, as here). Each run is now read once."""
    old = sys.get_int_max_str_digits()
    limit = 100_000
    sys.set_int_max_str_digits(limit)
    try:
        runs = "".join(f'k{n} = "{"1" * (limit - 1)}"\n' for n in range(9))
        path = _write(tmp_path, f"{runs}max-running = 1{'0' * limit}\n")
        with pytest.raises(ConfigError, match=r"toolsetd\.toml:10: holds an integer of more"):
            _load(path)
    finally:
        sys.set_int_max_str_digits(old)
