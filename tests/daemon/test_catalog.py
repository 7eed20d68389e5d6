"""Tests for ``toolsetd.daemon.catalog``: discovery, overlay, notes, config, cache and hashes."""

from __future__ import annotations

import codecs
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import pytest
from toolsetd.daemon.catalog import (
    RACY_NS,
    ManifestCache,
    build_catalog,
    load_config,
    note_info,
    set_info,
    tool_info,
)
from toolsetd.daemon.model import (
    DEFAULT_RESERVED_NAMES,
    Approval,
    ApprovalSource,
    Catalog,
    Config,
    SetState,
    Source,
)

SCHEMA: dict[str, Any] = {"type": "object", "properties": {"environment": {"type": "string"}}}


def tool(name: str, **fields: Any) -> dict[str, Any]:
    """One valid exec tool object."""
    return {"name": name, "description": f"{name} tool", "schema": SCHEMA, **fields}


def manifest(*names: str, **root: Any) -> dict[str, Any]:
    """An exec manifest with one tool per name."""
    return {"runner": "exec", "command": ["acme"], "tools": [tool(n) for n in names], **root}


def write(root: Path, directory: str, body: Any) -> Path:
    """Write ``body`` (dict or bytes) as ``root/directory/tools.json``; return the set directory."""
    set_dir = root / directory
    set_dir.mkdir(parents=True, exist_ok=True)
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    (set_dir / "tools.json").write_bytes(data)
    return set_dir


@pytest.fixture
def home(tmp_path: Path) -> Path:
    """An empty Crystal home."""
    path = tmp_path / "home"
    (path / "tools").mkdir(parents=True)
    return path


@pytest.fixture
def workspace(tmp_path: Path) -> Path:
    """An empty workspace with a project tools root."""
    path = tmp_path / "ws"
    (path / ".crystal" / "tools").mkdir(parents=True)
    return path


def build(home: Path, workspace: Path | None = None, **kwargs: Any) -> Catalog:
    """Build a catalog with a fresh cache and the default reserved names."""
    kwargs.setdefault("reserved", DEFAULT_RESERVED_NAMES)
    kwargs.setdefault("cache", ManifestCache())
    return build_catalog(home, workspace, **kwargs)


def states(catalog: Catalog) -> list[tuple[str, str, str]]:
    """``(directory, source, state)`` for every set entry, in catalog order."""
    return [(e.directory, e.source.value, e.state.value) for e in catalog.sets]


def messages(catalog: Catalog) -> list[str]:
    """The catalog's note messages in order."""
    return [n.message for n in catalog.notes]


def test_build_catalog_loads_home_and_project_sets(home: Path, workspace: Path) -> None:
    """Home and project sets load; tools keep set order, then manifest order."""
    write(home / "tools", "alpha", manifest("a2", "a1"))
    write(workspace / ".crystal" / "tools", "beta", manifest("b1"))
    catalog = build(home, workspace)
    assert list(catalog.tools) == ["a2", "a1", "b1"]
    assert states(catalog) == [("alpha", "home", "loaded"), ("beta", "project", "loaded")]
    assert catalog.notes == ()
    assert catalog.tools["b1"].toolset.source is Source.PROJECT


def test_build_catalog_without_workspace_scans_home_only(home: Path, workspace: Path) -> None:
    """With no workspace only the home tree is scanned."""
    write(workspace / ".crystal" / "tools", "beta", manifest("b1"))
    assert build(home, None).sets == ()


def test_build_catalog_broken_project_hides_home(home: Path, workspace: Path) -> None:
    """A project set with an invalid manifest still hides the home set of the same name."""
    write(home / "tools", "acme", manifest("deploy"))
    write(workspace / ".crystal" / "tools", "acme", b"{")
    catalog = build(home, workspace)
    assert catalog.tools == {}
    assert states(catalog) == [("acme", "home", "hidden"), ("acme", "project", "refused")]
    assert messages(catalog) == [
        "External tool set 'acme' was skipped: tools.json is not valid JSON: "
        "Expecting property name enclosed in double quotes: line 1 column 2 (char 1)"
    ]
    assert catalog.sets[1].error is not None and catalog.sets[1].enabled is None


def test_build_catalog_disabled_project_hides_home(home: Path, workspace: Path) -> None:
    """A disabled project set hides the home set and drops out without a note."""
    write(home / "tools", "acme", manifest("deploy"))
    write(workspace / ".crystal" / "tools", "acme", manifest("deploy", enabled=False))
    catalog = build(home, workspace)
    assert catalog.tools == {}
    assert catalog.notes == ()
    assert states(catalog) == [("acme", "home", "hidden"), ("acme", "project", "disabled")]
    assert catalog.sets[1].enabled is False


