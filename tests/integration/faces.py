"""One call, three faces: the native ``invoke``, ``toolsetctl mcp`` and MCP over HTTP.

``Faces`` holds one daemon serving ``--mcp-listen``, and sends the same call through the
native wire (``invoke`` on a raw socket connection), a real ``toolsetctl mcp`` subprocess
and real HTTP requests, with the same binding (workspace, mode, headless, catalog). Each
answer is brought to one ``Outcome``: the decision (``ran``, ``denied``, ``approval``,
``invalid``, ``unknown`` or an error code), ``isError`` and the content text as the model
reads it, so a test compares the three and names the face that differs.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .conftest import Daemon, RawConn
from .http_helpers import INIT_PARAMS, endpoint, http, rpc
from .mcp_helpers import RawPump, pump_args

FACES = ("native", "stdio", "http")


@dataclass(frozen=True)
class Outcome:
    """What one face made of a call, in the terms the three share."""

    decision: str
    is_error: bool | None
    text: str

    def same(self) -> tuple[str, bool | None, str]:
        """The fields the faces must agree on, with the documented translation undone."""
        text = re.sub(r" \((\d+) more (below|in data\.errors)\)", r" (\1 more)", self.text)
        text = re.sub(r"tool-output/\S+ \(", "tool-output/<call id> (", text)
        if self.decision == "error -32700":
            return self.decision, self.is_error, "Parse error"
        if re.match(r"Invalid arguments for '[^']*': expected object, got \w+$", text) or (
            text.startswith("Invalid params: 'arguments' must be an object")
        ):
            # Documented (docs/mcp.md): MCP refuses such arguments as a malformed request.
            return "arguments not an object", None, ""
        # MCP's refusal lists every problem below the message; the native one has them in data.
        text = text.split("\nEvery problem (JSON Pointer", 1)[0]
        return self.decision, self.is_error, text


def _content_text(result: dict[str, Any]) -> str:
    parts = []
    for block in result.get("content", []):
        if block.get("type") == "text":
            parts.append(block["text"])
        else:
            parts.append(f"<{block.get('type')} {block.get('mimeType')}>")
    return "\n--\n".join(parts)


def native_outcome(reply: dict[str, Any]) -> Outcome:
    """A native ``invoke`` response as an ``Outcome``."""
    if "result" in reply:
        result = reply["result"]
        return Outcome("ran", result["isError"], _content_text(result))
    error = reply["error"]
    code, message = error["code"], error["message"]
    decision = {-32003: "denied", -32004: "approval", -32002: "invalid", -32001: "unknown"}.get(
        code, f"error {code}"
    )
    if decision == "approval":
        return Outcome(decision, True, error["data"]["reason"])
    return Outcome(decision, True if decision in ("denied", "invalid") else None, message)


def mcp_outcome(reply: dict[str, Any]) -> Outcome:
    """An MCP ``tools/call`` response as an ``Outcome``."""
    if "error" in reply:
        error = reply["error"]
        if error["code"] == -32602 and error["message"].startswith("Unknown tool"):
            return Outcome("unknown", None, error["message"])
        return Outcome(f"error {error['code']}", None, error["message"])
    result = reply["result"]
    text = _content_text(result)
    if "toolsetd/status" in result.get("_meta", {}):
        return Outcome("ran", result["isError"], text)
    if text.startswith("Denied: "):
        return Outcome("denied", result["isError"], text)
    if text.startswith("Approval required: "):
        reason = text.removeprefix("Approval required: ").split(
            " This MCP host did not declare elicitation", 1
        )[0]
        return Outcome("approval", result["isError"], reason)
    return Outcome("invalid", result["isError"], text)


@dataclass
class Binding:
    """The options a call is made under, on every face."""

    mode: str | None = None
    headless: bool = False
    catalog: str | None = None

    def pump_flags(self) -> list[str]:
        flags = []
        if self.mode is not None:
            flags += ["--mode", self.mode]
        if self.catalog is not None:
            flags += ["--catalog", self.catalog]
        if self.headless:
            flags.append("--headless")
        return flags

    def query(self) -> dict[str, str]:
        query = {}
        if self.mode is not None:
            query["mode"] = self.mode
        if self.catalog is not None:
            query["catalog"] = self.catalog
        if self.headless:
            query["headless"] = "true"
        return query


class Faces:
    """The three faces of one daemon, for one workspace."""

    def __init__(self, daemon: Daemon, url: str, workspace: Path) -> None:
        self.daemon = daemon
        self.url = url
        self.workspace = workspace
        self._pumps: dict[tuple[Any, ...], RawPump] = {}
        self._sessions: dict[tuple[Any, ...], str] = {}
        self._next = 100

    def close(self) -> None:
        for pump in self._pumps.values():
            pump.close()
        self._pumps.clear()

    def _id(self) -> int:
        self._next += 1
        return self._next

    # -- native ----------------------------------------------------------------------------

    def native(
        self, tool: str, arguments: Any, binding: Binding | None = None, raw: bytes | None = None
    ) -> dict[str, Any]:
        b = binding or Binding()
        params: dict[str, Any] = {
            "tool": tool,
            "arguments": arguments,
            "workspace": str(self.workspace),
            "headless": b.headless,
        }
        if b.mode is not None:
            params["mode"] = b.mode
        if b.catalog is not None:
            params["catalog"] = b.catalog
        if raw is None:
            raw = (
                json.dumps(
                    {"jsonrpc": "2.0", "id": 7, "method": "invoke", "params": params}
                ).encode()
                + b"\n"
            )
        with RawConn(self.daemon.socket, timeout=60) as conn:
            conn.send_bytes(raw)
            while True:
                reply = conn.receive()
                if "method" not in reply:
                    return reply

    # -- stdio -----------------------------------------------------------------------------

    def pump(self, binding: Binding | None = None) -> RawPump:
        b = binding or Binding()
        key = (b.mode, b.headless, b.catalog)
        if key not in self._pumps:
            pump = RawPump(
                pump_args(self.daemon, self.workspace, *b.pump_flags()), env=dict(os.environ)
            )
            reply = pump.request(1, "initialize", INIT_PARAMS)
            assert "result" in reply, reply
            pump.send({"jsonrpc": "2.0", "method": "notifications/initialized"})
            self._pumps[key] = pump
        return self._pumps[key]

    def stdio(
        self, tool: str, arguments: Any, binding: Binding | None = None, raw: bytes | None = None
    ) -> dict[str, Any]:
        pump = self.pump(binding)
        request_id = self._id()
        if raw is None:
            raw = json.dumps(rpc(0, "tools/call", {"name": tool, "arguments": arguments})).encode()
            raw += b"\n"
        pump.send(raw.replace(b'"id": 0', f'"id": {request_id}'.encode()))
        while True:
            reply = pump.receive()
            if reply.get("id") in (request_id, None) and "method" not in reply:
                return reply

    # -- HTTP ------------------------------------------------------------------------------

    def endpoint(self, binding: Binding | None = None) -> str:
        return endpoint(self.url, self.workspace, **(binding or Binding()).query())

    def session(self, binding: Binding | None = None) -> str:
        b = binding or Binding()
        key = (b.mode, b.headless, b.catalog)
        if key not in self._sessions:
            url = self.endpoint(b)
            reply = http(url, body=rpc(1, "initialize", INIT_PARAMS))
            assert reply.status == 200, reply
            session = reply.headers["mcp-session-id"]
            note = http(
                url,
                body={"jsonrpc": "2.0", "method": "notifications/initialized"},
                headers={"mcp-session-id": session},
            )
            assert note.status == 202, note
            self._sessions[key] = session
        return self._sessions[key]

    def http(
        self, tool: str, arguments: Any, binding: Binding | None = None, raw: bytes | None = None
    ) -> dict[str, Any]:
        session = self.session(binding)
        request_id = self._id()
        body: Any = rpc(request_id, "tools/call", {"name": tool, "arguments": arguments})
        if raw is not None:
            body = raw.replace(b'"id": 0', f'"id": {request_id}'.encode())
        reply = http(
            self.endpoint(binding), body=body, headers={"mcp-session-id": session}, timeout=60
        )
        messages = [m for m in reply.messages() if "method" not in m]
        assert messages, reply
        return messages[-1]

    # -- all three -------------------------------------------------------------------------

    def call(self, tool: str, arguments: Any, binding: Binding | None = None) -> dict[str, Outcome]:
        """The same call on each face, as outcomes by face name."""
        return {
            "native": native_outcome(self.native(tool, arguments, binding)),
            "stdio": mcp_outcome(self.stdio(tool, arguments, binding)),
            "http": mcp_outcome(self.http(tool, arguments, binding)),
        }

    def call_raw(
        self, tool: str, arguments_json: bytes, binding: Binding | None = None
    ) -> dict[str, Outcome]:
        """The same call with its arguments as exact JSON text (duplicate keys, ``-0``...)."""
        b = binding or Binding()
        params = {"tool": tool, "workspace": str(self.workspace), "headless": b.headless}
        if b.mode is not None:
            params["mode"] = b.mode
        native = json.dumps(params)[:-1].encode() + b', "arguments": ' + arguments_json + b"}"
        native_line = b'{"jsonrpc": "2.0", "id": 7, "method": "invoke", "params": ' + native
        native_line += b"}\n"
        mcp = (
            b'{"jsonrpc": "2.0", "id": 0, "method": "tools/call", "params": {"name": '
            + json.dumps(tool).encode()
            + b', "arguments": '
            + arguments_json
            + b"}}"
        )
        return {
            "native": native_outcome(self.native(tool, None, b, raw=native_line)),
            "stdio": mcp_outcome(self.stdio(tool, None, b, raw=mcp + b"\n")),
            "http": mcp_outcome(self.http(tool, None, b, raw=mcp)),
        }


def disagreement(outcomes: dict[str, Outcome], workspace: Path) -> str | None:
    """None when the faces agree; else each face's outcome, for the failure message."""
    seen = {
        face: (*o.same()[:2], o.same()[2].replace(str(workspace), "<ws>"))
        for face, o in outcomes.items()
    }
    if len(set(seen.values())) == 1:
        return None
    return "\n".join(f"{face}: {value!r:.600}" for face, value in seen.items())
