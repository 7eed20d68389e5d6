"""The confinement settings: the [confinement] table, per-set resolution, bubblewrap argv."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from dataclasses import replace
from pathlib import Path

import pytest
from structlog.testing import capture_logs
from toolsetd.daemon import sandbox
from toolsetd.daemon.cgroup import Limits, parse_limits
from toolsetd.daemon.confinement import (
    Confinement,
    ConfinementError,
    ExecutableError,
    check_executable,
    parse_confinement,
)
from toolsetd.daemon.model import RunnerKind, Source, ToolSet
from toolsetd.daemon.sandbox import (
    Profile,
    SandboxPlan,
    bind_identities,
    binds_moved,
    bwrap_argv,
    call_binds,
    mount_aliases,
    probe_bind_check,
    probe_ipc,
    probe_status,
    setup_done,
)
from toolsetd.daemon.settings import ConfigError, build_parser, load_settings, reload_settings


def _set(directory: str, source: Source, path: Path | None = None) -> ToolSet:
    return ToolSet(directory=directory, source=source, path=path or Path("/sets") / directory,
                   runner=RunnerKind.EXEC)


def _confinement(table: dict[str, object], bwrap: str | None = "/usr/bin/bwrap",
                 home: Path = Path("/home/u")) -> Confinement:
    return Confinement(parse_confinement(table), None, "no tree here", bwrap,
                       "bwrap not found", home, home / ".crystal", home / "run" / "s.sock")


@pytest.mark.parametrize(
    ("table", "message"),
    [
        ({"sandbox": "on"}, 'confinement.sandbox: must be "auto", "off" or an absolute path'),
        ({"cgroup": "relative/path"}, "confinement.cgroup: must be"),
        ({"profiles": {}}, "confinement.profiles: unknown key"),
        ({"project": {"profile": "strict"}}, "confinement.project.profile: must be one of"),
        ({"home": {"network": "yes"}}, "confinement.home.network: must be true or false"),
        ({"sets": {"lint": {"memory-max": "lots"}}}, "confinement.sets.lint.memory-max: must be"),
        ({"sets": {"lint": {"memory-max": 1000}}}, "memory-max: must be at least 1M"),
        ({"sets": {"lint": {"pids-max": 0}}}, "confinement.sets.lint.pids-max: must be an integer"),
        # Past what the kernel takes: memory.max parsed 99999999999T past 64 bits (a limit
        # it wraps, or refuses), pids.max refuses more than 4194304; the start passed and
        # every call of the set failed, or ran with another limit.
        ({"project": {"memory-max": "99999999999T"}}, "memory-max: must be at most 8388607T"),
        ({"project": {"memory-max": 1 << 63}}, "memory-max: must be at most 8388607T"),
        ({"project": {"pids-max": 4194305}}, "pids-max: must be an integer from 1 to 4194304"),
        ({"sets": {"lint": {"cpu-max": "half"}}}, "confinement.sets.lint.cpu-max: must be a number"),
        ({"sets": {"lint": {"color": 1}}}, "confinement.sets.lint.color: unknown key"),
        ({"hide": "~/.aws"}, "confinement.hide: must be a list of paths"),
        # A table no set can ever match would confine nothing, silently.
        ({"sets": {"lint ": {"profile": "read-only"}}}, "no set directory can be named 'lint '"),
        ({"sets": {"9lint": {}}}, "confinement.sets.9lint: no set directory can be named"),
        ({"sets": {"a" * 65: {}}}, "64 characters at most"),
        ({"hide": ["$HOME/.aws"]}, "confinement.hide: each path must be absolute or start"),
        ({"hide": ["~/.aws", "secrets/key"]}, 'got "secrets/key"'),
        ({"hide": ["~user/.aws"]}, "confinement.hide: each path must be absolute or start"),
    ],
)
def test_confinement_config_errors_name_the_key(table: dict[str, object], message: str) -> None:
    """Every wrong key or value is refused with a message naming it and what it must be."""
    with pytest.raises(ValueError, match=r"^confinement\.") as info:
        parse_confinement(table)
    assert message in str(info.value)


def test_confinement_limits_parse_sizes_and_cpus() -> None:
    """Sizes take K/M/G suffixes; cpu-max is a number of CPUs written as quota and period."""
    limits = parse_limits({"memory-max": "512M", "pids-max": 64, "cpu-max": 0.5}, "sets.x")
    assert limits == Limits(512 << 20, 64, "50000 100000")
    assert parse_limits({"memory-max": "2GiB"}, "x").memory_max == 2 << 30
    assert parse_limits({}, "x").needs() == ()


def test_confinement_table_of_toolsetd_toml(tmp_path: Path) -> None:
    """toolsetd.toml's [confinement] table is read; an error names the file, line and key."""
    good = tmp_path / "good.toml"
    good.write_text('[confinement]\ncgroup = "off"\n[confinement.sets.lint]\npids-max = 9\n')
    settings = load_settings(build_parser("t").parse_args(["--config", str(good)]), {})
    assert settings.confinement.cgroup == "off"
    assert settings.confinement.sets["lint"].limits.pids_max == 9
    assert settings.sources["confinement"] == f"{good}:1"
    bad = tmp_path / "bad.toml"
    bad.write_text('[confinement]\ncgroup = "off"\n\n[confinement.sets.lint]\ncolor = 1\n')
    with pytest.raises(ConfigError) as info:
        load_settings(build_parser("t").parse_args(["--config", str(bad)]), {})
    assert str(info.value).startswith(f"{bad}:5: confinement.sets.lint.color: unknown key")


