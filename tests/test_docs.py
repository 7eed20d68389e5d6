"""The docs stand on their own: no pointers outside the repository, the goals carried here."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from pydantic import BaseModel

REPO = Path(__file__).resolve().parents[1]
DOCS = sorted([*(REPO / "docs").glob("*.md"), REPO / "README.md", *(REPO / "bench").glob("*.py")])


@pytest.mark.parametrize("path", DOCS, ids=lambda p: p.name)
def test_no_absolute_path_outside_the_repository(path: Path) -> None:
    """A reader of the repository cannot follow ``/work/...``, nor a session's scratch
    folder (``/tmp/p16/pyc_check.py``, gone with it): nothing may point there."""
    text = path.read_text()
    assert not re.search(r"/work/(shared|main|wt-)", text), path
    assert not re.search(r"/tmp/[a-z]+\d+/", text), path  # a pattern, no file


@pytest.mark.parametrize("path", DOCS, ids=lambda p: p.name)
def test_no_pointer_into_the_contract(path: Path) -> None:
    """The external contract is not in the repository: a page that sends its reader to
    "contract section 4" or "the MCP section of the contract" sends them nowhere. The
    docs carry what it says themselves, and point at each other."""
    pointer = re.search(r"[Cc]ontract,? section \d|section of the contract", path.read_text())
    assert pointer is None, (path.name, pointer)


def test_benchmarks_carry_the_performance_goals() -> None:
    text = (REPO / "docs" / "benchmarks.md").read_text()
    goals = re.findall(r"^(\d)\. \*\*", text.split("## Goals", 1)[1], flags=re.M)
    assert goals[:8] == [str(n) for n in range(1, 9)]
    assert "spawn and reap `/bin/true`, C `posix_spawn`" in text  # the floors too


def _section(text: str, heading: str) -> str:
    """The body of one ``#``-heading, up to the next heading of any level."""
    return re.split(r"\n#{2,4} ", text.split(heading + "\n", 1)[1], maxsplit=1)[0]


def test_operations_flag_table_names_every_setting_with_its_default() -> None:
    """docs/operations.md's Command line table has one row per toolsetd flag, no row for
    a flag that does not exist, and the numeric default each one has in the code."""
    from toolsetd.daemon.settings import OPTIONS

    body = _section((REPO / "docs" / "operations.md").read_text(), "### Command line")
    rows = dict(re.findall(r"^\| `(--[a-z-]+)[^`]*` \|\s*([^|]*?)\s*\|", body, flags=re.M))
    flags = {option.flag: option for option in OPTIONS}
    assert set(rows) == {*flags, "--config", "--print-config", "--version"}
    for flag, option in flags.items():
        if option.kind in ("int", "float"):
            shown = re.match(r"\d+(?:\.\d+)?", rows[flag])
            assert shown is not None, (flag, rows[flag])
            assert float(shown.group()) == option.default, (flag, rows[flag])


def test_operations_config_key_table_names_every_key() -> None:
    """Every setting is a row of the config file's key table, and no row names another."""
    from toolsetd.daemon.settings import OPTIONS

    body = _section(
        (REPO / "docs" / "operations.md").read_text(), "### The config file (`toolsetd.toml`)"
    )
    table = body.split("| key | type | at reload |", 1)[1].split("\n\n", 1)[0]
    cells = [line.split("|")[1] for line in table.splitlines() if line.startswith("| `")]
    keys = {key for cell in cells for key in re.findall(r"`([a-z-]+)`", cell)}
    assert keys == {option.key for option in OPTIONS}
    # Each row says whether a reload applies its keys, as Option.reloadable has it.
    applied = {
        key
        for line in table.splitlines()
        if line.startswith("| `") and line.rstrip(" |").split("|")[-1].strip().startswith("applied")
        for key in re.findall(r"`([a-z-]+)`", line.split("|")[1])
    }
    assert applied == {option.key for option in OPTIONS if option.reloadable}


def test_protocol_error_table_matches_the_codes() -> None:
    """docs/protocol.md's error table lists every error class, by code and name, once."""
    from toolsetd.protocol.errors import ERROR_CLASSES

    body = _section((REPO / "docs" / "protocol.md").read_text(), "## Errors")
    rows = re.findall(r"^\| (-\d+) \| `(\w+)` \|", body, flags=re.M)
    assert sorted(rows) == sorted((str(code), cls.__name__) for code, cls in ERROR_CLASSES.items())


