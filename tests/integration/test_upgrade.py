"""toolsetd upgraded in place under a running daemon (``daemon/install.py``).

Each daemon here runs from a venv of its own holding a copy of the package (and of some
distributions), which the test then changes, as ``pip install -U``, a ``git pull`` in an
editable checkout or a distro package would, or removes, as when the venv goes: what the
daemon (or a ``toolsetctl mcp``) starts or imports from disk later (the check process,
the MCP face's modules, jsonschema, prometheus_client, the pump's last words) is then
other code, or none.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import py_compile
import shutil
import signal
import socket
import subprocess
import sys
import venv
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import pytest

from .conftest import REPO, Daemon, eventually, shut_down, start_daemon, write_set

#: A tool whose string may hold 10 characters: 70,000 of them are checked in the check
#: process (``validation.off_loop``), 11 on the loop.
_SHORT = {
    "runner": "exec",
    "command": ["/bin/true"],
    "tools": [
        {
            "name": "short",
            "description": "Takes a short string.",
            "schema": {"type": "object", "properties": {"s": {"type": "string", "maxLength": 10}}},
        }
    ],
}
_REFUSED = "Invalid arguments for 'short': /s: expected at most 10 characters, got 70000"
_UPGRADED = "toolsetd was upgraded (or removed) under this daemon: restart it"


#: The distributions the jsonschema test installs into the daemon's venv (import name,
#: distribution name), beside the copy of the package: jsonschema and what it imports.
_JSONSCHEMA = {
    "jsonschema": "jsonschema", "jsonschema_specifications": "jsonschema_specifications",
    "referencing": "referencing", "rpds": "rpds_py", "attr": "attrs", "attrs": "attrs",
}


def _daemon_from_a_venv(
    base: Path,
    distributions: dict[str, str] | None = None,
    warm: bool = False,
    compiled: bool = False,
    args: Sequence[str] = (),
    python_flags: Sequence[str] = (),
    env: dict[str, str] | None = None,
    hook: str = "",
) -> tuple[Daemon, Path]:
    """A daemon run from a venv of its own holding a copy of the package (and of
    ``distributions``), and that copy's ``toolsetd`` folder. The venv finds the other
    distributions in this one's site-packages (a ``.pth`` line, which does not load this
    one's editable install). ``warm``: started once before, so that its set cache is warm
    (the daemon then parses no set, and imports no jsonschema, at its start). ``compiled``:
    an install of compiled files only (``_compile``). ``args``: the daemon's, more;
    ``python_flags``: its interpreter's; ``env``: its environment's, more; ``hook``: a
    module every process of the venv runs at its start (a ``.pth`` line imports it)."""
    venv.create(base / "venv", with_pip=False, symlinks=True)
    python = base / "venv" / "bin" / "python"
    purelib = [python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"]
    site = Path(subprocess.run(purelib, capture_output=True, text=True, check=True, timeout=60).stdout.strip())
    ours = [Path(path) for path in sys.path if path.endswith("-packages")]
    (site / "deps.pth").write_text("".join(f"{path}\n" for path in ours))
    package = site / "toolsetd"
    for part in ("protocol", "daemon", "client"):
        shutil.copytree(REPO / part, package / part, ignore=shutil.ignore_patterns("__pycache__"))
    distributions = distributions or {}
    for module, distribution in distributions.items():
        origin = Path(importlib.util.find_spec(module).origin).parent  # type: ignore[union-attr,arg-type]
        shutil.copytree(origin, site / module, ignore=shutil.ignore_patterns("__pycache__"))
        for info in origin.parent.glob(f"{distribution}-*.dist-info"):
            shutil.copytree(info, site / info.name, dirs_exist_ok=True)
    if compiled:
        _compile(package)
    if hook:
        (site / "upgrade_hook.py").write_text(hook)
        (site / "upgrade_hook.pth").write_text("import upgrade_hook\n")
    names = ", ".join(["toolsetd.daemon", *distributions])
    where = [python, "-P", "-c", f"import {names}, sys; print(*(m.__file__ for m in ({names},)))"]
    found = subprocess.run(where, capture_output=True, text=True, check=True, timeout=60)
    assert all(Path(path).is_relative_to(site) for path in found.stdout.split())  # not ours
    home, workspace = base / "home", base / "ws"
    (home / "tools").mkdir(parents=True)
    workspace.mkdir()
    write_set(home / "tools", "short", _SHORT)
    launcher = [str(python), *python_flags, "-P", "-m", "toolsetd.daemon"]
    env = {"PYTHONDONTWRITEBYTECODE": "1", **(env or {})}
    options = ["--no-watch", *args]
    if warm:
        shut_down(start_daemon(home, workspace, base, options, env=env, launcher=launcher))
    return start_daemon(home, workspace, base, options, env=env, launcher=launcher), package


@pytest.fixture
def installed(tmp_base: Path) -> Iterator[tuple[Daemon, Path]]:
    """A daemon run from a venv of its own holding a copy of the package, and that copy."""
    daemon, package = _daemon_from_a_venv(tmp_base)
    try:
        yield daemon, package
    finally:
        shut_down(daemon)


def _compile(package: Path) -> None:
    """Each module of ``package`` (a ``toolsetd`` folder) as a compiled file only."""
    for module in package.rglob("*.py"):
        py_compile.compile(str(module), cfile=str(module.with_suffix(".pyc")), doraise=True)
        module.unlink()


def _edit(path: Path, old: str, new: str) -> None:
    text = path.read_text()
    assert old in text
    path.write_text(text.replace(old, new))


#: ``validation.py``'s check, and one of a release whose check passes every argument.
_CHECK = "    def errors_for("
_PASSES = "    def errors_for(self, *args, **kwargs):\n        return []\n\n    def _old("


def _other_rules(package: Path) -> None:
    """A release whose check passes every argument."""
    _edit(package / "daemon" / "validation.py", _CHECK, _PASSES)


def _other_wire(package: Path) -> None:
    """A release whose check process answers in another shape."""
    _edit(package / "daemon" / "checkworker.py", '"errors": validators', '"found": validators')


def _other_greeting(package: Path) -> None:
    """A release whose check process says something else first, and then waits for its
    own kind of request."""
    _edit(
        package / "daemon" / "checkworker.py",
        'stdout.write(json_dumps({"code": code_id()}) + b"\\n")',
        'stdout.write(b\'{"version": 2}\\n\'); stdout.flush(); time.sleep(3600)',
    )
    _edit(package / "daemon" / "checkworker.py", "import signal\n", "import signal\nimport time\n")


def _removed(package: Path) -> None:
    """The venv removed."""
    shutil.rmtree(package.parents[3])  # venv/lib/python3.x/site-packages/toolsetd


@pytest.mark.parametrize("upgrade", [_other_rules, _other_wire, _other_greeting, _removed])
def test_large_arguments_are_checked_by_the_daemons_own_code_after_an_upgrade(
    installed: tuple[Daemon, Path], upgrade: Callable[[Path], None]
) -> None:
    """The check process is started from disk at the first large check. After an upgrade
    in place it ran the new code: a release whose check differed judged the call by its
    rules (70,000 characters where 10 fit passed), one whose answer had another shape
    failed every large call as an internal error, one that said something else first
    held the call until the check's limit and 10 s (its echo awaited), then said it "was
    stopped", and a removed install was logged as a process that "exited with status 1 at
    its start", naming no upgrade. The daemon uses only a process that runs its own code:
    the call is checked on the loop, as the small ones are, and the log says to restart
    it."""
    daemon, package = installed
    upgrade(package)
    params = {"tool": "short", "arguments": {"s": "x" * 70_000}, "workspace": str(daemon.workspace)}
    for _ in range(2):  # the second finds the worker given up, not started again
        error = daemon.call("invoke", params).get("error")
        assert error is not None and error["message"] == _REFUSED
    said = [e for e in daemon.log_events() if e["event"].startswith("argument_check_process")]
    assert [(e["event"], e.get("error")) for e in said][-1:] == [
        ("argument_check_process_upgraded", _UPGRADED)
    ]
    assert sum(e["event"] == "argument_check_process_started" for e in said) <= 1


def test_a_check_process_is_used_again_once_a_reinstall_of_the_same_code_is_done(
    installed: tuple[Daemon, Path],
) -> None:
    """A reinstall of the same version removes the files and writes them again: a check
    process started in between cannot run, and the daemon gave up the process until its
    restart, checking every large call on the event loop (stalling its other clients)
    with the install its own again. It is tried again once the install changed."""
    daemon, package = installed
    module = package / "daemon" / "checkworker.py"
    text = module.read_bytes()
    module.unlink()
    params = {"tool": "short", "arguments": {"s": "x" * 70_000}, "workspace": str(daemon.workspace)}
    for _ in range(2):  # the second finds the install as it was: no process is tried
        error = daemon.call("invoke", params).get("error")
        assert error is not None and error["message"] == _REFUSED
    module.write_bytes(text)
    error = daemon.call("invoke", params).get("error")
    assert error is not None and error["message"] == _REFUSED
    said = [e["event"] for e in daemon.log_events() if e["event"].startswith("argument_check_process")]
    assert said == [
        "argument_check_process_started",
        "argument_check_process_upgraded",
        "argument_check_process_started",
    ]


#: A reinstall of the same version that a check process's start meets half done: the
#: first check process's look at its install finds ``mcp_session.py`` gone (its listing of
#: the daemon's folder), and the file is back before that process greets.
_HALF_DONE = """
import os, sys, sysconfig

