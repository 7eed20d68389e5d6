"""The MCP face's pure shapes: tools/list pages and cursors, signed approval states."""

from __future__ import annotations

import base64
import json
from pathlib import Path

import orjson
import pytest
from toolsetd.daemon.catalog import ManifestCache, build_catalog
from toolsetd.daemon.mcp_mapping import (
    McpError,
    StateSigner,
    ToolPages,
    approval_answer,
    input_required_result,
)
from toolsetd.daemon.model import DEFAULT_RESERVED_NAMES
from toolsetd.protocol.jsontext import RawJson


def _home(tmp_path: Path, names: list[str], schema: object = None) -> Path:
    for name in names:
        folder = tmp_path / "tools" / name
        folder.mkdir(parents=True)
        (folder / "tools.json").write_text(
            json.dumps(
                {
                    "runner": "exec",
                    "description": f"tool {name}",
                    "schema": schema or {"type": "object"},
                    "command": ["/bin/true"],
                    "approval": "always",
                }
            )
        )
    return tmp_path


def _entries(page: RawJson) -> list[dict[str, object]]:
    """A page's entries as a client reads them (stdlib json: exact integers)."""
    decoded = json.loads(page.text)
    assert isinstance(decoded, list)
    return decoded


def _catalog(home: Path):  # type: ignore[no-untyped-def]
    return build_catalog(home, None, reserved=DEFAULT_RESERVED_NAMES, cache=ManifestCache())


def test_mcp_pages_walk_the_catalog_in_name_order(tmp_path: Path) -> None:
    """Pages of two walk every tool once, by name, and the last page has no cursor."""
    home = _home(tmp_path, ["echo", "alpha", "delta", "bravo", "charlie"])
    catalog = _catalog(home)
    pages = ToolPages()
    seen: list[str] = []
    cursor = None
    for _ in range(5):
        tools, cursor = pages.page(pages.listing(catalog, None), cursor, 2)
        seen += [t["name"] for t in _entries(tools)]
        if cursor is None:
            break
    assert seen == ["alpha", "bravo", "charlie", "delta", "echo"]
    first = _entries(pages.page(pages.listing(catalog, None), None, 10)[0])[0]
    assert first["annotations"] == {"readOnlyHint": False, "destructiveHint": True}
    assert first["_meta"]["toolsetd/set"] == "alpha"
    assert first["inputSchema"] == {"type": "object"}


def _cursor_at(pages: ToolPages, catalog: object, offset: int) -> str:
    """A cursor forged for ``offset`` (its tag read from one the class gave out)."""
    _, given = pages.page(pages.listing(catalog, None), None, 1)  # type: ignore[arg-type]
    assert given is not None
    tag = base64.urlsafe_b64decode(given).decode().split(":")[0]
    return base64.urlsafe_b64encode(f"{tag}:{offset}".encode()).decode()


def test_mcp_pages_are_encoded_once(tmp_path: Path) -> None:
    """Each page handed out is encoded once; a walk still sees every tool in order."""
    names = [f"t{i:02d}" for i in range(7)]
    catalog = _catalog(_home(tmp_path, names))
    pages = ToolPages()
    first, cursor = pages.page(pages.listing(catalog, None), None, 2)
    assert pages.page(pages.listing(catalog, None), None, 2)[0] is first
    walked = _entries(first)
    while cursor is not None:
        page, following = pages.page(pages.listing(catalog, None), cursor, 2)
        assert pages.page(pages.listing(catalog, None), cursor, 2)[0] is page
        walked += _entries(page)
        cursor = following
    assert [t["name"] for t in walked] == names


def test_mcp_forged_cursors_are_answered_but_not_kept(tmp_path: Path) -> None:
    """Offsets we never hand out (mid-page, past the end) are encoded per request."""
    catalog = _catalog(_home(tmp_path, ["a", "b", "c", "d", "e"]))
    pages = ToolPages()
    first = pages.page(pages.listing(catalog, None), None, 2)[0]
    for offset in (1, 3, 5, 9, 10**6):
        forged = _cursor_at(pages, catalog, offset)
        page = pages.page(pages.listing(catalog, None), forged, 2)[0]
        assert page is not pages.page(pages.listing(catalog, None), forged, 2)[0], offset
        assert _entries(page) == _all(pages, catalog)[offset : offset + 2], offset
    # The pages we do hand out are still kept (forged ones took no room).
    assert pages.page(pages.listing(catalog, None), None, 2)[0] is first


