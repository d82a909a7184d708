"""The HTTPRoute transport at scale, against the fake API server in a process of its own (SPEC §8).

    python benchmarks/httproute_scale.py --maps 10000 --changes 20

1. First publish: N maps of 4 backends, `read()` of an empty cluster, then one `write()` of them
   all (4 ExternalName Services and a route per map); with `--controller`, the fake's process also
   plays the gateway's controller (a watch of the routes, a status write per route generation), so
   the write waits for real verdicts instead of its status timeout.
2. `--changes` single-map weight changes, one `write()` each as the engine would, then a restart:
   a fresh transport's `read()` of all N.
Prints times and the API requests each step cost, by verb, as the fake counted them; for each step
the peak RSS of this process (the transport, and the groups the engine would hold) and the longest
event-loop stall with what the loop was doing (a sampled stack, or the garbage collector).
Everything listens on 127.0.0.1; the fake's process is stopped at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import gc
import json
import os
import resource
import signal
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from adapters.httproute import HttpRouteOptions, build  # noqa: E402
from publisher.loop import STARTUP_GC_OLDER, STARTUP_GC_THRESHOLD  # noqa: E402
from publisher.core.values import Backend, MapKey, Route  # noqa: E402

PYTHON_GC_THRESHOLD = gc.get_threshold()

# The fake's process: prints its URL, then answers each line on stdin with its request counts by
# verb (since the last line). With a controller, it reports Accepted/ResolvedRefs on every route
# generation it sees through a watch, over HTTP like a real gateway controller.
FAKE_SERVER = """
import asyncio, collections, json, sys
sys.path.insert(0, {root!r})
import aiohttp
from tests.fakes.kube_api import FakeKubeAPI

ROUTES = "/apis/gateway.networking.k8s.io/v1/httproutes"
PARENT = {{"group": "gateway.networking.k8s.io", "kind": "Gateway", "namespace": "gateways", "name": "global"}}

async def controller(url):
    async with aiohttp.ClientSession() as session:
        version = "0"
        while True:
            params = {{"watch": "true", "resourceVersion": version, "allowWatchBookmarks": "true"}}
            async with session.get(url + ROUTES, params=params, timeout=aiohttp.ClientTimeout(total=None)) as stream:
                async for line in stream.content:
                    event = json.loads(line)
                    route = event["object"]
                    version = route["metadata"]["resourceVersion"]
                    if event["type"] not in ("ADDED", "MODIFIED"):
                        continue
                    generation = route["metadata"]["generation"]
                    parents = (route.get("status") or {{}}).get("parents") or []
                    if parents and parents[0]["conditions"][0]["observedGeneration"] == generation:
                        continue
                    conditions = [{{"type": t, "status": "True", "reason": t, "message": "",
                                    "lastTransitionTime": "2026-12-01T00:00:00Z", "observedGeneration": generation}}
                                  for t in ("Accepted", "ResolvedRefs")]
                    status = {{"status": {{"parents": [{{"parentRef": PARENT, "controllerName": "example.com/gateway",
                                                        "conditions": conditions}}]}}}}
                    path = f"{{url}}/apis/gateway.networking.k8s.io/v1/namespaces/{{route['metadata']['namespace']}}/httproutes/{{route['metadata']['name']}}/status"
                    async with session.patch(path, data=json.dumps(status),
                                             headers={{"Content-Type": "application/merge-patch+json"}}) as response:
                        await response.read()

async def main():
    api = FakeKubeAPI(history_size=200_000)
    url = await api.start()
    tasks = [asyncio.create_task(controller(url))] if {controller} else []
    print(url, flush=True)
    reader = asyncio.StreamReader()
    await asyncio.get_running_loop().connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    seen = 0
    while await reader.readline():
        counts = collections.Counter(r.verb for r in api.requests[seen:] if "/status" not in r.path and r.field_manager != "controller")
        seen = len(api.requests)
        print(json.dumps(counts), flush=True)