_site = sysconfig.get_path("purelib")
_module = _site + "/toolsetd/daemon/mcp_session.py"
_aside = _site + "/mcp_session.py.aside"
_once = _site + "/half-done"
_moved = []

def _reinstall(event, args):
    if not sys.argv or not sys.argv[0].endswith("checkworker.py"):
        return
    if event == "os.listdir" and str(args[0]).endswith("toolsetd/daemon") and not os.path.exists(_once + ONCE):
        open(_once, "w").close()
        os.rename(_module, _aside)
        _moved.append(True)
    elif event == "open" and _moved and "/toolsetd/protocol/" in str(args[0]):
        _moved.clear()
        os.rename(_aside, _module)

sys.addaudithook(_reinstall)
"""


@pytest.mark.parametrize("once", [True, False])
def test_a_check_process_that_met_a_reinstall_half_done_is_tried_again(
    tmp_base: Path, once: bool
) -> None:
    """A reinstall of the same version removes the files and writes them again. A check
    process started meanwhile greets with the code of the install half done, and when
    the daemon looked at the install after that greeting it found it whole again, its
    own: it gave the process up "until the install changes", which it then never did.
    Every large call after it was checked on the event loop until the restart, and the
    log said toolsetd was upgraded, which it was not. The next large check tries another
    process (a second one greeting with other code while the install reads as the
    daemon's is given up: another Python under the same path, say; here each process
    finds the file gone, ``once`` false)."""
    hook = _HALF_DONE.replace("_once + ONCE", "_once" if once else "_once + '-never'")
    daemon, _ = _daemon_from_a_venv(tmp_base, hook=hook)
    try:
        params = {"tool": "short", "arguments": {"s": "x" * 70_000}, "workspace": str(daemon.workspace)}
        for _ in range(3):
            error = daemon.call("invoke", params).get("error")
            assert error is not None and error["message"] == _REFUSED
        assert any(tmp_base.rglob("half-done"))  # the first process met it
        said = [e["event"] for e in daemon.log_events() if e["event"].startswith("argument_check_process")]
        assert said == [
            "argument_check_process_started",
            "argument_check_process_other_code",
            "argument_check_process_started",
            *([] if once else ["argument_check_process_upgraded"]),
        ]
    finally:
        shut_down(daemon)


#: An upgrade that lands while a daemon starts: once its modules are loaded (its start
#: then reads its config file, with tomllib), a release whose check passes everything.
_UPGRADE_AT_START = f"""
import sys, sysconfig

