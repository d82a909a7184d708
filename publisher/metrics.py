"""Every metric, defined once, the per-map series policy, and the HTTP app for /metrics, /healthz,
/readyz and /debug/maps.

Metrics live in one registry owned by this module. Other modules update the aggregate ones directly,
but per-map series only through `map_weights`, `map_state` and `forget_map`, so `--metrics-per-map`
decides here alone which maps have series. The app asks the loop for health and map state through
the small `Health` protocol, so this module knows nothing of the loop's internals.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterable, Mapping
from typing import Any, Literal, Protocol, get_args, runtime_checkable

from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Gauge, GCCollector, Histogram, PlatformCollector, ProcessCollector, disable_created_metrics
from prometheus_client.aiohttp import make_aiohttp_handler
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from publisher import __version__
from publisher.core.values import MapKey

PREFIX = "ome_gateway_publisher_"
REGISTRY = CollectorRegistry(auto_describe=True)
# A `_created` series per counter and histogram doubles what a scrape carries for a timestamp
# nothing here reads (rate() and increase() need only the counter itself).
disable_created_metrics()

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
MAP_FAILED = Gauge(
    PREFIX + "map_failed", "1 while a map's gateway write failed or was rejected, labelled with the reason.",
    ["namespace", "name", "reason"], registry=REGISTRY,
)
WEIGHT = Gauge(
    PREFIX + "weight", "The weight the gateway holds for a map's cluster (which maps: --metrics-per-map).",
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
STATUS_WRITES = Counter(
    PREFIX + "status_writes", "Status writes by outcome: TrafficMap conditions, or RegionReports in report mode.", ["result"], registry=REGISTRY
)

# Fail static: an API fault changes nothing the gateway serves, so it is reported here instead.
SOURCE_LAST_SUCCESS = Gauge(
    PREFIX + "source_last_success_timestamp_seconds",
    "Unix time of the last successful list, watch connection or watch event, by resource and namespace (\"\": all).",
    ["resource", "namespace"], registry=REGISTRY,
)
SOURCE_REFUSED = Gauge(
    PREFIX + "source_refused",
    "1 while the API server refuses our list or watch (400, 401, 403, 404: a selector, credentials, RBAC or a missing CRD).",
    ["resource", "namespace"], registry=REGISTRY,
)

BUILD_INFO.labels(version=__version__).set(1)
ProcessCollector(registry=REGISTRY)
PlatformCollector(registry=REGISTRY)
GCCollector(registry=REGISTRY)

# Label values known before anything happens: their series start at 0, so rate() and increase()
# see the first event instead of a series that appears with it. Only the paths the running
# sidecar can take get them (`start`): a series that can never move is noise on every dashboard.
MAP_STATES = ("published", "held", "withdrawn", "failed", "pending")
PUBLICATION_RESULTS = ("published", "withdrawn", "failed")
RELOAD_RESULTS = ("success", "rejected")
WATCHED_RESOURCES = ("trafficmaps", "inferenceservices")
STATUS_WRITE_RESULTS = ("written", "error")
for _state in MAP_STATES:
    MAPS.labels(state=_state).set(0)


def start(adapter: str, *, source: Literal["kube", "dir"] = "kube", reloads: bool = False, status: bool = True) -> None:
    """Pre-initialise the series of the paths this sidecar can take: its adapter's; reloads only
    for a gateway that reloads; watch restarts for the kube source, status writes when it writes
    status, source errors for the directory source."""
    for result in PUBLICATION_RESULTS:
        PUBLICATIONS.labels(adapter=adapter, result=result)
    if reloads:
        for result in RELOAD_RESULTS:
            RELOADS.labels(adapter=adapter, result=result)
    APPLY_DURATION.labels(adapter=adapter)
    EVENT_TO_APPLY.labels(adapter=adapter)
    if source == "kube":
        for resource in WATCHED_RESOURCES:
            WATCH_RESTARTS.labels(resource=resource, reason="Expired")
        if status:
            for result in STATUS_WRITE_RESULTS:
                STATUS_WRITES.labels(result=result)
    else:
        SOURCE_ERRORS.labels(source="dir")


# --- per-Envoy series of the xDS gateway ---------------------------------------------------------


@runtime_checkable
class EnvoyFleet(Protocol):
    """A gateway with Envoys connected to it (adapters.envoy.xds.XdsTransport): its `envoys()`
    are statuses with name (the `envoy` label), node, peer, nacks (by resource kind), unacked_since
    (monotonic), sent and refused (maps held back on it); `served(key)` says which version of a map each Envoy serves (for /debug/maps)."""

    def envoys(self) -> list[Any]: ...

    def served(self, key: MapKey) -> dict[str, str | None]: ...


class _EnvoyCollector:
    """Reads the connected Envoys from the transport at scrape time, so an Envoy that leaves
    leaves no series behind and the transport keeps no metrics of its own."""

    fleet: EnvoyFleet | None = None

    def describe(self) -> list[Any]:
        return []

    def collect(self) -> Iterable[Any]:
        if self.fleet is None:
            return []
        envoys = self.fleet.envoys()
        now = time.monotonic()
        connected = GaugeMetricFamily(PREFIX + "xds_envoys", "Envoys connected to the xDS server.", value=len(envoys))
        nacks = CounterMetricFamily(PREFIX + "xds_nacks", "Responses an Envoy refused since it connected, by resource kind.", labels=["envoy", "kind"])
        unacked = GaugeMetricFamily(
            PREFIX + "xds_oldest_unacked_seconds", "Age of the oldest change an Envoy has not ACKed (0: in sync).", labels=["envoy"]
        )
        sent = CounterMetricFamily(PREFIX + "xds_resources_sent", "Resources added or removed on an Envoy's stream.", labels=["envoy"])
        refused = GaugeMetricFamily(
            PREFIX + "xds_maps_refused", "Maps whose current weights an Envoy refused: it serves their older ones.", labels=["envoy"]
        )
        for envoy in envoys:
            name = envoy.name
            for kind in ("cluster", "scope", "route"):
                nacks.add_metric([name, kind], envoy.nacks.get(kind, 0))
            unacked.add_metric([name], 0.0 if envoy.unacked_since is None else now - envoy.unacked_since)
            sent.add_metric([name], envoy.sent)
            refused.add_metric([name], envoy.refused)
        return [connected, nacks, unacked, sent, refused]


_ENVOYS = _EnvoyCollector()
REGISTRY.register(_ENVOYS)


def watch_envoys(fleet: EnvoyFleet | None) -> None:
    """Export per-Envoy series for `fleet` (None: none)."""
    _ENVOYS.fleet = fleet


# --- the NGINX Lua table ---------------------------------------------------------------------------

# The reasons adapters.nginx.lua.LuaTransport counts a failure under: each exported from 0, so a
# first failure is an increase.
NGINX_TABLE_FAILURE_REASONS = ("invalid", "table_full", "unreachable", "unauthorized", "unconfirmed", "resolve")


@runtime_checkable
class NginxTableStats(Protocol):
    """What the Lua transport counts (adapters.nginx.lua.LuaStats); bytes are None until NGINX answered."""

    pushes: int
    failures: Mapping[str, int]
    restarts_detected: int
    counters_evicted: int
    bytes_free: int | None

    @property
    def bytes_used(self) -> int | None: ...


class _NginxTableCollector:
    """Reads the Lua transport's counters at scrape time, so the transport keeps no metrics of its own."""

    stats: NginxTableStats | None = None

    def describe(self) -> list[Any]:
        return []

    def collect(self) -> Iterable[Any]:
        stats = self.stats
        if stats is None:
            return []
        pushes = CounterMetricFamily(PREFIX + "nginx_table_pushes", "Batches NGINX's Lua table confirmed.", value=stats.pushes)
        failures = CounterMetricFamily(
            PREFIX + "nginx_table_failures", "Batches (and name lookups) that did not reach NGINX's Lua table, by reason.", labels=["reason"]
        )
        for reason in sorted({*NGINX_TABLE_FAILURE_REASONS, *stats.failures}):
            failures.add_metric([reason], stats.failures.get(reason, 0))
        restarts = CounterMetricFamily(
            PREFIX + "nginx_restarts_detected", "NGINX restarts seen by a new boot id (the table re-pushed).", value=stats.restarts_detected
        )
        evicted = CounterMetricFamily(
            PREFIX + "nginx_counters_evicted",
            "Request counters (served-split check) evicted from a full ome_counts dict: raise nginx-config --counts-dict-size.",
            value=stats.counters_evicted,
        )
        families = [pushes, failures, restarts, evicted]
        if stats.bytes_free is not None and stats.bytes_used is not None:
            families.append(GaugeMetricFamily(PREFIX + "nginx_table_used_bytes", "Bytes of NGINX's Lua table in use.", value=stats.bytes_used))
            families.append(GaugeMetricFamily(PREFIX + "nginx_table_free_bytes", "Bytes of NGINX's Lua table still free.", value=stats.bytes_free))
        return families


