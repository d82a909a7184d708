"""The served-split check end to end (issue 22): the sidecar's own loop publishing the demo's map
into a real gateway, reading the gateway's own counts and judging them. NGINX in Lua mode: a
correct split is verified; a table rewritten behind the sidecar's back 10 points away from the
weights is named off within two windows, in /debug/maps and the metrics, while the map stays
published. Envoy in xDS mode, through `ome-publisher run` on the fake API server: a correct split
is verified, a second Envoy serving other weights than the sidecar published (its LRS reports come
to the same server) is named off within two windows, and an Envoy's restart starts its window over.
Envoy in file mode: its LRS reports reach the sidecar's own LRS server and the split is verified."""

from __future__ import annotations

import asyncio
import contextlib
import math
import re
from pathlib import Path

import aiohttp
import pytest
import yaml
from prometheus_client import generate_latest

from adapters import ADAPTERS
from adapters.envoy import EnvoyOptions
from adapters.envoy.bootstrap import bootstrap
from adapters.envoy.render import CDS_FILE, RDS_FILE, render
from adapters.envoy.process import run_envoy
from adapters.nginx.lua_render import LuaRenderer
from publisher.cli import demo
from publisher import loop, metrics
from publisher.loop import LoopOptions, Publisher
from publisher.source.manifests import parse_manifests
from publisher.core.values import Backend, Route
from publisher.split.check import SplitVerifier
from publisher.source.directory import DirectorySource
from publisher.source.store import Stores
from publisher.status import condition_type
from tests.adapters.nginx_fixtures import running_lua_nginx
from tests.adapters.test_envoy_xds import envoy
from tests.builders import make_entry, make_isvc, make_map
from tests.gateways import Backends, eventually, free_port, measure
from tests.test_cli_run import start_run, stop

pytestmark = pytest.mark.slow

CHAT = demo.CHAT
WINDOW = 2000  # a window is judged at 2,000 requests


def _near(window: dict, backend: str, share: float) -> bool:
    """Whether an Envoy window observed `backend` near `share`. Envoy draws each request's backend
    at random, so the observed share is binomial: within five standard errors over the window's
    requests, which chance misses less than once in a million windows (a fixed bound of 3 points
    over 2,000 requests missed about once in 160, and did in CI)."""
    return abs(window["observed"][backend] - share) < 5 * math.sqrt(share * (1 - share) / window["requests"])


def _instance_view(publisher: Publisher) -> dict:
    (entry,) = [m for m in publisher.debug_maps() if (m["namespace"], m["name"]) == CHAT]
    return entry["split"]["instances"]


async def test_the_demo_map_is_verified_on_nginx_and_a_ten_point_skew_is_named_within_two_windows(tmp_path: Path) -> None:
    example = parse_manifests(str(demo.EXAMPLE), demo.EXAMPLE.read_text())
    maps = tmp_path / "maps"
    maps.mkdir()
    async with Backends(demo.CLUSTERS) as backends, running_lua_nginx(tmp_path / "nginx") as nginx:
        objects = demo.point_at(example, CHAT, {name: backends.endpoint(name) for name in demo.CLUSTERS})
        (maps / "chat.yaml").write_text(yaml.safe_dump_all(objects))
        engine = ADAPTERS["nginx"].engine("nginx", nginx.options())
        publisher = Publisher(Stores.empty(), engine, LoopOptions(adapter_name="nginx", resync=3600))
        counter = engine.transport.request_counter
        # One second between reads instead of the CLI's floor of 10: the test's time, not the rule's.
        publisher.split = SplitVerifier(counter, 1.0, "nginx", publisher.split_changed)
        metrics.watch_split(publisher.split)
        source = DirectorySource(maps, publisher.stores, publisher, clock=publisher.clock, poll_interval=0.1)
        running = asyncio.create_task(loop.run(publisher, source))
        try:
            await eventually(lambda: CHAT in publisher.published, timeout=20)
            host = publisher.published[CHAT].hostname
            assert [b.weight for b in publisher.published[CHAT].backends] == [2, 3]
            # Let the sidecar read a baseline, then fill a window past the skipped interval.
            await eventually(lambda: counter.instance in _instance_view(publisher), timeout=10)
            await asyncio.sleep(1.5)
            for _ in range(2):
                await measure(nginx.url, host, WINDOW)
            await eventually(lambda: _instance_view(publisher)[counter.instance]["verdict"] == "verified", timeout=15)
            window = _instance_view(publisher)[counter.instance]
            assert window["expected"] == {"worker-a": 0.4, "worker-b": 0.6}
            assert abs(window["observed"]["worker-a"] - 0.4) < 0.02

            # 1:1 written into NGINX's table with the control listener's secret: 50/50 served for 40/60.
            served = publisher.published[CHAT]
            even = Route(served.hostname, tuple(Backend(b.cluster, b.endpoint, 1) for b in served.backends))
            rogue = engine.transport._entry_text(LuaRenderer().render(CHAT, even))
            secret = nginx.secret_file.read_text().strip()
            async with aiohttp.ClientSession() as session:
                batch = f"{{}}\nset {CHAT.namespace}/{CHAT.name} {rogue}\n"
                async with session.post(nginx.control_url + "/batch", data=batch, headers={"Authorization": f"Bearer {secret}"}) as answer:
                    assert answer.status == 200, await answer.text()
            for _ in range(3):  # the interval that mixes both tables, then two windows
                await measure(nginx.url, host, WINDOW)
                await asyncio.sleep(1.5)
            await eventually(lambda: publisher.split.note(CHAT) is not None, timeout=15)
            assert publisher.split.note(CHAT).startswith(f"served split on nginx {counter.instance} over ")
            assert "(weights 2/3)" in publisher.split.note(CHAT)
            assert _instance_view(publisher)[counter.instance]["verdict"] == "off"
            assert publisher.states[CHAT].state == "published"  # a report, never a hold
            scrape = generate_latest(metrics.REGISTRY).decode()
            assert f'split_off{{gateway="{counter.instance}",name="{CHAT.name}",namespace="{CHAT.namespace}"}} 1.0' in scrape
        finally:
            metrics.watch_split(None)
            running.cancel()
            await asyncio.gather(running, return_exceptions=True)
            await engine.aclose()