def test_protocol_limits_table_defaults_match_the_flags() -> None:
    """Each row of docs/protocol.md's limits table that names a flag states its default."""
    from toolsetd.daemon.settings import OPTIONS

    flags = {option.flag: option for option in OPTIONS}
    body = _section((REPO / "docs" / "protocol.md").read_text(), "## Limits and timeouts")
    rows = re.findall(r"^\| ([^|]+) \| ([^|]+) \| `(--[a-z-]+)` \|", body, flags=re.M)
    assert len(rows) >= 6, rows
    units = {"MiB": 1 << 20, "s": 1}
    for what, default, flag in rows:
        option = flags[flag]
        if "\N{MULTIPLICATION SIGN}" in default:  # "4 x the line size": derived from the flag
            continue
        number = re.match(r"([\d,]+)(?: (MiB|s)\b)?", default)
        assert number is not None, (what, default)
        value = int(number.group(1).replace(",", "")) * units.get(number.group(2) or "", 1)
        assert value == option.default, (what, default, flag)


def _anchors(text: str) -> set[str]:
    """The fragment ids of a page: its headings as GitHub slugs them, and explicit ids."""
    outside_code = re.sub(r"```.*?```", "", text, flags=re.S)
    headings = re.findall(r"^#{1,6} (.+)$", outside_code, flags=re.M)
    slugs = {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in headings}
    return slugs | set(re.findall(r'<a id="([^"]+)"', text))


@pytest.mark.parametrize("path", [p for p in DOCS if p.suffix == ".md"], ids=lambda p: p.name)
def test_links_between_the_docs_lead_somewhere(path: Path) -> None:
    """Every relative link names a file that exists and, with a fragment, a heading of it:
    a renamed section leaves no link pointing nowhere."""
    text = path.read_text()
    for target, fragment in re.findall(r"\]\(([^):#\s]*)(?:#([^)\s]+))?\)", text):
        page = (path.parent / target).resolve() if target else path
        assert page.exists(), (path.name, target)
        if fragment and page.suffix == ".md":
            assert fragment in _anchors(page.read_text()), (path.name, target, fragment)


def test_readme_layout_names_every_top_level_folder() -> None:
    """README.md's Layout is where a newcomer learns what each folder is: it names every
    folder the repository holds (a hidden one such as ``.ci`` too)."""
    import shutil
    import subprocess

    git = shutil.which("git")
    if git is None or not (REPO / ".git").exists():
        pytest.skip("not a git checkout")
    files = subprocess.run(
        [git, "-C", str(REPO), "ls-files"], capture_output=True, text=True, check=True
    ).stdout.splitlines()
    folders = {name.split("/", 1)[0] for name in files if "/" in name}
    layout = _section((REPO / "README.md").read_text(), "## Layout")
    named = set(re.findall(r"`(\.?[a-z]+)/`", layout))
    assert folders <= named, sorted(folders - named)


def test_architecture_names_the_daemon_modules_the_offline_client_imports() -> None:
    """docs/architecture.md names the daemon modules client/offline.py imports (the one
    exception to the layering): each of them, and no other."""
    import ast

    tree = ast.parse((REPO / "client" / "offline.py").read_text())
    imported = {
        node.module.removeprefix("toolsetd.daemon.")
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom)
        and node.module
        and node.module.startswith("toolsetd.daemon.")
    }
    text = (REPO / "docs" / "architecture.md").read_text()
    row = next(line for line in text.splitlines() if line.startswith("| `client/` |"))
    named = re.search(r"pure file-reading modules \(([^)]*)\)", row)
    assert named is not None, row
    assert set(re.findall(r"`(\w+)`", named.group(1))) == imported