def _upgrade(event, args):
    if event == "import" and args[0] == "tomllib":
        path = sysconfig.get_path("purelib") + "/toolsetd/daemon/validation.py"
        with open(path) as source:
            text = source.read()
        with open(path, "w") as source:
            source.write(text.replace({_CHECK!r}, {_PASSES!r}))

sys.addaudithook(_upgrade)
"""


def test_an_upgrade_landing_while_the_daemon_starts_is_told(tmp_base: Path) -> None:
    """The daemon hashed its install once its start had loaded its modules and read its
    config: an upgrade that landed in between (a socket-activated start during ``pip
    install -U``) was taken for the daemon's own code, and its check process was used,
    judging by the new release's rules (here 70,000 characters where 10 fit passed).
    The hash is taken before the daemon's modules load."""
    daemon, _ = _daemon_from_a_venv(tmp_base, hook=_UPGRADE_AT_START)
    try:
        params = {"tool": "short", "arguments": {"s": "x" * 70_000}, "workspace": str(daemon.workspace)}
        error = daemon.call("invoke", params).get("error")
        assert error is not None and error["message"] == _REFUSED
    finally:
        shut_down(daemon)


def test_an_install_of_compiled_files_only_is_told_from_another(tmp_base: Path) -> None:
    """An install of compiled files only (``.pyc`` in place of each ``.py``) had no source
    to tell its code by: after an upgrade to another such install, the check process ran
    the new code, as if it were the daemon's (here a check that passes everything). Its
    compiled files tell it as the source would."""
    daemon, package = _daemon_from_a_venv(tmp_base, compiled=True)
    try:
        validation = package / "daemon" / "validation.pyc"
        source = (REPO / "daemon" / "validation.py").read_text()
        lenient = tmp_base / "validation.py"
        lenient.write_text(source.replace(_CHECK, _PASSES))
        py_compile.compile(str(lenient), cfile=str(validation), doraise=True)
        params = {"tool": "short", "arguments": {"s": "x" * 70_000}, "workspace": str(daemon.workspace)}
        error = daemon.call("invoke", params).get("error")
        assert error is not None and error["message"] == _REFUSED
    finally:
        shut_down(daemon)