HOST = "chat.example.com"
TM = "ome.io/v1beta1/trafficmaps"
# Requests per round sent through each Envoy, and the most rounds a phase may take: bounded traffic.
ROUND = 2000
ROUNDS = 6


class RunningSidecar:
    """`ome-publisher run` as a process: its /debug/maps split view of CHAT, and its /metrics."""

    def __init__(self, base: str, session: aiohttp.ClientSession) -> None:
        self.base, self.session = base, session
        # Every distinct judgment seen per instance, in order (see `watch`).
        self.judgments: dict[str, list[tuple[int, float | None, str]]] = {}

    async def split(self) -> dict:
        """CHAT's window per instance; each new judgment in it is recorded."""
        try:
            async with self.session.get(self.base + "/debug/maps") as response:
                body = await response.json()
        except aiohttp.ClientError:
            return {}
        entries = [m for m in body["maps"] if (m["namespace"], m["name"]) == (CHAT.namespace, CHAT.name)]
        instances = entries[0]["split"].get("instances", {}) if entries else {}
        for instance, window in instances.items():
            if "requests" in window:
                seen = self.judgments.setdefault(instance, [])
                judgment = (window["requests"], window["pValue"], window["verdict"])
                if not seen or seen[-1][:2] != judgment[:2]:
                    seen.append(judgment)
        return instances

    async def metrics(self) -> str:
        async with self.session.get(self.base + "/metrics") as response:
            return await response.text()

    async def reports(self) -> dict[str, float]:
        """Load reports folded so far, per instance."""
        found = re.findall(r'^ome_gateway_publisher_split_counts_total\{gateway="([^"]+)"\} (\S+)$', await self.metrics(), re.M)
        return {instance: float(n) for instance, n in found}

    async def watch(self) -> None:
        """Look often enough to record every judgment (one per interval at most), until cancelled."""
        while True:
            await self.split()
            await asyncio.sleep(0.2)


async def rounds_until(sidecar: RunningSidecar, envoys: dict[str, str], done) -> dict:
    """Rounds of ROUND requests through each Envoy (instance -> URL), each round ending once the
    sidecar folded a later report from every one of them, until `done(split view)`; at most ROUNDS."""
    for _ in range(ROUNDS):
        await asyncio.gather(*(measure(url, HOST, ROUND) for url in envoys.values()))
        sent = await sidecar.reports()

        async def folded() -> bool:
            now = await sidecar.reports()
            return all(now.get(instance, 0) > sent.get(instance, 0) for instance in envoys)

        await eventually(folded, timeout=30, interval=0.2)
        view = await sidecar.split()
        if done(view):
            return view
    raise AssertionError(f"not reached within {ROUNDS} rounds of {ROUND} requests: {view}")