def test_protocol_child_environment_matches_the_runner() -> None:
    """protocol.md's table of what a child's environment gains is the runner's list (plus
    TRACEPARENT, for a call with a trace), in its order, and what it loses is the systemd
    variables the daemon scrubs and the daemon's own trace context."""
    from toolsetd.daemon import runner, sdnotify

    body = _section(
        (REPO / "docs" / "protocol.md").read_text(), "## For tool authors: the child process"
    )
    added = re.findall(r"^  \| `([A-Z_]+)` \|", body, flags=re.M)
    assert added == [name.decode() for name in runner._CALL_VARIABLES] + ["TRACEPARENT"]
    environment = body.split("* **Environment**:", 1)[1].split(", plus:", 1)[0]
    removed = set(re.findall(r"`([A-Z_]+)`", environment))
    assert removed == set(sdnotify.SYSTEMD_ENV_VARS) | runner._DAEMON_TRACE_VARIABLES
    security = (REPO / "docs" / "security.md").read_text()
    minus = security.split("* **Environment:** the daemon's environment, **minus**", 1)[1]
    minus = minus.split("**plus**", 1)[0]
    assert set(re.findall(r"`([A-Z_]+)`", minus)) == removed


@pytest.mark.parametrize("package", ["protocol", "daemon", "client"])
def test_architecture_names_every_module_and_no_other(package: str) -> None:
    """docs/architecture.md's section of each package names every module of its folder (as
    `module`, or `module.name`), and each of its bullets names a module that exists: a new
    or renamed module is not left out of the contract between modules, nor a removed one
    kept in it."""
    text = (REPO / "docs" / "architecture.md").read_text()
    section = text.split(f"### `toolsetd.{package}`\n", 1)[1]
    section = re.split(r"\n##+ ", section, maxsplit=1)[0]
    modules = {path.stem for path in (REPO / package).glob("*.py") if path.stem != "__init__"}
    unnamed = {m for m in modules if not re.search(rf"`{re.escape(m)}[`.(]", section)}
    assert unnamed <= {"__main__"}, sorted(unnamed)
    bullets = set(re.findall(r"^\* `(\w+)`", section, flags=re.M))
    assert bullets <= modules, sorted(bullets - modules)


def _defined_names() -> tuple[set[str], dict[str, set[str]]]:
    """Every function, class and method the three packages define, and each class's
    attributes (methods, class-level fields, ``self.x`` assignments)."""
    import ast

    names: set[str] = set()
    members: dict[str, set[str]] = {}
    for package in ("protocol", "daemon", "client"):
        for path in (REPO / package).glob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    names.add(node.name)
                if isinstance(node, ast.ClassDef):
                    found = members.setdefault(node.name, set())
                    for inner in ast.walk(node):
                        if isinstance(inner, (ast.FunctionDef, ast.AsyncFunctionDef)):
                            found.add(inner.name)
                        elif isinstance(inner, ast.AnnAssign) and isinstance(
                            inner.target, ast.Name
                        ):
                            found.add(inner.target.id)
                        elif isinstance(inner, ast.Attribute) and isinstance(inner.value, ast.Name):
                            if inner.value.id == "self":
                                found.add(inner.attr)
                        elif isinstance(inner, ast.Name):
                            found.add(inner.id)
    return names, members


def test_architecture_names_only_what_the_code_defines() -> None:
    """Each ``function(...)`` and ``Class.member`` docs/architecture.md names is defined in
    the code: a function renamed or a hook moved to another class leaves no stale name in
    the contract between modules (``tcp_peer_uid`` outlived its rename to ``tcp_peer``)."""
    import builtins

    text = (REPO / "docs" / "architecture.md").read_text()
    names, members = _defined_names()
    foreign = {"CapacityLimiter"}  # anyio's
    called = set(re.findall(r"`(?:\w+\.)*(\w+)\(", text))
    unknown = {
        n for n in called if n not in names and n not in foreign and not hasattr(builtins, n)
    }
    assert unknown == set(), sorted(unknown)
    dotted = set(re.findall(r"`([A-Z]\w*)\.(\w+)", text))
    stale = {f"{c}.{a}" for c, a in dotted if c in members and a not in members[c]}
    assert stale == set(), sorted(stale)


