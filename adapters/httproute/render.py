"""Pure: the Gateway API gateway's names, validation, rendering and reading back.

`HttpRouteRenderer` renders a map's Route as an `ObjectGroup` (an HTTPRoute `<map>-<instance>`
and an ExternalName Service per backend), with our labels and no generation; `render_route` and
`render_service` are the objects as applied; `parse_route` and `route_verdict` read a route back.
"""

from __future__ import annotations

import hashlib
import ipaddress
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from adapters.httproute.options import HttpRouteOptions
from adapters.timeouts import unit_duration
from publisher.kube import HTTP_ROUTES, SERVICES
from publisher.core.addresses import is_dns_subdomain, parse_endpoint
from publisher.core.values import Backend, Held, MapKey, Reason, Route

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

# What read() says a route of ours serves when it is not as we render it (another parent, a
# Service pointing elsewhere or gone, a refusal): no hostname, so it equals no map's route and the
# engine rewrites it, or withdraws it when its map is gone.
UNKNOWN_ROUTE = Route("", ())


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
        instance = self._options.region
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
            "labels": _labels(group.key, options.region),
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
            "labels": _labels(group.key, options.region),
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


def contains_fields(actual: Any, wanted: Any) -> bool:
    """Whether `actual` holds every field of `wanted` (servers add defaults and fields of their own)."""
    if isinstance(wanted, dict):
        return isinstance(actual, dict) and all(k in actual and contains_fields(actual[k], v) for k, v in wanted.items())
    if isinstance(wanted, list):
        return isinstance(actual, list) and len(actual) == len(wanted) and all(map(contains_fields, actual, wanted))
    return bool(actual == wanted)


def is_ours(obj: Mapping[str, Any], instance: str) -> bool:
    labels = (obj.get("metadata") or {}).get("labels") or {}
    return labels.get(MANAGED_BY_LABEL) == MANAGED_BY and labels.get(INSTANCE_LABEL) == instance


def map_of(obj: Mapping[str, Any], instance: str) -> MapKey | None:
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
        service = service_name(key, str(cluster), options.region)
        if service in refs_by_name:
            refs.append(_ref(key, str(cluster), str(endpoint), int(refs_by_name[service].get("weight", 1)), options.region))
    hostname = str(hostnames[0]) if len(hostnames) == 1 else ""
    group = ObjectGroup(key, str(metadata["namespace"]), str(metadata["name"]), hostname, tuple(refs))
    return group, contains_fields(obj, render_route(group, options))


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

