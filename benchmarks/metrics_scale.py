"""/metrics at scale: series and bytes per scrape for each --metrics-per-map policy.

    python benchmarks/metrics_scale.py --maps 10000 --held 1000

N maps of 4 entries go through the loop's real decide-and-apply path (in-process, in-memory
adapter); `--held` of them carry a wrong weight and are held. For each policy it serves /metrics
on 127.0.0.1, scrapes it plain and gzipped, and prints series, bytes, scrape time and the longest
the event loop stalled during the scrapes (a 1 ms ticker). Everything stops at the end.
"""

from __future__ import annotations

import argparse
import logging
import asyncio
import sys
import time
from pathlib import Path

import aiohttp

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from publisher import metrics  # noqa: E402
from publisher.loop import LoopOptions, Publisher  # noqa: E402
from publisher.loop.sidecar import serve, start_server  # noqa: E402
from publisher.core.model import parse_traffic_map  # noqa: E402
from publisher.source.objects import parse_isvc  # noqa: E402
from publisher.source.store import Stores  # noqa: E402
from tests.builders import make_entry, make_isvc, make_map  # noqa: E402
from tests.fakes.memory_adapter import memory_engine  # noqa: E402
from tests.gateways import free_port  # noqa: E402


async def loaded_publisher(maps: int, held: int) -> Publisher:
    stores = Stores.empty()
    engine, _ = memory_engine()
    publisher = Publisher(stores, engine, LoopOptions(adapter_name=engine.name))
    isvc = parse_isvc(make_isvc("m", host=None))  # each map its own hostname, from the template
    assert isvc is not None
    entries = [make_entry(f"worker-{j}", allocated=1, ready=1, weight=1) for j in range(4)]
    wrong = [{**entries[0], "weight": 7}, *entries[1:]]
    for i in range(maps):
        tm = parse_traffic_map(make_map(f"m{i:05d}", entries=wrong if i < held else entries))
        stores.maps.upsert(tm.key, tm, "1")
        stores.isvcs.upsert(tm.key, isvc, "1")
    await publisher.sync_once(dict.fromkeys(stores.maps.keys()))
    return publisher


async def scrape(session: aiohttp.ClientSession, url: str, encoding: str) -> tuple[bytes, float]:
    started = time.perf_counter()
    async with session.get(url, headers={"Accept-Encoding": encoding}, auto_decompress=False) as response:
        body = await response.read()
    return body, time.perf_counter() - started


async def measure(policy: str, maps: int, held: int) -> str:
    metrics.start("memory")
    metrics.per_map(policy)  # type: ignore[arg-type]
    publisher = await loaded_publisher(maps, held)
    port = free_port()
    server = asyncio.create_task(serve(await start_server(metrics.make_app(publisher), "127.0.0.1", port)))
    stall = 0.0

    async def ticker() -> None:
        nonlocal stall
        while True:
            before = time.perf_counter()
            await asyncio.sleep(0.001)
            stall = max(stall, time.perf_counter() - before - 0.001)

    try:
        async with aiohttp.ClientSession() as session:
            url = f"http://127.0.0.1:{port}/metrics"
            for _ in range(50):
                try:
                    await scrape(session, url, "identity")
                    break
                except aiohttp.ClientError:
                    await asyncio.sleep(0.1)
            ticking = asyncio.create_task(ticker())
            plain, plain_time = await scrape(session, url, "identity")
            zipped, _ = await scrape(session, url, "gzip")
            ticking.cancel()
    finally:
        server.cancel()
        await asyncio.gather(server, return_exceptions=True)
    series = sum(1 for line in plain.decode().splitlines() if line and not line.startswith("#"))
    return (f"| {policy} | {maps:,} ({held:,} held) | {series:,} | {len(plain) / 1024:,.0f} KB | {len(zipped) / 1024:,.0f} KB "
            f"| {plain_time * 1000:,.0f} ms | {stall * 1000:,.1f} ms |")


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--maps", type=int, default=10_000)
    parser.add_argument("--held", type=int, default=0)
    args = parser.parse_args()
    logging.disable(logging.WARNING)  # one "map held" line per held map says nothing here
    print("| --metrics-per-map | maps | series | scrape | gzipped | scrape time | longest loop stall |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for policy in metrics.PER_MAP_CHOICES:
        print(await measure(policy, args.maps, args.held), flush=True)


if __name__ == "__main__":
    asyncio.run(main())