def test_confinement_change_needs_a_restart(tmp_path: Path) -> None:
    """A reload that finds a new [confinement] keeps the running one and says restart."""
    path = tmp_path / "t.toml"
    path.write_text('[confinement]\ncgroup = "off"\n')
    args = build_parser("t").parse_args(["--config", str(path)])
    running = load_settings(args, {})
    path.write_text('[confinement]\ncgroup = "auto"\n')
    outcome = reload_settings(running, args, {})
    assert outcome.restart_needed == ("confinement",)
    assert outcome.settings.confinement.cgroup == "off"


def test_confinement_defaults_project_sandboxed_home_not() -> None:
    """Defaults: workspace-write without network for project sets, off with network for home."""
    c = _confinement({})
    project = c.for_set(_set("lint", Source.PROJECT))
    assert (project.profile, project.network, project.failure) == (
        Profile.WORKSPACE_WRITE, False, None)
    home = c.for_set(_set("lint", Source.HOME))
    assert (home.profile, home.network) == (Profile.OFF, True)


def test_confinement_set_wins_over_source() -> None:
    """For a home set, a sets.<directory> table overrides its source's table, key by key."""
    c = _confinement({
        "home": {"profile": "read-only", "network": False},
        "sets": {"web": {"network": True}, "lint": {"profile": "off"}},
    })
    web = c.for_set(_set("web", Source.HOME))
    assert (web.profile, web.network) == (Profile.READ_ONLY, True)
    lint = c.for_set(_set("lint", Source.HOME))
    assert lint.profile == Profile.OFF
    assert lint.network is False  # the source said so; profile off does not reopen it


@pytest.mark.parametrize(
    ("project", "by_set", "expected"),
    [
        # Loosening the operator's set must not loosen anyone's project set of its name.
        ({}, {"profile": "off"}, (Profile.WORKSPACE_WRITE, False)),
        ({}, {"network": True}, (Profile.WORKSPACE_WRITE, False)),
        ({}, {"profile": "off", "network": True}, (Profile.WORKSPACE_WRITE, False)),
        ({"profile": "read-only"}, {"profile": "workspace-write"}, (Profile.READ_ONLY, False)),
        # Confining more does apply.
        ({}, {"profile": "read-only"}, (Profile.READ_ONLY, False)),
        ({"network": True}, {"network": False}, (Profile.WORKSPACE_WRITE, False)),
        # What the project table already allows, the set table may say again.
        ({"network": True}, {"network": True}, (Profile.WORKSPACE_WRITE, True)),
        ({"profile": "off"}, {"profile": "off"}, (Profile.OFF, True)),
        # A sandbox with the network confines more than no sandbox (which has it).
        ({"profile": "off"}, {"profile": "workspace-write", "network": True},
         (Profile.WORKSPACE_WRITE, True)),
    ],
)
def test_confinement_set_table_never_loosens_a_project_set(
    project: dict[str, object], by_set: dict[str, object], expected: tuple[Profile, bool]
) -> None:
    """A project set of a name the operator relaxed for a home set is anyone's (a cloned
    repository, a sandboxed call writing the workspace): the table may confine it more
    than the project's settings, never less. The home set still gets what it says."""
    c = _confinement({"project": project, "sets": {"lint": by_set}})
    got = c.for_set(_set("lint", Source.PROJECT))
    assert (got.profile, got.network) == expected
    home = c.for_set(_set("lint", Source.HOME))
    if "profile" in by_set:
        assert home.profile == Profile(str(by_set["profile"]))
    if "network" in by_set:
        assert home.network is by_set["network"]


@pytest.mark.parametrize(
    ("project", "by_set", "expected"),
    [
        # A table that tightens one limit of the home set lifts none of the project's.
        ({"memory-max": "2G", "pids-max": 64}, {"cpu-max": 0.5},
         Limits(2 << 30, 64, "50000 100000")),
        # A higher limit is left out for the project set; a lower one counts.
        ({"memory-max": "2G", "cpu-max": 1}, {"memory-max": "64G", "cpu-max": 4},
         Limits(2 << 30, None, "100000 100000")),
        ({"pids-max": 64}, {"pids-max": 16}, Limits(None, 16, None)),
        # What the project's table leaves out, the set's table sets as written.
        ({}, {"memory-max": "1G"}, Limits(1 << 30, None, None)),
    ],
)
def test_confinement_set_table_never_lifts_a_project_sets_limits(
    project: dict[str, object], by_set: dict[str, object], expected: Limits
) -> None:
    """A sets.<directory> table's limits replaced all of the project's for a project set of
    that name: [confinement.sets.lint] cpu-max = 0.5, meant to tighten the home 'lint',
    let a repository's 'lint' run without the project's memory-max and pids-max."""
    c = _confinement({"project": project, "sets": {"lint": by_set}})
    assert c.for_set(_set("lint", Source.PROJECT)).limits == expected
    # The home set gets its table as written.
    assert c.for_set(_set("lint", Source.HOME)).limits == parse_limits(by_set, "sets.lint")


