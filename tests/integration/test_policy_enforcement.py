"""The policy through a real daemon: classify answers the table, invoke enforces it.

Two daemons serve the same kind of tree: tool sets in the home (which follow the author by
default) and in the project (which follow the host by default), each with an ``inherit``
and an ``always`` tool; the second daemon's ``config.json`` says the project follows the
author too. Every tool script drops a marker named after its call id, so a refused call
is proven to have started no process. The daemon's ``HOME`` is a temporary folder with a
``.ssh`` in it, so ``~`` and credential paths are hermetic.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from itertools import count
from pathlib import Path
from typing import Any

import pytest

from .conftest import EXAMPLES, Daemon, start_daemon, write_set

MODES = ("plan", "default", "edit", "review", "audit", "full")

# docs/policy.md section 3, written out again here from the reference host's table
# (crystal-behaviour.md section 5) and the contract's headless rule.
WORKSPACE_TABLE = {
    ("always", False): dict.fromkeys(MODES, "allow"),
    ("inherit", False): {"plan": "ask", "default": "ask", "edit": "ask", "review": "review",
                         "audit": "review", "full": "allow"},
    ("always", True): dict.fromkeys(MODES, "allow"),
    ("inherit", True): {"plan": "deny", "default": "deny", "edit": "deny", "review": "review",
                        "audit": "review", "full": "allow"},
}
OUTSIDE_TABLE = {
    False: {"plan": "ask", "default": "ask", "edit": "ask", "review": "review", "audit": "review",
            "full": "ask"},
    True: {"plan": "deny", "default": "deny", "edit": "deny", "review": "review", "audit": "review",
           "full": "deny"},
}
FORBIDDEN_TABLE = {False: dict.fromkeys(MODES, "ask"), True: dict.fromkeys(MODES, "deny")}

MARK = '#!/bin/sh\nmkdir -p "$CRYSTAL_WORKSPACE/ran"\n: > "$CRYSTAL_WORKSPACE/ran/$TOOLSETD_CALL_ID"\n'


def _policy_set(prefix: str) -> dict[str, Any]:
    tool = {"description": "d", "schema": {"type": "object"}, "command": ["mark.sh"]}
    return {
        "runner": "exec", "stdin": True,
        "tools": [
            {**tool, "name": f"{prefix}_inherit", "approval": "inherit"},
            {**tool, "name": f"{prefix}_always", "approval": "always"},
            {**tool, "name": f"{prefix}_path_always", "approval": "always", "pathArguments": ["path"]},
            {**tool, "name": f"{prefix}_path_inherit", "pathArguments": ["path"]},
            {**tool, "name": f"{prefix}_echo", "approval": "always", "pathArguments": ["path"],
             "command": ["echo.sh"]},
            {**tool, "name": f"{prefix}_mode", "approval": "always", "command": ["mode.sh"]},
        ],
    }


@dataclass
class Tree:
    daemon: Daemon
    workspace: Path
    user_home: Path
    ids: Iterator[int]

    def call_id(self) -> str:
        return f"pol-{next(self.ids)}"

    def ran(self, call_id: str) -> bool:
        return (self.workspace / "ran" / call_id).exists()

    def request(self, method: str, params: dict[str, Any]) -> dict[str, Any]:
        return self.daemon.call(method, {"workspace": str(self.workspace), **params})


def _make_tree(project_author: bool) -> tuple[Tree, Path]:
    base = Path(tempfile.mkdtemp(prefix="tsp-"))
    home = base / "home"
    shutil.copytree(EXAMPLES, home / "tools")
    files = {"mark.sh": MARK, "echo.sh": "#!/bin/sh\ncat\n",
             "mode.sh": '#!/bin/sh\necho "$CRYSTAL_APPROVAL"\n'}
    write_set(home / "tools", "hp", _policy_set("h"), **files)
    workspace = base / "ws"
    write_set(workspace / ".crystal" / "tools", "pp", _policy_set("p"), **files)
    if project_author:
        (home / "config.json").write_text(json.dumps({"externalToolApproval": {"project": "author"}}))
    user_home = base / "uh"
    (user_home / ".ssh").mkdir(parents=True)
    (user_home / ".ssh" / "x").write_text("secret")
    (workspace / "keys").symlink_to(user_home / ".ssh")
    (workspace / "loop1").symlink_to("loop2")
    (workspace / "loop2").symlink_to("loop1")
    d = start_daemon(home, workspace, base, ["--no-watch"], env={"HOME": str(user_home)})
    return Tree(d, workspace, user_home, count()), base


@pytest.fixture(scope="module")
def tree() -> Iterator[Tree]:
    """Home and project sets; default operator config."""
    t, base = _make_tree(project_author=False)
    try:
        yield t
    finally:
        t.daemon.stop()
        shutil.rmtree(base, ignore_errors=True)


@pytest.fixture(scope="module")
def author_tree() -> Iterator[Tree]:
    """The same tree with config.json externalToolApproval.project = author."""
    t, base = _make_tree(project_author=True)
    try:
        yield t
    finally:
        t.daemon.stop()
        shutil.rmtree(base, ignore_errors=True)


def _check_enforcement(t: Tree, tool: str, arguments: dict[str, Any], mode: str, headless: bool,
                       decision: str) -> dict[str, Any]:
    """classify answers ``decision``; invoke with and without approved does what it means."""
    common = {"tool": tool, "arguments": arguments, "mode": mode, "headless": headless}
    classification = t.request("classify", common)["result"]
    assert classification["decision"] == decision, classification
    assert classification["authority"] == "write"
    assert classification["reason"]
    # Without approval.
    call_id = t.call_id()
    reply = t.request("invoke", {**common, "callId": call_id})
    if decision == "allow":
        assert reply["result"]["status"] == "ok", reply
        assert t.ran(call_id)
    else:
        code = -32003 if decision == "deny" else -32004
        assert reply["error"]["code"] == code, reply
        assert reply["error"]["data"] == classification
        assert classification["reason"] in reply["error"]["message"]
        assert not t.ran(call_id)
    # With approval: ask and review run; deny stays denied.
    call_id = t.call_id()
    reply = t.request("invoke", {**common, "callId": call_id, "approved": True})
    if decision == "deny":
        assert reply["error"]["code"] == -32003, reply
        assert not t.ran(call_id)
    else:
        assert reply["result"]["status"] == "ok", reply
        assert t.ran(call_id)
    return classification


# -- the decision table, workspace scope -----------------------------------------------


@pytest.mark.parametrize("headless", [False, True], ids=["attended", "headless"])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("declared", ["inherit", "always"])
@pytest.mark.parametrize("where", ["home", "project", "project-author"])
def test_policy_workspace_table(
    tree: Tree, author_tree: Tree, where: str, declared: str, mode: str, headless: bool
) -> None:
    """A workspace call gets the table's decision for its effective approval, and invoke enforces it."""
    t = author_tree if where == "project-author" else tree
    prefix = "h" if where == "home" else "p"
    policy = "host" if where == "project" else "author"
    effective = "inherit" if policy == "host" else declared
    decision = WORKSPACE_TABLE[(effective, headless)][mode]
    c = _check_enforcement(t, f"{prefix}_{declared}", {}, mode, headless, decision)
    assert c["source"] == ("home" if where == "home" else "project")
    assert c["approval"] == {"declared": declared, "policy": policy, "effective": effective}
    assert c["scope"] == "workspace"
    assert c["requirePrompt"] is False
    expected_grants = ["once", "session", "persistent"] if decision in ("ask", "review") else []
    assert c["grantScopes"] == expected_grants


