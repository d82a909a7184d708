"""The sidecar at scale, against the fake API server in a process of its own (SPEC §8).

    python benchmarks/loop_scale.py --maps 10000 --rate 100 --seconds 20

1. Start: N TrafficMaps of 4 entries on the fake; `ome-publisher run --source kube --adapter json`
   as a process; time from its start until the JSON file holds all N; its peak RSS.
2. Churn: `--rate` map updates per second for `--seconds` (a spec change, then OME's Routable
   condition for the new generation, as OME's controller writes them), then the sidecar's own
   `event_to_apply_seconds` histogram (watch event to the gateway confirming the write).
Everything listens on 127.0.0.1; both processes are stopped at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.builders import make_condition, make_entry  # noqa: E402
from tests.gateways import free_port  # noqa: E402

FAKE_SERVER = """
import asyncio, sys
sys.path.insert(0, {root!r})
from tests.fakes.kube_api import FakeKubeAPI
from tests.builders import make_entry, make_isvc, make_map

async def main():
    api = FakeKubeAPI(bookmark_interval=30.0)
    url = await api.start()
    for i in range({maps}):
        name = f"m{{i:05d}}"
        isvc = api.create(make_isvc(name))
        api.create(make_map(name, generation=1, isvc_uid=isvc["metadata"]["uid"], observed_isvc_generation=1,
            entries=[make_entry(f"w{{j}}", allocated=1, ready=1, weight=1, service=name) for j in range(4)]))
    print(url, flush=True)
    await asyncio.Event().wait()

asyncio.run(main())
"""

TM = "/apis/ome.io/v1beta1/namespaces/prod/trafficmaps"


def rss_peak_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def buckets(text: str, name: str) -> list[tuple[float, float]]:
    """(upper bound, cumulative count) of a Prometheus histogram in exposition text."""
    found = []
    for line in text.splitlines():
        if line.startswith(name + "_bucket"):
            le = line.split('le="')[1].split('"')[0]
            found.append((float("inf") if le == "+Inf" else float(le), float(line.rsplit(" ", 1)[1])))
    return found


def quantile(before: list[tuple[float, float]], after: list[tuple[float, float]], q: float) -> tuple[float, int]:
    """The upper bound of the bucket holding quantile q of what was observed between two scrapes."""
    delta = [(bound, count - dict(before).get(bound, 0.0)) for bound, count in after]
    total = delta[-1][1] if delta else 0
    for bound, count in delta:
        if total and count >= q * total:
            return bound, int(total)
    return float("nan"), int(total)


async def scrape(port: int) -> str:
    async with aiohttp.ClientSession() as session, session.get(f"http://127.0.0.1:{port}/metrics") as response:
        return await response.text()


async def churn(url: str, maps: int, rate: int, seconds: int) -> int:
    sent = 0
    interval = 1.0 / rate
    start = time.monotonic()
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as session:
        while time.monotonic() - start < seconds:
            i = sent % maps
            name = f"m{i:05d}"
            ready = 1 + (sent // maps) % 5 + 1
            entries = [make_entry(f"w{j}", allocated=ready if j == 0 else 1, ready=ready if j == 0 else 1,
                                  weight=ready if j == 0 else 1, service=name) for j in range(4)]
            async with session.patch(f"{url}{TM}/{name}", json={"spec": {"entries": entries}},
                                     headers={"Content-Type": "application/merge-patch+json"}) as response:
                generation = (await response.json())["metadata"]["generation"]
            status = {"apiVersion": "ome.io/v1beta1", "kind": "TrafficMap", "metadata": {"name": name, "namespace": "prod"},
                      "status": {"conditions": [make_condition("Routable", observed_generation=generation)]}}
            async with session.patch(f"{url}{TM}/{name}/status", params={"fieldManager": "ome-trafficmap-routing", "force": "true"},
                                     data=json.dumps(status), headers={"Content-Type": "application/apply-patch+yaml"}) as response:
                await response.read()
            sent += 1
            await asyncio.sleep(max(0.0, start + sent * interval - time.monotonic()))
    return sent


async def main(maps: int, rate: int, seconds: int) -> None:
    fake = await asyncio.create_subprocess_exec(sys.executable, "-c", FAKE_SERVER.format(root=str(ROOT), maps=maps),
                                                stdout=asyncio.subprocess.PIPE)
    work = Path(tempfile.mkdtemp())
    publisher = None
    try:
        url = (await asyncio.wait_for(fake.stdout.readline(), 600)).decode().strip()
        kubeconfig = work / "kubeconfig"
        kubeconfig.write_text(json.dumps({"apiVersion": "v1", "kind": "Config", "current-context": "fake",
                                          "clusters": [{"name": "fake", "cluster": {"server": url}}],
                                          "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": "fake"}}],
                                          "users": [{"name": "fake", "user": {"token": "x"}}]}))
        out = work / "out.json"
        port = free_port()
        started = time.monotonic()
        publisher = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "publisher.cli", "run", "--source", "kube", "--kubeconfig", str(kubeconfig),
            "--adapter", "json", "--json-path", str(out), "--listen", f"127.0.0.1:{port}", "--no-report-status",
            "--log-level", "error", cwd=str(ROOT))
        while True:
            await asyncio.sleep(0.05)
            try:
                if len(json.loads(out.read_text())["publications"]) == maps:
                    break
            except (FileNotFoundError, ValueError):
                pass
            if time.monotonic() - started > 120:
                raise SystemExit("not all maps published within 120 s")
        print(f"start: {maps} maps published in {time.monotonic() - started:.2f} s; peak RSS {rss_peak_mb(publisher.pid):.0f} MB")
        name = "ome_gateway_publisher_event_to_apply_seconds"
        before = buckets(await scrape(port), name)
        sent = await churn(url, maps, rate, seconds)
        await asyncio.sleep(1.0)
        after = buckets(await scrape(port), name)
        p50, count = quantile(before, after, 0.5)
        p99, _ = quantile(before, after, 0.99)
        print(f"churn: {sent} updates at {rate}/s ({count} applied); event to confirmed write: "
              f"p50 <= {p50 * 1000:g} ms, p99 <= {p99 * 1000:g} ms (histogram bucket bounds); "
              f"peak RSS {rss_peak_mb(publisher.pid):.0f} MB")
    finally:
        for process in (publisher, fake):
            if process is not None and process.returncode is None:
                process.send_signal(signal.SIGTERM)
                try:
                    await asyncio.wait_for(process.wait(), 10)
                except TimeoutError:
                    process.kill()
                    await process.wait()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--maps", type=int, default=10_000)
    parser.add_argument("--rate", type=int, default=100)
    parser.add_argument("--seconds", type=int, default=20)
    args = parser.parse_args()
    asyncio.run(main(args.maps, args.rate, args.seconds))
