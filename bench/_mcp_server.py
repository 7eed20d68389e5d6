"""A tiny MCP server (MCP Python SDK, ``MCPServer``) over stdio, for ``bench_mcp``.

Runs under the interpreter that has ``mcp`` (``BENCH_MCP_PYTHON``), never the project venv:
``python bench/_mcp_server.py [--tools N]``.

Tool ``noop`` runs ``/bin/true`` through ``asyncio.create_subprocess_exec`` with three pipes
and ``communicate()`` (what the minimal baseline of ``bench_invoke`` does). ``--tools N``
registers N - 1 more tools ``t00001`` ... each with a small schema distinct from the others
(one string parameter named after the tool and an optional integer), like the sets of
``bench_catalog``.
"""

from __future__ import annotations

import argparse
import asyncio

from mcp.server.mcpserver import MCPServer


async def noop() -> str:
    """Runs /bin/true."""
    proc = await asyncio.create_subprocess_exec(
        "/bin/true",
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, _ = await proc.communicate()
    return out.decode() or f"exit {proc.returncode}"


def build(n_tools: int) -> MCPServer:
    server = MCPServer("bench", log_level="WARNING")
    server.add_tool(noop, name="noop", description="Runs /bin/true.")
    namespace: dict[str, object] = {}
    source = "\n".join(
        f"async def t{i:05d}(p{i}: str, count: int = 0) -> str:\n"
        f"    '''Tool number {i}.'''\n"
        f"    return 'ok'\n"
        for i in range(1, n_tools)
    )
    exec(source, namespace)  # noqa: S102 - generating N distinct signatures
    for i in range(1, n_tools):
        server.add_tool(namespace[f"t{i:05d}"], name=f"t{i:05d}", description=f"Tool number {i}.")  # type: ignore[arg-type]
    return server


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tools", type=int, default=1)
    args = parser.parse_args()
    import anyio

    anyio.run(build(args.tools).run_stdio_async)


if __name__ == "__main__":
    main()