# -- outside and forbidden paths -------------------------------------------------------


@pytest.mark.parametrize("headless", [False, True], ids=["attended", "headless"])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("approval", ["inherit", "always"])
def test_policy_outside_workspace_path(tree: Tree, approval: str, mode: str, headless: bool) -> None:
    """An absolute /tmp path is outsideWorkspace: never automatic, one-time grants only."""
    path = "/tmp/toolsetd-policy-outside/file"  # a path outside the workspace
    decision = OUTSIDE_TABLE[headless][mode]
    c = _check_enforcement(tree, f"h_path_{approval}", {"path": path}, mode, headless, decision)
    assert c["scope"] == "outsideWorkspace"
    assert c["paths"] == [
        {"argument": "path", "value": path, "resolved": path, "scope": "outsideWorkspace"}
    ]
    assert c["requirePrompt"] is False
    assert c["grantScopes"] == (["once"] if decision in ("ask", "review") else [])


@pytest.mark.parametrize("headless", [False, True], ids=["attended", "headless"])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("value", ["~/.ssh/x", "keys/x"], ids=["tilde", "symlink"])
def test_policy_forbidden_path(tree: Tree, value: str, mode: str, headless: bool) -> None:
    """A credential path (by ~ or through a workspace symlink) is forbidden: only the operator passes it."""
    decision = FORBIDDEN_TABLE[headless][mode]
    c = _check_enforcement(tree, "h_path_always", {"path": value}, mode, headless, decision)
    assert c["scope"] == "forbidden"
    resolved = str(tree.user_home / ".ssh" / "x")
    assert c["paths"] == [
        {"argument": "path", "value": value, "resolved": resolved, "scope": "forbidden"}
    ]
    assert c["requirePrompt"] is True
    assert c["grantScopes"] == (["once"] if decision == "ask" else [])
    assert c["arguments"] == {"path": resolved}