def test_a_daemon_run_without_the_environment_starts_its_check_process_alike(
    tmp_base: Path,
) -> None:
    """A daemon run by ``python -E`` or ``-I`` (a unit's hardening), or ``-s`` (a
    distro's script line, ``#!/usr/bin/python3 -s``), started its check process without
    that flag: the process found libraries the daemon does not see (here a format
    package on the ``PYTHONPATH`` the daemon ignores; a user's ``pip install --user``),
    so from its first large check the daemon said "toolsetd was upgraded ... restart
    it", and checked every large call on the event loop, nothing upgraded."""
    extra = tmp_base / "extra"
    (extra / "webcolors").mkdir(parents=True)
    (extra / "webcolors" / "__init__.py").write_text("")
    (extra / "webcolors-99.0.dist-info").mkdir()
    daemon, _ = _daemon_from_a_venv(tmp_base, python_flags=["-E"], env={"PYTHONPATH": str(extra)})
    try:
        params = {"tool": "short", "arguments": {"s": "x" * 70_000}, "workspace": str(daemon.workspace)}
        error = daemon.call("invoke", params).get("error")
        assert error is not None and error["message"] == _REFUSED
        said = [e["event"] for e in daemon.log_events()]
        assert "argument_check_process_started" in said
        assert "argument_check_process_upgraded" not in said
    finally:
        shut_down(daemon)


def _other_instructions(package: Path) -> None:
    """A release that says other things to MCP hosts."""
    _edit(package / "daemon" / "mcp_session.py", "The operator's external tools", "Other tools")


_INITIALIZE = {
    "jsonrpc": "2.0",
    "id": 1,
    "method": "initialize",
    "params": {
        "protocolVersion": "2025-06-18",
        "capabilities": {},
        "clientInfo": {"name": "upgrade-test", "version": "1"},
    },
}


def _bind(daemon: Daemon) -> subprocess.CompletedProcess[str]:
    """A ``toolsetctl mcp`` whose host sends ``initialize`` and ends: what it wrote."""
    return subprocess.run(
        [sys.executable, "-m", "toolsetd.client", "--socket", str(daemon.socket),
         "--workspace", str(daemon.workspace), "mcp"],
        input=json.dumps(_INITIALIZE) + "\n", capture_output=True, text=True, timeout=60,
        check=False,
    )


def _served(daemon: Daemon) -> None:
    """A new MCP host is served, and a large check runs in a check process, of the
    daemon's own code."""
    pump = _bind(daemon)
    assert pump.returncode == 0, pump.stderr
    assert json.loads(pump.stdout.splitlines()[0])["result"]["serverInfo"]["name"] == "toolsetd"
    params = {"tool": "short", "arguments": {"s": "x" * 70_000}, "workspace": str(daemon.workspace)}
    error = daemon.call("invoke", params).get("error")
    assert error is not None and error["message"] == _REFUSED
    said = [e["event"] for e in daemon.log_events()]
    assert "argument_check_process_started" in said
    assert not [event for event in said if event.endswith("_upgraded")]


def test_an_editors_files_beside_the_modules_are_no_upgrade(
    installed: tuple[Daemon, Path],
) -> None:
    """Files that no import loads appear in an install that is not upgraded: Emacs's lock
    of a modified buffer (``.#validation.py``, a dangling symlink, in an editable
    checkout), a compiled file beside its source (``compileall -b``: the source is what
    an import loads). Counted as code, they refused every MCP host (toolsetctl mcp exit
    9, "toolsetd was upgraded ... restart it") and gave up the check process, until the
    daemon was restarted, though the code it would load was its own."""
    daemon, package = installed
    modules = package / "daemon"
    (modules / ".#validation.py").symlink_to("operator@host.4242:1764000000")
    py_compile.compile(str(modules / "validation.py"), cfile=str(modules / "validation.pyc"), doraise=True)
    (package / "protocol" / ".errors.py").write_text("# an editor's hidden copy\n")
    _served(daemon)


@pytest.mark.parametrize("upgrade", [_other_instructions, _removed])
def test_an_mcp_host_after_an_upgrade_is_told_to_restart_the_daemon(
    installed: tuple[Daemon, Path], upgrade: Callable[[Path], None]
) -> None:
    """The daemon imports its MCP face at the first ``mcp.bind``. After an upgrade in
    place it imported the new files into the old daemon, which then served MCP with
    mixed code, or (the venv removed) failed the bind as an internal error with an
    incident id. The bind is refused, saying what happened and what to do."""
    daemon, package = installed
    upgrade(package)
    for _ in range(2):  # refused until the restart, said once
        pump = _bind(daemon)
        assert (pump.returncode, pump.stderr.strip()) == (
            9,
            "toolsetctl mcp: toolsetd was upgraded (or removed) under this daemon, which loads "
            "its MCP code at its first MCP session: restart it",
        )
    said = [(e["event"], e.get("error")) for e in daemon.log_events()]
    assert said.count(("mcp_code_upgraded", _UPGRADED)) == 1


