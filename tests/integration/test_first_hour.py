"""An operator's and a CI job's first hour: the mistakes people make, and what they are told.

A real daemon serves tool sets written with those mistakes; ``toolsetctl`` (a subprocess)
and ``toolsetctl mcp`` (the MCP SDK's client over stdio) call them. Each refusal must name
the file or field at fault and the fix, and say it the same on both faces: one core
words it.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest
from mcp import Client
from mcp.shared.exceptions import MCPError

from .conftest import REPO, Daemon, daemon_in, eventually, start_daemon, write_set
from .mcp_helpers import server

TOOL = {"runner": "exec", "description": "d", "schema": {"type": "object"}}


def _fill(home: Path, workspace: Path) -> None:
    tools, project = home / "tools", workspace / ".crystal" / "tools"
    # A home tool that asks (approval inherit), and a project one whose author wrote
    # "always", which the project sets' default host policy does not let count.
    write_set(tools, "fmt", {**TOOL, "command": ["/bin/echo", "formatted"]})
    write_set(project, "deploy", {**TOOL, "command": ["/bin/echo", "ran"], "approval": "always"})
    # A set the operator turned off, one whose field name is misspelt ("comand": the
    # shorthand then has no command), and a home set a project copy replaces whole.
    write_set(tools, "lint", {**TOOL, "command": ["/bin/true"], "enabled": False})
    write_set(tools, "typo", {**TOOL, "comand": ["/bin/true"]})
    shared = {"runner": "exec", "command": ["/bin/true"]}
    write_set(
        tools, "pair", {**shared, "tools": [{**TOOL, "name": "left"}, {**TOOL, "name": "right"}]}
    )
    write_set(project, "pair", {**shared, "tools": [{**TOOL, "name": "left"}]})
    # Misspelt members of a set that loads: its path argument goes unfenced.
    fenced = {"name": "cat", "description": "d", "schema": {"type": "object"}}
    write_set(
        tools,
        "typo2",
        {
            "runner": "exec",
            "command": ["/bin/cat"],
            "timeout_seconds": 5,
            "tools": [{**fenced, "pathArgument": ["file"], "Approval": "always"}],
        },
    )
    # Two sets that declare one tool name: the earlier set in sort order has it.
    for clash in ("clashA", "clashB"):
        write_set(tools, clash, {**shared, "tools": [{**TOOL, "name": "clash"}]})
    # Sets where toolsetd does not look: in the home itself, and one level too deep.
    write_set(home, "misplaced", {**TOOL, "command": ["/bin/true"]})
    write_set(tools / "nest", "inner", {**TOOL, "command": ["/bin/true"]})
    # Members people add that are no misspelling: $schema (for editors) and a root name.
    write_set(
        tools,
        "editor",
        {"$schema": "file:///x", "name": "Editor", **TOOL, "command": ["/bin/true"]},
    )
    # Scripts the system cannot run as they stand (approval always: they run unasked).
    for name, (body, _fix) in SCRIPTS.items():
        runs = {**TOOL, "command": ["run.sh"], "approval": "always"}
        write_set(tools, name, runs, **{"run.sh": body.format(folder=tools / name)})
    for name, (body, _fix) in ENV_SCRIPTS.items():
        runs = {**TOOL, "command": ["run.sh"], "approval": "always"}
        write_set(tools, name, runs, **{"run.sh": body})
    (tools / "noexec" / "run.sh").chmod(0o644)
    (tools / "interpnox" / "interp").write_text("#!/bin/sh\n")  # not executable
    inner = tools / "nested" / "inner"
    inner.write_text("#!/usr/bin/python9-not-installed\nprint(1)\n")
    inner.chmod(0o755)
    for level in range(1, 6):  # run.sh, then s1 to s5: six scripts
        script = tools / "chain" / f"s{level}"
        script.write_text(f"#!{tools / 'chain' / f's{level + 1}'}\n" if level < 5 else "#!/bin/sh\n")
        script.chmod(0o755)
    write_set(project, "pcrlf", {**TOOL, "command": ["run.sh"]}, **{"run.sh": CRLF})


CRLF = "#!/bin/sh\r\necho hi\r\n"
#: A script, and the sentence (after "Command file <path> ") that names its fix.
SCRIPTS = {
    "nobang": (
        "echo hi\n",
        "does not start with a #! line: make its first line one that names its "
        "interpreter, such as #!/bin/sh.",
    ),
    "crlf": (
        CRLF,
        "has Windows (CRLF) line endings: its #! line ends in a carriage return, which the "
        "system reads as part of the interpreter's name; save it with LF line endings "
        "(dos2unix {path}).",
    ),
    "python9": (
        "#!/usr/bin/python9-not-installed\nprint(1)\n",
        "names the interpreter /usr/bin/python9-not-installed on its #! line, which does not "
        "exist: install it, or name one that does.",
    ),
    "noexec": ("#!/bin/sh\necho hi\n", "is not executable: run chmod +x {path}."),
    # An interpreter that is there but cannot run: the start said only "Permission denied"
    # for the script, whose own x bits are set.
    "interpnox": (
        "#!{folder}/interp\necho hi\n",
        "names the interpreter {folder}/interp on its #! line, which is not executable: run "
        "chmod +x {folder}/interp, or name another.",
    ),
    "interpdir": (
        "#!{folder}\necho hi\n",
        "names the interpreter {folder} on its #! line, which is a folder: name the program "
        "in it.",
    ),
    # The kernel reads the first 256 bytes: an interpreter's name that does not end there
    # is refused ("Exec format error"), not cut and looked for: it was "does not exist".
    "longbang": (
        "#!{folder}/" + "i" * 300 + "\necho hi\n",
        "has a #! line whose interpreter's name does not end within the first 256 bytes of "
        "the file, all the system reads of it, so the system refuses to run it: name the "
        "interpreter by a shorter path (a link to it).",
    ),
    "emptybang": (
        "#!\necho hi\n",
        "has a #! line that names no interpreter: name one, such as #!/bin/sh.",
    ),
    # An interpreter that is a script is run by its own interpreter: one missing there was
    # "No such file or directory" for the tool's script, with no sentence at all.
    "nested": (
        "#!{folder}/inner\necho hi\n",
        "names the interpreter {folder}/inner on its #! line, a script that names the "
        "interpreter /usr/bin/python9-not-installed on its #! line, which does not exist: "
        "install it, or name one that does.",
    ),
    # Looked for from the workspace, not on PATH: "No such file or directory", no sentence.
    "relbang": (
        "#!bash\necho hi\n",
        "names the interpreter bash on its #! line, a relative path, which the system looks "
        "for from the folder the tool runs in (the workspace), not on PATH: name it by its "
        "full path, or through env (#!/usr/bin/env bash).",
    ),
    # Six scripts in a chain: "Too many levels of symbolic links", of no link.
    "chain": (
        "#!{folder}/s1\necho hi\n",
        "starts a chain of scripts, each the #! interpreter of the one before ({folder}/s1, "
        "{folder}/s2, {folder}/s3, {folder}/s4, {folder}/s5), longer than the 5 the system "
        "runs: name a program, not a script, on one of their #! lines.",
    ),
}


#: Scripts that start (``/usr/bin/env`` is there) whose ``env`` finds no interpreter: it
#: exits 127 with its own "No such file or directory", which names neither the script nor
#: the fix. The sentence (after "Command file <path> ") that does, or None for one whose
#: 127 is its own (``sh`` is there).
ENV_SCRIPTS = {
    "envpy9": (
        "#!/usr/bin/env python9-not-installed\nprint(1)\n",
        "names the interpreter 'python9-not-installed' on its #! line, through /usr/bin/env, "
        "which finds no such program on PATH (the tool's, which is toolsetd's): install it, "
        "or name one that is.",
    ),
    "envsplit": (
        "#!/usr/bin/env -S python9-not-installed -u\nprint(1)\n",
        "names the interpreter 'python9-not-installed' on its #! line, through /usr/bin/env, "
        "which finds no such program on PATH (the tool's, which is toolsetd's): install it, "
        "or name one that is.",
    ),
    # Linux passes "sh -e" to env as one argument: no program has that name.
    "envargs": (
        "#!/usr/bin/env sh -e\necho hi\n",
        "names the interpreter 'sh -e' on its #! line, through /usr/bin/env: the system "
        "passes the rest of a #! line as one argument, so env looks for one program of that "
        "name, spaces and all; write #!/usr/bin/env -S sh -e.",
    ),
    "envown127": ("#!/usr/bin/env sh\nexit 127\n", None),
}


@pytest.fixture(scope="module")
def first_hour() -> Iterator[Daemon]:
    with daemon_in("tfh-", _fill, ["--no-watch"]) as daemon:
        yield daemon


@pytest.fixture(scope="module")
def unconfined() -> Iterator[Daemon]:
    """The same sets under a daemon with no cgroups and no sandbox: the spawn itself fails."""
    with tempfile.TemporaryDirectory(prefix="tfh-conf-") as folder:
        config = Path(folder) / "toolsetd.toml"
        config.write_text('[confinement]\ncgroup = "off"\nsandbox = "off"\n')
        with daemon_in("tfh-", _fill, ["--no-watch", "--config", str(config)]) as daemon:
            yield daemon


def ctl(daemon: Daemon, *args: str) -> subprocess.CompletedProcess[str]:
    """``toolsetctl`` against the module's daemon and workspace, as a CI step runs it."""
    argv = [sys.executable, "-m", "toolsetd.client", "--socket", str(daemon.socket)]
    argv += ["--workspace", str(daemon.workspace), *args]
    return subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False)


