"""Confinement end to end: a cgroup per call, the bubblewrap sandbox, and no orphans.

Everything here runs real tools under a real daemon. The cgroup tests need a writable
cgroup v2 tree (as root on this host: ``/sys/fs/cgroup/unified``), the limit tests the
controller each limit needs, the sandbox tests bubblewrap (installed by
``ensure_bubblewrap`` where it can be); each skips with the reason the daemon's ``status``
gives otherwise. The trees live under ``/var/tmp``, not ``/tmp``: a sandboxed call gets a
private ``/tmp``, which would hide a home under ``/tmp`` for the wrong reason.
"""

from __future__ import annotations

import contextlib
import json
import os
import pwd
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from .conftest import (
    Daemon,
    ensure_bubblewrap,
    eventually,
    launched_at_the_limit,
    marked_processes,
    start_daemon,
    tasks_limited,
    write_set,
)
from .http_helpers import endpoint, listening_urls

# One tool, many actions: it reports what each attempt did as one JSON line.
PROBE = textwrap.dedent(
    """\
    #!{python}
    import json, os, socket, subprocess, sys, time
    args = json.load(sys.stdin)
    action, target = args["action"], args.get("target", "")
    result = {{"ok": True}}
    try:
        if action == "write":
            with open(target, "w") as f:
                f.write("written by the tool\\n")
        elif action == "read":
            with open(target) as f:
                result["content"] = f.read()
        elif action == "hardlink-read":
            link = os.path.join(os.environ["CRYSTAL_WORKSPACE"], "hl-" + args["name"])
            os.link(target, link)
            with open(link) as f:
                result["content"] = f.read()
        elif action == "uncover-read":
            # Take away the mount that hides ``target``'s folder (root with CAP_SYS_ADMIN
            # can), then read it.
            import ctypes
            libc = ctypes.CDLL(None, use_errno=True)
            if libc.umount2(os.path.dirname(target).encode(), 2) != 0:  # MNT_DETACH
                raise OSError(ctypes.get_errno(), os.strerror(ctypes.get_errno()))
            with open(target) as f:
                result["content"] = f.read()
        elif action == "trap-term":
            import signal
            def cleanup(signum, frame):
                time.sleep(0.5)  # a clean-up that takes a moment
                with open(target, "w") as f:
                    f.write("cleaned up\\n")
                sys.exit(3)
            signal.signal(signal.SIGTERM, cleanup)
            time.sleep(30)
        elif action == "trap-term-stopped":
            import signal
            def cleanup_stopped(signum, frame):
                with open(target, "w") as f:
                    f.write("cleaned up\\n")
                sys.exit(3)
            signal.signal(signal.SIGTERM, cleanup_stopped)
            os.kill(os.getpid(), signal.SIGSTOP)  # stopped until continued
            time.sleep(30)
        elif action == "trap-term-all":
            # Three processes of one call, each with its own clean-up on SIGTERM; the tool
            # waits for its children's before it exits (its exit ends the sandbox).
            import signal
            index, children = 0, []
            def cleanup_all(signum, frame):
                with open(target + "." + str(index), "w") as f:
                    f.write("cleaned up\\n")
                for child in children:
                    os.waitpid(child, 0)
                os._exit(3)
            signal.signal(signal.SIGTERM, cleanup_all)
            for number in (1, 2):
                child = os.fork()
                if child == 0:
                    index, children = number, []
                    break
                children.append(child)
            time.sleep(30)
            os._exit(0)
        elif action == "fake-setup-failure":
            with open(target, "w") as f:
                f.write("the tool ran\\n")
            print("done its work")
            sys.stderr.write("bwrap: Can't mount tmpfs on /newroot/tmp: Permission denied\\n")
            sys.exit(1)
        elif action == "ipc":
            result["ipc"] = os.readlink("/proc/self/ns/ipc")
        elif action == "open-write":
            # Open for writing and close again: never write (``target`` may be a sysctl).
            os.close(os.open(target, os.O_WRONLY))
        elif action == "open-write-any":
            # Every ``target`` under /proc/<pid>/root/ that opens for writing (then closes:
            # never written); a process of the host's /proc leads into the host's root.
            result["writable"] = []
            for pid in os.listdir("/proc"):
                if pid.isdigit():
                    path = "/proc/" + pid + "/root" + target
                    try:
                        os.close(os.open(path, os.O_WRONLY))
                        result["writable"].append(path)
                    except OSError:
                        pass
        elif action == "mount-options":
            # The options of the mount at ``target`` (the last one there wins).
            for line in open("/proc/self/mountinfo"):
                fields = line.split()
                if fields[4] == target:
                    result["options"] = fields[5]
        elif action == "connect":
            host, port = target.rsplit(":", 1)
            socket.create_connection((host, int(port)), timeout=3).close()
        elif action == "mcp-post":
            # First try to leave the call's cgroup (into ``move_to``), then post an
            # ``initialize`` to the MCP endpoint ``target``.
            import http.client, urllib.parse
            if args.get("move_to"):
                try:
                    with open(args["move_to"], "w") as f:
                        f.write("0")
                    result["moved"] = True
                except OSError as exc:
                    result["moved"] = exc.strerror
            child = None
            if args.get("clone_into"):
                # Then post from a child made by clone3(CLONE_INTO_CGROUP) in the nearest
                # ancestor of the call's cgroup that takes it, on the cgroup2 mount
                # ``clone_into`` (the kernel checks cgroup.procs' mode, not the read-only
                # bind); the result comes back on a pipe.
                import ctypes, struct
                libc = ctypes.CDLL(None, use_errno=True)
                libc.syscall.restype = ctypes.c_long
                own = [x for x in open("/proc/self/cgroup") if x.startswith("0::")][0][3:]
                parts = own.strip().strip("/").split("/")
                reader, writer = os.pipe()
                for depth in range(len(parts) - 1, -1, -1):
                    fd = os.open(os.path.join(args["clone_into"], *parts[:depth]), os.O_RDONLY)
                    clone_args = ctypes.create_string_buffer(  # flags, exit_signal, cgroup
                        struct.pack("=11Q", 0x200000000, 0, 0, 0, 17, 0, 0, 0, 0, 0, fd))
                    child = libc.syscall(ctypes.c_long(435), clone_args, ctypes.c_size_t(88))
                    if child >= 0:
                        break
                if child is None or child < 0:
                    raise OSError(ctypes.get_errno(), os.strerror(ctypes.get_errno()))
                if child > 0:
                    os.close(writer)
                    os.waitpid(child, 0)
                    result.update(json.loads(os.read(reader, 65536) or b"{{}}"))
            if not child:  # no clone, or the clone
                try:
                    url = urllib.parse.urlsplit(target)
                    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=10)
                    body = json.dumps({{"jsonrpc": "2.0", "id": 1, "method": "initialize",
                                       "params": {{
                        "protocolVersion": "2025-06-18", "capabilities": {{}},
                        "clientInfo": {{"name": "probe", "version": "0"}}}}}})
                    conn.request("POST", url.path + "?" + url.query, body, {{
                        "Content-Type": "application/json",
                        "Accept": "application/json, text/event-stream"}})
                    answer = conn.getresponse()
                    result["status"] = answer.status
                    result["body"] = answer.read().decode(errors="replace")[:500]
                finally:
                    if child == 0:
                        os.write(writer, json.dumps(result).encode())
                        os._exit(0)
        elif action == "clone-into":
            # A child made by clone3(CLONE_INTO_CGROUP) in the nearest ancestor of the
            # call's cgroup that takes it, on the cgroup2 mount ``target``; it says which
            # cgroup it is in on a pipe.
            import ctypes, struct
            libc = ctypes.CDLL(None, use_errno=True)
            libc.syscall.restype = ctypes.c_long
            own = [x for x in open("/proc/self/cgroup") if x.startswith("0::")][0][3:]
            parts = own.strip().strip("/").split("/")
            reader, writer = os.pipe()
            child = -1
            for depth in range(len(parts) - 1, -1, -1):
                fd = os.open(os.path.join(target, *parts[:depth]), os.O_RDONLY)
                clone_args = ctypes.create_string_buffer(  # flags, exit_signal, cgroup
                    struct.pack("=11Q", 0x200000000, 0, 0, 0, 17, 0, 0, 0, 0, 0, fd))
                child = libc.syscall(ctypes.c_long(435), clone_args, ctypes.c_size_t(88))
                if child == 0:
                    line = [x for x in open("/proc/self/cgroup") if x.startswith("0::")][0]
                    os.write(writer, line[3:].strip().encode())
                    os._exit(0)
                if child > 0:
                    break
            if child < 0:
                raise OSError(ctypes.get_errno(), os.strerror(ctypes.get_errno()))
            os.close(writer)
            os.waitpid(child, 0)
            result["own"] = own.strip()
            result["child"] = os.read(reader, 65536).decode()
        elif action == "own-cgroup":
            # The call's own cgroup, where /proc/self/cgroup names it on the cgroup2 mount
            # ``target``: what a runtime reads to size its heap, and what it may change.
            own = [x for x in open("/proc/self/cgroup") if x.startswith("0::")][0][3:].strip()
            folder = os.path.join(target, own.lstrip("/"))
            result["own"] = own
            result["procs"] = open(os.path.join(folder, "cgroup.procs")).read().split()
            for attempt, run in (
                ("write", lambda: open(os.path.join(folder, "cgroup.procs"), "w").write("0")),
                ("mkdir", lambda: os.mkdir(os.path.join(folder, "child"))),
            ):
                try:
                    run()
                    result[attempt] = "done"
                except OSError as exc:
                    result[attempt] = exc.strerror
        elif action == "exec":
            os.execv(args["argv"][0], args["argv"])
        elif action == "userns":
            import ctypes
            libc = ctypes.CDLL(None, use_errno=True)
            if libc.unshare(0x10000000) != 0:  # CLONE_NEWUSER
                raise OSError(ctypes.get_errno(), os.strerror(ctypes.get_errno()))
        elif action == "hold":
            # Keep the call (and its runner slot) until ``target`` appears.
            deadline = time.monotonic() + 30
            while not os.path.exists(target) and time.monotonic() < deadline:
                time.sleep(0.01)
        elif action == "write-both":
            with open(args["path"], "w") as f:
                f.write("approved\\n")
            with open(target, "w") as f:
                f.write("not approved\\n")
        elif action == "escape":
            marker = args["marker"]
            subprocess.Popen(
                [os.path.realpath(sys.executable), "-c", "import time; time.sleep(1000)", marker],
                start_new_session=True, stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            )
            if args.get("wait"):
                time.sleep(1000)
        elif action == "fork-bomb":
            children = 0
            try:
                for _ in range(10000):
                    subprocess.Popen(["sleep", "30"])
                    children += 1
            except OSError as exc:
                result["stopped"] = exc.strerror
            result["children"] = children
        elif action == "hog":
            chunks = []
            while True:
                chunks.append(bytearray(16 << 20))
        elif action in ("spill-swap-temp", "spill-swap-folder"):
            # Outgrow the kept prefix so the daemon streams to disk, wait for its file, then
            # swap the stderr temp file (or the whole folder) for a link to ``target``.
            folder = os.path.join(os.environ["CRYSTAL_PROJECT_DATA"], "tool-output")
            call_id = os.environ["TOOLSETD_CALL_ID"]
            if action == "spill-swap-temp":
                os.write(2, b"E" * 600000)
                planted = spilled = os.path.join(folder, "." + call_id + ".stderr")
            else:
                os.write(1, b"O" * 600000)
                planted, spilled = folder, os.path.join(folder, call_id)
            deadline = time.monotonic() + 5
            while not os.path.lexists(spilled):
                if time.monotonic() > deadline:
                    raise OSError(0, "the daemon never spilled")
                time.sleep(0.005)
            if planted == folder:
                os.rename(folder, folder + ".moved")
            else:
                os.unlink(planted)
            os.symlink(target, planted)
            result["planted"] = planted
    except OSError as exc:
        result = {{"ok": False, "error": exc.strerror}}
    print(json.dumps(result))
    """
)


def _manifest(prefix: str, **extra: Any) -> dict[str, Any]:
    tool = {
        "name": f"{prefix}_probe", "description": "d", "approval": "always", "command": ["probe.py"],
        "schema": {"type": "object"},
    }
    approved = {**tool, "name": f"{prefix}_probe_path", "pathArguments": ["path"]}
    return {"runner": "exec", "stdin": True, "tools": [tool, approved], **extra}


def _kill_marked(marker: str) -> None:
    for pid in marked_processes(marker):
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass


