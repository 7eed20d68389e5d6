"""The baseline servers: minimal orjson + asyncio NDJSON servers on a Unix socket or stdio.

``python -m bench._baseline --socket S --mode status|spawn``;
``python bench/_baseline.py --mode mcp-stdio``

* ``status``: parse each request line with orjson and answer a canned status-like result
  (the same fields as toolsetd's ``status``), the "orjson NDJSON echo" of goal 3.
* ``spawn``: for each request, spawn ``/bin/true`` with three pipes through
  ``asyncio.create_subprocess_exec`` (default child watcher), ``communicate()`` (drains
  both output pipes and waits), and answer a small result: goal 1's "receive request,
  spawn with pipes, answer" loop. No notifications, no validation, no policy.

* ``mcp-stdio``: the same spawn loop as an MCP server on stdin/stdout, the floor of the
  MCP face's ``tools/call`` rows (issue 10's table): ``initialize`` answered with a
  canned result, notifications ignored, each ``tools/call`` run in its own task (so
  requests in flight overlap, as in the SDK's server and ours) and answered with the
  child's output as one text block. Anything else is -32601. It stops when stdin closes.

It is what one would write first: ``asyncio.start_unix_server`` and ``readline``, one
task per connection, requests on a connection answered in order. Plain asyncio loop
(never uvloop, like the daemon). It stops on SIGTERM.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys
import time

import orjson

_STARTED = time.monotonic()


def _status(sock: str) -> dict[str, object]:
    return {
        "version": "0.1.0",
        "pid": os.getpid(),
        "uptimeSeconds": round(time.monotonic() - _STARTED, 3),
        "socket": sock,
        "home": "/tmp/home",  # noqa: S108 - a canned value in a reply, never a path we use
        "generation": 1,
        "workspaces": [],
        "inFlight": 0,
        "connections": 1,
    }


async def _spawn_true() -> tuple[int, bytes]:
    proc = await asyncio.create_subprocess_exec(
        "/bin/true",
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, _ = await proc.communicate()
    assert proc.returncode is not None
    return proc.returncode, out


async def _serve(sock: str, mode: str) -> None:
    loads, dumps = orjson.loads, orjson.dumps

    async def status_conn(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while line := await reader.readline():
                msg = loads(line)
                writer.write(
                    dumps({"jsonrpc": "2.0", "id": msg.get("id"), "result": _status(sock)}) + b"\n"
                )
        finally:
            writer.close()

    async def spawn_conn(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while line := await reader.readline():
                msg = loads(line)
                if msg.get("method") == "status":
                    result: object = _status(sock)
                else:
                    code, out = await _spawn_true()
                    result = {
                        "status": "ok" if code == 0 else "error",
                        "exitCode": code,
                        "content": [{"type": "text", "text": out.decode()}],
                        "isError": code != 0,
                    }
                writer.write(
                    dumps({"jsonrpc": "2.0", "id": msg.get("id"), "result": result}) + b"\n"
                )
        finally:
            writer.close()

    handler = status_conn if mode == "status" else spawn_conn
    server = await asyncio.start_unix_server(handler, path=sock, limit=1 << 24)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    async with server:
        await stop.wait()
    try:
        os.unlink(sock)
    except OSError:
        pass


async def _serve_mcp_stdio() -> None:
    loads, dumps = orjson.loads, orjson.dumps
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader(limit=1 << 24)
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    transport, protocol = await loop.connect_write_pipe(
        asyncio.streams.FlowControlMixin, sys.stdout
    )
    writer = asyncio.StreamWriter(transport, protocol, reader, loop)
    tasks: set[asyncio.Task[None]] = set()

    def answer(request_id: object, result: object) -> None:
        writer.write(dumps({"jsonrpc": "2.0", "id": request_id, "result": result}) + b"\n")

    async def call(request_id: object) -> None:
        code, out = await _spawn_true()
        answer(
            request_id, {"content": [{"type": "text", "text": out.decode()}], "isError": code != 0}
        )

    while line := await reader.readline():
        msg = loads(line)
        if "id" not in msg:
            continue  # a notification
        method = msg.get("method")
        if method == "tools/call":
            task = asyncio.create_task(call(msg["id"]))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
        elif method == "initialize":
            answer(
                msg["id"],
                {
                    "protocolVersion": msg["params"]["protocolVersion"],
                    "capabilities": {"tools": {}},
                    "serverInfo": {"name": "floor", "version": "0"},
                },
            )
        else:
            error = {"code": -32601, "message": f"Method not found: {method}"}
            writer.write(dumps({"jsonrpc": "2.0", "id": msg["id"], "error": error}) + b"\n")
    if tasks:
        await asyncio.wait(tasks)
    await writer.drain()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--socket")
    parser.add_argument("--mode", choices=["status", "spawn", "mcp-stdio"], default="status")
    args = parser.parse_args()
    if args.mode == "mcp-stdio":
        asyncio.run(_serve_mcp_stdio())
        return
    if args.socket is None:
        parser.error(f"--mode {args.mode} needs --socket")
    asyncio.run(_serve(args.socket, args.mode))


if __name__ == "__main__":
    main()
