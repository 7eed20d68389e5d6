"""``toolsetctl`` as a subprocess with no daemon: validate, list, show, enable, disable, exit 5.

Every run points ``--socket`` at a path where nothing listens and keeps ``--home`` and
``--workspace`` under ``tmp_path``, so nothing outside the test is read or written.
"""

from __future__ import annotations

import fcntl
import json
import os
import resource
import select
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import termios
from pathlib import Path

import pytest
from toolsetd.client.cli import OUT_OF_MEMORY

NOT_RUNNING = "toolsetd is not running at {}; showing the tool sets on disk.\n"
DISCOVERY_OFF = (
    "External tool discovery is off. Enabled tool sets will not load until external tool "
    "discovery is turned on."
)


class Env:
    """A home, a workspace and a dead socket path, plus a runner for ``toolsetctl``."""

    def __init__(self, root: Path) -> None:
        self.home = root / "home"
        self.workspace = root / "ws"
        self.socket = root / "no-daemon.sock"
        self.home.mkdir()
        self.workspace.mkdir()

    def home_set(self, name: str, manifest: dict[str, object] | str) -> Path:
        """Write a home set's ``tools.json``."""
        return self._write(self.home / "tools" / name / "tools.json", manifest)

    def project_set(self, name: str, manifest: dict[str, object] | str) -> Path:
        """Write a project set's ``tools.json``."""
        return self._write(self.workspace / ".crystal" / "tools" / name / "tools.json", manifest)

    @staticmethod
    def _write(path: Path, manifest: dict[str, object] | str) -> Path:
        path.parent.mkdir(parents=True, exist_ok=True)
        text = manifest if isinstance(manifest, str) else json.dumps(manifest)
        path.write_text(text, encoding="utf-8")
        return path

    def run(
        self, *args: str, stdin: str | None = None, **extra_env: str
    ) -> subprocess.CompletedProcess[str]:
        """Run ``python -m toolsetd.client`` with the global options after the subcommand."""
        env = {k: v for k, v in os.environ.items() if k not in ("TOOLSETD_SOCKET", "CRYSTAL_HOME")}
        env.update(extra_env)
        return subprocess.run(
            [sys.executable, "-m", "toolsetd.client", *args,
             "--home", str(self.home), "--workspace", str(self.workspace),
             "--socket", str(self.socket)],
            capture_output=True, text=True, timeout=60, check=False, input=stdin, env=env,
        )


@pytest.fixture
def env(tmp_path: Path) -> Env:
    """A fresh hermetic environment."""
    return Env(tmp_path)


def exec_set(*names: str, **extra: object) -> dict[str, object]:
    """An exec manifest with one tool per name."""
    return {
        "runner": "exec",
        "command": ["true"],
        "tools": [{"name": n, "description": f"{n} tool", "schema": {"type": "object"}} for n in names],
        **extra,
    }


# -- validate ---------------------------------------------------------------------------


def test_validate_valid_set_exits_0(env: Env) -> None:
    """A valid set prints its tools and exits 0."""
    path = env.home_set("acme", exec_set("fmt", "lint"))
    proc = env.run("validate", str(path.parent))
    assert (proc.returncode, proc.stdout, proc.stderr) == (
        0, "Tool set acme is valid: 2 tools (fmt, lint).\n", "",
    )


def test_validate_a_valid_dotnet_set_says_toolsetd_skips_it(env: Env) -> None:
    """A valid dotnet set is valid (exit 0), and the daemon skips it: "valid: 0 tools"
    alone read as if it were served. Its tools are its overlays, as the reference host
    declares them (it said 0 tools for any)."""
    path = env.home_set("net", {"runner": "dotnet", "assembly": "Net.dll", "tools": {}})
    proc = env.run("validate", str(path.parent))
    assert (proc.returncode, proc.stdout, proc.stderr) == (
        0,
        "Tool set net is valid: 0 tools.\n"
        "toolsetd skips it: the dotnet runner is not supported (no .NET runtime).\n",
        "",
    )
    env.home_set("net", {"runner": "dotnet", "assembly": "Net.dll", "tools": {"a": {}, "b": {}}})
    proc = env.run("validate", str(path.parent))
    assert proc.stdout.startswith("Tool set net is valid: 2 tools (a, b).\n"), proc.stdout


def test_validate_given_a_file_says_what_it_is(env: Env) -> None:
    """``toolsetctl validate .crystal/tools/acme/tools.json`` (the manifest, not its folder:
    an easy slip in a CI step) said "Tool set directory '.../tools.json' does not exist." of
    a file that exists. It names the folder to give; any other file is "not a directory"."""
    path = env.home_set("acme", exec_set("fmt"))
    proc = env.run("validate", str(path))
    assert proc.returncode == 2
    assert proc.stdout == (
        "Tool set tools.json is not valid:\n"
        f"- '{path}' is the manifest, not its set: validate takes the set's folder "
        f"(toolsetctl validate {path.parent}).\n"
    )
    other = path.parent / "notes.txt"
    other.write_text("x", encoding="utf-8")
    proc = env.run("validate", str(other))
    assert proc.returncode == 2
    assert f"- Tool set directory '{other}' is not a directory.\n" in proc.stdout
    assert "does not exist" not in proc.stdout


def test_validate_reports_parse_error_exits_2(env: Env) -> None:
    """A manifest failing a structural rule prints the parser's message and exits 2."""
    path = env.home_set("acme", {"runner": "perl"})
    proc = env.run("validate", str(path.parent))
    assert proc.returncode == 2
    assert proc.stdout == (
        "Tool set acme is not valid:\n- tools.json must set runner to exec or dotnet.\n"
    )


def test_validate_refuses_a_lone_surrogate_escape(env: Env) -> None:
    """A string holding a lone surrogate escape is invalid JSON to validate, as to the daemon."""
    path = env.home_set(
        "acme", '{"runner": "exec", "command": ["true"], "description": "x\\ud800", "schema": {}}'
    )
    proc = env.run("validate", str(path.parent))
    assert proc.returncode == 2
    assert proc.stdout == (
        "Tool set acme is not valid:\n- tools.json is not valid JSON: Unpaired surrogate \\ud800: "
        "line 1 column 58 (char 57)\n"
    )


def test_validate_reports_every_schema_problem(env: Env) -> None:
    """Each tool's invalid schema is reported, not only the first."""
    manifest = exec_set("a", "b")
    for tool in manifest["tools"]:  # type: ignore[attr-defined]
        tool["schema"] = {"type": 5}
    path = env.home_set("acme", manifest)
    proc = env.run("validate", str(path.parent))
    assert proc.returncode == 2
    problems = [line for line in proc.stdout.splitlines() if line.startswith("- ")]
    assert len(problems) == 2
    assert problems[0].startswith("- Tool 'a' has an invalid JSON Schema: ")
    assert problems[1].startswith("- Tool 'b' has an invalid JSON Schema: ")


def test_validate_prints_every_problem_not_only_the_parsers_first(env: Env) -> None:
    """Contract section 6: validate prints every problem. It printed the parser's first
    (the daemon's note, which stops there as the reference host does), so a CI job fixed
    one problem a run. Each member that failed is now left out and the file read again:
    the root's optional members, each tool (or its optional member), each overlay; what is
    left is checked as a valid set is (schemas, commands). A problem that only leaving
    tools out makes (no tool, no command left) is not the file's, and is not said."""
    path = env.home_set("multi", {
        "runner": "exec", "command": ["nope.sh"], "timeoutSeconds": 0, "catalogs": ["x"],
        "tools": [
            {"name": "a", "description": "d", "schema": {"type": "object"},
             "approval": "sometimes", "output": "html"},
            {"name": "bad name!", "description": "d", "schema": {"type": "object"}},
            {"name": "ok", "description": "d", "schema": {"type": "object", "minProperties": -1}},
            {"name": "a", "description": "again", "schema": {"type": "object"}},
        ],
    })
    proc = env.run("validate", str(path.parent))
    assert proc.returncode == 2
    problems = [line for line in proc.stdout.splitlines() if line.startswith("- ")]
    assert problems[:6] == [
        "- catalogs must be plan, work, or both.",
        "- timeoutSeconds must be a supported positive integer or unlimited.",
        "- Tool 'a' has invalid approval: approval must be inherit or always.",
        "- Tool 'a' has invalid output: output must be text or content.",
        "- Tool name 'bad name!' is reserved or invalid.",
        "- Duplicate tool name 'a'.",
    ]
    assert problems[6].startswith("- Tool 'ok' has an invalid JSON Schema: ")
    assert problems[7].startswith("- Command 'nope.sh' is neither a file in ")
    assert len(problems) == 8, problems
    # Every tool refused: the problems are theirs, not "exec tools array must not be empty".
    path = env.home_set("none", {"runner": "exec", "command": ["true"], "tools": [
        {"name": "read", "description": "d", "schema": {}}, {"description": "d"}]})
    proc = env.run("validate", str(path.parent))
    assert proc.stdout.splitlines()[1:] == [
        "- Tool name 'read' is reserved or invalid.", "- Each exec tool requires name."]
    # A dotnet set's overlays, each.
    path = env.home_set("dn", {"runner": "dotnet", "assembly": "a.dll", "tools": {
        "read": {}, "ok": {"approval": 1}, "fine": {}}})
    proc = env.run("validate", str(path.parent))
    assert proc.stdout.splitlines()[1:3] == [
        "- Overlay 'read' is reserved or invalid.",
        "- Overlay 'ok' has invalid approval: approval must be inherit or always.",
    ]


