"""The Gateway API gateway: per map, an HTTPRoute `<map>-<instance>` and an ExternalName Service per backend.

`HttpRouteRenderer` (pure) renders a map's Route as an `ObjectGroup`, with our labels and no
generation. `HttpRouteTransport` server-side applies groups a bounded number at a time, reads the
gateway's verdict from route status, collects what maps left (weights to 0, route, Services) and
reads back what our objects serve. It never touches an object without our labels (OME's own
`<isvc>-global` route included), and does all Kubernetes I/O through publisher.kube.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import ipaddress
import json
import logging
import re
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, TypeVar

import aiohttp
from pydantic import BaseModel, ConfigDict, Field, field_validator

from adapters.base import AdapterError, Rejected, TransportDefaults, Unavailable, WriteResult
from adapters.timeouts import RouteTimeout, route_timeout_field, unit_duration
from publisher.kube import HTTP_ROUTES, SERVICES, Kube, KubeError
from publisher.model import (
    Duration,
    Backend,
    Held,
    MapKey,
    Reason,
    Route,
    is_dns_label,
    is_dns_subdomain,
    parse_endpoint,
)

log = logging.getLogger("adapters.httproute")

__all__ = [
    "BackendRef",
    "HttpRouteOptions",
    "HttpRouteRenderer",
    "HttpRouteTransport",
    "ObjectGroup",
    "UNKNOWN_ROUTE",
    "build",
    "parse_route",
    "render_route",
    "render_service",
    "route_name",
    "route_verdict",
    "service_name",
]

MAX_BACKEND_REFS = 16  # Gateway API v1: at most 16 backendRefs per rule.
MAX_NAME = 63  # A DNS label: what Service names must be, and the bound the issue sets on route names.
GATEWAY_GROUP = "gateway.networking.k8s.io"
MANAGED_BY_LABEL = "app.kubernetes.io/managed-by"
MANAGED_BY = "ome-gateway-publisher"
INSTANCE_LABEL = "gateway-publisher.ome.io/instance"
SOURCE_NAMESPACE_LABEL = "gateway-publisher.ome.io/source-namespace"
SOURCE_NAME_LABEL = "gateway-publisher.ome.io/source-name"
MAP_ANNOTATION = "gateway-publisher.ome.io/map"
CLUSTER_ANNOTATION = "gateway-publisher.ome.io/cluster"
ENDPOINTS_ANNOTATION = "gateway-publisher.ome.io/endpoints"
ALL_ZERO_NOTE = "every weight is 0: Gateway API answers this host with HTTP 500, not 503"
NOT_REPORTED_NOTE = "the gateway has not reported on the route yet"
# Requests in flight at once: enough to hide the API server's latency at start (10,000 maps), few
# enough to stay well inside API Priority and Fairness' default share for one client.
_CONCURRENCY = 32
# Up to this many routes are looked at one GET each; more, and one list of them all is cheaper.
_GET_LIMIT = 32
# How often a route's status is read while waiting for the gateway controller to report on it:
# the first look soon (a healthy controller reconciles in well under a second), then less often.
_STATUS_POLL_SECONDS = 0.05
_STATUS_POLL_MAX_SECONDS = 1.0
_PAGE = 500  # list page size, as kubectl's
_PARSE_BATCH = 100  # objects read back between two yields to the event loop (about 15 ms of parsing)

_R = TypeVar("_R")

# What read() says a route of ours serves when it is not as we render it (another parent, a
# Service pointing elsewhere or gone, a refusal): no hostname, so it equals no map's route and the
# engine rewrites it, or withdraws it when its map is gone.
UNKNOWN_ROUTE = Route("", ())


# `<map>-global` names OME's own route for an InferenceService: an instance of this name would
# write routes named like OME's. The chart refuses it too (tools/chart_limits.py).
RESERVED_INSTANCE = "global"


class HttpRouteOptions(BaseModel):
    """Where the routes go and how they point at the workload clusters."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    gateway_kubeconfig: Path | None = Field(
        default=None,
        description="Kubeconfig of the gateway's cluster; none means in-cluster, as the sidecar runs beside the gateway.",
    )
    gateway: str = Field(description="The parent Gateway, NAMESPACE/NAME; required, as there is no default Gateway.")
    backend_port: int = Field(
        ge=1, le=65535, description="Port of every ExternalName Service; required, as only the install knows it."
    )
    route_namespace: str | None = Field(
        default=None,
        description="Namespace of the routes and Services; none keeps each beside its map, as OME's own publisher does.",
    )
    name: str = Field(default="default", description="The publisher instance (--name); 'default' as the CLI's default.")
    route_status_timeout: Duration = Field(
        default=5.0,
        description="How long to wait for the gateway to report on a route; covers a healthy controller's reconcile.",
    )
    route_timeout: RouteTimeout = route_timeout_field()

    @field_validator("gateway")
    @classmethod
    def _namespaced_name(cls, value: str) -> str:
        namespace, _, name = value.partition("/")
        if not is_dns_label(namespace) or not is_dns_subdomain(name):
            raise ValueError(f"{value!r} is not NAMESPACE/NAME")
        return value

    @field_validator("route_namespace")
    @classmethod
    def _namespace(cls, value: str | None) -> str | None:
        if value is not None and not is_dns_label(value):
            raise ValueError(f"{value!r} is not a DNS label")
        return value

    @field_validator("name")
    @classmethod
    def _instance(cls, value: str) -> str:
        if not is_dns_label(value):
            raise ValueError(f"{value!r} is not a DNS label")
        if value == RESERVED_INSTANCE:
            # `<map>-global` is the name of OME's own route for the same InferenceService.
            raise ValueError("'global' would name our routes like OME's own '<isvc>-global'")
        return value

    @property
    def gateway_namespace(self) -> str:
        return self.gateway.partition("/")[0]

    @property
    def gateway_name(self) -> str:
        return self.gateway.partition("/")[2]

    @property
    def field_manager(self) -> str:
        return f"ome-gateway-publisher-{self.name}"

    def namespace_for(self, key: MapKey) -> str:
        return self.route_namespace or key.namespace