def test_an_mcp_host_is_served_once_a_reinstall_of_the_same_code_is_done(
    installed: tuple[Daemon, Path],
) -> None:
    """A reinstall of the same version (``pip install --force-reinstall``, a config
    manager's run) removes the files and writes them again: a bind in between is refused,
    as the MCP code cannot be loaded then. The refusal was kept until the restart: every
    MCP host after it was refused too, with the install its own again."""
    daemon, package = installed
    session = package / "daemon" / "mcp_session.py"
    text = session.read_bytes()
    session.unlink()
    assert _bind(daemon).returncode == 9
    session.write_bytes(text)
    pump = _bind(daemon)
    assert pump.returncode == 0, pump.stderr
    said = [(e["event"], e.get("error")) for e in daemon.log_events()]
    assert said.count(("mcp_code_upgraded", _UPGRADED)) == 1


def test_an_mcp_host_is_served_when_only_a_library_of_the_checks_changed(
    installed: tuple[Daemon, Path],
) -> None:
    """The MCP modules load none of jsonschema's libraries, nor orjson anew. A format
    package installed beside the daemon (another tool's dependency; a distro's update of
    python3-idna under a distro's toolsetd) refused every new MCP host until the restart,
    toolsetd's own code unchanged."""
    daemon, package = installed
    site = package.parent
    (site / "webcolors").mkdir()
    (site / "webcolors" / "__init__.py").write_text("")
    (site / "webcolors-99.0.dist-info").mkdir()
    pump = _bind(daemon)
    assert pump.returncode == 0, pump.stderr


def _other_jsonschema(package: Path) -> None:
    """A jsonschema 999.0.0 whose ``maxLength`` checks nothing, over the daemon's."""
    site = package.parent
    keywords = site / "jsonschema" / "_keywords.py"
    _edit(keywords, "def maxLength(validator, mL, instance, schema):\n",
          "def maxLength(validator, mL, instance, schema):\n    return\n")
    (info,) = site.glob("jsonschema-*.dist-info")
    info.rename(site / "jsonschema-999.0.0.dist-info")


_JSONSCHEMA_UPGRADED = (
    "toolsetd was upgraded (or removed) under this daemon, which loads jsonschema at its "
    "first check of a schema: restart it"
)


def test_a_daemon_started_warm_checks_with_the_jsonschema_it_started_with(tmp_base: Path) -> None:
    """A daemon started with its set cache warm parses no set, so it imports jsonschema
    at the first check that needs it, from disk. After an upgrade that brought another
    jsonschema (``pipx install --force`` makes the venv anew), the old daemon checked the
    calls with it: here a jsonschema whose ``maxLength`` checks nothing, and 11 characters
    where 10 fit passed. The call is refused, saying to restart the daemon."""
    daemon, package = _daemon_from_a_venv(tmp_base, _JSONSCHEMA, warm=True)
    try:
        _other_jsonschema(package)
        params = {"tool": "short", "arguments": {"s": "x" * 11}, "workspace": str(daemon.workspace)}
        for _ in range(2):  # refused until the restart, said once
            error = daemon.call("invoke", params).get("error")
            assert error is not None
            assert (error["code"], error["message"]) == (-32603, _JSONSCHEMA_UPGRADED)
        said = [(e["event"], e.get("error")) for e in daemon.log_events()]
        assert said.count(("schema_code_upgraded", _UPGRADED)) == 1
    finally:
        shut_down(daemon)


def test_a_set_changed_after_an_upgrade_waits_for_the_restart(tmp_base: Path) -> None:
    """The same daemon's first parse of a set (one added, or edited, after the upgrade)
    imported the other jsonschema too: the set was judged by its rules, and from then on
    every call was checked with them (11 characters where 10 fit passed). Or, a jsonschema
    that cannot be imported (a venv half replaced), the reload and every call failed as
    internal errors. The set is skipped with a note saying to restart the daemon, and not
    cached; the other sets are served on, with the daemon's own checks."""
    daemon, package = _daemon_from_a_venv(tmp_base, _JSONSCHEMA, warm=True)
    try:
        _other_jsonschema(package)
        referenced = {"type": "object", "properties": {"s": {"$ref": "#/$defs/s"}},
                      "$defs": {"s": {"type": "string"}}}
        write_set(daemon.home / "tools", "added", {
            "runner": "exec", "command": ["/bin/true"],
            "tools": [{"name": "added", "description": "Added after the upgrade.", "schema": referenced}],
        })
        reloaded = daemon.call("reload")["result"]
        assert reloaded["notes"] == [{
            "set": "added", "source": "home",
            "message": f"External tool set 'added' was skipped: {_JSONSCHEMA_UPGRADED}",
        }]
        params = {"tool": "short", "arguments": {"s": "x" * 11}, "workspace": str(daemon.workspace)}
        error = daemon.call("invoke", params).get("error")
        assert error is not None
        assert (error["code"], error["message"]) == (-32603, _JSONSCHEMA_UPGRADED)
        params["arguments"] = {"s": "fits"}  # the plain subset: checked without jsonschema
        error = daemon.call("invoke", params).get("error")
        assert error is not None and error["code"] == -32004  # checked, put to the operator
    finally:
        shut_down(daemon)