def test_policy_forbidden_child_receives_the_resolved_path(tree: Tree) -> None:
    """An approved forbidden call runs with the canonical path, the one that was judged."""
    reply = tree.request("invoke", {"tool": "h_echo", "arguments": {"path": "keys/x"},
                                    "mode": "full", "approved": True})
    text = reply["result"]["content"][0]["text"]
    assert json.loads(text.split("\n", 1)[1]) == {"path": str(tree.user_home / ".ssh" / "x")}


def test_policy_worst_path_wins(tree: Tree) -> None:
    """With one outside and one forbidden value in an array, the call is forbidden."""
    c = tree.request("classify", {"tool": "h_path_always",
                                  "arguments": {"path": ["/tmp/a", "~/.ssh/x"]}, "mode": "full"})
    assert c["result"]["scope"] == "forbidden"
    assert c["result"]["requirePrompt"] is True


@pytest.mark.parametrize("headless", [False, True], ids=["attended", "headless"])
@pytest.mark.parametrize("mode", ["review", "full"])
@pytest.mark.parametrize("how", ["path", "hard-link", "absent"])
def test_policy_crystal_home_credentials_are_forbidden(
    tree: Tree, how: str, mode: str, headless: bool
) -> None:
    """The Crystal home's credentials.json is a credential path, wherever the home is.

    The daemon's home is ``--home`` (not ``~/.crystal``), so no ``.crystal`` segment names
    the file: it is caught by its place and, under another name (a hard link in the
    workspace), by identity, as the sandbox hides it.
    """
    credentials = tree.daemon.home / "credentials.json"
    link = tree.workspace / "notes.json"
    if how != "absent":
        credentials.write_text('{"token": "secret"}')
    if how == "hard-link":
        os.link(credentials, link)
    try:
        value = "notes.json" if how == "hard-link" else str(credentials)
        decision = FORBIDDEN_TABLE[headless][mode]
        c = _check_enforcement(tree, "h_path_always", {"path": value}, mode, headless, decision)
        assert c["scope"] == "forbidden"
        assert c["requirePrompt"] is True
        # Named by its own path, it is no file "under another name" (it said so).
        by_name = how != "hard-link"
        assert ("a credential path:" in c["reason"]) is by_name, c["reason"]
        assert ("under another name" in c["reason"]) is not by_name, c["reason"]
    finally:
        link.unlink(missing_ok=True)
        credentials.unlink(missing_ok=True)


# -- modes, catalogs, tools, arguments, workspaces -------------------------------------


def test_policy_invalid_mode_lists_valid_names(tree: Tree) -> None:
    """An unknown mode is InvalidParams naming every valid mode."""
    for bad in ("bogus", "auto"):
        for method in ("classify", "invoke"):
            error = tree.request(method, {"tool": "h_always", "arguments": {}, "mode": bad})["error"]
            assert error["code"] == -32602
            assert "mode" in error["message"]
            for name in MODES:
                assert name in error["message"]


@pytest.mark.parametrize(
    ("alias", "decision"),
    [("yolo", "allow"), ("fullauto", "allow"), ("autoedit", "ask"), ("fullreview", "review"),
     ("full-review", "review"), (" FULL ", "allow"), ("Review", "review")],
)
def test_policy_mode_aliases(tree: Tree, alias: str, decision: str) -> None:
    """The reference host's aliases (any case, spaces trimmed) map to their modes."""
    c = tree.request("classify", {"tool": "h_inherit", "arguments": {}, "mode": alias})
    assert c["result"]["decision"] == decision