@pytest.mark.parametrize(
    ("name", "text", "said"),
    [
        (  # the only tool with a command left out: "no command" is not the file's
            "cmdtool",
            '{"runner":"exec","tools":[{"name":"bad name!","description":"d","schema":{},'
            '"command":["true"]},{"name":"ok","description":"d","schema":{}}]}',
            ["Tool name 'bad name!' is reserved or invalid."],
        ),
        (  # the root command left out: the tools are still checked, with a stand-in
            "badcmd",
            '{"runner":"exec","command":"run.sh","tools":[{"name":"a","description":"d",'
            '"schema":{},"approval":"x"},{"name":"b","description":"d","schema":{"type":5}}]}',
            ["command must be an array of strings.",
             "Tool 'a' has invalid approval: approval must be inherit or always.",
             "Tool 'b' has an invalid JSON Schema: 5 is not valid under any of the given "
             "schemas (at /type)"],
        ),
        (  # a key given twice keeps both values, as the daemon checks both
            "dupargv",
            '{"runner":"exec","command":["true"],"tools":[{"name":"a","description":"d",'
            '"schema":{},"approval":"sometimes"},{"name":"b","description":"d","schema":{},'
            '"argv":{"x":5,"x":"--x"}}]}',
            ["Tool 'a' has invalid approval: approval must be inherit or always.",
             "argv 'x' must be a flag string."],
        ),
        (
            "dndup",
            '{"runner":"dotnet","assembly":"a.dll","tools":{"a":{"approval":1},'
            '"b":{"approval":2},"b":{}}}',
            ["Overlay 'a' has invalid approval: approval must be inherit or always.",
             "Overlay 'b' has invalid approval: approval must be inherit or always."],
        ),
        (  # a shorthand set in a folder whose name is no tool name: said once
            "1bad",
            '{"runner":"exec","command":["true"],"description":"d","schema":{},"argv":5}',
            ["Tool set directory '1bad' is not a valid name.",
             "argv must be an object of flag strings.",
             "Directory '1bad' is not a valid tool name for exec shorthand."],
        ),
    ],
)
def test_validate_leaves_out_only_what_the_file_says(
    env: Env, name: str, text: str, said: list[str]
) -> None:
    """What leaving a member out makes is not said, what is left is still checked, and the
    file is read again as the daemon reads it (from the review of the change above)."""
    path = env.home_set(name, text)
    proc = env.run("validate", str(path.parent))
    assert proc.returncode == 2
    assert [line[2:] for line in proc.stdout.splitlines() if line.startswith("- ")] == said


def test_validate_reads_a_utf16_manifest_again_in_its_encoding(env: Env) -> None:
    """A UTF-16 manifest (with its byte order mark) is read again as UTF-16."""
    path = env.home_set("wide", "{}")
    text = json.dumps({"runner": "exec", "command": ["true"], "timeoutSeconds": 0,
                       "catalogs": ["x"], "tools": [{"name": "a", "description": "d",
                                                     "schema": {}}]})
    path.write_bytes(b"\xff\xfe" + text.encode("utf-16-le"))
    proc = env.run("validate", str(path.parent))
    assert proc.stdout.splitlines()[1:] == [
        "- catalogs must be plan, work, or both.",
        "- timeoutSeconds must be a supported positive integer or unlimited.",
    ]


def test_validate_reports_directory_name_and_parse_error(env: Env) -> None:
    """An invalid directory name is reported along with the manifest's own problem."""
    path = env.home_set(
        "9lives", {"runner": "exec", "command": ["true"], "description": "d", "schema": {}}
    )
    proc = env.run("validate", str(path.parent))
    assert proc.returncode == 2
    assert proc.stdout.splitlines() == [
        "Tool set 9lives is not valid:",
        "- Tool set directory '9lives' is not a valid name.",
        "- Directory '9lives' is not a valid tool name for exec shorthand.",
    ]
    path = env.home_set("my.set", {"runner": "exec", "tools": [{"name": "t"}]})
    proc = env.run("validate", str(path.parent))
    assert proc.stdout.splitlines()[1:] == ["- Tool 't' requires description."]


def test_validate_says_a_tool_whose_schema_no_double_holds_is_not_listed_to_mcp_hosts(
    env: Env,
) -> None:
    """A schema holding an integer beyond a double's range is valid (exit 0), and the
    daemon leaves that tool out of MCP's tools/list (a JavaScript host reads Infinity
    there): validate says so, with the JSON Pointer of the number."""
    manifest = exec_set("big", "small")
    manifest["tools"][0]["schema"] = {  # type: ignore[index]
        "type": "object", "properties": {"n": {"type": "integer", "minimum": -(10**400)}}}
    path = env.home_set("acme", manifest)
    proc = env.run("validate", str(path.parent))
    assert (proc.returncode, proc.stderr) == (0, "")
    lines = proc.stdout.splitlines()
    assert lines[0] == "Tool set acme is valid: 2 tools (big, small)."
    assert lines[1].startswith(
        "External tool 'big' is not listed to MCP hosts: its schema holds an integer beyond "
        "the range of a double (about ±1.8e308) at /properties/n/minimum")
    assert len(lines) == 2


def test_validate_says_a_tool_whose_header_marks_break_mcp_rules_is_listed_without_them(
    env: Env,
) -> None:
    """``x-mcp-header`` on a ``number`` breaks MCP's rules: the set is valid (exit 0), and
    validate says the tool is listed to MCP hosts without its marks."""
    manifest = exec_set("routed")
    manifest["tools"][0]["schema"] = {  # type: ignore[index]
        "type": "object", "properties": {"ratio": {"type": "number", "x-mcp-header": "Ratio"}}}
    path = env.home_set("acme", manifest)
    proc = env.run("validate", str(path.parent), "--format", "json")
    assert (proc.returncode, proc.stderr) == (0, "")
    assert json.loads(proc.stdout)["notes"] == [
        "External tool 'routed' is listed to MCP hosts without its x-mcp-header marks: the "
        "one on 'ratio' is on a type other than string, integer or boolean, which MCP's rules "
        "refuse (its 2026-07-28 clients drop such a tool), so no argument of it is mirrored "
        "into a header, nor checked in one."]


@pytest.mark.parametrize(
    ("schema", "valid"),
    [
        ({"$schema": "http://json-schema.org/draft-07/schema#",
          "dependencies": {"mode": {"properties": {"file": {"type": "string"}}}}}, True),
        ({"$schema": "http://json-schema.org/draft-04/schema#",
          "dependencies": {"mode": {"properties": {"file": {"type": "string"}}}}}, True),
        ({"$schema": "http://json-schema.org/draft-03/schema#",
          "extends": {"properties": {"file": {"type": "string"}}}}, True),
        ({"$schema": "http://json-schema.org/draft-03/schema#",
          "type": [{"properties": {"file": {"type": "string"}}}]}, True),
        # 2020-12 has no ``dependencies``: the daemon passes it by, and so does validate.
        ({"dependencies": {"mode": {"properties": {"file": {"type": "string"}}}}}, False),
    ],
)
def test_validate_reads_a_drafts_own_ways_to_add_properties(
    env: Env, schema: dict[str, object], valid: bool
) -> None:
    """A ``pathArguments`` name that a draft's own keyword adds to the schema (draft 4 to
    7's ``dependencies``, draft 3's ``extends`` or a schema in its ``type``) is one the
    model may send: validate called such a set, which the daemon loads and fences, not
    valid ("not among its schema's properties ... goes unfenced")."""
    declared = {"type": "object", "properties": {"mode": {"type": "string"}}, **schema}
    manifest = {"runner": "exec", "description": "d", "command": ["true"], "schema": declared,
                "pathArguments": ["file"]}
    path = env.home_set("paths", manifest)
    proc = env.run("validate", str(path.parent), "--format", "json")
    report = json.loads(proc.stdout)
    assert (proc.returncode == 0, report["valid"]) == (valid, valid), report
    if not valid:
        assert "pathArguments names 'file'" in report["problems"][0]