# --- Pure: names, validation, rendering, reading back ---------------------------------------------


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:10]


def _bounded(name: str, seed: str, limit: int = MAX_NAME) -> str:
    """`name` when it fits in `limit`, else a prefix of it and a hash of `seed` (which names it whole)."""
    if len(name) <= limit:
        return name
    suffix = _digest(seed)
    return f"{name[: limit - len(suffix) - 1].rstrip('-.')}-{suffix}"


def route_name(key: MapKey, instance: str) -> str:
    """`<map name>-<instance>`, at most 63 characters (a hash of the whole key when cut)."""
    return _bounded(f"{key.name}-{instance}", f"{key.namespace}/{key.name}/{instance}")


def service_name(key: MapKey, cluster: str, instance: str) -> str:
    """The ExternalName Service for one backend: a DNS-1035 label, readable, unique by its hash."""
    readable = re.sub(r"[^a-z0-9]+", "-", f"{key.name[:20]}-{cluster[:20]}").strip("-")
    return f"ogp-{readable}-{_digest(f'{key.namespace}/{key.name}/{cluster}/{instance}')}"


def _label_value(value: str) -> str:
    """A label value (at most 63 characters); the exact value travels in an annotation."""
    return _bounded(value, value)


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return False
    return True


@dataclass(frozen=True, slots=True)
class BackendRef:
    """One backend as the route weighs it, and the ExternalName Service it points at."""

    cluster: str
    endpoint: str
    weight: int
    service: str
    external_name: str  # the endpoint's host, which the Service points at


def _ref(key: MapKey, cluster: str, endpoint: str, weight: int, instance: str) -> BackendRef:
    return BackendRef(cluster, endpoint, weight, service_name(key, cluster, instance), parse_endpoint(endpoint).host.lower())


@dataclass(frozen=True, slots=True)
class ObjectGroup:
    """One map's objects on the gateway's cluster: its route and the Services it points at. Equal
    groups are equal objects; no generation is in it, so a generation-only change writes nothing."""

    key: MapKey
    namespace: str  # of the route and its Services
    route: str  # the route's name
    hostname: str
    refs: tuple[BackendRef, ...]

    @property
    def all_zero(self) -> bool:
        return not any(ref.weight for ref in self.refs)

    @property
    def served(self) -> Route:
        return Route(self.hostname, tuple(Backend(r.cluster, r.endpoint, r.weight) for r in self.refs))

    def zeroed(self) -> ObjectGroup:
        return replace(self, refs=tuple(replace(r, weight=0) for r in self.refs))


