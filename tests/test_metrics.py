from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from publisher import metrics


@dataclass
class FakeHealth:
    is_alive: bool = True
    readiness: tuple[bool, str] = (True, "ready")
    maps: list[dict[str, Any]] = field(default_factory=list)

    def alive(self) -> bool:
        return self.is_alive

    def ready(self) -> tuple[bool, str]:
        return self.readiness

    def debug_maps(self) -> list[dict[str, Any]]:
        return self.maps


async def test_health_endpoints_follow_the_loop(aiohttp_client):
    health = FakeHealth(is_alive=False, readiness=(False, "waiting for the first sync"))
    client = await aiohttp_client(metrics.make_app(health))
    assert (await client.get("/healthz")).status == 503
    response = await client.get("/readyz")
    assert response.status == 503 and "waiting for the first sync" in await response.text()
    health.is_alive, health.readiness = True, (True, "ready")
    assert (await client.get("/healthz")).status == 200
    assert (await client.get("/readyz")).status == 200


async def test_debug_maps_is_json(aiohttp_client):
    health = FakeHealth(maps=[{"namespace": "prod", "name": "chat", "decision": "held", "reason": "VerificationFailed"}])
    client = await aiohttp_client(metrics.make_app(health))
    assert await (await client.get("/debug/maps")).json() == {"maps": health.maps}


async def test_metrics_are_exposed_with_their_labels(aiohttp_client):
    metrics.MAP_HELD.labels(namespace="prod", name="test-metrics", reason="VerificationFailed").set(1)
    client = await aiohttp_client(metrics.make_app(FakeHealth()))
    response = await client.get("/metrics")
    text = await response.text()
    assert response.headers["Content-Type"].startswith("text/plain")
    assert 'ome_gateway_publisher_map_held{name="test-metrics",namespace="prod",reason="VerificationFailed"} 1.0' in text
    for name in ("publications_total", "apply_duration_seconds", "event_to_apply_seconds", "maps", "weight",
                 "verification_failures_total", "watch_restarts_total", "reloads_total",
                 "last_success_timestamp_seconds", "build_info"):
        assert f"# HELP ome_gateway_publisher_{name} " in text, name
    metrics.MAP_HELD.remove("prod", "test-metrics", "VerificationFailed")


# --- issue 14: metrics that scale -----------------------------------------------------------------

import gzip  # noqa: E402
import threading  # noqa: E402

import pytest  # noqa: E402
from prometheus_client.metrics_core import GaugeMetricFamily  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from publisher.loop import LoopOptions, Publisher  # noqa: E402
from publisher.core.model import parse_traffic_map  # noqa: E402
from publisher.core.values import Backend, MapKey, Publication  # noqa: E402
from publisher.source.objects import parse_isvc  # noqa: E402
from publisher.source.store import Stores  # noqa: E402
from tests.builders import make_entry, make_isvc, make_map  # noqa: E402
from tests.fakes.memory_adapter import memory_engine  # noqa: E402

CHAT = MapKey("prod", "chat")


@pytest.fixture(autouse=True)
def default_per_map_policy():
    metrics.per_map("problems")
    yield
    metrics.per_map("problems")


def publication(key: MapKey, *weights: int) -> Publication:
    backends = tuple(Backend(cluster=f"worker-{i}", endpoint=f"http://w{i}.example:8000", weight=w) for i, w in enumerate(weights))
    return Publication(namespace=key.namespace, name=key.name, hostname=f"{key.name}.example", generation=1,
                       observed_isvc_generation=1, backends=backends)


def samples(name: str) -> dict[tuple[tuple[str, str], ...], float]:
    """Every sample of one metric now in the registry, by its sorted labels."""
    found = {}
    for family in metrics.REGISTRY.collect():
        for sample in family.samples:
            if sample.name == metrics.PREFIX + name:
                found[tuple(sorted(sample.labels.items()))] = sample.value
    return found


def per_map_series(key: MapKey) -> set[str]:
    names = set()
    for name in ("weight", "map_held", "map_failed"):
        for labels in samples(name):
            if ("name", key.name) in labels and ("namespace", key.namespace) in labels:
                names.add(name)
    return names