_ELEVEN = "Invalid arguments for 'short': /s: expected at most 10 characters, got 11"


def _eleven(daemon: Daemon) -> dict[str, object]:
    """The error of a call whose 11 characters need jsonschema for their message."""
    params = {"tool": "short", "arguments": {"s": "x" * 11}, "workspace": str(daemon.workspace)}
    error = daemon.call("invoke", params).get("error")
    assert error is not None
    return error


@pytest.mark.parametrize(("module", "distribution"), [("attr", "attrs"), ("rpds", "rpds_py")])
def test_a_daemon_started_warm_loads_no_other_companion_of_jsonschema(
    tmp_base: Path, module: str, distribution: str
) -> None:
    """jsonschema's first import, at the first check that needs it in a daemon started
    warm, loads its resolver's libraries too, attrs and rpds, which nothing loads before.
    Their versions were not looked at: another release of either (here one that refuses
    to load) was imported into the daemon, and the call failed as an internal error
    with an incident id (or was checked with the new code). The call is refused, saying
    to restart the daemon, as for another jsonschema."""
    daemon, package = _daemon_from_a_venv(tmp_base, _JSONSCHEMA, warm=True)
    try:
        site = package.parent
        (site / module / "__init__.py").write_text(f"raise ImportError('{module} 999 is being installed')\n")
        (info,) = site.glob(f"{distribution}-*.dist-info")
        info.rename(site / f"{distribution}-999.0.0.dist-info")
        for _ in range(2):  # refused until the restart, said once
            error = _eleven(daemon)
            assert (error["code"], error["message"]) == (-32603, _JSONSCHEMA_UPGRADED)
        said = [(e["event"], e.get("error")) for e in daemon.log_events()]
        assert said.count(("schema_code_upgraded", _UPGRADED)) == 1
    finally:
        shut_down(daemon)


def test_a_daemon_started_warm_checks_after_a_reinstall_of_the_same_jsonschema(
    tmp_base: Path,
) -> None:
    """A reinstall of the same versions (``pip install --force-reinstall toolsetd``
    reinstalls jsonschema too) removes jsonschema's files a moment: a call that needed
    jsonschema's first import then was refused, and so was every such call after it, and
    every set added or edited, until the restart, with jsonschema the daemon's again."""
    daemon, package = _daemon_from_a_venv(tmp_base, _JSONSCHEMA, warm=True)
    try:
        (info,) = package.parent.glob("jsonschema-*.dist-info")
        aside = tmp_base / info.name
        info.rename(aside)  # pip's uninstall moves it away first
        assert _eleven(daemon)["message"] == _JSONSCHEMA_UPGRADED
        aside.rename(info)
        assert _eleven(daemon)["message"] == _ELEVEN
    finally:
        shut_down(daemon)


def test_a_daemon_started_warm_checks_after_orjson_changed(tmp_base: Path) -> None:
    """jsonschema's first import loads no orjson: the daemon's is loaded since its start.
    Another orjson installed under a daemon started warm (another tool's requirement in
    the same venv) refused each call needing jsonschema, and each set added or edited,
    until the restart, though nothing they load changed."""
    daemon, package = _daemon_from_a_venv(tmp_base, {"orjson": "orjson"}, warm=True)
    try:
        (info,) = package.parent.glob("orjson-*.dist-info")
        info.rename(package.parent / "orjson-999.0.0.dist-info")
        assert _eleven(daemon)["message"] == _ELEVEN
    finally:
        shut_down(daemon)


@contextlib.contextmanager
def _initialized_pump(
    tmp_base: Path, command: list[str], tool_command: list[str]
) -> Iterator[tuple[subprocess.Popen[bytes], Daemon, Path]]:
    """A ``toolsetctl mcp`` run from a daemon's venv (``_daemon_from_a_venv``), its session
    initialized, serving the home set ``tool`` (``command`` and ``tool_command``); the
    pump, the daemon and the venv's ``toolsetd`` folder. Both end with the block."""
    daemon, package = _daemon_from_a_venv(tmp_base)
    write_set(daemon.home / "tools", "tool", {
        "runner": "exec", "command": command,
        "tools": [{"name": "tool", "description": "A tool.", "schema": {"type": "object"},
                   "command": tool_command}],
    })
    assert daemon.call("reload")["result"]["changed"]
    python = package.parents[3] / "bin" / "python"  # venv/lib/python3.x/site-packages/toolsetd
    with subprocess.Popen(
        [python, "-P", "-m", "toolsetd.client", "--socket", str(daemon.socket),
         "--workspace", str(daemon.workspace), "mcp", "--mode", "full"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    ) as pump:
        try:
            assert pump.stdin is not None and pump.stdout is not None
            initialize = {"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {
                "protocolVersion": "2025-06-18", "capabilities": {},
                "clientInfo": {"name": "upgrade-test", "version": "1"}}}
            pump.stdin.write(json.dumps(initialize).encode() + b"\n")
            pump.stdin.flush()
            assert json.loads(pump.stdout.readline())["id"] == 1
            pump.stdin.write(b'{"jsonrpc": "2.0", "method": "notifications/initialized"}\n')
            yield pump, daemon, package
        finally:
            if pump.poll() is None:
                pump.kill()
            shut_down(daemon)