@dataclass
class Tree:
    """A daemon with the probe as a home set (``hp``) and a project set (``pp``)."""

    daemon: Daemon
    base: Path
    workspace: Path
    user_home: Path

    def invoke(self, tool: str, arguments: dict[str, Any], *, project: bool = True,
               **extra: Any) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        name = f"p_{tool}" if project else f"h_{tool}"
        with self.daemon.raw(timeout=60) as conn:
            return conn.invoke({"tool": name, "arguments": arguments,
                                "workspace": str(self.workspace), **extra})

    def probe(self, arguments: dict[str, Any], **kw: Any) -> dict[str, Any]:
        """Run the probe and parse the line it printed."""
        _, reply = self.invoke("probe", arguments, **kw)
        result = reply["result"]
        text = result["content"][0]["text"]
        try:
            return {**json.loads(text.strip().splitlines()[-1]), "isError": result["isError"]}
        except (json.JSONDecodeError, IndexError):
            return {"ok": None, "text": text, "isError": result["isError"]}

    def status(self) -> dict[str, Any]:
        return self.daemon.call("status")["result"]["confinement"]


def _make_tree(config: str = "", args: tuple[str, ...] = (),
               launcher: list[str] | None = None, **manifest: Any) -> Tree:
    base = Path(tempfile.mkdtemp(prefix="tsc-", dir="/var/tmp"))  # see the docstring
    home = base / "home"
    workspace = base / "ws"
    user_home = base / "uh"
    # The interpreter file itself, not the venv link: a checkout under /tmp is hidden by the
    # sandbox's private /tmp (the probe uses the standard library only).
    probe = PROBE.format(python=os.path.realpath(sys.executable))
    write_set(home / "tools", "hp", _manifest("h", **manifest), **{"probe.py": probe})
    write_set(workspace / ".crystal" / "tools", "pp", _manifest("p", **manifest),
              **{"probe.py": probe})
    (home / "config.json").write_text(json.dumps({"externalToolApproval": {"project": "author"}}))
    (user_home / ".ssh").mkdir(parents=True)
    (user_home / ".ssh" / "id_rsa").write_text("PRIVATE KEY\n")
    (user_home / ".bashrc").write_text("# bashrc\n")
    (base / "other-ws").mkdir()
    extra = list(args)
    if config:
        (base / "toolsetd.toml").write_text(textwrap.dedent(config))
        extra += ["--config", str(base / "toolsetd.toml")]
    daemon = start_daemon(home, workspace, base, ["--no-watch", *extra],
                          env={"HOME": str(user_home)}, launcher=launcher)
    return Tree(daemon, base, workspace, user_home)


def _close(tree: Tree) -> None:
    tree.daemon.stop(signal.SIGKILL if tree.daemon.proc.poll() is None else signal.SIGTERM)
    shutil.rmtree(tree.base, ignore_errors=True)


@pytest.fixture(scope="module")
def tree() -> Iterator[Tree]:
    """The default config: cgroups where writable, project sets sandboxed."""
    reason = ensure_bubblewrap()
    t = _make_tree(timeoutSeconds=2)
    try:
        t.bwrap_missing = reason  # type: ignore[attr-defined]
        yield t
    finally:
        _close(t)


def _need_cgroup(t: Tree) -> dict[str, Any]:
    cgroup: dict[str, Any] = t.status()["cgroup"]
    if cgroup["mode"] != "cgroup":
        pytest.skip(f"no writable cgroup v2 tree: {cgroup['reason']}")
    return cgroup


def _need_sandbox(t: Tree) -> None:
    sandbox = t.status()["sandbox"]
    if sandbox["mechanism"] != "bubblewrap":
        pytest.skip(f"no sandbox: {sandbox['reason']}")


@contextlib.contextmanager
def _shared_loopback(*args: str) -> Iterator[Tree]:
    """A daemon serving MCP over HTTP whose project sets keep the network in their sandbox
    (skipped without bubblewrap or a cgroup tree)."""
    ensure_bubblewrap()
    t = _make_tree("[confinement.project]\nnetwork = true\n",
                   args=("--mcp-listen", "127.0.0.1:0", *args))
    try:
        _need_sandbox(t)
        _need_cgroup(t)
        yield t
    finally:
        _close(t)


def _need_controller(t: Tree, name: str) -> None:
    cgroup = _need_cgroup(t)
    if name not in cgroup["controllers"]:
        v1 = [line for line in Path("/proc/self/cgroup").read_text().splitlines()
              if name in line.split(":")[1].split(",")]
        where = f"; it is bound to a cgroup v1 hierarchy ({v1[0]})" if v1 else ""
        pytest.skip(
            f"the cgroup tree {cgroup['tree']} has no {name} controller (enabled: "
            f"{', '.join(cgroup['controllers']) or 'none'}{where})"
        )


# -- status and classify -------------------------------------------------------------------


def test_confinement_status_says_which_mode_is_active(tree: Tree) -> None:
    """status names the cgroup mode (or why process groups) and the sandbox (or why none)."""
    status = tree.status()
    assert status["cgroup"]["mode"] in ("cgroup", "process-group")
    if status["cgroup"]["mode"] == "cgroup":
        assert Path(status["cgroup"]["tree"]).name == f"toolsetd-{tree.daemon.proc.pid}"
        assert (Path(status["cgroup"]["tree"]) / "cgroup.procs").exists()
    else:
        assert status["cgroup"]["reason"]
    assert status["sandbox"]["mechanism"] in ("bubblewrap", "none")


def test_confinement_classify_reports_the_sandbox(tree: Tree) -> None:
    """classify says which profile and network a call would get: project sandboxed, home not."""
    _need_sandbox(tree)
    outside = str(tree.base / "outside.txt")
    wire = tree.daemon.call("classify", {
        "tool": "p_probe_path", "arguments": {"path": outside, "action": "x"},
        "workspace": str(tree.workspace),
    })["result"]
    assert wire["confinement"]["sandbox"] == {
        "profile": "workspace-write", "network": False, "alsoWritable": [outside],
    }
    home = tree.daemon.call("classify", {
        "tool": "h_probe", "arguments": {}, "workspace": str(tree.workspace),
    })["result"]
    assert home["confinement"]["sandbox"] == {"profile": "off", "network": True}
    assert home["confinement"]["failure"] is None


# -- the cgroup --------------------------------------------------------------------------


@pytest.mark.parametrize("how", ["exit", pytest.param("timeout", marks=pytest.mark.slow), "cancel"])
def test_confinement_setsid_grandchild_dies_with_the_call(tree: Tree, how: str) -> None:
    """A grandchild that called setsid is gone when the call ends: exit, timeout or cancel."""
    _need_cgroup(tree)
    marker = f"tsc-{uuid.uuid4().hex}"
    arguments = {"action": "escape", "marker": marker, "wait": how != "exit"}
    try:
        if how == "cancel":
            call_id = f"c-{marker}"
            result: dict[str, Any] = {}

            def run() -> None:
                result["reply"] = tree.invoke("probe", arguments, project=False,
                                              callId=call_id)[1]

            thread = threading.Thread(target=run)
            thread.start()
            eventually(lambda: bool(marked_processes(marker)), what="the grandchild")
            assert tree.daemon.call("cancel", {"callId": call_id})["result"]["cancelled"]
            thread.join(30)
            reply = result["reply"]["result"]
            assert reply["status"] == "cancelled"
        else:
            reply = tree.invoke("probe", arguments, project=False)[1]["result"]
            assert reply["status"] == ("ok" if how == "exit" else "timeout"), reply
        # The answer comes after the cgroup is empty: nothing to wait for.
        assert marked_processes(marker) == []
    finally:
        _kill_marked(marker)


def test_confinement_without_cgroup_the_grandchild_survives() -> None:
    """The control: with cgroup = "off" the setsid'd grandchild outlives its call."""
    t = _make_tree('[confinement]\ncgroup = "off"\nsandbox = "off"\n')
    marker = f"tsc-{uuid.uuid4().hex}"
    try:
        assert t.status()["cgroup"] == {
            "mode": "process-group", "reason": 'cgroups are off in the config (cgroup = "off")',
        }
        t.invoke("probe", {"action": "escape", "marker": marker}, project=False)
        # Waited for: the probe's Popen returns (and the call ends) before the kernel has
        # set the grandchild's argv, which is how it is found.
        eventually(lambda: marked_processes(marker) != [], what="the grandchild")
    finally:
        _kill_marked(marker)
        _close(t)


def test_confinement_call_usage_in_the_log_line(tree: Tree) -> None:
    """call_finished carries the call's CPU time (and peak memory where the kernel tells)."""
    _need_cgroup(tree)
    _, reply = tree.invoke("probe", {"action": "read", "target": "/etc/hostname"}, project=False,
                           callId="usage-1")
    assert reply["result"]["status"] == "ok"
    eventually(lambda: any(e.get("call_id") == "usage-1" and e.get("event") == "call_finished"
                           for e in tree.daemon.log_events()))
    line = next(e for e in tree.daemon.log_events()
                if e.get("call_id") == "usage-1" and e.get("event") == "call_finished")
    assert isinstance(line["cpu_ms"], int)
    assert line["cpu_ms"] >= 1  # a Python interpreter start costs milliseconds
    assert "peak_memory_bytes" in line
    text = tree.daemon.call("metrics", {})["result"]["text"]
    cpu = [row for row in text.splitlines()
           if row.startswith('toolsetd_call_cpu_seconds_total{set="hp"}')]
    assert cpu, text
    assert float(cpu[0].split()[-1]) >= line["cpu_ms"] / 1000


def _remove_cgroup_folder(folder: Path) -> None:
    """Remove the daemon's cgroup folder from outside (its emptied call cgroups first)."""
    for child in folder.iterdir():
        if child.is_dir():
            child.rmdir()
    folder.rmdir()


def test_confinement_a_cgroup_folder_removed_from_outside_is_made_again() -> None:
    """The daemon's folder removed while it runs (an operator's cleanup, a cgroup manager's
    sweep): the next calls run, in a folder made again, instead of failing until a restart."""
    t = _make_tree()
    try:
        folder = Path(_need_cgroup(t)["tree"])
        for _ in range(2):  # the second leaves an emptied call cgroup kept for reuse
            assert t.probe({"action": "read", "target": "/etc/hostname"},
                           project=False)["isError"] is False
        _remove_cgroup_folder(folder)
        for _ in range(3):
            result = t.probe({"action": "read", "target": "/proc/self/cgroup"}, project=False)
            assert result["isError"] is False, result
            own = next(x for x in result["content"].splitlines() if x.startswith("0::"))
            assert f"/{folder.name}/c" in own, own  # in a call cgroup of the folder
        assert (folder / "cgroup.procs").exists()
        remade = [e for e in t.daemon.log_events() if e.get("event") == "cgroup_folder_remade"]
        assert len(remade) == 1, t.daemon.log()
        assert remade[0]["folder"] == str(folder)
        assert remade[0]["level"] == "warning"
    finally:
        _close(t)


def test_confinement_fork_bomb_capped_by_pids_max() -> None:
    """A fork bomb stops at pids.max; the call still ends and takes every child with it."""
    t = _make_tree('[confinement.home]\npids-max = 20\n')
    try:
        _need_controller(t, "pids")
        result = t.probe({"action": "fork-bomb"}, project=False)
        assert result["ok"] is True
        assert result["children"] < 20
        assert result["stopped"]
    finally:
        _close(t)


def test_confinement_memory_hog_killed_by_memory_max() -> None:
    """A tool that outgrows memory.max is OOM-killed, and its result text says so."""
    t = _make_tree('[confinement.home]\nmemory-max = "64M"\n')
    try:
        _need_controller(t, "memory")
        _, reply = t.invoke("probe", {"action": "hog"}, project=False)
        result = reply["result"]
        assert result["isError"] is True
        assert "killed by the out-of-memory killer" in result["content"][0]["text"]
    finally:
        _close(t)


def test_confinement_limit_without_its_controller_fails_closed() -> None:
    """A limit the cgroup tree cannot enforce: the call does not run, and the text says why."""
    t = _make_tree('[confinement.home]\npids-max = 20\nmemory-max = "64M"\n')
    try:
        cgroup = _need_cgroup(t)
        if {"pids", "memory"} <= set(cgroup["controllers"]):
            pytest.skip("the tree has both controllers: the limits are enforced, not refused")
        events, reply = t.invoke("probe", {"action": "write", "target": "x"}, project=False)
        assert events == []
        result = reply["result"]
        assert result["isError"] is True
        text = result["content"][0]["text"]
        assert "controller" in text
        assert "did not run" in text
        assert not (t.workspace / "x").exists()
    finally:
        _close(t)


# -- the sandbox -------------------------------------------------------------------------


