"""The Gateway API adapter: weights into HTTPRoutes on the cluster of the gateway beside the sidecar.

Owns, per Publication, one HTTPRoute `<map name>-<instance>` (one parentRef, the map's hostname, one
`PathPrefix /` rule with a weighted backendRef per backend) and one ExternalName Service per backend,
all carrying our labels and written by server-side apply with field manager
`ome-gateway-publisher-<instance>`. After a write it reads the route's status to learn whether the
gateway took it; objects of maps that left are garbage-collected (weights to 0, route, Services).
It never touches an object without our labels (OME's own `<isvc>-global` route included), decides
nothing about maps, imports no metrics, and does all Kubernetes I/O through publisher.kube.
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
from collections.abc import AsyncIterator, Awaitable, Iterable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, TypeVar

from pydantic import BaseModel, ConfigDict, Field, field_validator

from adapters.base import ApplyResult, Rejected, Unavailable, publication_problem
from publisher.kube import HTTP_ROUTES, SERVICES, Kube, KubeError
from publisher.model import Backend, Held, MapKey, Publication, Reason, is_dns_label, is_dns_subdomain, parse_endpoint

log = logging.getLogger(__name__)

__all__ = [
    "HttpRouteAdapter",
    "HttpRouteOptions",
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
PUBLICATION_ANNOTATION = "gateway-publisher.ome.io/publication"
MAP_ANNOTATION = "gateway-publisher.ome.io/map"
CLUSTER_ANNOTATION = "gateway-publisher.ome.io/cluster"
ALL_ZERO_NOTE = "every weight is 0: Gateway API answers this host with HTTP 500, not 503"
NOT_REPORTED_NOTE = "the gateway has not reported on the route yet"
# Writes in flight at once: enough to hide the API server's latency at start (10,000 maps), few
# enough to stay well inside API Priority and Fairness' default share for one client.
_CONCURRENCY = 16
# How often a route's status is read while waiting for the gateway controller to report on it.
_STATUS_POLL_SECONDS = 0.1


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
    route_status_timeout: float = Field(
        default=5.0,
        gt=0,
        description="How long to wait for the gateway to report on a route; covers a healthy controller's reconcile.",
    )

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
        if value == "global":
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


def _problem(pub: Publication) -> str | None:
    """Why an HTTPRoute cannot carry `pub`, or None: every value that reaches an object, checked."""
    problem = publication_problem(pub)
    if problem is not None:
        return problem
    if _is_ip(pub.hostname):
        return f"hostname {pub.hostname!r} is an IP address, which is not a Gateway API hostname"
    if len(pub.backends) > MAX_BACKEND_REFS:
        return f"{len(pub.backends)} backends, but Gateway API allows at most {MAX_BACKEND_REFS} backendRefs per rule"
    for backend in pub.backends:
        endpoint = parse_endpoint(backend.endpoint)
        if _is_ip(endpoint.host):
            return (
                f"backends[{backend.cluster}].endpoint host {endpoint.host} is an IP address, "
                "which an ExternalName Service cannot hold"
            )
        if not is_dns_subdomain(endpoint.host.lower()):
            return f"backends[{backend.cluster}].endpoint host {endpoint.host!r} is not a DNS-1123 subdomain"
    return None


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return False
    return True


def _labels(key: MapKey, instance: str) -> dict[str, str]:
    return {
        MANAGED_BY_LABEL: MANAGED_BY,
        INSTANCE_LABEL: instance,
        SOURCE_NAMESPACE_LABEL: key.namespace,
        SOURCE_NAME_LABEL: _label_value(key.name),
    }


def _external_name(backend: Backend) -> str:
    return parse_endpoint(backend.endpoint).host.lower()


def render_service(pub: Publication, backend: Backend, options: HttpRouteOptions) -> dict[str, Any]:
    """The ExternalName Service of one backend, as applied."""
    return {
        "apiVersion": SERVICES.api_version,
        "kind": SERVICES.kind,
        "metadata": {
            "name": service_name(pub.key, backend.cluster, options.name),
            "namespace": options.namespace_for(pub.key),
            "labels": _labels(pub.key, options.name),
            "annotations": {MAP_ANNOTATION: str(pub.key), CLUSTER_ANNOTATION: backend.cluster},
        },
        "spec": {
            "type": "ExternalName",
            "externalName": _external_name(backend),
            "ports": [{"name": "http", "port": options.backend_port, "protocol": "TCP"}],
        },
    }


def render_route(pub: Publication, options: HttpRouteOptions) -> dict[str, Any]:
    """The HTTPRoute of one Publication, as applied; its annotation is enough to read `pub` back."""
    rule: dict[str, Any] = {"matches": [{"path": {"type": "PathPrefix", "value": "/"}}]}
    if pub.backends:
        rule["backendRefs"] = [
            {
                "group": "",
                "kind": "Service",
                "name": service_name(pub.key, b.cluster, options.name),
                "port": options.backend_port,
                "weight": b.weight,
            }
            for b in pub.backends
        ]
    return {
        "apiVersion": HTTP_ROUTES.api_version,
        "kind": HTTP_ROUTES.kind,
        "metadata": {
            "name": route_name(pub.key, options.name),
            "namespace": options.namespace_for(pub.key),
            "labels": _labels(pub.key, options.name),
            "annotations": {PUBLICATION_ANNOTATION: json.dumps(pub.to_json(), separators=(",", ":"))},
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
            "hostnames": [pub.hostname],
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


def parse_route(obj: Mapping[str, Any], options: HttpRouteOptions) -> tuple[Publication, bool]:
    """The Publication a route of ours holds, and whether the route is exactly as we render it.

    The annotation names the map and its endpoints; hostname and weights come from the route itself,
    so a route edited by hand reads back as what it serves, differs from the map, and gets rewritten.
    Raises ValueError for a route we cannot read.
    """
    metadata = obj.get("metadata") or {}
    pub = Publication.from_json(json.loads((metadata.get("annotations") or {})[PUBLICATION_ANNOTATION]))
    expected = render_route(pub, options)
    if _contains(obj, expected):
        return pub, True
    spec = obj.get("spec") or {}
    hostnames = spec.get("hostnames") or []
    rules = spec.get("rules") or []
    refs = {ref.get("name"): ref for rule in rules for ref in (rule.get("backendRefs") or [])}
    backends = tuple(
        Backend(b.cluster, b.endpoint, int(refs[name].get("weight", 1)))
        for b in pub.backends
        if (name := service_name(pub.key, b.cluster, options.name)) in refs
    )
    hostname = str(hostnames[0]) if len(hostnames) == 1 else ""
    return replace(pub, hostname=hostname, backends=backends), False


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


_T = TypeVar("_T")


async def _bounded_gather(coros: Iterable[Awaitable[_T]]) -> list[_T | BaseException]:
    semaphore = asyncio.Semaphore(_CONCURRENCY)

    async def one(coro: Awaitable[_T]) -> _T:
        async with semaphore:
            return await coro

    return await asyncio.gather(*(one(c) for c in coros), return_exceptions=True)


@dataclass(slots=True)
class _Held:
    """What the cluster holds for one map, as far as we know. Our options are fixed for the
    adapter's life, so the Publication a route renders from names its whole body, and the host an
    ExternalName Service points at names the Service's; None: the object exists but differs."""

    namespace: str
    route: str | None = None  # its name, None when there is no route
    route_pub: Publication | None = None
    services: dict[str, str | None] = field(default_factory=dict)  # Service name -> externalName