def test_a_pump_whose_install_went_says_why_it_ends(tmp_base: Path) -> None:
    """A ``toolsetctl mcp`` lives as long as its host's session, and its install may go
    meanwhile (a venv made anew). Its last words were written with a module it imported
    only then: a pump whose daemon went away, its host's input ended while it waited for
    another, ended with exit 1 and an ``ImportError`` traceback, not with exit 5 and what
    happened."""
    with _initialized_pump(tmp_base, ["/bin/sleep"], ["60"]) as (pump, daemon, package):
        assert pump.stdin is not None and pump.stdout is not None
        call = {"jsonrpc": "2.0", "id": 2, "method": "tools/call",
                "params": {"name": "tool", "arguments": {}}}
        pump.stdin.write(json.dumps(call).encode() + b"\n")
        pump.stdin.flush()
        shutil.rmtree(package.parents[3])  # the venv goes
        daemon.proc.kill()  # and the daemon with the call: the pump answers it, and waits
        daemon.proc.wait(timeout=20)
        gone = json.loads(pump.stdout.readline())
        assert gone["id"] == 2 and gone["result"]["isError"]
        # The host ends (its input) while the pump waits for a daemon.
        _, stderr = pump.communicate(timeout=60)
        assert (pump.returncode, stderr.decode()) == (
            5,
            f"toolsetctl mcp: toolsetd at {daemon.socket} closed the connection (the input "
            "ended while the pump waited for it to come back)\n",
        )


def test_metrics_whose_library_cannot_be_loaded_say_why(tmp_base: Path) -> None:
    """The daemon imports prometheus_client at the first scrape, from disk. One that could
    not be imported then (the venv half replaced, or removed) failed ``toolsetctl
    metrics`` as "Internal error (incident ...)", and a scrape of ``/metrics`` got no answer
    at all (the connection closed, a traceback logged as a bug, every 15 s). Both say
    what happened and what to do: the call's message, and a 503 carrying it."""
    daemon, package = _daemon_from_a_venv(
        tmp_base, {"prometheus_client": "prometheus_client"},
        args=["--metrics-listen", "127.0.0.1:0"],
    )
    try:
        broken = package.parent / "prometheus_client" / "__init__.py"
        broken.write_text("raise ImportError('prometheus_client is being replaced')\n")
        said = (
            "toolsetd was upgraded (or removed) under this daemon, which loads its metrics "
            "renderer at the first scrape, and it cannot be loaded now (prometheus_client is "
            "being replaced): restart it"
        )
        error = daemon.call("metrics").get("error")
        assert error is not None and (error["code"], error["message"]) == (-32603, said)
        address = next(e["address"] for e in daemon.log_events() if e["event"] == "metrics_listening")
        host, _, port = address.rpartition(":")
        with socket.create_connection((host, int(port)), timeout=10) as scrape:
            scrape.sendall(f"GET /metrics HTTP/1.1\r\nHost: {address}\r\n\r\n".encode())
            answer = b""
            while chunk := scrape.recv(65536):
                answer += chunk
        head, _, body = answer.partition(b"\r\n\r\n")
        assert head.split(b"\r\n")[0] == b"HTTP/1.1 503 Service Unavailable"
        assert body.decode() == said + "\n"
    finally:
        shut_down(daemon)


def _any_address(package: Path) -> None:
    """A release whose MCP endpoint listens on any address, not loopback only."""
    _edit(package / "daemon" / "httpguard.py", "    if not address.is_loopback:", "    if False:")


@pytest.mark.parametrize(("upgrade", "address"), [(_any_address, "0.0.0.0:8765"), (_removed, "127.0.0.1:0")])
def test_a_listen_address_added_after_an_upgrade_is_not_judged_by_other_code(
    installed: tuple[Daemon, Path], upgrade: Callable[[Path], None], address: str
) -> None:
    """A daemon started without a listen key loads the rules of listen addresses
    (``httpguard``) at the first one its config file names. Added after an upgrade in
    place, it was read with the new release's rules, mixed into the daemon (here a
    release that listens on any address: the reload took 0.0.0.0 as fine, waiting for
    the restart); with the venv removed (or half replaced) the ``reload`` call failed as
    an internal error, and a SIGHUP ended the daemon. The reload keeps the running
    settings and says to restart it, as a bad file is said."""
    daemon, package = installed
    upgrade(package)
    config = daemon.log_path.parent / "toolsetd.toml"
    config.write_text(f'mcp-listen = ["{address}"]\n')
    said = (
        f"{config}:1: mcp-listen: toolsetd was upgraded (or removed) under this daemon, which "
        "loads its rules of listen addresses at the first one it reads: restart it"
    )
    reloaded = daemon.call("reload").get("result")
    assert reloaded is not None and reloaded["config"] == {
        "applied": [], "restartNeeded": [], "error": said
    }
    daemon.proc.send_signal(signal.SIGHUP)
    eventually(lambda: [e["event"] for e in daemon.log_events()].count("config_reload_failed") == 2)
    assert "result" in daemon.call("status")