_NGINX_TABLE = _NginxTableCollector()
REGISTRY.register(_NGINX_TABLE)


def watch_nginx_table(stats: NginxTableStats | None) -> None:
    """Export the Lua table's series from `stats` (None: none)."""
    _NGINX_TABLE.stats = stats


# --- the served-split check ----------------------------------------------------------------------

SPLIT_STATES = ("verified", "off", "few_requests", "unsupported")


class SplitView(Protocol):
    """What publisher.split.check.SplitVerifier knows, read at scrape time."""

    folded: Mapping[str, int]
    fold_seconds: float
    map_states: Mapping[str, int]

    def off(self) -> list[tuple[MapKey, str]]: ...


class _SplitCollector:
    """The served-split series: `split_off` exists only while a map is off on an instance, so its
    series are bounded by the maps that are wrong, as `--metrics-per-map problems` is."""

    view: SplitView | None = None

    def describe(self) -> list[Any]:
        return []

    def collect(self) -> Iterable[Any]:
        view = self.view
        if view is None:
            return []
        states = GaugeMetricFamily(PREFIX + "split_maps", "Published maps by served-split verdict.", labels=["state"])
        for state in SPLIT_STATES:
            states.add_metric([state], view.map_states.get(state, 0))
        off = GaugeMetricFamily(
            PREFIX + "split_off", "1 while a map's served split is off on a gateway instance.", labels=["namespace", "name", "gateway"]
        )
        for key, instance in view.off():
            off.add_metric([key.namespace, key.name, instance], 1)
        folded = CounterMetricFamily(PREFIX + "split_counts", "Request counts folded (one per gateway instance and interval), by gateway instance.", labels=["gateway"])
        # Its name until issue 28, kept for one release so dashboards and alerts can move.
        deprecated = CounterMetricFamily(PREFIX + "split_reports", "Deprecated (one release): split_counts_total's old name.", labels=["gateway"])
        for instance, count in sorted(view.folded.items()):
            folded.add_metric([instance], count)
            deprecated.add_metric([instance], count)
        fold = CounterMetricFamily(PREFIX + "split_fold_seconds", "Time spent folding and judging request counts.", value=view.fold_seconds)
        return [states, off, folded, deprecated, fold]