def test_mcp_pages_are_cut_short_by_their_bytes(tmp_path: Path) -> None:
    """Tools whose JSON together passes the page's bytes go over more pages (a page of
    1,000 long descriptions passed the socket's 64 MiB line: an MCP host got -32007 and
    cannot ask for less). A walk still sees each tool once, in order, and each page it
    walks is kept; a tool larger than the bound alone is a page of its own."""
    names = [f"t{i:02d}" for i in range(9)]
    home = _home(tmp_path, names)
    big = tmp_path / "tools" / "t04" / "tools.json"
    big.write_text(big.read_text().replace('"tool t04"', '"' + "x" * 5000 + '"'))
    catalog = _catalog(home)
    one = len(orjson.dumps(_all(ToolPages(), catalog)[0]))
    pages = ToolPages(page_bytes=3 * one + 4)  # brackets and commas: three tools, no more
    walked: list[str] = []
    sizes: list[int] = []
    cursor = None
    for _ in range(20):
        page, following = pages.page(pages.listing(catalog, None), cursor, 100)
        assert pages.page(pages.listing(catalog, None), cursor, 100)[0] is page
        entries = _entries(page)
        walked += [t["name"] for t in entries]
        sizes.append(len(entries))
        cursor = following
        if cursor is None:
            break
    assert walked == names
    assert sizes == [3, 1, 1, 3, 1]  # halved from 100: three fit; t04 alone; the rest


def _all(pages: ToolPages, catalog: object) -> list[dict[str, object]]:
    listing = pages.listing(catalog, None)  # type: ignore[arg-type]
    return _entries(pages.page(listing, None, 100)[0])


def test_mcp_a_new_snapshot_is_listed_fresh(tmp_path: Path) -> None:
    """A tool added since is in the next snapshot's pages, not an older snapshot's."""
    home = _home(tmp_path, ["alpha", "bravo"])
    pages = ToolPages()
    before = pages.page(pages.listing(_catalog(home), None), None, 10)[0]
    assert [t["name"] for t in _entries(before)] == ["alpha", "bravo"]
    _home(tmp_path, ["charlie"])
    after = pages.page(pages.listing(_catalog(home), None), None, 10)[0]
    assert [t["name"] for t in _entries(after)] == ["alpha", "bravo", "charlie"]


def test_mcp_page_writes_a_wide_integer_exactly(tmp_path: Path) -> None:
    """An integer wider than 64 bits in a schema reaches the host as written."""
    schema = {"type": "object", "properties": {"n": {"type": "integer", "maximum": 2**70}}}
    catalog = _catalog(_home(tmp_path, ["wide"], schema))
    pages = ToolPages()
    entry = _entries(pages.page(pages.listing(catalog, None), None, 10)[0])[0]
    assert entry["inputSchema"] == schema


def test_mcp_cursor_of_a_changed_catalog_or_garbage_is_refused(tmp_path: Path) -> None:
    """A cursor from before a change, or one we never gave out, is -32602."""
    home = _home(tmp_path, ["alpha", "bravo", "charlie"])
    pages = ToolPages()
    _, cursor = pages.page(pages.listing(_catalog(home), None), None, 1)
    _home(tmp_path, ["delta"])
    with pytest.raises(McpError) as changed:
        pages.page(pages.listing(_catalog(home), None), cursor, 1)
    assert changed.value.code == -32602
    assert "changed" in changed.value.message
    for junk in ("not-a-cursor", 7, "YWJj"):
        with pytest.raises(McpError) as bad:
            pages.page(pages.listing(_catalog(home), None), junk, 1)
        assert bad.value.code == -32602


