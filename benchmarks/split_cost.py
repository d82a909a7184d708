"""Benchmark: what the served-split check costs at scale, on each gateway that counts.

Envoy (xDS mode): the xDS server and a real Envoy on 127.0.0.1, N maps of 4 backends published
in one write, then Envoy's Load Reporting Service reporting every `--interval` seconds: the bytes
of one report, the sidecar's time to fold one (and the longest the event loop was held by it), and
Envoy's CPU per report interval with reports on against a second Envoy run with the bootstrap's
`load_stats_config` left out (the same maps, the same idle window).

NGINX (Lua mode): Debian's NGINX with the `nginx-config` snippet, N maps in its table: the time
one full read of every map's counters takes (pages of `LuaRequestCounts.page_backends` counters) and the
NGINX workers' CPU it costs; and NGINX's CPU per request with the counter (counted at the pick) against
`nginx-config --counts-dict-size off`, over the same requests. Everything is stopped at the end.

The judge step (in-process, no gateway): `SplitVerifier.fold` of one read in which every one of the
N maps counted about 2,400 requests, so each is judged: what compare.py cannot show, as it sends no
traffic through the gateway (every counter stays 0 and no window is ever judged).

    python benchmarks/split_cost.py --maps 10000
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from adapters.base import RequestCounts  # noqa: E402
from adapters.envoy.bootstrap import xds_bootstrap  # noqa: E402
from adapters.envoy.process import run_envoy  # noqa: E402
from adapters.envoy.resources import XdsRenderer  # noqa: E402
from adapters.envoy.xds import XdsTransport  # noqa: E402
from adapters.nginx.lua import LuaTransport  # noqa: E402
from adapters.nginx.lua_render import LuaRenderer  # noqa: E402
from benchmarks.xds_scale import _free_port, _key, _route  # noqa: E402
from publisher.core.values import Backend, MapKey, Route  # noqa: E402
from publisher.split.check import SplitVerifier  # noqa: E402
from tests.adapters.nginx_fixtures import running_lua_nginx  # noqa: E402
from tests.gateways import Backends, measure  # noqa: E402

TICK = os.sysconf("SC_CLK_TCK")


def _cpu_seconds(pids: list[int]) -> float:
    total = 0
    for pid in pids:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        total += int(fields[11]) + int(fields[12])  # utime, stime
    return total / TICK


class LoopLag:
    """The longest the event loop was held between two ticks of a 1 ms timer."""

    def __init__(self) -> None:
        self.worst = 0.0
        self._task: asyncio.Task[None] | None = None

    async def _run(self) -> None:
        while True:
            before = time.perf_counter()
            await asyncio.sleep(0.001)
            self.worst = max(self.worst, time.perf_counter() - before - 0.001)

    def __enter__(self) -> LoopLag:
        self._task = asyncio.get_running_loop().create_task(self._run())
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._task is not None
        self._task.cancel()


async def _envoy_run(maps: int, interval: float, reports: int, load_stats: bool) -> dict[str, float]:
    renderer = XdsRenderer()
    transport = XdsTransport("127.0.0.1:0", renderer)
    counter = transport.request_counter
    counter.enable(interval)
    serving = asyncio.create_task(transport.serve())
    try:
        port = await transport.started()
        with tempfile.TemporaryDirectory(prefix="split-cost-") as tmp:
            listen, admin = _free_port(), _free_port()
            boot = Path(tmp) / "bootstrap.yaml"
            boot.write_text(
                xds_bootstrap(xds_host="127.0.0.1", xds_port=port, listen_host="127.0.0.1", listen_port=listen,
                              admin_host="127.0.0.1", admin_port=admin, load_stats=load_stats)
            )  # fmt: skip
            async with run_envoy(boot, admin_url=f"http://127.0.0.1:{admin}", log_path=Path(tmp) / "envoy.log", ready_timeout=60) as envoy:
                while transport.unready() is not None:
                    await asyncio.sleep(0.01)
                parts = {_key(i): renderer.render(_key(i), _route(i, (1, 1, 1, 1))) for i in range(maps)}
                assert not (await transport.write(parts, parts)).rejected
                # Envoy lists new clusters from the report after the one that first sees them.
                await asyncio.sleep(2 * interval)
                await counter.collect()
                folded, seconds, size = counter.reports, counter.fold_seconds, counter.report_bytes
                cpu = _cpu_seconds([envoy.process.pid])
                with LoopLag() as lag:
                    await asyncio.sleep(reports * interval)
                cpu = _cpu_seconds([envoy.process.pid]) - cpu
                got = counter.reports - folded
                return {
                    "reports": got,
                    "bytes": (counter.report_bytes - size) / got if got else 0.0,
                    "fold_ms": (counter.fold_seconds - seconds) / got * 1000 if got else 0.0,
                    "lag_ms": lag.worst * 1000,
                    "envoy_cpu_per_interval_ms": cpu / reports * 1000,
                }
    finally:
        serving.cancel()
        await asyncio.gather(serving, return_exceptions=True)
        await transport.aclose()


def _nginx_route(index: int, a: str, b: str) -> Route:
    return Route(f"model-{index}.example.com", (
        Backend("worker-a", a, 1), Backend("worker-b", b, 1),
        Backend("worker-c", "http://127.0.0.1:9", 0), Backend("worker-d", "http://127.0.0.1:10", 0),
    ))  # fmt: skip


async def _nginx_run(maps: int, requests: int, counts_dict_size: str | None) -> dict[str, float]:
    renderer = LuaRenderer()
    with tempfile.TemporaryDirectory(prefix="split-cost-nginx-") as tmp:
        async with Backends(("a", "b")) as backends, running_lua_nginx(
            Path(tmp), shared_dict_size="32m", counts_dict_size=counts_dict_size
        ) as nginx:
            a, b = backends.endpoint("a"), backends.endpoint("b")
            transport = LuaTransport(nginx.options())
            try:
                parts = {MapKey(f"ns-{i % 100}", f"model-{i}"): renderer.render(MapKey("", ""), _nginx_route(i, a, b)) for i in range(maps)}
                await transport.read()
                await transport.write(parts, parts)
                workers = sorted(nginx.pids()[1])
                counter = transport.request_counter
                counter.enable(60.0)
                if counts_dict_size is not None:
                    await counter.collect()  # the baseline
                cpu = _cpu_seconds(workers)
                await measure(nginx.url, "model-7.example.com", requests)
                per_request = (_cpu_seconds(workers) - cpu) / requests
                result = {"cpu_us_per_request": per_request * 1e6}
                if counts_dict_size is not None:
                    cpu = _cpu_seconds(workers)
                    with LoopLag() as lag:
                        started = time.perf_counter()
                        (report,) = await counter.collect()
                        result["read_s"] = time.perf_counter() - started
                    result["read_nginx_cpu_ms"] = (_cpu_seconds(workers) - cpu) * 1000
                    result["read_lag_ms"] = lag.worst * 1000
                    result["counted"] = sum(report.counts.get(MapKey("ns-7", "model-7"), {}).values())
                return result
            finally:
                await transport.aclose()


async def _judge_run(maps: int, rounds: int = 4) -> dict[str, float]:
    """Each round one report of every map's four backends, 580-620 requests each: the first round
    after a route change is skipped, every later one fills and judges every map's window. The fold's
    time, and the longest it held the event loop."""
    verifier = SplitVerifier(None, 60.0, "nginx", lambda key: None)  # type: ignore[arg-type]
    verifier.clock = lambda: 0.0  # routes confirmed at 0 s; the rounds below are folded at 60 s, 120 s, ...
    keys = [MapKey(f"ns-{i % 100}", f"model-{i}") for i in range(maps)]
    backends = tuple(Backend(f"worker-{b}", "http://10.0.0.1:8000", 1) for b in range(4))
    for i, key in enumerate(keys):
        verifier.route_confirmed(key, Route(f"model-{i}.example.com", backends))
    spread = [580 + (i * 7) % 41 for i in range(4 * maps)]
    # As the sidecar after its first sync (publisher.loop): what is there is frozen, so a collector
    # pass walks only what came after.
    gc.collect()
    gc.freeze()
    seconds, held = [], []
    for round_ in range(rounds):
        counts = {key: {b.cluster: spread[(4 * i + j + round_) % len(spread)] for j, b in enumerate(backends)}
                  for i, key in enumerate(keys)}  # fmt: skip
        with LoopLag() as lag:
            started = time.perf_counter()
            await verifier.fold([RequestCounts("nginx-1", counts)], 60.0 * (round_ + 1))
            seconds.append(time.perf_counter() - started)
        held.append(lag.worst)
    gc.unfreeze()
    return {"skipped_ms": seconds[0] * 1000, "judged_ms": max(seconds[1:]) * 1000, "skipped_held_ms": held[0] * 1000,
            "judged_held_ms": max(held[1:]) * 1000, "verified": verifier.map_states["verified"]}


async def main(maps: int, interval: float, reports: int, requests: int) -> None:
    print(f"maps={maps} backends/map=4 report interval={interval:g}s", flush=True)
    on = await _envoy_run(maps, interval, reports, load_stats=True)
    off = await _envoy_run(maps, interval, reports, load_stats=False)
    print(f"envoy: {on['reports']} reports of {on['bytes'] / 1e6:.2f} MB; sidecar folds one in {on['fold_ms']:.0f} ms "
          f"(event loop held at most {on['lag_ms']:.1f} ms)", flush=True)  # fmt: skip
    print(f"envoy CPU per interval: {on['envoy_cpu_per_interval_ms']:.0f} ms with reports, "
          f"{off['envoy_cpu_per_interval_ms']:.0f} ms without", flush=True)  # fmt: skip
    counting = await _nginx_run(maps, requests, "8m")
    plain = await _nginx_run(maps, requests, None)
    print(f"nginx: one read of every map's counters {counting['read_s']:.3f} s, NGINX workers' CPU "
          f"{counting['read_nginx_cpu_ms']:.0f} ms, event loop held at most {counting['read_lag_ms']:.1f} ms "
          f"({counting['counted']:.0f} of {requests} requests counted on the map sent to)", flush=True)  # fmt: skip
    print(f"nginx CPU per request: {counting['cpu_us_per_request']:.1f} us counting, {plain['cpu_us_per_request']:.1f} us not "
          f"({requests} requests each, fresh connections)", flush=True)  # fmt: skip
    judged = await _judge_run(maps)
    print(f"sidecar: one fold of {maps} busy maps takes {judged['judged_ms']:.0f} ms when every map is judged, holding the event loop "
          f"at most {judged['judged_held_ms']:.1f} ms ({judged['skipped_ms']:.0f} ms and {judged['skipped_held_ms']:.1f} ms for the "
          f"round after a route change, not judged); {judged['verified']:.0f} verified", flush=True)  # fmt: skip


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--maps", type=int, default=10_000)
    parser.add_argument("--interval", type=float, default=5.0, help="Envoy's report interval (the sidecar's floor is 10 s)")
    parser.add_argument("--reports", type=int, default=4, help="report intervals measured per Envoy run")
    parser.add_argument("--requests", type=int, default=5000, help="requests through NGINX per run")
    arguments = parser.parse_args()
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(main(arguments.maps, arguments.interval, arguments.reports, arguments.requests))
