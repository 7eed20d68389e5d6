"""The official MCP SDK's Streamable HTTP server, run beside the daemon as the oracle for
behaviour the spec leaves loose: ``python sdk_oracle_server.py`` prints its port, then
serves ``/mcp`` on 127.0.0.1 (stateful sessions, SSE answers: the SDK's defaults) until
killed."""

from __future__ import annotations

import socket

import uvicorn
from mcp.server.mcpserver import MCPServer


def main() -> None:
    server = MCPServer("oracle")

    @server.tool()
    def echo(text: str) -> str:
        """Echo the text."""
        return text

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(64)
    print(sock.getsockname()[1], flush=True)  # noqa: T201 - the port, for the test that started it
    config = uvicorn.Config(server.streamable_http_app(), log_level="warning")
    uvicorn.Server(config).run(sockets=[sock])


if __name__ == "__main__":
    main()