def _params(state: str, action: str = "accept", arguments: object = None) -> dict[str, object]:
    return {
        "requestState": state,
        "arguments": arguments or {},
        "inputResponses": {"toolsetd_approval": {"action": action}},
    }


def test_mcp_state_round_trip_and_answers() -> None:
    """A signed state gives back its digest on accept; decline is a decline."""
    signer = StateSigner(600, key=b"k" * 32)
    result = input_required_result(signer, {"tool": "t"}, "digest-1", "bind", "t", {"a": 1})
    state = result["requestState"]
    assert result["resultType"] == "input_required"
    answer = approval_answer(signer, _params(state), "bind", "t", {"a": 1})
    assert answer.digest == "digest-1"
    declined = approval_answer(signer, _params(state, "decline"), "bind", "t", {"a": 1})
    assert declined.declined
    assert declined.digest is None


def test_mcp_state_tampered_foreign_or_expired() -> None:
    """A changed state, a state of another call or binding is refused; an expired one asks again."""
    now = [1000.0]
    signer = StateSigner(600, key=b"k" * 32, clock=lambda: now[0])
    state = input_required_result(signer, {}, "d", "bind", "t", {"a": 1})["requestState"]
    body, mac = state.split(".")
    for bad in (f"{body}x.{mac}", f"{body}.{mac[:-2]}AA", "garbage", ""):
        with pytest.raises(McpError):
            approval_answer(signer, _params(bad), "bind", "t", {"a": 1})
    for binding, tool, arguments in (
        ("other", "t", {"a": 1}),
        ("bind", "u", {"a": 1}),
        ("bind", "t", {"a": 2}),
    ):
        with pytest.raises(McpError):
            approval_answer(signer, _params(state), binding, tool, arguments)
    with pytest.raises(McpError):
        approval_answer(StateSigner(600, key=b"j" * 32), _params(state), "bind", "t", {"a": 1})
    now[0] += 601
    expired = approval_answer(signer, _params(state), "bind", "t", {"a": 1})
    assert expired.digest is None
    assert not expired.declined


def test_mcp_state_runs_its_call_once() -> None:
    """An accepted state is spent: sent again it asks again (no digest); the same call
    asked again gets a state of its own, good once too."""
    signer = StateSigner(600, key=b"k" * 32)
    state = input_required_result(signer, {}, "d", "bind", "t", {})["requestState"]
    assert approval_answer(signer, _params(state), "bind", "t", {}).digest == "d"
    again = approval_answer(signer, _params(state), "bind", "t", {})
    assert (again.digest, again.declined) == (None, False)
    other = input_required_result(signer, {}, "d", "bind", "t", {})["requestState"]
    assert other != state  # the same call asked twice: two states, each good once
    assert approval_answer(signer, _params(other), "bind", "t", {}).digest == "d"


def test_mcp_spent_states_past_the_cap_fail_closed() -> None:
    """With room for 3 spent states, 40 states each accepted three times in a mixed
    order run at most once each, the memory stays at 3, and a new state still runs."""
    now = [1000.0]
    signer = StateSigner(600, key=b"k" * 32, clock=lambda: now[0], max_spent=3)
    states = [
        input_required_result(signer, {}, f"d{i}", "bind", "t", {})["requestState"]
        for i in range(40)
    ]
    triple = [s for s in states for _ in range(3)]
    order = [triple[i * 7 % len(triple)] for i in range(len(triple))]  # 7 is prime to 120
    ran = [approval_answer(signer, _params(s), "bind", "t", {}).digest for s in order]
    runs = [d for d in ran if d is not None]
    assert len(runs) == len(set(runs)) >= 3
    assert len(signer._spent) <= 3
    fresh = input_required_result(signer, {}, "new", "bind", "t", {})["requestState"]
    assert approval_answer(signer, _params(fresh), "bind", "t", {}).digest == "new"
    now[0] += 601  # every spent state expired: forgotten first, nothing else refused
    late = [
        input_required_result(signer, {}, f"late{i}", "bind", "t", {})["requestState"]
        for i in range(4)
    ]
    assert [approval_answer(signer, _params(s), "bind", "t", {}).digest for s in late[:3]] == [
        "late0",
        "late1",
        "late2",
    ]
    assert approval_answer(signer, _params(late[0]), "bind", "t", {}).digest is None
    assert approval_answer(signer, _params(late[3]), "bind", "t", {}).digest == "late3"
    assert approval_answer(signer, _params(late[0]), "bind", "t", {}).digest is None


