"""Tests for the invocation policy: modes, the decision table, and classify."""

from __future__ import annotations

import itertools
import json
import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from toolsetd.daemon.model import (
    Approval,
    ApprovalSource,
    CatalogName,
    LoadedTool,
    RunnerKind,
    Source,
    ToolDef,
    ToolSet,
)
from toolsetd.daemon.paths import Scope
from toolsetd.daemon.policy import (
    DECISION_TABLE,
    Classification,
    Decision,
    Mode,
    Rule,
    classify,
    decide,
)

from tests.budget import examples

DOCS = Path(__file__).resolve().parents[2] / "docs" / "policy.md"

# --- the decision table --------------------------------------------------------------

WORKSPACE_GRANTS = ("once", "session", "persistent")


def expected_rule(scope: Scope, mode: Mode, approval: Approval, headless: bool) -> Rule:
    """The reference host's table (crystal-behaviour.md section 5), written out independently."""
    reviewing = mode in (Mode.REVIEW, Mode.AUDIT)
    if scope == Scope.FORBIDDEN:
        # Only the operator: the reviewer's allow does not count, so ask in every mode.
        decision = Decision.ASK
    elif scope == Scope.OUTSIDE:
        # Never automatic; review modes consult the reviewer first.
        decision = Decision.REVIEW if reviewing else Decision.ASK
    elif approval == Approval.ALWAYS or mode == Mode.FULL:
        decision = Decision.ALLOW
    else:
        decision = Decision.REVIEW if reviewing else Decision.ASK
    if headless and decision == Decision.ASK:
        decision = Decision.DENY
    if decision in (Decision.ALLOW, Decision.DENY):
        grants: tuple[str, ...] = ()
    elif scope == Scope.WORKSPACE:
        grants = WORKSPACE_GRANTS
    else:
        grants = ("once",)
    return Rule(decision, scope == Scope.FORBIDDEN, grants)


ALL_COMBINATIONS = list(itertools.product(Scope, Mode, Approval, (False, True)))


def test_decision_table_covers_every_combination() -> None:
    """The table has exactly one rule for each of the 72 combinations."""
    assert len(ALL_COMBINATIONS) == 72
    assert set(DECISION_TABLE) == set(ALL_COMBINATIONS)


@pytest.mark.parametrize(("scope", "mode", "approval", "headless"), ALL_COMBINATIONS)
def test_decide_matches_reference_table(
    scope: Scope, mode: Mode, approval: Approval, headless: bool
) -> None:
    """Every cell of the table matches the independent reading of the reference table."""
    assert decide(scope, mode, approval, headless) == expected_rule(scope, mode, approval, headless)


@pytest.mark.parametrize(("scope", "mode", "approval", "headless"), ALL_COMBINATIONS)
def test_decide_safety_invariants(
    scope: Scope, mode: Mode, approval: Approval, headless: bool
) -> None:
    """Only workspace calls run unasked; forbidden calls always need the operator."""
    rule = decide(scope, mode, approval, headless)
    if rule.decision == Decision.ALLOW:
        assert scope == Scope.WORKSPACE
    if scope == Scope.FORBIDDEN:
        assert rule.require_prompt
        assert rule.decision in (Decision.ASK, Decision.DENY)
    if headless:
        assert rule.decision != Decision.ASK
    if scope != Scope.WORKSPACE:
        assert set(rule.grant_scopes) <= {"once"}


def test_decide_accepts_wire_strings() -> None:
    """Plain strings from the wire look up the same rules."""
    rule = decide("workspace", "full", "inherit", False)  # type: ignore[arg-type]
    assert rule.decision == Decision.ALLOW
    with pytest.raises(ValueError, match="auto"):
        decide(Scope.WORKSPACE, "auto", Approval.INHERIT, False)  # type: ignore[arg-type]