def test_build_catalog_project_replaces_home_whole(home: Path, workspace: Path) -> None:
    """The project set replaces the home set as a whole; lists are not merged."""
    write(home / "tools", "acme", manifest("deploy", "inventory"))
    write(workspace / ".crystal" / "tools", "acme", manifest("deploy"))
    catalog = build(home, workspace)
    assert list(catalog.tools) == ["deploy"]
    assert catalog.tools["deploy"].toolset.source is Source.PROJECT


def test_build_catalog_overlay_is_case_sensitive(home: Path, workspace: Path) -> None:
    """Home ``Acme`` and project ``acme`` are two separate sets on Linux."""
    write(home / "tools", "Acme", manifest("a"))
    write(workspace / ".crystal" / "tools", "acme", manifest("b"))
    assert states(build(home, workspace)) == [("Acme", "home", "loaded"), ("acme", "project", "loaded")]


def test_build_catalog_ordinal_order_first_set_wins(home: Path) -> None:
    """Sets load in ordinal order (``Zeta`` before ``alpha``); the later duplicate tool is omitted alone."""
    write(home / "tools", "alpha", manifest("deploy", "inventory"))
    write(home / "tools", "Zeta", manifest("deploy"))
    catalog = build(home)
    assert list(catalog.tools) == ["deploy", "inventory"]
    assert catalog.tools["deploy"].toolset.directory == "Zeta"
    assert [e.directory for e in catalog.sets] == ["Zeta", "alpha"]
    assert messages(catalog) == ["External tool 'deploy' was omitted because the name is already registered."]
    alpha = catalog.sets[1]
    assert (alpha.state, alpha.tools, alpha.notes) == (SetState.LOADED, ("inventory",), tuple(messages(catalog)))
    assert note_info(catalog.notes[0]) == {"set": "alpha", "source": "home", "message": messages(catalog)[0]}


def test_build_catalog_every_tool_omitted_refuses_set(home: Path) -> None:
    """A set whose every tool was omitted is refused."""
    write(home / "tools", "a", manifest("deploy"))
    write(home / "tools", "b", manifest("deploy"))
    assert states(build(home)) == [("a", "home", "loaded"), ("b", "home", "refused")]


def test_build_catalog_reserved_name_refuses_set(home: Path) -> None:
    """A tool named like a reserved name (here a --reserve name) refuses its whole exec set."""
    write(home / "tools", "acme", manifest("inventory", "deploy"))
    catalog = build(home, reserved=DEFAULT_RESERVED_NAMES | {"deploy"})
    assert catalog.tools == {}
    assert messages(catalog) == ["External tool set 'acme' was skipped: Tool name 'deploy' is reserved or invalid."]


def test_build_catalog_external_tools_off(home: Path, workspace: Path) -> None:
    """``externalTools: false`` yields an empty catalog with no notes and no sets."""
    write(home / "tools", "acme", b"{")
    (home / "config.json").write_text('{"externalTools": false}')
    catalog = build(home, workspace)
    assert (dict(catalog.tools), catalog.sets, catalog.notes) == ({}, (), ())
    assert catalog.config.external_tools is False


def test_build_catalog_invalid_directory_names(home: Path) -> None:
    """An invalid directory name gets a note only when it holds a tools.json."""
    write(home / "tools", "my tools", manifest("a"))
    (home / "tools" / ".git").mkdir()
    (home / "tools" / "9lives").mkdir()
    catalog = build(home)
    assert messages(catalog) == ["External tool set 'my tools' was skipped: directory name is invalid."]
    assert states(catalog) == [("my tools", "home", "refused")]


def test_build_catalog_home_sets_come_in_ordinal_order(home: Path) -> None:
    """Without a workspace the entries keep the scan's ordinal order, invalid names included."""
    for name in ("b", "A", "c"):
        write(home / "tools", name, manifest(name.lower() + "x"))
    write(home / "tools", "a b", manifest("ab"))
    assert [e.directory for e in build(home).sets] == ["A", "a b", "b", "c"]


def test_build_catalog_through_a_symlinked_tools_folder(home: Path, tmp_path: Path) -> None:
    """The tools folder itself may be a link; a tools "folder" that is a file has no sets."""
    elsewhere = tmp_path / "elsewhere"
    write(elsewhere, "linked", manifest("l"))
    (home / "tools").rmdir()
    (home / "tools").symlink_to(elsewhere)
    assert states(build(home)) == [("linked", "home", "loaded")]
    (home / "tools").unlink()
    (home / "tools").write_text("not a folder")
    assert (build(home).sets, build(home).notes) == ((), ())


def test_manifest_cache_keeps_an_error_without_its_traceback(home: Path) -> None:
    """A cached manifest error holds its message only, not the parser's frames."""
    write(home / "tools", "broken", b"{not json")
    cache = ManifestCache()
    catalog = build_catalog(home, None, reserved=DEFAULT_RESERVED_NAMES, cache=cache)
    assert catalog.sets[0].error
    (entry,) = cache._entries.values()
    assert isinstance(entry.result, Exception)
    assert entry.result.__traceback__ is None
    assert entry.result.__cause__ is None and entry.result.__context__ is None


