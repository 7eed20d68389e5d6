"""Rendering: the list inventory in its plain-text form, fields, and call content."""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import pytest
from toolsetd.client.blocking import json_number
from toolsetd.client.cli import _report
from toolsetd.client.exits import CLI_ERROR_CODES, EXIT_INTERRUPTED, Failure
from toolsetd.client.render import (
    SET_HEADERS,
    Output,
    aligned_fields,
    aligned_rows,
    classification_fields,
    content_lines,
    set_rows_from_list,
    status_fields,
)

from .cells import cells


def _tool(name: str, set_: str, source: str, declared: str, catalogs: list[str]) -> dict[str, Any]:
    return {
        "name": name,
        "description": "d",
        "inputSchema": {"type": "object"},
        "set": set_,
        "source": source,
        "runner": "exec",
        "catalogs": catalogs,
        "approval": {"declared": declared, "policy": "author", "effective": declared},
        "timeoutSeconds": 120,
        "output": "text",
        "pathArguments": [],
        "hash": "sha256:00",
    }


LIST_RESULT: dict[str, Any] = {
    "generation": 3,
    "tools": [
        _tool("fmt", "acme", "project", "always", ["plan", "work"]),
        _tool("lint", "acme", "project", "inherit", ["plan", "work"]),
        _tool("zap", "zeta", "home", "inherit", ["work"]),
    ],
    "sets": [
        {"directory": "zeta", "source": "home", "path": "/h/tools/zeta", "enabled": True,
         "state": "loaded", "tools": ["zap"], "notes": []},
        {"directory": "acme", "source": "project", "path": "/w/.crystal/tools/acme",
         "enabled": True, "state": "loaded", "tools": ["fmt", "lint"], "notes": []},
        {"directory": "acme", "source": "home", "path": "/h/tools/acme", "enabled": False,
         "state": "hidden", "tools": [], "notes": []},
        {"directory": "bad", "source": "home", "path": "/h/tools/bad", "enabled": None,
         "state": "refused", "tools": [],
         "notes": ["External tool set 'bad' was skipped: tools.json must be a JSON object."]},
    ],
    "notes": [],
}


def test_list_text_form_snapshot() -> None:
    """The plain form: sorted by directory then source, two-space gaps, last column unpadded."""
    rows = set_rows_from_list(LIST_RESULT)
    assert aligned_rows(SET_HEADERS, [row.cells() for row in rows]) == [
        "Directory  Source   Enabled  Effective  Path                               Runner  Catalogs   Approval  Tools",
        "acme       Home     No       No         /h/tools/acme/tools.json           -       -          -         -",
        "acme       Project  Yes      Yes        /w/.crystal/tools/acme/tools.json  exec    Plan+Work  -         fmt (always), lint",
        "bad        Home     -        Yes        /h/tools/bad/tools.json            -       -          -         External tool set 'bad' was skipped: tools.json must be a JSON object.",
        "zeta       Home     Yes      Yes        /h/tools/zeta/tools.json           exec    Work       -         zap",
    ]


def test_list_rows_use_set_level_fields_when_sent() -> None:
    """Set-level runner, catalogs, approval, effective and error win over derived values."""
    result = {
        "tools": [],
        "sets": [{"directory": "d", "source": "home", "path": "/h/tools/d", "enabled": True,
                  "state": "disabled", "tools": [], "notes": [], "runner": "dotnet",
                  "catalogs": ["plan"], "approval": "always", "effective": False,
                  "error": "boom"}],
    }
    (row,) = set_rows_from_list(result)
    assert row.cells() == ["d", "Home", "Yes", "No", "/h/tools/d/tools.json", "dotnet", "Plan",
                           "always", "boom"]


def test_output_text_rows_and_empty() -> None:
    """The text format prints aligned rows, and the empty message when there are none."""
    stdout = io.StringIO()
    out = Output("text", stdout, io.StringIO())
    out.rows(("A", "Bee"), [["xx", "1"], ["y", "22"]], empty="No tool sets.")
    out.rows(("A",), [], empty="No tool sets.")
    assert stdout.getvalue() == "A   Bee\nxx  1\ny   22\nNo tool sets.\n"


def test_aligned_fields_pads_labels() -> None:
    """Fields print as ``Label  value`` with labels padded to the widest."""
    assert aligned_fields([("Directory", "a"), ("Error", "x")]) == ["Directory  a", "Error      x"]


def test_content_lines_text_and_image() -> None:
    """Text content prints as is; an image prints its type and decoded size."""
    content = [
        {"type": "text", "text": "hello"},
        {"type": "image", "data": "iVBORw0KGgo=", "mimeType": "image/png"},
    ]
    assert content_lines(content) == ["hello", "[image image/png, 8 bytes]"]


