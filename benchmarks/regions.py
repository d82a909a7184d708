"""R regions' sidecars on one control plane, in one run: what status costs as regions are added (issue 20).

    python benchmarks/regions.py --regions 1,2,5,10 --maps 1000 --rate 20 --seconds 30
    python benchmarks/regions.py --regions 5 --status-mode report          # passed on to every sidecar
    python benchmarks/regions.py --regions 1,2,5 --sidecar-root /tmp/main  # another checkout's sidecar

Per R, all on 127.0.0.1, every process stopped at the end (the pieces are compare.py's):
1. The fake API server in its own process, loaded by server-side apply as OME writes (N
   InferenceServices and N TrafficMaps of 4 entries, with managedFields).
2. R sidecars, `ome-publisher run --region region-<i> --adapter json --json-dir DIR_i` with status on
   (and `--status-mode X` when given), compare.py's bare watcher, and an observer here: a raw watch
   of TrafficMaps that counts events and their bytes and reads every region's condition from them.
3. Start: until every sidecar serves every map, every region's condition says Published (condition
   mode; in another mode, no TrafficMap condition is waited for) and no status write (each
   sidecar's status_writes_total{result="written"}) or condition change came for QUIET seconds.
   "Settled" is the time from the sidecars' start to the last of those writes or changes.
4. compare.py's sender changes --rate maps a second for --seconds: the entries by merge patch
   (stamped), then OME's Routable condition for the new generation by server-side apply. The
   churn ends when every sidecar serves each map's last weights, every region's condition (in
   condition mode) is at its last generation, and status has been quiet for QUIET seconds.

Per change, over the churn: status writes per sidecar (the sidecars' own counters), TrafficMap
watch events (what every watcher receives, the observer counts them), CPU of a sidecar (the mean
over the R), of the bare watcher and of the fake API server; latency stamp -> served (every
sidecar's json file, by inotify), stamp -> decoded by the bare watcher, stamp -> a region's
condition True at the new generation; how long OME's two writes of a change took. One `JSON {...}`
line per R; with several R in the condition mode, the in-process cost of one event of a map at
R = 20 and 50 (`--per-event` measures it alone) and a projection to 10,000 maps and 100 changes/s
there (see project()).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import re
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent))
import compare  # noqa: E402  (the fake, the sender, the bare watcher and the process accounting)
from compare import NAMESPACE, ROOT, TM_PATH, JsonDir, Peak, free_port, observe, percentile, spawn, stop_process  # noqa: E402

CONDITION_PREFIX = "gateway-publisher.ome.io/"
WRITTEN = re.compile(r'^ome_gateway_publisher_status_writes_total\{result="written"\} ([0-9.e+]+)$', re.M)
QUIET = 3.0  # seconds without a status write or condition change: settled
START_LIMIT = 420.0  # seconds a start may take before the run reports it unsettled
TAIL_LIMIT = 120.0  # seconds after the sender for the churn's last updates and status


class SidecarDir(JsonDir):
    """compare.py's json-dir detector, polled less often: R of them share the runner's core."""

    interval = 0.02


class Observer:
    """A raw watch of every TrafficMap: events and bytes received, every region's condition as the
    events show it (status, observedGeneration), when each first read True at each generation, and
    when any of them last changed."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.events = 0
        self.bytes = 0
        self.conditions: dict[tuple[str, str], tuple[str, int | None]] = {}
        self.true_at: dict[tuple[str, str, int], float] = {}
        self.last_change = time.monotonic()
        self.session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None, sock_read=None))
        self.task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        async with self.session.get(self.url + TM_PATH) as response:
            listed = await response.json()
        for item in listed["items"]:
            self._note(item)
        self.task = asyncio.create_task(self._watch(listed["metadata"]["resourceVersion"]))

    def _note(self, obj: dict[str, Any]) -> None:
        name = obj["metadata"]["name"]
        for condition in (obj.get("status") or {}).get("conditions") or []:
            kind = condition.get("type", "")
            if not kind.startswith(CONDITION_PREFIX):
                continue
            region = kind[len(CONDITION_PREFIX):]
            value = (condition.get("status"), condition.get("observedGeneration"))
            if self.conditions.get((name, region)) != value:
                self.conditions[(name, region)] = value
                self.last_change = time.monotonic()
                if value[0] == "True" and isinstance(value[1], int):
                    self.true_at.setdefault((name, region, value[1]), time.time())

    async def _watch(self, version: str) -> None:
        while True:
            params = {"watch": "true", "resourceVersion": version, "allowWatchBookmarks": "true", "timeoutSeconds": "3600"}
            with contextlib.suppress(aiohttp.ClientError, asyncio.TimeoutError):
                async with self.session.get(self.url + TM_PATH, params=params) as response:
                    if response.status != 200:
                        raise SystemExit(f"observer watch answered {response.status}")
                    async for line in response.content:
                        event = json.loads(line)
                        version = event["object"]["metadata"].get("resourceVersion", version)
                        if event["type"] == "BOOKMARK":
                            continue
                        self.events += 1
                        self.bytes += len(line)
                        self._note(event["object"])
            await asyncio.sleep(0.1)

    def published_everywhere(self, regions: list[str], generations: dict[str, int]) -> bool:
        """Every region's condition True at each map's generation in `generations`."""
        return all(self.conditions.get((name, region)) == ("True", generation)
                   for name, generation in generations.items() for region in regions)

    async def aclose(self) -> None:
        if self.task is not None:
            self.task.cancel()
            await asyncio.gather(self.task, return_exceptions=True)
        await self.session.close()