@pytest.mark.parametrize(
    ("schema", "problem", "note"),
    [
        ({"allOf": [{"$ref": "#/$defs/missing"}]},
         "Tool 'refs' can take no call: its schema's $ref '#/$defs/missing' at /allOf/0/$ref "
         "leads nowhere (the schema has nothing at that pointer), and every call's arguments "
         "pass through it.", None),
        ({"$ref": "#/$defs/a", "$defs": {"a": {"allOf": [{"$ref": "#"}]}}},
         "Tool 'refs' can take no call: its schema's $ref '#' at /$defs/a/allOf/0/$ref leads "
         "back to itself before checking anything, so no check of arguments ends.", None),
        ({"properties": {"a": {"$ref": "https://example.invalid/a.json"}}}, None,
         "Tool 'refs''s schema has a $ref 'https://example.invalid/a.json' at "
         "/properties/a/$ref that leads nowhere (it is neither in the schema nor a standard "
         "meta-schema, and toolsetd fetches nothing): a call whose arguments reach it is "
         "refused."),
        # An anyOf's or a oneOf's first member is checked whole on every call (the daemon
        # refused every call of these while validate said nothing, or only a note).
        ({"anyOf": [{"$ref": "#/$defs/missing"}, {}]},
         "Tool 'refs' can take no call: its schema's $ref '#/$defs/missing' at /anyOf/0/$ref "
         "leads nowhere (the schema has nothing at that pointer), and every call's arguments "
         "pass through it.", None),
        ({"oneOf": [{"$ref": "#"}]},
         "Tool 'refs' can take no call: its schema's $ref '#' at /oneOf/0/$ref leads "
         "back to itself before checking anything, so no check of arguments ends.", None),
        # A later member only when those before it fail: a note, as under a property.
        ({"anyOf": [{}, {"$ref": "#/$defs/missing"}]}, None,
         "Tool 'refs''s schema has a $ref '#/$defs/missing' at /anyOf/1/$ref that leads "
         "nowhere (the schema has nothing at that pointer): a call whose arguments reach it "
         "is refused."),
        # Fine: a tree's $ref to its root, under a property, and one draft 7 passes by.
        ({"properties": {"kids": {"items": {"$ref": "#"}}}}, None, None),
        ({"$schema": "http://json-schema.org/draft-07/schema#", "$ref": "#/definitions/a",
          "definitions": {"a": {}}, "properties": {"x": {"$ref": "#/nowhere"}}}, None, None),
        # An $id that is no URI: what it names is the daemon's to say, at a call.
        ({"$id": "http://[x/", "properties": {"x": {"$ref": "#/nowhere"}}}, None, None),
    ],
)
def test_validate_says_a_ref_that_leads_nowhere(
    env: Env, schema: dict[str, object], problem: str | None, note: str | None
) -> None:
    """A ``$ref`` that names nothing, or leads back to itself, passes the meta-schema, so
    the set loads and validate called it valid; every call that reaches it is refused
    ("the tool's input schema cannot be used", "cannot be checked to its end"). One every
    call reaches is a problem (the tool can take no call), any other a note."""
    manifest = {"runner": "exec", "description": "d", "command": ["true"],
                "schema": {"type": "object", **schema}}
    path = env.home_set("refs", manifest)
    report = json.loads(env.run("validate", str(path.parent), "--format", "json").stdout)
    assert report["problems"] == ([problem] if problem else []), report
    assert report["notes"] == ([note] if note else []), report


#: In a user and mount namespace of its own (nothing outside sees it): mount binfmt_misc,
#: register a format by extension and one by magic, each run by /bin/sh, run each command
#: file as the system does, validate each set, and have a daemon run the first.
_BINFMT_SCRIPT = """
set -e
mount -t binfmt_misc binfmt_misc /proc/sys/fs/binfmt_misc
echo ':tsdx:E::tsdx::/bin/sh:' > /proc/sys/fs/binfmt_misc/register
echo ':tsdm:M::TSDM::/bin/sh:' > /proc/sys/fs/binfmt_misc/register
"$SETS/ext/run.tsdx"
"$SETS/magic/run"
for s in ext magic plain; do
  "$PY" -m toolsetd.client validate "$SETS/$s" --format json --home "$HOME_DIR" \
    --socket "$SOCK" > "$SOCKDIR/$s.json" || true
done
"$PY" -m toolsetd.daemon --socket "$SOCK" --home "$HOME_DIR" --config "$CONFIG" --no-watch \
  --no-cache > "$SOCKDIR/log" 2>&1 &
daemon=$!
for i in $(seq 100); do [ -S "$SOCK" ] && break; sleep 0.1; done
"$PY" -m toolsetd.client invoke ext --socket "$SOCK" --home "$HOME_DIR" --headless || true
kill "$daemon"
wait "$daemon" || true
"""


def test_validate_takes_a_command_file_the_machine_runs_through_binfmt_misc(env: Env) -> None:
    """A command file with neither a #! line nor an ELF header that a binfmt_misc format
    of the machine matches (a .jar, an MZ program) runs, and the daemon runs it: validate
    called it unrunnable ("does not start with a #! line"). One no format matches still
    is. Run in a user namespace's own binfmt_misc (Linux 6.7 and later)."""
    unshare = shutil.which("unshare")
    probe = unshare and subprocess.run(
        [unshare, "-Urm", "sh", "-c", "mount -t binfmt_misc b /proc/sys/fs/binfmt_misc"],
        capture_output=True, check=False, timeout=30,
    )
    if not probe or probe.returncode != 0:
        pytest.skip("no binfmt_misc of a user namespace's own here")
    sets = env.home / "tools"
    runs = {"runner": "exec", "description": "d", "schema": {"type": "object"}, "approval": "always"}
    for name, command, body in (
        ("ext", "run.tsdx", "echo ran-ext\n"),
        ("magic", "run", "TSDM=1; echo ran-magic\n"),
        ("plain", "run", "echo ran-plain\n"),
    ):
        folder = env.home_set(name, {**runs, "command": [command]}).parent
        (folder / command).write_text(body)
        (folder / command).chmod(0o755)
    config = env.home / "empty.toml"
    config.write_text("")
    with tempfile.TemporaryDirectory(dir="/tmp") as sockdir:
        environ = {
            **{k: v for k, v in os.environ.items() if k not in ("TOOLSETD_SOCKET", "CRYSTAL_HOME")},
            "PY": sys.executable, "SETS": str(sets), "HOME_DIR": str(env.home),
            "SOCK": f"{sockdir}/d.sock", "SOCKDIR": sockdir, "CONFIG": str(config),
        }
        proc = subprocess.run(
            [unshare, "-Urm", "sh", "-c", _BINFMT_SCRIPT],
            capture_output=True, text=True, timeout=60, check=False, env=environ,
        )
        log = Path(sockdir, "log").read_text() if Path(sockdir, "log").exists() else ""
        reports = {
            name: json.loads(Path(sockdir, f"{name}.json").read_text())
            for name in ("ext", "magic", "plain")
        }
    lines = proc.stdout.splitlines()
    assert lines[:2] == ["ran-ext", "ran-magic"], (proc.stdout, proc.stderr)
    assert {name: r["valid"] for name, r in reports.items()} == {
        "ext": True, "magic": True, "plain": False}, reports
    assert "does not start with a #! line" in reports["plain"]["problems"][0]
    assert "ran-ext" in lines[2:], (proc.stdout, proc.stderr, log)


def test_validate_json_format(env: Env) -> None:
    """``--format json`` prints the report object."""
    path = env.home_set("acme", exec_set("fmt"))
    proc = env.run("validate", str(path.parent), "--format", "json")
    assert proc.returncode == 0
    report = json.loads(proc.stdout)
    assert report["valid"] is True
    assert report["tools"] == ["fmt"]
    assert report["problems"] == []


# -- list and show without a daemon -----------------------------------------------------


