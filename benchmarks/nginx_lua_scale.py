"""Benchmark: NGINX in Lua mode at scale, through the transport the adapter uses.

Starts Debian's NGINX (2 workers) with the `nginx-config` snippet on 127.0.0.1 and two local
backends, loads N maps of 4 backends in one batch, then changes one map at a time (its weight moves
from backend A to backend B) and times, per change, the confirmed write and the moment a request
through NGINX first lands on B. Also: read-back times (a sidecar's first, and a resync's), table
bytes (and the change log's share), NGINX RSS, master and worker PIDs before and after (no
reloads), and a restart restored. Everything is stopped at the end.

    python benchmarks/nginx_lua_scale.py --maps 10000 --changes 200
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from adapters.nginx.lua import LuaTransport  # noqa: E402
from adapters.nginx.lua_render import LuaRenderer  # noqa: E402
from publisher.core.values import Backend, MapKey, Route  # noqa: E402
from tests.adapters.nginx_fixtures import running_lua_nginx  # noqa: E402
from tests.gateways import BACKEND_HEADER, Backends  # noqa: E402


def _rss_mb(pids: list[int]) -> float:
    total = 0
    for pid in pids:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                total += int(line.split()[1])
    return total / 1024


def _percentile(values: list[float], fraction: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(fraction * (len(ordered) - 1))))]


def _route(index: int, a: str, b: str, to_b: bool) -> Route:
    # Two unused backends with weight 0 make every map the 4-backend size the issue measured.
    return Route(f"model-{index}.example.com", (
        Backend("worker-a", a, 0 if to_b else 1), Backend("worker-b", b, 1 if to_b else 0),
        Backend("worker-c", "http://127.0.0.1:9", 0), Backend("worker-d", "http://127.0.0.1:10", 0),
    ))  # fmt: skip


async def main(maps: int, changes: int) -> None:
    renderer = LuaRenderer()
    with tempfile.TemporaryDirectory(prefix="nginx-lua-scale-") as tmp:
        async with Backends(("a", "b")) as backends, running_lua_nginx(Path(tmp), shared_dict_size="32m") as nginx:
            a, b = backends.endpoint("a"), backends.endpoint("b")
            transport = LuaTransport(nginx.options())
            parts = {MapKey(f"ns-{i % 100}", f"model-{i}"): renderer.render(MapKey("", ""), _route(i, a, b, False)) for i in range(maps)}
            try:
                await transport.read()
                started = time.perf_counter()
                await transport.write(parts, parts)
                load = time.perf_counter() - started
                pids = nginx.pids()
                print(f"maps={maps} backends/map=4 nginx workers={len(pids[1])}", flush=True)
                print(f"load the whole table: {load:.3f} s (one batch, confirmed)", flush=True)
                stats = transport.stats
                used = stats.bytes_used or 0
                print(f"table bytes used: {used / 1e6:.2f} MB of {(stats.bytes_capacity or 0) / 1e6:.1f} MB ({used / maps:.0f} B/map)")
                fresh = LuaTransport(nginx.options())  # a sidecar that just started
                try:
                    started = time.perf_counter()
                    served = await fresh.read()
                    print(f"read-back of every map: {time.perf_counter() - started:.3f} s ({len(served)} maps)", flush=True)
                finally:
                    await fresh.aclose()
                started = time.perf_counter()
                await transport.read()
                print(f"read-back by the sidecar that wrote it (a resync, nothing changed): {time.perf_counter() - started:.3f} s", flush=True)

                writes, visible = [], []
                connector = aiohttp.TCPConnector(limit=1)
                async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=10)) as session:
                    for n in range(changes):
                        index = (n * 7919) % maps
                        key = MapKey(f"ns-{index % 100}", f"model-{index}")
                        host = f"model-{index}.example.com"
                        # Each change moves a map not changed before from A to B (7919 is prime).
                        part = renderer.render(key, _route(index, a, b, True))
                        parts[key] = part
                        started = time.perf_counter()
                        await transport.write(parts, {key: part})
                        writes.append(time.perf_counter() - started)
                        for _ in range(1000):  # bounded: a change not visible after 1,000 requests fails the run
                            async with session.get(nginx.url, headers={"Host": host}) as response:
                                await response.read()
                                if response.headers.get(BACKEND_HEADER) == "b":
                                    break
                        else:
                            raise SystemExit(f"change {n} never became visible")
                        visible.append(time.perf_counter() - started)
                ms = 1000
                print(f"{changes} changes, confirmed write p50/p99/max: {_percentile(writes, .5) * ms:.1f} / "
                      f"{_percentile(writes, .99) * ms:.1f} / {max(writes) * ms:.1f} ms")  # fmt: skip
                print(f"  write to visible in routing p50/p99/max: {_percentile(visible, .5) * ms:.1f} / "
                      f"{_percentile(visible, .99) * ms:.1f} / {max(visible) * ms:.1f} ms")  # fmt: skip
                logged = (transport.stats.bytes_used or 0) - used
                print(f"table bytes used after the changes: {(used + logged) / 1e6:.2f} MB (+{logged / 1e3:.0f} kB, "
                      f"the change log of the last {min(changes, 1024)} batches)")  # fmt: skip
                after = nginx.pids()
                print(f"reloads: {'none (master and worker PIDs unchanged)' if after == pids else f'PIDs changed {pids} -> {after}'}")
                print(f"NGINX RSS (master + workers): {_rss_mb([after[0], *after[1]]):.0f} MB")

                pushes = transport.stats.pushes
                await nginx.restart()
                started = time.perf_counter()
                serving = asyncio.create_task(transport.serve())
                try:
                    while transport.stats.restarts_detected == 0 or transport.stats.pushes == pushes:
                        await asyncio.sleep(0.005)
                        if time.perf_counter() - started > 30:
                            raise SystemExit(f"the table was not restored within 30 s: {transport.stats} {transport.unready()}")
                finally:
                    serving.cancel()
                    await asyncio.gather(serving, return_exceptions=True)
                print(f"NGINX restarted: table of {maps} maps restored {time.perf_counter() - started:.3f} s after the new master was up")
            finally:
                await transport.aclose()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--maps", type=int, default=10_000)
    parser.add_argument("--changes", type=int, default=200, help="at most --maps")
    arguments = parser.parse_args()
    asyncio.run(main(arguments.maps, arguments.changes))