class HttpRouteRenderer:
    """Pure: how an HTTPRoute and its ExternalName Services express one map."""

    def __init__(self, options: HttpRouteOptions) -> None:
        self._options = options

    def problem(self, key: MapKey, route: Route) -> str | None:
        """What an HTTPRoute cannot carry, beyond the shared strict checks."""
        if _is_ip(route.hostname):
            return f"hostname {route.hostname!r} is an IP address, which is not a Gateway API hostname"
        if len(route.backends) > MAX_BACKEND_REFS:
            return f"{len(route.backends)} backends, but Gateway API allows at most {MAX_BACKEND_REFS} backendRefs per rule"
        for backend in route.backends:
            host = parse_endpoint(backend.endpoint).host
            if _is_ip(host):
                return (
                    f"backends[{backend.cluster}].endpoint host {host} is an IP address, "
                    "which an ExternalName Service cannot hold"
                )
            if not is_dns_subdomain(host.lower()):
                return f"backends[{backend.cluster}].endpoint host {host!r} is not a DNS-1123 subdomain"
        return None

    def render(self, key: MapKey, route: Route) -> ObjectGroup:
        instance = self._options.name
        refs = tuple(_ref(key, b.cluster, b.endpoint, b.weight, instance) for b in route.backends)
        return ObjectGroup(key, self._options.namespace_for(key), route_name(key, instance), route.hostname, refs)


def _labels(key: MapKey, instance: str) -> dict[str, str]:
    return {
        MANAGED_BY_LABEL: MANAGED_BY,
        INSTANCE_LABEL: instance,
        SOURCE_NAMESPACE_LABEL: key.namespace,
        SOURCE_NAME_LABEL: _label_value(key.name),
    }


def render_service(group: ObjectGroup, ref: BackendRef, options: HttpRouteOptions) -> dict[str, Any]:
    """The ExternalName Service of one backend, as applied."""
    return {
        "apiVersion": SERVICES.api_version,
        "kind": SERVICES.kind,
        "metadata": {
            "name": ref.service,
            "namespace": group.namespace,
            "labels": _labels(group.key, options.name),
            "annotations": {MAP_ANNOTATION: str(group.key), CLUSTER_ANNOTATION: ref.cluster},
        },
        "spec": {
            "type": "ExternalName",
            "externalName": ref.external_name,
            "ports": [{"name": "http", "port": options.backend_port, "protocol": "TCP"}],
        },
    }


def render_route(group: ObjectGroup, options: HttpRouteOptions) -> dict[str, Any]:
    """The HTTPRoute of one map, as applied. Hostname and weights are read back from the route
    itself; its annotations name the map and each backend's exact endpoint."""
    # timeouts.request "0s" is no deadline (Gateway API: zero disables it); left out, the deadline
    # is the implementation's own (Envoy Gateway's is 15 s), which cuts LLM streams. backendRequest
    # (per attempt, and never longer than request) is left to the implementation: no retries are set.
    rule: dict[str, Any] = {
        "matches": [{"path": {"type": "PathPrefix", "value": "/"}}],
        "timeouts": {"request": unit_duration(options.route_timeout)},
    }
    if group.refs:
        rule["backendRefs"] = [
            {"group": "", "kind": "Service", "name": ref.service, "port": options.backend_port, "weight": ref.weight}
            for ref in group.refs
        ]
    endpoints = [[ref.cluster, ref.endpoint] for ref in group.refs]
    return {
        "apiVersion": HTTP_ROUTES.api_version,
        "kind": HTTP_ROUTES.kind,
        "metadata": {
            "name": group.route,
            "namespace": group.namespace,
            "labels": _labels(group.key, options.name),
            "annotations": {
                MAP_ANNOTATION: str(group.key),
                ENDPOINTS_ANNOTATION: json.dumps(endpoints, separators=(",", ":")),
            },
        },
        "spec": {
            "parentRefs": [
                {
                    "group": GATEWAY_GROUP,
                    "kind": "Gateway",
                    "namespace": options.gateway_namespace,
                    "name": options.gateway_name,
                }
            ],
            "hostnames": [group.hostname],
            "rules": [rule],
        },
    }


def _contains(actual: Any, wanted: Any) -> bool:
    """Whether `actual` holds every field of `wanted` (servers add defaults and fields of their own)."""
    if isinstance(wanted, dict):
        return isinstance(actual, dict) and all(k in actual and _contains(actual[k], v) for k, v in wanted.items())
    if isinstance(wanted, list):
        return isinstance(actual, list) and len(actual) == len(wanted) and all(map(_contains, actual, wanted))
    return bool(actual == wanted)


def _is_ours(obj: Mapping[str, Any], instance: str) -> bool:
    labels = (obj.get("metadata") or {}).get("labels") or {}
    return labels.get(MANAGED_BY_LABEL) == MANAGED_BY and labels.get(INSTANCE_LABEL) == instance