async def written(session: aiohttp.ClientSession, port: int) -> float:
    """A sidecar's status writes so far (its /metrics), or NaN when it does not answer."""
    with contextlib.suppress(aiohttp.ClientError, asyncio.TimeoutError):
        async with session.get(f"http://127.0.0.1:{port}/metrics", headers={"Accept": "text/plain"}) as response:
            found = WRITTEN.search(await response.text())
            return float(found[1]) if found else 0.0
    return float("nan")


async def spawn_sidecar(stack: contextlib.AsyncExitStack, root: Path, args: list[str], log: Path) -> asyncio.subprocess.Process:
    """`ome-publisher run ARGS` from the checkout at `root` (compare.spawn runs in this one)."""
    handle = stack.enter_context(open(log, "ab"))
    process = await asyncio.create_subprocess_exec(sys.executable, "-m", "publisher.cli", "run", *args, stdin=asyncio.subprocess.DEVNULL,
                                                   stdout=handle, stderr=handle, cwd=str(root))
    stack.push_async_callback(stop_process, process, signal.SIGTERM)
    return process


async def map_bytes(session: aiohttp.ClientSession, url: str) -> int:
    async with session.get(f"{url}{TM_PATH}/{compare.map_name(0)}") as response:
        return len(json.dumps(await response.json(), separators=(",", ":")))