async def mcp_call(daemon: Daemon, tool: str, *options: str) -> tuple[bool | None, str]:
    """``tools/call`` through ``toolsetctl mcp``: (isError, the text), or (None, the
    JSON-RPC error's message)."""
    with anyio.fail_after(30):
        async with Client(server(daemon, daemon.workspace, *options)) as client:
            try:
                result = await client.call_tool(tool, {})
            except MCPError as exc:  # an unknown tool is -32602
                return None, exc.error.message
    text = "".join(getattr(block, "text", "") for block in result.content)
    return result.is_error, text


def _json(r: subprocess.CompletedProcess[str]) -> Any:
    return json.loads(r.stdout)


# -- approval: what would let the call run --------------------------------------------


HOST_IGNORES = (
    "The tool declares approval 'always', which does not count for project tool sets: "
    "externalToolApproval.project in the Crystal home's config.json is host; set it to "
    "author to let the declaration count."
)


def test_project_always_that_asks_says_the_policy_ignores_it(first_hour: Daemon) -> None:
    """A project set's "approval": "always" reads as inherit under the host policy: the
    call asks, and the operator who wrote "always" is told why and what to change."""
    r = ctl(first_hour, "invoke", "deploy")
    assert r.returncode == 3, r.stderr
    assert HOST_IGNORES in r.stderr
    assert "run the command again with --approve" in r.stderr
    headless = ctl(first_hour, "invoke", "deploy", "--headless", "--format", "json")
    assert headless.returncode == 3
    assert HOST_IGNORES in _json(headless)["error"]["message"]


