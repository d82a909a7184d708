"""Every metric, defined once, and the HTTP app for /metrics, /healthz, /readyz and /debug/maps.

Metrics live in one registry owned by this module; other modules import the objects and update
them. The app asks the loop for health and map state through the small `Health` protocol, so
this module knows nothing of the loop's internals.
"""

from __future__ import annotations

from typing import Any, Protocol

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from publisher import __version__

PREFIX = "ome_gateway_publisher_"
REGISTRY = CollectorRegistry(auto_describe=True)

# Watch-to-gateway latency targets sit at tens of milliseconds; NGINX reload coalescing at seconds.
_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)

PUBLICATIONS = Counter(
    PREFIX + "publications", "Map publications by outcome (published, rejected, failed, withdrawn).",
    ["adapter", "result"], registry=REGISTRY,
)
APPLY_DURATION = Histogram(
    PREFIX + "apply_duration_seconds", "Time one adapter apply took, confirmation included.",
    ["adapter"], buckets=_LATENCY_BUCKETS, registry=REGISTRY,
)
EVENT_TO_APPLY = Histogram(
    PREFIX + "event_to_apply_seconds", "From the watch event or file change to the gateway confirming the write.",
    ["adapter"], buckets=_LATENCY_BUCKETS, registry=REGISTRY,
)
MAPS = Gauge(PREFIX + "maps", "Maps by state (published, held, withdrawn, pending).", ["state"], registry=REGISTRY)
MAP_HELD = Gauge(
    PREFIX + "map_held", "1 while a map is held, labelled with the gate's reason.",
    ["namespace", "name", "reason"], registry=REGISTRY,
)
WEIGHT = Gauge(
    PREFIX + "weight", "The weight the gateway holds for a map's cluster.",
    ["namespace", "name", "cluster"], registry=REGISTRY,
)
VERIFICATION_FAILURES = Counter(
    PREFIX + "verification_failures", "Maps whose weights differed from the recomputed ones.", registry=REGISTRY,
)
WATCH_RESTARTS = Counter(
    PREFIX + "watch_restarts", "Watch reconnects and relists by resource and reason.",
    ["resource", "reason"], registry=REGISTRY,
)
RELOADS = Counter(PREFIX + "reloads", "Gateway reloads by outcome.", ["adapter", "result"], registry=REGISTRY)
LAST_SUCCESS = Gauge(
    PREFIX + "last_success_timestamp_seconds", "Unix time of the last apply the gateway confirmed.",
    ["adapter"], registry=REGISTRY,
)
BUILD_INFO = Gauge(PREFIX + "build_info", "Always 1; the version label says which build runs.", ["version"], registry=REGISTRY)
SOURCE_ERRORS = Counter(PREFIX + "source_errors", "Source inputs that could not be read (a bad manifest file).", ["source"], registry=REGISTRY)
INTERNAL_ERRORS = Counter(
    PREFIX + "internal_errors", "Maps held because deciding or rendering them raised unexpectedly.", registry=REGISTRY,
)
STATUS_WRITES = Counter(PREFIX + "status_writes", "TrafficMap status condition writes by outcome.", ["result"], registry=REGISTRY)

BUILD_INFO.labels(version=__version__).set(1)


class Health(Protocol):
    """What the HTTP endpoints ask of the running loop."""

    def alive(self) -> bool: ...

    def ready(self) -> tuple[bool, str]: ...

    def debug_maps(self) -> list[dict[str, Any]]: ...


HEALTH = web.AppKey("health", Health)


async def _metrics(request: web.Request) -> web.Response:
    body = generate_latest(REGISTRY)
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})


async def _healthz(request: web.Request) -> web.Response:
    alive = request.app[HEALTH].alive()
    return web.Response(status=200 if alive else 503, text="ok\n" if alive else "loop stopped\n")


async def _readyz(request: web.Request) -> web.Response:
    ready, why = request.app[HEALTH].ready()
    return web.Response(status=200 if ready else 503, text=f"{why}\n")


async def _debug_maps(request: web.Request) -> web.Response:
    return web.json_response({"maps": request.app[HEALTH].debug_maps()})


def make_app(health: Health) -> web.Application:
    app = web.Application()
    app[HEALTH] = health
    app.router.add_get("/metrics", _metrics)
    app.router.add_get("/healthz", _healthz)
    app.router.add_get("/readyz", _readyz)
    app.router.add_get("/debug/maps", _debug_maps)
    return app