@contextlib.asynccontextmanager
async def skewed_file_envoy(tmp_path: Path, backends: Backends, lrs_port: int):
    """An Envoy in file mode serving CHAT at 1:1 from files the test wrote (the sidecar published
    2:3), its load reports going to the sidecar's server at `lrs_port`: a gateway that serves other
    weights than it was given."""
    directory = tmp_path / "skewed"
    directory.mkdir()
    even = Route(HOST, tuple(Backend(name, backends.endpoint(name), 1) for name in demo.CLUSTERS))
    files = render({CHAT: even})
    (directory / CDS_FILE).write_text(files.cds)
    (directory / RDS_FILE).write_text(files.rds)
    listen, admin = free_port(), free_port()
    boot = tmp_path / "skewed.yaml"
    boot.write_text(bootstrap(envoy_dir=directory, listen_host="127.0.0.1", listen_port=listen, admin_host="127.0.0.1",
                              admin_port=admin, lrs=("127.0.0.1", lrs_port)))
    async with run_envoy(boot, admin_url=f"http://127.0.0.1:{admin}", log_path=tmp_path / "skewed.log"):
        yield f"http://127.0.0.1:{listen}/"


async def test_the_running_sidecar_verifies_envoys_split_names_a_skewed_envoy_and_starts_over_on_a_restart(
    kube_api, kubeconfig, tmp_path: Path
) -> None:
    a = "ome-gateway-envoy"  # the xDS bootstrap's node id
    b = "ome-gateway-publisher"  # the file mode bootstrap's
    async with Backends(demo.CLUSTERS) as backends, aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as session:
        isvc = kube_api.create(make_isvc(host=HOST))
        entries = [make_entry(name, allocated=n, ready=n, weight=n, endpoint=backends.endpoint(name)) for name, n in zip(demo.CLUSTERS, (2, 3))]
        kube_api.create(make_map(generation=1, isvc_uid=isvc["metadata"]["uid"], observed_isvc_generation=1, entries=entries))
        xds, listen = free_port(), free_port()
        process = await start_run(
            "--source", "kube", "--kubeconfig", str(kubeconfig), "--region", "e2e", "--adapter", "envoy",
            "--envoy-xds-listen", f"127.0.0.1:{xds}", "--split-verify", "on", "--split-interval", "10s",
            "--listen", f"127.0.0.1:{listen}",
        )  # fmt: skip
        sidecar = RunningSidecar(f"http://127.0.0.1:{listen}", session)
        watching = asyncio.create_task(sidecar.watch())
        try:
            async with contextlib.AsyncExitStack() as beside:
                # Beside the sidecar's own Envoy, one serving 1:1 where the sidecar published 2:3,
                # reporting to the same server.
                skewed = await beside.enter_async_context(skewed_file_envoy(tmp_path, backends, xds))
                # A restarted Envoy's window starts over: nothing of the old process's counts or
                # verdict is carried into the new one's.
                async with envoy(tmp_path, xds, name="envoy-a") as first:
                    await eventually(lambda: _listed(sidecar, a, b), timeout=30)
                    view = await rounds_until(sidecar, {a: first.url, b: skewed}, lambda v: "requests" in v.get(a, {}))
                    assert view[a]["verdict"] == "verified"
                await eventually(lambda: _listed(sidecar, missing=(a,)), timeout=30)
                async with envoy(tmp_path, xds, name="envoy-a-again") as right:
                    await eventually(lambda: _listed(sidecar, a), timeout=30)
                    fresh = (await sidecar.split())[a]
                    assert fresh["verdict"] == "few_requests" and fresh["counting"] == 0 and "requests" not in fresh

                    view = await rounds_until(sidecar, {a: right.url, b: skewed}, lambda v: v.get(a, {}).get("verdict") == "verified"
                                              and v.get(b, {}).get("verdict") == "off")
                    assert view[a]["expected"] == {"worker-a": 0.4, "worker-b": 0.6}
                    assert _near(view[a], "worker-a", 0.4)
                    assert all(verdict != "off" for _, _, verdict in sidecar.judgments[a])
                    # Off from its second judged window on (the first one already off, not yet reported).
                    verdicts = [verdict for _, _, verdict in sidecar.judgments[b]]
                    assert verdicts[:2] == ["few_requests", "off"] and set(verdicts[2:]) <= {"off"}
                    assert _near(view[b], "worker-a", 0.5) and view[b]["largestDeviation"] > 0.05
                    note = await eventually(lambda: "served split" in _published_message(kube_api) and _published_message(kube_api), timeout=15)
                    named = re.search(rf"served split on envoy {b} over [\d,]+ requests: worker-a (\d+)%, worker-b (\d+)% \(weights 2/3\)$", note)
                    assert named and abs(int(named[1]) - 50) <= 3 and abs(int(named[2]) - 50) <= 3, note
                    scrape = await sidecar.metrics()
                    assert f'ome_gateway_publisher_split_off{{gateway="{b}",name="chat",namespace="prod"}} 1.0' in scrape
                    assert f'split_off{{gateway="{a}"' not in scrape
                    assert 'ome_gateway_publisher_split_maps{state="off"} 1.0' in scrape

                    # The skewed Envoy gone, the map is verified on every Envoy left: metrics and condition say so.
                    await beside.aclose()
                    await eventually(lambda: _scraped(sidecar, 'ome_gateway_publisher_split_maps{state="verified"} 1.0'), timeout=30)
                    assert "split_off{" not in await sidecar.metrics()
                    await eventually(lambda: "served split" not in _published_message(kube_api), timeout=15)
        finally:
            watching.cancel()
            await asyncio.gather(watching, return_exceptions=True)
            await stop(process)


