"""A live catalog: reload, watching, SIGHUP, catalogChanged, enable/disable, idle release."""

from __future__ import annotations

import functools
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from .conftest import Daemon, start_daemon, write_set
from .conftest import eventually as _eventually

#: This file's deadline: its waits span daemon restarts and watcher settling.
eventually = functools.partial(_eventually, timeout=15.0)

SIMPLE = {"runner": "exec", "description": "d", "schema": {"type": "object"}, "command": ["true"]}


def names(daemon: Daemon, workspace: Path | None = None) -> list[str]:
    params = {"workspace": str(workspace)} if workspace else {}
    return [t["name"] for t in daemon.call("list", params)["result"]["tools"]]


@pytest.fixture
def unwatched(home: Path, workspace: Path, tmp_base: Path) -> Daemon:
    """A daemon with watching off, so only explicit reloads change its catalog."""
    d = start_daemon(home, workspace, tmp_base, ["--no-watch"])
    yield d
    d.stop()


def test_reload_reports_home_and_project_changes(unwatched: Daemon, workspace: Path) -> None:
    """reload answers added, removed and updated sets with their sources, and bumps the generation."""
    d = unwatched
    project = workspace / ".crystal" / "tools"
    assert "extra" not in names(d, workspace)
    before = d.call("status")["result"]["generation"]
    write_set(d.home / "tools", "extra", SIMPLE)
    write_set(project, "proj", SIMPLE)
    shutil.rmtree(d.home / "tools" / "swatch")
    (d.home / "tools" / "hello" / "tools.json").write_text("{ broken")
    result = d.call("reload", {"workspace": str(workspace)})["result"]
    changed = {(c["set"], c["source"], c["change"]) for c in result["changed"]}
    assert changed == {
        ("extra", "home", "added"),
        ("proj", "project", "added"),
        ("swatch", "home", "removed"),
        ("hello", "home", "updated"),
    }
    assert result["generation"] > before
    assert any("hello" in n["message"] for n in result["notes"])
    assert set(names(d, workspace)) == {"notes_add", "notes_list", "notes_index", "extra", "proj"}


def test_reload_without_changes_keeps_the_generation(unwatched: Daemon) -> None:
    """A reload that finds nothing new changes nothing and keeps the generation."""
    first = unwatched.call("reload")["result"]
    second = unwatched.call("reload")["result"]
    assert second["changed"] == []
    assert second["generation"] == first["generation"]


def test_reload_rename_is_removed_plus_added(unwatched: Daemon) -> None:
    """Renaming a set directory reports the old name removed and the new one added."""
    (unwatched.home / "tools" / "hello").rename(unwatched.home / "tools" / "greet")
    result = unwatched.call("reload")
    changed = {(c["set"], c["change"]) for c in result["result"]["changed"]}, result
    assert changed[0] == {("hello", "removed"), ("greet", "added")}, changed[1]


@pytest.mark.slow
def test_reload_call_in_flight_keeps_its_definition(unwatched: Daemon, workspace: Path) -> None:
    """A call started before a reload that removes its set finishes with its definition."""
    d = unwatched
    write_set(d.home / "tools", "slow", {
        "runner": "exec", "description": "d", "schema": {"type": "object"},
        "command": ["slow.sh"], "stdin": False, "approval": "always",
    }, **{"slow.sh": '#!/bin/sh\n: > "$CRYSTAL_WORKSPACE/slow-ran"\nsleep 1\necho done-$0\n'})
    d.call("reload")
    result: dict[str, Any] = {}

    def run() -> None:
        with d.raw() as conn:
            result["events"], result["reply"] = conn.invoke(
                {"tool": "slow", "arguments": {}, "workspace": str(workspace)}
            )

    thread = threading.Thread(target=run)
    thread.start()
    # The tool itself says it runs: a confined child execs its tool a moment after the
    # call is in flight (it joins its cgroup first), and the file must still be there then.
    eventually(lambda: (workspace / "slow-ran").exists())
    shutil.rmtree(d.home / "tools" / "slow")
    assert ("slow", "removed") in {
        (c["set"], c["change"]) for c in d.call("reload")["result"]["changed"]
    }
    thread.join(30)
    reply = result["reply"]["result"]
    assert reply["status"] == "ok"
    assert "done-" in reply["content"][0]["text"]
    assert "slow" not in names(d)