async def test_metrics_negotiate_openmetrics_and_gzip(aiohttp_client):
    client = await aiohttp_client(metrics.make_app(FakeHealth()))
    response = await client.get("/metrics", headers={"Accept": "application/openmetrics-text; version=1.0.0", "Accept-Encoding": "gzip"},
                                auto_decompress=False)
    assert response.status == 200
    assert response.headers["Content-Type"].startswith("application/openmetrics-text")
    assert response.headers["Content-Encoding"] == "gzip"
    text = gzip.decompress(await response.read()).decode()
    assert text.rstrip().endswith("# EOF")
    plain = await client.get("/metrics", headers={"Accept-Encoding": "identity"})
    assert plain.headers["Content-Type"].startswith("text/plain") and "Content-Encoding" not in plain.headers


async def test_process_and_platform_metrics_are_exposed(aiohttp_client):
    client = await aiohttp_client(metrics.make_app(FakeHealth()))
    text = await (await client.get("/metrics")).text()
    names = {family.name for family in text_string_to_metric_families(text)}
    assert {"process_resident_memory_bytes", "process_cpu_seconds", "process_open_fds", "python_info"} <= names


def test_labelled_counters_start_at_zero_for_their_known_labels():
    # An adapter name no other test publishes through: the registry is the process's.
    metrics.start("counters-test", reloads=True)
    metrics.start("json", source="dir")
    publications = samples("publications_total")
    for result in ("published", "withdrawn", "failed"):
        assert publications[(("adapter", "counters-test"), ("result", result))] == 0.0
    assert samples("reloads_total")[(("adapter", "counters-test"), ("result", "rejected"))] == 0.0
    assert (("result", "error"),) in samples("status_writes_total")
    assert (("reason", "Expired"), ("resource", "trafficmaps")) in samples("watch_restarts_total")
    assert (("source", "dir"),) in samples("source_errors_total")
    assert samples("apply_duration_seconds_count")[(("adapter", "counters-test"),)] == 0.0
    assert {labels[0][1] for labels in samples("maps")} >= {"published", "held", "withdrawn", "failed", "pending"}


def test_problems_policy_gives_series_only_to_held_or_failed_maps():
    metrics.map_weights(CHAT, publication(CHAT, 2, 3))
    metrics.map_state(CHAT, "published", None)
    assert per_map_series(CHAT) == set()
    metrics.map_state(CHAT, "held", "VerificationFailed")
    assert per_map_series(CHAT) == {"map_held", "weight"}
    assert samples("weight")[(("cluster", "worker-1"), ("name", "chat"), ("namespace", "prod"))] == 3.0  # still served
    metrics.map_state(CHAT, "failed", "ApplyFailed")
    assert per_map_series(CHAT) == {"map_failed", "weight"}
    metrics.map_weights(CHAT, publication(CHAT, 1))
    assert {labels[0][1] for labels in samples("weight") if ("name", "chat") in labels} == {"worker-0"}
    metrics.map_state(CHAT, "published", None)
    assert per_map_series(CHAT) == set()


def test_all_policy_shows_every_published_map_and_forgets_deleted_ones():
    metrics.per_map("all")
    metrics.map_weights(CHAT, publication(CHAT, 2, 3))
    metrics.map_state(CHAT, "published", None)
    assert per_map_series(CHAT) == {"weight"}
    metrics.map_state(CHAT, "held", "SourceMissing")
    assert per_map_series(CHAT) == {"weight", "map_held"}
    metrics.forget_map(CHAT)
    assert per_map_series(CHAT) == set()


def test_none_policy_gives_no_map_a_series():
    metrics.per_map("none")
    metrics.map_weights(CHAT, publication(CHAT, 2, 3))
    metrics.map_state(CHAT, "held", "VerificationFailed")
    assert per_map_series(CHAT) == set()