def test_docs_table_matches_code() -> None:
    """docs/policy.md prints the same table as the code, cell for cell."""
    rows = [
        [cell.strip().strip("`*") for cell in line.strip().strip("|").split("|")]
        for line in DOCS.read_text(encoding="utf-8").splitlines()
        if re.match(r"^\|\s*`?(workspace|outsideWorkspace|forbidden)`?\s*\|", line)
    ]
    modes = [Mode.PLAN, Mode.DEFAULT, Mode.EDIT, Mode.REVIEW, Mode.AUDIT, Mode.FULL]
    seen = set()
    for scope, approval, headless, *cells in rows:
        assert len(cells) == len(modes)
        for mode, cell in zip(modes, cells, strict=True):
            key = (Scope(scope), mode, Approval(approval), {"no": False, "yes": True}[headless])
            assert DECISION_TABLE[key].decision.value == cell, key
            seen.add(key)
    assert seen == set(DECISION_TABLE)


# --- classify ------------------------------------------------------------------------


@pytest.fixture
def root(tmp_path: Path) -> Path:
    """A canonical temporary root."""
    return Path(os.path.realpath(tmp_path))


@pytest.fixture
def home(root: Path) -> Path:
    """A fake user profile with ``.ssh/id_rsa``."""
    path = root / "home"
    (path / ".ssh").mkdir(parents=True)
    (path / ".ssh" / "id_rsa").write_text("secret")
    return path


@pytest.fixture
def ws(root: Path) -> Path:
    """A canonical workspace."""
    path = root / "ws"
    path.mkdir()
    (path / "file.txt").write_text("x")
    return path


def loaded(
    *path_arguments: str,
    declared: Approval = Approval.INHERIT,
    policy: ApprovalSource = ApprovalSource.AUTHOR,
) -> LoadedTool:
    """A loaded exec tool with the given path arguments and approval."""
    tool = ToolDef(
        name="fmt",
        description="Format a file.",
        schema={"type": "object"},
        catalogs=frozenset({CatalogName.WORK}),
        approval=declared,
        path_arguments=path_arguments,
    )
    toolset = ToolSet(
        directory="formatters",
        source=Source.HOME,
        path=Path("/nonexistent/formatters"),
        runner=RunnerKind.EXEC,
        tools=(tool,),
    )
    effective = Approval.INHERIT if policy == ApprovalSource.HOST else declared
    return LoadedTool(tool, toolset, effective, policy, "sha256:0")


def run(
    tool: LoadedTool,
    arguments: Any,
    ws: Path,
    home: Path,
    mode: Mode | str = Mode.DEFAULT,
    headless: bool = False,
) -> Classification:
    """Classify and check the wire form is JSON."""
    result = classify(tool, arguments, ws, mode, headless, home)
    json.dumps(result.to_wire())
    return result


def test_classify_floor_without_path_arguments(ws: Path, home: Path) -> None:
    """A tool without path arguments gets the floor: write, workspace."""
    result = run(loaded(), {"path": "~/.ssh/id_rsa"}, ws, home)
    assert result.authority == "write"
    assert result.scope == Scope.WORKSPACE
    assert result.paths == ()
    assert result.decision == Decision.ASK
    assert result.grant_scopes == ("once", "session", "persistent")
    assert result.reason == (
        "External tools need approval in default mode; this call stays inside the workspace."
    )
    assert result.arguments == {"path": "~/.ssh/id_rsa"}


@pytest.mark.parametrize(
    ("mode", "declared", "policy", "headless"),
    list(itertools.product(Mode, Approval, ApprovalSource, (False, True))),
)
def test_classify_pathless_fast_path_matches_the_general_one(
    ws: Path, home: Path, mode: Mode, declared: Approval, policy: ApprovalSource, headless: bool
) -> None:
    """A tool without path arguments is classified exactly as one whose path arguments are
    all absent (the general path), in every mode, approval, policy and headless state."""
    arguments = {"q": 1, "path": "/etc/passwd"}
    fast = run(loaded(declared=declared, policy=policy), arguments, ws, home, mode, headless)
    general = run(
        loaded("absent", declared=declared, policy=policy), arguments, ws, home, mode, headless
    )
    assert fast == general
    assert fast.arguments is arguments