def test_benchmarks_how_to_run_names_every_benchmark() -> None:
    """docs/benchmarks.md's ``--only`` line and bench/__main__.py's docstring name the
    benchmarks ``python -m bench`` runs, each of them and no other: a benchmark added to
    the runner is one a reader can select."""
    import ast

    tree = ast.parse((REPO / "bench" / "__main__.py").read_text())  # importing it is slow
    known = next(
        ast.literal_eval(node.value)
        for node in tree.body
        if isinstance(node, ast.Assign)
        and any(isinstance(t, ast.Name) and t.id == "ALL" for t in node.targets)
    )
    text = (REPO / "docs" / "benchmarks.md").read_text()
    line = next(line for line in text.splitlines() if "-m bench --only" in line)
    listed = line.split("# a subset:", 1)[1]
    assert [name.strip() for name in listed.split(",")] == list(known)
    doc = ast.get_docstring(tree) or ""
    names = doc.split("the names\nbeing ``ALL``'s:", 1)[1].split(".\n", 1)[0]
    assert [name.strip() for name in names.split(",")] == list(known)


def test_kill_grace_help_names_every_call_it_applies_to() -> None:
    """``toolsetd --help`` said the kill grace is for a timed-out call; it is the grace of
    every end the daemon forces on a call's process group (operations.md's row: timeout,
    cancel, stop), so the help names each of them too."""
    from toolsetd.daemon.settings import OPTIONS

    body = _section((REPO / "docs" / "operations.md").read_text(), "### Command line")
    row = next(line for line in body.splitlines() if line.startswith("| `--kill-grace"))
    ends = re.search(r"process group \(([^)]*)\)", row)
    assert ends is not None, row
    option = next(option for option in OPTIONS if option.flag == "--kill-grace")
    for end in ends.group(1).split(", "):
        assert end[:4] in option.help, (end, option.help)


def test_readme_documentation_table_names_every_page() -> None:
    """README.md's Documentation table is the way into docs/: it has one row per page
    there, and no row for a page that is gone."""
    table = _section((REPO / "README.md").read_text(), "## Documentation")
    rows = re.findall(r"^\| \[docs/([\w.-]+\.md)\]\(docs/\1\) \|", table, flags=re.M)
    assert sorted(rows) == sorted(path.name for path in (REPO / "docs").glob("*.md"))


def _logged_events() -> dict[str, tuple[set[str], set[str]]]:
    """Each event name the three packages log, with the levels and the keyword fields of
    its calls: ``log.<level>("name", ...)``, ``log_incident(log, "name", ...)`` (an error,
    with ``incident``), setcache's ``_warn_once("name", ...)`` (a
    warning), the acceptors' ``<prefix>_failed|_retry|_resumed`` (a ``Shortage`` of its
    own: ``_retry|_resumed``) and the log writer's own
    ``log_lines_dropped``."""
    import ast

    levels = {"debug", "info", "warning", "error", "exception", "critical"}
    events: dict[str, tuple[set[str], set[str]]] = {}

    def add(name: str, level: str, fields: set[str]) -> None:
        found = events.setdefault(name, (set(), set()))
        found[0].add(level)
        found[1].update(fields)

    prefixes: set[str] = set()
    shortages: set[str] = set()
    for package in ("protocol", "daemon", "client"):
        for path in (REPO / package).glob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if not isinstance(node, ast.Call) or not node.args:
                    continue
                first = node.args[0]
                func = node.func
                name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
                if name == "Acceptor":
                    prefix = node.args[2] if len(node.args) > 2 else None
                    if isinstance(prefix, ast.Constant) and isinstance(prefix.value, str):
                        prefixes.add(prefix.value)
                    continue
                if name == "Shortage":  # an accept loop of its own: no _failed event
                    prefix = node.args[1] if len(node.args) > 1 else None
                    if isinstance(prefix, ast.Constant) and isinstance(prefix.value, str):
                        shortages.add(prefix.value)
                    continue
                if name == "log_incident" and len(node.args) > 1:
                    # logs.log_incident(logger, "name", ...): an error, with its incident id
                    event = node.args[1]
                    if isinstance(event, ast.Constant) and isinstance(event.value, str):
                        # exc_info: the traceback (another exception than the one
                        # being handled), as for log.<level>; no field of its own.
                        fields = {k.arg for k in node.keywords if k.arg and k.arg != "exc_info"}
                        add(event.value, "error", fields | {"incident"})
                    continue
                if not (isinstance(first, ast.Constant) and isinstance(first.value, str)):
                    continue
                if not re.fullmatch(r"[a-z]+(_[a-z0-9]+)+", first.value):
                    continue
                fields = {k.arg for k in node.keywords if k.arg and k.arg != "exc_info"}
                if name in levels:
                    add(first.value, "error" if name == "exception" else name, fields)
                elif name == "_warn_once":
                    add(first.value, "warning", fields | {"path"})
    assert prefixes, "no Acceptor(...) found: the acceptors' events would go unchecked"
    for prefix in prefixes:
        add(f"{prefix}_failed", "error", {"error"})
    for prefix in prefixes | shortages:
        add(f"{prefix}_retry", "warning", {"errno", "error"})
        add(f"{prefix}_resumed", "info", {"retries"})
    add("log_lines_dropped", "warning", {"dropped"})
    return events