def _queued_behind_a_held_slot(
    d: Daemon, workspace: Path, change: Callable[[], None]
) -> tuple[list[str], dict[str, Any]]:
    """Call ``tool`` while ``hold`` keeps the daemon's one runner slot, so the call is
    judged and then queued; ``change()`` the files; then free the slot (the file ``gate``
    ends ``hold``). Returns the queued call's notifications and its result."""
    with d.raw(timeout=30) as holder, d.raw(timeout=30) as caller:
        for conn, tool in ((holder, "hold"), (caller, "tool")):
            params = {"tool": tool, "arguments": {}, "workspace": str(workspace)}
            conn.send({"jsonrpc": "2.0", "id": 1, "method": "invoke", "params": params})
        assert holder.receive()["method"] == "started"
        queued = caller.receive()
        assert queued["params"].get("queued"), queued
        change()
        (workspace / "gate").touch()
        events = []
        while "id" not in (message := caller.receive()):
            events.append(message["method"])
    return events, message["result"]


@pytest.mark.parametrize("refused", [True, False], ids=["pointed-at-refused", "edited"])
def test_reload_a_queued_call_starts_only_while_its_sets_manifest_loads(
    tmp_base: Path, refused: bool
) -> None:
    """A call judged, then queued for a runner slot, runs the files in its set's folder
    when it starts. Its set's link pointed meanwhile at a folder whose tools.json is
    refused: it ran that folder's program, which no manifest that ever loaded names (the
    chaos run of the three faces found it). It now starts no process. A manifest edited
    in place to another version that loads still runs the call, as accepted."""
    home, workspace, links = tmp_base / "home", tmp_base / "ws", tmp_base / "links"
    workspace.mkdir()
    (home / "tools").mkdir(parents=True)
    program = f"#!{sys.executable}\nopen('ran', 'a').write('%s')\n"
    tool = {**SIMPLE, "command": ["t.py"], "approval": "always"}
    write_set(links, "good", tool, **{"t.py": program % "good"})
    write_set(links, "bad", {**tool, "catalogs": ["nowhere"]}, **{"t.py": program % "bad"})
    os.symlink(links / "good", home / "tools" / "tool")
    hold = f"#!/bin/sh\nwhile [ ! -e {workspace / 'gate'} ]; do sleep 0.02; done\n"
    write_set(home / "tools", "hold", {**tool, "command": ["hold.sh"]}, **{"hold.sh": hold})

    def change() -> None:
        if refused:
            os.symlink(links / "bad", home / "tools" / "new")
            os.replace(home / "tools" / "new", home / "tools" / "tool")
        else:
            (links / "good" / "tools.json").write_text(json.dumps({**tool, "description": "e"}))

    d = start_daemon(home, workspace, tmp_base, ["--no-watch", "--max-running", "1"])
    try:
        events, result = _queued_behind_a_held_slot(d, workspace, change)
    finally:
        d.stop()
    if not refused:
        assert result["status"] == "ok", result
        assert (workspace / "ran").read_text() == "good"
        return
    assert "started" not in events, (events, result)
    assert result["isError"], result
    assert result["exitCode"] is None
    text = result["content"][0]["text"]
    assert text.startswith("The call did not run: the manifest of tool set 'tool' ("), text
    assert "no longer loads: catalogs must be plan, work, or both." in text
    assert not (workspace / "ran").exists(), (workspace / "ran").read_text()


def test_reload_catalog_changed_only_to_subscribers(unwatched: Daemon, workspace: Path) -> None:
    """catalogChanged reaches a connection that listed with subscribe, and not one that did not."""
    d = unwatched
    with d.raw() as subscriber, d.raw() as bystander:
        subscriber.request("list", {"workspace": str(workspace), "subscribe": True})
        bystander.request("list", {"workspace": str(workspace)})
        write_set(workspace / ".crystal" / "tools", "proj", SIMPLE)
        d.call("reload")
        note = subscriber.receive()
        assert note["method"] == "catalogChanged"
        assert note["params"]["workspace"] == str(workspace.resolve())
        assert {"set": "proj", "source": "project", "change": "added"} in note["params"]["changed"]
        # The bystander's next message is the answer to its own request, nothing before it.
        bystander.send({"jsonrpc": "2.0", "method": "status", "id": "probe"})
        assert bystander.receive()["id"] == "probe"


def test_reload_sighup_reloads(unwatched: Daemon) -> None:
    """SIGHUP makes the daemon rescan its tool sets."""
    write_set(unwatched.home / "tools", "viahup", SIMPLE)
    unwatched.proc.send_signal(signal.SIGHUP)
    eventually(lambda: "viahup" in names(unwatched))