def test_confinement_without_bwrap_default_off_named_fails_closed() -> None:
    """No bubblewrap: a default profile becomes off; a profile the operator named fails closed."""
    c = _confinement({"sets": {"lint": {"profile": "workspace-write"}}}, bwrap=None)
    assert c.for_set(_set("other", Source.PROJECT)).profile == Profile.OFF
    named = c.for_set(_set("lint", Source.PROJECT))
    assert named.failure is not None
    assert "bwrap not found" in named.failure
    with pytest.raises(ConfinementError, match="did not run"):
        c.prepare(_set("lint", Source.PROJECT), ["/bin/true"], "/ws", ("/d", "/ws/d"), ())


def test_confinement_limits_without_cgroups_fail_closed() -> None:
    """A limit with no cgroup tree cannot be enforced: the set's calls fail closed."""
    c = _confinement({"home": {"pids-max": 10}})
    failure = c.for_set(_set("x", Source.HOME)).failure
    assert failure is not None
    assert "no tree here" in failure


def test_confinement_describe_for_classify() -> None:
    """describe gives the profile, network, approved writable paths, limits and failure."""
    c = _confinement({"project": {"memory-max": "1G"}})
    wire = c.describe(_set("lint", Source.PROJECT), ["/elsewhere/file"])
    assert wire["sandbox"] == {"profile": "workspace-write", "network": False,
                               "alsoWritable": ["/elsewhere/file"]}
    assert wire["limits"] == {"memoryMax": 1 << 30}
    assert wire["cgroup"] is False
    assert wire["failure"] is not None  # the memory limit has no cgroup tree here


def test_confinement_bwrap_argv_binds_in_order(tmp_path: Path) -> None:
    """Root read-only, private /tmp, set folder, writable binds, the sandbox's own /proc
    and /sys read-only again (over any writable bind there), then the hidden paths."""
    ws = tmp_path / "ws"
    ws.mkdir()
    ssh = tmp_path / ".ssh"
    ssh.mkdir()
    cred = tmp_path / "credentials.json"
    cred.write_text("{}")
    plan = SandboxPlan(Profile.WORKSPACE_WRITE, False, (str(tmp_path),), (str(ws), "/missing"),
                       (str(ssh), str(cred), "/not/there"), str(ws))
    argv = bwrap_argv("/usr/bin/bwrap", plan)
    assert argv[:7] == ["/usr/bin/bwrap", "--die-with-parent", "--unshare-pid", "--cap-drop",
                        "ALL", "--unshare-ipc", "--unshare-net"]
    text = " ".join(argv)
    assert "--ro-bind / / --dev /dev --tmpfs /tmp" in text
    assert text.index(f"--ro-bind {tmp_path} {tmp_path}") < text.index(f"--bind {ws} {ws}")
    assert text.index(f"--bind {ws} {ws}") < text.index("--proc /proc --ro-bind-try /proc/sys")
    assert text.index(f"--bind {ws} {ws}") < text.index("--ro-bind-try /sys /sys")
    assert text.index("--proc /proc") < text.index(f"--tmpfs {ssh} --remount-ro {ssh}")
    assert f"--ro-bind /dev/null {cred}" in text
    assert "/missing" not in text
    assert "/not/there" not in text
    assert argv[-3:] == ["--chdir", str(ws), "--"]
    open_net = bwrap_argv("/b", SandboxPlan(Profile.READ_ONLY, True, (), (), (), "/"))
    assert "--unshare-net" not in open_net


def test_confinement_hidden_link_to_a_folder_is_hidden_where_it_leads() -> None:
    """``~/.ssh`` as a link to a folder elsewhere (a dotfile manager's) made bubblewrap fail
    every sandboxed call (/dev/null cannot be bound over a folder); now the call runs and
    the key is unreadable through the link and through the folder it leads to."""
    bwrap = shutil.which("bwrap")
    if bwrap is None:
        pytest.skip("bubblewrap is not installed")
    with tempfile.TemporaryDirectory(dir="/var/tmp") as base:  # not the sandbox's private /tmp
        _hidden_link_to_a_folder(bwrap, Path(base))


def _hidden_link_to_a_folder(bwrap: str, tmp_path: Path) -> None:
    keys, home = tmp_path / "keys", tmp_path / "home"
    keys.mkdir()
    home.mkdir()
    (keys / "id_rsa").write_text("PRIVATE KEY\n")
    (home / ".ssh").symlink_to(keys)
    plan = SandboxPlan(Profile.WORKSPACE_WRITE, False, (), (), (str(home / ".ssh"),), "/")
    script = f"cat {home}/.ssh/id_rsa {keys}/id_rsa; ls {keys}; echo ran"
    done = subprocess.run(
        [*bwrap_argv(bwrap, plan), "/bin/sh", "-c", script], capture_output=True, text=True,
        timeout=30, check=False,
    )
    assert done.stdout == "ran\n", (done.stdout, done.stderr)
    assert "PRIVATE" not in done.stderr