def _map_of(obj: Mapping[str, Any], instance: str) -> MapKey | None:
    """The map an object of ours belongs to: its annotation, else its source labels when they name
    it whole (a route written by an older version, or an annotation removed by hand)."""
    metadata = obj.get("metadata") or {}
    namespace, _, name = str((metadata.get("annotations") or {}).get(MAP_ANNOTATION, "")).partition("/")
    if namespace and name:
        return MapKey(namespace, name)
    labels = metadata.get("labels") or {}
    key = MapKey(str(labels.get(SOURCE_NAMESPACE_LABEL, "")), str(labels.get(SOURCE_NAME_LABEL, "")))
    if key.namespace and key.name and metadata.get("name") == route_name(key, instance):
        return key
    return None


def parse_route(obj: Mapping[str, Any], options: HttpRouteOptions) -> tuple[ObjectGroup, bool]:
    """The group a route of ours holds, and whether the route is exactly as we render that group.

    The annotations name the map and its endpoints; hostname and weights come from the route itself,
    so a route edited by hand reads back as what it serves. Raises ValueError (or KeyError,
    TypeError) for a route we cannot read.
    """
    metadata = obj["metadata"]
    annotations = metadata.get("annotations") or {}
    namespace, _, name = str(annotations[MAP_ANNOTATION]).partition("/")
    key = MapKey(namespace, name)
    endpoints = json.loads(annotations[ENDPOINTS_ANNOTATION])
    spec = obj.get("spec") or {}
    hostnames = spec.get("hostnames") or []
    refs_by_name = {ref.get("name"): ref for rule in spec.get("rules") or [] for ref in rule.get("backendRefs") or []}
    refs = []
    for cluster, endpoint in endpoints:
        service = service_name(key, str(cluster), options.name)
        if service in refs_by_name:
            refs.append(_ref(key, str(cluster), str(endpoint), int(refs_by_name[service].get("weight", 1)), options.name))
    hostname = str(hostnames[0]) if len(hostnames) == 1 else ""
    group = ObjectGroup(key, str(metadata["namespace"]), str(metadata["name"]), hostname, tuple(refs))
    return group, _contains(obj, render_route(group, options))


def _parent_status(route: Mapping[str, Any], options: HttpRouteOptions) -> Mapping[str, Any] | None:
    route_namespace = (route.get("metadata") or {}).get("namespace")
    for parent in (route.get("status") or {}).get("parents") or []:
        ref = parent.get("parentRef") or {}
        if (
            ref.get("name") == options.gateway_name
            and ref.get("namespace", route_namespace) == options.gateway_namespace
            and ref.get("group", GATEWAY_GROUP) == GATEWAY_GROUP
            and ref.get("kind", "Gateway") == "Gateway"
        ):
            return parent
    return None


def route_verdict(route: Mapping[str, Any], options: HttpRouteOptions) -> Held | bool | None:
    """What the gateway said of `route` at its current generation: True (taken), Held(ApplyFailed)
    with the gateway's reason, or None when it has not reported on this generation yet."""
    parent = _parent_status(route, options)
    if parent is None:
        return None
    generation = (route.get("metadata") or {}).get("generation")
    conditions = {c.get("type"): c for c in parent.get("conditions") or []}
    current = {}
    for kind in ("Accepted", "ResolvedRefs"):
        condition = conditions.get(kind)
        if condition is None or condition.get("observedGeneration") != generation:
            return None
        current[kind] = condition
    for kind in ("Accepted", "ResolvedRefs"):
        condition = current[kind]
        if condition.get("status") == "False":
            reason = condition.get("reason") or kind
            message = f"{kind} is False, {reason}: {condition.get('message', '')}"
            if reason == "RefNotPermitted":
                message += " (a ReferenceGrant to the Services' namespace is missing)"
            return Held(Reason.APPLY_FAILED, message)
    if all(current[kind].get("status") == "True" for kind in current):
        return True
    return None


# --- I/O -------------------------------------------------------------------------------------------


@contextlib.asynccontextmanager
async def _translated(what: str) -> AsyncIterator[None]:
    """The one place Kubernetes errors become adapter errors: refusals of an object are Rejected
    (the caller pins them on its map), everything a retry may fix is Unavailable."""
    try:
        yield
    except KubeError as exc:
        if exc.code in (400, 404, 422):
            raise Rejected(f"{what}: {exc.reason or exc.code}: {exc.message}") from exc
        raise Unavailable(f"{what}: {exc}") from exc


ObjectName = tuple[str, str]  # (namespace, name)
ServiceSpec = tuple[str, str]  # (cluster, externalName): all a Service of ours varies in