def test_classify_wire_shape(ws: Path, home: Path) -> None:
    """``to_wire`` gives exactly the contract's camelCase fields."""
    tool = loaded("path", declared=Approval.ALWAYS, policy=ApprovalSource.HOST)
    wire = run(tool, {"path": "file.txt", "n": 1}, ws, home, Mode.FULL).to_wire()
    assert wire == {
        "tool": "fmt",
        "set": "formatters",
        "source": "home",
        "authority": "write",
        "scope": "workspace",
        "paths": [
            {
                "argument": "path",
                "value": "file.txt",
                "resolved": str(ws / "file.txt"),
                "scope": "workspace",
            }
        ],
        "approval": {"declared": "always", "policy": "host", "effective": "inherit"},
        "requirePrompt": False,
        "grantScopes": [],
        "decision": "allow",
        "reason": "Full mode runs external tools without asking; "
        "this call stays inside the workspace.",
        "arguments": {"path": str(ws / "file.txt"), "n": 1},
    }
    assert all(type(v) in (str, bool, list, dict) for v in wire.values())


def test_classify_always_runs_in_workspace(ws: Path, home: Path) -> None:
    """Effective ``always`` runs a workspace call in every mode, without asking."""
    tool = loaded("path", declared=Approval.ALWAYS)
    for mode in Mode:
        result = run(tool, {"path": "file.txt"}, ws, home, mode)
        assert result.decision == Decision.ALLOW
        assert "'always'" in result.reason


def test_classify_outside_path(ws: Path, home: Path) -> None:
    """An absolute path outside the workspace asks, offering once only."""
    result = run(loaded("path"), {"path": "/etc//passwd/"}, ws, home, Mode.FULL)
    assert result.scope == Scope.OUTSIDE
    assert result.decision == Decision.ASK
    assert result.grant_scopes == ("once",)
    assert result.arguments == {"path": "/etc/passwd"}
    assert "Argument 'path' resolves to /etc/passwd, outside the workspace" in result.reason


def test_classify_dotdot_escape(ws: Path, home: Path, root: Path) -> None:
    """``work/../../etc/passwd`` climbs out of the workspace: outside."""
    result = run(loaded("path"), {"path": "work/../../etc/passwd"}, ws, home)
    assert result.scope == Scope.OUTSIDE
    assert result.paths[0].resolved == str(root / "etc" / "passwd")


def test_classify_tilde_ssh_is_forbidden(ws: Path, home: Path) -> None:
    """``~/.ssh/id_rsa`` is forbidden: ask, requirePrompt, once only."""
    result = run(loaded("path"), {"path": "~/.ssh/id_rsa"}, ws, home, Mode.FULL)
    assert result.scope == Scope.FORBIDDEN
    assert result.decision == Decision.ASK
    assert result.require_prompt is True
    assert result.grant_scopes == ("once",)
    assert result.reason == (
        f"Argument 'path' resolves to {home}/.ssh/id_rsa, a credential path: "
        "only the operator can approve it, once."
    )


def test_classify_link_into_ssh_is_forbidden(ws: Path, home: Path) -> None:
    """A workspace link into ``~/.ssh`` is caught on the resolved path."""
    (ws / "notes.txt").symlink_to(home / ".ssh" / "id_rsa")
    result = run(loaded("path"), {"path": "notes.txt"}, ws, home, Mode.AUDIT)
    assert result.scope == Scope.FORBIDDEN
    assert result.decision == Decision.ASK
    assert result.arguments == {"path": str(home / ".ssh" / "id_rsa")}
    assert "reviewing model's allow does not count" in result.reason


def test_classify_link_out_then_dotdot(ws: Path, home: Path, root: Path) -> None:
    """A link out of the workspace followed by ``..`` stays outside."""
    (root / "out" / "deep").mkdir(parents=True)
    (ws / "o").symlink_to(root / "out" / "deep")
    result = run(loaded("path"), {"path": "o/../x"}, ws, home)
    assert result.scope == Scope.OUTSIDE
    assert result.arguments == {"path": str(root / "out" / "x")}