def _targets(t: Tree) -> dict[str, str]:
    key = str(t.user_home / ".ssh" / "id_rsa")
    link = t.workspace / "key-link"
    if not link.is_symlink():
        link.symlink_to(key)
    # The user's own Crystal credentials: the daemon's home is --home, elsewhere, but the
    # fence forbids ~/.crystal/credentials.json too, and the sandbox hides what it forbids.
    crystal = t.user_home / ".crystal" / "credentials.json"
    if not crystal.exists():
        crystal.parent.mkdir(exist_ok=True)
        crystal.write_text('{"token": "SECRET"}\n')
    return {
        "bashrc": str(t.user_home / ".bashrc"),
        "crystal-credentials": str(crystal),
        "etc": "/etc/toolsetd-sandbox-test",
        "other": str(t.base / "other-ws" / "file"),
        "key": key,
        "key-link": str(link),
    }


@pytest.mark.parametrize(
    ("action", "target"),
    [
        ("write", "bashrc"),
        ("write", "etc"),
        ("write", "other"),
        ("read", "key"),
        ("read", "key-link"),
        ("hardlink-read", "key"),
        ("read", "crystal-credentials"),
    ],
)
def test_confinement_sandbox_refuses(tree: Tree, action: str, target: str) -> None:
    """workspace-write: writing outside, reading the key (direct, symlink, hard link) or the
    user's own ~/.crystal/credentials.json (the daemon's home is elsewhere) fail."""
    _need_sandbox(tree)
    path = _targets(tree)[target]
    before = Path(path).read_bytes() if Path(path).exists() else None
    result = tree.probe({"action": action, "target": path, "name": uuid.uuid4().hex})
    assert result["ok"] is False, result
    assert "content" not in result
    after = Path(path).read_bytes() if Path(path).exists() else None
    assert after == before


def _passwd_home_elsewhere() -> tuple[Path, list[str]]:
    """A home of the test's with keys in it, and a launcher that gives the daemon a mount
    namespace whose ``/etc/passwd`` names it as its user's home (``HOME`` stays elsewhere)."""
    if shutil.which("unshare") is None or os.geteuid() != 0:
        pytest.skip("needs root and unshare(1) to give the daemon a passwd file of its own")
    passwd_home = Path(tempfile.mkdtemp(prefix="tsc-passwd-", dir="/var/tmp"))
    (passwd_home / ".ssh").mkdir()
    (passwd_home / ".ssh" / "id_ed25519").write_text("PASSWD HOME KEY\n")
    (passwd_home / ".gnupg").mkdir()
    (passwd_home / ".gnupg" / "secring").write_text("PASSWD HOME GPG\n")
    me = pwd.getpwuid(os.getuid())
    entry = ":".join([me.pw_name, "x", str(me.pw_uid), str(me.pw_gid), me.pw_gecos,
                      str(passwd_home), me.pw_shell])
    (passwd_home / "passwd").write_text(entry + "\n")
    launcher = ["unshare", "--mount", "--propagation", "private", "--", "sh", "-c",
                'mount --bind "$0" /etc/passwd && exec "$@"', str(passwd_home / "passwd"),
                sys.executable, "-m", "toolsetd.daemon"]
    return passwd_home, launcher


def test_confinement_credentials_of_the_passwd_home_hidden_when_home_is_elsewhere() -> None:
    """A daemon whose ``HOME`` is not its user's passwd home hides the passwd home's
    credential paths too.

    ssh reads its keys from the passwd entry's home whatever ``HOME`` says, so a daemon
    started with ``HOME`` elsewhere (``sudo -E``, a unit's ``Environment=HOME=``) hid an
    empty ``$HOME/.ssh`` and left the keys ssh uses readable to every sandboxed call. The
    daemon runs in a mount namespace of its own, whose ``/etc/passwd`` gives its user a
    home of the test's.
    """
    ensure_bubblewrap()
    passwd_home, launcher = _passwd_home_elsewhere()
    t = _make_tree(launcher=launcher)
    try:
        _need_sandbox(t)
        for key in (".ssh/id_ed25519", ".gnupg/secring"):
            result = t.probe({"action": "read", "target": str(passwd_home / key)})
            assert "content" not in result, (key, result)
        # $HOME's stay hidden too.
        result = t.probe({"action": "read", "target": str(t.user_home / ".ssh" / "id_rsa")})
        assert "content" not in result, result
    finally:
        _close(t)
        shutil.rmtree(passwd_home, ignore_errors=True)


def test_policy_hard_link_to_a_key_of_the_passwd_home_is_forbidden_when_home_is_elsewhere(
) -> None:
    """The fence's identity check knows the passwd home's keys too, not only ``$HOME``'s.

    A hard link in the workspace to the passwd home's ``~/.ssh/id_ed25519`` (the key ssh
    uses, whatever ``HOME`` says) has no credential segment; it was judged ``workspace`` and
    an unconfined call was handed the key. No sandbox is needed to see it: ``classify``
    judges it, and the home set runs unconfined.
    """
    passwd_home, launcher = _passwd_home_elsewhere()
    t = _make_tree(launcher=launcher)
    try:
        for key, name in ((".ssh/id_ed25519", "notes.txt"), (".gnupg/secring", "ring.txt")):
            os.link(passwd_home / key, t.workspace / name)
            params = {"tool": "h_probe_path", "arguments": {"path": name},
                      "workspace": str(t.workspace)}
            result = t.daemon.call("classify", params)["result"]
            assert result["paths"][0]["scope"] == "forbidden", (key, result)
            assert "hard link" in result["reason"], result
            _, reply = t.invoke("probe_path", {"path": name, "action": "read", "target": name},
                                project=False)
            assert "PASSWD HOME" not in json.dumps(reply), reply
    finally:
        _close(t)
        shutil.rmtree(passwd_home, ignore_errors=True)


def test_confinement_hidden_folder_holding_another_hidden_path_still_runs() -> None:
    """A hidden folder listed before a hidden path inside it (``hide = ["~/.aws",
    "~/.aws/credentials"]``) hides both; the call runs.

    The inner path was mounted after the folder's empty read-only tmpfs, where bubblewrap
    could not make its mount point: every sandboxed call failed to set up.
    """
    ensure_bubblewrap()
    base_config = '[confinement]\nhide = ["~/.aws", "~/.aws/credentials"]\n'
    t = _make_tree(base_config)
    try:
        _need_sandbox(t)
        key = t.user_home / ".aws" / "credentials"
        key.parent.mkdir(exist_ok=True)
        key.write_text("AWS SECRET\n")
        result = t.probe({"action": "read", "target": str(key)})
        assert result == {"ok": False, "error": "No such file or directory",
                          "isError": False}, result
    finally:
        _close(t)


def test_confinement_hidden_linked_folder_holding_another_hidden_path_still_runs() -> None:
    """The same when the hidden folder is a link to a folder elsewhere (``~/.aws`` kept by
    a dotfile manager): the folder is hidden where it leads, and the path inside it, named
    through the link, lies there too.

    Compared by their names, the path was not inside the folder's target, was mounted after
    the empty read-only tmpfs there, and bubblewrap, following the link, could not make its
    mount point: every sandboxed call failed to set up.
    """
    ensure_bubblewrap()
    t = _make_tree('[confinement]\nhide = ["~/.aws", "~/.aws/credentials"]\n')
    try:
        _need_sandbox(t)
        kept = t.base / "dotfiles" / "aws"
        kept.mkdir(parents=True)
        (kept / "credentials").write_text("AWS SECRET\n")
        (t.user_home / ".aws").symlink_to(kept)
        key = t.user_home / ".aws" / "credentials"
        result = t.probe({"action": "read", "target": str(key)})
        assert result == {"ok": False, "error": "No such file or directory",
                          "isError": False}, result
    finally:
        _close(t)


def test_confinement_sandbox_writes_the_workspace_and_its_tmp(tree: Tree) -> None:
    """workspace-write: the workspace takes the write; the home set (off) is not sandboxed."""
    _need_sandbox(tree)
    target = tree.workspace / "out.txt"
    assert tree.probe({"action": "write", "target": str(target)})["ok"] is True
    assert target.read_text() == "written by the tool\n"
    assert tree.probe({"action": "write", "target": "/tmp/private"})["ok"] is True
    assert not Path("/tmp/private").exists()  # the sandbox's /tmp was private
    readable = tree.probe({"action": "read", "target": str(tree.user_home / ".bashrc")})
    assert readable["content"] == "# bashrc\n"
    # The home set runs unsandboxed by default: the same read of the key works there.
    assert tree.probe({"action": "read", "target": _targets(tree)["key"]},
                      project=False)["content"] == "PRIVATE KEY\n"


def test_confinement_sandbox_runs_in_a_workspace_whose_name_holds_a_line_separator(
    tree: Tree,
) -> None:
    """The bind check read the sandbox's /proc/<pid>/mountinfo with ``splitlines``, which
    also splits at U+2028 (and \\x1c-\\x1e, U+0085, U+2029): a workspace so named (a
    name pasted from a document) was never found bound, and every sandboxed call there
    failed, "changed while its sandbox was being made". So did a carriage return: the file
    was read in text mode, which turns ``\\r`` into ``\\n``. The kernel ends its lines
    with ``\\n`` alone (and escapes that one in paths)."""
    _need_sandbox(tree)
    for odd in ("\u2028", "\x1c", "\x85", "\r"):
        workspace = tree.base / f"ws{odd}sep"
        shutil.copytree(tree.workspace / ".crystal", workspace / ".crystal")
        with tree.daemon.raw(timeout=60) as conn:
            _, reply = conn.invoke({"tool": "p_probe", "workspace": str(workspace),
                                    "arguments": {"action": "write",
                                                  "target": str(workspace / "out.txt")}})
        result = reply["result"]
        assert result["isError"] is False, (repr(odd), result)
        assert (workspace / "out.txt").read_text() == "written by the tool\n"


def test_confinement_sandboxed_call_cannot_call_the_mcp_http_endpoint() -> None:
    """A sandboxed call that keeps the network is refused by the daemon's MCP endpoint.

    It shares the loopback, and the peer check sees the daemon's own uid: it used to get
    a session with ``mode=full`` and could run any tool outside its sandbox. The socket's
    cgroup tells it apart; the call cannot leave its cgroup (cgroupfs is read-only in the
    sandbox). An unsandboxed call (the home set) still gets in, as over the Unix socket.
    """
    token = Path(tempfile.mkdtemp(prefix="tsc-token-", dir="/var/tmp")) / "token"
    token.write_text("s3cret-token\n")
    token.chmod(0o600)
    try:
        with _shared_loopback("--mcp-token-file", str(token)) as t:
            cgroup = _need_cgroup(t)
            # The bearer token (for peers whose uid is unknown) is hidden like the socket.
            assert t.probe({"action": "read", "target": str(token)}).get("content") is None
            assert t.probe({"action": "read", "target": str(token)},
                           project=False)["content"] == "s3cret-token\n"
            url = endpoint(listening_urls(t.daemon)[0], t.workspace, mode="full")
            inside = t.probe({"action": "mcp-post", "target": url,
                              "move_to": os.path.join(cgroup["tree"], "cgroup.procs")})
            assert inside["moved"] is not True, inside
            assert inside["status"] == 403, inside
            assert "inside a sandboxed call" in inside["body"]
            outside = t.probe({"action": "mcp-post", "target": url}, project=False)
            assert outside["status"] == 200, outside
            refused = [e for e in t.daemon.log_events()
                       if e.get("event") == "mcp_http_peer_refused"]
            assert refused and refused[0]["sandboxed"] is True
    finally:
        shutil.rmtree(token.parent)


def test_confinement_sandboxed_call_cannot_clone_into_another_cgroup() -> None:
    """A sandboxed call with the network cannot make a process in another cgroup to call
    the MCP HTTP endpoint from.

    ``clone3(CLONE_INTO_CGROUP)`` takes a cgroup folder's descriptor, and the kernel checks
    the mode of its ``cgroup.procs``, not the read-only bind the folder is seen through: a
    child made in the cgroup tree above the call's, as the daemon's uid, got a session.
    Such a call does not see the cgroup v2 mounts at all.
    """
    with _shared_loopback() as t:
        mounts = _cgroup2_mounts()
        url = endpoint(listening_urls(t.daemon)[0], t.workspace, mode="full")
        inside = t.probe({"action": "mcp-post", "target": url, "clone_into": mounts[0]})
        assert "status" not in inside, inside
        # No folder on the way (ENOENT), or one that is no cgroup (EBADF): the folders
        # above the call's own cgroup, shown again, are the hiding tmpfs's.
        assert inside["error"] in ("No such file or directory", "Bad file descriptor"), inside


def _cgroup2_mounts() -> list[str]:
    """Where cgroup v2 is mounted, as ``/proc/self/mounts`` lists it."""
    return [line.split()[1] for line in Path("/proc/self/mounts").read_text().splitlines()
            if line.split()[2] == "cgroup2"]


