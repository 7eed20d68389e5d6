"""Helpers for the MCP-over-HTTP tests: a daemon with ``--mcp-listen``, raw HTTP requests."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from http.client import HTTPConnection
from pathlib import Path
from typing import Any
from urllib.parse import quote, urlsplit

from .conftest import Daemon, start_daemon

INIT_PARAMS = {
    "protocolVersion": "2025-11-25",
    "capabilities": {},
    "clientInfo": {"name": "toolsetd-tests", "version": "1"},
}
JSON_HEADERS = {"content-type": "application/json", "accept": "application/json, text/event-stream"}


def listening_urls(daemon: Daemon, count: int = 1, timeout: float = 10.0) -> list[str]:
    """The MCP endpoint URLs the daemon logged (``mcp_http_listening``), in order."""
    deadline = time.monotonic() + timeout
    while True:
        urls = [e["url"] for e in daemon.log_events() if e.get("event") == "mcp_http_listening"]
        if len(urls) >= count:
            return urls
        if time.monotonic() > deadline:
            raise AssertionError(f"the daemon logged no MCP URL:\n{daemon.log()}")
        time.sleep(0.02)


def start_http_daemon(
    home: Path, workspace: Path, base: Path, extra: list[str] | None = None
) -> tuple[Daemon, str]:
    """A daemon serving MCP on an ephemeral 127.0.0.1 port; returns it and its base URL."""
    daemon = start_daemon(home, workspace, base, ["--mcp-listen", "127.0.0.1:0", *(extra or [])])
    return daemon, listening_urls(daemon)[0]


def endpoint(url: str, workspace: Path | str | None, **query: str) -> str:
    """The endpoint URL with a workspace (and catalog, mode) in its query."""
    parts = [f"workspace={quote(str(workspace))}"] if workspace is not None else []
    parts += [f"{k}={quote(v)}" for k, v in query.items()]
    return url + ("?" + "&".join(parts) if parts else "")


@dataclass
class HttpReply:
    """One HTTP response, read whole."""

    status: int
    headers: dict[str, str]
    body: bytes

    def json(self) -> Any:
        """The body as JSON."""
        return json.loads(self.body)

    def events(self) -> list[Any]:
        """The JSON messages of an SSE body, in order."""
        found = []
        for block in self.body.decode().split("\n\n"):
            data = [line[5:].strip() for line in block.splitlines() if line.startswith("data:")]
            if data and data[0]:
                found.append(json.loads("\n".join(data)))
        return found

    def messages(self) -> list[Any]:
        """The JSON-RPC messages of the answer, whether it came as JSON or as SSE."""
        if self.headers.get("content-type", "").startswith("text/event-stream"):
            return self.events()
        return [self.json()] if self.body else []


def http(
    url: str, method: str = "POST", body: Any = None, headers: dict[str, str] | None = None,
    timeout: float = 30.0,
) -> HttpReply:
    """One HTTP request on a fresh connection (``body`` as JSON unless bytes)."""
    parts = urlsplit(url)
    conn = HTTPConnection(parts.hostname, parts.port, timeout=timeout)
    try:
        path = parts.path + (f"?{parts.query}" if parts.query else "")
        data = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
        conn.request(method, path, body=data, headers={**JSON_HEADERS, **(headers or {})})
        response = conn.getresponse()
        return HttpReply(
            response.status, {k.lower(): v for k, v in response.getheaders()}, response.read()
        )
    finally:
        conn.close()


def rpc(request_id: Any, method: str, params: dict[str, Any] | None = None) -> dict[str, Any]:
    """A JSON-RPC request object."""
    message: dict[str, Any] = {"jsonrpc": "2.0", "id": request_id, "method": method}
    if params is not None:
        message["params"] = params
    return message


def initialize(url: str) -> str:
    """Open a session (initialize, then initialized); returns its Mcp-Session-Id."""
    reply = http(url, body=rpc(1, "initialize", INIT_PARAMS))
    assert reply.status == 200, reply
    session = reply.headers["mcp-session-id"]
    note = http(url, body={"jsonrpc": "2.0", "method": "notifications/initialized"},
                headers={"mcp-session-id": session})
    assert note.status == 202, note
    return session


@contextmanager
def sdk_oracle() -> Iterator[str]:
    """The official SDK's Streamable HTTP server (``sdk_oracle_server.py``) on 127.0.0.1, as
    the oracle for what the spec leaves loose; yields its endpoint URL, ends it after."""
    script = Path(__file__).with_name("sdk_oracle_server.py")
    proc = subprocess.Popen(
        [sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL
    )
    try:
        assert proc.stdout is not None
        port = proc.stdout.readline().strip().decode()
        assert port.isdigit(), f"the SDK's server printed no port ({proc.poll()})"
        # Listening before it prints: a request made before uvicorn serves waits its turn.
        yield f"http://127.0.0.1:{port}/mcp"
    finally:
        proc.kill()
        proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()