async def run_once(regions: int, maps: int, rate: int, seconds: float, status_mode: str | None, root: Path) -> dict[str, Any]:
    work = Path(tempfile.mkdtemp(prefix=f"regions-{regions}-"))
    script = str(Path(compare.__file__).resolve())
    result: dict[str, Any] = {"regions": regions, "maps": maps, "rate": rate, "seconds": seconds, "status_mode": status_mode or "default",
                              "sidecar_root": str(root), "load_average_start": os.getloadavg()[0]}
    names = [f"region-{i}" for i in range(regions)]
    condition_mode = status_mode_is_condition(status_mode)
    async with contextlib.AsyncExitStack() as stack:
        fake = await spawn(stack, sys.executable, script, "_fake", str(maps), "dns", log=work / "fake.log", stdout=asyncio.subprocess.PIPE)
        line = await asyncio.wait_for(fake.stdout.readline(), 300)
        if not line:
            raise SystemExit(f"fake API server failed: {(work / 'fake.log').read_text()[-2000:]}")
        url = line.decode().split()[0]
        from tests.fakes.kube_api import write_kubeconfig

        kubeconfig = write_kubeconfig(work / "kubeconfig", url)
        session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30))
        stack.push_async_callback(session.close)
        result["trafficmap_bytes_loaded"] = await map_bytes(session, url)
        observer = Observer(url)
        await observer.start()
        stack.push_async_callback(observer.aclose)
        peak = Peak()
        peak.watch("fake API", fake.pid)
        peak.sample()
        loaded_cpu = peak.cpu("fake API")  # loading the maps is not the start's
        started = time.monotonic()
        runner_cpu = time.process_time()  # the observer and the R directory watchers run in this process
        bare = await spawn(stack, sys.executable, script, "_bare", str(kubeconfig), str(work / "bare.json"), log=work / "bare.log")
        peak.watch("bare watcher", bare.pid)
        mode = ["--status-mode", status_mode] if status_mode else []
        ports, sidecars, detectors = [], [], []
        for name in names:
            directory = work / name
            directory.mkdir()
            ports.append(free_port())
            sidecars.append(await spawn_sidecar(stack, root, ["--source", "kube", "--kubeconfig", str(kubeconfig), "--namespace", NAMESPACE,
                                                              "--listen", f"127.0.0.1:{ports[-1]}", "--log-level", "warning", "--region", name,
                                                              "--adapter", "json", "--json-dir", str(directory), *mode],
                                                work / f"{name}.log"))
            peak.watch(name, sidecars[-1].pid)
            detectors.append(SidecarDir(directory))
            stack.push_async_callback(detectors[-1].aclose)
        served: list[dict[int, int]] = [{} for _ in names]
        first_seen: list[dict[tuple[int, int], float]] = [{} for _ in names]
        stop = asyncio.Event()
        watchers = [asyncio.create_task(observe(d, s, f, stop)) for d, s, f in zip(detectors, served, first_seen)]

        async def sample() -> None:
            while True:
                peak.sample()
                await asyncio.sleep(0.25)

        sampler = asyncio.create_task(sample())

        async def settle(deadline: float, generations: dict[str, int], weights: dict[int, int]) -> float | None:
            """Seconds since `started` at which status last moved, once all is served and quiet; None at the deadline."""
            last_total, last_move = -1.0, time.monotonic()
            while time.monotonic() < deadline:
                for process in sidecars:
                    if process.returncode is not None:
                        raise SystemExit(f"a sidecar exited {process.returncode}; logs in {work}")
                total = sum([await written(session, port) for port in ports])
                if total != last_total:
                    last_total, last_move = total, time.monotonic()
                moved = max(last_move, observer.last_change)
                done = all(all(s.get(i, 0) >= w for i, w in weights.items()) for s in served)
                if condition_mode:
                    done = done and observer.published_everywhere(names, generations)
                if done and time.monotonic() - moved >= QUIET:
                    return moved - started
                await asyncio.sleep(1.0)  # each look reads every sidecar's /metrics, which costs it CPU
            return None

        try:
            settled = await settle(started + START_LIMIT, {compare.map_name(i): 1 for i in range(maps)}, dict.fromkeys(range(maps), 1))
            result["settled_seconds"] = round(settled, 1) if settled is not None else None
            start_writes = [await written(session, port) for port in ports]
            result["start_writes_per_map_per_sidecar"] = round(sum(start_writes) / (maps * regions), 3)
            result["start_writes"] = int(sum(start_writes))
            result["start_watch_events"] = observer.events
            result["start_watch_mb_per_watcher"] = round(observer.bytes / 1e6, 1)
            result["trafficmap_bytes"] = await map_bytes(session, url)
            cpu_before = {label: peak.cpu(label) for label in peak.roots}
            result["start_cpu_s"] = {"sidecar_mean": round(sum(cpu_before[name] for name in names) / regions, 2),
                                     "bare watcher": round(cpu_before["bare watcher"], 2), "fake API": round(cpu_before["fake API"] - loaded_cpu, 2)}
            # Every process of the run shares the machine: their CPU until settled over its cores is
            # the least wall time the start could have taken here. A settle near it is the machine's.
            total = sum(cpu_before.values()) - loaded_cpu + time.process_time() - runner_cpu
            result["start_cpu_s"]["all"] = round(total, 1)
            result["settle_floor_s"] = round(total / (os.cpu_count() or 1), 1)
            events_before, bytes_before = observer.events, observer.bytes
            churn_start = time.monotonic()
            sender = await spawn(stack, sys.executable, script, "_sender", url, str(maps), str(rate), str(seconds), "dns",
                                 str(work / "sent.jsonl"), log=work / "sender.log", stdout=asyncio.subprocess.PIPE)
            summary = json.loads((await asyncio.wait_for(sender.stdout.readline(), seconds + 120)).decode())
            sent = [json.loads(x) for x in (work / "sent.jsonl").read_text().splitlines()]
            latest: dict[int, int] = {}
            for record in sent:
                latest[record["map"]] = max(latest.get(record["map"], 0), record["version"])
            tail = await settle(time.monotonic() + TAIL_LIMIT, {compare.map_name(i): 1 + v for i, v in latest.items()},
                                {i: 1 + v for i, v in latest.items()})
            result["churn_settled"] = tail is not None
            result["churn_seconds"] = round(time.monotonic() - churn_start, 1)
            cpu = {label: peak.cpu(label) - cpu_before[label] for label in peak.roots}
            churn_writes = sum([await written(session, port) for port in ports]) - sum(start_writes)
            events, received = observer.events - events_before, observer.bytes - bytes_before
            result["trafficmap_bytes_end"] = await map_bytes(session, url)
        finally:
            stop.set()
            sampler.cancel()
            await asyncio.gather(*watchers, sampler, return_exceptions=True)
        await stop_process(bare)
        bare_seen = {int(k): v for k, v in json.loads((work / "bare.json").read_text()).items()} if (work / "bare.json").exists() else {}

    changes = max(1, len(sent))
    served_ms, status_ms = [], []
    for record in sent:
        for seen in first_seen:
            at = [t for (index, weight), t in seen.items() if index == record["map"] and weight >= 1 + record["version"]]
            if at:
                served_ms.append(1000 * (min(at) - record["stamp"]))
        for name in names:
            at = observer.true_at.get((compare.map_name(record["map"]), name, 1 + record["version"]))
            if at is not None:
                status_ms.append(1000 * (at - record["stamp"]))
    bare_ms = [1000 * (bare_seen[r["seq"]] - r["stamp"]) for r in sent if r["seq"] in bare_seen]
    # OME's two writes of a change: a map is held between them, and a hold longer than the
    # sidecar's --status-delay (500ms) is written. An API server starved of CPU spreads them.
    two_writes_ms = [1000 * (r["written"] - r["stamp"]) for r in sent]
    quantiles = lambda values: {"p50": round(percentile(values, 0.5), 1), "p99": round(percentile(values, 0.99), 1)}  # noqa: E731
    sidecar_cpu = [cpu[name] for name in names]
    result |= {
        "sent": len(sent), "send_failures": summary["failed"], "achieved_seconds": round(summary["seconds"], 1),
        "status_writes_per_change_per_sidecar": round(churn_writes / (changes * regions), 3),
        "watch_events_per_change": round(events / changes, 2),
        "watch_bytes_per_change": round(received / changes),
        "cpu_ms_per_change": {"sidecar_mean": round(1000 * sum(sidecar_cpu) / regions / changes, 2),
                              "sidecar_max": round(1000 * max(sidecar_cpu) / changes, 2),
                              "bare watcher": round(1000 * cpu["bare watcher"] / changes, 2),
                              "fake API": round(1000 * cpu["fake API"] / changes, 2)},
        "served_ms": quantiles(served_ms), "served_updates": len(served_ms), "bare_ms": quantiles(bare_ms),
        "omes_two_writes_ms": quantiles(two_writes_ms),
        "omes_two_writes_over_500ms": round(sum(1 for v in two_writes_ms if v > 500) / changes, 3),
        "status_ms": quantiles(status_ms), "status_updates": len(status_ms),
        "peak_rss_mb": {label: round(v) for label, v in peak.peaks.items() if label in ("fake API", "bare watcher", names[0])},
        "load_average_end": os.getloadavg()[0],
    }
    if result["served_updates"] < len(sent) * regions or not result["churn_settled"] or result["settled_seconds"] is None:
        result["logs"] = str(work)
    else:
        for path in sorted(work.rglob("*"), reverse=True):
            path.unlink() if path.is_file() else path.rmdir()
        work.rmdir()
    return result