@dataclass(slots=True)
class _Objects:
    """What the cluster holds for one map, as far as we know. Our options are fixed for the
    transport's life, so a group names a route's whole body and a ServiceSpec a Service's."""

    route: ObjectName | None = None  # our route for this map, None when there is none
    group: ObjectGroup | None = None  # what the route holds; None when it is unreadable
    exact: bool = False  # whether the route is exactly as `group` renders
    refused: bool = False  # whether the gateway's last verdict on the route was a refusal
    services: dict[ObjectName, ServiceSpec | None] = field(default_factory=dict)  # None: differs


class HttpRouteTransport(TransportDefaults):
    """Object groups onto the gateway's cluster. `read()` once before the first `write()`: it learns
    which objects are ours, so a write sends only what differs."""

    def __init__(self, options: HttpRouteOptions, kube: Kube | None = None) -> None:
        self._options = options
        self._kube = kube
        self._own_kube = kube is None
        self._limit = asyncio.Semaphore(_CONCURRENCY)
        self._held: dict[MapKey, _Objects] = {}
        self._owners: dict[ObjectName, MapKey] = {}  # our routes (and names being claimed) -> their map
        self._orphans: set[MapKey] = set()  # maps with Services of ours but no route, as last read
        self._told_timeouts_dropped = False

    async def _connected(self) -> Kube:
        if self._kube is None:
            async with _translated("cannot connect to the gateway's cluster"):
                self._kube = await Kube.connect(self._options.gateway_kubeconfig)
        return self._kube

    async def _call(self, what: str, call: Callable[[], Awaitable[_R]]) -> _R:
        """One API request, within the concurrency bound, its errors translated."""
        async with self._limit, _translated(what):
            return await call()

    async def _pages(self, resource: Any, selector: str | None) -> AsyncIterator[tuple[list[dict[str, Any]], str]]:
        """Every object of `resource` in our namespace(s) matching `selector`, a page at a time
        (never all of them in memory at once), each with the list's resourceVersion."""
        kube, namespace = await self._connected(), self._options.route_namespace
        token: str | None = None
        while True:
            page = await self._call(
                f"cannot list {resource.plural}",
                lambda: kube.list(resource, namespace=namespace, label_selector=selector, limit=_PAGE, continue_token=token),
            )
            metadata = page.get("metadata") or {}
            yield page.get("items") or [], str(metadata.get("resourceVersion", ""))
            token = metadata.get("continue")
            if not token:
                return

    @property
    def _selector(self) -> str:
        return f"{MANAGED_BY_LABEL}={MANAGED_BY},{INSTANCE_LABEL}={self._options.name}"

    # --- read -------------------------------------------------------------------------------------

    async def read(self) -> dict[MapKey, Route]:
        """What our routes serve, for every map with a route of ours: hostname and weights as the
        route has them (edited by hand or not), when the route and every Service it points at are
        otherwise exactly as we render them and the gateway has not refused the route; else
        UNKNOWN_ROUTE. Everything of ours is remembered for the next write."""
        options = self._options
        held: dict[MapKey, _Objects] = {}
        owners: dict[ObjectName, MapKey] = {}
        # Parsed a page at a time, with a pause now and then: 10,000 maps are 50,000 objects, seconds
        # of parsing that must not hold the event loop.
        async for routes, _ in self._pages(HTTP_ROUTES, self._selector):
            for count, route in enumerate(routes, 1):
                metadata = route["metadata"]
                key = _map_of(route, options.name)
                if key is None:
                    log.warning("unreadable route left alone", extra={"route": f"{metadata['namespace']}/{metadata['name']}"})
                    continue
                try:
                    group, exact = parse_route(route, options)
                except (KeyError, ValueError, TypeError):
                    group, exact = None, False
                refused = isinstance(route_verdict(route, options), Held)
                held[key], owners[_name(route)] = _Objects(_name(route), group, exact, refused), key
                if count % _PARSE_BATCH == 0:
                    await asyncio.sleep(0)
        async for services, _ in self._pages(SERVICES, self._selector):
            for count, service in enumerate(services, 1):
                key = _map_of(service, options.name)
                if key is None:
                    log.warning("unreadable service left alone", extra={"service": "/".join(_name(service))})
                    continue
                state = held.setdefault(key, _Objects())
                state.services[_name(service)] = _service_spec(service, state.group, options)
                if count % _PARSE_BATCH == 0:
                    await asyncio.sleep(0)
        self._held, self._owners = held, owners
        self._orphans = {key for key, state in held.items() if state.route is None}
        return {key: state.group.served if _serves(state) else UNKNOWN_ROUTE for key, state in held.items() if state.route is not None}

    # --- write ------------------------------------------------------------------------------------

    async def write(self, parts: Mapping[MapKey, ObjectGroup], changes: Mapping[MapKey, ObjectGroup | None]) -> WriteResult:
        """Withdrawals first (a hostname a map let go of is free before another map takes it),
        then every changed map, a bounded number at a time; then the gateway's verdicts. Services
        of ours whose map has no route and is not in `parts` are collected too."""
        await self._connected()
        orphans = [k for k in self._orphans if k not in parts and k not in changes]
        withdrawals = sorted([k for k, group in changes.items() if group is None] + orphans)
        withdrawn = await self._each(withdrawals, self._withdraw)
        self._orphans.clear()
        rejected: dict[MapKey, str | Held] = {k: str(o) for k, o in withdrawn.items() if isinstance(o, Rejected)}
        publish = {k: group for k, group in sorted(changes.items()) if group is not None}
        rejected.update(await self._claim(publish))
        written = await self._each([k for k in publish if k not in rejected], lambda k: self._publish(publish[k]))
        routes: dict[MapKey, Mapping[str, Any]] = {}
        for key, outcome in written.items():
            if isinstance(outcome, Rejected):
                rejected[key] = str(outcome)
            elif outcome is not None:
                routes[key] = outcome
        notes: dict[MapKey, str] = {}
        for key, verdict in (await self._verdicts(routes)).items():
            self._held[key].refused = isinstance(verdict, Held)
            if isinstance(verdict, Held):
                rejected[key] = verdict
            elif verdict is None:
                notes[key] = NOT_REPORTED_NOTE
        for key, group in publish.items():
            if group.all_zero and key not in rejected:
                notes[key] = "; ".join([*([notes[key]] if key in notes else []), ALL_ZERO_NOTE])
        return WriteResult(rejected=rejected, notes=notes)

    async def _each(self, keys: Iterable[MapKey], work: Callable[[MapKey], Awaitable[_R]]) -> dict[MapKey, _R | Rejected]:
        """`work` for every key, _CONCURRENCY maps at a time. A Rejected is that map's outcome; the
        first other error stops taking new keys and is raised once the maps in flight are done."""
        queue = iter(keys)
        outcomes: dict[MapKey, _R | Rejected] = {}
        failures: list[Exception] = []

        async def worker() -> None:
            for key in queue:
                if failures:
                    return
                try:
                    outcomes[key] = await work(key)
                except Rejected as exc:
                    outcomes[key] = exc
                except Exception as exc:  # raised below, once the other workers are done
                    failures.append(exc)

        await asyncio.gather(*(worker() for _ in range(_CONCURRENCY)))
        if failures:
            raise failures[0]
        return outcomes

    async def _claim(self, publish: Mapping[MapKey, ObjectGroup]) -> dict[MapKey, str | Held]:
        """Refusals of maps whose route name is taken: by another map of ours (the first key in
        order keeps a name two maps ask for at once), or by a route without our labels. A name we
        hold no route of ours under is looked up: one GET each for a few, one list for many."""
        rejected: dict[MapKey, str | Held] = {}
        lookup: list[MapKey] = []
        for key, group in publish.items():
            name = (group.namespace, group.route)
            owner = self._owners.get(name)
            if owner is None:
                self._owners[name] = key
                lookup.append(key)
            elif owner != key:
                rejected[key] = Held(Reason.CLAIM_REJECTED, f"route {name[0]}/{name[1]} already publishes {owner}")
        if not lookup:
            return rejected
        names = {(publish[k].namespace, publish[k].route) for k in lookup}
        existing: dict[ObjectName, Mapping[str, Any]] = {}
        if len(lookup) <= _GET_LIMIT:
            found = await _all(self._get_route(name) for name in names)
            existing = {_name(route): route for route in found if route is not None}
        else:
            async for routes, _ in self._pages(HTTP_ROUTES, None):
                existing.update((_name(route), route) for route in routes if _name(route) in names)
        for key in lookup:
            name = (publish[key].namespace, publish[key].route)
            route = existing.get(name)
            if route is None:
                continue
            where = f"route {name[0]}/{name[1]}"
            if not _is_ours(route, self._options.name):
                problem = f"{where} exists without this publisher's labels; it is left untouched"
            elif (owner := _map_of(route, self._options.name)) != key:
                problem = f"{where} already publishes {owner or 'an unreadable map'}"
            else:
                continue  # ours for this map, written since we last read: the apply takes it as it is
            del self._owners[name]
            rejected[key] = Held(Reason.CLAIM_REJECTED, problem)
        return rejected

    async def _get_route(self, name: ObjectName) -> dict[str, Any] | None:
        kube = await self._connected()
        try:
            return await self._call(f"cannot read route {name[0]}/{name[1]}", lambda: kube.get(HTTP_ROUTES, *name))
        except Rejected as exc:
            if isinstance(exc.__cause__, KubeError) and exc.__cause__.not_found:
                return None
            raise Unavailable(str(exc)) from exc

    async def _publish(self, group: ObjectGroup) -> Mapping[str, Any] | None:
        """Services first (so the route's refs resolve), then the route, then what it no longer
        uses: a route of ours under another name (other options since we last ran; no weights to 0
        first, as the new route already serves the host) and Services it dropped. Returns the route
        as the server answered, when it was written or its last verdict was a refusal."""
        kube, options = await self._connected(), self._options
        state = self._held.setdefault(group.key, _Objects())
        wanted = {(group.namespace, ref.service): ref for ref in group.refs}

        async def apply_service(name: ObjectName, ref: BackendRef) -> None:
            body = render_service(group, ref, options)
            await self._call(f"service {name[0]}/{name[1]}", lambda: kube.apply(SERVICES, body, field_manager=options.field_manager))
            state.services[name] = (ref.cluster, ref.external_name)

        stale_services = [
            (name, ref) for name, ref in wanted.items() if state.services.get(name) != (ref.cluster, ref.external_name)
        ]
        await _all(apply_service(name, ref) for name, ref in stale_services)
        route = None
        target = (group.namespace, group.route)
        if state.route != target or not state.exact or state.group != group:
            body = render_route(group, options)
            route = await self._call(
                f"route {target[0]}/{target[1]}", lambda: kube.apply(HTTP_ROUTES, body, field_manager=options.field_manager)
            )
            self._check_timeouts_kept(route)
            if state.route not in (None, target):
                await self._delete(HTTP_ROUTES, state.route)
                self._owners.pop(state.route, None)
            state.route, state.group, state.exact = target, group, True
            self._owners[target] = group.key
        elif state.refused:
            route = await self._get_route(target)  # unchanged, but refused last time: ask again
        await _all(self._delete_service(state, name) for name in list(state.services) if name not in wanted)
        return route

    def _check_timeouts_kept(self, route: Mapping[str, Any] | None) -> None:
        """Logs once when the API server dropped the rules' `timeouts`: an HTTPRoute CRD older than
        Gateway API v1.2 (standard channel) does not know them. The gateway then keeps its own
        deadline (15 s in some), and each resync finds the route not as rendered and applies it again."""
        rules = ((route or {}).get("spec") or {}).get("rules") or []
        if route is None or self._told_timeouts_dropped or all("timeouts" in rule for rule in rules):
            return
        self._told_timeouts_dropped = True
        log.warning(
            "the API server dropped the HTTPRoute's timeouts: install Gateway API's CRDs v1.2 or later (standard channel)",
            extra={"route": "/".join(_name(route)), "request_timeout": unit_duration(self._options.route_timeout)},
        )

    async def _withdraw(self, key: MapKey) -> None:
        """Safe order: the route's weights to 0 (no request can reach a Service we delete), then the
        route, then its Services."""
        state = self._held.get(key)
        if state is None:
            return
        if state.route is not None:
            if state.group is not None and not state.group.all_zero:
                body = render_route(state.group.zeroed(), self._options)
                kube, manager = await self._connected(), self._options.field_manager
                await self._call(f"route {state.route[0]}/{state.route[1]}", lambda: kube.apply(HTTP_ROUTES, body, field_manager=manager))
                state.group = state.group.zeroed()
            await self._delete(HTTP_ROUTES, state.route)
            log.info("route withdrawn", extra={"map": str(key), "route": "/".join(state.route)})
            self._owners.pop(state.route, None)
            state.route = state.group = None
        await _all(self._delete_service(state, name) for name in list(state.services))
        del self._held[key]

    async def _delete_service(self, state: _Objects, name: ObjectName) -> None:
        await self._delete(SERVICES, name)
        del state.services[name]

    async def _delete(self, resource: Any, name: ObjectName) -> None:
        kube = await self._connected()
        try:
            await self._call(f"cannot delete {resource.kind} {name[0]}/{name[1]}", lambda: kube.delete(resource, *name))
        except Rejected as exc:
            if isinstance(exc.__cause__, KubeError) and exc.__cause__.not_found:
                return
            # A withdrawal has no map to pin a refusal on: retry it with the whole write.
            raise Unavailable(str(exc)) from exc

    async def _verdicts(self, routes: Mapping[MapKey, Mapping[str, Any]]) -> dict[MapKey, Held | bool | None]:
        """Each written route's verdict; waits up to route_status_timeout for the gateway to report
        on the rest: a GET of each now and then when few are left, one list and a watch from it
        when many are (a poll of thousands of routes would cost a list of them each time)."""
        options = self._options
        verdicts = {key: route_verdict(route, options) for key, route in routes.items()}
        waiting = {_name(route): key for key, route in routes.items() if verdicts[key] is None}
        deadline = time.monotonic() + options.route_status_timeout
        if len(waiting) > _GET_LIMIT:
            # Any failure of the list or the stream leaves the rest unreported; the note says so.
            with contextlib.suppress(TimeoutError, AdapterError, KubeError, ValueError, aiohttp.ClientError):
                async with asyncio.timeout(options.route_status_timeout):
                    await self._watch_verdicts(verdicts, waiting)
            return verdicts  # what is still unreported after the timeout gets a note
        delay = _STATUS_POLL_SECONDS
        while waiting and (left := deadline - time.monotonic()) > 0:
            await asyncio.sleep(min(delay, left))
            delay = min(2 * delay, _STATUS_POLL_MAX_SECONDS)
            try:
                found = await _all(self._get_route(name) for name in waiting)
            except AdapterError:
                continue  # a failed read leaves them unreported; the note says so
            for route in found:
                if route is not None:
                    _take_verdict(verdicts, waiting, route, options)
        return verdicts

    async def _watch_verdicts(self, verdicts: dict[MapKey, Held | bool | None], waiting: dict[ObjectName, MapKey]) -> None:
        """Verdicts from one list of our routes, then from a watch of them, until none is waiting."""
        options, kube = self._options, await self._connected()
        version = ""
        async for routes, version in self._pages(HTTP_ROUTES, self._selector):
            for route in routes:
                _take_verdict(verdicts, waiting, route, options)
        if not waiting:
            return
        watch = kube.watch(
            HTTP_ROUTES,
            namespace=options.route_namespace,
            resource_version=version,
            label_selector=self._selector,
            timeout_seconds=int(options.route_status_timeout) + 1,
        )
        async with watch as stream:
            while waiting:
                line = await stream.readline()
                if not line:
                    return
                event = json.loads(line)
                if event.get("type") in ("ADDED", "MODIFIED"):
                    _take_verdict(verdicts, waiting, event["object"], options)

    async def aclose(self) -> None:
        if self._own_kube and self._kube is not None:
            await self._kube.close()
            self._kube = None