def test_list_offline_text(env: Env) -> None:
    """Without a daemon, list says so on stderr and prints the inventory from disk."""
    env.home_set("acme", exec_set("fmt"))
    env.project_set("acme", exec_set("p1", approval="always", catalogs=["work"]))
    env.home_set("broken", "{")
    proc = env.run("list", "--format", "text")
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == NOT_RUNNING.format(env.socket)
    lines = proc.stdout.splitlines()
    assert lines[0].split() == [
        "Directory", "Source", "Enabled", "Effective", "Path", "Runner", "Catalogs", "Approval", "Tools",
    ]
    assert lines[1].split()[:8] == [
        "acme", "Home", "Yes", "No", str(env.home / "tools/acme/tools.json"), "exec", "Plan+Work", "inherit",
    ]
    assert lines[1].endswith("  fmt")
    assert lines[2].split()[:8] == [
        "acme", "Project", "Yes", "Yes", str(env.workspace / ".crystal/tools/acme/tools.json"),
        "exec", "Work", "always",
    ]
    assert lines[2].endswith("  p1 (always)")
    assert lines[3].startswith("broken     Home     -        Yes")
    assert "tools.json is not valid JSON" in lines[3]
    assert any(line.startswith("- ") and "broken" in line for line in lines[4:])


@pytest.mark.parametrize("columns", ["\u00b2", "\u0664\u0660", "9" * 5000, "abc", "0", " 40"])
def test_a_columns_that_is_no_width_is_ignored(env: Env, columns: str) -> None:
    """``COLUMNS=\u00b2`` (``str.isdigit()`` says yes, ``int()`` refuses it) or a number of
    more digits than ``int()`` reads: every command (``status`` too) ended in a traceback
    and Python's exit 1, which means "the tool ran and failed". A ``COLUMNS`` that is not a
    positive number in ASCII digits is ignored, as ``abc`` was: no limit into a pipe."""
    env.home_set("acme", exec_set("fmt"))
    proc = env.run("list", COLUMNS=columns)
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr
    assert proc.stdout.splitlines()[2].split()[:2] == ["acme", "Home"]
    assert env.run("status", COLUMNS=columns).returncode == 5


def test_list_offline_says_why_when_something_is_there(env: Env) -> None:
    """A socket path where something is, but toolsetd cannot be reached (here a datagram
    socket; the same for a socket the user may not open, or a full listen backlog): list
    said "toolsetd is not running at ..." and showed the files. It shows the files, but
    says what happened instead of claiming nothing runs."""
    env.home_set("acme", exec_set("fmt"))
    squatter = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    try:
        squatter.bind(str(env.socket))
        proc = env.run("list")
    finally:
        squatter.close()
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == (
        f"Cannot connect to toolsetd at {env.socket}: Protocol wrong type for socket. "
        "Showing the tool sets on disk.\n"
    )
    assert "acme" in proc.stdout


def test_list_offline_text_rows_for_manifests_that_cannot_be_read(env: Env) -> None:
    """A tools.json that is a FIFO or a link leading nowhere is a candidate, as in the
    daemon's list (and the reference host's ``File.Exists``): a row with the error, and a
    project one makes the home copy not effective."""
    env.home_set("acme", exec_set("fmt"))
    (env.workspace / ".crystal" / "tools" / "acme").mkdir(parents=True)
    (env.workspace / ".crystal" / "tools" / "acme" / "tools.json").symlink_to("gone.json")
    (env.home / "tools" / "fifo").mkdir()
    os.mkfifo(env.home / "tools" / "fifo" / "tools.json")
    proc = env.run("list", "--format", "text")
    assert proc.returncode == 0, proc.stderr
    rows = [line.split(maxsplit=4)[:4] for line in proc.stdout.splitlines()[1:4]]
    assert rows == [
        ["acme", "Home", "Yes", "No"], ["acme", "Project", "-", "Yes"], ["fifo", "Home", "-", "Yes"],
    ], proc.stdout
    assert proc.stdout.splitlines()[2].endswith("  tools.json could not be read.")
    assert proc.stdout.splitlines()[3].endswith("  tools.json could not be read.")


def test_list_offline_shows_a_name_that_is_not_utf8_as_the_daemon_does(env: Env) -> None:
    """A folder name whose bytes are not UTF-8 is shown with U+FFFD, as in the daemon's
    answer (and as .NET decodes file names), in the JSON and in the table: not as a lone
    surrogate escape (``caf\\udce9``) no strict JSON reader takes."""
    folder = os.fsencode(env.home / "tools") + b"/caf\xe9"
    os.makedirs(folder)
    with open(folder + b"/tools.json", "w") as f:
        f.write(json.dumps(exec_set("fmt")))
    proc = env.run("list", "--format", "json")
    assert proc.returncode == 0, proc.stderr
    assert "\\udce9" not in proc.stdout
    result = json.loads(proc.stdout)
    assert [s["directory"] for s in result["sets"]] == ["caf\ufffd"]
    assert result["sets"][0]["path"] == str(env.home / "tools" / "caf\ufffd")
    assert result["notes"][0]["message"] == (
        "External tool set 'caf\ufffd' was skipped: directory name is invalid."
    )
    proc = env.run("list", "--format", "text")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[1].split()[:2] == ["caf\ufffd", "Home"], proc.stdout


def test_list_offline_discovery_off_line(env: Env) -> None:
    """With ``externalTools`` false the list ends with the discovery-off line."""
    (env.home / "config.json").write_text('{"externalTools": false}')
    env.home_set("acme", exec_set("fmt"))
    proc = env.run("list", "--format", "text")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[-1] == DISCOVERY_OFF
    assert proc.stdout.splitlines()[1].startswith("acme")


def test_list_offline_json(env: Env) -> None:
    """``--format json`` prints a list-shaped result built from disk."""
    env.home_set("acme", exec_set("fmt"))
    proc = env.run("list", "--format", "json")
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    assert [t["name"] for t in result["tools"]] == ["fmt"]
    assert [s["directory"] for s in result["sets"]] == ["acme"]


@pytest.mark.parametrize("command", [("list",), ("show", "alpha"), ("--format", "json", "list")])
@pytest.mark.parametrize("kind", ["missing", "file"])
def test_list_and_show_offline_refuse_a_workspace_that_is_not_a_directory(
    env: Env, command: tuple[str, ...], kind: str
) -> None:
    """``list --workspace /mistyped`` exited 2 with a daemon (InvalidWorkspace) and 0
    without one, showing the home sets as if the workspace had none: a CI check passed or
    failed by whether a daemon ran. Without one it is now the daemon's refusal, exit 2."""
    env.home_set("alpha", exec_set("alpha"))
    shutil.rmtree(env.workspace)
    if kind == "file":
        env.workspace.write_text("not a folder", encoding="utf-8")
    r = env.run(*command)
    assert r.returncode == 2, r.stdout + r.stderr
    message = (
        f"Invalid workspace: {str(env.workspace)!r} is not a directory; 'workspace' must be "
        "an absolute path to an existing directory."
    )
    if "json" in command:
        assert json.loads(r.stdout) == {
            "error": {"code": -32006, "message": message, "data": {"field": "workspace"}}
        }
    else:
        assert r.stdout == ""
        assert r.stderr == message + "\n"


@pytest.mark.parametrize("command", [("disable", "alpha"), ("enable", "alpha"), ("validate", "alpha")])
@pytest.mark.parametrize("kind", ["missing", "file"])
def test_edits_and_validate_by_name_refuse_a_workspace_that_is_not_a_directory(
    env: Env, command: tuple[str, ...], kind: str
) -> None:
    """``--workspace "$CI_PROJECT_DIR/typo" disable alpha`` found no project copy in the
    mistyped folder and disabled the home copy instead (exit 0), a set the job never meant;
    ``validate alpha`` checked the home copy as if the project had none. As for ``list``
    and ``show``, a workspace that is not a directory is the daemon's refusal, exit 2, and
    nothing is written."""
    home_file = env.home_set("alpha", exec_set("alpha", enabled=(command[0] == "disable")))
    before = home_file.read_bytes()
    shutil.rmtree(env.workspace)
    if kind == "file":
        env.workspace.write_text("not a folder", encoding="utf-8")
    r = env.run(*command)
    assert r.returncode == 2, r.stdout + r.stderr
    assert r.stderr == (
        f"Invalid workspace: {str(env.workspace)!r} is not a directory; 'workspace' must be "
        "an absolute path to an existing directory.\n"
    )
    assert home_file.read_bytes() == before
    r = env.run(*command, "--format", "json")
    assert r.returncode == 2
    assert json.loads(r.stdout)["error"]["code"] == -32006