class _ThreadRecorder:
    """A collector that notes which thread collects it."""

    def __init__(self) -> None:
        self.threads: list[int] = []

    def collect(self):
        self.threads.append(threading.get_ident())
        yield GaugeMetricFamily("test_thread_recorder", "which thread rendered /metrics", value=1)


async def test_metrics_render_off_the_event_loop_thread(aiohttp_client):
    recorder = _ThreadRecorder()
    metrics.REGISTRY.register(recorder)
    recorder.threads.clear()  # the registry collects once on register, to describe the collector
    try:
        client = await aiohttp_client(metrics.make_app(FakeHealth()))
        assert "test_thread_recorder 1.0" in await (await client.get("/metrics")).text()
    finally:
        metrics.REGISTRY.unregister(recorder)
    assert recorder.threads and threading.get_ident() not in recorder.threads


async def test_ten_thousand_healthy_maps_scrape_small_by_default(aiohttp_client):
    """Finding 1: at 10,000 published maps of 4 entries (and one held), the default scrape carries
    no per-map series but the held map's, and stays under 100 KB uncompressed."""
    stores = Stores.empty()
    engine, _ = memory_engine()
    publisher = Publisher(stores, engine, LoopOptions(adapter_name=engine.name))
    isvc = parse_isvc(make_isvc("m", host=None))  # each map its own hostname, from the template
    assert isvc is not None
    entries = [make_entry(f"worker-{j}", allocated=1, ready=1, weight=1) for j in range(4)]
    for i in range(10_000):
        tm = parse_traffic_map(make_map(f"m{i:05d}", entries=entries))
        stores.maps.upsert(tm.key, tm, "1")
        stores.isvcs.upsert(tm.key, isvc, "1")
    bad = make_map("m00000", entries=[{**entries[0], "weight": 7}, *entries[1:]])
    stores.maps.upsert(MapKey("prod", "m00000"), parse_traffic_map(bad), "2")
    await publisher.sync_once(dict.fromkeys(stores.maps.keys()))
    assert sum(state.state == "published" for state in publisher.states.values()) == 9_999
    client = await aiohttp_client(metrics.make_app(FakeHealth()))
    body = await (await client.get("/metrics")).read()
    families = list(text_string_to_metric_families(body.decode()))
    assert samples("map_held") == {(("name", "m00000"), ("namespace", "prod"), ("reason", "VerificationFailed")): 1.0}
    assert samples("weight") == {}
    assert len(body) < 100_000, len(body)
    assert sum(len(f.samples) for f in families) < 500


async def test_a_map_the_gateway_refuses_shows_the_weights_it_still_serves():
    """Through the loop: a refused change makes the map `failed`; under `problems` it gains
    map_failed and the weights the gateway kept, and loses both once a write goes through."""
    from tests.fakes.memory_adapter import MemoryGateway

    gateway = MemoryGateway()
    engine, _ = memory_engine(gateway)
    stores = Stores.empty()
    publisher = Publisher(stores, engine, LoopOptions(adapter_name=engine.name))
    isvc = parse_isvc(make_isvc())
    assert isvc is not None
    stores.isvcs.upsert(CHAT, isvc, "1")

    async def put(raw: dict) -> None:
        tm = parse_traffic_map(raw)
        stores.maps.upsert(tm.key, tm, raw["metadata"]["resourceVersion"])
        await publisher.sync_once({CHAT: None})

    await put(make_map())
    assert publisher.states[CHAT].state == "published" and per_map_series(CHAT) == set()
    gateway.reject[CHAT] = "gateway refused it"
    rescaled = make_map(generation=4, resource_version="2", entries=[make_entry("worker-a", allocated=4, ready=4, weight=1)])
    await put(rescaled)
    assert publisher.states[CHAT].state == "failed"
    assert per_map_series(CHAT) == {"map_failed", "weight"}
    assert {labels[0][1]: value for labels, value in samples("weight").items()} == {"worker-a": 2.0, "worker-b": 3.0}
    gateway.reject.clear()
    await put({**rescaled, "metadata": {**rescaled["metadata"], "resourceVersion": "3"}})
    assert publisher.states[CHAT].state == "published" and per_map_series(CHAT) == set()