def print_run(r: dict[str, Any]) -> None:
    cpu = r["cpu_ms_per_change"]
    settled = f"{r['settled_seconds']} s" if r["settled_seconds"] is not None else f"not within {START_LIMIT:g} s"
    print(f"== R = {r['regions']}, {r['maps']} maps, {r['rate']}/s for {r['seconds']:g} s, status mode {r['status_mode']} "
          f"(load average {r['load_average_start']:.2f} -> {r['load_average_end']:.2f})")
    print(f"  start: {r['start_writes']} status writes, {r['start_writes_per_map_per_sidecar']} per map per sidecar; settled {settled}; "
          f"{r['start_watch_events']} watch events, {r['start_watch_mb_per_watcher']} MB to each watcher")
    print(f"  CPU until settled: sidecar {r['start_cpu_s']['sidecar_mean']} s (mean), bare watcher {r['start_cpu_s']['bare watcher']} s, "
          f"fake API {r['start_cpu_s']['fake API']} s; every process {r['start_cpu_s']['all']} s, "
          f"so at least {r['settle_floor_s']} s on {os.cpu_count()} cores")
    print(f"  TrafficMap: {r['trafficmap_bytes_loaded']} B loaded, {r['trafficmap_bytes']} B settled, {r['trafficmap_bytes_end']} B at the end")
    print(f"  per change ({r['sent']} sent, {r['send_failures']} failed): {r['status_writes_per_change_per_sidecar']} status writes per sidecar, "
          f"{r['watch_events_per_change']} watch events ({r['watch_bytes_per_change']} B) to each watcher")
    print(f"  CPU per change: sidecar {cpu['sidecar_mean']} ms (max {cpu['sidecar_max']}), bare watcher {cpu['bare watcher']} ms, "
          f"fake API {cpu['fake API']} ms")
    print(f"  OME's two writes per change took p50 {r['omes_two_writes_ms']['p50']} ms, p99 {r['omes_two_writes_ms']['p99']} ms; "
          f"{r['omes_two_writes_over_500ms']:.1%} over 500 ms (a hold that long is written)")
    print(f"  latency p50/p99: served {r['served_ms']['p50']}/{r['served_ms']['p99']} ms ({r['served_updates']} of {r['sent'] * r['regions']}), "
          f"bare decoded {r['bare_ms']['p50']}/{r['bare_ms']['p99']} ms, status {r['status_ms']['p50']}/{r['status_ms']['p99']} ms")
    if "logs" in r:
        print(f"  incomplete: logs kept in {r['logs']}")
    print("JSON " + json.dumps(r, sort_keys=True), flush=True)


