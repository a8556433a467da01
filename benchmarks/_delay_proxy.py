"""A TCP proxy that delays every chunk by DELAY ± JITTER seconds each way, in order.

Usage: ``python _delay_proxy.py LISTEN_HOST:PORT TARGET_HOST:PORT DELAY JITTER``. Used by
``slow_store_init.py`` to put the rendezvous store of one simulated host behind a slow link
(this machine's kernel has no netem). Prints ``listening`` once it accepts.
"""

from __future__ import annotations

import asyncio
import random
import sys
import time


async def _pump(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, delay: float,
                jitter: float) -> None:
    queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()
    last = 0.0

    async def deliver() -> None:
        while True:
            due, data = await queue.get()
            if not data:
                writer.close()
                return
            await asyncio.sleep(max(0.0, due - time.monotonic()))
            writer.write(data)
            await writer.drain()

    task = asyncio.ensure_future(deliver())
    try:
        while True:
            data = await reader.read(65536)
            jitter_s = random.uniform(-jitter, jitter)  # noqa: S311 - a delay, not a secret
            last = max(last, time.monotonic() + delay + jitter_s)
            await queue.put((last, data))
            if not data:
                break
        await task
    except (ConnectionError, OSError):
        task.cancel()
        writer.close()


async def _serve(listen: str, target: str, delay: float, jitter: float) -> None:
    thost, _, tport = target.rpartition(":")

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_r, up_w = await asyncio.open_connection(thost, int(tport))
        except OSError:
            writer.close()
            return
        await asyncio.gather(_pump(reader, up_w, delay, jitter),
                             _pump(up_r, writer, delay, jitter), return_exceptions=True)

    host, _, port = listen.rpartition(":")
    server = await asyncio.start_server(handle, host, int(port))
    print("listening", flush=True)
    async with server:
        await server.serve_forever()


if __name__ == "__main__":
    asyncio.run(_serve(sys.argv[1], sys.argv[2], float(sys.argv[3]), float(sys.argv[4])))