def test_validate_a_name_found_nowhere_names_every_place_looked_in(env: Env) -> None:
    """``validate NAME`` looks for a folder ``NAME`` here, then the set ``NAME`` in the
    workspace and the home; found nowhere, it said only that ``./NAME`` does not exist, so a
    CI author whose set sits under another home or workspace saw no hint of either."""
    r = env.run("validate", "ghost")
    assert r.returncode == 2
    home_place = env.home / "tools" / "ghost"
    project_place = env.workspace / ".crystal" / "tools" / "ghost"
    assert f"- No tool set 'ghost' in the workspace ({project_place}) or the home ({home_place})" in r.stdout


def test_show_offline_set_and_tool(env: Env) -> None:
    """show prints a set's fields by directory, and a tool's fields by tool name."""
    env.home_set("acme", exec_set("fmt"))
    proc = env.run("show", "acme", "--source", "home", "--format", "text")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[0] == "Directory  acme"
    assert "Tools      fmt" in proc.stdout.splitlines()
    proc = env.run("show", "fmt", "--format", "text")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[0].split() == ["Name", "fmt"]


def test_show_offline_broken_set_has_error_line(env: Env) -> None:
    """A broken set's show output ends with its ``Error`` line."""
    env.home_set("acme", '{"runner": 1}')
    proc = env.run("show", "acme", "--format", "text")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[-1] == "Error      tools.json must set runner to exec or dotnet."


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("show", "ghost"), "Tool set 'ghost' was not found.\n"),
        (("show", "ghost", "--source", "home"), "Tool set 'ghost' was not found in Home.\n"),
        (("show", "ghost", "--source", "project"), "Tool set 'ghost' was not found in Project.\n"),
        (("show", "my tools"), "Directory name is invalid.\n"),
        (("show", ""), "Directory is required.\n"),
        (("show", "  "), "Directory is required.\n"),
    ],
)
def test_show_offline_not_found_exits_2(env: Env, args: tuple[str, ...], message: str) -> None:
    """show of a missing set prints the reference message and exits 2."""
    proc = env.run(*args)
    assert proc.returncode == 2
    assert proc.stderr == NOT_RUNNING.format(env.socket) + message


# -- enable and disable without a daemon -------------------------------------------------


def test_disable_then_enable_project_set(env: Env) -> None:
    """disable writes ``enabled: false`` in the project copy; enable then appends nothing new."""
    path = env.project_set("acme", exec_set("fmt"))
    env.home_set("acme", exec_set("other"))
    written = path.read_text()
    proc = env.run("disable", "acme", "--format", "text")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[-1] == "Tool set acme disabled."
    assert f"Edited {path} in the workspace" in proc.stderr, proc.stderr
    assert "Source     Project" in proc.stdout.splitlines()
    assert "Enabled    No" in proc.stdout.splitlines()
    document = json.loads(path.read_text())
    assert list(document)[-1] == "enabled" and document["enabled"] is False
    assert path.read_text() == written[:-1] + ', "enabled": false}'  # the rest as it was
    proc = env.run("enable", "acme", "--format", "text")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[-1] == "Tool set acme enabled."
    assert path.read_text() == written[:-1] + ', "enabled": true}'


def test_disable_refuses_to_grow_a_manifest_past_the_limit_the_daemon_reads(env: Env) -> None:
    """A manifest of exactly 1 MiB that loads: ``disable`` (``true`` to ``false``, a byte
    more) exited 0, and the set was then skipped as larger than 1 MiB, by the daemon and
    by the ``enable`` that should have undone it. It is refused, exit 2, nothing written."""
    head = '{"runner":"exec","command":["true"],"description":"d","schema":{},"x":"'
    tail = '","enabled":true}'
    path = env.home_set("big", head + "x" * ((1 << 20) - len(head) - len(tail)) + tail)
    before = path.read_bytes()
    assert len(before) == 1 << 20
    proc = env.run("disable", "big")
    assert proc.returncode == 2, proc.stderr
    assert "tools.json would be 1,048,577 bytes with enabled written, past the 1,048,576" in (
        proc.stderr
    )
    assert path.read_bytes() == before
    assert env.run("show", "big").returncode == 0


def test_an_import_that_fails_for_want_of_memory_is_said_as_such() -> None:
    """Under a limit, the loader's mmap of an extension module can fail ("failed to map
    segment from shared object"): that was said as a usage error, "Reading tool sets from
    disk is unavailable" (exit 2), where any other want of memory is exit 9."""
    from toolsetd.client.cli import _out_of_memory_loading

    mapped = "/usr/lib/python3.11/lib-dynload/_struct.so: failed to map segment from shared object"
    assert _out_of_memory_loading(ImportError(mapped))
    assert _out_of_memory_loading(ImportError("libx.so: cannot open: Cannot allocate memory"))
    assert not _out_of_memory_loading(ImportError("No module named 'toolsetd.daemon'"))


def test_enable_already_enabled_message(env: Env) -> None:
    """Enabling an enabled set says so and leaves the file byte-identical."""
    path = env.home_set("acme", '{"runner":"exec","command":["true"],"description":"d","schema":{}}')
    before = path.read_bytes()
    proc = env.run("enable", "acme", "--format", "text")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[-1] == "Tool set acme is already enabled."
    assert path.read_bytes() == before
    assert f"Left {path} as it was, in the home" in proc.stderr, proc.stderr
    assert "Edited" not in proc.stderr


def test_source_is_trimmed_and_any_case_as_the_reference_reads_it(env: Env) -> None:
    """``--source`` is read as the reference host's console reads it (trimmed, any case),
    and a bad value gets its message."""
    env.home_set("acme", exec_set("fmt", enabled=False))
    proc = env.run("enable", "acme", "--source", " HOME ", "--format", "text")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[-1] == "Tool set acme enabled."
    proc = env.run("show", "acme", "--source", "Home", "--format", "text")
    assert proc.returncode == 0, proc.stderr
    for bad in ("both", "home\x1c"):  # .NET's Trim() keeps U+001C..U+001F; strip() did not
        proc = env.run("disable", "acme", "--source", bad)
        assert proc.returncode == 2
        assert "Source must be home or project." in proc.stderr, proc.stderr


def test_directory_is_trimmed_as_the_reference_trims_it(env: Env) -> None:
    """The directory name is trimmed as .NET's ``Trim()`` trims, as ``--source`` is: it
    keeps U+001C..U+001F, which ``str.strip()`` took too, so ``"acme\\x1c"`` enabled,
    disabled and showed the set ``acme`` where the reference host finds no valid name."""
    path = env.home_set("acme", exec_set("fmt", enabled=False))
    before = path.read_bytes()
    for args in (("enable", "acme\x1c"), ("disable", "\x1facme"), ("show", "acme\x1c")):
        proc = env.run(*args, "--format", "text")
        assert proc.returncode == 2, (args, proc.stdout)
        assert proc.stderr.endswith("Directory name is invalid.\n"), (args, proc.stderr)
    assert path.read_bytes() == before
    for args in (("enable", "\x1c"), ("show", "\x1d")):  # not blank: no valid name either
        proc = env.run(*args)
        assert proc.returncode == 2, (args, proc.stdout)
        assert proc.stderr.endswith("Directory name is invalid.\n"), (args, proc.stderr)
    proc = env.run("enable", "\u3000acme\n", "--format", "text")  # .NET's white space
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[-1] == "Tool set acme enabled."
    proc = env.run("show", "\u2028")
    assert (proc.returncode, proc.stderr.splitlines()[-1]) == (2, "Directory is required.")


def test_enable_broken_manifest_left_alone_exits_2(env: Env) -> None:
    """A manifest that does not parse is reported, exit 2, and not touched."""
    path = env.home_set("acme", '{"runner": "exec",')
    before = path.read_bytes()
    proc = env.run("disable", "acme")
    assert proc.returncode == 2
    assert proc.stderr.startswith("tools.json is not valid JSON: ")
    assert path.read_bytes() == before


def test_enable_with_discovery_off_prints_the_line(env: Env) -> None:
    """Enabling while ``externalTools`` is false adds the discovery-off line."""
    (env.home / "config.json").write_text('{"externalTools": false}')
    env.home_set("acme", exec_set("fmt", enabled=False))
    proc = env.run("enable", "acme", "--format", "text")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[-2:] == ["Tool set acme enabled.", DISCOVERY_OFF]