async def _scraped(sidecar: RunningSidecar, line: str) -> bool:
    return line in await sidecar.metrics()


async def _listed(sidecar: RunningSidecar, *names: str, missing: tuple[str, ...] = ()) -> bool:
    """/debug/maps lists a window of CHAT for each of `names`, and none for `missing`."""
    instances = await sidecar.split()
    return all(n in instances for n in names) and not any(n in instances for n in missing)


def _published_message(kube_api) -> str:
    """The message of the sidecar's condition on CHAT; the map must be Published (a report, never a hold)."""
    current = kube_api.get(TM, CHAT.namespace, CHAT.name) or {}
    mine = [c for c in current.get("status", {}).get("conditions", []) if c.get("type") == condition_type("e2e")]
    if not mine:
        return ""
    assert mine[0]["reason"] == "Published", mine[0]
    return mine[0]["message"]


async def test_envoy_in_file_mode_reports_to_the_sidecars_lrs_server_and_the_demo_map_is_verified(tmp_path: Path) -> None:
    example = parse_manifests(str(demo.EXAMPLE), demo.EXAMPLE.read_text())
    maps, directory = tmp_path / "maps", tmp_path / "envoy"
    maps.mkdir()
    directory.mkdir()
    listen, admin, lrs = free_port(), free_port(), free_port()
    boot = tmp_path / "envoy.yaml"
    boot.write_text(bootstrap(envoy_dir=directory, listen_host="127.0.0.1", listen_port=listen, admin_host="127.0.0.1",
                              admin_port=admin, lrs=("127.0.0.1", lrs)))
    options = EnvoyOptions(envoy_dir=directory, envoy_admin=f"http://127.0.0.1:{admin}", envoy_lrs_listen=f"127.0.0.1:{lrs}")
    engine = ADAPTERS["envoy"].engine("envoy", options)
    async with Backends(demo.CLUSTERS) as backends:
        objects = demo.point_at(example, CHAT, {name: backends.endpoint(name) for name in demo.CLUSTERS})
        (maps / "chat.yaml").write_text(yaml.safe_dump_all(objects))
        publisher = Publisher(Stores.empty(), engine, LoopOptions(adapter_name="envoy", resync=3600))
        counter = engine.transport.request_counter
        # One second between reports instead of the CLI's floor of 10: the test's time, not the rule's.
        publisher.split = SplitVerifier(counter, 1.0, "envoy", publisher.split_changed)
        metrics.watch_split(publisher.split)
        source = DirectorySource(maps, publisher.stores, publisher, clock=publisher.clock, poll_interval=0.1)
        await engine.start()  # the empty files Envoy starts from
        running = asyncio.create_task(loop.run(publisher, source))
        try:
            async with run_envoy(boot, admin_url=f"http://127.0.0.1:{admin}", log_path=tmp_path / "envoy.log"):
                instance = "ome-gateway-publisher"  # the file mode bootstrap's node id
                await eventually(lambda: CHAT in publisher.published and instance in _instance_view(publisher), timeout=20)
                host = publisher.published[CHAT].hostname
                await asyncio.sleep(1.5)  # a report that may predate the clusters, then a window
                for _ in range(3):
                    await measure(f"http://127.0.0.1:{listen}/", host, WINDOW)
                    await asyncio.sleep(1.5)
                    if _instance_view(publisher)[instance]["verdict"] == "verified":
                        break
                window = _instance_view(publisher)[instance]
                assert window["verdict"] == "verified", window
                assert window["expected"] == {"worker-a": 0.4, "worker-b": 0.6}
                assert _near(window, "worker-a", 0.4)
                scrape = generate_latest(metrics.REGISTRY).decode()
                assert 'ome_gateway_publisher_split_maps{state="verified"} 1.0' in scrape
        finally:
            metrics.watch_split(None)
            running.cancel()
            await asyncio.gather(running, return_exceptions=True)
            await engine.aclose()
