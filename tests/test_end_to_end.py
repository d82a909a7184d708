"""TrafficMap to traffic: the fake API server, the loop, the Envoy adapter and a real Envoy."""

from __future__ import annotations

import asyncio

import pytest

from adapters import ADAPTERS
from adapters.envoy import EnvoyOptions
from adapters.envoy.bootstrap import bootstrap
from adapters.envoy.process import run_envoy
from publisher import loop
from publisher.kube import Kube
from publisher.loop import LoopOptions, Publisher
from publisher.core.values import MapKey
from publisher.status import ConditionSink
from publisher.source.informer import WatchOptions
from publisher.source.kube_source import KubeSource
from publisher.source.store import Stores
from tests.builders import make_condition, make_entry, make_isvc, make_map
from tests.gateways import Backends, assert_measured_split, eventually, free_port

TM = "ome.io/v1beta1/trafficmaps"
HOST = "chat.example.com"


def entries(backends: Backends, ready_a: int, ready_b: int) -> list[dict]:
    return [
        make_entry("worker-a", allocated=ready_a, ready=ready_a, weight=ready_a, endpoint=backends.endpoint("worker-a")),
        make_entry("worker-b", allocated=ready_b, ready=ready_b, weight=ready_b, endpoint=backends.endpoint("worker-b")),
    ]


@pytest.mark.slow
async def test_a_trafficmap_change_is_live_in_envoy_within_a_second(kube_api, kubeconfig, tmp_path):
    async with Backends(("worker-a", "worker-b")) as backends:
        isvc = kube_api.create(make_isvc(host=HOST))
        kube_api.create(make_map(generation=1, isvc_uid=isvc["metadata"]["uid"], observed_isvc_generation=1,
                                 entries=entries(backends, 1, 1)))
        directory = tmp_path / "envoy"
        directory.mkdir()
        listen, admin = free_port(), free_port()
        boot = tmp_path / "bootstrap.yaml"
        boot.write_text(bootstrap(envoy_dir=directory, listen_host="127.0.0.1", listen_port=listen,
                                  admin_host="127.0.0.1", admin_port=admin))
        adapter = ADAPTERS["envoy"].engine("envoy", EnvoyOptions(envoy_dir=directory, envoy_admin=f"http://127.0.0.1:{admin}"))
        kube = await Kube.connect(kubeconfig)
        stores = Stores.empty()
        publisher = Publisher(stores, adapter, LoopOptions(adapter_name="envoy", region="e2e"),
                              status_sink=ConditionSink(kube, stores.maps, "e2e"))
        source = KubeSource(kube, stores, publisher, WatchOptions(), clock=publisher.clock)
        await adapter.start()  # the empty files Envoy starts from
        url = f"http://127.0.0.1:{listen}/"
        try:
            async with run_envoy(boot, admin_url=f"http://127.0.0.1:{admin}", log_path=tmp_path / "envoy.log"):
                task = asyncio.create_task(loop.run(publisher, source))
                try:
                    chat = MapKey("prod", "chat")
                    await eventually(lambda: chat in publisher.published)
                    await assert_measured_split(url, HOST, {"worker-a": 1, "worker-b": 1}, 1000)

                    current = kube_api.get(TM, "prod", "chat")
                    current["spec"]["entries"] = entries(backends, 3, 1)
                    current["status"]["conditions"] = [make_condition("Routable", observed_generation=2)]
                    kube_api.update(current)
                    # Published means Envoy's admin confirmed the new version: the one second.
                    await eventually(lambda: [b.weight for b in publisher.published[chat].backends] == [3, 1], timeout=1.0,
                                     interval=0.01)
                    await assert_measured_split(url, HOST, {"worker-a": 3, "worker-b": 1}, 1000)
                finally:
                    task.cancel()
                    await asyncio.gather(task, return_exceptions=True)
        finally:
            await adapter.aclose()
            await kube.close()