def test_mcp_approval_shapes_keep_exact_numbers() -> None:
    """What the operator is shown, and the digest of it, take 1.50 and a 90-bit integer as
    written (orjson alone refuses both: a float subclass, and an int past 64 bits)."""
    from toolsetd.daemon.mcp_mapping import approval_message
    from toolsetd.daemon.service import approval_digest
    from toolsetd.protocol.jsontext import loads

    arguments = loads(b'{"n": 1.50, "big": 123456789012345678901234567890}')
    classification = {"tool": "t", "reason": "asks", "paths": [], "arguments": arguments}
    shown = approval_message(classification)
    assert '{"n":1.50,"big":123456789012345678901234567890}' in shown
    other = {**classification, "arguments": loads(b'{"n": 1.5, "big": 123456789012345678901234567890}')}
    digest = approval_digest(classification, tool="sha256:a")
    assert digest != approval_digest(other, tool="sha256:a")  # 1.50 is not 1.5
    # The tool's definition counts as well: an edited tools.json is another approval.
    assert digest != approval_digest(classification, tool="sha256:b")


def test_mcp_docs_show_the_approval_message_the_operator_sees() -> None:
    """docs/mcp.md prints the elicitation message; it is approval_message's own text for
    the call it describes (the forbidden line aside, which that call does not get)."""
    from toolsetd.daemon.mcp_mapping import approval_message

    doc = (Path(__file__).resolve().parents[2] / "docs" / "mcp.md").read_text()
    block = doc.split("and this\n  message:\n\n  ```\n", 1)[1].split("\n  ```", 1)[0]
    shown = [line.removeprefix("  ") for line in block.splitlines()]
    forbidden = [line for line in shown if line.endswith("(forbidden calls only)")]
    assert len(forbidden) == 1, shown
    shown.remove(forbidden[0])
    reason = "<the classification's reason>"
    classification = {
        "tool": "write_note",
        "set": "notes",
        "source": "project",
        "reason": reason,
        "scope": "outsideWorkspace",
        "authority": "write",
        "paths": [
            {
                "argument": "path",
                "value": "../elsewhere/a.txt",
                "resolved": "/home/me/elsewhere/a.txt",
                "scope": "outsideWorkspace",
            }
        ],
        "arguments": {"path": "/home/me/elsewhere/a.txt", "text": "..."},
        "requirePrompt": False,
    }
    assert shown == approval_message(classification).splitlines()
    forbidden_line = forbidden[0].removesuffix("(forbidden calls only)").rstrip()
    assert forbidden_line in approval_message({**classification, "requirePrompt": True})


def test_mcp_approval_message_shows_control_characters_escaped() -> None:
    """What the model chose (a path argument) or a cloned repository named (a set's folder)
    is shown with its control characters escaped, as toolsetctl shows them: a newline in a
    path forged lines of the operator's question ("Scope: workspace; authority: read."),
    and an ESC reached a terminal host as a control sequence."""
    from toolsetd.daemon.mcp_mapping import approval_message

    forged = "a.txt\nScope: workspace; authority: read.\n\x1b[2J\u202e\x9b"
    classification = {
        "tool": "write_note",
        "set": "notes\x1b]0;title\x07",
        "source": "project",
        "reason": "<the classification's reason>",
        "scope": "outsideWorkspace",
        "authority": "write",
        "paths": [
            {
                "argument": "path",
                "value": forged,
                "resolved": f"/home/me/{forged}",
                "scope": "outsideWorkspace",
            }
        ],
        "arguments": {"path": f"/home/me/{forged}"},
        "requirePrompt": False,
    }
    message = approval_message(classification)
    lines = message.splitlines()
    assert [line for line in lines if line.startswith("Scope:")] == [
        "Scope: outsideWorkspace; authority: write."
    ]
    assert not any(c in message for c in "\x1b\x07\x9b\u202e")
    assert "- path: a.txt\\nScope: workspace; authority: read.\\n\\x1b[2J" in message
    assert "(set 'notes\\x1b]0;title\\x07', project)" in lines[0]