def test_operations_log_table_names_every_event_the_code_logs() -> None:
    """docs/operations.md's Logs table has a row for each event the code logs, and no row
    for an event nothing logs; each row's level is the level the code logs it at, and its
    fields name every keyword field the code passes (beyond ``conn_id``, which every event
    of a connection carries). The integration test checks the events of one run; this
    one checks every event, including those only a failure logs."""
    logs = (REPO / "docs" / "operations.md").read_text().split("\n## Logs\n", 1)[1]
    table = logs.split("| event | level | fields | when |\n", 1)[1].split("\n\n", 1)[0]
    rows = {
        m.group(1): (m.group(2), set(re.findall(r"`(\w+)`", m.group(3))))
        for m in re.finditer(r"^\| `(\w+)` \| (\w+) \|([^|]*)\|", table, flags=re.M)
    }
    events = _logged_events()
    assert sorted(set(events) - set(rows)) == [], "logged, but no row"
    assert sorted(set(rows) - set(events)) == [], "a row, but nothing logs it"
    for event, (levels, fields) in events.items():
        level, named = rows[event]
        assert levels == {level}, (event, level, levels)
        assert fields - {"conn_id"} <= named, (event, sorted(fields - named))


def test_docs_list_the_reserved_names_the_daemon_reserves() -> None:
    """manifest.md (the tool author's list) and operations.md's ``--reserve`` row (the
    operator's) name the front ends' built-in tool names the daemon reserves: each of
    them, and no other. A name added to the code and not to the pages refuses sets their
    authors were told are legal."""
    from toolsetd.daemon.model import DEFAULT_RESERVED_NAMES

    manifest = (REPO / "docs" / "manifest.md").read_text()
    listed = manifest.split("Reserved names are compared case-sensitively:", 1)[1]
    listed = listed.split(", plus every", 1)[0]
    assert set(re.findall(r"`(\w+)`", listed)) == DEFAULT_RESERVED_NAMES
    body = _section((REPO / "docs" / "operations.md").read_text(), "### Command line")
    row = next(line for line in body.splitlines() if line.startswith("| `--reserve"))
    built_ins = row.split("front ends' built-ins (", 1)[1].split(")", 1)[0]
    assert set(re.findall(r"`(\w+)`", built_ins)) == DEFAULT_RESERVED_NAMES


def _wire_names(model: type[BaseModel]) -> set[str]:
    """The wire (camelCase) names of a protocol model's members."""
    return {field.alias or name for name, field in model.model_fields.items()}


def test_protocol_method_tables_name_each_param_of_the_models() -> None:
    """Each method's table in docs/protocol.md names every param of its model (the status
    table, its result members), and no member the model does not have: the tables are
    where front-end authors learn the wire, and the models refuse unknown params, so a
    param renamed, added or dropped in one and not the other breaks their calls."""
    from toolsetd.protocol import models

    text = (REPO / "docs" / "protocol.md").read_text()

    def rows(heading: str) -> set[str]:
        return set(re.findall(r"^\| `(\w+)` \|", _section(text, heading), flags=re.M))

    tables = {
        "## status": models.StatusResult,
        "## list": models.ListParams,
        "## classify": models.ClassifyParams,
        "## cancel": models.CancelParams,
        "## reload": models.ReloadParams,
    }
    for heading, model in tables.items():
        assert rows(heading) == _wire_names(model), heading
    # invoke's table: "the params are those of classify, plus" these.
    extra = _wire_names(models.InvokeParams) - _wire_names(models.ClassifyParams)
    assert rows("## invoke") == extra
    for heading, model in {
        "## started (notification)": models.StartedParams,
        "## completed (notification)": models.CompletedParams,
    }.items():
        sentence = _section(text, heading).split("Params:", 1)[1].split(".", 1)[0]
        assert set(re.findall(r"`(\w+)`", sentence)) == _wire_names(model), heading