def _namespace_test_mounts(why_root: str) -> list[str]:
    """The cgroup v2 mounts, for a test that gives the daemon a cgroup namespace: skipped
    without root and unshare(1), or where the tests do not run in the root cgroup
    (``why_root`` says why the test needs it)."""
    if shutil.which("unshare") is None or os.geteuid() != 0:
        pytest.skip("needs root and unshare(1) for a cgroup namespace")
    own = [x for x in Path("/proc/self/cgroup").read_text().splitlines() if x.startswith("0::")]
    if own != ["0::/"]:
        pytest.skip(why_root)
    return _cgroup2_mounts()


def _new_cgroups(mounts: list[str], *prefixes: str) -> list[Path]:
    """One new cgroup per prefix (``<prefix>-<tag>``) at the root of the first cgroup v2
    mount; the test is skipped where there is none or they cannot be made. The caller
    removes them."""
    if not mounts:
        pytest.skip("no cgroup v2 mount")
    tag = uuid.uuid4().hex[:8]
    made: list[Path] = []
    for prefix in prefixes:
        folder = Path(mounts[0]) / f"{prefix}-{tag}"
        try:
            folder.mkdir()
        except OSError as exc:
            for done in made:
                done.rmdir()
            pytest.skip(f"cannot make a cgroup on {mounts[0]}: {exc.strerror}")
        made.append(folder)
    return made


def test_confinement_sandboxed_call_cannot_leave_its_cgroup(tree: Tree) -> None:
    """A sandboxed call without the network cannot make a process outside its cgroup.

    ``clone3(CLONE_INTO_CGROUP)`` with the descriptor of a folder above the call's cgroup
    made a child there (the kernel checks the mode of its ``cgroup.procs``, not the
    read-only bind): out of the call's ``memory-max``, ``pids-max`` and ``cpu-max``, and of
    its accounting. The cgroup v2 mounts are hidden from every sandboxed call.
    """
    _need_sandbox(tree)
    _need_cgroup(tree)
    mounts = _cgroup2_mounts()
    inside = tree.probe({"action": "clone-into", "target": mounts[0]})
    assert "child" not in inside, inside
    # No folder on the way (ENOENT), or one that is no cgroup (EBADF): the folders above
    # the call's own cgroup, shown again, are the hiding tmpfs's.
    assert inside["error"] in ("No such file or directory", "Bad file descriptor"), inside
    # Unsandboxed (the home set), the same clone lands above the call's cgroup.
    outside = tree.probe({"action": "clone-into", "target": mounts[0]}, project=False)
    assert outside["child"] != outside["own"], outside


def test_confinement_sandboxed_call_without_cgroups_clones_into_no_other_cgroup() -> None:
    """Without a cgroup per call (process groups), a sandboxed call still cannot make a
    process in another cgroup.

    The cgroup v2 mounts were hidden only where calls run in cgroups: in process-group mode
    ``clone3(CLONE_INTO_CGROUP)`` with a folder's descriptor put a child in any cgroup whose
    ``cgroup.procs`` the daemon's uid may write (as root: every one, another service's or
    another daemon's call's, into their limits and accounting). The daemon's own cgroup,
    the call's, is shown again read-only, as a call's own is.
    """
    ensure_bubblewrap()
    mounts = _cgroup2_mounts()
    other, own = _new_cgroups(mounts, "tsc-other", "tsc-daemon")
    # The daemon runs in a cgroup of its own below the root, as under a service manager.
    launcher = ["sh", "-c", 'echo $$ > "$0/cgroup.procs" && exec "$@"', str(own),
                sys.executable, "-m", "toolsetd.daemon"]
    t = _make_tree('[confinement]\ncgroup = "off"\n', launcher=launcher)
    try:
        _need_sandbox(t)
        assert t.status()["cgroup"]["mode"] != "cgroup"
        # Unsandboxed (the home set), the clone lands there.
        outside = t.probe({"action": "clone-into", "target": str(other)}, project=False)
        assert outside.get("child") == "/" + other.name, outside
        inside = t.probe({"action": "clone-into", "target": str(other)})
        assert "child" not in inside, inside
        assert inside["error"] in ("No such file or directory", "Bad file descriptor"), inside
        # Its own cgroup, the daemon's, it reads and cannot change.
        seen = t.probe({"action": "own-cgroup", "target": mounts[0]})
        assert seen["own"] == "/" + own.name, seen
        assert seen["procs"], seen
        assert seen["write"] == seen["mkdir"] == "Read-only file system", seen
    finally:
        _close(t)
        other.rmdir()
        eventually(lambda: not (own / "cgroup.procs").read_text().split(), what="daemon gone")
        own.rmdir()


#: Runs the daemon in a cgroup namespace whose root (``argv[1]``) it then leaves, for
#: the root cgroup of the mount ``argv[2]``.
_OUT_OF_NAMESPACE = (
    "import ctypes, os, sys\n"
    "entry, mount = sys.argv[1:3]\n"
    "open(os.path.join(entry, 'cgroup.procs'), 'w').write('0')\n"
    "if ctypes.CDLL(None, use_errno=True).unshare(0x02000000) != 0:  # CLONE_NEWCGROUP\n"
    "    sys.exit(f'unshare: {os.strerror(ctypes.get_errno())}')\n"
    "open(os.path.join(mount, 'cgroup.procs'), 'w').write('0')\n"
    "os.execv(sys.executable, [sys.executable, '-m', 'toolsetd.daemon', *sys.argv[3:]])\n"
)


def test_confinement_a_daemon_outside_its_cgroup_namespace_shows_no_cgroup_mount() -> None:
    """A daemon in a cgroup namespace whose root is not an ancestor of its cgroup (it
    entered the namespace, or was moved out of its root, as ``nsenter --cgroup`` leaves a
    process) reads its cgroup as a path that climbs out (``0::/..``). Joined to the mount,
    that named a folder above it (``/sys/fs/cgroup``), which every sandboxed call without a
    cgroup of its own was shown again, the cgroup v2 mounts inside it with it: a
    ``clone3(CLONE_INTO_CGROUP)`` then put a child in any cgroup, as if nothing was hidden.
    """
    ensure_bubblewrap()
    mounts = _namespace_test_mounts("the test moves the daemon into the root cgroup, where it runs")
    other, entry = _new_cgroups(mounts, "tsc-other", "tsc-ns")
    # The namespace's root is ``entry``; the daemon then goes back to the root cgroup.
    launcher = [sys.executable, "-c", _OUT_OF_NAMESPACE, str(entry), mounts[0]]
    t = _make_tree('[confinement]\ncgroup = "off"\n', launcher=launcher)
    try:
        _need_sandbox(t)
        outside = t.probe({"action": "read", "target": "/proc/self/cgroup"}, project=False)
        assert "0::/..\n" in outside["content"], outside
        inside = t.probe({"action": "clone-into", "target": str(other)})
        assert "child" not in inside, inside
        seen = t.probe({"action": "read", "target": str(other / "cgroup.procs")})
        assert "content" not in seen, seen
    finally:
        _close(t)
        for folder in (other, entry):  # once the processes that were in it are gone
            eventually(lambda f=folder: _removed(f), what=f"{folder} removed")


#: Runs the daemon in a cgroup namespace whose root is its cgroup (``argv[1]``), as a
#: container with a cgroup namespace of its own and the host's cgroup mount has it.
_IN_NAMESPACE = (
    "import ctypes, os, sys\n"
    "entry = sys.argv[1]\n"
    "open(os.path.join(entry, 'cgroup.procs'), 'w').write('0')\n"
    "if ctypes.CDLL(None, use_errno=True).unshare(0x02000000) != 0:  # CLONE_NEWCGROUP\n"
    "    sys.exit(f'unshare: {os.strerror(ctypes.get_errno())}')\n"
    "os.execv(sys.executable, [sys.executable, '-m', 'toolsetd.daemon', *sys.argv[2:]])\n"
)


def test_confinement_a_daemon_in_a_cgroup_namespace_stays_in_its_cgroup() -> None:
    """A daemon whose cgroup is the root of its cgroup namespace reads it as ``0::/``,
    and a mount made outside the namespace shows the hierarchy's root (``/..`` in its
    ``mountinfo`` root). Joined to that mount, ``/`` named the hierarchy's root: the
    daemon made its calls' tree there, outside its own cgroup (and its limits), and after
    its first call's spawn "went back" to the root cgroup, leaving its own for good. Its
    folder is where a mount shows its cgroup (as ``daemon_cgroup`` has it): this mount
    shows it under a name the daemon cannot know, so it has no cgroup tree (and says
    why), and stays where it is."""
    mounts = _namespace_test_mounts("the test makes the daemon's cgroup below the root cgroup")
    (entry,) = _new_cgroups(mounts, "tsc-in")
    t = _make_tree(launcher=[sys.executable, "-c", _IN_NAMESPACE, str(entry)])
    pid = t.daemon.proc.pid
    try:
        cgroup = t.status()["cgroup"]
        assert cgroup["mode"] != "cgroup", cgroup
        assert "no cgroup v2 mount shows the daemon's cgroup" in cgroup["reason"], cgroup
        done = t.probe({"action": "read", "target": "/proc/self/cgroup"}, project=False)
        assert "content" in done, done
        lines = Path(f"/proc/{pid}/cgroup").read_text().splitlines()
        assert [x for x in lines if x.startswith("0::")] == [f"0::/{entry.name}"], lines
    finally:
        t.daemon.stop(signal.SIGTERM)
        _close(t)
        for root, dirs, _ in os.walk(Path(mounts[0]), topdown=False):
            for name in dirs:  # the tree the daemon left, wherever it made it
                if name == f"toolsetd-{pid}" or root.startswith(str(entry)):
                    with contextlib.suppress(OSError):
                        Path(root, name).rmdir()
        eventually(lambda: _removed(entry), what=f"{entry} removed")


def _removed(folder: Path) -> bool:
    try:
        folder.rmdir()
    except FileNotFoundError:
        return True
    except OSError:
        return False
    return True


def test_confinement_sandboxed_call_reads_its_own_cgroup_and_changes_nothing(tree: Tree) -> None:
    """With the cgroup v2 mounts hidden, a sandboxed call still finds its own cgroup where
    ``/proc/self/cgroup`` names it (a runtime sizes its heap from its ``memory.max``), read
    only: it can neither write its ``cgroup.procs`` nor make a cgroup below it, and a clone
    into it stays in it."""
    _need_sandbox(tree)
    _need_cgroup(tree)
    mounts = _cgroup2_mounts()
    inside = tree.probe({"action": "own-cgroup", "target": mounts[0]})
    assert inside["ok"] is True, inside
    assert inside["own"].startswith("/toolsetd-"), inside
    assert inside["procs"], inside  # its own processes, seen by their pids outside
    assert inside["write"] == inside["mkdir"] == "Read-only file system", inside


# Takes over the sandbox's init (bubblewrap's process, pid 1 of the call's namespace: the
# tool's user, no capability, dumpable): ptrace it, have it clear its parent-death signal
# and leave the group (setsid), then do the same in the tool itself. x86_64 only.
HIJACK = textwrap.dedent(
    """\
    import ctypes, os, signal, sys, time
    libc = ctypes.CDLL(None, use_errno=True)
    libc.ptrace.restype = ctypes.c_long
    libc.ptrace.argtypes = [ctypes.c_long, ctypes.c_long, ctypes.c_void_p, ctypes.c_void_p]
    ATTACH, DETACH, GETREGS, SETREGS, SINGLESTEP, WALL = 16, 17, 12, 13, 9, 0x40000000
    class Regs(ctypes.Structure):
        _fields_ = [(n, ctypes.c_ulonglong) for n in (
            "r15 r14 r13 r12 rbp rbx r11 r10 r9 r8 rax rcx rdx rsi rdi orig_rax rip cs "
            "eflags rsp ss fs_base gs_base ds es fs gs").split()]
    def check(r):
        if r < 0:
            raise OSError(ctypes.get_errno(), os.strerror(ctypes.get_errno()))
    check(libc.ptrace(ATTACH, 1, None, None))
    os.waitpid(1, WALL)
    saved = Regs()
    check(libc.ptrace(GETREGS, 1, None, ctypes.byref(saved)))
    syscall = None  # the address of a syscall instruction in the init's code
    with open("/proc/1/maps") as maps, open("/proc/1/mem", "rb") as mem:
        for line in maps:
            fields = line.split()
            if "x" in fields[1] and syscall is None:
                start, end = (int(x, 16) for x in fields[0].split("-"))
                try:
                    mem.seek(start)
                    at = mem.read(min(end - start, 1 << 20)).find(b"\\x0f\\x05")
                except OSError:
                    continue
                if at >= 0:
                    syscall = start + at
    def inject(number, *args):
        regs = Regs()
        ctypes.memmove(ctypes.byref(regs), ctypes.byref(saved), ctypes.sizeof(Regs))
        regs.rax, regs.orig_rax, regs.rip = number, 2**64 - 1, syscall
        for name, value in zip(("rdi", "rsi"), args):
            setattr(regs, name, value)
        check(libc.ptrace(SETREGS, 1, None, ctypes.byref(regs)))
        check(libc.ptrace(SINGLESTEP, 1, None, None))
        os.waitpid(1, WALL)
        check(libc.ptrace(GETREGS, 1, None, ctypes.byref(regs)))
        return ctypes.c_longlong(regs.rax).value
    done = (inject(157, 1, 0), inject(112))  # prctl(PR_SET_PDEATHSIG, 0), setsid()
    check(libc.ptrace(SETREGS, 1, None, ctypes.byref(saved)))
    check(libc.ptrace(DETACH, 1, None, None))
    os.setsid()
    libc.prctl(1, 0, 0, 0, 0)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if done[0] == 0 and done[1] > 0:
        open(os.path.join(os.environ["CRYSTAL_WORKSPACE"], sys.argv[1]), "w").close()
    time.sleep(1000)
    """
)


