"""What a client sees: a fresh request through the real gateway, answered by the new backend.

compare.py's `_prober` process runs two backends, A and B, that answer every request with their
letter, and listens for notices from the sender: one line `SEQ MAP VERSION HOST` per change, sent just
after the change's stamp and before its first API write (the first line names the gateway,
`gateway HOST:PORT`). With `flip` endpoints (compare.entries) version v of a map routes every
request to backend A when v is even and to B when it is odd, so one answer from the expected
backend shows the change served. Per change a probe sends `GET /` with the map's Host header over
a kept-alive connection every PERIOD (at once again when a request took longer), until the answer
comes from the new backend, a later change of the same map takes over (then the later one's time
counts for both: it confirms every earlier one), or LIMIT passes. On SIGTERM it writes
`{seq: wall time the answer arrived}` and its counts as JSON.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import sys
import time
from pathlib import Path
from typing import Any

PERIOD = 0.001  # seconds between one probe's requests
LIMIT = 60.0  # seconds a probe gives up after


def letter(version: int) -> bytes:
    return b"A" if version % 2 == 0 else b"B"


def flip_endpoints(style: str) -> tuple[int, int] | None:
    """The backends' ports of a `flip:PORT_A:PORT_B` endpoint style, else None."""
    if not style.startswith("flip:"):
        return None
    _, a, b = style.split(":")
    return int(a), int(b)


async def _backend(name: bytes, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    body = b"HTTP/1.1 200 OK\r\nContent-Length: 1\r\nContent-Type: text/plain\r\n\r\n" + name
    with contextlib.suppress(ConnectionError, asyncio.IncompleteReadError):
        while True:
            head = await reader.readuntil(b"\r\n\r\n")
            length = _content_length(head)
            if length:
                await reader.readexactly(length)
            writer.write(body)
            await writer.drain()
    writer.close()


def _content_length(head: bytes) -> int:
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            return int(line.split(b":", 1)[1])
    return 0


class Prober:
    def __init__(self) -> None:
        self.gateway: tuple[str, int] | None = None
        self.served: dict[int, float] = {}  # seq -> wall time the new backend's answer arrived
        self.latest: dict[int, int] = {}  # map -> the latest change's seq
        self.waiting: dict[int, list[int]] = {}  # map -> seqs not yet served
        self.requests = 0
        self.errors = 0
        self.gave_up = 0
        self.tasks: set[asyncio.Task[None]] = set()

    async def notices(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while line := await reader.readline():
            parts = line.decode().split()
            if parts[0] == "gateway":
                host, _, port = parts[1].rpartition(":")
                self.gateway = (host, int(port))
                continue
            seq, index, version, host = int(parts[0]), int(parts[1]), int(parts[2]), parts[3]
            self.latest[index] = seq
            self.waiting.setdefault(index, []).append(seq)
            task = asyncio.create_task(self.probe(seq, index, version, host))
            self.tasks.add(task)
            task.add_done_callback(self.tasks.discard)
        writer.close()

    async def probe(self, seq: int, index: int, version: int, host: str) -> None:
        assert self.gateway is not None
        request = f"GET / HTTP/1.1\r\nHost: {host}\r\nUser-Agent: bench-prober\r\n\r\n".encode()
        want, deadline = letter(version), time.monotonic() + LIMIT
        connection: tuple[asyncio.StreamReader, asyncio.StreamWriter] | None = None
        try:
            while self.latest.get(index) == seq and time.monotonic() < deadline:
                started = time.monotonic()
                try:
                    if connection is None:
                        connection = await asyncio.open_connection(*self.gateway)
                    reader, writer = connection
                    writer.write(request)
                    head = await reader.readuntil(b"\r\n\r\n")
                    body = await reader.readexactly(_content_length(head))
                    at = time.time()
                    self.requests += 1
                    if b"connection: close" in head.lower():
                        writer.close()
                        connection = None
                except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ValueError):
                    self.errors += 1
                    if connection is not None:
                        connection[1].close()
                    connection = None
                    body, at = b"", 0.0
                if body == want:
                    for earlier in self.waiting.pop(index, []):
                        self.served.setdefault(earlier, at)
                    return
                await asyncio.sleep(max(0.0, started + PERIOD - time.monotonic()))
            if self.latest.get(index) == seq:
                self.gave_up += 1
        finally:
            if connection is not None:
                connection[1].close()

    def report(self) -> dict[str, Any]:
        return {"served": self.served, "requests": self.requests, "errors": self.errors, "gave_up": self.gave_up}


async def role_prober(out: Path) -> None:
    """Prints `PORT_A PORT_B NOTICE_PORT`, serves until SIGTERM, then writes its report to `out`."""
    a = await asyncio.start_server(lambda r, w: _backend(b"A", r, w), "127.0.0.1", 0)
    b = await asyncio.start_server(lambda r, w: _backend(b"B", r, w), "127.0.0.1", 0)
    prober = Prober()
    notices = await asyncio.start_server(prober.notices, "127.0.0.1", 0)
    ports = [server.sockets[0].getsockname()[1] for server in (a, b, notices)]
    print(*ports, flush=True)
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    await stop.wait()
    for task in list(prober.tasks):
        task.cancel()
    await asyncio.gather(*prober.tasks, return_exceptions=True)
    out.write_text(json.dumps(prober.report()))
    sys.stdout.flush()
