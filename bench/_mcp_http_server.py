"""The MCP Python SDK's own Streamable HTTP server (``MCPServer``), for ``bench_mcp_http``.

``python bench/_mcp_http_server.py PORT [--sse]``: the ``noop`` tool of ``_mcp_server``
(``/bin/true`` through ``asyncio.create_subprocess_exec``) served at
``http://127.0.0.1:PORT/mcp`` by uvicorn, with sessions, answering JSON (its faster
mode) unless ``--sse``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import anyio

from bench._mcp_server import build


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("port", type=int)
    parser.add_argument("--sse", action="store_true")
    args = parser.parse_args()
    server = build(1)
    anyio.run(
        lambda: server.run_streamable_http_async(
            host="127.0.0.1", port=args.port, json_response=not args.sse
        )
    )


if __name__ == "__main__":
    main()