def project(runs: list[dict[str, Any]], costs: dict[int, dict[str, float]], maps: int = 10_000, rate: float = 100.0) -> list[dict[str, Any]]:
    """The condition mode at more regions, from what the runs measured and the in-process cost of
    one event of a map carrying that many regions' conditions (`costs`, per_event_costs by R).
    A change is OME's two writes and one status write per region (`writes` per change per sidecar,
    as measured at the largest R), every one a write of the whole object to etcd and an event of
    it to every watcher. The TrafficMap grows by a fixed amount per region (least squares over the
    runs). A sidecar pays, per change, what it paid at the smallest R (its own events, its gateway
    write, its status write) plus each other region's event at the cost measured for that R:
    noted now, parsed and decided before the prefilter."""
    rs = [float(r["regions"]) for r in runs]
    ys = [float(r["trafficmap_bytes_end"]) for r in runs]
    mx, my = sum(rs) / len(rs), sum(ys) / len(ys)
    per_region = sum((x - mx) * (y - my) for x, y in zip(rs, ys)) / max(1e-12, sum((x - mx) ** 2 for x in rs))
    base = min(runs, key=lambda r: r["regions"])
    writes = max(runs, key=lambda r: r["regions"])["status_writes_per_change_per_sidecar"]
    out = []
    for count, cost in sorted(costs.items()):
        object_bytes = my + per_region * (count - mx)
        events = 2 + count * writes
        others = events - base["watch_events_per_change"]
        own_ms = base["cpu_ms_per_change"]["sidecar_mean"]
        out.append({
            "regions": count, "maps": maps, "changes_per_second": rate, "trafficmap_bytes": round(object_bytes),
            "watch_events_per_change": round(events, 1), "status_writes_per_second": round(rate * count * writes),
            "etcd_write_mb_per_second": round(rate * events * object_bytes / 1e6, 1),
            "watch_mb_per_second_per_watcher": round(rate * events * object_bytes / 1e6, 1),
            "api_server_watch_mb_per_second": round(rate * events * object_bytes * (count + 1) / 1e6),
            "sidecar_cores": round(rate * (own_ms + others * cost["noted_us"] / 1000) / 1000, 2),
            "sidecar_cores_without_prefilter": round(rate * (own_ms + others * cost["parsed_and_decided_us"] / 1000) / 1000, 2),
            "bare_decode_cores": round(rate * events * cost["bare_decode_us"] / 1e6, 2),
            "start_writes": count * maps,
            "start_mb_per_watcher": round(count * maps * object_bytes / 2 / 1e6),  # the map grows from 0 to R conditions
        })  # fmt: skip
    return out