def test_classify_child_gets_the_path_it_judged(
    ws: Path, home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A link swapped while the call is judged never hands the child an unjudged path.

    The swap is made during the credential check, between the scoping of the path and
    the rewrite of the arguments: a second resolution there would give the child
    ``~/.ssh/id_rsa`` under a name that was scoped ``workspace`` and allowed headless.
    """
    from toolsetd.daemon import paths

    (ws / "l").symlink_to(ws / "file.txt")
    real = paths.credential_identities

    def swap_then_read(
        user_home: Path, crystal_home: Path | None = None
    ) -> frozenset[tuple[int, int]]:
        (ws / "l").unlink(missing_ok=True)
        (ws / "l").symlink_to(home / ".ssh" / "id_rsa")
        return real(user_home, crystal_home)

    monkeypatch.setattr(paths, "credential_identities", swap_then_read)
    result = run(loaded("path", declared=Approval.ALWAYS), {"path": "l"}, ws, home, headless=True)
    assert result.paths[0].resolved == str(ws / "file.txt")
    assert result.arguments == {"path": str(ws / "file.txt")}
    assert result.decision == Decision.ALLOW


def test_classify_symlinked_workspace(ws: Path, home: Path, root: Path) -> None:
    """A workspace given through a link still scopes its own files as workspace."""
    link = root / "wslink"
    link.symlink_to(ws)
    result = run(loaded("path"), {"path": str(link / "file.txt")}, link, home, Mode.FULL)
    assert result.scope == Scope.WORKSPACE
    assert result.decision == Decision.ALLOW
    assert result.arguments == {"path": str(ws / "file.txt")}


def test_classify_tilde_user_is_workspace(ws: Path, home: Path) -> None:
    """``~root`` is a workspace name, and the child receives that workspace path."""
    result = run(loaded("path"), {"path": "~root"}, ws, home, Mode.FULL)
    assert result.scope == Scope.WORKSPACE
    assert result.arguments == {"path": str(ws / "~root")}


def test_classify_worst_scope_wins_credential_last(ws: Path, home: Path) -> None:
    """A credential path wins over an outside path, whatever its position."""
    tool = loaded("a", "b", "c")
    arguments = {"c": "~/.ssh", "a": "file.txt", "b": "/etc/passwd"}
    result = run(tool, arguments, ws, home)
    assert [p.argument for p in result.paths] == ["a", "b", "c"]
    assert [p.scope for p in result.paths] == [Scope.WORKSPACE, Scope.OUTSIDE, Scope.FORBIDDEN]
    assert result.scope == Scope.FORBIDDEN
    assert result.reason.startswith("Argument 'c' resolves to")
    assert list(result.arguments) == ["c", "a", "b"]


@pytest.mark.parametrize(
    ("value", "detail"),
    [("\x00", "NUL"), ("x" * 5000, "longer"), ("y" * 300, "component"), ("loop", "loop")],
)
def test_classify_unresolvable_fails_closed(ws: Path, home: Path, value: str, detail: str) -> None:
    """A path that cannot be resolved is outside (never workspace), and invoke will refuse it."""
    (ws / "loop").symlink_to("loop")
    result = run(loaded("path"), {"path": value}, ws, home, Mode.FULL)
    assert result.scope == Scope.OUTSIDE
    assert result.decision == Decision.ASK
    assert result.paths[0].resolved is None
    assert "cannot be resolved" in result.reason
    assert detail in result.reason
    assert result.arguments == {"path": value}
    assert result.arguments_error == "Path is not valid."


def test_classify_unresolvable_credential_is_forbidden(ws: Path, home: Path) -> None:
    """A credential raw text is forbidden even when it cannot be resolved."""
    result = run(loaded("path"), {"path": "~/.ssh/id_rsa\x00"}, ws, home)
    assert result.scope == Scope.FORBIDDEN
    assert result.require_prompt


@pytest.mark.parametrize("value", ["", "   "])
def test_classify_blank_is_skipped_and_flagged(ws: Path, home: Path, value: str) -> None:
    """A blank path is not inspected, but the fence's refusal is reported."""
    result = run(loaded("path"), {"path": value}, ws, home)
    assert result.paths == ()
    assert result.scope == Scope.WORKSPACE
    assert result.arguments_error == "Argument 'path' must be a path string."
    assert result.reason.endswith(
        "The arguments are refused: Argument 'path' must be a path string."
    )


@pytest.mark.parametrize("arguments", [["x"], "x", 3, None])
def test_classify_non_object_arguments(ws: Path, home: Path, arguments: Any) -> None:
    """Non-object arguments get the floor, and the fence's refusal is reported."""
    result = run(loaded("path"), arguments, ws, home)
    assert result.scope == Scope.WORKSPACE
    assert result.arguments == arguments
    assert result.arguments_error == "Arguments must be a JSON object."


@pytest.mark.parametrize("value", [None, 3, 2.5, True, False])
def test_classify_scalar_non_strings_pass_through(ws: Path, home: Path, value: Any) -> None:
    """Numbers, booleans and null name no path: the floor, and unchanged arguments."""
    result = run(loaded("path"), {"path": value}, ws, home, Mode.FULL)
    assert result.paths == ()
    assert result.decision == Decision.ALLOW
    assert result.arguments == {"path": value}
    assert result.arguments_error is None


@pytest.mark.parametrize(
    ("value", "scope"),
    [
        (["file.txt"], Scope.OUTSIDE),
        ({"p": "file.txt"}, Scope.OUTSIDE),
        ([], Scope.OUTSIDE),
        (["~/.ssh/id_rsa"], Scope.FORBIDDEN),
        ([[{"deep": [".gnupg"]}]], Scope.FORBIDDEN),
        ({".ssh": 1}, Scope.FORBIDDEN),
        (["key"], Scope.FORBIDDEN),
        ([f"f{i}" for i in range(100)], Scope.FORBIDDEN),
    ],
)
def test_classify_container_values_fail_closed(
    ws: Path, home: Path, value: Any, scope: Scope
) -> None:
    """Arrays and objects in a path argument are never workspace; credentials: forbidden."""
    (ws / "key").symlink_to(home / ".ssh")
    result = run(loaded("path"), {"path": value}, ws, home, Mode.FULL)
    assert result.scope == scope
    assert result.decision == Decision.ASK
    assert result.paths[0].resolved is None
    assert result.arguments == {"path": value}


@pytest.mark.parametrize(
    "value",
    [
        ["/proc/self/cwd/key"],
        {"p": "/proc/thread-self/cwd/key"},
        ["/dev/fd/../cwd/key"],
        ["proc/cwd/key"],
        ["/proc/self/status"],
    ],
)
def test_classify_container_strings_through_proc_self_are_forbidden(
    ws: Path, home: Path, value: Any
) -> None:
    """The tool follows a string inside an array or object itself, and /proc/self (with
    /proc/thread-self, /dev/fd, /dev/stdin) is then its own process, working in the
    workspace: /proc/self/cwd/key is the workspace's link to ~/.ssh for it, whatever the
    daemon's /proc/self leads to. Such a string cannot be judged here, so it counts as
    forbidden: the reviewer's allow must not pass it, and headless it is denied."""
    (ws / "key").symlink_to(home / ".ssh" / "id_rsa")
    (ws / "proc").symlink_to("/proc/self")
    result = run(loaded("path"), {"path": value}, ws, home, Mode.REVIEW, headless=True)
    assert result.scope == Scope.FORBIDDEN
    assert result.decision == Decision.DENY
    assert result.require_prompt
    assert "/proc/self" in result.reason
    # A string argument is different: the tool receives the daemon's resolution of it.
    direct = run(loaded("path"), {"path": "/proc/self/status"}, ws, home, Mode.REVIEW)
    assert direct.scope == Scope.OUTSIDE
    assert direct.arguments == {"path": f"/proc/{os.getpid()}/status"}


@pytest.mark.parametrize(
    "text",
    [
        "./" * 2100 + "key",  # too long for the kernel; Python's resolve drops the ./
        "x" * 300 + "/../key",  # a name too long, then ..: dropped before links are followed
        "key\x00.txt",  # a C tool stops at the NUL byte
    ],
    ids=["too-long", "long-name", "nul"],
)
def test_classify_container_strings_read_as_tools_read_them_are_judged(
    ws: Path, home: Path, text: str
) -> None:
    """A string inside an array or object that the kernel cannot resolve is judged as tools
    read it too: Python's ``resolve`` (Node's too) drops ``./`` and ``name/..`` before
    following links, and took both long strings to the workspace's link ``key`` to
    ``~/.ssh/id_rsa``; a C tool stops at a NUL byte. They counted as outsideWorkspace, so a
    reviewer's allow ran the call and the tool read the key. Now they are forbidden: only
    the operator may pass them, and headless they are denied. The same string as a string
    argument is refused at invoke (the tool would receive the daemon's resolution, and
    there is none). A long text that is no path, or leads nowhere forbidden read so,
    stays outsideWorkspace: an edit tool's objects carry text beside their paths."""
    (ws / "key").symlink_to(home / ".ssh" / "id_rsa")
    (ws / "notes").mkdir()
    nested = run(loaded("path"), {"path": ["notes.txt", text]}, ws, home, Mode.REVIEW,
                 headless=True)
    assert nested.scope == Scope.FORBIDDEN
    assert nested.decision == Decision.DENY
    assert nested.require_prompt
    direct = run(loaded("path"), {"path": text}, ws, home, Mode.REVIEW)
    assert (direct.scope, direct.arguments_error) == (Scope.OUTSIDE, "Path is not valid.")
    harmless = text.replace("key", "notes")
    for value in ([harmless], [{"path": "src/a.py", "new_text": "x = 1  # " + "a" * 300}],
                  ["word " * 900]):
        kept = run(loaded("path"), {"path": value}, ws, home, Mode.REVIEW)
        assert (kept.scope, kept.decision) == (Scope.OUTSIDE, Decision.REVIEW), value


def _free_pid() -> int:
    """A process id no process has now (the highest free one below ``pid_max``)."""
    pid = int(Path("/proc/sys/kernel/pid_max").read_text()) - 1
    while Path(f"/proc/{pid}").exists():
        pid -= 1
    return pid


@pytest.mark.skipif(not Path("/proc/self").is_symlink(), reason="needs procfs at /proc")
def test_classify_paths_through_a_process_not_there_are_not_judged_as_missing(
    ws: Path, home: Path
) -> None:
    """/proc/<pid> of no process now is no missing name to keep as written: the tool started
    for the call may be that process (pids are handed out in order, and the model can learn
    a recent one), and then /proc/<pid>/cwd is its workspace: /proc/<pid>/cwd/key reaches the
    workspace's link to ~/.ssh, judged outside the workspace (a reviewer's allow passed it).
    A string argument such a path is refused (fail closed, as for any path that cannot be
    resolved); inside an array or object, which the tool follows itself, it is forbidden,
    as /proc/self is."""
    (ws / "key").symlink_to(home / ".ssh" / "id_rsa")
    where = f"/proc/{_free_pid()}/cwd/key"
    direct = run(loaded("path"), {"path": where}, ws, home, Mode.REVIEW)
    assert direct.paths[0].resolved is None
    assert direct.scope == Scope.OUTSIDE
    assert direct.arguments_error == "Path is not valid."
    nested = run(loaded("path"), {"path": [where]}, ws, home, Mode.REVIEW, headless=True)
    assert nested.scope == Scope.FORBIDDEN
    assert nested.decision == Decision.DENY
    # A process that is there is resolved, in the daemon's view, and the child gets that.
    mine = run(loaded("path"), {"path": f"/proc/{os.getpid()}/status"}, ws, home, Mode.REVIEW)
    assert mine.arguments == {"path": f"/proc/{os.getpid()}/status"}
    assert mine.arguments_error is None


@pytest.mark.skipif(not Path("/proc/self").is_symlink(), reason="needs procfs at /proc")
@pytest.mark.parametrize("value", [["/proc/1/cwd/key"], {"p": "/proc/PID/status"}])
def test_classify_container_strings_through_a_live_process_are_forbidden(
    ws: Path, home: Path, value: Any
) -> None:
    """The links of /proc/<pid> (``cwd``, ``root``, ``fd/<n>``) are not followed by their
    text: the kernel takes the tool to that process's own folder and root, in its mount
    namespace, and in a sandboxed call's PID namespace /proc/1 and /proc/2 are the call's
    own processes, working in the workspace. The daemon's walk reads the text in its own
    namespaces, so for a string the tool follows itself it judged another place than the
    tool reaches: such a string is forbidden, as /proc/self is. A string argument still
    gets the daemon's resolution, which the tool receives."""
    (ws / "key").symlink_to(home / ".ssh" / "id_rsa")
    text = json.dumps(value).replace("PID", str(os.getpid()))
    result = run(loaded("path"), {"path": json.loads(text)}, ws, home, Mode.REVIEW, headless=True)
    assert result.scope == Scope.FORBIDDEN
    assert result.decision == Decision.DENY
    assert result.require_prompt
    direct = run(loaded("path"), {"path": f"/proc/{os.getpid()}/status"}, ws, home, Mode.REVIEW)
    assert direct.arguments == {"path": f"/proc/{os.getpid()}/status"}
    assert direct.scope == Scope.OUTSIDE


@pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("unshare") is None,
    reason="needs root and unshare(1) for a mount namespace",
)
def test_classify_container_strings_into_another_mount_namespace_are_forbidden(
    root: Path, ws: Path, home: Path
) -> None:
    """A process of the user in another mount namespace (a container, a flatpak) with the
    user's ~/.ssh bound at another path: /proc/<pid>/root<that path>/id_rsa is the key for
    the kernel, while the daemon's walk read ``root``'s text ("/") and judged a path of its
    own namespace, missing there: outsideWorkspace, which a reviewer's allow passed, and
    the tool read the key."""
    keys = root / "keys"
    keys.mkdir()
    holder = subprocess.Popen(
        [
            "unshare",
            "-m",
            "--propagation",
            "private",
            "sh",
            "-c",
            'mount --bind "$0" "$1" && echo ready && exec sleep 60',
            home / ".ssh",
            keys,
        ],
        stdout=subprocess.PIPE,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline() == b"ready\n"
        target = f"/proc/{holder.pid}/root{keys}/id_rsa"
        assert Path(target).read_text() == "secret"  # what the tool reads
        result = run(loaded("path"), {"path": [target]}, ws, home, Mode.REVIEW)
        assert result.scope == Scope.FORBIDDEN
        assert result.require_prompt
    finally:
        holder.kill()
        holder.communicate()


@pytest.mark.parametrize("value", [["~/id_rsa"], [" key"], {"p": ["key\n"]}, [" "]])
def test_classify_container_strings_are_judged_as_written_too(
    ws: Path, home: Path, value: Any
) -> None:
    """A string inside an array or object reaches the tool as written, and the kernel
    neither trims it nor expands ~: "~/id_rsa" is <workspace>/~/id_rsa for a tool that
    opens it, " key" is <workspace>/" key". Where those are links to ~/.ssh, the call is
    forbidden, as the same strings trimmed and expanded (as a string argument is) are."""
    (ws / "~").symlink_to(home / ".ssh")
    for name in (" key", "key\n", " "):
        (ws / name).symlink_to(home / ".ssh" / "id_rsa")
    result = run(loaded("path"), {"path": value}, ws, home, Mode.AUDIT, headless=True)
    assert result.scope == Scope.FORBIDDEN
    assert result.decision == Decision.DENY
    assert result.arguments == {"path": value}


def test_classify_headless_denies_ask(ws: Path, home: Path) -> None:
    """Headless, an ask becomes deny with the headless sentence first, and what would let
    it run last."""
    result = run(loaded("path"), {"path": "file.txt"}, ws, home, Mode.DEFAULT, headless=True)
    assert result.decision == Decision.DENY
    assert result.grant_scopes == ()
    assert result.reason == (
        "Headless run: a call that needs a person's approval is denied. "
        "External tools need approval in default mode; this call stays inside the workspace. "
        'To let it run headless, declare "approval": "always" for the tool in its '
        "tools.json, or run in full mode (--mode full; mode=full in an MCP URL)."
    )


@pytest.mark.parametrize("headless", [False, True])
def test_classify_always_under_host_says_it_does_not_count(
    ws: Path, home: Path, headless: bool
) -> None:
    """A declared 'always' that the host policy reads as inherit asks (or, headless, is
    denied) with the policy and the setting that would let the declaration count; a
    call outside the workspace, which 'always' never covers, does not say so."""
    tool = loaded("path", declared=Approval.ALWAYS, policy=ApprovalSource.HOST)
    inside = run(tool, {"path": "file.txt"}, ws, home, Mode.DEFAULT, headless=headless)
    assert inside.decision == (Decision.DENY if headless else Decision.ASK)
    assert inside.reason.endswith(
        " The tool declares approval 'always', which does not count for home tool sets: "
        "externalToolApproval.home in the Crystal home's config.json is host; set it to "
        "author to let the declaration count."
    )
    outside = run(tool, {"path": "/etc/hosts"}, ws, home, Mode.DEFAULT, headless=headless)
    assert "does not count" not in outside.reason
    assert "To let it run headless" not in outside.reason
    author = loaded("path", declared=Approval.ALWAYS, policy=ApprovalSource.AUTHOR)
    allowed = run(author, {"path": "file.txt"}, ws, home, Mode.DEFAULT, headless=headless)
    assert allowed.decision == Decision.ALLOW
    assert allowed.reason == (
        "The tool's effective approval is 'always', so it runs in any mode; "
        "this call stays inside the workspace."
    )


def test_classify_headless_review_stays_review(ws: Path, home: Path) -> None:
    """Headless review still consults the reviewer for a non-forbidden call."""
    result = run(loaded("path"), {"path": "/etc/hosts"}, ws, home, "fullreview", headless=True)
    assert result.decision == Decision.REVIEW
    assert result.grant_scopes == ("once",)
    assert result.reason.endswith(
        "Headless run: unless the reviewing model allows it, it is denied."
    )


def test_classify_headless_forbidden_denies(ws: Path, home: Path) -> None:
    """Headless, a forbidden call is denied even in review modes, and still requires the prompt."""
    for mode in Mode:
        result = run(loaded("path"), {"path": "~/.gnupg"}, ws, home, mode, headless=True)
        assert result.decision == Decision.DENY
        assert result.require_prompt is True


def test_classify_always_does_not_cover_outside(ws: Path, home: Path) -> None:
    """Approval ``always`` does not cover paths outside the workspace, and says so."""
    result = run(loaded("path", declared=Approval.ALWAYS), {"path": "/tmp"}, ws, home, Mode.FULL)
    assert result.decision == Decision.ASK
    assert result.reason.endswith("Approval 'always' covers only calls inside the workspace.")


def test_classify_rejects_bad_mode(ws: Path, home: Path) -> None:
    """An unknown mode is a ValueError listing the names."""
    with pytest.raises(ValueError, match="invalid mode"):
        classify(loaded(), {}, ws, "auto", False, home)


JSON_SCALARS = st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text()
JSON_VALUES = st.recursive(
    JSON_SCALARS,
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3)
    ),
    max_leaves=8,
)
PATHISH = st.lists(
    st.sampled_from(["~", "/", "..", ".", "key", "loop", ".ssh", "~root", "x", "\x00", " ", "//"])
).map("".join)


