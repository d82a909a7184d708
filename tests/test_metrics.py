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