async def _all(coros: Iterable[Awaitable[_R]]) -> list[_R]:
    """Await them together; once all are done, raise the first failure (Unavailable before
    Rejected, so a retryable failure is never pinned on the map)."""
    outcomes = await asyncio.gather(*coros, return_exceptions=True)
    failures = [o for o in outcomes if isinstance(o, BaseException)]
    if failures:
        raise next((f for f in failures if not isinstance(f, Rejected)), failures[0])
    return outcomes  # type: ignore[return-value]  # no failures: every outcome is an _R


def _name(obj: Mapping[str, Any]) -> ObjectName:
    return (obj["metadata"]["namespace"], obj["metadata"]["name"])


def _take_verdict(
    verdicts: dict[MapKey, Held | bool | None], waiting: dict[ObjectName, MapKey], route: Mapping[str, Any], options: HttpRouteOptions
) -> None:
    """Record the verdict `route` carries, when it is one of those `waiting` and carries one."""
    key = waiting.get(_name(route))
    if key is not None and (verdict := route_verdict(route, options)) is not None:
        verdicts[key] = verdict
        del waiting[_name(route)]


def _service_spec(service: Mapping[str, Any], group: ObjectGroup | None, options: HttpRouteOptions) -> ServiceSpec | None:
    """The ServiceSpec a Service of ours holds, when it is exactly as we render it for `group`."""
    if group is None:
        return None
    metadata = service.get("metadata") or {}
    cluster = (metadata.get("annotations") or {}).get(CLUSTER_ANNOTATION)
    ref = next((r for r in group.refs if r.cluster == cluster and r.service == metadata.get("name")), None)
    if ref is None or metadata.get("namespace") != group.namespace:
        return None
    return (ref.cluster, ref.external_name) if _contains(service, render_service(group, ref, options)) else None


def _serves(state: _Objects) -> bool:
    """Whether a map's objects serve what its route says: route and Services as we render them,
    and a route the gateway has not refused."""
    group = state.group
    return (
        state.route is not None
        and state.exact
        and not state.refused
        and group is not None
        and all(state.services.get((group.namespace, r.service)) == (r.cluster, r.external_name) for r in group.refs)
    )


def build(options: HttpRouteOptions) -> tuple[HttpRouteRenderer, HttpRouteTransport]:
    """The gateway as the engine drives it."""
    return HttpRouteRenderer(options), HttpRouteTransport(options)