@pytest.mark.skipif(os.uname().machine != "x86_64", reason="the takeover injects x86_64 code")
def test_confinement_sandboxed_call_that_takes_over_its_init_does_not_outlive_it() -> None:
    """A sandboxed call without a cgroup does not outlive its call by taking over the init
    of its PID namespace.

    That init (bubblewrap's process inside) runs as the tool's user and is dumpable: the
    tool ptraced it, cleared its parent-death signal and moved it to a session of its own,
    then left the group itself. The timeout's SIGKILL of the group then reached neither,
    bubblewrap's death no longer took the init, and both kept running with the
    workspace writable after the call ended. The daemon SIGKILLs the init itself.
    """
    t = _make_tree('[confinement]\ncgroup = "off"\n', args=("--kill-grace", "1"),
                   timeoutSeconds=3)
    marker = f"tsc-{uuid.uuid4().hex}"
    try:
        _need_sandbox(t)
        script = t.base / "hijack.py"
        script.write_text(HIJACK)
        python = os.path.realpath(sys.executable)
        _, reply = t.invoke("probe", {"action": "exec", "argv": [python, str(script), marker]})
        assert reply["result"]["status"] == "timeout", reply
        if not (t.workspace / marker).exists():
            pytest.skip("the tool could not take over its sandbox's init here")
        eventually(lambda: marked_processes(marker) == [], timeout=10,
                   what="the call's processes gone")
    finally:
        _kill_marked(marker)
        _close(t)


def test_confinement_sandboxed_call_with_the_network_makes_no_user_namespace() -> None:
    """A sandboxed call that shares the loopback with the MCP endpoint cannot make a user
    namespace (bubblewrap's --disable-userns); its other calls still can.

    In one of its own, with a mount and a cgroup namespace, a call of a daemon that is not
    root mounts a cgroup2 of its cgroup, makes a cgroup below it and moves there: its
    sockets' cgroup is then not the call's. (Root's cannot: mapping uid 0 needs
    CAP_SETFCAP, so this test shows the namespace, not the move.)
    """
    with _shared_loopback() as t:
        made = t.probe({"action": "userns"})
        assert made == {"ok": False, "error": "No space left on device", "isError": False}
    t = _make_tree("[confinement.project]\nnetwork = true\n")
    try:
        _need_sandbox(t)
        assert t.probe({"action": "userns"})["ok"] is True
    finally:
        _close(t)


def test_confinement_network_and_mcp_http_without_disable_userns_fail_closed() -> None:
    """A bubblewrap that cannot --disable-userns (before 0.8, or setuid) could not keep such
    a call in its cgroup: with --mcp-listen it does not run, and ``classify`` says so."""
    ensure_bubblewrap()
    folder = Path(tempfile.mkdtemp(prefix="tsc-bwrap-", dir="/var/tmp"))
    older = folder / "bwrap"
    older.write_text(textwrap.dedent(f"""\
        #!/bin/sh
        for arg; do
            [ "$arg" = --disable-userns ] && {{ echo "bwrap: Unknown option $arg" >&2; exit 1; }}
        done
        exec {shutil.which("bwrap")} "$@"
        """))
    older.chmod(0o755)
    t = _make_tree(f'[confinement]\nsandbox = "{older}"\n[confinement.project]\nnetwork = true\n',
                   args=("--mcp-listen", "127.0.0.1:0"))
    try:
        _need_sandbox(t)
        _need_cgroup(t)
        result = t.probe({"action": "userns"})
        assert result["ok"] is None and result["isError"] is True, result
        assert "--disable-userns" in result["text"] and "did not run" in result["text"]
        reply = t.daemon.call("classify", {"tool": "p_probe", "arguments": {"action": "x"},
                                           "workspace": str(t.workspace)})
        assert "--disable-userns" in reply["result"]["confinement"]["failure"]
        assert t.probe({"action": "userns"}, project=False)["ok"] is True
    finally:
        _close(t)
        shutil.rmtree(folder)


def test_confinement_network_and_mcp_http_without_cgroups_fail_closed() -> None:
    """Without a cgroup per call a sandboxed call with the network would be anonymous on
    the loopback: with --mcp-listen it does not run, and ``classify`` says so first."""
    ensure_bubblewrap()
    t = _make_tree('[confinement]\ncgroup = "off"\n[confinement.project]\nnetwork = true\n',
                   args=("--mcp-listen", "127.0.0.1:0"))
    try:
        _need_sandbox(t)
        url = endpoint(listening_urls(t.daemon)[0], t.workspace)
        result = t.probe({"action": "mcp-post", "target": url})
        assert result["ok"] is None and result["isError"] is True, result
        assert "--mcp-listen" in result["text"] and "did not run" in result["text"]
        reply = t.daemon.call("classify", {"tool": "p_probe", "arguments": {"action": "x"},
                                           "workspace": str(t.workspace)})
        assert "--mcp-listen" in reply["result"]["confinement"]["failure"]
        # The home set (unsandboxed) and the sets whose network is denied still run.
        assert t.probe({"action": "mcp-post", "target": url}, project=False)["status"] == 200
    finally:
        _close(t)


def test_confinement_sandbox_denies_the_network(tree: Tree) -> None:
    """With the network denied a TCP connection to a listening host port fails."""
    _need_sandbox(tree)
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        address = f"127.0.0.1:{server.getsockname()[1]}"
        assert tree.probe({"action": "connect", "target": address}, project=False)["ok"] is True
        assert tree.probe({"action": "connect", "target": address})["ok"] is False


def test_confinement_sandbox_hides_the_daemon_socket(tree: Tree) -> None:
    """A sandboxed tool cannot call the daemon through its socket."""
    _need_sandbox(tree)
    result = tree.probe({"action": "read", "target": str(tree.daemon.socket)})
    assert result.get("content", "") == ""  # /dev/null over it


def test_confinement_sandbox_holds_no_capability(tree: Tree) -> None:
    """A daemon run as root gave bubblewrap, and so the tool, every capability: the tool
    could umount the tmpfs over ~/.ssh and read the key (or remount / read-write). Now the
    tool holds none, cannot take a hiding mount away, and has its own IPC namespace."""
    _need_sandbox(tree)
    key = str(tree.user_home / ".ssh" / "id_rsa")
    result = tree.probe({"action": "uncover-read", "target": key})
    assert "content" not in result, result
    assert result["ok"] is False
    status = tree.probe({"action": "read", "target": "/proc/self/status"})["content"]
    assert "CapEff:\t0000000000000000" in status
    assert "CapPrm:\t0000000000000000" in status
    ipc = tree.probe({"action": "ipc"})
    assert ipc["ipc"] != os.readlink("/proc/self/ns/ipc"), ipc


def test_confinement_sandboxed_tool_gets_the_grace_period_on_timeout(tree: Tree) -> None:
    """Timeout sends SIGTERM, then a grace period: SIGTERM used to reach bubblewrap too,
    which died at once and took the sandbox with it (SIGKILL), so a sandboxed tool never
    ran its SIGTERM handler. Now the tool's handler runs and writes its file."""
    _need_sandbox(tree)
    target = tree.workspace / f"cleanup-{uuid.uuid4().hex}"
    _, reply = tree.invoke("probe", {"action": "trap-term", "target": str(target)})
    assert reply["result"]["status"] == "timeout", reply
    assert target.read_text() == "cleaned up\n"


def test_confinement_stopped_sandboxed_tool_gets_the_grace_period_on_timeout(tree: Tree) -> None:
    """A sandboxed tool that is stopped (SIGSTOP) when its call times out is continued
    after the grace SIGTERM, so it runs its handler: stopped, it sat out the grace and
    died by SIGKILL without it."""
    _need_sandbox(tree)
    target = tree.workspace / f"cleanup-stopped-{uuid.uuid4().hex}"
    _, reply = tree.invoke("probe", {"action": "trap-term-stopped", "target": str(target)})
    assert reply["result"]["status"] == "timeout", reply
    assert target.read_text() == "cleaned up\n"


def test_confinement_grace_sigterm_reaches_every_process_of_a_sandboxed_call(
    tree: Tree,
) -> None:
    """The grace SIGTERM of a sandboxed call goes to each of its processes (pinned by
    pidfds as they are listed, bubblewrap spared): the tool and both its children run their
    clean-up."""
    _need_sandbox(tree)
    target = tree.workspace / f"cleanup-all-{uuid.uuid4().hex}"
    _, reply = tree.invoke("probe", {"action": "trap-term-all", "target": str(target)})
    assert reply["result"]["status"] == "timeout", reply
    for index in range(3):
        assert Path(f"{target}.{index}").read_text() == "cleaned up\n"


def test_confinement_tool_failing_like_bubblewrap_is_not_a_setup_failure(tree: Tree) -> None:
    """A tool that exits 1 with a stderr starting ``bwrap: `` (a bubblewrap of its own, or a
    lie) got its output replaced by "the sandbox could not be set up, so the tool did not
    run", after it had run. bubblewrap's status says it ran: its own result stands."""
    _need_sandbox(tree)
    target = tree.workspace / f"ran-{uuid.uuid4().hex}"
    _, reply = tree.invoke("probe", {"action": "fake-setup-failure", "target": str(target)})
    text = reply["result"]["content"][0]["text"]
    assert target.read_text() == "the tool ran\n"
    assert "could not be set up" not in text, text
    assert text.startswith("exit 1\ndone its work\n"), text
    assert reply["result"]["exitCode"] == 1


@pytest.mark.parametrize("how", ["relative", "hidden-interpreter"])
def test_confinement_command_that_cannot_be_executed_is_not_blamed_on_the_sandbox(
    tree: Tree, how: str
) -> None:
    """A sandboxed script whose ``#!`` interpreter cannot be run in the sandbox (``#!bash``,
    looked for in the workspace; one under the host's ``/tmp``, which the sandbox's private
    ``/tmp`` hides) made bubblewrap's ``execvp`` fail once the sandbox was built, and the
    call said "the sandbox could not be set up". It is the command that could not be
    executed: the text says so as an unsandboxed start does, and names the cause."""
    _need_sandbox(tree)
    workspace = tree.base / f"ws-exec-{uuid.uuid4().hex}"
    host_tmp = Path(tempfile.mkdtemp(prefix="tsc-interp-"))  # the host's /tmp
    try:
        interpreter = host_tmp / "sh"
        interpreter.symlink_to("/bin/sh")
        line = "#!bash" if how == "relative" else f"#!{interpreter}"
        manifest = {"runner": "exec", "tools": [
            {"name": "x_run", "description": "d", "command": ["run.sh"], "schema": {"type": "object"}},
        ]}
        write_set(workspace / ".crystal" / "tools", "xp", manifest,
                  **{"run.sh": f"{line}\necho ran\n"})
        with tree.daemon.raw(timeout=60) as conn:
            _, reply = conn.invoke({"tool": "x_run", "arguments": {}, "workspace": str(workspace),
                                     "approved": True})
        result = reply["result"]
        text = result["content"][0]["text"]
        assert result["isError"] is True, result
        assert "could not be set up" not in text, text
        script = workspace / ".crystal" / "tools" / "xp" / "run.sh"
        assert text.startswith(
            f"The external process failed to start: No such file or directory: {script}. "
        ), text
        named = "a relative path" if how == "relative" else "a sandboxed call has a /tmp of its own"
        assert named in text, text
    finally:
        shutil.rmtree(workspace, ignore_errors=True)
        shutil.rmtree(host_tmp, ignore_errors=True)