@pytest.mark.anyio
async def test_headless_denial_names_the_fix_and_the_fix_works(first_hour: Daemon) -> None:
    """A CI job's headless call that needs approval is denied with what would let it run,
    the same on toolsetctl and MCP; and the named fix (--mode full) does run it."""
    fix = (
        'To let it run headless, declare "approval": "always" for the tool in its '
        "tools.json, or run in full mode (--mode full; mode=full in an MCP URL)."
    )
    r = ctl(first_hour, "invoke", "fmt", "--headless")
    assert r.returncode == 3
    assert r.stderr.startswith("Denied: Headless run:")
    assert fix in r.stderr
    is_error, text = await mcp_call(first_hour, "fmt", "--headless")
    assert is_error is True
    assert fix in text
    assert text in r.stderr
    ran = ctl(first_hour, "invoke", "fmt", "--headless", "--mode", "full")
    assert (ran.returncode, ran.stdout) == (0, "exit 0\nformatted\n"), ran.stderr
    # Under the host policy a declaration does not count: only the mode is offered there,
    # besides the sentence about the policy.
    project = ctl(first_hour, "invoke", "deploy", "--headless")
    assert 'declare "approval"' not in project.stderr
    assert HOST_IGNORES in project.stderr


# -- a tool that is not loaded: which set has it, and why it did not load ---------------


@pytest.mark.parametrize(
    ("tool", "why"),
    [
        (
            "lint",
            "Tool set 'lint' (home, {home}/tools/lint/tools.json) declares it but is disabled: "
            'set "enabled": true in it, or run toolsetctl enable lint --source home.',
        ),
        (
            "typo",
            "Tool set 'typo' (home, {home}/tools/typo/tools.json) was skipped (toolsetctl "
            "validate typo lists every problem): exec requires a command array.",
        ),
        (
            "right",
            "Tool set 'pair' (home, {home}/tools/pair/tools.json) declares it but is hidden by "
            "the project tool set of the same directory name, which replaces it whole.",
        ),
    ],
)
@pytest.mark.anyio
async def test_unknown_tool_of_a_set_that_did_not_load_says_why(
    first_hour: Daemon, tool: str, why: str
) -> None:
    """Calling a tool whose set is disabled, skipped or hidden was "no such tool" and a
    list of loaded tools that does not name it. The refusal now names the set, its
    tools.json and the fix, the same on toolsetctl and MCP."""
    why = why.format(home=first_hour.home)
    r = ctl(first_hour, "invoke", tool, "--format", "json")
    assert r.returncode == 2
    error = _json(r)["error"]
    assert error["code"] == -32001
    assert error["message"].startswith(f"Unknown tool '{tool}': no such tool")
    loaded, said = error["message"].split(". Loaded tools: ", 1)[1].split(". ", 1)
    assert "fmt" in loaded.split(", ")
    assert tool not in loaded.split(", ")
    assert said == why
    is_error, text = await mcp_call(first_hour, tool)
    assert (is_error, text) == (None, error["message"])


def test_unknown_tool_nobody_declares_says_nothing_more(first_hour: Daemon) -> None:
    """A name no set on disk has keeps the plain refusal."""
    r = ctl(first_hour, "invoke", "nothing_has_this")
    assert r.returncode == 2
    assert re.search(r"\. Loaded tools: [a-z0-9, ]+\.$", r.stderr.rstrip()), r.stderr


# -- a command file the system cannot start: the fix, before and after ------------------


@pytest.mark.parametrize("name", sorted(SCRIPTS))
def test_validate_names_what_stops_a_script(first_hour: Daemon, name: str) -> None:
    """validate called these sets valid (all but noexec), and the call then failed with
    "No such file or directory" for a script that is there, or "Exec format error"."""
    folder = first_hour.home / "tools" / name
    path = folder / "run.sh"
    r = ctl(first_hour, "validate", str(folder))
    assert r.returncode == 2, r.stdout
    fix = SCRIPTS[name][1].format(path=path, folder=folder)
    assert r.stdout == (
        f"Tool set {name} is not valid:\n- Command file {path} {fix} (used by {name})\n"
    )