@dataclass(frozen=True, slots=True)
class _Outcome:
    route: Mapping[str, Any] | None = None  # the route as the server answered, when published
    held: Held | None = None


class HttpRouteAdapter:
    """Publications into HTTPRoutes. `await current()` once before the first `apply()`."""

    name = "httproute"

    def __init__(self, options: HttpRouteOptions, kube: Kube | None = None) -> None:
        self._options = options
        self._kube = kube
        self._own_kube = kube is None
        self._held: dict[MapKey, _Held] = {}
        self._orphans: set[MapKey] = set()  # Services of ours whose map has no route of ours

    def check(self, pub: Publication) -> Held | None:
        problem = _problem(pub)
        return Held(Reason.INVALID_PLAN, problem) if problem is not None else None

    async def _connected(self) -> Kube:
        if self._kube is None:
            async with _translated("cannot connect to the gateway's cluster"):
                self._kube = await Kube.connect(self._options.gateway_kubeconfig)
        return self._kube

    async def current(self) -> dict[MapKey, Publication]:
        kube = await self._connected()
        options = self._options
        selector = f"{MANAGED_BY_LABEL}={MANAGED_BY},{INSTANCE_LABEL}={options.name}"
        async with _translated("cannot list our routes and Services"):
            routes = await _list_all(kube, HTTP_ROUTES, options.route_namespace, selector)
            services = await _list_all(kube, SERVICES, options.route_namespace, selector)
        held: dict[MapKey, _Held] = {}
        pubs: dict[MapKey, Publication] = {}
        for route in routes:
            metadata = route["metadata"]
            try:
                pub, exact = parse_route(route, options)
            except (KeyError, ValueError, TypeError) as exc:
                log.warning("unreadable route left alone", extra={"route": metadata.get("name"), "error": str(exc)})
                continue
            held[pub.key] = _Held(metadata["namespace"], metadata["name"], pub if exact else None)
            pubs[pub.key] = pub
        for service in services:
            metadata = service["metadata"]
            annotations = metadata.get("annotations") or {}
            namespace, _, name = str(annotations.get(MAP_ANNOTATION, "")).partition("/")
            if not name:
                log.warning("unreadable service left alone", extra={"service": metadata.get("name")})
                continue
            key = MapKey(namespace, name)
            state = held.setdefault(key, _Held(metadata["namespace"]))
            state.services[metadata["name"]] = self._service_host(service, pubs.get(key))
        self._held = held
        self._orphans = {key for key, state in held.items() if state.route is None}
        return pubs

    def _service_host(self, service: Mapping[str, Any], pub: Publication | None) -> str | None:
        if pub is None:
            return None
        cluster = ((service.get("metadata") or {}).get("annotations") or {}).get(CLUSTER_ANNOTATION)
        backend = next((b for b in pub.backends if b.cluster == cluster), None)
        if backend is None:
            return None
        body = render_service(pub, backend, self._options)
        return _external_name(backend) if _contains(service, body) else None

    async def apply(self, desired: Mapping[MapKey, Publication], changed: frozenset[MapKey]) -> ApplyResult:
        kube = await self._connected()
        keys = sorted(changed | {k for k in self._orphans if k not in desired})
        wrote: list[bool] = []
        outcomes = await _bounded_gather(self._sync(kube, key, desired.get(key), wrote) for key in keys)
        failures = [o for o in outcomes if isinstance(o, BaseException)]
        for failure in failures:
            if not isinstance(failure, Unavailable):
                raise failure
        if failures:
            raise failures[0]
        self._orphans.difference_update(keys)
        rejected: dict[MapKey, Held] = {}
        notes: dict[MapKey, str] = {}
        routes: dict[MapKey, Mapping[str, Any]] = {}
        for key, outcome in zip(keys, outcomes, strict=True):
            assert isinstance(outcome, _Outcome)
            if outcome.held is not None:
                rejected[key] = outcome.held
            elif outcome.route is not None:
                routes[key] = outcome.route
        verdicts = await self._await_verdicts(kube, routes)
        for key, verdict in verdicts.items():
            pub = desired[key]
            if isinstance(verdict, Held):
                rejected[key] = verdict
                continue
            parts = ([NOT_REPORTED_NOTE] if verdict is None else []) + ([ALL_ZERO_NOTE] if pub.all_zero else [])
            if parts:
                notes[key] = "; ".join(parts)
        return ApplyResult(rejected=rejected, notes=notes, wrote=any(wrote))

    async def _sync(self, kube: Kube, key: MapKey, pub: Publication | None, wrote: list[bool]) -> _Outcome:
        """Bring one map's objects to `pub` (None: withdraw them). Raises Unavailable."""
        state = self._held.get(key)
        if pub is None:
            if state is not None:
                await self._withdraw(kube, key, state, wrote)
            return _Outcome()
        namespace, name = self._options.namespace_for(key), route_name(key, self._options.name)
        # Another --route-namespace than the one our objects are in: publish anew, then collect the old.
        moved = state is not None and (state.namespace != namespace or state.route not in (None, name))
        old = state if moved else None
        if state is None or state.route is None or moved:
            claim = await self._claim(kube, key, namespace, name)
            if claim is not None:
                return _Outcome(held=claim)
            if state is None or moved:
                state = self._held[key] = _Held(namespace)
            state.route, state.route_pub = name, None
        try:
            route = await self._publish(kube, state, pub, wrote)
        except Rejected as exc:
            return _Outcome(held=Held(Reason.APPLY_FAILED, str(exc)))
        if old is not None:
            await self._withdraw(kube, key, old, wrote, keep_held=True)
        return _Outcome(route=route)

    async def _claim(self, kube: Kube, key: MapKey, namespace: str, name: str) -> Held | None:
        """Held(ClaimRejected) when a route of our name exists that is not this map's route of ours."""
        try:
            async with _translated(f"cannot read route {namespace}/{name}"):
                try:
                    existing = await kube.get(HTTP_ROUTES, namespace, name)
                except KubeError as exc:
                    if exc.not_found:
                        return None
                    raise
        except Rejected as exc:
            return Held(Reason.APPLY_FAILED, str(exc))
        if not _is_ours(existing, self._options.name):
            return Held(
                Reason.CLAIM_REJECTED,
                f"route {namespace}/{name} exists without this publisher's labels; it is left untouched",
            )
        try:
            pub, _ = parse_route(existing, self._options)
        except (KeyError, ValueError, TypeError):
            pub = None
        if pub is None or pub.key != key:
            source = str(pub.key) if pub is not None else "an unreadable map"
            return Held(Reason.CLAIM_REJECTED, f"route {namespace}/{name} already publishes {source}")
        return None

    async def _publish(self, kube: Kube, state: _Held, pub: Publication, wrote: list[bool]) -> Mapping[str, Any]:
        """Services first (so the route's refs resolve), then the route, then Services it dropped."""
        options, manager = self._options, self._options.field_manager
        wanted: set[str] = set()
        for backend in pub.backends:
            name, host = service_name(pub.key, backend.cluster, options.name), _external_name(backend)
            wanted.add(name)
            if state.services.get(name, "") != host:
                async with _translated(f"service {state.namespace}/{name}"):
                    await kube.apply(SERVICES, render_service(pub, backend, options), field_manager=manager)
                state.services[name] = host
                wrote.append(True)
        assert state.route is not None
        route = None if state.route_pub != pub else await self._read(kube, state.namespace, state.route)
        if route is None:  # changed, or deleted behind our back since we last read it
            async with _translated(f"route {state.namespace}/{state.route}"):
                route = await kube.apply(HTTP_ROUTES, render_route(pub, options), field_manager=manager)
            state.route_pub = pub
            wrote.append(True)
        for stale in [s for s in state.services if s not in wanted]:
            await self._delete(kube, SERVICES, state.namespace, stale, wrote)
            del state.services[stale]
        return route

    async def _withdraw(self, kube: Kube, key: MapKey, state: _Held, wrote: list[bool], *, keep_held: bool = False) -> None:
        """Safe order: the route's weights to 0 (no request can reach a Service we delete), then the
        route, then its Services."""
        if state.route is not None:
            route = await self._read(kube, state.namespace, state.route)
            if route is not None and _is_ours(route, self._options.name):
                try:
                    pub, _ = parse_route(route, self._options)
                except (KeyError, ValueError, TypeError):
                    pub = None
                if pub is not None and not pub.all_zero:
                    zeroed = replace(pub, backends=tuple(replace(b, weight=0) for b in pub.backends))
                    body = render_route(zeroed, self._options)
                    body["metadata"]["name"] = state.route
                    body["metadata"]["namespace"] = state.namespace
                    async with _translated(f"route {state.namespace}/{state.route}"):
                        await kube.apply(HTTP_ROUTES, body, field_manager=self._options.field_manager)
                    wrote.append(True)
                await self._delete(kube, HTTP_ROUTES, state.namespace, state.route, wrote)
                log.info("route withdrawn", extra={"map": str(key), "route": f"{state.namespace}/{state.route}"})
            state.route = state.route_pub = None
        for name in list(state.services):
            await self._delete(kube, SERVICES, state.namespace, name, wrote)
            del state.services[name]
        if not keep_held:
            self._held.pop(key, None)

    async def _read(self, kube: Kube, namespace: str, name: str) -> dict[str, Any] | None:
        try:
            async with _translated(f"cannot read route {namespace}/{name}"):
                try:
                    return await kube.get(HTTP_ROUTES, namespace, name)
                except KubeError as exc:
                    if exc.not_found:
                        return None
                    raise
        except Rejected as exc:
            raise Unavailable(str(exc)) from exc

    @staticmethod
    async def _delete(kube: Kube, resource: Any, namespace: str, name: str, wrote: list[bool]) -> None:
        try:
            async with _translated(f"cannot delete {resource.kind} {namespace}/{name}"):
                try:
                    await kube.delete(resource, namespace, name)
                except KubeError as exc:
                    if not exc.not_found:
                        raise
        except Rejected as exc:
            # A withdrawal has no map to pin a refusal on: retry it with the whole write.
            raise Unavailable(str(exc)) from exc
        wrote.append(True)

    async def _await_verdicts(
        self, kube: Kube, routes: Mapping[MapKey, Mapping[str, Any]]
    ) -> dict[MapKey, Held | bool | None]:
        """Each route's verdict; waits up to route_status_timeout for the gateway to report on the rest."""
        verdicts = {key: route_verdict(route, self._options) for key, route in routes.items()}
        deadline = time.monotonic() + self._options.route_status_timeout
        while True:
            waiting = [key for key, verdict in verdicts.items() if verdict is None]
            if not waiting or time.monotonic() >= deadline:
                return verdicts
            await asyncio.sleep(_STATUS_POLL_SECONDS)
            reads = await _bounded_gather(
                self._read(kube, routes[key]["metadata"]["namespace"], routes[key]["metadata"]["name"])
                for key in waiting
            )
            for key, route in zip(waiting, reads, strict=True):
                if isinstance(route, BaseException):
                    if not isinstance(route, Unavailable):
                        raise route
                    continue  # a failed read leaves it unreported; the note says so
                if route is not None:
                    verdicts[key] = route_verdict(route, self._options)

    def hold_off(self) -> float:
        return 0.0  # server-side apply cuts no connections: every batch may be written at once

    async def aclose(self) -> None:
        if self._own_kube and self._kube is not None:
            await self._kube.close()
            self._kube = None


async def _list_all(kube: Kube, resource: Any, namespace: str | None, selector: str) -> list[dict[str, Any]]:
    """Every object of `resource` matching `selector`, page by page (500 a page, as kubectl)."""
    items: list[dict[str, Any]] = []
    token: str | None = None
    while True:
        page = await kube.list(resource, namespace=namespace, label_selector=selector, limit=500, continue_token=token)
        items.extend(page.get("items") or [])
        token = (page.get("metadata") or {}).get("continue")
        if not token:
            return items