def test_build_catalog_directory_without_manifest_is_silent(home: Path) -> None:
    """A valid directory without tools.json, or with a directory named tools.json, is no candidate."""
    (home / "tools" / "empty").mkdir()
    (home / "tools" / "odd" / "tools.json").mkdir(parents=True)
    (home / "tools" / "stray.json").write_text("{}")
    catalog = build(home)
    assert (catalog.sets, catalog.notes) == ((), ())


def test_build_catalog_fifo_manifest_does_not_hang(home: Path, workspace: Path) -> None:
    """A FIFO named tools.json is unreadable, is never opened blocking, and still hides home."""
    write(home / "tools", "acme", manifest("deploy"))
    (workspace / ".crystal" / "tools" / "acme").mkdir()
    os.mkfifo(workspace / ".crystal" / "tools" / "acme" / "tools.json")
    catalog = build(home, workspace)
    assert messages(catalog) == ["External tool set 'acme' was skipped: tools.json could not be read."]
    assert states(catalog) == [("acme", "home", "hidden"), ("acme", "project", "refused")]


@pytest.mark.parametrize(
    ("target", "kind"),
    [("/proc/self/environ", "proc"), ("/sys/devices/system/cpu/online", "sysfs")],
    ids=["procfs", "sysfs"],
)
def test_build_catalog_manifest_in_a_kernel_file_system_is_refused_unread(
    home: Path, workspace: Path, target: str, kind: str
) -> None:
    """A tools.json linked to a file of /proc or /sys is a regular file by its mode, but a
    view of kernel state (the daemon's environment; as root, /proc/kmsg's messages, taken
    from whoever else reads them): it is refused unread, with a note that names its file
    system and the fix, and a project one still hides the home set. Before, it was read
    and parsed (``tools.json is not valid JSON: ...``)."""
    if not os.path.exists(target):
        pytest.skip(f"{target} is not here")
    write(home / "tools", "acme", manifest("deploy"))
    (workspace / ".crystal" / "tools" / "acme").mkdir()
    (workspace / ".crystal" / "tools" / "acme" / "tools.json").symlink_to(target)
    catalog = build(home, workspace)
    assert messages(catalog) == [
        f"External tool set 'acme' was skipped: tools.json is in the kernel's {kind} file "
        "system (a view of kernel state, not a file) and is not read: make tools.json a "
        "regular file on a disk, or a link to one."
    ]
    assert states(catalog) == [("acme", "home", "hidden"), ("acme", "project", "refused")]


def test_load_config_in_a_kernel_file_system_is_unusable(home: Path) -> None:
    """A config.json linked into /proc is not read either: unusable, as a FIFO is."""
    (home / "config.json").symlink_to("/proc/self/environ")
    config, notes = load_config(home)
    assert config == UNUSABLE
    assert [n.message for n in notes] == [
        "config.json is in the kernel's proc file system (a view of kernel state, not a file) "
        "and is not read: make config.json a regular file on a disk, or a link to one. "
        "External tool discovery is off, and the approval policy host for both sources, "
        "until it is fixed."
    ]


@pytest.mark.parametrize("target", ["gone.json", "tools.json"], ids=["dangling", "loop"])
def test_build_catalog_manifest_link_to_nowhere_is_unreadable_and_hides_home(
    home: Path, workspace: Path, target: str
) -> None:
    """A tools.json symlink that leads nowhere is a candidate, as the reference host's
    ``File.Exists`` counts it on Unix (an lstat that finds a link is enough): it cannot be
    read, and a project one hides the home set of its name."""
    write(home / "tools", "acme", manifest("deploy"))
    (workspace / ".crystal" / "tools" / "acme").mkdir()
    (workspace / ".crystal" / "tools" / "acme" / "tools.json").symlink_to(target)
    catalog = build(home, workspace)
    assert messages(catalog) == ["External tool set 'acme' was skipped: tools.json could not be read."]
    assert states(catalog) == [("acme", "home", "hidden"), ("acme", "project", "refused")]
    assert list(catalog.tools) == []


def test_build_catalog_oversized_manifest(home: Path) -> None:
    """A manifest over 1 MiB is refused without being parsed."""
    write(home / "tools", "big", b" " * (1 << 20) + b"{}")
    assert messages(build(home)) == ["External tool set 'big' was skipped: tools.json is larger than 1 MiB."]


def test_build_catalog_follows_symlinked_set_directory(home: Path, tmp_path: Path) -> None:
    """A set directory that is a symlink loads like any other."""
    target = write(tmp_path / "elsewhere", "real", manifest("linked"))
    (home / "tools" / "linked").symlink_to(target)
    catalog = build(home)
    assert list(catalog.tools) == ["linked"]
    assert catalog.sets[0].path == home / "tools" / "linked"