def test_confinement_hidden_path_a_call_could_uncover_is_refused(tmp_path: Path) -> None:
    """A hidden path two or more folders below a path the call may write was uncovered for
    the next call: the call renamed the folder between (a mount point cannot be renamed, a
    folder holding one can) and made an empty one in its place; the next call, approved or
    not, read the file the operator hid. Such a call now does not run; one level below, the
    hidden path stays a mount point the tool cannot move, and the call runs."""
    home = tmp_path / "home"
    ws, config = home / "ws", home / ".config"
    (config / "gh").mkdir(parents=True)
    (config / "gh" / "hosts.yml").write_text("TOKEN\n")
    (ws / "conf" / "ssh").mkdir(parents=True)
    (home / ".aws").mkdir()
    c = Confinement(
        parse_confinement({"hide": ["~/.config/gh/hosts.yml", "~/.aws"]}), None, "off",
        "/usr/bin/bwrap", "", home, home / ".crystal",
    )  # fmt: skip
    project = _set("lint", Source.PROJECT, ws / ".crystal" / "tools" / "lint")
    data = (str(home / "data"), str(ws / ".crystal" / "data"))

    def prepare(approved: tuple[str, ...] = ()) -> None:
        prepared = c.prepare(project, ["/bin/true"], str(ws), data, approved)
        for fd in prepared.status or ():
            os.close(fd)

    prepare()  # nothing hidden below the workspace
    prepare((str(home / ".aws"),))  # the hidden path itself: a mount point, it cannot move
    with pytest.raises(ConfinementError, match=r"hosts\.yml lies two or more folders below"):
        prepare((str(config),))  # ~/.config/gh could be renamed
    # ~/.ssh kept in the workspace by a dotfile manager, hidden where it leads.
    (home / ".ssh").symlink_to(ws / "conf" / "ssh")
    with pytest.raises(ConfinementError, match=r"\.ssh lies two or more folders below"):
        prepare()
    (home / ".ssh").unlink()
    (home / ".ssh").symlink_to(ws / "conf")  # one level below: the link's target cannot move
    prepare()


def _bwrap_refusing(tmp_path: Path, option: str, message: str) -> tuple[str, Path]:
    """The real bubblewrap, and a wrapper of it that fails as bubblewrap does on ``option``
    (an older release, or a system that does not allow what it asks for)."""
    bwrap = shutil.which("bwrap")
    if bwrap is None:
        pytest.skip("bubblewrap is not installed")
    fake = tmp_path / "bwrap-refusing"
    fake.write_text(
        f"#!/bin/sh\nfor a in \"$@\"; do [ \"$a\" = {option} ] && "
        f"{{ echo 'bwrap: {message}' >&2; exit 1; }}; done\n"
        f'exec {bwrap} "$@"\n'
    )
    fake.chmod(0o755)
    return bwrap, fake


def test_confinement_ipc_namespace_where_allowed(tmp_path: Path) -> None:
    """Sandboxed calls get their own IPC namespace; a system that refuses one (a unit whose
    RestrictNamespaces= has no ``ipc``) keeps the sandbox without it instead of losing it."""
    bwrap, fake = _bwrap_refusing(tmp_path, "--unshare-ipc", "Operation not permitted")
    assert probe_ipc(bwrap) is True
    assert probe_ipc(str(fake)) is False
    home = tmp_path / "home"
    conf = Confinement.probe(parse_confinement({"cgroup": "off", "sandbox": str(fake)}),
                             home, home / ".crystal")
    assert conf.bwrap == str(fake)  # the sandbox stays
    assert conf.own_ipc is False
    plan = SandboxPlan(Profile.READ_ONLY, False, (), (), (), "/", own_ipc=False)
    assert "--unshare-ipc" not in bwrap_argv(str(fake), plan)
    assert "--unshare-ipc" in bwrap_argv(bwrap, replace(plan, own_ipc=True))


def test_confinement_older_bubblewrap_without_json_status_keeps_the_sandbox(
    tmp_path: Path,
) -> None:
    """A bubblewrap that does not know --json-status-fd (before 0.5) still sandboxes: the
    start probe does not need it, and calls are spawned without it."""
    bwrap, fake = _bwrap_refusing(
        tmp_path, "--json-status-fd", "Unknown option --json-status-fd"
    )
    assert probe_status(bwrap) is True
    assert probe_status(str(fake)) is False
    home = tmp_path / "home"
    conf = Confinement.probe(parse_confinement({"cgroup": "off", "sandbox": str(fake)}),
                             home, home / ".crystal")
    assert conf.bwrap == str(fake)
    assert conf.status_fd is False
    toolset = _set("s", Source.PROJECT, tmp_path / "ws" / ".crystal" / "tools" / "s")
    (tmp_path / "ws").mkdir()
    prepared = conf.prepare(toolset, ["/bin/true"], str(tmp_path / "ws"),
                            (str(home / "data"), str(tmp_path / "ws" / ".crystal" / "d")), ())
    assert prepared.sandboxed
    assert prepared.status is None
    assert "--json-status-fd" not in prepared.argv