asyncio.run(main())
"""


def options(kubeconfig: Path, status_timeout: float) -> HttpRouteOptions:
    return HttpRouteOptions(
        gateway_kubeconfig=kubeconfig, gateway="gateways/global", backend_port=8080, region="eu",
        route_status_timeout=status_timeout,
    )


def route(i: int, first_weight: int = 1) -> Route:
    return Route(f"m{i:05d}.example.com", tuple(
        Backend(f"worker-{j}", f"http://m{i:05d}.worker-{j}.example.com", first_weight if j == 0 else 1) for j in range(4)
    ))


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def counts(fake: Any) -> dict[str, Any]:
    """The fake's request counts by verb since the last call (the controller's status writes left
    out), and the CPU seconds both processes used so far."""
    fake.stdin.write(b"\n")
    await fake.stdin.drain()
    found = dict(json.loads(await fake.stdout.readline()))
    found["cpu"] = f"fake {cpu_seconds(fake.pid):.1f} s, ours {time.process_time():.1f} s"
    return found


class LoopWatch:
    """The longest event-loop stall while it runs, and what the loop was doing then.

    A 1 ms ticker on the loop measures each gap between two of its turns; a thread samples the
    main thread's stack while a turn is late (the innermost frame in the project's code), and
    gc.callbacks time the collector, which no stack shows."""

    def __init__(self) -> None:
        self.longest = 0.0
        self.doing = "nothing"
        self._turn, self._cpu = time.perf_counter(), time.thread_time()
        self._samples: list[str] = []  # what the late loop was doing, since its last turn
        self._collected: list[tuple[int, float]] = []  # (generation, seconds) since the last turn
        self._gc_started = 0.0
        self._main = threading.get_ident()
        self._stop = threading.Event()
        self._ticker: asyncio.Task[None] | None = None
        self._sampler = threading.Thread(target=self._sample, daemon=True)

    async def __aenter__(self) -> LoopWatch:
        gc.callbacks.append(self._gc)
        self._turn, self._cpu = time.perf_counter(), time.thread_time()
        self._ticker = asyncio.create_task(self._tick())
        self._sampler.start()
        return self

    async def __aexit__(self, *_: object) -> None:
        assert self._ticker is not None
        self._ticker.cancel()
        await asyncio.gather(self._ticker, return_exceptions=True)
        self._stop.set()
        self._sampler.join()
        gc.callbacks.remove(self._gc)

    def __str__(self) -> str:
        return f"longest event-loop stall {self.longest * 1000:.0f} ms ({self.doing})"

    async def _tick(self) -> None:
        while True:
            await asyncio.sleep(0.001)
            now, cpu = time.perf_counter(), time.thread_time()
            stall = now - self._turn - 0.001
            samples, collected = self._samples, self._collected
            self._turn, self._samples, self._collected = now, [], []
            if stall > self.longest:
                # The loop's own CPU in the gap tells a busy loop from a machine that did not run it.
                busy = f"{(cpu - self._cpu) * 1000:.0f} ms of it on the loop's CPU"
                self.longest, self.doing = stall, "; ".join([busy, self._describe(samples, collected)])
            self._cpu = cpu

    @staticmethod
    def _describe(samples: list[str], collected: list[tuple[int, float]]) -> str:
        parts = [f"gc generation {gen} {took * 1000:.0f} ms" for gen, took in collected if took > 0.002]
        if samples:
            where, count = collections.Counter(samples).most_common(1)[0]
            parts.append(f"{count} of {len(samples)} samples in {where}")
        return "; ".join(parts) or "no sample: one call into C"

    def _sample(self) -> None:
        while not self._stop.wait(0.002):
            if time.perf_counter() - self._turn < 0.005:
                continue
            frame = innermost = sys._current_frames().get(self._main)
            if frame is None:
                continue
            where = None
            while frame is not None and where is None:
                path = frame.f_code.co_filename
                if path.startswith(str(ROOT)) and not path.startswith(str(ROOT / "benchmarks")):
                    where = f"{Path(path).relative_to(ROOT)}:{frame.f_lineno} {frame.f_code.co_name}"
                frame = frame.f_back
            self._samples.append(where or f"{Path(innermost.f_code.co_filename).name}:{innermost.f_lineno} {innermost.f_code.co_name}")

    def _gc(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._gc_started = time.perf_counter()
        else:
            self._collected.append((info["generation"], time.perf_counter() - self._gc_started))


def peak_rss_mb() -> float:
    """This process's peak resident set since the last reset_peak_rss() (Linux's VmHWM)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def reset_peak_rss() -> None:
    """Starts a new peak: 5 written to clear_refs resets VmHWM to the current resident set."""
    Path("/proc/self/clear_refs").write_text("5")