_SPLIT = _SplitCollector()
REGISTRY.register(_SPLIT)


def watch_split(view: SplitView | None) -> None:
    """Export the served-split series of `view` (None: none; a gateway that counts nothing)."""
    _SPLIT.view = view


# --- per-map series ------------------------------------------------------------------------------

PerMap = Literal["all", "problems", "none"]
PER_MAP_CHOICES: tuple[str, ...] = get_args(PerMap)
_PROBLEM_GAUGES = {"held": MAP_HELD, "failed": MAP_FAILED}


class _Backend(Protocol):
    @property
    def cluster(self) -> str: ...

    @property
    def weight(self) -> int: ...


class _Served(Protocol):
    """What the gateway serves for a map (a Publication or a Route): only its backends matter here."""

    @property
    def backends(self) -> Iterable[_Backend]: ...


class _PerMapSeries:
    """Which maps have `weight`, `map_held` and `map_failed` series. `problems` (the default) gives
    them only to held or failed maps, so 10,000 healthy maps cost no per-map series at all, while a
    map that needs attention shows its reason and the weights the gateway still serves for it."""

    def __init__(self) -> None:
        self.policy: PerMap = "problems"
        self._weights: dict[MapKey, tuple[tuple[str, int], ...]] = {}
        self._problems: dict[MapKey, tuple[str, str]] = {}  # key -> (state, reason)

    def configure(self, policy: PerMap) -> None:
        for key in list(self._weights.keys() | self._problems.keys()):
            self.forget(key)
        self.policy = policy

    def _weights_shown(self, key: MapKey) -> bool:
        return self.policy == "all" or (self.policy == "problems" and key in self._problems)

    def weights(self, key: MapKey, served: _Served | None) -> None:
        new = tuple((b.cluster, b.weight) for b in served.backends) if served is not None else ()
        old = self._weights.pop(key, ())
        if new and self.policy != "none":
            self._weights[key] = new
        if self._weights_shown(key):
            self._show_weights(key, old, new)

    def state(self, key: MapKey, state: str, reason: str | None) -> None:
        if self.policy == "none":
            return
        was_shown = self._weights_shown(key)
        old = self._problems.pop(key, None)
        if old is not None:
            _PROBLEM_GAUGES[old[0]].remove(key.namespace, key.name, old[1])
        if state in _PROBLEM_GAUGES:
            self._problems[key] = (state, reason or "")
            _PROBLEM_GAUGES[state].labels(namespace=key.namespace, name=key.name, reason=reason or "").set(1)
        shown = self._weights.get(key, ())
        if was_shown and not self._weights_shown(key):
            self._show_weights(key, shown, ())
        elif self._weights_shown(key) and not was_shown:
            self._show_weights(key, (), shown)

    def forget(self, key: MapKey) -> None:
        if self._weights_shown(key):
            self._show_weights(key, self._weights.get(key, ()), ())
        self._weights.pop(key, None)
        problem = self._problems.pop(key, None)
        if problem is not None:
            _PROBLEM_GAUGES[problem[0]].remove(key.namespace, key.name, problem[1])

    @staticmethod
    def _show_weights(key: MapKey, old: tuple[tuple[str, int], ...], new: tuple[tuple[str, int], ...]) -> None:
        clusters = {cluster for cluster, _ in new}
        for cluster, _ in old:
            if cluster not in clusters:
                WEIGHT.remove(key.namespace, key.name, cluster)
        for cluster, weight in new:
            WEIGHT.labels(namespace=key.namespace, name=key.name, cluster=cluster).set(weight)