def test_confinement_bubblewrap_that_cannot_be_held_runs_calls_unchecked(
    tmp_path: Path,
) -> None:
    """Where the daemon cannot hold a sandbox and look into it (a setuid bubblewrap hides
    its /proc; here one that ignores --block-fd), calls keep the sandbox without the bind
    check, and the start says so, instead of every sandboxed call being refused."""
    bwrap = shutil.which("bwrap")
    if bwrap is None:
        pytest.skip("bubblewrap is not installed")
    fake = tmp_path / "bwrap-unheld"
    fake.write_text(
        '#!/bin/sh\nskip=0\nfor a in "$@"; do shift\n'
        "  if [ $skip = 1 ]; then skip=0; continue; fi\n"
        '  if [ "$a" = --block-fd ]; then skip=1; continue; fi\n'
        '  set -- "$@" "$a"\ndone\n'
        f'exec {bwrap} "$@"\n'
    )
    fake.chmod(0o755)
    assert probe_bind_check(bwrap) is None
    assert "without waiting on --block-fd" in (probe_bind_check(str(fake)) or "")
    home = tmp_path / "home"
    (tmp_path / "ws").mkdir()
    toolset = _set("s", Source.PROJECT, tmp_path / "ws" / ".crystal" / "tools" / "s")
    data = (str(home / "data"), str(tmp_path / "ws" / ".crystal" / "d"))
    for binary, checked in ((bwrap, True), (str(fake), False)):
        with capture_logs() as logs:
            conf = Confinement.probe(
                parse_confinement({"cgroup": "off", "sandbox": binary}), home, home / ".crystal"
            )
        assert conf.status_fd is True
        assert conf.bind_check is checked
        unchecked = [e for e in logs if e["event"] == "sandbox_without_bind_check"]
        assert bool(unchecked) is not checked
        prepared = conf.prepare(toolset, ["/bin/true"], str(tmp_path / "ws"), data, ())
        assert prepared.sandboxed
        assert (prepared.block is not None) is checked
        assert ("--block-fd" in prepared.argv) is checked
        for fd in (*(prepared.status or ()), *(prepared.block or ())):
            os.close(fd)


@pytest.mark.parametrize(
    "option", ["--unshare-net", "--unshare-ipc", "--block-fd", "--json-status-fd",
               "--disable-userns"],
)
@pytest.mark.parametrize(
    "message", ["Creating new namespace failed: Resource temporarily unavailable",
                "Creating new namespace failed: Cannot allocate memory", "Out of memory"],
)
def test_confinement_probe_short_of_tasks_or_memory_is_deferred_not_off(
    tmp_path: Path, option: str, message: str
) -> None:
    """A probe of bubblewrap (or of any option it is given) that fails for want of tasks
    or memory says nothing about bubblewrap here: the sandbox is deferred, not off (nor
    without its IPC namespace, its bind check or --disable-userns), and the sets whose
    profile is sandboxed fail closed meanwhile; a home set's default stays off."""
    _, fake = _bwrap_refusing(tmp_path, option, message)
    home = tmp_path / "home"
    with capture_logs() as logs:
        conf = Confinement.probe(
            parse_confinement({"cgroup": "off", "sandbox": str(fake),
                               "sets": {"lint": {"profile": "read-only"}}}),
            home, home / ".crystal", http_peers=True,
        )
    assert conf.bwrap is None and conf.sandbox_short is True
    assert message in conf.sandbox_reason and "tried again" in conf.sandbox_reason
    assert [e["event"] for e in logs if e["event"].startswith("sandbox_")] == [
        "sandbox_probe_deferred"
    ]
    project = conf.for_set(_set("p", Source.PROJECT))
    assert (project.profile, project.network) == (Profile.WORKSPACE_WRITE, False)
    assert project.failure is not None and "cannot be set up yet" in project.failure
    named = conf.for_set(_set("lint", Source.HOME))
    assert named.profile == Profile.READ_ONLY and named.failure is not None
    assert conf.for_set(_set("h", Source.HOME)) == conf.for_set(_set("h", Source.HOME))
    assert conf.for_set(_set("h", Source.HOME)).profile == Profile.OFF
    assert conf.for_set(_set("h", Source.HOME)).failure is None
    with pytest.raises(ConfinementError, match="did not run"):
        conf.prepare(_set("p", Source.PROJECT), ["/bin/true"], "/ws", ("/d", "/ws/d"), ())