def test_policy_mode_alias_reaches_the_child_canonical(tree: Tree) -> None:
    """CRYSTAL_APPROVAL holds the canonical mode name for an alias."""
    for alias, canonical in (("yolo", "full"), ("full-review", "audit"), ("AutoEdit", "edit")):
        reply = tree.request("invoke", {"tool": "h_mode", "arguments": {}, "mode": alias})
        assert reply["result"]["content"][0]["text"] == f"exit 0\n{canonical}\n"


def test_policy_catalog_mismatch_is_unknown_tool(tree: Tree) -> None:
    """notes_index is work-only: invoking it from the plan catalog is UnknownTool."""
    error = tree.request("invoke", {"tool": "notes_index", "arguments": {"path": "."},
                                    "catalog": "plan", "approved": True})["error"]
    assert error["code"] == -32001
    assert "notes_index" in error["message"] and "plan" in error["message"]


def test_policy_unknown_tool_is_named(tree: Tree) -> None:
    """An unknown tool is UnknownTool with its name in message and data."""
    for method in ("classify", "invoke"):
        error = tree.request(method, {"tool": "no_such_tool", "arguments": {}})["error"]
        assert error["code"] == -32001
        assert "no_such_tool" in error["message"]
        assert error["data"]["tool"] == "no_such_tool"


def test_policy_schema_violation_points_into_the_arguments(tree: Tree) -> None:
    """Schema errors are InvalidArguments with JSON Pointers, nested ones included; nothing runs."""
    error = tree.request("invoke", {"tool": "notes_add", "arguments": {"text": "x", "tags": ["a", 5]},
                                    "approved": True})["error"]
    assert error["code"] == -32002
    assert [e["path"] for e in error["data"]["errors"]] == ["/tags/1"]
    assert error["data"]["errors"][0]["message"]
    error = tree.request("classify", {"tool": "hello", "arguments": {"name": 5}})["error"]
    assert error["code"] == -32002
    assert error["data"]["errors"][0]["path"] == "/name"
    error = tree.request("invoke", {"tool": "hello", "arguments": {}})["error"]
    assert error["code"] == -32002
    assert "name" in error["data"]["errors"][0]["message"]


@pytest.mark.parametrize(
    ("workspace", "code"),
    [("relative/ws", -32006), ("/nonexistent/toolsetd/ws", -32006), ("", -32006)],
)
def test_policy_bad_workspace(tree: Tree, workspace: str, code: int) -> None:
    """A relative or missing workspace is InvalidWorkspace for classify and invoke."""
    for method in ("classify", "invoke"):
        reply = tree.daemon.call(method, {"tool": "h_always", "arguments": {}, "workspace": workspace})
        assert reply["error"]["code"] == code, reply
        assert "workspace" in reply["error"]["message"]


def test_policy_workspace_that_is_a_file(tree: Tree) -> None:
    """A workspace naming a file is InvalidWorkspace."""
    reply = tree.request("invoke", {"tool": "h_always", "arguments": {},
                                    "workspace": str(tree.workspace / "keys" / "x")})
    assert reply["error"]["code"] == -32006


def test_policy_workspace_absent_is_invalid_params(tree: Tree) -> None:
    """invoke without a workspace is InvalidParams naming workspace."""
    error = tree.daemon.call("invoke", {"tool": "h_always", "arguments": {}})["error"]
    assert error["code"] == -32602
    assert "workspace" in error["message"]


def test_policy_non_string_path_passes_through(tree: Tree) -> None:
    """A number in a path argument is not a path: it reaches the child unchanged."""
    c = tree.request("classify", {"tool": "h_echo", "arguments": {"path": 5}})["result"]
    assert c["scope"] == "workspace" and c["decision"] == "allow"
    assert c["arguments"] == {"path": 5}
    reply = tree.request("invoke", {"tool": "h_echo", "arguments": {"path": 5, "n": 1.50}})
    assert reply["result"]["content"][0]["text"] == 'exit 0\n{"path":5,"n":1.5}'