def test_reload_watcher_follows_home_and_project(daemon: Daemon, workspace: Path) -> None:
    """With watching on, adding, breaking and removing sets shows up without a reload call."""
    assert "watched" not in names(daemon, workspace)
    write_set(daemon.home / "tools", "watched", SIMPLE)
    eventually(lambda: "watched" in names(daemon, workspace))
    write_set(workspace / ".crystal" / "tools", "proj", SIMPLE)
    eventually(lambda: "proj" in names(daemon, workspace))
    shutil.rmtree(daemon.home / "tools" / "watched")
    eventually(lambda: "watched" not in names(daemon, workspace))


@pytest.mark.parametrize("where", ["home", "project"])
def test_reload_a_set_link_pointed_at_another_release_serves_that_release(
    daemon: Daemon, workspace: Path, tmp_base: Path, where: str
) -> None:
    """A set folder that is a link, pointed at another release with ``ln -sfn`` and a
    rename (an atomic deploy), is served from the new release without a reload call:
    other tools (added), the same tool names with another command (patched in place),
    and edits made in the release it now points at. Pins the thirty-fourth pass's check
    of a deploy that kept serving the old release."""
    root = daemon.home / "tools" if where == "home" else workspace / ".crystal" / "tools"
    root.mkdir(parents=True, exist_ok=True)
    tool = {"description": "d", "schema": {"type": "object"}}

    def release(name: str, command: str, *tools: str) -> Path:
        manifest = {"runner": "exec", "command": [command], "stdin": False,
                    "tools": [{"name": t, **tool} for t in tools]}
        return write_set(tmp_base / "releases", name, manifest)

    def deploy(target: Path) -> None:
        staged = root / ".deploy.tmp"
        staged.symlink_to(target)
        os.replace(staged, root / "app")  # ln -sfn, atomically

    def command(name: str) -> str:
        listed = daemon.call("list", {"workspace": str(workspace)})["result"]
        (entry,) = [s for s in listed["sets"] if s["directory"] == "app" and s["state"] == "loaded"]
        assert name in entry["tools"]
        return str(daemon.call("invoke", {
            "tool": name, "arguments": {}, "workspace": str(workspace), "approved": True,
        })["result"]["content"][0]["text"])

    deploy(release("v1", "/bin/true", "app_one"))
    eventually(lambda: "app_one" in names(daemon, workspace))
    deploy(release("v2", "/bin/true", "app_two"))
    eventually(lambda: "app_two" in names(daemon, workspace) and "app_one" not in names(
        daemon, workspace))
    deploy(release("v3", "/bin/pwd", "app_two"))
    eventually(lambda: command("app_two") != "exit 0\n", what="v3's command for app_two")
    write_set(tmp_base / "releases", "v3", {"runner": "exec", "command": ["/bin/pwd"],
              "stdin": False, "tools": [{"name": "app_two", **tool}, {"name": "app_3", **tool}]})
    eventually(lambda: "app_3" in names(daemon, workspace), what="an edit in the new release")


def test_reload_the_home_catalog_is_built_after_the_watchers_first_probe(daemon: Daemon) -> None:
    """The daemon builds the home catalog only once the watcher has taken its first probe,
    so an edit made while it starts differs from that probe and is reloaded (the watcher's
    tests show that part). Built first, an edit in between went into the probe unsent."""

    def order() -> list[str]:
        return [
            e["event"]
            for e in daemon.log_events()
            if e.get("event") == "watch_baseline"
            or (e.get("event") == "catalog_built" and e.get("workspace") is None)
        ]

    eventually(lambda: len(order()) == 2, what="the first probe and the home catalog")
    assert order() == ["watch_baseline", "catalog_built"]