def test_set_rows_take_declared_tools_of_a_set_that_did_not_load() -> None:
    """A sets[] tool given as {name, approval} (a disabled set) is labelled like a loaded one."""
    result = {"tools": [], "notes": [], "sets": [
        {"directory": "web", "source": "home", "path": "/h/tools/web", "enabled": False,
         "state": "disabled", "notes": [], "error": None,
         "tools": [{"name": "web", "approval": "always"}, {"name": "fetch", "approval": "inherit"}]},
    ]}
    (row,) = set_rows_from_list(result)
    assert row.tools_cell() == "web (always), fetch"


def test_render_status_says_which_confinement_is_active() -> None:
    """status shows the cgroup mode and the sandbox, or why each is missing."""
    on = {"cgroup": {"mode": "cgroup", "tree": "/sys/fs/cgroup/t", "controllers": ["pids"]},
          "sandbox": {"mechanism": "bubblewrap", "binary": "/usr/bin/bwrap"}}
    rows = dict(status_fields({"confinement": on}))
    assert rows["Cgroups"] == "a cgroup per call under /sys/fs/cgroup/t (pids)"
    assert rows["Sandbox"] == "bubblewrap (/usr/bin/bwrap)"
    off = {"cgroup": {"mode": "process-group", "reason": "no cgroup v2"},
           "sandbox": {"mechanism": "none", "reason": "bwrap not found"}}
    rows = dict(status_fields({"confinement": off}))
    assert rows["Cgroups"] == "process groups (no cgroup v2)"
    assert rows["Sandbox"] == "none (bwrap not found)"
    assert "Cgroups" not in dict(status_fields({}))  # an older daemon


def test_render_status_says_how_edits_arrive() -> None:
    """status shows whether the daemon watches, polls (and why), or neither. The seconds
    are read as toolsetctl reads the daemon's line (``json_number``: a ``WrittenNumber``,
    no ``float`` by type), which showed them as ``a poll -``."""

    def read(status: dict[str, Any]) -> list[tuple[str, str]]:
        return status_fields(json.loads(json.dumps(status), parse_float=json_number))

    base = {"reason": None, "watched": 5, "pastCap": 0, "maxWatches": 8192, "pollSeconds": 2.0}
    rows = dict(read({"watch": {**base, "state": "watching"}}))
    assert rows["Watch"] == "watching 5 folders, and a poll every 2 s"
    rows = dict(read({"watch": {**base, "state": "polling", "watched": 0,
                                "pollSeconds": 40.5, "reason": "OSError: limit"}}))
    assert rows["Watch"] == "polling every 40.5 s: the watch is unavailable (OSError: limit)"
    rows = dict(read({"watch": {**base, "state": "off", "reason": "--no-watch",
                                "pollSeconds": None}}))
    assert rows["Watch"] == "off (--no-watch)"
    assert "Watch" not in dict(read({}))  # an older daemon


def test_render_status_shows_the_poll_period_as_toolsetctl_reads_it() -> None:
    """The reader gives pollSeconds (2.0 on the wire) as a WrittenNumber, a float subclass
    keeping its text: the Watch row printed 'a poll -' for every daemon."""
    status = json.loads(
        '{"watch": {"state": "watching", "reason": null, "watched": 4, "pastCap": 0,'
        ' "maxWatches": 4, "pollSeconds": 2.0}}',
        parse_float=json_number,
    )
    assert dict(status_fields(status))["Watch"] == "watching 4 folders, and a poll every 2 s"
    status["watch"]["state"] = "starting"  # the fourth state, which no test rendered
    assert dict(status_fields(status))["Watch"] == "starting, and a poll every 2 s"


def test_render_classification_shows_the_sandbox() -> None:
    """classify shows the profile, the network, approved paths and a fail-closed reason."""
    confinement = {"sandbox": {"profile": "workspace-write", "network": False,
                               "alsoWritable": ["/x/y"]}, "failure": "no bwrap"}
    rows = dict(classification_fields({"confinement": confinement}))
    assert rows["Sandbox"] == "workspace-write, network denied, also writable: /x/y"
    assert rows["Confinement"] == "fails closed: no bwrap"


def test_a_multi_line_description_reads_as_a_paragraph_in_table_and_escaped_in_text() -> None:
    """Line breaks and tabs in a value: spaces where ``table`` wraps it, escapes where
    ``text`` keeps one line per field; every other control character escaped in both."""
    value = "First line.\nSecond line.\tTabbed \x1b]0;t\x07 end"
    table, text = io.StringIO(), io.StringIO()
    Output("table", table, io.StringIO(), width=200).fields([("Description", value)])
    Output("text", text, io.StringIO()).fields([("Description", value)])
    assert table.getvalue() == (
        "Description  First line. Second line. Tabbed \\x1b]0;t\\x07 end\n"
    )
    assert text.getvalue() == (
        "Description  First line.\\nSecond line.\\tTabbed \\x1b]0;t\\x07 end\n"
    )