def test_build_catalog_an_entry_it_cannot_examine_is_skipped_alone(
    home: Path, workspace: Path
) -> None:
    """A symlink loop in a tools root is skipped silently; every other set of the root loads."""
    write(home / "tools", "good", manifest("g"))
    (home / "tools" / "loopy").symlink_to("loopy")
    write(workspace / ".crystal" / "tools", "proj", manifest("p"))
    (workspace / ".crystal" / "tools" / "ploop").symlink_to("ploop")
    catalog = build(home, workspace)
    assert states(catalog) == [("good", "home", "loaded"), ("proj", "project", "loaded")]
    assert catalog.notes == ()


_AS_NOBODY = """
import json, sys
from pathlib import Path
from toolsetd.daemon.catalog import ManifestCache, build_catalog
from toolsetd.daemon.model import DEFAULT_RESERVED_NAMES
catalog = build_catalog(
    Path(sys.argv[1]), None, reserved=DEFAULT_RESERVED_NAMES, cache=ManifestCache()
)
sets = [[e.directory, e.state.value] for e in catalog.sets]
print(json.dumps(sets + [n.message for n in catalog.notes]))
"""


def test_build_catalog_a_link_into_a_folder_it_may_not_search_is_skipped_alone(
    as_nobody: tuple[str, ...],
) -> None:
    """Run as nobody, a set linked from a folder nobody may search is skipped; the rest load."""
    base = Path(tempfile.mkdtemp(prefix="tsd-eacces-"))
    try:
        base.chmod(0o755)
        write(base / "home" / "tools", "good", manifest("g"))
        write(base / "private", "x", manifest("x"))
        (base / "private").chmod(0o700)  # root's: nobody gets EACCES through the link
        (base / "home" / "tools" / "zlink").symlink_to(base / "private" / "x")
        done = subprocess.run(
            [*as_nobody, sys.executable, "-c", _AS_NOBODY, str(base / "home")],
            capture_output=True, text=True, timeout=60, check=False,
        )
        assert done.returncode == 0, done.stderr
        assert json.loads(done.stdout) == [["good", "loaded"]]
    finally:
        shutil.rmtree(base, ignore_errors=True)


@pytest.mark.parametrize("first", ["1e400", "null"])
def test_build_catalog_a_number_beyond_a_double_never_shares_a_verdict_with_null(
    home: Path, first: str
) -> None:
    """``maximum: 1e400`` is refused for its number, and ``null`` for its schema, in any order."""
    def schema_set(maximum: str) -> bytes:
        return (
            b'{"runner": "exec", "command": ["x"], "description": "d", "schema": {"type": '
            b'"object", "properties": {"n": {"type": "number", "maximum": %s}}}}' % maximum.encode()
        )

    second = "null" if first == "1e400" else "1e400"
    write(home / "tools", "a1", schema_set(first))
    write(home / "tools", "b1", schema_set(second))
    cache = ManifestCache()  # one schema-check cache for both sets
    errors = {e.directory: e.error for e in build(home, cache=cache).sets}
    by_number = {first: errors["a1"], second: errors["b1"]}
    assert by_number == {
        "1e400": "tools.json has a number toolsetd cannot hold: 1e400 is beyond the range of a "
        "double (about ±1.8e308). Write a smaller number, or leave it out.",
        "null": "Tool 'a1' has an invalid JSON Schema: None is not of type 'number' "
        "(at /properties/n/maximum)".replace("a1", "a1" if first == "null" else "b1"),
    }


def test_build_catalog_dotnet_set_skipped_with_note(home: Path, workspace: Path) -> None:
    """A valid dotnet set is refused with the no-.NET note, and a project dotnet set still hides home."""
    write(home / "tools", "Acme.Tools", manifest("deploy"))
    write(workspace / ".crystal" / "tools", "Acme.Tools", {"runner": "dotnet", "assembly": "Acme.Tools.dll"})
    catalog = build(home, workspace)
    assert catalog.tools == {}
    assert states(catalog) == [("Acme.Tools", "home", "hidden"), ("Acme.Tools", "project", "refused")]
    assert messages(catalog) == [
        "External tool set 'Acme.Tools' was skipped: dotnet runner is not supported by toolsetd "
        "(no .NET runtime); the manifest is valid."
    ]


def test_build_catalog_disabled_invalid_set_gets_note(home: Path) -> None:
    """A disabled set whose manifest is invalid is still skipped with a note."""
    write(home / "tools", "acme", {"runner": "exec", "enabled": False, "stdin": "x"})
    assert messages(build(home)) == ["External tool set 'acme' was skipped: stdin must be a boolean."]