@pytest.mark.parametrize("value", ["", "   "])
def test_policy_blank_path_is_invalid_arguments(tree: Tree, value: str) -> None:
    """A blank path string is refused with InvalidArguments pointing at it; nothing runs."""
    call_id = tree.call_id()
    error = tree.request("invoke", {"tool": "h_path_always", "arguments": {"path": value},
                                    "callId": call_id})["error"]
    assert error["code"] == -32002
    assert error["data"]["errors"] == [
        {"path": "/path", "message": "Argument 'path' must be a path string."}
    ]
    assert not tree.ran(call_id)


def test_policy_blank_path_refused_before_asking(tree: Tree) -> None:
    """An inherit tool with a blank path answers InvalidArguments, not ApprovalRequired."""
    error = tree.request("invoke", {"tool": "h_path_inherit", "arguments": {"path": ""}})["error"]
    assert error["code"] == -32002, error


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (" sub/a.txt\n", "{ws}/sub/a.txt"),
        ("\u3000~/x\t", "{home}/x"),
        ("\x1csub", "{ws}/\x1csub"),
    ],
    ids=["spaces-and-newline", "ideographic-space-tilde", "file-separator-kept"],
)
def test_policy_path_is_trimmed_as_the_reference_host_trims_it(
    tree: Tree, value: str, expected: str
) -> None:
    """A path argument loses surrounding white space before it is resolved.

    The reference host's fence resolves ``path.Trim()`` (.NET white space), so a model's
    ``" sub/a.txt\\n"`` reaches the child as ``<ws>/sub/a.txt``; toolsetd used to hand it
    ``<ws>/ sub/a.txt\\n``, a file that does not exist. U+001C, which Python's ``strip``
    would also take but .NET keeps, stays part of the name.
    """
    want = expected.format(ws=tree.workspace, home=tree.user_home)
    c = tree.request("classify", {"tool": "h_echo", "arguments": {"path": value}})["result"]
    assert [p["resolved"] for p in c["paths"]] == [want]
    assert c["arguments"] == {"path": want}
    reply = tree.request("invoke", {"tool": "h_echo", "arguments": {"path": value},
                                    "mode": "full", "approved": True})
    text = reply["result"]["content"][0]["text"]
    assert json.loads(text.split("\n", 1)[1]) == {"path": want}


# -- hostile values through classify ---------------------------------------------------


def _hostile(t: Tree) -> list[tuple[Any, str, str | None]]:
    ws = str(t.workspace.resolve())
    return [
        ("../" * 30 + "etc/passwd", "outsideWorkspace", "/etc/passwd"),
        ("a\x00b", "outsideWorkspace", None),
        ("x" * 5000, "outsideWorkspace", None),
        ("y" * 300, "outsideWorkspace", None),
        ("loop1/x", "outsideWorkspace", None),
        ("sub///", "workspace", f"{ws}/sub"),
        ("./a/../b/./", "workspace", f"{ws}/b"),
        ("~root", "workspace", f"{ws}/~root"),
        ("~root/.ssh/id", "forbidden", f"{ws}/~root/.ssh/id"),
        (".SSH/k", "forbidden", f"{ws}/.SSH/k"),
        ("a\\.gnupg\\b", "forbidden", f"{ws}/a\\.gnupg\\b"),
        (".ssh.bak", "workspace", f"{ws}/.ssh.bak"),
        ("x/.crystal/credentials.json", "forbidden", f"{ws}/x/.crystal/credentials.json"),
        (ws + "2/f", "outsideWorkspace", ws + "2/f"),
        ("/", "outsideWorkspace", "/"),
        ("~", "outsideWorkspace", str(t.user_home)),
        (".", "workspace", ws),
    ]


def test_policy_hostile_paths_classify(tree: Tree) -> None:
    """Hostile path values each get a classification; the daemon keeps serving throughout."""
    with tree.daemon.raw() as conn:
        for value, scope, resolved in _hostile(tree):
            reply = conn.request("classify", {"tool": "h_path_always", "arguments": {"path": value},
                                              "workspace": str(tree.workspace), "mode": "full"})
            c = reply["result"]
            assert c["scope"] == scope, (value[:40], c)
            assert c["paths"][0]["resolved"] == resolved, (value[:40], c)
            assert c["decision"] == ("allow" if scope == "workspace" else "ask")
            assert "result" in conn.request("status")