async def loaded_map(regions: int) -> dict[str, Any]:
    """One TrafficMap as the fake API server holds it once OME wrote it and `regions` regions
    wrote their condition, each by server-side apply (so with every managedFields entry)."""
    from tests.fakes.kube_api import FakeKubeAPI

    async with FakeKubeAPI() as api, aiohttp.ClientSession() as session:
        name, path = compare.map_name(0), f"{api.url}{TM_PATH}/{compare.map_name(0)}"
        apply = {"force": "true"}
        async with session.patch(f"{api.url}{compare.ISVC_PATH}/{name}", params={**apply, "fieldManager": "ome-controller"},
                                 data=json.dumps(compare.isvc_body(0)), headers=compare.APPLY) as response:
            uid = (await response.json())["metadata"]["uid"]
        for suffix, manager, body in (("", "ome-trafficmap-controller", compare.tm_spec_body(0, uid, "dns")),
                                      ("/status", "ome-trafficmap-routing", compare.tm_status_body(0, uid, 1))):
            async with session.patch(path + suffix, params={**apply, "fieldManager": manager}, data=json.dumps(body),
                                     headers=compare.APPLY) as response:
                await response.read()
        for region in range(regions):
            condition = {"type": f"{CONDITION_PREFIX}region-{region}", "status": "True", "reason": "Published",
                         "message": f"the json gateway serves generation 1 for {compare.hostname(0)}: w0=1, w1=1, w2=1, w3=1",
                         "observedGeneration": 1, "lastTransitionTime": compare.now()}
            body = {"apiVersion": compare.API, "kind": "TrafficMap", "metadata": {"name": name, "namespace": NAMESPACE},
                    "status": {"conditions": [condition]}}
            async with session.patch(path + "/status", params={**apply, "fieldManager": f"ome-gateway-publisher-region-{region}"},
                                     data=json.dumps(body), headers=compare.APPLY) as response:
                await response.read()
        return api.get(f"{compare.API}/trafficmaps", NAMESPACE, name)


