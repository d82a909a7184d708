"""The floor under the sidecar's status write: what a bare client's CPU pays for one condition
written as the sidecar writes it (server-side apply of one condition on trafficmaps/status, the
whole object decoded from the answer), nothing else. compare.py's bare watch only reads, so it is
no floor for a sidecar with status on; this number added to it is (issue 29).

    python benchmarks/status_floor.py --maps 1000 --writes 2000 [--client bare|sidecar|both]

The fake API server (compare.py's, loaded as OME writes) runs in its own process; the writes go
8 at a time over one aiohttp session; the client's CPU is its process time over the writes.
`--client sidecar` writes the same conditions through the sidecar's own `write_condition` and
Kube client instead, so the distance to the floor is measured too.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent))

import compare  # noqa: E402

CONCURRENCY = 8
REGION = "default"


async def measure(maps: int, writes: int, client: str) -> dict:
    work = Path(tempfile.mkdtemp(prefix="status-floor-"))
    async with contextlib.AsyncExitStack() as stack:
        fake = await compare.spawn(stack, sys.executable, str(Path(compare.__file__).resolve()), "_fake", str(maps), "dns",
                                   log=work / "fake.log", stdout=asyncio.subprocess.PIPE)
        url = (await asyncio.wait_for(fake.stdout.readline(), 300)).decode().split()[0]
        limit = asyncio.Semaphore(CONCURRENCY)
        write = await (sidecar_writer(stack, work, url) if client == "sidecar" else bare_writer(stack, url))

        async def one(seq: int) -> None:
            async with limit:
                await write(seq % maps, seq)

        await asyncio.gather(*(one(seq) for seq in range(min(200, writes))))  # warm: connections, first condition
        cpu, wall = time.process_time(), time.monotonic()
        await asyncio.gather(*(one(seq) for seq in range(writes)))
        cpu, wall = time.process_time() - cpu, time.monotonic() - wall
    return {"client": client, "maps": maps, "writes": writes, "client_cpu_ms_per_write": round(1000 * cpu / writes, 3),
            "wall_ms_per_write": round(1000 * wall / writes, 3)}


async def bare_writer(stack: contextlib.AsyncExitStack, url: str) -> Callable[[int, int], Awaitable[None]]:
    """compare.py's bare status writer over one aiohttp session."""
    session = await stack.enter_async_context(aiohttp.ClientSession())
    return compare.bare_status_writer(session, url, "condition", REGION)


async def sidecar_writer(stack: contextlib.AsyncExitStack, work: Path, url: str) -> Callable[[int, int], Awaitable[None]]:
    """The sidecar's own path: `publisher.status.write_condition` over its Kube client."""
    from publisher import status
    from publisher.core.values import MapKey
    from publisher.kube import Kube
    from tests.fakes.kube_api import write_kubeconfig

    kube = await Kube.connect(write_kubeconfig(work / "kubeconfig", url))
    stack.push_async_callback(kube.close)

    async def write(index: int, seq: int) -> None:
        condition = compare.condition_body(index, seq, REGION)["status"]["conditions"][0]
        await status.write_condition(kube, MapKey(compare.NAMESPACE, compare.map_name(index)), condition, REGION)

    return write


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--maps", type=int, default=1000)
    parser.add_argument("--writes", type=int, default=2000)
    parser.add_argument("--client", default="bare", help="bare, sidecar or both: a bare aiohttp client, or the sidecar's own write path")
    args = parser.parse_args()
    for client in ("bare", "sidecar") if args.client == "both" else (args.client,):
        print("JSON " + json.dumps(asyncio.run(measure(args.maps, args.writes, client))), flush=True)


if __name__ == "__main__":
    main()
