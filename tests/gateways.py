"""Shared by the real-gateway tests: local backends standing in for workload clusters, and the
Gateway API conformance way of measuring a split (N requests, shares within a tolerance, exactly
zero for a weight-0 backend). Everything listens on 127.0.0.1, on free ports."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import socket
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field

import aiohttp
from aiohttp import web

BACKEND_HEADER = "x-ome-backend"


_HANDED_OUT: set[int] = set()


def free_port() -> int:
    """A port free on 127.0.0.1 now, and never one this process handed out before: the kernel may
    give a just-released port again, and a test that took two for two servers then started both on
    one (the README recipe's Envoy found its listener taken by the sidecar's)."""
    while True:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        if port not in _HANDED_OUT:
            _HANDED_OUT.add(port)
            return port


@contextlib.contextmanager
def taken_port() -> Iterator[int]:
    """A port on 127.0.0.1 another socket listens on while the block runs: an address in use."""
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", free_port()))
        holder.listen()
        yield holder.getsockname()[1]


@dataclass
class Backends:
    """HTTP servers named after clusters; each answers 200 with its name and counts what it got."""

    names: tuple[str, ...]
    ports: dict[str, int] = field(default_factory=dict)
    hits: collections.Counter[str] = field(default_factory=collections.Counter)
    host_headers: dict[str, collections.Counter[str]] = field(default_factory=dict)
    _runners: list[web.AppRunner] = field(default_factory=list)

    def endpoint(self, name: str) -> str:
        return f"http://127.0.0.1:{self.ports[name]}"

    async def __aenter__(self) -> Backends:
        for name in self.names:
            app = web.Application()
            app.router.add_route("*", "/{tail:.*}", self._handler(name))
            runner = web.AppRunner(app, access_log=None)
            await runner.setup()
            site = web.TCPSite(runner, "127.0.0.1", 0)
            await site.start()
            self._runners.append(runner)
            self.ports[name] = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
            self.host_headers[name] = collections.Counter()
        return self

    async def __aexit__(self, *exc: object) -> None:
        for runner in self._runners:
            await runner.cleanup()

    def _handler(self, name: str):
        async def handle(request: web.Request) -> web.Response:
            self.hits[name] += 1
            self.host_headers[name][request.headers.get("Host", "")] += 1
            return web.Response(text=name, headers={BACKEND_HEADER: name})

        return handle


async def measure(url: str, host: str, requests: int, *, concurrency: int = 16) -> collections.Counter[str]:
    """Send `requests` GETs to `url` with Host `host`; count answers by backend name, or by
    `status:<code>` for answers no backend gave. Bounded in count; each request has a timeout."""
    counts: collections.Counter[str] = collections.Counter()
    queue: asyncio.Queue[int] = asyncio.Queue()
    for i in range(requests):
        queue.put_nowait(i)
    timeout = aiohttp.ClientTimeout(total=10)
    # A fresh connection per request: NGINX and Envoy pick the backend per request either way,
    # and no keep-alive state can hide a reload.
    connector = aiohttp.TCPConnector(force_close=True, limit=concurrency)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:

        async def worker() -> None:
            while True:
                try:
                    queue.get_nowait()
                except asyncio.QueueEmpty:
                    return
                async with session.get(url, headers={"Host": host}) as response:
                    await response.read()
                    backend = response.headers.get(BACKEND_HEADER)
                    counts[backend if backend else f"status:{response.status}"] += 1

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return counts


def assert_split(counts: Mapping[str, int], weights: Mapping[str, int], *, tolerance: float = 0.05) -> None:
    """Each backend's share within `tolerance` of its weight's share; weight 0 gets exactly 0."""
    total = sum(counts.values())
    weight_sum = sum(weights.values())
    assert total > 0, "no requests were answered"
    strays = {k: v for k, v in counts.items() if k not in weights}
    assert not strays, f"answers from outside the map: {strays}"
    for name, weight in weights.items():
        got = counts.get(name, 0)
        if weight == 0:
            assert got == 0, f"{name} has weight 0 but got {got} of {total} requests"
            continue
        share, want = got / total, weight / weight_sum
        assert abs(share - want) <= tolerance, f"{name}: share {share:.3f}, want {want:.3f} ±{tolerance} ({dict(counts)})"


async def eventually(condition, *, timeout: float = 10.0, interval: float = 0.05):
    """Poll an (async or plain) condition until it returns a truthy value; fail after `timeout`."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    last: object = None
    while True:
        last = condition()
        if asyncio.iscoroutine(last):
            last = await last
        if last:
            return last
        if loop.time() > deadline:
            raise AssertionError(f"condition not met within {timeout}s (last value: {last!r})")
        await asyncio.sleep(interval)


async def assert_measured_split(url: str, host: str, weights: Mapping[str, int], requests: int = 1000, *,
                                attempts: int = 3, tolerance: float = 0.05) -> None:
    """The Gateway API conformance way: measure `requests`, and measure again (up to `attempts`)
    only when a share falls outside the tolerance by chance. A request to a weight-0 backend, or
    to a backend outside the map, fails at once: no retry can excuse it."""
    for attempt in range(1, attempts + 1):
        counts = await measure(url, host, requests)
        strays = {k: v for k, v in counts.items() if weights.get(k, 0) == 0 and v}
        assert not strays, f"requests to backends that must get none: {strays}"
        try:
            assert_split(counts, weights, tolerance=tolerance)
            return
        except AssertionError:
            if attempt == attempts:
                raise