@pytest.mark.parametrize("approved", [None, "/proc", "/proc/sys/kernel"])
def test_confinement_sandbox_keeps_kernel_settings_read_only(
    tree: Tree, approved: str | None
) -> None:
    """``/proc/sys`` is read-only in the sandbox, even with ``/proc`` approved writable.

    bubblewrap's ``--proc`` covers it only when its own ``access(W_OK)`` of the folder
    succeeds, which it did not under a daemon run as root: the tool, uid 0 without a
    capability, could open the 0644 sysctls for writing (``kernel/core_pattern`` runs a
    program as root outside the sandbox).
    """
    _need_sandbox(tree)
    tool, extra = ("probe", {}) if approved is None else ("probe_path", {"path": approved})

    def probe(arguments: dict[str, Any]) -> dict[str, Any]:
        _, reply = tree.invoke(tool, {**arguments, **extra}, approved=True)
        text = reply["result"]["content"][0]["text"]
        result: dict[str, Any] = json.loads(text.strip().splitlines()[-1])
        return result

    mounted = probe({"action": "mount-options", "target": "/proc/sys"})
    assert mounted.get("options", "").split(",")[0] == "ro", mounted
    opened = probe({"action": "open-write", "target": "/proc/sys/kernel/core_pattern"})
    assert opened["ok"] is False, opened
    # Nor through another process's root: a /proc approved writable was the host's, where
    # /proc/<pid>/root of bubblewrap's own process (uid 0, no capability) led to the
    # host's root and its writable /proc/sys.
    around = probe({"action": "open-write-any", "target": "/proc/sys/kernel/core_pattern"})
    assert around.get("writable") == [], around


#: Kernel settings in sysfs that uid 0 may open for writing without a capability (0644).
_SYSFS_SETTINGS = ("/sys/kernel/mm/transparent_hugepage/enabled", "/sys/power/state")


@pytest.mark.parametrize("approved", ["/sys", "setting's folder", "cgroup tree"])
def test_confinement_approved_sys_stays_read_only(tree: Tree, approved: str) -> None:
    """``/sys`` is read-only in the sandbox, even with it (or a folder below) approved.

    An approved ``/sys`` was bound writable: under a daemon running as root the tool, uid 0
    without a capability, could write the kernel's settings there (suspend the host through
    ``/sys/power/state``) and its cgroup tree's ``cgroup.procs`` (leave its call's cgroup,
    and the limits with it), which security.md says a sandboxed tool cannot.
    """
    _need_sandbox(tree)
    setting = next((p for p in _SYSFS_SETTINGS if os.path.exists(p)), None)
    targets = [setting] if setting is not None else []
    cgroup = tree.status()["cgroup"]
    if cgroup["mode"] == "cgroup":
        targets.append(str(Path(cgroup["tree"]) / "cgroup.procs"))
    if approved == "setting's folder":
        if setting is None:
            pytest.skip("no known kernel setting in /sys here")
        approved = os.path.dirname(setting)
    elif approved == "cgroup tree":
        if cgroup["mode"] != "cgroup":
            pytest.skip("no cgroup tree")
        approved = cgroup["tree"]

    def probe(arguments: dict[str, Any]) -> dict[str, Any]:
        _, reply = tree.invoke("probe_path", {**arguments, "path": approved}, approved=True)
        text = reply["result"]["content"][0]["text"]
        result: dict[str, Any] = json.loads(text.strip().splitlines()[-1])
        return result

    mounted = probe({"action": "mount-options", "target": "/sys"})
    assert mounted.get("options", "").split(",")[0] == "ro", mounted
    for target in targets:
        opened = probe({"action": "open-write", "target": target})
        assert opened["ok"] is False, (target, opened)


def test_confinement_approved_outside_path_for_that_call_only(tree: Tree) -> None:
    """An approved outside path is writable in its call; another outside path is not."""
    _need_sandbox(tree)
    approved = tree.base / "outside-approved.txt"
    other = tree.base / "outside-other.txt"
    arguments = {"action": "write-both", "path": str(approved), "target": str(other)}
    _, reply = tree.invoke("probe_path", arguments, approved=True)
    text = reply["result"]["content"][0]["text"]
    assert json.loads(text.strip().splitlines()[-1])["ok"] is False
    assert approved.read_text() == "approved\n"
    assert not other.exists()
    # A later call that is not given the path cannot write it any more.
    result = tree.probe({"action": "write", "target": str(approved)})
    assert result["ok"] is False
    assert approved.read_text() == "approved\n"


def test_confinement_approved_new_path_made_through_no_swapped_in_link() -> None:
    """A missing approved path whose folder is swapped for a link after the call was checked
    is not made where the link leads.

    The daemon makes a missing approved path as an empty file so that it can be bound. It
    made it by path, following links on the way: whoever may write a folder above it (a
    sandboxed call of a workspace around it, another user owning a folder there) could swap
    the folder for a link to ``~/.ssh`` while the call waited for a runner slot, and the file
    appeared there, outside everything the call was approved for.
    """
    ensure_bubblewrap()
    t = _make_tree(args=("--max-running", "1"), timeoutSeconds=60)
    try:
        _need_sandbox(t)
        folder = t.base / "approved-folder"
        folder.mkdir()
        released = t.base / "released"
        planted = t.user_home / ".ssh" / "planted"
        with t.daemon.raw(timeout=60) as holder, t.daemon.raw(timeout=60) as waiter:
            holder.send({"jsonrpc": "2.0", "method": "invoke", "id": 1, "params": {
                "tool": "h_probe", "workspace": str(t.workspace),
                "arguments": {"action": "hold", "target": str(released)}}})
            # The holder has the slot before the waiter asks for it: sent on another
            # connection, the waiter's call could be served first and never queue.
            while holder.receive().get("method") != "started":
                pass
            waiter.send({"jsonrpc": "2.0", "method": "invoke", "id": 2, "params": {
                "tool": "p_probe_path", "workspace": str(t.workspace), "approved": True,
                "arguments": {"action": "write", "path": str(folder / "planted"),
                              "target": str(folder / "planted")}}})
            # Checked, and waiting for the slot the holder has.
            while not waiter.receive().get("params", {}).get("queued"):
                pass
            folder.rename(folder.with_name("moved-away"))
            folder.symlink_to(t.user_home / ".ssh")
            released.touch()
            while "id" not in (reply := waiter.receive()):
                pass
            while "id" not in holder.receive():
                pass
        assert not planted.exists(), "the approved path was made where the swapped-in link led"
        assert reply["result"]["isError"] is True, reply
    finally:
        _close(t)


@pytest.mark.parametrize("sandboxed", [True, False])
def test_confinement_spill_temp_swapped_for_a_link_copies_nothing(
    tree: Tree, sandboxed: bool
) -> None:
    """A tool that swaps its stderr spill temp file for a link to the key (which the sandbox
    hides from it) gets its own output in outputPath, never the key's bytes."""
    if sandboxed:
        _need_sandbox(tree)
    key = tree.user_home / ".ssh" / "id_rsa"
    _, reply = tree.invoke("probe", {"action": "spill-swap-temp", "target": str(key)},
                           project=sandboxed, callId=f"swap-temp-{sandboxed}")
    result = reply["result"]
    assert result["truncated"] is True, result
    assert '"planted"' in result["content"][0]["text"], result["content"][0]["text"][:300]
    data = Path(result["outputPath"]).read_bytes()
    assert b"PRIVATE KEY" not in data
    assert data.endswith(b"\n" + b"E" * 600000)
    assert key.read_text() == "PRIVATE KEY\n"


@pytest.mark.parametrize("sandboxed", [True, False])
def test_confinement_spill_folder_swapped_for_a_link_deletes_nothing(
    tree: Tree, sandboxed: bool
) -> None:
    """A tool that swaps the spill folder for a link to ~/.ssh after its output spilled has
    nothing there pruned, and its result names no file (spill_failed says why)."""
    if sandboxed:
        _need_sandbox(tree)
    victim = tree.user_home / ".ssh" / f"id_old_{sandboxed}"
    victim.write_text("old key\n")
    month_ago = time.time() - 30 * 86400
    os.utime(victim, (month_ago, month_ago))
    call_id = f"swap-folder-{sandboxed}"
    folder = tree.workspace / ".crystal" / "data" / "tools" / ("pp" if sandboxed else "hp")
    try:
        _, reply = tree.invoke("probe", {"action": "spill-swap-folder",
                                         "target": str(victim.parent)},
                               project=sandboxed, callId=call_id)
        result = reply["result"]
        assert result["truncated"] is True, result
        assert (folder / "tool-output").is_symlink()  # the tool did swap it
        assert victim.read_text() == "old key\n"
        assert result["outputPath"] is None
        assert "[full output:" not in result["content"][0]["text"]
        failed = [e for e in tree.daemon.log_events() if e.get("event") == "spill_failed"
                  and "replaced" in e.get("error", "")]
        assert failed, tree.daemon.log()[-2000:]
        assert not (victim.parent / call_id).exists()
    finally:
        if (folder / "tool-output").is_symlink():
            (folder / "tool-output").unlink()
            (folder / "tool-output.moved").rename(folder / "tool-output")


@contextlib.contextmanager
def _bind_mounted(source: Path, target: Path) -> Iterator[None]:
    """``source`` bind-mounted at ``target`` (skipped where the test may not mount)."""
    target.mkdir() if source.is_dir() else target.touch()
    done = subprocess.run(["mount", "--bind", str(source), str(target)],
                          capture_output=True, check=False)
    if done.returncode != 0:
        target.rmdir() if source.is_dir() else target.unlink()
        pytest.skip(f"cannot bind-mount here: {done.stderr.decode(errors='replace').strip()}")
    try:
        yield
    finally:
        subprocess.run(["umount", "-l", str(target)], capture_output=True, check=False)
        target.rmdir() if source.is_dir() else target.unlink()


@pytest.mark.parametrize("what", ["home", ".ssh", "key"])
def test_confinement_bind_mount_of_a_hidden_path_is_hidden_too(tree: Tree, what: str) -> None:
    """A hidden path another mount also shows (a bind mount of the home, of ``~/.ssh``, of
    a key) is hidden there too: the sandbox hid the path only, and the key was readable as
    ``<mount>/.ssh/id_rsa``, while the fence forbids that path as an argument."""
    _need_sandbox(tree)
    source = {"home": tree.user_home, ".ssh": tree.user_home / ".ssh",
              "key": tree.user_home / ".ssh" / "id_rsa"}[what]
    alias = tree.base / f"alias-{uuid.uuid4().hex[:8]}"
    key = {"home": alias / ".ssh" / "id_rsa", ".ssh": alias / "id_rsa", "key": alias}[what]
    with _bind_mounted(source, alias):
        assert key.read_text() == "PRIVATE KEY\n"
        result = tree.probe({"action": "read", "target": str(key)})
        assert result["ok"] is False, result
        assert "content" not in result
        # Hidden only where the key is: the rest of the other mount stays readable.
        if what == "home":
            shown = tree.probe({"action": "read", "target": str(alias / ".bashrc")})
            assert shown["content"] == "# bashrc\n", shown


@pytest.mark.parametrize("where", ["id_rsa", "keys/work/client/id_ed25519"])
def test_confinement_planted_hard_link_fails_closed(tree: Tree, where: str) -> None:
    """A second hard link to a credential file: sandboxed calls refuse to run, saying why.

    Also for a key kept deeper in ``~/.ssh`` (as deep as the fence looks, four levels): the
    check looked two levels down, and a link to ``~/.ssh/keys/work/client/id_ed25519`` in
    the workspace let a sandboxed call read the key.
    """
    _need_sandbox(tree)
    key = tree.user_home / ".ssh" / where
    if not key.exists():
        key.parent.mkdir(parents=True, exist_ok=True)
        key.write_text("PRIVATE KEY\n")
    planted = tree.workspace / "planted"
    os.link(key, planted)
    try:
        events, reply = tree.invoke("probe", {"action": "read", "target": str(planted)})
        assert events == []
        text = reply["result"]["content"][0]["text"]
        assert "hard link" in text
        assert "PRIVATE KEY" not in text
    finally:
        planted.unlink()