async def main(maps: int, changes: int, controller: bool, status_timeout: float, sidecar_gc: bool) -> None:
    fake = await asyncio.create_subprocess_exec(
        sys.executable, "-c", FAKE_SERVER.format(root=str(ROOT), controller=controller),
        stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE)
    work = Path(tempfile.mkdtemp())
    try:
        url = (await asyncio.wait_for(fake.stdout.readline(), 60)).decode().strip()
        kubeconfig = work / "kubeconfig"
        kubeconfig.write_text(json.dumps({"apiVersion": "v1", "kind": "Config", "current-context": "fake",
                                          "clusters": [{"name": "fake", "cluster": {"server": url}}],
                                          "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": "fake"}}],
                                          "users": [{"name": "fake", "user": {"token": "x"}}]}))
        renderer, transport = build(options(kubeconfig, status_timeout))
        keys = [MapKey("prod", f"m{i:05d}") for i in range(maps)]
        parts = {key: renderer.render(key, route(i)) for i, key in enumerate(keys)}
        await counts(fake)
        print(f"before the first publish: RSS {peak_rss_mb():.0f} MB at most (the interpreter, its imports and the "
              f"{maps} groups the engine would hold)")
        if sidecar_gc:
            gc.set_threshold(STARTUP_GC_THRESHOLD, STARTUP_GC_OLDER, PYTHON_GC_THRESHOLD[2])
        reset_peak_rss()
        started = time.monotonic()
        async with LoopWatch() as watch:
            assert await transport.read() == {}
            result = await transport.write(parts, parts)
        took = time.monotonic() - started
        assert not result.rejected, list(result.rejected.items())[:3]
        unreported = sum(1 for note in result.notes.values() if "not reported" in note)
        print(f"first publish: {maps} maps in {took:.1f} s ({maps / took:.0f} maps/s); "
              f"requests {await counts(fake)}; {unreported} without a verdict after {status_timeout:g} s; "
              f"peak RSS {peak_rss_mb():.0f} MB; {watch}")
        if sidecar_gc:  # as Publisher.run_applier after its first sync: no collection first
            gc.freeze()
            gc.set_threshold(*PYTHON_GC_THRESHOLD)
        latencies = []
        async with LoopWatch() as watch:
            for n in range(changes):
                i = (n * 7919) % maps
                parts[keys[i]] = renderer.render(keys[i], route(i, first_weight=2 + n))
                started = time.monotonic()
                result = await transport.write(parts, {keys[i]: parts[keys[i]]})
                latencies.append(time.monotonic() - started)
                assert not result.rejected
        if changes:
            per_change = {verb: count / changes if isinstance(count, int) else count for verb, count in (await counts(fake)).items()}
            print(f"one change: p50 {statistics.median(latencies) * 1000:.0f} ms, max {max(latencies) * 1000:.0f} ms; "
                  f"requests per change {per_change}; {watch}")
        await transport.aclose()
        del transport  # a restarted sidecar holds no earlier transport: its memory is not the restart's
        if sidecar_gc:  # a new process, at its start
            gc.unfreeze()
            gc.set_threshold(STARTUP_GC_THRESHOLD, STARTUP_GC_OLDER, PYTHON_GC_THRESHOLD[2])
        gc.collect()
        _, restarted = build(options(kubeconfig, status_timeout))
        reset_peak_rss()
        started = time.monotonic()
        async with LoopWatch() as watch:
            served = await restarted.read()
        took = time.monotonic() - started
        nothing = await restarted.write(parts, {key: parts[key] for key in keys[:100]})
        print(f"restart: read {len(served)} maps in {took:.1f} s, peak RSS {peak_rss_mb():.0f} MB, {watch}; "
              f"requests {await counts(fake)}; "
              f"100 unchanged maps written again: {nothing.rejected or 'no refusals'}, requests {await counts(fake)}")
        await restarted.aclose()
        print(f"peak RSS of this process over the run: {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MB")
    finally:
        if fake.returncode is None:
            fake.send_signal(signal.SIGTERM)
            try:
                await asyncio.wait_for(fake.wait(), 10)
            except TimeoutError:
                fake.kill()
                await fake.wait()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--maps", type=int, default=10_000)
    parser.add_argument("--changes", type=int, default=20)
    parser.add_argument("--controller", action="store_true", help="the fake's process plays the gateway's controller")
    parser.add_argument("--status-timeout", type=float, default=5.0, help="--route-status-timeout")
    parser.add_argument(
        "--gc", choices=("python", "sidecar"), default="python",
        help="python: the collector's defaults throughout; sidecar: as the sidecar runs it (publisher.loop: "
             "STARTUP_GC_THRESHOLD and STARTUP_GC_OLDER until the first sync, then gc.freeze() and the "
             "defaults; a restart starts afresh)")
    args = parser.parse_args()
    asyncio.run(main(args.maps, args.changes, args.controller, args.status_timeout, args.gc == "sidecar"))