def per_event_costs(raw: dict[str, Any], rounds: int = 2000, repeats: int = 5) -> dict[str, float]:
    """Microseconds per watch event of this map, in this process: what a bare watch pays to
    decode it; what region-0's sidecar pays for an event that changes only another region's
    condition (decode, digest, note the version); and what it paid before that was recognised
    (decode, parse and validate, store, decide). Each is the best of `repeats` passes of `rounds`
    events: on a shared machine the least disturbed pass is the cost."""
    from publisher.kube import TRAFFIC_MAPS
    from publisher.loop import LoopOptions, Publisher
    from publisher.core.model import parse_traffic_map
    from publisher.core.values import MapKey
    from publisher.source.informer import Informer, WatchOptions
    from publisher.source.objects import map_digest, parse_isvc
    from publisher.source.store import Stores
    from publisher.source.watch import WatchState
    from tests.fakes.memory_adapter import memory_engine

    other = json.loads(json.dumps(raw))
    conditions = other["status"]["conditions"]
    foreign = next((c for c in conditions if c["type"] == f"{CONDITION_PREFIX}region-1"), None)
    if foreign is not None:
        foreign["status"], foreign["reason"] = "False", "RoutableOutdated"
    lines = []
    for version, obj in enumerate([raw, other] * (rounds // 2)):
        obj = json.loads(json.dumps(obj))
        obj["metadata"]["resourceVersion"] = str(1000 + version)
        lines.append(json.dumps({"type": "MODIFIED", "object": obj}, separators=(",", ":")).encode())
    isvc = parse_isvc(json.loads(json.dumps(compare.isvc_body(0) | {"metadata": {**compare.isvc_body(0)["metadata"], "uid": raw["status"]["sourceUID"], "generation": 1}})))

    def timed(digest: Any) -> float:
        stores = Stores.empty()
        key = MapKey(NAMESPACE, compare.map_name(0))
        assert isvc is not None
        stores.isvcs.upsert(key, isvc, "1")
        engine, _ = memory_engine()
        publisher = Publisher(stores, engine, LoopOptions(adapter_name=engine.name, region="region-0"))

        class Decides:
            """The loop's part of an event: decide each changed map."""

            def changed(self, keys: Any, *, at: float) -> None:
                for changed in keys:
                    publisher.decide(changed)

            def reported(self, keys: Any) -> None:
                return None

            def synced(self) -> None:
                return None

        sink = Decides()
        informer = Informer(None, TRAFFIC_MAPS, namespace=NAMESPACE, options=WatchOptions(), store=stores.maps,  # type: ignore[arg-type]
                            parse=parse_traffic_map, sink=sink, on_synced=lambda: None, clock=time.monotonic, digest=digest)
        state = WatchState("1")
        informer._handle(state.feed(lines[0]))  # the object as listed
        started = time.perf_counter()
        for line in lines[1:]:
            informer._handle(state.feed(line))
        return 1e6 * (time.perf_counter() - started) / (len(lines) - 1)

    def decoded() -> float:
        started = time.perf_counter()
        for line in lines:
            json.loads(line)
        return 1e6 * (time.perf_counter() - started) / len(lines)

    own = f"{CONDITION_PREFIX}region-0"
    bare = min(decoded() for _ in range(repeats))
    noted = min(timed(lambda obj: map_digest(obj, own)) for _ in range(repeats))
    parsed = min(timed(None) for _ in range(repeats))
    return {"event_bytes": len(lines[0]), "bare_decode_us": round(bare, 1), "noted_us": round(noted, 1), "parsed_and_decided_us": round(parsed, 1)}


async def main(args: argparse.Namespace) -> None:
    if args.per_event:
        for regions in [int(x) for x in args.regions.split(",")]:
            costs = per_event_costs(await loaded_map(regions))
            print("PER_EVENT " + json.dumps({"regions": regions, **costs}), flush=True)
        return
    root = Path(args.sidecar_root).resolve() if args.sidecar_root else ROOT
    runs = []
    for regions in [int(x) for x in args.regions.split(",")]:
        runs.append(await run_once(regions, args.maps, args.rate, args.seconds, args.status_mode, root))
        print_run(runs[-1])
    if len(runs) > 1 and status_mode_is_condition(args.status_mode):
        costs = {regions: per_event_costs(await loaded_map(regions)) for regions in (20, 50)}
        for regions, cost in costs.items():
            print("PER_EVENT " + json.dumps({"regions": regions, **cost}), flush=True)
        for row in project(runs, costs):
            print("PROJECTION " + json.dumps(row, sort_keys=True), flush=True)


def status_mode_is_condition(mode: str | None) -> bool:
    return mode in (None, "condition")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--regions", default="1,2,5,10", help="comma-separated region counts (one run each)")
    parser.add_argument("--maps", type=int, default=1000, help="TrafficMaps (and InferenceServices) loaded")
    parser.add_argument("--rate", type=int, default=20, help="map changes per second")
    parser.add_argument("--seconds", type=float, default=30, help="how long the sender changes maps")
    parser.add_argument("--status-mode", default=None, help="passed to every sidecar as --status-mode (default: not passed)")
    parser.add_argument("--sidecar-root", default=None, help="run the sidecars from this checkout (e.g. main, for before-numbers)")
    parser.add_argument("--per-event", action="store_true",
                        help="instead: in-process cost of one watch event of a map carrying --regions conditions")
    return parser.parse_args()


if __name__ == "__main__":
    asyncio.run(main(parse_args()))