def _exchange(one: Path, other: Path) -> None:
    """Swap two names at once (``renameat2(RENAME_EXCHANGE)``)."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    if libc.renameat2(-100, bytes(one), -100, bytes(other), 2) != 0:  # AT_FDCWD, EXCHANGE
        raise OSError(ctypes.get_errno(), os.strerror(ctypes.get_errno()))


def test_confinement_workspace_swapped_for_a_link_binds_no_other_folder(tree: Tree) -> None:
    """A workspace swapped for a symlink just before its call's sandbox is made binds the
    workspace, never where the link leads.

    Whoever may write the workspace's parent (a sandboxed call of a workspace around it)
    can swap it, between the daemon's checks and bubblewrap's mount, for a relative link to
    any folder: bubblewrap followed it, and that folder was bound writable in the call.
    """
    _need_sandbox(tree)
    inner = tree.workspace / f"inner-{uuid.uuid4().hex[:8]}"
    probe = PROBE.format(python=os.path.realpath(sys.executable))
    write_set(inner / ".crystal" / "tools", "pp", _manifest("p"), **{"probe.py": probe})
    victim = tree.base / f"victim-{uuid.uuid4().hex[:8]}"
    victim.mkdir()
    link = inner.with_name(inner.name + ".link")
    link.symlink_to(os.path.join("..", victim.name))  # relative: it leads there in the sandbox too
    written = victim / "written"

    def call() -> dict[str, Any]:
        with tree.daemon.raw(timeout=60) as conn:
            _, reply = conn.invoke({"tool": "p_probe", "workspace": str(inner),
                                    "arguments": {"action": "write", "target": str(written)}})
        return reply

    assert "result" in call()  # the inner workspace's catalog, read before the swaps
    stop = threading.Event()

    def swap() -> None:
        while not stop.is_set():
            _exchange(inner, link)
            time.sleep(0.0005)

    swapper = threading.Thread(target=swap)
    swapper.start()
    try:
        for _ in range(300):
            call()
            if written.exists():
                break
    finally:
        stop.set()
        swapper.join()
        if inner.is_symlink():
            _exchange(inner, link)
    assert not written.exists(), "a sandboxed call wrote where the swapped-in link led"


def test_confinement_project_data_link_out_of_the_workspace_fails_closed(tree: Tree) -> None:
    """A project data folder that is a symlink out of the workspace is never bound.

    The repository (or another sandboxed call) can plant it; bound read-write, it made the
    user's home writable to the sandboxed tool.
    """
    _need_sandbox(tree)
    data = tree.workspace / ".crystal" / "data" / "tools" / "pp"
    data.parent.mkdir(parents=True, exist_ok=True)
    kept = data.with_name("pp.kept")
    if data.exists():
        data.rename(kept)
    data.symlink_to(os.path.relpath(tree.user_home, data.parent))
    bashrc = tree.user_home / ".bashrc"
    try:
        events, reply = tree.invoke("probe", {"action": "write", "target": str(bashrc)})
        assert bashrc.read_text() == "# bashrc\n"
        assert events == []
        text = reply["result"]["content"][0]["text"]
        assert "leads out of the workspace" in text
        assert "did not run" in text
    finally:
        data.unlink()
        if kept.exists():
            kept.rename(data)
    assert tree.probe({"action": "write", "target": str(data / "x")})["ok"] is True


def test_confinement_read_only_profile_and_named_profile_fails_closed() -> None:
    """read-only: the workspace cannot be written; a named profile without bwrap fails closed."""
    reason = ensure_bubblewrap()
    t = _make_tree(textwrap.dedent("""\
        [confinement.sets.pp]
        profile = "read-only"
        network = true
    """))
    try:
        if reason is not None or t.status()["sandbox"]["mechanism"] != "bubblewrap":
            pytest.skip(f"no sandbox: {reason or t.status()['sandbox']['reason']}")
        result = t.probe({"action": "write", "target": str(t.workspace / "ro.txt")})
        assert result["ok"] is False
        assert not (t.workspace / "ro.txt").exists()
    finally:
        _close(t)
    t = _make_tree('[confinement]\nsandbox = "off"\n[confinement.project]\nprofile = "workspace-write"\n')
    try:
        events, reply = t.invoke("probe", {"action": "write", "target": str(t.workspace / "x")})
        assert events == []
        text = reply["result"]["content"][0]["text"]
        assert "'workspace-write'" in text
        assert "did not run" in text
        assert not (t.workspace / "x").exists()
    finally:
        _close(t)


def test_confinement_a_named_bubblewrap_that_is_missing_fails_closed() -> None:
    """``sandbox = "/path/to/bwrap"`` asks for the sandbox. A path with no bubblewrap (a
    typo, a package moved) turned the default profiles ``off``: a repository's tools ran
    unconfined, with the network, and only a log line said so. The default profiles stay:
    the project set's calls fail closed, saying which setting to fix; the home set's
    default is ``off`` as always."""
    missing = "/nonexistent/toolsetd-test/bwrap"
    t = _make_tree(f'[confinement]\nsandbox = "{missing}"\n')
    try:
        assert t.status()["sandbox"]["mechanism"] == "none"
        marker = t.workspace / "ran.txt"
        wire = t.daemon.call("classify", {
            "tool": "p_probe", "arguments": {"action": "x"}, "workspace": str(t.workspace),
        })["result"]
        assert wire["confinement"]["sandbox"]["profile"] == "workspace-write", wire
        failure = wire["confinement"]["failure"]
        assert f"sandbox = '{missing}' is not an executable file" in failure, failure
        assert "toolsetd.toml" in failure, failure
        events, reply = t.invoke("probe", {"action": "write", "target": str(marker)})
        assert events == []
        assert reply["result"]["isError"] is True, reply
        assert "did not run" in reply["result"]["content"][0]["text"], reply
        assert not marker.exists()
        home = t.probe({"action": "write", "target": str(t.workspace / "home.txt")},
                       project=False)
        assert home["ok"] is True, home
    finally:
        _close(t)


@pytest.mark.parametrize("free", [0, 1], ids=["no-fork", "bwrap-cannot-fork"])
def test_confinement_sandbox_probe_short_of_tasks_at_start_fails_closed_then_recovers(
    free: int,
) -> None:
    """A daemon started at its limit of processes and threads could not run bubblewrap's
    probe (the fork failed with EAGAIN; or, with room for bubblewrap alone, bubblewrap could
    not fork its sandbox: "Resource temporarily unavailable"), and took that for "no
    bubblewrap here" for its whole life: project sets got profile ``off`` with the network,
    and once there was room their calls ran unconfined. Such a failure passes: the project
    set's calls fail closed meanwhile, saying so, and once bubblewrap can run they are
    sandboxed (the probe is tried again), as ``status`` says."""
    if ensure_bubblewrap() is not None:
        pytest.skip("bubblewrap is not installed")
    base = Path(tempfile.mkdtemp(prefix="tsp-", dir="/var/tmp"))  # see _make_tree
    made: list[Tree] = []

    def classified() -> dict[str, Any]:
        params = {"tool": "p_probe", "arguments": {}, "workspace": str(t.workspace)}
        confinement: dict[str, Any] = t.daemon.call("classify", params)["result"]["confinement"]
        return confinement

    try:
        with launched_at_the_limit(
            base, lambda launcher: _make_tree(launcher=launcher), made, free
        ) as t:
            sandbox = t.status()["sandbox"]
            assert sandbox["mechanism"] == "none", sandbox
            assert "tried again" in sandbox["reason"], sandbox
            wire = classified()
            assert wire["sandbox"] == {"profile": "workspace-write", "network": False}, wire
            assert "tried again" in wire["failure"], wire
            events, reply = t.invoke(
                "probe", {"action": "read", "target": str(t.user_home / ".ssh" / "id_rsa")}
            )
            assert events == [], "no process started"
            text = reply["result"]["content"][0]["text"]
            assert reply["result"]["isError"] and text.startswith("toolsetd: "), reply
            assert "did not run" in text and "tried again" in text, text
        key = str(t.user_home / ".ssh" / "id_rsa")

        def sandboxed() -> bool:
            result = t.probe({"action": "read", "target": key})
            assert "PRIVATE KEY" not in json.dumps(result), result
            return result.get("ok") is not None  # it ran (not refused)

        eventually(sandboxed, timeout=30, what="a sandboxed call once bubblewrap runs")
        assert t.status()["sandbox"]["mechanism"] == "bubblewrap"
        with socket.socket() as server:
            server.bind(("127.0.0.1", 0))
            server.listen()
            address = f"127.0.0.1:{server.getsockname()[1]}"
            assert t.probe({"action": "connect", "target": address})["ok"] is False
            assert t.probe({"action": "connect", "target": address}, project=False)["ok"] is True
        wire = classified()
        assert wire["sandbox"] == {"profile": "workspace-write", "network": False}, wire
        assert wire["failure"] is None, wire
        events = [e.get("event") for e in t.daemon.log_events()]
        assert events.count("sandbox_probe_deferred") == 1, events
        assert events.count("sandbox_recovered") == 1, events
        assert "sandbox_unavailable" not in events, events
    finally:
        for tree in made:
            _close(tree)
        shutil.rmtree(base, ignore_errors=True)


@pytest.mark.parametrize("option", ["--unshare-ipc", "--block-fd"])
def test_confinement_option_probe_short_of_tasks_at_start_weakens_nothing(option: str) -> None:
    """bubblewrap worked, but the probe of one option it is given failed for want of tasks
    (bubblewrap's "Resource temporarily unavailable"): the daemon took that for a machine
    without it, and every sandboxed call ran for its life without its own IPC namespace
    (sharing the host's System V IPC) or without the check of its binds. Such a failure
    passes: sandboxed calls fail closed meanwhile, and once the probe runs they get both."""
    ensure_bubblewrap()
    folder = Path(tempfile.mkdtemp(prefix="tsc-bwrap-", dir="/var/tmp"))
    flag = folder / "short"
    flag.touch()
    short = folder / "bwrap"
    short.write_text(textwrap.dedent(f"""\
        #!/bin/sh
        case " $* " in *" {option} "*)
            if [ -e {flag} ]; then
                echo "bwrap: Can't fork for pid 1: Resource temporarily unavailable" >&2
                exit 1
            fi
        esac
        exec {shutil.which("bwrap")} "$@"
        """))
    short.chmod(0o755)
    t = _make_tree(f'[confinement]\nsandbox = "{short}"\n')
    try:
        sandbox = t.status()["sandbox"]
        assert sandbox["mechanism"] == "none", sandbox
        assert "Resource temporarily unavailable" in sandbox["reason"], sandbox
        events, reply = t.invoke("probe", {"action": "ipc"})
        assert events == [], "no process started"
        text = reply["result"]["content"][0]["text"]
        assert text.startswith("toolsetd: ") and "tried again" in text, text
        flag.unlink()
        eventually(lambda: t.probe({"action": "ipc"}).get("ok") is not None, timeout=30,
                   what="a sandboxed call once the probe runs")
        assert t.probe({"action": "ipc"})["ipc"] != os.readlink("/proc/self/ns/ipc")
        assert t.status()["sandbox"] == {"mechanism": "bubblewrap", "binary": str(short)}
        events = [e.get("event") for e in t.daemon.log_events()]
        assert "sandbox_without_ipc" not in events, events
        assert "sandbox_without_bind_check" not in events, events
        assert events.count("sandbox_recovered") == 1, events
    finally:
        _close(t)
        shutil.rmtree(folder)


# -- orphans -------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("sandboxed", [True, False])
def test_confinement_daemon_sigkill_leaves_no_tool(sandboxed: bool) -> None:
    """SIGKILL the daemon mid-call: no tool process (setsid'd grandchildren too) survives.

    Sandboxed calls are covered by the PID namespace without the sentinel
    (``--no-orphan-guard``); unsandboxed ones by the sentinel writing ``cgroup.kill``.
    """
    reason = ensure_bubblewrap()
    args = ("--no-orphan-guard",) if sandboxed else ()
    t = _make_tree(args=args)
    marker = f"tsc-{uuid.uuid4().hex}"
    try:
        if sandboxed and t.status()["sandbox"]["mechanism"] != "bubblewrap":
            pytest.skip(f"no sandbox: {reason or t.status()['sandbox']['reason']}")
        if not sandboxed:
            _need_cgroup(t)
        _kill_the_daemon_under_escaped_tools(t, marker, sandboxed, 2)
    finally:
        _kill_marked(marker)
        _close(t)


def _kill_the_daemon_under_escaped_tools(
    t: Tree, marker: str, project: bool, count: int
) -> None:
    """Run ``count`` calls whose tool leaves a ``setsid``'d grandchild marked ``marker``
    (``_swallow``, each in a thread), SIGKILL the daemon once all of them run, and see
    every one of them gone: what kills them is the orphan guard's, the daemon had no say."""
    for _ in range(count):
        threading.Thread(target=lambda: _swallow(t, marker, project), daemon=True).start()
    eventually(lambda: len(marked_processes(marker)) >= count, what="the grandchildren")
    t.daemon.proc.send_signal(signal.SIGKILL)
    t.daemon.proc.wait(10)
    eventually(lambda: marked_processes(marker) == [], timeout=10, what="no tool left")


def _swallow(t: Tree, marker: str, project: bool) -> None:
    try:
        t.invoke("probe", {"action": "escape", "marker": marker, "wait": True}, project=project)
    except (OSError, EOFError):
        pass  # the daemon was killed under it


def test_confinement_bad_config_names_the_key(tmp_base: Path) -> None:
    """A wrong value in [confinement] stops the start with a message naming the key."""
    config = tmp_base / "bad.toml"
    config.write_text('[confinement.sets.lint]\nprofile = "strict"\n')
    done = subprocess.run(
        [sys.executable, "-m", "toolsetd.daemon", "--config", str(config)],
        capture_output=True, timeout=30, check=False,
    )
    assert done.returncode == 2
    assert "confinement.sets.lint.profile: must be one of 'off', 'workspace-write', 'read-only'" in (
        done.stderr.decode()
    )


def test_confinement_sandbox_failing_at_the_call_fails_closed() -> None:
    """bubblewrap refusing a call's set-up: the tool does not run and the text says why."""
    reason = ensure_bubblewrap()
    t = _make_tree('[confinement]\nhide = ["~/dangling"]\n')
    try:
        if reason is not None or t.status()["sandbox"]["mechanism"] != "bubblewrap":
            pytest.skip(f"no sandbox: {reason or t.status()['sandbox']['reason']}")
        # A hidden path that is a dangling symlink: bubblewrap cannot mount /dev/null on it.
        (t.user_home / "dangling").symlink_to(t.base / "nowhere" / "x")
        target = t.workspace / "ran.txt"
        _, reply = t.invoke("probe", {"action": "write", "target": str(target)})
        result = reply["result"]
        assert result["isError"] is True
        assert result["exitCode"] is None
        text = result["content"][0]["text"]
        assert text.startswith("toolsetd: the sandbox could not be set up, so the tool did not run: bwrap: ")
        assert not target.exists()
    finally:
        _close(t)


def test_confinement_bubblewrap_failing_before_its_sandbox_says_why_at_once() -> None:
    """A bubblewrap that exits before it makes the sandbox (its clone refused: no user
    namespace left, a pids limit; or a cgroup join that failed) writes no child pid: the
    call says bubblewrap's own error, as before the bind check, and does not wait for a
    sandbox that will never be built."""
    ensure_bubblewrap()
    folder = Path(tempfile.mkdtemp(prefix="tsc-bwrap-", dir="/var/tmp"))
    flag = folder / "fail"
    failing = folder / "bwrap"
    failing.write_text(textwrap.dedent(f"""\
        #!/bin/sh
        if [ -e {flag} ]; then
            echo "bwrap: Creating new namespace failed: No space left on device" >&2
            exit 1
        fi
        exec {shutil.which("bwrap")} "$@"
        """))
    failing.chmod(0o755)
    t = _make_tree(f'[confinement]\nsandbox = "{failing}"\n')
    try:
        _need_sandbox(t)
        flag.touch()  # after the probes at start: only the calls fail
        with t.daemon.raw(timeout=120) as conn:
            _, reply = conn.invoke({"tool": "p_probe", "arguments": {"action": "x"},
                                    "workspace": str(t.workspace)})
        result = reply["result"]
        assert result["isError"] is True, result
        assert "Creating new namespace failed" in result["content"][0]["text"], result
    finally:
        _close(t)
        shutil.rmtree(folder)


def test_confinement_sandbox_not_built_within_the_time_limit_times_out() -> None:
    """A sandbox that bubblewrap does not finish building (a hung file system on a bind's
    way) is bound by the set's time limit, timed from the spawn as any call's: the call
    says ``timeout`` then, not a minute later."""
    ensure_bubblewrap()
    folder = Path(tempfile.mkdtemp(prefix="tsc-bwrap-", dir="/var/tmp"))
    flag = folder / "hang"
    hanging = folder / "bwrap"
    hanging.write_text(textwrap.dedent(f"""\
        #!/bin/sh
        [ -e {flag} ] && sleep 600
        exec {shutil.which("bwrap")} "$@"
        """))
    hanging.chmod(0o755)
    t = _make_tree(f'[confinement]\nsandbox = "{hanging}"\n', timeoutSeconds=1)
    try:
        _need_sandbox(t)
        flag.touch()  # after the probes at start: only the calls hang
        with t.daemon.raw(timeout=120) as conn:
            _, reply = conn.invoke({"tool": "p_probe", "arguments": {"action": "x"},
                                    "workspace": str(t.workspace)})
        assert reply["result"]["status"] == "timeout", reply
    finally:
        _close(t)
        shutil.rmtree(folder)


def test_confinement_approved_path_on_a_read_only_mount_runs_read_only() -> None:
    """An approved path on a read-only mount (a snapshot, a read-only export, a system
    folder under ProtectSystem=) is bound writable, and bubblewrap's bind of it is
    read-only as the mount is: the call runs and may read it. The bind check took that
    read-only bind for one swapped while the sandbox was made, and refused every such
    call ('changed while its sandbox was being made ... retry it') however often retried.
    """
    ensure_bubblewrap()
    if shutil.which("unshare") is None or os.geteuid() != 0:
        pytest.skip("needs root and unshare(1) to make a read-only mount for the daemon")
    t = _make_tree()  # only its files: the daemon below runs in a mount namespace of its own
    base = Path(tempfile.mkdtemp(prefix="tsc-ro-", dir="/var/tmp"))
    shutil.copytree(t.base, base, dirs_exist_ok=True, ignore=shutil.ignore_patterns("*.sock"))
    _close(t)
    read_only = base / "ro"
    read_only.mkdir()
    (read_only / "notes.txt").write_text("read me\n")
    mount_ro = 'mount --bind "$0" "$0" && mount -o remount,bind,ro "$0" && exec "$@"'
    launcher = ["unshare", "-m", "sh", "-c", mount_ro, str(read_only),
                sys.executable, "-m", "toolsetd.daemon"]  # fmt: skip
    daemon = start_daemon(base / "home", base / "ws", base, ["--no-watch"],
                          env={"HOME": str(base / "uh")}, launcher=launcher)
    tree = Tree(daemon, base, base / "ws", base / "uh")
    try:
        _need_sandbox(tree)
        target = str(read_only / "notes.txt")
        _, reply = tree.invoke("probe_path", {"action": "read", "path": target,
                                              "target": target}, approved=True)
        text = reply["result"]["content"][0]["text"]
        assert "changed while its sandbox was being made" not in text, text
        assert json.loads(text.strip().splitlines()[-1])["content"] == "read me\n", text
    finally:
        _close(tree)


def test_confinement_bubblewrap_that_cannot_fork_for_want_of_tasks_says_what_ran_out() -> None:
    """At the daemon's limit of processes and threads, with room for bubblewrap alone,
    bubblewrap's own fork of its sandbox fails ("bwrap: Creating new namespace failed:
    Resource temporarily unavailable"): the call's text said bubblewrap's words only, which
    name neither the limit nor what to do, where a fork of the daemon's own says both. It
    says both too; once there is room the call runs, sandboxed."""
    if ensure_bubblewrap() is not None:
        pytest.skip("bubblewrap is not installed")
    t = _make_tree()
    try:
        _need_sandbox(t)
        key = str(t.user_home / ".ssh" / "id_rsa")
        with tasks_limited(t.daemon.proc.pid, free=1):
            _, reply = t.invoke("probe", {"action": "read", "target": key})
        text = reply["result"]["content"][0]["text"]
        assert reply["result"]["isError"], reply
        assert text.startswith(
            "toolsetd: the sandbox could not be set up, so the tool did not run: bwrap: "
        ), text
        assert text.endswith(
            "Resource temporarily unavailable: toolsetd is at its limit of processes and "
            "threads (RLIMIT_NPROC, or its cgroup's pids.max, such as a unit's TasksMax=); "
            "retry when some calls have finished."
        ), text
        result = t.probe({"action": "read", "target": key})
        assert result["ok"] is False, result
    finally:
        _close(t)


@contextlib.contextmanager
def _base_without_room(tag: str) -> Iterator[tuple[Path, Path, str]]:
    """A cgroup v2 folder (``outer``) whose ``cgroup.max.descendants`` is 1 and taken by
    its ``base``: a daemon given ``base`` cannot make its own folder there (EAGAIN) until
    the test writes ``max``. Yields (outer, base, the cgroup v2 mount); removed after."""
    unified = next(iter(_cgroup2_mounts()), None)
    if os.geteuid() != 0 or unified is None:
        pytest.skip("needs root and a cgroup v2 mount")
    outer = Path(unified) / f"toolsetd-test-{tag}-{uuid.uuid4().hex[:8]}"
    base = outer / "base"
    try:
        outer.mkdir()
        (outer / "cgroup.max.descendants").write_text("1")
        base.mkdir()  # the one descendant: the daemon's own folder cannot be made
    except OSError as exc:
        pytest.skip(f"a cgroup with cgroup.max.descendants cannot be made here: {exc}")
    try:
        yield outer, base, unified
    finally:
        for folder in sorted(outer.rglob("*"), key=lambda p: -len(p.parts)):
            if folder.is_dir():
                with contextlib.suppress(OSError):
                    folder.rmdir()
        with contextlib.suppress(OSError):
            outer.rmdir()


def test_confinement_cgroup_probe_short_at_start_is_tried_again() -> None:
    """A cgroup probe that failed at start for want of room (the kernel's EAGAIN: here the
    base's ``cgroup.max.descendants`` reached, as other daemons' calls can hold it; or
    ENOMEM) left the daemon without a cgroup per call for its whole life: every call ran
    in a process group alone (a ``setsid`` grandchild outlives it), and a set with limits
    failed closed telling the operator to give the daemon a writable subtree. Such a
    failure passes: the sets that need a cgroup fail closed meanwhile, saying it is tried
    again, and once there is room the next call probes again and runs in its own cgroup,
    as ``status`` says."""
    with _base_without_room("descendants") as (outer, base, unified):
        t = _make_tree(
            f'[confinement]\ncgroup = "{base}"\nsandbox = "off"\n'
            "[confinement.sets.hp]\npids-max = 64\n"
        )
        try:
            cgroup = t.status()["cgroup"]
            assert cgroup["mode"] == "process-group", cgroup
            assert "Resource temporarily unavailable" in cgroup["reason"], cgroup
            assert "tried again" in cgroup["reason"], cgroup
            _, reply = t.invoke("probe", {"action": "read", "target": "x"}, project=False)
            text = reply["result"]["content"][0]["text"]
            assert "did not run" in text and "tried again" in text, text  # the limits' set
            (outer / "cgroup.max.descendants").write_text("max")

            def in_its_own_cgroup() -> bool:
                result = t.probe({"action": "read", "target": "/proc/self/cgroup"})
                line = next(x for x in result["content"].splitlines() if x.startswith("0::"))
                return line.startswith(f"0::/{base.relative_to(unified)}/toolsetd-")

            eventually(in_its_own_cgroup, timeout=30, what="a call in a cgroup of its own")
            cgroup = t.status()["cgroup"]
            assert cgroup["mode"] == "cgroup", cgroup
            assert Path(cgroup["tree"]).parent == base, cgroup
            _, reply = t.invoke("probe", {"action": "read", "target": "x"}, project=False)
            text = reply["result"]["content"][0]["text"]
            assert "tried again" not in text, text  # the limits' controller is judged now
            events = [e.get("event") for e in t.daemon.log_events()]
            assert events.count("cgroups_probe_deferred") == 1, events
            assert events.count("cgroups_recovered") == 1, events
            assert "cgroups_unavailable" not in events, events
        finally:
            _close(t)


def test_confinement_cgroup_tree_made_late_is_killed_by_the_orphan_guard() -> None:
    """The orphan guard's sentinel starts with the daemon and is told the cgroup tree it
    writes ``cgroup.kill`` of should the daemon die. A tree the retry made later (its probe
    at start was short of room) must reach it too: else a SIGKILLed daemon's setsid'd
    grandchild, out of every process group the sentinel kills, outlived it."""
    with _base_without_room("late-guard") as (outer, base, _):
        t = _make_tree(f'[confinement]\ncgroup = "{base}"\nsandbox = "off"\n')
        marker = f"tsc-{uuid.uuid4().hex}"
        try:
            assert t.status()["cgroup"]["mode"] == "process-group"
            (outer / "cgroup.max.descendants").write_text("max")
            eventually(lambda: t.status()["cgroup"]["mode"] == "cgroup", timeout=30,
                       what="the cgroup tree made by the retry")
            _kill_the_daemon_under_escaped_tools(t, marker, False, 1)
        finally:
            _kill_marked(marker)
            _close(t)