@pytest.mark.parametrize(
    ("args", "state"),
    [
        (("disable", "acme"), "disabled"),  # the project copy, which wins
        (("enable", "acme", "--source", "project"), "loaded"),
        (("disable", "acme", "--source", "home"), "hidden"),  # its project copy hides it
        (("enable", "solo"), "loaded"),
        (("disable", "net"), "disabled"),
        (("enable", "net"), "refused"),  # valid, and skipped: a dotnet set
        (("enable", "twin"), "refused"),  # its one tool's name is acme's: omitted
    ],
)
def test_enable_json_entry_is_the_set_as_show_prints_it(
    env: Env, args: tuple[str, ...], state: str
) -> None:
    """``--format json``'s ``entry`` is the set as ``show --format json`` prints it (its
    ``sets[]`` entry: the folder as ``path``, ``state``, the registered ``tools``,
    ``notes``, ``catalogs`` as an array, ``declaredTools``), not the inventory row
    (``tools.json`` as ``path``, ``Plan+Work``, ``name (always)`` labels) it was, which a
    script reading both the same way broke on; a set the edit leaves refused or hidden
    too."""
    env.project_set("acme", exec_set("fmt", approval="always"))
    env.home_set("acme", exec_set("other"))
    env.home_set("solo", exec_set("lint", enabled=False))
    env.home_set("net", {"runner": "dotnet", "assembly": "Net.dll", "tools": {}})
    env.home_set("twin", exec_set("fmt", enabled=False))
    proc = env.run(*args, "--format", "json")
    assert proc.returncode == 0, proc.stderr
    done = json.loads(proc.stdout)
    shown = env.run("show", done["directory"], "--source", done["source"], "--format", "json")
    assert shown.returncode == 0, shown.stderr
    assert done["entry"] == json.loads(shown.stdout)
    assert done["entry"]["state"] == state
    assert done["entry"]["path"] == str(Path(done["path"]).parent)


def test_enable_json_entry_with_discovery_off_is_what_show_prints(env: Env) -> None:
    """With discovery off no ``list`` has a ``sets[]`` entry: ``entry`` is then what
    ``show --format json`` prints of the set, its inventory row."""
    (env.home / "config.json").write_text('{"externalTools": false}')
    env.home_set("acme", exec_set("fmt", enabled=False))
    proc = env.run("enable", "acme", "--format", "json")
    assert proc.returncode == 0, proc.stderr
    shown = env.run("show", "acme", "--source", "home", "--format", "json")
    assert json.loads(proc.stdout)["entry"] == json.loads(shown.stdout)
    assert json.loads(shown.stdout)["effective"] is True


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("enable", "my tools"), "Directory name is invalid.\n"),
        (("enable", ""), "Directory is required.\n"),
        (("disable", " "), "Directory is required.\n"),
        (("disable", "ghost"), "Tool set 'ghost' was not found.\n"),
        (("enable", "ghost", "--source", "project"), "Tool set 'ghost' was not found in Project.\n"),
    ],
)
def test_enable_errors_exit_2(env: Env, args: tuple[str, ...], message: str) -> None:
    """Bad names and missing sets give the reference messages on stderr and exit 2."""
    proc = env.run(*args)
    assert (proc.returncode, proc.stderr) == (2, message)


def test_enable_and_disable_mean_the_copy_list_and_show_mean(env: Env) -> None:
    """A project ``tools.json`` that cannot be read (a link that leads nowhere, a FIFO) is
    a candidate: ``list`` and ``show`` take it for the project copy, which hides the home
    set. ``disable`` without ``--source`` edited the home copy instead, and said "Tool set
    acme disabled." of a set that did not count; with ``--source project`` it said the set
    was not found. The copy that counts is the one edited: its read error, nothing written.
    """
    home = env.home_set("acme", exec_set("fmt"))
    before = home.read_bytes()
    project = env.workspace / ".crystal" / "tools" / "acme"
    project.mkdir(parents=True)
    (project / "tools.json").symlink_to("gone.json")
    shown = env.run("show", "acme", "--format", "json")
    assert json.loads(shown.stdout)["source"] == "project", shown.stdout
    for args in (("disable", "acme"), ("disable", "acme", "--source", "project")):
        proc = env.run(*args)
        assert (proc.returncode, proc.stderr) == (2, "tools.json could not be read.\n")
    assert home.read_bytes() == before
    assert not (project / "tools.json").exists()  # the link still leads nowhere


# -- commands that need the daemon -------------------------------------------------------


@pytest.mark.parametrize(
    "args",
    [("status",), ("reload",), ("classify", "fmt"), ("invoke", "fmt", "--args", "{}")],
)
def test_daemon_commands_exit_5_naming_the_socket(env: Env, args: tuple[str, ...]) -> None:
    """A command that needs the daemon exits 5 with a message naming the socket path."""
    proc = env.run(*args)
    assert proc.returncode == 5
    assert str(env.socket) in proc.stderr
    assert "Traceback" not in proc.stderr


def test_global_options_before_subcommand(env: Env) -> None:
    """Global options work before the subcommand too."""
    proc = subprocess.run(
        [sys.executable, "-m", "toolsetd.client", "--socket", str(env.socket), "status"],
        capture_output=True, text=True, timeout=60, check=False,
    )
    assert proc.returncode == 5
    assert str(env.socket) in proc.stderr


def test_usage_error_exits_2(env: Env) -> None:
    """An unknown flag is a usage error: exit 2."""
    proc = env.run("list", "--bogus")
    assert proc.returncode == 2


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (("--sock", "/nowhere.sock", "mcp", "--no-autostart"), "invalid choice: '/nowhere.sock'"),
        (("--work", "/tmp", "mcp"), "invalid choice: '/tmp'"),
        (("--form", "json", "invoke"), "invalid choice: 'json'"),
        (("list", "--cat", "plan"), "unrecognized arguments: --cat"),
        (("validate", "x", "--res", "y"), "unrecognized arguments: --res"),
    ],
)
def test_an_abbreviated_option_is_a_usage_error(env: Env, args: tuple[str, ...], said: str) -> None:
    """argparse took ``--sock`` for ``--socket`` and ``--form`` for ``--format``, but what
    reads the command line before it (which sends ``mcp`` to its pump; the format of a
    usage error) knows full spellings only: ``toolsetctl --sock S mcp`` ended in
    ``unexpected error: KeyError: 'mcp'`` (exit 9). Options are spelled in full, as the
    ``mcp`` pump always required: anything else is a usage error, exit 2."""
    proc = env.run(*args)
    assert proc.returncode == 2, proc.stderr
    assert said in proc.stderr
    assert "unexpected error" not in proc.stderr


@pytest.mark.parametrize("option", ["--socket", "--workspace", "--home"])
@pytest.mark.parametrize("command", ["status", "list", "mcp"])
def test_an_empty_path_option_is_a_usage_error(env: Env, option: str, command: str) -> None:
    """``--socket ''`` (an unset variable in a CI script) meant the default socket, and an
    empty --workspace the current folder, silently; the daemon refuses its own empty
    --socket. Each is a usage error naming the option (exit 2)."""
    proc = env.run(f"{option}=", command, stdin="")
    assert proc.returncode == 2, proc.stderr
    assert option in proc.stderr
    assert "must be a path, not empty" in proc.stderr


def test_a_manifest_that_is_not_a_regular_file_is_unreadable_never_waited_on(env: Env) -> None:
    """A FIFO or a link to a device as tools.json: reported as the daemon reports it, no hang."""
    fifo_dir = env.home / "tools" / "fifo"
    fifo_dir.mkdir(parents=True)
    os.mkfifo(fifo_dir / "tools.json")  # nobody ever writes: a blocking read would hang
    zero_dir = env.home / "tools" / "zero"
    zero_dir.mkdir()
    (zero_dir / "tools.json").symlink_to("/dev/zero")  # endless: an unbounded read would eat memory
    for directory in (fifo_dir, zero_dir):
        proc = env.run("validate", str(directory))
        assert proc.returncode == 2, proc.stderr
        assert "tools.json could not be read." in proc.stdout + proc.stderr
    proc = env.run("list", "--format", "json")
    assert proc.returncode == 0, proc.stderr
    rows = {row["directory"]: row for row in json.loads(proc.stdout)["sets"]}
    assert set(rows) == {"fifo", "zero"}, rows
    assert all(row["error"] == "tools.json could not be read." for row in rows.values()), rows
    proc = env.run("enable", "fifo")  # not a file to edit: refused at once, nothing opened
    assert (proc.returncode, proc.stderr) == (2, "tools.json could not be read.\n")