@pytest.mark.parametrize("option", ["--unshare-net", "--unshare-ipc", "--block-fd"])
def test_confinement_probe_that_does_not_end_in_time_is_deferred_not_off(
    tmp_path: Path, option: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A probe that did not end within its time limit (a machine swapping or its CPUs taken
    at start) says nothing about bubblewrap either: it turned the sandbox off for the
    daemon's life (the first probe), or left it without its IPC namespace or its bind check.
    It is deferred, as a probe short of tasks is."""
    bwrap = shutil.which("bwrap")
    if bwrap is None:
        pytest.skip("bubblewrap is not installed")
    monkeypatch.setattr(sandbox, "_PROBE_SECONDS", 0.5)
    fake = tmp_path / "bwrap-slow"
    fake.write_text(
        f'#!/bin/sh\nfor a in "$@"; do [ "$a" = {option} ] && exec sleep 30; done\n'
        f'exec {bwrap} "$@"\n'
    )
    fake.chmod(0o755)
    home = tmp_path / "home"
    conf = Confinement.probe(parse_confinement({"cgroup": "off", "sandbox": str(fake)}),
                             home, home / ".crystal")
    assert conf.bwrap is None and conf.sandbox_short is True
    assert "did not finish within 0.5 s" in conf.sandbox_reason
    assert conf.for_set(_set("p", Source.PROJECT)).failure is not None


@pytest.mark.anyio
async def test_confinement_deferred_probe_is_tried_again_then_confines(tmp_path: Path) -> None:
    """A deferred probe runs again at most every RETRY_SECONDS; once bubblewrap runs, the
    sets are confined as at start and ``generation`` says ``status`` changed."""
    bwrap = shutil.which("bwrap")
    if bwrap is None:
        pytest.skip("bubblewrap is not installed")
    flag, runs = tmp_path / "short", tmp_path / "runs"
    flag.touch()
    fake = tmp_path / "bwrap-short"
    fake.write_text(
        f"#!/bin/sh\necho run >> {runs}\n"
        f"[ -e {flag} ] && {{ echo 'bwrap: Creating new namespace failed: Resource "
        "temporarily unavailable' >&2; exit 1; }\n"
        f'exec {bwrap} "$@"\n'
    )
    fake.chmod(0o755)
    home = tmp_path / "home"
    conf = Confinement.probe(parse_confinement({"cgroup": "off", "sandbox": str(fake)}),
                             home, home / ".crystal")
    assert conf.sandbox_short and conf.for_set(_set("p", Source.PROJECT)).failure is not None
    await conf.retry_probes()  # the first try at once: still short
    tried = runs.read_text().count("run")
    flag.unlink()
    await conf.retry_probes()  # within RETRY_SECONDS of the last: not tried
    assert runs.read_text().count("run") == tried
    assert conf.sandbox_short and conf.generation == 0
    conf._next_probe = 0.0  # as RETRY_SECONDS later
    with capture_logs() as logs:
        await conf.retry_probes()
    assert conf.bwrap == str(fake) and not conf.sandbox_short and conf.generation == 1
    assert conf.own_ipc and conf.status_fd and conf.bind_check
    assert [e["event"] for e in logs] == ["sandbox_recovered"]
    project = conf.for_set(_set("p", Source.PROJECT))
    assert (project.profile, project.network, project.failure) == (
        Profile.WORKSPACE_WRITE, False, None,
    )
    assert conf.status()["sandbox"] == {"mechanism": "bubblewrap", "binary": str(fake)}


def test_confinement_data_binds_never_follow_a_link_out(tmp_path: Path) -> None:
    """Data folders in the workspace ride on its bind; one linked out of it is refused."""
    ws, home = tmp_path / "ws", tmp_path / "home"
    project = ws / ".crystal" / "data" / "tools" / "s"
    project.mkdir(parents=True)
    (home / "data" / "tools" / "s").mkdir(parents=True)
    tool = home / "data" / "tools" / "s"
    own = ws / ".crystal" / "tools" / "s"

    def data_binds(tool_data: Path) -> tuple[tuple[str, ...], str]:
        _, writable, escaped = call_binds(str(ws), str(own), str(tool_data), str(project))
        return writable, escaped

    assert data_binds(tool) == ((str(ws), str(tool)), "")
    # An operator's link for the tool data folder is bound by where it leads.
    elsewhere = tmp_path / "disk" / "s"
    elsewhere.mkdir(parents=True)
    tool.rmdir()
    tool.symlink_to(elsewhere)
    assert data_binds(tool) == ((str(ws), str(elsewhere)), "")
    # A tool data folder that resolves into the workspace needs no bind of its own.
    inside = ws / "td"
    assert data_binds(inside) == ((str(ws),), "")
    # A project data folder linked out of the workspace (relative link): refused.
    project.rmdir()
    project.symlink_to(os.path.relpath(home, project.parent))
    assert data_binds(tool) == ((), str(home))
    # ... and one linked to a sibling folder whose name starts like the workspace's.
    (tmp_path / "ws2").mkdir()
    project.unlink()
    project.symlink_to(tmp_path / "ws2")
    assert data_binds(tool) == ((), str(tmp_path / "ws2"))


def test_confinement_set_binds_never_bind_a_path_spelled_in_the_workspace(
    tmp_path: Path,
) -> None:
    """A set folder in the workspace is never bound, even while it is a link out of it:
    another sandboxed call can flip it to a link to the host's /tmp as bwrap mounts."""
    ws = tmp_path / "ws"
    project = ws / ".crystal" / "data" / "tools" / "pp"
    project.mkdir(parents=True)
    tool = str(tmp_path / "home" / "data" / "tools" / "pp")

    def set_binds(folder: Path) -> tuple[str, ...]:
        return call_binds(str(ws), str(folder), tool, str(project))[0]

    own = ws / ".crystal" / "tools" / "pp"
    own.parent.mkdir(parents=True)
    own.symlink_to(os.path.relpath("/tmp", own.parent))  # the flip, caught mid-way
    assert set_binds(own) == ()
    home_set = tmp_path / "home" / "tools" / "hs"
    home_set.mkdir(parents=True)
    linked = tmp_path / "linked"
    linked.symlink_to(home_set)
    # Outside the workspace: bound where it resolves.
    assert set_binds(home_set) == (str(home_set),)
    assert set_binds(linked) == (str(home_set),)
    # A path outside that resolves into the workspace rides on its bind.
    (tmp_path / "into").symlink_to(ws)
    assert set_binds(tmp_path / "into") == ()


def test_confinement_check_executable(tmp_path: Path) -> None:
    """A missing or non-executable tool is refused before any process starts."""
    script = tmp_path / "tool"
    script.write_text("#!/bin/sh\n")
    with pytest.raises(ExecutableError, match="Permission denied"):
        check_executable(str(script), None)
    script.chmod(0o755)
    check_executable(str(script), None)
    with pytest.raises(ExecutableError, match="No such file"):
        check_executable(str(tmp_path / "absent"), None)
    with pytest.raises(ExecutableError, match="No such file"):
        check_executable("no-such-tool-anywhere", str(tmp_path))
    with pytest.raises(ExecutableError, match="Permission denied"):
        check_executable(str(tmp_path), None)


def test_confinement_check_executable_of_a_name_on_path_that_cannot_run(tmp_path: Path) -> None:
    """A bare name whose only file on PATH is not executable was refused as "No such file
    or directory: ... neither a file in ... nor found on PATH" (the spawn itself says
    "Permission denied"): it names the file found and its fix."""
    found = tmp_path / "toolsetd-on-path-tool"
    found.write_text("#!/bin/sh\n")
    with pytest.raises(ExecutableError) as refused:
        check_executable(found.name, f"{tmp_path}:/usr/bin:/bin", tmp_path / "set")
    assert str(refused.value) == (
        f"Permission denied: {found.name}. Command file {found} is not executable: run "
        f"chmod +x {found}."
    )


def test_confinement_hidden_link_a_call_could_remove_is_refused() -> None:
    """A hidden path that is a link is hidden where it leads, so the link is no mount point:
    with ``$HOME`` as the workspace and ``~/.ssh`` a dotfile manager's link, one call removed
    the link and the next call read the key where it led. Such a call now does not run."""
    bwrap = shutil.which("bwrap")
    if bwrap is None:
        pytest.skip("bubblewrap is not installed")
    with tempfile.TemporaryDirectory(dir="/var/tmp") as base:  # not the sandbox's private /tmp
        tmp = Path(base)
        home, keys, crystal = tmp / "home", tmp / "dotfiles" / "ssh", tmp / "crystal"
        keys.mkdir(parents=True)
        home.mkdir()
        (keys / "id_rsa").write_text("PRIVATE KEY\n")
        (home / ".ssh").symlink_to(keys)
        c = Confinement(parse_confinement({}), None, "off", bwrap, "", home, crystal,
                        status=False)
        project = _set("lint", Source.PROJECT, home / ".crystal" / "tools" / "lint")
        data = (str(crystal / "data"), str(home / ".crystal" / "data"))
        with pytest.raises(ConfinementError, match=r"\.ssh is a symbolic link below"):  # noqa: PT012 - prepared, the call runs
            prepared = c.prepare(project, ["/bin/rm", str(home / ".ssh")], str(home), data, ())
            subprocess.run(prepared.argv, capture_output=True, timeout=30, check=False)
        assert (home / ".ssh").is_symlink()
        # The same home reached through a link: the workspace is where it leads.
        (tmp / "users").mkdir()
        (tmp / "users" / "u").symlink_to(home)
        c = Confinement(parse_confinement({}), None, "off", bwrap, "", tmp / "users" / "u",
                        crystal, status=False)
        with pytest.raises(ConfinementError, match=r"\.ssh is a symbolic link below"):
            c.prepare(project, ["/bin/true"], str(home), data, ())


@pytest.mark.parametrize(
    ("table", "tree", "no_userns", "refused"),
    [
        # Sandboxed calls that keep the network run: a peer the kernel cannot name is refused.
        ({"project": {"network": True}}, True, True, True),
        ({"sets": {"web": {"profile": "read-only", "network": True}}}, True, True, True),
        # A network = true that no sandboxed call ends up with.
        ({"sets": {"web": {"profile": "off", "network": True}}}, True, True, False),
        ({"home": {"network": True}}, True, True, False),  # home sets: profile off
        ({"sets": {"web": {"network": True}}}, True, True, False),  # home off; project denies
        ({"project": {"network": True}}, False, True, False),  # no tree: such calls fail
        ({"project": {"network": True}}, True, False, False),  # no --disable-userns: fail
    ],
)
def test_unknown_mcp_peer_is_refused_only_where_a_sandboxed_call_keeps_the_network(
    table: dict[str, object], tree: bool, no_userns: bool, refused: bool
) -> None:
    """An unknown MCP HTTP peer (no cgroup: it closed first, or the /proc fallback, or a
    kernel before 5.7, where every peer is) is refused where a sandboxed call may keep the
    network, as ``_resolve`` decides, not wherever a table says ``network = true``: that
    refused every client of a daemon whose sandboxed calls cannot have the network."""
    from typing import cast

    from toolsetd.daemon.cgroup import CgroupTree

    home = Path("/home/u")
    c = Confinement(
        parse_confinement(table), cast(CgroupTree, object()) if tree else None, "no tree",
        "/usr/bin/bwrap", "", home, home / ".crystal", http_peers=True, no_userns=no_userns,
    )  # fmt: skip
    assert (c.sandboxed_peer(None) is not None) == refused


def test_confinement_mount_aliases_of_hidden_paths(tmp_path: Path) -> None:
    """Every other mount of a hidden path's file system that shows it, or a part of it, is
    found from mountinfo (escaped names too); a place where something else is seen is not."""
    home = tmp_path / "the home"
    (home / ".ssh" / "keys").mkdir(parents=True)
    # Stand-ins for the other mounts: links, so the place leads to the very folder.
    (tmp_path / "alias").symlink_to(home)
    (tmp_path / "keys").symlink_to(home / ".ssh" / "keys")
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "elsewhere" / ".ssh").mkdir()  # not the same folder: not hidden
    (tmp_path / "other fs").mkdir()

    def line(n: int, device: str, root: str, point: str) -> str:
        escaped = [x.replace(" ", "\\040") for x in (root, point)]
        return f"{n} 1 {device} {escaped[0]} {escaped[1]} rw - ext4 /dev/x rw"

    mountinfo = "\n".join([
        line(1, "8:1", "/", "/"),
        line(2, "8:1", str(home), str(tmp_path / "alias")),
        line(3, "8:1", str(home / ".ssh" / "keys"), str(tmp_path / "keys")),
        line(4, "8:1", str(home), str(tmp_path / "elsewhere")),
        line(5, "9:9", str(home), str(tmp_path / "other fs")),
    ])
    ssh = str(home / ".ssh")
    assert mount_aliases([ssh, "/not/there"], mountinfo) == [
        str(tmp_path / "alias" / ".ssh"), str(tmp_path / "keys"),
    ]
    assert mount_aliases([ssh], "") == []