def test_build_catalog_note_order(home: Path, workspace: Path) -> None:
    """Notes run config first, then home discovery, then project discovery, then load notes."""
    (home / "config.json").write_text('{"externalToolApproval": {"home": "maybe"}}')
    write(home / "tools", "b", manifest("x"))
    write(home / "tools", "c", b"[]")
    write(workspace / ".crystal" / "tools", "a", b"[]")
    write(workspace / ".crystal" / "tools", "d", manifest("x"))
    catalog = build(home, workspace)
    assert [(n.set, n.source) for n in catalog.notes] == [
        ("config.json", None),
        ("c", Source.HOME),
        ("a", Source.PROJECT),
        ("d", Source.PROJECT),
    ]


def test_build_catalog_sets_sorted_by_directory_then_source(home: Path, workspace: Path) -> None:
    """Set entries sort by directory name, then home before project."""
    write(workspace / ".crystal" / "tools", "b", manifest("p"))
    write(home / "tools", "b", manifest("h"))
    write(home / "tools", "a", manifest("a"))
    assert [(e.directory, e.source.value) for e in build(home, workspace).sets] == [
        ("a", "home"),
        ("b", "home"),
        ("b", "project"),
    ]


@pytest.mark.parametrize(
    ("config", "home_effective", "project_effective"),
    [
        ({}, Approval.ALWAYS, Approval.INHERIT),
        ({"externalToolApproval": {"home": "host"}}, Approval.INHERIT, Approval.INHERIT),
        ({"externalToolApproval": {"project": " Author "}}, Approval.ALWAYS, Approval.ALWAYS),
    ],
)
def test_build_catalog_source_policy(
    home: Path, workspace: Path, config: dict[str, Any], home_effective: Approval, project_effective: Approval
) -> None:
    """The effective approval follows the author under ``author`` and is inherit under ``host``."""
    (home / "config.json").write_text(json.dumps(config))
    write(home / "tools", "h", manifest("ht", approval="always"))
    write(workspace / ".crystal" / "tools", "p", manifest("pt", approval="always"))
    catalog = build(home, workspace)
    assert catalog.tools["ht"].effective_approval is home_effective
    assert catalog.tools["pt"].effective_approval is project_effective
    assert catalog.tools["pt"].tool.approval is Approval.ALWAYS


def test_build_catalog_explicit_config_skips_config_file(home: Path) -> None:
    """A passed Config is used as is, and the config file is not read (no config notes)."""
    (home / "config.json").write_text("{")
    write(home / "tools", "acme", manifest("t", approval="always"))
    catalog = build(home, config=Config(home_policy=ApprovalSource.HOST))
    assert catalog.notes == ()
    assert catalog.tools["t"].effective_approval is Approval.INHERIT


def test_tool_info_wire_shape(home: Path) -> None:
    """``tool_info`` renders the contract's camelCase tools[] entry."""
    write(home / "tools", "acme", manifest("deploy", catalogs=["work", "plan"], timeoutSeconds="unlimited"))
    loaded = build(home).tools["deploy"]
    assert tool_info(loaded) == {
        "name": "deploy",
        "description": "deploy tool",
        "inputSchema": SCHEMA,
        "set": "acme",
        "source": "home",
        "runner": "exec",
        "catalogs": ["plan", "work"],
        "approval": {"declared": "inherit", "policy": "author", "effective": "inherit"},
        "timeoutSeconds": None,
        "output": "text",
        "pathArguments": [],
        "hash": loaded.hash,
    }


def test_set_info_wire_shape(home: Path) -> None:
    """``set_info`` renders the contract's sets[] entry."""
    set_dir = write(home / "tools", "acme", manifest("deploy"))
    assert set_info(build(home).sets[0]) == {
        "directory": "acme",
        "source": "home",
        "path": str(set_dir),
        "enabled": True,
        "state": "loaded",
        "tools": ["deploy"],
        "notes": [],
        "runner": "exec",
        "catalogs": ["plan", "work"],
        "approval": "inherit",
        "declaredTools": [{"name": "deploy", "approval": "inherit", "catalogs": ["plan", "work"]}],
        "error": None,
    }


def test_set_info_of_a_disabled_set_names_its_declared_tools(home: Path) -> None:
    """A set that did not load still names its tools with their approval (issue 11)."""
    body = manifest("deploy", enabled=False)
    body["tools"][0]["approval"] = "always"
    write(home / "tools", "acme", body)
    info = set_info(build(home).sets[0])
    assert info["state"] == "disabled" and info["tools"] == []
    assert info["declaredTools"] == [{"name": "deploy", "approval": "always", "catalogs": ["plan", "work"]}]


def test_set_info_of_an_invalid_name_has_the_short_error_cell(home: Path) -> None:
    write(home / "tools", "bad name", manifest("deploy"))
    info = set_info(build(home).sets[0])
    assert info["error"] == "directory name is invalid."
    assert info["declaredTools"] == []