def test_list_offline_skips_a_link_into_a_folder_it_may_not_search(
    as_nobody: tuple[str, ...],
) -> None:
    """Run as nobody, the text inventory leaves out a set linked from an unsearchable folder."""
    base = Path(tempfile.mkdtemp(prefix="tsd-eacces-"))
    try:
        base.chmod(0o755)
        env = Env(base)
        env.home_set("good", exec_set("fmt"))
        private = base / "private"
        Env._write(private / "x" / "tools.json", exec_set("x"))
        private.chmod(0o700)  # root's: nobody gets EACCES through the link
        (env.home / "tools" / "zlink").symlink_to(private / "x")
        proc = subprocess.run(
            [*as_nobody, sys.executable, "-m", "toolsetd.client", "list", "--format", "text",
             "--home", str(env.home), "--workspace", str(env.workspace),
             "--socket", str(env.socket)],
            capture_output=True, text=True, timeout=60, check=False,
        )
        assert proc.returncode == 0, proc.stderr
        rows = proc.stdout.splitlines()[1:]
        assert [row.split()[0] for row in rows] == ["good"]
    finally:
        shutil.rmtree(base, ignore_errors=True)


@pytest.mark.parametrize("private", ["socket", "folder"])
def test_a_socket_the_user_may_not_open_names_its_owner_and_the_fix(
    as_nobody: tuple[str, ...], private: str
) -> None:
    """A CI job running as another user than the daemon's: "Permission denied connecting to
    toolsetd at <socket>." named neither whose socket (or folder) it is nor what to do. The
    message now says who owns what refused the user, with its mode, and the way out."""
    base = Path(tempfile.mkdtemp(prefix="tsd-eacces-"))
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        base.chmod(0o755)
        folder = base / "run"
        folder.mkdir(mode=0o755)
        path = folder / "d.sock"
        server.bind(str(path))
        server.listen(1)
        if private == "socket":
            path.chmod(0o600)
        else:
            folder.chmod(0o700)
        proc = subprocess.run(
            [*as_nobody, sys.executable, "-m", "toolsetd.client", "--socket", str(path),
             "--workspace", str(base), "status"],
            capture_output=True, text=True, timeout=60, check=False,
        )
        assert proc.returncode == 5, proc.stderr
        refused = path if private == "socket" else folder
        mode = "0600" if private == "socket" else "0700"
        assert proc.stderr.startswith(f"Permission denied connecting to toolsetd at {path}")
        assert f"{refused} belongs to root:" in proc.stderr, proc.stderr
        assert f"mode {mode}" in proc.stderr
        assert "--allow-group" in proc.stderr
    finally:
        server.close()
        shutil.rmtree(base, ignore_errors=True)


def test_folders_the_user_may_not_search_are_named_not_an_unexpected_error(
    as_nobody: tuple[str, ...],
) -> None:
    """A CI container run with ``--user`` and ``HOME=/root``, or a workspace, home or set
    folder under a folder the job's user may not search: pathlib's ``is_dir`` raises
    PermissionError there, and toolsetctl ended with "unexpected error: PermissionError"
    (exit 9, an internal error). Each is now a usage error (exit 2) naming the path and the
    reason."""
    base = Path(tempfile.mkdtemp(prefix="tsd-eacces-"))
    try:
        base.chmod(0o755)
        private = base / "private"
        (private / "ws").mkdir(parents=True)
        Env._write(private / "home" / "tools" / "x" / "tools.json", exec_set("x"))
        private.chmod(0o700)  # root's: nobody may not look inside
        ws, home = private / "ws", private / "home"
        runs = {
            "list in a workspace": ("--workspace", str(ws), "list"),
            "show in a workspace": ("--workspace", str(ws), "show", "x"),
            "enable with --home": ("--workspace", str(base), "--home", str(home), "enable", "x"),
            "enable in the default home": ("--workspace", str(base), "enable", "x"),
            "validate by name": ("--workspace", str(base), "--home", str(home), "validate", "x"),
            "validate a folder": ("--workspace", str(base), "validate", str(home / "tools" / "x")),
        }
        environ = {k: v for k, v in os.environ.items() if k != "CRYSTAL_HOME"}
        environ["HOME"] = str(private)  # the default home, private/.crystal, out of reach
        for what, args in runs.items():
            proc = subprocess.run(
                [*as_nobody, sys.executable, "-m", "toolsetd.client",
                 "--socket", str(base / "none.sock"), *args],
                capture_output=True, text=True, timeout=60, check=False, cwd=base, env=environ,
            )
            output = proc.stdout + proc.stderr
            assert proc.returncode == 2, (what, output)
            assert "unexpected error" not in output, (what, output)
            assert "Permission denied" in output, (what, output)
            assert str(private) in output, (what, output)
    finally:
        private.chmod(0o755)
        shutil.rmtree(base, ignore_errors=True)


def test_a_non_blocking_stdout_gets_the_whole_output(env: Env) -> None:
    """A CI runner whose stdout descriptor is non-blocking (a Node parent's, inherited):
    once the pipe was full, Python's writer kept what fitted and dropped the rest without
    an error, and toolsetctl exited 0 with its output cut at 64 KiB. Now it waits for the
    reader as on a blocking pipe. The reader here reads only once the pipe is full (or the
    writer has exited), so no timing decides it."""
    env.home_set("big", {
        "runner": "exec", "command": ["true"],
        "tools": [
            {"name": f"tool_{n}", "description": "d" * 3000, "schema": {"type": "object"}}
            for n in range(60)
        ],
    })
    read_end, write_end = os.pipe()
    os.set_blocking(write_end, False)
    size = fcntl.fcntl(write_end, fcntl.F_GETPIPE_SZ)
    env_vars = {k: v for k, v in os.environ.items() if k not in ("TOOLSETD_SOCKET", "CRYSTAL_HOME")}
    proc = subprocess.Popen(
        [sys.executable, "-m", "toolsetd.client", "--format", "json", "list",
         "--home", str(env.home), "--workspace", str(env.workspace), "--socket", str(env.socket)],
        stdout=write_end, stderr=subprocess.DEVNULL, env=env_vars,
    )
    os.close(write_end)
    data = b""
    try:
        while True:
            waiting = struct.unpack("i", fcntl.ioctl(read_end, termios.FIONREAD, b"\0" * 4))[0]
            if waiting < size and proc.poll() is None:
                select.select([], [], [], 0.01)
                continue
            chunk = os.read(read_end, 1 << 20)
            if not chunk:
                break
            data += chunk
    finally:
        os.close(read_end)
        proc.wait(timeout=60)
    assert proc.returncode == 0
    assert len(data) > size
    result = json.loads(data)
    assert len(result["tools"]) == 60


def test_an_empty_home_is_the_passwd_entrys(env: Env) -> None:
    """``HOME=`` with no ``CRYSTAL_HOME``: the default home is the passwd entry's
    ``~/.crystal``, as the daemon's (and .NET's) is; Python's ``expanduser`` made it
    ``/.crystal``, so ``list`` without a daemon read, and ``enable`` edited, another home
    than the daemon serves."""
    import pwd

    crystal = Path(pwd.getpwuid(os.getuid()).pw_dir) / ".crystal"
    clean = {k: v for k, v in os.environ.items() if k not in ("TOOLSETD_SOCKET", "CRYSTAL_HOME")}
    proc = subprocess.run(
        [sys.executable, "-m", "toolsetd.client", "--format", "json", "enable", "no-such-set",
         "--workspace", str(env.workspace), "--socket", str(env.socket)],
        capture_output=True, text=True, timeout=60, env={**clean, "HOME": ""},
    )
    assert proc.returncode == 2, proc.stderr
    assert json.loads(proc.stdout)["error"]["data"] == {"home": str(crystal)}


@pytest.mark.parametrize("command", ["enable", "disable"])
def test_enable_names_a_home_tools_folder_that_is_no_folder(env: Env, command: str) -> None:
    """A home whose ``tools`` is a file (a botched copy, a tarball unpacked wrong): the set
    was "not found" and nothing said why, since the daemon and the reference host skip such
    a root without a word. The not-found message now names the tools folder's fault."""
    (env.home / "tools").write_text("not a folder")
    r = env.run(command, "hello")
    assert r.returncode == 2
    assert r.stderr.splitlines() == [
        "Tool set 'hello' was not found.",
        f"  The home's tools folder {env.home / 'tools'} is not a directory.",
    ]