def test_table_fits_wide_characters_to_the_terminal_by_cells() -> None:
    """A CJK description (two cells a character) was wrapped and padded by characters: at
    50 columns its lines took 84 cells, the terminal wrapped them again and the columns of
    a table no longer lined up. ``table`` counts cells; ``text`` (the reference host's
    form, nothing fitted) is unchanged."""
    value = "这是一个非常长的中文描述，用来测试表格在终端中的换行和对齐是否正确处理宽字符。"  # noqa: RUF001 - Chinese text has its full-width comma
    out = io.StringIO()
    Output("table", out, io.StringIO(), width=50).fields([("Description", value), ("Set", "x")])
    lines = out.getvalue().splitlines()
    assert all(cells(line) <= 50 for line in lines), lines
    assert "".join(line[13:] for line in lines[:-1]) == value
    out = io.StringIO()
    Output("table", out, io.StringIO(), width=None).rows(
        ["Name", "Description"], [["工具", "中文"], ["tool", "x"]], empty=""
    )
    header, _, first, second = out.getvalue().splitlines()
    # the second column starts at the same cell on every line
    assert cells(first[: first.index("中文")]) == cells(second[: second.index("x")]) == 6
    assert cells(header[: header.index("Description")]) == 6


def test_table_counts_no_cell_for_marks_without_a_combining_class() -> None:
    """A Thai vowel sign (U+0E34) is drawn on the cell before it and a zero-width space
    (U+200B) on none, but both have canonical combining class 0: counted by
    ``unicodedata.combining`` each took a cell, and the column after them started further
    out on that row than on the others."""
    out = io.StringIO()
    Output("table", out, io.StringIO(), width=None).rows(
        ["Name", "Description"],
        [["\u0e01\u0e34\u0e01\u0e34", "thai"], ["a\u200bb", "zero-width space"], ["ab", "x"]],
        empty="",
    )
    assert out.getvalue().splitlines() == [
        "Name  Description",
        "────  ────────────────",
        "\u0e01\u0e34\u0e01\u0e34    thai",
        "a\u200bb    zero-width space",
        "ab    x",
    ]


def test_no_line_reads_as_a_ci_runners_command_and_escaping_twice_changes_nothing() -> None:
    """GitHub Actions takes ``::`` at a line's start (after white space) and ``##[`` in it,
    Azure Pipelines ``##vso[`` anywhere; ``## Usage`` and ``a ::b`` are nobody's command."""
    cases = {
        "::add-mask::x  Project": "\\x3a:add-mask::x  Project",
        "\u3000 ::set-output name=a::b": "\u3000 \\x3a:set-output name=a::b",
        "a ##vso[task.prependpath]/x": "a \\x23#vso[task.prependpath]/x",
        "###[error]z": "#\\x23#[error]z",
        "## Usage, a ::b": "## Usage, a ::b",
    }
    for text, shown in cases.items():
        stdout, stderr = io.StringIO(), io.StringIO()
        out = Output("text", stdout, stderr)
        out.line(text)
        out.error(text)
        out.line(shown)
        assert stdout.getvalue() == f"{shown}\n{shown}\n"
        assert stderr.getvalue() == f"{shown}\n"


def test_numbers_print_as_written_where_python_has_no_encoder_hook(monkeypatch: Any) -> None:
    """Without json's private ``_make_iterencode`` (no Python yet), ``dumps`` fell back to
    json's own float writer: ``1.5``, and ``Infinity`` for ``1e400``, a line no JSON reader
    takes. It prints every number as written, through json's public API alone.

    Only ``jsonl`` can be run so: json's own ``indent`` path needs the function too (a
    Python that dropped it would have another); ``dumps``' path for ``indent`` without it
    (the markers) is held to the same text in ``test_jsonout``."""
    from toolsetd.client.blocking import read_json

    value = read_json('{"n": 1.50, "m": [1e4, 1e400, -2.5E+401], "k": 0.5}')
    monkeypatch.delattr(json.encoder, "_make_iterencode")
    stdout = io.StringIO()
    Output("jsonl", stdout, io.StringIO()).json(value)
    assert stdout.getvalue() == '{"n":1.50,"m":[1e4,1e400,-2.5E+401],"k":0.5}\n'


def test_a_signal_before_a_json_document_is_written_leaves_the_error_document(
    tmp_path: Path,
) -> None:
    """``--format json`` prints one document: once it has begun, a failure (a signal)
    goes to stderr, the document finished first. A signal while the document was still
    being encoded (some 0.15 s for 4 MB) counted as begun: stdout held nothing at all,
    no JSON for the consumer, where the error document should have been."""

    class Stopped(float):  # a number whose text the signal interrupts, as any step may be
        @property
        def text(self) -> str:
            raise KeyboardInterrupt

    path = tmp_path / "out.json"
    with path.open("w", encoding="utf-8") as stdout:
        out = Output("json", stdout, io.StringIO())
        with pytest.raises(KeyboardInterrupt):
            out.json({"result": {"n": Stopped(1.5)}})
        failure = Failure(EXIT_INTERRUPTED, CLI_ERROR_CODES["interrupted"], "Interrupted.", None)
        assert _report(out, failure) == EXIT_INTERRUPTED
    assert json.loads(path.read_text())["error"]["message"] == "Interrupted."