def test_reload_half_written_manifest_settles_to_the_final_version(
    daemon: Daemon, workspace: Path
) -> None:
    """A manifest caught half-written is replaced by its final version without any reload call."""
    set_dir = daemon.home / "tools" / "halfway"
    set_dir.mkdir()
    text = json.dumps(SIMPLE)
    with open(set_dir / "tools.json", "w") as f:
        f.write(text[: len(text) // 2])
        f.flush()
        eventually(lambda: any(
            "halfway" in n["message"] for n in daemon.call("list")["result"]["notes"]
        ))
        f.write(text[len(text) // 2:])
    eventually(lambda: "halfway" in names(daemon))


@pytest.mark.slow
def test_reload_idle_workspaces_are_released(home: Path, workspace: Path, tmp_base: Path) -> None:
    """A workspace unused for the idle time is dropped from the daemon."""
    d = start_daemon(home, workspace, tmp_base, ["--workspace-idle", "0.5"])
    try:
        d.call("list", {"workspace": str(workspace)})
        assert d.call("status")["result"]["workspaces"] == [str(workspace.resolve())]
        eventually(lambda: d.call("status")["result"]["workspaces"] == [])
    finally:
        d.stop()


def test_reload_disable_and_enable_through_the_cli(daemon: Daemon, workspace: Path) -> None:
    """toolsetctl disable edits the manifest and the running daemon drops the set at once."""

    def ctl(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "toolsetd.client", "--socket", str(daemon.socket),
             "--home", str(daemon.home), "--workspace", str(workspace), *args],
            capture_output=True, text=True, timeout=30, check=False,
        )

    out = ctl("disable", "hello")
    assert out.returncode == 0, out.stderr
    assert "Tool set hello disabled." in out.stdout
    assert "hello" not in names(daemon, workspace)
    manifest = json.loads((daemon.home / "tools" / "hello" / "tools.json").read_text())
    assert manifest["enabled"] is False
    assert list(manifest)[-1] == "enabled"
    assert "already disabled" in ctl("disable", "hello").stdout
    assert ctl("enable", "hello").returncode == 0
    assert "hello" in names(daemon, workspace)


def test_reload_notes_only_change_is_announced(unwatched: Daemon) -> None:
    """A reload that changes only the notes still tells subscribers: a bad project policy
    is noted and counts as host, the project default, so no home tool changes. (A bad
    home policy makes home tools host, and a bad externalTools turns discovery off: those
    change sets too.)"""
    d = unwatched
    with d.raw() as subscriber:
        before = subscriber.request("list", {"subscribe": True})["result"]["generation"]
        (d.home / "config.json").write_text('{"externalToolApproval": {"project": "sometimes"}}')
        result = d.call("reload")["result"]
        assert result["generation"] == before + 1
        assert any("config.json" in n["message"] for n in result["notes"])
        note = subscriber.receive()
        assert note["method"] == "catalogChanged"
        assert note["params"]["workspace"] is None
        assert note["params"]["changed"] == []
        assert note["params"]["generation"] == before + 1


def test_a_workspace_released_as_idle_comes_back_under_another_generation(
    home: Path, workspace: Path, tmp_base: Path
) -> None:
    """A released workspace's catalog is built afresh at its next use, from files that no
    watch followed meanwhile: listed at generation 1 with one description, released,
    edited, and listed again, it had the new description under generation 1 still, so a
    front end that kept the tools it saw at generation 1 was told nothing had changed."""
    write_set(workspace / ".crystal" / "tools", "proj", SIMPLE)
    d = start_daemon(home, workspace, tmp_base, ["--workspace-idle", "0.5", "--no-watch"])
    try:
        first = d.call("list", {"workspace": str(workspace)})["result"]
        eventually(lambda: d.call("status")["result"]["workspaces"] == [])
        manifest = workspace / ".crystal" / "tools" / "proj" / "tools.json"
        manifest.write_text(manifest.read_text().replace('"description": "', '"description": "new '))
        again = d.call("list", {"workspace": str(workspace)})["result"]
        described = {t["name"]: t["description"] for t in again["tools"]}
        assert described["proj"].startswith("new ")
        assert again["generation"] != first["generation"]
    finally:
        d.stop()


@pytest.mark.slow
def test_reload_subscribed_workspace_is_not_released(
    home: Path, workspace: Path, tmp_base: Path
) -> None:
    """A workspace with a subscriber stays loaded past the idle time and keeps notifying."""
    d = start_daemon(home, workspace, tmp_base, ["--workspace-idle", "0.5", "--no-watch"])
    other = tmp_base / "other"
    other.mkdir()
    try:
        with d.raw() as subscriber:
            subscriber.request("list", {"workspace": str(workspace), "subscribe": True})
            d.call("list", {"workspace": str(other)})
            ws = str(workspace.resolve())
            eventually(lambda: d.call("status")["result"]["workspaces"] == [ws])
            write_set(workspace / ".crystal" / "tools", "late", SIMPLE)
            d.call("reload")
            note = subscriber.receive()
            assert note["method"] == "catalogChanged"
            assert note["params"]["workspace"] == ws
    finally:
        d.stop()


def test_reload_a_symlink_loop_in_a_tools_root_drops_nothing_else(
    unwatched: Daemon, workspace: Path
) -> None:
    """A self-referencing link in each tools root is skipped silently; every set still loads."""
    d = unwatched
    write_set(workspace / ".crystal" / "tools", "proj", SIMPLE)
    before = set(names(d, workspace))
    (d.home / "tools" / "loopy").symlink_to("loopy")
    (workspace / ".crystal" / "tools" / "ploop").symlink_to("ploop")
    result = d.call("reload", {"workspace": str(workspace)})["result"]
    assert result["changed"] == []
    listed = d.call("list", {"workspace": str(workspace)})["result"]
    assert {t["name"] for t in listed["tools"]} == before
    assert "proj" in before
    assert listed["notes"] == []


def test_reload_a_manifest_linked_into_proc_is_refused_unread(
    unwatched: Daemon, workspace: Path
) -> None:
    """A project tools.json linked to the daemon's /proc/self/environ is not read (as root,
    a link to /proc/kmsg took the kernel's messages from whoever reads them): the set is
    refused with a note that names it, its file system and the fix."""
    d = unwatched
    (workspace / ".crystal" / "tools" / "envy").mkdir(parents=True)
    (workspace / ".crystal" / "tools" / "envy" / "tools.json").symlink_to("/proc/self/environ")
    listed = d.call("list", {"workspace": str(workspace)})["result"]
    assert listed["notes"] == [
        {
            "set": "envy",
            "source": "project",
            "message": "External tool set 'envy' was skipped: tools.json is in the kernel's "
            "proc file system (a view of kernel state, not a file) and is not read: make "
            "tools.json a regular file on a disk, or a link to one.",
        }
    ]
    assert [s["state"] for s in listed["sets"] if s["directory"] == "envy"] == ["refused"]


def test_reload_status_says_nothing_watches_under_no_watch(unwatched: Daemon) -> None:
    """Under --no-watch, status says that edits wait for a reload (no watch, no poll)."""
    watch = unwatched.call("status")["result"]["watch"]
    assert watch["reason"] == "--no-watch: only SIGHUP, the reload method and toolsetctl reload"
    assert (watch["state"], watch["pollSeconds"], watch["maxWatches"]) == ("off", None, None)
    assert (watch["watched"], watch["pastCap"]) == (0, 0)
    assert len(watch) == 6


def test_reload_status_of_a_home_not_made_yet_is_not_starting(
    workspace: Path, tmp_base: Path
) -> None:
    """With no home folder yet there is nothing to watch, and nothing an event could miss:
    status said the watch was starting for as long as the home did not exist. It says
    watching 0 folders, and once the home is made, its folders."""
    home = tmp_base / "later"
    d = start_daemon(home, workspace, tmp_base)
    try:
        eventually(lambda: d.call("status")["result"]["watch"]["state"] != "starting",
                   timeout=5, what="a state other than starting")
        watch = d.call("status")["result"]["watch"]
        assert (watch["state"], watch["watched"]) == ("watching", 0), watch
        (home / "tools").mkdir(parents=True)
        eventually(lambda: d.call("status")["result"]["watch"]["watched"] == 2,
                   what="the home and its tools root watched")
    finally:
        d.stop()


def _inotify_watches(pid: int) -> int:
    """The inotify watches held by ``pid``'s descendants (its watch process), as their
    ``/proc/<pid>/fdinfo`` lists them (one ``inotify wd:`` line a watch)."""
    pids, found = [pid], 0
    while pids:
        each = pids.pop()
        try:
            for task in os.listdir(f"/proc/{each}/task"):
                with open(f"/proc/{each}/task/{task}/children") as children:
                    pids += [int(c) for c in children.read().split()]
            for fd in os.listdir(f"/proc/{each}/fd"):
                if os.readlink(f"/proc/{each}/fd/{fd}") == "anon_inode:inotify":
                    with open(f"/proc/{each}/fdinfo/{fd}") as info:
                        found += sum(line.startswith("inotify") for line in info)
        except (FileNotFoundError, ProcessLookupError):
            continue  # a process that ended meanwhile
    return found


def test_reload_watches_are_bounded_and_the_rest_is_polled(
    home: Path, workspace: Path, tmp_base: Path
) -> None:
    """Each set folder took an inotify watch, with no bound: a project of 190,000 folders
    took the user's whole fs.inotify.max_user_watches, and the user's other programs could
    watch nothing. The watch takes at most --max-watches directories (the home and the
    roots first); the set folders past it are followed by the stat poll, an edit in one
    still reaches the catalog, and status and the log say so."""
    for index in range(8):
        write_set(home / "tools", f"zz{index}", {**SIMPLE, "description": "before"})
    sets = len([p for p in (home / "tools").iterdir() if (p / "tools.json").exists()])
    d = start_daemon(home, workspace, tmp_base, ["--max-watches", "4"])
    try:
        eventually(lambda: d.call("status")["result"]["watch"]["state"] == "watching")
        watch = d.call("status")["result"]["watch"]
        # <home>, <home>/tools and two set folders; every other set folder is polled.
        assert (watch["watched"], watch["pastCap"], watch["maxWatches"]) == (4, sets - 2, 4)
        assert _inotify_watches(d.proc.pid) == 4
        exposition = d.call("metrics", {})["result"]["text"]
        assert 'toolsetd_watch_folders{state="watched"} 4.0\n' in exposition
        assert f'toolsetd_watch_folders{{state="polled"}} {sets - 2}.0\n' in exposition
        assert "toolsetd_watch_available 1.0\n" in exposition
        capped = [e for e in d.log_events() if e.get("event") == "watch_capped"]
        assert [(e["watched"], e["past_cap"], e["max_watches"]) for e in capped] == [
            (4, sets - 2, 4)
        ]
        manifest = home / "tools" / "zz7" / "tools.json"  # last in order: past the bound
        manifest.write_text(manifest.read_text().replace('"before"', '"after"'))

        def described() -> str:
            tools = d.call("list")["result"]["tools"]
            return str({t["name"]: t["description"] for t in tools}["zz7"])

        eventually(lambda: described() == "after", what="the edit past the bound")
        shown = subprocess.run(
            [sys.executable, "-m", "toolsetd.client", "--socket", str(d.socket), "status",
             "--format", "text"],
            capture_output=True, text=True, timeout=60, check=True,
        ).stdout
        assert re.search(
            r"^Watch +watching 4 folders, and a poll every [0-9.]+ s; "
            f"{sets - 2} set folders past the bound of 4 \\(--max-watches\\) are followed by "
            "the poll alone$",
            shown,
            re.MULTILINE,
        ), shown
    finally:
        d.stop()


def test_reload_names_that_are_not_utf8_still_get_answers(tmp_base: Path) -> None:
    """A folder name that is not UTF-8 and a lone-surrogate escape never cost anyone an answer.

    The folder is shown as .NET decodes it (U+FFFD), the manifest is refused as invalid
    JSON, and a workspace reached through a link into a non-UTF-8 folder lists, reloads
    and survives a restart (its old manifests are then indexed by the set cache).
    """
    home, link = tmp_base / "home", tmp_base / "wslink"
    write_set(home / "tools", "good", SIMPLE)
    write_set(home / "tools", "evil", '{"runner": "exec", "description": "x\\ud800y"}')
    tools = os.fsencode(home / "tools")
    os.mkdir(tools + b"/caf\xe9")
    with open(tools + b"/caf\xe9/tools.json", "wb") as f:
        f.write(b"{}")
    real = os.fsdecode(os.fsencode(tmp_base) + b"/w\xe9")
    write_set(Path(real) / ".crystal" / "tools", "proj", SIMPLE)
    link.symlink_to(real)
    old = time.time() - 60  # past the set cache's racy window: indexed on the next start
    for manifest in (*home.glob("tools/*/tools.json"), Path(real, ".crystal/tools/proj/tools.json")):
        os.utime(manifest, (old, old))
    d = start_daemon(home, link, tmp_base, ["--no-watch"])
    try:
        for _ in range(2):
            listed = d.call("list", {"workspace": str(link)})["result"]
            assert [t["name"] for t in listed["tools"]] == ["good", "proj"]
            assert [n["message"] for n in listed["notes"]] == [
                "External tool set 'caf\ufffd' was skipped: directory name is invalid.",
                "External tool set 'evil' was skipped: tools.json is not valid JSON: "
                "Unpaired surrogate \\ud800: line 1 column 37 (char 36)",
            ]
            assert listed["sets"][-1]["path"] == real.encode(
                "utf-8", "surrogateescape").decode("utf-8", "replace") + "/.crystal/tools/proj"
            assert "result" in d.call("reload", {"workspace": str(link)})
            assert d.call("status")["result"]["workspaces"] == [listed["sets"][-1]["path"][:-20]]
            d.stop()
            d = start_daemon(home, link, tmp_base, ["--no-watch"])
    finally:
        d.stop()


def test_reload_numbers_a_double_cannot_hold_are_refused_by_name(tmp_base: Path) -> None:
    """1e400 and a 5,000-digit integer refuse their sets with the fix; null is judged alone."""
    home = tmp_base / "home"

    def schema_set(directory: str, maximum: str) -> None:
        write_set(home / "tools", directory, '{"runner": "exec", "command": ["true"], '
                  '"description": "d", "schema": {"type": "object", "properties": '
                  f'{{"n": {{"type": "number", "maximum": {maximum}}}}}}}}}')

    schema_set("a1", "1e400")
    schema_set("b1", "null")
    schema_set("c1", "9" * 5000)
    schema_set("d1", "1e300")
    d = start_daemon(home, tmp_base, tmp_base, ["--no-watch"])
    try:
        listed = d.call("list")["result"]
        assert [t["name"] for t in listed["tools"]] == ["d1"]
        assert listed["tools"][0]["inputSchema"]["properties"]["n"]["maximum"] == 1e300
        cannot = "tools.json has a number toolsetd cannot hold: "
        assert {s["directory"]: s["error"] for s in listed["sets"]} == {
            "a1": cannot + "1e400 is beyond the range of a double (about ±1.8e308). "
            "Write a smaller number, or leave it out.",
            "b1": "Tool 'b1' has an invalid JSON Schema: None is not of type 'number' "
            "(at /properties/n/maximum)",
            "c1": cannot + "an integer of more than 4,300 digits: line 1 column 140 "
            "(char 139). Write a shorter number.",
            "d1": None,
        }
    finally:
        d.stop()


def test_reload_a_config_policy_change_is_announced(unwatched: Daemon) -> None:
    """A config.json source policy change re-hashes every tool: the reload says so.

    The sets' manifests are unchanged, but each tool's effective approval and hash are
    not, so the generation moves and subscribers hear of it.
    """
    d = unwatched
    with d.raw() as subscriber:
        first = subscriber.request("list", {"subscribe": True})["result"]
        before = {t["name"]: t["hash"] for t in first["tools"]}
        (d.home / "config.json").write_text(
            json.dumps({"externalToolApproval": {"home": "host"}})
        )
        result = d.call("reload")["result"]
        after = {t["name"]: t["hash"] for t in d.call("list")["result"]["tools"]}
        assert after.keys() == before.keys() and all(after[n] != before[n] for n in after)
        assert result["generation"] > first["generation"]
        assert ("hello", "home", "updated") in {
            (c["set"], c["source"], c["change"]) for c in result["changed"]
        }
        note = subscriber.receive()
        assert note["method"] == "catalogChanged", note


def test_reload_of_one_workspace_carries_a_home_change_to_the_others(
    unwatched: Daemon, workspace: Path, tmp_base: Path
) -> None:
    """A home set changed and reloaded through one workspace changes every loaded catalog.

    The home sets are part of every catalog: another loaded workspace must not keep the
    old definition under the new generation, and its subscribers hear of the change.
    """
    d = unwatched
    other = tmp_base / "other"
    other.mkdir()
    write_set(d.home / "tools", "greeter", {**SIMPLE, "description": "old"})
    d.call("reload")
    d.call("list", {"workspace": str(workspace)})
    with d.raw() as subscriber:
        subscriber.request("list", {"workspace": str(other), "subscribe": True})
        write_set(d.home / "tools", "greeter", {**SIMPLE, "description": "new"})
        result = d.call("reload", {"workspace": str(workspace)})["result"]
        assert {"set": "greeter", "source": "home", "change": "updated"} in result["changed"]
        note = subscriber.receive()
        assert note["method"] == "catalogChanged", note
        assert note["params"]["workspace"] == str(other.resolve())
    tools = d.call("list", {"workspace": str(other)})["result"]["tools"]
    assert [t["description"] for t in tools if t["name"] == "greeter"] == ["new"]


def test_a_set_folder_the_daemon_may_not_read_leaves_the_rest_watched(
    as_nobody: tuple[str, ...],
) -> None:
    """Run as nobody, a set folder nobody may read is not watched; everything else is.

    A watch needs read permission on its directory, and one awatch covers every folder:
    one folder it could not watch (root's, mode 0700, in a shared project's tools) failed
    the whole watch, and the daemon went on its stat poll alone for every set.
    """
    base = Path(tempfile.mkdtemp(prefix="tsd-unreadable-"))
    try:
        home, workspace = base / "home", base / "ws"
        write_set(home / "tools", "good", SIMPLE)
        workspace.mkdir()
        for path in (base, home, home / "tools", home / "tools" / "good", workspace):
            os.chown(path, 65534, 65534)
        (home / "tools" / "good" / "tools.json").chmod(0o644)
        write_set(home / "tools", "private", SIMPLE)
        (home / "tools" / "private").chmod(0o700)  # root's: nobody may not read it
        base.chmod(0o755)
        d = start_daemon(
            home, workspace, base,
            launcher=[*as_nobody, sys.executable, "-m", "toolsetd.daemon"],
        )
        try:
            assert names(d) == ["good"]
            write_set(home / "tools", "later", SIMPLE)  # root's, readable by all
            eventually(lambda: names(d) == ["good", "later"], what="the new set")
            assert '"watch_started"' in d.log()
            assert '"watch_unavailable"' not in d.log()
        finally:
            d.stop()
    finally:
        shutil.rmtree(base, ignore_errors=True)


class _OpenGate:
    """fanotify (``FAN_OPEN_PERM``, root): every open of one file waits for this test, which
    notes the thread that opened it and, at the first open by ``pid``'s main thread, writes
    ``fill`` into it (through the event's own descriptor, which raises no event) before the
    open goes on. A file the daemon stat'ed small is then larger when it reads it, however
    long the daemon took between the two: no race to win."""

    def __init__(self, path: Path, pid: int, fill: bytes) -> None:
        import ctypes  # only this test speaks to the kernel so

        libc = ctypes.CDLL(None, use_errno=True)
        libc.fanotify_mark.argtypes = [
            ctypes.c_int, ctypes.c_uint, ctypes.c_uint64, ctypes.c_int, ctypes.c_char_p,
        ]  # fmt: skip
        # FAN_CLOEXEC | FAN_CLASS_CONTENT | FAN_REPORT_TID; the event's file opened read-write
        self.fd = libc.fanotify_init(0x1 | 0x4 | 0x100, os.O_RDWR)
        if self.fd < 0:
            pytest.skip(f"no fanotify here: {os.strerror(ctypes.get_errno())}")
        # FAN_MARK_ADD, FAN_OPEN_PERM, on the file's inode
        if libc.fanotify_mark(self.fd, 0x1, 0x10000, -100, str(path).encode()) != 0:
            os.close(self.fd)
            pytest.skip(f"no FAN_OPEN_PERM here: {os.strerror(ctypes.get_errno())}")
        self.pid, self.fill = pid, fill
        self.openers: list[int] = []  # the thread ids of the opens, in order
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        import select
        import struct

        while not self._stop.is_set():
            if not select.select([self.fd], [], [], 0.1)[0]:
                continue
            data = os.read(self.fd, 4096)
            while data:
                length, _, _, _, _, event_fd, tid = struct.unpack("IBBHQii", data[:24])
                data = data[length:]
                try:
                    if tid == self.pid and not self.openers:
                        os.pwrite(event_fd, self.fill, 0)
                    self.openers.append(tid)
                finally:
                    os.write(self.fd, struct.pack("iI", event_fd, 0x1))  # FAN_ALLOW
                    os.close(event_fd)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(10)
        os.close(self.fd)


def test_reload_inline_reread_is_bounded_by_what_it_reads(tmp_base: Path) -> None:
    """A manifest too fresh to judge by its stat is read again on the event loop when its
    stat says it is small (64 KiB at most). The bound was the stat's alone: a file that
    grew between that stat and the read (or one renamed over it) was read on the loop up
    to the manifest limit, 1 MiB. The read itself is bounded: past the bound the manifest
    goes to a worker thread, as one large by its stat does."""
    if os.geteuid() != 0:
        pytest.skip("fanotify permission events need root")
    home, workspace = tmp_base / "home", tmp_base / "ws"
    workspace.mkdir()
    big = json.dumps({**SIMPLE, "description": "x" * (200 * 1024)}, indent=2).encode()
    manifest = write_set(home / "tools", "big", big.decode()) / "tools.json"
    future = time.time_ns() + 3600 * 10**9  # too fresh to judge by its stat for an hour
    os.utime(manifest, ns=(future, future))
    d = start_daemon(home, workspace, tmp_base, ["--no-watch"])
    try:
        assert names(d) == ["big"]
        os.truncate(manifest, 0)  # small by its stat (no open: no event)
        os.utime(manifest, ns=(future, future))
        gate = _OpenGate(manifest, d.proc.pid, big)
        try:
            assert d.call("reload")["result"]["changed"] == []
        finally:
            gate.close()
        assert manifest.read_bytes() == big
        assert gate.openers[:1] == [d.proc.pid], gate.openers  # read on the loop first
        # ... and, past the bound there, again in a worker thread.
        assert [tid for tid in gate.openers if tid != d.proc.pid], gate.openers
        assert names(d) == ["big"]
    finally:
        d.stop()