# A signal sent as ``Termination.end`` is entered: once the command has returned and
# printed its outcome, before the default actions are back. A signal comes there only by
# chance; the trace hook puts it there every time. To the main thread, which runs Python's
# handlers: sent to the process, another thread of it may take the signal, and the handler
# runs at the main thread's next check, which may come after ``end``.
_SIGNAL_AS_END_BEGINS = """\
import os, signal, sys, threading
from toolsetd.client.termination import Termination

def hook(frame, event, arg):
    if event == "{event}" and frame.f_code is Termination.{method}.__code__:
        signal.pthread_kill(threading.main_thread().ident, signal.{name})
    return hook if frame.f_code is Termination.{method}.__code__ else None

signal.signal(signal.SIGINT, signal.default_int_handler)  # as a terminal's command starts
sys.argv = ["toolsetctl", *sys.argv[1:]]
sys.settrace(hook)
from toolsetd.client.__main__ import main
main()
"""


def _validate_signalled_as_end_begins(
    env: Env, name: str, event: str = "call", method: str = "end"
) -> subprocess.CompletedProcess[str]:
    """``toolsetctl validate`` of a valid set, signal ``name`` sent as ``end`` begins (or
    at another ``event`` of another ``Termination`` method)."""
    path = env.home_set("acme", exec_set("fmt"))
    clean = {k: v for k, v in os.environ.items() if k not in ("TOOLSETD_SOCKET", "CRYSTAL_HOME")}
    script = _SIGNAL_AS_END_BEGINS.format(name=name, event=event, method=method)
    return subprocess.run(
        [sys.executable, "-c", script, "validate",
         str(path.parent), "--home", str(env.home), "--socket", str(env.socket)],
        capture_output=True, text=True, timeout=60, check=False, env=clean,
    )


def test_a_sigterm_once_the_command_has_finished_ends_toolsetctl_by_it(env: Env) -> None:
    """A SIGTERM between the command's end and ``Termination.end`` raised ``Terminated``
    outside every handler: a traceback on stderr and an exit status of 1 instead of death
    by SIGTERM, which a CI runner or ``timeout`` reads. It ends by the signal now, the
    command's output whole."""
    proc = _validate_signalled_as_end_begins(env, "SIGTERM")
    assert proc.stderr == "", proc.stderr
    assert proc.stdout == "Tool set acme is valid: 1 tool (fmt).\n"
    assert proc.returncode == -signal.SIGTERM


def test_a_ctrl_c_once_the_command_has_finished_is_exit_130_without_a_traceback(
    env: Env,
) -> None:
    """A Ctrl-C between the command's end and ``Termination.end`` raised Python's
    ``KeyboardInterrupt`` outside every handler: a traceback on stderr and a death by
    SIGINT, after an outcome already printed. It exits 130, as for a Ctrl-C the command
    handled, with nothing more printed and the output whole."""
    proc = _validate_signalled_as_end_begins(env, "SIGINT")
    assert proc.stderr == "", proc.stderr
    assert proc.stdout == "Tool set acme is valid: 1 tool (fmt).\n"
    assert proc.returncode == 130


def test_a_ctrl_c_as_run_returns_prints_no_traceback(env: Env) -> None:
    """``Termination.run`` has returned its code (the signal sent at its return): Python's
    own SIGINT handler raised ``KeyboardInterrupt`` in ``main``, outside every handler, a
    traceback after the outcome. ``catch``'s handler only notes it there; the exit code,
    decided already, is the command's."""
    proc = _validate_signalled_as_end_begins(env, "SIGINT", event="return", method="run")
    assert proc.stderr == "", proc.stderr
    assert proc.stdout == "Tool set acme is valid: 1 tool (fmt).\n"
    assert proc.returncode == 0


#: ``toolsetctl`` with orjson's parser and writer gone from ``jsontext`` (any call of them
#: fails it, exit 9): what must hold once allocations are checked. ``exhaustion`` writes
#: its constant frames at import, before any switch can be turned (a few hundred bytes).
_WITHOUT_ORJSON = (
    "import sys, orjson\n"
    "import toolsetd.daemon.exhaustion\n"
    "import toolsetd.protocol.jsontext as jsontext\n"
    "class NoOrjson:\n"
    "    def __getattr__(self, name):\n"
    "        if name in ('loads', 'dumps'):\n"
    "            raise AssertionError(f'orjson.{name} was called')\n"
    "        return getattr(orjson, name)\n"
    "jsontext.orjson = NoOrjson()\n"
    "from toolsetd.client.__main__ import main\n"
    "main()\n"
)


def _bounded_run(
    env: Env, soft: int, *args: str, without_orjson: bool = False
) -> subprocess.CompletedProcess[str]:
    """``env.run`` under an address-space soft limit of ``soft`` bytes from the start (as
    ``ulimit -v`` or a CI job's unit bounds it); the hard limit is left as it is."""
    hard = resource.getrlimit(resource.RLIMIT_AS)[1]
    if hard != resource.RLIM_INFINITY:
        soft = min(soft, hard)
    program = ["-c", _WITHOUT_ORJSON] if without_orjson else ["-m", "toolsetd.client"]
    return subprocess.run(
        ["prlimit", f"--as={soft}:", "--", sys.executable, *program, *args,
         "--home", str(env.home), "--workspace", str(env.workspace), "--socket", str(env.socket)],
        capture_output=True, text=True, timeout=60, check=False,
    )


def _wide_set(tools: int) -> dict[str, object]:
    """A valid exec set of ``tools`` tools with long descriptions: some 2 KB each."""
    manifest = exec_set(*(f"t{i}" for i in range(tools)))
    for tool in manifest["tools"]:  # type: ignore[attr-defined]
        tool["description"] = "d" * 1_000
        tool["schema"] = {"type": "object", "properties": {
            f"p{j}": {"type": "string", "description": "p" * 100} for j in range(8)}}
    return manifest


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("prlimit") is None, reason="needs util-linux's prlimit")
def test_validate_under_a_memory_limit_says_so_and_never_crashes(env: Env) -> None:
    """Under an address-space limit, ``validate`` of a large set either passes or says it
    ran out of memory and what to do (exit 9). orjson, which read the manifest's keys,
    does not check its allocations: short of memory it wrote to a null pointer, and
    toolsetctl died of SIGSEGV (here 5 steps of 21 between 37 and 38.5 MiB), with nothing
    said. Swept in 128 KiB steps over the 4 MiB below the least limit it passes under."""
    env.home_set("wide", _wide_set(400))
    target = str(env.home / "tools" / "wide")
    assert env.run("validate", target).returncode == 0

    def passes(soft: int) -> bool:
        return _bounded_run(env, soft, "validate", target).returncode == 0

    low, high = 8 << 20, 1 << 30  # fails at low (the interpreter cannot start), passes at high
    assert passes(high) and not passes(low)
    while high - low > 128 << 10:
        middle = (low + high) // 2
        low, high = (low, middle) if passes(middle) else (middle, high)
    said: list[str] = []
    for soft in range(high - (4 << 20), high + (128 << 10), 128 << 10):
        run = _bounded_run(env, soft, "validate", target)
        # Killed by a signal is a negative code (prlimit execs the interpreter).
        assert run.returncode >= 0, (soft >> 10, run.returncode, run.stderr[-2000:])
        if run.returncode == 0:
            assert "is valid" in run.stdout
            continue
        # Short of memory for a module's code, an import fails in the loader's words
        # (exit 9, said too); the interpreter's own lack of it can end it with its
        # traceback (exit 1: "SystemError: error return without exception set", seen here
        # at one limit).
        assert run.stderr.strip(), (soft >> 10, run.returncode)
        said.append(run.stderr.strip().splitlines()[-1])
    assert OUT_OF_MEMORY in said, said  # the sweep reached the manifest's reading


@pytest.mark.skipif(shutil.which("prlimit") is None, reason="needs util-linux's prlimit")
def test_disable_under_a_memory_limit_writes_what_it_writes_unbounded(env: Env) -> None:
    """Under a limit, the offline commands read JSON with checked code (orjson's values,
    from code that checks its allocations): run with orjson's parser gone (its writer too,
    which an edit no longer uses), an edit still works, so it did not run, and writes byte
    for byte what an unbounded edit writes."""
    manifest = env.home_set("wide", _wide_set(3) | {"extra": {"n": [1.5, 1e-7, {}, []]}})
    unbounded = {}
    for command in ("disable", "enable"):
        assert env.run(command, "wide").returncode == 0
        unbounded[command] = manifest.read_bytes()
    assert unbounded["enable"].endswith(b', "enabled": true}')
    for command in ("disable", "enable"):
        run = _bounded_run(env, 1 << 40, command, "wide", without_orjson=True)
        assert run.returncode == 0, run.stderr
        assert manifest.read_bytes() == unbounded[command], command