@settings(
    max_examples=examples(300),
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(
    value=PATHISH | JSON_VALUES,
    mode=st.sampled_from(list(Mode)),
    approval=st.sampled_from(list(Approval)),
    headless=st.booleans(),
)
def test_classify_never_crashes_or_leaks_credentials(
    ws: Path, home: Path, value: Any, mode: Mode, approval: Approval, headless: bool
) -> None:
    """Any value classifies; nothing that reaches a credential path runs without the operator."""
    if not (ws / "loop").is_symlink():
        (ws / "loop").symlink_to("loop")
        (ws / "key").symlink_to(home / ".ssh" / "id_rsa")
    result = run(loaded("path", declared=approval), {"path": value}, ws, home, mode, headless)
    if result.decision == Decision.ALLOW:
        assert result.scope == Scope.WORKSPACE
        child = result.arguments["path"]
        if isinstance(child, str) and result.arguments_error is None:
            assert child == str(ws) or child.startswith(str(ws) + "/")
            assert ".ssh" not in child.split("/")
    touches_ssh = isinstance(value, str) and (".ssh" in value or "key" in value)
    if touches_ssh and result.arguments_error is None:
        child = result.arguments["path"]
        if ".ssh" in child.split("/"):
            assert result.scope == Scope.FORBIDDEN
            assert result.decision in (Decision.ASK, Decision.DENY)
