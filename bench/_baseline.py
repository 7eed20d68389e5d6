"""The baseline servers: minimal orjson + asyncio NDJSON servers on a Unix socket.

``python -m bench._baseline --socket S --mode status|spawn``

* ``status``: parse each request line with orjson and answer a canned status-like result
  (the same fields as toolsetd's ``status``), the "orjson NDJSON echo" of goal 3.
* ``spawn``: for each request, spawn ``/bin/true`` with three pipes through
  ``asyncio.create_subprocess_exec`` (default child watcher), ``communicate()`` (drains
  both output pipes and waits), and answer a small result: goal 1's "receive request,
  spawn with pipes, answer" loop. No notifications, no validation, no policy.

It is what one would write first: ``asyncio.start_unix_server`` and ``readline``, one
task per connection, requests on a connection answered in order. Plain asyncio loop
(never uvloop, like the daemon). It stops on SIGTERM.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
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
                    proc = await asyncio.create_subprocess_exec(
                        "/bin/true",
                        stdin=asyncio.subprocess.PIPE,
                        stdout=asyncio.subprocess.PIPE,
                        stderr=asyncio.subprocess.PIPE,
                    )
                    out, _ = await proc.communicate()
                    result = {
                        "status": "ok" if proc.returncode == 0 else "error",
                        "exitCode": proc.returncode,
                        "content": [{"type": "text", "text": out.decode()}],
                        "isError": proc.returncode != 0,
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--socket", required=True)
    parser.add_argument("--mode", choices=["status", "spawn"], default="status")
    args = parser.parse_args()
    asyncio.run(_serve(args.socket, args.mode))


if __name__ == "__main__":
    main()