def test_set_info_of_a_broken_manifest_carries_its_error(home: Path) -> None:
    """A set whose manifest did not parse has null set-level fields and its error."""
    (home / "tools" / "broken").mkdir(parents=True)
    (home / "tools" / "broken" / "tools.json").write_text("{")
    info = set_info(build(home).sets[0])
    assert info["state"] == "refused"
    assert info["runner"] is None and info["catalogs"] is None and info["approval"] is None
    assert info["error"].startswith("tools.json is not valid JSON")


def test_tool_hash_stable_and_sensitive(home: Path) -> None:
    """The hash is stable across builds and changes with anything that changes how the tool runs."""
    write(home / "tools", "acme", manifest("deploy"))
    first = build(home).tools["deploy"].hash
    assert first.startswith("sha256:") and len(first) == 7 + 64
    assert build(home).tools["deploy"].hash == first
    variants = [
        manifest("deploy", command=["other"]),
        manifest("deploy", stdin=False),
        manifest("deploy", timeoutSeconds=5),
        {**manifest(), "tools": [tool("deploy", argv={"environment": "--env"})]},
        {**manifest(), "tools": [tool("deploy", description="changed")]},
    ]
    seen = {first}
    for body in variants:
        write(home / "tools", "acme", body)
        seen.add(build(home).tools["deploy"].hash)
    assert len(seen) == len(variants) + 1
    write(home / "tools", "acme", manifest("deploy"))
    assert build(home, config=Config(home_policy=ApprovalSource.HOST)).tools["deploy"].hash != first


def test_manifest_cache_skips_unchanged_sets(home: Path, workspace: Path) -> None:
    """A rebuild with unchanged files neither re-reads nor re-parses any manifest."""
    write(home / "tools", "a", manifest("a"))
    write(home / "tools", "b", b"{")
    later = time.time_ns() + 10 * RACY_NS  # the files are old enough to be judged by stat
    cache = ManifestCache(clock_ns=lambda: later)
    first = build(home, workspace, cache=cache)
    assert (cache.reads, cache.parses) == (2, 2)
    second = build(home, workspace, cache=cache)
    assert (cache.reads, cache.parses) == (2, 2)
    assert second.tools["a"] is not first.tools["a"]
    assert second.tools["a"].toolset is first.tools["a"].toolset
    assert messages(second) == messages(first)


def test_manifest_cache_rereads_a_fresh_file_until_it_settles(home: Path) -> None:
    """A manifest modified within the racy window is re-read (not re-parsed) until it is older."""
    write(home / "tools", "a", manifest("a"))
    now = [time.time_ns()]
    cache = ManifestCache(clock_ns=lambda: now[0])
    build(home, cache=cache)
    build(home, cache=cache)
    assert (cache.reads, cache.parses) == (2, 1)
    now[0] += 10 * RACY_NS
    build(home, cache=cache)
    build(home, cache=cache)
    assert (cache.reads, cache.parses) == (3, 1)


def test_manifest_cache_touched_identical_file_is_not_reparsed(home: Path) -> None:
    """A touched file with identical bytes is re-read but not re-parsed; changed bytes are re-parsed."""
    set_dir = write(home / "tools", "a", manifest("a"))
    cache = ManifestCache()
    build(home, cache=cache)
    os.utime(set_dir / "tools.json", ns=(1, 1))
    build(home, cache=cache)
    assert (cache.reads, cache.parses) == (2, 1)
    write(home / "tools", "a", manifest("b"))
    assert list(build(home, cache=cache).tools) == ["b"]
    assert (cache.reads, cache.parses) == (3, 2)


def test_manifest_cache_reserved_change_reparses(home: Path) -> None:
    """A different reserved set forces a re-parse, since names may become reserved."""
    write(home / "tools", "a", manifest("deploy"))
    cache = ManifestCache()
    assert list(build(home, cache=cache).tools) == ["deploy"]
    assert build(home, cache=cache, reserved=frozenset({"deploy"})).tools == {}
    assert cache.parses == 2


def test_manifest_cache_reuses_schema_checks(home: Path) -> None:
    """Sets sharing one schema content are checked once."""
    for name in ("a", "b", "c"):
        write(home / "tools", name, manifest(name + "1", name + "2"))
    cache = ManifestCache()
    build(home, cache=cache)
    assert cache.schemas.checks == 1


#: What a config.json that cannot be read or parsed means (the strict reading of anything).
UNUSABLE = Config(
    external_tools=False, home_policy=ApprovalSource.HOST, project_policy=ApprovalSource.HOST
)


def test_load_config_missing_file_defaults(home: Path) -> None:
    """No config.json means the defaults and no notes."""
    assert load_config(home) == (Config(), [])