def test_protocol_has_a_section_for_every_method_and_notification() -> None:
    """protocol.md has a ``##`` section for each method of the native wire and each
    notification (protocol/names.py), and its Contents links every section (a method
    toolsetd added, such as ``metrics``, too): a reader scanning the Contents for a
    method finds it."""
    from toolsetd.protocol.names import METHODS, NOTIFICATIONS

    text = (REPO / "docs" / "protocol.md").read_text()
    sections = set(re.findall(r"^## (.+)$", text, flags=re.M))
    assert set(METHODS) <= sections, sorted(set(METHODS) - sections)
    named = {f"{name} (notification)" for name in NOTIFICATIONS}
    assert named <= sections, sorted(named - sections)
    contents = _section(text, "## Contents")
    linked = set(re.findall(r"\]\(#([\w-]+)\)", contents))
    outside_code = re.sub(r"```.*?```", "", text, flags=re.S)
    headings = re.findall(r"^## (.+)$", outside_code, flags=re.M)
    slugs = {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in headings}
    assert sorted(slugs - linked - {"contents"}) == []


def test_protocol_results_name_every_member_of_the_models() -> None:
    """Each member of a result, entry and notification model is named (in code font) where
    docs/protocol.md describes that shape: a member added to the wire is documented for the
    front ends that will read it."""
    from toolsetd.protocol import models

    text = (REPO / "docs" / "protocol.md").read_text()

    def between(body: str, start: str, end: str) -> str:
        return body.split(start, 1)[1].split(end, 1)[0]

    listing = _section(text, "## list")
    reload_ = _section(text, "## reload")
    classify = _section(text, "## classify")
    shapes: dict[str, tuple[str, type[BaseModel]]] = {
        "list result": (between(listing, "The result has", "A `tools[]`"), models.ListResult),
        "tools[]": (between(listing, "A `tools[]` entry", "A `sets[]` entry"), models.ToolInfo),
        "approval": (listing, models.ApprovalInfo),
        "sets[]": (between(listing, "A `sets[]` entry", "A `notes[]` entry"), models.SetInfo),
        "declaredTools": (listing, models.DeclaredTool),
        "notes[]": (between(listing, "A `notes[]` entry", "```"), models.NoteInfo),
        "classification": (
            between(classify, "The result is the classification:", "```"),
            models.Classification,
        ),
        "paths[]": (classify, models.PathInfo),
        "invoke result": (
            between(_section(text, "## invoke"), "The result:", "```"),
            models.InvokeResult,
        ),
        "cancel result": (
            between(_section(text, "## cancel"), "The result is", "```"),
            models.CancelResult,
        ),
        "reload result": (between(reload_, "The result:", "```"), models.ReloadResult),
        "changed[]": (reload_, models.SetChange),
        "config": (reload_, models.ReloadConfig),
        "metrics result": (_section(text, "## metrics"), models.MetricsResult),
        "progress": (_section(text, "## progress (notification)"), models.ProgressParams),
        "catalogChanged": (
            _section(text, "## catalogChanged (notification)"),
            models.CatalogChangedParams,
        ),
    }
    for shape, (body, model) in shapes.items():
        named = {
            word for span in re.findall(r"`([^`]+)`", body) for word in re.findall(r"\w+", span)
        }
        assert sorted(_wire_names(model) - named) == [], shape


def test_security_output_files_state_the_mode_spill_files_get(tmp_path: Path) -> None:
    """security.md tells the operator who can read a spill file: the mode it states is
    the one a real spill file gets (it said anyone who can read the workspace could read
    them, of files made 0600)."""
    import os

    from toolsetd.daemon.spill import Spill

    ws = Path(os.path.realpath(tmp_path))
    spill = Spill(ws, ws / "out", "c", cap=10, keep=100, max_age_seconds=3600)
    spill.write(0, b"0123456")
    assert spill.finish(b"", b"", 7, 0) is not None
    mode = f"{(ws / 'out' / 'c').stat().st_mode & 0o777:04o}"
    section = _section((REPO / "docs" / "security.md").read_text(), "## Output files")
    assert f"mode {mode}" in section
    assert "anyone who can read the workspace can read those files" not in section