def test_mcp_refusal_names_each_pointer_once() -> None:
    """Every problem of an InvalidArguments reads ``JSON Pointer: message`` (docs/mcp.md).

    A schema error's message already starts with its pointer (``/name: expected
    string``), and the list printed it twice (``- /name: /name: expected string``); a
    fence error's message does not, and keeps the pointer in front.
    """
    from toolsetd.daemon.mcp_mapping import refusal_result
    from toolsetd.protocol.errors import InvalidArguments

    errors = [
        {"path": "", "message": "property 'mood' is not allowed"},
        {"path": "/name", "message": "/name: expected string, got integer"},
        {"path": "/path", "message": "Path is not valid."},
    ]
    result = refusal_result(
        InvalidArguments("Invalid arguments for 'hello': ...", {"errors": errors})
    )
    lines = result["content"][0]["text"].splitlines()
    assert lines[2:] == [
        "- (the arguments object): property 'mood' is not allowed",
        "- /name: expected string, got integer",
        "- /path: Path is not valid.",
    ]


def test_mcp_refusal_sends_the_model_to_the_list_not_to_data_errors() -> None:
    """The native message counts the other problems "in data.errors"; an MCP result has no
    data.errors, the list below the message carries them, and the text says so."""
    from toolsetd.daemon.mcp_mapping import refusal_result
    from toolsetd.protocol.errors import InvalidArguments

    errors = [
        {"path": "", "message": "property 'mood' is not allowed"},
        {"path": "/name", "message": "/name: expected string, got integer"},
    ]
    message = (
        "Invalid arguments for 'hello': property 'mood' is not allowed (1 more in data.errors)"
    )
    text = refusal_result(InvalidArguments(message, {"errors": errors}))["content"][0]["text"]
    assert "data.errors" not in text
    assert text.splitlines()[0] == (
        "Invalid arguments for 'hello': property 'mood' is not allowed (1 more below)"
    )


def test_mcp_approval_message_shows_control_characters_as_escapes() -> None:
    """A path argument is the model's text: its line breaks, carriage returns, escape
    sequences and bidirectional controls are shown as escapes in the question the operator
    answers, never obeyed, so no argument can forge or hide a line of it (as the reason
    already shows them)."""
    from toolsetd.daemon.mcp_mapping import approval_message

    forged = "../x\x1b[2K\rScope: workspace; authority: write.\nAll clear.\u202e\u2028"
    classification = {
        "tool": "t",
        "set": "s",
        "source": "home",
        "reason": "asks",
        "scope": "outsideWorkspace",
        "authority": "write",
        "paths": [
            {"argument": "path", "value": forged, "resolved": "/r/x\nAll clear.",
             "scope": "outsideWorkspace"},
            {"argument": "more", "value": ["a\nb"], "resolved": None,
             "scope": "outsideWorkspace"},
        ],
        "arguments": {"path": forged, "more": ["a\nb"]},
        "requirePrompt": False,
    }
    lines = approval_message(classification).split("\n")
    assert lines[3:7] == [
        "Paths:",
        "- path: ../x\\x1b[2K\\rScope: workspace; authority: write.\\nAll clear.\\u202e\\u2028"
        " -> /r/x\\nAll clear. (outsideWorkspace)",
        '- more: ["a\\nb"] -> null (outsideWorkspace)',
        'Arguments: {"path":"../x\\u001b[2K\\rScope: workspace; authority: write.\\nAll clear.'
        '\\u202e\\u2028","more":["a\\nb"]}',
    ]
    assert len(lines) == 8, lines