def test_validate_of_a_script_on_a_noexec_mount_does_not_say_chmod(tmp_path: Path) -> None:
    """A script with its x bits, on a file system mounted noexec (a hardened /tmp, a CI
    runner's scratch mount), fails as "Permission denied", and ``access`` says it is not
    executable: validate (and a start failure, which adds the same sentence) told the
    author to run chmod +x on a file that had its x bits. The mount is made in a mount
    namespace of the check's own, so nothing outside sees it."""
    unshare, mount = shutil.which("unshare"), shutil.which("mount")
    if os.geteuid() != 0 or unshare is None or mount is None:
        pytest.skip("a noexec mount of its own needs root, unshare and mount")
    folder = tmp_path / "home" / "tools"  # the home's tools folder, mounted noexec
    write_set(folder, "tool", {**TOOL, "command": ["run.sh"]}, **{"run.sh": "#!/bin/sh\n"})
    path = folder / "tool" / "run.sh"
    path.chmod(0o755)
    script = (
        'mount --bind "$1" "$1" && mount -o remount,bind,noexec "$1" "$1" || exit 99; '
        'shift; exec "$@"'
    )
    r = subprocess.run(
        [unshare, "-m", "--propagation", "private", "sh", "-c", script, "sh", str(folder),
         sys.executable, "-m", "toolsetd.client", "--home", str(folder.parent), "validate",
         str(folder / "tool")],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    if r.returncode == 99:
        pytest.skip(f"no mount namespace of its own here: {r.stderr.strip()[:200]}")
    assert (r.returncode, r.stderr) == (2, "")
    assert r.stdout == (
        f"Tool set tool is not valid:\n- Command file {path} is on a file system mounted "
        "noexec, from which the system starts no program: move the tool set to another file "
        "system, or mount this one without noexec. (used by tool)\n"
    )


@pytest.mark.parametrize("confinement", ["confined", "unconfined"])
@pytest.mark.parametrize("name", sorted(SCRIPTS))
def test_a_call_that_cannot_start_names_the_fix(
    request: pytest.FixtureRequest, confinement: str, name: str
) -> None:
    """The start failure adds the sentence validate prints, whether the daemon checks the
    command before a confined spawn or the spawn itself fails."""
    daemon: Daemon = request.getfixturevalue(
        "first_hour" if confinement == "confined" else "unconfined"
    )
    path = daemon.home / "tools" / name / "run.sh"
    r = ctl(daemon, "invoke", name)
    assert r.returncode == 1, r.stderr
    assert r.stdout.startswith("The external process failed to start: ")
    fix = SCRIPTS[name][1].format(path=path, folder=path.parent)
    assert r.stdout.endswith(f": {path}. Command file {path} {fix}\n")


@pytest.mark.skipif(not os.access("/usr/bin/env", os.X_OK), reason="no /usr/bin/env")
@pytest.mark.parametrize("name", sorted(ENV_SCRIPTS))
def test_validate_names_an_interpreter_env_does_not_find(first_hour: Daemon, name: str) -> None:
    """validate called a set valid whose script's #!/usr/bin/env names a program not on
    PATH (or "sh -e", which env reads as one name); its call then exits 127."""
    folder = first_hour.home / "tools" / name
    path = folder / "run.sh"
    r = ctl(first_hour, "validate", str(folder))
    fix = ENV_SCRIPTS[name][1]
    if fix is None:
        assert (r.returncode, r.stdout) == (0, f"Tool set {name} is valid: 1 tool ({name}).\n")
        return
    assert r.returncode == 2, r.stdout
    assert r.stdout == (
        f"Tool set {name} is not valid:\n- Command file {path} {fix} (used by {name})\n"
    )


@pytest.mark.skipif(not os.access("/usr/bin/env", os.X_OK), reason="no /usr/bin/env")
@pytest.mark.parametrize("confinement", ["confined", "unconfined"])
@pytest.mark.parametrize("name", sorted(ENV_SCRIPTS))
def test_a_call_whose_env_finds_no_interpreter_names_it(
    request: pytest.FixtureRequest, confinement: str, name: str
) -> None:
    """Such a call's result was env's "/usr/bin/env: 'python9': No such file or directory"
    and exit 127 alone, naming neither the script nor the fix, where an absolute #! path
    not installed is named. The sentence follows env's words now; a script that exits
    127 itself (its interpreter found) keeps its output as it is."""
    daemon: Daemon = request.getfixturevalue(
        "first_hour" if confinement == "confined" else "unconfined"
    )
    path = daemon.home / "tools" / name / "run.sh"
    r = ctl(daemon, "invoke", name, "--tool-exit-code")
    assert r.returncode == 127, r.stderr
    fix = ENV_SCRIPTS[name][1]
    if fix is None:
        assert r.stdout == "exit 127\n"
        return
    assert r.stdout.startswith("exit 127\n/usr/bin/env: "), r.stdout
    assert r.stdout.endswith(f"\ntoolsetd: Command file {path} {fix}\n"), r.stdout


@pytest.mark.anyio
@pytest.mark.parametrize("confinement", ["confined", "unconfined"])
async def test_a_crlf_project_script_is_no_sandbox_failure(
    request: pytest.FixtureRequest, confinement: str
) -> None:
    """A project script saved with Windows line endings, sandboxed, was reported as "the
    sandbox could not be set up" (bubblewrap's exec of it failed): the sandbox was fine.
    It is now the start failure that names the file and the fix, on both faces."""
    daemon: Daemon = request.getfixturevalue(
        "first_hour" if confinement == "confined" else "unconfined"
    )
    path = daemon.workspace / ".crystal" / "tools" / "pcrlf" / "run.sh"
    r = ctl(daemon, "invoke", "pcrlf", "--approve")
    assert r.returncode == 1, r.stderr
    fix = SCRIPTS["crlf"][1].format(path=path)
    assert r.stdout == (
        f"The external process failed to start: No such file or directory: {path}. "
        f"Command file {path} {fix}\n"
    )
    is_error, text = await mcp_call(daemon, "pcrlf", "--mode", "full")
    assert (is_error, text) == (True, r.stdout.rstrip("\n"))


@pytest.mark.parametrize("confinement", ["confined", "unconfined"])
@pytest.mark.parametrize("source", ["home", "project"])
def test_a_command_on_path_whose_interpreter_is_gone_names_it(
    tmp_path: Path, confinement: str, source: str
) -> None:
    """A bare command found on ``PATH`` (a console script whose venv was made anew, its
    ``#!`` naming the old one's python): validate called the set valid, a start said only
    "No such file or directory: <name>" of a command that is on PATH, and a sandboxed one
    "the sandbox could not be set up" (the check before it let a bare name by). Each now
    names the file found and its interpreter, as for a command given by its path."""
    env = dict(os.environ)
    fix = (
        "Command file {script} names the interpreter /usr/bin/python9-not-installed on its "
        "#! line, which does not exist: install it, or name one that does."
    )

    def fill(home: Path, workspace: Path) -> None:
        # On PATH in the workspace, which a project set's sandbox shows as it is.
        folder = workspace / "bin"
        folder.mkdir()
        (folder / "py9tool").write_text("#!/usr/bin/python9-not-installed\nprint(1)\n")
        (folder / "py9tool").chmod(0o755)
        env["PATH"] = f"{folder}{os.pathsep}{os.environ.get('PATH', '')}"  # the daemon's too
        tools = home / "tools" if source == "home" else workspace / ".crystal" / "tools"
        write_set(tools, "py9", {**TOOL, "command": ["py9tool"], "approval": "always"})

    config = tmp_path / "toolsetd.toml"
    config.write_text('[confinement]\ncgroup = "off"\nsandbox = "off"\n')
    args = ["--no-watch"] + (["--config", str(config)] if confinement == "unconfined" else [])
    with daemon_in("tfh-", fill, args, env=env) as daemon:
        root = daemon.home if source == "home" else daemon.workspace / ".crystal"
        fixed = fix.format(script=daemon.workspace / "bin" / "py9tool")
        argv = [sys.executable, "-m", "toolsetd.client", "--socket", str(daemon.socket),
                "--workspace", str(daemon.workspace)]  # fmt: skip

        def run(*args: str) -> subprocess.CompletedProcess[str]:
            return subprocess.run([*argv, *args], capture_output=True, text=True, timeout=60,
                                  env=env, check=False)  # fmt: skip

        r = run("validate", str(root / "tools" / "py9"))
        assert (r.returncode, r.stdout) == (
            2, f"Tool set py9 is not valid:\n- {fixed} (used by py9)\n"
        ), r.stderr
        r = run("invoke", "py9", "--approve")
        assert (r.returncode, r.stdout) == (
            1, f"The external process failed to start: No such file or directory: py9tool. "
            f"{fixed}\n"
        ), r.stderr


# -- a CI job whose daemon is not running -------------------------------------------------


def test_a_job_without_a_daemon_is_told_how_to_start_one() -> None:
    """A CI step that calls before any toolsetd runs exits 5 with nothing on stdout, and
    the message on stderr says how to start one; started so, the same step runs."""
    base = Path(tempfile.mkdtemp(prefix="tfh-ci-", dir="/tmp"))
    home, workspace = base / "home", base / "ws"
    workspace.mkdir()
    _fill(home, workspace)
    sock = base / "s.sock"  # where start_daemon puts it
    absent = Daemon(None, sock, home, workspace, base / "daemon.log")  # type: ignore[arg-type]
    r = ctl(absent, "invoke", "fmt", "--headless", "--mode", "full")
    assert (r.returncode, r.stdout) == (5, "")
    assert r.stderr == (
        f"toolsetd is not running at {sock} (no such socket): start it (toolsetd --socket "
        f"{sock}), or give --socket (or TOOLSETD_SOCKET) the socket a running toolsetd "
        "serves.\n"
    )
    daemon = start_daemon(home, workspace, base, ["--no-watch"])
    try:
        assert daemon.socket == sock
        r = ctl(daemon, "invoke", "fmt", "--headless", "--mode", "full")
        assert (r.returncode, r.stdout) == (0, "exit 0\nformatted\n"), r.stderr
    finally:
        daemon.stop()
        shutil.rmtree(base, ignore_errors=True)


def _ci_script() -> str:
    text = (REPO / "docs" / "cli.md").read_text(encoding="utf-8")
    section = text.split("\n## In a CI job\n", 1)[1]
    return section.split("```sh\n", 1)[1].split("```", 1)[0]


def _ci_checkout(base: Path, body: str) -> tuple[Path, Path, dict[str, str]]:
    """A job's checkout in ``base`` whose project set ``lint`` runs the script ``body``, its
    ``TMPDIR``, and the environment the docs' script runs in (this toolsetd on ``PATH``)."""
    checkout, scratch = base / "checkout", base / "tmp"
    scratch.mkdir()
    write_set(
        checkout / ".crystal" / "tools",
        "lint",
        {**TOOL, "command": ["run.sh"]},
        **{"run.sh": body},
    )
    env = {k: v for k, v in os.environ.items() if k not in ("TOOLSETD_SOCKET", "CRYSTAL_HOME")}
    env["PATH"] = f"{Path(sys.executable).parent}:{env.get('PATH', '/usr/bin:/bin')}"
    env["TMPDIR"] = str(scratch)
    return checkout, scratch, env


@pytest.mark.parametrize(("lint", "code", "out"), [(0, 0, "clean"), (3, 3, "2 problems")])
def test_the_ci_job_of_the_docs_runs_as_written(lint: int, code: int, out: str) -> None:
    """docs/cli.md's CI script, run verbatim by bash in a checkout with a project set:
    it starts its own daemon, gates on the tool's exit code, and leaves nothing behind."""
    base = Path(tempfile.mkdtemp(prefix="tfh-job-", dir="/tmp"))
    try:
        checkout, scratch, env = _ci_checkout(base, f"#!/bin/sh\necho '{out}'\nexit {lint}\n")
        r = subprocess.run(
            ["bash", "-c", _ci_script()],
            cwd=checkout,
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        assert (r.returncode, r.stdout) == (code, f"exit {lint}\n{out}\n"), r.stderr
        [folder] = scratch.iterdir()
        assert not (folder / "toolsetd.sock").exists()  # the daemon stopped and cleaned up
    finally:
        shutil.rmtree(base, ignore_errors=True)


def _daemon_of(scratch: Path) -> int | None:
    """The pid of the toolsetd the docs' script started in ``scratch`` (its home is there)."""
    for entry in Path("/proc").iterdir():
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if any(b"toolsetd" in arg for arg in argv) and any(
            arg.startswith(str(scratch).encode()) for arg in argv
        ):
            return int(entry.name)
    return None


def test_the_ci_job_of_the_docs_fails_as_unreachable_when_its_daemon_dies() -> None:
    """docs/cli.md's CI script when its daemon dies mid-call (the OOM killer, a crash): the
    step ends with toolsetctl's 5, and says why, not with the 1 of a tool that failed."""
    base = Path(tempfile.mkdtemp(prefix="tfh-job-", dir="/tmp"))
    try:
        checkout, scratch, env = _ci_checkout(base, "#!/bin/sh\nexec sleep 30\n")
        job = subprocess.Popen(
            ["bash", "-c", _ci_script()],
            cwd=checkout,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            eventually(
                lambda: any("call_started" in log.read_text() for log in scratch.glob("*/*.log")),
                timeout=60,
                what="the job's call started",
            )
            daemon = _daemon_of(scratch)
            assert daemon is not None
            os.kill(daemon, signal.SIGKILL)
            _out, err = job.communicate(timeout=60)
        finally:
            if job.poll() is None:
                job.kill()
                job.wait()
        assert job.returncode == 5, err
        assert "Lost the connection to toolsetd" in err
        assert '"event": "call_started"' in err  # the daemon's log, to say why
    finally:
        shutil.rmtree(base, ignore_errors=True)


# -- a misspelt member -----------------------------------------------------------------


def test_validate_names_a_misspelt_member(first_hour: Daemon) -> None:
    """An unknown member is ignored (as the reference host ignores it), so "comand" was
    only "exec requires a command array." and "pathArgument" left the path unfenced in
    a set that validate called valid. validate names each with the member meant."""
    tools = first_hour.home / "tools"
    ignored = "which toolsetd ignores, as the reference host does: did you mean"
    r = ctl(first_hour, "validate", str(tools / "typo"))
    assert (r.returncode, r.stdout) == (
        2,
        "Tool set typo is not valid:\n- exec requires a command array.\n"
        f"- tools.json has the member 'comand', {ignored} 'command'?\n",
    )
    r = ctl(first_hour, "validate", str(tools / "typo2"), "--format", "json")
    assert r.returncode == 2
    assert _json(r)["problems"] == [
        f"tools.json has the member 'timeout_seconds', {ignored} 'timeoutSeconds'?",
        f"Tool 'cat' has the member 'pathArgument', {ignored} 'pathArguments'?",
        f"Tool 'cat' has the member 'Approval', {ignored} 'approval'?",
    ]
    r = ctl(first_hour, "validate", str(tools / "editor"))
    assert (r.returncode, r.stdout) == (0, "Tool set editor is valid: 1 tool (editor).\n")


# -- a set in the wrong folder -------------------------------------------------------------


def test_validate_says_where_sets_go(first_hour: Daemon) -> None:
    """A set made in the wrong folder was called valid and then loaded nowhere, and a
    folder with no tools.json was "tools.json could not be read.", as if a permission
    were wrong. validate says where toolsetd reads sets, and which folders hold one."""
    home, workspace = first_hour.home, first_hour.workspace
    where = (
        f"it reads the tool sets in {home / 'tools'} (the home's) and "
        f"{workspace / '.crystal' / 'tools'} (this workspace's); move the folder into one "
        "of them.\n"
    )
    r = ctl(first_hour, "validate", str(home / "misplaced"))
    assert (r.returncode, r.stdout) == (
        0,
        f"Tool set misplaced is valid: 1 tool (misplaced).\ntoolsetd does not load it from "
        f"{home}: {where}",
    )
    nest = home / "tools" / "nest"
    r = ctl(first_hour, "validate", str(nest))
    assert (r.returncode, r.stdout) == (
        2,
        f"Tool set nest is not valid:\n- {nest} has no tools.json. The folder inner in it "
        "has one: a tool set is a folder with its own tools.json (toolsetctl validate "
        f"{nest / 'inner'}).\n",
    )
    r = ctl(first_hour, "validate", str(nest / "inner"), "--format", "json")
    assert r.returncode == 0
    assert _json(r)["notes"] == [f"toolsetd does not load it from {nest}: {where.rstrip()}"]
    r = ctl(first_hour, "validate", str(home / "tools"))
    assert r.returncode == 2
    assert f"- {home / 'tools'} has no tools.json. The folders " in r.stdout
    r = ctl(first_hour, "validate", str(home / "tools" / "fmt"))
    assert (r.returncode, r.stdout) == (0, "Tool set fmt is valid: 1 tool (fmt).\n")


# -- the daemon log ---------------------------------------------------------------------


def test_the_log_names_each_note_once(tmp_path: Path) -> None:
    """A service's journal said 'catalog_built notes=1' and nothing of which set, why, or
    where its tools.json is. Each note is logged with its set and file when it first
    appears; the workspace's catalog, which has the home's notes too, says no more."""

    def fill(home: Path, workspace: Path) -> None:
        write_set(home / "tools", "typo", {**TOOL, "comand": ["/bin/true"]})
        write_set(home / "tools", "fine", {**TOOL, "command": ["/bin/true"]})

    with daemon_in("tfh-log-", fill, ["--no-watch"]) as daemon:

        def notes() -> list[dict[str, Any]]:
            return [e for e in daemon.log_events() if e.get("event") == "catalog_note"]

        typo = daemon.home / "tools" / "typo" / "tools.json"
        skipped = {
            "set": "typo",
            "source": "home",
            "path": str(typo),
            "message": "External tool set 'typo' was skipped: exec requires a command array.",
            "level": "warning",
        }
        assert ctl(daemon, "list").returncode == 0  # the workspace's catalog: built now
        assert [{k: e[k] for k in skipped} for e in notes()] == [skipped]
        fine = daemon.home / "tools" / "fine" / "tools.json"
        fine.write_text(json.dumps({**TOOL, "command": ["/bin/true"], "enabled": "no"}))
        assert ctl(daemon, "reload", "--all").returncode == 0
        broken = {
            **skipped,
            "set": "fine",
            "path": str(fine),
            "message": "External tool set 'fine' was skipped: enabled must be a boolean.",
        }
        assert [{k: e[k] for k in skipped} for e in notes()] == [skipped, broken]


# -- a CI script's command line ------------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "hint"),
    [
        (["list", "--json"], "unrecognized arguments: --json; for --json, give --format json"),
        (
            ["invoke", "fmt", "--arg", "{}"],
            "unrecognized arguments: --arg {}; did you mean --args? (options are spelled in full)",
        ),
        (
            ["invoke", "fmt", "--headles"],
            "; did you mean --headless? (options are spelled in full)",
        ),
        (
            ["invoke", "fmt", "--aprove"],
            "unrecognized arguments: --aprove; did you mean --approve?",
        ),
        (["--sock", "s.sock", "list"], "invalid choice: 's.sock' (choose from "),
        (["--sock", "s.sock", "list"], "; did you mean --socket? (options are spelled in full)"),
    ],
)
def test_an_unknown_option_names_the_one_meant(
    first_hour: Daemon, args: list[str], hint: str
) -> None:
    """Options are spelled in full, so an abbreviation, a misspelling or another tool's
    --json was a usage error that named no way out (--sock S even read S as the command)."""
    r = ctl(first_hour, *args)
    assert (r.returncode, r.stdout) == (2, ""), r.stderr
    assert hint in r.stderr.splitlines()[-1]


def test_an_option_of_another_command_is_not_suggested(first_hour: Daemon) -> None:
    """Only the command's own options are offered: --approve is invoke's, not list's."""
    r = ctl(first_hour, "list", "--approve")
    assert r.returncode == 2
    assert r.stderr.splitlines()[-1] == "toolsetctl: error: unrecognized arguments: --approve"


def test_args_naming_a_file_says_to_give_it_with_an_at(first_hour: Daemon, tmp_path: Path) -> None:
    """--args args.json (for --args @args.json) was "not valid JSON: Expecting value", of a
    file its author knew to be valid JSON."""
    args = tmp_path / "args.json"
    args.write_text("{}")
    r = ctl(first_hour, "invoke", "fmt", "--args", str(args), "--headless", "--mode", "full")
    assert (r.returncode, r.stdout) == (2, "")
    assert r.stderr == (
        "--args is not valid JSON: Expecting value: line 1 column 1 (char 0) "
        f"({args} is a file: give --args @{args} to read the arguments from it)\n"
    )
    r = ctl(first_hour, "invoke", "fmt", "--args", f"@{args}", "--headless", "--mode", "full")
    assert (r.returncode, r.stdout) == (0, "exit 0\nformatted\n"), r.stderr


# -- two sets with one tool name -----------------------------------------------------------


def test_a_name_two_sets_declare_says_which_sets(first_hour: Daemon, tmp_path: Path) -> None:
    """The reference host's note names the tool, not the set that lost it nor the one
    that has it. toolsetctl list adds both, and the fix, with a daemon and without."""
    said = (
        "- External tool 'clash' was omitted because the name is already registered. "
        "It is tool set clashB's (home); the 'clash' that loaded is tool set clashA's "
        "(home): rename one of them."
    )
    r = ctl(first_hour, "list")
    assert r.returncode == 0
    assert said in r.stdout.splitlines()
    offline = ctl(
        first_hour, "--socket", str(tmp_path / "none.sock"), "--home", str(first_hour.home), "list"
    )
    assert offline.returncode == 0, offline.stderr
    assert said in offline.stdout.splitlines()
    notes = _json(ctl(first_hour, "list", "--format", "json"))["notes"]
    assert {"set": "clashB", "source": "home", "message": said[2:].split(" It is")[0]} in notes


# -- pathArguments and argv that name no property ---------------------------------------------


def test_validate_names_path_and_argv_names_the_schema_lacks(
    first_hour: Daemon, tmp_path: Path
) -> None:
    """Neither is checked against the schema when the set loads (nor by the reference
    host): a pathArguments name the schema does not have left the real path argument
    unfenced, and a misspelt argv key a flag never passed, in a set validate called
    valid. A schema that can admit other properties (allOf, patternProperties ...) is
    not second-guessed."""
    schema = {"type": "object", "properties": {"path": {"type": "string"}}}
    manifest = {**TOOL, "schema": schema, "command": ["/bin/cat"]}
    folder = write_set(
        tmp_path, "reader", {**manifest, "pathArguments": ["file"], "argv": {"paht": "--path"}}
    )
    r = ctl(first_hour, "validate", str(folder), "--format", "json")
    assert r.returncode == 2
    assert _json(r)["problems"] == [
        "Tool 'reader' pathArguments names 'file', which is not among its schema's properties "
        "(path), so the path it was meant for goes unfenced.",
        "Tool 'reader' argv names 'paht', which is not among its schema's properties (path), "
        "so its flag is never passed: did you mean 'path'?",
    ]
    fine = write_set(tmp_path, "fine", {**manifest, "pathArguments": ["path"]})
    open_schema = {**schema, "patternProperties": {"^f": {"type": "string"}}}
    wider = write_set(
        tmp_path, "wider", {**manifest, "schema": open_schema, "pathArguments": ["file"]}
    )
    for folder in (fine, wider):
        r = ctl(first_hour, "validate", str(folder), "--format", "json")
        assert (r.returncode, _json(r)["problems"]) == (0, []), r.stdout


# -- a host's variable left unexpanded ------------------------------------------------


def test_a_workspace_variable_the_host_left_unexpanded_is_named(
    first_hour: Daemon, tmp_path: Path
) -> None:
    """Cursor and VS Code leave ``${workspaceFolder}`` as it is when no folder is open, so
    ``toolsetctl mcp`` got that text for its workspace and said only that the path (the
    current folder joined with it) is no directory. Every face now names the variable
    and the fix: the pump, a command through the daemon, and one with no daemon."""
    hint = (
        "It holds '${workspaceFolder}', a variable its host did not expand (Cursor and VS Code "
        "leave ${workspaceFolder} so when no folder is open): open a folder, or give the "
        "folder's own path."
    )
    argv = [sys.executable, "-m", "toolsetd.client", "--socket", str(first_hour.socket)]
    unexpanded = ["--workspace", "${workspaceFolder}"]
    pump = subprocess.run(
        [*argv, *unexpanded, "mcp", "--no-autostart"],
        input="", capture_output=True, text=True, timeout=60, check=False, cwd=tmp_path,
    )
    assert pump.returncode == 2
    assert f"'{tmp_path}/${{workspaceFolder}}' is not a directory" in pump.stderr
    assert hint in pump.stderr
    listed = subprocess.run(
        [*argv, *unexpanded, "list"],
        capture_output=True, text=True, timeout=60, check=False, cwd=tmp_path,
    )
    assert listed.returncode == 2
    assert hint in listed.stderr
    offline = subprocess.run(
        [sys.executable, "-m", "toolsetd.client", "--socket", str(tmp_path / "none.sock"),
         *unexpanded, "list"],
        capture_output=True, text=True, timeout=60, check=False, cwd=tmp_path,
    )
    assert offline.returncode == 2
    assert hint in offline.stderr
    plain = ctl(first_hour, "--workspace", str(tmp_path / "gone"), "list")
    assert plain.returncode == 2
    assert "It holds" not in plain.stderr
    # As sent by a client that does not make it absolute (an HTTP URL's workspace=, a
    # client of the socket): a relative path, with the same variable in it.
    error = first_hour.call("list", {"workspace": "${workspaceFolder}"})["error"]
    assert error["code"] == -32006
    assert error["message"].endswith(f"got a relative path. {hint}")
    relative = first_hour.call("list", {"workspace": "ws"})["error"]["message"]
    assert relative.endswith("got a relative path.")


def test_a_host_variable_named_in_the_hint_is_quoted_as_the_path_is(
    first_hour: Daemon, tmp_path: Path
) -> None:
    """The hint named the variable bare: ``${...}`` holds anything but ``}`` and ``$``, so
    one with an ESC in it and one with ``\\x1b`` typed there read alike (every face shows
    the ESC as its escape), where the path beside it, quoted, tells them apart; and one
    with a space ran into the sentence. It is quoted as the path is now."""
    shown = {}
    for variable in ("${my\x1bfolder}", "${my\\x1bfolder}", "${my folder}"):
        r = ctl(first_hour, "--workspace", variable, "list")
        assert r.returncode == 2, r.stdout + r.stderr
        shown[variable] = r.stderr
        assert f"It holds {variable!r}, a variable its host did not expand" in r.stderr
    assert len(set(shown.values())) == 3