def test_a_pump_whose_install_went_still_serves_a_line_nested_past_pythons_json(
    tmp_base: Path,
) -> None:
    """A host line nested past what Python's json reads (some 990 levels; the daemon's
    parser reads 1,024) is read by the pump with the daemon's parser, loaded only for such
    a line. After the install went (a venv made anew), that import failed in the pump's
    input thread: the line was never sent and the host waited for its answer for ever."""
    with _initialized_pump(tmp_base, ["/bin/true"], []) as (pump, _, package):
        assert pump.stdin is not None
        shutil.rmtree(package.parents[3])  # the venv goes; the daemon stays
        deep = "[" * 1000 + "]" * 1000
        call = ('{"jsonrpc": "2.0", "id": 2, "method": "tools/call", "params": '
                '{"name": "tool", "arguments": {"deep": ' + deep + "}}}")
        pump.stdin.write(call.encode() + b"\n")
        out, err = pump.communicate(timeout=30)  # the input ends: the pump answers, ends
        # The daemon's answer (it takes 64 levels of arguments): the line reached it.
        assert [json.loads(line)["id"] for line in out.splitlines()] == [2]
        assert (pump.returncode, err) == (0, b"")


def test_a_pump_whose_install_went_counts_no_deep_line_it_cannot_read_as_refused(
    tmp_base: Path,
) -> None:
    """Without the daemon's parser (its install went) the pump reads a line nested past
    Python's json as a parse error, and counted it as one the daemon refuses, which the
    daemon serves. The pump tells whether the daemon took a line over 16 MiB by the parse
    errors it answered up to then: with that count one too many, a call the daemon refused
    (a NaN in it) stayed in flight and was answered at a restart ("the tool may have
    run"), after the daemon's refusal."""
    args = ["--max-message-bytes", "40000000"]
    daemon, package = _daemon_from_a_venv(tmp_base, args=args)
    python = package.parents[3] / "bin" / "python"  # venv/lib/python3.x/site-packages/toolsetd
    restarted: list[Daemon] = []
    with subprocess.Popen(
        [python, "-P", "-m", "toolsetd.client", "--socket", str(daemon.socket),
         "--workspace", str(daemon.workspace), "mcp", "--mode", "full"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    ) as pump:
        assert pump.stdin is not None and pump.stdout is not None
        stdin, stdout = pump.stdin, pump.stdout

        def send(line: bytes) -> None:
            stdin.write(line)
            stdin.flush()

        def until(request_id: int) -> list[dict[str, object]]:
            seen = []
            while not seen or seen[-1].get("id") != request_id or "method" in seen[-1]:
                seen.append(json.loads(stdout.readline()))
            return seen

        try:
            send(json.dumps({"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {
                "protocolVersion": "2025-06-18", "capabilities": {},
                "clientInfo": {"name": "upgrade-test", "version": "1"}}}).encode() + b"\n")
            assert until(1)[-1]["result"]
            shutil.rmtree(package.parents[3])  # the venv goes; the daemon stays
            send(b'{"jsonrpc": "2.0", "method": "notifications/initialized"}\n')
            deep = "[" * 1000 + "]" * 1000
            send(b'{"jsonrpc": "2.0", "id": 2, "method": "ping", "params": {"deep": %s}}\n'
                 % deep.encode())
            assert until(2)[-1] == {"jsonrpc": "2.0", "id": 2, "result": {}}  # served
            send(b'{"jsonrpc":"2.0","id":3,"method":"tools/call","params":{"name":"short",'
                 b'"arguments":{"pad":"%s","wrong":NaN}}}\n' % (b"x" * 17_000_000))
            send(b'{"jsonrpc": "2.0", "id": 4, "method": "ping"}\n')
            seen = until(4)
            assert [(m["id"], m["error"]["code"]) for m in seen if "error" in m] == [  # type: ignore[index]
                (None, -32700)
            ]
            daemon.proc.kill()
            daemon.proc.wait()
            restarted.append(start_daemon(daemon.home, daemon.workspace, tmp_base, ["--no-watch"]))
            send(b'{"jsonrpc": "2.0", "id": 5, "method": "ping"}\n')
            seen = until(5)
            assert [m for m in seen if m.get("id") == 3] == [], str(seen)[:500]
        finally:
            if pump.poll() is None:
                pump.kill()
            shut_down(daemon)
            for other in restarted:
                shut_down(other)