@pytest.mark.parametrize("value", ["a\x00b", "x" * 5000, "loop1/x"], ids=["nul", "long", "loop"])
def test_policy_unresolvable_path_is_refused_on_invoke(tree: Tree, value: str) -> None:
    """An approved call with an unresolvable path answers InvalidArguments 'Path is not valid.'."""
    call_id = tree.call_id()
    error = tree.request("invoke", {"tool": "h_path_always", "arguments": {"path": value},
                                    "approved": True, "callId": call_id})["error"]
    assert error["code"] == -32002
    assert error["data"]["errors"] == [{"path": "/path", "message": "Path is not valid."}]
    assert not tree.ran(call_id)


def test_policy_unpaired_surrogate_gets_a_clear_error(tree: Tree) -> None:
    """A path holding an unpaired surrogate escape gets an error answer, and the daemon carries on."""
    with tree.daemon.raw() as conn:
        conn.send_bytes(json.dumps({"jsonrpc": "2.0", "id": 1, "method": "classify", "params": {
            "tool": "h_path_always", "arguments": {"path": "\ud800"},
            "workspace": str(tree.workspace)}}).encode() + b"\n")
        reply = conn.receive()
        assert "error" in reply
        assert reply["error"]["code"] in (-32700, -32602, -32002)
        assert "result" in conn.request("status")


@pytest.mark.parametrize(
    "config",
    [
        '{"externalToolApproval": {"home": "hots"}}',
        '{"externalToolApproval": "host"}',
    ],
    ids=["typo", "not-an-object"],
)
def test_policy_unusable_approval_config_never_honours_always(config: str) -> None:
    """An approval policy the daemon cannot read counts as host, never as the author default.

    The operator who writes ``externalToolApproval`` means to restrict it; a typo or a broken
    file used to fall back to home ``author``, so a home tool declaring ``approval: always``
    ran in default mode without asking. The reference host refuses such a file outright.
    """
    base = Path(tempfile.mkdtemp(prefix="tsp-"))
    try:
        home, workspace = base / "home", base / "ws"
        write_set(home / "tools", "hp", _policy_set("h"), **{"mark.sh": MARK})
        workspace.mkdir()
        (home / "config.json").write_text(config)
        d = start_daemon(home, workspace, base, ["--no-watch"])
        try:
            listed = d.call("list", {"workspace": str(workspace)})["result"]
            tool = next(t for t in listed["tools"] if t["name"] == "h_always")
            assert tool["approval"] == {"declared": "always", "policy": "host", "effective": "inherit"}
            assert any(n["set"] == "config.json" and "host" in n["message"] for n in listed["notes"])
            result = d.call("classify", {"tool": "h_always", "arguments": {}, "workspace": str(workspace)})
            assert result["result"]["decision"] == "ask"
            refused = d.call("invoke", {"tool": "h_always", "arguments": {}, "workspace": str(workspace)})
            assert refused["error"]["code"] == -32004
            assert not (workspace / "ran").exists()
        finally:
            d.stop()
    finally:
        shutil.rmtree(base, ignore_errors=True)


def test_policy_a_config_that_cannot_be_parsed_turns_discovery_off() -> None:
    """A config.json that does not parse may have said ``externalTools: false``: it turns
    discovery off (a note says why) rather than load, under any policy, the tools the
    operator may have turned off. The reference host refuses such a file outright."""
    base = Path(tempfile.mkdtemp(prefix="tsp-"))
    try:
        home, workspace = base / "home", base / "ws"
        write_set(home / "tools", "hp", _policy_set("h"), **{"mark.sh": MARK})
        workspace.mkdir()
        (home / "config.json").write_text('{"externalTools": false,}')
        d = start_daemon(home, workspace, base, ["--no-watch"])
        try:
            listed = d.call("list", {"workspace": str(workspace)})["result"]
            assert listed["tools"] == []
            assert any(n["set"] == "config.json" and "discovery is off" in n["message"]
                       for n in listed["notes"])
            refused = d.call("invoke", {"tool": "h_always", "arguments": {}, "workspace": str(workspace)})
            assert "error" in refused
            assert not (workspace / "ran").exists()
        finally:
            d.stop()
    finally:
        shutil.rmtree(base, ignore_errors=True)