@pytest.mark.parametrize("writable", [True, False])
def test_confinement_built_sandbox_shows_a_bind_swapped_for_a_link(
    tmp_path: Path, writable: bool
) -> None:
    """A bound path that is a link to another folder when bubblewrap mounts it (a call of a
    workspace around it swapped it after the daemon's checks) is found in the built
    sandbox, before the tool runs; the same path left alone is not."""
    bwrap = shutil.which("bwrap")
    if bwrap is None:
        pytest.skip("bubblewrap is not installed")
    base = Path(os.path.realpath(tmp_path))
    inner, victim = base / "inner", base / "victim"
    inner.mkdir()
    victim.mkdir()
    checked = bind_identities([(str(inner), writable)])
    assert checked == ((str(inner), *_identity(inner), writable),)

    def built(swapped: bool) -> str | None:
        if swapped:
            inner.rename(base / "aside")
            inner.symlink_to("victim")
        block_r, block_w = os.pipe()
        status_r, status_w = os.pipe()
        binds = ((str(inner),), ()) if not writable else ((), (str(inner),))
        plan = SandboxPlan(Profile.WORKSPACE_WRITE, False, *binds, (), "/")
        argv = [*bwrap_argv(bwrap, plan, status_w, block_r), "/bin/true"]
        child = subprocess.Popen(argv, pass_fds=(block_r, status_w))
        os.close(block_r)
        os.close(status_w)
        try:
            status = b""
            while b"}" not in status:
                status += os.read(status_r, 4096)
            pid = int(status.split(b'"child-pid":')[1].split(b",")[0].split(b"}")[0])
            while not setup_done(pid, block_r):
                assert child.poll() is None, "bubblewrap ended before it built the sandbox"
            return binds_moved(pid, checked)
        finally:
            os.write(block_w, b"x")
            os.close(block_w)
            os.close(status_r)
            child.wait(timeout=60)
            if swapped:
                inner.unlink()
                (base / "aside").rename(inner)

    assert built(swapped=False) is None
    assert built(swapped=True) == str(inner)


def _identity(path: Path) -> tuple[int, int]:
    seen = path.stat()
    return seen.st_dev, seen.st_ino