@pytest.mark.parametrize(
    ("text", "expected", "note"),
    [
        ("{", UNUSABLE, "config.json is not valid JSON: Expecting property name enclosed in double quotes: "
         "line 1 column 2 (char 1); external tool discovery is off, and the approval policy host for both sources, until it is fixed."),
        ("[]", UNUSABLE, "config.json must be a JSON object; external tool discovery is off, and the approval policy host for both sources, until it is fixed."),
        ('{"externalTools": "no"}', Config(external_tools=False),
         "config.json: externalTools must be true or false; external tool discovery is off until it "
         "is fixed."),
        ('{"externalTools": true, "EXTERNALTOOLS": "true"}', Config(external_tools=False),
         "config.json: externalTools must be true or false; external tool discovery is off until it "
         "is fixed."),
        ('{"externalToolApproval": "host"}', Config(home_policy=ApprovalSource.HOST),
         'config.json: externalToolApproval must be an object such as {"home": "author", "project": "host"}; '
         "using host for both, so no manifest's approval counts, until it is fixed."),
        ('{"externalToolApproval": {"home": "maybe", "project": "AUTHOR"}}',
         Config(home_policy=ApprovalSource.HOST, project_policy=ApprovalSource.AUTHOR),
         "config.json: externalToolApproval.home must be author or host. External tool trust policy must be "
         "author or host. Using host for home sets, so no home manifest's approval counts, until it is fixed."),
        ('{"externalToolApproval": {"home": "author\\u001c"}}', Config(home_policy=ApprovalSource.HOST),
         "config.json: externalToolApproval.home must be author or host. External tool trust policy must be "
         "author or host. Using host for home sets, so no home manifest's approval counts, until it is fixed."),
        ('{"externalToolApproval": {"project": 1}}', Config(),
         "config.json: externalToolApproval.project must be author or host. External tool trust policy must be "
         "author or host. Using host for project sets, so no project manifest's approval counts, until it is fixed."),
    ],
)
def test_load_config_bad_parts_fall_back_with_note(home: Path, text: str, expected: Config, note: str) -> None:
    """Each bad part of config.json falls back and yields one note naming the field and the fix.

    Each fallback is the strict reading: an approval policy the daemon cannot read is host,
    never author (a typo must not make ``approval: always`` count), and an externalTools
    it cannot read, or a file it cannot use (which may have said false), turns discovery
    off, never on.
    """
    (home / "config.json").write_text(text)
    config, notes = load_config(home)
    assert config == expected
    assert [(n.set, n.source, n.message) for n in notes] == [("config.json", None, note)]


def test_load_config_valid_values(home: Path) -> None:
    """Valid values are read, trimmed and case-insensitive; nulls mean the default."""
    (home / "config.json").write_text(
        '{"externalTools": false, "externalToolApproval": {"home": " Host ", "project": null}}'
    )
    assert load_config(home) == (Config(external_tools=False, home_policy=ApprovalSource.HOST), [])


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ('{"ExternalToolApproval": {"Home": "host"}}', Config(home_policy=ApprovalSource.HOST)),
        ('{"externaltoolapproval": {"HOME": "host", "PROJECT": "author"}}',
         Config(home_policy=ApprovalSource.HOST, project_policy=ApprovalSource.AUTHOR)),
        ('{"EXTERNALTOOLS": false}', Config(external_tools=False)),
        # Two spellings of one name: the stricter reading wins.
        ('{"externalToolApproval": {"home": "author", "Home": "host"}}',
         Config(home_policy=ApprovalSource.HOST)),
        ('{"externalToolApproval": {"Home": "host"}, "externalToolapproval": {"home": "author"}}',
         Config(home_policy=ApprovalSource.HOST)),
        ('{"externalTools": true, "ExternalTools": false}', Config(external_tools=False)),
        # An object that leaves a source out says its default for it: merged with another
        # spelling's author it stays the stricter, host (the project's default).
        ('{"externalToolApproval": {"project": "author"}, "ExternalToolApproval": {"home": "host"}}',
         Config(home_policy=ApprovalSource.HOST)),
        ('{"externalToolApproval": {"project": "author"}, "ExternalToolApproval": {}}', Config()),
        ('{"externalToolApproval": {"project": "author"}, "ExternalToolApproval": {"project": null}}',
         Config()),
        ('{"ExternalToolApproval": {"project": "author"}, "externalToolApproval": null}', Config()),
        ('{"externalToolApproval": null}', Config()),
    ],
)
def test_load_config_property_names_in_any_case(home: Path, text: str, expected: Config) -> None:
    """Property names match in any case, as the reference host reads config.json.

    It reads the file with ``PropertyNameCaseInsensitive``, so ``"ExternalToolApproval":
    {"Home": "host"}`` makes home tools ``host`` there; read case-sensitively it was
    ignored, and a home tool's ``approval: always`` ran without asking.
    """
    (home / "config.json").write_text(text)
    assert load_config(home) == (expected, [])