_PER_MAP = _PerMapSeries()


def per_map(policy: PerMap) -> None:
    """Set `--metrics-per-map`; drops every per-map series recorded so far."""
    _PER_MAP.configure(policy)


def map_weights(key: MapKey, served: _Served | None) -> None:
    """The gateway now serves `served` for `key` (None: nothing)."""
    _PER_MAP.weights(key, served)


def map_state(key: MapKey, state: str, reason: str | None) -> None:
    """The loop decided `state` (published, held, withdrawn, failed, pending) for `key`."""
    _PER_MAP.state(key, state, reason)


def forget_map(key: MapKey) -> None:
    """`key` left every record of the loop: drop its series."""
    _PER_MAP.forget(key)


class Health(Protocol):
    """What the HTTP endpoints ask of the running loop."""

    def alive(self) -> bool: ...

    def ready(self) -> tuple[bool, str]: ...

    def debug_maps(self) -> list[dict[str, Any]]: ...


HEALTH = web.AppKey("health", Health)


_PROMETHEUS_HANDLER = make_aiohttp_handler(REGISTRY)


async def _metrics(request: web.Request) -> web.Response:
    # prometheus_client's handler negotiates OpenMetrics and gzip, but renders without ever
    # awaiting: with --metrics-per-map all and 10,000 maps that is tens of thousands of series, so
    # it runs on a worker thread's own event loop and the sidecar's loop goes on meanwhile.
    return await asyncio.to_thread(asyncio.run, _PROMETHEUS_HANDLER(request))


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