@pytest.mark.parametrize(
    ("bom", "encoding"),
    [
        (codecs.BOM_UTF8, "utf-8"),
        (codecs.BOM_UTF16_LE, "utf-16-le"),
        (codecs.BOM_UTF16_BE, "utf-16-be"),
        (codecs.BOM_UTF32_LE, "utf-32-le"),
        (codecs.BOM_UTF32_BE, "utf-32-be"),
    ],
)
def test_load_config_reads_the_encodings_the_reference_host_reads(
    home: Path, bom: bytes, encoding: str
) -> None:
    """config.json is read as .NET's ``File.ReadAllText`` reads it (the reference host's
    ``SettingsStore.Load``): a UTF-16 or UTF-32 byte order mark chooses that encoding, as
    for tools.json. A UTF-16 file (Windows Notepad's "Unicode") was decoded as UTF-8, was
    "not valid JSON", and turned discovery off with both sources host."""
    text = '{"externalTools": false, "externalToolApproval": {"project": "author"}}'
    (home / "config.json").write_bytes(bom + text.encode(encoding))
    assert load_config(home) == (
        Config(external_tools=False, project_policy=ApprovalSource.AUTHOR), []
    )


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ('{"externalToolApproval": {"home": ""}}', Config()),
        ('{"externalToolApproval": {"home": " \\u00a0", "project": "\\t"}}', Config()),
        ('{"externalToolApproval": {"home": "", "project": "author"}}',
         Config(project_policy=ApprovalSource.AUTHOR)),
        ('{"externalToolApproval": {"home": "host", "Home": ""}}', Config(home_policy=ApprovalSource.HOST)),
        ('{"externalToolApproval": {"project": "", "Project": "author"}}', Config()),
    ],
)
def test_load_config_blank_policy_means_the_default(home: Path, text: str, expected: Config) -> None:
    """A blank (empty or white space) source policy means that source's default, as the
    reference host reads it (``string.IsNullOrWhiteSpace`` in ``ReadExternalToolApproval``):
    home author, project host, and no note. It was refused with "must be author or host",
    which made home sets host, so their ``approval: always`` stopped counting."""
    (home / "config.json").write_text(text)
    assert load_config(home) == (expected, [])


def test_load_config_dangling_symlink_is_unreadable(home: Path, tmp_path: Path) -> None:
    """A config.json symlink whose target is gone is the operator's file that cannot be
    read (it may have said false), not a missing file: discovery off, host, and a note.
    It was read as absent: discovery on and home author, silently."""
    (home / "config.json").symlink_to(tmp_path / "gone" / "crystal.json")
    config, notes = load_config(home)
    assert config == UNUSABLE
    assert [n.message for n in notes] == [
        "config.json could not be read. External tool discovery is off, and the approval policy "
        "host for both sources, until it is fixed."
    ]


def test_load_config_fifo_is_unreadable(home: Path) -> None:
    """A FIFO config.json does not hang the loader; it is unusable: discovery off, host."""
    os.mkfifo(home / "config.json")
    config, notes = load_config(home)
    assert config == UNUSABLE
    assert [n.message for n in notes] == [
        "config.json could not be read. External tool discovery is off, and the approval policy "
        "host for both sources, until it is fixed."
    ]


def test_sets_come_in_the_reference_hosts_ordinal_order(home: Path, workspace: Path) -> None:
    """Set folders are taken and listed in .NET's ordinal order (``StringComparer.Ordinal``:
    UTF-16 code units, a name's stray bytes read as U+FFFD), not Python's code points: a
    character past U+FFFF sorts below U+E000 to U+FFFF there, and a stray byte sorted as its
    lone surrogate (below U+F000) though the wire shows U+FFFD. Such names are invalid, so
    only the rows' and notes' order changed; the offline inventory agrees."""
    stray = os.fsdecode(b"caf\xe9")
    for name in ("b", "\U0001f600x", "\uff21x", "\ue000x", stray, "caf\uf000"):
        write(home / "tools", name, manifest("t"))
    write(workspace / ".crystal" / "tools", "\uff21x", manifest("u"))
    expected = [("b", "home"), ("caf\uf000", "home"), (stray, "home"), ("\U0001f600x", "home"),
                ("\ue000x", "home"), ("\uff21x", "home"), ("\uff21x", "project")]
    assert [(e.directory, e.source.value) for e in build(home, workspace).sets] == expected
    assert [(e.directory, e.source.value) for e in build(home).sets] == expected[:-1]
    from toolsetd.client.offline import inventory

    shown = [("caf\ufffd" if name == stray else name, source) for name, source in expected]
    assert [(row.directory, row.source) for row in inventory(home, workspace)] == shown
